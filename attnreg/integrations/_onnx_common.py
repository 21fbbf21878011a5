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
    if cap < s:
        # attnreg's queries are the last S of at least S keys: pad K/V with zero keys that
        # the bias masks (a copy; cross-attention with fewer keys than queries)
        axis = 1 if kv_layout == "BSNH" else 2
        widths = [(0, 0)] * 4
        widths[axis] = (0, s - cap)
        k, v = np.pad(k, widths), np.pad(v, widths)
        lengths = np.minimum(lengths, cap) if lengths is not None else np.full(b, cap, np.int64)
        if visible is not None:
            visible = np.pad(visible, [(0, 0)] * 3 + [(0, s - cap)])
        if add is not None and add.shape[-1] == cap:
            add = np.pad(add, [(0, 0)] * (add.ndim - 1) + [(0, s - cap)])
        cap = s
        rules.append("fewer keys than queries: K/V padded to S keys, the pad masked by the bias")
    full = np.full(b, cap, np.int64)
    rows = np.full(b, s, np.int64) if q_lens is None else q_lens.astype(np.int64)
    use_lens = lengths is not None and bool(np.all((lengths >= rows) & (lengths <= cap)))
    assert q_lens is None or use_lens, "the op mapper checks 1 <= S_b <= L_b <= C"
    lens = lengths.astype(np.int64) if use_lens and lengths is not None else full
    starts = None
    if visible is not None:
        try:
            np.broadcast_shapes(visible.shape, (b, n, s, cap))
        except ValueError:
            raise SpecError(f"{op} mask", visible.shape, "a shape broadcastable to "
                            f"[B, Nq, S, total] = {(b, n, s, cap)}") from None
        found = left_padding(visible, b, lengths if lengths is not None else full)
        if found is not None:
            visible = None
            if found.any():
                starts = found
                rules.append("mask hides the same key prefix from every row and head: "
                             "kv_start (left padding), no bias")
            else:
                rules.append("mask hides no existing key: dropped")
    vis = visible
    j = np.arange(cap)

    def also(mask: np.ndarray) -> None:
        nonlocal vis
        vis = mask if vis is None else vis & mask

    if lengths is not None and not use_lens:
        also(j[None, None, None, :] < lengths.reshape(b, 1, 1, 1))
        rules.append("valid lengths outside [S, C]: a -inf bias masks keys j >= length")
    frontier, causal = causal, False
    win = right = -1
    if offsets is not None:
        what = " and ".join(w for w, on in (("causal frontier j <= i + offset", frontier),
                                            ("windows", window > 0 or right_window >= 0)) if on)
        if np.array_equal(offsets, lens - rows):
            causal, win, right = frontier, window, right_window
            rules.append(f"{what}: positions i + offset equal attnreg's bottom-right p_i")
        else:
            i = np.arange(s)[None, None, :, None]
            p = i + offsets.reshape(b, 1, 1, 1)
            jj = j[None, None, None, :]
            m = jj <= p if frontier else np.ones((1, 1, 1, cap), bool)
            if window > 0:
                m = m & (jj > p - window)
            if right_window >= 0:
                m = m & (jj - p <= right_window)
            also(m)
            rules.append(f"{what} at positions i + offset (offset != valid length - S): a -inf "
                         "bias")
    bias = None
    if vis is not None or add is not None:
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
            np.broadcast_shapes(bias.shape, (b, n, s, cap))
        except ValueError:
            raise SpecError(f"{op} mask/bias", bias.shape,
                            f"shapes broadcastable to [B, Nq, S, total] = {(b, n, s, cap)}") from None
        bias = np.ascontiguousarray(bias)
    padded = q_lens is not None and bool(np.any(rows != s))
    spec = AttentionSpec(batch=b, seq_len=s, past_len=max(int(lens.max()) - s, 0), num_heads=n,
                         kv_num_heads=nkv, head_size=h, v_head_size=hv if hv != h else None,
                         dtype=dtype, q_layout=q_layout, kv_layout=kv_layout, causal=causal,
                         scale=scale or None, softcap=float(softcap), local_window=win,
                         right_window=right,
                         kv_capacity=cap, bias=bias is not None,
                         seqlens_k=use_lens and not np.all(lens == cap),
                         head_sink=sink is not None, seqlens_q=padded,
                         kv_start=starts is not None)
    tensors: dict[str, np.ndarray] = {"q": q, "k": k, "v": v}
    if spec.seqlens_k:
        tensors["seqlens_k"] = lens.astype(np.int32)
        rules.append("per-batch valid lengths -> seqlens_k")
    if padded:
        tensors["seqlens_q"] = rows.astype(np.int32)
        rules.append("per-batch query row counts -> seqlens_q (padding rows are 0)")
    if starts is not None:
        tensors["kv_start"] = starts.astype(np.int32)
    if hv != h:
        rules.append(f"V head size {hv} != K head size {h} -> v_head_size")
    if bias is not None:
        tensors["bias"] = bias
    if sink is not None:
        tensors["head_sink"] = sink
    wanted = tuple(node.wants(i) for i in range(min(len(node.outputs), 3)))
    pk, pv = present if present is not None else (None, None)
    return spec, NodeRun(op, tensors, output_shape, wanted, pk, pv, tuple(rules), idle)
