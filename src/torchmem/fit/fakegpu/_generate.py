"""transformers under fake tensors: the decisions it reads from tensor values, as on a GPU.

transformers reads a few tensor values on the host, which fake tensors do not have, and it
takes fake tensors for a sign of tracing (``is_tracing``), which makes it build masks a GPU run
would not (an explicit ``batch x 1 x S x S`` attention mask instead of SDPA's ``is_causal``):

- ``generate()``'s input checks: whether the prompt is right-padded, whether the pad token is
  the EOS token, whether the attention mask is all ones (then it is dropped), whether encoder
  ids are negative; its stopping decision after each new token
  (``unfinished_sequences.max() == 0``);
- the mask code's checks: whether positions are packed sequences, whether a padding mask is all
  ones.

While an estimate runs, :class:`GenerationPatches` makes transformers see fake tensors as
eager ones (not tracing) and answers the boolean value reads *made by transformers' own code*
the way an unpadded batch generating exactly ``max_new_tokens`` tokens goes, which is also the
most memory it can take: a read of a tensor made by ``all()`` is ``True`` (the mask is all
ones, nothing is packed), any other boolean read is ``False`` (no padding, no special token in
the prompt, no sequence finished early: EOS never stops it, as with ``min_new_tokens =
max_new_tokens``), and ``generate()``'s loop stops when the sequence reaches ``max_length``
(transformers' ``MaxLengthCriteria``, which the patched ``StoppingCriteriaList`` evaluates on
the sequence length, a Python int). A read made by any other code is still the clear error of
:mod:`torchmem.fit.run._engine`. The patches are installed once transformers is imported (by the
user's build) and removed when the estimate ends. A streamer is not fed (fake tokens cannot be
decoded).

The values themselves follow :mod:`torchmem.fit.fakegpu._values`' policy (whose booleans are the
rules above); these patches decide which reads are transformers' own, so they are answered even
with ``strict_values=True``.

Example:
    >>> import torch
    >>> from torch._subclasses import FakeTensorMode
    >>> g = GenerationPatches()
    >>> with FakeTensorMode():
    ...     mask = torch.ones(2, 3, dtype=torch.long)
    ...     no_padding = (mask == 1).all()                # made by aten.all: read as True
    ...     g.values.note_output(torch.ops.aten.all.default, no_padding, ())
    ...     g.active = True                               # as inside generate()
    ...     g.answer(no_padding), g.answer((mask == 0).any())
    (True, False)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from torchmem.fit.fakegpu._values import ValueReads

__all__ = ["GenerationPatches", "LOCAL_SCALAR"]

#: The operator behind ``.item()``, ``bool(t)``, ``int(t)``: a value read on the host.
LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
_MODULE = "transformers.generation.utils"
_STOPPING = "transformers.generation.stopping_criteria"
_IMPORT_UTILS = "transformers.utils.import_utils"
_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # torchmem/


def _not_fake(*args: Any, **kwargs: Any) -> bool:
    """transformers' ``is_fake_tensor`` during an estimate: fake tensors stand for real ones."""
    return False


