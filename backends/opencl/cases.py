"""OpenCL conformance cases: a covering subset of the issue's axes, as data.

Each (variant, dtype) pair meets every contract feature once; layouts, GQA ratio, head
size, seq_len and total length rotate with independent strides, so every value of every
axis appears in every variant (tests/test_opencl.py checks that). Run on PoCL by pytest,
and on any OpenCL device without pytest (the H100 check)::

    python3 -m attnreg.backends.opencl.cases --device h100 [name-filter ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import attnreg
from attnreg import reference as ref
from attnreg.kernel import TOLERANCE
from attnreg.plan import Stage
from attnreg.spec import AttentionSpec
from attnreg.tensors import check_tensors
from attnreg.tools import testing

DT = {"float32": "f32", "float16": "f16"}
LAYOUTS = (("BSNH", "BNSH"), ("BNSH", "BSNH"), ("BSNH", "BSNH"), ("BNSH", "BNSH"))
GQA = (1, 4, 7)
HEADS = (32, 64, 80, 96, 128, 256)
SEQ = (1, 2, 3, 4, 5, 33, 97)
# Tile boundaries +-1 (tiles are 16/32/64 keys, splits multiples of 16..64), 1, and > 1000.
TOTALS = (1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 129, 1025, 1500)

# variant tag -> (kernel id pattern, how it runs). "-sg" variants run natively where the
# device has sub-groups; "-emu" ones run the same sub-group code with the shuffles
# emulated in local memory, on any device.
VARIANTS: dict[str, tuple[str, str]] = {
    "prefill-wgmem": ("opencl.prefill.{dt}.wgmem", "attention"),
    "prefill-sg": ("opencl.prefill.{dt}.sg", "attention"),
    "prefill-sg-emu": ("opencl.prefill.{dt}.sg", "emulated"),
    "decode_partial-m1": ("opencl.decode_partial.{dt}.m1", "attention"),
    "decode_partial-m2": ("opencl.decode_partial.{dt}.m2", "attention"),
    "decode_partial-m4": ("opencl.decode_partial.{dt}.m4", "attention"),
    "decode_partial-sg-m1": ("opencl.decode_partial.{dt}.sg.m1", "attention"),
    "decode_partial-sg-m4": ("opencl.decode_partial.{dt}.sg.m4", "attention"),
    "decode_partial-sg-m2-emu": ("opencl.decode_partial.{dt}.sg.m2", "emulated"),
    "partial-m4": ("opencl.decode_partial.{dt}.m4", "partial"),  # reduced by the reference
    "partial-m1": ("opencl.decode_partial.{dt}.m1", "partial"),
    "reduce": ("opencl.reduce.{dt}", "reduce"),                  # reference partials reduced here
    "decode_fused-m1": ("opencl.decode_fused.{dt}.m1", "attention"),
    "decode_fused-sg-m1": ("opencl.decode_fused.{dt}.sg.m1", "attention"),
    "decode_fused-sg-m4": ("opencl.decode_fused.{dt}.sg.m4", "attention"),
    "decode_fused-sg-m2-emu": ("opencl.decode_fused.{dt}.sg.m2", "emulated"),
    # (m4 fused/unfused and the paged sg decode_partial run in the registry matrix and on
    # NVIDIA through decode_fused-sg-m1-paged: the same decode tile)
    "unfused-m1": ("opencl.decode_qk.{dt}.m1", "attention"),     # decode_qk -> decode_pv -> reduce
    "partial-unfused-m2": ("opencl.decode_qk.{dt}.m2", "partial"),
    # paged KV pools (page sizes rotate), every family that reads K/V
    "prefill-wgmem-paged": ("opencl.prefill.{dt}.wgmem", "attention"),
    "prefill-sg-paged": ("opencl.prefill.{dt}.sg", "attention"),
    "decode_fused-m2-paged": ("opencl.decode_fused.{dt}.m2", "attention"),
    "decode_fused-sg-m1-paged": ("opencl.decode_fused.{dt}.sg.m1", "attention"),
    "unfused-m2-paged": ("opencl.decode_qk.{dt}.m2", "attention"),
    # masked-block skipping: bias features only, block-diagonal biases among them
    "prefill-wgmem-bs": ("opencl.prefill.{dt}.wgmem.bs", "attention"),
    "prefill-sg-bs": ("opencl.prefill.{dt}.sg.bs", "attention"),
    "prefill-sg-bs-emu": ("opencl.prefill.{dt}.sg.bs", "emulated"),
    "decode_partial-m1-bs": ("opencl.decode_partial.{dt}.m1.bs", "attention"),
    "decode_partial-m4-bs-paged": ("opencl.decode_partial.{dt}.m4.bs", "attention"),
}
NATIVE_SG = ("prefill-sg", "decode_partial-sg-m1", "decode_partial-sg-m4", "decode_fused-sg-m1",
             "decode_fused-sg-m4", "prefill-sg-paged", "decode_fused-sg-m1-paged", "prefill-sg-bs")
PAGE_SIZES = (16, 5, 1, 32)


@dataclass(frozen=True)
class Case:
    name: str
    variant: str
    kernel: str
    mode: str
    spec: AttentionSpec
    feature: str
    make: dict[str, Any] = field(default_factory=dict)   # make_tensors keywords (+ bias_f16)
    masked_row: bool = False                             # bias -inf over all keys of row 0
    split_size: int | None = None


def skip_features(b: int, nq: int, s: int, c: int
                  ) -> list[tuple[str, dict[str, Any], dict[str, Any], bool]]:
    """The bias features, plus document masks (block-diagonal biases: whole blocks -inf)
    -- what a block-skipping variant can run."""
    return [f for f in testing.contract_features(b, nq, s, c) if f[1].get("bias")] + [
        ("docs-shared-zero", {"bias": True}, {"docs": 3, "bias_shape": (1, 1, s, c)}, False),
        ("docs-heads", {"bias": True, "causal": False}, {"docs": 4, "doc_values": True}, False),
        ("docs-everything", {"seqlens_k": True, "kv_capacity": c + 5, "softcap": 3.0,
                             "alibi_max_bias": 4.0, "head_sink": True, "return_lse": True,
                             "bias": True},
         {"docs": 2, "doc_values": True, "bias_shape": (1, nq, s, c + 5)}, False),
    ]


def _lift(total: int, s: int) -> int:
    """A total length >= s that keeps total's position relative to 64-key tiles."""
    return total if total >= s else total + 64 * math.ceil((s - total) / 64)


