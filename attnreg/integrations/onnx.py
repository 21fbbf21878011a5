"""Run ONNX attention nodes with attnreg: the standard ``Attention`` op (opset 23-25) and
com.microsoft ``GroupQueryAttention`` and ``MultiHeadAttention``, as ONNX Runtime computes them.

>>> spec, how = spec_from_node(node, {name: array, ...})       # doctest: +SKIP
>>> outputs = how.outputs(attnreg.run(spec, how.tensors))     # doctest: +SKIP
>>> outputs = run_node(node, inputs, backend="webgpu")        # the same, in one call  # doctest: +SKIP

``node`` is an ``onnx.NodeProto`` (onnx is imported only here, lazily; without it every call
raises SpecError naming the package). ``inputs`` maps the node's input names to arrays, or is
a sequence of arrays (None for absent ones) in the node's input order. The outputs come back
in the op's order: output, present_key, present_value (None where the node names no output).
float32, float16 and bfloat16 inputs are taken (ORT's CPU EP runs float32 and float16 of these
ops; attnreg's GPU kernels run bfloat16 only on the reference backend so far).

Mapping rules (checked against onnxruntime 1.32's CPU EP in tests/integrations/test_onnx.py):

- Heads. Packed [B, S, N*H] inputs become [B, S, N, H] views (q_layout / kv_layout BSNH, no
  copy); 4-D ``Attention`` Q [B, N, S, H] is q_layout BNSH and Y comes back in that layout.
  Packed QKV (GQA: query [B, S, (Nq+2Nkv)*H]; MHA: [B, S, N, 3, H]) and MHA's packed KV
  [B, T, N, 2, H] are split into views (ORT's CPU EP implements neither MHA packing; the
  tests compare them with ORT on the unpacked equivalent). MHA's 4-D key/value are BNSH
  cross-attention K/V, used as they are. ``q_num_heads`` / ``kv_num_heads`` / ``num_heads``
  give the head counts.
- V head size. Where the op lets V's head size Hv differ from K's it becomes ``v_head_size``
  and the output has Hv: Attention (V [B, Nkv, T, Hv] or [B, T, Nkv*Hv], past_value
  [B, Nkv, P, Hv]; Y [B, Nq, S, Hv] or [B, S, Nq*Hv]) and MHA's 3-D value [B, T, N*Hv]
  (projection bias [2*N*H + N*Hv], present_value [B, N, T, Hv]; output [B, S, N*Hv]). MHA's
  past_value, 4-D and packed K/V have one head size in ORT's op (its CPU EP refuses another),
  and GQA has one head size: those are refused.
- KV cache. past_key/past_value are BNSH [B, Nkv, P, H]; present = past followed by the new
  K/V (a host concatenation, BNSH) and attention reads present. GQA: ``seqlens_k[b]`` is the
  total length - 1, so attnreg's seqlens_k = value + 1 (L_b); batch entry b's new rows go at
  P_b = L_b - S_b, after past[:P_b] (S_b = S unless right-padded, below); present has capacity
  max(total_sequence_length, P) (ORT's shared-buffer mode, where past already has the maximum
  length, is the same rule) and becomes ``kv_capacity``; present rows at or beyond L_b are 0
  (ORT's CPU EP zero-fills them too when past and present are separate buffers). A GQA call is
  a first prompt when S == total_sequence_length.
- Right-padded prompts use seqlens_q. A GQA first prompt with seqlens_k + 1 < S is
  right-padded (row i at position i): S_b = L_b = seqlens_k[b] + 1 (seqlens_q and seqlens_k),
  rows i >= S_b are padding (0) and their K/V stay out of present. GQA's ``query_seqlens``
  (ORT's right-padded chunk: Q_b valid rows after P_b = seqlens_k + 1 - Q_b cached ones) is
  seqlens_q = Q_b with L_b = T_b = seqlens_k + 1: only the valid rows enter present (at P_b), rotary
  positions are P_b + i or ``position_ids`` (all of [B, S]), and total_sequence_length is only
  an upper bound; ORT's rules are checked (causal=1, past_key given, Q_b <= min(S, T_b), T_b
  <= total_sequence_length, P_b <= past length, P_b + S <= capacity). Q_b = 0 is an idle
  entry: its cache is kept and its output is 0 (attnreg runs one row for it, which
  ``how.outputs`` zeroes; ``how.idle`` lists them). The standard Attention op and MHA define
  no query-side length (MHA's [3B+2] key_padding_mask carries cumulative query starts of
  packed sequences, which ORT's CPU EP ignores; refused).
- Causal. ORT's frontier is "row i sees j <= i + offset": offset = P (past given), or
  nonpad_kv_seqlen[b] - S (Attention with an external cache), or 0 (neither: top-left, also
  when K is longer than Q). attnreg's causal is bottom-right (p_i = L_b - S_b + i); the two
  agree when the new K length equals S (S_b with seqlens_q), and then spec.causal is used;
  otherwise the frontier becomes a -inf bias (with the windows, below). ``is_causal``
  (Attention), ``causal`` (GQA, default 1), ``unidirectional`` (MHA: refused unless the new
  key length equals S, because ORT's mask for cross lengths matches neither alignment). ORT
  1.32 departs from ONNX in one case: with past_key, a single query row and several new keys,
  it attends every key (ONNX: j <= P); that node is refused as ambiguous. Fewer keys than
  query rows (cross-attention): K/V are padded to S zero keys that the bias masks (attnreg's
  queries are the last S of >= S keys).
- ``local_window_size`` = W > 0 (GQA) is attnreg's ``local_window`` = W: ORT 1.32 keys a row
  at position p to j in (p - W, p], the same as attnreg (measured; older ORT used W + 1 keys).
- Windows (Attention, opset 25). ONNX: a row at position p = i + offset (offset as for the
  causal frontier above: P, nonpad_kv_seqlen[b] - S, or 0) sees keys p - left_window_size
  <= j <= p + right_window_size, each bound only when >= 0 (-1: that side unbounded), with
  or without ``is_causal`` (which still hides j > p). The row's own key is not counted in
  ``left_window_size`` but is in attnreg's ``local_window`` (j > p - W: W keys ending at the
  row's own), so local_window = left_window_size + 1 (0: the row's own key and those to its
  right only) and right_window = right_window_size (0 with is_causal=0: exactly causal). A
  bound that no key can reach (at least total + S) is none (-1). When the offset is
  attnreg's bottom-right one (offset = L_b - S) these are the spec's fields; otherwise the
  windows (with the causal frontier) become a -inf bias at ONNX's positions. Values below
  -1 are refused.
- Masks. Attention's bool ``attn_mask`` (True = attend) becomes a 0/-inf bias, a float one
  (float32 or the inputs' dtype) is added; it has 1 to 4 dims, broadcast as numpy does
  (ONNX), and a last dim shorter than total is padded with -inf (ONNX; ORT's CPU EP refuses
  such masks). GQA/MHA ``attention_bias`` [B|1, N|1, S, total] is
  the bias (GQA's columns are absolute positions). ``nonpad_kv_seqlen`` and MHA's 1-D
  ``key_padding_mask`` (key lengths) become seqlens_k where every length is in [S, C] (and,
  for MHA, not causal: ORT's MHA keeps the causal offset at P whatever the padding), else a
  -inf bias; 2-D/3-D ``key_padding_mask`` (0 = padding) is a -inf bias (left padding: below).
- Left padding. A bool attn_mask or 2-D/3-D key_padding_mask that, for each batch entry b,
  hides exactly the keys j < start_b of the existing ones (j below the valid length) from
  every row and head, and leaves at least one key, is ``kv_start`` = start_b and no bias
  (checked element for element; anything else, one element off included, stays a bias); one
  that hides no existing key is dropped.
- Scalars. ``scale`` 0 or absent is 1/sqrt(H); ``softcap`` 0 is off (applied before the
  mask, like ORT); GQA's ``smooth_softmax`` is an all-zero head_sink and its ``head_sink``
  input is attnreg's head_sink (ORT uses it with or without smooth_softmax); MHA's projection
  ``bias`` is added to q, k, v on the host.
- Rotary (GQA ``do_rotary``): applied to q and the new k on the host with cos_cache/sin_cache
  [max_seq, rotary_dim/2] (rotary_dim <= H; half-split or ``rotary_interleaved``), positions
  P_b + i (0..S-1 on a first prompt) or ``position_ids`` (refused on a first prompt,
  where ORT reads only its first element), in float32 and rounded to the dtype (float16
  present_key bit-identical to ORT's on the tests' cases, float32 within a few ulp).

Specs that use v_head_size, kv_start or seqlens_q run on the backends whose kernels
implement those fields; elsewhere the plan raises attnreg.NoKernelError saying so.

Known differences from ORT (documented, tested): padding query rows (rows i >= S_b above)
are 0 in attnreg. ORT's CPU EP computes a right-padded first prompt's padding row i as an
ordinary row at position i over the L_b valid keys (not 0) and leaves the padding rows' K/V
in present beyond L_b (attnreg: 0 there); with ``query_seqlens`` ORT's padding rows are
unspecified (our runs saw 0 and other values). A query row with no visible key is 0 in
attnreg (docs/contract.md "The math"). The standard Attention op and GQA give 0 too, but ORT's MHA
adds ``mask_filter_value`` (-10000) for key_padding_mask instead of masking, so a row whose keys
are all padding gets about the softmax over those padded keys, and an all -inf ``attention_bias``
row gives NaN; attnreg gives 0 in both cases. Rows with a visible key agree (exp(-10000)
underflows).

Refused with SpecError (field, value, what is expected): the qk / output_qk /
qk_matmul_output outputs (attnreg never materialises scores) and a non-zero GQA ``qk_output``;
Attention's ``qk_matmul_output_mode`` 0-3 only says what qk_matmul_output would hold, so with
that output not asked for any of them runs (ONNX's own qk_matmul_output node tests pass that
way, tests/integrations/test_onnx_node_suite.py); quantized GQA caches (k_scale, v_scale, *_quant_type), the
``sliding_window_cache`` layout, q/k_norm_weight, ``query_seqlens`` outside ORT's rules;
MHA's ``past_sequence_length`` shared-buffer mode and ``cache_indirection``, 1-D [3B+2]
key_padding_mask; integer attn_mask types; unknown attributes; V head size != K head size in
GQA, and in MHA with past_key/past_value or 4-D key/value; any shape, dtype or value out of
range.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import SpecError
from ..spec import AttentionSpec
from ._onnx_common import Inputs, NodeRun, read_node
from ._onnx_gqa import GQA_IN, map_gqa
from ._onnx_ops import ATTENTION_IN, MHA_IN, map_attention, map_mha

__all__ = ["NodeRun", "run_node", "spec_from_node"]

_OPS = {("", "Attention"): (ATTENTION_IN, map_attention),
        ("ai.onnx", "Attention"): (ATTENTION_IN, map_attention),
        ("com.microsoft", "GroupQueryAttention"): (GQA_IN, map_gqa),
        ("com.microsoft", "MultiHeadAttention"): (MHA_IN, map_mha)}


def spec_from_node(node: Any, inputs: Mapping[str, Any] | Sequence[Any]
                   ) -> tuple[AttentionSpec, NodeRun]:
    """The AttentionSpec of one ONNX attention node and ``how`` to run it.

    ``how.tensors`` is what ``attnreg.run(spec, ...)`` takes (views of the inputs where the
    layout allows, host-built present K/V, masks turned into a bias); ``how.outputs(out)``
    gives the node's outputs in the op's order; ``how.rules`` says which mapping rules fired.
    The spec depends on input values (seqlens_k, lengths, masks), so pass the arrays.
    """
    n = read_node(node)
    key = (n.domain, n.op)
    if key not in _OPS:
        raise SpecError("node.op_type", f"{n.domain or 'ai.onnx'}::{n.op}",
                        "Attention (ai.onnx, opset 23+), com.microsoft::GroupQueryAttention or "
                        "com.microsoft::MultiHeadAttention")
    names, mapper = _OPS[key]
    return mapper(n, Inputs(n, names, inputs))


def run_node(node: Any, inputs: Mapping[str, Any] | Sequence[Any], backend: str | None = None,
             session: Any = None, flags: Mapping[str, Any] | None = None
             ) -> list[np.ndarray | None]:
    """Run one ONNX attention node with attnreg: the node's outputs in the op's order.

    ``session`` (an attnreg.Session) is used when given, else ``attnreg.run`` on ``backend``.
    """
    spec, how = spec_from_node(node, inputs)
    if session is not None:
        out = session.run(spec, how.tensors, flags=flags)
    else:
        from ..api import run  # the module-level default sessions
        out = run(spec, how.tensors, backend=backend, flags=flags)
    return how.outputs(out)
