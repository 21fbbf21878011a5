"""The torch peer: scaled_dot_product_attention on CUDA when available, else CPU."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ...spec import AttentionSpec
from .status import torch_status


def torch_supports(spec: AttentionSpec) -> str | None:
    """None if the torch peer can express ``spec`` exactly, else why not."""
    if spec.softcap > 0:
        return "softcap: scaled_dot_product_attention has no logit soft-capping"
    if spec.alibi_max_bias > 0:
        return "alibi: not mapped by this peer"
    if spec.head_sink:
        return "head_sink: scaled_dot_product_attention has no sink logit"
    if spec.return_lse:
        return "return_lse: scaled_dot_product_attention does not return the log-sum-exp"
    return None


def _has_enable_gqa(torch: Any) -> bool:
    import inspect

    try:
        return "enable_gqa" in inspect.signature(torch.nn.functional.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):   # a builtin without a signature: ask by version
        major, minor = (int(x) for x in torch.__version__.split(".")[:2])
        return (major, minor) >= (2, 5)


class TorchSDPA:
    """torch.nn.functional.scaled_dot_product_attention on the spec's tensors.

    ``device``: "cuda", "cpu" or None (CUDA when available). ``gqa``: "auto" uses
    ``enable_gqa=True`` where torch has it, "repeat" expands K/V heads with
    repeat_interleave once, outside the timed call. Masks: none for decode, whisper-style
    non-causal and fresh prefill (``is_causal=True`` is right when S == L); a boolean
    bottom-right mask otherwise (past keys, seqlens_k, local_window), built once.
    """

    name = "torch-sdpa"

    def __init__(self, spec: AttentionSpec, device: str | None = None, *, gqa: str = "auto") -> None:
        why = torch_supports(spec)
        if why:
            raise ValueError(f"{self.name} cannot run {spec.short()}: {why}")
        status = torch_status()
        if status:
            raise RuntimeError(f"{self.name} unavailable: {status}")
        if gqa not in ("auto", "repeat"):
            raise ValueError(f"gqa={gqa!r}: expected 'auto' or 'repeat'")
        import torch

        self.torch = torch
        self.spec = spec
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.version = torch.__version__
        self.enable_gqa = gqa == "auto" and spec.group_size > 1 and _has_enable_gqa(torch)
        self._args: tuple[Any, ...] = ()
        self._kwargs: dict[str, Any] = {}

    def load(self, tensors: Mapping[str, Any]) -> None:
        """Move the tensors to the device in [B, N, S|L, H] and build the mask (not timed)."""
        from ...tensors import check_tensors, valid_lengths

        torch, spec = self.torch, self.spec
        t = check_tensors(spec, tensors)
        q = t["q"] if spec.q_layout == "BNSH" else t["q"].transpose(0, 2, 1, 3)   # [B,Nq,S,H]
        k = t["k"] if spec.kv_layout == "BNSH" else t["k"].transpose(0, 2, 1, 3)  # [B,Nkv,C,H]
        v = t["v"] if spec.kv_layout == "BNSH" else t["v"].transpose(0, 2, 1, 3)
        lengths = valid_lengths(spec, t)
        L = int(lengths.max())
        k, v = k[:, :, :L], v[:, :, :L]     # keys past every batch's length never exist
        dev = self.device

        def put(x: np.ndarray) -> Any:
            return torch.from_numpy(np.ascontiguousarray(x)).to(dev)

        tq, tk, tv = put(q), put(k), put(v)
        if spec.group_size > 1 and not self.enable_gqa:
            tk = tk.repeat_interleave(spec.group_size, dim=1).contiguous()
            tv = tv.repeat_interleave(spec.group_size, dim=1).contiguous()
        S = spec.seq_len
        uniform = bool((lengths == L).all())
        kwargs: dict[str, Any] = {"scale": float(spec.effective_scale)}
        if self.enable_gqa:
            kwargs["enable_gqa"] = True
        mask = None
        need_mask = (not uniform or spec.local_window > 0 or spec.bias
                     or (spec.causal and S > 1 and S != L))
        if need_mask:
            j = np.arange(L)[None, None, :]                          # [1, 1, L]
            i = np.arange(S)[None, :, None]                          # [1, S, 1]
            lb = lengths[:, None, None]                              # [B, 1, 1]
            p = lb - S + i                                           # [B, S, 1]
            vis = j < lb
            if spec.causal:
                vis = vis & (j <= p)
            if spec.local_window > 0:
                vis = vis & (j > p - spec.local_window)
            vis4 = vis[:, None]                                      # [B, 1, S, L]
            if spec.bias:
                bias = np.asarray(t["bias"], dtype=np.float32)[..., :L]
                fmask = np.where(vis4, bias, -np.inf).astype(spec.dtype)
                mask = put(fmask)
            else:
                mask = put(vis4)
            kwargs["attn_mask"] = mask
        elif spec.causal and S > 1:
            kwargs["is_causal"] = True                               # S == L: top-left == bottom-right
        self._args = (tq, tk, tv)
        self._kwargs = kwargs

    def _call(self) -> Any:
        return self.torch.nn.functional.scaled_dot_product_attention(*self._args, **self._kwargs)

    def run(self, tensors: Mapping[str, Any]) -> np.ndarray:
        """The output for ``tensors`` (numpy, spec dtype, spec q layout)."""
        self.load(tensors)
        with self.torch.no_grad():
            out = self._call()                                       # [B, Nq, S, H]
        o = out.detach().to("cpu").numpy()
        spec = self.spec
        o = o if spec.q_layout == "BNSH" else o.transpose(0, 2, 1, 3)
        return np.ascontiguousarray(o.astype(spec.dtype, copy=False))

    def timings(self, iters: int = 50, warmup: int = 5) -> dict[str, list[float]]:
        """Per-call seconds: wall_s (call + synchronize), and gpu_s from CUDA events on CUDA."""
        torch = self.torch
        if not self._args:
            from ..testing import make_tensors

            self.load(make_tensors(self.spec, seed=0, poison=False))
        cuda = self.device.startswith("cuda")
        sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
        wall: list[float] = []
        gpu: list[float] = []
        with torch.no_grad():
            for _ in range(warmup):
                self._call()
            sync()
            for _ in range(iters):
                if cuda:
                    e0 = torch.cuda.Event(enable_timing=True)
                    e1 = torch.cuda.Event(enable_timing=True)
                    t0 = time.perf_counter()
                    e0.record()
                    self._call()
                    e1.record()
                    e1.synchronize()
                    wall.append(time.perf_counter() - t0)
                    gpu.append(e0.elapsed_time(e1) * 1e-3)
                else:
                    t0 = time.perf_counter()
                    self._call()
                    wall.append(time.perf_counter() - t0)
        out: dict[str, list[float]] = {"wall_s": wall}
        if cuda:
            out["gpu_s"] = gpu
        return out

    def describe(self) -> dict[str, Any]:
        name = self.torch.cuda.get_device_name() if self.device.startswith("cuda") else "cpu"
        return {"peer": self.name, "version": self.version, "device": self.device,
                "device_name": name, "enable_gqa": self.enable_gqa,
                "mask": "attn_mask" in self._kwargs, "is_causal": bool(self._kwargs.get("is_causal"))}

    def close(self) -> None:
        self._args = ()
        self._kwargs = {}
