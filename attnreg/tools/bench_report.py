"""What `attnreg bench` reports: its rows, the tables (every row, ratios against the peers,
storages against their float16 twins), JSON in and out, and the roofline plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .bench_suites import QUICK, SUITES, traffic, twin


@dataclass
class Row:
    suite: str
    case: str
    backend: str
    device: str
    kernels: str
    gpu_us: float | None
    wall_us: float
    gb_s: float | None
    tflops: float | None
    max_err: float | None
    extra: dict[str, Any] = field(default_factory=dict)
    # per call with N calls back to back, the first start to the last end / N (bench.py)
    b2b_us: float | None = None
    # the case's limit time / its kernel time, and what the limit is (bench_limits.py)
    limit: float | None = None
    limit_of: str = ""


def _basis(r: Row) -> float:
    """A row's time: GPU (kernel) time where measured, else wall clock."""
    return r.gpu_us if r.gpu_us is not None else r.wall_us


def storage_ratios(rows: Sequence[Row]) -> str:
    """Per backend and device: each bf16 / int8 / int4 case's speed-up over its float16 twin
    (x = twin's time / the case's; GPU time where measured)."""
    from .textui import table

    basis = _basis
    ok = [r for r in rows if r.suite == "kv-dtypes" and not r.kernels.startswith(("FAILED", "n/a"))]
    by = {(r.backend, r.device, r.case): r for r in ok}
    out = []
    for r in ok:
        base = by.get((r.backend, r.device, twin(r.case) or ""))
        if base is None:
            continue
        out.append([f"{r.backend}/{r.device}", r.case, f"{basis(base):.1f}", f"{basis(r):.1f}",
                    f"{basis(base) / basis(r):.2f}x", f"{r.max_err:.2g}" if r.max_err else "-"])
    return table(("device", "case", "f16 twin (us)", "this (us)", "speed-up", "max err"), out)

def context_parallel(rows: Sequence[Row]) -> str:
    """Per backend: the sharded decode against one device over L / N keys (the target: at
    most 1.15x) and over all L, and the merge's share of the sharded call."""
    from .textui import table

    out = []
    for r in rows:
        if r.suite != "context-parallel" or "vs_1dev_L/N" not in r.extra:
            continue
        e = r.extra
        out.append((r.backend, r.case, r.device, f"{r.wall_us:.1f}", f"{e['vs_1dev_L/N']:.2f}x",
                    f"{e['vs_1dev_L']:.2f}x", f"{e['merge_share']:.0%}",
                    "-" if r.max_err is None else f"{r.max_err:.1e}"))
    return table(("backend", "case", "ranks", "wall us", "vs 1 device L/N", "vs 1 device L",
                  "merge share", "max err"), out)


def roofline_png(rows: Sequence[Row], path: str) -> str | None:
    """Effective GB/s against arithmetic intensity (FLOP/byte) per device, with the measured
    copy bandwidth as the roof. Needs matplotlib (pip install attnreg[bench]); returns the
    reason when it cannot draw."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'attnreg[bench]')"
    fig, ax = plt.subplots(figsize=(8, 5))
    table = {c.name: c.spec for cases in (*SUITES.values(), *QUICK.values()) for c in cases}
    devices = sorted({(r.backend, r.device) for r in rows if r.suite != "roof"})
    for backend, dev in devices:
        pts = [r for r in rows if (r.backend, r.device) == (backend, dev) and r.gb_s
               and r.case in table]
        if not pts:
            continue
        xs = [traffic(table[r.case])[1] / traffic(table[r.case])[0] for r in pts]
        line = ax.scatter(xs, [float(r.gb_s or 0) for r in pts], label=f"{backend}/{dev}")
        for x, r in zip(xs, pts):
            ax.annotate(r.case, (x, r.gb_s), fontsize=6, alpha=0.7)
        roof = next((r.gb_s for r in rows if r.suite == "roof" and (r.backend, r.device)
                     == (backend, dev)), None)
        if roof:
            ax.axhline(roof, linestyle="--", color=line.get_facecolor()[0],
                       label=f"{backend}/{dev} copy roof {roof:.0f} GB/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte moved)")
    ax.set_ylabel("effective bandwidth (GB/s)")
    ax.set_title("attnreg bench: effective bandwidth vs arithmetic intensity")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _versus(peer: Row, mine: Sequence[Row]) -> str:
    """The peer's time against attnreg's best of ``mine``, like with like: kernel time
    against kernel time (and back to back against back to back where both have it), or,
    for a peer without a kernel time, wall clock against wall clock."""
    flag = "" if peer.extra.get("correct", True) else " (peer WRONG)"
    if peer.gpu_us is None:
        best = min(mine, key=lambda r: r.wall_us)
        return f"{peer.wall_us:.1f} us wall = {peer.wall_us / best.wall_us:.2f}x our wall{flag}"
    timed = [r for r in mine if r.gpu_us is not None]
    if not timed:
        return f"{peer.gpu_us:.1f} us (no GPU time of ours to compare){flag}"
    best = min(timed, key=lambda r: r.gpu_us or 0.0)
    text = f"{peer.gpu_us:.1f} us = {peer.gpu_us / (best.gpu_us or 1.0):.2f}x"
    b2b = [r for r in mine if r.b2b_us]
    if peer.b2b_us and b2b:
        text += f", {peer.b2b_us / min(r.b2b_us or 0.0 for r in b2b):.2f}x b2b"
    return text + flag


def ratios(rows: Sequence[Row]) -> str:
    """Per case: attnreg's best row against each peer (x = peer time / ours), like with like
    (see _versus)."""
    from .textui import table

    peers = ("ort-webgpu", "torch", "reference")
    out = []
    own = ("roof", "decode-loop", "context-parallel")
    for case in dict.fromkeys(r.case for r in rows if r.suite not in own):
        mine = [r for r in rows if r.case == case and r.backend not in peers
                and not r.kernels.startswith(("FAILED", "n/a"))]
        if not mine:
            continue
        best = min(mine, key=_basis)
        hosts: dict[str, str] = {}
        for r in sorted(mine, key=_basis):
            hosts.setdefault(r.backend, f"{r.backend} {_basis(r):.1f}"
                             + (f" (b2b {r.b2b_us:.1f})" if r.b2b_us else ""))
        cells = [case, f"{best.backend}/{best.device} {_basis(best):.1f} us",
                 ", ".join(hosts.values())]
        webgpu = [r for r in mine if r.backend == "webgpu"]
        for peer in peers:
            pr = next((r for r in rows if r.case == case and r.backend == peer), None)
            cells.append("-" if pr is None else
                         _versus(pr, webgpu if peer == "ort-webgpu" and webgpu else mine))
        out.append(cells)
    return table(("case", "attnreg best", "each backend (us)", "ORT WebGPU (vs our webgpu)",
                  "torch SDPA", "numpy reference"), out)


def limits(rows: Sequence[Row]) -> str:
    """What each device's limits are (the "of limit" column's short names spelled out) and
    how each peer's times were taken."""
    lines = []
    for backend, dev in dict.fromkeys((r.backend, r.device) for r in rows):
        mine = [r for r in rows if (r.backend, r.device) == (backend, dev)]
        used = sorted({r.limit_of for r in mine if r.limit_of})
        timing = next((str(r.extra["timing"]) for r in mine if r.extra.get("timing")), "")
        if used or timing:
            lines.append(f"  {backend}/{dev}: " + "; ".join(used)
                         + (f"  [times: {timing}]" if timing else ""))
    return "\n".join(lines)


