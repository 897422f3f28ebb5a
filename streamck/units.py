"""Byte counts and durations as people read them, for the CLI's lines and the progress log."""

from __future__ import annotations


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
