"""Plugin loading is atomic (issue [trust]): a plugin module that exits, raises
KeyboardInterrupt or whose hook raises is reported as broken, and every other backend
still loads."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

import attnreg
from attnreg import registry as regmod


def _plugin_module(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, body: str) -> str:
    name = f"trust_plugin_{abs(hash(body)) % 10**8}_{len(list(tmp_path.iterdir()))}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_a_plugin_that_exits_is_broken_and_the_others_load(tmp_path: Any,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    name = _plugin_module(tmp_path, monkeypatch, "raise SystemExit(3)\n")
    monkeypatch.setenv("ATTNREG_PLUGINS", name)
    reg = regmod.Registry()
    assert "SystemExit" in reg.broken_plugins()[name]
    assert reg.devices("reference")[0].available
    assert any(d.backend == name and not d.available for d in reg.devices("reference") +
               [c for c in reg.devices() if c.backend == name])


def test_an_interrupted_load_is_retried(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt while plugins load (a module raising it, or Ctrl-C at the first
    call) left every later call failing with "installed backends []", reference included."""
    name = _plugin_module(tmp_path, monkeypatch, "raise KeyboardInterrupt\n")
    monkeypatch.setenv("ATTNREG_PLUGINS", name)
    reg = regmod.Registry()
    with pytest.raises(KeyboardInterrupt):
        reg.backends()
    monkeypatch.delenv("ATTNREG_PLUGINS")          # Ctrl-C was the caller's: the next load
    assert "reference" in reg.backends() and name not in reg.broken_plugins()
    monkeypatch.setenv("ATTNREG_PLUGINS", name)
    again = regmod.Registry()
    with pytest.raises(KeyboardInterrupt):
        again.backends()
    assert "reference" in again.backends()         # raised twice: the module is broken
    assert "KeyboardInterrupt" in again.broken_plugins()[name]


def test_a_plugin_whose_hook_raises_is_reported_and_refused(tmp_path: Any,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    body = ("import attnreg\n@attnreg.hookimpl\ndef attnreg_register_backends(register):\n"
            "    raise RuntimeError('no GPU here')\n")
    name = _plugin_module(tmp_path, monkeypatch, body)
    monkeypatch.setenv("ATTNREG_PLUGINS", name)
    reg = regmod.Registry()
    assert "no GPU here" in reg.broken_plugins()[name]
    assert {"reference", "webgpu", "opencl"} <= set(reg.backends())
    with pytest.raises(attnreg.SpecError, match="no GPU here"):
        regmod.get().register_plugin(importlib.import_module(name), name="raising")
    assert regmod.get().backend("reference") is not None
