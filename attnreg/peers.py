"""Comparison peers for `attnreg bench`: what users would run instead of attnreg.

Two optional peers, each computing the same contract math (CONTRACT.md) for an
:class:`attnreg.AttentionSpec`, timed the way a real decode loop pays for it:

* :class:`OrtWebGPUAttention` -- ONNX Runtime's WebGPU execution provider (package
  ``onnxruntime-webgpu``, Dawn inside) running a one-node ``com.microsoft`` model:
  ``GroupQueryAttention`` for causal specs (static KV cache in ORT's shared past/present
  buffer mode, so the cache is never copied) and ``MultiHeadAttention`` with BNSH key/value
  (ORT's cross-attention form) for non-causal ones. Inputs, the KV cache and the output are
  bound once as WebGPU-device OrtValues through IO binding; a timed call is
  ``run_with_iobinding`` plus the smallest read-back that waits for the GPU (ORT's own
  ``synchronize_outputs`` returns before the GPU work ends on this EP).
* :class:`TorchSDPA` -- ``torch.nn.functional.scaled_dot_product_attention`` on CUDA when
  available, else CPU; GPU time from CUDA events.

Nothing here is imported at module import time beyond numpy and the standard library:
``onnxruntime``, ``onnx`` and ``torch`` are imported inside functions, and each peer says
why it is unusable through :func:`ort_webgpu_status` / :func:`torch_status` (``None`` when
usable) instead of raising.

Lavapipe: Dawn refuses Debian 12's Mesa 22.3 lavapipe. ``ci/bench_peers.sh`` builds a
pass-through Vulkan ICD (``../shared/tools/lvp-dawn-shim``) into ``.peers/``; when it is
built, no Vulkan variable is set by the user and no hardware GPU node exists, this module
points ``VK_ICD_FILENAMES`` at it before the first ORT WebGPU session. That is safe for
wgpu-py in the same process, before or after wgpu made its own Vulkan instance: the Vulkan
loader re-reads the variable at every ``vkCreateInstance``, and the shim forwards to
lavapipe unchanged (it only reports two image-array features as present). It must happen
before ORT's first WebGPU session, because Dawn keeps the adapter list it found first for
the life of the process. ``ATTNREG_PEERS_SHIM`` overrides: a path to an ICD json, or ``0``
to never set the variable.

Known peer defects (onnxruntime-webgpu 1.27.0; ``run()`` returns what ORT computed, callers
compare and print, never hide it; ``python -m attnreg.peers --cases probes`` re-checks):
* lavapipe only: more than one new token (prefill, S=4 with past, the S=4 MHA) is wrong;
  single-token decode is right. The same cases are right on an NVIDIA H100.
* every device seen (lavapipe, H100): ``softcap`` is not applied as the contract (and ORT's
  own CPU EP) does, and batches with different ``seqlens_k`` are wrong; ORT's CPU EP gets
  both right on the same model and inputs, so the model is not at fault.
* NaN in the cache past a batch's valid length leaks into the output (0 * NaN), in ORT and
  in torch SDPA alike; the bench's inputs keep that memory finite, as a real cache does.
* f16 prefill S=2048 on the H100: 5 of 8.4M values just outside the f16 tolerance (7e-3).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import io
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .spec import AttentionSpec

ORT_PACKAGE = "onnxruntime-webgpu"
ORT_PROVIDER = "WebGpuExecutionProvider"
_REPO = Path(__file__).resolve().parent.parent
_SHIM_JSON = _REPO / ".peers" / "lvp-dawn-shim" / "lvp_shim_icd.json"
_LVP_JSON_NAMES = ("lvp_icd.x86_64.json", "lvp_icd.aarch64.json", "lvp_icd.json")
_ICD_DIRS = ("/usr/share/vulkan/icd.d", "/usr/local/share/vulkan/icd.d", "/etc/vulkan/icd.d")
_HW_NODES = ("/dev/dri/renderD*", "/dev/nvidia[0-9]*", "/dev/dxg", "/dev/kfd")

# What happened to VK_ICD_FILENAMES in this process (for reports): None = untouched.
shim_in_use: str | None = None


# --------------------------------------------------------------------------------------
# Vulkan set-up for Dawn on lavapipe
# --------------------------------------------------------------------------------------
def _is_lavapipe_json(path: str) -> bool:
    return os.path.basename(path) in _LVP_JSON_NAMES or "lvp_icd" in os.path.basename(path)


def shim_path() -> str | None:
    """The built lavapipe shim's ICD json, or None ($ATTNREG_PEERS_SHIM, else .peers/)."""
    env = os.environ.get("ATTNREG_PEERS_SHIM", "")
    if env == "0":
        return None
    if env:
        return env if os.path.isfile(env) else None
    return str(_SHIM_JSON) if _SHIM_JSON.is_file() else None


