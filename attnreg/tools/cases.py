"""Conformance cells, generated from the registry (attnreg.tools.conformance runs them).

Every registered kernel x every available device of its backend x its dtypes becomes cells
with readable ids such as ``webgpu-llvmpipe-decode_partial-f16-m4-gqa4-h32-causal``. Each
cell forces its kernel, so vendor-tuned and fallback variants run on whatever device can
execute them; a kernel whose device lacks a feature it needs runs under its declared
``KernelInfo.emulation`` params, as an ordinary forced kernel. Four kinds of cells:

- feature cells: a small base problem with one contract feature (layout, GQA ratio, paged
  KV, ...) changed at a time, and all at once; the full matrix adds head sizes, lengths
  around the kernel's tiles, row counts and partial states.
- covering cells: one per input recipe of ``recipes.contract_features`` (``document_features``
  with its document masks for block-skipping kernels) per dtype, while the other axes rotate
  (rotation.Rotation): q/kv layouts (paged pools with page sizes 16/5/1/32 where the kernel reads
  them), GQA 1/4/7, head sizes 32..256, seq_len 1..97, and total lengths 1, +-1 around the
  kernel's own kv tiles, and > 1000. Every kernel meets every run-time value; the values
  backends compile into programs (head size, page size) are spread over a family's kernels,
  a few per (kernel, dtype), since compiling dominates a cell's cost. Kernels that write
  partial states alternate attention and partial-state checks (partial states against the
  reference's, then reduced); reduce kernels reduce the reference's partials with NaN in
  the o of empty splits.
- non-finite cells (tools.nonfinite_cells): per (kernel, dtype) one cell, two through the
  partial route too where the kernel writes partial states, with NaN / inf planted where
  some rows see them and others do not; the reference says which rows turn NaN.
- profile cells: the plan of every stored device profile, forced on a device here.
- interop cells (tools.interop_cells): per family, a covering cell run on the caller's device
  object and buffers, recorded into the caller's command stream, where the backend runs on
  device objects.

The quick matrix (CI) leaves out the full matrix's sweeps, and gives a kernel that runs
emulated on a device its covering cells only.

Nothing here names a backend: a new kernel or plugin is covered without editing this file.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import registry as regmod
from ..caps import DeviceCaps
from ..errors import NoKernelError
from ..kernel import SPLIT_FAMILIES, KernelInfo
from ..spec import AttentionSpec
from . import cells, recipes
from . import feature_families as families
from .cells import Case, dtype_rank, emulation_params, everything_fields, unique, variant_ranks
from .interop_cells import interop_cells
from .nonfinite_cells import nonfinite_cells
from .profile_cells import profile_cases
from .rotation import Rotation


@dataclass
class _Gen:
    """The feature and covering cells of one kernel on one device."""

    k: KernelInfo
    dev: DeviceCaps
    quick: bool
    rank: int = 0               # the kernel's variant among its family's (rotation offset)
    slots: dict[str, int] = field(default_factory=dict)   # dtype -> its (variant, dtype) index
    out: list[Case] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.emu = emulation_params(self.k, self.dev)
        self.split = self.k.family in SPLIT_FAMILIES

    # -- shared ------------------------------------------------------------------------
    def head(self, preferred: int = cells.SMALL_HEAD) -> int | None:
        if self.k.head_size_ok(preferred):
            return preferred
        ok = [h for h in cells.HEAD_SIZES if self.k.head_size_ok(h)]
        lo, hi, _ = self.k.head_sizes
        return ok[0] if ok else (lo if lo <= hi else None)

    def base(self) -> dict[str, Any]:
        dtype = sorted(self.k.dtypes)[0]
        m = int(self.k.params.get("m_tile", 1))
        s = {"prefill": 33, "reduce": 3}.get(self.k.family, m)
        if self.k.max_seq_len is not None:
            s = min(s, self.k.max_seq_len)
        return dict(batch=2, seq_len=s, past_len=70, num_heads=4, kv_num_heads=2,
                    head_size=self.head() or 1, dtype=dtype, causal=False)

    def runs(self, spec: AttentionSpec, params: dict[str, Any]) -> bool:
        return not self.k.not_supported_reasons(spec, self.dev, params)

    def emit(self, label: str, spec: AttentionSpec, params: dict[str, Any], **kw: Any) -> None:
        check = kw.pop("check", "reduce" if self.k.family == "reduce" else "attention")
        self.out.append(Case(self.dev.backend, self.dev.id, self.dev.slug, self.k.id,
                             self.k.family, check, label, spec,
                             tuple(sorted({**params, **self.emu}.items())),
                             emulated=bool(self.emu), seed=len(self.out), **kw))

    # -- feature cells -----------------------------------------------------------------
    def add(self, label: str, changes: dict[str, Any], **kw: Any) -> None:
        fields = {**self.base(), **changes}
        try:
            spec = AttentionSpec(**fields)
        except ValueError:
            return
        params = dict(kw.pop("params", ()))
        fit = kw.pop("fit", False)
        if not self.runs(spec, {**params, **self.emu}):
            # with fit: at the tiles the rules shrink to where the defaults do not fit (the
            # head sizes past 256); else outside the kernel's declared support: not a cell
            fitted = self._fitted_tiles(spec, params) if fit else None
            if fitted is None:
                return
            params.update(fitted)
        if kw.pop("bias_bcast", False):
            kw["bias_shape"] = (1, spec.num_heads, 1, spec.capacity)
        kw.setdefault("mask_frac", 0.1 if spec.bias else 0.0)
        kw.setdefault("feature", label)
        self.emit(label, spec, params, **kw)

    def feature_cells(self) -> None:
        k, sup = self.k, self.k.supports
        split = (("split_size", int(k.defaults.get("kv_tile", 16))),) if self.split else ()
        for dtype in sorted(k.dtypes):
            d = {"dtype": dtype}
            self.add("plain", d, params=split)
            if "causal" in sup:
                self.add("causal", {**d, "causal": True}, params=split, rerun=True)
            if "bias" in sup:
                self.add("bias", {**d, "bias": True}, params=split)
                self.add("bias-bcast", {**d, "bias": True}, params=split, bias_bcast=True)
                if "return_lse" in sup:
                    self.add("masked-rows", {**d, "bias": True, "return_lse": True},
                             params=split, mask_rows="corners")
            if {"seqlens_k", "kv_capacity"} <= sup:
                self.add("seqlens", {**d, "seqlens_k": True, "kv_capacity": 96, "causal": True},
                         params=split, lengths=(96, 40))
            for feat, ch in (("local_window", {"local_window": 9, "causal": True}),
                             ("softcap", {"softcap": 4.0}), ("alibi", {"alibi_max_bias": 8.0}),
                             ("head_sink", {"head_sink": True}), ("return_lse", {"return_lse": True})):
                if feat in sup:
                    self.add(feat.replace("_", ""), {**d, **ch}, params=split)
            self.add("layouts", {**d, "q_layout": "BNSH", "kv_layout": "BSNH"}, params=split)
            if "paged" in k.kv_layouts:
                # (96, 3): a sequence shorter than one page (at least seq_len keys)
                short = max(3, int(self.base()["seq_len"]))
                for ps, lens in ((16, (96, 40)), (5, (96, short))):
                    self.add(f"paged{ps}", {**d, "kv_layout": "paged", "page_size": ps,
                                            "num_pages": 2 * -(-96 // ps) + 3, "seqlens_k": True,
                                            "kv_capacity": 96, "causal": True},
                             params=split, lengths=lens)
            if "gqa" in sup:
                self.add("mqa", {**d, "num_heads": 7, "kv_num_heads": 1}, params=split)
                self.add("gqa4", {**d, "num_heads": 8, "kv_num_heads": 2}, params=split)
            self.add("mha", {**d, "num_heads": 2, "kv_num_heads": 2}, params=split)
            everything = everything_fields(sup)
            self.add("all", {**d, **everything, "q_layout": "BNSH", "kv_layout": "BSNH"},
                     params=split, lengths=(90, 33) if "seqlens_k" in everything else None,
                     rerun=True)
            # the quick matrix reads each quantized storage and the model shapes through one
            # dtype of the kernel (its first): what they add is the K/V reader and the
            # row/key bounds, which every dtype shares; the full matrix has them all
            if not self.quick or dtype == min(k.dtypes, key=dtype_rank):
                families.quantized_cells(self, d, split)
                families.model_cells(self, d, split)
                families.padded_cells(self, d, split)
                families.window_cells(self, d, split)
            if not self.quick:
                families.sweeps(self, d, split)

    def partials_ok(self) -> bool:
        # Block-skipping splits share out the listed blocks instead of following split_size,
        # so their partial states are not the contract's.
        return self.k.family in cells.PARTIAL_FAMILIES and not self.k.params.get("block_skip")

    # -- covering cells ----------------------------------------------------------------
    def covering_cells(self) -> None:
        """One cell per recipe and dtype: slot n = dtype x recipe (Rotation picks its axes)."""
        k = self.k
        recipes_of = recipes.document_features if k.params.get("block_skip") \
            else recipes.contract_features
        n_rec = len(recipes_of(1, 1, 1, 1))
        rot = Rotation(k, self.head() or 1, self.rank)
        for dtype in sorted(k.dtypes, key=dtype_rank):
            di = dtype_rank(dtype)[0]
            for fi in range(n_rec):
                n = di * n_rec + fi
                h, g, ps = rot.shape(n * cells.SHAPES_PER_DTYPE // n_rec,
                                     self.slots.get(dtype, self.rank + di))
                s, total = rot.lengths(n)
                big = s >= cells.BIG_ROWS or total >= cells.BIG_TOTAL
                nkv = 1 if g == 7 or big else 2
                b = 2 if h <= 96 and not big else 1
                tag, changes, make, masked = recipes_of(b, nkv * g, s, total)[fi]
                cap = int(changes.get("kv_capacity", total))
                ql, kl, kv_tag = rot.layout(ps)
                fields: dict[str, Any] = dict(
                    batch=b, seq_len=s, past_len=total - s, num_heads=nkv * g, kv_num_heads=nkv,
                    head_size=h, dtype=dtype, q_layout=ql, kv_layout=kl, **changes)
                if kl == "paged":
                    fields.update(page_size=ps, num_pages=b * -(-cap // ps) + 3)
                params: dict[str, Any] = {}
                if k.family == "reduce" or self.split or k.family in cells.PARTIAL_FAMILIES:
                    params["split_size"] = max(int(rot.split_unit * rot.split_factor(n)),
                                               -(-cap // cells.MAX_SPLITS))
                check = "reduce" if k.family == "reduce" else \
                    "partial" if self.partials_ok() and (n + self.rank) % 2 else "attention"
                spec = self._fit(fields, params)
                if spec is not None and check == "attention" and self.partials_ok() \
                        and not self.plannable(spec, check, params):
                    check = "partial"      # the same recipe through the partial route
                if spec is None or not self.plannable(spec, check, params):
                    continue
                for stored in cells.storages(spec, make.get("stored", ())):
                    self.emit(f"s{spec.seq_len}-L{total}-{ql.lower()}-{kv_tag}-{tag}", spec,
                              params, check=check, kind="covering", feature=tag,
                              bias_shape=make.get("bias_shape"),
                              mask_frac=make.get("mask_frac", 0.0), stored=stored,
                              docs=int(make.get("docs", 0)), doc_values=bool(make.get("doc_values")),
                              mask_rows="first" if masked else "", rerun=tag == "all")

    def _fit(self, fields: dict[str, Any], params: dict[str, Any]) -> AttentionSpec | None:
        """The rotated spec, with the tunables the rules fit to this device where the
        defaults do not fit (stored in ``params``: the cell runs what it declares), or at
        halved head sizes where nothing fits: the same code at a size the device holds."""
        try:
            spec = AttentionSpec(**fields)
        except ValueError:
            return None
        while not self.runs(spec, {**params, **self.emu}):
            fitted = self._fitted_tiles(spec, params)
            if fitted is not None:
                params.update(fitted)
                return spec
            smaller = spec.head_size // 2
            if smaller < 16 or not self.k.head_size_ok(smaller):
                return None
            spec = spec.replace(head_size=smaller)
        return spec

    def _fitted_tiles(self, spec: AttentionSpec, params: dict[str, Any]) -> dict[str, Any] | None:
        """The tunables the registry's rules give this kernel for spec, if they make it fit."""
        try:
            plan = regmod.get().plan(spec, caps=self.dev, kernel=self.k.id,
                                     params={**params, **self.emu})
        except NoKernelError:
            return None
        stage = next(st for st in plan.stages if st.kernel == self.k.id)
        tiles = {n: stage.params[n] for n in self.k.defaults
                 if n in stage.params and stage.params[n] != self.k.defaults[n]}
        return tiles if self.runs(spec, {**params, **tiles, **self.emu}) else None

    def plannable(self, spec: AttentionSpec, check: str, params: dict[str, Any]) -> bool:
        """A kernel that does not start its route runs behind stages the rules choose; where
        they choose parameters no kernel of that family has, the registry cannot build the
        route and there is no cell for this kernel (the first stage's own cells cover it)."""
        if self.k.family in cells.FIRST_FAMILIES or self.k.family == "reduce":
            return True
        op = "partial" if check == "partial" else "attention"
        try:
            regmod.get().plan(spec, op=op, caps=self.dev, kernel=self.k.id,
                              params={**params, **self.emu})
        except NoKernelError:
            return False
        return True

    def generate(self) -> list[Case]:
        # An emulated build compiles anew for every program and runs slower; in the quick
        # matrix its covering cells (every recipe per dtype) stand for the kernel, with one
        # cell of every model shape at once (the recipes have none) where it implements them.
        if not (self.quick and self.emu):
            self.feature_cells()
        else:
            split = (("split_size", int(self.k.defaults.get("kv_tile", 16))),) \
                if self.split else ()
            first = {"dtype": min(self.k.dtypes, key=dtype_rank)}
            families.model_cells(self, first, split, only_all=True)
            families.padded_cells(self, first, split)
            families.window_cells(self, first, split)
        self.covering_cells()
        nonfinite_cells(self)
        return self.out


