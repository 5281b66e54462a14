"""Sizes and durations as people write them (`512Mi`, `1.5Gi`, `30s`, `7d`).

Sizes follow Kubernetes resource quantities, so a value copied from a
`KVCachePool` means the same number of bytes to the agent.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator, PlainSerializer

from .sizes import human_size as human_size

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGTPE]i|[kMGTPE])?\s*$")
_DURATION_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a Kubernetes quantity string; raises ValueError."""
    if isinstance(value, bool):
        raise ValueError("a size must be a number of bytes or a quantity like 512Mi")
    if isinstance(value, int | float):
        n = float(value)
    else:
        m = _SIZE_RE.match(value)
        if not m:
            raise ValueError(
                f"{value!r} is not a size: use bytes or a quantity like 512Mi, 4Gi, 10G"
            )
        suffix = m.group(2)
        scale = _BINARY.get(suffix or "", 0) or _DECIMAL.get(suffix or "", 1)
        n = float(m.group(1)) * scale
    if n != int(n):
        raise ValueError(f"{value!r} is not a whole number of bytes")
    if n <= 0:
        raise ValueError(f"{value!r}: a size must be greater than zero")
    return int(n)


def format_size(n: int) -> str:
    """The shortest exact binary quantity for n bytes (`64Mi`), else plain bytes.

    For what a machine reads back (config, manifests, JSON); people get `human_size`.
    """
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        scale = _BINARY[suffix]
        if n >= scale and n % scale == 0:
            return f"{n // scale}{suffix}"
    return str(n)


def parse_duration(value: int | float | str) -> float:
    """Seconds from a number or a string like `500ms`, `30s`, `5m`, `2h`, `7d`."""
    if isinstance(value, bool):
        raise ValueError("a duration must be seconds or a string like 30s, 5m, 1h")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        m = _DURATION_RE.match(value)
        if not m:
            raise ValueError(f"{value!r} is not a duration: use a string like 30s, 5m, 1h, 7d")
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2) or "s"]
    if seconds <= 0:
        raise ValueError(f"{value!r}: a duration must be greater than zero")
    return seconds


def format_duration(seconds: float) -> str:
    for suffix, scale in (("d", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if seconds >= scale and seconds % scale == 0:
            return f"{int(seconds // scale)}{suffix}"
    return f"{int(seconds * 1000)}ms"


ByteSize = Annotated[
    int,
    BeforeValidator(parse_size),
    PlainSerializer(format_size, return_type=str, when_used="json"),
]
"""A size in bytes; accepts ints and quantities, serialises to JSON as a quantity."""

Duration = Annotated[
    float,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
]
"""A duration in seconds; accepts numbers and `30s`-style strings."""
