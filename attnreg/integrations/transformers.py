"""Run Hugging Face transformers models' attention with attnreg.

    from attnreg.integrations import transformers as hf
    hf.register(backend="webgpu", name="attnreg-webgpu")
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attnreg-webgpu")
    model.set_attn_implementation("attnreg-webgpu")       # or switch a loaded model

``register(backend=None, flags=None, name="attnreg", *, kv_bucket=256)`` puts an attention
function in transformers' ``AttentionInterface`` and a mask function in
``AttentionMaskInterface`` under ``name`` (register several names for several backends).
Each name has one attnreg ``Session(backend, flags=flags)``, opened on first use
(``session(name)`` returns it); ``unregister(name)`` removes both functions and closes it.
Written against transformers 5.24 (Llama, Mistral, Qwen2, Gemma2, GPT-OSS and models built
like them; tested in tests/integrations/test_transformers.py against eager attention).

Why a mask function too: transformers builds masks only for names in AttentionMaskInterface;
an attention function registered alone gets ``attention_mask=None``, so a padded batch would
be silently wrong. Ours asks transformers' own ``sdpa_mask`` for the exact boolean mask
[B, 1, S, L] (never its "skip the mask" shortcuts), so padding, sliding windows, packed
sequences and overlays are what eager would see, then describes it for attnreg and checks
the description: it computes the visibility the description gives under docs/contract.md and keeps
it only if it equals the mask element for element. What it cannot describe falls back to an
additive -inf bias holding the whole mask, so no mask is ever approximated.
The mask tensor (contiguous, so generate's ``.contiguous()`` keeps it) carries the
description as an attribute; the attention functions of all layers of a forward read it.

Mapping rules (transformers -> AttentionSpec):

- Tensors. query [B, Nq, S, H], key/value [B, Nkv, L, H] (BNSH) are read in place through
  DLPack (bfloat16 through its bits as ml_dtypes.bfloat16): q_layout "BSNH" when query is a
  transposed view of a [B, S, Nq, H] projection (the usual case, and then out [B, S, Nq, H]
  comes back with no transpose), else "BNSH"; kv_layout follows the key's strides. GQA:
  kv_num_heads = Nkv (no repeat_kv). out is a new contiguous torch tensor [B, S, Nq, H] in
  the input dtype (float32, float16, bfloat16; bfloat16 needs a backend with bfloat16
  kernels, else NoKernelError says so). A V head size other than K's -> v_head_size.
- Scalars. ``scaling`` -> scale (None: 1/sqrt(H)); ``softcap`` (Gemma2) -> softcap, applied
  before the mask as eager does; ``s_aux`` (GPT-OSS sinks, one logit per query head) ->
  head_sink (in the model dtype or float32). ``sliding_window`` is not read: eager ignores it
  too, the mask carries the window (below).
- Causal and positions. The mask's query rows sit at positions q_offset + i and its keys at
  kv_offset + j; with L = q_offset - kv_offset + S valid keys, attnreg's bottom-right rule
  (row i at L - S + i) is the same frontier. A sliding window W (``local_size`` of
  transformers' sliding masks: key j visible from position p iff p - W < j <= p, which is
  attnreg's local_window = W exactly) -> local_window = W.
- Left padding (keys j before batch entry b's first visible key invisible) -> attnreg's
  ``kv_start`` tensor [B] (no bias is built or read); an entry with no visible key at all
  falls back to a float32 bias [B, 1, 1, C] with -inf on its keys. Query rows that see no
  key (padding tokens) are 0 in attnreg; eager gives them the mean of V (an all-minimum
  row); no real token reads them.
- Anything else a mask says (right-padded prompts, packed sequences, chunked or bidirectional
  masks, a user's 4-D mask): a bias [B|1, 1, S, C] of 0 / -inf (bool masks) or the float mask
  itself (eager adds it), with causal off.
- Caches. Dynamic caches hand over K/V of exactly L keys: a first prompt (L == S) runs with
  capacity L. Later steps (L > S) would make every new length a new spec and a new plan, so
  the capacity is rounded up to a multiple of ``kv_bucket`` (256; 0: never) and K/V copied
  into a reused zeroed buffer of that capacity with seqlens_k = L (keys past L never count):
  one plan per bucket. Measured (tiny 2-layer GQA model, one decode step = mask + 2 layers,
  lavapipe and PoCL): a new length costs 1.6-1.7x (webgpu) and 2.4-2.5x (opencl) a seen one
  with exact capacities, 1.01-1.07x with buckets of 256. Static caches
  (``cache_implementation="static"``) hand over their whole buffer of max_cache_len keys:
  it is read in place with kv_capacity = max_cache_len and seqlens_k = L from the cache
  position (without seqlens_k the queries would silently sit at C - S + i). A saturated
  sliding-window dynamic cache (W - 1 + S keys) is copied as well.
- No mask (a bare module call, or a cache transformers makes no mask for): causal from
  ``is_causal`` (kwarg, else module.is_causal) when S == L, none when S == 1; a causal call
  with 1 < S < L is refused (eager would attend every key, sdpa aligns top-left).

transformers behaviours this relies on (5.24): ``from_config(cfg, attn_implementation=n)``
sets ``n`` on the config object it is given (two models built from one config share it);
``generate`` builds 4-D masks through the mask interface itself for static caches and calls
``.contiguous()`` on them; torch sdpa gives fully masked rows 0 like attnreg, eager the mean
of V.

Refused with attnreg.SpecError (field, value, why), never approximated: dropout > 0,
output_attentions (attnreg never materialises the weights), ``position_bias``/``head_mask``,
flex BlockMasks, masks whose shape does not broadcast to [B, Nq, S, L], fewer keys than
queries, mixed dtypes, and backward: attnreg has no gradient, so
where autograd would need one the output's backward raises SpecError.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import attnreg
from attnreg import flags as flagmod
from attnreg import registry as regmod
from attnreg.errors import SpecError

from .hf_attention import Binding, make_attention
from .hf_masks import make_mask

__all__ = ["KV_BUCKET", "register", "registered", "session", "unregister"]

KV_BUCKET = 256
"""Default ``kv_bucket``: dynamic-cache capacities are rounded up to a multiple of it."""

_BUILTIN = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3",
            "flash_attention_4", "paged|eager")
_LOCK = threading.Lock()
_BINDINGS: dict[str, Binding] = {}


def _interfaces() -> tuple[Any, Any]:
    """(AttentionInterface, AttentionMaskInterface), or SpecError naming the package."""
    try:
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface
    except ImportError as exc:
        raise SpecError("transformers", None, "the transformers package installed "
                        f"(pip install transformers): {exc}") from None
    return AttentionInterface, AttentionMaskInterface


def register(backend: str | None = None, flags: Mapping[str, Any] | None = None,
             name: str = "attnreg", *, kv_bucket: int = KV_BUCKET) -> str:
    """Register attnreg attention and its mask function under ``name`` in transformers'
    AttentionInterface and AttentionMaskInterface; returns ``name``.

    ``backend`` (None: attnreg picks) and ``flags`` (session flags) are checked now; the
    Session opens on the first forward. ``kv_bucket``: dynamic-cache capacities round up to
    a multiple of it (one plan per bucket; 0 plans every length). Registering a name again
    replaces it (and closes its old Session).
    """
    attention_interface, mask_interface = _interfaces()
    if not isinstance(name, str) or not name or any(c in name for c in "/:|") \
            or name in _BUILTIN or any(w in name for w in ("sdpa", "flash", "flex")):
        raise SpecError("name", name, "a non-empty str without '/', ':' or '|' that is not a "
                        "built-in implementation and does not contain 'sdpa', 'flash' or "
                        "'flex' (transformers dispatches those names to its own checks)")
    if backend is not None:
        if not isinstance(backend, str):
            raise SpecError("backend", backend, "None or an installed backend's name")
        regmod.get().backend(backend)                 # unknown -> SpecError now
    if flags is not None and not isinstance(flags, Mapping):
        raise SpecError("flags", flags, "None or a mapping of session flags")
    flagmod.resolve(dict(flags or {}))                # unknown or ill-typed -> SpecError now
    if isinstance(kv_bucket, bool) or not isinstance(kv_bucket, int) or kv_bucket < 0:
        raise SpecError("kv_bucket", kv_bucket, "an integer >= 0 (0: no bucketing)")
    binding = Binding(name, backend, dict(flags or {}), kv_bucket)
    with _LOCK:
        old = _BINDINGS.pop(name, None)
        _BINDINGS[name] = binding
    if old is not None:
        old.close()
    attention_interface.register(name, make_attention(binding))
    mask_interface.register(name, make_mask(name, kv_bucket))
    return name


def unregister(name: str = "attnreg") -> None:
    """Remove ``name`` from both interfaces and close its Session (a model still set to it
    then fails in transformers' dispatch, not silently)."""
    attention_interface, mask_interface = _interfaces()
    with _LOCK:
        binding = _BINDINGS.pop(name, None)
        known = sorted(_BINDINGS)
    if binding is None:
        raise SpecError("name", name, f"a registered name: {known}")
    attention_interface._global_mapping.pop(name, None)
    mask_interface._global_mapping.pop(name, None)
    binding.close()


def registered() -> dict[str, tuple[str | None, dict[str, Any]]]:
    """{name: (backend, flags)} of every registered name."""
    with _LOCK:
        return {n: (b.backend, dict(b.flags)) for n, b in _BINDINGS.items()}


def session(name: str = "attnreg") -> attnreg.Session:
    """The Session behind ``name`` (opened now if needed): explain(), plans, close()."""
    with _LOCK:
        binding = _BINDINGS.get(name)
        known = sorted(_BINDINGS)
    if binding is None:
        raise SpecError("name", name, f"a registered name: {known}")
    return binding.session
