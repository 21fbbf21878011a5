"""Attention states (o, lse) between kernels: the checks on split-KV partial states handed
to a reduce, and merge_states (docs/contract.md "Split-KV partial states and merging"), which
merges states over disjoint key sets in numpy or, through Session.merge_states, as one reduce on a
device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import reference
from .errors import SpecError
from .spec import AttentionSpec
from .tensors import accepted_dtypes


def check_partials(spec: AttentionSpec, o_parts: Any, lse_parts: Any,
                   head_sink: Any, seqlens_q: Any = None) -> dict[str, np.ndarray]:
    """Validate partial states for the reduce (shapes of docs/contract.md "Split-KV partial states
    and merging", float32), and the head sink and query row counts it takes (padding rows get no
    sink)."""
    o = np.asarray(o_parts) if hasattr(o_parts, "__array__") else o_parts
    lse = np.asarray(lse_parts) if hasattr(lse_parts, "__array__") else lse_parts
    if not isinstance(o, np.ndarray) or o.dtype != np.float32 or o.ndim != 5:
        raise SpecError("o_parts", o_parts, "a float32 array [B, Nq, S, T, H]")
    b, nq, s, t, h = o.shape
    want = (spec.batch, spec.num_heads, spec.seq_len)
    if (b, nq, s) != want or h != spec.head_size_v or t < 1:
        raise SpecError("o_parts.shape", o.shape,
                        f"[B, Nq, S, T, Hv] = {(*want, 'T>=1', spec.head_size_v)}")
    if not isinstance(lse, np.ndarray) or lse.dtype != np.float32 or lse.shape != o.shape[:4]:
        raise SpecError("lse_parts", lse_parts, f"a float32 array of shape {o.shape[:4]}")
    # lse values: finite, -inf (an empty split, its o ignored) or NaN/+inf (a poisoned row:
    # docs/contract.md "Non-finite values and scalar fields", propagated as NaN by every reduce).
    out = {"o_parts": np.ascontiguousarray(o), "lse_parts": np.ascontiguousarray(lse)}
    if spec.head_sink:
        # the dtypes run() accepts for the sink (docs/contract.md "Tensors": float32 or the spec's
        # dtype)
        allowed = " or ".join(accepted_dtypes(spec, "head_sink"))
        if head_sink is None:
            raise SpecError("head_sink", None, f"a {allowed} [Nq] array, because spec.head_sink")
        sink = np.asarray(head_sink)
        if sink.dtype.name not in accepted_dtypes(spec, "head_sink") \
                or sink.shape != (spec.num_heads,) or not np.isfinite(sink).all():
            raise SpecError("head_sink", head_sink,
                            f"a finite {allowed} array of shape ({spec.num_heads},)")
        # the reduce kernels read float32 sinks: f16 / bf16 -> f32 is exact
        out["head_sink"] = np.ascontiguousarray(sink, dtype=np.float32)
    elif head_sink is not None:
        raise SpecError("head_sink", head_sink, "None, because spec.head_sink is False")
    if spec.seqlens_q:
        if seqlens_q is None:
            raise SpecError("seqlens_q", None, "an int32 [B] array, because spec.seqlens_q")
        from .tensors import _check_index
        box = {"seqlens_q": seqlens_q if hasattr(seqlens_q, "dtype") else np.asarray(seqlens_q)}
        _check_index("seqlens_q", box, spec.batch, 1, np.full(spec.batch, spec.seq_len),
                     "the number of query rows of batch b: 1 <= value <= seq_len")
        out["seqlens_q"] = np.ascontiguousarray(box["seqlens_q"])
    elif seqlens_q is not None:
        raise SpecError("seqlens_q", seqlens_q, "None, because spec.seqlens_q is False")
    return out


LAYOUTS = ("rows", "BSNH", "BNSH")


def states_layout(states: Any, layout: str | None) -> str:
    """How the states pair o with lse: "rows" (lse is o's shape without H: any leading
    shape, BNSH included) or "BSNH" (what run(..., return_lse=True) returns for q_layout
    BSNH: o [B, S, Nq, H] with lse [B, Nq, S]). None: told by the first pair's shapes; where
    both readings fit (S == Nq) rows is taken, so run's BSNH output with S == Nq needs
    layout="BSNH" (the shapes cannot tell them apart)."""
    if layout is not None:
        if layout not in LAYOUTS:
            raise SpecError("layout", layout, f"None or one of {LAYOUTS} (BNSH is rows)")
        return "rows" if layout == "BNSH" else layout
    try:
        o, lse = np.shape(states[0][0]), np.shape(states[0][1])
    except Exception:           # malformed states: _check_states names what is wrong
        return "rows"
    bsnh = len(o) == 4 and tuple(lse) == (o[0], o[2], o[1]) != tuple(o[:-1])
    return "BSNH" if bsnh else "rows"


def _check_states(states: Any, layout: str = "rows"
                  ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The o and lse arrays of the states, lse as o's shape without H (a BSNH lse
    [B, Nq, S] is viewed as [B, S, Nq])."""
    if isinstance(states, (str, bytes)) or not isinstance(states, Sequence) or len(states) < 1:
        raise SpecError("states", states, "a non-empty list of (o, lse) pairs")
    os_: list[np.ndarray] = []
    lses: list[np.ndarray] = []
    for i, pair in enumerate(states):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise SpecError(f"states[{i}]", pair, "an (o, lse) pair")
        o, lse = np.asarray(pair[0]), np.asarray(pair[1])
        if o.dtype.kind != "f" or o.ndim < 1 or (layout == "BSNH" and o.ndim != 4):
            raise SpecError(f"states[{i}][0]", pair[0], "a float array [B, S, Nq, H]"
                            if layout == "BSNH" else "a float array [..., H]")
        want = (o.shape[0], o.shape[2], o.shape[1]) if layout == "BSNH" else o.shape[:-1]
        if lse.dtype.kind != "f" or lse.shape != want:
            raise SpecError(f"states[{i}][1]", pair[1], f"a float array of shape {want}"
                            + (" (run's lse [B, Nq, S] beside a BSNH out)"
                               if layout == "BSNH" else ""))
        if layout == "BSNH":
            lse = lse.transpose(0, 2, 1)
        if os_ and (o.shape != os_[0].shape or o.dtype != os_[0].dtype or lse.dtype != lses[0].dtype):
            raise SpecError(f"states[{i}]", pair, f"o {os_[0].shape} {os_[0].dtype} and lse "
                            f"{lses[0].dtype} like states[0]")
        os_.append(o)
        lses.append(lse)
    return os_, lses


