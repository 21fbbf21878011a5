"""Two-sided windows (docs/contract.md "Every head size, two-sided windows"): ``right_window`` in
the spec (keys more than right_window positions after a row's position are invisible; the left
side stays ``local_window``), the float64 reference against the naive loop transcription
(tests/naive.py), the kernels' parameter block, and every WGSL and OpenCL kernel family forced on
narrow two-sided windows over long sequences whose keys and bias entries outside the windows are
NaN (a kernel that loads and weights them, or misses a tile inside them, fails), on rows that see
no key at all (out 0, lse -inf), block-skip lists clipped to the windows, and windows near 2**31
(no int32 overflow). The conformance matrix's window cells (attnreg.tools.cases window_cells) add
every kernel variant.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import attnreg
from attnreg import reference as ref
from attnreg.backends import common
from attnreg.errors import SpecError
from attnreg.spec import INT_MAX, AttentionSpec
from attnreg.tensors import check_tensors, kv_starts, q_lengths, valid_lengths
from attnreg.testing import compare, expected, make_tensors, plant_nonfinite, visibility
from attnreg.tools.recipes import doc_mask
from tests.naive import naive_attention
from tests.support import require_devices, require_opencl_device

BASE: dict[str, Any] = dict(batch=2, seq_len=6, past_len=13, num_heads=4, kv_num_heads=2,
                            head_size=16, causal=False)

# -- the spec --------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-2, 2**31, 1.5, True, "2", None])
def test_bad_right_window_is_a_spec_error(value: Any) -> None:
    with pytest.raises(SpecError) as err:
        AttentionSpec(**{**BASE, "right_window": value})
    assert err.value.field == "right_window" and "2**31-1" in str(err.value)


def test_right_window_is_a_feature_only_where_it_can_change_the_result() -> None:
    assert "right_window" not in AttentionSpec(**BASE).features            # -1: none
    zero = AttentionSpec(**{**BASE, "right_window": 0})                      # 0: meaningful
    assert "right_window" in zero.features and "right_window" in zero.short()
    assert AttentionSpec(**{**BASE, "right_window": INT_MAX}).right_window == INT_MAX
    causal = AttentionSpec(**{**BASE, "causal": True, "right_window": 3})
    assert "right_window" not in causal.features                            # j <= p already
    assert repr(zero) == "AttentionSpec(batch=2, seq_len=6, past_len=13, num_heads=4, " \
        "kv_num_heads=2, head_size=16, causal=False, right_window=0)"


def test_params_block_carries_the_right_window() -> None:
    """right_window takes the place of the pad word after the ALiBi fields: the block keeps
    its size (a multiple of 16 bytes, as WGSL uniforms need) and every other field its
    offset."""
    assert common.SIZE % 16 == 0 and "pad0" not in dict(common.FIELDS)
    names = [n for n, _ in common.FIELDS]
    assert names.index("right_window") == names.index("alibi_e1") + 1
    assert dict(common.FIELDS)["right_window"] == "i"
    spec = AttentionSpec(**{**BASE, "right_window": 5})
    assert common.values(spec, {})["right_window"] == 5
    assert common.values(AttentionSpec(**BASE), {})["right_window"] == -1


# -- the reference ---------------------------------------------------------------------------

REFERENCE_CASES: dict[str, dict[str, Any]] = {
    "right-only": {"right_window": 2},
    "right-zero": {"right_window": 0},
    "two-sided": {"right_window": 1, "local_window": 3},
    "two-sided-one-key": {"right_window": 0, "local_window": 1},        # the row's own key
    "kv-start-empty-rows": {"right_window": 0, "kv_start": True, "past_len": 0,
                            "return_lse": True},
    "everything": {"right_window": 2, "local_window": 5, "kv_start": True, "seqlens_q": True,
                   "seqlens_k": True, "kv_capacity": 24, "bias": True, "softcap": 3.0,
                   "alibi_max_bias": 4.0, "head_sink": True, "return_lse": True,
                   "q_layout": "BNSH", "kv_layout": "BSNH"},
    "causal-ignores-it": {"right_window": 1, "causal": True, "local_window": 4},
}


def _tensors(spec: AttentionSpec, seed: int = 0) -> dict[str, np.ndarray]:
    # kv_start past row 0's right window in batch 0: rows that see no key at all
    starts = [min(4, spec.total_len - 1), 0] if spec.kv_start else None
    return check_tensors(spec, make_tensors(spec, seed, starts=starts,
                                            lengths=[24, 17] if spec.seqlens_k else None))


@pytest.mark.parametrize("name", list(REFERENCE_CASES))
def test_reference_matches_the_naive_loop(name: str) -> None:
    spec = AttentionSpec(**{**BASE, **REFERENCE_CASES[name]})
    t = _tensors(spec)
    out, lse = ref.attention(spec, t)
    n_out, n_lse = naive_attention(spec, t)
    np.testing.assert_allclose(out, n_out, atol=1e-12, rtol=1e-12)
    np.testing.assert_allclose(lse, n_lse, atol=1e-12, rtol=1e-12)
    if name == "kv-start-empty-rows":           # rows 0..3 of batch 0 see nothing
        assert np.isneginf(lse[0, :, :4]).all() and not out[0, :, :4].any()
        assert np.isfinite(lse[0, :, 4:]).all()


def test_visibility_is_the_contracts() -> None:
    """key j is visible iff ... and j <= p_i + right_window (testing.visibility, which
    plants non-finite values, agrees with the reference's rule)."""
    spec = AttentionSpec(**{**BASE, "right_window": 2, "local_window": 3})
    t = _tensors(spec)
    vis = visibility(spec, valid_lengths(spec, t), kv_starts(spec, t), q_lengths(spec, t))
    p = spec.past_len + np.arange(spec.seq_len)[:, None]
    j = np.arange(spec.capacity)[None, :]
    want = (j > p - 3) & (j <= p + 2)
    assert (vis == want[None]).all() and (vis.sum(axis=-1)[:, :-2] == 5).all()


def test_right_window_zero_is_causal_and_causal_ignores_it() -> None:
    spec = AttentionSpec(**{**BASE, "bias": True, "return_lse": True, "local_window": 4})
    t = _tensors(spec, 3)
    causal = ref.attention(spec.replace(causal=True), t)
    for other in (spec.replace(right_window=0), spec.replace(causal=True, right_window=0),
                  spec.replace(causal=True, right_window=INT_MAX)):
        got = ref.attention(other, t)
        assert all(np.array_equal(a, b) for a, b in zip(got, causal)), other


def test_partial_states_split_the_two_sided_window() -> None:
    """Split-KV partial states over a two-sided window reduce to the attention, splits
    wholly outside it empty (o 0, lse -inf)."""
    spec = AttentionSpec(**{**BASE, "past_len": 40, "right_window": 1, "local_window": 3,
                            "return_lse": True})
    t = _tensors(spec, 4)
    o, lse = ref.partial_states(spec, t, 8)
    assert np.isneginf(lse[..., :4]).all() and not o[..., :4, :].any()   # keys < 32
    out, l_red = ref.reduce(spec, o, lse)
    want_out, want_lse = ref.attention(spec, t)
    np.testing.assert_allclose(out, want_out, atol=1e-12)
    np.testing.assert_allclose(l_red, want_lse, atol=1e-12)


# -- the kernels -----------------------------------------------------------------------------
# (kernel id after "<backend>.", params, flags): one or more kernels of every family, the
# block-skipping variants and the matrix kernels' emulated builds.
WGSL_KERNELS: tuple[tuple[str, dict[str, Any], dict[str, Any]], ...] = (
    ("prefill.f32.sg", {}, {}),
    ("prefill.f16.wgmem", {"kv_staging": "workgroup", "kv_tile": 16}, {}),
    ("decode_partial.f32.m4", {}, {"split_size": 32}),
    ("decode_partial.f16.m1", {}, {"split_size": 64}),
    ("decode_qk.f32.m2", {}, {"split_size": 32}),
    ("prefill.f32.sg.blocks", {"q_tile": 16}, {"block_skip": "on"}),
    ("decode_partial.f32.m2.blocks", {}, {"block_skip": "on", "split_size": 32}),
    ("prefill.f16.mma", {"mma": "emulate"}, {}),
    ("decode_partial.f16.mma", {"mma": "emulate"}, {"split_size": 32}),
)
# Dawn compiles the very WGSL the webgpu backend runs (one program builder): two families
# prove its host (every kernel's window cells run on Dawn in the conformance matrix)
DAWN_KERNELS = tuple(k for k in WGSL_KERNELS if k[0] in ("prefill.f32.sg", "decode_partial.f32.m4"))
EMU = {"sg_impl": "emu"}
MMA = {"mma": "emulate"}
OPENCL_KERNELS: tuple[tuple[str, dict[str, Any], dict[str, Any]], ...] = (
    ("prefill.f32.wgmem", {}, {}),
    ("prefill.f16.sg", EMU, {}),
    ("decode_partial.f32.m4", {"split_size": 32}, {}),
    ("decode_fused.f32.sg.m2", {**EMU, "split_size": 32}, {}),
    ("decode_qk.f32.m2", {"split_size": 32}, {}),
    ("prefill.f32.wgmem.bs", {}, {}),
    ("decode_partial.f32.m1.bs", {"split_size": 32}, {}),
    ("prefill.f16.mma", MMA, {}),
    ("decode_fused.f16.mma", {**MMA, "split_size": 32}, {}),
)


def _spec(kid: str, name: str) -> AttentionSpec:
    prefill = kid.startswith("prefill")
    dtype = "float16" if ".f16." in kid else "float32"
    s = 40 if prefill else 5
    bias = ".bs" in kid or ".blocks" in kid
    f: dict[str, Any] = dict(batch=2, num_heads=4, kv_num_heads=2, head_size=64, dtype=dtype,
                             causal=False, return_lse=True, bias=bias, seq_len=s)
    if name == "narrow-long":        # a narrow two-sided window over a long sequence
        f.update(past_len=400 - s, local_window=6, right_window=2, seqlens_k=True,
                 kv_capacity=400)
    elif name == "empty-rows":       # kv_start past the right window of the first rows
        f.update(past_len=60 - s, right_window=0, kv_start=True, seqlens_q=True)
    else:                            # windows that reach past every key: no overflow
        f.update(past_len=50 - s, right_window=INT_MAX, local_window=INT_MAX, causal=False)
    return AttentionSpec(**f)


def _inputs(spec: AttentionSpec, seed: int) -> dict[str, np.ndarray]:
    """make_tensors' inputs (NaN past L_b and before kv_start), with NaN also in the keys
    (k and v) no row sees and in the bias entries outside each row's windows; a document
    mask over the bias for the block-skipping kernels (whole -inf blocks to skip); and
    testing.plant_nonfinite's NaN / inf that some rows see and others do not, among them a
    value just right of the first row's right window (its row must stay clean: a tile on a
    window's edge selects each contribution, 0 * NaN = NaN otherwise)."""
    starts = [spec.total_len - 3, 0] if spec.kv_start else None
    t = make_tensors(spec, seed, lengths=[400, 333] if spec.seqlens_k else None,
                     starts=starts, q_lens=[spec.seq_len, 2] if spec.seqlens_q else None)
    vis = visibility(spec, valid_lengths(spec, t), kv_starts(spec, t), q_lengths(spec, t))
    if spec.bias:
        t["bias"] = doc_mask(spec, t["bias"], 3, True)
        t["bias"] = np.where(vis[:, None], t["bias"], np.nan).astype(np.float32)
    unseen = ~vis.any(axis=1)[:, None, :, None]      # [B, 1, C, 1]: BNSH, the default layout
    for name in ("k", "v"):
        t[name] = np.where(unseen, np.nan, t[name]).astype(t[name].dtype)
    plant_nonfinite(spec, t)
    return t


def _check(session: attnreg.Session, backend: str, kid: str, params: dict[str, Any],
           flags: dict[str, Any], name: str) -> None:
    spec = _spec(kid, name)
    t = _inputs(spec, seed=len(kid) + len(name))
    kernel = f"{backend}.{kid}"
    got, plan = session.run_with_plan(spec, t, kernel=kernel, params=params or None,
                                      flags=flags or None)
    assert plan.kernel == kernel
    want = expected(spec, t)
    assert not np.isnan(want[0]).all()
    _, problem = compare(spec, got, want)
    assert not problem, f"{kernel} {name}: {problem}"
    if name == "empty-rows":             # batch 0's first rows see no key: 0 and -inf
        out, lse = got
        assert np.isneginf(want[1][0, :, :2]).all() and np.isneginf(lse[0, :, :2]).all()
        assert not ref.q_canonical(spec, out.astype(np.float32))[0, :, :2].any()


NAMES = ("narrow-long", "empty-rows", "beyond-int32")


@pytest.fixture(scope="module")
def webgpu() -> Iterator[attnreg.Session]:
    require_devices("webgpu")
    with attnreg.Session(backend="webgpu") as s:
        yield s


@pytest.mark.parametrize("kernel", WGSL_KERNELS, ids=[k[0] for k in WGSL_KERNELS])
def test_webgpu(webgpu: attnreg.Session, kernel: tuple[str, dict[str, Any], dict[str, Any]]
                ) -> None:
    for name in NAMES:
        _check(webgpu, "webgpu", *kernel, name)


def test_dawn() -> None:
    require_devices("dawn")
    with attnreg.Session(backend="dawn") as s:
        for kernel in DAWN_KERNELS:
            for name in NAMES[:2]:
                _check(s, "dawn", *kernel, name)


@pytest.fixture(scope="module")
def opencl() -> Iterator[attnreg.Session]:
    with attnreg.Session(backend="opencl", device=require_opencl_device().id) as s:
        yield s


@pytest.mark.parametrize("kernel", OPENCL_KERNELS, ids=[k[0] for k in OPENCL_KERNELS])
def test_opencl(opencl: attnreg.Session, kernel: tuple[str, dict[str, Any], dict[str, Any]]
                ) -> None:
    kid, params, _ = kernel
    for name in NAMES:
        _check(opencl, "opencl", kid, params, {}, name)
