"""What the OpenCL tensor-core tests share (test_mma*.py): the builds each device runs, PoCL's
caps dressed as the H100's, a forced run, inputs whose logits grow past the lazy max's
threshold, non-finite v planted where only some rows see it, and the check of a build's local
memory against the kernel's declaration."""

from __future__ import annotations

from typing import Any

import numpy as np

import attnreg
from attnreg.backends.opencl import device as odevice
from attnreg.backends.opencl import mma_probe, program
from attnreg.backends.opencl import tiles as otiles
from attnreg.spec import AttentionSpec
from tests.support import check_close, make_tensors, missing

TAU = 8.0                      # the lazy-max threshold of flash_prefill_mma.cl and decode_mma.cl
ROUTE = {"prefill": "prefill", "decode_partial": "split_kv", "decode_fused": "split_kv_fused"}
# A bf16 value whose exponent has f16's exponent bits (0x7c00) all set: finite, but an f16
# non-finite test on its bits would call it inf / NaN.
HUGE = float(np.float32(1.5 * 2.0**121))


def _devices() -> list[attnreg.DeviceCaps]:
    try:
        return [d for d in attnreg.devices("opencl") if d.available]
    except Exception:
        return []


# (device, build): every device runs the emulation; the probed ones the hardware build too.
BUILDS = [(d, "emulate") for d in _devices()] + \
    [(d, "hardware") for d in _devices() if mma_probe.FEATURE in d.features]
IDS = [f"{d.slug}-{b}" for d, b in BUILDS]


def nvidia_like(pocl: attnreg.DeviceCaps) -> attnreg.DeviceCaps:
    """PoCL's caps dressed as the H100's OpenCL: vendor, the probed mma.sync, 132 units."""
    return pocl.model_copy(update={
        "vendor": "nvidia", "device_type": "gpu", "compute_units": 132,
        "features": pocl.features | {mma_probe.FEATURE, otiles.NV_SHUFFLE},
        "limits": {**pocl.limits, "workgroup_storage": 48 * 1024}})


def run(dev: attnreg.DeviceCaps, build: str, kernel: str, spec: AttentionSpec,
        t: dict[str, np.ndarray], split_size: int = 64, **params: Any) -> tuple[Any, Any]:
    """``kernel`` forced on ``dev`` in ``build`` (its route; decodes split every split_size keys)."""
    family = kernel.split(".")[1]
    flags: dict[str, Any] = {"route": ROUTE[family]}
    if family != "prefill":
        flags["split_size"] = split_size
    with attnreg.Session(backend="opencl", device=dev.id, flags=flags) as s:
        return s.run_with_plan(spec, t, kernel=kernel, params={"mma": build, **params})


