"""An estimate's arguments checked before any run: the build's keyword parameters and their
values, the search range, and the margin applied to a finished run's verdict.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torchmem.errors import InvalidInputError
from torchmem.fit.verdict._catalog import GPU
from torchmem.fit.verdict._estimate import Estimate
from torchmem.fit.verdict._margin import MarginSpec, describe_margin, margin_for
from torchmem.units import format_bytes

#: The search stops doubling here (a build that ignores the parameter would never stop).
MAX_SEARCH_BATCH = 1 << 24


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _signature(build: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(build)
    except (TypeError, ValueError):
        return None


def _keywords(build: Any) -> tuple[dict[str, Any], bool] | None:
    """``build``'s keyword parameters (after the batch size) with their defaults
    (``inspect.Parameter.empty`` when none), and whether it takes ``**kwargs``; ``None`` when
    the signature cannot be read."""
    sig = _signature(build)
    if sig is None:
        return None
    params = list(sig.parameters.values())
    out: dict[str, Any] = {}
    var_kw = False
    first = True
    for p in params:
        if p.kind is p.VAR_KEYWORD:
            var_kw = True
        elif p.kind is p.VAR_POSITIONAL:
            first = False
        elif first and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            first = False  # the batch size
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            out[p.name] = p.default
    return out, var_kw


def _check_value(where: str, name: str, value: Any, default: Any) -> None:
    """A value whose type does not match the default's (an int parameter given ``'abc'``)."""
    if default is inspect.Parameter.empty or default is None or value is None:
        return
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = _is_int(value)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        return
    if not ok:
        kind = type(default).__name__
        raise InvalidInputError(
            f"{where}(): {name}={value!r} ({type(value).__name__}) does not fit the parameter: "
            f"its default is {kind} {default!r}; fix: give a {kind}, e.g. {name}={default!r}"
        )


def _check_params(
    build: Any, names: list[str], values: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Fail clearly when ``build`` does not take one of ``names`` (or a value does not match
    its default's type); the keywords it takes."""
    info = _keywords(build)
    if info is None:
        return {}
    accepted, var_kw = info
    where = getattr(build, "__qualname__", None) or type(build).__name__
    for name, value in (values or {}).items():
        if name in accepted:
            _check_value(where, name, value, accepted[name])
    for name in names:
        if name not in accepted and not var_kw:
            takes = ", ".join(accepted) if accepted else "none besides the batch size"
            raise InvalidInputError(
                f"{where}() takes no parameter {name!r}; its keyword parameters: {takes}; "
                f"fix: add `{name}` to build's signature (build(batch_size, {name}=...)) or "
                "set one it takes"
            )
    return accepted


def _apply_margin(e: Estimate, margin: MarginSpec, card: GPU) -> Estimate:
    e.margin_bytes = margin_for(margin, card, e.peak_reserved_bytes)
    e.margin_rule = describe_margin(margin, card)
    e.fits_without_margin = e.fits
    if e.fits and e.headroom_bytes < e.margin_bytes:
        e.fits = False
        e.notes.append(
            f"fits the simulation with {format_bytes(e.headroom_bytes)} free, less than the "
            f"error margin {format_bytes(e.margin_bytes)} ({e.margin_rule}); counted as not "
            "fitting (margin=0 judges the simulated run alone)"
        )
    return e


def _check_range(
    search_range: object, maximize: str | None
) -> tuple[int | None, int | None, int]:
    if search_range is None:
        return None, None, 1
    if maximize is None:
        raise InvalidInputError(
            "search_range is only used by a search; fix: also pass maximize='seq_len' (or "
            "max_batch_size=True), or drop search_range"
        )
    got: list[int] = []
    if isinstance(search_range, (tuple, list)) and len(search_range) in (2, 3):
        got = [x for x in search_range if _is_int(x)]
        if len(got) != len(search_range):
            got = []
    step = got[2] if len(got) == 3 else 1
    ok = bool(got) and 1 <= got[0] <= got[1] and step >= 1
    if not ok or got[1] // step < -(-got[0] // step):
        raise InvalidInputError(
            f"search_range must be (low, high) or (low, high, step) ints with 1 <= low <= high "
            f"and a multiple of step between them, got {search_range!r}"
        )
    return got[0], got[1], step
