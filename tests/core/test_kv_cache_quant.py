"""Quantized KV caches (kv_dtype int8 / int4) that quantize on append, on the device, in the
BSNH, BNSH and paged layouts: the codes and scales every backend writes against
attnreg.quantize_kv on the same data, attention over them (the reference backend reads
quantized K/V today), codes written on one backend read by another, the paged cache's own
block table, and the bad inputs a cache refuses."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attnreg
from attnreg.testing import compare, expected
from tests.support import require_devices

BACKENDS = ("reference", "webgpu", "dawn", "opencl")
LAYOUTS = ("BSNH", "BNSH", "paged")
B, NKV, NQ, H, C, PAGE = 2, 2, 4, 64, 40, 8
STEPS = (5, 1, 11)                       # a prompt, a token, a chunk: three appends


def _session(backend: str) -> attnreg.Session:
    require_devices(backend)
    return attnreg.Session(backend=backend)


def _cache(s: attnreg.Session, kv_dtype: str | None, layout: str, dtype: str = "float16",
           head_size: int = H, **kw: Any) -> attnreg.KVCache:
    if layout == "paged":
        kw.setdefault("page_size", PAGE)
    return s.kv_cache(batch=B, kv_num_heads=NKV, head_size=head_size, capacity=C, dtype=dtype,
                      layout=layout, kv_dtype=kv_dtype, **kw)


def _fill(cache: attnreg.KVCache, seed: int, dtype: str = "float16"
          ) -> tuple[np.ndarray, np.ndarray]:
    """Append STEPS tokens; return everything appended, k and v [B, L, Nkv, H]."""
    rng = np.random.default_rng(seed)
    ks, vs = [], []
    for s in STEPS:
        shape = (B, s, NKV, cache.head_size)
        ks.append((rng.standard_normal(shape) * 3).astype(dtype))
        vs.append(rng.standard_normal((*shape[:3], cache.head_size_v)).astype(dtype))
        cache.append(ks[-1], vs[-1])
    return np.concatenate(ks, 1), np.concatenate(vs, 1)


def _tokens(cache: attnreg.KVCache, stored: np.ndarray) -> np.ndarray:
    """A downloaded k / v / scale tensor as [B, L, Nkv, ...], token by token."""
    n = int(cache.lengths.max())
    if cache.layout == "BSNH":
        return stored[:, :n]
    if cache.layout == "BNSH":
        return stored[:, :, :n].swapaxes(1, 2)
    assert cache.block_table is not None and cache.page_size is not None
    table = cache.block_table.numpy()
    pos = np.arange(n)
    slots = table[:, pos // cache.page_size] * cache.page_size + pos % cache.page_size
    return stored.reshape(-1, *stored.shape[2:])[slots]


def _nibbles(codes: np.ndarray) -> np.ndarray:
    return np.concatenate([codes & 15, codes >> 4], -1).astype(np.int64)


def check_codes(kv_dtype: str, got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Codes equal quantize_kv's except at exact ties: a tiny count, each one code off."""
    a, b = (_nibbles(got), _nibbles(want)) if kv_dtype == "int4" else \
        (got.astype(np.int64), want.astype(np.int64))
    diff = np.abs(a - b)
    assert diff.max(initial=0) <= 1 and (diff != 0).sum() <= max(2, diff.size // 10000), \
        f"{what}: {(diff != 0).sum()} codes differ (max {diff.max()})"


def check_scales(kv_dtype: str, got: np.ndarray, want: np.ndarray, what: str) -> None:
    """int8: float32 a / 127, correctly rounded in-kernel -> equal (1 ulp allowed, the
    contract's bound); int4: float16 of m / -8, rounded to nearest even -> exactly equal."""
    if kv_dtype == "int4":
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), what
    else:
        assert np.all(np.abs(got - want) <= np.spacing(want)), what


def _check_cache(cache: attnreg.KVCache, k_all: np.ndarray, v_all: np.ndarray) -> None:
    kvd = cache.kv_dtype
    assert kvd is not None and cache.k_scale is not None and cache.v_scale is not None
    for name, x, codes, scales in (("k", k_all, cache.k, cache.k_scale),
                                   ("v", v_all, cache.v, cache.v_scale)):
        want_c, want_s = attnreg.quantize_kv(x, kvd)
        check_codes(kvd, _tokens(cache, codes.numpy()), want_c, f"{name} codes")
        check_scales(kvd, _tokens(cache, scales.numpy()), want_s, f"{name} scales")


def _host_tensors(cache: attnreg.KVCache, q: np.ndarray) -> dict[str, np.ndarray]:
    return {n: (t.numpy() if isinstance(t, attnreg.DeviceTensor) else t)
            for n, t in cache.tensors(q).items()}


