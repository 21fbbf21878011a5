"""`attnreg export-wgsl`: a plan's specialised WGSL and a small ES module for web apps.

The directory gets ``attention.js`` (the stages' WGSL, binding layouts, grids and the
parameter block for this spec as constants, plus a small runtime: requestDevice(),
createAttention() -> {run, dispatch, setBiasShape, destroy}), one ``.wgsl`` file per stage,
``plan.txt`` (the registry's explanation) and ``README.md`` (how to use it from a web app).
:func:`check` runs the exported module in headless Chromium against the float64 reference.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np

from attnreg import ports, registry
from attnreg.backends import common
from attnreg.backends.webgpu import mma as wmma
from attnreg.backends.webgpu import program
from attnreg.caps import DeviceCaps
from attnreg.errors import NoKernelError, SpecError
from attnreg.kernel import binding_bytes
from attnreg.plan import Plan
from attnreg.spec import AttentionSpec
from attnreg.testing import compare, expected, make_tensors

from . import kernels
from .host import BrowserError, BrowserHost
from .probe import NAME

CAPS_CHOICES = ("browser-profile", "browser-subgroup-matrix", "browser", "webgpu")
# What every WebGPU implementation grants without asking (the spec's default limits): a
# plan for these caps runs in any browser with WebGPU (and shader-f16 for a float16 spec).
PROFILE = DeviceCaps(
    backend=NAME, id=f"{NAME}:profile", name="any WebGPU browser (default limits, no subgroups)",
    device_type="gpu", backend_type="WebGPU", features=frozenset({"shader-f16"}),
    limits={"workgroup_storage": 16384, "invocations": 256, "workgroup_size_x": 256,
            "storage_binding": 134217728, "buffer_size": 268435456, "workgroups_per_dim": 65535})


# A browser that exposes Dawn's subgroup matrices with the shape the matrix prefill uses
# (f16 16x16x16 -> f32 on 32-lane subgroups, as NVIDIA's Vulkan driver gives them) and
# 32 KiB of workgroup storage (most adapters; the module requests it). Exports for it plan
# with matrix_units=on.
SUBGROUP_MATRIX_PROFILE = PROFILE.model_copy(update={
    "id": f"{NAME}:subgroup-matrix", "name": "a WebGPU browser exposing subgroup matrices",
    "features": frozenset({"shader-f16", "subgroups", "subgroup-matrix"}),
    "subgroup_min_size": 32, "subgroup_max_size": 32,
    "limits": {**PROFILE.limits, "workgroup_storage": 32768},
    "extra": {"subgroup_matrix_configs": [
        {"component_type": "f16", "result_component_type": "f32", "m": 16, "n": 16, "k": 16,
         "min_subgroup_size": 32, "max_subgroup_size": 32}]}})
SUBGROUP_MATRIX_FEATURE = "chromium-experimental-subgroup-matrix"
SUBGROUP_MATRIX_NOTE = (
    "It uses Dawn's experimental subgroup matrices (feature `chromium-experimental-subgroup-"
    "matrix`, WGSL `enable chromium_experimental_subgroup_matrix;`). No browser exposes them "
    "by default today: Chromium lists the feature only with unsafe WebGPU APIs allowed (start "
    "it with `--enable-unsafe-webgpu`, or chrome://flags/#enable-unsafe-webgpu, which sets "
    "Dawn's `allow_unsafe_apis` toggle) and only on adapters whose driver has matrix units "
    "(Vulkan's cooperative matrices, Metal's simdgroup matrices) with the f16 16x16x16 -> f32 "
    "shape on 32-lane subgroups. `requestDevice()` names what is missing; export for "
    "`browser-profile` for a module that runs anywhere.")


def caps_for(name: str) -> DeviceCaps:
    """``browser-profile``, the probed ``browser`` or ``webgpu`` adapter, or a stored
    WebGPU profile (``attnreg profiles``)."""
    if name == "browser-profile":
        return PROFILE
    if name == "browser-subgroup-matrix":
        return SUBGROUP_MATRIX_PROFILE
    if name in ("browser", "webgpu"):
        devs = registry.get().devices(name)
        ok = [d for d in devs if d.available]
        if not ok:
            raise SpecError("--backend-caps", name, "a backend with an available device; "
                            + "; ".join(d.reason for d in devs))
        return ok[0]
    from attnreg.profiles import profiles
    table = {n: c for n, c in profiles().items() if c.backend == "webgpu"}
    if name not in table:
        raise SpecError("--backend-caps", name, f"one of {[*CAPS_CHOICES, *sorted(table)]}")
    return table[name]


@dataclass(frozen=True)
class Exported:
    out_dir: str
    files: tuple[str, ...]
    plan: Plan
    programs: tuple[program.Program, ...]


def _threads(consts: Mapping[str, int]) -> int:
    if "THREADS" in consts:
        return int(consts["THREADS"])
    return int(consts["Q_TILE"]) // int(consts["ROWS_PER_LANE"]) * int(consts["ROW_LANES"])


def requirements(plan: Plan, progs: list[program.Program]) -> dict[str, Any]:
    """Features, limits and the subgroup width the exported stages need."""
    spec, reg = plan.spec, registry.get()
    storage = threads = binding = grid = nbuf = 0
    sg, matrix = 1, False
    for st, prog in zip(program.launch_stages(plan), progs):
        k = reg.kernel(st.kernel)
        p = {**k.defaults, **st.params, **k.params}
        storage = max(storage, k.storage_need(spec, p))
        threads = max(threads, _threads(prog.consts))
        binding = max([binding, *binding_bytes(st.family, spec, p).values()])
        grid = max(grid, *prog.grid)
        nbuf = max(nbuf, sum(b.access != "uniform" for b in prog.bindings))
        if program.SUBGROUP_MATRIX_DIRECTIVE in prog.wgsl:
            sg, matrix = max(sg, wmma.MMA_SUBGROUP), True
        elif prog.uses_subgroups:
            sg = max(sg, int(prog.consts.get("SHUFFLE_LANES", 4)))
    feats = (["shader-f16"] if spec.dtype == "float16" else []) + (["subgroups"] if sg > 1 else [])
    feats += [SUBGROUP_MATRIX_FEATURE] if matrix else []
    return {"features": feats, "subgroup_min_size": sg, "limits": {
        "maxComputeWorkgroupStorageSize": storage, "maxComputeInvocationsPerWorkgroup": threads,
        "maxComputeWorkgroupSizeX": threads, "maxStorageBufferBindingSize": binding,
        "maxBufferSize": binding, "maxComputeWorkgroupsPerDimension": grid,
        "maxStorageBuffersPerShaderStage": nbuf}}


# The tensors an exported module takes and returns, in the order its SHAPES list them.
_TENSORS = ("q", "k", "v", "out", "lse", "bias", "seqlens_k", "head_sink", "kv_start",
            "seqlens_q")


def _shapes(spec: AttentionSpec, n_splits: int
            ) -> tuple[dict[str, list[int]], dict[str, int], dict[str, int]]:
    """Shapes of the tensors (attnreg/ports.py: k and v as stored, the bias at its full
    size), bytes per element of the inputs, and bytes of the buffers the module allocates."""
    names = _TENSORS + (("k_scale", "v_scale") if spec.kv_dtype else ())
    shapes = {n: list(ports.named(n).shape_for(spec, n_splits)) for n in names}
    elem = {n: ports.ITEMSIZE[ports.named(n).dtype(spec)] for n in names
            if n not in ("out", "lse")}
    nbytes = {n: ports.named(n).nbytes(spec, n_splits)
              for n in ("out", "lse", "o_parts", "lse_parts")}
    return shapes, elem, nbytes


def module_text(plan: Plan, progs: list[program.Program]) -> str:
    """attention.js: this plan's constants, then the shared runtime."""
    spec = plan.spec
    shapes, elem, nbytes = _shapes(spec, program.n_splits(plan))
    req = requirements(plan, progs)
    full_bias = tuple(shapes["bias"]) if spec.bias else None
    words = np.frombuffer(program.param_block(plan, full_bias), dtype=np.uint32)
    js = json.dumps
    plan_info = {"route": plan.route, "kernels": list(plan.kernels), "caps": plan.caps.label,
                 "rules": list(plan.rules)}
    lines = [
        "// attention.js, generated by `attnreg export-wgsl`; regenerate rather than edit.",
        f"// spec: {spec.short()}",
        f"// plan: {' -> '.join(plan.kernels)} (route {plan.route}) for {plan.caps.label}",
        "",
        f"export const SPEC = {js(spec.model_dump(mode='json'))};",
        f"export const PLAN = {js(plan_info)};",
        "/** Tensor shapes in the spec's layouts (bias: the full shape; any of its first three"
        " dims may be 1). */",
        f"export const SHAPES = {js(shapes)};",
        f"const BYTES_PER_ELEMENT = {js(elem)};",
        f"const BYTES = {js(nbytes)};",
        f"export const REQUIRED_FEATURES = {js(req['features'])};",
        f"export const REQUIRED_LIMITS = {js(req['limits'])};",
        f"export const SUBGROUP_MIN_SIZE = {req['subgroup_min_size']};",
        "/** The kernels' parameter block (backends/common.py FIELDS, each one 32-bit word:",
        " *  u32, i32 or the bits of an f32), packed for this spec; paramsFor() patches the bias",
        " *  strides for a broadcast bias. */",
        f"export const PARAM_FIELDS = {js([n for n, _ in common.FIELDS])};",
        f"const PARAM_WORDS = {js({n: i for i, (n, _) in enumerate(common.FIELDS)})};",
        f"export const PARAMS = new Uint32Array({js([int(w) for w in words])});",
    ]
    for i, p in enumerate(progs):
        lines.append(f"const WGSL_{i} = {js(p.wgsl)};")
    stage_rows = []
    for i, p in enumerate(progs):
        stage_rows.append(
            f"  {{kernel: {js(p.kernel)}, family: {js(p.family)}, wgsl: WGSL_{i}, "
            f"entryPoint: {js(p.entry)}, "
            f"bindings: {js([[b.index, b.access, b.name] for b in p.bindings])}, "
            f"grid: {js(list(p.grid))}, workgroups: {p.workgroups}}},")
    lines += ["/** The dispatches, in order; bindings are [binding, uniform|read|rw, buffer]. */",
              "export const STAGES = [", *stage_rows, "];", ""]
    runtime = resources.files(__package__ or "attnreg.backends.browser").joinpath("export_runtime.js")
    return "\n".join(lines) + "\n" + runtime.read_text(encoding="utf-8")


