"""Registry, planning, explain, flags and Session behaviour, through a third-party-style plugin."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import attnreg
from attnreg import registry as regmod
from tests.support import check_close, make_tensors
from tests.toy_plugin import ToyPlugin


@pytest.fixture
def toy() -> Iterator[ToyPlugin]:
    plugin = ToyPlugin()
    attnreg.register_plugin(plugin, name="toy-test")
    try:
        yield plugin
    finally:
        attnreg.unregister_plugin(name="toy-test")


PREFILL = attnreg.AttentionSpec(batch=1, seq_len=40, past_len=0, num_heads=2, head_size=16)
DECODE = attnreg.AttentionSpec(batch=1, seq_len=1, past_len=100, num_heads=4, kv_num_heads=2,
                               head_size=16)


def test_builtin_plugins_come_from_entry_points() -> None:
    names = set(regmod.get().backends())
    assert {"reference", "webgpu", "opencl"} <= names | set(regmod.get().broken_plugins())
    assert "reference" in names


def test_runtime_plugin_is_listed_and_chosen_when_it_fits(toy: ToyPlugin) -> None:
    assert any(d.backend == "toy" and d.name == "Toy GPU 9000" for d in attnreg.devices())
    assert {k.id for k in attnreg.kernels("toy")} >= {"toy.prefill.f32", "toy.reduce.f32"}
    plan = attnreg.explain(PREFILL)
    assert plan.backend == "toy" and plan.kernel == "toy.prefill.f32.broken"  # highest priority
    assert "tuned for otherco" in " ".join(plan.rejected["toy.prefill.f32.toyco_tuned"])
    assert "unobtainium" in " ".join(plan.rejected["toy.prefill.f32.needs_unobtainium"])
    assert toy.backend.opened == 0, "explain must not open devices or compile anything"


def test_compile_failure_becomes_a_reason_and_next_candidate_runs(toy: ToyPlugin) -> None:
    t = make_tensors(PREFILL, seed=1)
    with attnreg.Session() as s:
        out, plan = s.run_with_plan(PREFILL, t)
        assert plan.kernel == "toy.prefill.f32"
        assert "toy compiler: error at 1:1" in " ".join(plan.rejected["toy.prefill.f32.broken"])
        check_close(PREFILL, out, t)
        s.run(PREFILL, t)
    assert toy.backend.launched == [("toy.prefill.f32.broken",), ("toy.prefill.f32",),
                                    ("toy.prefill.f32",)]
    assert toy.backend.opened == 1, "one runtime per device per session"


def test_rejections_fall_through_to_the_next_device(toy: ToyPlugin) -> None:
    big = PREFILL.replace(head_size=128, softcap=2.0)     # toy supports neither
    plan = attnreg.explain(big)
    assert plan.backend != "toy"
    reasons = plan.rejected["toy.prefill.f32"]
    assert any("head_size 128 outside 8..64" in r for r in reasons)
    assert any("does not implement softcap" in r for r in reasons)
    assert any("workgroup storage" in r for r in reasons)
    text = plan.explain()
    assert "toy.prefill.f32" in text and "softcap" in text


def test_no_kernel_error_lists_every_candidate(toy: ToyPlugin) -> None:
    big = PREFILL.replace(head_size=128, dtype="float16")
    with pytest.raises(attnreg.NoKernelError) as info:
        attnreg.explain(big, backend="toy")
    msg = str(info.value)
    for k in attnreg.kernels("toy"):
        assert k.id in msg
    assert "dtype float16 not in ['float32']" in msg
    assert isinstance(info.value, attnreg.SpecError)


def test_split_kv_route_picks_m_tile_variant_by_rule(toy: ToyPlugin) -> None:
    plan = attnreg.explain(DECODE, backend="toy")
    assert plan.route == "split_kv" and plan.kernels == ("toy.decode_partial.f32.m1",
                                                          "toy.reduce.f32")
    assert any(r.startswith("split_kv_few_rows") for r in plan.rules)
    assert "the rules chose m_tile=1" in " ".join(plan.rejected["toy.decode_partial.f32.m4"])
    p4 = attnreg.explain(DECODE.replace(seq_len=4), backend="toy")
    assert p4.kernel == "toy.decode_partial.f32.m4"
    st = plan.stage("decode_partial").params
    assert st["split_size"] % 16 == 0 and st["n_splits"] * st["split_size"] >= DECODE.capacity
    assert plan.stage("reduce").params["n_splits"] == st["n_splits"]


def test_forced_kernel_bypasses_preferences_not_capabilities(toy: ToyPlugin) -> None:
    plan = attnreg.explain(PREFILL, kernel="toy.prefill.f32.toyco_tuned")
    assert plan.kernel == "toy.prefill.f32.toyco_tuned"
    with pytest.raises(attnreg.NoKernelError, match="unobtainium"):
        attnreg.explain(PREFILL, kernel="toy.prefill.f32.needs_unobtainium")
    plan = attnreg.explain(DECODE, flags={"force_kernel": "toy.decode_partial.f32.m4"})
    assert plan.kernels == ("toy.decode_partial.f32.m4", "toy.reduce.f32")


def test_route_flag_and_params(toy: ToyPlugin) -> None:
    plan = attnreg.explain(DECODE, backend="toy", flags={"route": "prefill"})
    assert plan.route == "prefill"
    plan = attnreg.explain(DECODE, backend="toy", flags={"split_size": 32})
    assert plan.params["split_size"] == 32 and plan.params["n_splits"] == 4
    t = make_tensors(DECODE, seed=3)
    o_parts, lse_parts = attnreg.partial_states(DECODE, t, split_size=48, backend="toy")
    assert o_parts.shape[3] == 3 and o_parts.dtype == np.float32
    out = attnreg.reduce_states(DECODE, o_parts, lse_parts, backend="reference")
    check_close(DECODE, out, t)


def test_vendor_flag_is_listed_as_ignored(toy: ToyPlugin) -> None:
    plan = attnreg.explain(PREFILL, backend="toy", flags={"apple_tuned_flash": True})
    assert "apple_tuned_flash" in plan.ignored_flags
    assert "toyco" in plan.ignored_flags["apple_tuned_flash"]


def test_flags_from_environment(monkeypatch: pytest.MonkeyPatch, toy: ToyPlugin) -> None:
    monkeypatch.setenv("ATTNREG_FLAGS", "route=prefill, split_size=64")
    assert attnreg.explain(DECODE, backend="toy").route == "prefill"
    monkeypatch.setenv("ATTNREG_FLAGS", "warp_speed=1")
    with pytest.raises(attnreg.SpecError, match="known flags"):
        attnreg.explain(DECODE, backend="toy")
    monkeypatch.setenv("ATTNREG_FLAGS", "split_size=lots")
    with pytest.raises(attnreg.SpecError, match="split_size"):
        attnreg.explain(DECODE, backend="toy")
    monkeypatch.setenv("ATTNREG_FLAGS", "route")
    with pytest.raises(attnreg.SpecError, match="ATTNREG_FLAGS"):
        attnreg.explain(DECODE, backend="toy")


def test_session_validates_flags_and_caches_plans(toy: ToyPlugin) -> None:
    with pytest.raises(attnreg.SpecError, match="known flags"):
        attnreg.Session(flags={"turbo": True})
    with pytest.raises(attnreg.SpecError, match="backend"):
        attnreg.Session(backend="nope")
    with attnreg.Session(backend="toy", flags={"split_size": 32}) as s:
        assert s.plans_made == 0
        p1 = s.plan(DECODE)
        assert s.plan(DECODE) is p1 and p1.params["split_size"] == 32
        assert s.plans_made == 1                    # the second plan came from the cache
        assert s.plan(DECODE, flags={"split_size": 64}).params["split_size"] == 64
        assert s.plans_made == 2
    with pytest.raises(attnreg.SpecError, match="closed"):
        s.run(DECODE, make_tensors(DECODE))


def test_broken_plugin_is_reported_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNREG_PLUGINS", "tests.broken_plugin")
    reg = regmod.Registry()
    devs = reg.devices()
    broken = [d for d in devs if not d.available and "libtoygpu" in d.reason]
    assert broken and broken[0].backend == "tests.broken_plugin"
    assert any(d.backend == "reference" and d.available for d in devs)


def test_explain_text_reads_like_a_plan() -> None:
    text = attnreg.explain(DECODE, backend="reference").explain()
    for word in ("spec:", "route: split_kv", "kernels:", "rules fired:", "split_kv_few_rows"):
        assert word in text


class _FusedPlugin:
    @attnreg.hookimpl
    def attnreg_register_kernels(self, register):  # type: ignore[no-untyped-def]
        register(attnreg.KernelInfo(id="toy.decode_fused.f32", backend="toy",
                                    family="decode_fused", dtypes=frozenset({"float32"}),
                                    head_sizes=(8, 64, 8), defaults={"kv_tile": 16},
                                    supports=attnreg.kernel.ALL_FEATURES - {"head_sink"}))


def test_fused_split_kv_is_preferred_when_a_kernel_exists(toy: ToyPlugin) -> None:
    assert attnreg.explain(DECODE, backend="toy").route == "split_kv"
    attnreg.register_plugin(_FusedPlugin(), name="toy-fused")
    try:
        plan = attnreg.explain(DECODE, backend="toy")
        assert plan.route == "split_kv_fused" and plan.kernels == ("toy.decode_fused.f32",)
        assert any(r.startswith("split_kv_fused_when_available") for r in plan.rules)
        assert plan.params["n_splits"] * plan.params["split_size"] >= DECODE.capacity
        # where the fused kernel cannot run, the two-launch route stays
        assert attnreg.explain(DECODE.replace(head_sink=True), backend="toy").route == "split_kv"
        t = make_tensors(DECODE, seed=4)
        with attnreg.Session(backend="toy") as s:
            check_close(DECODE, s.run(DECODE, t), t)
    finally:
        attnreg.unregister_plugin(name="toy-fused")
