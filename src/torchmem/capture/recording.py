"""Record memory history and take snapshots on CUDA (PyTorch's allocator) and CPU (our tracker).

- CUDA: :func:`record_history` drives ``torch.cuda.memory._record_memory_history`` with safe
  defaults (Python-only stacks, alloc-time context, a bounded ``max_entries`` ring buffer) and
  :func:`snapshot` reads ``torch.cuda.memory._snapshot()``.
- CPU and other devices have no caching allocator and no allocator history; recording runs
  torchmem's dispatch-mode tracker (:func:`torchmem.track`) and the snapshot is built from its
  events by :func:`~torchmem.io.convert.snapshot_from_events` (one segment per live
  storage, synthetic addresses; the snapshot's ``notes`` say so).

:func:`start_recording` and :func:`stop_recording` are aliases of ``record_history(...).start()``
and ``.stop()``. Write a snapshot with ``torchmem.write_snapshot(path, torchmem.snapshot())``
(:func:`~torchmem.io.snapshot_file.write_snapshot`); :func:`dump_snapshot` is deprecated.

Example:
    >>> import torch, torchmem
    >>> with torchmem.record_history(device="cpu") as rec:
    ...     x = torch.zeros(1024)          # 4096 bytes
    ...     y = torch.ones(256)            # 1024 bytes
    ...     del y
    >>> snap = rec.snapshot()
    >>> [e.action for e in snap.trace(0) if e.action in ("alloc", "free_completed")]
    ['alloc', 'alloc', 'free_completed']
    >>> [b.size for s in snap.segments for b in s.blocks]
    [4096]
"""

from __future__ import annotations

import os
import sys
import warnings
from types import TracebackType
from typing import Any

import torch

from torchmem._device import device_name
from torchmem.capture._oom_errors import (
    OOM_MESSAGES,
    append_device_oom,
    append_host_oom,
    is_host_oom,
    is_oom_error,
    requested_bytes,
)
from torchmem.errors import DeviceError, InvalidInputError
from torchmem.io.convert import CPU_NOTE, snapshot_from_trace
from torchmem.io.pytorch_snapshot import from_pytorch
from torchmem.io.snapshot_file import write_snapshot
from torchmem.model.snapshot import Snapshot

__all__ = [
    "record_history",
    "start_recording",
    "stop_recording",
    "snapshot",
    "dump_snapshot",
    "oom_guard",
    "is_oom_error",
    "requested_bytes",
    "append_device_oom",
    "OOM_MESSAGES",
    "DEFAULT_MAX_ENTRIES",
]

#: Default ring-buffer size for CUDA history: bounded so long jobs cannot exhaust host memory
#: (PyTorch's own default is unbounded).
DEFAULT_MAX_ENTRIES = 100_000

# Active recordings, innermost last (per process; recordings are meant for the main thread).
_ACTIVE: list[record_history] = []
_LAST: list[Snapshot] = []


def _resolve_device(device: Any) -> torch.device:
    if device is None:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device_name(device))
    except DeviceError as e:
        raise DeviceError(f"record_history: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(
            f"record_history: device {device!r} was requested but CUDA is not available on this "
            "machine; use device='cpu' (recorded by torchmem's tracker) or run on a GPU"
        )
    return dev