def _check_attention(cache: attnreg.KVCache, k_all: np.ndarray, v_all: np.ndarray,
                     seed: int) -> None:
    """Attention over the cache's tensors (downloaded, on the reference backend) equals the
    reference over quantize_kv of what was appended: the cache holds every token."""
    spec = cache.spec(num_heads=NQ, seq_len=2)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(spec.q_shape).astype(spec.dtype)
    with np.errstate(over="ignore", invalid="ignore"):   # unwritten memory past the lengths
        got = attnreg.run(spec, _host_tensors(cache, q), backend="reference")
    flat = spec.replace(kv_layout="BSNH", page_size=None, num_pages=None)
    host: dict[str, Any] = {"q": q, "seqlens_k": cache.lengths.copy()}
    shapes = {"k": (flat.kv_shape, flat.kv_code_shape, flat.kv_scale_shape),
              "v": (flat.v_shape, flat.v_code_shape, flat.v_scale_shape)}
    if cache.kv_dtype is None:
        for name, x in (("k", k_all), ("v", v_all)):
            full = np.zeros(shapes[name][0], x.dtype)
            full[:, :x.shape[1]] = x
            host[name] = full
    else:
        for name, x in (("k", k_all), ("v", v_all)):
            codes, scales = attnreg.quantize_kv(x, cache.kv_dtype)
            full_c = np.zeros(shapes[name][1], codes.dtype)
            full_s = np.zeros(shapes[name][2], scales.dtype)
            full_c[:, :x.shape[1]], full_s[:, :x.shape[1]] = codes, scales
            host[name], host[f"{name}_scale"] = full_c, full_s
    _, problem = compare(spec, got, expected(flat, host))
    assert not problem, problem


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_append_quantizes_on_the_device(backend: str, kv_dtype: str, layout: str) -> None:
    with _session(backend) as s:
        cache = _cache(s, kv_dtype, layout)
        before = s.device_runtime(cache.k.device_id).counters["host_uploads"]
        k_all, v_all = _fill(cache, seed=len(layout) + len(kv_dtype))
        assert list(cache.lengths) == [sum(STEPS)] * B
        if backend != "reference":
            # one staging upload per append, plus seqlens (and block-table pages when paged)
            uploads = s.device_runtime(cache.k.device_id).counters["host_uploads"] - before
            assert uploads <= len(STEPS) * (2 + 2 * (layout == "paged")), uploads
        _check_cache(cache, k_all, v_all)
        if backend == "reference":
            # the reference reads the cache's own tensors
            spec = cache.spec(num_heads=NQ)
            q = np.ones(spec.q_shape, np.float16)
            np.testing.assert_array_equal(s.run(spec, cache.tensors(q)),
                                          attnreg.run(spec, _host_tensors(cache, q),
                                                      backend="reference"))
        _check_attention(cache, k_all, v_all, seed=3)


@pytest.mark.parametrize(("kv_dtype", "layout"), [(None, "BNSH"), ("int4", "paged"),
                                                  ("int8", "BSNH")])
@pytest.mark.parametrize("backend", ("reference", "webgpu", "opencl"))
def test_v_head_size_cache(backend: str, kv_dtype: str | None, layout: str) -> None:
    """A cache whose v vectors are longer than k's (v_head_size 96 with H 64): both are
    stored (and quantized, each with its own width) token by token."""
    with _session(backend) as s:
        cache = _cache(s, kv_dtype, layout, v_head_size=96)
        assert cache.v.shape[-1] == (48 if kv_dtype == "int4" else 96)
        k_all, v_all = _fill(cache, seed=11)
        assert v_all.shape[-1] == 96 and cache.spec(num_heads=NQ).head_size_v == 96
        if kv_dtype is not None:
            _check_cache(cache, k_all, v_all)
        _check_attention(cache, k_all, v_all, seed=5)
        with pytest.raises(attnreg.SpecError, match="Hv=96"):
            cache.append(k_all[:, :1], k_all[:, :1])


@pytest.mark.parametrize("backend", ("webgpu", "opencl"))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_input_dtypes(backend: str, dtype: str) -> None:
    with _session(backend) as s:
        for kv_dtype in ("int8", "int4"):
            cache = _cache(s, kv_dtype, "BSNH", dtype=dtype, head_size=96)
            k_all, v_all = _fill(cache, seed=11, dtype=dtype)
            _check_cache(cache, k_all, v_all)


