"""The binary framing between Python and the page, both ways.

A message is ``b"ATRG"``, a little-endian u32 header length, the header as UTF-8 JSON
(metadata only: names, sizes, WGSL text, grids), zero padding to a 16-byte boundary, then
the blobs (tensors, the parameter block, results) back to back, each starting on a 16-byte
boundary. The header's ``blobs`` lists each blob's name, offset (from the blob area's
start) and size in bytes. Tensors travel as their raw bytes, never as JSON numbers.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

MAGIC = b"ATRG"
ALIGN = 16


def _pad(n: int) -> int:
    return -n % ALIGN


def encode(header: Mapping[str, Any], blobs: Mapping[str, bytes | memoryview]) -> bytes:
    """One message: the header (plus the blob table) and the blobs."""
    table = []
    off = 0
    for name, data in blobs.items():
        size = len(memoryview(data).cast("B"))
        table.append({"name": name, "offset": off, "size": size})
        off += size + _pad(size)
    head = json.dumps({**header, "blobs": table}, separators=(",", ":")).encode()
    parts: list[bytes | memoryview] = [MAGIC, struct.pack("<I", len(head)), head,
                                       b"\0" * _pad(8 + len(head))]
    for data in blobs.values():
        mv = memoryview(data).cast("B")
        parts += [mv, b"\0" * _pad(len(mv))]
    return b"".join(parts)


def decode(msg: bytes) -> tuple[dict[str, Any], dict[str, memoryview]]:
    """(header, name -> blob view) of one message."""
    if len(msg) < 8 or msg[:4] != MAGIC:
        raise ValueError(f"not an attnreg browser message ({len(msg)} bytes, starts {msg[:8]!r})")
    (n,) = struct.unpack_from("<I", msg, 4)
    header: dict[str, Any] = json.loads(msg[8:8 + n].decode())
    base = 8 + n + _pad(8 + n)
    view = memoryview(msg)
    blobs = {b["name"]: view[base + b["offset"]: base + b["offset"] + b["size"]]
             for b in header.get("blobs", [])}
    for b in header.get("blobs", []):
        if base + b["offset"] + b["size"] > len(msg):
            raise ValueError(f"blob {b['name']!r} runs past the end of the message")
    return header, blobs
