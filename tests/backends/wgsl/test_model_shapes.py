"""The shapes real models need (docs/contract.md "Shapes real models need": kv_start, seqlens_q,
v_head_size, head sizes up to 576 for q/k and 512 for v) in the WGSL kernels, on every WGSL host:
webgpu (wgpu-native, naga), dawn (Tint, in-process) and browser (headless Chromium, the families
its runtime binds).

Every family is forced on inputs whose keys before kv_start and past seqlens_k, and whose q
rows past seqlens_q, are NaN (attnreg.testing.make_tensors; NaN scales for quantized
K/V), and checked against the float64 reference at the contract tolerance: each feature
alone and all together, v's head size below and above head_size, head sizes 320 / 512,
MLA's q/k 576 with v 512 and one KV head, bfloat16 and int8 / int4 K/V, paged KV, the
split-KV partial states (reduced on the reference) and the reduce's padding rows, and the
matrix kernels' emulated builds. The generated conformance cells (attnreg.tools.cases model
cells) add the per-kernel matrix.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attnreg
from attnreg import reference as ref
from attnreg.backends.webgpu import kernels as wkernels
from attnreg.backends.webgpu import mma as wmma
from attnreg.backends.webgpu import program
from attnreg.backends.webgpu import tiles as wtiles
from attnreg.kernel import MODEL_FEATURES
from attnreg.tensors import check_tensors
from attnreg.testing import compare, compare_partials, expected, make_tensors
from tests.support import require_devices

SPLIT = {"flags": {"split_size": 16}}
ALL = {"kv_start": True, "seqlens_q": True, "seqlens_k": True, "head_sink": True,
       "return_lse": True}
BASE = {"batch": 3, "num_heads": 4, "kv_num_heads": 2, "head_size": 32}
MLA = {"batch": 2, "num_heads": 8, "kv_num_heads": 1, "head_size": 576, "v_head_size": 512}

# name -> (kernel id after "<backend>.", spec fields, run keywords). Each row a family with
# the new features alone or together; S > 1 rows everywhere but decode m1, so padding rows
# meet real ones in one row tile.
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "prefill-kvstart": ("prefill.f32.sg", {"seq_len": 7, "past_len": 30, "causal": True,
                                           "kv_start": True, "local_window": 20}, {}),
    "prefill-seqlensq": ("prefill.f16.sg", {"dtype": "float16", "seq_len": 9, "past_len": 0,
                                            "causal": True, "seqlens_q": True, "seqlens_k": True,
                                            "head_sink": True, "return_lse": True}, {}),
    "prefill-staged-all": ("prefill.bf16.wgmem", {**ALL, "dtype": "bfloat16", "seq_len": 6,
                                                  "past_len": 40, "causal": True,
                                                  "v_head_size": 16},
                           {"params": {"kv_staging": "workgroup", "kv_tile": 16}}),
    "prefill-blocks-all": ("prefill.f32.sg.blocks", {**ALL, "seq_len": 5, "past_len": 30,
                                                     "bias": True, "v_head_size": 48},
                           {"flags": {"block_skip": "on"}}),
    "decode-m1-vlarge": ("decode_partial.f16.m1", {"dtype": "float16", "seq_len": 1,
                                                   "past_len": 50, "v_head_size": 64}, SPLIT),
    "decode-m4-all-paged-int8": ("decode_partial.f32.m4", {
        **ALL, "seq_len": 3, "past_len": 61, "causal": True, "v_head_size": 24,
        "kv_layout": "paged", "page_size": 16, "num_pages": 15, "kv_capacity": 64,
        "kv_dtype": "int8"}, SPLIT),
    "decode-blocks-all": ("decode_partial.f16.m2.blocks", {
        **ALL, "dtype": "float16", "seq_len": 2, "past_len": 60, "bias": True,
        "v_head_size": 16}, {"flags": {"block_skip": "on", "split_size": 16}}),
    "unfused-all-int4": ("decode_qk.f16.m2", {**ALL, "dtype": "float16", "seq_len": 3,
                                              "past_len": 45, "causal": True,
                                              "v_head_size": 64, "kv_dtype": "int4"}, SPLIT),
    "mma-prefill-all": ("prefill.f16.mma", {**ALL, "dtype": "float16", "seq_len": 20,
                                            "past_len": 30, "causal": True, "v_head_size": 16},
                        {"params": {"mma": "emulate"}}),
    "mma-decode-all": ("decode_partial.f16.mma", {**ALL, "dtype": "float16", "seq_len": 3,
                                                  "past_len": 70, "causal": True,
                                                  "v_head_size": 48},
                       {"params": {"mma": "emulate"}, "flags": {"split_size": 32}}),
    # head sizes past 256 (tiles shrink to fit 32 KiB of workgroup memory)
    "prefill-h512": ("prefill.f16.sg", {**ALL, "dtype": "float16", "batch": 2, "num_heads": 2,
                                        "kv_num_heads": 1, "head_size": 512, "seq_len": 5,
                                        "past_len": 20, "causal": True}, {}),
    "decode-h320-v512": ("decode_partial.f32.m2", {**ALL, "batch": 2, "num_heads": 2,
                                                   "kv_num_heads": 1, "head_size": 320,
                                                   "v_head_size": 512, "seq_len": 2,
                                                   "past_len": 30}, SPLIT),
    "mma-h320-v160": ("prefill.f16.mma", {"kv_start": True, "seqlens_q": True, "dtype": "float16",
                                          "batch": 2, "num_heads": 2, "kv_num_heads": 1,
                                          "head_size": 320, "v_head_size": 160, "seq_len": 5,
                                          "past_len": 20}, {"params": {"mma": "emulate"}}),
    # MLA (q/k 576, v 512, one KV head): decode, speculative rows, the unfused pair, prefill
    "mla-decode-paged": ("decode_partial.f16.m1", {**ALL, **MLA, "dtype": "float16",
                                                   "seq_len": 1, "past_len": 40,
                                                   "kv_layout": "paged", "page_size": 16,
                                                   "num_pages": 9, "kv_capacity": 64}, SPLIT),
    "mla-decode-m4": ("decode_partial.bf16.m4", {**MLA, "dtype": "bfloat16", "seq_len": 4,
                                                 "past_len": 30, "causal": True}, SPLIT),
    "mla-unfused": ("decode_qk.f32.m2", {**ALL, **MLA, "seq_len": 2, "past_len": 30}, SPLIT),
    "mla-prefill": ("prefill.f16.wgmem", {**ALL, **MLA, "dtype": "float16", "seq_len": 9,
                                          "past_len": 0, "causal": True},
                    {"params": {"kv_staging": "workgroup"}}),
}
# Tint compiles the same WGSL: dawn takes the rows that cover its families and builds once
# each (a cold compile costs about a second on lavapipe); the browser's runtime binds
# prefill, decode_partial and the reduce over BSNH / BNSH.
DAWN = ("prefill-staged-all", "decode-m4-all-paged-int8", "unfused-all-int4",
        "decode-blocks-all", "mma-decode-all", "mla-decode-paged")
BROWSER_CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "prefill-all": ("prefill.f32.sg", {**ALL, "seq_len": 6, "past_len": 30, "causal": True,
                                       "v_head_size": 16, "q_layout": "BNSH"}, {}),
    # (with quantized K/V the browser's 10 storage buffers per stage are too few: see
    # test_rejections_say_what_does_not_fit)
    "decode-m4-all": ("decode_partial.{f16}.m4", {
        **ALL, "dtype": "float16", "seq_len": 3, "past_len": 40, "v_head_size": 64,
        "kv_layout": "BNSH"}, SPLIT),
}


def _run(session: attnreg.Session, backend: str, name: str, seed: int = 0) -> None:
    kid, fields, kw = (BROWSER_CASES if backend == "browser" else CASES)[name]
    if "{f16}" in kid:            # SwiftShader has no shader-f16: float16 widened on the host
        f16 = "shader-f16" in attnreg.devices(backend)[0].features
        kid = kid.format(f16="f16" if f16 else "f16.cast32")
    spec = attnreg.AttentionSpec(**{**BASE, **fields})
    t = make_tensors(spec, seed)
    kernel = f"{backend}.{kid}"
    got, plan = session.run_with_plan(spec, t, kernel=kernel, **kw)
    assert plan.kernel == kernel
    _, problem = compare(spec, got, expected(spec, t))
    assert not problem, f"{kernel} {name}: {problem}"


@pytest.fixture(scope="module")
def webgpu():
    require_devices("webgpu")
    with attnreg.Session(backend="webgpu") as s:
        yield s


@pytest.mark.parametrize("name", list(CASES))
def test_webgpu(webgpu, name):
    _run(webgpu, "webgpu", name)


def test_dawn():
    require_devices("dawn")
    with attnreg.Session(backend="dawn") as s:
        for name in DAWN:
            _run(s, "dawn", name, seed=1)
        _reduce_padding_rows(s, "dawn")


def test_browser(tmp_path):
    require_devices("browser")
    with attnreg.Session(backend="browser") as s:
        for name in BROWSER_CASES:
            _run(s, "browser", name, seed=2)
        _reduce_padding_rows(s, "browser")
    # export-wgsl's module binds kv_start / seqlens_q and sizes out by Hv
    from attnreg.backends.browser import export
    spec = attnreg.AttentionSpec(**{**BASE, **ALL, "seq_len": 1, "past_len": 40,
                                    "v_head_size": 48})
    res = export.export(spec, str(tmp_path), "browser")
    assert res.plan.route == "split_kv"
    _, problem = export.check(str(tmp_path), spec, seed=3)
    assert not problem, problem


# -- partial states and the reduce ---------------------------------------------------------
def test_partial_states_reduced_on_the_reference(webgpu):
    """decode_partial's and the unfused pair's partial states [B, Nq, S, T, Hv] with every
    feature: padding rows' splits empty (o 0, lse -inf); reduced on the reference with the
    sink, which padding rows do not take."""
    for kid, hv in (("decode_partial.f32.m4", 40), ("decode_qk.f32.m2", 16)):
        spec = attnreg.AttentionSpec(**{**BASE, **ALL, "seq_len": 4, "past_len": 44,
                                        "causal": True, "v_head_size": hv})
        t = make_tensors(spec, 5)
        o, lse = webgpu.partial_states(spec, t, split_size=16, kernel=f"webgpu.{kid}")
        assert o.shape == (3, 4, 4, 3, hv)
        want = ref.partial_states(spec, check_tensors(spec, t), 16)
        _, problem = compare_partials(spec, (o, lse), want, (2e-5, 1e-4))
        assert not problem, f"{kid}: {problem}"
        pad = np.arange(4)[None, :] >= t["seqlens_q"][:, None]          # [B, S]
        assert pad.any() and np.isneginf(lse[pad.nonzero()[0], :, pad.nonzero()[1]]).all()
        out, lse_r = ref.reduce(spec, o, lse, t["head_sink"], t["seqlens_q"])
        _, problem = compare(spec, (ref.out_layout(spec, out).astype(np.float32),
                                    lse_r.astype(np.float32)), expected(spec, t))
        assert not problem, f"{kid} reduced: {problem}"


def _reduce_padding_rows(session: attnreg.Session, backend: str) -> None:
    """The reduce with seqlens_q and a sink: padding rows get out 0 and lse -inf (their
    splits are empty; garbage in their o must not leak), real rows the sink."""
    spec = attnreg.AttentionSpec(**{**BASE, **ALL, "seq_len": 5, "past_len": 30,
                                    "v_head_size": 48})
    t = make_tensors(spec, 7)
    o, lse = ref.partial_states(spec, check_tensors(spec, t), 8)
    o, lse = o.astype(np.float32), lse.astype(np.float32)
    o[np.isneginf(lse)] = np.nan
    out, got_lse = session.reduce_states(spec, o, lse, t["head_sink"], seqlens_q=t["seqlens_q"],
                                         kernel=f"{backend}.reduce.f32")
    _, problem = compare(spec, (out, got_lse), expected(spec, t))
    assert not problem, f"{backend}.reduce.f32: {problem}"
    pad = np.arange(5)[None, :] >= t["seqlens_q"][:, None]
    assert pad.any()
    b, i = pad.nonzero()
    canonical = out.transpose(0, 2, 1, 3)               # BSNH -> [B, Nq, S, Hv]
    assert np.isneginf(got_lse[b, :, i]).all() and (canonical[b, :, i] == 0).all()


def test_reduce_padding_rows(webgpu):
    _reduce_padding_rows(webgpu, "webgpu")


# -- declarations and generated code (no device) --------------------------------------------
def test_declared_features_and_head_sizes():
    reg = attnreg.registry.get()
    for backend in ("webgpu", "dawn", "browser"):
        ks = reg.kernels(backend)
        assert ks and all(k.supports >= MODEL_FEATURES for k in ks), backend
        for k in ks:
            if k.params.get("form") == "direct":
                # the matrix prefill's direct form holds its Q operands and output tiles in
                # 8 variables each; the staged form (checked here) runs the larger heads
                assert k.head_size_ok(128) and not k.head_size_ok(144), k.id
                assert k.v_head_size_ok(128) and not k.v_head_size_ok(144), k.id
                continue
            if k.family != "reduce":
                assert k.head_size_ok(512) and k.head_size_ok(320), k.id
                assert k.v_head_size_ok(512) and not k.v_head_size_ok(520), k.id
            if k.family != "reduce" and k.matrix is None:
                # q/k to 576, v to 512, apart (MLA: q/k 576, v 512)
                assert k.head_size_ok(576) and not k.head_size_ok(584), k.id
            elif k.matrix is not None:
                # past 512, Q and K rows need more than 32 KiB at the smallest tiles
                assert not k.head_size_ok(528), k.id


def test_every_mla_shape_has_a_kernel():
    """MLA's shapes (q/k 576, v 512, one KV head) and the heads around them plan on every
    WGSL host's device or profile, in every dtype, with or without the matrix units: the
    matrix variants decline (head size, storage) and the scalar ones run them."""
    reg = attnreg.registry.get()
    devices = [*attnreg.profiles().values(), *(d for b in ("dawn", "browser")
                                               for d in attnreg.devices(b) if d.available)]
    for caps in (c for c in devices if c.backend in ("webgpu", "dawn", "browser")):
        for dtype in ("float16", "bfloat16", "float32"):
            for h, hv in ((576, 512), (520, 512), (64, 512), (576, 64)):
                for s, past in ((1, 100), (4, 60), (33, 0)):
                    spec = attnreg.AttentionSpec(batch=1, num_heads=16, kv_num_heads=1,
                                                 head_size=h, v_head_size=hv, seq_len=s,
                                                 past_len=past, dtype=dtype)
                    for flags in ({}, {"matrix_units": "on"}):
                        plan = reg.plan(spec, caps=caps, flags=flags)
                        assert plan.stages, (caps.id, spec)


def test_rejections_say_what_does_not_fit():
    """Hv takes the values head_size does; a matrix kernel whose smallest tiles exceed the
    device's workgroup storage says how many bytes it needs."""
    caps = attnreg.profile("lavapipe")
    k = attnreg.registry.get().kernel("webgpu.prefill.f16.sg")
    spec = attnreg.AttentionSpec(head_size=64, v_head_size=12, dtype="float16")
    assert "v_head_size 12 outside 8..512 step 8 (v's and out's head size)" in \
        k.not_supported_reasons(spec, caps)
    # q/k and v are bounded apart, and the reason names which one is out of range
    wide = attnreg.AttentionSpec(head_size=584, v_head_size=520, dtype="float16")
    assert k.not_supported_reasons(wide, caps)[:2] == [
        "head_size 584 outside 8..576 step 8 (q and k's head size)",
        "v_head_size 520 outside 8..512 step 8 (v's and out's head size)"]
    mla = wide.replace(head_size=576, v_head_size=512)
    fit = wkernels.fit_tiles(k, mla, {}, caps.limit("workgroup_storage"))
    assert fit and not k.not_supported_reasons(mla, caps, fit)
    m = attnreg.registry.get().kernel("webgpu.prefill.f16.mma")
    big = attnreg.AttentionSpec(head_size=512, dtype="float16", seq_len=16)
    fit = wmma.fit_tiles(m, big, {"mma": "emulate"}, 32768)
    why = m.not_supported_reasons(big, caps, {"mma": "emulate", **fit})
    assert any("B of workgroup storage, device limit is 32768 B" in w for w in why), why
    # 336 needs 33992 B at the smallest tiles, 320 fits (32456 B: the O scratch lives in the
    # subgroup's score rows, no array of its own)
    mid = attnreg.AttentionSpec(head_size=336, dtype="float16", seq_len=16)
    fit = wmma.fit_tiles(m, mid, {"mma": "emulate"}, 32768)
    assert m.not_supported_reasons(mid, caps, {"mma": "emulate", **fit}) == [
        "needs 33992 B of workgroup storage, device limit is 32768 B"]
    ok = mid.replace(head_size=320)
    fit = wmma.fit_tiles(m, ok, {"mma": "emulate"}, 32768)
    assert not m.not_supported_reasons(ok, caps, {"mma": "emulate", **fit})
    # each optional input is a storage buffer: a browser's 10 do not hold a quantized decode
    # with kv_start and seqlens_q (12)
    ten = caps.model_copy(update={"limits": {**caps.limits, "storage_buffers": 10}})
    d = attnreg.registry.get().kernel("webgpu.decode_partial.f16.m1")
    quant = attnreg.AttentionSpec(head_size=64, dtype="float16", kv_dtype="int8",
                                  kv_start=True, seqlens_q=True)
    assert d.not_supported_reasons(quant, ten) == [
        "binds 12 storage buffers, device limit is 10 per shader stage "
        "(maxStorageBuffersPerShaderStage)"]
    assert not d.not_supported_reasons(quant.replace(kv_start=False, seqlens_q=False), ten)


