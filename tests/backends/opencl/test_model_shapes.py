"""The shapes real models need (docs/contract.md "Shapes real models need": kv_start, seqlens_q,
v_head_size, head sizes up to 576 for q/k and 512 for v) in every OpenCL kernel family, against
the float64 reference on PoCL: each family with the features together and alone, v's head size
smaller and larger than q/k's, head sizes 320 and 512, MLA's q/k 576 with v 512 and one KV head,
bf16 / int8 / int4 storages, paged pools, partial states reduced on the reference, the reduce's
padding rows, and the tensor-core kernels' emulated builds (mma=emulate, the same indexing as
their PTX builds).

make_tensors poisons what no row may read: keys before kv_start[b] and past L_b are NaN, and
so is q in the padding rows past seqlens_q[b]; a kernel that loads or multiplies them fails.
The sub-group kernels run with their shuffles emulated (sg_impl=emu) where the device has
none; the device is tests.support.opencl_device().
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attnreg
from attnreg import reference as ref
from attnreg.backends.opencl import kernels as cl_kernels
from attnreg.backends.opencl import mma_probe, tiles
from attnreg.kernel import MODEL_FEATURES, TOLERANCE
from attnreg.spec import AttentionSpec
from attnreg.tensors import check_tensors
from attnreg.testing import compare, compare_partials, plant_nonfinite
from tests.support import check_close, make_tensors, opencl_device

DEV = opencl_device()

EMU = {"sg_impl": "emu"}
MMA = {"mma": "emulate"}
# Every feature at once: left padding, right-padded queries, lengths, causal, sink and lse.
MODEL: dict[str, Any] = dict(batch=2, num_heads=8, kv_num_heads=2, head_size=64, seq_len=5,
                             past_len=60, seqlens_k=True, causal=True, kv_start=True,
                             seqlens_q=True, head_sink=True, return_lse=True)
BIG: dict[str, Any] = dict(batch=1, num_heads=2, kv_num_heads=1, seq_len=3, past_len=40)
PAGED: dict[str, Any] = dict(kv_layout="paged", page_size=16, num_pages=12)
MLA: dict[str, Any] = dict(num_heads=8, kv_num_heads=1, head_size=576, v_head_size=512)
# name -> (kernel id, params, spec fields over MODEL, plant visible NaN / inf too)
CELLS: dict[str, tuple[str, dict[str, Any], dict[str, Any], bool]] = {
    # v's head size smaller / larger than q's, bias, block skipping, bf16
    "prefill.wgmem-hv32": ("prefill.f16.wgmem", {}, dict(dtype="float16", v_head_size=32),
                           True),
    "prefill.sg-hv96-bias": ("prefill.bf16.sg", EMU, dict(dtype="bfloat16", v_head_size=96,
                                                          bias=True), False),
    "prefill.wgmem.bs-hv96": ("prefill.f32.wgmem.bs", {}, dict(v_head_size=96, bias=True),
                              False),
    "decode_partial.m1.bs": ("decode_partial.bf16.m1.bs", {"split_size": 16},
                             dict(dtype="bfloat16", seq_len=3, v_head_size=32, bias=True),
                             False),
    # quantized K/V and paged pools (int4 needs v rows of whole 32-blocks)
    "decode_fused.m2-int8": ("decode_fused.f32.m2", {"split_size": 16},
                             dict(kv_dtype="int8", v_head_size=96), False),
    "decode_fused.sg-paged-int4": ("decode_fused.f16.sg.m1", {**EMU, "split_size": 16},
                                   dict(dtype="float16", kv_dtype="int4", v_head_size=128,
                                        seq_len=3, **PAGED), False),
    # the unfused pair (decode_qk -> decode_pv -> the reduce with seqlens_q)
    "decode_qk.m2-hv96": ("decode_qk.f32.m2", {"split_size": 16}, dict(v_head_size=96), True),
    # head sizes 320 / 512: tiles shrunk to 48 KiB (v read unstaged where it has no room;
    # the quick conformance matrix runs h320 / h512 on every kernel too)
    "prefill.wgmem-h512": ("prefill.f32.wgmem", {}, dict(**BIG, head_size=512,
                                                         v_head_size=256), False),
    "decode_partial.sg-h320": ("decode_partial.f32.sg.m1", {**EMU, "split_size": 32}, dict(
        head_size=320, v_head_size=512, seq_len=1, num_heads=16, kv_num_heads=1), False),
    # the tensor-core kernels, emulated (f16 and bf16; the f16 decodes dequantize int8/int4)
    "mma.prefill-hv32": ("prefill.f16.mma", MMA, dict(dtype="float16", v_head_size=32), True),
    "mma.prefill-h320-hv512": ("prefill.bf16.mma", MMA, dict(
        **BIG, dtype="bfloat16", head_size=320, v_head_size=512), True),
    "mma.decode_fused-int8-hv192": ("decode_fused.f16.mma", {**MMA, "split_size": 32},
                                    dict(dtype="float16", kv_dtype="int8", v_head_size=192),
                                    False),
    "mma.decode_fused-int4-paged": ("decode_fused.f16.mma", {**MMA, "split_size": 32}, dict(
        dtype="float16", kv_dtype="int4", v_head_size=128, **PAGED), False),
    "mma.decode_fused-bf16-h512": ("decode_fused.bf16.mma", {**MMA, "split_size": 32}, dict(
        dtype="bfloat16", head_size=512, v_head_size=320, seq_len=2), True),
    # MLA (q/k 576, v 512, one KV head): decode (one row, speculative rows, the unfused pair,
    # paged pools), prefill, the sub-group and tensor-core builds
    "mla.decode_fused-paged": ("decode_fused.f16.m1", {"split_size": 16}, dict(
        **MLA, dtype="float16", seq_len=1, **PAGED), False),
    "mla.decode_partial.sg-m4": ("decode_partial.bf16.sg.m4", {**EMU, "split_size": 16}, dict(
        **MLA, dtype="bfloat16", seq_len=4), False),
    "mla.decode_qk": ("decode_qk.f32.m1", {"split_size": 16}, dict(**MLA, seq_len=1), False),
    "mla.prefill.sg": ("prefill.f32.sg", EMU, dict(**MLA, seq_len=9, past_len=0), False),
    "mla.mma.decode_fused": ("decode_fused.f16.mma", {**MMA, "split_size": 32}, dict(
        **MLA, dtype="float16", seq_len=2), True),
    "mla.mma.prefill-hv256": ("prefill.bf16.mma", MMA, {
        **MLA, "dtype": "bfloat16", "seq_len": 9, "past_len": 0, "v_head_size": 256}, False),
}
# One feature at a time (the others off): each must work without the rest.
ALONE: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "kv_start": ("prefill.f32.wgmem", {}, dict(kv_start=True)),
    "seqlens_q": ("decode_fused.f32.sg.m2", {**EMU, "split_size": 16}, dict(seqlens_q=True)),
    "right-padded": ("prefill.f16.sg", EMU, dict(dtype="float16", seqlens_q=True, past_len=0,
                                                 seq_len=9)),
    "v_head_size": ("decode_partial.f32.m4", {"split_size": 16}, dict(v_head_size=96)),
}
# Partial states [B, Nq, S, T, Hv] against the reference's, then reduced in float64.
PARTIALS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "decode_partial.m4": ("decode_partial.f32.m4", {}, dict(v_head_size=32)),
    "decode_partial.sg.m2": ("decode_partial.f16.sg.m2", EMU, dict(dtype="float16",
                                                                   v_head_size=96)),
    "mma.decode_partial": ("decode_partial.f16.mma", MMA, dict(dtype="float16",
                                                               v_head_size=128, **PAGED)),
}


def _padding_rows(spec: AttentionSpec, t: dict[str, np.ndarray], got: Any) -> None:
    """Rows past seqlens_q[b]: out exactly 0, lse -inf (no sink), whatever their q held."""
    out, lse = got if spec.return_lse else (got, None)
    out = ref.q_canonical(spec, np.asarray(out, np.float32))       # [B, Nq, S, Hv]
    for b, n in enumerate(np.asarray(t.get("seqlens_q", [spec.seq_len] * spec.batch))):
        assert not out[b, :, n:].any(), f"padding rows of batch {b} are not 0"
        if lse is not None:
            assert np.isneginf(lse[b, :, n:]).all(), f"padding rows of batch {b}: lse"


@pytest.mark.parametrize("name", list(CELLS))
def test_features_together(session, name):
    kid, params, fields, nonfinite = CELLS[name]
    kid = f"opencl.{kid}"
    spec = AttentionSpec(**{**MODEL, **fields})
    t = make_tensors(spec, seed=len(name), mask_frac=0.2 if spec.bias else 0.0)
    if nonfinite:
        plant_nonfinite(spec, t)        # NaN / inf that some rows see and others do not
    got = session.run(spec, t, kernel=kid, params=params)
    check_close(spec, got, t, what=kid)
    _padding_rows(spec, t, got)


@pytest.mark.parametrize("name", list(ALONE))
def test_feature_alone(session, name):
    kid, params, fields = ALONE[name]
    base = {k: v for k, v in MODEL.items() if k not in ("kv_start", "seqlens_q")}
    spec = AttentionSpec(**{**base, **fields})
    t = make_tensors(spec, seed=7)
    got = session.run(spec, t, kernel=f"opencl.{kid}", params=params)
    check_close(spec, got, t, what=kid)


def test_inf_before_kv_start_and_in_padding_rows(session):
    """+inf and -inf (not only NaN) in the keys before kv_start and in padding q rows never
    reach a result: they are never loaded, or selected away (0 * inf = NaN otherwise)."""
    spec = AttentionSpec(**{**MODEL, "v_head_size": 96})
    t = make_tensors(spec, seed=11)
    starts, rows = t["kv_start"], t["seqlens_q"]
    assert starts[0] > 0 and rows[-1] < spec.seq_len
    for b in range(spec.batch):
        t["k"][b, : starts[b]] = np.inf                  # BSNH: [B, C, Nkv, H]
        t["v"][b, : starts[b]] = -np.inf
        t["q"][b, rows[b]:] = np.inf
    got = session.run(spec, t, kernel="opencl.decode_partial.f32.m2", params={"split_size": 16})
    check_close(spec, got, t, what="decode_partial.f32.m2")
    _padding_rows(spec, t, got)


@pytest.mark.parametrize("name", list(PARTIALS))
def test_partial_states_reduced_on_the_reference(session, name):
    kid, params, fields = PARTIALS[name]
    spec = AttentionSpec(**{**MODEL, **fields})
    t = make_tensors(spec, seed=5)
    o, lse = session.partial_states(spec, t, split_size=16, kernel=f"opencl.{kid}",
                                    params=params)
    assert o.shape == (*spec.lse_shape, o.shape[3], spec.head_size_v)
    tol = TOLERANCE[spec.dtype]
    _, problem = compare_partials(spec, (o, lse),
                                     ref.partial_states(spec, check_tensors(spec, t), 16), tol)
    assert not problem, f"{kid}: {problem}"
    pad = np.arange(spec.seq_len)[None, :] >= t["seqlens_q"][:, None]       # [B, S]
    assert np.isneginf(lse[pad[:, None, :, None].repeat(spec.num_heads, 1)
                           .repeat(lse.shape[3], 3)]).all()
    out, lse_red = ref.reduce(spec, o, lse, t["head_sink"], t["seqlens_q"])
    got = (ref.out_layout(spec, out).astype(spec.dtype), lse_red.astype(np.float32))
    check_close(spec, got, t, what=f"{kid} reduced")


def test_reduce_padding_rows_take_no_sink(session):
    """The reduce with seqlens_q: a padding row gets out 0 and lse -inf although the head
    sink would give it a finite lse; v's head size sets the rows' length."""
    spec = AttentionSpec(**{**MODEL, "dtype": "float16", "v_head_size": 96})
    t = make_tensors(spec, seed=3)
    o, lse = ref.partial_states(spec, check_tensors(spec, t), 16)
    o, lse = o.astype(np.float32), lse.astype(np.float32)
    o[np.isneginf(lse)] = np.nan                      # an empty split's o may hold anything
    got = session.reduce_states(spec, o, lse, t["head_sink"], seqlens_q=t["seqlens_q"],
                                kernel="opencl.reduce.f16")
    want = ref.reduce(spec, o, lse, t["head_sink"], t["seqlens_q"])
    _, problem = compare(spec, got, (ref.out_layout(spec, want[0]), want[1]),
                           TOLERANCE[spec.dtype])
    assert not problem, problem
    _padding_rows(spec, t, got)


# -- declarations, tiles and rejections (no device work) -----------------------------------
def test_every_kernel_declares_the_model_features_and_head_sizes():
    """q/k to 576 and v to 512, apart (MLA: q/k 576, v 512); the reduce's rows take any
    multiple of 4 to 1024 (merge_states)."""
    for k in attnreg.kernels("opencl"):
        assert k.supports >= MODEL_FEATURES, k.id
        assert k.head_size_ok(512) and k.head_size_ok(576), k.id
        assert k.v_head_size_ok(512), k.id
        if k.family != "reduce":
            assert not k.head_size_ok(592) and not k.v_head_size_ok(576), k.id


def test_every_mla_shape_has_a_kernel():
    """MLA's shapes and the heads around them plan in every dtype on PoCL and on a device
    with NVIDIA's 48 KiB, sub-groups and tensor cores (matrix units on or not): variants
    whose tiles do not fit decline and another variant of the family runs the spec."""
    nv = _nvidia_like()
    reg = attnreg.registry.get()
    for caps in (DEV, nv):
        for dtype in ("float16", "bfloat16", "float32"):
            for h, hv in ((576, 512), (520, 512), (64, 512), (576, 64)):
                for s, past in ((1, 100), (4, 60), (33, 0)):
                    spec = AttentionSpec(batch=1, num_heads=16, kv_num_heads=1, head_size=h,
                                         v_head_size=hv, seq_len=s, past_len=past, dtype=dtype)
                    for flags in ({}, {"matrix_units": "on"}):
                        plan = reg.plan(spec, caps=caps, flags=flags)
                        assert plan.stages, (caps.id, spec)


def _nvidia_like() -> attnreg.DeviceCaps:
    assert DEV is not None or pytest.skip("no OpenCL device")
    return DEV.model_copy(update={
        "limits": {**DEV.limits, "workgroup_storage": 48 * 1024, "invocations": 1024},
        "features": DEV.features | {mma_probe.FEATURE, "subgroups", tiles.NV_SHUFFLE},
        "subgroup_min_size": 32, "subgroup_max_size": 32, "vendor": "nvidia",
        "device_type": "gpu"})


@pytest.mark.parametrize("h,hv,nq,nkv,mma", [(128, 128, 32, 8, True), (128, 128, 16, 1, True),
                                            (256, 256, 16, 1, False), (576, 512, 16, 1, False),
                                            (576, 512, 64, 1, False), (576, 512, 128, 1, True)])
def test_nvidia_tensor_core_decode_where_measured_faster(h, hv, nq, nkv, mma):
    """opencl_mma_decode_nvidia: the tensor-core decode up to head size 128, and past it only
    for groups of 128 query heads a KV head (H100: MLA with 16 heads 494 vs 101 us for the
    sub-group decode, with 128 heads 353 vs 554 us; ci/results/h100_peers.txt)."""
    spec = AttentionSpec(batch=1, seq_len=1, past_len=4095, num_heads=nq, kv_num_heads=nkv,
                         head_size=h, v_head_size=hv, dtype="float16")
    plan = attnreg.registry.get().plan(spec, caps=_nvidia_like())
    assert (".mma" in plan.kernel) == mma, plan.explain()


@pytest.mark.parametrize("h,hv", [(512, 512), (64, 512), (512, 64), (320, 320), (576, 512),
                                  (576, 64)])
def test_scalar_tiles_fit_48k(h, hv):
    """Every scalar variant's tiles fit 48 KiB at head sizes to 576 (q/k) and 512 (v), except
    the sub-group prefill, whose K tile holds a sub-group's 32 keys: past q/k 320 it needs
    more, and a 48 KiB device rejects it by that storage (the tiled prefill runs those)."""
    nv = DEV.model_copy(update={"limits": {**DEV.limits, "workgroup_storage": 48 * 1024}}) \
        if DEV is not None else None
    for k in attnreg.kernels("opencl"):
        if k.matrix is not None or k.family == "reduce":
            continue
        for m in (1, 4):
            spec = AttentionSpec(batch=1, seq_len=4, num_heads=16, kv_num_heads=1,
                                 head_size=h, v_head_size=hv, past_len=60,
                                 dtype=min(k.dtypes))
            p = {**k.defaults, **k.params}
            if "m_tile" in p:
                p["m_tile"] = m
            need = k.storage_need(spec, p)
            g = tiles.geometry(k.family, cl_kernels.variant_of(k), spec, p)
            assert need == g.storage(h) and g.hv == hv
            if k.family == "prefill" and ".sg" in k.id and h > 320:
                assert need > tiles.STORAGE_BUDGET
                if nv is not None:
                    why = k.not_supported_reasons(spec, nv, p)
                    assert any("workgroup storage" in w for w in why), why
            else:
                assert need <= tiles.STORAGE_BUDGET, (k.id, m, need)


def test_unfused_pair_tiles_rows_alike():
    """decode_qk and decode_pv must agree on the row tiling at every head size."""
    for h, hv in ((64, 64), (512, 96), (64, 512)):
        spec = AttentionSpec(batch=1, seq_len=3, num_heads=16, kv_num_heads=1, head_size=h,
                             v_head_size=hv, past_len=60)
        for m in (1, 2, 4):
            qk = tiles.geometry("decode_qk", "", spec, {"m_tile": m, "kv_tile": 64})
            pv = tiles.geometry("decode_pv", "", spec, {"m_tile": m})
            assert (qk.gc, qk.mq) == (pv.gc, pv.mq)


def test_rejections_say_what_does_not_fit():
    assert DEV is not None or pytest.skip("no OpenCL device")
    nv = DEV.model_copy(update={"limits": {**DEV.limits, "workgroup_storage": 48 * 1024},
                                "features": DEV.features | {mma_probe.FEATURE}})
    spec = AttentionSpec(batch=1, seq_len=1, past_len=64, num_heads=8, kv_num_heads=2,
                         head_size=320, v_head_size=160, dtype="float16")
    mma = attnreg.registry.get().kernel("opencl.decode_fused.f16.mma")
    why = mma.not_supported_reasons(spec, nv, MMA)
    assert any("v_head_size 160" in w for w in why), why
    int4 = spec.replace(head_size=64, v_head_size=320, kv_dtype="int4")
    why = mma.not_supported_reasons(int4, nv, MMA)
    assert any("int4" in w and "320" in w for w in why), why
    pre = attnreg.registry.get().kernel("opencl.prefill.f16.mma")
    big = spec.replace(seq_len=64, past_len=0, head_size=512, v_head_size=512)
    p = {**pre.defaults, **MMA, "q_tile": 16, "kv_tile": 16}
    why = pre.not_supported_reasons(big, nv, p)
    assert any("workgroup storage" in w for w in why), why
