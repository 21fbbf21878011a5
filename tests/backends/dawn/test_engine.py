"""The dawn backend (wgpudawn: Dawn + Tint in-process; lavapipe through attnreg's Vulkan shim in
CI): the toggles as data, the shim, probe failures that become unavailable devices (never
crashes), and nothing experimental without the opt-in. Its conformance cells run in
tests/conformance/test_dawn_cells.py, Tint compile failures that re-plan in
tests/backends/wgsl/test_tint.py."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import attnreg
from attnreg import vkshim
from attnreg.backends.dawn import device as ddevice
from attnreg.backends.dawn import probe as dprobe
from attnreg.backends.dawn import toggles
from attnreg.backends.webgpu import program
from tests.support import (
    check_close,
    make_tensors,
    missing,
    require_devices,
)


@pytest.fixture(scope="module")
def session():
    require_devices("dawn")
    with attnreg.Session(backend="dawn") as s:
        yield s


# -- the device and what it was set up with ----------------------------------------------------
def test_device_shows_its_toggles_and_the_shim() -> None:
    dev = require_devices("dawn")[0]
    text = "\n".join(dev.settings)
    for t in toggles.in_force():
        assert f"dawn toggle {t.name}={'on' if t.enable else 'off'}" in text, text
    assert "vulkan_enable_f16_on_nvidia=on" in text and "timestamp_quantization=off" in text
    if "llvmpipe" in dev.name and vkshim.lavapipe_manifest():
        assert "pass-through ICD" in text, text        # Debian 12's lavapipe needs it
    plan = attnreg.explain(attnreg.AttentionSpec(batch=1, seq_len=1, past_len=63, num_heads=2,
                                                 kv_num_heads=2, head_size=32), backend="dawn")
    assert "dawn toggle timestamp_quantization=off" in plan.explain()


def test_cli_devices_lists_the_set_up(capsys: pytest.CaptureFixture[str]) -> None:
    require_devices("dawn")
    from attnreg.tools import cli

    assert cli.main(["devices", "--backend", "dawn"]) == 0
    out = capsys.readouterr().out
    assert "dawn:0 set-up:" in out and "allow_unsafe_apis=on" in out


def test_nothing_experimental_without_the_opt_in(session: attnreg.Session) -> None:
    spec = attnreg.AttentionSpec(batch=1, seq_len=1, past_len=15, num_heads=2, kv_num_heads=2,
                                 head_size=32)
    plan = session.plan(spec)
    dev = ddevice.get(plan.caps)
    assert not set(dev.features) & set(dprobe.EXPERIMENTAL)
    assert set(dev.features) <= set(dprobe.REQUEST)
    from attnreg import flags, registry

    registry.get()                                       # plugins' flags are declared
    assert flags.table()["experimental_features"].default is False


def test_programs_are_built_for_tint(session: attnreg.Session) -> None:
    spec = attnreg.AttentionSpec(batch=1, seq_len=64, past_len=0, num_heads=2, kv_num_heads=2,
                                 head_size=32, causal=True)
    plan = session.plan(spec, flags={"force_kernel": "dawn.prefill.f32.sg"})
    (prog,) = program.programs(plan, plan.caps, dialect=ddevice.get(plan.caps).dialect)
    assert prog.wgsl.lstrip().startswith("enable subgroups;"), prog.wgsl[:80]


def test_results_equal_the_webgpu_backend_on_the_same_adapter() -> None:
    """The same WGSL through naga and through Tint: both within tolerance of the reference."""
    require_devices("dawn")
    require_devices("webgpu")
    spec = attnreg.AttentionSpec(batch=2, seq_len=3, past_len=77, num_heads=8, kv_num_heads=2,
                                 head_size=64, dtype="float16", causal=True, seqlens_k=True,
                                 softcap=20.0, local_window=40)
    t = make_tensors(spec, seed=5)
    got = {b: attnreg.run(spec, t, backend=b) for b in ("dawn", "webgpu")}
    for b, out in got.items():
        check_close(spec, out, t, what=b)
    assert np.isfinite(got["dawn"].astype(np.float32)).all()


# -- toggles as data -----------------------------------------------------------------------
def test_toggle_table_says_why_and_where() -> None:
    names = {t.name: t for t in toggles.TOGGLES}
    assert {"allow_unsafe_apis", "vulkan_enable_f16_on_nvidia", "timestamp_quantization"} <= set(names)
    assert names["timestamp_quantization"].enable is False
    assert names["allow_unsafe_apis"].stage == "instance"
    assert all(t.why and t.stage in ("instance", "adapter", "device") for t in toggles.TOGGLES)


def test_environment_edits_the_toggles(monkeypatch: pytest.MonkeyPatch) -> None:
    known = {"allow_unsafe_apis": "instance", "dump_shaders": "device",
             "timestamp_quantization": "device", "vulkan_enable_f16_on_nvidia": "adapter",
             "disable_workgroup_init": "device", "disable_robustness": "device"}
    monkeypatch.setenv(toggles.ENV, "!allow_unsafe_apis,+dump_shaders,+timestamp_quantization")
    got = {t.name: t for t in toggles.in_force(known)}
    assert "allow_unsafe_apis" not in got
    assert got["dump_shaders"].enable and got["dump_shaders"].stage == "device"
    assert got["timestamp_quantization"].enable and got["timestamp_quantization"].source == toggles.ENV
    monkeypatch.setenv(toggles.ENV, "+no_such_toggle")
    with pytest.raises(ValueError, match="no_such_toggle"):
        toggles.in_force(known)
    monkeypatch.setenv(toggles.ENV, "allow_unsafe_apis")
    with pytest.raises(ValueError, match=r"\+name"):
        toggles.in_force(known)


def test_robustness_follows_the_shared_checks_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(toggles.CHECKS_ENV, "none")
    assert "disable_robustness" in {t.name for t in toggles.in_force()}
    monkeypatch.setenv(toggles.CHECKS_ENV, "bounds")
    assert "disable_robustness" not in {t.name for t in toggles.in_force()}


# -- failures become unavailable devices -----------------------------------------------------
def _fresh_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dprobe, "_ADAPTERS", None)
    monkeypatch.setattr(dprobe, "_FAILED", None)


def test_missing_package_is_an_unavailable_device(monkeypatch: pytest.MonkeyPatch) -> None:
    _fresh_probe(monkeypatch)
    monkeypatch.setattr(dprobe, "version", lambda: None)
    (caps,) = dprobe.probe()
    assert not caps.available and "pip install 'attnreg[dawn]'" in caps.reason
    assert dprobe.PINNED in caps.reason


@pytest.mark.parametrize(("var", "value"), [
    (toggles.ENV, "allow_unsafe_apis"),                # not +name / -name / !name
    (toggles.ENV, "+no_such_toggle"),                  # Dawn has none: found in the child
    (vkshim.ENV, "/etc/passwd"),                       # not an ICD manifest
    (dprobe.DISABLE_ENV, "maybe"),
])
def test_a_malformed_variable_is_the_reason_not_a_traceback(monkeypatch: pytest.MonkeyPatch,
                                                            var: str, value: str) -> None:
    """A bad ATTNREG_DAWN_TOGGLES showed the probe child's traceback as the reason, and
    ATTNREG_VK_SHIM=/etc/passwd read "Dawn found no adapter": the reason is now the
    SpecError's message, naming the variable."""
    if dprobe.version() is None:
        missing("wgpudawn is not installed")
    _fresh_probe(monkeypatch)
    monkeypatch.setenv(var, value)
    (caps,) = dprobe.probe()
    assert not caps.available and caps.reason.startswith(f"{var}=") and "expected" in caps.reason
    assert "Traceback" not in caps.reason


