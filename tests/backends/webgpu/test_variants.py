"""The issue-8 variants on WebGPU beyond the registry-generated cells: masked-block skipping
on block-structured biases (zero blocks, per-head lists, balanced splits, partial states),
the unfused decode route on longer caches and several rows, paged caches through every
K/V reader, and the rules that choose them."""

from __future__ import annotations

import numpy as np
import pytest

import attnreg
from attnreg import reference as ref
from attnreg.tensors import check_tensors
from attnreg.testing import compare_partials
from tests.support import check_close, make_tensors, require_devices


@pytest.fixture(scope="module")
def session():
    require_devices("webgpu")
    with attnreg.Session(backend="webgpu") as s:
        yield s


def packed_bias(lengths: list[int], rows: int | None = None, heads: int = 1,
                causal: bool = False, batch: int = 1) -> np.ndarray:
    """Block-diagonal bias of sequences packed in one batch entry: a key is visible (0) only
    from its own sequence; the last ``rows`` query rows (all if None) are the queries."""
    n = sum(lengths)
    full = np.full((n, n), -np.inf, np.float32)
    start = 0
    for L in lengths:
        blk = np.zeros((L, L), np.float32)
        if causal:
            blk[np.triu_indices(L, 1)] = -np.inf
        full[start:start + L, start:start + L] = blk
        start += L
    full = full[n - (rows or n):]
    return np.array(np.broadcast_to(full, (batch, heads, *full.shape)))


def _dt(spec: attnreg.AttentionSpec) -> str:
    return "f16" if spec.dtype == "float16" else "f32"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("red", ["sg", "wgmem"])
def test_prefill_block_skip_on_packed_sequences(session, dtype, red):
    lengths = [37, 64, 19, 40]
    n = sum(lengths)
    spec = attnreg.AttentionSpec(seq_len=n, past_len=0, num_heads=4, kv_num_heads=2,
                                 head_size=32, dtype=dtype, causal=True, bias=True,
                                 return_lse=True)
    t = make_tensors(spec, 1)
    t["bias"] = packed_bias(lengths)
    t["bias"][0, 0, 5, 3] = 0.75                 # one non-zero block: its bias is loaded
    kid = f"webgpu.prefill.{_dt(spec)}.{red}.blocks"
    for p in ({"q_tile": 16, "kv_staging": "direct", "max_k_step": 16},
              {"q_tile": 8, "kv_staging": "workgroup", "kv_tile": 16}):
        check_close(spec, session.run(spec, t, kernel=kid, params=p), t, what=str(p))


def test_prefill_block_skip_per_head_and_batch_lists(session):
    spec = attnreg.AttentionSpec(batch=2, seq_len=50, past_len=30, num_heads=4,
                                 kv_num_heads=2, head_size=64, causal=True, bias=True,
                                 seqlens_k=True, kv_capacity=96, local_window=60)
    t = make_tensors(spec, 2, lengths=[96, 70])
    rng = np.random.default_rng(0)
    bias = np.where(rng.random((2, 4, 50, 96)) < 0.02, 0.3, 0.0).astype(np.float32)
    bias[0, 1, :, 16:64] = -np.inf               # masked blocks differ per batch and head
    bias[1, 3, 10:40, :48] = -np.inf
    t["bias"] = bias
    got = session.run(spec, t, kernel="webgpu.prefill.f32.sg.blocks", params={"q_tile": 16})
    check_close(spec, got, t)


@pytest.mark.parametrize("m", [1, 4])
def test_decode_block_skip_balances_splits(session, m):
    """S rows over 4 packed sequences: with the listed blocks dealt out over the splits the
    reduce still gives the dense result; per-head biases take one head per workgroup."""
    lengths = [200, 120, 90, 100]
    n = sum(lengths)
    for heads in (1, 8):
        spec = attnreg.AttentionSpec(seq_len=4, past_len=n - 4, num_heads=8, kv_num_heads=2,
                                     head_size=64, dtype="float16", causal=True, bias=True,
                                     head_sink=True)
        t = make_tensors(spec, 3)
        t["bias"] = packed_bias(lengths, rows=4, heads=heads)
        kid = f"webgpu.decode_partial.f16.m{m}.blocks"
        check_close(spec, session.run(spec, t, kernel=kid, flags={"split_size": 64}), t,
                    what=f"heads={heads}")


def test_decode_block_skip_partials_keep_split_ranges(session):
    """op partial: each split's state covers its own key range (a block straddling a split
    boundary is cut), as the contract requires."""
    spec = attnreg.AttentionSpec(seq_len=2, past_len=118, num_heads=4, kv_num_heads=1,
                                 head_size=32, causal=True, bias=True)
    t = make_tensors(spec, 4)
    t["bias"] = packed_bias([50, 70], rows=2)
    inputs = check_tensors(spec, t)
    for split in (24, 40):
        got = session.partial_states(spec, t, split_size=split,
                                     kernel="webgpu.decode_partial.f32.m2.blocks")
        want = ref.partial_states(spec, inputs, split)
        _, problem = compare_partials(spec, got, want, (2e-5, 1e-4))
        assert not problem, f"split {split}: {problem}"


