"""Byte sizes and counts as people write them: parsing '2GiB' and printing 1.50 GiB / 2.72T."""

from __future__ import annotations

import argparse
import re

_BYTE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MB', '1e9', '0' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 512MiB, 2GiB, 1e9)")
    try:
        return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])
    except (ValueError, OverflowError):  # OverflowError: '1e999' is float inf
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 512MiB, 2GiB, 1e9)") from None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))
