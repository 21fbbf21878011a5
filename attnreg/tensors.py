"""Checks the tensors handed to run() against the spec, before any kernel sees them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .device_tensor import DeviceTensor
from .errors import SpecError, short
from .spec import AttentionSpec

REQUIRED = ("q", "k", "v")
OPTIONAL = {"bias": "bias", "seqlens_k": "seqlens_k", "head_sink": "head_sink",
            "block_table": "kv_layout", "k_scale": "kv_dtype", "v_scale": "kv_dtype",
            "kv_start": "kv_start", "seqlens_q": "seqlens_q"}


def _wants(spec: AttentionSpec, name: str) -> bool:
    return spec.kv_layout == "paged" if name == "block_table" else bool(getattr(spec, OPTIONAL[name]))


def _is_device(value: Any) -> bool:
    return isinstance(value, DeviceTensor)


def _as_array(name: str, value: Any) -> Any:
    """A numpy view of any CPU array: numpy itself, DLPack exporters (torch CPU tensors,
    jax, cupy-on-host ...) and __array__ objects, without a copy where the source allows."""
    if isinstance(value, np.ndarray) or _is_device(value):
        return value
    if hasattr(value, "__dlpack__"):
        try:
            return np.from_dlpack(value)
        except (BufferError, TypeError, RuntimeError, ValueError) as exc:
            arr = _bf16_view(value)          # numpy's DLPack has no bfloat16: view the bits
            if arr is not None:
                return arr
            if not hasattr(value, "__array__"):
                raise SpecError(f"tensors[{name!r}]", value, "a CPU array numpy can read "
                                f"through DLPack ({exc})") from None
    if hasattr(value, "__array__") and hasattr(value, "dtype") and hasattr(value, "shape"):
        try:
            return np.asarray(value)
        except Exception as exc:                 # e.g. a GPU tensor refusing __array__
            raise SpecError(f"tensors[{name!r}]", value, f"a CPU array ({exc})") from None
    raise SpecError(f"tensors[{name!r}]", value,
                    "a numpy array (or a CPU array with __dlpack__ or __array__)")


def _bf16_view(value: Any) -> np.ndarray | None:
    """A torch bfloat16 CPU tensor as an ml_dtypes.bfloat16 array over the same memory."""
    if str(getattr(value, "dtype", "")) != "torch.bfloat16" or not hasattr(value, "view"):
        return None
    # only reached for a torch tensor, so torch is importable
    import torch

    try:
        return np.from_dlpack(value.view(torch.int16)).view(_DTYPE_OBJ["bfloat16"])
    except (BufferError, TypeError, RuntimeError, ValueError):
        return None


_DTYPE_OBJ = {n: np.dtype(n) for n in ("float32", "float16", "bfloat16", "int32", "int64",
                                       "int8", "uint8")}
INT32_MAX = 2**31 - 1

# The float tensors a caller may store in more than one dtype (docs/contract.md "Tensors": bias
# and head_sink float32 or the spec's dtype), "dtype" standing for spec.dtype. Every runtime reads
# each of these as accepted (a bias reaches the runtimes as stored; a head_sink, [Nq] values, is
# widened to float32 by check_tensors and check_partials, exactly), and the conformance matrix
# stores each in every dtype listed here (attnreg.tools.cases): a dtype added here gets cells, and
# a kernel that misreads it fails them. The first entry is what testing.make_tensors stores.
STORED_AS: dict[str, tuple[str, ...]] = {"bias": ("float32", "dtype"),
                                         "head_sink": ("float32", "dtype")}


def accepted_dtypes(spec: AttentionSpec, name: str) -> tuple[str, ...]:
    """The dtypes the checks accept for tensor ``name`` (one of STORED_AS) under spec."""
    return tuple(dict.fromkeys(spec.dtype if d == "dtype" else d for d in STORED_AS[name]))


def _check_dtype(name: str, arr: Any, allowed: tuple[str, ...]) -> None:
    # dtype objects compare fast; dtype.name builds a string on every call (hot in a decode loop)
    if not any(arr.dtype == _DTYPE_OBJ.get(a, a) for a in allowed):
        raise SpecError(f"tensors[{name!r}].dtype", arr.dtype.name,
                        " or ".join(allowed) + " (attnreg never casts inputs silently)")


def _check_shape(name: str, arr: Any, shape: tuple[int, ...], how: str) -> None:
    if tuple(arr.shape) != tuple(shape):
        raise SpecError(f"tensors[{name!r}].shape", tuple(arr.shape), f"{tuple(shape)} ({how})")


def bias_shape_ok(spec: AttentionSpec, shape: tuple[int, ...]) -> bool:
    full = (spec.batch, spec.num_heads, spec.seq_len, spec.capacity)
    return len(shape) == 4 and shape[3] == full[3] and all(
        s in (1, f) for s, f in zip(shape[:3], full[:3]))


def check_tensors(spec: AttentionSpec, tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Validate names, dtypes, shapes and ranges; return C-contiguous numpy arrays
    (DeviceTensors pass through after the same checks on their metadata).

    Non-contiguous or Fortran-ordered inputs are accepted by copying (values unchanged).
    """
    wanted = _check_names(spec, tensors)
    arrays = {n: _as_array(n, tensors[n]) for n in wanted}
    _check_qkv(spec, arrays)
    if spec.bias:
        _check_bias(spec, arrays["bias"])
    if spec.seqlens_k:
        _check_seqlens_k(spec, arrays)
    lengths = valid_lengths(spec, arrays)
    if spec.seqlens_q:
        _check_index("seqlens_q", arrays, spec.batch, 1,
                     np.minimum(spec.seq_len, lengths), "the number of query rows of batch b: "
                     f"1 <= value <= min(seq_len={spec.seq_len}, L_b)")
    if spec.kv_start:
        _check_index("kv_start", arrays, spec.batch, 0, lengths - 1,
                     "the first existing key of batch b: 0 <= value < L_b")
    if spec.head_sink:
        _check_sink(spec, arrays)
    if spec.kv_layout == "paged":
        _check_block_table(spec, arrays)
    return {n: a if _is_device(a) else np.ascontiguousarray(a) for n, a in arrays.items()}


