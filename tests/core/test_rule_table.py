"""The routing policy is a table of named rules: each says why in one sentence and names the
ci/results/ files that measured it, and explain shows the rules that fire, the forced route
and the fallback order included."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import attnreg
from attnreg import registry
from attnreg.rules import RULE_NUMBERS
from attnreg.spec import AttentionSpec

ROOT = Path(__file__).resolve().parents[2]
# A why that quotes a benchmark: times, speed-ups, percentages (those live in ci/results/).
NUMBERS = re.compile(r"\d(\.\d+)?\s?(us|ms)\b|\d(\.\d+)?x\b|\d%")
DECODE = AttentionSpec(seq_len=1, past_len=63, num_heads=4, kv_num_heads=2, head_size=16)


def _rules() -> list[attnreg.Rule]:
    return list(registry.get().rules())


def test_rule_names_are_unique() -> None:
    names = [r.name for r in _rules()]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("rule", _rules(), ids=lambda r: r.name)
def test_why_is_one_sentence_without_numbers(rule: attnreg.Rule) -> None:
    why = rule.why
    assert not re.search(r"[.;]\s", why) and not why.endswith("."), why
    assert len(why) <= 220, (len(why), why)
    assert not NUMBERS.search(why), f"{rule.name}: measurements belong in ci/results/: {why}"


@pytest.mark.parametrize("rule", [r for r in _rules() if r.measured], ids=lambda r: r.name)
def test_measured_names_files_of_ci_results(rule: attnreg.Rule) -> None:
    for path in rule.measured:
        assert path.startswith("ci/results/") and (ROOT / path).is_file(), path
    if RULE_NUMBERS in rule.measured:
        headings = re.findall(r"^## (.+)$", (ROOT / RULE_NUMBERS).read_text(), re.M)
        assert any(rule.name in re.split(r",\s*", h) for h in headings), \
            f"{RULE_NUMBERS} has no section for {rule.name}"


def test_every_rule_section_has_its_rule() -> None:
    """No orphaned numbers: each section of the file belongs to a rule that cites it."""
    citing = {r.name for r in _rules() if RULE_NUMBERS in r.measured}
    text = (ROOT / RULE_NUMBERS).read_text()
    for heading in re.findall(r"^## (.+)$", text, re.M):
        assert set(re.split(r",\s*", heading)) & citing, heading


def test_explain_shows_a_forced_route() -> None:
    plan = attnreg.explain(DECODE, backend="reference", kernel="reference.prefill")
    assert plan.route == "prefill"            # the decode rows would route split-KV
    assert plan.rules[0].startswith("forced_kernel:") and plan.rules[0].endswith("route=prefill")
    assert "forced_kernel: a forced kernel runs on the route of its family" in plan.explain()


def test_explain_shows_the_fallback_route() -> None:
    caps = attnreg.devices("reference")[0]
    plan = registry.get().plan(DECODE, caps=caps,
                               exclude={(caps.id, "reference.decode_partial"): "left out here"})
    assert plan.route == "prefill" and plan.kernels == ("reference.prefill",)
    fired = [r for r in plan.rules if r.startswith("fallback_other_routes:")]
    assert fired and fired[0].endswith("-> route=prefill (route split_kv found no kernel on "
                                       "this device)"), plan.rules
    assert "fallback_other_routes" in plan.explain()
    plain = attnreg.explain(DECODE, caps=caps)
    assert plain.route == "split_kv" and not any(r.startswith("fallback") for r in plain.rules)


def test_a_fixed_route_has_no_fallback() -> None:
    caps = attnreg.devices("reference")[0]
    left_out = {(caps.id, "reference.decode_partial"): "left out here"}
    for how in ({"flags": {"route": "split_kv"}}, {"kernel": "reference.reduce"}):
        with pytest.raises(attnreg.NoKernelError, match="left out here"):
            registry.get().plan(DECODE, caps=caps, exclude=left_out, **how)


def test_explain_names_the_measurement() -> None:
    plan = attnreg.explain(DECODE, backend="reference")
    line = next(r for r in plan.rules if r.startswith("split_size_fill_device:"))
    assert "(measured: ci/results/h100_split_sweep.txt)" in line
