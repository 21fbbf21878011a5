"""Shared pieces of the ONNX adapter: reading a node, its inputs, and turning a masked
attention problem into an AttentionSpec plus tensors (see attnreg.integrations.onnx)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import SpecError
from ..spec import AttentionSpec

FLOATS = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Node:
    """What the adapter reads from an onnx.NodeProto."""

    op: str
    domain: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any]

    def attr(self, name: str, default: Any, kind: type) -> Any:
        value = self.attrs.get(name, default)
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if not ok:
            raise SpecError(f"{self.op}.attribute[{name!r}]", value, f"a {kind.__name__} attribute")
        return value

    def check_attrs(self, known: Sequence[str]) -> None:
        for name in self.attrs:
            if name not in known:
                raise SpecError(f"{self.op}.attribute[{name!r}]", self.attrs[name],
                                f"one of the attributes attnreg maps: {sorted(known)} (an "
                                "unknown attribute may change the math, so it is refused)")

    def wants(self, i: int) -> bool:
        """Whether output i is requested (present and named)."""
        return i < len(self.outputs) and bool(self.outputs[i])


def read_node(node: Any) -> Node:
    try:
        import onnx  # lazily: attnreg itself does not need onnx
    except ImportError:
        raise SpecError("node", node, "the onnx package to read a NodeProto (pip install onnx, "
                        "or attnreg's 'clients' extra)") from None
    if not isinstance(node, onnx.NodeProto):
        raise SpecError("node", node, "an onnx.NodeProto")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in attrs.items()}
    return Node(node.op_type, node.domain, tuple(node.input), tuple(node.output), attrs)


class Inputs:
    """A node's inputs by their position in the op's signature (names in error messages)."""

    def __init__(self, node: Node, names: Sequence[str], given: Any) -> None:
        self.op, self.names = node.op, names
        if len(node.inputs) > len(names):
            raise SpecError(f"{node.op}.input", list(node.inputs),
                            f"at most {len(names)} inputs {list(names)}")
        self.values: list[Any] = [None] * len(names)
        if isinstance(given, Mapping):
            for i, n in enumerate(node.inputs):
                if n:
                    if n not in given:
                        raise SpecError(f"inputs[{n!r}]", None, f"an array for {node.op} "
                                        f"input {names[i]!r} (the node names it)")
                    self.values[i] = given[n]
        elif isinstance(given, Sequence) and not isinstance(given, (str, bytes)):
            if len(given) > len(names):
                raise SpecError("inputs", f"<{len(given)} values>", f"at most {len(names)} "
                                f"values in {node.op}'s input order {list(names)}")
            for i, v in enumerate(given):
                self.values[i] = v
        else:
            raise SpecError("inputs", given, "a mapping {input name: array} or a sequence of "
                            "arrays in the node's input order")
        for i, v in enumerate(self.values):
            if v is not None and not isinstance(v, np.ndarray):
                if not hasattr(v, "__array__"):
                    raise SpecError(self.field(i), v, "a CPU array (numpy or __array__)")
                self.values[i] = np.asarray(v)

    def field(self, i: int) -> str:
        return f"{self.op}.inputs[{self.names[i]!r}]"

    def get(self, i: int, dtypes: Sequence[str] | None = None, ndim: Sequence[int] | None = None
            ) -> np.ndarray | None:
        v = self.values[i]
        if v is None:
            return None
        if dtypes is not None and v.dtype.name not in dtypes:
            raise SpecError(self.field(i) + ".dtype", v.dtype.name, " or ".join(dtypes))
        if ndim is not None and v.ndim not in ndim:
            raise SpecError(self.field(i) + ".shape", v.shape,
                            " or ".join(f"{d} dims" for d in ndim))
        return v

    def need(self, i: int, dtypes: Sequence[str] | None = None,
             ndim: Sequence[int] | None = None) -> np.ndarray:
        v = self.get(i, dtypes, ndim)
        if v is None:
            raise SpecError(self.field(i), None, f"an array ({self.op} requires it)")
        return v

    def refuse(self, i: int, why: str) -> None:
        if self.values[i] is not None:
            raise SpecError(self.field(i), self.values[i], why)


def expect_shape(field_: str, arr: np.ndarray, shape: tuple[int, ...], how: str) -> None:
    if tuple(arr.shape) != tuple(shape):
        raise SpecError(field_ + ".shape", tuple(arr.shape), f"{tuple(shape)} ({how})")


def heads(field_: str, arr: np.ndarray, n: int) -> np.ndarray:
    """[B, S, n*H] -> a [B, S, n, H] view (no copy)."""
    if n <= 0 or arr.shape[-1] % n:
        raise SpecError(field_ + ".shape", tuple(arr.shape),
                        f"a last dim divisible by the head count {n}")
    return arr.reshape(*arr.shape[:-1], n, arr.shape[-1] // n)


def concat_kv(past: np.ndarray | None, new_bsnh: np.ndarray) -> np.ndarray:
    """present = past (BNSH) followed by the new keys/values ([B, T, N, H]) along the sequence."""
    new = new_bsnh.transpose(0, 2, 1, 3)
    return np.ascontiguousarray(new) if past is None or past.shape[2] == 0 else \
        np.concatenate([past, new], axis=2)


@dataclass(frozen=True)
class NodeRun:
    """How a node runs on attnreg: ``attnreg.run(spec, how.tensors)`` then ``how.outputs(out)``.

    present_key / present_value are the op's BNSH KV-cache outputs (None when not requested);
    ``rules`` says in words which mapping rules fired; ``idle`` lists the batch entries with
    no valid query row (GQA query_seqlens 0), whose output ``outputs`` sets to 0.
    """

    op: str
    tensors: dict[str, np.ndarray]
    output_shape: tuple[int, ...]
    wanted: tuple[bool, ...]
    present_key: np.ndarray | None = None
    present_value: np.ndarray | None = None
    rules: tuple[str, ...] = field(default=())
    idle: tuple[int, ...] = field(default=())

    def outputs(self, out: np.ndarray) -> list[np.ndarray | None]:
        """The node's outputs in the op's order (None where the node names no output).
        Batch entries listed in ``idle`` (GQA query_seqlens 0: no valid query row) are 0."""
        y = np.asarray(out).reshape(self.output_shape)
        if self.idle:
            y = y.copy()
            y[list(self.idle)] = 0
        got = [y, self.present_key, self.present_value]
        return [got[i] if w else None for i, w in enumerate(self.wanted)]


def left_padding(visible: np.ndarray, b: int, ends: np.ndarray) -> np.ndarray | None:
    """kv_start per batch entry when the bool mask ``visible`` [B|1, N|1, S|1, C] says exactly
    "key j is visible iff j >= start[b]", the same for every head and row, among the keys
    j < ends[b] that exist (the others are never seen, whatever the mask says there); None
    when it says anything else, or hides every existing key of some entry (kv_start < L_b)."""
    j = np.arange(visible.shape[3])
    v = np.broadcast_to(visible, (b, *visible.shape[1:]))
    inside = j[None, :] < ends[:, None]                                  # [B, C]
    row = v[:, 0, 0, :]                                                  # [B, C]
    if not np.all((v == row[:, None, None, :]) | ~inside[:, None, None, :]):
        return None
    seen = row & inside
    if not seen.any(axis=1).all():
        return None
    start = np.argmax(seen, axis=1)
    if not np.array_equal(seen, (j[None, :] >= start[:, None]) & inside):
        return None
    return start.astype(np.int64)


def _dims(op: str, q: np.ndarray, q_layout: str, k: np.ndarray, v: np.ndarray, kv_layout: str
          ) -> tuple[int, int, int, int, int, int, int]:
    """(B, S, Nq, H, Nkv, Hv, C) of q, k and v, their dtypes and shapes checked."""
    dtype = q.dtype.name
    if dtype not in FLOATS:
        raise SpecError(f"{op}.inputs[query].dtype", dtype, " or ".join(FLOATS))
    for name, t in (("key", k), ("value", v)):
        if t.dtype != q.dtype:
            raise SpecError(f"{op}.inputs[{name}].dtype", t.dtype.name,
                            f"{dtype}, the query's dtype (attnreg never casts inputs)")
    b, s, n, h = q.shape if q_layout == "BSNH" else (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    cap = k.shape[1] if kv_layout == "BSNH" else k.shape[2]
    nkv = k.shape[2] if kv_layout == "BSNH" else k.shape[1]
    hv = v.shape[-1]
    if k.shape[-1] != h:
        raise SpecError(f"{op}.inputs[key].shape", tuple(k.shape),
                        f"the query's head size {h} in the last dim")
    if v.shape[:-1] != k.shape[:-1]:
        raise SpecError(f"{op}.inputs[value].shape", tuple(v.shape),
                        f"{(*k.shape[:-1], 'Hv')}, the key's shape with any head size Hv")
    if cap < 1:
        raise SpecError(f"{op}.inputs[key].shape", tuple(k.shape), "at least one key")
    return b, s, n, h, nkv, hv, cap


def _pad_keys(k: np.ndarray, v: np.ndarray, kv_layout: str, s: int, cap: int,
              lengths: np.ndarray | None, visible: np.ndarray | None, add: np.ndarray | None,
              rules: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None,
                                         np.ndarray | None]:
    """attnreg's queries are the last S of at least S keys: with fewer keys than queries
    (cross-attention) K/V are padded (a copy) with zero keys up to S, which the lengths and
    the bias mask. Returns k, v, lengths, visible, add."""
    axis = 1 if kv_layout == "BSNH" else 2
    widths = [(0, 0)] * 4
    widths[axis] = (0, s - cap)
    k, v = np.pad(k, widths), np.pad(v, widths)
    lengths = np.minimum(lengths, cap) if lengths is not None else np.full(k.shape[0], cap, np.int64)
    if visible is not None:
        visible = np.pad(visible, [(0, 0)] * 3 + [(0, s - cap)])
    if add is not None and add.shape[-1] == cap:
        add = np.pad(add, [(0, 0)] * (add.ndim - 1) + [(0, s - cap)])
    rules.append("fewer keys than queries: K/V padded to S keys, the pad masked by the bias")
    return k, v, lengths, visible, add


def _kv_start(op: str, visible: np.ndarray, shape: tuple[int, int, int, int], ends: np.ndarray,
              rules: list[str]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A bool mask [B, Nq, S, C] (broadcast) that hides one key prefix from every row and
    head as kv_start (left padding) instead of a bias. Returns (the mask still needed, or
    None; kv_start, or None)."""
    try:
        np.broadcast_shapes(visible.shape, shape)
    except ValueError:
        raise SpecError(f"{op} mask", visible.shape, "a shape broadcastable to "
                        f"[B, Nq, S, total] = {shape}") from None
    found = left_padding(visible, shape[0], ends)
    if found is None:
        return visible, None
    if not found.any():
        rules.append("mask hides no existing key: dropped")
        return None, None
    rules.append("mask hides the same key prefix from every row and head: "
                 "kv_start (left padding), no bias")
    return None, found