def readme_text(plan: Plan, progs: list[program.Program], files: list[str]) -> str:
    spec = plan.spec
    req = requirements(plan, progs)
    extra = [n for n, on in (("bias", spec.bias), ("seqlens_k", spec.seqlens_k),
                             ("head_sink", spec.head_sink), ("kv_start", spec.kv_start),
                             ("seqlens_q", spec.seqlens_q)) if on]
    if spec.kv_dtype:
        extra += ["k_scale", "v_scale"]
    args = ", ".join(["q", "k", "v", *extra])
    lse = ", lse" if spec.return_lse else ""
    bits = {"float16": " (f16 as Uint16Array bits)", "bfloat16": " (bf16 as Uint16Array bits)"
            }.get(spec.dtype, "")
    if spec.kv_dtype:
        bits += (f"; k, v {spec.kv_dtype} codes ({spec.kv_code_dtype}) with k_scale, "
                 f"v_scale ({spec.kv_scale_dtype})")
    wgsl_files = ", ".join(f"`{f}`" for f in files if f.endswith(".wgsl"))
    needs = "".join(f", feature `{f}`" for f in req["features"])
    note = f"\n{SUBGROUP_MATRIX_NOTE}\n" if SUBGROUP_MATRIX_FEATURE in req["features"] else ""
    return f"""# attnreg attention for `{spec.short()}`

Generated by `attnreg export-wgsl`. Plan: `{' -> '.join(plan.kernels)}` (route {plan.route})
for {plan.caps.label}; `plan.txt` lists every rule that fired and every kernel rejected.

The WGSL in `attention.js` (also in {wgsl_files}, for reading) is specialised for exactly
this spec: shapes, layouts, masks and tile sizes are compiled in. It needs WebGPU{needs},
and the limits in `REQUIRED_LIMITS`: `requestDevice()` asks for them and says what an
adapter lacks.
{note}
## Use from a web app

```js
import {{requestDevice, createAttention, SHAPES}} from './attention.js';

const adapter = await navigator.gpu.requestAdapter();
const device = await requestDevice(adapter);   // the features and limits these kernels need
const attention = await createAttention(device); // pipelines and buffers, created once

// Typed arrays in the spec's layouts (SHAPES): {spec.dtype} q, k, v{bits}
const {{out{lse}}} = await attention.run({{{args}}});
```

Tensors already on the GPU: record the stages into your own compute pass.

```js
const pass = encoder.beginComputePass();
attention.dispatch(pass, {{{args}, out{lse}}});   // GPUBuffers
pass.end();
```

Math: attnreg's docs/contract.md (the float64 reference is the judge): out and lse follow the
contract for this spec, a row with no visible key gives out = 0 and lse = -inf.
"""


