"""The fake GPU: what the user's code runs on during an estimate, and what it reads back.

A run's operators flow through here, from the user's code down to the simulated allocator:

- ``_env`` (:func:`fake_cuda`): ``"cuda"`` devices, ``.cuda()``, streams, events and the
  CUDA queries answered as on a machine with the GPU, on fake CPU tensors;
- ``_placement``: which fake storages the GPU holds and which the host;
- ``_dispatch``: the dispatch mode each operator passes through (value reads answered,
  data-dependent sizes by rule, CUDA's in-place paths, the stop at the out-of-memory point);
- ``kernels/``: CUDA's kernel behaviours, one module per family (autocast, attention, reductions,
  convolutions, cuBLAS workspaces) behind :class:`~torchmem.fit.fakegpu.kernels.CudaEmulation`;
- ``_memory``: every GPU storage's birth and death fed to :class:`torchmem.sim.CachingAllocator`,
  with the workspaces and scratch buffers, the peaks and the out-of-memory point;
- ``_readings``: the script's own ``torch.cuda.memory_*`` readings, answered from the simulator;
- ``_values``, ``_shapes``, ``_generate``: values and sizes fake tensors cannot know, answered by a
  documented policy and listed (transformers' own reads as on a GPU);
- ``_accelerate``, ``_bnb``: libraries that decide on the device (accelerate's mixed precision)
  or whose CUDA kernels allocate what their fake kernels do not say (bitsandbytes' 4-bit and
  8-bit matmuls, paged optimizer state; :class:`~torchmem.fit.Adam8bitStandIn` where
  bitsandbytes is not installed);
- ``_dist``: the other ranks of a job (a fake process group, :class:`FakeWorld`);
- ``_checkpoints``: checkpoints loaded from their shapes, never their weights (``torch.load``,
  safetensors, transformers' ``from_pretrained``, Lightning's lazy load), with ``_imports``
  patching libraries when the script imports them;
- ``_compile``: the program's ``torch.compile`` calls, which run eagerly here, named in the
  report's note.

It imports :mod:`torchmem.fit.verdict` only; the run (:mod:`torchmem.fit.run`) assembles it.

Example:
    >>> import torch
    >>> from torchmem.fit.fakegpu._env import fake_cuda
    >>> with fake_cuda("H100-80GB", (9, 0)):
    ...     torch.cuda.is_available(), torch.cuda.get_device_capability()
    (True, (9, 0))
"""
