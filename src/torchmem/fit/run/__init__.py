"""One fake run: a build function and its step, on the fake GPU, to an :class:`~torchmem.fit.Estimate`.

- ``_engine`` (:func:`run_once`): builds the fake GPU (:mod:`torchmem.fit.fakegpu`) for a card,
  runs ``build(batch_size, **params)`` and ``step()`` inside :func:`torchmem.track`, and turns the
  simulator's peaks, the tracker's events and the watchers' findings into the estimate; a
  user's error is reported at the user's line;
- ``_kv``: which storages are the KV cache (cache objects, named attributes);
- ``_decode``, ``_decode_feed``: ``generate()``'s later decode steps extrapolated from the first
  ones and replayed into the simulator without the model;
- ``_stream``: a run's allocator requests recorded, so that a search predicts a probe from two
  earlier ones.

Every target (:mod:`torchmem.fit.targets`) and search (:mod:`torchmem.fit.search`) ends in
:func:`run_once`; it imports only the fake GPU and :mod:`torchmem.fit.verdict`.

Example:
    >>> import torch
    >>> from torchmem.fit.run._engine import run_once
    >>> def build(batch):
    ...     x = torch.zeros(batch, 1024, device="cuda")
    ...     return lambda: x * 2
    >>> e = run_once(build, 256, "T4")
    >>> e.peak_requested_bytes == 2 * 256 * 1024 * 4
    True
"""
