"""What the distributed tests share: a shard's cache read back to the host, the shards put
together as the one unsharded cache, and the float64 reference of a call on that cache."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from attnreg import AttentionSpec, KVCache
from attnreg.tensors import check_tensors
from attnreg.testing import compare, expected


def shard_arrays(kv: KVCache) -> dict[str, np.ndarray]:
    """A shard's k, v (codes), scales and block table, read back from its device."""
    out = {"k": kv.k.numpy(), "v": kv.v.numpy()}
    if kv.k_scale is not None and kv.v_scale is not None:
        out.update(k_scale=kv.k_scale.numpy(), v_scale=kv.v_scale.numpy())
    if kv.block_table is not None:
        assert kv.block_table.host is not None
        out["block_table"] = kv.block_table.host.copy()
    return out


def _by_token(x: np.ndarray, layout: str, capacity: int, table: Any) -> np.ndarray:
    """A shard tensor as [B, C, Nkv, ...] (token-major, as BSNH stores it)."""
    if layout == "BSNH":
        return x
    if layout == "BNSH":
        return np.swapaxes(x, 1, 2)
    pages = x[np.asarray(table).reshape(-1)]
    return pages.reshape(table.shape[0], -1, *x.shape[2:])[:, :capacity]


def unshard(parts: Sequence[Mapping[str, np.ndarray]], offsets: np.ndarray, counts: np.ndarray,
            capacities: Sequence[int], layout: str) -> dict[str, np.ndarray]:
    """The shards as one BSNH cache of the summed capacity (positions the shards do not hold
    are zeros: they lie past every entry's length)."""
    whole = {}
    for name in (n for n in parts[0] if n != "block_table"):
        toks = [_by_token(p[name], layout, c, p.get("block_table"))
                for p, c in zip(parts, capacities)]
        g = np.zeros((toks[0].shape[0], sum(capacities), *toks[0].shape[2:]), toks[0].dtype)
        for r, t in enumerate(toks):
            for b in range(g.shape[0]):
                o, n = int(offsets[r][b]), int(counts[r][b])
                g[b, o:o + n] = t[b, :n]
        whole[name] = g
    return whole


def reference(spec: AttentionSpec, q: np.ndarray, whole: Mapping[str, np.ndarray],
              lengths: np.ndarray, extras: Mapping[str, Any] | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """The float64 reference of the call on the unsharded cache."""
    ref_spec = spec.replace(kv_layout="BSNH", page_size=None, num_pages=None)
    t = {"q": q, **whole, "seqlens_k": np.asarray(lengths, np.int32), **(extras or {})}
    return expected(ref_spec, check_tensors(ref_spec, t))


def check(spec: AttentionSpec, got: Any, want: tuple[np.ndarray, np.ndarray], what: str) -> float:
    """The contract's tolerance test of got against the reference; the max error."""
    err, problem = compare(spec, got, want)
    assert not problem, f"{what}: {problem}"
    return err