def _read_by_transformers() -> bool:
    """Whether the innermost Python frame outside torch and torchmem is transformers' code."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_TORCH_DIR) or name.startswith(_OWN_DIR)):
            package = sys.modules.get("transformers")
            where = getattr(package, "__file__", None)
            return where is not None and name.startswith(os.path.dirname(where))
        frame = frame.f_back
    return False


class GenerationPatches:
    """Patches transformers' generation loop for one estimate (see the module docstring).

    ``install()`` patches ``GenerationMixin.generate``,
    ``GenerationMixin._has_unfinished_sequences``, ``StoppingCriteriaList.__call__`` and
    ``is_fake_tensor`` (behind ``is_tracing``) when transformers is imported (a no-op
    otherwise; call it again after the user's code imports it); ``remove()`` restores them.
    ``active`` is true inside ``generate()``; ``answer(t)`` is the value read from the fake
    boolean ``t`` by transformers' code (``None``: not answered).

    Example:
        >>> g = GenerationPatches()
        >>> g.install(); g.remove(); g.active, g.installed, g.calls
        (False, False, 0)
    """

    def __init__(self, values: ValueReads | None = None) -> None:
        self.active = False
        self.done = False
        #: whether the patches are in place (transformers is imported)
        self.installed = False
        #: generate() calls seen.
        self.calls = 0
        #: where the values come from: what made each tensor, and the policy
        self.values = values if values is not None else ValueReads()
        self._saved: list[tuple[Any, str, Any]] = []
        #: called at each loop check inside generate() while the loop goes on; True ends
        #: the loop there (:mod:`torchmem.fit.run._decode` replayed the rest)
        self.on_check: Callable[[GenerationPatches], bool] | None = None
        #: the sequence length at the last stopping check, and the length that stops it
        self.length: int | None = None
        self.max_length: int | None = None

    # -- value reads ----------------------------------------------------------------------------

    def answer(self, t: torch.Tensor) -> bool | None:
        """The value of a boolean read of ``t`` inside ``generate()`` or by transformers' own
        code; ``None`` when not answered (another reader, or not a one-element boolean)."""
        if t.dtype != torch.bool or t.numel() != 1:
            return None
        if not self.active and not _read_by_transformers():
            return None
        return bool(self.values.stand_in(t)[1])

    # -- the patches ----------------------------------------------------------------------------

    def install(self) -> None:
        """Patch transformers' generation loop, once, if it is imported."""
        mod = sys.modules.get(_MODULE)
        stop = sys.modules.get(_STOPPING)
        utils = sys.modules.get(_IMPORT_UTILS)
        if self.installed or mod is None or stop is None or utils is None:
            return
        mixin = getattr(mod, "GenerationMixin", None)
        criteria = getattr(stop, "StoppingCriteriaList", None)
        if mixin is None or criteria is None or not hasattr(mixin, "_has_unfinished_sequences"):
            return
        if hasattr(utils, "is_fake_tensor"):
            self._patch(utils, "is_fake_tensor", lambda original: _not_fake)
        self._patch(mixin, "generate", self._wrap_generate)
        self._patch(mixin, "_has_unfinished_sequences", self._wrap_unfinished)
        self._patch(criteria, "__call__", self._wrap_criteria)
        self.installed = True

    def remove(self) -> None:
        """Restore what :meth:`install` patched."""
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)
        self.active = self.installed = False

    def _patch(self, owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
        original = vars(owner)[name]
        self._saved.append((owner, name, original))
        setattr(owner, name, wrap(original))

    def _wrap_generate(self, original: Any) -> Any:
        patches = self

        def generate(model: Any, *args: Any, **kwargs: Any) -> Any:
            outer = patches.active
            patches.active, patches.done = True, False
            patches.length = patches.max_length = None
            patches.calls += 1
            try:
                return original(model, *args, **kwargs)
            finally:
                patches.active = outer

        generate.__wrapped__ = original  # type: ignore[attr-defined]
        return generate

    def _wrap_unfinished(self, original: Any) -> Any:
        patches = self

        def _has_unfinished_sequences(model: Any, this_peer_finished: Any, *args: Any,
                                      **kwargs: Any) -> bool:
            if patches.active and patches.done:
                return False
            if patches.active and patches.on_check is not None and patches.on_check(patches):
                patches.done = True
                return False
            return bool(original(model, this_peer_finished, *args, **kwargs))

        return _has_unfinished_sequences

    def _wrap_criteria(self, original: Any) -> Any:
        patches = self

        def __call__(criteria: Any, input_ids: Any, scores: Any = None, **kwargs: Any) -> Any:
            out = original(criteria, input_ids, scores, **kwargs)
            length = getattr(criteria, "max_length", None)
            if patches.active and length is not None:
                patches.length, patches.max_length = int(input_ids.shape[-1]), int(length)
                if input_ids.shape[-1] >= length:
                    patches.done = True
            return out

        return __call__