def _check_names(spec: AttentionSpec, tensors: Any) -> set[str]:
    """The tensor names ``spec`` wants, each present in ``tensors`` and nothing else there."""
    if not isinstance(tensors, Mapping):
        raise SpecError("tensors", tensors, "a mapping such as {'q': q, 'k': k, 'v': v}")
    wanted = set(REQUIRED) | {n for n in OPTIONAL if _wants(spec, n)}
    for name in REQUIRED:
        if name not in tensors:
            raise SpecError(f"tensors[{name!r}]", None, "a tensor (q, k and v are required)")
    for name in tensors:
        if name not in wanted:
            why = (f"no such tensor; known: {sorted(set(REQUIRED) | set(OPTIONAL))}"
                   if name not in OPTIONAL else
                   "absent because spec.kv_layout is not 'paged'" if name == "block_table" else
                   "absent because spec.kv_dtype is None" if OPTIONAL[name] == "kv_dtype" else
                   f"absent because spec.{OPTIONAL[name]} is False")
            raise SpecError(f"tensors[{short(name)}]", tensors[name], why)
    for name in wanted:
        if name not in tensors:
            raise SpecError(f"tensors[{name!r}]", None, "a tensor, because spec.kv_layout is 'paged'"
                            if name == "block_table" else
                            f"a tensor, because spec.kv_dtype is {spec.kv_dtype!r}"
                            if OPTIONAL[name] == "kv_dtype" else
                            f"a tensor, because spec.{OPTIONAL[name]} is True")
    return wanted


def _check_qkv(spec: AttentionSpec, arrays: Mapping[str, Any]) -> None:
    """q, k and v (and a quantized cache's scales): dtypes and shapes of the spec's layouts."""
    layout_q = f"q_layout={spec.q_layout}"
    layout_kv = ("kv_layout=paged: [num_pages, page_size, Nkv, H]" if spec.kv_layout == "paged"
                 else f"kv_layout={spec.kv_layout}, capacity C={spec.capacity}")
    _check_dtype("q", arrays["q"], (spec.dtype,))
    _check_shape("q", arrays["q"], spec.q_shape, layout_q)
    for name, shape in (("k", spec.kv_code_shape), ("v", spec.v_code_shape)):
        _check_dtype(name, arrays[name], (spec.kv_code_dtype,))
        hv = "" if name == "k" or spec.head_size_v == spec.head_size else \
            f"; last dimension v_head_size={spec.head_size_v}"
        _check_shape(name, arrays[name], shape, layout_kv + hv
                     + ("" if spec.kv_dtype != "int4" else "; int4: H/2 bytes of packed codes"))
    if spec.kv_dtype is not None:
        for name, shape in (("k_scale", spec.kv_scale_shape), ("v_scale", spec.v_scale_shape)):
            # NaN/inf scales are allowed: they make the dequantized values non-finite, which
            # docs/contract.md "Non-finite values and scalar fields" then governs like any
            # non-finite k or v.
            _check_dtype(name, arrays[name], (spec.kv_scale_dtype,))
            _check_shape(name, arrays[name], shape,
                         f"kv_dtype={spec.kv_dtype}: " + ("one scale per vector" if
                         spec.kv_dtype == "int8" else "one scale per 32 elements"))


