"""The reference K/V quantizer and dequantizer of the contract's quantized caches (kv_dtype
"int8" / "int4"; docs/contract.md "Storage dtypes and quantized K/V"), in numpy.

int8: one float32 scale per vector (max|x| / 127), codes round-half-even in [-127, 127].
int4: ggml's q4_0 block layout: one float16 scale per 32 elements (the element of largest
magnitude, with its sign, divided by -8), codes round-half-even + 8 clamped to [0, 15]; block
j's 32 elements fill bytes [16j, 16j+16), byte 16j+i holding element 32j+i in its low nibble
and element 32j+i+16 in its high nibble.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import SpecError
from .spec import AttentionSpec

KV_DTYPES = ("int8", "int4")
INT4_BLOCK = 32


def _float_input(x: Any, kv_dtype: str) -> np.ndarray:
    if kv_dtype not in KV_DTYPES:
        raise SpecError("kv_dtype", kv_dtype, f"one of {KV_DTYPES}")
    if not isinstance(x, np.ndarray) or not (np.issubdtype(x.dtype, np.floating)
                                             or x.dtype.name == "bfloat16"):
        raise SpecError("x", x, "a numpy array of floats [..., H]")
    if x.ndim < 1 or x.shape[-1] < 1:
        raise SpecError("x", x, "a numpy array of floats [..., H] with H >= 1")
    if kv_dtype == "int4" and x.shape[-1] % INT4_BLOCK:
        raise SpecError("x", x, f"a last axis H divisible by {INT4_BLOCK} for int4 "
                        f"(blocks of {INT4_BLOCK}), got H={x.shape[-1]}")
    xf = x.astype(np.float32)
    bad = ~np.isfinite(xf)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise SpecError("x", x, f"finite values (a quantized cache cannot hold NaN or inf); "
                        f"x{list(at)} = {xf[at]!r}")
    return xf


def quantize_kv(x: Any, kv_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scales) of x [..., H] (any float array): int8 codes [..., H] with float32
    scales [...], or int4 codes packed as uint8 [..., H/2] with float16 scales [..., H/32]."""
    xf = _float_input(x, kv_dtype)
    if kv_dtype == "int8":
        scale = (np.abs(xf).max(axis=-1) / np.float32(127)).astype(np.float32)
        safe = np.where(scale > 0, scale, np.float32(1))[..., None]
        codes = np.clip(np.rint(xf / safe), -127, 127).astype(np.int8)
        return codes, scale
    blocks = xf.reshape(*xf.shape[:-1], -1, INT4_BLOCK)
    idx = np.argmax(np.abs(blocks), axis=-1)[..., None]
    m = np.take_along_axis(blocks, idx, axis=-1)[..., 0]
    scale = (m / np.float32(-8)).astype(np.float16)
    s32 = scale.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s32 != 0, np.rint(blocks / np.where(s32 != 0, s32, 1)) + 8, 8)
    nib = np.clip(q, 0, 15).astype(np.uint8)
    half = INT4_BLOCK // 2
    packed = nib[..., :half] | (nib[..., half:] << 4)
    return packed.reshape(*xf.shape[:-1], -1).astype(np.uint8), scale


def dequantize_kv(codes: Any, scales: Any, kv_dtype: str) -> np.ndarray:
    """The values the kernels compute with (float32 [..., H]): int8 code * scale; int4
    (nibble - 8) * its block's scale."""
    if kv_dtype not in KV_DTYPES:
        raise SpecError("kv_dtype", kv_dtype, f"one of {KV_DTYPES}")
    want = (np.int8, np.float32) if kv_dtype == "int8" else (np.uint8, np.float16)
    if not isinstance(codes, np.ndarray) or codes.dtype != want[0] or codes.ndim < 1:
        raise SpecError("codes", codes, f"a numpy {np.dtype(want[0]).name} array [..., "
                        f"{'H' if kv_dtype == 'int8' else 'H/2'}]")
    lead = codes.shape[:-1]
    shape = lead if kv_dtype == "int8" else (*lead, codes.shape[-1] * 2 // INT4_BLOCK)
    if kv_dtype == "int4" and codes.shape[-1] % (INT4_BLOCK // 2):
        raise SpecError("codes", codes, f"a last axis H/2 divisible by {INT4_BLOCK // 2}")
    if not isinstance(scales, np.ndarray) or scales.dtype != want[1] or scales.shape != shape:
        raise SpecError("scales", scales, f"a numpy {np.dtype(want[1]).name} array of "
                        f"shape {shape}")
    if kv_dtype == "int8":
        return codes.astype(np.float32) * scales[..., None]
    b = codes.reshape(*lead, -1, INT4_BLOCK // 2)
    nib = np.concatenate([b & 0xF, b >> 4], axis=-1).astype(np.float32) - 8
    return (nib * scales.astype(np.float32)[..., None]).reshape(*lead, -1)


def kv_bytes_per_token(spec: AttentionSpec) -> int:
    """Bytes one token adds to the cache: k and v over every kv head, scales included."""
    h = spec.head_size
    per = {"int8": h + 4, "int4": h // 2 + 2 * (h // INT4_BLOCK)}.get(spec.kv_dtype or "",
                                                                      h * spec.itemsize)
    return 2 * spec.kv_num_heads * per


def kv_storage_text(spec: AttentionSpec) -> str:
    """What the cache holds, per explain: the storage and its bytes per token."""
    what = {"int8": "int8 codes + a float32 scale per vector",
            "int4": "int4 q4_0 blocks + a float16 scale per 32 elements"}.get(
        spec.kv_dtype or "", spec.dtype)
    return f"{what}, {kv_bytes_per_token(spec)} B per token (k and v, {spec.kv_num_heads} kv heads)"
