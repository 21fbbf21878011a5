"""bfloat16 and quantized (int8 / int4) K/V in the WGSL kernels, on every WGSL host: webgpu
(wgpu-native, naga), dawn (Tint, in-process) and browser (headless Chromium).

Every K/V-reading family is forced on inputs with seqlens_k and poisoned tails (NaN past
each sequence's length; for quantized K/V NaN scales there, see attnreg.testing), and
its output checked against the float64 reference (which dequantizes with attnreg.quant) at
the contract tolerance of the spec's dtype. The generated conformance cells (attnreg.tools
.cases) cover the contract's features per kernel; this file covers the storage x family
matrix and the helpers' generated WGSL.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attnreg
from attnreg.backends.webgpu import kernels as wkernels
from attnreg.backends.webgpu import program, wgsl_io
from attnreg.backends.webgpu import tiles as wtiles
from attnreg.testing import compare, expected, make_tensors
from tests.support import require_devices

SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
# (dtype, kv_dtype): bf16 stored, the two quantized storages under f16 and f32, and both
# new things at once.
STORAGES = [("bfloat16", None), ("float16", "int8"), ("float16", "int4"), ("float32", "int8"),
            ("bfloat16", "int4")]
GQA = {"batch": 2, "num_heads": 4, "kv_num_heads": 2, "head_size": 32, "seqlens_k": True}


def _bias_with_masked_blocks(spec: attnreg.AttentionSpec, seed: int) -> np.ndarray:
    """A random bias whose keys 16..31 are -inf for every row: a block the lists skip."""
    rng = np.random.default_rng(seed)
    bias = rng.standard_normal((spec.batch, 1, spec.seq_len, spec.capacity)).astype(np.float32)
    bias[..., 16:32] = -np.inf
    return bias


# family -> (kernel id after "<backend>.", spec fields, run keywords, lengths). S > 1 rows in
# every family but decode m1; lengths leave a poisoned tail in batch entry 1.
FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, Any], list[int]]] = {
    "prefill_sg": ("prefill.{d}.sg", {"seq_len": 6, "past_len": 34, "causal": True,
                                      "return_lse": True}, {}, [40, 23]),
    "prefill_wgmem": ("prefill.{d}.wgmem", {"seq_len": 6, "past_len": 34, "causal": True,
                                            "kv_layout": "BNSH", "head_sink": True},
                      {"params": {"kv_staging": "workgroup", "kv_tile": 16}}, [40, 23]),
    "decode_m1": ("decode_partial.{d}.m1", {"seq_len": 1, "past_len": 70},
                  {"flags": {"split_size": 32}}, [71, 44]),
    "decode_m4": ("decode_partial.{d}.m4", {"seq_len": 3, "past_len": 60, "causal": True,
                                            "q_layout": "BNSH", "kv_layout": "BNSH"},
                  {"flags": {"split_size": 32}}, [63, 30]),
    "unfused": ("decode_qk.{d}.m2", {"seq_len": 2, "past_len": 60, "causal": True,
                                     "softcap": 5.0}, {"flags": {"split_size": 32}}, [62, 37]),
    "blocks": ("decode_partial.{d}.m2.blocks", {"seq_len": 2, "past_len": 62, "causal": True,
                                                "bias": True}, {"flags": {"split_size": 32}},
               [64, 41]),
    "paged": ("decode_partial.{d}.m4", {"seq_len": 3, "past_len": 61, "causal": True,
                                        "kv_layout": "paged", "page_size": 16, "num_pages": 9,
                                        "kv_capacity": 64}, {"flags": {"split_size": 32}},
              [64, 35]),
}
# The browser runtime binds prefill and decode_partial over BSNH / BNSH only.
BROWSER_FAMILIES = ("prefill_sg", "prefill_wgmem", "decode_m1", "decode_m4")


def _check(session: attnreg.Session, backend: str, family: str, dtype: str,
           kv_dtype: str | None, seed: int) -> None:
    kid, fields, kw, lengths = FAMILIES[family]
    spec = attnreg.AttentionSpec(**{**GQA, **fields}, dtype=dtype, kv_dtype=kv_dtype)
    t = make_tensors(spec, seed, lengths=lengths)
    if spec.bias:
        t["bias"] = _bias_with_masked_blocks(spec, seed)
    d = SHORT[dtype]
    if backend == "browser" and dtype == "float16" and "shader-f16" not in \
            attnreg.devices("browser")[0].features:
        d = "f16.cast32"            # SwiftShader: float16 widened on the host
    kernel = f"{backend}.{kid.format(d=d)}"
    got, plan = session.run_with_plan(spec, t, kernel=kernel, **kw)
    assert plan.kernel == kernel
    _, problem = compare(spec, got, expected(spec, t))
    assert not problem, f"{kernel} {dtype}/{kv_dtype}: {problem}"


@pytest.fixture(scope="module", params=["webgpu", "dawn", "browser"])
def host(request):
    require_devices(request.param)
    with attnreg.Session(backend=request.param) as s:
        yield request.param, s


def _storages(backend: str, family: str) -> list[tuple[str, str | None]]:
    """Storages per family, rotating through STORAGES so that every storage meets every
    host in several families: webgpu three consecutive ones (each family then reads int8
    and int4), dawn and browser (the same WGSL through Tint) two. A cold compile costs about
    a second per variant on lavapipe, and the file must stay well under a minute."""
    i, n = list(FAMILIES).index(family), len(STORAGES)
    steps = (0, 1, 2) if backend == "webgpu" else (0, 2)
    return [STORAGES[(i + j) % n] for j in steps]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_storages_per_family(host, family):
    """Storages through one family's kernel (the browser: the families it binds)."""
    backend, session = host
    if backend == "browser" and family not in BROWSER_FAMILIES:
        pytest.skip("the browser runtime binds prefill and decode_partial, BSNH/BNSH only")
    for i, (dtype, kv_dtype) in enumerate(_storages(backend, family)):
        _check(session, backend, family, dtype, kv_dtype, seed=10 + i)


