"""The browser backend: WebGPU in headless Chromium (Dawn + Tint, SwiftShader in CI).

Kernel results are judged against the float64 reference only; the conformance matrix
(tests/conformance/test_conformance.py) gives every browser kernel its cells, and
tests/backends/wgsl/test_tint.py shows Tint's rejections re-planned. Here: the adapter probe,
the page protocol, one browser per Session and no process outliving it (also after timeouts
and crashes), host-cast float16.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import attnreg
from attnreg import reference as ref
from attnreg.backends.browser import chromium, kernels, probe, wire
from attnreg.backends.browser.host import TIMEOUT_ENV, BrowserError, BrowserHost, job_timeout
from attnreg.backends.webgpu import kernels as wkernels
from attnreg.backends.webgpu import mma as wmma
from attnreg.backends.webgpu import program
from tests.support import (
    check_close,
    make_tensors,
    require_devices,
)

# What the page reported for Debian 12's chromium 156 (SwiftShader), trimmed.
SWIFTSHADER_HELLO = {
    "info": {"vendor": "google", "architecture": "swiftshader", "device": "", "description": "",
             "subgroupMinSize": 4, "subgroupMaxSize": 4, "isFallbackAdapter": True},
    "features": ["subgroups", "timestamp-query", "float32-filterable"],
    "deviceFeatures": ["subgroups", "timestamp-query"],
    "limits": {"maxComputeWorkgroupStorageSize": 32768, "maxComputeInvocationsPerWorkgroup": 256,
               "maxComputeWorkgroupSizeX": 256, "maxStorageBufferBindingSize": 1073741824,
               "maxBufferSize": 1073741824, "maxComputeWorkgroupsPerDimension": 65535},
    "userAgent": "Mozilla/5.0 (X11; Linux x86_64) HeadlessChrome/156.0.0.0 Safari/537.36",
}
DOUBLE = """@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@compute @workgroup_size(4)
fn main(@builtin(global_invocation_id) g: vec3<u32>) {
  x[g.x] = 2.0 * x[g.x];
}
"""

# DOUBLE's job made slow: each lane runs a long chain of dependent FMAs (SwiftShader: 1.1-1.2
# s a call, DOUBLE 0.05-0.09 s), so that no reply can beat a timeout of a millisecond.
# DOUBLE's reply once did, in a clean-clone CI run on 2 cores: the host's wait takes a reply
# that is there before it tests its deadline, and on a loaded machine its wake-up can come late.
SLOW = DOUBLE.replace("  x[g.x] = 2.0 * x[g.x];",
                      "  var a = x[g.x];\n"
                      "  for (var i = 0u; i < 200000000u; i++) {\n"
                      "    a = a * 0.999999 + 1.0;\n"
                      "  }\n"
                      "  x[g.x] = a;")


def _job(wgsl: str, key: str = "double", source: bool = True) -> dict[str, Any]:
    return {"label": "double", "buffers": [{"name": "x", "usage": "storage", "size": 16, "blob": "x"}],
            "stages": [{"key": key, "label": "test.double", "family": "test",
                        "wgsl": wgsl if source else None,
                        "entry": "main", "grid": [1, 1, 1], "bindings": [[0, "rw", "x"]]}],
            "outputs": [{"name": "x", "buffer": "x", "size": 16}]}


@pytest.fixture(scope="module", autouse=True)
def _nothing_left_running() -> Iterator[None]:
    # Only this module's browsers: pytest-xdist may have run other modules in this worker
    # before, and a Session they dropped unclosed is ended by the garbage collector, not here.
    before = {id(b) for b in list(chromium._LIVE)}
    yield
    gc.collect()
    live = [b for b in list(chromium._LIVE) if b.alive() and id(b) not in before]
    assert not live, f"browsers still running after the browser tests: {[b.pid for b in live]}"


@pytest.fixture(scope="module")
def session() -> Iterator[attnreg.Session]:
    require_devices("browser")
    with attnreg.Session(backend="browser") as s:
        yield s


# -- caps and kernels (no browser needed) ------------------------------------------------------
def test_caps_of_a_swiftshader_report() -> None:
    caps = probe.caps_of(SWIFTSHADER_HELLO)
    assert caps.backend == "browser" and caps.id == "browser:0"
    assert caps.slug == "swiftshader" and "SwiftShader" in caps.name and "Chromium 156" in caps.name
    assert caps.features == frozenset({"subgroups", "timestamp-query"})
    assert caps.device_type == "cpu" and caps.subgroup_min_size == 4
    assert caps.limits["workgroup_storage"] == 32768 and caps.limits["invocations"] == 256


def test_kernels_are_the_webgpu_variants_rehomed() -> None:
    mine = {k.id for k in attnreg.kernels("browser")}
    want = {kernels.browser_id(k.id) for k in wkernels.declare() if k.family in kernels.FAMILIES}
    assert want <= mine
    assert "browser.prefill.f32.sg" in mine and "browser.decode_partial.f32.m4" in mine
    # the matrix variants (declare_matrix) are re-homed too, with no host-cast twins
    matrix = {kernels.browser_id(k.id) for k in wmma.declare_matrix()}
    assert matrix <= mine
    cast = mine - want - matrix
    assert cast == {f"browser.{k.split('.', 1)[1].replace('.f32', '.f16.cast32')}"
                    for k in want if ".f32" in k}


def test_f16_variants_are_rejected_with_the_reason() -> None:
    caps = probe.caps_of(SWIFTSHADER_HELLO)
    spec = attnreg.AttentionSpec(batch=1, seq_len=1, past_len=50, num_heads=4, kv_num_heads=2,
                                 head_size=64, dtype="float16")
    plan = attnreg.explain(spec, caps=caps)
    for kid in ("browser.decode_partial.f16.m1", "browser.reduce.f16"):
        assert "device lacks feature(s) shader-f16" in plan.rejected[kid], plan.rejected[kid]
    assert plan.kernels == ("browser.decode_partial.f16.cast32.m1", "browser.reduce.f16.cast32")
    plan = attnreg.explain(spec.replace(seq_len=64), caps=caps)
    for kid in ("browser.prefill.f16.sg", "browser.prefill.f16.wgmem"):
        assert "device lacks feature(s) shader-f16" in plan.rejected[kid], plan.rejected[kid]
    assert plan.kernel == "browser.prefill.f16.cast32.sg"


def test_wgsl_is_backends_webgpus_with_the_tint_directive() -> None:
    caps = probe.caps_of(SWIFTSHADER_HELLO)
    spec = attnreg.AttentionSpec(batch=1, seq_len=40, past_len=20, num_heads=4, kv_num_heads=2,
                                 head_size=64)
    plan = attnreg.explain(spec, caps=caps, kernel="browser.prefill.f32.sg")
    prog = program.programs(plan, dialect=program.TINT)[0]
    assert prog.wgsl.startswith(program.SUBGROUP_DIRECTIVE)
    naga = program.programs(plan)[0]          # what wgpu-native compiles for the same plan
    assert prog.wgsl == program.SUBGROUP_DIRECTIVE + naga.wgsl
    assert prog.bindings == naga.bindings and prog.grid == naga.grid
    plain = program.programs(attnreg.explain(spec, caps=caps, kernel="browser.prefill.f32.wgmem"),
                             dialect=program.TINT)[0]
    assert "enable subgroups" not in plain.wgsl and "subgroupShuffle" not in plain.wgsl


def test_a_job_carries_tensors_as_raw_bytes() -> None:
    from attnreg.backends.browser.runtime import BrowserRuntime
    caps = probe.caps_of(SWIFTSHADER_HELLO)
    spec = attnreg.AttentionSpec(batch=2, seq_len=1, past_len=300, num_heads=8, kv_num_heads=2,
                                 head_size=64, seqlens_k=True)
    t = make_tensors(spec, seed=1)
    plan = attnreg.explain(spec, caps=caps)
    header, blobs, _, _ = BrowserRuntime(caps).job(plan, t)
    assert blobs["k"] == t["k"].tobytes() and blobs["seqlens_k"] == t["seqlens_k"].tobytes()
    msg = wire.encode(header, blobs)
    assert t["k"].tobytes() in msg and len(msg) < 2 * sum(len(b) for b in blobs.values()) + 65536
    head, got = wire.decode(msg)
    assert bytes(got["q"]) == t["q"].tobytes() and head["label"] == header["label"]
    # No tensor travels as JSON numbers: the header holds sources and metadata only.
    assert not any(isinstance(x, list) and len(x) > 64 for x in _values(json.loads(json.dumps(header))))


def _values(x: object) -> Iterator[object]:
    yield x
    if isinstance(x, dict):
        for v in x.values():
            yield from _values(v)
    elif isinstance(x, list):
        for v in x:
            yield from _values(v)


# -- probing --------------------------------------------------------------------------------------
def test_probe_reports_the_browser_adapter() -> None:
    d = require_devices("browser")[0]
    assert d.backend == "browser" and d.driver.startswith("Chromium")
    for name in ("workgroup_storage", "invocations", "storage_binding", "workgroups_per_dim"):
        assert d.limits.get(name, 0) > 0, name
    assert d.extra["adapter_features"] and "userAgent" not in d.extra
    if d.architecture == "swiftshader":
        assert d.slug == "swiftshader" and "subgroups" in d.features
        assert "shader-f16" not in d.features


def test_probe_is_cached_and_ends_its_browser(monkeypatch: pytest.MonkeyPatch) -> None:
    require_devices("browser")
    t0 = time.perf_counter()
    probe.probe()
    assert time.perf_counter() - t0 < 0.05, "the probe is cached per process"
    started: list[chromium.Chromium] = []
    real = chromium.Chromium

    def spy(*a: object, **kw: object) -> chromium.Chromium:
        b = real(*a, **kw)  # type: ignore[arg-type]
        started.append(b)
        return b

    monkeypatch.setattr("attnreg.backends.browser.host.Chromium", spy)
    fresh = probe._probe()
    assert fresh[0].available and len(started) == 1
    assert started[0].pids() == [] and not os.path.exists(started[0].dir)


def test_without_chromium_the_backend_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chromium, "find", lambda: None)
    monkeypatch.delenv(chromium.BINARY_ENV, raising=False)
    (caps,) = probe._probe()
    assert not caps.available and "Chromium is not installed" in caps.reason
    monkeypatch.setenv(probe.DISABLE_ENV, "off")
    assert "disabled" in probe._probe()[0].reason


def test_devices_command_survives_a_missing_chromium() -> None:
    env = {**os.environ, chromium.BINARY_ENV: "/nonexistent/chromium"}
    r = subprocess.run([sys.executable, "-m", "attnreg.tools.cli", "devices"], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "browser" in r.stdout and "/nonexistent/chromium is not an executable" in r.stdout


def test_devices_command_lists_the_browser_adapter() -> None:
    d = require_devices("browser")[0]
    r = subprocess.run([sys.executable, "-m", "attnreg.tools.cli", "devices", "--backend", "browser"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert d.name in r.stdout and "yes" in r.stdout


# -- the page protocol and process hygiene -----------------------------------------------------------
def test_page_runs_a_binary_job_and_caches_pipelines() -> None:
    require_devices("browser")
    x = np.array([1.0, 2.0, -3.5, 4.25], np.float32)
    with BrowserHost("run") as host:
        reply, out = host.call(_job(DOUBLE), {"x": x.tobytes()})
        assert reply["ok"], reply
        np.testing.assert_array_equal(np.frombuffer(bytes(out["x"]), np.float32), 2 * x)
        reply, out = host.call(_job(DOUBLE, source=False), {"x": x.tobytes()})  # cached there
        assert reply["ok"] and reply["ms"]["compile"] < 50
        np.testing.assert_array_equal(np.frombuffer(bytes(out["x"]), np.float32), 2 * x)
        reply, _ = host.call(_job(DOUBLE, "never-sent", source=False), {"x": x.tobytes()})
        assert not reply["ok"] and reply["kind"] == "missing"
        browser = host.browser
        assert browser is not None and len(browser.pids()) >= 3
    assert browser.pids() == [] and not os.path.exists(browser.dir)


def test_page_reports_tints_messages() -> None:
    require_devices("browser")
    with BrowserHost("run") as host:
        reply, _ = host.call(_job(DOUBLE.replace("2.0 *", "2.0 * undefined_name *"), "bad"),
                             {"x": bytes(16)})
    assert not reply["ok"] and reply["kind"] == "compile"
    assert "error at line 4" in reply["error"] and "undefined_name" in reply["error"]


def test_a_timeout_ends_the_browser() -> None:
    require_devices("browser")
    host = BrowserHost("run")
    browser = host.browser
    assert browser is not None
    with pytest.raises(BrowserError, match="timed out"):
        host.call(_job(SLOW, key="slow"), {"x": bytes(16)}, timeout=0.001)
    assert not host.alive() and browser.pids() == [] and not os.path.exists(browser.dir)


def test_a_crashed_browser_is_reported_and_cleaned_up() -> None:
    require_devices("browser")
    host = BrowserHost("run")
    browser = host.browser
    assert browser is not None
    os.kill(browser.pid, signal.SIGKILL)          # the main process only: children linger
    browser.proc.wait(30)
    with pytest.raises(BrowserError, match=r"chromium exited|the page failed"):
        host.call(_job(DOUBLE), {"x": bytes(16)}, timeout=60)
    assert browser.pids() == [] and not os.path.exists(browser.dir)


# -- kernels in the browser, against the reference ---------------------------------------------------
def test_one_browser_per_session_ended_with_it() -> None:
    require_devices("browser")
    spec = attnreg.AttentionSpec(batch=1, seq_len=5, past_len=40, num_heads=4, kv_num_heads=2,
                                 head_size=32, causal=True)
    t = make_tensors(spec, seed=3)
    with attnreg.Session(backend="browser") as s:
        for kernel in ("browser.prefill.f32.wgmem", "browser.decode_partial.f32.m4"):
            out, plan = s.run_with_plan(spec, t, kernel=kernel)
            check_close(spec, out, t, what=kernel)
        rt = s.runtime(plan)
        host = rt.host                                                   # type: ignore[attr-defined]
        assert rt.browsers_started == 1 and rt.pid == host.pid           # type: ignore[attr-defined]
        browser = host.browser
    assert browser.pids() == [] and not os.path.exists(browser.dir)


def test_families_against_the_reference(session: attnreg.Session) -> None:
    spec = attnreg.AttentionSpec(batch=2, seq_len=3, past_len=90, num_heads=6, kv_num_heads=2,
                                 head_size=64, causal=True, seqlens_k=True, head_sink=True,
                                 return_lse=True, kv_capacity=100)
    t = make_tensors(spec, seed=5, lengths=(100, 47))
    for kernel in ("browser.prefill.f32.sg", "browser.prefill.f32.wgmem",
                   "browser.decode_partial.f32.m1", "browser.decode_partial.f32.m2"):
        check_close(spec, session.run(spec, t, kernel=kernel), t, what=kernel)
    o_p, l_p = session.partial_states(spec, t, split_size=32)
    want_o, want_l = ref.partial_states(spec, t, 32)
    np.testing.assert_allclose(o_p, want_o, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(l_p, want_l, atol=2e-4)
    got = session.reduce_states(spec, want_o.astype(np.float32), want_l.astype(np.float32),
                                t["head_sink"])
    check_close(spec, got, t, what="reduce of reference partials")
    o, lse = session.merge_states([(want_o[..., 0, :], want_l[..., 0]),
                                   (want_o[..., 1, :], want_l[..., 1])])
    wo, wl = ref.merge([(want_o[..., 0, :], want_l[..., 0]), (want_o[..., 1, :], want_l[..., 1])])
    np.testing.assert_allclose(o, wo, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(lse, wl, atol=2e-4)


def test_float16_runs_through_the_host_cast_variants(session: attnreg.Session) -> None:
    if "shader-f16" in require_devices("browser")[0].features:
        pytest.skip("this adapter runs float16 natively")
    spec = attnreg.AttentionSpec(batch=1, seq_len=40, past_len=30, num_heads=4, kv_num_heads=1,
                                 head_size=64, dtype="float16", causal=True, bias=True)
    t = make_tensors(spec, seed=7)
    out, plan = session.run_with_plan(spec, t)
    assert out.dtype == np.float16 and ".cast32." in plan.kernel
    check_close(spec, out, t, what=plan.kernel)


@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf", "nan", "1e9"])
def test_a_malformed_job_timeout_is_a_spec_error_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                          value: str) -> None:
    """ATTNREG_BROWSER_TIMEOUT=abc silently meant 300 s."""
    monkeypatch.setenv(TIMEOUT_ENV, value)
    with pytest.raises(attnreg.SpecError) as info:
        job_timeout()
    assert info.value.field == TIMEOUT_ENV
    monkeypatch.setenv(TIMEOUT_ENV, "12.5")
    assert job_timeout() == 12.5


def test_a_malformed_switch_is_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(probe.DISABLE_ENV, "maybe")
    (caps,) = probe._probe()
    assert not caps.available and caps.reason.startswith(f"{probe.DISABLE_ENV}=")
