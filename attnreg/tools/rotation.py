"""The covering cells' axes (attnreg.tools.cases): which head size, GQA group, KV kind,
lengths, layouts and split size each covering cell of a kernel takes."""

from __future__ import annotations

from ..kernel import KernelInfo
from . import cells
from .cells import kv_tiles


class Rotation:
    """The covering cells' axes for one kernel. What backends compile into a program (head
    size, GQA group, paged page size) changes with the shape, a few slots apart: most shapes
    keep the feature cells' head size and contiguous cache (their programs), the new ones
    take the family's next head size and KV kind (consecutive over its variants and dtypes,
    so a family meets them all). What kernels read at run time (seq_len, total length,
    layouts, split size) changes every slot; the variant's rank offsets each axis so that
    variants do not pair the same values."""

    def __init__(self, k: KernelInfo, base_head: int, rank: int) -> None:
        self.rank, self.base_head = rank, base_head
        self.others = [h for h in cells.HEAD_SIZES if k.head_size_ok(h) and h != base_head] \
            or [base_head]
        self.groups = cells.GQA if "gqa" in k.supports else (1,)
        self.kinds = cells.KV_KINDS if "paged" in k.kv_layouts else (0,)
        self.flat: list[tuple[str, str]] = [
            lay for lay in cells.LAYOUTS if lay[0] in k.q_layouts and lay[1] in k.kv_layouts
        ] or [("BSNH", "BSNH")]
        self.paged_q: list[str] = [q for q in ("BSNH", "BNSH") if q in k.q_layouts]
        self.totals, self.unit = cells.tile_totals(k), cells.lift_unit(k)
        self.split_unit = min(kv_tiles(k))
        self.max_rows = k.max_seq_len
        self.n_flat = self.n_paged = 0

    def shape(self, shape: int, slot: int) -> tuple[int, int, int]:
        """(head size, GQA group, page size or 0) of the dtype's ``shape``-th shape; ``slot``
        numbers the (variant, dtype) within the family."""
        g = self.groups[(shape + self.rank) % len(self.groups)]
        new = shape % cells.SHAPES_PER_DTYPE - (cells.SHAPES_PER_DTYPE - cells.NEW_SHAPES)
        if new < 0:
            return self.base_head, g, 0
        j = slot * cells.NEW_SHAPES + new
        return self.others[j % len(self.others)], g, self.kinds[j % len(self.kinds)]

    def lengths(self, n: int) -> tuple[int, int]:
        """(seq_len, total length) of slot n; a total below seq_len is lifted by whole tiles
        (it keeps its tile edge)."""
        total = self.totals[(n + 5 * self.rank) % len(self.totals)]
        s = 1 if total == 1 else cells.SEQ_LENS[(3 * n + self.rank) % len(cells.SEQ_LENS)]
        if total >= cells.BIG_TOTAL:      # long caches with few rows: the decode shape
            s = min(s, cells.BIG_ROWS)
        if self.max_rows is not None:
            s = min(s, self.max_rows)
        if total < s:
            total += self.unit * -(-(s - total) // self.unit)
        return s, total

    def layout(self, page_size: int) -> tuple[str, str, str]:
        """(q_layout, kv_layout, kv tag for the label): the next flat pair, or a paged pool."""
        if page_size and self.paged_q:
            self.n_paged += 1
            q = self.paged_q[(self.n_paged - 1 + self.rank) % len(self.paged_q)]
            return q, "paged", f"paged{page_size}"
        self.n_flat += 1
        q, kv = self.flat[(self.n_flat - 1 + self.rank) % len(self.flat)]
        return q, kv, kv.lower()

    def split_factor(self, n: int) -> float:
        return cells.SPLIT_FACTORS[(n // 2 + self.rank) % len(cells.SPLIT_FACTORS)]