def _edge_values(dtype: str) -> np.ndarray:
    """Zero vectors, exact ties, equal magnitudes of both signs, large and tiny values,
    [B, 4, Nkv, H]."""
    x = np.zeros((B, 4, NKV, H), np.float32)
    x[0, 1] = np.arange(H) - H / 2                     # int8: x/s lands on halves
    x[0, 2, :, ::2] = 8.0
    x[0, 2, :, 1::2] = -8.0                            # |+8| == |-8|: the first one wins
    x[0, 3, :, :32] = np.linspace(-1, 1, 32) * 2.5     # int4 ties: multiples of s / 2
    x[1, 0] = 1e4 * np.sign(np.sin(np.arange(H)))
    x[1, 1] = 3e-3 * np.cos(np.arange(H))              # small int4 scales
    x[1, 2, :, 5] = 1.0                                # one non-zero element per vector
    x[1, 3] = np.random.default_rng(1).standard_normal((NKV, H))
    return x.astype(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_edge_values(backend: str) -> None:
    with _session(backend) as s:
        for kv_dtype in ("int8", "int4"):
            cache = _cache(s, kv_dtype, "BNSH")
            x = _edge_values("float16")
            cache.append(x, -x)
            _check_cache(cache, x, -x)


def test_codes_agree_across_backends() -> None:
    """The same tokens quantized by webgpu, dawn and opencl give the same bytes; webgpu's
    codes run on the reference backend give what the reference's own cache gives."""
    got: dict[str, list[np.ndarray]] = {}
    for backend in ("reference", "webgpu", "dawn", "opencl"):
        with _session(backend) as s:
            got[backend] = []
            for kv_dtype in ("int8", "int4"):
                cache = _cache(s, kv_dtype, "paged")
                _fill(cache, seed=21)
                got[backend] += [_tokens(cache, t.numpy()) for t in (
                    cache.k, cache.v, cache.k_scale, cache.v_scale)]   # written tokens only
                if backend == "webgpu":
                    spec = cache.spec(num_heads=NQ)
                    q = np.random.default_rng(2).standard_normal(spec.q_shape).astype(np.float16)
                    got["webgpu_out"] = [attnreg.run(spec, _host_tensors(cache, q),
                                                     backend="reference")]
                    got["q"] = [q]
    for backend in ("webgpu", "dawn", "opencl"):
        for a, b in zip(got[backend], got["reference"]):
            assert a.tobytes() == b.tobytes(), backend
    with attnreg.Session(backend="reference") as s:
        cache = _cache(s, "int4", "paged")
        _fill(cache, seed=21)
        spec = cache.spec(num_heads=NQ)
        np.testing.assert_array_equal(s.run(spec, cache.tensors(got["q"][0])), got["webgpu_out"][0])


# -- paging ----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ("reference", "webgpu"))
def test_float_paged_cache(backend: str) -> None:
    """An unquantized paged cache: tokens written through the owned table, attention on
    the backend itself matches the reference over the same tokens."""
    with _session(backend) as s:
        cache = _cache(s, None, "paged", dtype="float32")
        k_all, v_all = _fill(cache, seed=4, dtype="float32")
        assert cache.block_table is not None
        table = cache.block_table.numpy()
        n_pages = -(-sum(STEPS) // PAGE)
        assert sorted(table[:, :n_pages].reshape(-1)) == list(range(B * n_pages))
        _check_attention(cache, k_all, v_all, seed=5)
        spec = cache.spec(num_heads=NQ)
        q = np.random.default_rng(6).standard_normal(spec.q_shape).astype(np.float32)
        _, problem = compare(spec, s.run(spec, cache.tensors(q)),
                             expected(spec, _host_tensors(cache, q)))
        assert not problem, problem


def test_pages_are_assigned_released_and_rolled_back(monkeypatch: pytest.MonkeyPatch) -> None:
    with attnreg.Session(backend="reference") as s:
        cache = _cache(s, "int8", "paged", num_pages=7)
        x = np.ones((B, 9, NKV, H), np.float16)
        cache.append(x, x)                                 # 2 pages each
        assert cache.block_table is not None and len(cache.free_pages) == 3
        with pytest.raises(attnreg.SpecError, match="free pages"):
            cache.append(np.ones((B, 16, NKV, H), np.float16), np.ones((B, 16, NKV, H), np.float16))
        table = cache.block_table.numpy().copy()

        def boom(*a: Any, **k: Any) -> None:
            raise RuntimeError("device lost")
        monkeypatch.setattr(s.device_runtime(cache.k.device_id), "quantize_into", boom)
        with pytest.raises(RuntimeError):
            cache.append(x, x)                             # would take 2 more pages
        assert len(cache.free_pages) == 3 and list(cache.lengths) == [9, 9]
        np.testing.assert_array_equal(cache.block_table.numpy(), table)
        monkeypatch.undo()
        cache.release(0)
        assert len(cache.free_pages) == 5 and list(cache.lengths) == [0, 9]
        cache.append(x, x)
        assert list(cache.lengths) == [9, 18]
        with pytest.raises(attnreg.SpecError, match="batch index"):
            cache.release(B)


def test_caller_block_table() -> None:
    with attnreg.Session(backend="reference") as s:
        table = np.arange(B * 5, dtype=np.int32)[::-1].reshape(B, 5).copy()
        cache = _cache(s, "int4", "paged", block_table=table)
        k_all, v_all = _fill(cache, seed=8)
        _check_cache(cache, k_all, v_all)
        _check_attention(cache, k_all, v_all, seed=9)
        shared = np.zeros((B, 5), np.int32)                # both sequences on page 0
        cache = _cache(s, "int4", "paged", block_table=shared)
        x = np.ones((B, 1, NKV, H), np.float16)
        with pytest.raises(attnreg.SpecError, match="written twice"):
            cache.append(x, x)
        with pytest.raises(attnreg.SpecError, match="block_table"):
            _cache(s, "int4", "paged", block_table=table[:, :3])
        bad = table.copy()
        bad[1, 0] = 99
        cache = _cache(s, "int8", "paged", block_table=bad)
        with pytest.raises(attnreg.SpecError, match=r"block_table\[1, 0\]"):
            cache.append(x, x)


# -- bad inputs ------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ("reference", "webgpu", "opencl"))
def test_bad_appends(backend: str) -> None:
    with _session(backend) as s:
        cache = _cache(s, "int4", "BSNH")
        ok = np.ones((B, 2, NKV, H), np.float16)
        for k_new, field in ((ok.astype(np.float32), "k_new"), (ok[:, :, :1], "k_new"),
                             (np.ones((B, C + 1, NKV, H), np.float16), r"k_new\.shape\[1\]")):
            with pytest.raises(attnreg.SpecError, match=field):
                cache.append(k_new, np.ones(k_new.shape, k_new.dtype))
        for bad in (np.nan, np.inf, -np.inf):
            v = ok.copy()
            v[1, 0, 1, 7] = bad
            with pytest.raises(attnreg.SpecError, match=r"v_new\[1, 0, 1, 7\].*finite"):
                cache.append(ok, v)
        assert list(cache.lengths) == [0, 0]
        with pytest.raises(attnreg.SpecError, match="kv_dtype"):
            _cache(s, "int4", "BSNH", head_size=48)
        with pytest.raises(attnreg.SpecError, match="kv_dtype"):
            _cache(s, "int3", "BSNH")
        with pytest.raises(attnreg.SpecError, match="page_size"):
            _cache(s, "int8", "BSNH", page_size=4)


def test_head_sizes_a_kernel_cannot_store() -> None:
    """int8 codes are stored in 32-bit words on WebGPU: H % 4 != 0 is refused there (naming
    the field, the value and why); OpenCL stores bytes and takes it."""
    refused = pytest.raises(attnreg.SpecError, match=r"kv_dtype.*head_size % 4 == 0")
    with _session("webgpu") as s, refused:
        _cache(s, "int8", "BSNH", head_size=6)
    with _session("opencl") as s:
        cache = _cache(s, "int8", "BNSH", head_size=6)
        k_all, v_all = _fill(cache, seed=12)
        _check_cache(cache, k_all, v_all)


def test_runtime_that_cannot_quantize_says_why() -> None:
    """A runtime that cannot quantize (the browser: its tensors live on the host and travel
    with each launch) says so through quantize_refusal: a quantized cache is refused with a
    SpecError naming kv_dtype and giving that reason, before any buffer is allocated."""
    with _session("browser") as s:
        rt = s.device_runtime(s.home_device())
        with pytest.raises(attnreg.SpecError, match=r"kv_dtype.*no on-device quantizer"):
            _cache(s, "int8", "BSNH")
        assert rt.counters["allocs"] == 0


def test_byte_tensors() -> None:
    """int8 / uint8 / bfloat16 DeviceTensors. WebGPU writes 1-byte tensors in whole words (its
    memory's write granule): a write off the word that does not reach the end is refused
    there; host memory writes any byte."""
    for backend in ("reference", "webgpu"):
        with _session(backend) as s:
            a = np.arange(-7, 6, dtype=np.int8)               # 13 bytes: not a word multiple
            t = s.tensor(a)
            np.testing.assert_array_equal(t.numpy(), a)
            t.write(np.full(5, 3, np.int8), 8)                # reaches the end
            assert list(t.numpy()[8:]) == [3] * 5
            if backend == "webgpu":
                with pytest.raises(attnreg.SpecError, match=r"offset_elems.*4-byte boundaries"):
                    t.write(np.ones(2, np.int8), 1)
            else:
                t.write(np.ones(2, np.int8), 1)
                assert list(t.numpy()[:4]) == [-7, 1, 1, -4]
            bf = np.linspace(-2, 2, 6).astype("bfloat16")
            np.testing.assert_array_equal(s.tensor(bf).numpy(), bf)