# -- the generated WGSL and the declarations ---------------------------------------------
def test_declarations():
    ks = wkernels.declare() + wkernels.declare_block_skip()
    ids = {k.id for k in ks}
    for kid in ("webgpu.prefill.bf16.sg", "webgpu.decode_partial.bf16.m4",
                "webgpu.decode_qk.bf16.m1", "webgpu.decode_pv.bf16", "webgpu.reduce.bf16",
                "webgpu.decode_partial.bf16.m2.blocks"):
        assert kid in ids
    for k in ks:
        if k.family == "reduce":
            assert not k.kv_dtypes
        else:
            assert k.kv_dtypes == {"int8", "int4"}, k.id
            assert "dequantized from their codes" in k.doc
        if "bfloat16" in k.dtypes:
            assert "shader-f16" not in k.features


def _spec(**kw: Any) -> attnreg.AttentionSpec:
    return attnreg.AttentionSpec(**{"seq_len": 1, "past_len": 31, "head_size": 64, **kw})


def test_binding_types_and_helpers():
    """Quantized K/V bind as words with their scales; bf16 q / K / V as 16-byte granules of
    8 values (vec4<u32>, float16's granule), bf16 out as word pairs; plain dtypes as before.
    Helpers exist only for what a program binds."""
    q8 = program.source("decode_partial", _spec(dtype="float16", kv_dtype="int8"),
                        {"M_TILE": 1, "GROUP_TILE": 1, "KV_TILE": 16, "THREADS": 64,
                         "PREFETCH": 1, "BALANCE": 0},
                        aux=frozenset({"k_scale", "v_scale"}))
    assert "var<storage, read> k: array<u32>;" in q8
    assert "var<storage, read> k_scale: array<f32>;" in q8
    assert "var<storage, read> q: array<mat2x4<f16>>;" in q8
    assert "fn i8x4(" in q8 and "fn store_out(" not in q8
    q4 = program.source("prefill", _spec(dtype="bfloat16", kv_dtype="int4"),
                        wtiles.prefill_consts(_spec(dtype="bfloat16"), {}),
                        aux=frozenset({"k_scale", "v_scale"}))
    assert "var<storage, read> v_scale: array<u32>;" in q4
    assert "var<storage, read> q: array<vec4<u32>>;" in q4
    assert "var<storage, read_write> out: array<vec2<u32>>;" in q4
    assert "enable f16;" not in q4 and "unpack2x16float(" in q4
    assert "alias GV = mat2x4<f32>;" in q4 and "alias TS = vec4<f32>;" in q4
    bf = program.source("decode_partial", _spec(dtype="bfloat16"),
                        {"M_TILE": 1, "GROUP_TILE": 1, "KV_TILE": 16, "THREADS": 64,
                         "PREFETCH": 1, "BALANCE": 0})
    for decl in ("var<storage, read> q: array<vec4<u32>>;", "var<storage, read> k: array<vec4<u32>>;",
                 "alias GV = vec4<u32>;", "const GRANULE: u32 = 8u;", "alias TS = vec2<u32>;",
                 "var<workgroup> k_s: array<TS, 1u + (1u - DIRECT) * (KV_TILE * K_STRIDE - 1u)>;"):
        assert decl in bf, decl
    red = program.source("reduce", _spec(dtype="bfloat16"), {"THREADS": 256})
    assert "fn bf16_pack(" in red and "fn load_q(" not in red
    assert wgsl_io.compute_itemsize(_spec(dtype="bfloat16")) == 4
    assert wgsl_io.granule(_spec(dtype="bfloat16")) == wgsl_io.granule(_spec(dtype="float16")) == 8