def test_disabled_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    _fresh_probe(monkeypatch)
    monkeypatch.setenv(dprobe.DISABLE_ENV, "0")
    (caps,) = dprobe.probe()
    assert not caps.available and dprobe.DISABLE_ENV in caps.reason


def test_a_dawn_that_crashes_costs_a_child_not_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    _fresh_probe(monkeypatch)
    monkeypatch.setattr(dprobe, "_CHILD", "import os, sys; print('dawn blew up', file=sys.stderr); "
                                          "sys.stderr.flush(); os.abort()")
    (caps,) = dprobe.probe()
    assert not caps.available
    assert "crashed" in caps.reason and "signal 6" in caps.reason and "dawn blew up" in caps.reason


# -- the Vulkan shim -----------------------------------------------------------------------------
def test_shim_swaps_lavapipe_in_the_driver_list(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    shim = tmp_path / "shim.json"
    shim.write_text('{"ICD": {"library_path": "/x/libshim.so"}}')
    monkeypatch.setenv(vkshim.ENV, str(shim))
    monkeypatch.setenv("VK_DRIVER_FILES", "/x/nvidia_icd.json:/usr/share/vulkan/icd.d/lvp_icd.x86_64.json")
    monkeypatch.delenv("VK_ICD_FILENAMES", raising=False)
    assert vkshim.driver_files() == f"/x/nvidia_icd.json:{shim}"
    with vkshim.loader_env() as files:
        assert os.environ["VK_DRIVER_FILES"] == files == os.environ["VK_ICD_FILENAMES"]
    assert os.environ["VK_DRIVER_FILES"].endswith("lvp_icd.x86_64.json")
    assert "VK_ICD_FILENAMES" not in os.environ
    monkeypatch.setenv("VK_DRIVER_FILES", "/x/nvidia_icd.json")
    assert vkshim.driver_files() is None                  # no lavapipe named: nothing to swap
    monkeypatch.setenv(vkshim.ENV, "0")
    monkeypatch.setenv("VK_DRIVER_FILES", "/usr/share/vulkan/icd.d/lvp_icd.x86_64.json")
    assert vkshim.driver_files() is None                  # turned off


def test_shim_build_is_idempotent_and_makes_an_icd(monkeypatch: pytest.MonkeyPatch) -> None:
    if vkshim.lavapipe_manifest() is None:
        missing("no lavapipe on this machine (the shim is for it)")
    monkeypatch.delenv(vkshim.ENV, raising=False)
    for v in vkshim.LOADER_VARS:
        monkeypatch.delenv(v, raising=False)
    first = vkshim.build()
    stamp = (first.parent / vkshim.LIBRARY).stat().st_mtime_ns
    again = vkshim.build()
    assert again == first and (first.parent / vkshim.LIBRARY).stat().st_mtime_ns == stamp
    import json

    icd = json.loads(first.read_text())["ICD"]
    assert icd["library_path"].endswith(vkshim.LIBRARY) and os.path.isfile(icd["library_path"])
    nm = subprocess.run(["nm", "-D", "--defined-only", icd["library_path"]], capture_output=True,
                        text=True)
    if nm.returncode == 0:                               # binutils present
        exported = {ln.split()[-1] for ln in nm.stdout.splitlines() if ln.strip()}
        assert {"vk_icdGetInstanceProcAddr", "vk_icdNegotiateLoaderICDInterfaceVersion",
                "vk_icdGetPhysicalDeviceProcAddr"} <= exported
        assert not {s for s in exported if s.startswith("shim_")}    # only the ICD entry points


def test_dawn_sees_lavapipe_only_through_the_shim() -> None:
    """In a fresh process: no shim, no lavapipe adapter for Dawn; with it, one."""
    if vkshim.lavapipe_manifest() is None or vkshim.manifest() is None:
        missing("needs lavapipe and the built shim")
    code = ("import sys; from attnreg.backends.dawn import probe as p\n"
            "print(len(p._enumerate()))")
    counts = {}
    for mode in ("0", ""):
        env = {**os.environ, vkshim.ENV: mode} if mode else dict(os.environ)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=120)
        assert done.returncode == 0, done.stderr[-800:]
        counts[mode or "shim"] = int(done.stdout.split()[-1])
    gpus = counts["0"]            # hardware adapters Dawn accepts without the shim (none in CI)
    assert counts["shim"] == gpus + 1, counts


