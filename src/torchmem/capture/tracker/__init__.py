"""The dispatch-mode memory tracker: every storage created while active, with attribution.

CONTRACT (other parts of torchmem code against this; it is stable):

* ``torchmem.track(*modules_and_optimizers, stacks=False, stack_depth=8, listeners=(), ...)``
  is a context manager yielding a :class:`Tracker`.
* ``tracker.add_listener(fn)`` / ``tracker.remove_listener(fn)`` / ``listeners=``:
  ``fn(event, storage)`` is called synchronously for every event as it is recorded. ALLOC events
  pass the ``torch.UntypedStorage`` (attach your own ``weakref.finalize`` to it if you need to;
  do not keep it alive), FREE and MARK events pass ``None``. The category an ALLOC carries at
  that moment is *provisional* (by phase: forward -> activation, backward/optimizer ->
  temporary, otherwise other); ``tracker.events()`` returns the final categories (see
  "Categories" below).
* ``tracker.events()`` (in sequence order), ``tracker.peak()`` (device -> peak live bytes),
  ``tracker.live_bytes(device=None)``, ``tracker.save(path)``, ``tracker.trace`` (a torch-free
  :class:`~torchmem.model.trace.Trace`); ``torchmem.load_trace(path)`` reads a saved file.
* ``tracker.mark(name)`` adds a MARK event with ``op=name``. A *step marker* is a MARK with
  ``op == "step"``: added after each ``optimizer.step()`` (``step_marker="optimizer"``, the
  default) or by ``tracker.step()``. ``Event.step`` counts the step markers recorded before the
  event, so iteration *k* is the events with ``step == k``.

How it works: a ``TorchDispatchMode`` sees every operator output (forward, backward, optimizer,
autograd's saved tensors are operator outputs too). An output whose ``UntypedStorage`` is not
already live is a new allocation (outputs of view and in-place/``out=`` operators alias their
inputs and are skipped; an in-place op allocates nothing). A weak reference with a callback on
the ``UntypedStorage`` records the free when PyTorch destroys the storage; the tracker never holds
a tensor or a storage. Module attribution uses global forward pre/post hooks; they also note the
autograd sequence number at each module boundary, so in backward the node being executed
(``torch._C._current_autograd_node()``) maps back to the module whose forward created it, with
no per-call tensor hooks. The optimizer phase uses the global optimizer step pre/post hooks.

Categories (heuristics):
  parameter / buffer / gradient / optimizer_state: storages of ``module.parameters()``,
  ``module.buffers()``, ``param.grad`` and ``optimizer.state`` of the objects passed to
  ``track()`` (recorded as ALLOC events at time 0), and of any module seen running or optimizer
  seen stepping (reclassified when seen). activation: allocated in the forward phase and still
  alive when forward ends (the forward phase runs from the first module call to the start of
  backward, an optimizer step or a step marker). temporary: freed within the phase it was
  allocated in. gradient (new): allocated in backward and the ``.grad`` of a known parameter when
  backward ends. optimizer_state: allocated in ``optimizer.step`` and held in
  ``optimizer.state``. input: allocated outside any phase and passed to an outermost module
  call. communication: a buffer a collective (``c10d::`` and functional collective operators)
  reads or writes that is none of the above (a DDP gradient bucket, FSDP2's all-gather and
  reduce-scatter buffers); its operator is the collective's name (``_comm`` says what was
  measured). other: the rest.

Distributed training: operator outputs that are wrapper subclasses (``DTensor``) are recorded by
their local tensors' storages; FSDP2's unsharded parameters (freed and re-made with
``UntypedStorage.resize_``, which the tracker wraps while active) are parameters, operator
``fsdp::split_with_sizes_copy``.

Storage ids: ``Event.storage`` is the ALLOC's sequence number + 1. A storage resized in place
(``resize_``, an ``out=`` into a too-small tensor) is recorded as a FREE of the old size and an
ALLOC of the new size (a new id). Frees that happen on another thread are recorded on the
tracking thread at its next event.

Threads: every ``threading.Thread`` started while the tracker is active runs under a mode of
its own, and ``Event.thread`` names the thread of each allocation and free (``_threads`` says
what happens to threads already running, and to those still running when the block ends).
Other threads' events are queued and appended by the tracking thread at its next event (or when
the block ends), so they have no module, phase ``other`` and category ``other``.

Limits: allocations inside one aten kernel that never surface as an output (workspaces) are
invisible (:func:`torchmem.track_lite` sees them); storages a kernel resizes without returning
them are missed; frees of storages in reference cycles are recorded when the garbage collector
runs; tensors created from Python data (``torch.tensor``) are seen through ``lift_fresh``.

Code layout (private modules, each one responsibility; :class:`Tracker` inherits them in this
order, so every step of an event runs as a plain method or closure, with no indirection):

- ``_sites``: call-site capture (the user's Python frames of an event).
- ``_recorder``: the tracker's state, listeners and the general path that appends one event.
- ``_phases``: step markers, phase regions, final categories, backward module attribution.
- ``_comm``: collectives, FSDP2's copy-out and storage resizes (distributed training).
- ``_hooks``: the global module and optimizer hooks (module names, the optimizer phase).
- ``_hotpath``: the dispatch mode and the per-operator and per-free closures.
- ``_threads``: the modes of threads started while tracking (``threading.Thread.start``).
- ``_tracker``: :class:`Tracker` (read API, lifecycle) and :func:`track`.

Example:
    >>> import torch, torchmem
    >>> model = torch.nn.Linear(4, 3)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with torchmem.track(model, opt) as tr:
    ...     model(torch.randn(2, 4)).sum().backward()
    ...     opt.step()
    >>> tr.peak()["cpu"] >= 48 + 12          # the parameters are counted from the start
    True
    >>> sorted({e.category.label for e in tr.events()})
    ['activation', 'gradient', 'input', 'other', 'parameter', 'temporary']
"""

from __future__ import annotations

from torchmem.capture.tracker._recorder import Listener
from torchmem.capture.tracker._tracker import Tracker, track

__all__ = ["track", "Tracker", "Listener"]
