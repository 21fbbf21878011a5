"""Non-finite conformance cells (docs/contract.md "Non-finite values and scalar fields"), for
attnreg.tools.cases.

Per (kernel, dtype) one cell with every feature the kernel implements, causal, several query
rows (a key can be visible to the last row only), seqlens_k, a window and a bias, and NaN /
inf planted where some rows see them and others do not (testing.plant_nonfinite; reduce
kernels: non-finite partial states, conformance.nonfinite_partials). The reference says
which rows and components turn NaN; NaN must appear exactly there and every other value
match it. Kernels that write partial states get a second cell through the partial route.

The cells take the shape of the kernel's "all" cell (head size, GQA group, layouts, page
size, bias broadcast: what backends compile into programs), so they add runs, not programs.
Nothing here names a backend.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..kernel import KernelInfo
from ..spec import AttentionSpec
from .cells import Case, dtype_rank

TOTAL = 90                      # capacity; batch 1 holds 47 keys (seqlens_k)
# (spec field, value, the contract feature the kernel must implement for it)
FIELDS = (("bias", True, "bias"), ("seqlens_k", True, "seqlens_k"),
          ("kv_capacity", TOTAL, "kv_capacity"), ("local_window", 30, "local_window"),
          ("softcap", 5.0, "softcap"), ("alibi_max_bias", 4.0, "alibi"),
          ("head_sink", True, "head_sink"), ("return_lse", True, "return_lse"))


class CellMaker(Protocol):
    """What these cells need of the generator of one kernel's cells on one device (the cases
    module's generator is one)."""

    k: KernelInfo
    out: list[Case]                  # the cells so far; emit appends
    emu: dict[str, Any]              # the parameters an emulated build adds

    def partials_ok(self) -> bool: ...

    def runs(self, spec: AttentionSpec, params: dict[str, Any]) -> bool: ...

    def plannable(self, spec: AttentionSpec, check: str, params: dict[str, Any]) -> bool: ...

    def emit(self, label: str, spec: AttentionSpec, params: dict[str, Any], **kw: Any) -> None: ...


def nonfinite_cells(g: CellMaker) -> None:
    """Emit the non-finite cells of g's kernel (after its feature and covering cells)."""
    k = g.k
    for dtype in sorted(k.dtypes, key=dtype_rank):
        mine = [c for c in g.out if c.spec.dtype == dtype]
        tpl = next((c for c in mine if c.feature in ("all", "docs-everything")),
                   mine[0] if mine else None)
        if tpl is None:
            continue
        t = tpl.spec
        m = int(k.params.get("m_tile", 1))
        rows = {"prefill": 33, "reduce": 3}.get(k.family, 2 * m)
        if k.max_seq_len is not None:
            rows = min(rows, k.max_seq_len)
        fields: dict[str, Any] = dict(
            batch=2, seq_len=rows, past_len=TOTAL - rows, num_heads=t.num_heads,
            kv_num_heads=t.kv_num_heads, head_size=t.head_size, dtype=dtype,
            q_layout=t.q_layout, kv_layout=t.kv_layout, causal=True)
        fields.update({f: v for f, v, feat in FIELDS if feat in k.supports})
        if t.kv_layout == "paged" and t.page_size:
            fields.update(page_size=t.page_size, num_pages=2 * -(-TOTAL // t.page_size) + 3)
        try:
            spec = AttentionSpec(**fields)
        except ValueError:
            continue
        bias_shape = None
        if spec.bias and tpl.bias_shape is not None:      # the template's broadcast
            full = (spec.batch, spec.num_heads, spec.seq_len, spec.capacity)
            bias_shape = tuple(1 if n == 1 else f for n, f in zip(tpl.bias_shape[:3], full)) \
                + (spec.capacity,)
        params = {n: v for n, v in tpl.params if n not in g.emu}
        blocks = bool(k.params.get("block_skip"))
        checks = [tpl.check if k.family == "reduce" else "attention"]
        if g.partials_ok():
            checks.append("partial")
        for check in checks:
            if not g.runs(spec, {**params, **g.emu}) or not g.plannable(spec, check, params):
                continue
            g.emit("nonfinite", spec, params, check=check, kind="nonfinite",
                   feature="nonfinite", nonfinite=True,
                   lengths=(TOTAL, 47) if spec.seqlens_k else None, bias_shape=bias_shape,
                   docs=2 if blocks else 0, doc_values=blocks)
