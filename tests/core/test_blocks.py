"""Masked-block lists against a direct per-tile scan of the bias."""

from __future__ import annotations

import numpy as np
import pytest

import attnreg
from attnreg import blocks


def _block_diagonal(lengths: list[int]) -> np.ndarray:
    n = sum(lengths)
    bias = np.full((1, 1, n, n), -np.inf, np.float32)
    start = 0
    for L in lengths:
        bias[0, 0, start:start + L, start:start + L] = 0.0
        start += L
    return bias


@pytest.mark.parametrize("q_tile,kv_tile", [(4, 8), (16, 16), (5, 7)])
def test_block_list_matches_direct_scan(q_tile: int, kv_tile: int) -> None:
    bias = _block_diagonal([13, 20, 7, 24])
    bias[0, 0, 30, 3] = 0.5                        # a stray visible key with a non-zero bias
    n = bias.shape[-1]
    spec = attnreg.AttentionSpec(seq_len=n, past_len=0, num_heads=2, head_size=8, bias=True)
    bl = blocks.build(spec, bias, q_tile, kv_tile)
    n_q, n_k = -(-n // q_tile), -(-n // kv_tile)
    for qt in range(n_q):
        got = bl.blocks[bl.offsets[qt]:bl.offsets[qt + 1]].tolist()
        zero = bl.zero[bl.offsets[qt]:bl.offsets[qt + 1]].tolist()
        want, want_zero = [], []
        for kb in range(n_k):
            t = bias[0, 0, qt * q_tile:(qt + 1) * q_tile, kb * kv_tile:(kb + 1) * kv_tile]
            if np.isfinite(t).any():
                want.append(kb)
                want_zero.append(int((t == 0).all()))
        assert got == want and zero == want_zero, (qt, got, want)
    assert 0 < bl.density < 1


def test_device_bias_lists_are_cached_until_written() -> None:
    bias = _block_diagonal([8, 8])
    spec = attnreg.AttentionSpec(seq_len=16, past_len=0, head_size=8, bias=True)
    with attnreg.Session(backend="reference") as s:
        dev = s.tensor(bias)
        a = blocks.cached(spec, dev, 4, 4)
        assert blocks.cached(spec, dev, 4, 4) is a
        dev.write(np.zeros_like(bias))
        b = blocks.cached(spec, dev, 4, 4)
        assert b is not a and b.density == 1.0