def test_staging_sized_in_staged_type():
    """bf16 K/V tiles are staged as bf16 bits: the workgroup storage (and so the fitted
    tiles and the plans) of float16; with quantized K/V they stage dequantized f32, as the
    f32 kernels do."""
    staged = {"kv_staging": "workgroup"}          # decode_partial's staged tiles
    for fn, p in ((wtiles.prefill_storage, {}), (wtiles.decode_storage, staged),
                  (wtiles.qk_storage, {}), (wtiles.pv_storage, {})):
        f32 = fn(_spec(), p)
        assert fn(_spec(dtype="bfloat16"), p) == fn(_spec(dtype="float16"), p) < f32
        assert fn(_spec(dtype="bfloat16", kv_dtype="int8"), p) == f32
        assert fn(_spec(dtype="float32", kv_dtype="int4"), p) == f32
    # read straight into registers (kv_staging "direct"), K/V take no workgroup storage
    direct = wtiles.decode_storage(_spec(), {})
    assert direct == wtiles.decode_storage(_spec(dtype="float16"), {}) < \
        wtiles.decode_storage(_spec(dtype="float16"), staged)
    assert wtiles.prefill_consts(_spec(dtype="bfloat16"), {}) == \
        wtiles.prefill_consts(_spec(dtype="float16"), {})


def test_bf16_plans_match_f16():
    """On the stored H100 profile the bf16 plans pick float16's kernels' tiles and splits:
    decode (GQA 32/8, H=128, L 2048..32768), whisper-style m4 decode and causal prefill."""
    caps = attnreg.profile("nvidia-h100")
    specs = [dict(seq_len=1, past_len=L - 1, num_heads=32, kv_num_heads=8, head_size=128)
             for L in (2048, 8192, 32768)]
    specs += [dict(seq_len=4, past_len=1496, num_heads=20, kv_num_heads=20, head_size=64),
              dict(seq_len=512, past_len=0, num_heads=32, kv_num_heads=8, head_size=128,
                   causal=True),
              dict(seq_len=2048, past_len=0, num_heads=32, kv_num_heads=8, head_size=128,
                   causal=True)]
    for fields in specs:
        f16 = attnreg.explain(attnreg.AttentionSpec(**fields, dtype="float16"), caps=caps)
        bf16 = attnreg.explain(attnreg.AttentionSpec(**fields, dtype="bfloat16"), caps=caps)
        assert bf16.route == f16.route and bf16.split == f16.split, fields
        assert [k.replace(".bf16", ".f16") for k in bf16.kernels] == list(f16.kernels), fields
        assert [dict(s.params) for s in bf16.stages] == [dict(s.params) for s in f16.stages]