def cache_inputs(base: dict[str, Any], fields: dict[str, Any], capacity: int,
                 short: int) -> tuple[AttentionSpec, dict[str, np.ndarray]]:
    """The spec of ``fields`` over ``base`` (with seqlens_k: a cache of ``capacity`` keys,
    batch entries of ``capacity`` and ``short`` keys; paged: a pool that holds both and three
    pages more) and its inputs, seeded by len(fields), a tenth of a bias masked."""
    f = {**base, **fields}
    if f.get("seqlens_k"):
        f["kv_capacity"] = capacity
    if f.get("kv_layout") == "paged":
        f["num_pages"] = 2 * -(-capacity // f["page_size"]) + 3
    spec = AttentionSpec(**f)
    t = make_tensors(spec, seed=len(fields), mask_frac=0.1 if spec.bias else 0.0,
                     lengths=(capacity, short) if spec.seqlens_k else None)
    return spec, t


def growing(spec: AttentionSpec, seed: int, shape: str) -> dict[str, np.ndarray]:
    """q and k along one direction, k scaled by a profile over the key position: logits of
    about 0.4 per key step, so a 32-key tile's max moves by ~13 > TAU ("up": every tile of a
    row rescales), or down from the start ("down": none after the first), or up in steps
    with dips between ("saw": some tiles rescale, others stay within TAU)."""
    t = make_tensors(spec, seed=seed)
    rng = np.random.default_rng(seed)
    h, c = spec.head_size, spec.capacity
    u = rng.choice([-1.0, 1.0], h)
    j = np.arange(c, dtype=np.float64)
    prof = {"up": j, "down": c - 1 - j, "saw": np.abs((j % 96) - 48.0) + j / 2}[shape]
    k = 0.05 * prof[:, None] * u + 0.05 * rng.standard_normal((c, h))
    q = u + 0.1 * rng.standard_normal((spec.seq_len, h))
    t["k"][:] = k[None, :, None, :].astype(np.float16)           # BSNH [B, C, Nkv, H]
    t["q"][:] = q[None, :, None, :].astype(np.float16)           # BSNH [B, S, N, H]
    return t


def growing_logits(seq_len: int, past_len: int, dtype: str,
                   shape: str) -> tuple[AttentionSpec, dict[str, np.ndarray], np.ndarray]:
    """(spec, inputs, logits of KV head 0 in float64) of ``growing`` on one batch entry, two
    query heads of one KV head at head size 64; the last row's logits span more than 4 TAU."""
    spec = AttentionSpec(batch=1, seq_len=seq_len, past_len=past_len, num_heads=2,
                         kv_num_heads=1, head_size=64, dtype=dtype, causal=True,
                         return_lse=True, q_layout="BSNH", kv_layout="BSNH")
    t = growing(spec, 11, shape)
    logits = (t["q"][0, :, 0].astype(np.float64) @ t["k"][0, :, 0].astype(np.float64).T) \
        * spec.effective_scale
    assert np.ptp(logits[-1]) > 4 * TAU
    return spec, t, logits


def check_non_finite_v(dev: attnreg.DeviceCaps, build: str, kernel: str, spec: AttentionSpec,
                       first_row: int, cols: tuple[int, int, int], **params: Any) -> None:
    """NaN and inf in v (BSNH, two batches, two KV heads of two query heads each) where rows
    i >= first_row of KV head 1 see them (columns cols[0], cols[1]), -inf only the last row
    sees (cols[2]) and NaN every row sees (column 8): each poisons its column of exactly the
    rows that see it; the rest is the reference's."""
    t = make_tensors(spec, seed=4)
    j, last = spec.capacity - spec.seq_len + first_row, spec.capacity - 1
    t["v"][0, j, 1, cols[0]] = np.nan
    t["v"][0, j, 1, cols[1]] = np.inf
    t["v"][1, last, 0, cols[2]] = -np.inf
    t["v"][1, 5, 0, 8] = np.nan
    got, plan = run(dev, build, kernel, spec, t, **params)
    out = got[0]
    for c in cols[:2]:
        assert np.isnan(out[0, first_row:, 2:4, c]).all(), c
        assert not np.isnan(out[0, :first_row, 2:4, c]).any(), c
    assert np.isnan(out[1, -1, 0:2, cols[2]]).all()
    assert not np.isnan(out[1, :-1, 0:2, cols[2]]).any()
    assert np.isnan(out[1, :, 0:2, 8]).all()
    check_close(spec, got, t, what=f"{plan.stages[0].kernel} {build} {params}")


def check_declared_local_memory(dev: attnreg.DeviceCaps, kernel_id: str,
                                cases: list[tuple[AttentionSpec, dict[str, Any]]]) -> None:
    """Build the emulated program of ``kernel_id`` for each (spec, params) on ``dev``: the
    local memory the build uses is what the kernel declares."""
    import pyopencl as cl

    k = attnreg.registry.get().kernel(kernel_id)
    ctx, cdev = odevice.context(dev)
    used, declared = [], []
    for spec, params in cases:
        params = {"mma": "emulate", **params}
        g = otiles.geometry(k.family, "mma", spec, params)
        opts = program.options(program.defines(spec, g, None, params))
        prog = cl.Program(ctx, program.source(k.family, "mma")).build(options=list(opts))
        used.append(cl.Kernel(prog, program.ENTRY[k.family]).get_work_group_info(
            cl.kernel_work_group_info.LOCAL_MEM_SIZE, cdev))
        declared.append(k.storage_need(spec, params))
    if not any(used):          # PoCL's "cpu" driver (the GPU machine's) reports 0
        missing(f"{dev.name} does not report the local memory a kernel uses")
    assert used == declared
