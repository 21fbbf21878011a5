"""`attnreg devices | explain | demo | bench | conformance | flags | tune | profiles | kernels`,
and the commands plugins register (export-wgsl, from the browser backend)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .. import api, registry
from ..errors import NoKernelError, SpecError
from ..hookspecs import Command
from ..session import Session
from ..spec import AttentionSpec
from . import demo
from .textui import table


def add_spec_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("spec (or --spec FILE.json)")
    g.add_argument("--spec", metavar="FILE", help="JSON object of AttentionSpec fields")
    g.add_argument("--batch", type=int)
    g.add_argument("--seq-len", type=int)
    g.add_argument("--past-len", type=int)
    g.add_argument("--heads", metavar="NQ[/NKV]", help="query heads, optionally /kv heads")
    g.add_argument("--head-size", type=int)
    g.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    g.add_argument("--kv-dtype", choices=["int8", "int4"], help="quantized K/V storage")
    g.add_argument("--q-layout", choices=["BSNH", "BNSH"])
    g.add_argument("--kv-layout", choices=["BSNH", "BNSH"])
    g.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--scale", type=float)
    g.add_argument("--softcap", type=float)
    g.add_argument("--local-window", type=int)
    g.add_argument("--right-window", type=int, help="keys after the query's position it "
                   "may see (-1: all; non-causal two-sided windows)")
    g.add_argument("--alibi-max-bias", type=float)
    g.add_argument("--kv-capacity", type=int)
    for name in ("bias", "seqlens-k", "head-sink", "return-lse"):
        g.add_argument(f"--{name}", action="store_true", default=None)


def add_plan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", help="webgpu | opencl | reference | a plugin's name")
    p.add_argument("--device", help="device id or part of its name")
    p.add_argument("--kernel", help="force a kernel id")
    p.add_argument("--flag", action="append", default=[], metavar="NAME=VALUE",
                   help="session flag (repeatable); see `attnreg flags`")


def spec_from_args(a: argparse.Namespace) -> AttentionSpec:
    fields: dict[str, Any] = {}
    if a.spec:
        try:
            with open(a.spec) as fh:
                fields = json.load(fh)
        except (OSError, json.JSONDecodeError) as exc:
            raise SpecError("--spec", a.spec, f"a readable JSON file ({exc})") from None
        if not isinstance(fields, dict):
            raise SpecError("--spec", a.spec, "a JSON object of AttentionSpec fields")
    if a.heads:
        nq, _, nkv = a.heads.partition("/")
        try:
            fields["num_heads"] = int(nq)
            fields["kv_num_heads"] = int(nkv) if nkv else int(nq)
        except ValueError:
            raise SpecError("--heads", a.heads, "NQ or NQ/NKV, e.g. 32/8") from None
    for opt in ("batch", "seq_len", "past_len", "head_size", "dtype", "kv_dtype", "q_layout",
                "kv_layout",
                "causal", "scale", "softcap", "local_window", "right_window", "alibi_max_bias",
                "kv_capacity", "bias", "seqlens_k", "head_sink", "return_lse"):
        v = getattr(a, opt, None)
        if v is not None:
            fields[opt] = v
    return AttentionSpec(**fields)


def flags_from_args(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq:
            raise SpecError("--flag", item, "NAME=VALUE")
        out[name.strip()] = value.strip()
    return out


# -- commands ----------------------------------------------------------------------------
def cmd_devices(a: argparse.Namespace) -> int:
    devs = api.devices(a.backend, refresh=True)
    rows: list[tuple[str, ...]] = []
    for d in devs:
        if d.available:
            feats = ",".join(sorted(f for f in d.features if f in (
                "subgroups", "shader-f16", "timestamp-query", "cl_khr_fp16", "cl_khr_subgroups",
                "subgroup-matrix", "ptx-mma-m16n8k16-f16")))
            wg = d.limit("workgroup_storage")
            rows.append((d.backend, d.id, d.name, d.vendor, d.device_type, d.backend_type,
                         feats or "-", f"{wg // 1024} KiB" if wg else "-", "yes"))
        else:
            rows.append((d.backend, d.id, d.name, "-", "-", "-", "-", "-", f"no: {d.reason}"))
    print(table(("backend", "id", "device", "vendor", "type", "api", "features", "wg mem",
                 "available"), rows))
    for d in devs:
        if d.available and d.settings:
            print(f"\n{d.id} set-up:")
            print("\n".join(f"  - {line}" for line in d.settings))
    if a.json:
        print(json.dumps([d.model_dump(mode="json") for d in devs], indent=2))
    return 0


def cmd_explain(a: argparse.Namespace) -> int:
    spec = spec_from_args(a)
    caps = None
    if a.profile:
        from ..profiles import profile
        caps = profile(a.profile)
    try:
        plan = api.explain(spec, backend=a.backend, caps=caps, flags=flags_from_args(a.flag),
                           op=a.op, device=a.device, kernel=a.kernel)
    except NoKernelError as exc:
        print(exc.explanation)
        return 2
    print(plan.explain())
    return 0


def cmd_flags(a: argparse.Namespace) -> int:
    from ..flags import table as flag_table
    rows = [(f.name, f.type.__name__, repr(f.default), f.vendor or "-", f.doc)
            for f in flag_table().values()]
    print(table(("flag", "type", "default", "vendor", "doc"), rows))
    return 0


def cmd_tune(a: argparse.Namespace) -> int:
    from ..tuned import cache_path
    from .tune import tune
    spec = spec_from_args(a)
    with Session(backend=a.backend, device=a.device) as s:
        entry = tune(s, spec, iters=a.iters, log=lambda m: print(m, file=sys.stderr))
    print(f"best for {entry['kernel']}: {entry['params']} at {entry['us']} us "
          f"(rule default {entry['rule_default_us']} us); stored in {cache_path()}")
    print("use it with --flag use_tuning_cache=1 (or ATTNREG_FLAGS=use_tuning_cache=1)")
    return 0


def cmd_profiles(a: argparse.Namespace) -> int:
    from ..profiles import profiles
    rows = [(name, c.backend, c.name, c.vendor, c.architecture or "-", c.device_type,
             f"{c.subgroup_min_size}-{c.subgroup_max_size}" if c.subgroup_max_size else "-",
             f"{(c.limit('workgroup_storage') or 0) // 1024} KiB")
            for name, c in profiles().items()]
    print(table(("profile", "backend", "device", "vendor", "arch", "type", "subgroup",
                 "wg mem"), rows))
    return 0


def cmd_kernels(a: argparse.Namespace) -> int:
    rows = []
    for k in sorted(api.kernels(a.backend), key=lambda k: k.id):
        lo, hi, step = k.head_sizes
        heads = f"{lo}..{hi}/{step}"
        if k.v_head_sizes not in (None, k.head_sizes):
            vlo, vhi, vstep = k.v_head_sizes
            heads += f" v {vlo}..{vhi}/{vstep}"
        rows.append((k.id, k.family, ",".join(sorted(k.dtypes)), heads,
                     ",".join(sorted(k.features)) or "-", k.vendor or "-", k.flag or "-"))
    print(table(("kernel", "family", "dtypes", "head sizes", "needs", "vendor", "opt-in"), rows))
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from . import bench, bench_report
    suites = a.suite or ["decode", "whisper", "prefill"]
    if a.from_json:
        rows = bench_report.read_json(a.from_json)
    else:
        rows = bench.run_suites(suites, backend=a.backend, device=a.device, quick=a.quick,
                                iters=a.iters, warmup=a.warmup, peers=a.peers,
                                gpu_only=a.gpu_only, flags=flags_from_args(a.flag),
                                cp_length=a.cp_length, cp_ranks=a.cp_ranks,
                                log=lambda m: print(m, file=sys.stderr))
    print(bench_report.format_rows(rows))
    print()
    print("of limit: the case's limit time / its kernel time (gpu us), the limit being the larger "
          "of bytes / copy roof and FLOPs / peak:")
    print(bench_report.limits(rows))
    tried = bench_report.candidates(rows)
    if tried:
        print("torch SDPA candidates (every backend, both GQA strategies; time per call):")
        print(tried)
    print()
    print("ratios (peer time / attnreg time; > 1 means attnreg is faster; kernel time against "
          "kernel time, b2b against b2b, wall against wall):")
    print(bench_report.ratios(rows))
    if any(r.suite == "kv-dtypes" for r in rows):
        print()
        print("storages (float16 twin's time / this case's; > 1 means faster than float16):")
        print(bench_report.storage_ratios(rows))
    if any(r.suite == "context-parallel" for r in rows):
        print()
        print("context parallel (sharded call's time / one device's; merge share: exchange + "
              "reduce over the call):")
        print(bench_report.context_parallel(rows))
    if a.json:
        bench_report.write_json(rows, a.json)
    if a.png:
        why = bench_report.roofline_png(rows, a.png)
        print(f"roofline: {why}" if why else f"roofline written to {a.png}")
    return 1 if any(r.kernels.startswith("FAILED") for r in rows) else 0


def cmd_conformance(a: argparse.Namespace) -> int:
    from . import conformance as conf
    from .textui import progress
    devs = api.devices(a.backend)
    if a.gpu_only:
        devs = [d for d in devs if d.device_type == "gpu"]
    cells = conf.cases(devs, quick=a.quick)
    if a.kernel:
        cells = [c for c in cells if a.kernel in c.kernel]
    if a.dtype:
        cells = [c for c in cells if c.spec.dtype == a.dtype]
    if a.kv_dtype:
        cells = [c for c in cells if c.spec.kv_dtype == a.kv_dtype]
    results = conf.run_matrix(cells, progress=lambda cs: progress(cs, "conformance"))
    problems = []
    for r in results:
        if r.status == "fail":
            problems.append(f"FAIL {r.case.id}: {r.message}")
    if a.required:
        req = conf.load_required(a.required)
        problems += [f"MISSING required device {m}" for m in conf.missing_required(req, devs)]
        if not (a.kernel or a.dtype or a.kv_dtype):      # a filtered run covers a part
            allowed = req.get("uncoverable", {})
            for kid, why in conf.uncovered(cells, devs).items():
                if kid not in allowed:
                    problems.append(f"UNCOVERED {kid}: no cell on any CI device ({why})")
    md = conf.markdown(results)
    print(md)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump([r.as_dict() for r in results], fh, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as fh:
            fh.write(md + "\n")
    for p in problems:
        print(p)
    secs = sum(r.seconds for r in results)
    print(f"{len(results)} cells, {sum(r.status == 'pass' for r in results)} pass, "
          f"{len(problems)} problems, {secs:.1f} s in kernels")
    return 1 if problems else 0


def _plugin_command(cmd: Command) -> Callable[[argparse.Namespace], int]:
    def run(a: argparse.Namespace) -> int:
        return cmd.run(a, spec_from_args(a) if cmd.takes_spec else None)
    return run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnreg", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("devices", help="list probed devices of every backend")
    d.add_argument("--backend")
    d.add_argument("--json", action="store_true", help="also print the full caps as JSON")
    d.set_defaults(fn=cmd_devices)
    e = sub.add_parser("explain", help="print the plan for a spec and every rejection reason")
    add_spec_options(e)
    add_plan_options(e)
    e.add_argument("--op", default="attention", choices=["attention", "partial", "reduce"])
    e.add_argument("--profile", help="plan for a stored device profile instead of probing")
    e.set_defaults(fn=cmd_explain)
    m = sub.add_parser("demo", help="run a prefill and a decode on every available device")
    m.add_argument("--backend")
    m.set_defaults(fn=demo.cmd_demo)
    b = sub.add_parser("bench", help="time named suites on every device, side by side")
    b.add_argument("--suite", action="append", choices=["decode", "long-context", "whisper",
                                                        "prefill", "decode-loop", "kv-dtypes",
                                                        "context-parallel"])
    b.add_argument("--cp-length", type=int, metavar="L", help="context-parallel: keys of the "
                   "decode (default 131072, 4096 with --quick)")
    b.add_argument("--cp-ranks", type=int, default=2, metavar="N",
                   help="context-parallel: ranks the keys are split over (default 2)")
    b.add_argument("--gpu-only", action="store_true",
                   help="only GPU devices (plus the numpy reference as the baseline)")
    b.add_argument("--backend", help="one backend, or several comma-separated (webgpu,opencl)")
    b.add_argument("--device")
    b.add_argument("--quick", action="store_true", help="small sizes (CI smoke)")
    b.add_argument("--iters", type=int, default=50)
    b.add_argument("--warmup", type=int, default=5)
    b.add_argument("--json", metavar="PATH")
    b.add_argument("--png", metavar="PATH", help="roofline plot (needs matplotlib)")
    b.add_argument("--from-json", metavar="PATH", help="re-print and plot a saved run "
                   "instead of measuring")
    b.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                   help="also time ONNX Runtime WebGPU and torch SDPA when installed")
    b.add_argument("--flag", action="append", default=[], metavar="NAME=VALUE",
                   help="session flag for every device (repeatable), e.g. "
                        "experimental_features=true and matrix_units=on for Dawn's matrix kernels")
    b.set_defaults(fn=cmd_bench)
    c = sub.add_parser("conformance", help="run the registry-generated conformance matrix")
    c.add_argument("--backend")
    c.add_argument("--quick", action="store_true", help="fewer cells per kernel")
    c.add_argument("--gpu-only", action="store_true", help="only GPU devices")
    c.add_argument("--kernel", help="only kernels whose id contains this text")
    c.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="only cells computing in this dtype")
    c.add_argument("--kv-dtype", choices=["int8", "int4"],
                   help="only cells whose K/V are stored quantized so")
    c.add_argument("--json", metavar="PATH", help="write every cell as JSON")
    c.add_argument("--markdown", metavar="PATH", help="write the kernels x devices table")
    c.add_argument("--required", metavar="FILE", help="fail if a device or kernel named as "
                   "required there is not covered (CI: ci/required_matrix.json)")
    c.set_defaults(fn=cmd_conformance)
    f = sub.add_parser("flags", help="list the declared session flags")
    f.set_defaults(fn=cmd_flags)
    t = sub.add_parser("tune", help="measure tunable parameters for a spec on a device and "
                       "store the fastest in the tuning cache")
    add_spec_options(t)
    t.add_argument("--backend")
    t.add_argument("--device")
    t.add_argument("--iters", type=int, default=20)
    t.set_defaults(fn=cmd_tune)
    pr = sub.add_parser("profiles", help="list stored device profiles (for explain --profile)")
    pr.set_defaults(fn=cmd_profiles)
    k = sub.add_parser("kernels", help="list registered kernel variants")
    k.add_argument("--backend")
    k.set_defaults(fn=cmd_kernels)
    for cmd in sorted(registry.get().commands().values(), key=lambda c: c.name):
        x = sub.add_parser(cmd.name, help=cmd.help)
        if cmd.takes_spec:
            add_spec_options(x)
        cmd.configure(x)
        x.set_defaults(fn=_plugin_command(cmd))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except SpecError as exc:
        print(f"attnreg: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
