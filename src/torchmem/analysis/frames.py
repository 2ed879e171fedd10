"""Stack keys: which frames are PyTorch's internals, and how allocations group by stack.

An allocation's stack (innermost frame first) is shortened to a *key*: its ``depth`` innermost
frames that belong to the user's code, each as ``file:line:name``. Allocations with equal keys
form one :class:`StackGroup`.

Example:
    >>> from torchmem.model.snapshot import Frame
    >>> stack_key((Frame("??", 0, "torch::unwind::unwind()"), Frame("m.py", 4, "fwd")))
    ('m.py:4:fwd',)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from torchmem.model.snapshot import Frame, Snapshot

__all__ = ["is_internal_frame", "stack_key", "StackGroup", "group_by_stack"]

NO_STACK = "<no stack>"
INTERNAL_ONLY = "<torch internals>"

# Frames that say nothing about the user's code: PyTorch's own C++ unwinding and Python-runtime
# frames (the same families torch.cuda._memory_viz omits), plus files inside the torch package.
_OMIT_NAMES = (
    "unwind::unwind",
    "CapturedTraceback::gather",
    "gather_with_cpp",
    "_start",
    "__libc_start_main",
    "PyEval_",
    "PyObject_",
    "PyFunction_",
)
_OMIT_FILES = (
    "core/boxing",
    "/Register",
    "/Redispatch",
    "pythonrun.c",
    "Modules/main.c",
    "Objects/call.c",
    "Objects/methodobject.c",
    "pycore_ceval.h",
    "ceval.c",
    "cpython/abstract.h",
)


@lru_cache(maxsize=65536)
def is_internal_frame(frame: Frame) -> bool:
    """True for frames of PyTorch's internals and the Python runtime (filtered from stacks).

    Internal: native (C++) frames (any file not ending in ``.py``, e.g. ``??`` or
    ``CUDACachingAllocator.cpp``), interpreter frames, and Python files inside an installed
    ``torch`` package (``.../torch/...``).

    Example:
        >>> is_internal_frame(Frame("/venv/lib/site-packages/torch/nn/modules/module.py", 1, "_call_impl"))
        True
        >>> is_internal_frame(Frame("train.py", 3, "step"))
        False
    """
    name, filename = frame.name, frame.filename
    if filename.startswith("<"):  # torchmem's <op>/<module> pseudo-frames, <frozen ...>
        return False
    if not filename.endswith(".py"):  # native frames: PyTorch's C++ (or "??" when unsymbolised)
        return True
    for o in _OMIT_NAMES:
        if o in name:
            return True
    for o in _OMIT_FILES:
        if o in filename:
            return True
    f = filename.replace("\\", "/")
    return "/torch/" in f or f.startswith("torch/")


def stack_key(frames: Sequence[Frame], depth: int = 5, filter_internal: bool = True) -> tuple[str, ...]:
    """Group key of a stack: its ``depth`` innermost (non-internal) frames as ``file:line:name``.

    Example:
        >>> stack_key((Frame("??", 0, "torch::unwind::unwind()"), Frame("m.py", 4, "fwd"),
        ...            Frame("t.py", 9, "main")), depth=1)
        ('m.py:4:fwd',)
        >>> stack_key(())
        ('<no stack>',)
    """
    if not frames:
        return (NO_STACK,)
    kept = [f for f in frames if not is_internal_frame(f)] if filter_internal else list(frames)
    if not kept:
        return (INTERNAL_ONLY,)
    if depth > 0:
        kept = kept[:depth]
    return tuple(f.label() for f in kept)


@dataclass
class StackGroup:
    """Bytes and allocation count of one stack key (innermost frame first).

    Example:
        >>> StackGroup(("m.py:1:f",), 512, 1).to_dict()["bytes"]
        512
    """

    stack: tuple[str, ...]
    bytes: int
    count: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict.

        Example:
            >>> StackGroup(("a",), 1, 1).to_dict()
            {'stack': ['a'], 'bytes': 1, 'count': 1}
        """
        return {"stack": list(self.stack), "bytes": self.bytes, "count": self.count}


def group_by_stack(
    snap: Snapshot,
    live: Iterable[tuple[int, int]],
    depth: int = 5,
    filter_internal: bool = True,
    top: int | None = None,
) -> list[StackGroup]:
    """Group ``(size, stack id)`` pairs of ``snap`` by :func:`stack_key`, largest first.

    ``top`` keeps that many groups (``None`` or 0: all).

    Example:
        >>> s = Snapshot(); sid = s.intern_stack((Frame("m.py", 1, "f"),))
        >>> [g.to_dict() for g in group_by_stack(s, [(100, sid), (28, sid), (5, 0)])]
        [{'stack': ['m.py:1:f'], 'bytes': 128, 'count': 2}, {'stack': ['<no stack>'], 'bytes': 5, 'count': 1}]
    """
    cache: dict[int, tuple[str, ...]] = {}
    acc: dict[tuple[str, ...], list[int]] = {}
    stacks = snap.stacks
    for size, sid in live:
        key = cache.get(sid)
        if key is None:
            key = cache[sid] = stack_key(stacks[sid], depth, filter_internal)
        slot = acc.get(key)
        if slot is None:
            acc[key] = [size, 1]
        else:
            slot[0] += size
            slot[1] += 1
    groups = [StackGroup(k, v[0], v[1]) for k, v in acc.items()]
    groups.sort(key=lambda g: (-g.bytes, g.stack))
    return groups[:top] if top else groups
