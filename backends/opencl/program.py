"""How each OpenCL family is built and launched: its source (with the kernel signature
generated from attnreg/ports.py), build options, the stage parameters, grid and kernel
arguments of one plan stage.

Sources are read with importlib.resources from ``attnreg.kernels_cl`` (never from a path
relative to the checkout). Arguments follow the family's port table; a buffer that a spec
does not use (no bias, no block table, no k_scale / v_scale) is bound as NULL. The storage
types (q/out dtype, K/V codes, scales) are build options, so one source serves them all.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

from attnreg import blocks, env, ports
from attnreg.backends import common
from attnreg.caps import DeviceCaps
from attnreg.errors import SpecError
from attnreg.plan import Plan, Stage
from attnreg.spec import AttentionSpec

from . import mma
from .tiles import Geometry

# family -> source files, in include order (the Params struct and the signature in front)
_DECODE = ("common.cl", "flash_core.cl", "flash_rows.cl", "subgroups.cl", "decode_core.cl")
FILES = {
    "prefill": ("common.cl", "flash_core.cl", "flash_rows.cl", "subgroups.cl", "flash_prefill.cl"),
    "decode_partial": (*_DECODE, "decode_partial.cl"),
    "decode_fused": (*_DECODE, "decode_merge.cl", "decode_fused.cl"),
    "decode_qk": ("common.cl", "flash_core.cl", "decode_qk.cl"),
    "decode_pv": ("common.cl", "flash_core.cl", "decode_pv.cl"),
    "reduce": ("common.cl", "reduce.cl"),
}
# (family, variant) -> source files of a variant with a program of its own; the family's
# kernel signature and entry point stay. The tensor-core kernels: -D MMA picks the primitive;
# decode_mma.cl is both decode kernels (-D MMA_OUT, below); a kernel file's helpers (*_tiles.cl,
# *_chunks.cl) come just before it.
_MMA = ("common.cl", "flash_core.cl", "subgroups.cl", "mma_sync.cl", "mma_tile.cl")
VARIANT_FILES = {
    ("prefill", "mma"): (*_MMA, "mma_async.cl", "flash_prefill_mma_tiles.cl",
                         "flash_prefill_mma.cl"),
    ("decode_partial", "mma"): (*_MMA, "mma_kvq.cl", "mma_prefetch.cl", "decode_mma_chunks.cl",
                                "decode_mma.cl"),
    ("decode_fused", "mma"): (*_MMA, "mma_kvq.cl", "mma_prefetch.cl", "decode_merge.cl",
                              "decode_mma_chunks.cl", "decode_mma.cl"),
}
MMA_OUT = {"decode_partial": 1, "decode_fused": 2}
ENTRY = {"prefill": "flash_prefill", "reduce": "reduce",
         **{f: f for f in ("decode_partial", "decode_fused", "decode_qk", "decode_pv")}}
BASE_OPTIONS = ("-cl-std=CL1.2",)
EXTRA_ENV = "ATTNREG_OPENCL_BUILD_OPTIONS"   # e.g. -cl-nv-verbose, for diagnosis
# Options that let the compiler assume no NaN or inf (the contract's non-finite rules rest on
# them): refused in the environment, where one silently turned rows that must be 0 / -inf
# into NaN.
UNSAFE_OPTIONS = ("-cl-fast-relaxed-math", "-cl-finite-math-only",
                  "-cl-unsafe-math-optimizations")
# -D KV_Q per K/V storage (kernels_cl/common.cl): the spec's dtype, int8 codes + float32
# scales per vector, int4 q4_0 blocks + float16 scales per 32 elements.
KV_Q = {None: 0, "int8": 1, "int4": 2}

# OpenCL C spelling of each port kind (attnreg/ports.py); elem_t (q, out), kv_t (k, v as
# stored), scale_t (k_scale, v_scale), bias_t and PARAMS are defined by common.cl, which
# precedes the first use of the signature.
_CL_TYPES = {"kv": "elem_t", "kvc": "kv_t", "scale": "scale_t", "bias": "bias_t",
             "out": "elem_t", "f32": "float", "f32x2": "float", "f32x4": "float", "i32": "int",
             "u32": "uint"}


@cache
def read_file(name: str) -> str:
    return resources.files("attnreg.kernels_cl").joinpath(name).read_text(encoding="utf-8")


def signature(family: str) -> str:
    """``#define KERNEL_ARGS ...``: the family's kernel parameters, from its port table."""
    args = []
    for p in ports.ports(family, ports.OPENCL):
        if p.kind == "params":
            args.append(f"PARAMS {p.ident}")
        elif p.kind == "ticket":
            args.append(f"volatile __global uint* {p.ident}")
        else:
            const = "const " if p.access == "read" else ""
            args.append(f"{const}__global {_CL_TYPES[p.kind]}* {p.ident}")
    return "#define KERNEL_ARGS " + ", ".join(args) + "\n"


