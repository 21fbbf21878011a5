"""How each OpenCL family is launched: the stage parameters, build defines, grid and kernel
arguments of one plan stage, and the scratch each route needs.

Arguments are positional and mirror the kernels' signatures in kernels_cl/ exactly; a
buffer that a spec does not use (no bias, no block table) is bound as NULL.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from attnreg import blocks
from attnreg.errors import SpecError
from attnreg.plan import Plan, Stage
from attnreg.spec import AttentionSpec

from . import kernels

SPLIT_FAMILIES = ("decode_partial", "decode_fused", "decode_qk")


def split_params(plan: Plan) -> dict[str, int]:
    """One split geometry for every stage of a split-KV plan, derived from the first split
    stage's split_size (a caller may give split_size alone; later stages must agree)."""
    spec = plan.spec
    if plan.op == "reduce":
        return {}
    first = next((s for s in plan.stages if s.family in SPLIT_FAMILIES), None)
    if first is None:
        return {}
    size = int(first.params.get("split_size", spec.capacity))
    return {"split_size": size, "n_splits": -(-spec.capacity // size)}


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


def defines(spec: AttentionSpec, g: kernels.Geometry, bias_f16: bool,
            params: Mapping[str, Any]) -> dict[str, int]:
    return {"IS_F16": int(spec.dtype == "float16"), "HD": spec.head_size,
            "BIAS_F16": int(bias_f16),
            "PAGED": int(spec.page_size or 0) if spec.kv_layout == "paged" else 0,
            "BLOCK_SKIP": int(bool(params.get("block_skip"))), **g.defines()}


def global_size(family: str, spec: AttentionSpec, g: kernels.Geometry,
                params: Mapping[str, Any]) -> int:
    if family == "reduce":
        return spec.batch * spec.num_heads * spec.seq_len * g.wg
    if family == "prefill":
        return g.n_groups(spec) * g.wg
    return g.n_groups(spec, int(params["n_splits"])) * g.wg


def tiles(spec: AttentionSpec, g: kernels.Geometry, params: Mapping[str, Any]) -> int:
    """decode_fused's row tiles (one ticket each)."""
    return g.n_groups(spec, int(params["n_splits"])) // int(params["n_splits"])


def arguments(family: str, block: Any, b: Mapping[str, Any]) -> list[Any]:
    """Kernel arguments in signature order (``b`` maps buffer names to buffers)."""
    kv = [b.get("q"), b.get("k"), b.get("v"), b.get("bias"), b.get("seqlens_k"), b.get("block_table")]
    lists = [b.get("blk_off"), b.get("blk_ids"), b.get("blk_zero")]
    if family == "reduce":
        return [block, b["o_parts"], b["lse_parts"], b.get("head_sink"), b["out"], b.get("lse")]
    if family == "prefill":
        return [block, *kv[:5], b.get("head_sink"), kv[5], *lists, b.get("wg_order"),
                b["out"], b.get("lse")]
    if family == "decode_partial":
        return [block, *kv, *lists, b["o_parts"], b["lse_parts"]]
    if family == "decode_fused":
        return [block, *kv, *lists, b.get("head_sink"), b["o_parts"], b["lse_parts"],
                b["tickets"], b["out"], b.get("lse")]
    if family == "decode_qk":
        return [block, b["q"], b["k"], b.get("bias"), b.get("seqlens_k"), b.get("block_table"),
                b["scores"], b["stats"]]
    if family == "decode_pv":
        return [block, b["v"], b.get("seqlens_k"), b.get("block_table"), b["scores"], b["stats"],
                b["o_parts"], b["lse_parts"]]
    raise SpecError("family", family, f"one of {sorted(kernels.DECODES)}, prefill, reduce")


def scratch_sizes(plan: Plan, split: Mapping[str, int]) -> dict[str, int]:
    """Bytes of the buffers a plan's stages pass between each other (sized per plan)."""
    spec = plan.spec
    fams = {s.family for s in plan.stages}
    out: dict[str, int] = {}
    if not split or plan.op == "reduce":
        return out
    rows = spec.batch * spec.num_heads * spec.seq_len * int(split["n_splits"])
    if fams & {"decode_partial", "decode_pv", "decode_fused"}:
        out["o_parts"] = rows * spec.head_size * 4
        out["lse_parts"] = rows * 4
    if "decode_qk" in fams:
        out["scores"] = spec.batch * spec.num_heads * spec.seq_len * spec.capacity * 4
        out["stats"] = 2 * rows * 4
    return out


def heavy_first(spec: AttentionSpec, g: kernels.Geometry, bl: blocks.BlockList) -> np.ndarray:
    """Prefill work-group order for block skipping: most listed blocks (within the causal
    bound) first, so the longest work-groups start early and the tail stays short."""
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
    if spec.causal:
        i1 = np.minimum((rt + 1) * g.mq, spec.seq_len) - 1
        hi = np.minimum(hi, spec.total_len - spec.seq_len + i1 + 1)
    counts = np.array([np.searchsorted(bl.blocks[bl.offsets[r]:bl.offsets[r + 1]] * bl.kv_tile,
                                       h, side="left") for r, h in zip(row, hi)], np.int64)
    return np.argsort(-counts, kind="stable").astype(np.int32)
