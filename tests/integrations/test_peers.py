"""The optional bench peers (attnreg.tools.peers): availability reasons without the packages, and,
where a peer is usable, its output against the float64 reference.

CI has no onnxruntime-webgpu, so its numerical tests skip there; CI installs torch (CPU, the
clients extra), so a missing torch fails there (tests.support.missing). The status and
spec-mapping tests always run and need neither package. Sizes are small: a peer's test
costs well under a second on lavapipe.
"""

from __future__ import annotations

import importlib
import re
import sys

import numpy as np
import pytest

import attnreg
from attnreg.testing import compare, expected, make_tensors
from attnreg.tools import peers
from tests.support import missing

DECODE = dict(batch=1, seq_len=1, past_len=127, num_heads=4, kv_num_heads=2, head_size=64)


def _spec(**kw: object) -> attnreg.AttentionSpec:
    return attnreg.AttentionSpec(**{**DECODE, **kw})


@pytest.fixture
def fresh_status():
    """Status caches are per process; clear them around a test that fakes the imports."""
    peers.ort_webgpu_status.cache_clear()
    peers.torch_status.cache_clear()
    yield
    peers.ort_webgpu_status.cache_clear()
    peers.torch_status.cache_clear()


# -- no package needed ------------------------------------------------------------------
def test_module_imports_nothing_optional():
    code = ("import sys, attnreg.tools.peers; bad = [m for m in ('onnxruntime', 'onnx', 'torch') "
            "if m in sys.modules]; assert not bad, bad")
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("module", ["onnxruntime", "onnx"])
def test_ort_status_is_a_reason_when_missing(monkeypatch, fresh_status, module):
    monkeypatch.setitem(sys.modules, module, None)     # `import module` now raises ImportError
    why = peers.ort_webgpu_status()
    assert isinstance(why, str) and module in why and "not importable" in why
    with pytest.raises(RuntimeError, match="unavailable"):
        peers.OrtWebGPUAttention(_spec())


def test_torch_status_is_a_reason_when_missing(monkeypatch, fresh_status):
    monkeypatch.setitem(sys.modules, "torch", None)
    why = peers.torch_status()
    assert isinstance(why, str) and "torch" in why and "not importable" in why
    with pytest.raises(RuntimeError, match="unavailable"):
        peers.TorchSDPA(_spec())
    assert peers.statuses()["torch-sdpa"] == why


def test_ort_status_without_the_webgpu_provider(monkeypatch, fresh_status):
    class FakeOrt:
        __version__ = "0.0-fake"

        @staticmethod
        def get_available_providers():
            return ["CPUExecutionProvider"]

    monkeypatch.setitem(sys.modules, "onnxruntime", FakeOrt)
    if importlib.util.find_spec("onnx") is None:
        monkeypatch.setitem(sys.modules, "onnx", object())
    why = peers.ort_webgpu_status()
    assert why is not None and "WebGpuExecutionProvider" in why


def test_unsupported_features_are_named():
    assert peers.ort_webgpu_supports(_spec()) is None
    assert peers.ort_webgpu_supports(_spec(causal=False, num_heads=2)) is None
    assert "alibi" in peers.ort_webgpu_supports(_spec(alibi_max_bias=8.0))
    assert "return_lse" in peers.ort_webgpu_supports(_spec(return_lse=True))
    assert "multiple of 8" in peers.ort_webgpu_supports(_spec(head_size=12))
    assert "num_heads == kv_num_heads" in peers.ort_webgpu_supports(_spec(causal=False))
    assert "batch == 1" in peers.ort_webgpu_supports(_spec(batch=2, seq_len=4, past_len=8))
    assert "float32 and float16 only" in peers.ort_webgpu_supports(_spec(dtype="bfloat16"))
    assert peers.torch_supports(_spec(local_window=8, seqlens_k=True)) is None
    assert "softcap" in peers.torch_supports(_spec(softcap=30.0))
    assert "head_sink" in peers.torch_supports(_spec(head_sink=True))
    with pytest.raises(ValueError, match="alibi"):
        peers.OrtWebGPUAttention(_spec(alibi_max_bias=8.0))


