"""Call-site capture: the user's Python frames at the moment an event is recorded.

Frames inside torch and torchmem (except the bundled example script), frozen modules and
``runpy`` are skipped, so a stack names the user's code only, innermost last.

Example:
    >>> import sys
    >>> def where():
    ...     return call_site(sys._getframe(), {}, 2)
    >>> [s.rsplit(":", 1)[1] for s in where()]
    ['<module>', 'where']
"""

from __future__ import annotations

import os
import sys
from types import CodeType, FrameType
from typing import Optional

import torch

__all__ = ["BOUNDARIES", "call_site"]

#: Code objects whose frames end a stack: what lies outside them is the machinery that runs the
#: user's program (the CLI, a worker process), not the program. The estimate of a script adds the
#: function that runs it, so its stacks start at the script's own ``<module>``. Add a code object
#: before a tracker first records from inside it (each tracker caches its verdict per code).
BOUNDARIES: set[CodeType] = set()

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TORCHMEM_DIR = (
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
)
_SKIP_FILES = {os.path.abspath(getattr(sys.modules.get("runpy"), "__file__", "") or "runpy.py")}


def call_site(frame: Optional[FrameType], skip: dict[CodeType, bool], depth: int) -> list[str]:
    """``"file:line:function"`` of up to ``depth`` user frames from ``frame`` outwards.

    The result is innermost last. ``skip`` caches, per code object, whether its frames are
    skipped; pass the same dict on every call.

    Example:
        >>> import sys
        >>> len(call_site(sys._getframe(), {}, 1))
        1
    """
    out: list[str] = []
    f = frame
    while f is not None and len(out) < depth:
        code = f.f_code
        s = skip.get(code)
        if s is None:
            fn = code.co_filename
            if code in BOUNDARIES:
                break
            s = skip[code] = (
                fn.startswith(_TORCH_DIR)
                or (fn.startswith(_TORCHMEM_DIR) and not fn.endswith("_example_train.py"))
                or fn.startswith("<frozen")
                or fn == "<frozen runpy>"
                or os.path.abspath(fn) in _SKIP_FILES
            )
        if not s:
            out.append(f"{code.co_filename}:{f.f_lineno}:{code.co_name}")
        f = f.f_back
    out.reverse()
    return out
