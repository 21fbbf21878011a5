"""The torch peer: scaled_dot_product_attention on CUDA when available, else CPU."""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from ...reference import within_reach
from ...spec import AttentionSpec
from .status import torch_status

# attnreg's short names for the members of torch.nn.attention.SDPBackend, in the order tried.
BACKENDS: Mapping[str, str] = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION",
                               "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
BF16 = np.dtype(ml_dtypes.bfloat16)
# GQA strategies: torch's own enable_gqa=True, or K/V heads expanded once, outside the timed call.
GQA_STRATEGIES = ("enable", "repeat")


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


# How torch's CUDA warnings name each kernel ("cuDNN attention kernel not used because:").
_WARNING_NAMES = {"cudnn": "cudnn", "flash": "flash", "efficient": "memory efficient", "math": "math"}


def _why_failed(backend: str, exc: BaseException, caught: list[warnings.WarningMessage]) -> str:
    """A short reason why ``backend`` failed. On CUDA torch raises only a generic "No viable
    backend" and explains in warnings, one header per kernel ("<kernel> ... not used because:")
    followed by its reasons, other kernels' included; keep the reasons under this backend's."""
    groups: dict[str, list[str]] = {}
    head = ""
    for w in caught:
        msg = str(w.message).split(" (Triggered internally")[0].strip()
        if msg.endswith("not used because:"):
            head = msg.lower()
        elif msg:
            groups.setdefault(head, []).append(msg)
    said = next((m for h, m in groups.items() if h.startswith(_WARNING_NAMES[backend])), [])
    if not said:   # the exception's first sentence: what follows it is a generic hint
        said = [(str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0]]
    return "; ".join(dict.fromkeys(said))[:240]


# Calls captured back to back in the CUDA graph that each GPU-time sample replays (see _time).
GRAPH_CALLS = 20
# What the peer's times are, by device (describe()["timing"], the bench's label).
TIMING_CUDA = (f"GPU time per call: a CUDA graph of {GRAPH_CALLS} back-to-back calls replayed "
               f"between two CUDA events, / {GRAPH_CALLS}")
TIMING_CPU = "no CUDA graph on the CPU: host wall time per call (no GPU time)"


_ROOFS: dict[str, float] = {}


