"""Byte sizes as people write them on a command line: `5GB`, `500MiB`, `4096`.

Decimal units (KB, MB, GB: powers of 1000) and binary ones (KiB, MiB, GiB: powers of 1024), any
case, a number that may have a fraction; a bare number is bytes. `zaya convert --max-shard-size`
and `zaya bench --sizes` read sizes with `parse_size`.
"""

from __future__ import annotations

import re

UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMG]I?B|B)?\s*")


def parse_size(text: str) -> int | None:
    """The positive whole number of bytes `text` names, or None when it names none."""
    match = _SIZE.fullmatch(text.upper())
    value = int(float(match[1]) * UNITS[match[2] or ""]) if match else 0
    return value if value > 0 else None
