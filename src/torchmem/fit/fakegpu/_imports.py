"""Patch a library when it is imported: a script under the estimate imports transformers or
Lightning itself, after the estimate's patches were put in place.

:func:`when_imported` calls ``patch(module)`` for each named module: at once when it is already
imported, else right after the script's import of it has run (a finder on ``sys.meta_path`` wraps
that module's loader). ``patch`` returns what undoes it; everything is undone on exit, and the
finder is removed. ``around`` names modules whose own import runs inside a context manager (made
by the callable given): bitsandbytes, for one, must be imported as on a machine without CUDA.

Example:
    >>> seen = []
    >>> with when_imported({"json": lambda m: seen.append(m.__name__)}):
    ...     import json
    >>> seen
    ['json']
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

__all__ = ["when_imported"]

Patch = Callable[[ModuleType], "Callable[[], None] | None"]


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the patch (every other attribute is the loader's)."""

    def __init__(self, inner: Any, after: Callable[[ModuleType], None],
                 around: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
                 ) -> None:
        self._inner = inner
        self._after = after
        self._around = around

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with self._around() if self._around else contextlib.nullcontext():
            self._inner.exec_module(module)
        self._after(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... (tracebacks)
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, patches: dict[str, Patch], undo: list[Callable[[], None]],
                 around: Mapping[str, Callable[[], Any]] | None = None) -> None:
        self.patches = patches
        self.undo = undo
        self.around = dict(around or {})

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = None
        for finder in sys.meta_path:  # the finders after this one find it as they would
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, self._apply(patch), self.around.get(fullname))
        return spec

    def _apply(self, patch: Patch) -> Callable[[ModuleType], None]:
        def after(module: ModuleType) -> None:
            undo = patch(module)
            if undo is not None:
                self.undo.append(undo)

        return after


@contextlib.contextmanager
def when_imported(patches: Mapping[str, Patch],
                  around: Mapping[str, Callable[[], Any]] | None = None) -> Iterator[None]:
    """``patch(module)`` for each ``{module name: patch}``, now or when the module is imported
    inside; what each patch returns (a callable, or ``None``) is called on exit. A module named
    in ``around`` (``{name: context manager factory}``; it needs a patch too) is imported inside
    that context manager.

    Example:
        >>> import types
        >>> with when_imported({"types": lambda m: None}):
        ...     pass
    """
    undo: list[Callable[[], None]] = []
    finder = _Finder({}, undo, around)
    for name, patch in patches.items():
        module = sys.modules.get(name)
        if module is not None:
            finder._apply(patch)(module)
        else:
            finder.patches[name] = patch
    if finder.patches:
        sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        for u in reversed(undo):
            u()
