"""The float64 reference against a naive per-row transcription of docs/contract.md."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import attnreg
from attnreg import reference as ref
from attnreg.tensors import check_tensors
from attnreg.testing import plant_nonfinite
from tests.naive import naive_attention
from tests.support import make_tensors

BASE = dict(batch=2, seq_len=3, past_len=9, num_heads=4, kv_num_heads=2, head_size=8)

FEATURES = {
    "plain": {},
    "noncausal": {"causal": False},
    "bias": {"bias": True},
    "seqlens_capacity": {"seqlens_k": True, "kv_capacity": 17},
    "window": {"local_window": 4},
    "softcap": {"softcap": 2.5},
    "alibi": {"alibi_max_bias": 8.0},
    "alibi_nonpow2": {"alibi_max_bias": 8.0, "num_heads": 6, "kv_num_heads": 3},
    "sink": {"head_sink": True},
    "layouts": {"q_layout": "BNSH", "kv_layout": "BSNH"},
    "mha": {"kv_num_heads": 4},
    "mqa": {"kv_num_heads": 1},
    "scale": {"scale": 0.3},
    "f16": {"dtype": "float16"},
    "everything": {"bias": True, "seqlens_k": True, "kv_capacity": 20, "local_window": 5,
                   "softcap": 3.0, "alibi_max_bias": 4.0, "head_sink": True,
                   "q_layout": "BNSH", "kv_layout": "BSNH", "causal": True},
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_reference_matches_naive(name: str) -> None:
    spec = attnreg.AttentionSpec(**{**BASE, **FEATURES[name]})
    t = check_tensors(spec, make_tensors(spec, seed=hash(name) % 1000))
    out, lse = ref.attention(spec, t)
    n_out, n_lse = naive_attention(spec, t)
    np.testing.assert_allclose(out, n_out, atol=1e-12, rtol=1e-10)
    np.testing.assert_allclose(lse, n_lse, atol=1e-12, rtol=1e-10)
    assert not np.isnan(out).any()


@pytest.mark.parametrize("bias_shape", [(1, 4, 3, 12), (2, 1, 3, 12), (2, 4, 1, 12), (1, 1, 1, 12)])
def test_bias_broadcast(bias_shape: tuple[int, ...]) -> None:
    spec = attnreg.AttentionSpec(**{**BASE, "bias": True})
    t = check_tensors(spec, make_tensors(spec, seed=3, bias_shape=bias_shape, mask_frac=0.2))
    np.testing.assert_allclose(ref.attention(spec, t)[0], naive_attention(spec, t)[0], atol=1e-12)


def test_nan_beyond_seqlens_never_reaches_output() -> None:
    spec = attnreg.AttentionSpec(**{**BASE, "seqlens_k": True, "kv_capacity": 30})
    t = make_tensors(spec, seed=5, lengths=[3, 30])      # batch 0 has 27 NaN keys
    assert np.isnan(t["k"]).any()
    out, lse = ref.attention(spec, check_tensors(spec, t))
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    np.testing.assert_allclose(out, naive_attention(spec, t)[0], atol=1e-12)


def test_fully_masked_rows_are_zero_with_neg_inf_lse() -> None:
    spec = attnreg.AttentionSpec(**{**BASE, "bias": True})
    t = make_tensors(spec, seed=1)
    t["bias"][0, 1, 2, :] = -np.inf        # one row fully masked by the bias
    t["bias"][1, :, 0, :] = -np.inf        # batch 1, row 0, every head
    out, lse = ref.attention(spec, check_tensors(spec, t))
    assert (out[0, 1, 2] == 0).all() and lse[0, 1, 2] == -np.inf
    assert (out[1, :, 0] == 0).all() and np.isneginf(lse[1, :, 0]).all()
    assert np.isfinite(out).all()
    # with a sink the row is no longer empty: out stays 0 (no values), lse = sink
    spec2 = spec.replace(head_sink=True)
    t["head_sink"] = np.full(4, 0.5, np.float32)
    out2, lse2 = ref.attention(spec2, check_tensors(spec2, t))
    assert (out2[0, 1, 2] == 0).all() and lse2[0, 1, 2] == pytest.approx(0.5)


def test_window_and_causal_can_leave_rows_empty_without_nan() -> None:
    # seq_len > L means early rows have p_i < 0: no visible key at all.
    spec = attnreg.AttentionSpec(batch=1, seq_len=4, past_len=0, num_heads=1, head_size=4,
                                 seqlens_k=True, kv_capacity=4)
    t = make_tensors(spec, seed=2, lengths=[4])
    out, _ = ref.attention(spec, check_tensors(spec, t))
    assert np.isfinite(out).all()


SPLIT_SPECS = [
    attnreg.AttentionSpec(**{**BASE, **FEATURES["everything"]}),
    attnreg.AttentionSpec(batch=1, seq_len=1, past_len=40, num_heads=4, kv_num_heads=1,
                          head_size=8, seqlens_k=True, kv_capacity=64),
    attnreg.AttentionSpec(batch=2, seq_len=5, past_len=20, num_heads=2, head_size=4,
                          local_window=3, head_sink=True),
]


@pytest.mark.parametrize("split_size", [1, 3, 8, 16, 64, 1000])
@pytest.mark.parametrize("which", range(len(SPLIT_SPECS)))
def test_partials_reduce_to_full_attention(which: int, split_size: int) -> None:
    spec = SPLIT_SPECS[which]
    t = check_tensors(spec, make_tensors(spec, seed=which, lengths=[9, 20][: spec.batch]
                                         if spec.seqlens_k else None))
    o_parts, lse_parts = ref.partial_states(spec, t, split_size)
    assert o_parts.shape == (spec.batch, spec.num_heads, spec.seq_len,
                             ref.n_splits(spec, split_size), spec.head_size)
    empty = np.isneginf(lse_parts)
    if split_size <= 8:
        assert empty.any(), "this case is meant to include empty splits"
    assert (o_parts[empty] == 0).all()
    out, lse = ref.reduce(spec, o_parts, lse_parts, t.get("head_sink"))
    want, want_lse = ref.attention(spec, t)
    np.testing.assert_allclose(out, want, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12)


def test_merge_states_is_order_independent_and_matches_full() -> None:
    spec = attnreg.AttentionSpec(batch=1, seq_len=2, past_len=30, num_heads=2, head_size=8,
                                 causal=False)
    t = check_tensors(spec, make_tensors(spec, seed=9))
    o_parts, lse_parts = ref.partial_states(spec, t, 8)
    states = [(o_parts[..., i, :].astype(np.float32), lse_parts[..., i].astype(np.float32))
              for i in range(o_parts.shape[3])]
    want = ref.attention(spec, t)
    results = []
    for perm in itertools.islice(itertools.permutations(range(len(states))), 6):
        o, lse = attnreg.merge_states([states[i] for i in perm])
        assert o.dtype == np.float32 and lse.dtype == np.float32
        np.testing.assert_allclose(o, want[0], atol=2e-6)
        np.testing.assert_allclose(lse, want[1], atol=2e-5)
        results.append(o)
    for r in results[1:]:
        np.testing.assert_allclose(r, results[0], atol=1e-6)
    # an empty state (lse=-inf, o garbage) contributes nothing and leaks no NaN
    junk = (np.full_like(states[0][0], np.nan), np.full_like(states[0][1], -np.inf))
    o, lse = attnreg.merge_states([*states, junk])
    np.testing.assert_allclose(o, want[0], atol=2e-6)


def test_alibi_slopes_match_contract_formula() -> None:
    s = ref.alibi_slopes(12, 8.0)
    n = 8
    m0, m1 = 2 ** (-8.0 / n), 2 ** (-4.0 / n)
    want = [m0 ** (h + 1) if h < n else m1 ** (2 * (h - n) + 1) for h in range(12)]
    np.testing.assert_allclose(s, want, rtol=1e-15)


@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_paged_layout_equals_contiguous(page_size: int) -> None:
    spec = attnreg.AttentionSpec(batch=3, seq_len=2, past_len=30, num_heads=4, kv_num_heads=2,
                                 head_size=8, seqlens_k=True, kv_capacity=40, bias=True)
    pages = 3 * (-(-40 // page_size)) + 2
    paged = spec.replace(kv_layout="paged", page_size=page_size, num_pages=pages)
    t = make_tensors(paged, seed=4, lengths=[40, 7, 2])
    assert np.isnan(t["k"]).any() and (t["block_table"] == -1).any()
    t = check_tensors(paged, t)
    # the same keys, contiguous
    flat = {"q": t["q"], "bias": t["bias"], "seqlens_k": t["seqlens_k"],
            "k": np.zeros(spec.kv_shape, np.float32), "v": np.zeros(spec.kv_shape, np.float32)}
    for b, L in enumerate(t["seqlens_k"]):
        for j in range(L):
            page, slot = t["block_table"][b, j // page_size], j % page_size
            flat["k"][b, :, j] = t["k"][page, slot]
            flat["v"][b, :, j] = t["v"][page, slot]
    got = ref.attention(paged, t)
    want = ref.attention(spec, check_tensors(spec, flat))
    np.testing.assert_allclose(got[0], want[0], atol=1e-12)
    assert np.isfinite(got[0]).all()


def test_paged_block_table_is_checked() -> None:
    spec = attnreg.AttentionSpec(batch=2, seq_len=1, past_len=9, num_heads=2, head_size=8,
                                 kv_layout="paged", page_size=4, num_pages=6, seqlens_k=True)
    t = make_tensors(spec, seed=1, lengths=[10, 3])
    bad = dict(t, block_table=t["block_table"].copy())
    bad["block_table"][1, 0] = 6
    with pytest.raises(attnreg.SpecError, match=r"block_table'\]\[1, 0\]"):
        check_tensors(spec, bad)
    bad["block_table"] = t["block_table"].astype(np.float32)
    with pytest.raises(attnreg.SpecError, match=r"block_table'\]\.dtype"):
        check_tensors(spec, bad)
    with pytest.raises(attnreg.SpecError, match="page_size"):
        spec.replace(page_size=None)
    with pytest.raises(attnreg.SpecError, match="num_pages"):
        attnreg.AttentionSpec(num_pages=3)
    ok = dict(t, block_table=t["block_table"].copy())
    ok["block_table"][1, 2] = 99          # past batch 1's length (3 keys = 1 page): ignored
    check_tensors(spec, ok)


# -- non-finite values (docs/contract.md "Non-finite values and scalar fields"): positional visibility
NONFINITE = {
    "causal": {},
    "everything": FEATURES["everything"],
    "window-noncausal": {"causal": False, "local_window": 4, "seqlens_k": True, "kv_capacity": 14},
    "bias-bcast": {"bias": True, "softcap": 2.0},
}


@pytest.mark.parametrize("name", list(NONFINITE))
def test_nonfinite_reference_matches_naive(name: str) -> None:
    spec = attnreg.AttentionSpec(**{**BASE, **NONFINITE[name]})
    shape = (1, spec.num_heads, 1, spec.capacity) if name == "bias-bcast" else None
    t = make_tensors(spec, seed=7, bias_shape=shape,
                     lengths=[spec.capacity, spec.capacity - 4] if spec.seqlens_k else None)
    plant_nonfinite(spec, t)
    t = check_tensors(spec, t)
    out, lse = ref.attention(spec, t)
    n_out, n_lse = naive_attention(spec, t)
    np.testing.assert_allclose(out, n_out, atol=1e-12, rtol=1e-10)   # NaN where NaN
    np.testing.assert_allclose(lse, n_lse, atol=1e-12, rtol=1e-10)
    assert np.isnan(out).any() and np.isfinite(out).any()


def test_nonfinite_seen_only_by_the_rows_that_see_it() -> None:
    """Causal, 3 rows, L = 12: key 11 is visible to row 2 only, key 10 to rows 1 and 2."""
    spec = attnreg.AttentionSpec(batch=1, seq_len=3, past_len=9, num_heads=2, kv_num_heads=1,
                                 head_size=4, q_layout="BNSH", kv_layout="BNSH", bias=True,
                                 return_lse=True)
    clean = make_tensors(spec, seed=3)
    want_out, want_lse = ref.attention(spec, check_tensors(spec, clean))
    t = {n: a.copy() for n, a in clean.items()}
    t["k"][0, 0, 11, 2] = np.nan           # only row 2 sees it: rows 0, 1 unchanged
    t["v"][0, 0, 11, :] = np.nan           # weight 0 for rows 0, 1: must not multiply
    t["v"][0, 0, 10, 1] = np.inf           # rows 1, 2: component 1 NaN, lse unchanged
    t["bias"][0, 1, 0, 10] = np.nan        # invisible to row 0
    t["bias"][0, 0, 1, 11] = np.inf        # invisible to row 1
    t["bias"][0, 1, 0, 3] = -np.inf        # visible, masks the logit
    t["bias"][0, 0, 0, 2] = np.inf         # visible: row 0 of head 0 NaN
    out, lse = ref.attention(spec, check_tensors(spec, t))
    assert np.isnan(out[0, :, 2]).all() and np.isnan(lse[0, :, 2]).all()
    assert np.isnan(out[0, 0, 0]).all() and np.isnan(lse[0, 0, 0])
    assert np.isnan(out[0, :, 1, 1]).all() and not np.isnan(np.delete(out[0, :, 1], 1, -1)).any()
    np.testing.assert_allclose(lse[0, :, 1], want_lse[0, :, 1], atol=1e-12)
    np.testing.assert_allclose(np.delete(out[0, :, 1], 1, -1),
                               np.delete(want_out[0, :, 1], 1, -1), atol=1e-12)
    # head 1 row 0: the -inf bias changes its weights, nothing is NaN
    assert np.isfinite(out[0, 1, 0]).all() and np.isfinite(lse[0, 1, 0])
    spec2 = spec.replace(return_lse=False)
    np.testing.assert_allclose(naive_attention(spec2, check_tensors(spec2, t))[0], out, atol=1e-12)


@pytest.mark.parametrize("split_size", [1, 4, 16])
def test_nonfinite_partials_reduce_to_attention(split_size: int) -> None:
    spec = attnreg.AttentionSpec(**{**BASE, **FEATURES["everything"]})
    t = make_tensors(spec, seed=11, lengths=[20, 13])
    plant_nonfinite(spec, t)
    t = check_tensors(spec, t)
    o_parts, lse_parts = ref.partial_states(spec, t, split_size)
    assert np.isnan(o_parts).any() and np.isnan(lse_parts).any()
    empty = np.isneginf(lse_parts)
    assert (o_parts[empty] == 0).all()
    out, lse = ref.reduce(spec, o_parts, lse_parts, t["head_sink"])
    want, want_lse = ref.attention(spec, t)
    np.testing.assert_allclose(out, want, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12)


def test_combine_propagates_nonfinite_o_of_every_nonempty_split() -> None:
    o = np.ones((2, 3, 4))
    lse = np.array([[0.0, -np.inf, -800.0], [0.0, np.nan, 1.0]])
    o[0, 1] = np.nan                       # empty split: ignored
    o[0, 2, 3] = np.nan                    # weight underflows to 0: still NaN
    o[0, 0, 1] = np.inf                    # inf in o: NaN out
    out, m = ref.combine(o, lse)
    assert np.isnan(out[0, [1, 3]]).all() and (out[0, [0, 2]] == 1).all()
    assert m[0] == pytest.approx(0.0)
    assert np.isnan(out[1]).all() and np.isnan(m[1])      # a NaN lse_t: the row is NaN


def test_reference_backend_runs_paged_kv() -> None:
    """kv_layout="paged" on the reference backend: a pool built from a contiguous cache (an
    independent scatter, shuffled pages) gives what the contiguous spec gives."""
    flat = attnreg.AttentionSpec(batch=2, seq_len=3, past_len=30, num_heads=4, kv_num_heads=2,
                                 head_size=8, seqlens_k=True, kv_capacity=40, bias=True,
                                 causal=True, return_lse=True, kv_layout="BSNH")
    t = make_tensors(flat, seed=6, lengths=[40, 11])
    ps = 5
    paged = flat.replace(kv_layout="paged", page_size=ps, num_pages=20)
    rng = np.random.default_rng(0)
    order = rng.permutation(20)
    pool = {n: np.full(paged.kv_shape, np.nan, np.float32) for n in ("k", "v")}
    table = np.full(paged.block_table_shape, -1, np.int32)
    nxt = 0
    for b, L in enumerate(t["seqlens_k"]):
        for p in range(-(-int(L) // ps)):
            table[b, p] = order[nxt]
            for n in ("k", "v"):                       # t[n] is BSNH [B, C, Nkv, H]
                pool[n][order[nxt], : min(ps, L - p * ps)] = t[n][b, p * ps: min((p + 1) * ps, L)]
            nxt += 1
    tp = {**t, **pool, "block_table": table}
    assert attnreg.explain(paged, backend="reference").kernel.startswith("reference.")
    got = attnreg.run(paged, tp, backend="reference")
    want = attnreg.run(flat, t, backend="reference")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    with attnreg.Session(backend="reference") as s:      # the split-KV route too
        o, lse = s.partial_states(paged, tp, split_size=16)
        o2, lse2 = s.partial_states(flat, t, split_size=16)
        np.testing.assert_array_equal(o, o2)
        np.testing.assert_array_equal(lse, lse2)