def _lavapipe_only() -> bool:
    """True when lavapipe is the only Vulkan driver that can find a device here: no
    hardware GPU device node exists and lavapipe's ICD is installed (or is the one named)."""
    if any(glob.glob(p) for p in _HW_NODES):
        return False
    named = os.environ.get("VK_ICD_FILENAMES") or os.environ.get("VK_DRIVER_FILES")
    if named:
        return all(_is_lavapipe_json(p) for p in named.split(os.pathsep) if p)
    return any(os.path.isfile(os.path.join(d, n)) for d in _ICD_DIRS for n in _LVP_JSON_NAMES)


def ensure_vulkan_env() -> str | None:
    """Point the Vulkan loader at the lavapipe shim when that is what Dawn needs here.

    Called before every ORT WebGPU session. Leaves the environment alone when a user named
    a non-lavapipe driver (e.g. the NVIDIA ICD on the GPU machine), when a hardware GPU node
    exists, when the shim is not built, or when ``ATTNREG_PEERS_SHIM=0``. Returns the ICD
    json now in force because of this module, or None.
    """
    global shim_in_use
    if shim_in_use is not None:
        return shim_in_use
    shim = shim_path()
    if shim is None:
        return None
    forced = bool(os.environ.get("ATTNREG_PEERS_SHIM"))
    if not forced and not _lavapipe_only():
        return None
    os.environ["VK_ICD_FILENAMES"] = shim
    os.environ.pop("VK_DRIVER_FILES", None)           # it would take precedence over ours
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")  # Dawn's Vulkan loader wants one
    shim_in_use = shim
    return shim


# --------------------------------------------------------------------------------------
# availability
# --------------------------------------------------------------------------------------
def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _root_cause(exc: BaseException) -> str:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip().splitlines()
    msg = text[-1] if text else type(exc).__name__
    if " was false. " in msg:          # ORT_ENFORCE: "<file:line> <lambda...> <cond> was false. <why>"
        msg = msg.split(" was false. ", 1)[1]
    return msg[-300:]


@functools.lru_cache(maxsize=1)
def ort_webgpu_status() -> str | None:
    """None when ONNX Runtime's WebGPU EP can run here, else the reason (never raises).

    Creates one tiny WebGPU session (CPU fallback disabled) to prove an adapter exists.
    Cached for the process: Dawn itself keeps its first adapter list.
    """
    try:
        import onnxruntime as ort
    except Exception as exc:   # ImportError, or a broken install raising something else
        return f"onnxruntime is not importable ({type(exc).__name__}: {exc}); " \
               f"pip install {ORT_PACKAGE}==1.27.0 onnx (or run ci/bench_peers.sh)"
    try:
        import onnx  # noqa: F401  (builds the model)
    except Exception as exc:
        return f"onnx is not importable ({type(exc).__name__}: {exc}); pip install onnx"
    providers = ort.get_available_providers()
    if ORT_PROVIDER not in providers:
        other = [d for d in ("onnxruntime", "onnxruntime-gpu") if _version(d)]
        return (f"onnxruntime {ort.__version__} has no {ORT_PROVIDER} (providers: {providers}); "
                f"install {ORT_PACKAGE}" + (f" and uninstall {', '.join(other)}" if other else ""))
    ensure_vulkan_env()
    try:
        sess = _make_session(_probe_model(), profile=False)
        x = np.arange(8, dtype=np.float32)
        y = sess.run(None, {"x": x})[0]
        if not np.array_equal(y, x + x):
            return f"{ORT_PROVIDER} computed a wrong probe result {y!r}"
    except Exception as exc:
        cause = _root_cause(exc)
        hint = ""
        if "adapter" in cause.lower() and shim_in_use is None and _lavapipe_only():
            hint = (" (Dawn refuses Mesa 22.3 lavapipe: run ci/bench_peers.sh to build the shim"
                    + (", and unset ATTNREG_PEERS_SHIM=0" if os.environ.get("ATTNREG_PEERS_SHIM") == "0"
                       else "") + ")")
        return f"{ORT_PROVIDER} unusable: {cause}{hint}"
    return None


@functools.lru_cache(maxsize=1)
def torch_status() -> str | None:
    """None when torch (with scaled_dot_product_attention) is importable, else the reason."""
    try:
        import torch
    except Exception as exc:
        return f"torch is not importable ({type(exc).__name__}: {exc}); it is optional " \
               f"(pip install torch)"
    if not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        return f"torch {torch.__version__} has no scaled_dot_product_attention (needs >= 2.0)"
    return None


