"""ONNX Runtime WebGPU: which specs its attention ops express, one-node models, sessions, uploads."""

from __future__ import annotations

import contextlib
import functools
import io
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...spec import AttentionSpec
from .vulkan import ensure_vulkan_env

ORT_PACKAGE = "onnxruntime-webgpu"
ORT_PROVIDER = "WebGpuExecutionProvider"
# The q/k/v dtypes the peer's models declare; ort_webgpu_supports refuses every other one.
ORT_DTYPES = ("float16", "float32")


# --------------------------------------------------------------------------------------
# ONNX Runtime WebGPU
# --------------------------------------------------------------------------------------
def ort_webgpu_supports(spec: AttentionSpec) -> str | None:
    """None if the ORT peer can express ``spec`` exactly, else why not (no ORT needed)."""
    if spec.dtype not in ORT_DTYPES:
        return (f"dtype={spec.dtype}: ORT WebGPU's kernels take float32 and float16 only "
                "(WebGpuSupportedFloatTypes)")
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
    if spec.right_window >= 0:
        return "non-causal right_window: ORT's MultiHeadAttention has no sliding window"
    if spec.softcap > 0:
        return "non-causal softcap: ORT's MultiHeadAttention has no softcap"
    return None


def _onnx_dtype(dtype: str) -> int:
    from onnx import TensorProto

    if dtype not in ORT_DTYPES:      # never a silent float32 stand-in for another dtype
        raise ValueError(f"dtype={dtype}: the ORT peer's models take {ORT_DTYPES}")
    return int(TensorProto.FLOAT16 if dtype == "float16" else TensorProto.FLOAT)


def _finish_model(graph: Any, *, ms_domain: bool) -> bytes:
    from onnx import helper

    opsets = [helper.make_opsetid("", 17)]
    if ms_domain:
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="attnreg.tools.peers")
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
