"""The WebGPU conformance cases: a covering subset of the issue's axes, as data.

Every kernel family x dtype meets every contract feature once, and the other axes (layouts,
GQA ratio, head size, seq_len, total length) rotate so that each of their values appears in
every family. tests/test_webgpu.py runs them on lavapipe; ``python3 -m attnreg.backends.webgpu.cases``
runs them on whatever adapter is present (the H100 check), without pytest.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import attnreg
from attnreg import reference as ref
from attnreg.kernel import TOLERANCE
from attnreg.spec import AttentionSpec
from attnreg.tensors import check_tensors
from attnreg.tools import testing

DTYPES = {"float32": "f32", "float16": "f16"}
LAYOUTS = (("BSNH", "BNSH"), ("BNSH", "BSNH"), ("BSNH", "BSNH"), ("BNSH", "BNSH"))
GQA = (1, 4, 7)
HEADS = (32, 64, 80, 96, 128, 256)
SEQ = (1, 2, 3, 4, 5, 33, 97)
# Total lengths on tile boundaries +-1 (tiles are 8..64 keys); lifted by multiples of 64
# when seq_len is larger, which keeps them on a boundary.
TOTALS = (1, 31, 32, 33, 63, 64, 65, 127, 129)

# family tag -> kernel id pattern ({dt} is f32/f16)
FAMILIES = {
    "prefill-sg": "webgpu.prefill.{dt}.sg",
    "prefill-wgmem": "webgpu.prefill.{dt}.wgmem",
    "decode_partial-m1": "webgpu.decode_partial.{dt}.m1",
    "decode_partial-m2": "webgpu.decode_partial.{dt}.m2",
    "decode_partial-m4": "webgpu.decode_partial.{dt}.m4",
    "partial-m4": "webgpu.decode_partial.{dt}.m4",   # partial states, reduced by the reference
    "reduce": "webgpu.reduce.{dt}",                  # reference partials, reduced here
}


@dataclass
class Case:
    name: str
    family: str
    kernel: str
    spec: AttentionSpec
    tensors: dict[str, Any] = field(default_factory=dict)   # make_tensors keywords
    masked_rows: bool = False          # bias -inf over every key of query row 0
    split_size: int | None = None
    feature: str = ""


def _long(fam: str) -> list[tuple[int, int]]:
    """(seq_len, past_len) with a total over 1000 keys, per family."""
    if fam.startswith("prefill"):
        return [(33, 992)]
    return [(1, 1499), (4, 1100)]


def build() -> list[Case]:
    """Every case, deterministic order."""
    cases: list[Case] = []
    n = 0
    for fam, pattern in FAMILIES.items():
        for dtype, dt in DTYPES.items():
            feats = testing.contract_features(1, 1, 1, 1)
            long_cases = _long(fam)
            for f_i in range(len(feats) + len(long_cases)):
                n += 1
                ql, kl = LAYOUTS[n % len(LAYOUTS)]
                g = GQA[n % len(GQA)]
                h = HEADS[n % len(HEADS)]
                if f_i < len(feats):
                    s, total = SEQ[n % len(SEQ)], TOTALS[(n // 2) % len(TOTALS)]
                    past = total - s if total >= s else total + 64 * math.ceil((s - total) / 64) - s
                else:
                    s, past = long_cases[f_i - len(feats)]
                    h = HEADS[f_i % len(HEADS)]
                nkv = 1 if g == 7 else 2
                b = 2 if h <= 96 else 1
                c = s + past
                name, changes, tkw, masked = (testing.contract_features(b, nkv * g, s, c) + [
                    ("long", {}, {}, False)] * len(long_cases))[f_i]
                if name == "long":
                    name = f"long-L{c}"
                kw = dict(batch=b, seq_len=s, past_len=past, num_heads=nkv * g,
                          kv_num_heads=nkv, head_size=h, dtype=dtype, q_layout=ql, kv_layout=kl)
                kw.update(changes)
                spec = AttentionSpec(**kw)
                split = None
                if fam.startswith(("decode", "partial", "reduce")) and c > 24:
                    split = [16, 24, 40, 64][n % 4]       # several splits, some empty
                layout = f"q{ql}-kv{kl}".lower()
                cases.append(Case(
                    name=f"{fam}-{dt}-gqa{g}-h{h}-s{s}-L{c}-{layout}-{name}", family=fam,
                    kernel=pattern.format(dt=dt), spec=spec, tensors=dict(tkw),
                    masked_rows=masked, split_size=split, feature=name))
    return cases


def tensors_for(case: Case, seed: int = 0) -> dict[str, np.ndarray]:
    kw = dict(case.tensors)
    bias_f16 = kw.pop("bias_f16", False)
    t = testing.make_tensors(case.spec, seed, **kw)
    if case.masked_rows:
        t["bias"][:, :, 0, :] = -np.inf
    if bias_f16 and case.spec.dtype == "float16":
        t["bias"] = t["bias"].astype(np.float16)
    return t


def run_case(session: attnreg.Session, case: Case, seed: int = 0) -> tuple[float, str]:
    """(max error, problem or '') of one case on the session's WebGPU device."""
    spec = case.spec
    t = tensors_for(case, seed)
    want = testing.expected(spec, t)
    flags = {"split_size": case.split_size} if case.split_size else None
    if case.family.startswith(("prefill", "decode_partial")):
        got = session.run(spec, t, kernel=case.kernel, flags=flags)
        return testing.compare(spec, got, want)
    size = case.split_size or spec.capacity
    if case.family.startswith("partial"):
        o, lse = session.partial_states(spec, t, split_size=size, kernel=case.kernel)
        inputs = check_tensors(spec, t)
        wo, wl = ref.partial_states(spec, inputs, size)
        err, why = testing.compare_partials(spec, (o, lse), (wo, wl), TOLERANCE[spec.dtype])
        if why:
            return err, why
        out, l_red = ref.reduce(spec, o, lse, t.get("head_sink"))
        got = ref.out_layout(spec, out).astype(spec.dtype)
        return testing.compare(spec, (got, l_red.astype(np.float32)) if spec.return_lse else got,
                               want)
    inputs = check_tensors(spec, t)
    wo, wl = ref.partial_states(spec, inputs, size)
    o, lse = wo.astype(np.float32), wl.astype(np.float32)
    o[np.isneginf(lse)] = np.nan      # an empty split's o may be anything: it must not leak
    got = session.reduce_states(spec, o, lse, t.get("head_sink"), kernel=case.kernel)
    return testing.compare(spec, got, want)


