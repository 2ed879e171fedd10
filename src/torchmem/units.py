"""Bytes to human strings and back: the only place torchmem formats or parses units.

Bytes are plain ``int`` everywhere else. Binary units (KiB, MiB, GiB, TiB) are powers of 1024;
decimal units (kB, MB, GB, TB) are powers of 1000 -- GB is base 1000, GiB base 1024.

Example:
    >>> format_bytes(1536)
    '1.50 KiB'
    >>> format_bytes(1_500_000_000, decimal=True)
    '1.50 GB'
    >>> parse_bytes("1.5 GiB")
    1610612736
"""

from __future__ import annotations

import re

from torchmem.errors import InvalidInputError

__all__ = ["format_bytes", "parse_bytes", "KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "TB"]

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4
KB = 1000
MB = 1000**2
GB = 1000**3
TB = 1000**4

_BINARY = [("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)]
_DECIMAL = [("TB", TB), ("GB", GB), ("MB", MB), ("kB", KB)]
_PARSE = {
    "": 1, "b": 1, "byte": 1, "bytes": 1,
    "k": KiB, "kib": KiB, "m": MiB, "mib": MiB, "g": GiB, "gib": GiB, "t": TiB, "tib": TiB,
    "kb": KB, "mb": MB, "gb": GB, "tb": TB,
}
_NUM = re.compile(r"^\s*([+-]?\d+(?:\.\d*)?|[+-]?\.\d+)\s*([A-Za-z]*)\s*$")


def format_bytes(n: int | float, *, decimal: bool = False, precision: int = 2) -> str:
    """Format a byte count for people.

    ``decimal=False`` (default) uses KiB/MiB/GiB (base 1024); ``decimal=True`` uses kB/MB/GB
    (base 1000). Negative counts keep their sign (useful for diffs).

    Example:
        >>> format_bytes(0)
        '0 B'
        >>> format_bytes(-3 * 1024**2)
        '-3.00 MiB'
        >>> format_bytes(2_000_000, decimal=True, precision=1)
        '2.0 MB'
    """
    if isinstance(n, bool) or not isinstance(n, (int, float)):
        raise InvalidInputError(
            f"format_bytes expected an int or float byte count, got {type(n).__name__}: {n!r}"
        )
    sign = "-" if n < 0 else ""
    a = abs(n)
    for unit, size in _DECIMAL if decimal else _BINARY:
        if a >= size:
            return f"{sign}{a / size:.{precision}f} {unit}"
    if isinstance(a, float) and not a.is_integer():
        return f"{sign}{a:.{precision}f} B"
    return f"{sign}{int(a)} B"


def parse_bytes(text: str | int) -> int:
    """Parse ``"512"``, ``"1.5 GiB"``, ``"200MB"`` or ``"4G"`` into an int byte count.

    Single letters (``K``, ``M``, ``G``, ``T``) are binary, like ``ulimit`` and PyTorch's
    allocator settings. Matching is case-insensitive.

    Example:
        >>> parse_bytes("4K"), parse_bytes("1 kB"), parse_bytes(7)
        (4096, 1000, 7)
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InvalidInputError(f"expected a non-negative byte count, got {text}")
        return text
    if not isinstance(text, str):
        raise InvalidInputError(
            f"parse_bytes expected a string such as '1.5 GiB' or an int, got {type(text).__name__}"
        )
    m = _NUM.match(text)
    if not m or m.group(2).lower() not in _PARSE:
        raise InvalidInputError(
            f"could not parse {text!r} as a size; expected a number with an optional unit "
            "(B, KiB, MiB, GiB, TiB, kB, MB, GB, TB, or K/M/G/T), e.g. '1.5 GiB'"
        )
    value = float(m.group(1)) * _PARSE[m.group(2).lower()]
    if value < 0:
        raise InvalidInputError(f"expected a non-negative size, got {text!r}")
    return int(round(value))
