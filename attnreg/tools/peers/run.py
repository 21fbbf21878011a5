"""Running the peers alone (`python -m attnreg.tools.peers`) and as rows for `attnreg bench`."""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from ...spec import AttentionSpec
from . import vulkan
from .models import ort_webgpu_supports
from .ort import OrtWebGPUAttention
from .status import ort_webgpu_status, statuses, torch_status
from .torch_sdpa import TorchSDPA, torch_supports


def median_us(xs: list[float]) -> float:
    """Median of a list of seconds, in microseconds (nan for an empty list)."""
    return statistics.median(xs) * 1e6 if xs else float("nan")


# --------------------------------------------------------------------------------------
# `python -m attnreg.tools.peers`: the peers alone, on this machine's default device
# --------------------------------------------------------------------------------------
def _cases(which: str) -> list[tuple[str, AttentionSpec]]:
    def gqa(L: int, dtype: str = "float16", S: int = 1, n: int = 32, nkv: int = 8,
            h: int = 128) -> AttentionSpec:
        return AttentionSpec(batch=1, seq_len=S, past_len=L - S, num_heads=n, kv_num_heads=nkv,
                             head_size=h, dtype=dtype, causal=True)

    def whisper(T: int) -> AttentionSpec:
        return AttentionSpec(batch=1, seq_len=4, past_len=T - 4, num_heads=8, kv_num_heads=8,
                             head_size=64, dtype="float16", causal=False)

    full = [("decode-f16-L2048", gqa(2048)), ("decode-f16-L8192", gqa(8192)),
            ("decode-f16-L32768", gqa(32768)), ("decode-f32-L8192", gqa(8192, "float32")),
            ("whisper-S4-T1500", whisper(1500)), ("prefill-f16-S512", gqa(512, S=512)),
            ("prefill-f16-S2048", gqa(2048, S=2048))]
    small = [("decode-f16-L512", gqa(512)), ("decode-f16-L2048", gqa(2048)),
             ("decode-f32-L512", gqa(512, "float32")), ("whisper-S4-T300", whisper(300)),
             ("whisper-S4-T1500", whisper(1500)), ("prefill-f16-S64", gqa(64, S=64, n=8, nkv=2, h=64))]
    # Feature probes: small, to tell a peer's defect on this device from one of a driver.
    b2_seqlens = AttentionSpec(batch=2, seq_len=1, past_len=100, num_heads=4, kv_num_heads=2,
                               head_size=64, dtype="float32", seqlens_k=True, kv_capacity=160)
    probes = [
        ("probe-decode-b2-seqlens", b2_seqlens),
        ("probe-decode-b2-seqlens-nan", b2_seqlens),      # NaN past each length (the contract's poison)
        ("probe-decode-softcap", AttentionSpec(batch=1, seq_len=1, past_len=127, num_heads=4,
                                               kv_num_heads=2, head_size=64, dtype="float32",
                                               softcap=5.0)),
        ("probe-decode-window", AttentionSpec(batch=1, seq_len=1, past_len=127, num_heads=4,
                                              kv_num_heads=2, head_size=64, dtype="float32",
                                              local_window=32)),
        ("probe-S4-past", gqa(128, "float32", S=4, n=4, nkv=2, h=64)),
        ("probe-prefill-S16", gqa(16, S=16, n=4, nkv=2, h=64)),
    ]
    return {"full": full + probes, "small": small + probes, "probes": probes}[which]