def test_device_tensors():
    """Quantized codes, their scales and bf16 q / out as DeviceTensors bind as they are (no
    host copy): int8 K/V under bf16, then int4 under f16, written into a bf16 / f16 out.
    (dawn runs the same WebGpuRuntime.)"""
    require_devices("webgpu")
    with attnreg.Session(backend="webgpu") as s:
        for dtype, kv_dtype in (("bfloat16", "int8"), ("float16", "int4")):
            spec = attnreg.AttentionSpec(**GQA, seq_len=2, past_len=50, causal=True,
                                         dtype=dtype, kv_dtype=kv_dtype)
            t = make_tensors(spec, 3, lengths=[52, 29])
            dev = {n: s.tensor(np.ascontiguousarray(a)) for n, a in t.items()}
            out = s.empty(spec.out_shape, dtype)
            s.run(spec, dev, out=out)
            _, problem = compare(spec, out.numpy(), expected(spec, t))
            assert not problem, f"{dtype}/{kv_dtype}: {problem}"


def test_matrix_kernels_read_quantized_kv():
    """The f16 matrix-unit kernels stage dequantized K/V too (their emulated builds here)."""
    require_devices("webgpu")
    with attnreg.Session(backend="webgpu", flags={"matrix_units": "emulate",
                                                  "split_size": 32}) as s:
        for kv_dtype, fields in (("int4", {"seq_len": 1, "past_len": 70}),
                                 ("int8", {"seq_len": 20, "past_len": 30, "causal": True})):
            spec = attnreg.AttentionSpec(**{**GQA, **fields}, dtype="float16", kv_dtype=kv_dtype)
            t = make_tensors(spec, 2, lengths=[spec.capacity, spec.capacity - 13])
            got, plan = s.run_with_plan(spec, t)
            assert plan.kernels[0].endswith(".f16.mma") and plan.params["mma"] == "emulate"
            _, problem = compare(spec, got, expected(spec, t))
            assert not problem, f"{plan.kernels[0]} {kv_dtype}: {problem}"


@pytest.mark.parametrize("backend", ["webgpu", "dawn"])
def test_bf16_widening_and_rounding_are_exact(backend):
    """q = 0 over two keys: out = (v0 + v1) / 2 exactly in f32 (bf16 inputs, weights 1/2),
    and half of those sums are ties in bf16: the output must be ml_dtypes' round to nearest
    even of it, bit for bit (truncation or round-half-up would differ)."""
    require_devices(backend)
    import ml_dtypes

    spec = attnreg.AttentionSpec(batch=1, seq_len=1, past_len=1, num_heads=2, kv_num_heads=1,
                                 head_size=256, dtype="bfloat16", q_layout="BSNH",
                                 kv_layout="BSNH")
    rng = np.random.default_rng(7)
    v = rng.standard_normal(spec.kv_shape).astype(ml_dtypes.bfloat16)
    t = {"q": np.zeros(spec.q_shape, ml_dtypes.bfloat16), "k": v.copy(), "v": v}
    want = ((v[:, 0].astype(np.float32) + v[:, 1].astype(np.float32)) / 2).astype(
        ml_dtypes.bfloat16)                                   # [B, Nkv, H]
    with attnreg.Session(backend=backend) as s:
        for kid in ("prefill.bf16.sg", "decode_partial.bf16.m1"):
            got = s.run(spec, t, kernel=f"{backend}.{kid}")
            for h in range(spec.num_heads):
                assert np.array_equal(got[:, 0, h].view(np.uint16), want[:, 0].view(np.uint16)), \
                    f"{kid} head {h}"


