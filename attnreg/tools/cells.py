"""A conformance cell (a kernel on a device for one spec, input recipe and check), what makes
two cells the same, and the axes the generator in attnreg.tools.cases draws cells from."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..caps import DeviceCaps
from ..kernel import ROUTES, KernelInfo
from ..spec import AttentionSpec
from ..tensors import accepted_dtypes

HEAD_SIZES = (32, 64, 80, 96, 128, 256)
SMALL_HEAD = 32
# MLA's decode shape (DeepSeek-V2/V3): q/k head size 576 (512 latent + 64 rope), v 512.
MLA_HEADS = (576, 512)
SEQ_LENS = (1, 2, 3, 4, 5, 33, 97)
GQA = (1, 4, 7)
LAYOUTS = (("BSNH", "BNSH"), ("BNSH", "BSNH"), ("BSNH", "BSNH"), ("BNSH", "BNSH"))
PAGE_SIZES = (16, 5, 1, 32)
# The covering cells' KV layout kinds for kernels that read paged pools: a page size, or 0
# for a contiguous cache; a family's new shapes take them in turn.
KV_KINDS = (0, 16, 5, 0, 1, 32)
# Shapes (head size, GQA group, KV kind: what backends compile into a program) per (kernel,
# dtype) of the covering cells. Compiling dominates a cell's cost on CPU devices (lavapipe,
# PoCL, SwiftShader), so the shape changes only every few cells, and all but NEW_SHAPES of
# them keep the feature cells' head size and contiguous cache (their programs, one per GQA
# group); a family's kernels together meet every head size and page size.
SHAPES_PER_DTYPE = 3
NEW_SHAPES = 1
# Covering cells with this many rows or keys run one batch entry and one KV head (their
# cost is rows x keys; the other cells cover batches and KV heads).
BIG_ROWS, BIG_TOTAL = 33, 1000
MAX_SPLITS = 32
LONG_TOTALS = (1025, 1500)
# Tile edges for kernels that declare no kv_tile (reduce, reference): the usual tiles.
FALLBACK_TILES = (16, 32, 64)
# Split sizes of the covering cells, in units of the kernel's smallest kv tile: whole tiles,
# split edges inside a tile, and one split past most totals.
SPLIT_FACTORS = (1.0, 1.5, 2.5, 4.0)
# Families whose kernels write split-KV partial states (the registry's partial routes).
PARTIAL_FAMILIES = frozenset({ROUTES["split_kv"][0], *ROUTES["split_kv_unfused"][:2]})
# Families that start their route; a forced kernel of another family (decode_pv) gets the
# stages before it from the rules.
FIRST_FAMILIES = frozenset(fams[0] for fams in ROUTES.values())
DTYPE_ORDER = ("float32", "float16", "bfloat16")
DT_TAGS = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Case:
    """One cell: a kernel on a device for one spec, input recipe and check."""

    backend: str
    device: str                 # DeviceCaps.id
    slug: str                   # short device name for ids
    kernel: str
    family: str
    check: str                  # "attention" | "partial" | "reduce"
    label: str
    spec: AttentionSpec
    params: tuple[tuple[str, Any], ...] = ()
    lengths: tuple[int, ...] | None = None
    bias_shape: tuple[int, ...] | None = None   # None: the full [B, Nq, S, C]
    mask_frac: float = 0.0      # fraction of bias entries set to -inf
    # tensors stored in another dtype than make_tensors gives them, as (name, dtype): one of
    # the dtypes the checks accept (tensors.STORED_AS; see storages)
    stored: tuple[tuple[str, str], ...] = ()
    mask_rows: str = ""         # "corners": batch 0 row 0 and the last row; "first": row 0
    docs: int = 0               # > 0: a block-diagonal document mask (recipes.doc_mask)
    doc_values: bool = False    # the mask keeps the bias values inside a document
    rerun: bool = False         # also run twice and require bitwise-identical results
    nonfinite: bool = False     # NaN / inf planted (testing.plant_nonfinite; reduce: partials)
    emulated: bool = False      # params include the kernel's emulation
    kind: str = "feature"       # "feature" | "covering" | "nonfinite" | "profile" | "interop"
    # run on the caller's device object, buffers and command stream (tools.interop_cells)
    interop: bool = False
    feature: str = ""           # the contract feature or recipe the cell exercises
    seed: int = 0

    @property
    def variant(self) -> str:
        parts = self.kernel.split(".")[2:]
        return ".".join(p for p in parts if p not in DT_TAGS.values()) or "base"

    @property
    def id(self) -> str:
        dt = DT_TAGS.get(self.spec.dtype, self.spec.dtype)
        parts = [self.backend, self.slug, self.family, dt, self.variant + "-emu" * self.emulated,
                 f"gqa{self.spec.group_size}", f"h{self.spec.head_size}", self.label]
        if self.check != self.family and self.check != "attention":
            parts.append(self.check)
        return "-".join(parts)

    @property
    def key(self) -> tuple[Any, ...]:
        """What makes two cells the same test (labels and seeds aside)."""
        return (self.device, self.kernel, self.check, self.spec, self.params, self.lengths,
                self.bias_shape, self.mask_frac, self.stored, self.mask_rows, self.docs,
                self.doc_values, self.rerun, self.nonfinite, self.interop)


def emulation_params(k: KernelInfo, dev: DeviceCaps) -> dict[str, Any]:
    """The params cells of ``k`` carry on ``dev``: its emulation where the device lacks a
    feature the kernel needs (Session.reduce_states takes no params: reduce kernels never
    run emulated), else none."""
    if k.features <= dev.features or not k.emulation or k.family == "reduce":
        return {}
    return dict(k.emulation)


def kv_tiles(k: KernelInfo) -> tuple[int, ...]:
    """The kernel's kv tile sizes: its default and the values the rules may choose."""
    vals = {k.defaults.get("kv_tile"), *k.choices.get("kv_tile", ())}
    return tuple(sorted(int(t) for t in vals if t)) or FALLBACK_TILES


