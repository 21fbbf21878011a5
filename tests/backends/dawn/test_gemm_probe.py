"""The subgroup-matrix GEMM probe (backends/dawn/gemm_probe.py): on a Dawn adapter with
subgroup matrices its products match the float64 product at a tiny size, for straight and
staged operands and both B layouts; elsewhere (CI's lavapipe: Dawn lists no
chromium-experimental-subgroup-matrix there) it refuses with the reason, through the
runtime's matrix_peak too. The generated text keeps each accumulator a variable of its own."""

from __future__ import annotations

import re

import pytest

import attnreg
from attnreg.backends.dawn import device as ddevice
from attnreg.backends.dawn import gemm_probe as gp
from tests.support import require_devices

TINY = (64, 64, 128)            # M, N, K: every config below divides it
CONFIGS = (gp.Config(1, 1, 1, 1), gp.Config(2, 2, 2, 1), gp.Config(1, 2, 1, 2, bt=True),
           gp.Config(2, 2, 1, 2, stage=32), gp.Config(2, 1, 2, 1, stage=64, bt=True),
           gp.Config(2, 2, 1, 2, stage=32, prefetch=True),
           gp.Config(1, 2, 2, 1, stage=32, bt=True, prefetch=True))


def _peak() -> tuple[float | None, str]:
    spec = attnreg.AttentionSpec(seq_len=1, past_len=7, head_size=16)
    with attnreg.Session(backend="dawn") as s:
        return s.runtime(s.plan(spec)).matrix_peak()


def test_numerics_where_it_runs_and_the_reason_where_not() -> None:
    caps = require_devices("dawn")[0]
    why = gp.refusal(caps)
    if why is not None:
        assert why.startswith("no subgroup matrices on this device"), why
        assert _peak() == (None, why)
        with pytest.raises(RuntimeError, match="no subgroup matrices on this device"):
            gp.run(ddevice.get(caps), gp.Config(), TINY)
        return
    dev = ddevice.get(caps, experimental=True)
    for c in CONFIGS:
        res = gp.run(dev, c, TINY, repeats=1, samples=1, warmup_s=0.0)
        assert res.tflops is not None and res.tflops > 0, res.line()
        assert res.rel_err is not None and res.rel_err <= gp.REL_TOL, res.line()
    peak, how = _peak()
    assert peak is not None and peak > 0 and "GEMM probe" in how


def test_accumulators_are_separate_variables() -> None:
    """tm x tn result matrices, each its own `var` and stored once; no array of them (an
    array is indexed dynamically and spills)."""
    for c in (gp.Config(2, 4, 2, 2), gp.Config(4, 4, 2, 2, stage=32, bt=True)):
        text = gp.wgsl(c, (512, 512, 512), 16, 32)
        accs = re.findall(r"var (c\d+_\d+) = MC\(\);", text)
        assert len(set(accs)) == c.tm * c.tn
        assert "array<MC" not in text and text.count("subgroupMatrixStore") == c.tm * c.tn
        assert text.count("subgroupMatrixMultiplyAccumulate") == c.tm * c.tn


def test_fits_says_what_does_not_fit() -> None:
    caps = require_devices("dawn")[0]
    assert gp.fits(gp.Config(2, 4, 2, 2), (100, 128, 128), 16, caps) is not None
    big = gp.Config(4, 4, 4, 2, stage=64, pad=8)          # 256 x 128 x 64 blocks: 53 KiB
    assert "workgroup memory" in (gp.fits(big, (2048, 2048, 2048), 16, caps) or "")
