"""Tint's rejections on both of its hosts, dawn (in-process) and the browser (Chromium): a
WGSL program Tint does not compile becomes a reason that names Tint's message, and the plan
goes on past the kernel (tests.support.prefill_rejection_when_tint_fails breaks
flash_prefill's WGSL and checks what runs instead against the float64 reference)."""

from __future__ import annotations

import pytest

import attnreg
from tests.support import prefill_rejection_when_tint_fails, require_devices

# host -> (spec, input seed, the reason's words)
HOSTS = {
    "dawn": (attnreg.AttentionSpec(batch=1, seq_len=48, past_len=0, num_heads=2,
                                   kv_num_heads=2, head_size=40, causal=True),
             3, "WGSL compile failed"),
    "browser": (attnreg.AttentionSpec(batch=1, seq_len=64, past_len=0, num_heads=2,
                                      kv_num_heads=2, head_size=32, causal=True),
                2, "WGSL compile failed in Chromium (Tint)"),
}


@pytest.mark.parametrize("backend", list(HOSTS))
def test_a_kernel_tint_rejects_is_replanned_with_the_message(
        monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    require_devices(backend)
    spec, seed, words = HOSTS[backend]
    why = prefill_rejection_when_tint_fails(monkeypatch, backend, spec, seed=seed)
    assert words in why and "undefined_in_tint" in why
