"""Amounts as a person reads them: bytes in the unit that keeps their digits."""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def fmt_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit under which it is at least 1 ("512 B",
    "1.29 MiB", "3.60 GiB"): a small amount never reads "0.00 GiB"."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable: the last unit returns")
