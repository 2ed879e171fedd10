"""Will it fit? Estimate a training step's GPU memory on a machine without that GPU.

- :func:`estimate`: run ``build(batch_size, **params)`` and its ``step()`` under fake tensors
  through a simulation of PyTorch's CUDA caching allocator; returns an :class:`Estimate` whose
  ``fits`` keeps the documented error margin free (:mod:`torchmem.fit.verdict._margin`);
  ``maximize="seq_len"`` (or any integer parameter) finds the largest value that fits.
- :func:`estimate_script`: the same for an unmodified script (``python train.py args``, or a
  module like ``python -m``), stopped after a few optimizer steps; returns a
  :class:`ScriptEstimate` (which steps ran, why it stopped, the writes skipped).
- :func:`estimate_hf`: the same for a transformers model from its config alone (``forward``,
  ``generate`` with its KV cache, ``train``); no weights are read.
- :class:`WhatIfRow`: one memory lever tried on the step (``estimate(..., what_if=True)``,
  ``torchmem estimate --what-if``): ``Estimate.what_if`` and ``Estimate.what_if_best``.
- :class:`Adam8bitStandIn`: what bitsandbytes' 8-bit Adam allocates, for builds that use it
  (bitsandbytes' CUDA kernels cannot run in an estimate).
- :data:`GPUS` / :func:`gpu`: the catalog of GPUs (total and usable memory, compute
  capability, the source of each figure), or a GPU from a byte size.

Example:
    >>> import torch
    >>> from torchmem.fit import estimate
    >>> def build(batch):
    ...     net = torch.nn.Linear(512, 512).cuda()   # "cuda" is fine: it is simulated
    ...     opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ...     x = torch.randn(batch, 512, device="cuda")
    ...     def step():
    ...         net(x).sum().backward(); opt.step(); opt.zero_grad()
    ...     return step
    >>> e = estimate(build, gpu="T4", batch_size=32)
    >>> e.fits, e.by_category["parameter"] == (512 * 512 + 512) * 4
    (True, True)
"""

from __future__ import annotations

from torchmem.fit.fakegpu._bnb import Adam8bitStandIn
from torchmem.fit.levers._whatif import WhatIfRow
from torchmem.fit.search._search import estimate
from torchmem.fit.targets._hf import estimate_hf
from torchmem.fit.targets._script import ScriptEstimate, estimate_script
from torchmem.fit.verdict._catalog import CONTEXT_BYTES, GPU, GPUS, gpu
from torchmem.fit.verdict._estimate import Estimate, KVCache, OOMSite

__all__ = ["Adam8bitStandIn", "CONTEXT_BYTES", "GPU", "GPUS", "Estimate", "KVCache", "OOMSite",
           "ScriptEstimate", "WhatIfRow", "estimate", "estimate_hf", "estimate_script", "gpu"]
