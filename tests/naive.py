"""A deliberately naive, loop-per-row transcription of docs/contract.md, independent of
attnreg.reference, used to check the vectorised reference itself. Non-finite values follow
docs/contract.md "Non-finite values and scalar fields": only keys visible by position (L_b,
causal, the left and right windows) are looked at; a non-finite q_i or k_j, a score scale * q.k
beyond float32 ("Overflow"), or a NaN / +inf logit makes the row NaN; a non-finite v_j[d] makes
out[d] NaN (a -inf bias masks the logit, not the value)."""

from __future__ import annotations

import math

import numpy as np

from attnreg.spec import AttentionSpec

F32_MAX = float(np.finfo(np.float32).max)


def _in_reach(spec: AttentionSpec, j: int, p: int) -> bool:
    """Key j within the row at position p's causal frontier and windows."""
    return not ((spec.causal and j > p) or (spec.local_window > 0 and j <= p - spec.local_window)
                or (spec.right_window >= 0 and j > p + spec.right_window))


def naive_attention(spec: AttentionSpec, t: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    B, S, Nq, H = spec.batch, spec.seq_len, spec.num_heads, spec.head_size
    Hv = spec.v_head_size or H
    grp = Nq // spec.kv_num_heads
    scale = spec.scale if spec.scale is not None else 1 / math.sqrt(H)
    out = np.zeros((B, Nq, S, Hv))
    lse = np.zeros((B, Nq, S))

    def q_at(b: int, h: int, i: int) -> np.ndarray:
        x = t["q"][b, i, h] if spec.q_layout == "BSNH" else t["q"][b, h, i]
        return x.astype(np.float64)

    def kv_at(name: str, b: int, h: int, j: int) -> np.ndarray:
        x = t[name][b, j, h] if spec.kv_layout == "BSNH" else t[name][b, h, j]
        return x.astype(np.float64)

    n = 2 ** math.floor(math.log2(Nq))
    m0 = 2 ** (-spec.alibi_max_bias / n)
    m1 = 2 ** (-spec.alibi_max_bias / 2 / n)
    for b in range(B):
        L = int(t["seqlens_k"][b]) if spec.seqlens_k else spec.past_len + S
        Sb = int(t["seqlens_q"][b]) if spec.seqlens_q else S
        first = int(t["kv_start"][b]) if spec.kv_start else 0
        for h in range(Nq):
            kvh = h // grp
            slope = m0 ** (h + 1) if h < n else m1 ** (2 * (h - n) + 1)
            for i in range(S):
                if i >= Sb:                      # a padding row: out 0, lse -inf
                    lse[b, h, i] = -math.inf
                    continue
                p = L - Sb + i
                logits, values = [], []
                row_nan = False
                comp_nan = np.zeros(Hv, bool)
                for j in range(first, L):
                    if not _in_reach(spec, j, p):
                        continue
                    qi, kj, vj = q_at(b, h, i), kv_at("k", b, kvh, j), kv_at("v", b, kvh, j)
                    comp_nan |= ~np.isfinite(vj)
                    if not (np.isfinite(qi).all() and np.isfinite(kj).all()):
                        row_nan = True
                        continue
                    s = scale * float(np.dot(qi, kj))
                    if abs(s) > F32_MAX:         # docs/contract.md "Overflow": float32 scores
                        row_nan = True
                        continue
                    if spec.softcap > 0:
                        s = spec.softcap * math.tanh(s / spec.softcap)
                    if spec.bias:
                        bias = t["bias"]
                        s += float(bias[b % bias.shape[0], h % bias.shape[1], i % bias.shape[2], j])
                    if spec.alibi_max_bias > 0:
                        s += slope * (j - p)
                    if spec.bias and abs(s) > F32_MAX:   # a float32 logit: +inf or -inf there
                        s = math.copysign(math.inf, s)
                    if math.isnan(s) or s == math.inf:
                        row_nan = True
                    if s == -math.inf or row_nan:
                        continue
                    logits.append(s)
                    values.append(np.where(np.isfinite(vj), vj, 0.0))
                if row_nan:
                    out[b, h, i] = math.nan
                    lse[b, h, i] = math.nan
                    continue
                out[b, h, i, comp_nan] = math.nan
                sink = float(t["head_sink"][h]) if spec.head_sink else None
                cands = logits + ([sink] if sink is not None else [])
                if not cands or max(cands) == -math.inf:
                    lse[b, h, i] = -math.inf
                    continue
                m = max(cands)
                w = [math.exp(s - m) for s in logits]
                den = sum(w) + (math.exp(sink - m) if sink is not None else 0.0)
                acc = np.zeros(Hv)
                for wj, vj in zip(w, values):
                    acc += wj * vj
                out[b, h, i] = np.where(comp_nan, math.nan, acc / den)
                lse[b, h, i] = m + math.log(den)
    return out, lse