class record_history:
    """Record memory history while the block runs (context manager; also start/stop).

    Args:
        device: ``"cuda"``/``"cuda:N"`` (PyTorch's allocator history) or ``"cpu"`` (and other
            devices: torchmem's tracker). Default: CUDA when available, else CPU.
        max_entries: CUDA ring-buffer size (default :data:`DEFAULT_MAX_ENTRIES`).
        stacks: CUDA stacks, ``"python"`` (default, cheap) or ``"all"`` (adds C++ frames).
        context: CUDA tracebacks, ``"alloc"`` (default), ``"all"``, ``"state"`` or ``None``.
        track_args: modules/optimizers passed to :func:`torchmem.track` on CPU, so their
            parameters and state are in the snapshot from the start.
        track_stacks: record Python stacks on CPU (default True; frames of the snapshot).

    Re-entrant: a nested ``record_history`` on the same device reuses the running recording.
    On exit the recording stops (CUDA history is switched off only by the outermost one) and
    :meth:`snapshot` keeps returning the final snapshot.

    Example:
        >>> import torch
        >>> rec = record_history(device="cpu")
        >>> rec.start()
        >>> t = torch.empty(128)             # 512 bytes
        >>> snap = rec.stop()
        >>> sum(b.size for s in snap.segments for b in s.blocks)
        512
    """

    def __init__(
        self,
        *track_args: Any,
        device: Any = None,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        stacks: str = "python",
        context: str | None = "alloc",
        track_stacks: bool = True,
    ) -> None:
        if not isinstance(max_entries, int) or max_entries <= 0:
            raise InvalidInputError(
                f"record_history: max_entries should be a positive int, got {max_entries!r}"
            )
        if stacks not in ("python", "all"):
            raise InvalidInputError(
                f"record_history: stacks={stacks!r}; expected 'python' or 'all'"
            )
        self.device = _resolve_device(device)
        self.max_entries = max_entries
        self.stacks = stacks
        self.context = context
        self.track_args = track_args
        self.track_stacks = track_stacks
        self._tracker: Any = None
        self._depth = 0
        self._owner = False
        self._final: Snapshot | None = None

    @property
    def is_cuda(self) -> bool:
        """True when this recording uses PyTorch's CUDA allocator history.

        Example:
            >>> record_history(device="cpu").is_cuda
            False
        """
        return self.device.type == "cuda"

    @property
    def active(self) -> bool:
        """True between :meth:`start` and :meth:`stop`.

        Example:
            >>> record_history(device="cpu").active
            False
        """
        return self._depth > 0

    def start(self) -> None:
        """Start recording (idempotent while running).

        Example:
            >>> r = record_history(device="cpu"); r.start(); r.active
            True
            >>> _ = r.stop()
        """
        if self._depth > 0:
            self._depth += 1
            return
        self._final = None
        if self.is_cuda:
            # reuse an enclosing CUDA recording instead of restarting (which would change its settings)
            self._owner = not any(r.is_cuda and r.active and r is not self for r in _ACTIVE)
            if self._owner:
                torch.cuda.memory._record_memory_history(
                    enabled="all",
                    context=self.context,
                    stacks=self.stacks,
                    max_entries=self.max_entries,
                    device=self.device,
                )
        else:
            from torchmem.capture.tracker import track

            tracker = track(*self.track_args, stacks=self.track_stacks)
            tracker.__enter__()
            self._tracker = tracker
        # counted as running only once everything started: a failed start leaves it stopped
        self._depth = 1
        _ACTIVE.append(self)

    def stop(self) -> Snapshot:
        """Stop recording and return the final snapshot.

        Example:
            >>> r = record_history(device="cpu"); r.start()
            >>> r.stop().source.format
            'torchmem-events'
        """
        if self._depth == 0:
            if self._final is not None:
                return self._final
            raise InvalidInputError("record_history.stop() called but the recording never started")
        self._depth -= 1
        if self._depth > 0:
            return self.snapshot()
        try:
            if self.is_cuda:
                self._final = self._cuda_snapshot()
                if self._owner:
                    torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
            else:
                tr = self._tracker
                tr.__exit__(None, None, None)
                self._final = _from_tracker(tr)
                self._tracker = None
        finally:
            if self in _ACTIVE:
                _ACTIVE.remove(self)
        _LAST[:] = [self._final]
        return self._final

    def _cuda_snapshot(self) -> Snapshot:
        raw = torch.cuda.memory._snapshot(self.device)
        snap = from_pytorch(raw)
        for i in range(torch.cuda.device_count()):
            snap.device_names.setdefault(i, f"cuda:{i}")
        return snap

    def snapshot(self) -> Snapshot:
        """The snapshot now (while recording) or the final one (after stopping).

        Example:
            >>> import torch
            >>> with record_history(device="cpu") as r:
            ...     a = torch.empty(256)
            ...     live = r.snapshot()
            >>> [b.size for s in live.segments for b in s.blocks]
            [1024]
        """
        if self._depth == 0:
            if self._final is None:
                raise InvalidInputError(
                    "record_history.snapshot(): nothing recorded yet; call it inside the "
                    "'with record_history():' block or after it ends"
                )
            return self._final
        if self.is_cuda:
            return self._cuda_snapshot()
        return _from_tracker(self._tracker)

    def __enter__(self) -> record_history:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _from_tracker(tracker: Any) -> Snapshot:
    snap = snapshot_from_trace(tracker)
    if CPU_NOTE not in snap.notes:
        snap.notes.append(CPU_NOTE)
    return snap


def start_recording(*track_args: Any, **kwargs: Any) -> record_history:
    """Alias of ``record_history(*track_args, **kwargs)`` followed by ``.start()``; returns it.

    Takes the same arguments as :class:`record_history`. Prefer ``with record_history(...):``,
    which stops the recording even when the block raises.

    Example:
        >>> rec = start_recording(device="cpu")
        >>> rec.active, stop_recording(rec).source.format
        (True, 'torchmem-events')
    """
    rec = record_history(*track_args, **kwargs)
    rec.start()
    return rec