def bench_peers(cases: list[tuple[str, AttentionSpec]], *, iters: int = 100, warmup: int = 10,
                torch_device: str | None = None, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Time both peers on each case and check them against the float64 reference."""
    from attnreg.testing import compare, expected, make_tensors

    rows: list[dict[str, Any]] = []
    for name, spec in cases:
        # Only "-nan" cases put NaN in the keys past each valid length (the contract's
        # poison); elsewhere that memory holds finite values, as in a real cache.
        tensors = make_tensors(spec, seed=0, poison=name.endswith("-nan"))
        want = None
        row: dict[str, Any] = {"case": name, "spec": spec.short()}
        ort_why = ort_webgpu_status() or ort_webgpu_supports(spec)
        torch_why = torch_status() or torch_supports(spec)
        peers_: list[tuple[str, Callable[[], Any], str | None]] = [
            ("ort", functools.partial(OrtWebGPUAttention, spec), ort_why),
            ("torch", functools.partial(TorchSDPA, spec, torch_device), torch_why),
        ]
        if spec.group_size > 1 and not name.startswith("probe"):
            peers_.append(("torch_repeat", functools.partial(TorchSDPA, spec, torch_device, gqa="repeat"),
                           torch_why))
        for key, make, why in peers_:
            if why:
                row[key] = {"skipped": why}
                continue
            t0 = time.perf_counter()
            try:
                peer = make()
                if want is None:
                    want = expected(spec, tensors)
                # the torch peer checks each SDPA backend against the same reference
                out = peer.run(tensors, want) if isinstance(peer, TorchSDPA) else peer.run(tensors)
                err, problem = compare(spec, out, want)
                res: dict[str, Any] = {"max_err": err, "correct": not problem, "problem": problem}
                if not name.startswith("probe"):
                    tm = peer.timings(iters, warmup)
                    res.update({f"{k[:-2]}_us": median_us(v) for k, v in tm.items()})
                    res["iters"] = iters
                res["describe"] = peer.describe()
                if "label" in res["describe"]:      # which kernel the peer kept, e.g. torch-sdpa[cudnn]
                    res["label"] = res["describe"]["label"]
                peer.close()
            except Exception as exc:
                res = {"error": f"{type(exc).__name__}: {exc}"}
            res["setup_s"] = round(time.perf_counter() - t0, 3)
            row[key] = res
            log(f"{name:24s} {key:12s} " + ", ".join(
                f"{k}={v:.1f}" if isinstance(v, float) and k.endswith("_us") else f"{k}={v}"
                for k, v in res.items() if k not in ("describe", "max_err", "setup_s"))
                + (f", max_err={res['max_err']:.2e}" if "max_err" in res else ""))
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    def us(d: Any, k: str) -> str:
        v = d.get(k) if isinstance(d, dict) else None
        return f"{v:.1f}" if isinstance(v, float) and v == v else "-"

    def ok(d: Any) -> str:
        if not isinstance(d, dict) or "skipped" in d:
            return "n/a"
        if "error" in d:
            return "error"
        return "ok" if d.get("correct") else f"WRONG ({d.get('max_err', float('nan')):.1e})"

    head = ("case", "ORT GPU us", "ORT wall us", "ORT submit us", "ORT loop us", "ORT vs ref",
            "torch GPU us", "torch wall us", "torch vs ref", "torch kernel", "torch(repeat) GPU us")
    lines = [head]
    for r in rows:
        o, t, tr = r.get("ort", {}), r.get("torch", {}), r.get("torch_repeat", {})
        lines.append((r["case"], us(o, "gpu_us"), us(o, "wall_us"), us(o, "submit_us"),
                      us(o, "loop_us"), ok(o), us(t, "gpu_us"), us(t, "wall_us"), ok(t),
                      t.get("label", "-"), us(tr, "gpu_us")))
    widths = [max(len(str(x[i])) for x in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)) for line in lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import platform

    ap = argparse.ArgumentParser(prog="python -m attnreg.tools.peers",
                                 description="Time the bench peers (ORT WebGPU, torch SDPA) alone.")
    ap.add_argument("--cases", choices=("full", "small", "probes"), default="small")
    ap.add_argument("--only", default="", help="comma-separated case names to keep")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--torch-device", default=None)
    ap.add_argument("--json", default="", help="write the rows here")
    a = ap.parse_args(argv)
    cases = _cases(a.cases)
    if a.only:
        keep = set(a.only.split(","))
        cases = [c for c in cases if c[0] in keep]
    print("peers:", statuses(), "| VK_ICD_FILENAMES:", os.environ.get("VK_ICD_FILENAMES"),
          "| shim:", vulkan.shim_in_use, flush=True)
    rows = bench_peers(cases, iters=a.iters, warmup=a.warmup, torch_device=a.torch_device,
                       log=lambda s: print(s, flush=True))
    print(format_table(rows))
    if a.json:
        meta = {"host": platform.node(), "python": platform.python_version(),
                "vk_icd": os.environ.get("VK_ICD_FILENAMES"), "shim": vulkan.shim_in_use,
                "statuses": statuses(), "iters": a.iters, "warmup": a.warmup}
        with open(a.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=2, default=str)
    return 0




