"""Poisoned allocations: a large run with all-NaN inputs leaves the session's pooled device
buffers full of NaN; a smaller run that reuses them (buffers larger than it needs, NaN past
its extents) must still equal the reference. A kernel that reads past any of its tensors,
or past seqlens_k, shows up here as NaN."""

from __future__ import annotations

import numpy as np
import pytest

import attnreg
from attnreg.testing import compare, expected, make_tensors
from attnreg.tools import conformance as conf

DEVICES = [d for d in attnreg.devices() if d.available and d.backend != "reference"]
PAIRS = [(k, d) for d in DEVICES for k in attnreg.kernels(d.backend)
         if k.family in ("prefill", "decode_partial", "decode_fused") and k.features <= d.features
         and "float32" in k.dtypes and not k.params.get("block_skip")]


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{d.backend}-{d.slug}-{k.id}" for k, d in PAIRS])
def test_nan_filled_larger_buffers_do_not_leak(pair: tuple[attnreg.KernelInfo, attnreg.DeviceCaps]
                                               ) -> None:
    k, dev = pair
    m = int(k.params.get("m_tile", 1))
    s_small = 33 if k.family == "prefill" else m
    big = attnreg.AttentionSpec(batch=2, seq_len=2 * s_small, past_len=150, num_heads=8,
                                kv_num_heads=2, head_size=64, seqlens_k=True, kv_capacity=300,
                                head_sink=True, return_lse=True, causal=True)
    small = attnreg.AttentionSpec(batch=1, seq_len=s_small, past_len=40, num_heads=4,
                                  kv_num_heads=2, head_size=32, seqlens_k=True, kv_capacity=90,
                                  head_sink=True, return_lse=True, causal=True)
    for spec in (big, small):
        assert not k.not_supported_reasons(spec, dev), k.not_supported_reasons(spec, dev)
    with attnreg.Session(backend=dev.backend, device=dev.id) as s:
        poison = make_tensors(big, seed=1, lengths=[300, 250])
        for name in ("q", "k", "v"):
            poison[name][...] = np.nan
        s.run(big, poison, kernel=k.id)                  # fills pooled buffers with NaN
        t = make_tensors(small, seed=2, lengths=[41])    # keys 41..89 are NaN too
        got = s.run(small, t, kernel=k.id)
        _, problem = compare(small, got, expected(small, t), k.tolerance["float32"])
        assert not problem, problem


def test_poison_pairs_cover_every_backend_with_a_device() -> None:
    assert {d.backend for d in DEVICES} <= {d.backend for _, d in PAIRS}
    assert conf  # the matrix's own cells poison tails; this file poisons whole buffers