def candidates(rows: Sequence[Row]) -> str:
    """Every torch SDPA candidate the peer tried per case (each backend, both GQA
    strategies): its time per call, or why it was not timed."""
    lines = []
    for r in rows:
        tried = r.extra.get("tried") if r.backend == "torch" else None
        if tried:
            lines.append(f"  {r.case}: " + ", ".join(f"{k} {v}" for k, v in tried.items()))
    return "\n".join(lines)


def _limit_cell(r: Row) -> str:
    if r.limit is None:
        return "-"
    return f"{r.limit:.2f} {r.limit_of.split(':')[0].split(' ')[0]}"


def format_rows(rows: Sequence[Row]) -> str:
    from .textui import table

    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None or x != x else format(x, fmt)

    # Ratios side by side: every row's wall clock against the numpy reference's.
    ref = {r.case: r.wall_us for r in rows if r.backend == "reference"}
    out = []
    for r in rows:
        if r.suite == "roof":
            what = "device-to-device copy" if r.case == "copy-bandwidth" else r.kernels
            out.append((r.case, r.backend, r.device, what, "-", "-", "-", f(r.gb_s, ".1f"),
                        f(r.tflops, ".1f"), "-", "-", "-"))
            continue
        if r.suite == "decode-loop":
            e = r.extra
            parts = ", ".join(f"{k[:-3]} {v:.1f} us" for k, v in e.items()
                              if k.endswith("_us") and k != "step_waited_us")
            moved = f", {e['transfers_per_step']:.1f} host transfers/step" \
                if "transfers_per_step" in e else ""
            out.append((r.case, r.backend, r.device, f"{parts}; {e.get('plans')} plan(s){moved}",
                        "-", "-", f(r.wall_us, ".1f"), "-", "-", "-", "-", "-"))
            continue
        vs = f"{ref[r.case] / r.wall_us:.1f}x" if r.case in ref and r.backend != "reference" else "-"
        out.append((r.case, r.backend, r.device, r.kernels, f(r.gpu_us, ".1f"), f(r.b2b_us, ".1f"),
                    f(r.wall_us, ".1f"), f(r.gb_s, ".1f"), f(r.tflops, ".3f"), _limit_cell(r), vs,
                    f(r.max_err, ".1e")))
    return table(("case", "backend", "device", "kernels", "gpu us", "b2b us", "wall us", "GB/s",
                  "TFLOP/s", "of limit", "vs numpy wall", "max err"), out)


def read_json(path: str) -> list[Row]:
    with open(path) as fh:
        return [Row(**r) for r in json.load(fh)]


def write_json(rows: Sequence[Row], path: str) -> None:
    with open(path, "w") as fh:
        json.dump([asdict(r) for r in rows], fh, indent=2)