def main(argv: list[str] | None = None) -> int:
    """Run every case on the first WebGPU adapter; print failures and a summary."""
    pick: Callable[[Case], bool] = (lambda c: True) if not argv else \
        (lambda c: any(a in c.name for a in argv))
    bad = 0
    worst = 0.0
    t0 = time.perf_counter()
    cases = [c for c in build() if pick(c)]
    with attnreg.Session(backend="webgpu") as s:
        for case in cases:
            try:
                err, why = run_case(s, case)
            except Exception as exc:
                err, why = math.inf, f"{type(exc).__name__}: {str(exc)[:400]}"
            worst = max(worst, err) if not why else worst
            if why:
                bad += 1
                print(f"FAIL {case.name}: {why}", flush=True)
    print(f"{len(cases) - bad}/{len(cases)} cases pass in {time.perf_counter() - t0:.1f} s; "
          f"largest error of a passing case {worst:.3g}")
    return 1 if bad else 0


def _values(cases: list[Case]) -> Mapping[str, set[Any]]:
    """Axis values the cases cover (for the coverage test)."""
    return {
        "head_size": {c.spec.head_size for c in cases},
        "seq_len": {c.spec.seq_len for c in cases},
        "gqa": {c.spec.group_size for c in cases},
        "layouts": {(c.spec.q_layout, c.spec.kv_layout) for c in cases},
        "total_len": {c.spec.total_len for c in cases},
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
