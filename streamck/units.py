"""Byte counts and durations as people read them, for the CLI's lines and the progress log."""

from __future__ import annotations

import re
from fractions import Fraction


def human(n: float) -> str:
    """``n`` bytes in binary units: ``512 B``, ``1.50 GiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError


def duration(seconds: float) -> str:
    """``seconds`` as ``H:MM:SS`` (rounded to the second)."""
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)", re.IGNORECASE)
# Past this a size means nothing on any disk (8 EiB, the largest file offset), and int(float()) of it is
# an OverflowError or a number no allocation survives.
MAX_SIZE = (1 << 63) - 1


def parse_size(text: str, name: str = "size") -> int:
    """``5GB`` (or ``5G``, ``5gb``) → 5·10⁹, ``500MiB`` → 500·2²⁰, ``1024`` → 1024 bytes. ``name`` is
    what a refusal calls the value (a UsageError: not a size, under a byte, or past 8 EiB)."""
    from streamck.errors import UsageError

    m = _SIZE.fullmatch(text.strip())
    if m is None or (m.group(3) and not m.group(2)):
        raise UsageError(f"{name} {text!r}: cannot read the size (examples: 5GB, 500MiB, 1048576)")
    number, prefix, binary = m.group(1), m.group(2).upper(), bool(m.group(3))
    power = "KMGT".index(prefix) + 1 if prefix else 0
    value = Fraction(number) * ((1024 if binary else 1000) ** power)
    if value < 1:
        raise UsageError(f"{name} {text!r}: must be at least one byte")
    if value > MAX_SIZE:
        raise UsageError(f"{name} {text!r}: past the largest file size (8 EiB)")
    return int(value)


def is_bare_bytes(text: str) -> bool:
    """Whether ``text`` is a bare number under 1 MiB, which people mean in another unit more
    often than in bytes (``--max-shard-size 5``): worth a note naming the unit."""
    return text.strip().isdigit() and int(text) < (1 << 20)