def statuses() -> dict[str, str | None]:
    """{peer name: None if usable else the reason}."""
    return {"onnxruntime-webgpu": ort_webgpu_status(), "torch-sdpa": torch_status()}


# --------------------------------------------------------------------------------------
# ONNX Runtime WebGPU
# --------------------------------------------------------------------------------------
def ort_webgpu_supports(spec: AttentionSpec) -> str | None:
    """None if the ORT peer can express ``spec`` exactly, else why not (no ORT needed)."""
    if spec.bias:
        return "bias: not mapped to ORT's attention_bias by this peer"
    if spec.alibi_max_bias > 0:
        return "alibi: ORT's GroupQueryAttention has no ALiBi"
    if spec.head_sink:
        return "head_sink: not mapped by this peer"
    if spec.return_lse:
        return "return_lse: ORT's attention ops do not output the log-sum-exp"
    if spec.head_size % 8:
        return f"head_size={spec.head_size}: ORT's attention ops need a multiple of 8"
    if spec.causal:
        if spec.seq_len > 1 and spec.batch > 1 and (spec.past_len > 0 or spec.seqlens_k):
            return "seq_len > 1 with past keys: ORT's GroupQueryAttention needs batch == 1"
        return None
    # non-causal: MultiHeadAttention with the whole K/V as BNSH (cross-attention form)
    if spec.num_heads != spec.kv_num_heads:
        return "non-causal GQA: ORT's GroupQueryAttention is always causal and " \
               "MultiHeadAttention needs num_heads == kv_num_heads"
    if spec.seqlens_k:
        return "non-causal with seqlens_k: ORT WebGPU's MultiHeadAttention has no key_padding_mask"
    if spec.local_window > 0:
        return "non-causal local_window: ORT's MultiHeadAttention has no sliding window"
    if spec.softcap > 0:
        return "non-causal softcap: ORT's MultiHeadAttention has no softcap"
    return None


def _onnx_dtype(dtype: str) -> int:
    from onnx import TensorProto

    return int(TensorProto.FLOAT16 if dtype == "float16" else TensorProto.FLOAT)


def _finish_model(graph: Any, *, ms_domain: bool) -> bytes:
    from onnx import helper

    opsets = [helper.make_opsetid("", 17)]
    if ms_domain:
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="attnreg.peers")
    model.ir_version = 9            # onnx >= 1.16 writes 10+, which ORT 1.27 also reads
    return bytes(model.SerializeToString())


def _probe_model() -> bytes:
    from onnx import TensorProto, helper

    vi = helper.make_tensor_value_info
    g = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "probe",
                          [vi("x", TensorProto.FLOAT, [8])], [vi("y", TensorProto.FLOAT, [8])])
    return _finish_model(g, ms_domain=False)


def _upload_model(elem: int) -> bytes:
    from onnx import helper

    vi = helper.make_tensor_value_info
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "upload",
                          [vi("x", elem, None)], [vi("y", elem, None)])
    return _finish_model(g, ms_domain=False)


def build_gqa_model(spec: AttentionSpec) -> bytes:
    """The one-node com.microsoft GroupQueryAttention model for a causal spec.

    query [B,S,Nq*H], key/value [B,S,Nkv*H] (the new tokens), past_key/past_value and
    present_key/present_value [B,Nkv,C,H] (the static cache; bind the same buffer to both
    for ORT's shared-buffer mode), seqlens_k [B] int32 (= valid length - 1),
    total_sequence_length scalar int32 (a CPU input).
    """
    from onnx import TensorProto, helper

    t = _onnx_dtype(spec.dtype)
    b, s, nq, nkv, h, c = (spec.batch, spec.seq_len, spec.num_heads, spec.kv_num_heads,
                           spec.head_size, spec.capacity)
    attrs: dict[str, Any] = {"num_heads": nq, "kv_num_heads": nkv,
                             "scale": float(spec.effective_scale)}
    if spec.softcap > 0:
        attrs["softcap"] = float(spec.softcap)
    if spec.local_window > 0:
        attrs["local_window_size"] = int(spec.local_window)
    node = helper.make_node(
        "GroupQueryAttention",
        ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"],
        ["output", "present_key", "present_value"], name="gqa", domain="com.microsoft", **attrs)
    vi = helper.make_tensor_value_info
    inputs = [vi("query", t, [b, s, nq * h]), vi("key", t, [b, s, nkv * h]),
              vi("value", t, [b, s, nkv * h]), vi("past_key", t, [b, nkv, c, h]),
              vi("past_value", t, [b, nkv, c, h]), vi("seqlens_k", TensorProto.INT32, [b]),
              vi("total_sequence_length", TensorProto.INT32, [])]
    outputs = [vi("output", t, [b, s, nq * h]), vi("present_key", t, [b, nkv, c, h]),
               vi("present_value", t, [b, nkv, c, h])]
    return _finish_model(helper.make_graph([node], "attnreg_gqa", inputs, outputs), ms_domain=True)


