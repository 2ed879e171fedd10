"""What an estimate is judged against and what it returns: plain data at the bottom of the house.

- ``_catalog``: the GPUs (:class:`~torchmem.fit.GPU`: total and usable memory, compute
  capability, the CUDA context, the source of each figure) and :func:`~torchmem.fit.gpu`;
- ``_margin``: the error margin a "fits" keeps free, and the rule that applies it;
- ``_estimate``: the result, :class:`~torchmem.fit.Estimate` (with :class:`~torchmem.fit.KVCache`
  and :class:`~torchmem.fit.OOMSite`), JSON through ``to_dict``.

Every other room of :mod:`torchmem.fit` imports this one; it imports none of them.

Example:
    >>> from torchmem.fit.verdict._catalog import gpu
    >>> from torchmem.fit.verdict._margin import margin_for
    >>> card = gpu("A100-80GB")
    >>> card.compute_capability, margin_for(None, card, peak_reserved=0) == 256 << 20
    ((8, 0), True)
"""