def build(variants: tuple[str, ...] = tuple(VARIANTS)) -> list[Case]:
    """Every case of the given variants, in a fixed order.

    Within a variant, slot k (dtype x feature) takes each axis from its own rotation, with
    strides chosen so that 32 slots cover every value and values do not travel in pairs.
    """
    out: list[Case] = []
    order = list(VARIANTS)
    for var in variants:
        v = order.index(var)        # a variant's cases do not depend on what else is built
        pattern, mode = VARIANTS[var]
        emu = "-emu" in var
        feat_fn = skip_features if "-bs" in var else testing.contract_features
        for di, (dtype, dt) in enumerate(DT.items()):
            nfeat = len(feat_fn(1, 1, 1, 1))
            for fi in range(nfeat):
                k = di * nfeat + fi
                ql, kl = LAYOUTS[(k // 3 + v) % 4]
                g = GQA[(k // 2 + v) % 3]
                h = HEADS[(k + v) % 6]
                base = TOTALS[(k + 3 * v) % len(TOTALS)]
                s = 1 if base == 1 else SEQ[(k * 3 + v) % 7]
                total = _lift(base, s)
                if emu:   # the emulation pays two barriers per shuffle: keep it small
                    s, total, h = min(s, 5), min(total, 65 if "prefill" in var else 40), min(h, 64)
                nkv = 1 if g == 7 else 2
                b = 2 if h <= 96 and total < 1000 else 1
                tag, changes, kw, masked = feat_fn(b, nkv * g, s, total)[fi]
                layout: dict[str, Any] = {"kv_layout": kl}
                kv_tag = kl.lower()
                if var.endswith("-paged"):
                    ps = PAGE_SIZES[k % len(PAGE_SIZES)]
                    cap = int(changes.get("kv_capacity", total))
                    layout = {"kv_layout": "paged", "page_size": ps,
                              "num_pages": b * -(-cap // ps) + 3}
                    kv_tag = f"paged{ps}"
                spec = AttentionSpec(batch=b, seq_len=s, past_len=total - s, num_heads=nkv * g,
                                     kv_num_heads=nkv, head_size=h, dtype=dtype, q_layout=ql,
                                     **layout, **changes)
                split = None
                if mode != "attention" or "decode" in var or "unfused" in var:
                    split = (16, 48, 32, 100)[k % 4] if spec.capacity > 16 else None
                m = f"-m{pattern[-1]}" if "decode" in pattern else ""
                fam = "_".join(x for x in var.split("-")
                               if x not in ("emu", "paged") and (not x.startswith("m") or x == "m"))
                name = (f"{fam}-{dt}{m}-gqa{g}-h{h}-s{s}-L{total}"
                        f"-{ql.lower()}-{kv_tag}{'-emu' * emu}-{tag}")
                out.append(Case(name, var, pattern.format(dt=dt), mode, spec, tag, dict(kw),
                                masked, split))
    return out


def for_device(caps: attnreg.DeviceCaps) -> list[Case]:
    """The cases a device can run natively, plus the emulated sub-group ones."""
    skip = () if "subgroups" in caps.features else NATIVE_SG
    return build(tuple(v for v in VARIANTS if v not in skip))


def tensors_for(case: Case, seed: int = 0) -> dict[str, np.ndarray]:
    kw = dict(case.make)
    bias_f16 = kw.pop("bias_f16", False)
    docs, doc_values = kw.pop("docs", 0), kw.pop("doc_values", False)
    t = testing.make_tensors(case.spec, seed, **kw)
    if docs:
        t["bias"] = doc_mask(case.spec, t["bias"], docs, doc_values)
    if case.masked_row:
        t["bias"][:, :, 0, :] = -np.inf
    if bias_f16 and case.spec.dtype == "float16":
        t["bias"] = t["bias"].astype(np.float16)
    return t


def doc_mask(spec: AttentionSpec, bias: np.ndarray, docs: int, keep_values: bool) -> np.ndarray:
    """A block-diagonal bias: query row i sees key j only if both lie in the same of
    ``docs`` equal documents of the key range (packed sequences); 0 or the given values
    inside a document, -inf across."""
    c = bias.shape[3]
    rows = spec.total_len - spec.seq_len + np.arange(bias.shape[2])
    same = (rows[:, None] * docs // c) == (np.arange(c)[None, :] * docs // c)
    inside = bias if keep_values else np.zeros_like(bias)
    return np.where(same[None, None], inside, -np.inf).astype(bias.dtype)


def _emulated(session: attnreg.Session, case: Case, t: dict[str, np.ndarray],
              params: dict[str, Any] | None) -> Any:
    """The sub-group kernel with shuffles emulated in local memory, launched directly
    (the registry rightly refuses sg variants on a device without sub-groups)."""
    spec = case.spec
    generic = case.kernel.replace(".sg", ".wgmem" if ".prefill." in case.kernel else "")
    plan = session.plan(spec, kernel=generic, params=params)
    first = plan.stages[0]
    stage = Stage(case.kernel, first.family, {**first.params, "sg_impl": "emu"})
    plan = dataclasses.replace(plan, stages=(stage, *plan.stages[1:]))
    res = session.runtime(plan).launch(plan, check_tensors(spec, t))
    return (res["out"], res["lse"]) if spec.return_lse else res["out"]


def run_case(session: attnreg.Session, case: Case, seed: int = 0,
             extra_params: Mapping[str, Any] | None = None) -> tuple[float, str]:
    """(max error, problem or '') of one case on the session's OpenCL device;
    ``extra_params`` are forced on the case's kernel (e.g. {"cvt": "cl"} on NVIDIA)."""
    spec = case.spec
    t = tensors_for(case, seed)
    want = testing.expected(spec, t)
    params = {**({"split_size": case.split_size} if case.split_size else {}),
              **(extra_params or {})} or None
    if case.mode == "attention":
        return testing.compare(spec, session.run(spec, t, kernel=case.kernel, params=params),
                               want)
    if case.mode == "emulated":
        return testing.compare(spec, _emulated(session, case, t, params), want)
    size = case.split_size or spec.capacity
    inputs = check_tensors(spec, t)
    wo, wl = ref.partial_states(spec, inputs, size)
    if case.mode == "partial":
        o, lse = session.partial_states(spec, t, split_size=size, kernel=case.kernel,
                                        params=extra_params)
        err, why = testing.compare_partials(spec, (o, lse), (wo, wl), TOLERANCE[spec.dtype])
        if why:
            return err, why
        got = attnreg.reduce_states(spec, o, lse, t.get("head_sink"), backend="reference")
        return testing.compare(spec, got, want)
    o, lse = wo.astype(np.float32), wl.astype(np.float32)
    o[np.isneginf(lse)] = np.nan      # an empty split's o may hold anything; it must not leak
    got = session.reduce_states(spec, o, lse, t.get("head_sink"), kernel=case.kernel)
    return testing.compare(spec, got, want)


def axis_values(cases: list[Case]) -> dict[str, set[Any]]:
    return {
        "head_size": {c.spec.head_size for c in cases},
        "seq_len": {c.spec.seq_len for c in cases},
        "gqa": {c.spec.group_size for c in cases},
        "layouts": {(c.spec.q_layout, c.spec.kv_layout) for c in cases},
        "total_len": {c.spec.total_len for c in cases},
        "dtype": {c.spec.dtype for c in cases},
        "feature": {c.feature for c in cases},
    }


def main(argv: list[str] | None = None) -> int:
    """Run cases on one OpenCL device; print failures and a summary (and write JSON)."""
    ap = argparse.ArgumentParser(description="OpenCL conformance cases")
    ap.add_argument("--device", default=None)
    ap.add_argument("--variants", default="", help="comma-separated variant names (default all)")
    ap.add_argument("--dtype", default=None, help="float16 or float32 only")
    ap.add_argument("--params", default="{}", help="JSON params forced on every case's kernel")
    ap.add_argument("--json", default=None, help="write the summary and failures here")
    ap.add_argument("filters", nargs="*", help="substrings of case names")
    a = ap.parse_args(argv)
    params = json.loads(a.params)
    bad: list[str] = []
    skipped = 0
    worst, t0 = 0.0, time.perf_counter()
    with attnreg.Session(backend="opencl", device=a.device) as s:
        caps = s.plan(AttentionSpec()).caps
        wanted = [v for v in a.variants.split(",") if v]
        cases = [c for c in (build(tuple(wanted)) if wanted else for_device(caps))
                 if (not a.filters or any(f in c.name for f in a.filters))
                 and (a.dtype is None or c.spec.dtype == a.dtype)]
        print(f"{caps.label}: {len(cases)} cases {params or ''}", flush=True)
        for case in cases:
            try:
                err, why = run_case(s, case, extra_params=params)
            except attnreg.NoKernelError as exc:
                if "workgroup storage" in str(exc) and case.kernel in str(exc):
                    skipped += 1        # the device's local memory is too small: not a cell
                    continue
                err, why = math.inf, f"NoKernelError: {str(exc)[:500]}"
            except Exception as exc:
                err, why = math.inf, f"{type(exc).__name__}: {str(exc)[:500]}"
            if why:
                bad.append(f"{case.name}: {why}")
                print(f"FAIL {case.name}: {why}", flush=True)
            else:
                worst = max(worst, err)
    secs = time.perf_counter() - t0
    print(f"{len(cases) - len(bad) - skipped}/{len(cases)} pass ({skipped} need more local "
          f"memory than the device has) in {secs:.1f} s; largest error of a passing case "
          f"{worst:.3g}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"variants": wanted, "params": params, "dtype": a.dtype,
                       "cases": len(cases), "failed": len(bad), "skipped": skipped,
                       "failures": bad,
                       "worst_err": worst, "seconds": round(secs, 1)}, fh, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