def load_source(family: str) -> str:
    """The complete OpenCL C text of one family (tests may monkeypatch this)."""
    return _assemble(family, FILES[family])


def source(family: str, variant: str) -> str:
    """The OpenCL C text a kernel variant builds: its own files (VARIANT_FILES) or its
    family's."""
    files = VARIANT_FILES.get((family, variant))
    return load_source(family) if files is None else _assemble(family, files)


def _assemble(family: str, files: tuple[str, ...]) -> str:
    return common.opencl_struct() + signature(family) + "".join(read_file(f) for f in files)


def build_fix(caps: DeviceCaps) -> tuple[str, ...]:
    """Options every build on this device needs (compiler_check.py: -cl-opt-disable where the
    optimizer miscompiled the check kernel)."""
    return tuple(caps.extra.get("cl_build_fix", ()))


def env_options() -> tuple[str, ...]:
    """ATTNREG_OPENCL_BUILD_OPTIONS (the probe's settings show them; every build reads them
    again, so a tool may set them mid-process, as bench/opencl_gpu_check.py does); a
    SpecError naming it for an option that is not one or that breaks the contract."""
    got = tuple(env.text(EXTRA_ENV).split())
    for opt in got:
        if not opt.startswith("-") or opt.split("=")[0] in UNSAFE_OPTIONS:
            raise SpecError(EXTRA_ENV, env.text(EXTRA_ENV),
                            f"compiler options (-name) that keep the contract's float "
                            f"semantics; not {opt!r} (refused: {', '.join(UNSAFE_OPTIONS)})")
    return got


def device_options(caps: DeviceCaps) -> tuple[str, ...]:
    """What every program of the device is built with beyond its defines: the fixes its
    compiler needs (build_fix) and the environment's options."""
    return build_fix(caps) + env_options()