def test_block_skip_paged_cache(session):
    spec = attnreg.AttentionSpec(batch=2, seq_len=3, past_len=93, num_heads=4, kv_num_heads=2,
                                 head_size=32, dtype="float16", causal=True, bias=True,
                                 seqlens_k=True, kv_layout="paged", page_size=16, num_pages=20,
                                 kv_capacity=96)
    t = make_tensors(spec, 5, lengths=[96, 41])
    t["bias"] = np.ascontiguousarray(np.broadcast_to(packed_bias([40, 56], rows=3), (2, 1, 3, 96)))
    check_close(spec, session.run(spec, t, kernel="webgpu.decode_partial.f16.m4.blocks"), t)
    pre = spec.replace(seq_len=30, past_len=66)
    t = make_tensors(pre, 6, lengths=[96, 50])
    t["bias"] = packed_bias([66, 30], rows=30, batch=2)
    check_close(pre, session.run(pre, t, kernel="webgpu.prefill.f16.sg.blocks"), t)


def test_block_skip_rule_and_rejection(session):
    spec = attnreg.AttentionSpec(seq_len=64, past_len=0, num_heads=2, head_size=32, bias=True)
    plan = session.plan(spec, flags={"block_skip": "on"})
    assert plan.kernel.endswith(".blocks") and plan.params["block_skip"] is True
    assert any(r.startswith("webgpu_block_skip") for r in plan.rules)
    off = session.plan(spec, flags={"block_skip": "off"})
    assert not off.kernel.endswith(".blocks")
    assert "block_skip=False" in " ".join(off.rejected[plan.kernel])
    nobias = session.plan(spec.replace(bias=False), flags={"block_skip": "on"})
    assert not nobias.kernel.endswith(".blocks")
    assert any("needs a bias" in r for r in nobias.rejected[plan.kernel])


def test_device_bias_block_lists_are_built_once(session):
    lengths = [32, 32]
    spec = attnreg.AttentionSpec(seq_len=64, past_len=0, num_heads=2, head_size=32,
                                 causal=False, bias=True)
    t = make_tensors(spec, 7)
    bias = session.tensor(packed_bias(lengths))
    t["bias"] = packed_bias(lengths)
    rt = session.device_runtime(session.home_device())
    kid = "webgpu.prefill.f32.sg.blocks"
    check_close(spec, session.run(spec, {**t, "bias": bias}, kernel=kid), t)
    allocs = rt.counters["allocs"]
    check_close(spec, session.run(spec, {**t, "bias": bias}, kernel=kid), t)
    assert rt.counters["allocs"] == allocs
    t["bias"] = np.zeros_like(t["bias"])
    bias.write(t["bias"])                        # a written bias gets a new list
    check_close(spec, session.run(spec, {**t, "bias": bias}, kernel=kid), t)


@pytest.mark.parametrize("m", [1, 2, 4])
def test_unfused_decode_matches_reference(session, m):
    spec = attnreg.AttentionSpec(batch=2, seq_len=m + 1, past_len=700, num_heads=8,
                                 kv_num_heads=2, head_size=64, dtype="float16", causal=True,
                                 seqlens_k=True, kv_capacity=720, softcap=3.0, head_sink=True,
                                 return_lse=True, local_window=500, bias=True)
    t = make_tensors(spec, 8, lengths=[720, 333], mask_frac=0.05)
    got, plan = session.run_with_plan(spec, t, kernel=f"webgpu.decode_qk.f16.m{m}",
                                      flags={"split_size": 96})
    assert plan.route == "split_kv_unfused"
    assert plan.kernels[1:] == ("webgpu.decode_pv.f16", "webgpu.reduce.f16")
    check_close(spec, got, t)


def test_unfused_route_flag_and_partials(session):
    spec = attnreg.AttentionSpec(seq_len=1, past_len=300, num_heads=4, kv_num_heads=1,
                                 head_size=128, causal=True, alibi_max_bias=4.0)
    t = make_tensors(spec, 9)
    got, plan = session.run_with_plan(spec, t, flags={"route": "split_kv_unfused"})
    assert plan.kernels[0].startswith("webgpu.decode_qk")
    check_close(spec, got, t)
    inputs = check_tensors(spec, t)
    o, lse = session.partial_states(spec, t, split_size=64, kernel="webgpu.decode_qk.f32.m1")
    _, problem = compare_partials(spec, (o, lse), ref.partial_states(spec, inputs, 64),
                                  (2e-5, 1e-4))
    assert not problem


def test_paged_prefill_and_unfused(session):
    spec = attnreg.AttentionSpec(batch=2, seq_len=20, past_len=80, num_heads=4, kv_num_heads=2,
                                 head_size=64, dtype="float16", causal=True, seqlens_k=True,
                                 kv_layout="paged", page_size=8, num_pages=30, kv_capacity=100)
    t = make_tensors(spec, 10, lengths=[100, 27])
    for kid in ("webgpu.prefill.f16.sg", "webgpu.decode_qk.f16.m4", "webgpu.decode_partial.f16.m4"):
        check_close(spec, session.run(spec, t, kernel=kid, flags={"split_size": 32}), t, what=kid)
