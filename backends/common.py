"""What every GPU backend derives from a plan the same way: the scalar kernel parameters.

WGSL and OpenCL kernels read one parameter block with the fields below, in this order,
each 4 bytes (u32, i32 or f32). Packing it in one place keeps the two backends' kernels
reading identical numbers, and makes a mismatch a test failure in one file, not two.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from typing import Any

from attnreg.kernel import KernelInfo
from attnreg.spec import AttentionSpec

# (name, struct code) -- 'I' u32, 'i' i32, 'f' f32. Append only; kernels index by name.
FIELDS: tuple[tuple[str, str], ...] = (
    ("batch", "I"), ("seq_len", "I"), ("num_heads", "I"), ("kv_num_heads", "I"),
    ("head_size", "I"), ("capacity", "I"), ("group_size", "I"), ("total_len", "I"),
    # element strides; the innermost (head_size) stride is 1
    ("q_sb", "I"), ("q_sh", "I"), ("q_ss", "I"),
    ("kv_sb", "I"), ("kv_sh", "I"), ("kv_ss", "I"),
    ("bias_sb", "I"), ("bias_sh", "I"), ("bias_ss", "I"),
    ("split_size", "I"), ("n_splits", "I"),
    ("causal", "I"), ("has_seqlens", "I"), ("has_bias", "I"), ("has_sink", "I"),
    ("return_lse", "I"), ("local_window", "i"),
    ("scale", "f"), ("softcap", "f"),
    # alibi: slope_h = exp2(alibi_e0 * (h + 1)) if h < alibi_n else exp2(alibi_e1 * (2*(h-n)+1))
    ("has_alibi", "I"), ("alibi_n", "I"), ("alibi_e0", "f"), ("alibi_e1", "f"),
    # two-sided windows: key j is invisible to row i past p_i + right_window (-1: none)
    ("right_window", "i"),
    # paged KV (kv_layout="paged"): key j of batch b lives in page block_table[b, j / page_size]
    ("paged", "I"), ("page_size", "I"), ("pages_per_seq", "I"), ("pad1", "I"),
    # the shapes real models need: kv_start / seqlens_q tensors bound, v's head size (Hv:
    # v, out and the partial states' last dimension)
    ("has_kv_start", "I"), ("has_seqlens_q", "I"), ("head_size_v", "I"), ("pad2", "I"),
)
FORMAT = "<" + "".join(code for _, code in FIELDS)
SIZE = struct.calcsize(FORMAT)            # a multiple of 16 bytes, as WGSL uniforms need
assert SIZE % 16 == 0


def strides(layout: str, n: int, s: int, h: int) -> tuple[int, int, int]:
    """(batch, head, seq) element strides for a [B,S,N,H] or [B,N,S,H] tensor."""
    if layout == "BSNH":
        return s * n * h, h, n * h
    return n * s * h, s * h, h


def bias_strides(spec: AttentionSpec, bias_shape: tuple[int, ...] | None) -> tuple[int, int, int]:
    """Strides of a [Bb, Nb, Sb, C] bias with 0 on broadcast (size-1) dims."""
    if bias_shape is None:
        return 0, 0, 0
    bb, nb, sb, c = bias_shape
    ss = c if sb > 1 else 0
    sh = sb * c if nb > 1 else 0
    sbatch = nb * sb * c if bb > 1 else 0
    return sbatch, sh, ss


def values(spec: AttentionSpec, params: Mapping[str, Any],
           bias_shape: tuple[int, ...] | None = None) -> dict[str, int | float]:
    """The parameter block as a dict (what the kernels see)."""
    n = 2 ** math.floor(math.log2(spec.num_heads))
    return {
        "batch": spec.batch, "seq_len": spec.seq_len, "num_heads": spec.num_heads,
        "kv_num_heads": spec.kv_num_heads, "head_size": spec.head_size,
        "capacity": spec.capacity, "group_size": spec.group_size, "total_len": spec.total_len,
        **dict(zip(("q_sb", "q_sh", "q_ss"),
                   strides(spec.q_layout, spec.num_heads, spec.seq_len, spec.head_size))),
        # paged pools are [num_pages, page_size, Nkv, H]: strides within one page
        **dict(zip(("kv_sb", "kv_sh", "kv_ss"),
                   (spec.kv_num_heads * spec.head_size * (spec.page_size or 0), spec.head_size,
                    spec.kv_num_heads * spec.head_size) if spec.kv_layout == "paged" else
                   strides(spec.kv_layout, spec.kv_num_heads, spec.capacity, spec.head_size))),
        **dict(zip(("bias_sb", "bias_sh", "bias_ss"), bias_strides(spec, bias_shape))),
        "split_size": int(params.get("split_size", spec.capacity)),
        "n_splits": int(params.get("n_splits", 1)),
        "causal": int(spec.causal), "has_seqlens": int(spec.seqlens_k),
        "has_bias": int(spec.bias), "has_sink": int(spec.head_sink),
        "return_lse": int(spec.return_lse), "local_window": spec.local_window,
        "scale": spec.effective_scale, "softcap": spec.softcap,
        "has_alibi": int(spec.alibi_max_bias > 0), "alibi_n": n,
        "alibi_e0": -spec.alibi_max_bias / n, "alibi_e1": -spec.alibi_max_bias / 2.0 / n,
        "right_window": spec.right_window,
        "paged": int(spec.kv_layout == "paged"), "page_size": spec.page_size or 0,
        "pages_per_seq": spec.pages_per_seq, "pad1": 0,
        "has_kv_start": int(spec.kv_start), "has_seqlens_q": int(spec.seqlens_q),
        "head_size_v": spec.head_size_v, "pad2": 0,
    }


def pack(spec: AttentionSpec, params: Mapping[str, Any],
         bias_shape: tuple[int, ...] | None = None) -> bytes:
    v = values(spec, params, bias_shape)
    return struct.pack(FORMAT, *(v[name] for name, _ in FIELDS))


def wgsl_struct(name: str = "Params") -> str:
    """The WGSL declaration of the block (generated, so it cannot drift from FIELDS)."""
    ty = {"I": "u32", "i": "i32", "f": "f32"}
    body = "\n".join(f"  {n}: {ty[c]}," for n, c in FIELDS)
    return f"struct {name} {{\n{body}\n}};\n"


def opencl_struct(name: str = "Params") -> str:
    """The OpenCL C declaration of the block (generated from FIELDS)."""
    ty = {"I": "uint", "i": "int", "f": "float"}
    body = "\n".join(f"  {ty[c]} {n};" for n, c in FIELDS)
    return f"typedef struct {{\n{body}\n}} {name};\n"


def fit_tiles(kernel: KernelInfo, spec: AttentionSpec, params: Mapping[str, Any],
              limit: int | None, order: tuple[tuple[str, int], ...],
              fixed: frozenset[str] = frozenset(),
              regrow: tuple[str, ...] = ()) -> dict[str, int]:
    """Halve the kernel's tiles, in ``order`` (param, floor) and never those in ``fixed``,
    until its workgroup (local) storage fits ``limit``; then the tiles named in ``regrow``
    take back, doubling, what later halvings made room for (up to their value before). The
    params to set (empty when it already fits or nothing can shrink)."""
    p = {**kernel.defaults, **params, **kernel.params}
    if limit is None or kernel.storage_need(spec, p) <= limit:
        return {}
    changed: dict[str, int] = {}
    for name, floor in order:
        while name not in fixed and kernel.storage_need(spec, p) > limit \
                and int(p.get(name, 0)) > floor:
            # Halve to the first value that saves storage (a value clamped by the spec, such
            # as group_tile above the GQA group, saves nothing until it drops below it); a
            # tile that holds no storage here (kv_tile when K/V are not staged) stays.
            need, cand = kernel.storage_need(spec, p), int(p[name]) // 2
            while cand > floor and kernel.storage_need(spec, {**p, name: cand}) >= need:
                cand //= 2
            if kernel.storage_need(spec, {**p, name: cand}) >= need:
                break
            p[name] = changed[name] = cand
    if kernel.storage_need(spec, p) > limit:
        return changed
    for name in regrow:
        top = int({**kernel.defaults, **params}.get(name, 0))
        while name in changed and int(p[name]) < top \
                and kernel.storage_need(spec, {**p, name: 2 * int(p[name])}) <= limit:
            p[name] = changed[name] = 2 * int(p[name])
        if name in changed and changed[name] == top:
            del changed[name]
    return changed
