"""Profile cells: the plan every stored device profile gets (with and without its vendor
opt-in flags), forced on an available device of the same backend, so the parameters the
rules pick for a GPU that CI does not have still run here."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .. import registry as regmod
from ..caps import DeviceCaps
from ..errors import NoKernelError
from ..spec import AttentionSpec
from .cells import Case, emulation_params

# Small versions of the three workloads profiles are pinned on (decode, whisper, prefill):
# the rules pick per-vendor parameters from these, and the cells run those parameters here.
PROFILE_SPECS: tuple[tuple[str, AttentionSpec], ...] = (
    ("decode", AttentionSpec(batch=1, seq_len=1, past_len=299, num_heads=8, kv_num_heads=2,
                             head_size=128, dtype="float16", causal=True)),
    ("whisper", AttentionSpec(batch=1, seq_len=4, past_len=196, num_heads=8, kv_num_heads=8,
                              head_size=64, dtype="float16", causal=False)),
    ("prefill", AttentionSpec(batch=1, seq_len=64, past_len=0, num_heads=8, kv_num_heads=2,
                              head_size=128, dtype="float16", causal=True)),
)


def profile_cases(devices: Iterable[DeviceCaps]) -> tuple[list[Case], dict[str, str]]:
    """Every stored profile's plan (with and without its vendor opt-in flags), forced on the
    available device of the same backend. Returns (cases, {label: why not runnable here})."""
    from ..flags import table as flag_table
    from ..profiles import profiles
    devs = [d for d in devices if d.available]
    reg = regmod.get()
    out: list[Case] = []
    skipped: dict[str, str] = {}
    for name, caps in profiles().items():
        targets = [d for d in devs if d.backend == caps.backend]
        vendor_flags = [f.name for f in flag_table().values() if f.vendor == caps.vendor]
        flag_sets: list[dict[str, Any]] = [{}] + [{f: True} for f in vendor_flags]
        for flags in flag_sets:
            for work, spec in PROFILE_SPECS:
                try:
                    plan = reg.plan(spec, caps=caps, flags=flags)
                except NoKernelError as exc:
                    skipped[f"{name}-{work}"] = f"no plan on the profile: {exc}"
                    continue
                tag = f"profile-{name}" + "".join(f"-{f}" for f in flags)
                for dev in targets:
                    k = reg.kernel(plan.kernel)
                    params = {**dict(plan.params), **emulation_params(k, dev)}
                    run_spec = spec
                    why = k.not_supported_reasons(run_spec, dev, params)
                    # A bigger GPU's tiles may not fit a CI device's workgroup storage at this
                    # head size; the same parameter values at a smaller head size exercise
                    # the same code path, so try those before giving up.
                    while why and "workgroup storage" in " ".join(why) and run_spec.head_size > 32:
                        run_spec = run_spec.replace(head_size=run_spec.head_size // 2)
                        why = k.not_supported_reasons(run_spec, dev, params)
                    if why:
                        skipped[f"{tag}-{work}@{dev.slug}"] = "; ".join(why)
                        continue
                    check = "reduce" if k.family == "reduce" else "attention"
                    out.append(Case(dev.backend, dev.id, dev.slug, k.id, k.family, check,
                                    f"{tag}-{work}", run_spec, tuple(sorted(params.items())),
                                    emulated=bool(emulation_params(k, dev)),
                                    kind="profile", feature=work,
                                    seed=len(out)))
    return out, skipped