def build_mha_model(spec: AttentionSpec) -> bytes:
    """The one-node com.microsoft MultiHeadAttention model for a non-causal spec:
    query [B,S,N*H], key/value [B,N,L,H] (BNSH, ORT's cross-attention form), no cache."""
    from onnx import helper

    t = _onnx_dtype(spec.dtype)
    b, s, n, h, L = spec.batch, spec.seq_len, spec.num_heads, spec.head_size, spec.total_len
    node = helper.make_node("MultiHeadAttention", ["query", "key", "value"], ["output"],
                            name="mha", domain="com.microsoft", num_heads=n,
                            scale=float(spec.effective_scale))
    vi = helper.make_tensor_value_info
    inputs = [vi("query", t, [b, s, n * h]), vi("key", t, [b, n, L, h]), vi("value", t, [b, n, L, h])]
    outputs = [vi("output", t, [b, s, n * h])]
    return _finish_model(helper.make_graph([node], "attnreg_mha", inputs, outputs), ms_domain=True)


def _make_session(model: bytes, *, profile: bool, provider_options: Mapping[str, str] | None = None,
                  prefix: str | None = None) -> Any:
    """A WebGPU-only session: CPU fallback disabled both for nodes and for the whole session."""
    import onnxruntime as ort

    ensure_vulkan_env()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    if profile:
        so.enable_profiling = True
        if prefix:
            so.profile_file_prefix = prefix
    prov: list[Any] = [(ORT_PROVIDER, dict(provider_options))] if provider_options else [ORT_PROVIDER]
    # The Python wrapper prints an "EP Error ... Falling back" banner before re-raising;
    # keep it off stdout (the real cause stays in the exception chain).
    with contextlib.redirect_stdout(io.StringIO()):
        return ort.InferenceSession(model, so, providers=prov)


@functools.lru_cache(maxsize=4)
def _uploader(elem: int) -> Any:
    return _make_session(_upload_model(elem), profile=False)


def _to_device(arr: np.ndarray) -> Any:
    """A WebGPU-device OrtValue holding a copy of ``arr``.

    onnxruntime-webgpu 1.27's Python API cannot allocate on the WebGPU device
    (``OrtValue.ortvalue_from_numpy(x, "webgpu")`` raises "Can't allocate memory on the
    device using this package"), so an Identity session with its output bound to the
    device does the upload. The device is the process-wide WebGPU context, shared by all
    sessions, so the buffer is valid in the attention session too.
    """
    from onnx import TensorProto

    elem = {np.dtype(np.float16): TensorProto.FLOAT16, np.dtype(np.float32): TensorProto.FLOAT,
            np.dtype(np.int32): TensorProto.INT32}[arr.dtype]
    sess = _uploader(int(elem))
    binding = sess.io_binding()
    binding.bind_cpu_input("x", np.ascontiguousarray(arr))
    binding.bind_output("y", "webgpu")
    sess.run_with_iobinding(binding)
    return binding.get_outputs()[0]


def _node_providers(profile_file: str) -> dict[str, str]:
    """{node name: execution provider} from an ORT profile (Node events)."""
    with open(profile_file) as fh:
        events = json.load(fh)
    out: dict[str, str] = {}
    for e in events:
        if e.get("cat") == "Node" and "provider" in e.get("args", {}):
            out[e["args"].get("op_name", e.get("name", "?"))] = e["args"]["provider"]
    return out


def _bsnh_flat(x: np.ndarray) -> np.ndarray:
    """[B, S, N, H] -> [B, S, N*H], contiguous."""
    b, s, n, h = x.shape
    return np.ascontiguousarray(x.reshape(b, s, n * h))


