"""The OpenCL tensor-core split-KV decode (opencl.decode_partial.f16.mma,
opencl.decode_fused.f16.mma: kernels_cl/decode_mma.cl), and where they are the same tests,
their bfloat16 twins (opencl.decode_partial.bf16.mma, opencl.decode_fused.bf16.mma).

Against the float64 reference: every contract feature over several splits, paged caches,
each head size the kernel takes, GQA groups that fill the 16-row M tile or need head chunks,
the lazy max, and non-finite values on the causal edge of a multi-row tile (the path that
zeroes them and marks the columns of the rows that see them). PoCL runs the emulated build; a
device where the probe found mma.sync (the H100) runs the hardware build too. Then the
declared local memory against the build's, and how the rules select and size it.
"""

from __future__ import annotations

import pytest

import attnreg
from attnreg.backends.opencl import mma_probe
from attnreg.backends.opencl import tiles as otiles
from attnreg.spec import AttentionSpec
from tests.backends.opencl import mma_support
from tests.backends.opencl.mma_support import BUILDS, IDS
from tests.support import check_close, make_tensors

PARTIAL, FUSED = "opencl.decode_partial.f16.mma", "opencl.decode_fused.f16.mma"
# (family, dtype) -> kernel
DECODES = {(f, d): f"opencl.{f}.{t}.mma" for f in ("decode_partial", "decode_fused")
           for d, t in (("float16", "f16"), ("bfloat16", "bf16"))}
TAGS = {"float16": "f16", "bfloat16": "bf16"}


# (spec fields, params): every feature of the contract over several splits of 64 keys.
COVER = [
    (dict(head_size=64, num_heads=8, kv_num_heads=2, seq_len=1, kv_layout="paged",
          page_size=16, seqlens_k=True, bias=True, return_lse=True), {}),
    (dict(head_size=128, num_heads=7, kv_num_heads=1, seq_len=3, local_window=40,
          head_sink=True, q_layout="BNSH", kv_layout="BNSH"), dict(m_tile=2)),
    (dict(head_size=256, num_heads=4, kv_num_heads=4, seq_len=1, alibi_max_bias=8.0,
          softcap=5.0, return_lse=True), dict(wg=64)),
    (dict(head_size=192, num_heads=8, kv_num_heads=2, seq_len=5, kv_layout="paged",
          page_size=5, seqlens_k=True, head_sink=True, return_lse=True),
     dict(m_tile=8, kv_tile=32, prefetch=1)),
    (dict(head_size=64, num_heads=32, kv_num_heads=1, seq_len=1, bias=True, softcap=3.0),
     dict(wg=32)),
]


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
@pytest.mark.parametrize("kernel", [PARTIAL, FUSED], ids=["partial", "fused"])
@pytest.mark.parametrize(("fields", "params"), COVER,
                         ids=[f"h{f['head_size']}-g{f['num_heads'] // f['kv_num_heads']}"
                              f"-s{f['seq_len']}" for f, _ in COVER])
def test_contract_over_splits_layouts_and_head_sizes(dev, build, kernel, fields, params):
    base = dict(batch=2, past_len=200 - fields["seq_len"], dtype="float16", causal=True)
    spec, t = mma_support.cache_inputs(base, fields, 260, 77)
    got, plan = mma_support.run(dev, build, kernel, spec, t, **params)
    assert plan.stages[0].kernel == kernel and plan.stages[0].params["n_splits"] > 2
    assert {k: plan.stages[0].params[k] for k in params} == params
    check_close(spec, got, t, what=f"{kernel} {build} {params}")


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
@pytest.mark.parametrize("dtype", list(TAGS), ids=list(TAGS.values()))
@pytest.mark.parametrize("shape", ["up", "saw"])
def test_lazy_max_rescales_when_the_logits_grow_past_tau(dev, build, dtype, shape):
    spec, t, _ = mma_support.growing_logits(1, 255, dtype, shape)
    # one split of 256 keys, one warp: 16 chunks of 16 keys in a row
    got, plan = mma_support.run(dev, build, DECODES["decode_fused", dtype], spec, t, split_size=256, wg=32)
    check_close(spec, got, t, what=f"{plan.kernel} {shape}")