def stop_recording(rec: record_history | None = None) -> Snapshot:
    """Alias of ``rec.stop()`` (default ``rec``: the innermost active recording).

    Returns the recording's final snapshot, as :meth:`record_history.stop` does.

    Example:
        >>> _ = start_recording(device="cpu")
        >>> isinstance(stop_recording(), Snapshot)
        True
    """
    if rec is None:
        if not _ACTIVE:
            raise InvalidInputError(
                "stop_recording(): no recording is active; start one with "
                "torchmem.capture.start_recording() or 'with torchmem.record_history():'"
            )
        rec = _ACTIVE[-1]
    return rec.stop()


def snapshot(device: Any = None) -> Snapshot:
    """A snapshot now: of the innermost active recording, else the last finished one, else CUDA.

    Without any recording on a CUDA machine it returns ``torch.cuda.memory._snapshot()`` (segments
    and blocks; no history). On CPU without a recording it raises, because CPU has no allocator
    state to read.

    Example:
        >>> import torch
        >>> with record_history(device="cpu"):
        ...     z = torch.empty(64)
        ...     s = snapshot()
        >>> s.segments[0].total_size
        256
    """
    want = None if device is None else _resolve_device(device)
    for rec in reversed(_ACTIVE):
        if want is None or rec.device.type == want.type:
            return rec.snapshot()
    if _LAST and (want is None or want.type != "cuda"):
        return _LAST[0]
    dev = want or _resolve_device(None)
    if dev.type == "cuda":
        raw = torch.cuda.memory._snapshot(dev)
        return from_pytorch(raw)
    raise InvalidInputError(
        "torchmem.snapshot(): nothing was recorded on CPU (it has no allocator state to read); "
        "wrap your code in 'with torchmem.record_history():' first"
    )


class oom_guard:
    """Write a snapshot to ``path`` when an out-of-memory error escapes the block, then re-raise.

    Caught: every error :func:`is_oom_error` recognises (the CPU allocator's ``RuntimeError``,
    ``torch.OutOfMemoryError`` from CUDA and XPU, MPS and HIP messages, ``MemoryError``). With
    ``record=True`` (default) the block is recorded (:class:`record_history`) unless a
    recording is already active, so the snapshot has the history leading to the error. A CUDA
    OOM's ``oom`` trace entry is PyTorch's own (without recorded history it is read from the
    error's message: :func:`append_device_oom`); for a host OOM one is appended (the size from
    the error's message, 0 when it does not say; ``device_free`` from the OS's available memory).
    Other exceptions pass through untouched and no file is written.

    With ``explain=True`` (default) the explanation of ``torchmem oom`` is written beside the
    snapshot: ``<path>.oom.txt`` (the words) and ``<path>.oom.json`` (``torchmem oom --json``).
    It runs ``torchmem oom`` in a child Python process (the analysis is not part of the
    recording layer, and a failing explanation must never hide the OOM): allow a few seconds;
    after 120 s it is abandoned with a warning and the error is re-raised as it is.
    ``written`` and ``explained`` hold the paths written.

    Example:
        >>> import os, tempfile, torch
        >>> p = os.path.join(tempfile.mkdtemp(), "oom.pickle")
        >>> try:
        ...     with oom_guard(p, device="cpu"):
        ...         keep = torch.empty(1000)
        ...         huge = torch.empty(1 << 50, dtype=torch.uint8)   # 1 PiB: a real CPU OOM
        ... except RuntimeError as e:
        ...     print(str(e)[str(e).index("DefaultCPUAllocator"):][:42])
        DefaultCPUAllocator: can't allocate memory
        >>> from torchmem.io.snapshot_file import load_snapshot
        >>> s = load_snapshot(p)
        >>> s.trace(0)[-1].action, s.trace(0)[-1].size == 1 << 50, s.segments[0].total_size
        ('oom', True, 4000)
        >>> print(open(p + ".oom.txt").read().splitlines()[0])  # doctest: +ELLIPSIS
        Host out of memory on cpu at trace entry 2: a request of 1024.00 TiB ...
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        format: str = "pickle",
        record: bool = True,
        device: Any = None,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        explain: bool = True,
    ) -> None:
        if format not in ("pickle", "json"):
            raise InvalidInputError(f"oom_guard: format={format!r}; expected 'pickle' or 'json'")
        self.path = os.fspath(path)
        self.format = format
        self.record = record
        self.device = device
        self.max_entries = max_entries
        self.explain = explain
        self._recs: list[record_history | None] = []
        self.written: str | None = None
        self.explained: list[str] = []

    def __enter__(self) -> oom_guard:
        rec = None
        if self.record and not _ACTIVE:
            rec = record_history(device=self.device, max_entries=self.max_entries)
            rec.start()
        self._recs.append(rec)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        rec = self._recs.pop()
        try:
            if exc is not None and is_oom_error(exc):
                try:
                    if rec is not None:
                        snap = rec.stop()
                        rec = None
                    else:
                        snap = snapshot(self.device)
                    if not any(t.count("oom") for t in snap.traces.values()):
                        if is_host_oom(exc):
                            append_host_oom(snap, exc)
                        else:  # a device OOM with no history recorded: the message says it
                            append_device_oom(snap, exc)
                    write_snapshot(self.path, snap, format=self.format)
                except Exception as err:  # never hide the out-of-memory error behind our own
                    _note(exc, f"torchmem.oom_guard could not write the snapshot to {self.path}: "
                               f"{type(err).__name__}: {err}")
                    return
                self.written = self.path
                done = f"snapshot written to {self.path}"
                if self.explain:
                    self.explained = _write_explanation(self.path, exc)
                    if self.explained:
                        done += f", explained in {self.explained[0]}"
                print(f"torchmem: out of memory; {done}", file=sys.stderr)
        finally:
            if rec is not None:
                rec.stop()


def _note(exc: BaseException, msg: str) -> None:
    """Warn, and add ``msg`` to the error's notes (shown with its traceback)."""
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    if hasattr(exc, "add_note"):
        exc.add_note(msg)