def _positions(offsets: np.ndarray, lens: np.ndarray, rows: np.ndarray,
               shape: tuple[int, int, int, int], causal: bool, window: int, right_window: int,
               rules: list[str]) -> tuple[tuple[bool, int, int], np.ndarray | None]:
    """Row i at position i + offsets[b]: attnreg's own (causal, local_window, right_window)
    where those positions are its bottom-right p_i, else a mask [B, 1, S, C] for the bias.
    Returns the spec's three fields and the mask (None when the fields say it all)."""
    b, _, s, cap = shape
    what = " and ".join(w for w, on in (("causal frontier j <= i + offset", causal),
                                        ("windows", window > 0 or right_window >= 0)) if on)
    if np.array_equal(offsets, lens - rows):
        rules.append(f"{what}: positions i + offset equal attnreg's bottom-right p_i")
        return (causal, window, right_window), None
    p = np.arange(s)[None, None, :, None] + offsets.reshape(b, 1, 1, 1)
    jj = np.arange(cap)[None, None, None, :]
    m = jj <= p if causal else np.ones((1, 1, 1, cap), bool)
    if window > 0:
        m = m & (jj > p - window)
    if right_window >= 0:
        m = m & (jj - p <= right_window)
    rules.append(f"{what} at positions i + offset (offset != valid length - S): a -inf bias")
    return (False, -1, -1), m


