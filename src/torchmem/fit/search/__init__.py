"""``torchmem.estimate``: one fake run with given parameters, or the search for the largest value.

- ``_search`` (:func:`~torchmem.fit.estimate`): the arguments checked, then one run
  (:mod:`torchmem.fit.run`), the search, or the levers;
- ``_checks``: the build's keyword parameters, the search range and the margin's verdict;
- ``_bracket``: the search for the largest batch size, sequence length or any integer parameter
  that fits (a bracket narrowed by the memory curve, probes predicted from earlier ones);
- ``_lever_runs``: the levers of :mod:`torchmem.fit.levers` run on a build's step, and ``--max``
  searched again under the best of them.

Example:
    >>> import torch
    >>> from torchmem.fit.search._search import estimate
    >>> def build(batch):
    ...     x = torch.zeros(batch, 1 << 18, device="cuda")   # 1 MiB per row
    ...     return lambda: x * 2
    >>> estimate(build, gpu="T4", batch_size=64, steps=1).fits
    True
"""
