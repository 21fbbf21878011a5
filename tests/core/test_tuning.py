"""attnreg tune: measured parameters are stored per device and used only with the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

import attnreg
from attnreg import tuned as tuning
from attnreg.profiles import profiles
from attnreg.tools import tune


def test_tune_stores_and_rules_use_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNREG_CACHE_DIR", str(tmp_path))
    spec = attnreg.AttentionSpec(batch=1, seq_len=1, past_len=1023, num_heads=4, kv_num_heads=2,
                                 head_size=16)
    with attnreg.Session(backend="reference") as s:
        entry = tune.tune(s, spec, iters=2, warmup=1, log=lambda m: None)
    assert (tmp_path / "tuning.json").exists()
    assert entry["kernel"] == "reference.decode_partial"
    assert entry["us"] <= entry["rule_default_us"]
    plain = attnreg.explain(spec, backend="reference")
    tuned = attnreg.explain(spec, backend="reference", flags={"use_tuning_cache": True})
    assert not any(r.startswith("tuning_cache") for r in plain.rules)
    fired = [r for r in tuned.rules if r.startswith("tuning_cache")]
    assert fired, tuned.explain()
    assert tuned.split is not None and tuned.split.n_splits == tuned.params["n_splits"]
    ss = tuned.params["split_size"]
    assert ss == entry["params"].get("split_size", plain.params["split_size"])
    assert tuned.params["n_splits"] == -(-spec.capacity // ss)
    assert tuned.stage("reduce").params["n_splits"] == tuned.params["n_splits"]


def test_family_key_buckets_nearby_specs() -> None:
    a = attnreg.AttentionSpec(seq_len=1, past_len=1500, num_heads=8, head_size=64)
    b = a.replace(past_len=1800)
    c = a.replace(past_len=3000)
    assert tuning.family_key("decode_partial", a) == tuning.family_key("decode_partial", b)
    assert tuning.family_key("decode_partial", a) != tuning.family_key("decode_partial", c)


def test_split_kv_kernels_tune_the_split_size():
    spec = attnreg.AttentionSpec(batch=1, seq_len=1, past_len=4095, num_heads=32, kv_num_heads=8,
                                 head_size=128, dtype="float16")
    for family in ("decode_partial", "decode_fused"):
        cands = tune.candidates({"kv_tile": 32}, {"wg": (64, 128)}, spec, family)
        sizes = {c["split_size"] for c in cands}
        assert {32, 128, 4096} <= sizes and all(s % 32 == 0 for s in sizes), (family, sizes)
        assert {c["wg"] for c in cands} == {64, 128}
    assert all("split_size" not in c
               for c in tune.candidates({}, {"wg": (64,)}, spec, "prefill"))


def test_tuned_parameters_stand_against_later_rules(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuning cache's rule runs before the plugins' rules; what it set stays (here the
    WebGPU rule that gives NVIDIA's scalar prefill its sliced tiles would replace tuned
    keys-layout tiles)."""
    monkeypatch.setenv("ATTNREG_CACHE_DIR", str(tmp_path))
    caps = profiles()["nvidia-h100"]
    spec = attnreg.AttentionSpec(batch=1, seq_len=2048, past_len=0, num_heads=32,
                                 kv_num_heads=8, head_size=128, dtype="float16", causal=True)
    reg = attnreg.registry.get()
    plain = reg.plan(spec, caps=caps)
    assert (plain.params["q_tile"], plain.params["row_lanes"]) == (64, 8)
    assert any(r.startswith("webgpu_sliced_prefill_nvidia") for r in plain.rules)
    tuning.store(caps, "prefill", spec, {
        "kernel": plain.kernel, "params": {"q_tile": 32, "row_lanes": 16}, "us": 1.0,
        "rule_default_us": 2.0})
    tuned = reg.plan(spec, caps=caps, flags={"use_tuning_cache": True})
    assert tuned.kernel == plain.kernel
    assert (tuned.params["q_tile"], tuned.params["row_lanes"]) == (32, 16), tuned.explain()
    assert tuned.params.get("qk_layout", "keys") == "keys"
    assert not any(r.startswith("webgpu_sliced_prefill_nvidia") for r in tuned.rules)