def test_shim_is_left_alone_when_disabled_or_a_driver_is_named(monkeypatch, tmp_path):
    icd = tmp_path / "attnreg_vkshim_icd.json"         # a manifest (ATTNREG_VK_SHIM is checked)
    icd.write_text('{"file_format_version": "1.0.0", "ICD": {"library_path": '
                   '"libattnreg_vkshim.so", "api_version": "1.3.0"}}')
    monkeypatch.setattr(peers.vulkan, "shim_in_use", None)
    monkeypatch.setattr(peers.vulkan, "_HW_NODES", ())
    # set, then deleted, through monkeypatch: both loader variables are restored afterwards
    # (ensure_vulkan_env writes them, and a leftover one hides SwiftShader from Chromium)
    monkeypatch.setenv("VK_DRIVER_FILES", "unset-after-the-test")
    monkeypatch.delenv("VK_DRIVER_FILES")
    monkeypatch.setenv("ATTNREG_VK_SHIM", "0")
    monkeypatch.setenv("VK_ICD_FILENAMES", "/usr/share/vulkan/icd.d/lvp_icd.x86_64.json")
    assert peers.shim_path() is None and peers.ensure_vulkan_env() is None
    # A user-named non-lavapipe driver (the NVIDIA ICD on the GPU machine) is never replaced.
    monkeypatch.setenv("ATTNREG_VK_SHIM", str(icd))
    monkeypatch.setenv("VK_ICD_FILENAMES", "/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json")
    assert peers.ensure_vulkan_env() is None
    assert peers.vulkan.shim_in_use is None
    # Named lavapipe, nothing else: the shim replaces it (in both loader variables).
    monkeypatch.setenv("VK_ICD_FILENAMES", "/usr/share/vulkan/icd.d/lvp_icd.x86_64.json")
    assert peers.ensure_vulkan_env() == str(icd)
    env = sys.modules["os"].environ
    assert peers.vulkan.shim_in_use == str(icd) == env["VK_ICD_FILENAMES"] == env["VK_DRIVER_FILES"]


# -- ONNX Runtime WebGPU (skips without onnxruntime-webgpu and a WebGPU adapter) -----------
def _ort_or_skip() -> None:
    why = peers.ort_webgpu_status()
    if why:
        pytest.skip(why)


def _on_lavapipe() -> bool:
    return peers.vulkan.shim_in_use is not None or peers.vulkan._lavapipe_only()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_ort_decode_matches_reference(dtype):
    _ort_or_skip()
    spec = _spec(dtype=dtype, kv_layout="BSNH")
    t = make_tensors(spec, seed=3)
    with peers.OrtWebGPUAttention(spec) as peer:
        out = peer.run(t)
        assert peer.node_providers == {"GroupQueryAttention": "WebGpuExecutionProvider"}
        assert peer.providers[0] == "WebGpuExecutionProvider"
        _err, problem = compare(spec, out, expected(spec, t))
        assert not problem, problem
        # A second bound call on the device-resident cache gives the same answer.
        peer._call()
        np.testing.assert_array_equal(peer.output(), out)
        tm = peer.timings(iters=3, warmup=1, gpu=False)
        assert len(tm["wall_s"]) == 3 and all(x > 0 for x in tm["wall_s"])


@pytest.mark.parametrize("case", [
    dict(seq_len=4, past_len=60, dtype="float32"),                           # chunked prefill
    dict(seq_len=16, past_len=0, dtype="float16"),                           # fresh prefill
    dict(seq_len=4, past_len=60, dtype="float16", causal=False, kv_num_heads=4),  # whisper-like
])
def test_ort_multi_token(case):
    _ort_or_skip()
    spec = _spec(**case)
    t = make_tensors(spec, seed=4)
    with peers.OrtWebGPUAttention(spec) as peer:
        out = peer.run(t)
    _err, problem = compare(spec, out, expected(spec, t))
    if problem and _on_lavapipe():
        pytest.xfail(f"onnxruntime-webgpu {peer.version} on lavapipe is wrong for S>1 "
                     f"(right on an NVIDIA GPU): {problem}")
    assert not problem, problem


