"""The build-time unroller (backends/webgpu/unroll.py): which loops it writes out, and that the
prefill programs it rewrites still compile and match the float64 reference."""
from __future__ import annotations

import re

import pytest

import attnreg
from attnreg.backends.webgpu import program, unroll
from attnreg.spec import AttentionSpec
from attnreg.testing import compare, expected, make_tensors
from tests.support import require_devices

SRC = """const A: u32 = 2u;
const B: u32 = max(A * 3u, 1u) / 2u;
fn f() {
  for (var a = 0u; a < A; a++) {  // @unroll
    for (var e = 0u; e < B; e++) {  // @unroll
      x[a][e] = 1.0;  // a } in a comment is not a brace
    }
    for (var g = 0u; g < 4u; g++) { if (g == 1u) { break; } }
  }
  for (var c = 0u; c < B; c++) {  // @unroll
    if (c == 2u) { continue; }
  }
  for (var d = 0u; d < P.n; d++) {  // @unroll
    y[d] = 0.0;
  }
}
"""


def test_constants_follow_earlier_ones():
    assert unroll.constants(SRC) == {"A": 2, "B": 3}


def test_marked_constant_loops_are_written_out():
    out = unroll.unroll(SRC)
    # 2 x 3 copies of the inner body, each with its own constant indices
    assert out.count("x[a][e] = 1.0;") == 6
    assert [m.group(1) for m in re.finditer(r"let e = (\d)u;", out)] == list("012012")
    assert out.count("let a = ") == 2
    # an inner loop that breaks stays a loop (its break is its own)
    assert out.count("for (var g = 0u; g < 4u; g++)") == 2


def test_loops_that_jump_or_have_a_runtime_bound_stay():
    out = unroll.unroll(SRC)
    assert "for (var c = 0u; c < B; c++) {  // @unroll" in out      # continue
    assert "for (var d = 0u; d < P.n; d++) {  // @unroll" in out    # bound not a constant


def test_unmarked_text_is_unchanged():
    plain = SRC.replace("// @unroll", "")
    assert unroll.unroll(plain) == plain


@pytest.fixture(scope="module")
def session():
    require_devices("webgpu")
    with attnreg.Session(backend="webgpu") as s:
        yield s


@pytest.mark.parametrize("params", [{}, {"kv_staging": "workgroup", "rows_per_thread": 1}])
def test_prefill_program_is_unrolled_and_right(session, params):
    spec = AttentionSpec(batch=1, seq_len=9, past_len=7, num_heads=4, kv_num_heads=2,
                         head_size=32, dtype="float16", causal=True)
    kernel = "webgpu.prefill.f16.sg"
    plan = session.plan(spec, kernel=kernel, params=params)
    wgsl = program.programs(plan)[0].wgsl
    # the marked loops over the lane's tiles are written out; the shader marks them
    assert "// @unroll" in program.load("flash_prefill")
    assert not re.search(r"< (ROWS_PER_LANE|LANE_KEYS|REG_SLOTS); \w+\+\+\) \{", wgsl)
    t = make_tensors(spec, 0)
    err, problem = compare(spec, session.run(spec, t, kernel=kernel, params=params),
                           expected(spec, t))
    assert problem == "", (problem, err)
