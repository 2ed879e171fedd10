"""Per-rank estimates: one rank of an N-rank job, run under fake tensors with a fake process group.

``estimate(build, world_size=N)`` runs ``build`` and its ``step()`` inside :class:`FakeWorld`:

- **The process group** is PyTorch's own *fake* backend (``FakeProcessGroup`` with a
  ``FakeStore``, from ``torch.testing._internal.distributed.fake_pg``, the one PyTorch's tests
  use for ``fully_shard`` under fake tensors): rank ``R`` of ``N`` (``rank=R``, default 0;
  :func:`check_rank`); collectives return at once and
  move no data, but every tensor they are given or return has its real per-rank size, so
  ``fully_shard`` (FSDP2) shards to ``ceil(dim0 / N)`` rows (padded), all-gathers into
  ``N x shard`` buffers and reduce-scatters from them exactly as on a real job; a tensor
  parallel plan gives the rank its own local shapes (``torch.chunk``'s split: the last ranks
  of an uneven dimension hold fewer rows). ``RANK`` and ``LOCAL_RANK`` (the rank),
  ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` are set when unset. A default process group that is
  already initialised is an **error** (torchmem never reuses or tears down a group it did not
  create); the build's own ``dist.init_process_group(...)`` is accepted and does nothing.
  On exit the group is destroyed and every patch is undone, so a second estimate starts clean.
- **Device meshes** (``init_device_mesh``, which ``fully_shard`` calls) are built outside the
  fake mode (a mesh is a small host-side table of ranks, and its values are read); a
  ``"cuda"`` mesh stays one (``fully_shard``'s default mesh too: the accelerator is the fake
  GPU), so FSDP places its shards, all-gather and reduce-scatter buffers on the GPU
  (:mod:`torchmem.fit.fakegpu._placement`); DTensor's random-number tracker is off (fake tensors have
  no random values).
- **DTensor** (what ``fully_shard`` turns parameters into): the tracker and the simulator see
  the *local* operations a DTensor operator runs, never the global-size wrapper (their dispatch
  returns ``NotImplemented`` for DTensor arguments, as PyTorch's ``FSDPMemTracker`` does), and
  DTensor's sharding propagation (fake ops on global shapes, to compute output metadata) runs
  outside both.
- **Storage resizes**: FSDP2 frees unsharded parameters by resizing their storage to 0 and
  re-allocates them by resizing it back (``UntypedStorage.resize_``, not an operator). Each
  resize is shown to the tracker as an in-place ``set_`` on that storage, which the tracker
  records as a free of the old size and an allocation of the new one.
- **DDP** cannot run under fake tensors (its C++ reducer reads data pointers), so
  ``DistributedDataParallel(module, ...)`` builds :class:`_FakeDDP` instead: the module runs
  as is; the reducer's gradient buckets are allocated as DDP allocates them (PyTorch's own
  bucket assignment, ``dist._compute_bucket_assignment_by_size``: 1 MiB first bucket, then
  ``bucket_cap_mb``, default 25 MiB, in reverse parameter order), each gradient is copied into
  its bucket when ready and the bucket is all-reduced; ``gradient_as_bucket_view=True`` makes
  the gradients views of the buckets (no second copy).

How storages are categorised (:class:`DistWatch`, on top of the tracker's categories):
*communication* is every storage passed to or returned by a collective (an operator of the
``c10d``/``_c10d_functional`` namespaces: FSDP's all-gather output and reduce-scatter input
buffers, DDP's buckets); *parameter* the local storages of the parameters of every module seen
running (sharded DTensor shards, and FSDP's unsharded parameters while they are registered
during a module's forward); *gradient* the local storages of their ``.grad`` and the unsharded
gradients FSDP packs for its reduce-scatter (``fsdp.chunk_cat``'s inputs); *optimizer_state*
the local storages of ``optimizer.state``. A storage that is model state is never
communication (a reduce-scatter's output becomes the sharded gradient).

Example:
    >>> check_world_size(8), check_world_size(None)
    (8, None)
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torchmem._distributed import keep_defaults_groupless
from torchmem.errors import InvalidInputError

__all__ = ["check_world_size", "FakeWorld", "DistWatch"]

#: Collective operators live in these operator namespaces.
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})
#: Model-state categories win over communication.
_MODEL_STATE = ("parameter", "gradient", "optimizer_state")
_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def check_world_size(value: object, where: str = "world_size") -> int | None:
    """``value`` as a world size (an int >= 1), or ``None``; a clear error otherwise.

    Example:
        >>> check_world_size(64)
        64
        >>> check_world_size(0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        torchmem.errors.InvalidInputError: world_size must be an int >= 1 ..., got 0 ...
    """
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidInputError(
            f"{where} must be an int >= 1 (the number of ranks of the job to estimate), got "
            f"{value!r} ({type(value).__name__}); fix: e.g. {where}=8 for 8 GPUs"
        )
    return value


def check_rank(rank: Any, world_size: int | None, where: str = "rank") -> int:
    """Validate the rank a per-rank estimate runs: an int in ``0 .. world_size - 1``; a rank
    other than 0 needs a world size.

    Example:
        >>> check_rank(3, 8)
        3
        >>> check_rank(8, 8)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        torchmem.errors.InvalidInputError: rank must be an int from 0 to 7 ..., got 8 ...
    """
    if world_size is None:
        if rank == 0 and isinstance(rank, int) and not isinstance(rank, bool):
            return 0
        raise InvalidInputError(
            f"{where} {rank!r} names one rank of a job, but no world size was given; fix: give "
            "the job's size too (world_size=N, CLI: --world-size N), or drop the rank"
        )
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise InvalidInputError(
            f"{where} must be an int from 0 to {world_size - 1} (a rank of the "
            f"{world_size}-rank job), got {rank!r} ({type(rank).__name__}); fix: e.g. "
            f"{where}={world_size - 1} for the last rank"
        )
    return rank


def _forget_plans() -> None:
    """Clear DTensor's caches of sharding plans. They are keyed by the device mesh, which
    compares equal across ranks, and hold the local shapes of the rank that filled them: a
    process runs one rank on a real job, but an estimate of rank 3 after one of rank 0 would
    reuse rank 0's shapes (a view of 3 rows on rank 3's 1-row shard)."""
    try:
        from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # another torch version: nothing of the kind to clear
        return
    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()


def _check_mesh(shape: Any, world_size: int) -> None:
    """A device mesh of the job must fit its ranks: a mesh whose size does not divide the
    world size (``(3,)`` on 4 ranks) is refused in one line, naming the fix (a mesh larger
    than the world is torch's own error).

    Example:
        >>> _check_mesh((2, 4), 8); _check_mesh((2,), 8)
        >>> _check_mesh((3,), 4)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        torchmem.errors.InvalidInputError: init_device_mesh: a mesh of shape (3,) (3 ranks) does not divide ...
    """
    try:
        dims = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        return  # not a shape: torch's own error says so
    size = math.prod(dims)
    if size >= 1 and size <= world_size and world_size % size:
        raise InvalidInputError(
            f"init_device_mesh: a mesh of shape {dims} ({size} ranks) does not divide the job's "
            f"{world_size} ranks (world_size={world_size}); fix: a world size that is a multiple "
            f"of {size} (e.g. --world-size {size * -(-world_size // size)}), or a mesh whose "
            f"dimensions multiply to a divisor of {world_size}"
        )


def levers_on_rank_0(rank: int) -> None:
    """``what_if`` tries its levers on rank 0 of a job only: another rank is refused.

    Example:
        >>> levers_on_rank_0(0)
        >>> levers_on_rank_0(2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        torchmem.errors.InvalidInputError: what_if with rank=2: the levers are tried on rank 0 ...
    """
    if rank:
        raise InvalidInputError(
            f"what_if with rank={rank}: the levers are tried on rank 0 of the job only; fix: "
            f"drop rank, or estimate rank {rank} without what_if"
        )


def _local(t: Any) -> torch.Tensor | None:
    """A tensor's local data: a DTensor's local shard, a plain tensor itself."""
    if t is None or not isinstance(t, torch.Tensor):
        return None
    inner = getattr(t, "_local_tensor", None)
    if isinstance(inner, torch.Tensor):
        return inner
    return t


def _storage_key(t: Any) -> int | None:
    loc = _local(t)
    if loc is None or loc.layout is not torch.strided:
        return None
    try:
        return int(loc.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return None


class DistWatch:
    """Categories of a distributed run's storages and the sizes of its collectives.

    ``sid_of(storage_key)`` maps a live storage to the tracker's storage id. ``cat`` maps
    storage ids to report keys (``"parameter"``, ``"gradient"``, ``"optimizer_state"``,
    ``"communication"``); ``collectives`` maps an operator name to ``[calls, largest buffer
    bytes]``; ``model_state_pos`` is the tracker position (events recorded so far) at the end
    of the last ``optimizer.step()``, where :func:`torchmem.estimate` reads
    ``Estimate.model_state``.

    Example:
        >>> w = DistWatch(lambda key: None, lambda: 0)
        >>> w.cat, w.collectives, w.model_state_pos
        ({}, {}, -1)
    """

    def __init__(self, sid_of: Callable[[int], int | None], position: Callable[[], int]) -> None:
        self._sid_of = sid_of
        self._position = position
        self.cat: dict[int, str] = {}
        #: live storages' categories by storage key (a key is reused once its storage dies)
        self._by_key: dict[int, str] = {}
        self._freed: tuple[int, str | None] = (0, None)
        self.collectives: dict[str, list[int]] = {}
        self.model_state_pos = -1
        self._modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._optims: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._handles: list[Any] = []

    # -- marking -------------------------------------------------------------------------
    def _mark(self, t: Any, key_name: str) -> None:
        key = _storage_key(t)
        if key is None:
            return
        sid = self._sid_of(key)
        if key_name == "communication":
            if sid is not None and self.cat.get(sid) in _MODEL_STATE:
                return
            if self._by_key.get(key) in _MODEL_STATE:
                return
        self._by_key[key] = key_name
        if sid is not None:
            self.cat[sid] = key_name

    def on_free(self, key: int) -> None:
        """A storage's free (or the free half of a resize): its category is forgotten unless
        the next allocation is the same storage resized (:meth:`on_alloc`).

        Example:
            >>> w = DistWatch(lambda key: None, lambda: 0)
            >>> w._by_key[7] = "parameter"; w.on_free(7); w._by_key, w._freed
            ({}, (7, 'parameter'))
        """
        self._freed = (key, self._by_key.pop(key, None))

    def on_alloc(self, key: int, sid: int, op: str | None) -> None:
        """A storage resized in place (the tracker's ``set_`` allocation right after the
        free of its old size) keeps its category.

        Example:
            >>> w = DistWatch(lambda key: None, lambda: 0)
            >>> w._by_key[7] = "parameter"; w.on_free(7); w.on_alloc(7, 3, "aten::set_"); w.cat
            {3: 'parameter'}
        """
        freed_key, got = self._freed
        self._freed = (0, None)
        if op == "aten::set_" and freed_key == key and got is not None:
            self._by_key[key] = got
            self.cat[sid] = got

    def after_op(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """After each operator: collectives' buffers are communication; FSDP's packed
        unsharded gradients are gradients.

        Example:
            >>> w = DistWatch(lambda key: None, lambda: 0)
            >>> w.after_op(torch.ops.aten.add.Tensor, (), {}, None); w.collectives
            {}
        """
        ns = getattr(func, "namespace", "")
        if ns in _COLLECTIVE_NAMESPACES:
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs or {}, out))
                       if isinstance(t, torch.Tensor)]
            biggest = 0
            seen: set[int] = set()
            for t in tensors:
                key = _storage_key(t)
                if key is None or key in seen:
                    continue
                seen.add(key)
                loc = _local(t)
                if loc is not None:
                    biggest = max(biggest, int(loc.untyped_storage().nbytes()))
                self._mark(t, "communication")
            name = func.name()
            stat = self.collectives.setdefault(name, [0, 0])
            stat[0] += 1
            stat[1] = max(stat[1], biggest)
        elif ns == "fsdp" and func.__name__.startswith("chunk_cat"):
            for t in torch.utils._pytree.tree_leaves(args):
                if isinstance(t, torch.Tensor):
                    self._mark(t, "gradient")

    def _walk_module(self, m: torch.nn.Module) -> None:
        for p in m.parameters(recurse=False):
            self._mark(p, "parameter")
            if p.grad is not None:
                self._mark(p.grad, "gradient")
        for b in m.buffers(recurse=False):
            self._mark(b, "parameter")

    def _walk_optimizer(self, opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                self._mark(p, "parameter")
                if p.grad is not None:
                    self._mark(p.grad, "gradient")
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    self._mark(v, "optimizer_state")

    def walk(self) -> None:
        """Mark the model state of every module and optimizer seen so far.

        Example:
            >>> DistWatch(lambda key: None, lambda: 0).walk()
        """
        for m in list(self._modules):
            self._walk_module(m)
        for o in list(self._optims):
            self._walk_optimizer(o)

    # -- hooks ---------------------------------------------------------------------------
    def _fw_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._modules.add(module)
        self._walk_module(module)  # FSDP's unsharded parameters are registered now

    def _opt_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optims.add(opt)
        self.walk()

    def _opt_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optims.add(opt)
        self.walk()
        self.model_state_pos = self._position()

    def __enter__(self) -> DistWatch:
        from torch.nn.modules.module import register_module_forward_hook
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self._handles = [
            register_module_forward_hook(self._fw_post),
            register_optimizer_step_pre_hook(self._opt_pre),
            register_optimizer_step_post_hook(self._opt_post),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class FakeWorld:
    """Rank ``rank`` (default 0) of a ``world_size``-rank job in this process: PyTorch's fake process group and
    the patches that let ``fully_shard``/DDP run under ``fake_mode`` (see the module's
    docstring). ``extra_globals``: namespaces (the build's module globals) whose
    ``init_device_mesh``/``init_process_group`` are patched too; ``modes``: dispatch-mode
    classes besides the tracker's that must see DTensor's local operations. Not re-entrant;
    everything is undone on exit.

    Example:
        >>> import torch.distributed as dist
        >>> from torch._subclasses import FakeTensorMode
        >>> with FakeWorld(4, FakeTensorMode()):
        ...     dist.get_world_size(), dist.get_rank()
        (4, 0)
        >>> with FakeWorld(4, FakeTensorMode(), rank=3):
        ...     dist.get_rank()
        3
        >>> dist.is_initialized()
        False
    """

    def __init__(self, world_size: int, fake_mode: Any, extra_globals: list[dict[str, Any]]
                 | None = None, modes: tuple[type, ...] = (), rank: int = 0) -> None:
        self.world_size = check_world_size(world_size) or 1
        self.rank = check_rank(rank, self.world_size)
        self.fake_mode = fake_mode
        self._extra = extra_globals or []
        self._modes = modes  # more dispatch modes that must see DTensor's local operations
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> FakeWorld:
        import torch.distributed as dist

        if not dist.is_available():
            raise InvalidInputError(
                "world_size needs torch.distributed, which this PyTorch build lacks; fix: "
                "install a PyTorch build with distributed support or drop world_size"
            )
        if dist.is_initialized():
            raise InvalidInputError(
                f"a default process group is already initialised in this process (backend "
                f"{dist.get_backend()!r}, world size {dist.get_world_size()}); a per-rank "
                "estimate creates its own fake group of world_size ranks and never reuses or "
                "destroys yours; fix: estimate in a fresh process, or call "
                "torch.distributed.destroy_process_group() first"
            )
        from torch.testing._internal.distributed.fake_pg import FakeStore

        stack = self._stack
        keep_defaults_groupless()  # else a dispatch mode entered later may keep the fake group
        _forget_plans()  # another rank's, from an earlier estimate in this process
        stack.callback(_forget_plans)
        try:
            dist.init_process_group("fake", rank=self.rank, world_size=self.world_size,
                                    store=FakeStore())
            stack.callback(_destroy)
            for name, value in (("RANK", str(self.rank)), ("LOCAL_RANK", str(self.rank)),
                                ("WORLD_SIZE", str(self.world_size)),
                                ("LOCAL_WORLD_SIZE", str(self.world_size))):
                if name not in os.environ:
                    os.environ[name] = value
                    stack.callback(os.environ.pop, name, None)
            self._patch_all()
            warned = stack.enter_context(warnings.catch_warnings())
            del warned
            # fake tensors have no random values: DTensor's RNG tracker is off
            warnings.filterwarnings("ignore", message="DTensor random operators may not have")
        except BaseException:
            stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    # -- patches -------------------------------------------------------------------------
    def _patch_groups(self) -> None:
        """New groups (``new_group(backend="gloo")``, subgroups) on the fake backend too, and
        monitored barriers (Gloo's alone) that return at once."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        helper = c10d.__dict__["_new_process_group_helper"]
        self._set(c10d, "_new_process_group_helper", _fake_backend(helper))
        self._replace_everywhere(dist.monitored_barrier, _no_wait, "monitored_barrier")
        self._set(dist.ProcessGroup, "monitored_barrier", _no_wait)
        for name, sender in _OBJECT_COLLECTIVES.items():
            original = c10d.__dict__.get(name)
            if original is not None:
                self._replace_everywhere(original, _objects_of_others(name, original, sender),
                                         name)

    def _set(self, owner: Any, name: str, value: Any) -> None:
        if isinstance(owner, type) and name not in owner.__dict__:  # inherited: delete after
            setattr(owner, name, value)
            self._stack.callback(delattr, owner, name)
            return
        old = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        setattr(owner, name, value)
        self._stack.callback(setattr, owner, name, old)

    def _replace_everywhere(self, original: Any, replacement: Any, name: str) -> None:
        """``name`` in every loaded module (and the build's globals) bound to ``original``."""
        for mod in list(sys.modules.values()):
            # the module's own namespace only: a lazy module's __getattr__ is never called
            if getattr(mod, "__dict__", {}).get(name) is original:
                self._set(mod, name, replacement)
        for g in self._extra:
            if g.get(name) is original:
                g[name] = replacement
                self._stack.callback(g.__setitem__, name, original)

    def _patch_all(self) -> None:
        import torch.distributed as dist
        import torch.distributed.device_mesh as dm
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
        from torch.nn.parallel import DistributedDataParallel
        from torch.utils._python_dispatch import _disable_current_modes

        from torchmem.capture.tracker._hotpath import _Mode
        from torchmem.capture.tracker._threads import _ThreadMode

        original_mesh = dm.init_device_mesh

        world = self.world_size

        @functools.wraps(original_mesh)
        def init_device_mesh(device_type: str, *args: Any, **kwargs: Any) -> Any:
            shape = args[0] if args else kwargs.get("mesh_shape")
            _check_mesh(shape, world)
            with _disable_current_modes():
                return original_mesh(device_type, *args, **kwargs)

        self._replace_everywhere(original_mesh, init_device_mesh, "init_device_mesh")

        original_init = dist.init_process_group

        @functools.wraps(original_init)
        def init_process_group(*args: Any, **kwargs: Any) -> None:
            return None  # the fake group of the estimate is already the default group

        self._replace_everywhere(original_init, init_process_group, "init_process_group")
        self._patch_groups()

        # DTensor's random ops on a "cuda" mesh run under an offset-based RNG tracker (a
        # higher-order operator); fake tensors have no random values: plain random ops
        import torch.distributed.tensor._dispatch as dtensor_dispatch

        self._set(dtensor_dispatch, "is_rng_supported_mesh", lambda mesh: False)

        propagate = ShardingPropagator.__dict__["_propagate_tensor_meta_non_cached"]

        @functools.wraps(propagate)
        def quiet_propagation(prop: Any, op_schema: Any) -> Any:
            with _disable_current_modes():  # global-shape fake ops: metadata, not memory
                return propagate(prop, op_schema)

        self._set(ShardingPropagator, "_propagate_tensor_meta_non_cached", quiet_propagation)

        for cls in (_Mode, _ThreadMode, *self._modes):
            self._set(cls, "__torch_dispatch__", _local_ops_only(cls.__dict__[
                "__torch_dispatch__"], DTensor))

        resize = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            before = storage.nbytes()
            out = resize(storage, size)
            if storage.nbytes() != before:
                _show_resize(storage)
            return out

        self._set(torch.UntypedStorage, "resize_", resize_)
        # a DTensor's device is its local shard's (cuda:0 for a shard on the simulated GPU, as
        # the fake tensor's own device says outside operators): a second fully_shard over
        # modules already sharded checks it against the mesh's device (accelerate's FSDP2
        # preparation shards the blocks, then the embeddings and the model)
        self._set(DTensor, "device", property(_dtensor_device))
        # the tracker's own resize_ wrapper (for real FSDP2 runs) would record these resizes a
        # second time, without the categories this estimate keeps for them: off while estimating
        from torchmem.capture.tracker._comm import _Comm

        self._set(_Comm, "_install_resize", _no_resize_wrapper)
        self._set(DistributedDataParallel, "__new__", _ddp_new)


def _fake_backend(helper: Callable[..., Any]) -> Callable[..., Any]:
    """``distributed_c10d._new_process_group_helper`` making every new group on the fake
    backend: a group the program asks of another backend (Lightning's barrier makes a
    ``"gloo"`` one) would build that backend over the fake store, which it cannot use."""
    import inspect

    sig = inspect.signature(helper)

    @functools.wraps(helper)
    def new_group_helper(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        backend = bound.arguments.get("backend")
        if backend is not None and str(backend).lower() != "fake":
            bound.arguments["backend"] = "fake"
            if "backend_options" in sig.parameters:
                bound.arguments["backend_options"] = None  # another backend's options
        return helper(*bound.args, **bound.kwargs)

    return new_group_helper


#: the collectives of Python objects whose result comes from other ranks: name -> the argument
#: naming the rank that sends (this rank may run it: its own objects are known), or None (every
#: rank receives what others send)
_OBJECT_COLLECTIVES: dict[str, str | None] = {
    "broadcast_object_list": "src", "recv_object_list": None, "all_gather_object": None,
    "scatter_object_list": None, "gather_object": "dst",
}


def _objects_of_others(name: str, original: Callable[..., Any],
                       sender: str | None) -> Callable[..., Any]:
    """``torch.distributed.<name>`` under the fake ranks: the objects other ranks send cannot
    be known (only this rank runs; collectives move no data), so receiving them is an error
    that says so, instead of unpickling a fake tensor or sizing a buffer by an assumed value
    (a pipeline stage's shape inference asked for 127 TiB and read "does not fit"). The rank
    that sends (``src`` of a broadcast, ``dst`` of a gather, which only sends elsewhere) runs
    the collective as it is."""
    import inspect

    import torch.distributed as dist

    sig = inspect.signature(original)

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        me = dist.get_rank()
        if sender is not None:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            rank = bound.arguments.get(sender)
            local = bound.arguments.get(f"group_{sender}")
            if local is not None:
                group = bound.arguments.get("group") or dist.group.WORLD
                assert group is not None  # the fake world's default group
                rank = dist.get_global_rank(group, local)
            rank = 0 if rank is None else rank
            if (rank == me) == (sender == "src"):
                return original(*args, **kwargs)
        raise InvalidInputError(
            f"torch.distributed.{name} on rank {me} needs Python objects other ranks send; a "
            "per-rank estimate runs this rank alone (its collectives move no data), so they "
            "are unknown here (torch.distributed.pipelining exchanges its stages' shapes so: "
            "pipeline parallelism is not estimated yet); fix: estimate the rank that sends, or "
            "compute the objects on every rank instead of exchanging them")

    return collective


def _no_wait(*args: Any, **kwargs: Any) -> None:
    """A monitored barrier in the fake world: no other rank to wait for (the fake backend has
    no ``monitoredBarrier``; only Gloo's has)."""
    return None


def _dtensor_device(t: Any) -> torch.device:
    """``DTensor.device`` under the estimate: its local shard's device."""
    return t._local_tensor.device  # type: ignore[no-any-return]


def _no_resize_wrapper(tracker: Any) -> None:
    """Stands in for the tracker's ``_install_resize`` during a per-rank estimate."""
    return None


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _local_ops_only(original: Callable[..., Any], dtensor: type) -> Callable[..., Any]:
    """A mode's dispatch that lets DTensor run first, so the mode sees its local operations;
    ``wait_tensor`` returns its argument, as in eager mode (its fake implementation makes a
    new tensor, which would count a functional collective's output twice)."""
    wait = torch.ops._c10d_functional.wait_tensor.default

    def __torch_dispatch__(self: Any, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if any(issubclass(t, dtensor) for t in types):
            return NotImplemented
        if func is wait:
            return args[0]
        return original(self, func, types, args, kwargs)

    return __torch_dispatch__


def _show_resize(storage: torch.UntypedStorage) -> None:
    """Tell the tracker a storage changed size: an in-place ``set_`` on it (the tracker records
    a free of the old size and an allocation of the new one)."""
    # a fake tensor's storage is a meta storage; FSDP resizes the GPU's (unsharded parameters):
    # the fake GPU's view (the estimate's placement makes it a GPU tensor)
    view = torch.empty(0, dtype=torch.uint8, device="cuda")
    view.set_(storage)  # type: ignore[call-overload]
    del view


def _sharded(params: list[torch.Tensor]) -> bool:
    """Any of ``params`` is a DTensor (sharded by FSDP2)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch.distributed without DTensor
        return False
    return any(isinstance(p, DTensor) for p in params)


def _ddp_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    return torch.nn.Module.__new__(_FakeDDP)


def _make_fake_ddp() -> type:
    from torch.nn.parallel import DistributedDataParallel

    class FakeDDP(DistributedDataParallel):
        """DDP's memory under fake tensors: the module, its gradient buckets, an all-reduce
        per bucket (see :mod:`torchmem.fit.fakegpu._dist`)."""

        def __init__(self, module: torch.nn.Module, device_ids: Any = None,
                     output_device: Any = None, dim: int = 0, broadcast_buffers: bool = True,
                     init_sync: bool = True, process_group: Any = None,
                     bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                     check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                     static_graph: bool = False, **kwargs: Any) -> None:
            import torch.distributed as dist

            torch.nn.Module.__init__(self)
            self.module = module
            self.process_group = process_group
            self.gradient_as_bucket_view = gradient_as_bucket_view
            self.require_backward_grad_sync = True
            # what trainers read of a DDP module (Lightning's teardown: static_graph)
            self.device_ids, self.output_device, self.dim = device_ids, output_device, dim
            self.broadcast_buffers = broadcast_buffers
            self.find_unused_parameters = find_unused_parameters
            self.static_graph = static_graph
            params: list[torch.Tensor] = [p for p in module.parameters() if p.requires_grad]
            self._fake_buckets: list[tuple[torch.Tensor, list[torch.Tensor], list[int]]] = []
            self._fake_pending: dict[int, int] = {}
            self._fake_where: dict[int, tuple[int, int]] = {}
            if _sharded(params):
                # parameters FSDP already shards (the what-if's fsdp and cpu_offload levers
                # applied to a script that wraps its model in DDP): FSDP reduces their
                # gradients, so the wrapper is left with no buckets of its own, as the script
                # with fully_shard written in place of DDP has none
                return
            cap = int((25 if bucket_cap_mb is None else bucket_cap_mb) * 1024 * 1024)
            first = dist._DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
            indices, _ = dist._compute_bucket_assignment_by_size(
                params, [first, cap], [False] * len(params))
            for b, idx in enumerate(reversed(indices)):
                members = [params[i] for i in idx]
                offsets, total = [], 0
                for p in members:
                    offsets.append(total)
                    total += p.numel()
                flat = torch.empty(total, dtype=members[0].dtype, device=members[0].device)
                self._fake_buckets.append((flat, members, offsets))
                for p, off in zip(members, offsets):
                    self._fake_where[id(p)] = (b, off)
                    if gradient_as_bucket_view:
                        p.grad = flat.narrow(0, off, p.numel()).view_as(p)
                    p.register_post_accumulate_grad_hook(self._fake_ready)
            self._fake_reset()

        def _fake_reset(self) -> None:
            self._fake_pending = {b: len(m) for b, (_, m, _) in enumerate(self._fake_buckets)}

        def _fake_ready(self, p: torch.nn.Parameter) -> None:
            import torch.distributed as dist

            if not self.require_backward_grad_sync:
                return
            b, off = self._fake_where[id(p)]
            flat, members, offsets = self._fake_buckets[b]
            view = flat.narrow(0, off, p.numel()).view_as(p)
            grad = p.grad
            if grad is not None and (grad.untyped_storage()._cdata
                                     != flat.untyped_storage()._cdata):
                view.copy_(grad)
                if self.gradient_as_bucket_view:  # the reducer points the gradient at its bucket
                    p.grad = view
                del grad
            self._fake_pending[b] -= 1
            if self._fake_pending[b] == 0:
                dist.all_reduce(flat, group=self.process_group)
                if not self.gradient_as_bucket_view:  # averaged gradients copied back
                    for q, o in zip(members, offsets):
                        if q.grad is not None:
                            q.grad.copy_(flat.narrow(0, o, q.numel()).view_as(q))
                self._fake_pending[b] = len(members)

        def forward(self, *inputs: Any, **kwargs: Any) -> Any:
            if torch.is_grad_enabled():
                self._fake_reset()
            return self.module(*inputs, **kwargs)

        def _get_ddp_logging_data(self) -> dict[str, Any]:
            """DDP's runtime statistics: none here (its reducer never runs)."""
            return {"can_set_static_graph": False}

        def _set_static_graph(self) -> None:
            self.static_graph = True

        @contextlib.contextmanager
        def no_sync(self) -> Iterator[None]:
            old = self.require_backward_grad_sync
            self.require_backward_grad_sync = False
            try:
                yield
            finally:
                self.require_backward_grad_sync = old

    return FakeDDP


_FakeDDP: Any = _make_fake_ddp() if torch.distributed.is_available() else None
