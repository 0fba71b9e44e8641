"""Cheap checks that a model file on disk is whole, without loading it (used on the cached
downloads and on the converted embedded model)."""

from __future__ import annotations

import json
from pathlib import Path


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file's length, or None: it must be as long as its
    own header says (8-byte header length, the JSON header, then the tensors' data)."""
    try:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(min(header_len, 100_000_000)))
        ends = [int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return "has an unreadable header"
    expected = 8 + header_len + max(ends, default=0)
    size = path.stat().st_size
    return None if size == expected else f"has {size} bytes where its header says {expected}"
