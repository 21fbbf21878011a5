"""Bad call arguments and out-of-range scalars (issue [hardening]'s reproducers): each is a
SpecError naming its field, on every available device, and a good run follows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import attnreg
from attnreg.testing import compare, expected, make_tensors

DEVICES = [d for d in attnreg.devices() if d.available]
IDS = [f"{d.backend}-{d.slug}" for d in DEVICES]
S = attnreg.AttentionSpec
SPEC = S(batch=2, seq_len=1, past_len=20, num_heads=4, kv_num_heads=2, head_size=16,
         dtype="float32")


def _t(spec: attnreg.AttentionSpec = SPEC) -> dict[str, np.ndarray]:
    return make_tensors(spec, 0)


BAD_CALLS: list[tuple[str, Callable[[attnreg.Session], Any], str]] = [
    ("flags-as-string", lambda s: s.run(SPEC, _t(), flags="route=split_kv"), "flags"),
    ("list-valued-flag", lambda s: s.run(SPEC, _t(), flags={"route": ["split_kv"]}),
     "flags['route']"),
    ("huge-int-flag", lambda s: s.run(SPEC, _t(), flags={"split_size": 2**31}),
     "flags['split_size']"),
    ("split-size-0", lambda s: s.run(SPEC, _t(), params={"split_size": 0}), "params['split_size']"),
    ("split-size-negative", lambda s: s.run(SPEC, _t(), params={"split_size": -3}),
     "params['split_size']"),
    ("split-size-huge", lambda s: s.run(SPEC, _t(), params={"split_size": 10**12}),
     "params['split_size']"),
    ("split-size-string", lambda s: s.run(SPEC, _t(), params={"split_size": "4"}),
     "params['split_size']"),
    ("unknown-param", lambda s: s.run(SPEC, _t(), params={"zzz": 1}), "params"),
    ("params-not-a-mapping", lambda s: s.run(SPEC, _t(), params=[1]), "params"),
    ("kernel-not-a-string", lambda s: s.run(SPEC, _t(), kernel=5), "kernel"),
    ("forced-kernel-missing", lambda s: s.run(SPEC, _t(), flags={"force_kernel": "nope.x"}),
     "flags['force_kernel']"),
    ("window-2**31", lambda s: S(local_window=2**31), "local_window"),
    ("window-2**63", lambda s: S(local_window=2**63), "local_window"),
    ("batch-2**40", lambda s: S(batch=2**40, seq_len=1, head_size=8), "batch"),
    ("elements-over-int32", lambda s: S(batch=2**20, past_len=2**12, head_size=8), "batch"),
    ("softcap-subnormal", lambda s: S(softcap=1e-320), "softcap"),
    ("scale-over-float32", lambda s: S(scale=1e39), "scale"),
    ("scale-1e308", lambda s: S(scale=1e308), "scale"),
    ("alibi-over-float32", lambda s: S(alibi_max_bias=1e39), "alibi_max_bias"),
    ("empty-2**31-elements", lambda s: s.empty((2**31,), "float32"), "shape"),
    ("empty-2**64-elements", lambda s: s.empty((2**32, 2**32), "float32"), "shape"),
    ("empty-float-shape", lambda s: s.empty((1.5,), "float32"), "shape"),
    ("empty-past-buffer-limit", lambda s: s.empty((2**30,), "float32"), "shape"),
    ("head-sink-inf", lambda s: s.run(SPEC.replace(head_sink=True), {
        **_t(), "head_sink": np.array([0, np.inf, 0, 0], np.float32)}), "tensors['head_sink'][1]"),
    ("head-sink-nan", lambda s: s.run(SPEC.replace(head_sink=True), {
        **_t(), "head_sink": np.array([np.nan, 0, 0, 0], np.float32)}), "tensors['head_sink'][0]"),
]


@pytest.mark.parametrize("dev", DEVICES, ids=IDS)
def test_bad_calls_are_spec_errors_naming_the_field(dev: attnreg.DeviceCaps) -> None:
    with attnreg.Session(backend=dev.backend, device=dev.id) as s:
        for name, call, field in BAD_CALLS:
            if name == "empty-past-buffer-limit" and (dev.limit("buffer_size") or 2**62) >= 2**32:
                continue            # this device can hold 4 GiB: the call is valid there
            with pytest.raises(attnreg.SpecError) as info:
                call(s)
            assert info.value.field == field, f"{name}: {info.value}"
        t = _t()
        _, problem = compare(SPEC, s.run(SPEC, t), expected(SPEC, t))
        assert not problem, f"a good run after the bad calls: {problem}"


def test_a_parameter_no_candidate_takes_is_refused_not_dropped() -> None:
    """The reference prefill takes no kv_tile: asking for one is a NoKernelError that says
    so, never a run that ignores the parameter."""
    spec = SPEC.replace(seq_len=4)
    with attnreg.Session(backend="reference") as s, \
            pytest.raises(attnreg.NoKernelError, match="takes no parameter kv_tile"):
        s.run(spec, _t(spec), kernel="reference.prefill", params={"kv_tile": 16})
