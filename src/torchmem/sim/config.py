"""The caching allocator's options, parsed as PyTorch 2.13 parses them.

:class:`AllocatorConfig` is a frozen dataclass of every option of ``PYTORCH_CUDA_ALLOC_CONF`` /
``PYTORCH_ALLOC_CONF`` (``c10/core/AllocatorConfig.cpp`` and ``c10/cuda/CUDAAllocatorConfig``).
Build one from a settings string (:meth:`AllocatorConfig.parse`), from the environment
(:meth:`AllocatorConfig.from_env`) or from a snapshot's ``allocator_settings``
(:meth:`AllocatorConfig.from_settings`).

The rules (2.13):

- ``large_segment_size_mb`` (default 20) must be > 10; it is also the default and the lower
  bound of ``max_split_size_mb`` and ``max_non_split_rounding_mb`` (before 2.10 both bounds were
  a fixed 20 MiB and ``large_segment_size_mb`` did not exist);
- ``garbage_collection_threshold`` lies strictly between 0 and 1;
- ``roundup_power2_divisions`` is one power of two for all 16 size intervals (1 MiB .. 64 GiB),
  or a list ``[256:1,512:2,>:4]`` whose keys are power-of-two MiB interval starts; the first key
  also fills every lower interval and ``>`` fills the intervals after the last key (from its
  index + 1; versions up to about 2.9 filled from the last key's own index); values are 0 or
  a power of two;
- ``expandable_segments``, ``release_lock_on_cudamalloc`` and the other switches take exactly
  ``True`` or ``False``;
- ``per_process_memory_fraction`` lies in [0, 1] (set it to enable the fraction limit, as
  ``torch.cuda.set_per_process_memory_fraction`` does);
- ``backend:cudaMallocAsync`` is a different allocator, and ``throw_on_cudamalloc_oom:True``
  depends on the driver's free-memory estimate: neither can be simulated, both are rejected
  with an error naming the option.

Host-side (pinned memory) options are accepted, validated and kept, and change nothing here.

Older versions, where a snapshot from one is configured (:meth:`AllocatorConfig.from_settings`
puts the ones that apply in :attr:`AllocatorConfig.notes`): before about 2.10 there was no
``large_segment_size_mb`` (20 MiB, the default) and ``PYTORCH_ALLOC_CONF`` won over
``PYTORCH_CUDA_ALLOC_CONF``; before about 2.5 ``max_non_split_rounding_mb`` was a fixed 20 MiB
and garbage collection and the oversize release also freed blocks of expandable segments (the
simulator follows 2.13 and skips them). A snapshot stores the resolved
``roundup_power2_divisions`` table, so the changed meaning of ``>`` does not matter there.

Example:
    >>> c = AllocatorConfig.parse("max_split_size_mb:128,roundup_power2_divisions:[256:1,>:4]")
    >>> c.max_split_size >> 20, c.divisions_for(300 << 20), c.divisions_for(600 << 20)
    (128, 1, 4)
    >>> AllocatorConfig.parse("expandable_segments:True").expandable_segments
    True
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from torchmem.errors import InvalidInputError

__all__ = ["AllocatorConfig"]

MB = 1 << 20
_INTERVALS = 16  # roundup_power2_divisions: [1 MiB, 64 GiB) in 16 power-of-two intervals
_MIN_LARGE_ALLOC_MB = 10
_SIZE_MAX = (1 << 64) - 1
#: The environment variables PyTorch 2.13 reads, in order; the first one set wins.
ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

_BOOL_KEYS = (
    "expandable_segments",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_background_threads",
    "graph_capture_record_stream_reuse",
    "pinned_free_catch_all",
    "throw_on_cudamalloc_oom",
)
_INT_KEYS = (
    "large_segment_size_mb",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb",
    "pinned_max_round_threshold_mb",
    "pinned_max_cached_size_mb",
)
_FLOAT_KEYS = ("garbage_collection_threshold", "per_process_memory_fraction")
_ALIASES = {
    "release_lock_on_hipmalloc": "release_lock_on_cudamalloc",
    "pinned_use_hip_host_register": "pinned_use_cuda_host_register",
}


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _bad(option: str, value: object, allowed: str) -> InvalidInputError:
    return InvalidInputError(
        f"allocator option {option}: got {value!r}, expected {allowed}; fix the value in "
        "PYTORCH_CUDA_ALLOC_CONF / the settings string"
    )


@dataclass(frozen=True)
class AllocatorConfig:
    """The options of PyTorch's CUDA caching allocator (defaults = no settings at all).

    Sizes are in MiB as in the settings string; ``max_split_size_mb=None`` means unlimited and
    ``max_non_split_rounding_mb=None`` means "equal to ``large_segment_size_mb``".
    ``roundup_power2_divisions`` holds the 16 per-interval divisions (0 = plain 512 B rounding).
    ``settings`` is the string it was parsed from (PyTorch's ``last_allocator_settings``); it
    does not take part in ``==``, so the same options written differently compare equal.
    The byte-valued properties (:attr:`max_split_size`, ...) are what the simulator uses.

    Example:
        >>> c = AllocatorConfig(large_segment_size_mb=32)
        >>> c.large_segment_size >> 20, c.max_non_split_rounding_size >> 20, c.max_split_size
        (32, 32, 18446744073709551615)
        >>> AllocatorConfig(garbage_collection_threshold=1.5)
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: allocator option garbage_collection_threshold: got 1.5, expected a number strictly between 0.0 and 1.0; fix the value in PYTORCH_CUDA_ALLOC_CONF / the settings string
    """

    max_split_size_mb: int | None = None
    max_non_split_rounding_mb: int | None = None
    roundup_power2_divisions: tuple[int, ...] = (0,) * _INTERVALS
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    large_segment_size_mb: int = 20
    per_process_memory_fraction: float | None = None
    release_lock_on_cudamalloc: bool = False
    graph_capture_record_stream_reuse: bool = False
    pinned_use_cuda_host_register: bool = False
    pinned_num_register_threads: int = 1
    host_options: tuple[tuple[str, str], ...] = field(default=())
    settings: str = field(default="", compare=False)
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        lss = self.large_segment_size_mb
        if not isinstance(lss, int) or lss <= _MIN_LARGE_ALLOC_MB:
            raise _bad("large_segment_size_mb", lss, f"an integer > {_MIN_LARGE_ALLOC_MB} (MiB)")
        for name in ("max_split_size_mb", "max_non_split_rounding_mb"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < lss):
                raise _bad(
                    name, v, f"an integer >= large_segment_size_mb ({lss} MiB), or unset for "
                    + ("unlimited" if name == "max_split_size_mb" else "the default")
                )
        div = self.roundup_power2_divisions
        if len(div) != _INTERVALS or any(not isinstance(d, int) or (d and not _is_pow2(d)) for d in div):
            raise _bad(
                "roundup_power2_divisions", div, f"{_INTERVALS} divisions, each 0 or a power of two"
            )
        gc = self.garbage_collection_threshold
        if gc != 0.0 and not 0.0 < gc < 1.0:
            raise _bad("garbage_collection_threshold", gc, "a number strictly between 0.0 and 1.0")
        frac = self.per_process_memory_fraction
        if frac is not None and not 0.0 <= frac <= 1.0:
            raise _bad("per_process_memory_fraction", frac, "a number in [0.0, 1.0]")
        n = self.pinned_num_register_threads
        if not _is_pow2(n) or n > 128:
            raise _bad("pinned_num_register_threads", n, "a power of two <= 128")

    # -- bytes, as the simulator uses them ----------------------------------------------------

    @property
    def max_split_size(self) -> int:
        """``max_split_size_mb`` in bytes (``SIZE_MAX`` when unlimited, as in PyTorch).

        Example:
            >>> AllocatorConfig(max_split_size_mb=64).max_split_size
            67108864
        """
        return _SIZE_MAX if self.max_split_size_mb is None else self.max_split_size_mb * MB

    @property
    def max_non_split_rounding_size(self) -> int:
        """``max_non_split_rounding_mb`` in bytes (default: the large segment size).

        Example:
            >>> AllocatorConfig(max_non_split_rounding_mb=40).max_non_split_rounding_size >> 20
            40
        """
        mb = self.max_non_split_rounding_mb
        return (self.large_segment_size_mb if mb is None else mb) * MB

    @property
    def large_segment_size(self) -> int:
        """The segment size of a large request under 10 MiB, in bytes (default 20 MiB).

        Example:
            >>> AllocatorConfig().large_segment_size
            20971520
        """
        return self.large_segment_size_mb * MB

    def divisions_for(self, size: int) -> int:
        """The ``roundup_power2_divisions`` that apply to a request of ``size`` bytes.

        Interval 0 covers everything below 2 MiB, interval k covers [2^(20+k), 2^(21+k)) and
        interval 15 everything from 32 GiB up.

        Example:
            >>> c = AllocatorConfig.parse("roundup_power2_divisions:[1:2,4:8,>:16]")
            >>> [c.divisions_for(n << 20) for n in (1, 3, 4, 7, 8, 1 << 20)]  # 2-4 MiB: not listed
            [2, 0, 8, 8, 16, 16]
        """
        idx = min(max(size.bit_length() - 1 - 20, 0), _INTERVALS - 1)
        return self.roundup_power2_divisions[idx]

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def parse(cls, settings: str) -> AllocatorConfig:
        """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` string (``key:value,key:value``; spaces ignored).

        Raises :class:`~torchmem.errors.InvalidInputError` naming the option, the value and
        what is allowed, for unknown options, bad values and options that cannot be simulated.

        Example:
            >>> AllocatorConfig.parse("garbage_collection_threshold:0.6, max_split_size_mb:200")
            AllocatorConfig(max_split_size_mb=200, garbage_collection_threshold=0.6, settings='garbage_collection_threshold:0.6, max_split_size_mb:200')
            >>> AllocatorConfig.parse("backend:cudaMallocAsync")
            Traceback (most recent call last):
            ...
            torchmem.errors.InvalidInputError: allocator option backend: got 'cudaMallocAsync', expected native (cudaMallocAsync is a different allocator, driven by the CUDA driver's own pool, which torchmem cannot simulate); fix the value in PYTORCH_CUDA_ALLOC_CONF / the settings string
        """
        if not isinstance(settings, str):
            raise InvalidInputError(
                f"allocator settings must be a string like 'max_split_size_mb:128', got "
                f"{type(settings).__name__} {settings!r}"
            )
        tokens = _lex(settings)
        values: dict[str, Any] = {}
        host: list[tuple[str, str]] = []
        i = 0
        while i < len(tokens):
            key = tokens[i]
            if key in ",:[]":
                raise InvalidInputError(
                    f"allocator settings {settings!r}: expected an option name at token {i}, got "
                    f"{key!r}; write key:value pairs separated by commas"
                )
            key = _ALIASES.get(key, key)
            if i + 1 >= len(tokens) or tokens[i + 1] != ":":
                raise InvalidInputError(
                    f"allocator option {key}: expected ':' and a value after it in {settings!r}"
                )
            i += 2
            if key == "roundup_power2_divisions":
                values[key], i = _parse_divisions(tokens, i)
            else:
                if i >= len(tokens) or tokens[i] in ",:[]":
                    raise InvalidInputError(f"allocator option {key}: expected a value in {settings!r}")
                raw = tokens[i]
                i += 1
                if key == "backend":
                    if raw != "native":
                        raise _bad(
                            "backend", raw, "native (cudaMallocAsync is a different allocator, "
                            "driven by the CUDA driver's own pool, which torchmem cannot simulate)"
                        )
                elif key in _BOOL_KEYS:
                    if raw not in ("True", "False"):
                        raise _bad(key, raw, "True or False")
                    if key == "throw_on_cudamalloc_oom" and raw == "True":
                        raise _bad(
                            key, raw, "False (early OOM rejection depends on the driver's free-"
                            "memory estimate, which torchmem cannot simulate)"
                        )
                    _store(values, host, key, raw == "True", raw)
                elif key in _INT_KEYS:
                    try:
                        num = int(raw)
                    except ValueError:
                        raise _bad(key, raw, "an integer") from None
                    _store(values, host, key, num, raw)
                elif key in _FLOAT_KEYS:
                    try:
                        val = float(raw)
                    except ValueError:
                        raise _bad(key, raw, "a number") from None
                    if key == "garbage_collection_threshold" and not 0.0 < val < 1.0:
                        raise _bad(key, raw, "a number strictly between 0.0 and 1.0")
                    values[key] = val
                else:
                    raise InvalidInputError(
                        f"unrecognized allocator option {key!r} in {settings!r}; known options: "
                        + ", ".join(sorted({*_BOOL_KEYS, *_INT_KEYS, *_FLOAT_KEYS, "backend",
                                            "roundup_power2_divisions"}))
                    )
            if i < len(tokens):
                if tokens[i] != ",":
                    raise InvalidInputError(
                        f"allocator settings {settings!r}: expected ',' after option {key}, got "
                        f"{tokens[i]!r}"
                    )
                i += 1
        return cls(**values, host_options=tuple(host), settings=settings)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AllocatorConfig:
        """The configuration PyTorch 2.13 reads from the environment (``os.environ`` by default).

        2.13 takes the first variable that is set, even to an empty string, of
        ``PYTORCH_CUDA_ALLOC_CONF``, ``PYTORCH_HIP_ALLOC_CONF``, ``PYTORCH_ALLOC_CONF`` (about
        2.8-2.9 preferred ``PYTORCH_ALLOC_CONF``, and 2.9.1's CUDA-only keys ignored it).
        ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` turns the caching allocator off: rejected.

        Example:
            >>> env = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64",
            ...        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
            >>> c = AllocatorConfig.from_env(env)
            >>> c.expandable_segments, c.max_split_size_mb
            (True, None)
            >>> AllocatorConfig.from_env({}) == AllocatorConfig()
            True
        """
        env = os.environ if environ is None else environ
        for var in ("PYTORCH_NO_CUDA_MEMORY_CACHING", "PYTORCH_NO_HIP_MEMORY_CACHING"):
            if env.get(var, "") not in ("", "0"):
                raise InvalidInputError(
                    f"{var}={env[var]!r} turns PyTorch's caching allocator off (one cudaMalloc "
                    "per tensor), which this simulator does not model; unset it"
                )
        for var in ENV_VARS:
            if var in env:
                return cls.parse(env[var])
        return cls()

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any] | None) -> AllocatorConfig:
        """The configuration recorded in a snapshot's ``allocator_settings`` dict.

        The dict holds ``max_split_size`` (bytes, -1 = unlimited), ``garbage_collection_threshold``,
        ``expandable_segments``, ``roundup_power2_divisions`` (``{"1": d, "2": d, ...}`` keyed by
        MiB interval start) and the last settings string (``PYTORCH_CUDA_ALLOC_CONF``), from which
        the options the dict lacks (``large_segment_size_mb``, ``max_non_split_rounding_mb``,
        ``per_process_memory_fraction``) are recovered. ``None`` (no settings in the file) gives
        the defaults. :attr:`notes` says where the recording torch (judged by the keys the dict
        has) behaved differently from 2.13 under these settings.

        Example:
            >>> c = AllocatorConfig.from_settings({"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1,
            ...     "garbage_collection_threshold": 0.0, "expandable_segments": False,
            ...     "roundup_power2_divisions": {"1": 0, "2": 4}})
            >>> c.max_split_size_mb, c.divisions_for(3 << 20), c.divisions_for(1 << 20)
            (None, 4, 0)
        """
        if settings is None:
            return cls()
        if not isinstance(settings, Mapping):
            raise InvalidInputError(
                f"allocator_settings must be a dict (a snapshot's 'allocator_settings'), got "
                f"{type(settings).__name__}"
            )
        text = settings.get("PYTORCH_CUDA_ALLOC_CONF", settings.get("PYTORCH_ALLOC_CONF", ""))
        base = cls.parse(text) if isinstance(text, str) and text else cls()
        kw: dict[str, Any] = {}
        mss = settings.get("max_split_size")
        if mss is not None:
            if not isinstance(mss, int) or (mss != -1 and (mss < 0 or mss % MB)):
                raise _bad("max_split_size", mss, "-1 (unlimited) or a whole number of MiB in bytes")
            kw["max_split_size_mb"] = None if mss in (-1, _SIZE_MAX) else mss // MB
        for key, typ in (
            ("garbage_collection_threshold", float),
            ("expandable_segments", bool),
            ("release_lock_on_cudamalloc", bool),
            ("graph_capture_record_stream_reuse", bool),
            ("pinned_use_cuda_host_register", bool),
            ("pinned_num_register_threads", int),
        ):
            if key in settings and settings[key] is not None:
                v = settings[key]
                if not isinstance(v, (int, float)):
                    raise _bad(key, v, typ.__name__)
                kw[key] = typ(v)
        rd = settings.get("roundup_power2_divisions")
        if rd is not None:
            kw["roundup_power2_divisions"] = _divisions_from_dict(rd)
        cfg = replace(base, **kw)
        return replace(cfg, notes=_version_notes(settings, cfg))

    def to_settings(self) -> dict[str, Any]:
        """The ``allocator_settings`` dict PyTorch (2.11-2.13) writes into a snapshot.

        Example:
            >>> s = AllocatorConfig.parse("max_split_size_mb:64").to_settings()
            >>> s["max_split_size"], s["PYTORCH_CUDA_ALLOC_CONF"], s["roundup_power2_divisions"]["32768"]
            (67108864, 'max_split_size_mb:64', 0)
        """
        return {
            "PYTORCH_CUDA_ALLOC_CONF": self.settings,
            "max_split_size": -1 if self.max_split_size_mb is None else self.max_split_size,
            "garbage_collection_threshold": self.garbage_collection_threshold,
            "expandable_segments": self.expandable_segments,
            "pinned_num_register_threads": self.pinned_num_register_threads,
            "release_lock_on_cudamalloc": self.release_lock_on_cudamalloc,
            "pinned_use_cuda_host_register": self.pinned_use_cuda_host_register,
            "graph_capture_record_stream_reuse": self.graph_capture_record_stream_reuse,
            "roundup_power2_divisions": {
                str(1 << k): d for k, d in enumerate(self.roundup_power2_divisions)
            },
        }

    def __repr__(self) -> str:
        parts = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != f.default
        ]
        return f"AllocatorConfig({', '.join(parts)})"


def _version_notes(settings: Mapping[str, Any], cfg: AllocatorConfig) -> tuple[str, ...]:
    """Where a torch older than 2.13 (judged by the settings' keys) behaved differently."""
    notes = ["the snapshot's settings do not record large_segment_size_mb, "
             "max_non_split_rounding_mb or per_process_memory_fraction: taken from the settings "
             f"string {cfg.settings!r} (defaults where it does not set them)"]
    if "graph_capture_record_stream_reuse" not in settings:  # keys of torch <= about 2.8
        notes.append("recorded by torch <= about 2.8: PYTORCH_ALLOC_CONF, if set, won over "
                     "PYTORCH_CUDA_ALLOC_CONF there (2.13: the CUDA variable wins)")
        if cfg.expandable_segments and (
            cfg.garbage_collection_threshold > 0 or cfg.max_split_size_mb is not None
        ):
            notes.append("with expandable segments, torch before about 2.5 also freed "
                         "expandable blocks in garbage collection and the oversize release; "
                         "the simulator follows 2.13 and skips them")
    return tuple(notes)


def _store(values: dict[str, Any], host: list[tuple[str, str]], key: str, v: Any, raw: str) -> None:
    if key in {f.name for f in fields(AllocatorConfig)}:
        values[key] = v
    else:
        host.append((key, raw))


def _lex(text: str) -> list[str]:
    """Split like PyTorch's lexer: ``,:[]`` are tokens of their own, spaces are dropped."""
    tokens: list[str] = []
    buf: list[str] = []
    for ch in text:
        if ch in ",:[]":
            if buf:
                tokens.append("".join(buf))
                buf = []
            tokens.append(ch)
        elif not ch.isspace():
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


def _division(raw: str) -> int:
    try:
        d = int(raw)
    except ValueError:
        raise _bad("roundup_power2_divisions", raw, "an integer division, 0 or a power of two") from None
    if d != 0 and not _is_pow2(d):
        raise _bad("roundup_power2_divisions", raw, "0 (plain rounding) or a power of two")
    return d


def _parse_divisions(tokens: list[str], i: int) -> tuple[tuple[int, ...], int]:
    """Parse the value of ``roundup_power2_divisions`` at ``tokens[i]``; return it and the next i."""
    opt = "roundup_power2_divisions"
    if i >= len(tokens):
        raise _bad(opt, "", "a power of two or a list like [256:1,512:2,>:4]")
    if tokens[i] != "[":
        d = _division(tokens[i])
        if d == 0:
            raise _bad(opt, tokens[i], "a power of two (the single-value form)")
        return (d,) * _INTERVALS, i + 1
    table = [0] * _INTERVALS
    first = True
    last_index = 0
    i += 1
    while True:
        if i >= len(tokens):
            raise _bad(opt, " ".join(tokens), "a list closed by ']'")
        if tokens[i] == "]":
            return tuple(table), i + 1
        key = tokens[i]
        if i + 2 >= len(tokens) or tokens[i + 1] != ":":
            raise _bad(opt, key, "interval:division pairs like 256:1")
        d = _division(tokens[i + 2])
        if key == ">":
            for k in range(last_index + 1, _INTERVALS):
                table[k] = d
        else:
            try:
                start_mb = int(key)
            except ValueError:
                raise _bad(opt, key, "an interval start in MiB (a power of two) or '>'") from None
            if not _is_pow2(start_mb):
                raise _bad(opt, key, "an interval start in MiB that is a power of two")
            index = min(start_mb.bit_length() - 1, _INTERVALS - 1)
            if first:
                for k in range(index):
                    table[k] = d
                first = False
            table[index] = d
            last_index = index
        i += 3
        if i < len(tokens) and tokens[i] == ",":
            i += 1


def _divisions_from_dict(rd: object) -> tuple[int, ...]:
    if not isinstance(rd, Mapping):
        raise _bad("roundup_power2_divisions", rd, "a dict {'1': d, '2': d, ..., '32768': d}")
    table = [0] * _INTERVALS
    for key, d in rd.items():
        try:
            start_mb = int(key)
        except ValueError:
            raise _bad("roundup_power2_divisions", key, "interval starts in MiB ('1' .. '32768')") from None
        if not _is_pow2(start_mb) or start_mb.bit_length() > _INTERVALS:
            raise _bad("roundup_power2_divisions", key, "interval starts '1', '2', '4', ... '32768'")
        if not isinstance(d, int) or (d and not _is_pow2(d)):
            raise _bad("roundup_power2_divisions", d, "0 or a power of two")
        table[start_mb.bit_length() - 1] = d
    return tuple(table)
