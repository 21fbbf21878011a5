"""attnreg's environment variables are checked (attnreg/env.py, docs/errors.md "Environment
variables"): a malformed value is a SpecError naming the variable, read where the variable
is used, never a silent default and never a failure that names something else (a kernel that
"failed to compile", a device "with no adapter"). Probe-time variables make the device
unavailable with that message: tests/backends/<name>/ check those on fresh probes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import attnreg
from attnreg import registry as regmod
from attnreg import vkshim
from attnreg.testing import make_tensors

SPEC = attnreg.AttentionSpec(batch=1, seq_len=1, past_len=9, num_heads=2, kv_num_heads=1,
                             head_size=16)
WEBGPU = [d for d in attnreg.devices() if d.available and d.backend in ("webgpu", "dawn")]


def _run(s: attnreg.Session) -> Any:
    return s.run(SPEC, make_tensors(SPEC, seed=1))


# (variable, malformed value, the call that reads it)
CALL_TIME: list[tuple[str, str, Callable[[attnreg.Session], Any]]] = [
    ("ATTNREG_FLAGS", "route", lambda s: s.plan(SPEC)),
    ("ATTNREG_FLAGS", "nope=1", lambda s: s.plan(SPEC)),
    ("ATTNREG_CACHE_DIR", "relative/dir",
     lambda s: s.plan(SPEC, flags={"use_tuning_cache": True})),
    ("ATTNREG_CACHE_DIR", "/tmp/\x01bad", lambda s: s.plan(SPEC, flags={"use_tuning_cache": True})),
    ("ATTNREG_VK_SHIM", "/etc/passwd", lambda s: vkshim.manifest()),
    ("ATTNREG_VK_SHIM", "/no/such/file.json", lambda s: vkshim.manifest()),
]
# read at each compile and each read-back of the WebGPU hosts (webgpu, Dawn)
DEVICE_TIME = [("ATTNREG_WGSL_CHECKS", "paranoid"), ("ATTNREG_DEVICE_TIMEOUT", "abc"),
               ("ATTNREG_DEVICE_TIMEOUT", "-1"), ("ATTNREG_DEVICE_TIMEOUT", "nan")]


@pytest.mark.parametrize(("var", "value", "call"), CALL_TIME,
                         ids=[f"{v}={x!r}" for v, x, _ in CALL_TIME])
def test_a_malformed_variable_is_a_spec_error_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                        var: str, value: str, call: Any) -> None:
    with attnreg.Session(backend="reference") as s:
        monkeypatch.setenv(var, value)
        with pytest.raises(attnreg.SpecError) as info:
            call(s)
    assert info.value.field == var, str(info.value)


@pytest.mark.parametrize("dev", WEBGPU, ids=[f"{d.backend}-{d.slug}" for d in WEBGPU])
def test_webgpu_hosts_name_the_variable_then_run(monkeypatch: pytest.MonkeyPatch,
                                                 dev: attnreg.DeviceCaps) -> None:
    """A bad ATTNREG_WGSL_CHECKS was a "WGSL compile failed" (the kernel then counted as
    failed on the device); a bad read-back bound is refused before the map."""
    for var, value in DEVICE_TIME:
        with attnreg.Session(backend=dev.backend, device=dev.id) as s:
            monkeypatch.setenv(var, value)
            with pytest.raises(attnreg.SpecError) as info:
                _run(s)
            assert info.value.field == var, str(info.value)
            monkeypatch.delenv(var)
    with attnreg.Session(backend=dev.backend, device=dev.id) as s:
        assert np.isfinite(_run(s)).all()


def test_a_malformed_plugin_list_is_a_broken_entry_and_reference_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(regmod.PLUGINS_ENV, "tests.toy_plugin, not a module!, os;rm")
    reg = regmod.Registry()
    broken = reg.broken_plugins()
    bad = [why for why in broken.values() if regmod.PLUGINS_ENV in why]
    assert len(bad) == 2 and all("module names" in why for why in bad), broken
    assert "reference" in reg.backends() and reg.devices("reference")[0].available