# -- torch SDPA (skips without torch; fails so in CI) ----------------------------------------
@pytest.mark.parametrize("case", [
    dict(dtype="float32", q_layout="BNSH", kv_layout="BSNH"),
    dict(dtype="float16"),
    dict(dtype="float32", seq_len=4, past_len=60, local_window=16),
    dict(dtype="float32", batch=2, seq_len=2, past_len=40, seqlens_k=True, kv_capacity=64),
    dict(dtype="float32", seq_len=8, past_len=0, causal=False, bias=True),
    dict(dtype="bfloat16"),                              # through torch.bfloat16, bit for bit
    dict(dtype="bfloat16", seq_len=8, past_len=0, causal=False, bias=True),
])
@pytest.mark.parametrize("gqa", ["auto", "enable", "repeat"])
def test_torch_matches_reference(case, gqa):
    _torch_or_skip()
    spec = _spec(**case)
    t = make_tensors(spec, seed=5, poison=False)
    peer = peers.TorchSDPA(spec, "cpu", gqa=gqa)
    out = peer.run(t)
    _err, problem = compare(spec, out, expected(spec, t))
    assert not problem, problem
    tm = peer.timings(iters=2, warmup=1)
    assert len(tm["wall_s"]) == 2 and "gpu_s" not in tm


def _torch_or_skip() -> None:
    why = peers.torch_status()
    if why:
        missing(why)


TRIED = r"(\d+\.\d us|error: .+|wrong: .+)"


def test_torch_auto_picks_a_named_correct_backend():
    _torch_or_skip()
    spec = _spec(dtype="float32")
    t = make_tensors(spec, seed=6, poison=False)
    peer = peers.TorchSDPA(spec, "cpu", select_iters=2)
    out = peer.run(t)
    _err, problem = compare(spec, out, expected(spec, t))
    assert not problem, problem
    assert peer.backend in peers.torch_sdpa.BACKENDS
    assert peer.label.startswith(f"torch-sdpa[{peer.backend}")
    assert peer.describe()["label"] == peer.label
    # every backend was tried with both GQA strategies, each with a reason or a time
    assert set(peer.tried) == {b + g for b in peers.torch_sdpa.BACKENDS for g in ("", ",gqa=repeat")}
    for key, why in peer.tried.items():
        assert re.fullmatch(TRIED, why), (key, why)
    kept = peer.label[len("torch-sdpa["):-1]
    assert peer.tried[kept].endswith(" us")
    # the kept one is the fastest of those that ran correctly
    times = {k: float(v[:-3]) for k, v in peer.tried.items() if v.endswith(" us")}
    assert times[kept] == min(times.values())
    assert peer.tried["cudnn"].startswith("error: ")       # no cuDNN on the CPU: a reason, no crash


def test_torch_pinned_backend():
    _torch_or_skip()
    spec = _spec(dtype="float32", num_heads=2)             # MHA: no GQA strategy to choose
    t = make_tensors(spec, seed=7, poison=False)
    peer = peers.TorchSDPA(spec, "cpu", backend="math", select_iters=2)
    out = peer.run(t)
    _err, problem = compare(spec, out, expected(spec, t))
    assert not problem, problem
    assert peer.label == "torch-sdpa[math]" and list(peer.tried) == ["math"]
    tm = peer.timings(iters=2, warmup=1)
    assert len(tm["wall_s"]) == 2
    with pytest.raises(ValueError, match="backend="):
        peers.TorchSDPA(spec, "cpu", backend="fastest")


def test_torch_unavailable_or_wrong_everywhere_is_a_reason():
    _torch_or_skip()
    spec = _spec(dtype="float32")
    t = make_tensors(spec, seed=8, poison=False)
    with pytest.raises(RuntimeError, match=r"unavailable.*cudnn: error: "):
        peers.TorchSDPA(spec, "cpu", backend="cudnn").run(t)
    # NaN in the cache past a batch's length leaks into SDPA's output (a known torch defect):
    # every backend that runs is wrong, and the reasons say so.
    spec = _spec(dtype="float32", batch=2, seqlens_k=True, kv_capacity=160, past_len=100)
    with pytest.raises(RuntimeError, match="wrong: ") as info:
        peers.TorchSDPA(spec, "cpu", select_iters=2).run(make_tensors(spec, seed=8, poison=True))
    assert "math" in str(info.value)