def test_decode_reads_kv_directly_where_the_rules_say():
    """decode_partial reads K/V straight into registers (raw 16-byte words: k, and v unless
    quantized, bound as vec4<u32>) for one query row and small heads; the rules stage K/V
    for several rows per workgroup and for heads whose register tile would spill; int8 and
    int4 K/V keep 16-key tiles (a lane's q fits its registers there); a forced direct tile
    past DIRECT_MAX_REGS is rejected with its reason."""
    caps = attnreg.profile("nvidia-h100")
    gqa = dict(seq_len=1, past_len=8191, num_heads=32, kv_num_heads=8, head_size=128)
    cases = [(attnreg.AttentionSpec(**gqa), "direct", 16),
             (attnreg.AttentionSpec(**gqa, kv_dtype="int8"), "direct", 16),
             (attnreg.AttentionSpec(**gqa, kv_dtype="int4"), "direct", 16),
             (attnreg.AttentionSpec(seq_len=4, past_len=1496, num_heads=8, kv_num_heads=8,
                                    head_size=64), "workgroup", 16)]
    for spec, staging, tile in cases:
        stage = attnreg.explain(spec, caps=caps).stages[0]
        assert stage.family == "decode_partial", stage
        assert (stage.params["kv_staging"], stage.params.get("kv_tile", 16)) == (staging, tile)
    mla = attnreg.AttentionSpec(num_heads=16, kv_num_heads=1, head_size=576, v_head_size=512,
                                dtype="float16", seq_len=1, past_len=40)
    assert attnreg.explain(mla, caps=caps).stages[0].params["kv_staging"] == "workgroup"
    k = attnreg.registry.get().kernel("webgpu.decode_partial.f16.m1")
    why = k.not_supported_reasons(mla, caps, {"kv_staging": "direct"})
    assert any("kv_staging='direct' holds" in w for w in why), why
    consts = wtiles.stage_consts("decode_partial", _spec(dtype="float16", kv_dtype="int4"), {})
    assert consts["DIRECT"] == consts["KV_WIDE"] == 1
    src = program.source("decode_partial", _spec(dtype="float16", kv_dtype="int4"), consts,
                         aux=frozenset({"k_scale", "v_scale"}))
    assert "var<storage, read> k: array<vec4<u32>>;" in src
    assert "var<storage, read> v: array<u32>;" in src


def test_q_in_registers_where_the_lane_share_fits():
    """A direct decode_partial lane holds its q in registers (Q_IN_REGS) where its share --
    slice units x unit vec4s x query vectors -- is at most Q_REG_VEC4S vec4s and, with its two
    register tiles, LANE_REGS registers; staged tiles, decode_qk, and larger shares read q_s."""
    gqa = dict(seq_len=1, past_len=8191, num_heads=32, kv_num_heads=8, head_size=128)
    direct = {"kv_staging": "direct", "kv_tile": 16, "threads": 64}

    def q_regs(family: str, params: dict, **kw: object) -> int:
        return wtiles.stage_consts(family, attnreg.AttentionSpec(**{**gqa, **kw}),
                                   params)["Q_IN_REGS"]

    # f16 H=128, 4 vectors: 4 slices of 16 units -> 4 units x 2 vec4s x 4 = 32
    assert q_regs("decode_partial", direct, dtype="float16") == 1
    assert q_regs("decode_partial", direct, dtype="float16", kv_dtype="int8") == 1   # 2 x 4 x 4
    assert q_regs("decode_partial", {**direct, "kv_tile": 32}, dtype="float16",
                  kv_dtype="int8") == 0                                               # 4 x 4 x 4
    assert q_regs("decode_partial", direct, dtype="float16", head_size=256) == 0      # 8 x 2 x 4
    assert q_regs("decode_partial", direct, dtype="float16", num_heads=64) == 0       # 8 vectors
    assert q_regs("decode_partial", {**direct, "kv_staging": "workgroup"}, dtype="float16") == 0
    assert q_regs("decode_qk", direct, dtype="float16") == 0
    # f32: 32 vec4s of q (8 one-vec4 units x 4), but 16 load units a tile: 128 + 128 registers
    assert q_regs("decode_partial", direct, dtype="float32") == 0
    assert (wtiles.Q_REG_VEC4S, wtiles.LANE_REGS) == (32, 192)


