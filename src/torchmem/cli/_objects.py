"""Load a user's object from ``path/to/file.py:factory`` or ``package.module:attr``.

The attribute may be a module, an optimizer, a tensor, a mapping or sequence of tensors, a
``(module, optimizer)`` tuple, or a callable (called with no arguments) returning one of these.
Every failure raises :class:`~torchmem.errors.ObjectLoadError` saying what was expected, except
a file that does not exist: :class:`~torchmem.errors.MissingFileError`, as everywhere.

Example:
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp(); path = os.path.join(d, "model.py")
    >>> _ = open(path, "w").write("import torch\\ndef build():\\n    return torch.nn.Linear(2, 2)\\n")
    >>> obj = load_object(path + ":build")
    >>> type(classify(obj).module).__name__
    'Linear'
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torchmem.errors import MissingFileError, ObjectLoadError

__all__ = ["load_object", "classify", "Target"]


def _split(spec: str) -> tuple[str, str]:
    if not isinstance(spec, str) or ":" not in spec:
        raise ObjectLoadError(
            f"expected an object spec 'path/to/file.py:factory' or 'package.module:attr', got "
            f"{spec!r}; fix: add ':name' after the file or module"
        )
    where, _, attr = spec.rpartition(":")
    if len(where) == 1 and where.isalpha():  # a bare Windows drive letter, no attr
        raise ObjectLoadError(f"{spec!r} has no ':attr' part")
    if not where or not attr:
        raise ObjectLoadError(
            f"object spec {spec!r} is incomplete; expected 'path/to/file.py:factory' or "
            "'package.module:attr'"
        )
    return where, attr


def _load_file(path: str) -> Any:
    if not os.path.isfile(path):
        raise MissingFileError(
            f"file {path!r} does not exist (from the spec before ':')", path=path, kind="python"
        )
    name = "_torchmem_user_" + str(abs(hash(os.path.abspath(path))))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ObjectLoadError(f"cannot import {path!r} as Python; expected a .py file")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    directory = os.path.dirname(os.path.abspath(path))
    added = directory not in sys.path
    if added:
        sys.path.insert(0, directory)
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001 - the user's code failed: report it clearly
        sys.modules.pop(name, None)
        raise ObjectLoadError(f"running {path!r} failed: {type(e).__name__}: {e}") from e
    finally:
        if added:
            sys.path.remove(directory)
    return mod


def load_object(spec: str, *, call: bool = True) -> Any:
    """Import the object named by ``spec``; call it (no arguments) if it is a plain callable.

    Example:
        >>> load_object("torchmem.examples:list_examples")[0][0]
        'mlp'
        >>> load_object("no_such_pkg_xyz:thing")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        torchmem.errors.ObjectLoadError: cannot import module 'no_such_pkg_xyz' ...
    """
    where, attr = _split(spec)
    if where.endswith(".py") or os.sep in where or "/" in where:
        mod = _load_file(where)
    else:
        try:
            mod = importlib.import_module(where)
        except ImportError as e:
            raise ObjectLoadError(
                f"cannot import module {where!r} ({e}); fix: check the name, install it, or give "
                "a file path 'path/to/file.py:attr'"
            ) from e
        except Exception as e:  # noqa: BLE001
            raise ObjectLoadError(f"importing {where!r} failed: {type(e).__name__}: {e}") from e
    obj: Any = mod
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ObjectLoadError(
                f"{where!r} has no attribute {attr!r} (failed at {part!r})"
            ) from None
    if call and callable(obj) and not _is_value(obj):
        try:
            obj = obj()
        except TypeError as e:
            raise ObjectLoadError(
                f"calling {spec} with no arguments failed ({e}); expected a factory that takes "
                "no arguments, or a module/optimizer/tensor object"
            ) from e
        except Exception as e:  # noqa: BLE001
            raise ObjectLoadError(f"calling {spec} failed: {type(e).__name__}: {e}") from e
    return obj


def _is_value(obj: Any) -> bool:
    import torch

    return isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor))


@dataclass
class Target:
    """What to inspect, sorted out of a loaded object.

    Example:
        >>> Target().empty
        True
    """

    module: Any = None
    optimizer: Any = None
    tensors: Any = None

    @property
    def empty(self) -> bool:
        """True when nothing was found.

        Example:
            >>> Target(module=object()).empty
            False
        """
        return self.module is None and self.optimizer is None and self.tensors is None


def classify(obj: Any) -> Target:
    """Sort a loaded object into module / optimizer / tensors for :func:`torchmem.inspect_memory`.

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(1, 1); opt = torch.optim.SGD(m.parameters(), lr=1.0)
        >>> t = classify((m, opt)); t.module is m, t.optimizer is opt
        (True, True)
    """
    import torch

    t = Target()
    items = list(obj) if isinstance(obj, (tuple, list)) else [obj]
    tensors: dict[str, torch.Tensor] = {}
    for i, item in enumerate(items):
        if isinstance(item, torch.nn.Module) and t.module is None:
            t.module = item
        elif isinstance(item, torch.optim.Optimizer) and t.optimizer is None:
            t.optimizer = item
        elif isinstance(item, torch.Tensor):
            tensors[f"tensor[{i}]" if len(items) > 1 else "tensor"] = item
        elif isinstance(item, Mapping) and item and all(isinstance(v, torch.Tensor) for v in item.values()):
            tensors.update({str(k): v for k, v in item.items()})
        else:
            raise ObjectLoadError(
                f"expected a torch.nn.Module, a torch.optim.Optimizer, a tensor, a mapping of "
                f"tensors or a (module, optimizer) tuple, got {type(item).__module__}."
                f"{type(item).__name__}"
            )
    if tensors:
        t.tensors = tensors
    if t.empty:
        raise ObjectLoadError("the object spec gave nothing to inspect (an empty sequence)")
    return t
