"""The conformance matrix: cases generated from the registry, run against the reference.

Every registered kernel variant x every available device of its backend x its declared
dtypes, head sizes and contract features becomes typed cases with readable ids such as
``webgpu-llvmpipe-decode_partial-f16-m4-gqa4-causal-seqlens``. Each case forces its
kernel, so vendor-tuned and fallback variants run on whatever device can execute them.
A new kernel or a new plugin is covered without editing anything here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import reference as ref
from .. import registry as regmod
from ..caps import DeviceCaps
from ..errors import NoKernelError
from ..kernel import KernelInfo
from ..session import Session
from ..spec import AttentionSpec
from .testing import compare, compare_partials, expected, make_tensors

HEAD_SIZES = (32, 64, 80, 96, 128, 256)
SMALL_HEAD = 32


@dataclass(frozen=True)
class Case:
    """One cell of the matrix: a kernel on a device for one spec and input recipe."""

    backend: str
    device: str                 # DeviceCaps.id
    slug: str                   # short device name for ids
    kernel: str
    family: str
    check: str                  # "attention" | "partial" | "reduce"
    label: str
    spec: AttentionSpec
    params: tuple[tuple[str, Any], ...] = ()
    lengths: tuple[int, ...] | None = None
    bias_bcast: bool = False    # bias of shape [1, Nq, 1, C] instead of full
    mask_rows: bool = False     # fully mask some rows through the bias
    rerun: bool = False         # also run twice and require bitwise-identical results
    seed: int = 0

    @property
    def variant(self) -> str:
        parts = self.kernel.split(".")[2:]
        return ".".join(p for p in parts if p not in ("f16", "f32")) or "base"

    @property
    def id(self) -> str:
        dt = "f16" if self.spec.dtype == "float16" else "f32"
        parts = [self.backend, self.slug, self.family, dt, self.variant,
                 f"gqa{self.spec.group_size}", f"h{self.spec.head_size}", self.label]
        if self.check != self.family and self.check != "attention":
            parts.append(self.check)
        return "-".join(parts)


@dataclass
class Result:
    case: Case
    status: str                 # pass | fail | skip
    max_abs_err: float
    atol: float
    rtol: float
    seconds: float
    message: str = ""

    def as_dict(self) -> dict[str, Any]:
        c = self.case
        return {"backend": c.backend, "device": c.device, "kernel": c.kernel, "case": c.id,
                "dtype": c.spec.dtype, "status": self.status,
                "max_abs_err": None if not np.isfinite(self.max_abs_err) else self.max_abs_err,
                "atol": self.atol, "rtol": self.rtol, "seconds": round(self.seconds, 4),
                "message": self.message}


# -- generation --------------------------------------------------------------------------
@dataclass
class _Gen:
    k: KernelInfo
    dev: DeviceCaps
    quick: bool
    out: list[Case] = field(default_factory=list)

    def head(self, preferred: int = SMALL_HEAD) -> int | None:
        if self.k.head_size_ok(preferred):
            return preferred
        ok = [h for h in HEAD_SIZES if self.k.head_size_ok(h)]
        lo, hi, _ = self.k.head_sizes
        return ok[0] if ok else (lo if lo <= hi else None)

    def base(self) -> dict[str, Any]:
        dtype = sorted(self.k.dtypes)[0]
        m = int(self.k.params.get("m_tile", 1))
        s = {"prefill": 33, "reduce": 3}.get(self.k.family, m)
        if self.k.max_seq_len is not None:
            s = min(s, self.k.max_seq_len)
        return dict(batch=2, seq_len=s, past_len=70, num_heads=4, kv_num_heads=2,
                    head_size=self.head() or 1, dtype=dtype, causal=False)

    def add(self, label: str, changes: dict[str, Any], **kw: Any) -> None:
        fields = {**self.base(), **changes}
        try:
            spec = AttentionSpec(**fields)
        except ValueError:
            return
        check = "reduce" if self.k.family == "reduce" else "attention"
        if self.k.not_supported_reasons(spec, self.dev, dict(kw.get("params", ()))):
            return          # outside the kernel's declared support: not a cell
        self.out.append(Case(self.dev.backend, self.dev.id, self.dev.slug, self.k.id,
                             self.k.family, kw.pop("check", check), label, spec,
                             seed=len(self.out), **kw))

    def generate(self) -> list[Case]:
        k, sup = self.k, self.k.supports
        split = (("split_size", int(k.defaults.get("kv_tile", 16))),) \
            if k.family in ("decode_partial", "decode_qk", "decode_fused") else ()
        for dtype in sorted(k.dtypes):
            d = {"dtype": dtype}
            self.add("plain", d, params=split)
            if "causal" in sup:
                self.add("causal", {**d, "causal": True}, params=split, rerun=True)
            if "bias" in sup:
                self.add("bias", {**d, "bias": True}, params=split)
                self.add("bias-bcast", {**d, "bias": True}, params=split, bias_bcast=True)
                if "return_lse" in sup:
                    self.add("masked-rows", {**d, "bias": True, "return_lse": True},
                             params=split, mask_rows=True)
            if {"seqlens_k", "kv_capacity"} <= sup:
                self.add("seqlens", {**d, "seqlens_k": True, "kv_capacity": 96, "causal": True},
                         params=split, lengths=(96, 40))
            for feat, ch in (("local_window", {"local_window": 9, "causal": True}),
                             ("softcap", {"softcap": 4.0}), ("alibi", {"alibi_max_bias": 8.0}),
                             ("head_sink", {"head_sink": True}), ("return_lse", {"return_lse": True})):
                if feat in sup:
                    self.add(feat.replace("_", ""), {**d, **ch}, params=split)
            self.add("layouts", {**d, "q_layout": "BNSH", "kv_layout": "BSNH"}, params=split)
            if "paged" in k.kv_layouts:
                # (96, 3): a sequence shorter than one page (at least seq_len keys)
                short = max(3, int(self.base()["seq_len"]))
                for ps, lens in ((16, (96, 40)), (5, (96, short))):
                    self.add(f"paged{ps}", {**d, "kv_layout": "paged", "page_size": ps,
                                            "num_pages": 2 * -(-96 // ps) + 3, "seqlens_k": True,
                                            "kv_capacity": 96, "causal": True},
                             params=split, lengths=lens)
            if "gqa" in sup:
                self.add("mqa", {**d, "num_heads": 7, "kv_num_heads": 1}, params=split)
                self.add("gqa4", {**d, "num_heads": 8, "kv_num_heads": 2}, params=split)
            self.add("mha", {**d, "num_heads": 2, "kv_num_heads": 2}, params=split)
            everything = {f: v for f, v in (("bias", True), ("seqlens_k", True),
                          ("kv_capacity", 90), ("local_window", 30), ("softcap", 5.0),
                          ("alibi_max_bias", 4.0), ("head_sink", True), ("return_lse", True),
                          ("causal", True)) if _feature_of(f) in sup}
            self.add("all", {**d, **everything, "q_layout": "BNSH", "kv_layout": "BSNH"},
                     params=split, lengths=(90, 33) if "seqlens_k" in everything else None,
                     rerun=True)
            if self.quick:
                continue
            # Head sizes, row counts and key counts around tile edges.
            for h in HEAD_SIZES:
                if h != self.base()["head_size"]:
                    self.add("heads", {**d, "head_size": h, "batch": 1, "num_heads": 2,
                                       "past_len": 40}, params=split)
            tile = int(k.defaults.get("kv_tile", 64))
            for total in sorted({1, tile - 1, tile, tile + 1, 2 * tile + 1, 1029}):
                s = min(self.base()["seq_len"], total)
                self.add(f"L{total}", {**d, "batch": 1, "seq_len": s, "past_len": total - s,
                                       "causal": True}, params=split)
            if k.family in ("decode_partial", "decode_qk", "decode_fused"):
                m = int(k.params.get("m_tile", 1))
                for s in sorted({1, 2, 3, 4, 5, m + 1} - {m}):
                    self.add(f"S{s}", {**d, "seq_len": s, "causal": True}, params=split)
                if k.family != "decode_fused":       # fused kernels keep partials inside
                    self.add("partials", {**d, "causal": True, "local_window": 20},
                             params=split, check="partial")
            if k.family == "prefill":
                for s in (1, 2, 5, 97):
                    self.add(f"S{s}", {**d, "seq_len": s, "causal": True})
        return self.out


# Small versions of the three workloads profiles are pinned on (decode, whisper, prefill):
# the rules pick per-vendor parameters from these, and the cells run those parameters here.
PROFILE_SPECS: tuple[tuple[str, AttentionSpec], ...] = (
    ("decode", AttentionSpec(batch=1, seq_len=1, past_len=299, num_heads=8, kv_num_heads=2,
                             head_size=128, dtype="float16", causal=True)),
    ("whisper", AttentionSpec(batch=1, seq_len=4, past_len=196, num_heads=8, kv_num_heads=8,
                              head_size=64, dtype="float16", causal=False)),
    ("prefill", AttentionSpec(batch=1, seq_len=64, past_len=0, num_heads=8, kv_num_heads=2,
                              head_size=128, dtype="float16", causal=True)),
)


def profile_cases(devices: Iterable[DeviceCaps]) -> tuple[list[Case], dict[str, str]]:
    """Every stored profile's plan (with and without its vendor opt-in flags), forced on the
    available device of the same backend. Returns (cases, {label: why not runnable here})."""
    from ..flags import table as flag_table
    from ..profiles import profiles
    devs = [d for d in devices if d.available]
    reg = regmod.get()
    out: list[Case] = []
    skipped: dict[str, str] = {}
    for name, caps in profiles().items():
        targets = [d for d in devs if d.backend == caps.backend]
        vendor_flags = [f.name for f in flag_table().values() if f.vendor == caps.vendor]
        flag_sets: list[dict[str, Any]] = [{}] + [{f: True} for f in vendor_flags]
        for flags in flag_sets:
            for work, spec in PROFILE_SPECS:
                try:
                    plan = reg.plan(spec, caps=caps, flags=flags)
                except NoKernelError as exc:
                    skipped[f"{name}-{work}"] = f"no plan on the profile: {exc}"
                    continue
                tag = f"profile-{name}" + "".join(f"-{f}" for f in flags)
                for dev in targets:
                    k = reg.kernel(plan.kernel)
                    params = dict(plan.params)
                    run_spec = spec
                    why = k.not_supported_reasons(run_spec, dev, params)
                    # A bigger GPU's tiles may not fit a CI device's workgroup storage at this
                    # head size; the same parameter values at a smaller head size exercise
                    # the same code path, so try those before giving up.
                    while why and "workgroup storage" in " ".join(why) and run_spec.head_size > 32:
                        run_spec = run_spec.replace(head_size=run_spec.head_size // 2)
                        why = k.not_supported_reasons(run_spec, dev, params)
                    if why:
                        skipped[f"{tag}-{work}@{dev.slug}"] = "; ".join(why)
                        continue
                    check = "reduce" if k.family == "reduce" else "attention"
                    out.append(Case(dev.backend, dev.id, dev.slug, k.id, k.family, check,
                                    f"{tag}-{work}", run_spec, tuple(sorted(params.items())),
                                    seed=len(out)))
    return out, skipped


def _feature_of(field_name: str) -> str:
    return {"alibi_max_bias": "alibi", "kv_capacity": "kv_capacity"}.get(field_name, field_name)


def cases(devices: Iterable[DeviceCaps] | None = None, *, backend: str | None = None,
          quick: bool = False, kernels: Sequence[KernelInfo] | None = None) -> list[Case]:
    """All cells for the available devices (optionally one backend)."""
    reg = regmod.get()
    devs = [d for d in (devices if devices is not None else reg.devices(backend)) if d.available]
    out: list[Case] = []
    for dev in devs:
        for k in kernels if kernels is not None else reg.kernels(dev.backend):
            if k.backend == dev.backend:
                out += _Gen(k, dev, quick).generate()
    if kernels is None:
        out += profile_cases(devs)[0]
    return out


def uncovered(all_cases: Sequence[Case], devices: Iterable[DeviceCaps]) -> dict[str, str]:
    """Registered kernels with no cell on any of the given devices, and why (their reasons
    on a plain spec)."""
    reg = regmod.get()
    have = {c.kernel for c in all_cases}
    out = {}
    devs = [d for d in devices if d.available]
    for k in reg.kernels():
        mine = [d for d in devs if d.backend == k.backend]
        if k.id in have or not mine:
            continue
        g = _Gen(k, mine[0], True)
        spec = AttentionSpec(**g.base())
        out[k.id] = "; ".join(k.not_supported_reasons(spec, mine[0])) or "no case generated"
    return out


# -- running -----------------------------------------------------------------------------
def inputs_for(case: Case) -> dict[str, np.ndarray]:
    spec = case.spec
    shape = (1, spec.num_heads, 1, spec.capacity) if case.bias_bcast else None
    t = make_tensors(spec, seed=case.seed, lengths=case.lengths, bias_shape=shape,
                     mask_frac=0.1 if spec.bias else 0.0)
    if case.mask_rows:
        t["bias"][0, :, 0, :] = -np.inf          # batch 0, row 0: every key masked
        if t["bias"].shape[2] > 1:
            t["bias"][-1, -1, -1, :] = -np.inf
    return t


def run_case(case: Case, session: Session) -> Result:
    """Run one cell; never raises (errors become failing results)."""
    k = regmod.get().kernel(case.kernel)
    atol, rtol = k.tolerance.get(case.spec.dtype, (0.0, 0.0))
    t0 = time.perf_counter()
    try:
        err, problem = _execute(case, session, k, (atol, rtol))
        status = "fail" if problem else "pass"
    except NoKernelError as exc:
        err, problem, status = float("inf"), f"could not be forced: {exc}", "fail"
    except Exception as exc:   # a crash is a failing cell, not a crashed matrix
        err, problem, status = float("inf"), f"{type(exc).__name__}: {exc}", "fail"
    return Result(case, status, err, atol, rtol, time.perf_counter() - t0, problem)


def _execute(case: Case, s: Session, k: KernelInfo, tol: tuple[float, float]) -> tuple[float, str]:
    spec, params = case.spec, dict(case.params)
    t = inputs_for(case)
    if case.check == "reduce":
        o_p, l_p = ref.partial_states(spec, t, 16)
        o_p, l_p = o_p.astype(np.float32), l_p.astype(np.float32)
        got = s.reduce_states(spec, o_p, l_p, t.get("head_sink"), kernel=k.id)
        return compare(spec, got, expected(spec, t), tol)
    if case.check == "partial":
        ss = int(params["split_size"])
        got_p = s.partial_states(spec, t, split_size=ss, kernel=k.id)
        return compare_partials(spec, got_p, ref.partial_states(spec, t, ss), tol)
    got = s.run(spec, t, kernel=k.id, params=params)
    err, problem = compare(spec, got, expected(spec, t), tol)
    if not problem and case.rerun:
        again = s.run(spec, t, kernel=k.id, params=params)
        a = got if not spec.return_lse else got[0]
        b = again if not spec.return_lse else again[0]
        if a.tobytes() != b.tobytes():
            problem = "a rerun gave different bits"
    return err, problem


def run_matrix(all_cases: Sequence[Case], progress: Callable[[Sequence[Case]], Iterable[Case]]
               | None = None) -> list[Result]:
    """Run cases, one Session per device (so compiled kernels are reused)."""
    sessions: dict[str, Session] = {}
    results = []
    try:
        for case in (progress(all_cases) if progress else all_cases):
            s = sessions.get(case.device)
            if s is None:
                s = sessions[case.device] = Session(backend=case.backend, device=case.device)
            results.append(run_case(case, s))
    finally:
        for s in sessions.values():
            s.close()
    return results


def load_required(path: str) -> dict[str, Any]:
    import json
    with open(path) as fh:
        data: dict[str, Any] = json.load(fh)
    return data


def missing_required(required: dict[str, Any], devices: Iterable[DeviceCaps]) -> list[str]:
    """Required (backend, slug) pairs with no available device."""
    have = {(d.backend, d.slug) for d in devices if d.available}
    return [f"{r['backend']}/{r['slug']}" for r in required.get("devices", [])
            if (r["backend"], r["slug"]) not in have]


def markdown(results: Sequence[Result]) -> str:
    """Kernels x devices table of pass counts."""
    devices = sorted({f"{r.case.backend}/{r.case.slug}" for r in results})
    kernels = sorted({r.case.kernel for r in results})
    cell: dict[tuple[str, str], list[int]] = {}
    for r in results:
        c = cell.setdefault((r.case.kernel, f"{r.case.backend}/{r.case.slug}"), [0, 0])
        c[0] += r.status == "pass"
        c[1] += 1
    lines = ["| kernel | " + " | ".join(devices) + " |", "|---" * (len(devices) + 1) + "|"]
    for k in kernels:
        row = []
        for d in devices:
            p = cell.get((k, d))
            row.append("" if p is None else f"{p[0]}/{p[1]}" + ("" if p[0] == p[1] else " ❌"))
        lines.append(f"| {k} | " + " | ".join(row) + " |")
    total = sum(r.status == "pass" for r in results)
    lines.append(f"\n{total}/{len(results)} cells pass.")
    return "\n".join(lines)
