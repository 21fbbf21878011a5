"""Plain-text tables and a progress bar for the CLI (no dependencies)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TextIO, TypeVar

T = TypeVar("T")


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Left-aligned columns; numbers as given (format them before)."""
    body = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    rule = "  ".join("-" * w for w in widths)
    rows_ = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in body]
    return "\n".join([line.rstrip(), rule, *rows_])


def progress(items: Sequence[T], label: str = "", stream: TextIO | None = None) -> Iterator[T]:
    """Yield items while drawing a one-line bar on stderr (only when it is a terminal)."""
    out = stream or sys.stderr
    live = hasattr(out, "isatty") and out.isatty()
    n, t0 = len(items), time.perf_counter()
    for i, item in enumerate(items):
        if live:
            done = int(30 * i / max(n, 1))
            out.write(f"\r{label} [{'#' * done}{'.' * (30 - done)}] {i}/{n} "
                      f"{time.perf_counter() - t0:5.1f}s")
            out.flush()
        yield item
    if live:
        out.write(f"\r{label} [{'#' * 30}] {n}/{n} {time.perf_counter() - t0:5.1f}s\n")
        out.flush()
