"""Random single-node cases of the standard Attention op and com.microsoft
MultiHeadAttention for attnreg.integrations.onnx (tests/integrations/test_onnx*.py), run
beside onnxruntime through tests/onnx_cases.py. Imported only after the test modules'
importorskip of onnx and onnxruntime."""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.onnx_cases import assert_close, pick, rnd, run_both


def attention_case(seed: int, model: bool = False
                   ) -> tuple[list[tuple[str, Any]], dict[str, Any], int, int, str]:
    """A random Attention node; ``model``: other seeds, V head sizes != K's (v_head_size) and
    bool masks that left-pad (kv_start), some with one element off (must stay a bias)."""
    rng = np.random.default_rng((2500 if model else 2000) + seed)
    dtype = pick(rng, ("float32", "float32", "float16"))
    h, nkv = pick(rng, (32, 64)), pick(rng, (1, 2))
    hv = pick(rng, tuple(x for x in (16, 48, 64, 96) if x != h)) if model and rng.random() < 0.6 \
        else h
    nq = nkv * pick(rng, (1, 2, 4))
    b, s = int(rng.integers(1, 4)), int(rng.integers(1, 18))
    mode = pick(rng, ("self", "past", "cross", "nonpad"))
    t = s if mode == "self" else int(rng.integers(1, 21)) if mode == "cross" else \
        pick(rng, (s, s, int(rng.integers(1, 18)))) if mode == "past" else s + int(rng.integers(0, 30))
    past = int(rng.integers(1, 41)) if mode == "past" else 0
    total = past + t
    three_d = rng.random() < 0.5
    attrs: dict[str, Any] = {}
    if three_d:
        attrs.update(q_num_heads=nq, kv_num_heads=nkv)
        q, k, v = rnd(rng, dtype, b, s, nq * h), rnd(rng, dtype, b, t, nkv * h), \
            rnd(rng, dtype, b, t, nkv * hv)
    else:
        q, k, v = rnd(rng, dtype, b, nq, s, h), rnd(rng, dtype, b, nkv, t, h), rnd(rng, dtype, b, nkv, t, hv)
    if rng.random() < 0.5 and not (mode == "past" and s == 1 and t > 1):   # refused: see below
        attrs["is_causal"] = 1
    if rng.random() < 0.25:
        attrs["softcap"] = float(rng.uniform(1, 30))
    if rng.random() < 0.25:
        attrs["scale"] = float(rng.uniform(0.02, 0.3))
    mask = None
    kind = pick(rng, ("none", "bool", "float"))
    if model and rng.random() < 0.6:
        mask = left_pad_mask(rng, b, nq, s, total)
    elif kind != "none":
        shape = pick(rng, ((s, total), (pick(rng, (1, b)), pick(rng, (1, nq)), s, total),
                           (pick(rng, (1, nq)), s, total)))
        mask = rng.random(shape) < 0.75 if kind == "bool" else \
            rnd(rng, pick(rng, (dtype, "float32")), *shape)
    feeds = [("Q", q), ("K", k), ("V", v), ("attn_mask", mask)]
    n_out, opset = 1, pick(rng, (23, 24))
    if mode == "past":
        feeds += [("past_key", rnd(rng, dtype, b, nkv, past, h)),
                  ("past_value", rnd(rng, dtype, b, nkv, past, hv))]
        n_out = 3
    if mode == "nonpad":
        feeds += [("past_key", None), ("past_value", None),
                  ("nonpad_kv_seqlen", rng.integers(0 if rng.random() < 0.2 else s, t + 1, b))]
        opset = 24
    return feeds, attrs, n_out, opset, dtype


def left_pad_mask(rng: np.random.Generator, b: int, nq: int, s: int, total: int) -> np.ndarray:
    """A bool mask hiding keys j < start[b] from every row and head (left padding), in one of
    the shapes ONNX broadcasts; a quarter of them have one element flipped (not a prefix)."""
    start = rng.integers(0, total, b)
    shape = pick(rng, ((b, 1, s, total), (b, nq, s, total), (s, total)))   # ORT: S in the mask
    if len(shape) == 2:
        start = start[:1]
    mask = np.arange(total) >= start.reshape(-1, *[1] * (len(shape) - 1))
    mask = np.ascontiguousarray(np.broadcast_to(mask, shape))
    if rng.random() < 0.25:
        idx = tuple(int(rng.integers(d)) for d in shape)
        mask[idx] = not mask[idx]
    return mask


def check_attention(seed: int, backend: str = "reference", model: bool = False) -> None:
    feeds, attrs, n_out, opset, dtype = attention_case(seed, model)
    got, want, _ = run_both("Attention", feeds, attrs, n_out, opset, backend=backend)
    what = f"seed {seed}: {attrs} {[(n, None if v is None else v.shape) for n, v in feeds]}"
    # Fully masked rows are 0 in both (ONNX 1.23 errata; attnreg's contract).
    assert_close(got[0], want[0], dtype, what + " Y")
    for i in range(1, n_out):
        np.testing.assert_array_equal(got[i], want[i], err_msg=f"{what} present {i}")


