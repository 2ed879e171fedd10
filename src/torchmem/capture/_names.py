"""Module names as users know them from ``named_modules()``, shared by both trackers.

Example:
    >>> import torch
    >>> from torchmem.capture._names import _path_below
    >>> net = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(1, 1)]))
    >>> _path_below(net, net[0][0], "Net")
    'Net.0.0'
"""

from __future__ import annotations

import torch

__all__: list[str] = []


def _path_below(parent: torch.nn.Module, m: torch.nn.Module, pname: str) -> str:
    """``m``'s qualified name under ``parent`` (``"Net.h.0"``), as ``named_modules()`` gives it.

    A direct child is found at once; a module reached through a container that is never called
    itself (the blocks of a ``ModuleList`` or ``ModuleDict``) is found in the parent's subtree,
    so each layer keeps its index. A module that is not below ``parent`` (called from a
    parent's forward without being registered in it) is named by its type under the parent.
    """
    for attr, child in parent._modules.items():
        if child is m:
            return f"{pname}.{attr}"
    for qualified, sub in parent.named_modules():
        if sub is m and qualified:
            return f"{pname}.{qualified}"
    return f"{pname}.{type(m).__name__}"