def options(defines: dict[str, int], extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    return BASE_OPTIONS + extra + tuple(f"-D{k}={v}" for k, v in sorted(defines.items()))


def split_params(plan: Plan) -> dict[str, int]:
    """The plan's split geometry as the stage parameters carry it (empty without splits)."""
    return plan.split.params if plan.split is not None else {}


def stage_params(plan: Plan, stage: Stage, split: Mapping[str, int],
                 bias_shape: tuple[int, ...] | None) -> dict[str, Any]:
    """The parameters a stage compiles with: its own, the plan's split geometry, the row
    tiling decode_pv must share with decode_qk, and the bias's head count (block lists)."""
    params: dict[str, Any] = {**stage.params, **split}
    if stage.family == "decode_pv":
        qk = next((s for s in plan.stages if s.family == "decode_qk"), None)
        params["m_tile"] = int(qk.params.get("m_tile", 1)) if qk is not None else 1
    if params.get("block_skip"):
        if bias_shape is None:
            raise SpecError("bias", None, f"a bias tensor: {stage.kernel} skips the blocks a "
                            "bias leaves masked")
        if plan.op == "partial":
            raise SpecError("kernel", stage.kernel, "a kernel without block skipping for "
                            "partial states: block-skipping splits share out the listed blocks"
                            ", so they do not follow split_size")
        params["bias_heads"] = int(bias_shape[1])
    return params


def window_tests(spec: AttentionSpec, caps: DeviceCaps | None) -> bool:
    """Whether a program carries the right window's tests (flash_core.cl RIGHT_WINDOW): where
    the spec has one, and on CPU devices always, so that one program serves specs with and
    without (a CPU device's build costs more than the tests: PoCL builds a program in ~1.3 s);
    a GPU's programs without a right window leave them out (with them, the H100 tensor-core
    prefill ran 13% slower, S=2048 264 -> 300 us: ci/results/h100_peers.txt)."""
    return "right_window" in spec.features or (caps is not None and caps.device_type == "cpu")


def defines(spec: AttentionSpec, g: Geometry, bias_dtype: str | None,
            params: Mapping[str, Any], caps: DeviceCaps | None = None) -> dict[str, int]:
    """The -D constants of a stage's program; ``bias_dtype``: the bias as stored (any dtype
    the checks accept for it; None without a bias), which its reads follow (common.cl)."""
    out = {"IS_F16": int(spec.dtype == "float16"), "IS_BF16": int(spec.dtype == "bfloat16"),
           "HD": spec.head_size, "HV": spec.head_size_v, "BIAS_F16": int(bias_dtype == "float16"),
           # only where set: the build options of every other program stay as they were
           **({"BIAS_BF16": 1} if bias_dtype == "bfloat16" else {}),
           **({"RIGHT_WINDOW": 1} if window_tests(spec, caps) else {}),
           # the reduce reads no K/V: one build serves every storage
           "KV_Q": 0 if g.family == "reduce" else KV_Q[spec.kv_dtype],
           "PAGED": int(spec.page_size or 0) if spec.kv_layout == "paged" else 0,
           "BLOCK_SKIP": int(bool(params.get("block_skip"))), **g.defines()}
    if g.mma and g.family == "prefill":
        # local tile pitches in words (mma.mma_pitch; mma.mma_storage counts the same)
        out["QW"] = mma.mma_pitch(spec.head_size)
        if g.pf == 2:       # row-major K and V tiles for ldmatrix (kernels_cl/mma_async.cl)
            out.update(KW=mma.ldsm_pitch(spec.head_size), VW=mma.ldsm_pitch(spec.head_size_v),
                       QREG=int(mma.async_q_in_registers(spec.head_size)))
        else:
            out["VW"] = mma.mma_pitch(g.tk)
    elif g.mma:
        out["MMA_OUT"] = MMA_OUT[g.family]
    return out


def global_size(family: str, spec: AttentionSpec, g: Geometry,
                params: Mapping[str, Any]) -> int:
    if family == "reduce":
        return spec.batch * spec.num_heads * spec.seq_len * g.wg
    if family == "prefill":
        return g.n_groups(spec) * g.wg
    return g.n_groups(spec, int(params["n_splits"])) * g.wg


def tiles(spec: AttentionSpec, g: Geometry, params: Mapping[str, Any]) -> int:
    """decode_fused's row tiles (one ticket each)."""
    return g.n_groups(spec, int(params["n_splits"])) // int(params["n_splits"])


def arguments(family: str, block: Any, b: Mapping[str, Any]) -> list[Any]:
    """Kernel arguments in signature order: the parameter block, then each port's buffer by
    name (``b`` maps names to buffers; an absent one is NULL)."""
    return [block if p.kind == "params" else b.get(p.name)
            for p in ports.ports(family, ports.OPENCL)]


def heavy_first(spec: AttentionSpec, g: Geometry, bl: blocks.BlockList) -> np.ndarray:
    """Prefill work-group order for block skipping: most listed blocks (within the causal
    and right-window bounds) first, so the longest work-groups start early and the tail
    stays short."""
    n = g.n_groups(spec)
    gid = np.arange(n)
    rt_n, hc_n = -(-spec.seq_len // g.mq), -(-spec.group_size // g.gc)
    rt, hc = gid % rt_n, (gid // rt_n) % hc_n
    rest = gid // (rt_n * hc_n)
    kvh, b = rest % spec.kv_num_heads, rest // spec.kv_num_heads
    h0 = kvh * spec.group_size + hc * g.gc
    hb = bl.bias_heads
    row = ((b if bl.bias_batch > 1 else 0) * hb + (h0 if hb > 1 else 0)) * bl.n_qtiles + rt
    hi = np.full(n, spec.capacity)
    i1 = np.minimum((rt + 1) * g.mq, spec.seq_len) - 1
    if spec.causal:
        hi = np.minimum(hi, spec.total_len - spec.seq_len + i1 + 1)
    if spec.right_window >= 0:
        hi = np.minimum(hi, spec.total_len - spec.seq_len + i1 + 1 + spec.right_window)
    counts = np.array([np.searchsorted(bl.blocks[bl.offsets[r]:bl.offsets[r + 1]] * bl.kv_tile,
                                       h, side="left") for r, h in zip(row, hi)], np.int64)
    return np.argsort(-counts, kind="stable").astype(np.int32)