def copy_bandwidth(device: str, repeats: int = 5) -> float:
    """GB/s (bytes read + written) of a tensor copy on ``device`` (256 MiB on CUDA, timed by
    CUDA events; 64 MiB on the CPU, wall clock), median of ``repeats`` after one warm-up:
    the torch peer's copy roof, measured as attnreg's runtimes measure theirs. Cached."""
    if device not in _ROOFS:
        import torch

        cuda = device.startswith("cuda")
        n = (256 if cuda else 64) << 20
        src = torch.empty(n, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        secs = []
        for _ in range(repeats + 1):
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                dst.copy_(src)
                e1.record()
                e1.synchronize()
                secs.append(e0.elapsed_time(e1) * 1e-3)
            else:
                t0 = time.perf_counter()
                dst.copy_(src)
                secs.append(time.perf_counter() - t0)
        _ROOFS[device] = 2 * n / statistics.median(secs[1:]) / 1e9
    return _ROOFS[device]


class TorchSDPA:
    """torch.nn.functional.scaled_dot_product_attention on the spec's tensors.

    ``device``: "cuda", "cpu" or None (CUDA when available). ``backend``: one of
    :data:`BACKENDS` ("cudnn", "flash", "efficient", "math") pins that SDPA kernel through
    ``torch.nn.attention.sdpa_kernel``; "auto" tries each. ``gqa`` (only when num_heads >
    kv_num_heads): "enable" passes ``enable_gqa=True``, "repeat" expands K/V heads with
    repeat_interleave once, outside the timed call; "auto" tries both.

    On the first :meth:`load` every (backend, gqa) candidate runs once and is checked
    against the float64 reference at the contract tolerance; the correct ones are timed
    (``select_iters`` samples each, GPU time of a replayed CUDA graph on CUDA, wall on CPU)
    and the fastest is kept; a candidate whose calls cannot be captured in a CUDA graph is
    not timed ("no graph: ...").
    ``tried`` maps each candidate to "12.3 us", "error: ..." or "wrong: ..."; ``label``
    names the one kept, e.g. "torch-sdpa[cudnn]" or "torch-sdpa[flash,gqa=repeat]". When
    none works the peer raises RuntimeError("... unavailable ...") with the reasons.

    Masks: none for decode, whisper-style non-causal and fresh prefill (``is_causal=True``
    is right when S == L); a boolean bottom-right mask otherwise (past keys, seqlens_k,
    local_window, a non-causal right_window), built once.
    """

    name = "torch-sdpa"

    def __init__(self, spec: AttentionSpec, device: str | None = None, *, gqa: str = "auto",
                 backend: str = "auto", select_iters: int = 20) -> None:
        why = torch_supports(spec)
        if why:
            raise ValueError(f"{self.name} cannot run {spec.short()}: {why}")
        if gqa not in ("auto", *GQA_STRATEGIES):
            raise ValueError(f"gqa={gqa!r}: expected 'auto' or one of {GQA_STRATEGIES}")
        if backend not in ("auto", *BACKENDS):
            raise ValueError(f"backend={backend!r}: expected 'auto' or one of {tuple(BACKENDS)}")
        status = torch_status()
        if status:
            raise RuntimeError(f"{self.name} unavailable: {status}")
        import torch

        self.torch: Any = torch
        self.spec = spec
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.version = torch.__version__
        self.select_iters = select_iters
        self.backends = tuple(BACKENDS) if backend == "auto" else (backend,)
        # "" is the one strategy of a spec without grouped heads: nothing to choose.
        self.strategies = ("",) if spec.group_size == 1 else (
            GQA_STRATEGIES if gqa == "auto" else (gqa,))
        self.tried: dict[str, str] = {}
        self.backend: str | None = None          # the kept candidate, once selected
        self.gqa: str | None = None
        self._args: tuple[Any, ...] = ()
        self._kwargs: dict[str, Any] = {}

    @property
    def enable_gqa(self) -> bool:
        return self.gqa == "enable"

    @property
    def label(self) -> str:
        return self.name if self.backend is None else f"{self.name}[{self._key(self.backend, self.gqa)}]"

    @staticmethod
    def _key(backend: str, gqa: str | None) -> str:
        return backend + (",gqa=repeat" if gqa == "repeat" else "")

    def _kernel(self, backend: str) -> contextlib.AbstractContextManager[Any]:
        """The context that restricts SDPA to ``backend`` (entered outside timed loops)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, BACKENDS[backend]))

    def load(self, tensors: Mapping[str, Any],
             want: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Move the tensors to the device in [B, N, S|L, H] and build the mask (not timed).
        The first load also picks the backend; ``want`` is the float64 reference
        (testing.expected) for these tensors when the caller already has it."""
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
            x = np.ascontiguousarray(x)
            if x.dtype == BF16:         # torch has no numpy bfloat16: move the bits as int16
                return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).to(dev)
            return torch.from_numpy(x).to(dev)

        tq, tk, tv = put(q), put(k), put(v)
        S = spec.seq_len
        uniform = bool((lengths == L).all())
        kwargs: dict[str, Any] = {"scale": float(spec.effective_scale)}
        mask = None
        need_mask = (not uniform or spec.local_window > 0 or spec.bias
                     or (spec.right_window >= 0 and not spec.causal)
                     or (spec.causal and S > 1 and S != L))
        if need_mask:
            j = np.arange(L)[None, None, :]                          # [1, 1, L]
            i = np.arange(S)[None, :, None]                          # [1, S, 1]
            lb = lengths[:, None, None]                              # [B, 1, 1]
            p = lb - S + i                                           # [B, S, 1]
            vis4 = within_reach(spec, j < lb, j, p)[:, None]         # [B, 1, S, L]
            if spec.bias:
                bias = np.asarray(t["bias"], dtype=np.float32)[..., :L]
                fmask = np.where(vis4, bias, -np.inf).astype(spec.dtype)
                mask = put(fmask)
            else:
                mask = put(vis4)
            kwargs["attn_mask"] = mask
        elif spec.causal and S > 1:
            kwargs["is_causal"] = True                               # S == L: top-left == bottom-right

        def for_strategy(gqa: str | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
            if gqa == "repeat":
                g = spec.group_size
                return (tq, tk.repeat_interleave(g, dim=1).contiguous(),
                        tv.repeat_interleave(g, dim=1).contiguous()), kwargs
            return (tq, tk, tv), ({**kwargs, "enable_gqa": True} if gqa == "enable" else kwargs)

        if self.backend is None:
            from attnreg.testing import expected

            self._select(for_strategy, want if want is not None else expected(spec, t))
        else:
            self._args, self._kwargs = for_strategy(self.gqa)

    def _select(self, for_strategy: Callable[[str | None], tuple[tuple[Any, ...], dict[str, Any]]],
                want: tuple[np.ndarray, np.ndarray]) -> None:
        """Run each candidate once, keep the correct ones, time them, keep the fastest."""
        from attnreg.testing import compare

        self.tried = {}
        timed: dict[tuple[str, str], tuple[float, tuple[Any, ...], dict[str, Any]]] = {}
        basis = "gpu_s" if self.device.startswith("cuda") else "wall_s"
        for gqa in self.strategies:
            self._args, self._kwargs = for_strategy(gqa)
            for backend in self.backends:
                key = self._key(backend, gqa)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        out = self._output(backend)
                    except Exception as exc:   # unavailable here, or refuses these inputs
                        self.tried[key] = "error: " + _why_failed(backend, exc, caught)
                        continue
                _err, problem = compare(self.spec, out, want)
                if problem:
                    self.tried[key] = f"wrong: {problem}"
                    continue
                try:
                    us = statistics.median(self._time(backend, self.select_iters, 3)[basis]) * 1e6
                except Exception as exc:   # graph capture refused: no kernel time to compare
                    self.tried[key] = f"no graph: {str(exc).splitlines()[0][:160] if str(exc) else exc!r}"
                    continue
                self.tried[key] = f"{us:.1f} us"
                timed[backend, gqa] = (us, self._args, self._kwargs)
        self._args, self._kwargs = (), {}
        if not timed:
            reasons = "; ".join(f"{k}: {v}" for k, v in self.tried.items())
            raise RuntimeError(f"{self.name} unavailable for {self.spec.short()} on {self.device}: "
                               f"no backend ran correctly ({reasons})")
        (self.backend, self.gqa), (_, self._args, self._kwargs) = min(
            timed.items(), key=lambda kv: kv[1][0])

    def _call(self) -> Any:
        return self.torch.nn.functional.scaled_dot_product_attention(*self._args, **self._kwargs)

    def _output(self, backend: str) -> np.ndarray:
        """One call on ``backend``, as numpy in the spec's dtype and q layout."""
        with self.torch.no_grad(), self._kernel(backend):
            out = self._call()                                       # [B, Nq, S, H]
        o = out.detach().to("cpu")
        # bfloat16 back through its bits (torch's .numpy() refuses it); exact either way
        if o.dtype == self.torch.bfloat16:
            o = o.view(self.torch.int16).numpy().view(BF16)
        else:
            o = o.numpy()
        spec = self.spec
        o = o if spec.q_layout == "BNSH" else o.transpose(0, 2, 1, 3)
        return np.ascontiguousarray(o.astype(spec.dtype, copy=False))

    def run(self, tensors: Mapping[str, Any],
            want: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """The output for ``tensors`` (numpy, spec dtype, spec q layout) from the kept
        backend; ``want`` as in :meth:`load`."""
        self.load(tensors, want)
        assert self.backend is not None
        return self._output(self.backend)

    def timings(self, iters: int = 50, warmup: int = 5) -> dict[str, list[float]]:
        """Per-call seconds of the kept backend: wall_s (call + synchronize, one at a time)
        and on CUDA gpu_s (TIMING_CUDA: the kernels' time, no Python launch cost in it)."""
        if not self._args:
            from attnreg.testing import make_tensors

            self.load(make_tensors(self.spec, seed=0, poison=False))
        assert self.backend is not None
        return self._time(self.backend, iters, warmup)

    def _time(self, backend: str, iters: int, warmup: int) -> dict[str, list[float]]:
        torch = self.torch
        cuda = self.device.startswith("cuda")
        sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
        wall: list[float] = []
        with torch.no_grad(), self._kernel(backend):    # entered once: not part of a call's cost
            for _ in range(warmup):
                self._call()
            sync()
            for _ in range(iters):
                t0 = time.perf_counter()
                self._call()
                sync()
                wall.append(time.perf_counter() - t0)
            out: dict[str, list[float]] = {"wall_s": wall}
            if cuda:
                out["gpu_s"] = self._graph_times(iters)
        return out

    def _graph_times(self, iters: int) -> list[float]:
        """Seconds per call from a CUDA graph of GRAPH_CALLS back-to-back calls, replayed
        ``iters`` times between two events: the GPU time of the kernels alone. Timing Python
        launches between events instead measured the launches (cuDNN's decode L=8192: 44-57
        us that way, 12.1 us replayed)."""
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):          # capture needs warmed-up kernels (workspaces)
            for _ in range(3):
                self._call()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                self._call()
        graph.replay()                          # the first replay uploads the graph
        torch.cuda.synchronize()
        out = []
        for _ in range(iters):
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            graph.replay()
            e1.record()
            e1.synchronize()
            out.append(e0.elapsed_time(e1) * 1e-3 / GRAPH_CALLS)
        del graph
        return out

    def describe(self) -> dict[str, Any]:
        name = self.torch.cuda.get_device_name() if self.device.startswith("cuda") else "cpu"
        return {"peer": self.name, "version": self.version, "device": self.device,
                "device_name": name, "label": self.label, "backend": self.backend,
                "timing": TIMING_CUDA if self.device.startswith("cuda") else TIMING_CPU,
                "copy_gb_s": copy_bandwidth(self.device),
                "enable_gqa": self.enable_gqa, "tried": dict(self.tried),
                "mask": "attn_mask" in self._kwargs, "is_causal": bool(self._kwargs.get("is_causal"))}

    def close(self) -> None:
        self._args = ()
        self._kwargs = {}
