"""attnreg.integrations.transformers against transformers' own eager attention: tiny random
models (Llama GQA, Mistral sliding window, Qwen2 mixed full/sliding layers, Gemma2 softcap +
alternating windows, GPT-OSS sinks + alternating windows), the same weights run with
attn_implementation="eager" and with a registered attnreg name; logits on real tokens,
greedy generations (dynamic and static caches, left-padded batches) must agree. Never
attnreg against itself."""

from __future__ import annotations

import copy
import functools
from typing import Any

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import attnreg  # noqa: E402
from attnreg.integrations import transformers as hf  # noqa: E402
from tests.support import require_devices  # noqa: E402

BACKENDS = ("reference", "webgpu", "opencl")
GPU_MODELS = ("llama", "gemma2", "gpt_oss")       # GQA; softcap + windows; sinks + windows
MODELS = ("llama", "mistral", "qwen2", *GPU_MODELS[1:])
W = 5                                              # sliding windows shorter than the prompts


def _config(kind: str) -> Any:
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  initializer_range=0.15, pad_token_id=0, eos_token_id=None, bos_token_id=None,
                  max_position_embeddings=128, tie_word_embeddings=False)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=W)
    if kind == "qwen2":        # layer 0 full attention, layer 1 a sliding window
        return transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=W,
                                        max_window_layers=1)
    if kind == "gemma2":       # a small softcap, so that it matters; layers alternate
        return transformers.Gemma2Config(**common, sliding_window=W, attn_logit_softcapping=2.0,
                                         final_logit_softcapping=30.0, query_pre_attn_scalar=16)
    if kind == "gpt_oss":
        common.update(intermediate_size=32)
        return transformers.GptOssConfig(**common, sliding_window=W, num_local_experts=4,
                                         num_experts_per_tok=2)
    raise AssertionError(kind)


def _name(backend: str) -> str:
    return f"attnreg-test-{backend}"


@pytest.fixture(scope="module", autouse=True)
def _registered() -> Any:
    # One torch thread: these models are tiny, and torch's thread pool spinning beside
    # pytest-xdist workers and PoCL's threads made a generate() 100x slower (measured).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for b in BACKENDS:
        hf.register(backend=b, name=_name(b))
    yield
    for b in BACKENDS:
        hf.unregister(_name(b))
    torch.set_num_threads(threads)


def _backend(backend: str) -> str:
    if backend != "reference":
        require_devices(backend)
    return _name(backend)


@functools.cache
def _eager(kind: str, dtype: str = "float32") -> Any:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        _config(kind), attn_implementation="eager", dtype=getattr(torch, dtype))
    if kind == "gpt_oss":
        with torch.no_grad():      # init gives sinks ~ N(0, 0.15): make them matter
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.5)
    return model.eval()


def _pair(kind: str, name: str, dtype: str = "float32") -> tuple[Any, Any]:
    """(eager, attnreg) models with the same weights. The copy gets its own config:
    from_config(cfg, attn_implementation=...) sets it on the config object it is given."""
    eager = _eager(kind, dtype)
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation(name)
    assert eager.config._attn_implementation == "eager"
    assert ours.config._attn_implementation == name
    return eager, ours


def _batch(seed: int = 1, length: int = 11, pad: int = 3) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :pad] = 0                                   # row 1 is left-padded
    ids[1, :pad] = 0
    return ids, mask


def _close(got: Any, want: Any, rtol: float = 1e-4, what: str = "") -> None:
    atol = rtol * float(want.abs().max())
    np.testing.assert_allclose(got.double().numpy(), want.double().numpy(), rtol=rtol, atol=atol,
                               err_msg=what)


def _cases() -> list[Any]:
    return [pytest.param(k, b, id=f"{k}-{b}") for b in BACKENDS for k in MODELS
            if b == "reference" or k in GPU_MODELS]


# -- logits and generation against eager -----------------------------------------------