def tile_totals(k: KernelInfo) -> tuple[int, ...]:
    """Total lengths the covering cells rotate through: 1, each kv tile (and twice the
    largest) +-1, and the long ones."""
    tiles = kv_tiles(k)
    edges = {*tiles, 2 * max(tiles)}
    return tuple(sorted({1, *(e + d for e in edges for d in (-1, 0, 1)), *LONG_TOTALS}))


def dtype_rank(dtype: str) -> tuple[int, str]:
    """Where a dtype's slots start in the rotation: the f16 kernel of a variant continues
    where its f32 kernel stopped."""
    return (DTYPE_ORDER.index(dtype) if dtype in DTYPE_ORDER else len(DTYPE_ORDER), dtype)


def lift_unit(k: KernelInfo) -> int:
    """What totals shorter than seq_len are lifted by: a multiple of every tile edge, so the
    lifted total keeps its place relative to the tiles."""
    tiles = kv_tiles(k)
    return math.lcm(*tiles, 2 * max(tiles))


def variant_name(k: KernelInfo) -> str:
    """The kernel's variant: its id without the dtype (f32 and f16 kernels share it)."""
    return ".".join(p for p in k.id.split(".") if p not in DT_TAGS.values())


def variant_ranks(kernels: Sequence[KernelInfo]) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Each kernel's variant (its id without dtype) numbered within its family, and each of
    its dtypes' (variant, dtype) pair numbered within the family: the covering cells'
    rotations start there, so a family's variants take consecutive values."""
    ranks: dict[str, int] = {}
    slots: dict[str, dict[str, int]] = {}
    for fam in {k.family for k in kernels}:
        mine = [k for k in kernels if k.family == fam]
        names = sorted({variant_name(k) for k in mine})
        pairs = sorted({(names.index(variant_name(k)), dtype_rank(d)) for k in mine for d in k.dtypes})
        for k in mine:
            ranks[k.id] = names.index(variant_name(k))
            slots[k.id] = {d: pairs.index((ranks[k.id], dtype_rank(d))) for d in k.dtypes}
    return ranks, slots


def unique(found: Iterable[Case]) -> Iterator[Case]:
    """Cells without repeats (the same test reached by two recipes), ids made unique."""
    keys: set[tuple[Any, ...]] = set()
    ids: dict[str, int] = {}
    for c in found:
        if c.key in keys:
            continue
        keys.add(c.key)
        n = ids[c.id] = ids.get(c.id, 0) + 1
        yield c if n == 1 else replace(c, label=f"{c.label}-{n}")


def storages(spec: AttentionSpec, names: Iterable[str]) -> list[tuple[tuple[str, str], ...]]:
    """How a recipe that stores ``names`` (tensors of tensors.STORED_AS) runs under spec: one
    cell per further dtype the checks accept for them besides make_tensors' own (the table's
    first), so a dtype the checks come to accept gets its cells; [()] where none is left
    (a float32 spec): the recipe as made."""
    extra = {n: accepted_dtypes(spec, n)[1:] for n in names if getattr(spec, n)}
    count = max((len(d) for d in extra.values()), default=0)
    return [tuple((n, d[i % len(d)]) for n, d in extra.items() if d)
            for i in range(count)] or [()]


def everything_fields(sup: frozenset[str]) -> dict[str, Any]:
    """Every contract feature the kernel supports, at once (the "all" cells). Causal: the
    right window there must change nothing (tools.cases window_cells run it without)."""
    return {f: v for f, v in (("bias", True), ("seqlens_k", True), ("kv_capacity", 90),
                              ("local_window", 30), ("right_window", 6), ("softcap", 5.0),
                              ("alibi_max_bias", 4.0), ("head_sink", True), ("return_lse", True),
                              ("causal", True))
            if feature_of(f) in sup}


def feature_of(field_name: str) -> str:
    return {"alibi_max_bias": "alibi", "kv_capacity": "kv_capacity"}.get(field_name, field_name)