def merge_as_reduce(states: Any, layout: str = "rows"
                    ) -> tuple[AttentionSpec, np.ndarray, np.ndarray, tuple[int, ...]]:
    """The states as the splits of one reduce: a spec of batch 1, one head and R query rows
    (R = the product of the states' leading shape), float32 o_parts [1, 1, R, T, H] and
    lse_parts [1, 1, R, T], and that leading shape to restore the result's."""
    o_list, lse_list = _check_states(states, layout)
    lead, h = o_list[0].shape[:-1], o_list[0].shape[-1]
    r = int(np.prod(lead)) if lead else 1
    spec = AttentionSpec(batch=1, seq_len=r, past_len=0, num_heads=1, kv_num_heads=1,
                         head_size=h, dtype="float32", causal=False, return_lse=True)
    o_parts = np.stack([o.reshape(r, h).astype(np.float32) for o in o_list], axis=1)[None, None]
    lse_parts = np.stack([x.reshape(r).astype(np.float32) for x in lse_list], axis=1)[None, None]
    return spec, np.ascontiguousarray(o_parts), np.ascontiguousarray(lse_parts), tuple(lead)


def merge(states: Sequence[tuple[Any, Any]], layout: str = "rows"
          ) -> tuple[np.ndarray, np.ndarray]:
    """The states merged in float64 numpy, returned in the inputs' dtypes and layout."""
    os_, lses = _check_states(states, layout)
    o64, lse64 = reference.merge(list(zip(os_, lses)))
    return o64.astype(os_[0].dtype), restore_lse(lse64.astype(lses[0].dtype), layout)


def restore_lse(lse: np.ndarray, layout: str) -> np.ndarray:
    """A merged lse back in the states' layout (BSNH: [B, Nq, S] as run returns it)."""
    return np.ascontiguousarray(lse.transpose(0, 2, 1)) if layout == "BSNH" else lse