def _check_bias(spec: AttentionSpec, bias: Any) -> None:
    """The bias's dtype and its shape, broadcastable to [B, Nq, S, C]. NaN/inf are allowed:
    docs/contract.md "Non-finite values and scalar fields" fixes what they do (-inf masks)."""
    _check_dtype("bias", bias, accepted_dtypes(spec, "bias"))
    if not bias_shape_ok(spec, tuple(bias.shape)):
        full = (spec.batch, spec.num_heads, spec.seq_len, spec.capacity)
        raise SpecError("tensors['bias'].shape", tuple(bias.shape),
                        f"4 dims broadcastable to [B, Nq, S, C] = {full} "
                        "(B, Nq, S may each be 1; C must be full)")


def _check_seqlens_k(spec: AttentionSpec, arrays: dict[str, Any]) -> None:
    """seqlens_k: int32 (int64 on the host, narrowed), one length a batch entry in
    [S, C] ([1, C] with seqlens_q, whose L_b >= S_b is checked with it)."""
    sk = arrays["seqlens_k"]
    _check_dtype("seqlens_k", sk, ("int32",) if _is_device(sk) else ("int32", "int64"))
    _check_shape("seqlens_k", sk, (spec.batch,), "one valid length per batch entry")
    if _is_device(sk):
        # Range-check device lengths through their host mirror, or one small read.
        sk = sk.host if sk.host is not None else sk.numpy()
    low = 1 if spec.seqlens_q else spec.seq_len
    bad = (sk < low) | (sk > spec.capacity)
    if bad.any():
        i = int(np.argmax(bad))
        raise SpecError(f"tensors['seqlens_k'][{i}]", int(sk[i]),
                        f"an integer with {'1' if spec.seqlens_q else f'seq_len={low}'}"
                        f" <= value <= capacity={spec.capacity}")
    arrays["seqlens_k"] = _narrow(arrays["seqlens_k"])


def _check_sink(spec: AttentionSpec, arrays: dict[str, Any]) -> None:
    """head_sink: one finite logit a query head, widened to the float32 the kernels read (a
    DeviceTensor's again by a prepared run once it is written: PreparedRun)."""
    sink = arrays["head_sink"]
    _check_dtype("head_sink", sink, accepted_dtypes(spec, "head_sink"))
    _check_shape("head_sink", sink, (spec.num_heads,), "one sink logit per query head")
    values = host_sink(sink)
    if sink.dtype != _DTYPE_OBJ["float32"]:
        arrays["head_sink"] = values


def host_sink(sink: Any) -> np.ndarray:
    """A head_sink's values as float32 on the host (float16 / bfloat16 -> float32 is exact),
    checked finite (docs/contract.md "Non-finite values and scalar fields")."""
    if _is_device(sink):
        sink = sink.host if sink.host is not None else sink.numpy()
    if not np.isfinite(sink).all():
        i = int(np.argmax(~np.isfinite(sink)))
        raise SpecError(f"tensors['head_sink'][{i}]", float(sink[i]),
                        "a finite logit (docs/contract.md: head_sink values must be finite)")
    return np.asarray(sink, dtype=np.float32)


def read_on_host(tensors: Mapping[str, Any], checked: Mapping[str, Any]) -> dict[str, Any]:
    """The DeviceTensors among ``tensors`` that check_tensors replaced by host arrays: a
    float16 / bfloat16 head_sink (host_sink widens it), the only one."""
    sink = tensors.get("head_sink")
    return {"head_sink": sink} if _is_device(sink) and not _is_device(checked.get("head_sink")) \
        else {}