def _write_explanation(path: str, exc: BaseException) -> list[str]:
    """Run ``torchmem oom PATH --json`` in a child process; write ``PATH.oom.json`` and
    ``PATH.oom.txt``. Returns the paths written (none when it failed: a warning says why)."""
    import json
    import subprocess

    # the folder holding this torchmem package, so that the child imports the same one
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    code = "import sys; from torchmem.cli import main; sys.exit(main(sys.argv[1:]))"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, "oom", path, "--json"], capture_output=True, text=True,
            timeout=120, env=env, check=False,  # never hold the OOM back for long
        )
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip()
                               else f"exit code {proc.returncode}")
        doc = json.loads(proc.stdout)
        text = "".join(e["text"] for e in doc["explanations"])
        text += "".join(f"late OOMs     {c['text']}\n" for c in doc["creep"])
        with open(path + ".oom.json", "w", encoding="utf-8") as f:
            f.write(proc.stdout)
        with open(path + ".oom.txt", "w", encoding="utf-8") as f:
            f.write(text)
    except Exception as err:  # noqa: BLE001 - the OOM is what matters
        _note(exc, f"torchmem.oom_guard wrote {path} but could not explain it "
                   f"({type(err).__name__}: {err}); run 'torchmem oom {path}'")
        return []
    return [path + ".oom.txt", path + ".oom.json"]


_take_snapshot = snapshot  # dump_snapshot's parameter shadows the function


def dump_snapshot(
    path: str | os.PathLike[str], snapshot: Snapshot | None = None, format: str = "pickle"
) -> str:
    """Deprecated: use ``torchmem.write_snapshot(path, torchmem.snapshot())``.

    Writes ``snapshot`` (default: :func:`snapshot` now) to ``path`` with
    :func:`~torchmem.io.snapshot_file.write_snapshot` and returns the path, after a
    ``DeprecationWarning``.

    Example:
        >>> import os, tempfile, warnings, torch, torchmem
        >>> p = os.path.join(tempfile.mkdtemp(), "mem.pickle")
        >>> with torchmem.record_history(device="cpu"):
        ...     w = torch.empty(10)
        ...     with warnings.catch_warnings(record=True) as caught:
        ...         warnings.simplefilter("always")
        ...         _ = dump_snapshot(p)
        >>> caught[0].category.__name__
        'DeprecationWarning'
        >>> torchmem.load_snapshot(p).segments[0].total_size
        40
    """
    warnings.warn(
        "torchmem.capture.recording.dump_snapshot(path, snap) is deprecated; use "
        "torchmem.write_snapshot(path, snap) (or torchmem.write_snapshot(path, "
        "torchmem.snapshot()) for a snapshot taken now)",
        DeprecationWarning,
        stacklevel=2,
    )
    if snapshot is None:
        snapshot = _take_snapshot()
    write_snapshot(path, snapshot, format=format)
    return os.fspath(path)