def export(spec: AttentionSpec, out_dir: str, caps: str | DeviceCaps = "browser-profile",
           flags: Mapping[str, Any] | None = None) -> Exported:
    """Plan ``spec`` for ``caps`` and write the exported files into ``out_dir``."""
    c = caps_for(caps) if isinstance(caps, str) else caps
    if c.id == SUBGROUP_MATRIX_PROFILE.id:
        flags = {"matrix_units": "on", **(flags or {})}
    reg = registry.get()
    # Host-cast variants widen float16 in Python; an exported module runs native kernels.
    skip = {(c.id, k.id): "host-cast variant (widens float16 on the host): not exportable"
            for k in reg.kernels(c.backend) if kernels.COMPUTE_DTYPE in k.params}
    plan = reg.plan(spec, caps=c, flags=flags, exclude=skip)
    if plan.request is not None:
        # The module binds the web app's buffers as they are; padding them is a copy the
        # app can make (or avoid) better than a generated module could.
        raise SpecError("head_size", spec.head_size, f"head sizes an exported kernel takes as "
                        f"they are: {spec.head_size}/{spec.head_size_v} (k/v) would run padded "
                        f"to {plan.spec.head_size}/{plan.spec.head_size_v}; export that spec "
                        "and pass q, k, v with zero columns added")
    progs = program.programs(plan, c, dialect=program.TINT)
    os.makedirs(out_dir, exist_ok=True)
    files: dict[str, str] = {}
    for i, p in enumerate(progs):
        files[f"{i}_{p.family}.wgsl"] = p.wgsl
    files["attention.js"] = module_text(plan, progs)
    files["plan.txt"] = plan.explain() + "\n"
    files["README.md"] = readme_text(plan, progs, list(files))
    for name, text in files.items():
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as fh:
            fh.write(text)
    return Exported(out_dir, tuple(files), plan, tuple(progs))


