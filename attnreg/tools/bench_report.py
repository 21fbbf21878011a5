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


def storage_ratios(rows: Sequence[Row]) -> str:
    """Per backend and device: each bf16 / int8 / int4 case's speed-up over its float16 twin
    (x = twin's time / the case's; GPU time where measured)."""
    from .textui import table

    def basis(r: Row) -> float:
        return r.gpu_us if r.gpu_us is not None else r.wall_us

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


def ratios(rows: Sequence[Row]) -> str:
    """Per case: attnreg's best GPU-time row against each peer (x = peer time / ours)."""
    from .textui import table

    def basis(r: Row) -> float:
        return r.gpu_us if r.gpu_us is not None else r.wall_us

    peers = ("ort-webgpu", "torch", "reference")
    out = []
    for case in dict.fromkeys(r.case for r in rows if r.suite not in ("roof", "decode-loop")):
        mine = [r for r in rows if r.case == case and r.backend not in peers
                and not r.kernels.startswith(("FAILED", "n/a"))]
        if not mine:
            continue
        best = min(mine, key=basis)
        webgpu = [r for r in mine if r.backend == "webgpu"]
        hosts: dict[str, str] = {}
        for r in sorted(mine, key=basis):
            hosts.setdefault(r.backend, f"{r.backend} {basis(r):.1f}")
        cells = [case, f"{best.backend}/{best.device} {basis(best):.1f} us",
                 ", ".join(hosts.values())]
        for peer in peers:
            pr = next((r for r in rows if r.case == case and r.backend == peer), None)
            mine_r = min(webgpu, key=basis) if peer == "ort-webgpu" and webgpu else best
            if pr is None:
                cells.append("-")
                continue
            flag = "" if pr.extra.get("correct", True) else " (peer WRONG)"
            cells.append(f"{basis(pr):.1f} us = {basis(pr) / basis(mine_r):.2f}x{flag}")
        out.append(cells)
    return table(("case", "attnreg best", "each backend (us)", "ORT WebGPU (vs our webgpu)",
                  "torch SDPA",
                  "numpy reference"), out)


def format_rows(rows: Sequence[Row]) -> str:
    from .textui import table

    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None or x != x else format(x, fmt)

    # Ratios side by side: every row against the numpy reference of the same case.
    ref = {r.case: r.wall_us for r in rows if r.backend == "reference"}
    out = []
    for r in rows:
        if r.suite == "roof":
            out.append((r.case, r.backend, r.device, "device-to-device copy", "-", "-",
                        f(r.gb_s, ".1f"), "-", "-", "-"))
            continue
        if r.suite == "decode-loop":
            e = r.extra
            parts = ", ".join(f"{k[:-3]} {v:.1f} us" for k, v in e.items()
                              if k.endswith("_us") and k != "step_waited_us")
            moved = f", {e['transfers_per_step']:.1f} host transfers/step" \
                if "transfers_per_step" in e else ""
            out.append((r.case, r.backend, r.device, f"{parts}; {e.get('plans')} plan(s){moved}",
                        "-", f(r.wall_us, ".1f"), "-", "-", "-", "-"))
            continue
        basis = r.gpu_us if r.gpu_us is not None else r.wall_us
        vs = f"{ref[r.case] / basis:.1f}x" if r.case in ref and r.backend != "reference" else "-"
        out.append((r.case, r.backend, r.device, r.kernels, f(r.gpu_us, ".1f"), f(r.wall_us, ".1f"),
                    f(r.gb_s, ".1f"), f(r.tflops, ".3f"), vs, f(r.max_err, ".1e")))
    return table(("case", "backend", "device", "kernels", "gpu us", "wall us", "GB/s", "TFLOP/s",
                  "vs numpy", "max err"), out)


def read_json(path: str) -> list[Row]:
    with open(path) as fh:
        return [Row(**r) for r in json.load(fh)]


def write_json(rows: Sequence[Row], path: str) -> None:
    with open(path, "w") as fh:
        json.dump([asdict(r) for r in rows], fh, indent=2)
