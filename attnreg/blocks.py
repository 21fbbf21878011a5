"""Masked-block lists: which KV blocks a bias leaves visible, per (batch, head, query tile).

A bias that is -inf over whole (query tile x KV block) rectangles (packed sequences with a
block-diagonal mask, document masks) makes most of the key loop wasted. The kernels of the
block-skipping variants iterate over this list instead, and skip loading the bias of blocks
that are entirely 0. Lists are built once per bias: DeviceTensor biases are cached by
identity and version; host arrays are rebuilt per call (numpy arrays can change in place).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .spec import AttentionSpec


@dataclass(frozen=True)
class BlockList:
    """CSR lists over rows r = ((b * Hb) + h) * n_qtiles + qt of the bias's own broadcast
    shape [Bb, Hb, ...]: blocks[offsets[r]:offsets[r+1]] are the visible KV block indices
    (ascending); zero[i] is 1 when block blocks[i] is all 0 for that tile (skip its bias)."""

    q_tile: int
    kv_tile: int
    bias_batch: int
    bias_heads: int
    n_qtiles: int
    n_blocks: int
    offsets: np.ndarray       # int32 [rows + 1]
    blocks: np.ndarray        # int32 [nnz]
    zero: np.ndarray          # int32 [nnz]

    @property
    def density(self) -> float:
        rows = len(self.offsets) - 1
        return float(len(self.blocks)) / max(1, rows * self.n_blocks)

    def arrays(self) -> dict[str, np.ndarray]:
        return {"block_offsets": self.offsets, "block_ids": self.blocks, "block_zero": self.zero}


def build(spec: AttentionSpec, bias: np.ndarray, q_tile: int, kv_tile: int) -> BlockList:
    """Block list of a bias of shape [Bb, Hb, Sb, C] (the contract's broadcast shape)."""
    bb, hb, _, c = bias.shape
    s = spec.seq_len
    n_q = -(-s // q_tile)
    n_k = -(-c // kv_tile)
    full = np.broadcast_to(bias, (bb, hb, s, c))
    pad_s, pad_c = n_q * q_tile - s, n_k * kv_tile - c
    # Padding rows/keys are -inf so they never make a block visible on their own. A block is
    # skipped only where every entry is -inf: a NaN or +inf entry must reach the kernel (it
    # poisons the rows that see it).
    x = np.pad(full, ((0, 0), (0, 0), (0, pad_s), (0, pad_c)), constant_values=-np.inf)
    tiles = x.reshape(bb, hb, n_q, q_tile, n_k, kv_tile)
    visible = (~np.isneginf(tiles)).any(axis=(3, 5))                 # [bb, hb, n_q, n_k]
    valid = np.ones((n_q, q_tile, n_k, kv_tile), bool)
    if pad_s:
        valid[-1, q_tile - pad_s:] = False
    if pad_c:
        valid[:, :, -1, kv_tile - pad_c:] = False
    zero = ((tiles == 0) | ~valid[None, None]).all(axis=(3, 5))      # all-zero inside bounds
    mask = visible.reshape(-1, n_k)
    counts = mask.sum(axis=1)
    offsets = np.zeros(len(counts) + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    ids = np.nonzero(mask)[1].astype(np.int32)
    zeros = zero.reshape(-1, n_k)[mask].astype(np.int32)
    return BlockList(q_tile, kv_tile, bb, hb, n_q, n_k, offsets, ids, zeros)


_CACHE: dict[tuple[int, int, int, int], tuple[object, BlockList]] = {}


def cached(spec: AttentionSpec, bias: object, q_tile: int, kv_tile: int) -> BlockList:
    """Block list for a bias; DeviceTensors are cached by (identity, version)."""
    from .device_tensor import DeviceTensor
    if isinstance(bias, DeviceTensor) and bias.owned:   # a caller's buffer: built per call
        key = (id(bias), bias.version, q_tile, kv_tile)
        hit = _CACHE.get(key)
        if hit is not None and hit[0] is bias:
            return hit[1]
        bl = build(spec, bias.numpy(), q_tile, kv_tile)
        _CACHE[key] = (bias, bl)
        return bl
    host = bias.numpy() if isinstance(bias, DeviceTensor) else np.asarray(bias)
    return build(spec, host, q_tile, kv_tile)
