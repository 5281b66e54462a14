"""Sizes for people, with the standard library only: the light install's `kvpool stats`
prints them too (`kvpool.agent.units` re-exports `human_size` for the rest)."""

from __future__ import annotations

_HUMAN_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def human_size(n: int) -> str:
    """n bytes for people, one way everywhere: `100 B`, `4.0 KiB`, `64.0 MiB`, `1.5 GiB`."""
    value = float(n)
    for unit in _HUMAN_UNITS:
        if abs(round(value, 1)) < 1024 or unit == _HUMAN_UNITS[-1]:
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
