"""The estimator's error margin: how much free memory an answer keeps for what it may miss.

An estimate says "fits" only when the simulated run leaves at least the margin free at its peak
of reserved memory (``headroom_bytes >= margin_bytes``); the search for the largest value that
fits uses the same rule. The default margin (``margin=None``) is

    1 % of the estimated peak reserved bytes  +  256 MiB for the CUDA context
    (the context part is 0 when the GPU's context was measured: ``GPU(context_override=...)``)

Where the two parts come from:

- **1 % of the peak.** Against real GPU runs (``../shared/data/gpu-truth.md``,
  ``tests/test_gpu_truth.py``) the estimate's peaks agree to 0.08 % at worst: MAGMA27's peak
  requested exact, allocated +0.005 %, reserved exact; notHanmin's requested -0.02 %,
  allocated -0.08 % (its cache was sized by runs we cannot replay, so blocks land with other
  unsplit slack). The known sources of disagreement scale with the step (backward formulas
  that change between torch versions, a block's unsplit slack of up to 1 MiB in the large pool
  per live block, the allocation history before the recorded window), and held-out runs
  exercise kernels the two truth runs do not. 1 % is about twelve times the worst measured gap.
- **256 MiB for the CUDA context.** The context lives outside PyTorch's allocator and the
  catalog's figure is per GPU generation and approximate (``CONTEXT_BYTES``: 310-560 MiB).
  Public figures run from 256 MiB (a bare RTX 3090 context) to about 616 MiB (a datacenter
  GPU with pinned-memory registration): up to 186 MiB above the catalog's figure for that
  generation; 256 MiB covers it with room. A measured context (``context_override``) drops it.

``margin`` may also be an int (bytes), a size string (``"512 MiB"``), a percentage of the peak
reserved bytes (``"2%"``), or ``0`` to judge the simulated run alone.

Example:
    >>> from torchmem.fit.verdict._catalog import GPU
    >>> card = GPU("x", 10 << 30, (9, 0), "test")
    >>> margin_for(None, card, peak_reserved=4_000_000_000) == 40_000_000 + (256 << 20)
    True
    >>> margin_for("2%", card, peak_reserved=1000), margin_for("1 KiB", card, 0)
    (20, 1024)
"""

from __future__ import annotations

from torchmem.errors import InvalidInputError
from torchmem.fit.verdict._catalog import GPU
from torchmem.units import format_bytes, parse_bytes

__all__ = ["DEFAULT_FRACTION", "CONTEXT_UNCERTAINTY_BYTES", "MarginSpec", "check_margin",
           "margin_for", "describe_margin"]

#: Share of the estimated peak reserved bytes kept free by default (see the module docstring).
DEFAULT_FRACTION = 0.01
#: Kept free by default for the CUDA context's uncertainty, unless the context was measured.
CONTEXT_UNCERTAINTY_BYTES = 256 << 20

MarginSpec = int | str | None


def check_margin(margin: object) -> MarginSpec:
    """Validate a margin spec early (before any run): ``None``, a percentage string, or bytes.

    Example:
        >>> check_margin("3%"), check_margin(0), check_margin("1 KiB"), check_margin("default")
        ('3%', 0, 1024, None)
    """
    if margin is None:
        return None
    if isinstance(margin, bool) or not isinstance(margin, (int, str)):
        raise InvalidInputError(
            f"margin must be None (the documented default), an int byte count, a size such as "
            f"'512 MiB' or a percentage such as '2%', got {type(margin).__name__} {margin!r}; "
            "fix: pass '2%' for a share of the peak or 0 for no margin"
        )
    if isinstance(margin, int):
        if margin < 0:
            raise InvalidInputError(f"margin must be >= 0 bytes, got {margin}")
        return margin
    text = margin.strip()
    if text.lower() in ("default", "auto"):
        return None
    if text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            pct = -1.0
        if not 0 <= pct < 100:
            raise InvalidInputError(
                f"margin {margin!r} is not a percentage in [0, 100); expected e.g. '2%'"
            )
        return text
    try:
        return parse_bytes(text)  # a size: its bytes
    except InvalidInputError as e:
        raise InvalidInputError(
            f"margin {margin!r}: {e}; or a percentage of the peak such as '2%'"
        ) from None


def margin_for(margin: MarginSpec, card: GPU, peak_reserved: int) -> int:
    """The margin in bytes for a run on ``card`` whose peak reserved bytes were
    ``peak_reserved``.

    Example:
        >>> from torchmem.fit.verdict._catalog import GPU
        >>> measured = GPU("x", 8 << 30, (8, 0), "test", context_override=400 << 20)
        >>> margin_for(None, measured, peak_reserved=1 << 30)    # 1% of 1 GiB, rounded up
        10737419
    """
    margin = check_margin(margin)
    if margin is None:
        context = CONTEXT_UNCERTAINTY_BYTES if card.context_override is None else 0
        return -(-peak_reserved // 100) + context
    if isinstance(margin, int):
        return margin
    if margin.endswith("%"):
        return -(-int(round(float(margin[:-1]) * 1e6)) * peak_reserved // 100_000_000)
    return parse_bytes(margin)


def describe_margin(margin: MarginSpec, card: GPU) -> str:
    """The rule in words, for reports and JSON (``margin_rule``).

    Example:
        >>> from torchmem.fit.verdict._catalog import GPU
        >>> describe_margin(None, GPU("x", 8 << 30, (8, 0), "test"))
        'default: 1% of peak reserved + 256 MiB CUDA-context uncertainty'
        >>> describe_margin("2%", GPU("x", 8 << 30, (8, 0), "test"))
        '2% of peak reserved'
    """
    margin = check_margin(margin)
    if margin is None:
        if card.context_override is None:
            return (f"default: {DEFAULT_FRACTION:.0%} of peak reserved + "
                    f"{CONTEXT_UNCERTAINTY_BYTES >> 20} MiB CUDA-context uncertainty")
        return f"default: {DEFAULT_FRACTION:.0%} of peak reserved (measured CUDA context)"
    if isinstance(margin, int):
        return "none" if margin == 0 else format_bytes(margin)
    if margin.endswith("%"):
        return f"{margin} of peak reserved"
    return format_bytes(parse_bytes(margin))
