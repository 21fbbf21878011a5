"""The attention function registered in transformers' AttentionInterface (see
attnreg.integrations.transformers for the mapping rules and what is refused)."""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

import attnreg
from attnreg.errors import SpecError

from .hf_masks import ATTR, MaskInfo, capacity, to_numpy, user_mask, version

_BF16 = np.dtype(ml_dtypes.bfloat16)
_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}
_LOCAL = threading.local()


@dataclass
class Binding:
    """One registered name: its backend, flags, KV bucket, lazily opened Session and specs."""

    name: str
    backend: str | None
    flags: dict[str, Any]
    kv_bucket: int
    _session: attnreg.Session | None = None
    _specs: dict[tuple[Any, ...], attnreg.AttentionSpec] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def session(self) -> attnreg.Session:
        with self._lock:
            if self._session is None or self._session.closed:
                self._session = attnreg.Session(backend=self.backend, flags=self.flags)
            return self._session

    def spec(self, **fields: Any) -> attnreg.AttentionSpec:
        """AttentionSpec(**fields), built once per distinct fields (a decode loop)."""
        key = tuple(fields.values())
        got = self._specs.get(key)
        if got is None:
            got = attnreg.AttentionSpec(**fields)
            with self._lock:
                if len(self._specs) > 512:
                    self._specs.clear()
                self._specs[key] = got
        return got

    def close(self) -> None:
        with self._lock:
            if self._session is not None:
                self._session.close()
                self._session = None


def make_attention(binding: Binding) -> Any:
    """The function for AttentionInterface: (module, query, key, value, attention_mask, ...)
    -> (out [B, S, Nq, H], None)."""

    def attnreg_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                          dropout: float = 0.0, scaling: float | None = None,
                          sliding_window: int | None = None, softcap: float | None = None,
                          s_aux: Any = None, **kwargs: Any) -> tuple[Any, None]:
        import torch

        _refuse(dropout, kwargs)
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise SpecError("query", tuple(query.shape), "query, key, value of 4 dims "
                            "[B, N, S, H] (BNSH)")
        b, nq, s, h = (int(x) for x in query.shape)
        bk, _, lk, hk = (int(x) for x in key.shape)
        if tuple(value.shape[:3]) != tuple(key.shape[:3]):
            raise SpecError("value.shape", tuple(value.shape), f"the key's shape "
                            f"{tuple(key.shape[:3])} in its first 3 dims (the head size may "
                            "differ: v_head_size)")
        if bk != b or hk != h:
            raise SpecError("key.shape", tuple(key.shape), f"[B={b}, Nkv, L, H={h}] like the query")
        if lk < s:
            raise SpecError("key.shape", tuple(key.shape), f"at least S={s} keys (attnreg's queries "
                            "are the last S of the keys; cross-attention with fewer keys is not read)")
        dtype = _DTYPES.get(str(query.dtype))
        if dtype is None or key.dtype != query.dtype or value.dtype != query.dtype:
            raise SpecError("query.dtype", str(query.dtype), "float32, float16 or bfloat16, the "
                            f"same for key ({key.dtype}) and value ({value.dtype})")
        for n, t in (("query", query), ("key", key), ("value", value)):
            if t.device.type != "cpu":
                raise SpecError(f"{n}.device", str(t.device), "a CPU tensor (attnreg reads torch "
                                "CPU tensors; GPU work happens on attnreg's own device)")
        info = _mask_info(torch, module, attention_mask, b, nq, s, lk, np.dtype(dtype), kwargs,
                          binding.kv_bucket)
        args = (binding, info, dtype, scaling, softcap, s_aux)
        if torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (query, key, value, s_aux)):
            return _no_grad_function().apply(query, key, value, args), None
        return _run(torch, query, key, value, *args), None

    attnreg_attention.__qualname__ = f"attnreg_attention[{binding.name}]"
    return attnreg_attention


def _refuse(dropout: Any, kwargs: Mapping[str, Any]) -> None:
    if dropout:
        raise SpecError("dropout", dropout, "0 (attnreg has no attention dropout; call "
                        "model.eval() or set attention_dropout=0)")
    if kwargs.get("output_attentions") or _collecting_attentions():
        raise SpecError("output_attentions", True, "False: attnreg never materialises the "
                        "attention weights (use attn_implementation='eager' for them)")
    for name in ("position_bias", "head_mask"):
        if kwargs.get(name) is not None:
            raise SpecError(name, kwargs[name], "None (not read by attnreg's transformers "
                            "adapter)")


def _collecting_attentions() -> bool:
    """Whether transformers' output capture is collecting attention weights now (requested
    by output_attentions=True or config.output_attentions)."""
    try:
        from transformers.utils.output_capturing import _active_collector
        got = _active_collector.get()
    except Exception:                    # a changed internal: assume nothing is collected
        return False
    return isinstance(got, dict) and "attentions" in got


