"""Misuse fuzzing: random, mostly invalid calls on one backend, each classified.

Every call must either return a finite result of the right shape that matches the float64
reference, or raise SpecError naming a field. Anything else (another exception type, a
wrong or non-finite result) is a finding; a crash kills the child process that runs the
calls, and the parent reports the call it was on.

    python -m attnreg.tools.fuzz --backend webgpu --calls 2000      # the local profile
    python -m attnreg.tools.fuzz --calls 300                        # every available backend
    python -m attnreg.tools.fuzz --calls 2000 --families ''         # plain calls only

A third of the calls are made in a hostile setting (attnreg.tools.fuzz_hostile: planted cache
files, malformed environment variables, a SIGALRM whose handler raises mid-call, magnitudes
whose scores overflow float32). A call that runs past --call-timeout is reported as a hang.

tests/core/test_fuzz.py drives :func:`one_call` with hypothesis (bounded, in CI;
ATTNREG_FUZZ_EXAMPLES=2000 for the local profile there).
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import math
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import attnreg

from .. import reference as ref
from ..errors import SpecError
from ..kernel import LSE_ATOL
from ..tensors import check_tensors
from ..testing import compare, expected, make_tensors
from . import fuzz_hostile as hostile

NASTY: tuple[Any, ...] = (-1, 0, 2**31, 2**63, 10**12, 1.5, "4", None, True, math.nan, math.inf,
                          -math.inf, 1e-320, 1e39, 1e308, [], {}, (1,), "x")
FIELDS = ("batch", "seq_len", "past_len", "num_heads", "kv_num_heads", "head_size", "dtype",
          "q_layout", "kv_layout", "causal", "scale", "softcap", "local_window", "right_window",
          "alibi_max_bias", "kv_capacity", "bias", "seqlens_k", "head_sink", "return_lse",
          "page_size", "num_pages", "kv_dtype", "no_such_field")


Finding = hostile.Finding          # a successful call whose result is wrong


def base_fields(rnd: random.Random) -> dict[str, Any]:
    """A small valid spec (few distinct shapes: compiling dominates on CPU devices)."""
    nkv = rnd.choice((1, 2))
    f: dict[str, Any] = dict(batch=rnd.choice((1, 2)), seq_len=rnd.choice((1, 1, 2, 5)),
                             past_len=rnd.choice((0, 3, 17, 40)), num_heads=nkv * rnd.choice((1, 2)),
                             kv_num_heads=nkv, head_size=rnd.choice((16, 32)),
                             dtype=rnd.choice(("float32", "float16", "float16", "bfloat16")),
                             q_layout=rnd.choice(("BSNH", "BNSH")),
                             kv_layout=rnd.choice(("BSNH", "BNSH", "BNSH", "paged")),
                             causal=rnd.random() < 0.7)
    for name, value in (("softcap", 30.0), ("local_window", 8), ("right_window", 2),
                        ("alibi_max_bias", 8.0), ("bias", True), ("seqlens_k", True), ("head_sink", True),
                        ("return_lse", True), ("scale", 0.3)):
        if rnd.random() < 0.15:
            f[name] = value
    if rnd.random() < 0.2:
        f["kv_capacity"] = f["past_len"] + f["seq_len"] + rnd.choice((1, 9))
    if rnd.random() < 0.1:
        f["kv_dtype"] = rnd.choice(("int8", "int4"))   # int4: head_size 16 is refused
    if f["kv_layout"] == "paged":
        f["page_size"] = rnd.choice((4, 16))
        f["num_pages"] = f["batch"] * -(-(f.get("kv_capacity") or f["past_len"] + f["seq_len"])
                                        // f["page_size"]) + 1
    return f


def _mutate_tensors(rnd: random.Random, spec: attnreg.AttentionSpec,
                    t: dict[str, Any]) -> None:
    name = rnd.choice(sorted(t) + ["zz"])
    how = rnd.randrange(9)
    if name == "zz" or how == 0:
        t["zz" if name == "zz" else name + "_x"] = np.zeros(3, np.float32)
    elif how == 1:
        del t[name]
    elif how == 2:
        with np.errstate(invalid="ignore"):      # NaN poison cast to int: fine, refused anyway
            t[name] = np.asarray(t[name]).astype(rnd.choice(("float64", "int64", "bool",
                                                             "float16")))
    elif how == 3:
        t[name] = np.asarray(t[name]).reshape(-1)
    elif how == 4:
        t[name] = rnd.choice((None, "q", [1.0, 2.0], 3.5))
    elif how == 5:                   # valid: a non-contiguous view of the same values
        a = np.asarray(t[name])
        t[name] = np.asfortranarray(a) if a.ndim > 1 else a[::-1][::-1]
    elif how == 6 and name in ("seqlens_k", "block_table"):
        a = np.array(t[name])
        a.reshape(-1)[rnd.randrange(a.size)] = rnd.choice((-1, 0, 10**6, 2**31 - 1))
        t[name] = a
    elif how == 7 and name == "head_sink":
        a = np.array(t[name])
        a[0] = rnd.choice((math.nan, math.inf, -math.inf))
        t[name] = a
    elif how == 8:                   # valid: zero-stride broadcast of one value
        a = np.asarray(t[name])
        one = np.full((1,) * a.ndim, 1 if a.dtype.kind == "i" else 0.5, a.dtype)
        t[name] = np.broadcast_to(one, a.shape)


def _flags(rnd: random.Random) -> Any:
    return rnd.choice((None, "route=split_kv", ["route"], {"route": ["x"]}, {"nope": 1},
                       {"route": rnd.choice(("prefill", "split_kv", "split_kv_unfused", "bad"))},
                       {"split_size": rnd.choice(NASTY)}, {"m_tile": rnd.choice((0, 2, "4", -1))},
                       {"force_kernel": rnd.choice(("nope", "", "reference.prefill"))},
                       {"block_skip": rnd.choice(("on", "off", 1))}))


def _params(rnd: random.Random) -> Any:
    return rnd.choice((None, [1], {"zzz": 1}, {"split_size": rnd.choice(NASTY)},
                       {"kv_tile": rnd.choice((16, 3, 0, "16"))}, {"prefetch": rnd.choice((0, 1, 2))},
                       {"m_tile": rnd.choice((1, 2, 4, 3))}, {1: 2}))


def _check_run(spec: attnreg.AttentionSpec, tensors: dict[str, Any], got: Any) -> None:
    arrays = check_tensors(spec, tensors)
    want_out, want_lse = expected(spec, arrays)
    out, lse = got if spec.return_lse else (got, None)
    _, problem = compare(spec.replace(return_lse=False), out, (want_out, want_lse))
    if problem:
        raise Finding(problem)
    if lse is not None:
        # The contract's lse atol assumes |lse| of ordinary logits; a huge (valid) scale
        # makes |lse| ~ 1e20, where float32 has ulps of 1e12: allow float32 rounding.
        tol = LSE_ATOL[spec.dtype] + 2e-7 * np.abs(want_lse)
        same_inf = np.array_equal(np.isneginf(lse), np.isneginf(want_lse)) and \
            np.array_equal(np.isnan(lse), np.isnan(want_lse))
        fin = np.isfinite(want_lse)
        if lse.shape != spec.lse_shape or not same_inf or \
                (np.abs(lse[fin] - want_lse[fin]) > tol[fin]).any():
            raise Finding(f"lse off: got {lse.ravel()[:4]}, want {want_lse.ravel()[:4]}")


def _partials(rnd: random.Random, s: attnreg.Session, spec: attnreg.AttentionSpec,
              t: dict[str, Any]) -> None:
    split: Any = rnd.choice((None, 8, 16, 0, -2, 10**12, "8"))
    o, lse = s.partial_states(spec, t, split_size=split)
    if o.shape[:3] != spec.lse_shape:
        raise Finding(f"partials of shape {o.shape}")
    arrays = check_tensors(spec, t)
    want_out, _ = ref.attention(spec.replace(head_sink=False, return_lse=True),
                                       {n: a for n, a in arrays.items() if n != "head_sink"})
    with np.errstate(invalid="ignore"):
        out, _ = ref.combine(o, lse)
    # NaN exactly where the reference has it (a visible NaN input, a mutated block table that
    # makes one visible); the other values close
    if not np.allclose(out, want_out, atol=4e-3, rtol=4e-3, equal_nan=True):
        raise Finding("partial states do not reduce to the attention")


def _states(rnd: random.Random, s: attnreg.Session) -> None:
    h, n = rnd.choice((8, 16)), rnd.choice((1, 2, 3))
    lead = rnd.choice(((2,), (1, 3), (2, 1, 2)))
    states = [(np.random.default_rng(i).standard_normal((*lead, h)).astype(np.float32),
               np.random.default_rng(i + 9).standard_normal(lead).astype(np.float32))
              for i in range(n)]
    k = rnd.randrange(6)
    if k == 1:
        states[0] = (states[0][0], np.full(lead, math.nan, np.float32))
    elif k == 2:
        states[0] = (states[0][0].astype(np.float64), states[0][1])
    elif k == 3:
        states = []
    elif k == 4:
        states[0] = (states[0][0][..., :-1], states[0][1])
    o, lse = s.merge_states(states)
    want_o, want_lse = ref.combine(np.stack([x for x, _ in states], -2),
                                   np.stack([y for _, y in states], -1))
    if not np.allclose(o, want_o, atol=1e-4, rtol=1e-4, equal_nan=True) or \
            not np.allclose(lse, want_lse, atol=1e-4, rtol=1e-4, equal_nan=True):
        raise Finding("merge_states differs from the reference")


def _memory(rnd: random.Random, s: attnreg.Session) -> None:
    # Deliberately ill-typed values too: Any keeps the type checker out of the fuzzing.
    shape: Any = rnd.choice(((4,), (2, 3), (0,), (-1,), (2**31,), (2**32, 2**32), (1.5,), "x",
                             (True,)))
    dtype: Any = rnd.choice(("float32", "float16", "int32", "float64", "nope", 5))
    x = s.empty(shape, dtype)
    a = (np.arange(math.prod(x.shape)) % 7).astype(x.dtype).reshape(x.shape)
    x.write(a)
    if rnd.random() < 0.5:
        x.free()
        x.numpy()                    # must raise ClosedError
        raise Finding("a freed tensor could be read")
    if not np.array_equal(x.numpy(), a):
        raise Finding("device tensor read back differs")
    x.free()


def one_call(rnd: random.Random, s: attnreg.Session,
             families: Sequence[str] = hostile.FAMILIES, seen: list[str] | None = None,
             family: str | None = None) -> str:
    """One random call on session s, plain or in one of the hostile ``families`` (or in
    ``family`` when given: "plain" or one of them; attnreg.tools.fuzz_hostile; its name
    appended to ``seen``); returns its label; raises SpecError (fine), FuzzAlarm (the signals
    family's own interrupt: fine), Finding (wrong result) or anything else (a bug)."""
    if family is None:
        family = rnd.choices(("plain", *families),
                             (2 * len(families) or 1, *[1] * len(families)))[0]
    if seen is not None:
        seen.append(family)
    if family == "signals":
        try:
            return _one(rnd, s, family)
        finally:
            hostile.verify(s)
    if family == "environment":
        name, setting = hostile.hostile_environment(rnd)
        try:
            with setting:
                return "environment:" + _one(rnd, s)
        except SpecError as exc:
            if exc.field.startswith("ATTNREG_") and exc.field != name:
                raise Finding(f"{name} malformed, {exc.field} blamed: {exc}") from None
            raise
    return _one(rnd, s, family)


def _one(rnd: random.Random, s: attnreg.Session, family: str = "plain") -> str:
    """A plain call, or a valid run in the cache / magnitudes / signals family's setting
    (an interrupt must land while the device works)."""
    hostile_run = family in ("cache", "magnitudes", "signals")
    kind = "run" if hostile_run else \
        rnd.choices(("run", "partial", "merge", "memory", "explain"), (6, 1, 1, 1, 1))[0]
    if kind == "merge":
        _states(rnd, s)
        return kind
    if kind == "memory":
        _memory(rnd, s)
        return kind
    fields = base_fields(rnd)
    for _ in range(0 if hostile_run else rnd.choice((0, 0, 0, 1, 1, 2))):
        fields[rnd.choice(FIELDS)] = rnd.choice(NASTY)
    spec = attnreg.AttentionSpec(**fields)
    if kind == "explain":
        s.plan(spec, flags=_flags(rnd), params=_params(rnd))
        return kind
    if spec.capacity * spec.batch * spec.num_heads * spec.head_size > 1 << 20:
        raise SpecError("spec", spec, "(fuzz) a small problem")   # valid, but too slow here
    t: dict[str, Any] = make_tensors(spec, rnd.randrange(1 << 30))
    if family == "magnitudes":
        hostile.extreme_magnitudes(rnd, spec, t)
    elif not hostile_run and rnd.random() < 0.4:
        _mutate_tensors(rnd, spec, t)
    if kind == "partial":
        _partials(rnd, s, spec, t)
        return kind
    if family == "cache":
        with hostile.hostile_cache(rnd, s, spec):
            _check_run(spec, t, s.run(spec, t, flags={"use_tuning_cache": True}))
        return family
    if family == "signals":                     # armed as the run starts: it lands inside
        got = hostile.with_alarm(rnd.uniform(0.0, 0.003), lambda: s.run(spec, t))
        if got is hostile.INTERRUPTED:
            return f"signals:{got}"
        _check_run(spec, t, got)
        return family
    flags = _flags(rnd) if not hostile_run and rnd.random() < 0.3 else None
    params = _params(rnd) if not hostile_run and rnd.random() < 0.3 else None
    kernel: Any = None if hostile_run else \
        rnd.choice((None,) * 8 + ("nope", 3, "reference.prefill"))
    got = s.run(spec, t, flags=flags, params=params, kernel=kernel)
    _check_run(spec, t, got)
    return family if hostile_run else kind


def classify(call: Callable[[], Any]) -> tuple[str, str]:
    """(outcome, detail): ok | spec_error | interrupted | wrong | other."""
    try:
        call()
    except hostile.FuzzAlarm:
        return "interrupted", ""
    except SpecError as exc:
        return ("spec_error", "") if exc.field else ("other", f"SpecError without field: {exc}")
    except Finding as exc:
        return "wrong", str(exc)[:300]
    except Exception as exc:
        return "other", f"{type(exc).__name__}: {str(exc)[:300]}"
    return "ok", ""


def _child(backend: str, calls: int, seed: int, families: Sequence[str],
           call_timeout: float) -> None:
    """Runs the calls, one JSON line per call on stdout (flushed: a crash loses nothing). A
    call still running after ``call_timeout`` seconds is a hang: faulthandler dumps the
    stacks and ends the process, and the parent reports it."""
    with attnreg.Session(backend=backend) as s:
        for i in range(calls):
            labels: list[str] = []
            call = functools.partial(_labelled, labels, random.Random(seed * 1_000_003 + i), s,
                                     families)
            faulthandler.dump_traceback_later(call_timeout, exit=True)
            outcome, detail = classify(call)
            faulthandler.cancel_dump_traceback_later()
            print(json.dumps({"i": i, "outcome": outcome, "detail": detail,
                              "label": labels[0] if labels else ""}), flush=True)


def _labelled(labels: list[str], rnd: random.Random, s: attnreg.Session,
              families: Sequence[str]) -> None:
    labels.append(one_call(rnd, s, families))


def _report(be: str, seed: int, proc: subprocess.CompletedProcess[str], seconds: float) -> int:
    """Print one backend's counts and findings; the number of failures."""
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    counts = Counter(r["outcome"] for r in rows)
    hung = "Timeout (" in proc.stderr
    if proc.returncode != 0:
        counts["hang" if hung else "crash"] += 1
    hostile_calls = Counter(r["label"].split(":")[0] for r in rows
                            if r["label"].split(":")[0] in hostile.FAMILIES)
    hostile_calls["signals, interrupted"] = sum(
        r["label"] == f"signals:{hostile.INTERRUPTED}" for r in rows)
    print(f"{be}: {len(rows)} calls in {seconds:.0f} s: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
          + f" (completed in a hostile setting: {dict(sorted(hostile_calls.items()))})")
    for r in rows:
        if r["outcome"] in ("other", "wrong"):
            print(f"  call {r['i']} (seed {seed}): {r['outcome']}: {r['detail']}")
    if proc.returncode != 0:
        print(f"  {'hang' if hung else 'crash'} (exit {proc.returncode}) after call "
              f"{len(rows) - 1}: {proc.stderr.strip().splitlines()[-12:]}")
    return counts["other"] + counts["wrong"] + counts["crash"] + counts["hang"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attnreg.tools.fuzz", description=__doc__)
    ap.add_argument("--backend", default=None, help="one backend (default: every available one)")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--families", default=",".join(hostile.FAMILIES),
                    help="hostile families mixed in, comma-separated ('' for plain calls only)")
    ap.add_argument("--call-timeout", type=float, default=300.0,
                    help="seconds after which a call counts as a hang")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    families = [f for f in a.families.split(",") if f]
    if set(families) - set(hostile.FAMILIES):
        ap.error(f"--families: one of {hostile.FAMILIES}")
    if a.child:
        _child(a.backend, a.calls, a.seed, families, a.call_timeout)
        return 0
    backends = [a.backend] if a.backend else sorted({d.backend for d in attnreg.devices()
                                                      if d.available})
    failed = 0
    for be in backends:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "attnreg.tools.fuzz", "--child", "--backend",
                               be, "--calls", str(a.calls), "--seed", str(a.seed), "--families",
                               ",".join(families), "--call-timeout", str(a.call_timeout)],
                              capture_output=True, text=True)
        failed += _report(be, a.seed, proc, time.perf_counter() - t0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