class OrtWebGPUAttention:
    """ONNX Runtime WebGPU EP running the spec as one com.microsoft attention node.

    ``run(tensors)`` uploads the contract's tensors (q, k, v with the new tokens' K/V as the
    last S valid positions of k/v, seqlens_k when the spec has it) to the device, runs one
    bound call and returns the output in the spec's q layout. ``timings(iters, warmup)``
    repeats the bound call on the device-resident tensors. The KV cache is ORT's shared
    past/present buffer: each call writes the new K/V into it in place (the same values
    every time, so repeated calls compute the same result).
    """

    name = "onnxruntime-webgpu"

    def __init__(self, spec: AttentionSpec, *, provider_options: Mapping[str, str] | None = None,
                 verify_placement: bool = True) -> None:
        why = ort_webgpu_supports(spec)
        if why:
            raise ValueError(f"{self.name} cannot run {spec.short()}: {why}")
        status = ort_webgpu_status()
        if status:
            raise RuntimeError(f"{self.name} unavailable: {status}")
        import onnxruntime as ort

        self.spec = spec
        self.op = "GroupQueryAttention" if spec.causal else "MultiHeadAttention"
        self.version = ort.__version__
        self.vulkan_icd = os.environ.get("VK_ICD_FILENAMES")
        model = build_gqa_model(spec) if spec.causal else build_mha_model(spec)
        self._verify = verify_placement
        prefix = None
        if verify_placement:
            import tempfile

            self._profile_dir = tempfile.mkdtemp(prefix="attnreg-ort-")
            prefix = os.path.join(self._profile_dir, "ort")
        self.session = _make_session(model, profile=verify_placement,
                                     provider_options=provider_options, prefix=prefix)
        self.providers: list[str] = list(self.session.get_providers())
        if not self.providers or self.providers[0] != ORT_PROVIDER:
            raise RuntimeError(f"{self.name}: session providers are {self.providers}")
        # Static placement check: inputs the node reads on the device must live in WebGPU
        # memory (a CPU-placed node would ask for CPU memory).
        mem = {i.name: m.name for i, m in zip(self.session.get_inputs(),
                                              self.session.get_input_memory_infos())}
        cpu_side = [n for n, m in mem.items() if "webgpu" not in m.lower()
                    and n != "total_sequence_length"]
        if cpu_side:
            raise RuntimeError(f"{self.name}: inputs {cpu_side} are expected in CPU memory "
                               f"({mem}): the node did not land on {ORT_PROVIDER}")
        self.input_memory = mem
        self.node_providers: dict[str, str] = {}
        self.gpu_kernels: list[str] = []
        self._binding: Any = None
        self._dev: dict[str, Any] = {}
        self._out: Any = None
        self._sync: Any = None

    # -- inputs ------------------------------------------------------------------------
    def _host_inputs(self, tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
        from .tensors import check_tensors, valid_lengths

        spec = self.spec
        t = check_tensors(spec, tensors)
        dt = np.dtype(spec.dtype)
        q = t["q"] if spec.q_layout == "BSNH" else t["q"].transpose(0, 2, 1, 3)    # [B,S,N,H]
        k = t["k"] if spec.kv_layout == "BNSH" else t["k"].transpose(0, 2, 1, 3)   # [B,Nkv,C,H]
        v = t["v"] if spec.kv_layout == "BNSH" else t["v"].transpose(0, 2, 1, 3)
        lengths = valid_lengths(spec, t)
        out: dict[str, np.ndarray] = {"query": _bsnh_flat(q.astype(dt, copy=False))}
        if not spec.causal:            # MHA: the whole valid K/V, BNSH
            L = spec.total_len
            out["key"] = np.ascontiguousarray(k[:, :, :L])
            out["value"] = np.ascontiguousarray(v[:, :, :L])
            return out
        s = spec.seq_len
        new_k = np.stack([k[b, :, int(L) - s:int(L)] for b, L in enumerate(lengths)])  # [B,Nkv,S,H]
        new_v = np.stack([v[b, :, int(L) - s:int(L)] for b, L in enumerate(lengths)])
        out["key"] = _bsnh_flat(new_k.transpose(0, 2, 1, 3))
        out["value"] = _bsnh_flat(new_v.transpose(0, 2, 1, 3))
        out["past_key"] = np.ascontiguousarray(k)
        out["past_value"] = np.ascontiguousarray(v)
        out["seqlens_k"] = (lengths - 1).astype(np.int32)
        out["total_sequence_length"] = np.array(int(lengths.max()), dtype=np.int32)
        return out

    def load(self, tensors: Mapping[str, Any]) -> None:
        """Upload the tensors to the device and bind them (not timed)."""
        import onnxruntime as ort

        host = self._host_inputs(tensors)
        binding = self.session.io_binding()
        binding.bind_output("output", "webgpu")
        dev: dict[str, Any] = {}
        for name, arr in host.items():
            if name == "total_sequence_length":       # ORT reads this one on the host
                dev[name] = ort.OrtValue.ortvalue_from_numpy(arr)
            else:
                dev[name] = _to_device(arr)
            binding.bind_ortvalue_input(name, dev[name])
        if self.spec.causal:   # shared past/present buffer: the cache is updated in place
            binding.bind_ortvalue_output("present_key", dev["past_key"])
            binding.bind_ortvalue_output("present_value", dev["past_value"])
        self._binding, self._dev = binding, dev
        # The smallest device tensor: reading it back waits for all queued GPU work.
        self._sync = dev["seqlens_k"] if "seqlens_k" in dev else dev["query"]
        self.session.run_with_iobinding(binding)     # first call allocates the output...
        self._out = binding.get_outputs()[0]
        binding.bind_ortvalue_output("output", self._out)   # ...which later calls reuse
        if self._verify and not self.node_providers:
            path = self.session.end_profiling()
            try:
                self.node_providers = _node_providers(path)
            finally:
                with contextlib.suppress(OSError):
                    os.remove(path)
                    os.rmdir(self._profile_dir)
            bad = {n: p for n, p in self.node_providers.items() if p != ORT_PROVIDER}
            if bad or self.op not in self.node_providers:
                raise RuntimeError(f"{self.name}: node placement {self.node_providers}, "
                                   f"expected {self.op} on {ORT_PROVIDER}")

    def _call(self) -> None:
        self.session.run_with_iobinding(self._binding)

    def _wait(self) -> None:
        self._sync.numpy()

    # -- public ------------------------------------------------------------------------
    def run(self, tensors: Mapping[str, Any]) -> np.ndarray:
        """The output for ``tensors`` (numpy, spec dtype, spec q layout)."""
        self.load(tensors)
        self._call()
        return self.output()

    def output(self) -> np.ndarray:
        """Read the last call's output back, in the spec's q layout."""
        spec = self.spec
        out = np.asarray(self._out.numpy()).reshape(spec.batch, spec.seq_len, spec.num_heads,
                                                    spec.head_size)
        return np.ascontiguousarray(out if spec.q_layout == "BSNH" else out.transpose(0, 2, 1, 3))

    def timings(self, iters: int = 50, warmup: int = 5, *, gpu: bool = True) -> dict[str, list[float]]:
        """Per-call times of the bound call, in seconds.

        wall_s: ``run_with_iobinding`` + a 4-byte read-back that waits for the GPU (what a
        decode step costs end to end). submit_s: the host time of ``run_with_iobinding``
        alone in a back-to-back loop (ORT's per-call host overhead; the GPU work is async).
        loop_s: that loop's total time to the final sync, divided by the call count.
        gpu_s (``gpu=True``, when ORT reports kernel times): the sum of the call's GPU kernel
        durations from ORT's own WebGPU profiler (timestamp queries), taken in a second,
        profiled session on the same device tensors, so the other numbers pay no
        profiling cost.
        """
        if self._binding is None:
            from .testing import make_tensors

            self.load(make_tensors(self.spec, seed=0, poison=False))
        for _ in range(warmup):
            self._call()
            self._wait()
        wall: list[float] = []
        for _ in range(iters):
            t0 = time.perf_counter()
            self._call()
            self._wait()
            wall.append(time.perf_counter() - t0)
        submit: list[float] = []
        t_loop = time.perf_counter()
        for _ in range(iters):
            t0 = time.perf_counter()
            self._call()
            submit.append(time.perf_counter() - t0)
        self._wait()
        loop = (time.perf_counter() - t_loop) / max(iters, 1)
        out = {"wall_s": wall, "submit_s": submit, "loop_s": [loop]}
        if gpu:
            gpu_s = self._gpu_times(iters, warmup)
            if gpu_s:
                out["gpu_s"] = gpu_s
        return out

    def _gpu_times(self, iters: int, warmup: int) -> list[float]:
        """Per-call GPU time from ORT's WebGPU profiler ("Api" events, one per kernel)."""
        import tempfile

        model = build_gqa_model(self.spec) if self.spec.causal else build_mha_model(self.spec)
        with tempfile.TemporaryDirectory(prefix="attnreg-ort-gpu-") as tmp:
            sess = _make_session(model, profile=True, prefix=os.path.join(tmp, "ort"))
            binding = sess.io_binding()
            for name, val in self._dev.items():
                binding.bind_ortvalue_input(name, val)
            binding.bind_ortvalue_output("output", self._out)
            if self.spec.causal:
                binding.bind_ortvalue_output("present_key", self._dev["past_key"])
                binding.bind_ortvalue_output("present_value", self._dev["past_value"])
            n = warmup + iters
            for _ in range(n):
                sess.run_with_iobinding(binding)
                self._wait()
            path = sess.end_profiling()
            with open(path) as fh:
                events = json.load(fh)
        runs = sum(1 for e in events if e.get("cat") == "Node")
        kernels = sorted((e for e in events if e.get("cat") == "Api"), key=lambda e: e.get("ts", 0))
        if runs != n or not kernels or len(kernels) % n:
            self.gpu_kernels = [f"unparsed: {len(kernels)} kernel events for {runs} runs"]
            return []
        per = len(kernels) // n
        self.gpu_kernels = [str(e.get("name", "?")).split("&")[-1] for e in kernels[:per]]
        return [sum(float(e.get("dur", 0)) for e in kernels[r * per:(r + 1) * per]) * 1e-6
                for r in range(warmup, n)]

    def describe(self) -> dict[str, Any]:
        return {"peer": self.name, "version": self.version, "op": self.op,
                "providers": self.providers, "node_providers": self.node_providers,
                "gpu_kernels": self.gpu_kernels, "vulkan_icd": self.vulkan_icd, "shim": shim_in_use}

    def close(self) -> None:
        if self.session is not None and self._verify and not self.node_providers:
            # Profiling never ended (no load): end it now so ORT writes no file at exit.
            with contextlib.suppress(Exception):
                path = self.session.end_profiling()
                os.remove(path)
                os.rmdir(self._profile_dir)
        self._binding = None
        self._dev = {}
        self._out = self._sync = None
        self.session = None

    def __enter__(self) -> OrtWebGPUAttention:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------
# torch SDPA
# --------------------------------------------------------------------------------------
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
        from .tensors import check_tensors, valid_lengths

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
            from .testing import make_tensors

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


def median_us(xs: list[float]) -> float:
    """Median of a list of seconds, in microseconds (nan for an empty list)."""
    return statistics.median(xs) * 1e6 if xs else float("nan")


# --------------------------------------------------------------------------------------
# `python -m attnreg.peers`: the peers alone, on this machine's default device
# --------------------------------------------------------------------------------------
def _cases(which: str) -> list[tuple[str, AttentionSpec]]:
    def gqa(L: int, dtype: str = "float16", S: int = 1, n: int = 32, nkv: int = 8,
            h: int = 128) -> AttentionSpec:
        return AttentionSpec(batch=1, seq_len=S, past_len=L - S, num_heads=n, kv_num_heads=nkv,
                             head_size=h, dtype=dtype, causal=True)

    def whisper(T: int) -> AttentionSpec:
        return AttentionSpec(batch=1, seq_len=4, past_len=T - 4, num_heads=8, kv_num_heads=8,
                             head_size=64, dtype="float16", causal=False)

    full = [("decode-f16-L2048", gqa(2048)), ("decode-f16-L8192", gqa(8192)),
            ("decode-f16-L32768", gqa(32768)), ("decode-f32-L8192", gqa(8192, "float32")),
            ("whisper-S4-T1500", whisper(1500)), ("prefill-f16-S512", gqa(512, S=512)),
            ("prefill-f16-S2048", gqa(2048, S=2048))]
    small = [("decode-f16-L512", gqa(512)), ("decode-f16-L2048", gqa(2048)),
             ("decode-f32-L512", gqa(512, "float32")), ("whisper-S4-T300", whisper(300)),
             ("whisper-S4-T1500", whisper(1500)), ("prefill-f16-S64", gqa(64, S=64, n=8, nkv=2, h=64))]
    # Feature probes: small, to tell a peer's defect on this device from one of a driver.
    b2_seqlens = AttentionSpec(batch=2, seq_len=1, past_len=100, num_heads=4, kv_num_heads=2,
                               head_size=64, dtype="float32", seqlens_k=True, kv_capacity=160)
    probes = [
        ("probe-decode-b2-seqlens", b2_seqlens),
        ("probe-decode-b2-seqlens-nan", b2_seqlens),      # NaN past each length (the contract's poison)
        ("probe-decode-softcap", AttentionSpec(batch=1, seq_len=1, past_len=127, num_heads=4,
                                               kv_num_heads=2, head_size=64, dtype="float32",
                                               softcap=5.0)),
        ("probe-decode-window", AttentionSpec(batch=1, seq_len=1, past_len=127, num_heads=4,
                                              kv_num_heads=2, head_size=64, dtype="float32",
                                              local_window=32)),
        ("probe-S4-past", gqa(128, "float32", S=4, n=4, nkv=2, h=64)),
        ("probe-prefill-S16", gqa(16, S=16, n=4, nkv=2, h=64)),
    ]
    return {"full": full + probes, "small": small + probes, "probes": probes}[which]


def bench_peers(cases: list[tuple[str, AttentionSpec]], *, iters: int = 100, warmup: int = 10,
                torch_device: str | None = None, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Time both peers on each case and check them against the float64 reference."""
    from .testing import compare, expected, make_tensors

    rows: list[dict[str, Any]] = []
    for name, spec in cases:
        # Only "-nan" cases put NaN in the keys past each valid length (the contract's
        # poison); elsewhere that memory holds finite values, as in a real cache.
        tensors = make_tensors(spec, seed=0, poison=name.endswith("-nan"))
        want = None
        row: dict[str, Any] = {"case": name, "spec": spec.short()}
        ort_why = ort_webgpu_status() or ort_webgpu_supports(spec)
        torch_why = torch_status() or torch_supports(spec)
        peers_: list[tuple[str, Callable[[], Any], str | None]] = [
            ("ort", functools.partial(OrtWebGPUAttention, spec), ort_why),
            ("torch", functools.partial(TorchSDPA, spec, torch_device), torch_why),
        ]
        if spec.group_size > 1 and not name.startswith("probe"):
            peers_.append(("torch_repeat", functools.partial(TorchSDPA, spec, torch_device, gqa="repeat"),
                           torch_why))
        for key, make, why in peers_:
            if why:
                row[key] = {"skipped": why}
                continue
            t0 = time.perf_counter()
            try:
                peer = make()
                out = peer.run(tensors)
                if want is None:
                    want = expected(spec, tensors)
                err, problem = compare(spec, out, want)
                res: dict[str, Any] = {"max_err": err, "correct": not problem, "problem": problem}
                if not name.startswith("probe"):
                    tm = peer.timings(iters, warmup)
                    res.update({f"{k[:-2]}_us": median_us(v) for k, v in tm.items()})
                    res["iters"] = iters
                res["describe"] = peer.describe()
                peer.close()
            except Exception as exc:
                res = {"error": f"{type(exc).__name__}: {exc}"}
            res["setup_s"] = round(time.perf_counter() - t0, 3)
            row[key] = res
            log(f"{name:24s} {key:12s} " + ", ".join(
                f"{k}={v:.1f}" if isinstance(v, float) and k.endswith("_us") else f"{k}={v}"
                for k, v in res.items() if k not in ("describe", "max_err", "setup_s"))
                + (f", max_err={res['max_err']:.2e}" if "max_err" in res else ""))
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    def us(d: Any, k: str) -> str:
        v = d.get(k) if isinstance(d, dict) else None
        return f"{v:.1f}" if isinstance(v, float) and v == v else "-"

    def ok(d: Any) -> str:
        if not isinstance(d, dict) or "skipped" in d:
            return "n/a"
        if "error" in d:
            return "error"
        return "ok" if d.get("correct") else f"WRONG ({d.get('max_err', float('nan')):.1e})"

    head = ("case", "ORT GPU us", "ORT wall us", "ORT submit us", "ORT loop us", "ORT vs ref",
            "torch GPU us", "torch wall us", "torch vs ref", "torch(repeat) GPU us")
    lines = [head]
    for r in rows:
        o, t, tr = r.get("ort", {}), r.get("torch", {}), r.get("torch_repeat", {})
        lines.append((r["case"], us(o, "gpu_us"), us(o, "wall_us"), us(o, "submit_us"),
                      us(o, "loop_us"), ok(o), us(t, "gpu_us"), us(t, "wall_us"), ok(t),
                      us(tr, "gpu_us")))
    widths = [max(len(str(x[i])) for x in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)) for line in lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import platform

    ap = argparse.ArgumentParser(prog="python -m attnreg.peers",
                                 description="Time the bench peers (ORT WebGPU, torch SDPA) alone.")
    ap.add_argument("--cases", choices=("full", "small", "probes"), default="small")
    ap.add_argument("--only", default="", help="comma-separated case names to keep")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--torch-device", default=None)
    ap.add_argument("--json", default="", help="write the rows here")
    a = ap.parse_args(argv)
    cases = _cases(a.cases)
    if a.only:
        keep = set(a.only.split(","))
        cases = [c for c in cases if c[0] in keep]
    print("peers:", statuses(), "| VK_ICD_FILENAMES:", os.environ.get("VK_ICD_FILENAMES"),
          "| shim:", shim_in_use, flush=True)
    rows = bench_peers(cases, iters=a.iters, warmup=a.warmup, torch_device=a.torch_device,
                       log=lambda s: print(s, flush=True))
    print(format_table(rows))
    if a.json:
        meta = {"host": platform.node(), "python": platform.python_version(),
                "vk_icd": os.environ.get("VK_ICD_FILENAMES"), "shim": shim_in_use,
                "statuses": statuses(), "iters": a.iters, "warmup": a.warmup}
        with open(a.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
