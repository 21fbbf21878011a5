"""The matrix kernels' workgroup variables are whole multiples of 16 bytes.

Vulkan wants a cooperative matrix's workgroup pointer 16-byte aligned, but SPIR-V's workgroup
variables carry no layout: the driver places them by their types' natural alignment (2 for
an f16 array). On the H200 through Dawn, one workgroup variable of 4, 8 or 12 bytes beside
the matrix arrays made the products wrong, and one of 16 or 32 bytes did not
(bench/wgsl_matrix_decode_probe.py --extras; ci/results/h200_wgsl_matrix_decode.txt). This
checks every hardware build's declarations, sizes evaluated from the program's own constants,
so CI (which has no subgroup matrices) catches a variable that would move the arrays."""

from __future__ import annotations

import re
from typing import Any

import pytest

import attnreg
from attnreg.backends.webgpu import program

_CONST = re.compile(r"^\s*const\s+(\w+)\s*(?::\s*\w+)?\s*=\s*([^;]+);", re.M)
_VAR = re.compile(r"^\s*var<workgroup>\s+(\w+)\s*:\s*(.+);", re.M)
_SCALARS = {"f16": 2, "f32": 4, "u32": 4, "i32": 4, "bool": 4}


def _value(expr: str, env: dict[str, int]) -> int | None:
    """A u32 constant expression of WGSL's (literals, names, + - * /, max/min) as an int, or
    None where it is something else (floats, calls this does not know)."""
    py = re.sub(r"\b(\d+)u\b", r"\1", expr).replace("/", "//")
    if re.search(r"[^\w\s+\-*/(),]", py) or re.search(r"\d\.\d|\d+[fh]\b", py):
        return None
    try:
        got = eval(py, {"__builtins__": {}}, {"max": max, "min": min, **env})
    except (NameError, TypeError, SyntaxError, ZeroDivisionError):
        return None
    return got if isinstance(got, int) else None


def _size(ty: str, env: dict[str, int]) -> int:
    """Bytes of a workgroup variable's type (scalars, atomics, vectors, arrays of them)."""
    ty = ty.strip()
    if ty in _SCALARS:
        return _SCALARS[ty]
    m = re.fullmatch(r"atomic<(\w+)>", ty)
    if m:
        return _SCALARS[m.group(1)]
    m = re.fullmatch(r"vec([234])<(\w+)>", ty)
    if m:
        n = int(m.group(1))
        return (4 if n == 3 else n) * _SCALARS[m.group(2)]
    m = re.fullmatch(r"array<(.+),\s*([^,<>]+)>", ty)
    assert m, f"a workgroup type this test does not size: {ty}"
    count = _value(m.group(2), env)
    assert count is not None, f"array length {m.group(2)!r} not evaluated"
    return _size(m.group(1), env) * count


def workgroup_sizes(wgsl: str) -> dict[str, int]:
    """Every workgroup variable of a module and its size in bytes."""
    env: dict[str, int] = {}
    for name, expr in _CONST.findall(wgsl):
        got = _value(expr, env)
        if got is not None:
            env[name] = got
    return {name: _size(ty, env) for name, ty in _VAR.findall(wgsl)}


def test_the_sizer_reads_wgsl() -> None:
    text = ("const A: u32 = 4u;\nconst B: u32 = max(A * 3u, 2u) / 2u;\n"
            "var<workgroup> x: array<f16, A * B>;\nvar<workgroup> f: atomic<u32>;\n"
            "var<workgroup> v: vec4<u32>;\nvar<workgroup> m: array<vec3<f32>, 2u>;\n")
    assert workgroup_sizes(text) == {"x": 48, "f": 4, "v": 16, "m": 32}


PREFILL = attnreg.AttentionSpec(batch=1, seq_len=300, num_heads=8, kv_num_heads=2,
                                head_size=128, dtype="float16", causal=True)
DECODE = attnreg.AttentionSpec(batch=2, seq_len=1, past_len=700, num_heads=8, kv_num_heads=2,
                               head_size=128, dtype="float16", return_lse=True)
CASES: list[tuple[str, attnreg.AttentionSpec, dict[str, Any]]] = [
    ("webgpu.prefill.f16.mma_direct", PREFILL, {}),
    ("webgpu.prefill.f16.mma_direct", PREFILL, {"q_tile": 64}),     # the form's default
    ("webgpu.prefill.f16.mma_direct", PREFILL, {"q_tile": 128}),    # NVIDIA's rule
    ("webgpu.prefill.f16.mma_direct", PREFILL.replace(head_size=64), {}),
    ("webgpu.prefill.f16.mma", PREFILL.replace(head_size=256), {}),
    ("webgpu.prefill.f16.mma", PREFILL.replace(head_size=48, kv_dtype="int8"), {}),
    ("webgpu.decode_partial.f16.mma", DECODE, {}),
    ("webgpu.decode_partial.f16.mma", DECODE.replace(head_size=64, num_heads=32), {}),
]


@pytest.mark.parametrize("kernel,spec,params", CASES)
def test_matrix_kernels_keep_workgroup_variables_16_byte_sized(
        kernel: str, spec: attnreg.AttentionSpec, params: dict[str, Any]) -> None:
    # planned where CI's devices hold it, then built with the case's params (q_tile 128
    # takes 47.6 KB, past lavapipe's workgroup storage; NVIDIA's rule asks for it)
    plan = attnreg.Session(backend="webgpu", flags={"matrix_units": "emulate"}).plan(
        spec, kernel=kernel)
    st = plan.stages[0]
    hw = attnreg.Stage(st.kernel, st.family, {**st.params, **params, "mma": "hardware"})
    wgsl = program.build(hw, spec, plan.caps, dialect=program.TINT).wgsl
    assert "subgroupMatrixLoad" in wgsl
    sizes = workgroup_sizes(wgsl)
    assert len(sizes) >= 5, sizes
    odd = {name: n for name, n in sizes.items() if n % 16}
    assert not odd, f"{kernel} {params}: workgroup variables not a multiple of 16 bytes: {odd}"
