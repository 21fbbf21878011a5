"""The conformance matrix's feature-cell families beyond the single features (tools.cases
calls them for a kernel on a device): quantized K/V storages, the shapes real models need,
right-padded prompts, two-sided windows, and the full matrix's sweeps of head sizes,
lengths and rows."""

from __future__ import annotations

from typing import Any, Protocol

from .. import headpad
from ..spec import AttentionSpec
from . import cells
from .cells import everything_fields
from .nonfinite_cells import CellMaker


class FeatureMaker(CellMaker, Protocol):
    """What these families need of the generator of one kernel's cells on one device (the
    cases module's generator is one): nonfinite_cells' CellMaker and the feature cells'
    own."""

    quick: bool
    split: bool                      # the kernel writes split-KV partial states
    slots: dict[str, int]            # dtype -> its (variant, dtype) index in the family

    def base(self) -> dict[str, Any]: ...

    def add(self, label: str, changes: dict[str, Any], **kw: Any) -> None: ...


def quantized_cells(g: FeatureMaker, d: dict[str, Any], split: tuple[tuple[str, Any], ...]) -> None:
    """Each quantized K/V storage the kernel reads (KernelInfo.kv_dtypes): its codes and
    scales with poisoned (NaN-scaled) vectors past every length, paged pools with
    unused poisoned pages, both layouts, every feature at once, and tails."""
    sup = g.k.supports
    s = int(g.base()["seq_len"])
    for kv in sorted(g.k.kv_dtypes):
        q = {**d, "kv_dtype": kv}
        lens = {"seqlens_k": True, "kv_capacity": 96, "causal": True, "past_len": 96 - s} \
            if {"seqlens_k", "kv_capacity"} <= sup else {}
        g.add(kv, {**q, **lens}, params=split, lengths=(96, 40) if lens else None)
        if "paged" in g.k.kv_layouts and lens:
            g.add(f"{kv}-paged16", {**q, **lens, "kv_layout": "paged", "page_size": 16,
                                    "num_pages": 2 * 6 + 3}, params=split,
                  lengths=(96, 40))
        everything = everything_fields(sup)
        g.add(f"{kv}-all", {**q, **everything, "past_len": 90 - s, "q_layout": "BNSH",
                            "kv_layout": "BNSH"}, params=split,
              lengths=(90, 33) if "seqlens_k" in everything else None)
        if g.partials_ok():
            g.add(f"{kv}-partials", {**q, "causal": True}, params=split, check="partial")
        if not g.quick:
            g.add(f"{kv}-layouts", {**q, "q_layout": "BSNH", "kv_layout": "BNSH",
                                    "past_len": 61}, params=split)
            tile = int(g.k.defaults.get("kv_tile", 64))
            for total in sorted({tile - 1, tile + 1, 1029}):
                rows = min(s, total)
                g.add(f"{kv}-L{total}", {**q, "batch": 1, "seq_len": rows,
                                         "past_len": total - rows, "causal": True},
                      params=split)


def model_cells(g: FeatureMaker, d: dict[str, Any], split: tuple[tuple[str, Any], ...],
                only_all: bool = False) -> None:
    """The shapes real models need (docs/contract.md "Shapes real models need"), where the
    kernel implements them: every one at once with every other feature, right-padded prompt
    batches (seqlens_q with no past), head sizes 320 and 512, MLA's q/k 576 with v 512; the
    full matrix adds each alone and their partial states. (In the quick matrix, for one dtype
    of the kernel; ``only_all``: the first cell only.)"""
    sup = g.k.supports
    s, model = model_fields(g)
    if not model:
        return
    g.add("model-all", {**d, **everything_fields(sup), **model, "seq_len": s,
                        "past_len": 90 - s, "q_layout": "BNSH", "kv_layout": "BSNH"},
          params=split, lengths=(90, 33) if "seqlens_k" in sup else None, rerun=True)
    if only_all:
        return
    if {"seqlens_q", "seqlens_k"} <= sup:
        g.add("right-padded", {**d, "seqlens_q": True, "seqlens_k": True, "seq_len": s,
                               "past_len": 0, "causal": True}, params=split,
              lengths=(s, 1))
    mla_k, mla_v = cells.MLA_HEADS
    mla = "v_head_size" in model and g.k.family != "reduce" \
        and g.k.head_size_ok(mla_k) and g.k.v_head_size_ok(mla_v)
    for big in (320, 512):
        if big == 512 and mla and g.quick:
            continue        # the quick matrix's largest heads are the MLA cell's
        if g.k.head_size_ok(big):
            bv = big // 2 if "v_head_size" in model and g.k.v_head_size_ok(big // 2) \
                else big
            g.add(f"h{big}", {**d, **model, "head_size": big, "batch": 1,
                              "num_heads": 2, "seq_len": s, "past_len": 40,
                              "causal": True, "v_head_size": bv}, params=split, fit=True)
    if mla:
        # MLA's decode shape: q/k past 512, one KV head for the group (the reduce's rows
        # are v's, which h512 covers)
        g.add("mla", {**d, **model, "head_size": mla_k, "v_head_size": mla_v,
                      "batch": 1, "num_heads": 4, "kv_num_heads": 1, "seq_len": s,
                      "past_len": 24, "causal": True}, params=split, fit=True)
    if g.quick:
        return
    for f, v in model.items():
        lens = {"seqlens_k": True, "kv_capacity": 96, "past_len": 96 - s} \
            if "seqlens_k" in sup else {}
        g.add(f.replace("_", ""), {**d, f: v, "seq_len": s, "causal": True, **lens},
              params=split, lengths=(96, 40) if lens else None)
        if g.partials_ok():
            g.add(f"{f.replace('_', '')}-partials", {**d, f: v, "seq_len": s,
                                                     "causal": True, "head_sink": "head_sink" in sup},
                  params=split, check="partial")
    if "paged" in g.k.kv_layouts and "seqlens_k" in sup:
        g.add("model-paged5", {**d, **model, "seq_len": s, "past_len": 96 - s,
                               "kv_layout": "paged", "page_size": 5, "num_pages": 45,
                               "seqlens_k": True, "kv_capacity": 96, "causal": True},
              params=split, lengths=(96, 40))


