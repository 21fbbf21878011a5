"""transformers masks as attnreg fields (see attnreg.integrations.transformers for the rules).

The mask function registered in AttentionMaskInterface asks transformers' own ``sdpa_mask``
for the exact boolean mask [B, 1, S, L] and attaches a :class:`MaskInfo` to it: either
structured (causal, valid length L, sliding window, per-batch first visible key: checked
element for element against the mask) or a bias holding the whole mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from attnreg.errors import SpecError

ATTR = "_attnreg_mask"
"""The attribute of a mask tensor that carries (MaskInfo, tensor version)."""


@dataclass(frozen=True)
class MaskInfo:
    """What a mask means for attnreg, for K/V of ``kv_len`` keys and ``seq_len`` queries.

    causal: bottom-right causal over ``valid`` keys (L) with ``window`` (-1: none), the keys
    before each batch entry's first visible one left out by ``start`` (attnreg's kv_start
    tensor [B], None: no left padding); else ``bias`` [B|1, 1|Nq, S|1, C] holds the whole
    mask. ``capacity``: the C the spec uses."""

    seq_len: int
    kv_len: int
    capacity: int
    causal: bool
    valid: int
    window: int
    bias: np.ndarray | None
    start: np.ndarray | None = None


def capacity(seq_len: int, kv_len: int, valid: int, bucket: int) -> int:
    """K/V of exactly the valid keys after a first prompt (a dynamic cache): rounded up to a
    multiple of ``bucket`` (0: never), so that each new length is not a new spec."""
    if valid == kv_len and seq_len < kv_len and bucket > 0:
        return -(-kv_len // bucket) * bucket
    return kv_len


def version(t: Any) -> int | None:
    try:
        return int(t._version)
    except RuntimeError:            # inference tensors have no version counter
        return None


def describe(torch: Any, m: Any, q_offset: int, kv_offset: int, window: int | None,
             bucket: int) -> MaskInfo:
    """The bool mask m [B, 1, S, L] as attnreg fields, checked element for element."""
    b, _, s, lk = (int(x) for x in m.shape)
    rows = m[:, 0]
    valid = q_offset - kv_offset + s
    if s <= valid <= lk:
        cols = rows.any(dim=1)                                          # [B, L]
        first = torch.where(cols.any(dim=1), cols.to(torch.int8).argmax(dim=1),
                            torch.full((b,), valid, dtype=torch.long))
        j = torch.arange(lk)
        pos = (valid - s + torch.arange(s))[:, None]                    # [S, 1]
        want = (j <= pos) & (j < valid)
        if window is not None and window > 0:
            want = want & (j > pos - window)
        want = want[None] & (j[None, None, :] >= first[:, None, None])  # [B, S, L]
        if torch.equal(want, rows):
            cap = capacity(s, lk, valid, bucket)
            start = first.numpy().astype(np.int32)
            win = window if window and window > 0 else -1
            if (start == 0).all():
                return MaskInfo(s, lk, cap, True, valid, win, None)
            if (start < valid).all():
                # left padding: keys before each row's first visible key do not exist
                return MaskInfo(s, lk, cap, True, valid, win, None, start)
            # an entry whose every key is masked: kv_start must stay below L, so a bias
            bias = np.where(np.arange(cap)[None, None, None, :] < start[:, None, None, None],
                            np.float32(-np.inf), np.float32(0))
            return MaskInfo(s, lk, cap, True, valid, win, bias)
    cap = capacity(s, lk, lk, bucket)
    full = np.zeros((b, 1, s, cap), np.float32)
    full[..., :lk] = np.where(rows.numpy()[:, None], np.float32(0), np.float32(-np.inf))
    return MaskInfo(s, lk, cap, False, lk, -1, full)


def make_mask(name: str, bucket: int) -> Any:
    """The mask function for AttentionMaskInterface (sdpa_mask's arguments)."""
    from transformers import masking_utils

    def attnreg_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0,
                     kv_offset: int = 0, mask_function: Any = None, attention_mask: Any = None,
                     local_size: int | None = None, use_vmap: bool = False, device: Any = "cpu",
                     **kwargs: Any) -> Any:
        import torch

        fn = mask_function if mask_function is not None else masking_utils.causal_mask_function
        # never the "skip the mask" shortcuts: the exact mask, every time
        m = masking_utils.sdpa_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
            kv_offset=kv_offset, mask_function=fn, attention_mask=attention_mask,
            local_size=local_size, allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
            use_vmap=use_vmap, device=device)
        if m is None:               # skips are off: sdpa_mask always returns a mask
            raise SpecError("attention_mask", None, "a mask from transformers' sdpa_mask")
        m = m.contiguous()          # materialised: generate's own .contiguous() keeps this object
        if m.device.type != "cpu":
            raise SpecError("attention_mask.device", str(m.device), "a CPU mask (attnreg reads "
                            "torch CPU tensors)")
        info = describe(torch, m, int(q_offset), int(kv_offset), local_size, bucket)
        setattr(m, ATTR, (info, version(m)))
        return m

    attnreg_mask.__qualname__ = f"attnreg_mask[{name}]"
    return attnreg_mask


def user_mask(torch: Any, mask: Any, b: int, nq: int, s: int, lk: int, dtype: np.dtype,
              bucket: int) -> MaskInfo:
    """A 4-D mask transformers passed through unchanged (the caller's own): bool (True =
    attend) becomes 0 / -inf, a float mask is added as eager adds it."""
    if type(mask).__name__ == "BlockMask" or not hasattr(mask, "dim"):
        raise SpecError("attention_mask", mask, "a 4-D torch tensor or the mask of a name "
                        "registered with attnreg.integrations.transformers (flex BlockMasks "
                        "are not read)")
    shape = tuple(int(x) for x in mask.shape)
    if (mask.dim() != 4 or shape[0] not in (1, b) or shape[1] not in (1, nq)
            or shape[2] not in (1, s) or shape[3] != lk):
        raise SpecError("attention_mask.shape", shape, f"4 dims broadcastable to [B, Nq, S, L] "
                        f"= {(b, nq, s, lk)} with L the key length (eager adds it as is)")
    if mask.device.type != "cpu":
        raise SpecError("attention_mask.device", str(mask.device), "a CPU tensor")
    cap = capacity(s, lk, lk, bucket)
    if mask.dtype == torch.bool:
        bias = np.zeros((*shape[:3], cap), np.float32)
        bias[..., :lk] = np.where(mask.numpy(), np.float32(0), np.float32(-np.inf))
    elif mask.dtype in (torch.float32, torch.float16, torch.bfloat16):
        src = to_numpy(torch, mask)
        keep = src.dtype if src.dtype in (np.dtype(np.float32), dtype) else np.dtype(np.float32)
        if cap == lk and src.dtype == keep:
            bias = src                                  # read in place
        else:
            bias = np.zeros((*shape[:3], cap), keep)
            bias[..., :lk] = src
    else:
        raise SpecError("attention_mask.dtype", str(mask.dtype), "bool (True = attend) or a "
                        "float additive mask (float32, float16, bfloat16)")
    return MaskInfo(s, lk, cap, False, lk, -1, bias)


def to_numpy(torch: Any, t: Any) -> np.ndarray:
    """A numpy view of a CPU tensor (bfloat16 through its bits, as ml_dtypes.bfloat16)."""
    import ml_dtypes

    t = t.detach()
    if t.dtype == torch.bfloat16:
        return np.from_dlpack(t.view(torch.int16)).view(ml_dtypes.bfloat16)
    return np.from_dlpack(t)