def _check_block_table(spec: AttentionSpec, arrays: dict[str, Any]) -> None:
    """Pages that hold valid keys must exist; entries past a sequence's length are ignored
    (they may be -1), so a table can be reused while sequences grow."""
    bt = arrays["block_table"]
    _check_dtype("block_table", bt, ("int32",) if _is_device(bt) else ("int32", "int64"))
    _check_shape("block_table", bt, spec.block_table_shape,
                 f"[B, ceil(C / page_size)] = [{spec.batch}, {spec.pages_per_seq}]")
    if _is_device(bt):
        bt = bt.host if bt.host is not None else bt.numpy()
    lengths = valid_lengths(spec, arrays)
    assert spec.page_size is not None and spec.num_pages is not None
    used = -(-lengths // spec.page_size)
    for b in range(spec.batch):
        row = bt[b, : used[b]]
        bad = (row < 0) | (row >= spec.num_pages)
        if bad.any():
            p = int(np.argmax(bad))
            raise SpecError(f"tensors['block_table'][{b}, {p}]", int(row[p]),
                            f"a page index in [0, num_pages={spec.num_pages}) (page {p} holds "
                            f"keys of batch {b}, whose length is {int(lengths[b])})")
    if bt.dtype == _DTYPE_OBJ["int64"]:
        # entries past a sequence's length are ignored, but an int64 one that int32 cannot
        # hold would change on narrowing: refused rather than wrapped
        big = (bt < -INT32_MAX - 1) | (bt > INT32_MAX)
        if big.any():
            b, p = (int(x) for x in np.argwhere(big)[0])
            raise SpecError(f"tensors['block_table'][{b}, {p}]", int(bt[b, p]),
                            "a value int32 can hold (int64 tables are narrowed for the kernels)")
        arrays["block_table"] = bt.astype(np.int32)


def _check_index(name: str, arrays: dict[str, Any], batch: int, lo: int, hi: np.ndarray,
                 what: str) -> None:
    """A [B] int32/int64 tensor with lo <= value[b] <= hi[b] (narrowed to int32)."""
    x = arrays[name]
    _check_dtype(name, x, ("int32",) if _is_device(x) else ("int32", "int64"))
    _check_shape(name, x, (batch,), "one value per batch entry")
    if _is_device(x):
        x = x.host if x.host is not None else x.numpy()
    bad = (x < lo) | (x > hi)
    if bad.any():
        i = int(np.argmax(bad))
        raise SpecError(f"tensors[{name!r}][{i}]", int(x[i]),
                        f"{what} (here {lo} <= value <= {int(hi[i])})")
    arrays[name] = _narrow(arrays[name])


def _narrow(arr: Any) -> Any:
    """An int64 index tensor as the kernels' int32 (its values were range-checked)."""
    return arr.astype(np.int32) if not _is_device(arr) and arr.dtype == _DTYPE_OBJ["int64"] \
        else arr


def split_device_inputs(tensors: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(host arrays, device tensors)."""
    host = {n: a for n, a in tensors.items() if not _is_device(a)}
    return host, {n: a for n, a in tensors.items() if _is_device(a)}


def valid_lengths(spec: AttentionSpec, tensors: Mapping[str, Any]) -> np.ndarray:
    """L_b for every batch entry, as int64."""
    if spec.seqlens_k:
        return _host_ints(tensors["seqlens_k"])
    return np.full(spec.batch, spec.total_len, dtype=np.int64)


def _host_ints(x: Any) -> np.ndarray:
    if _is_device(x):
        x = x.host if x.host is not None else x.numpy()
    return np.asarray(x, dtype=np.int64)


def kv_starts(spec: AttentionSpec, tensors: Mapping[str, Any]) -> np.ndarray:
    """kv_start[b] (the first existing key) for every batch entry, as int64 (0 without)."""
    if spec.kv_start:
        return _host_ints(tensors["kv_start"])
    return np.zeros(spec.batch, dtype=np.int64)


def q_lengths(spec: AttentionSpec, tensors: Mapping[str, Any]) -> np.ndarray:
    """S_b (query rows of batch b) for every batch entry, as int64 (seq_len without)."""
    if spec.seqlens_q:
        return _host_ints(tensors["seqlens_q"])
    return np.full(spec.batch, spec.seq_len, dtype=np.int64)