@pytest.mark.parametrize(("kind", "backend"), _cases())
def test_logits_left_padded_batch(kind: str, backend: str) -> None:
    eager, ours = _pair(kind, _backend(backend))
    ids, mask = _batch()
    with torch.no_grad():
        want = eager(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
        alone = eager(ids[1:, 3:]).logits               # the padded row without padding
    _close(got[0], want[0], what="unpadded row")
    _close(got[1, 3:], want[1, 3:], what="real tokens of the left-padded row")
    _close(got[1, 3:], alone[0], rtol=1e-3, what="left-padded row vs the same row unpadded")


@pytest.mark.parametrize(("kind", "backend"), _cases())
def test_greedy_generate_dynamic_and_static(kind: str, backend: str) -> None:
    eager, ours = _pair(kind, _backend(backend))
    ids, mask = _batch(seed=2)
    with torch.no_grad():
        for cache in (None, "static"):
            kw = dict(attention_mask=mask, max_new_tokens=14, do_sample=False,
                      cache_implementation=cache)
            want = eager.generate(ids, **kw)
            got = ours.generate(ids, **kw)
            assert torch.equal(got, want), (cache, got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_steps_match_eager_logits(backend: str) -> None:
    """Step by step with a DynamicCache (queries at past_len + i, bucketed capacity) and a
    StaticCache (the whole buffer, seqlens_k from the cache position): logits every step."""
    eager, ours = _pair("gemma2" if backend != "reference" else "mistral", _backend(backend))
    ids, mask = _batch(seed=3, length=7, pad=2)
    for cache_cls in (transformers.DynamicCache, transformers.StaticCache):
        kw = {} if cache_cls is transformers.DynamicCache else {"max_cache_len": 24}
        caches = [cache_cls(config=m.config, **kw) for m in (eager, ours)]
        tok, m_ = ids, mask
        with torch.no_grad():
            for step in range(8):
                outs = [m(tok, attention_mask=m_, cache=c, use_cache=True).logits
                        for m, c in zip((eager, ours), caches)]
                real = outs[0] if step else outs[0][:, -1:]
                _close(outs[1][:, -real.shape[1]:], real, what=f"{cache_cls.__name__} step {step}")
                tok = outs[0][:, -1:].argmax(-1)
                m_ = torch.cat([m_, torch.ones(2, 1, dtype=m_.dtype)], dim=1)


@pytest.mark.parametrize("bucket", [256, 0])
def test_decode_reuses_one_spec_per_bucket(bucket: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dynamic cache grows by one key a step: with kv_bucket the decode steps share one
    spec (one plan); with 0 every step is a new one. Same tokens either way."""
    name = f"attnreg-test-bucket{bucket}"
    hf.register(backend="reference", name=name, kv_bucket=bucket)
    specs: list[Any] = []
    run = attnreg.Session.run

    def spy(self: Any, spec: Any, tensors: Any, **kw: Any) -> Any:
        specs.append(spec)
        return run(self, spec, tensors, **kw)

    monkeypatch.setattr(attnreg.Session, "run", spy)
    try:
        eager, ours = _pair("llama", name)
        ids, mask = _batch(seed=6)
        with torch.no_grad():
            kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
            assert torch.equal(ours.generate(ids, **kw), eager.generate(ids, **kw))
    finally:
        hf.unregister(name)
    decode = {sp for sp in specs if sp.seq_len == 1}
    assert len(decode) == (1 if bucket else 11), decode
    if bucket:
        (sp,) = decode
        assert sp.capacity == bucket and sp.seqlens_k


def test_right_padding_and_user_float_mask_fall_back_to_a_bias() -> None:
    eager, ours = _pair("llama", _backend("reference"))
    ids, _ = _batch(seed=4)
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0                                     # right padding: keys past 7 unseen
    with torch.no_grad():
        want, got = (m(ids, attention_mask=mask).logits for m in (eager, ours))
    _close(got[0], want[0])
    _close(got[1, :-4], want[1, :-4])
    # a token after the right-padded prompt: the padded keys sit mid-sequence, which only
    # the whole-mask bias can say (causal + lengths cannot)
    caches = [transformers.DynamicCache(config=m.config) for m in (eager, ours)]
    nxt = torch.tensor([[5], [7]])
    longer = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        for m, c in zip((eager, ours), caches):
            m(ids, attention_mask=mask, cache=c, use_cache=True)
        want, got = (m(nxt, attention_mask=longer, cache=c, use_cache=True).logits
                     for m, c in zip((eager, ours), caches))
    _close(got, want, what="decode step after right padding")
    # a caller's own 4-D additive mask passes through transformers unchanged
    s = ids.shape[1]
    custom = torch.zeros(2, 1, s, s)
    custom.masked_fill_(torch.ones(s, s, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    custom[0, 0, :, 2] += -1.5                           # any additive values
    with torch.no_grad():
        want, got = (m(ids, attention_mask=custom).logits for m in (eager, ours))
    _close(got, want)


# -- dtypes ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_dtypes_against_eager(dtype: str, backend: str) -> None:
    if backend != "reference" and not any(dtype in k.dtypes for k in attnreg.kernels(backend)):
        pytest.skip(f"no {dtype} kernel on {backend}")
    eager, ours = _pair("gpt_oss", _backend(backend), dtype)
    ids, mask = _batch(seed=5)
    with torch.no_grad():
        want = eager(ids, attention_mask=mask).logits.float()
        got = ours(ids, attention_mask=mask).logits
        ref = _eager("gpt_oss")(ids, attention_mask=mask).logits     # float32 weights
    assert got.dtype == getattr(torch, dtype)
    got = got.float()
    # eager rounds its softmax to the dtype, attnreg keeps float32 inside: both are within
    # the dtype's rounding of the float32 model, and of each other
    tol = {"float16": 2e-2, "bfloat16": 8e-2}[dtype]
    for what, rows in (("row 0", (0, slice(None))), ("row 1 real", (1, slice(3, None)))):
        _close(got[rows], want[rows], rtol=tol, what=f"{what} vs eager {dtype}")
        _close(got[rows], ref[rows], rtol=tol, what=f"{what} vs eager float32")


# -- what transformers does, and what is refused ----------------------------------------


def test_attention_only_registration_gets_no_mask_for_padded_batches() -> None:
    """Why register() installs a mask function: a name known only to AttentionInterface is
    handed attention_mask=None even for a left-padded batch."""
    from transformers.modeling_utils import AttentionInterface

    seen: list[Any] = []

    def spy(module: Any, q: Any, k: Any, v: Any, attention_mask: Any, **kw: Any) -> Any:
        seen.append(attention_mask)
        return q.transpose(1, 2).contiguous(), None

    AttentionInterface.register("attnreg-test-spy", spy)
    try:
        model = copy.deepcopy(_eager("llama"))
        model.set_attn_implementation("attnreg-test-spy")
        ids, mask = _batch()
        with torch.no_grad():
            model(ids, attention_mask=mask)
    finally:
        AttentionInterface._global_mapping.pop("attnreg-test-spy")
    assert seen and all(m is None for m in seen)


def test_refusals() -> None:
    _, ours = _pair("llama", _backend("reference"))
    ids, mask = _batch()
    with torch.no_grad(), pytest.raises(attnreg.SpecError, match="output_attentions"):
        ours(ids, attention_mask=mask, output_attentions=True)
    # backward: the forward runs, the gradient is refused, never silently zero
    logits = ours(ids, attention_mask=mask).logits
    with pytest.raises(attnreg.SpecError, match="no gradient"):
        logits.sum().backward()
    train = copy.deepcopy(ours)
    train.config.attention_dropout = 0.1
    for layer in train.model.layers:
        layer.self_attn.attention_dropout = 0.1
    train.train()
    with torch.no_grad(), pytest.raises(attnreg.SpecError, match="dropout"):
        train(ids, attention_mask=mask)
    with torch.no_grad(), pytest.raises(attnreg.SpecError, match=r"attention_mask\.shape"):
        ours(ids, attention_mask=torch.zeros(2, 1, 11, 9))
    for bad in ({"name": "sdpa"}, {"name": "my/attn"}, {"backend": "nope"},
                {"flags": {"no_such_flag": 1}}):
        with pytest.raises(attnreg.SpecError):
            hf.register(**bad)
    with pytest.raises(attnreg.SpecError):
        hf.unregister("never-registered")


def test_bare_attention_call_without_a_mask() -> None:
    """No mask (a bare module call): causal from module.is_causal when S == L, checked
    against torch's sdpa; a causal call with 1 < S < L is ambiguous and refused."""
    from transformers.modeling_utils import AttentionInterface

    fn = AttentionInterface._global_mapping[_name("reference")]
    module = torch.nn.Module()
    module.is_causal = True
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 6, 16, generator=g)
    k, v = torch.randn(2, 2, 6, 16, generator=g), torch.randn(2, 2, 6, 16, generator=g)
    with torch.no_grad():
        got, _ = fn(module, q, k, v, None, scaling=0.3)
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=0.3, enable_gqa=True).transpose(1, 2)
        _close(got, want)
        with pytest.raises(attnreg.SpecError, match="attention_mask"):
            fn(module, q[:, :, :2], k, v, None, scaling=0.3)


def test_register_several_names_and_sessions() -> None:
    assert hf.registered()[_name("reference")] == ("reference", {})
    s = hf.session(_name("reference"))
    assert isinstance(s, attnreg.Session) and s.backend == "reference"
    hf.register(backend="reference", name="attnreg-test-extra")
    try:
        eager, ours = _pair("llama", "attnreg-test-extra")
        ids, mask = _batch()
        with torch.no_grad():
            _close(ours(ids, attention_mask=mask).logits[0], eager(ids, attention_mask=mask).logits[0])
    finally:
        hf.unregister("attnreg-test-extra")
    assert "attnreg-test-extra" not in hf.registered()


def test_left_padding_becomes_kv_start_and_v_may_have_its_own_head_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A left-padded batch reaches attnreg as kv_start (no bias is built); a direct call with
    a V head size other than K's runs as v_head_size, against torch's own math."""
    _, ours = _pair("llama", _backend("reference"))
    seen: list[attnreg.AttentionSpec] = []
    sess = hf.session(_name("reference"))
    real = sess.run

    def spy(spec: attnreg.AttentionSpec, tensors: Any, **kw: Any) -> Any:
        seen.append(spec)
        if spec.kv_start:
            assert tensors["kv_start"].tolist() == [0, 3]
        return real(spec, tensors, **kw)

    monkeypatch.setattr(sess, "run", spy)
    ids, mask = _batch()
    with torch.no_grad():
        ours(ids, attention_mask=mask)
    assert seen and all(s.kv_start and not s.bias for s in seen)
    fn = transformers.modeling_utils.AttentionInterface()[_name("reference")]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 5, 4, 16, generator=g).transpose(1, 2)      # [B, Nq, S, H] views
    k = torch.randn(2, 2, 7, 16, generator=g)
    v = torch.randn(2, 2, 7, 24, generator=g)
    module = ours.model.layers[0].self_attn
    out, _ = fn(module, q, k, v, None, scaling=0.25, dropout=0.0, is_causal=False)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    want = torch.softmax(q @ kk.transpose(-1, -2) * 0.25, dim=-1) @ vv      # [B, Nq, S, Hv]
    assert seen[-1].v_head_size == 24
    _close(out, want.transpose(1, 2), rtol=1e-5, what="v_head_size 24 against torch")
