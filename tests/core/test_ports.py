"""The ports table (attnreg/ports.py) describes the buffers as the contract has them: every
input port's shape and dtype are those of the tensors a spec takes, the ports a launch
returns are shaped like the reference backend's results, and one buffer name means one
buffer in every family and language."""

from __future__ import annotations

import numpy as np
import pytest

import attnreg
from attnreg import kernel, ports
from tests.support import make_tensors

_BASE = dict(batch=2, seq_len=3, past_len=29, num_heads=4, kv_num_heads=2, head_size=32)
SPECS = {
    "all-f32": attnreg.AttentionSpec(**_BASE, bias=True, seqlens_k=True, head_sink=True,
                                     return_lse=True),
    "int8-hv64-bnsh": attnreg.AttentionSpec(**_BASE, dtype="float16", kv_dtype="int8",
                                            v_head_size=64, q_layout="BNSH", kv_layout="BNSH",
                                            seqlens_k=True),
    "int4-paged": attnreg.AttentionSpec(**{**_BASE, "head_size": 64}, dtype="float16",
                                        kv_dtype="int4", kv_layout="paged", page_size=8,
                                        num_pages=9, seqlens_k=True, return_lse=True),
    "model-bf16": attnreg.AttentionSpec(**_BASE, dtype="bfloat16", seqlens_k=True,
                                        kv_start=True, seqlens_q=True, head_sink=True),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_input_ports_are_the_tensors_a_spec_takes(name: str) -> None:
    spec = SPECS[name]
    tensors = make_tensors(spec, 1)
    inputs = {p.name: p for p in ports.bound("decode_partial", spec, {})
              if p.access == "read" and p.shape is not None}
    assert set(inputs) == set(tensors), name
    for tensor, arr in tensors.items():
        port = inputs[tensor]
        assert port.shape_for(spec) == arr.shape, tensor
        assert port.dtype(spec) == arr.dtype.name, tensor
        assert port.nbytes(spec) == arr.nbytes, tensor


@pytest.mark.parametrize("name", sorted(SPECS))
def test_result_ports_are_shaped_like_the_reference_results(name: str) -> None:
    spec = SPECS[name]
    t = make_tensors(spec, 2)
    split = 8
    n = -(-spec.capacity // split)
    with attnreg.Session(backend="reference") as s:
        got = s.run(spec, t)
        o_parts, lse_parts = s.partial_states(spec, t, split_size=split)
    out = got[0] if spec.return_lse else got
    launch = ports.written(("decode_partial", "reduce"), spec, ports.WGSL)
    want = {p.name: p for p in ports.results("attention", launch)}
    assert set(want) == ({"out", "lse"} if spec.return_lse else {"out"})
    assert want["out"].shape_for(spec, n) == out.shape
    assert want["out"].dtype(spec) == out.dtype.name
    if spec.return_lse:
        assert want["lse"].shape_for(spec, n) == got[1].shape
    parts = {p.name: p for p in ports.results("partial", launch)}
    assert [*parts] == ["o_parts", "lse_parts"]
    assert parts["o_parts"].shape_for(spec, n) == np.shape(o_parts)
    assert parts["lse_parts"].shape_for(spec, n) == np.shape(lse_parts)


def test_each_route_allocates_what_its_stages_write() -> None:
    spec = SPECS["all-f32"]
    for lang in (ports.WGSL, ports.OPENCL):
        def names(*fams: str, lang: str = lang) -> list[str]:
            return [p.name for p in ports.written(fams, spec, lang)]
        assert names("prefill") == ["out", "lse"]
        assert names("decode_partial", "reduce") == ["o_parts", "lse_parts", "out", "lse"]
        assert names("decode_qk", "decode_pv", "reduce") == \
            ["scores", "stats", "o_parts", "lse_parts", "out", "lse"]
        assert names("decode_partial") == ["o_parts", "lse_parts"]
        assert names("reduce") == ["out", "lse"]      # the partial states come in
    assert [p.name for p in ports.written(("prefill",), SPECS["int8-hv64-bnsh"], ports.WGSL)] \
        == ["out"]                                    # no lse without return_lse
    fused = ports.written(("decode_fused",), spec, ports.OPENCL)
    assert [p.name for p in fused] == ["o_parts", "lse_parts", "tickets", "out", "lse"]
    assert [p.name for p in ports.results("attention", fused)] == ["out", "lse"]


def test_one_name_is_one_buffer() -> None:
    seen: dict[str, ports.Port] = {}
    for family in kernel.FAMILIES:
        for p in ports.TABLE[family]:
            first = seen.setdefault(p.name, p)
            assert (p.kind, p.shape, p.when, p.var) == \
                (first.kind, first.shape, first.when, first.var), (family, p.name)
    assert set(ports.TABLE) == set(kernel.FAMILIES)


def test_binding_bytes_cover_every_buffer_a_kernel_binds() -> None:
    # decode_pv binds q, k and the bias beside what it reads most (WGSL binds every input of
    # attn_common.wgsl), so a device limit applies to them there too
    spec = SPECS["all-f32"]
    sizes = kernel.binding_bytes("decode_pv", spec, {"n_splits": 4})
    assert sizes["q"] == 2 * 3 * 4 * 32 * 4
    assert sizes["bias"] == sizes["scores"] == 2 * 4 * 3 * 32 * 4
    assert sizes["o_parts"] == 2 * 4 * 3 * 4 * 32 * 4
    assert "block_table" not in sizes and "k_scale" not in sizes
    quant = kernel.binding_bytes("decode_qk", SPECS["int4-paged"], {"n_splits": 1})
    assert quant["k"] == 9 * 8 * 2 * 32           # int4: two codes a byte
    assert quant["k_scale"] == 9 * 8 * 2 * 2 * 2    # a float16 scale per 32 elements
    assert quant["block_table"] == 2 * 4 * 4