def test_decode_tiles_keep_the_gqa_group_where_storage_allows():
    """MLA's decode (16 heads on one KV head, q/k 576, v 512) in 32 KiB: halving kv_tile to 8
    makes room for 4 of the group's heads per workgroup, which group_tile takes back (the
    halving order alone left 1, each head re-reading every K/V tile)."""
    reg = attnreg.registry.get()
    mla = attnreg.AttentionSpec(num_heads=16, kv_num_heads=1, head_size=576, v_head_size=512,
                                dtype="float16", seq_len=1, past_len=40)
    # decode_partial stages these heads' K/V in workgroup memory (the staging rule: a lane's
    # share of a tile read directly would be past DIRECT_MAX_REGS units)
    staged = {"kv_staging": "workgroup"}
    assert wtiles.decode_regs(mla, {}) > wtiles.DIRECT_MAX_REGS
    for kid, want, params in (("decode_partial.f16.m1", {"group_tile": 4, "kv_tile": 8}, staged),
                              ("decode_qk.f16.m1", {"group_tile": 4}, {}),
                              ("decode_pv.f16", {"group_tile": 4}, {})):
        k = reg.kernel(f"webgpu.{kid}")
        fit = wkernels.fit_tiles(k, mla, params, 32768)
        assert fit == want, (kid, fit)
        p = {**k.defaults, **params, **fit, **k.params}
        assert k.storage_need(mla, p) <= 32768 < k.storage_need(mla, {**p, "group_tile": 8})
    # a spec that fits keeps its tiles; one whose group is 1 has nothing to take back
    k = reg.kernel("webgpu.decode_partial.f16.m1")
    assert wkernels.fit_tiles(k, mla.replace(head_size=64, v_head_size=64), {}, 32768) == {}
    assert wkernels.fit_tiles(k, mla.replace(num_heads=1), staged, 32768) == {"kv_tile": 8}