def cases(devices: Iterable[DeviceCaps] | None = None, *, backend: str | None = None,
          quick: bool = False, kernels: Sequence[KernelInfo] | None = None) -> list[Case]:
    """All cells for the available devices (optionally one backend)."""
    reg = regmod.get()
    devs = [d for d in (devices if devices is not None else reg.devices(backend)) if d.available]
    out: list[Case] = []
    for dev in devs:
        mine = [k for k in (kernels if kernels is not None else reg.kernels(dev.backend))
                if k.backend == dev.backend]
        ranks, slots = variant_ranks(mine)
        for k in mine:
            out += _Gen(k, dev, quick, ranks[k.id], slots[k.id]).generate()
    out += interop_cells(out)
    if kernels is None:
        out += profile_cases(devs)[0]
    return list(unique(out))


def uncovered(all_cases: Sequence[Case], devices: Iterable[DeviceCaps]) -> dict[str, str]:
    """Registered kernels with no cell on any of the given devices, and why (their reasons
    on a plain spec)."""
    reg = regmod.get()
    have = {c.kernel for c in all_cases}
    out = {}
    devs = [d for d in devices if d.available]
    for k in reg.kernels():
        mine = [d for d in devs if d.backend == k.backend]
        if k.id in have or not mine:
            continue
        g = _Gen(k, mine[0], True)
        spec = AttentionSpec(**g.base())
        out[k.id] = "; ".join(k.not_supported_reasons(spec, mine[0], g.emu)) or "no case generated"
    return out
