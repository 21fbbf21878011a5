"""`attnreg export-wgsl`: the exported ES module, loaded in headless Chromium the way a web
app would use it, must match the float64 reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import attnreg
from attnreg.backends.browser import export
from attnreg.backends.browser.host import BrowserError
from tests.support import require_devices

DECODE = attnreg.AttentionSpec(batch=2, seq_len=1, past_len=299, num_heads=8, kv_num_heads=2,
                               head_size=64, causal=True, seqlens_k=True, return_lse=True,
                               kv_capacity=320)
PREFILL = attnreg.AttentionSpec(batch=1, seq_len=37, past_len=20, num_heads=4, kv_num_heads=4,
                                head_size=80, causal=True, bias=True, softcap=5.0,
                                q_layout="BNSH", kv_layout="BSNH", head_sink=True)


def test_export_writes_the_plan_the_module_and_a_readme(tmp_path: Path) -> None:
    res = export.export(DECODE, str(tmp_path))
    assert res.plan.route == "split_kv" and len(res.programs) == 2
    assert set(res.files) == {"0_decode_partial.wgsl", "1_reduce.wgsl", "attention.js",
                              "plan.txt", "README.md"}
    js = (tmp_path / "attention.js").read_text()
    assert "export async function createAttention" in js and "export const PARAMS" in js
    assert "cast32" not in js and "enable subgroups" not in js     # default limits, no subgroups
    assert (tmp_path / "0_decode_partial.wgsl").read_text() == res.programs[0].wgsl
    readme = (tmp_path / "README.md").read_text()
    assert "import {requestDevice, createAttention" in readme and "attention.run(" in readme


def test_exported_decode_module_matches_the_reference(tmp_path: Path) -> None:
    require_devices("browser")
    export.export(DECODE, str(tmp_path))
    _, problem = export.check(str(tmp_path), DECODE, seed=1, lengths=(320, 111))
    assert not problem, problem


def test_exported_prefill_module_with_a_broadcast_bias(tmp_path: Path) -> None:
    require_devices("browser")
    res = export.export(PREFILL, str(tmp_path), "browser")     # SwiftShader's caps: subgroups
    assert res.plan.route == "prefill"
    _, problem = export.check(str(tmp_path), PREFILL, seed=2,
                                bias_shape=(1, PREFILL.num_heads, 1, PREFILL.capacity))
    assert not problem, problem


def test_export_command_checks_in_chromium(tmp_path: Path) -> None:
    require_devices("browser")
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps({"batch": 1, "seq_len": 3, "past_len": 60, "num_heads": 4,
                                     "kv_num_heads": 1, "head_size": 32, "local_window": 16}))
    r = subprocess.run([sys.executable, "-m", "attnreg.tools.cli", "export-wgsl", "--spec",
                        str(spec_file), "--out", str(tmp_path / "out"), "--check"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "within tolerance" in r.stdout and (tmp_path / "out" / "attention.js").exists()


def test_a_float16_module_says_what_the_adapter_lacks(tmp_path: Path) -> None:
    dev = require_devices("browser")[0]
    spec = DECODE.replace(dtype="float16")
    export.export(spec, str(tmp_path))
    js = (tmp_path / "attention.js").read_text()
    assert 'REQUIRED_FEATURES = ["shader-f16"]' in js and "enable f16;" in js
    if "shader-f16" in dev.features:
        assert not export.check(str(tmp_path), spec)[1]
        return
    with pytest.raises(BrowserError, match="adapter lacks feature shader-f16"):
        export.check(str(tmp_path), spec)


def test_unknown_caps_name_the_choices() -> None:
    with pytest.raises(attnreg.SpecError, match="browser-profile"):
        export.export(DECODE, "/nonexistent", "no-such-caps")