@pytest.mark.parametrize("backend", ["webgpu", "dawn"])
def test_q_in_registers_and_in_workgroup_memory_match_the_reference(backend):
    """The same decode with q held in registers (f16 and int8 K/V, 16-key tiles) and read from
    q_s (int8's 32-key tiles, past the budget), several tiles a split and a ragged last one."""
    require_devices(backend)
    spec16 = attnreg.AttentionSpec(batch=2, seq_len=1, past_len=150, num_heads=8,
                                   kv_num_heads=2, head_size=128, dtype="float16")
    spec8 = spec16.replace(kv_dtype="int8")
    cases = [(spec16, 16, 1), (spec8, 16, 1), (spec8, 32, 0)]
    with attnreg.Session(backend=backend, flags={"split_size": 64}) as s:
        for spec, tile, in_regs in cases:
            params = {"kv_staging": "direct", "kv_tile": tile, "threads": 64}
            assert wtiles.stage_consts("decode_partial", spec, params)["Q_IN_REGS"] == in_regs
            t = make_tensors(spec, 3, lengths=[spec.capacity, spec.capacity - 37])
            got, plan = s.run_with_plan(spec, t, kernel=f"{backend}.decode_partial.f16.m1",
                                        params=params)
            assert plan.params["kv_tile"] == tile
            _, problem = compare(spec, got, expected(spec, t))
            assert not problem, f"{spec.kv_dtype} kv_tile {tile}: {problem}"


@pytest.mark.parametrize("backend", ["webgpu", "dawn"])
def test_direct_int4_scales_match_the_reference(backend):
    """The direct decode's int4 register tiles carry each block's scale as loaded (the word
    and the shift of its half), decoded where used: H=128 (blocks of a row in pairs) and
    H=96 (three blocks a row, so a row's first block sits in either half of a word), at 16-
    and 32-key tiles, against the float64 reference."""
    require_devices(backend)
    base = attnreg.AttentionSpec(batch=2, seq_len=1, past_len=150, num_heads=8, kv_num_heads=2,
                                 head_size=128, dtype="float16", kv_dtype="int4")
    with attnreg.Session(backend=backend, flags={"split_size": 64}) as s:
        for spec in (base, base.replace(head_size=96)):
            for tile in (16, 32):
                params = {"kv_staging": "direct", "kv_tile": tile, "threads": 64}
                t = make_tensors(spec, 5, lengths=[spec.capacity, spec.capacity - 37])
                got, plan = s.run_with_plan(spec, t, kernel=f"{backend}.decode_partial.f16.m1",
                                            params=params)
                assert plan.params["kv_staging"] == "direct"
                _, problem = compare(spec, got, expected(spec, t))
                assert not problem, f"H={spec.head_size} kv_tile {tile}: {problem}"


@pytest.mark.parametrize("backend", ["webgpu", "dawn"])
def test_staged_prefill_over_quantized_kv_matches_the_reference(backend):
    """The scalar prefill with K/V staged by the workgroup holds each quantized granule as
    loaded (kv_units.wgsl's RG: the code words, the scale's word, int4's shifts) and
    dequantizes it where it stores it: int8 in granules of 8 (float16: two words of codes),
    int4 in granules of 4 (float32: a granule in the low or the high nibbles), H=96 (int4: a
    row's blocks start in either half of a scale word), against the float64 reference.
    (lavapipe's own plan reads K/V directly; the staged decode's conformance cells take int4
    granules of 8.)"""
    require_devices(backend)
    with attnreg.Session(backend=backend) as s:
        for dtype, tag, kv in (("float16", "f16", "int8"), ("float32", "f32", "int4")):
            spec = attnreg.AttentionSpec(batch=2, seq_len=40, past_len=30, num_heads=4,
                                         kv_num_heads=2, head_size=96, dtype=dtype,
                                         causal=True, kv_dtype=kv)
            t = make_tensors(spec, 7, lengths=[spec.capacity, spec.capacity - 9])
            got, plan = s.run_with_plan(spec, t, kernel=f"{backend}.prefill.{tag}.sg",
                                        params={"kv_staging": "workgroup"})
            assert plan.params["kv_staging"] == "workgroup"
            _, problem = compare(spec, got, expected(spec, t))
            assert not problem, f"{dtype} {kv}: {problem}"
