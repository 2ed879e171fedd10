from __future__ import annotations

import pytest

from torchmem.errors import InvalidInputError
from torchmem.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    "n, decimal, expected",
    [
        (0, False, "0 B"),
        (1023, False, "1023 B"),
        (1024, False, "1.00 KiB"),
        (3 * 1024**3 // 2, False, "1.50 GiB"),
        (1000, True, "1.00 kB"),
        (2_500_000_000, True, "2.50 GB"),
        (-2048, False, "-2.00 KiB"),
    ],
)
def test_format(n: int, decimal: bool, expected: str) -> None:
    assert format_bytes(n, decimal=decimal) == expected


@pytest.mark.parametrize(
    "text, expected",
    [("12", 12), ("1 KiB", 1024), ("1kb", 1000), ("1.5GiB", 3 * 2**29), ("2 G", 2 * 2**30), ("3 TB", 3 * 10**12)],
)
def test_parse(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "1 XB", "-4", "1..2"])
def test_parse_errors(bad: str) -> None:
    with pytest.raises(InvalidInputError, match="expected"):
        parse_bytes(bad)


def test_roundtrip_binary() -> None:
    for n in (1, 1024, 5 * 1024**2, 7 * 1024**3):
        assert parse_bytes(format_bytes(n)) == n
