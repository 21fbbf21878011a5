"""Every tensor is read in the dtype the tensor checks accepted for it (docs/contract.md "Every
head size, two-sided windows": bias float32 or the spec's dtype, head_sink float32 or the spec's
dtype), on every GPU backend, as host arrays and as DeviceTensors, against the float64 reference.

ONNX's own node tests found a bfloat16 bias that the checks accepted and the OpenCL kernels
read as float32 (wrong values, and reads past the end of the bias buffer: NaN outputs). The
first tests here are those three node tests through the plain API; the others walk every
accepted storage of bias and head_sink (tensors.accepted_dtypes, the checks' own table)
through run, DeviceTensors, prepared runs and the split-KV reduce, and check that the quick
conformance matrix, which runs every kernel, has a cell for each accepted storage per kernel
and dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import attnreg
from attnreg import reference as ref
from attnreg.tensors import STORED_AS, accepted_dtypes, check_tensors
from attnreg.tools import cases as cases_mod
from tests.support import check_close, make_tensors, quick_keeps, require_devices

GPU = ("opencl", "webgpu", "dawn", "browser")
DTYPES = ("float32", "float16", "bfloat16")


@pytest.fixture(scope="module", params=GPU)
def session(request: pytest.FixtureRequest) -> Iterator[attnreg.Session]:
    require_devices(request.param)
    with attnreg.Session(backend=request.param) as s:
        yield s


# -- ONNX's three failing node tests, through the plain API ------------------------------
# Their shapes: Q [2, 3, 4, 8], K and V [2, 3, 6, 8] (BNSH), a bfloat16 attn_mask added to
# the scores; nonpad_kv_seqlen is seqlens_k (here at least seq_len: the plain API's causal
# rows end at L_b).
ONNX = {
    "attn_mask_causal_bf16": ({"causal": True}, {"bias_shape": (2, 1, 4, 6)}),
    "causal_padded_kv_bf16": ({"causal": True, "seqlens_k": True}, {"lengths": (4, 5)}),
    "padded_kv_bf16": ({"seqlens_k": True}, {"lengths": (4, 5)}),
}


@pytest.mark.parametrize("name", sorted(ONNX))
def test_onnx_bf16_bias_node_tests(session: attnreg.Session, name: str) -> None:
    changes, make = ONNX[name]
    spec = attnreg.AttentionSpec(batch=2, seq_len=4, past_len=2, num_heads=3, kv_num_heads=3,
                                 head_size=8, dtype="bfloat16", bias=True, q_layout="BNSH",
                                 kv_layout="BNSH", **{"causal": False, **changes})
    t = make_tensors(spec, seed=3, **make)
    t["bias"] = t["bias"].astype(np.dtype("bfloat16"))
    out, plan = session.run_with_plan(spec, t)
    check_close(spec, out, t, what=f"{session.backend} {plan.kernel} {name}")
    assert np.isfinite(np.asarray(out, np.float32)).all()


# -- every accepted storage of bias and head_sink ----------------------------------------
# A decode step: how a runtime binds bias and head_sink is the same for each of its kernels
# (the conformance matrix runs every kernel with each storage).
DECODE = dict(batch=2, seq_len=1, past_len=70, num_heads=4, kv_num_heads=2, head_size=32,
              causal=True)
# The spec dtypes under which bias or head_sink may be stored more than one way (a float32
# spec takes float32 only: what every other test stores).
WIDE = tuple(d for d in DTYPES if any(
    len(accepted_dtypes(attnreg.AttentionSpec(**DECODE, dtype=d), n)) > 1
    for n in STORED_AS))


def _storages(spec: attnreg.AttentionSpec) -> list[dict[str, str]]:
    """Bias and head_sink storages that together meet every dtype the checks accept for
    each: the i-th accepted dtype of one beside the (i+1)-th of the other."""
    bias, sink = accepted_dtypes(spec, "bias"), accepted_dtypes(spec, "head_sink")
    n = max(len(bias), len(sink))
    return [{"bias": bias[i % len(bias)], "head_sink": sink[(i + 1) % len(sink)]}
            for i in range(n)]


@pytest.mark.parametrize("dtype", WIDE)
def test_bias_and_sink_in_every_accepted_dtype(session: attnreg.Session, dtype: str) -> None:
    spec = attnreg.AttentionSpec(**DECODE, dtype=dtype, bias=True, head_sink=True,
                                 return_lse=True)
    for i, how in enumerate(_storages(spec)):
        t = make_tensors(spec, seed=10 + i, mask_frac=0.2,
                         bias_shape=(1, spec.num_heads, spec.seq_len, spec.capacity))
        t.update({n: t[n].astype(np.dtype(dt)) for n, dt in how.items()})
        got, plan = session.run_with_plan(spec, t)
        check_close(spec, got, t, what=f"{session.backend} {plan.kernel} host {how}")
        dev = {n: session.tensor(a) if n in how else a for n, a in t.items()}
        got = session.run(spec, dev)
        check_close(spec, got, t, what=f"{session.backend} {plan.kernel} DeviceTensor {how}")


@pytest.mark.parametrize("dtype", WIDE)
def test_device_bias_rewritten_in_place(session: attnreg.Session, dtype: str) -> None:
    """A DeviceTensor bias in the spec's dtype, written again between runs: the second run
    reads the new values (runtimes that widen it keep a derived copy per version)."""
    spec = attnreg.AttentionSpec(**DECODE, dtype=dtype, bias=True)
    t = make_tensors(spec, seed=5)
    bias = session.tensor(t["bias"].astype(np.dtype(dtype)))
    for seed in (5, 6):
        fresh = make_tensors(spec, seed=seed, mask_frac=0.3)["bias"].astype(np.dtype(dtype))
        bias.write(fresh)
        got = session.run(spec, {**t, "bias": bias})
        check_close(spec, got, {**t, "bias": fresh}, what=f"{session.backend} rewrite {seed}")


@pytest.mark.parametrize("dtype", WIDE)
def test_prepared_run_reads_a_rewritten_sink_and_bias(session: attnreg.Session,
                                                      dtype: str) -> None:
    """Session.prepare with bias and head_sink DeviceTensors in the spec's dtype: values
    written between calls are the ones read (the checks widen such a sink on the host, so the
    prepared run reads it again once written), and a non-finite one is still refused."""
    spec = attnreg.AttentionSpec(**DECODE, dtype=dtype, bias=True, head_sink=True)
    t = make_tensors(spec, seed=4)
    dev = {n: session.tensor(t[n].astype(np.dtype(dtype))) for n in STORED_AS}
    run = session.prepare(spec, {**t, **dev})
    for seed in (4, 9):
        fresh = make_tensors(spec, seed=seed, mask_frac=0.2)
        now = {n: fresh[n].astype(np.dtype(dtype)) for n in STORED_AS}
        for n in STORED_AS:
            dev[n].write(now[n])
        check_close(spec, run(), {**t, **now}, what=f"{session.backend} prepared {seed}")
    dev["head_sink"].write(np.full(spec.num_heads, np.inf, np.dtype(dtype)))
    with pytest.raises(attnreg.SpecError, match=r"tensors\['head_sink'\]\[0\]"):
        run()


@pytest.mark.parametrize("dtype", WIDE)
def test_reduce_takes_the_sink_in_every_accepted_dtype(session: attnreg.Session,
                                                       dtype: str) -> None:
    """Session.reduce_states (the split-KV reduce reads head_sink) with the sink in each
    dtype the checks accept, against the float64 reduce of the same partial states."""
    spec = attnreg.AttentionSpec(**DECODE, dtype=dtype, head_sink=True,
                                 return_lse=True)
    t = make_tensors(spec, seed=8)
    o_p, l_p = ref.partial_states(spec, check_tensors(spec, t), 16)
    o_p, l_p = o_p.astype(np.float32), l_p.astype(np.float32)
    for sink_dtype in accepted_dtypes(spec, "head_sink"):
        sink = t["head_sink"].astype(np.dtype(sink_dtype))
        got = session.reduce_states(spec, o_p, l_p, sink)
        check_close(spec, got, {**t, "head_sink": sink}, what=f"reduce sink {sink_dtype}")


# -- what the checks refuse, and the matrix --------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_other_dtype_is_refused(dtype: str) -> None:
    """The table the kernels and the matrix follow is the one the checks enforce."""
    spec = attnreg.AttentionSpec(**DECODE, dtype=dtype, bias=True, head_sink=True)
    for name in STORED_AS:
        assert accepted_dtypes(spec, name)[0] == "float32"
        for other in set(DTYPES) - set(accepted_dtypes(spec, name)):
            t = make_tensors(spec, seed=1)
            t[name] = t[name].astype(np.dtype(other))
            with pytest.raises(attnreg.SpecError, match=rf"tensors\['{name}'\]\.dtype"):
                attnreg.run(spec, t, backend="reference")


def _stored_dtype(case: Any, name: str) -> str:
    return dict(case.stored).get(name, accepted_dtypes(case.spec, name)[0])


def test_quick_matrix_reads_every_accepted_dtype() -> None:
    """Per kernel that reads bias / head_sink, per dtype of the kernel: the quick matrix as
    CI runs it (tests.support.quick_keeps) has a cell with that tensor stored in every dtype
    the checks accept, on every available device (a future accepted dtype gets cells too)."""
    cells = [c for c in cases_mod.cases(quick=True) if quick_keeps(c)]
    assert cells
    have: dict[tuple[str, str, str, str], set[str]] = {}
    for c in cells:
        for name in STORED_AS:
            if getattr(c.spec, name):
                have.setdefault((c.device, c.kernel, c.spec.dtype, name), set()).add(
                    _stored_dtype(c, name))
    missing = {}
    for (dev, kernel, dtype, name), got in have.items():
        spec = attnreg.AttentionSpec(**DECODE, dtype=dtype)
        want = set(accepted_dtypes(spec, name))
        if got != want:
            missing[(dev, kernel, dtype, name)] = sorted(want - got)
    assert not missing, missing
    # and every kernel that reads the tensor has cells that pass it
    reg = attnreg.registry.get()
    lacking = {(c.device, c.kernel, c.spec.dtype, name) for c in cells for name in STORED_AS
               if name in reg.kernel(c.kernel).supports} - set(have)
    assert not lacking, sorted(lacking)