def test_sessions_in_threads_share_the_device_safely() -> None:
    """Three Sessions (one shared Dawn device) in three threads. Without Dawn's
    implicit-device-synchronization this segfaulted 6 of 6 runs; run in a child process so a
    crash fails this test instead of taking the test worker down."""
    require_devices("dawn")
    code = """
import threading, attnreg
from attnreg.testing import make_tensors, expected, compare
SPEC = attnreg.AttentionSpec(batch=1, seq_len=2, past_len=20, num_heads=4, kv_num_heads=2,
                             head_size=32)
bad = []
def hammer(s, seed):
    for i in range(40):
        spec = SPEC.replace(past_len=10 + (seed * 7 + i) % 20)
        t = make_tensors(spec, seed * 1000 + i)
        _, problem = compare(spec, s.run(spec, t), expected(spec, t))
        if problem:
            bad.append(problem)
        x = s.tensor(t["q"]); x.numpy(); x.free()
ss = [attnreg.Session(backend="dawn") for _ in range(3)]
th = [threading.Thread(target=hammer, args=(ss[i], i)) for i in range(3)]
[t.start() for t in th]; [t.join() for t in th]
print("wrong results:", bad)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"status {done.returncode}: {done.stderr[-1500:]}"
    assert "wrong results: []" in done.stdout, done.stdout


def test_prefill_and_reduce_keep_memory_flat() -> None:
    """The lavapipe leak (tests/core/test_soak.py KNOWN_LEAKS) is confined to the decode kernels:
    prefill and reduce on dawn grow nothing over 150 runs."""
    import gc

    from tests.core.test_soak import rss_mib

    dev = require_devices("dawn")[0]
    pre = attnreg.AttentionSpec(batch=1, seq_len=64, past_len=0, num_heads=4, kv_num_heads=2,
                                head_size=32, dtype="float16", causal=True)
    dec = attnreg.AttentionSpec(batch=2, seq_len=1, past_len=100, num_heads=4, kv_num_heads=2,
                                head_size=32, dtype="float16")
    with attnreg.Session(backend="dawn", device=dev.id) as s:
        tp, td = make_tensors(pre, seed=0), make_tensors(dec, seed=1)
        o, lse = s.partial_states(dec, td, split_size=32)
        steps = (lambda: s.run(pre, tp), lambda: s.reduce_states(dec, o, lse))
        for f in steps:
            for _ in range(20):
                f()
        gc.collect()
        rss0 = rss_mib()
        for _ in range(150):
            for f in steps:
                f()
        gc.collect()
        assert rss_mib() - rss0 < 10, f"RSS grew {rss_mib() - rss0:.1f} MiB"
    if dev.slug == "llvmpipe":
        assert any("0.6 MB per decode dispatch" in x for x in dev.settings), dev.settings


def test_the_opt_in_reaches_a_separate_device() -> None:
    """experimental_features=true gives the Session the Dawn device that also requests the
    adapter's experimental features (none on lavapipe; the H100's subgroup matrices were
    checked by hand through it: a 16x16x16 f16 product, max error 9e-7)."""
    dev = require_devices("dawn")[0]
    spec = attnreg.AttentionSpec(batch=1, seq_len=1, past_len=15, num_heads=2, kv_num_heads=2,
                                 head_size=32)
    t = make_tensors(spec, seed=9)
    with attnreg.Session(backend="dawn", flags={"experimental_features": True}) as s:
        rt = s.runtime(s.plan(spec))
        assert rt.dev.experimental and rt.dev is not ddevice.get(dev, False)
        assert set(rt.dev.features) >= set(dprobe.REQUEST) & set(dev.extra["adapter_features"])
        assert set(rt.dev.features) - set(dprobe.REQUEST) == \
            set(dprobe.EXPERIMENTAL) & set(dev.extra["adapter_features"])
        check_close(spec, s.run(spec, t), t, what="experimental device")
    with attnreg.Session(backend="dawn") as s:
        assert not s.runtime(s.plan(spec)).dev.experimental