# -- MultiHeadAttention ----------------------------------------------------------------------
def mha_case(seed: int, model: bool = False
             ) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]] | None, dict[str, Any], int, str]:
    """A random MultiHeadAttention node; ``model``: other seeds, a V hidden size != K's
    (v_head_size; 3-D value without a past, as ORT defines it) and left-padding
    key_padding_masks (kv_start), some with one element off (must stay a bias)."""
    rng = np.random.default_rng((3500 if model else 3000) + seed)
    dtype = pick(rng, ("float32", "float32", "float16"))
    h, n = pick(rng, (32, 64)), pick(rng, (1, 2, 4))
    b, s = int(rng.integers(1, 4)), int(rng.integers(1, 18))
    form = pick(rng, ("self", "self", "cross", "packed_qkv", "packed_kv", "bnsh"))
    hv = h
    if model:
        form = pick(rng, ("self", "cross"))
        if rng.random() < 0.6:
            hv = pick(rng, tuple(x for x in (16, 48, 64, 96) if x != h))
    t = s if form in ("self", "packed_qkv") else int(rng.integers(1, 21))
    past = int(rng.integers(0, 41)) if form == "self" and hv == h else 0
    total = past + t
    attrs: dict[str, Any] = {"num_heads": n}
    if t == s and form != "bnsh" and rng.random() < 0.5:
        attrs["unidirectional"] = 1
    if rng.random() < 0.25:
        attrs["scale"] = float(rng.uniform(0.02, 0.3))
    q = rnd(rng, dtype, b, s, n * h)
    key = value = proj = None
    if form == "packed_qkv":
        q = rnd(rng, dtype, b, s, n, 3, h)
    elif form == "packed_kv":
        key = rnd(rng, dtype, b, t, n, 2, h)
    elif form == "bnsh":
        key, value = rnd(rng, dtype, b, n, t, h), rnd(rng, dtype, b, n, t, h)
    else:
        key, value = rnd(rng, dtype, b, t, n * h), rnd(rng, dtype, b, t, n * hv)
        if rng.random() < 0.25:
            proj = rnd(rng, dtype, 2 * n * h + n * hv)
    kpm = None
    kind = pick(rng, ("none", "none", "lengths", "2d", "3d"))
    if model and rng.random() < 0.6:
        # left padding; with unidirectional every row keeps a visible key (start <= past),
        # since ORT's MHA gives fully padded rows the softmax over them (see below)
        hi = past + 1 if "unidirectional" in attrs else total
        start = rng.integers(0, hi, b)
        kpm = (np.arange(total) >= start[:, None]).astype(np.int32)
        if rng.random() < 0.5:
            kpm = np.ascontiguousarray(np.broadcast_to(kpm[:, None], (b, s, total)))
        if rng.random() < 0.25:                      # not a prefix: stays a bias
            i = tuple(int(rng.integers(d)) for d in kpm.shape[:-1]) + (int(rng.integers(hi)),)
            kpm[i] = 1 - kpm[i]
            kpm[..., hi - 1] = 1
    elif kind == "lengths":
        kpm = rng.integers(1, total + 1, b).astype(np.int32)
    elif kind != "none":
        kpm = (rng.random((b, total) if kind == "2d" else (b, s, total)) < 0.7).astype(np.int32)
        kpm[..., 0] = 1                      # every row keeps a visible key (see the test below)
    ab = rnd(rng, dtype, pick(rng, (1, b)), pick(rng, (1, n)), s, total) if rng.random() < 0.3 else None
    feeds: list[tuple[str, Any]] = [("query", q), ("key", key), ("value", value), ("bias", proj),
                                    ("key_padding_mask", kpm), ("attention_bias", ab)]
    n_out = 1
    if form == "self" and hv == h and (past or rng.random() < 0.3):
        feeds += [("past_key", rnd(rng, dtype, b, n, past, h)),
                  ("past_value", rnd(rng, dtype, b, n, past, h))]
        n_out = 3
    elif hv != h and rng.random() < 0.4:
        n_out = 3                            # present_value [B, N, T, Hv] without a past
    ort_feeds = None                         # ORT's CPU EP has no packed forms: unpack for it
    if form == "packed_qkv":
        ort_feeds = [("query", q[:, :, :, 0].reshape(b, s, n * h)),
                     ("key", q[:, :, :, 1].reshape(b, s, n * h)),
                     ("value", q[:, :, :, 2].reshape(b, s, n * h)), *feeds[3:]]
    elif form == "packed_kv":
        assert key is not None
        ort_feeds = [feeds[0], ("key", key[:, :, :, 0].reshape(b, t, n * h)),
                     ("value", key[:, :, :, 1].reshape(b, t, n * h)), *feeds[3:]]
    return feeds, ort_feeds, attrs, n_out, dtype


def check_mha(seed: int, backend: str = "reference", model: bool = False) -> None:
    feeds, ort_feeds, attrs, n_out, dtype = mha_case(seed, model)
    got, want, _ = run_both("MultiHeadAttention", feeds, attrs, n_out, backend=backend,
                            ort_feeds=ort_feeds)
    what = f"seed {seed}: {attrs} {[(n, None if v is None else v.shape) for n, v in feeds]}"
    assert_close(got[0], want[0], dtype, what + " output")
    for i in range(1, n_out):
        assert_close(got[i], want[i], dtype, f"{what} present {i}")