def _bias(op: str, vis: np.ndarray | None, add: np.ndarray | None, dtype: str,
          shape: tuple[int, int, int, int]) -> np.ndarray | None:
    """One bias for attnreg: ``add`` (a short last dim padded with -inf, as ONNX says; kept
    in float32 or the query's dtype) with -inf where ``vis`` is False; None without either."""
    if vis is None and add is None:
        return None
    cap = shape[3]
    if add is not None:
        add4: np.ndarray = add.reshape((1,) * (4 - add.ndim) + tuple(add.shape))
        if add4.shape[3] < cap:   # ONNX: a short last dim is padded with -inf
            fill = np.full((*add4.shape[:3], cap - add4.shape[3]), -np.inf, add4.dtype)
            add4 = np.concatenate([add4, fill], axis=3)
        base = add4 if add4.dtype.name in ("float32", dtype) else add4.astype(np.float32)
    else:
        base = np.zeros((1, 1, 1, cap), np.float32)
    bias = base if vis is None else np.where(vis, base, np.array(-np.inf, base.dtype))
    try:
        np.broadcast_shapes(bias.shape, shape)
    except ValueError:
        raise SpecError(f"{op} mask/bias", bias.shape,
                        f"shapes broadcastable to [B, Nq, S, total] = {shape}") from None
    return np.ascontiguousarray(bias)