def test_code_without_the_features_is_unchanged():
    """A spec without kv_start / seqlens_q binds neither tensor and compiles their tests
    away (constant KV_START / Q_ROWS 0); with them the program binds and reads them."""
    spec = attnreg.AttentionSpec(seq_len=3, past_len=20, head_size=64)
    consts = wtiles.decode_consts(spec, {})
    plain = program.source("decode_partial", spec, consts)
    for name in ("kv_start", "seqlens_q"):
        assert f"> {name}:" not in plain and f"u32({name}[b])" not in plain
    assert "const KV_START: u32 = 0u;" in plain and "const Q_ROWS: u32 = 0u;" in plain
    model = spec.replace(kv_start=True, seqlens_q=True, v_head_size=32)
    aux = program.stage_aux(attnreg.plan.Stage("k", "decode_partial", {}), model)
    assert aux == {"kv_start", "seqlens_q"}
    src = program.source("decode_partial", model, consts, aux=aux)
    assert "var<storage, read> kv_start: array<i32>;" in src
    assert "return u32(seqlens_q[b]);" in src and "const V_DIM: u32 = 32u;" in src
    red = program.source("reduce", model, {"THREADS": 256},
                         aux=program.stage_aux(attnreg.plan.Stage("r", "reduce", {}), model))
    assert "u32(seqlens_q[b])" in red and "> kv_start:" not in red