def check(out_dir: str, spec: AttentionSpec, *, seed: int = 0, lengths: Any = None,
          bias_shape: tuple[int, ...] | None = None, module: str = "attention.js"
          ) -> tuple[float, str]:
    """Run the exported module in headless Chromium as a web app would, on random inputs;
    (max abs error, problem or "") against the float64 reference."""
    t = make_tensors(spec, seed, lengths=lengths, bias_shape=bias_shape)
    blobs: dict[str, bytes] = {name: np.ascontiguousarray(t[name]).tobytes()
             for name in ("q", "k", "v", "bias", "seqlens_k", "head_sink", "k_scale", "v_scale",
                          "kv_start", "seqlens_q")
             if name in t}
    header: dict[str, Any] = {"label": module}
    if "bias" in t:
        header["biasShape"] = list(t["bias"].shape)
    with BrowserHost("check", page="check.html", static_dir=out_dir) as host:
        if host.hello.get("error"):
            raise BrowserError(f"the exported module did not start: {host.hello['error']}")
        reply, data = host.call(header, blobs)
    if not reply.get("ok"):
        raise BrowserError(f"the exported module failed: {reply.get('error')}")
    out = np.frombuffer(bytes(data["out"]), dtype=spec.dtype).reshape(spec.out_shape)
    got: Any = out
    if spec.return_lse:
        got = (out, np.frombuffer(bytes(data["lse"]), dtype=np.float32).reshape(spec.lse_shape))
    return compare(spec, got, expected(spec, t))


def main(a: argparse.Namespace, spec: AttentionSpec) -> int:
    """The `attnreg export-wgsl` command (arguments parsed by attnreg.tools.cli)."""
    try:
        res = export(spec, a.out, a.backend_caps)
    except NoKernelError as exc:
        print(exc.explanation)
        return 2
    print(f"{' -> '.join(res.plan.kernels)} for {res.plan.caps.label}")
    for name in res.files:
        print(f"  wrote {os.path.join(res.out_dir, name)}")
    if getattr(a, "check", False):
        err, problem = check(res.out_dir, spec)
        print(f"check in headless Chromium: max abs error {err:.3g} vs the float64 reference"
              + (f": {problem}" if problem else " (within tolerance)"))
        return 1 if problem else 0
    return 0