# the float16 decodes with 4-row tiles on a 100-key cache, the bfloat16 twins with their
# defaults on 200 keys: the causal edge of a multi-row tile, where rows i >= 2 see the key
NON_FINITE_V = {"float16": (96, dict(m_tile=4)), "bfloat16": (196, {})}


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
@pytest.mark.parametrize(("family", "dtype"), list(DECODES),
                         ids=[f"{f.split('_')[1]}-{TAGS[d]}" for f, d in DECODES])
def test_non_finite_v_on_the_causal_edge_reaches_only_rows_that_see_it(dev, build, family,
                                                                        dtype):
    past_len, params = NON_FINITE_V[dtype]
    spec = AttentionSpec(batch=2, seq_len=4, past_len=past_len, num_heads=4, kv_num_heads=2,
                         head_size=64, dtype=dtype, causal=True, return_lse=True,
                         q_layout="BSNH", kv_layout="BSNH")
    mma_support.check_non_finite_v(dev, build, DECODES[family, dtype], spec, 2, (3, 40, 63), **params)


# (head size, m_tile, wg) per dtype
LOCAL_MEMORY = {"float16": [(64, 1, 128), (256, 4, 64), (128, 16, 256)],
                "bfloat16": [(128, 4, 128)]}


@pytest.mark.parametrize(("family", "dtype"), list(DECODES),
                         ids=[f"{f.split('_')[1]}-{TAGS[d]}" for f, d in DECODES])
def test_declared_local_memory_is_what_the_build_uses(pocl, family, dtype):
    mma_support.check_declared_local_memory(pocl, DECODES[family, dtype], [
        (AttentionSpec(seq_len=4, past_len=70, num_heads=8, kv_num_heads=2, head_size=h,
                       dtype=dtype), {"m_tile": m, "wg": wg, "n_splits": 2})
        for h, m, wg in LOCAL_MEMORY[dtype]])


# -- declaration and selection ----------------------------------------------------------
def test_declared_as_matrix_unit_decodes():
    for kid in (PARTIAL, FUSED):
        k = attnreg.registry.get().kernel(kid)
        assert k.matrix is not None and k.matrix.text() == "ptx_mma f16 16x8x16->f32"
        assert mma_probe.FEATURE in k.features and k.emulation == {"mma": "emulate"}
        assert all(k.head_size_ok(h) for h in (64, 128, 192, 256))
        assert all(k.head_size_ok(h) for h in (320, 512, 576)) and \
            not any(k.head_size_ok(h) for h in (32, 80, 96, 640))
        # v's rows stop at 512 (q/k 576, v 512: MLA)
        assert k.v_head_size_ok(512) and not any(k.v_head_size_ok(h) for h in (32, 576))


DECODE = AttentionSpec(seq_len=1, past_len=8191, num_heads=32, kv_num_heads=8,
                       head_size=128, dtype="float16", causal=True)


def test_auto_picks_it_on_nvidia_with_splits_for_two_groups_per_unit(pocl):
    nv = mma_support.nvidia_like(pocl)
    got = {}
    for L, want in ((8192, 256), (32768, 1008)):
        spec = DECODE.model_copy(update={"past_len": L - 1})
        plan = attnreg.explain(spec, caps=nv)
        st = plan.stages[0]
        assert st.kernel == FUSED and st.params["mma"] == "hardware"
        assert any(f.startswith("opencl_mma_decode_nvidia") for f in plan.rules)
        got[L] = st.params["split_size"]
        assert got[L] == want
    assert attnreg.explain(DECODE, caps=nv, flags={"matrix_units": "off"}).kernel != FUSED