def _tensors(spec: AttentionSpec, q: np.ndarray, k: np.ndarray, v: np.ndarray, lens: np.ndarray,
             rows: np.ndarray, starts: np.ndarray | None, bias: np.ndarray | None,
             sink: np.ndarray | None, rules: list[str]) -> dict[str, np.ndarray]:
    """attnreg's tensors for ``spec``, saying in ``rules`` which fields carry the node's."""
    tensors: dict[str, np.ndarray] = {"q": q, "k": k, "v": v}
    if spec.seqlens_k:
        tensors["seqlens_k"] = lens.astype(np.int32)
        rules.append("per-batch valid lengths -> seqlens_k")
    if spec.seqlens_q:
        tensors["seqlens_q"] = rows.astype(np.int32)
        rules.append("per-batch query row counts -> seqlens_q (padding rows are 0)")
    if starts is not None:
        tensors["kv_start"] = starts.astype(np.int32)
    if spec.v_head_size is not None:
        rules.append(f"V head size {spec.v_head_size} != K head size {spec.head_size} "
                     "-> v_head_size")
    if bias is not None:
        tensors["bias"] = bias
    if sink is not None:
        tensors["head_sink"] = sink
    return tensors


def build(op: str, node: Node, q: np.ndarray, q_layout: str, k: np.ndarray, v: np.ndarray,
          kv_layout: str, *, output_shape: tuple[int, ...], scale: float, softcap: float,
          lengths: np.ndarray | None = None, q_lens: np.ndarray | None = None,
          offsets: np.ndarray | None = None, causal: bool = True, window: int = -1,
          right_window: int = -1, visible: np.ndarray | None = None, add: np.ndarray | None = None,
          sink: np.ndarray | None = None, present: tuple[np.ndarray, np.ndarray] | None = None,
          idle: tuple[int, ...] = (), rules: list[str]) -> tuple[AttentionSpec, NodeRun]:
    """The spec and tensors for: keys j < lengths[b] (None: all); batch entry b's first
    q_lens[b] query rows valid (None: all S; the rest are padding, out 0); when ``offsets``
    is given row i is at position p = i + offsets[b] and sees j <= p if ``causal`` (ORT's
    causal frontier), j > p - W with window W > 0 and j <= p + R with right_window R >= 0;
    ``visible`` (bool) and ``add`` (float) broadcast to [B, Nq, S, C]. v's head size may
    differ from q's and k's (v_head_size). attnreg's own causal / seqlens_k / seqlens_q /
    kv_start / local_window / right_window are used where they say the same thing (the
    positions are attnreg's bottom-right p_i); anything else becomes a -inf bias."""
    b, s, n, h, nkv, hv, cap = _dims(op, q, q_layout, k, v, kv_layout)
    if cap < s:
        k, v, lengths, visible, add = _pad_keys(k, v, kv_layout, s, cap, lengths, visible, add,
                                                rules)
        cap = s
    shape = (b, n, s, cap)
    full = np.full(b, cap, np.int64)
    rows = np.full(b, s, np.int64) if q_lens is None else q_lens.astype(np.int64)
    use_lens = lengths is not None and bool(np.all((lengths >= rows) & (lengths <= cap)))
    assert q_lens is None or use_lens, "the op mapper checks 1 <= S_b <= L_b <= C"
    lens = lengths.astype(np.int64) if use_lens and lengths is not None else full
    starts = None
    if visible is not None:
        visible, starts = _kv_start(op, visible, shape, lengths if lengths is not None else full,
                                    rules)
    masks = [] if visible is None else [visible]
    if lengths is not None and not use_lens:
        masks.append(np.arange(cap)[None, None, None, :] < lengths.reshape(b, 1, 1, 1))
        rules.append("valid lengths outside [S, C]: a -inf bias masks keys j >= length")
    fields = (False, -1, -1)
    if offsets is not None:
        fields, mask = _positions(offsets, lens, rows, shape, causal, window, right_window, rules)
        masks += [] if mask is None else [mask]
    vis: np.ndarray | None = None
    for m in masks:
        vis = m if vis is None else vis & m
    bias = _bias(op, vis, add, q.dtype.name, shape)
    padded = q_lens is not None and bool(np.any(rows != s))
    spec = AttentionSpec(batch=b, seq_len=s, past_len=max(int(lens.max()) - s, 0), num_heads=n,
                         kv_num_heads=nkv, head_size=h, v_head_size=hv if hv != h else None,
                         dtype=q.dtype.name, q_layout=q_layout, kv_layout=kv_layout,
                         causal=fields[0], scale=scale or None, softcap=float(softcap),
                         local_window=fields[1], right_window=fields[2],
                         kv_capacity=cap, bias=bias is not None,
                         seqlens_k=use_lens and not np.all(lens == cap),
                         head_sink=sink is not None, seqlens_q=padded,
                         kv_start=starts is not None)
    tensors = _tensors(spec, q, k, v, lens, rows, starts, bias, sink, rules)
    wanted = tuple(node.wants(i) for i in range(min(len(node.outputs), 3)))
    pk, pv = present if present is not None else (None, None)
    return spec, NodeRun(op, tensors, output_shape, wanted, pk, pv, tuple(rules), idle)
