"""The cases `attnreg bench` times: named suites of AttentionSpecs (full size and --quick),
the kv-dtypes twins, and the bytes and FLOPs each case must move."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..quant import kv_bytes_per_token
from ..spec import AttentionSpec


@dataclass(frozen=True)
class Case:
    name: str
    spec: AttentionSpec
    note: str = ""


def decode_spec(L: int, dtype: str = "float16", kv_dtype: str | None = None) -> AttentionSpec:
    return AttentionSpec(batch=1, seq_len=1, past_len=L - 1, num_heads=32, kv_num_heads=8,
                         head_size=128, dtype=dtype, causal=True, kv_dtype=kv_dtype)


def _storages(cases: list[Case], long: int) -> list[Case]:
    """The kv-dtypes suite: every float16 case, then again in bfloat16 (the target: within
    5%), and the long decode with int8 and int4 K/V (the targets: 1.8x and 3x float16);
    storage_ratios compares each with its float16 twin, measured in the same run."""
    f16 = [c for c in cases if c.spec.dtype == "float16"]
    out = f16 + [Case(_bf16_name(c.name), c.spec.replace(dtype="bfloat16"), c.note) for c in f16]
    return out + [Case(f"decode-f16-{kv}-L{long}", decode_spec(long, kv_dtype=kv),
                       f"GQA 32/8 H=128, {kv} K/V") for kv in ("int8", "int4")]


def _bf16_name(name: str) -> str:
    return name.replace("f16", "bf16") if "f16" in name else name + "-bf16"


def twin(name: str) -> str | None:
    """The float16 case a kv-dtypes case is measured against (None: it is one)."""
    for kv in ("int8", "int4"):
        if f"-{kv}-" in name:
            return name.replace(f"-{kv}-", "-")
    if name.endswith("-bf16"):
        return name[:-len("-bf16")]
    return name.replace("bf16", "f16") if "bf16" in name else None


SUITES: dict[str, list[Case]] = {
    "decode": [Case(f"decode-f16-L{L}", decode_spec(L), "GQA 32/8 H=128") for L in (2048, 8192)]
    + [Case("decode-f32-L8192", decode_spec(8192, "float32"), "GQA 32/8 H=128")],
    "long-context": [Case("decode-f16-L32768", decode_spec(32768), "GQA 32/8 H=128")],
    "whisper": [Case("whisper-S4-T1500", AttentionSpec(
        batch=1, seq_len=4, past_len=1496, num_heads=8, kv_num_heads=8, head_size=64,
        dtype="float16", causal=False), "cross-attention, 8 heads H=64")],
    "prefill": [Case(f"prefill-f16-S{S}", AttentionSpec(
        batch=1, seq_len=S, past_len=0, num_heads=32, kv_num_heads=8, head_size=128,
        dtype="float16", causal=True), "causal GQA 32/8 H=128") for S in (512, 2048)],
}
QUICK: dict[str, list[Case]] = {
    "decode": [Case("decode-f16-L512", decode_spec(512)),
               Case("decode-f32-L512", decode_spec(512, "float32"))],
    "whisper": [Case("whisper-S4-T300", AttentionSpec(
        batch=1, seq_len=4, past_len=296, num_heads=8, kv_num_heads=8, head_size=64,
        dtype="float16", causal=False))],
    "prefill": [Case("prefill-f16-S64", AttentionSpec(
        batch=1, seq_len=64, past_len=0, num_heads=8, kv_num_heads=2, head_size=64,
        dtype="float16", causal=True))],
    "long-context": [],
}
SUITES["kv-dtypes"] = _storages([c for s in ("decode", "long-context", "whisper", "prefill")
                                 for c in SUITES[s]], 32768)
QUICK["kv-dtypes"] = _storages([c for s in ("decode", "whisper", "prefill") for c in QUICK[s]],
                               512)


def suite_cases(suites: Iterable[str], quick: bool = False) -> Iterator[tuple[str, Case]]:
    """(suite, case) for each case of the named suites in order, from the --quick tables (CPU
    devices) or the full ones."""
    table = QUICK if quick else SUITES
    return ((suite, case) for suite in suites for case in table[suite])


def visible_pairs(spec: AttentionSpec) -> int:
    """(query row, key) pairs that are visible, per (batch, head): sets the FLOPs."""
    L, S = spec.total_len, spec.seq_len
    total = 0
    for i in range(S):
        p = L - S + i
        hi = p + 1 if spec.causal else L
        if spec.right_window >= 0:
            hi = min(hi, p + spec.right_window + 1)
        lo = max(0, p - spec.local_window + 1) if spec.local_window > 0 else 0
        total += max(0, min(hi, L) - lo)
    return total


def traffic(spec: AttentionSpec) -> tuple[float, float]:
    """(bytes that must move, FLOPs) for one call, no reuse assumed beyond one read of K/V."""
    e = spec.itemsize
    q = spec.batch * spec.seq_len * spec.num_heads * spec.head_size * e
    kv = spec.batch * spec.total_len * kv_bytes_per_token(spec)    # as stored (codes + scales)
    flops = 4.0 * spec.batch * spec.num_heads * spec.head_size * visible_pairs(spec)
    return float(2 * q + kv), flops