def _mask_info(torch: Any, module: Any, mask: Any, b: int, nq: int, s: int, lk: int,
               dtype: np.dtype, kwargs: Mapping[str, Any], bucket: int) -> MaskInfo:
    if mask is None:
        causal = kwargs.get("is_causal")
        if causal is None:
            causal = bool(getattr(module, "is_causal", True))
        if causal and 1 < s < lk:
            raise SpecError("attention_mask", None, f"a mask when a causal call has S={s} queries "
                            f"and L={lk} > S keys (eager would attend every key, sdpa aligns "
                            "top-left; register() installs a mask function that supplies one)")
        return MaskInfo(s, lk, capacity(s, lk, lk, bucket), bool(causal) and s > 1, lk, -1, None,
                        None)
    got = getattr(mask, ATTR, None)
    if got is not None and got[1] == version(mask):
        info: MaskInfo = got[0]
        if info.kv_len != lk or info.seq_len != s or int(mask.shape[0]) != b:
            raise SpecError("attention_mask.shape", tuple(mask.shape), f"[B={b}, 1, S={s}, L={lk}]"
                            " for this layer's query and key")
        return info
    return user_mask(torch, mask, b, nq, s, lk, dtype, bucket)


def _layout(t: Any) -> tuple[str, Any]:
    """('BSNH', [B, S, N, H] view) when t [B, N, S, H] is a transposed contiguous tensor
    (the usual projection output), else ('BNSH', t)."""
    tt = t.transpose(1, 2)
    if tt.is_contiguous() and not t.is_contiguous():
        return "BSNH", tt
    return "BNSH", t


def _padded(which: str, src: np.ndarray, cap: int) -> np.ndarray:
    """src [B, N, L, H] copied into a reused zeroed buffer [B, N, cap, H] (one per thread;
    keys past L keep finite stale values that seqlens_k hides)."""
    bufs = getattr(_LOCAL, "bufs", None)
    if bufs is None:
        bufs = _LOCAL.bufs = {}
    b, n, lk, h = src.shape
    key = (which, b, n, cap, h, src.dtype)
    buf = bufs.get(key)
    if buf is None:
        if len(bufs) > 16:
            bufs.clear()
        buf = bufs[key] = np.zeros((b, n, cap, h), src.dtype)
    buf[:, :, :lk] = src
    return buf


def _to_torch(torch: Any, a: np.ndarray) -> Any:
    if a.dtype == _BF16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _run(torch: Any, query: Any, key: Any, value: Any, binding: Binding, info: MaskInfo,
         dtype: str, scaling: float | None, softcap: float | None, s_aux: Any) -> Any:
    b, nq, s, h = (int(x) for x in query.shape)
    nkv, lk, hv = int(key.shape[1]), int(key.shape[2]), int(value.shape[3])
    q_layout, q = _layout(query)
    cap = info.capacity
    if cap != lk:
        k = _padded("k", to_numpy(torch, key), cap)
        v = _padded("v", to_numpy(torch, value), cap)
        kv_layout = "BNSH"
    else:
        kv_layout, k = _layout(key)
        v_layout, v = _layout(value)
        if v_layout != kv_layout:
            v = value.transpose(1, 2) if kv_layout == "BSNH" else value
        k, v = to_numpy(torch, k), to_numpy(torch, v)
    tensors: dict[str, Any] = {"q": to_numpy(torch, q), "k": k, "v": v}
    seqlens = info.valid < cap
    if seqlens:
        tensors["seqlens_k"] = np.full(b, info.valid, np.int32)
    if info.bias is not None:
        tensors["bias"] = info.bias
    if info.start is not None:
        tensors["kv_start"] = info.start
    if s_aux is not None:
        if tuple(s_aux.shape) != (nq,):
            raise SpecError("s_aux.shape", tuple(s_aux.shape), f"[Nq={nq}] (one sink logit per "
                            "query head)")
        tensors["head_sink"] = to_numpy(torch, s_aux)
    scale = None if scaling is None else float(scaling)
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise SpecError("scaling", scaling, "None or a finite float > 0")
    spec = binding.spec(
        batch=b, seq_len=s, past_len=cap - s, num_heads=nq, kv_num_heads=nkv, head_size=h,
        dtype=dtype, q_layout=q_layout, kv_layout=kv_layout, causal=info.causal, scale=scale,
        softcap=float(softcap or 0.0), local_window=info.window, bias=info.bias is not None,
        seqlens_k=seqlens, head_sink=s_aux is not None, kv_start=info.start is not None,
        v_head_size=hv if hv != h else None)
    out = binding.session.run(spec, tensors)
    t = _to_torch(torch, out)
    return t if q_layout == "BSNH" else t.transpose(1, 2).contiguous()


_FUNCTION: list[Any] = []


def _no_grad_function() -> Any:
    """An autograd.Function running attnreg forward whose backward refuses: where autograd
    needs a gradient it gets a SpecError, never a silent zero."""
    if not _FUNCTION:
        import torch

        class AttnregNoGrad(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, query: Any, key: Any, value: Any, args: tuple[Any, ...]) -> Any:
                return _run(torch, query, key, value, *args)

            @staticmethod
            def backward(ctx: Any, *grads: Any) -> Any:
                raise SpecError("backward", "attnreg attention", "no gradient through attnreg "
                                "(inference only): train with attn_implementation='eager' or "
                                "'sdpa'")

        _FUNCTION.append(AttnregNoGrad)
    return _FUNCTION[0]