def padded_cells(g: FeatureMaker, d: dict[str, Any], split: tuple[tuple[str, Any], ...]) -> None:
    """Head sizes off the kernel's steps (k 13, v 5: every kernel's step is a power of
    two >= 4), run through zero padding (attnreg/headpad.py) with the kernel forced:
    what the padding must keep exact -- the scale of the asked size, zero columns in
    every layout, the output cut back -- with every feature the kernel has at once."""
    if g.quick and g.slots.get(d["dtype"], 1) != 0:
        return      # quick: the padding is the registry's, one cell per family and device
    if g.k.head_size_ok(13) and g.k.v_head_size_ok(5):
        return      # takes any head size (the reference): nothing to pad
    sup = g.k.supports
    fields = {**g.base(), **d, **everything_fields(sup), "head_size": 13,
              "past_len": 90 - int(g.base()["seq_len"])}
    if "v_head_size" in sup:
        fields["v_head_size"] = 5
    try:
        spec = AttentionSpec(**fields)
    except ValueError:
        return
    check = "reduce" if g.k.family == "reduce" else "attention"
    # the kernel runs it at its own step's sizes (planning it here would cost more)
    step = g.k.head_sizes[2]
    up = headpad.padded_spec(spec, -(-13 // step) * step, -(-spec.head_size_v // step) * step)
    if g.runs(up, {**dict(split), **g.emu}) and g.plannable(up, check, dict(split)):
        g.emit("padded", spec, dict(split), check=check, feature="head_padding",
               lengths=(90, 33) if spec.seqlens_k else None,
               mask_frac=0.1 if spec.bias else 0.0)


def model_fields(g: FeatureMaker) -> tuple[int, dict[str, Any]]:
    """The model cells' row count and the model shapes the kernel implements."""
    base = g.base()
    s = max(int(base["seq_len"]), 3)
    h = int(base["head_size"])
    hv = next((x for x in (h + 16, h // 2, h + 8, 2 * h) if g.k.v_head_size_ok(x)), h)
    return s, {f: v for f, v in (("kv_start", True), ("seqlens_q", True),
                                 ("v_head_size", hv)) if f in g.k.supports}


def window_cells(g: FeatureMaker, d: dict[str, Any], split: tuple[tuple[str, Any], ...]) -> None:
    """Two-sided windows (docs/contract.md "Every head size, two-sided windows"), where the
    kernel implements them: a right window without causal masking, with the left window, the
    model shapes and every other feature at once, in the model-all cell's shape (its programs:
    a run, not a compile), with NaN planted just right of a row's window and around it (a
    non-finite cell: testing.plant_nonfinite); the full matrix adds right_window 0 alone
    (exactly causal), with the left window alone, and partial states. (The causal "all" cells
    carry a right window too, which must change nothing.) Reduce kernels never see positions:
    none there."""
    sup = g.k.supports
    if "right_window" not in sup or g.k.family == "reduce":
        return
    # At least 3 rows and right window 1: the first row of a decode row tile cannot see
    # the last key (a window as wide as the rows would hide nothing from anyone).
    s, model = model_fields(g)
    blocks = bool(g.k.params.get("block_skip"))
    g.add("window2-all", {**d, **everything_fields(sup), **model, "causal": False,
                          "right_window": 1, "seq_len": s, "past_len": 90 - s,
                          "q_layout": "BNSH", "kv_layout": "BSNH"},
          params=split, lengths=(90, 33) if "seqlens_k" in sup else None,
          nonfinite=True, docs=2 if blocks else 0, doc_values=blocks,
          feature="right_window")
    if g.quick:
        return
    g.add("rightwindow", {**d, "right_window": 0, "seq_len": s}, params=split)
    g.add("window2", {**d, "right_window": 1, "local_window": 9, "seq_len": s},
          params=split)
    if g.partials_ok():
        g.add("window2-partials", {**d, "right_window": 1, "local_window": 20,
                                   "seq_len": s}, params=split, check="partial")


def sweeps(g: FeatureMaker, d: dict[str, Any], split: tuple[tuple[str, Any], ...]) -> None:
    """Head sizes, row counts and key counts around tile edges (the full matrix)."""
    k = g.k
    for h in cells.HEAD_SIZES:
        if h != g.base()["head_size"]:
            g.add("heads", {**d, "head_size": h, "batch": 1, "num_heads": 2,
                            "past_len": 40}, params=split)
    tile = int(k.defaults.get("kv_tile", 64))
    for total in sorted({1, tile - 1, tile, tile + 1, 2 * tile + 1, 1029}):
        s = min(g.base()["seq_len"], total)
        g.add(f"L{total}", {**d, "batch": 1, "seq_len": s, "past_len": total - s,
                            "causal": True}, params=split)
    if g.split:
        m = int(k.params.get("m_tile", 1))
        for s in sorted({1, 2, 3, 4, 5, m + 1} - {m}):
            g.add(f"S{s}", {**d, "seq_len": s, "causal": True}, params=split)
    if g.partials_ok():
        g.add("partials", {**d, "causal": True, "local_window": 20},
              params=split, check="partial")
    if k.family == "prefill":
        for s in (1, 2, 5, 97):
            g.add(f"S{s}", {**d, "seq_len": s, "causal": True})