def test_quantized_tiles_on_nvidia_and_the_l2_prefetch_knob(pocl):
    nv = mma_support.nvidia_like(pocl)
    spec = DECODE.model_copy(update={"past_len": 32767})
    got = {}
    for kv in ("int8", "int4"):
        plan = attnreg.explain(spec.model_copy(update={"kv_dtype": kv}), caps=nv)
        assert plan.stages[0].kernel == FUSED
        assert any(f.startswith("opencl_mma_decode_quantized_tiles") for f in plan.rules)
        got[kv] = plan.stages[0].params
    assert got["int8"]["kv_tile"] == 32 and got["int8"]["l2_prefetch"] == 1
    assert got["int8"]["prefetch"] == 1
    assert got["int4"]["prefetch"] == 1 and got["int4"].get("l2_prefetch", 0) == 0
    # the knob is validated like every tile (and is only a build option on NVIDIA's builds)
    g = otiles.mma_decode_geometry(spec, {"l2_prefetch": 2}, nv, "decode_fused")
    assert g.pl2 == 2 and g.defines()["PL2"] == 2
    assert "PL2" not in otiles.mma_decode_geometry(spec, {}, nv, "decode_fused").defines()
    with pytest.raises(attnreg.SpecError, match="l2_prefetch"):
        otiles.mma_decode_geometry(spec, {"l2_prefetch": 9}, nv, "decode_fused")
    # through the public params check: 0 (off, the default) is a value a caller may pass; a
    # negative one is not
    q = spec.model_copy(update={"kv_dtype": "int8"})
    plan = attnreg.explain(q, caps=nv, params={"l2_prefetch": 0})
    assert plan.stages[0].params["l2_prefetch"] == 0
    with pytest.raises(attnreg.SpecError, match=r"l2_prefetch.*-1"):
        attnreg.explain(q, caps=nv, params={"l2_prefetch": -1})


def test_mid_length_splits_prefetch_two_rounds_into_l2(pocl):
    nv = mma_support.nvidia_like(pocl)
    # rounds per warp = split_size / (4 warps x 16 keys): L=4096 -> 2, 8192 -> 4, 16384 -> 8,
    # 32768 -> 16 (opencl_mma_decode_splits' sizes on 132 units)
    for L, want in ((4096, 0), (8192, 2), (16384, 2), (32768, 0)):
        for dtype in ("float16", "bfloat16"):
            spec = DECODE.model_copy(update={"past_len": L - 1, "dtype": dtype})
            plan = attnreg.explain(spec, caps=nv)
            st = plan.stages[0]
            assert st.kernel.endswith(".mma"), (L, dtype, st.kernel)
            assert st.params.get("l2_prefetch", 0) == want, (L, dtype, st.params)
            assert (want > 0) == any(f.startswith("opencl_mma_decode_l2_prefetch_mid")
                                     for f in plan.rules)
    spec = DECODE.model_copy(update={"past_len": 8191})
    # the caller's own prefetch choice is kept; quantized K/V keep their own tiles; not off NVIDIA
    assert attnreg.explain(spec, caps=nv, params={"prefetch": 1}).stages[0].params.get(
        "l2_prefetch", 0) == 0
    q = attnreg.explain(spec.model_copy(update={"kv_dtype": "int4"}), caps=nv)
    assert q.stages[0].params.get("l2_prefetch", 0) == 0
    other = attnreg.explain(spec, caps=nv.model_copy(update={"vendor": "amd"}),
                            flags={"matrix_units": "on"}).stages[0]
    assert other.kernel.endswith(".mma") and other.params.get("l2_prefetch", 0) == 0


def test_matrix_units_emulate_runs_it_and_auto_passes_it_over_on_pocl(pocl):
    spec = DECODE.model_copy(update={"past_len": 300, "num_heads": 8, "kv_num_heads": 2,
                                     "head_size": 64})
    t = make_tensors(spec, seed=3)
    with attnreg.Session(backend="opencl", device=pocl.id,
                         flags={"matrix_units": "emulate", "route": "split_kv"}) as s:
        got, plan = s.run_with_plan(spec, t)
    assert plan.stages[0].kernel == PARTIAL and plan.stages[0].params["mma"] == "emulate"
    check_close(spec, got, t, what=PARTIAL)
    auto = attnreg.explain(spec, caps=pocl, flags={"route": "split_kv"})
    assert auto.stages[0].kernel != PARTIAL
    assert any("matrix_units=auto" in r for r in auto.rejected[PARTIAL])
