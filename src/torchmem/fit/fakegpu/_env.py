"""The fake GPU: run user code under fake tensors as if a CUDA device were present.

On a CPU-only build of PyTorch, fake tensors on a *fake CUDA* device abort the process in
autograd, so the estimate runs on fake *CPU* tensors; which of them stand for GPU memory and
which for host memory is kept by :class:`~torchmem.fit.fakegpu._placement.Placement`. For user code
written for CUDA this module makes that work:

- ``device="cuda"``, ``torch.device("cuda:0")``, ``.to("cuda")``, ``.cuda()``,
  ``module.cuda()``, ``with torch.device("cuda")`` and ``torch.set_default_device("cuda")``
  are redirected to the fake CPU device (a ``TorchFunctionMode`` rewrites device arguments)
  and, with a placement, make GPU storages (copies, for tensors on the host); ``.cpu()``,
  ``.to("cpu")`` and ``.pin_memory()`` make host ones; ``x.device``, ``x.is_cuda``,
  ``x.get_device()`` answer as on a GPU (``torch.device("cuda")`` stays a CUDA device);
- ``torch.cuda.is_available()`` is ``True``, ``device_count()`` 1 (N for a per-rank estimate
  of N ranks), ``get_device_name()`` the
  target GPU's name, ``get_device_capability()`` its compute capability,
  ``get_device_properties()`` its name, memory and capability, ``is_bf16_supported()``
  follows it; ``set_device``, ``manual_seed``, ``torch.cuda.device(...)`` do nothing; ``empty_cache()`` empties the *simulated* cache; the memory readings
  (``memory_allocated()``, ``max_memory_allocated()``, ``reset_peak_memory_stats()``,
  ``memory_stats()``, ``memory_summary()``, ``mem_get_info()``,
  ``memory._record_memory_history()``, ``memory._snapshot()``, ...) read or drive the
  simulator, in ``torch.cuda`` and ``torch.cuda.memory`` (:mod:`torchmem.fit.fakegpu._readings`);
  streams and events (``Stream``, ``stream()``, ``current_stream()``, ``Event``,
  ``synchronize()``, ``Tensor.record_stream``) give each stream its own pool and defer
  ``record_stream``'s frees (:mod:`torchmem.fit.fakegpu._streams`); CUDA graphs
  (``CUDAGraph``, ``graph()``, ``make_graphed_callables``) and ``MemPool`` allocate from
  private pools (:mod:`torchmem.fit.fakegpu._graphs`);
  ``get_rng_state()`` gives a 16-byte host tensor (checkpointing saves it);
  ``f"{t:.4f}"`` of a 0-d tensor formats its (answered) value, as for a real tensor;
  without a placement ``.pin_memory()`` returns the tensor;
- ``nn.init.trunc_normal_`` samples without rejection (the real loop reads tensor values);
  ``GradScaler.step`` steps the optimizer without asking (with ``.item()``) whether a gradient
  was inf/NaN: the estimate follows the usual path, finite gradients; a ``DataLoader``
  draws its seed and (``shuffle=True``) its permutation on real tensors, and loads batches in
  the main process (``num_workers`` is ignored: workers cannot receive fake tensors);
- **host data is real** (with a placement): a tensor made from host data (``torch.tensor(ids)``,
  ``torch.as_tensor``, ``torch.from_numpy``, ``torch.frombuffer``, with no device named or the
  host) is a real tensor, and so is the output of any call whose tensor inputs are all real host
  tensors without gradients and which names no GPU (``.type(torch.int64)``, ``torch.cat``,
  slicing, a collate's ``torch.stack``, ``.to(torch.float32)``, ``copy.deepcopy``): data
  preparation runs at the speed of a plain run, with its real values. Each new storage such a
  call makes is host memory in the estimate from then until it is freed. A real tensor meets
  the fake ones where the run moves it to the GPU (``.to("cuda")``, ``.pin_memory()``) or mixes
  it with them: from there on it is fake, as before. The GPU sees none of this;
  ``torch.randn(64, 512)`` and other factories without data stay fake;
- everything is restored on exit.

Example:
    >>> import torch
    >>> from torch._subclasses import FakeTensorMode
    >>> with FakeTensorMode(), fake_cuda("H100-80GB", (9, 0)):
    ...     ok = torch.cuda.is_available()
    ...     x = torch.ones(4, device="cuda").cuda()
    >>> ok, x.device.type, torch.cuda.is_available()
    (True, 'cpu', False)
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _device as _devmod

from torchmem.fit.fakegpu._graphs import FakeGraph, FakeMemPool, graph_pool_handle, use_mem_pool
from torchmem.fit.fakegpu._hostdata import _fast_inputs, _on_host_data, _real_on_host
from torchmem.fit.fakegpu._placement import _REAL, Placement, _tensors
from torchmem.fit.fakegpu._readings import SimReadings
from torchmem.fit.fakegpu._streams import ACTIVE, FakeEvent, FakeStream, Streams, fake_record_stream

__all__ = ["fake_cuda"]

_CPU = torch.device("cpu")


def _is_type(x: Any, kind: str) -> bool:
    """``x`` (a string or ``torch.device``) names a device of type ``kind``."""
    if isinstance(x, str):
        return x == kind or x.startswith(kind + ":")
    if isinstance(x, torch.device):
        return x.type == kind
    return False


def _is_cuda(x: Any) -> bool:
    return _is_type(x, "cuda")


def _fake_apply(self: torch.nn.Module, fn: Any, recurse: bool = True) -> torch.nn.Module:
    """``Module._apply`` for fake parameters: PyTorch swaps fake parameters with
    ``swap_tensors``, which fails while anything holds a weak reference to them (the tracker
    does); a conversion is applied in place with ``.data =``, as for real CPU/CUDA tensors, and
    a no-op conversion (``.to("cuda")`` here) leaves the parameter alone. A tensor subclass
    with inner tensors (a DTensor shard of ``fully_shard``: ``to_empty`` after building on the
    meta device) cannot take ``.data =``: it is swapped as PyTorch does, or replaced by a new
    parameter when something holds a weak reference to it."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if recurse:
        for m in self.children():
            m._apply(fn)
    for k, p in self._parameters.items():
        if p is None:
            continue
        with torch.no_grad():
            q = fn(p)
        wrapper = bool(is_traceable_wrapper_subclass(q) or is_traceable_wrapper_subclass(p))
        if q is p:
            pass
        elif wrapper:
            new = torch.nn.Parameter(q, requires_grad=p.requires_grad)
            try:
                torch.utils.swap_tensors(p, new)
            except RuntimeError:
                self._parameters[k] = p = new
        else:
            try:
                p.data = q
            except RuntimeError:  # another device type (a meta parameter): PyTorch replaces it
                self._parameters[k] = p = torch.nn.Parameter(q, requires_grad=p.requires_grad)
        g = p.grad
        if g is not None:
            with torch.no_grad():
                h = fn(g)
            if h is not g:
                p.grad = h
    for k, b in self._buffers.items():
        if b is not None:
            self._buffers[k] = fn(b)
    return self


def _fake_trunc_normal(
    tensor: torch.Tensor, mean: float, std: float, a: float, b: float,
    generator: Any = None,
) -> torch.Tensor:
    """``nn.init.trunc_normal_`` without rejection sampling, whose loop reads tensor values
    (``mask.any()``), which fake tensors do not have. In place, like the real one; the real
    one's short-lived masks (during ``build``) are not simulated."""
    with torch.no_grad():
        return tensor.normal_(mean, std, generator=generator).clamp_(a, b)


def _fake_maybe_opt_step(values: Any) -> Callable[..., Any]:
    """``GradScaler._maybe_opt_step``: the real one steps the optimizer when no gradient was
    inf/NaN, which it learns with ``.item()``; fake gradients have no values, so the estimate
    takes the common path (finite gradients: the optimizer steps and its state is allocated),
    listed in ``values`` (a :class:`~torchmem.fit.fakegpu._values.ValueReads`) as an assumed
    read of ``GradScaler found_inf`` with the value ``0.0``."""

    def maybe_opt_step(self: Any, optimizer: Any, optimizer_state: Any, *args: Any,
                       **kwargs: Any) -> Any:
        if values is not None:
            values.record("GradScaler found_inf", 0.0)
        return optimizer.step(*args, **kwargs)

    return maybe_opt_step


def _real_indices(original: Any) -> Any:
    """A sampler's ``__iter__`` run on real tensors: RandomSampler draws its seed and
    permutation with ``.item()``/``.tolist()``, which fake tensors cannot give. The indices are
    host-side integers (no GPU memory), so they are drawn for real, outside the fake mode and
    the tracker; the dataset is then indexed with them as usual."""

    def __iter__(self: Any) -> Iterator[Any]:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            indices = list(original(self))
        yield from indices

    return __iter__


def _real_init(original: Any) -> Any:
    """``_BaseDataLoaderIter.__init__`` outside the fake mode: it draws the loader's base seed
    with ``.item()`` (a host-side number, no GPU memory)."""

    def __init__(self: Any, loader: Any) -> None:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            original(self, loader)

    return __init__


def _main_process_iter(original: Callable[..., Any]) -> Callable[..., Any]:
    """``DataLoader.__iter__`` with ``num_workers`` read as 0 while the iterator is made.
    Worker processes cannot receive fake tensors, so batches are loaded in the main process
    (what workers produce is host memory, outside the GPU estimate); a subclass's own
    ``_get_iterator`` (litdata's ``StreamingDataLoader``: its multiprocessing
    iterator unless ``num_workers == 0``) loads in the main process too."""

    def __iter__(self: Any) -> Any:
        workers = self.num_workers
        self.num_workers = 0
        try:
            return original(self)
        finally:
            self.num_workers = workers

    return __iter__


def _cpu_fake_new(original: Callable[..., Any]) -> Callable[..., Any]:
    """``FakeTensor.__new__`` that makes a fake tensor of a CUDA device one of the fake CPU
    device: code that runs below this module's function mode (inside an operator, e.g.
    DTensor's sharding propagation on a ``"cuda"`` mesh) may still ask for ``"cuda"``; a
    CPU-only PyTorch cannot run such tensors (the estimate's placement says where they are).

    A fake parameter's type is ``FakeTensor`` (``nn.Parameter`` of a tensor subclass keeps the
    subclass), so the common idiom ``type(param)(data, requires_grad=...)`` (accelerate's
    ``init_empty_weights`` and ``set_module_tensor_to_device``) calls this with a tensor first:
    it makes the parameter that idiom means, ``nn.Parameter(data, requires_grad)``."""

    def __new__(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], torch.Tensor):
            grad = kwargs.get("requires_grad", args[1] if len(args) > 1 else True)
            return torch.nn.Parameter(args[0], requires_grad=bool(grad))
        fake_mode, elem, device, *rest = args
        if device.type == "cuda":
            device = _CPU
        return original(cls, fake_mode, elem, device, *rest, **kwargs)

    return __new__


#: ``{parameter subclass: its fake twin}`` (see :func:`_fake_make_subclass`)
_TWINS: dict[type, type] = {}


def _fake_make_subclass(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.Tensor._make_subclass`` that accepts a fake tensor: a parameter subclass whose
    ``__new__`` calls it (bitsandbytes' ``Params4bit`` and ``Int8Params``) gets, for fake data,
    a fake tensor whose class derives from both ``FakeTensor`` and that subclass, so the
    subclass's own methods (``Params4bit.to`` quantizes on the way to the GPU) run on it.
    ``type(p)(...)`` of such a tensor calls the subclass's ``__new__`` again."""

    def make_subclass(cls: Any, data: Any, require_grad: bool = False, *args: Any,
                      **kwargs: Any) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(data, FakeTensor) or issubclass(cls, FakeTensor):
            return original(cls, data, require_grad, *args, **kwargs)
        twin = _TWINS.get(cls)
        if twin is None:
            base = cls

            def __new__(klass: Any, *a: Any, **k: Any) -> Any:
                return base.__new__(base, *a, **k)

            twin = _TWINS[cls] = type(f"Fake{cls.__name__}", (FakeTensor, cls),
                                      {"__new__": __new__, "__module__": __name__})
        out = data.detach()
        out.requires_grad_(bool(require_grad))
        out.__class__ = twin
        return out

    return make_subclass


def _is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _fake_deepcopy(t: torch.Tensor, memo: dict[int, Any] | None) -> torch.Tensor:
    """``copy.deepcopy`` of a fake tensor (torchmetrics' states, a model copied for EMA):
    PyTorch's own copies the storage through the meta device, which it then refuses; a copy
    on the same side (GPU or host) with the same ``requires_grad``, as a real deepcopy."""
    if memo is not None and id(t) in memo:
        return memo[id(t)]  # type: ignore[no-any-return]
    if not t.is_leaf:
        raise RuntimeError(
            "Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
            "protocol at the moment"
        )
    with torch.no_grad():
        out = t.clone()
    out.requires_grad_(t.requires_grad)
    if isinstance(t, torch.nn.Parameter) or getattr(t, "_is_param", False):
        out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
    if memo is not None:
        memo[id(t)] = out
    return out


def _fake_format(self: torch.Tensor, spec: str) -> str:
    """``format(t, spec)`` of a fake tensor as of a real one: a 0-d tensor formats its value
    (a read, answered and listed as any other), so ``f"{loss:.4f}"`` logs."""
    if self.dim() == 0:
        return format(self.item(), spec)
    return object.__format__(self, spec)


def _rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch.cuda.get_rng_state()``: the generator's seed and offset, a 16-byte host tensor
    (checkpointing saves it to replay dropout in the recomputed forward)."""
    return torch.zeros(16, dtype=torch.uint8, device="cpu")


@contextlib.contextmanager
def _no_hub_kernels() -> Iterator[None]:
    """transformers 5.25+ swaps in CUDA kernels from the Hub for a model on a GPU (RoPE's
    ``kernels-community/rotary``); the estimate downloads nothing: the layers run their PyTorch
    code, as transformers' ``USE_HUB_KERNELS=NO`` makes them (unless the program sets it)."""
    if "USE_HUB_KERNELS" in os.environ:
        yield
        return
    os.environ["USE_HUB_KERNELS"] = "NO"
    try:
        yield
    finally:
        os.environ.pop("USE_HUB_KERNELS", None)


def _is_index(x: Any) -> bool:
    """``x`` is a device index (``.to(0)``, ``torch.device(0)``): an int, not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_cpu(x: Any) -> bool:
    return _is_type(x, "cpu")


def _target(x: Any) -> bool | None:
    """A device argument as a placement: ``True`` the GPU, ``False`` the host."""
    if _is_cuda(x):
        return True
    if _is_cpu(x):
        return False
    return None


_GETTERS = {
    torch.Tensor.is_cuda.__get__: lambda gpu: gpu,  # type: ignore[attr-defined]
    torch.Tensor.is_cpu.__get__: lambda gpu: not gpu,  # type: ignore[attr-defined]
    torch.Tensor.get_device: lambda gpu: 0 if gpu else -1,
}
_PARSE_TO = torch._C._nn._parse_to  # Module.to's argument parser
_COPIES = (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu)
#: the functions _CudaToCpu._placed handles by name (every other one takes its fast path
#: unless a device is named among its arguments)
_SPECIAL = frozenset({torch.Tensor.__deepcopy__, torch.Tensor.backward, torch.autograd.backward,
                      torch.device, _PARSE_TO, torch.Tensor.pin_memory, *_COPIES})
_DEVICE_ARGS = (str, torch.device)  # what _target reads as a device among the arguments


#: copies that stay on the host unless a GPU is named: real for real host tensors
_HOST_COPIES = frozenset({torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.__deepcopy__})


def _names_gpu(args: Any, kwargs: Any) -> bool:
    """A CUDA device (or a device index) among a copy's arguments."""
    dev = kwargs.get("device") if kwargs else None
    return any(_is_cuda(a) or _is_index(a) for a in args) or _is_cuda(dev) or _is_index(dev)


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to the (fake) CPU device; with a
    :class:`~torchmem.fit.fakegpu._placement.Placement`, keeps where each new storage is (the GPU or
    the host) and answers ``is_cuda``/``is_cpu``/``get_device()`` as on a GPU."""

    def __init__(self, placement: Placement | None = None) -> None:
        super().__init__()
        self.pl = placement

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        pl = self.pl
        if pl is None:
            return self._everything_on_gpu(func, args, kwargs)
        getter = _GETTERS.get(func)
        if getter is not None:
            gpu = pl.is_gpu(args[0]) if not pl.depth else None
            if gpu is None:  # PyTorch's internals, or a tensor the run did not make
                return func(*args, **kwargs)
            return getter(gpu)
        if (not kwargs and pl.on_real_host is not None and func not in _SPECIAL
                and _devmod.CURRENT_DEVICE is None):
            # host data preparation's common calls (torch.tensor(ids), x.type(torch.int64)):
            # what _placed would decide, found at once
            inputs = _fast_inputs(func, args)
            if inputs is not None:
                return _real_on_host(pl, func, args, kwargs, inputs)
        return self._placed(pl, func, args, kwargs)

    def _placed(self, pl: Placement, func: Any, args: Any, kwargs: Any) -> Any:
        if (func in _HOST_COPIES and pl.on_real_host is not None
                and not _names_gpu(args[1:], kwargs)):
            inputs = _on_host_data(func, args, kwargs)  # x.to(torch.float32), deepcopy(x)
            if inputs is not None:
                return _real_on_host(pl, func, args, kwargs, inputs)
        if (func not in _SPECIAL and _devmod.CURRENT_DEVICE is None
                and "device" not in kwargs and "pin_memory" not in kwargs):
            for a in args:
                if isinstance(a, _DEVICE_ARGS):
                    break
            else:  # the common case: no device named anywhere, the inputs place the outputs
                if pl.on_real_host is not None:
                    inputs = _on_host_data(func, args, kwargs)
                    if inputs is not None:
                        return _real_on_host(pl, func, args, kwargs, inputs)
                return self._in_context(pl, func, args, kwargs)
        if func is torch.Tensor.__deepcopy__ and _is_fake(args[0]):
            return _fake_deepcopy(args[0], args[1] if len(args) > 1 else kwargs.get("memo"))
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            out = self._backward(func, args, kwargs)
            if out is not NotImplemented:
                return out
        if func is torch.device or func is _PARSE_TO:
            # a CUDA device stays one: where it is used says the placement
            if func is torch.device and len(args) == 1 and not kwargs and _is_index(args[0]):
                # torch.device(0): the current accelerator's device 0, which a CPU-only
                # PyTorch refuses ("Cannot access accelerator device"); here the GPU
                return func("cuda", args[0])
            if func is _PARSE_TO and args and _is_index(args[0]):  # module.to(0)
                args = (torch.device("cuda", args[0]), *args[1:])
            return func(*args, **kwargs)
        if func is torch.Tensor.pin_memory:
            src = args[0]
            if pl.is_gpu(src):
                raise RuntimeError(
                    "cannot pin a CUDA tensor: only dense CPU tensors can be pinned "
                    "(PyTorch raises this on a GPU too); pin the host tensor before .to('cuda')"
                )
            with pl.force(False):
                return src.clone()
        if kwargs.get("pin_memory"):  # pinned host memory is host memory
            kwargs = dict(kwargs, pin_memory=False)
        target: bool | None = None
        if func is torch.Tensor.cuda:
            target = True
        elif func is torch.Tensor.cpu:
            target = False
        elif func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], torch.Tensor):
            target = pl.is_gpu(args[1])  # .to(other): other's device
        elif func is torch.Tensor.to and len(args) > 1 and _is_index(args[1]):
            args = (args[0], "cuda", *args[2:])  # .to(0): CUDA device 0 (rewritten below)
        for a in args:
            t = _target(a)
            if t is not None:
                target = t
        if any(_is_cuda(a) for a in args):
            args = tuple(_CPU if _is_cuda(a) else a for a in args)
        dev = kwargs.get("device")
        if dev is None and _devmod.CURRENT_DEVICE is not None and (
            func in _devmod._device_constructors()
        ):
            # torch.device("cuda") as a context / set_default_device: PyTorch's DeviceContext
            # sits below this mode and would add the CUDA device after it
            dev = _devmod.CURRENT_DEVICE
            kwargs = dict(kwargs, device=dev)
        if dev is not None:
            t = True if isinstance(dev, int) and not isinstance(dev, bool) else _target(dev)
            if t is not None:
                target = t
            if _is_cuda(dev) or isinstance(dev, int):
                kwargs = dict(kwargs, device=_CPU)
        if target is None:
            return self._in_context(pl, func, args, kwargs)
        saved_forced, pl.forced = pl.forced, target
        saved_context, pl.context = pl.context, target
        try:
            if func in _COPIES:
                src = args[0]
                if isinstance(src, torch.Tensor) and src.is_meta:
                    # a tensor without data (the meta device: init_empty_weights, a parameter
                    # a checkpoint did not fill) cannot be copied to a device, as in PyTorch
                    raise NotImplementedError("Cannot copy out of meta tensor; no data!")
                out = src if func is not torch.Tensor.to else func(*args, **kwargs)
                where = pl.is_gpu(src)
                if out is src and ((where is not None and where != target)
                                   or (where is None and target and not _is_fake(src))):
                    # a copy to the other side (PyTorch's .to does one); a real host tensor
                    # (host data, see _hostdata) becomes a fake one on the GPU
                    out = src.clone()
                return out
            return func(*args, **kwargs)
        finally:
            pl.forced, pl.context = saved_forced, saved_context

    @staticmethod
    def _in_context(pl: Placement, func: Any, args: Any, kwargs: Any) -> Any:
        """``func`` with no device named: its outputs go where its tensor inputs are."""
        tensors = [t for t in _tensors(args, kwargs) if type(t) not in _REAL]
        gpu = (True if not pl.host else pl.gpu_of(tensors)) if tensors else None
        if gpu is None or gpu == pl.context:
            return func(*args, **kwargs)
        saved, pl.context = pl.context, gpu
        try:
            return func(*args, **kwargs)
        finally:
            pl.context = saved

    def _backward(self, func: Any, args: Any, kwargs: Any) -> Any:
        """``backward()`` with this mode on: PyTorch turns a mode off while it handles a call,
        but the Python code autograd runs (hooks, custom ``Function.backward``, checkpointing's
        recomputed forward, FSDP's gradient offload) must see the GPU as the forward did. As
        ``torch.autograd.backward`` does, minus its torch-function dispatch (done here);
        ``NotImplemented`` for the forms it leaves to PyTorch (gradient edges)."""
        from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
        from torch.autograd.graph import _engine_run_backward
        from torch.overrides import is_tensor_like

        names = (("tensors", "gradient", "retain_graph", "create_graph", "inputs")
                 if func is torch.Tensor.backward else
                 ("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables",
                  "inputs"))
        bound = dict(zip(names, args))
        bound.update(kwargs)
        tensors = bound.get("tensors")
        grads = bound.get("gradient", bound.get("grad_tensors"))
        if grads is None:
            grads = bound.get("grad_variables")
        inputs = bound.get("inputs")
        tensors = (tensors,) if is_tensor_like(tensors) else tuple(tensors or ())
        if inputs is None:
            inputs_tuple: tuple[Any, ...] = ()
        elif is_tensor_like(inputs):
            inputs_tuple = (inputs,)
        elif isinstance(inputs, (list, tuple)):
            inputs_tuple = tuple(inputs)
        else:
            return NotImplemented
        if not tensors or not all(is_tensor_like(t) for t in tensors + inputs_tuple):
            return NotImplemented
        if inputs is not None and not inputs_tuple:
            raise RuntimeError("`inputs` argument to `backward()` cannot be empty.")
        create_graph = bool(bound.get("create_graph", False))
        retain_graph = bound.get("retain_graph")
        with self:
            grads_ = _tensor_or_tensors_to_tuple(grads, len(tensors))
            grads_ = _make_grads(tensors, grads_, is_grads_batched=False)
            _engine_run_backward(
                tensors, grads_, create_graph if retain_graph is None else retain_graph,
                create_graph, inputs_tuple, allow_unreachable=True, accumulate_grad=True,
            )
        return None

    @staticmethod
    def _everything_on_gpu(func: Any, args: Any, kwargs: Any) -> Any:
        """Without a placement: every fake tensor stands for GPU memory."""
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.device and args and _is_cuda(args[0]):
            return _CPU
        if func is torch.device and args and args[0] == "cuda":
            return _CPU
        if any(_is_cuda(a) for a in args):
            args = tuple(_CPU if _is_cuda(a) else a for a in args)
        dev = kwargs.get("device")
        if dev is not None and (_is_cuda(dev) or isinstance(dev, int)):
            kwargs = dict(kwargs, device=_CPU)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_cuda(
    name: str,
    capability: tuple[int, int],
    *,
    empty_cache: Callable[[], None] | None = None,
    clear_workspaces: Callable[[], None] | None = None,
    readings: SimReadings | None = None,
    total_bytes: int = 0,
    context_bytes: int = 0,
    placement: Placement | None = None,
    devices: int = 1,
    values: Any = None,
    streams: Streams | None = None,
) -> Iterator[None]:
    """Make user code see one CUDA device named ``name`` while fake tensors stand in for it.

    ``empty_cache`` is called by ``torch.cuda.empty_cache()``, ``clear_workspaces`` by
    ``torch._C._cuda_clearCublasWorkspaces()`` (a CUDA build's; PyTorch's memory tests call
    it before each reading); ``readings`` answers the memory
    readings (``torch.cuda.memory_allocated()`` and the rest) from the estimate's simulator
    (without it, from an empty one). ``placement`` (:class:`~torchmem.fit.fakegpu._placement.Placement`)
    keeps the host and the GPU apart; without it every fake tensor stands for GPU memory and
    reports the CPU device. ``devices`` is what ``device_count()`` says: a per-rank estimate of
    ``N`` ranks on one node sees ``N`` GPUs (a trainer asked for ``devices=N`` checks that),
    while the run itself uses device 0 (rank 0's). ``values`` (a
    :class:`~torchmem.fit.fakegpu._values.ValueReads`) lists what is assumed without a read
    (``GradScaler``'s finite gradients). ``streams`` (:class:`~torchmem.fit.fakegpu._streams.Streams`)
    answers ``torch.cuda.Stream``, ``stream()``, ``Event`` and ``record_stream`` (without it, one
    on ``readings``' simulator that marks no blocks). Not thread-safe and not re-entrant: one estimate at a
    time per process.

    Example:
        >>> import torch
        >>> with fake_cuda("T4", (7, 5)):
        ...     torch.cuda.get_device_name(), torch.cuda.is_bf16_supported()
        ('T4', False)
    """
    cuda = torch.cuda
    memory = torch.cuda.memory
    if readings is None:
        from torchmem.sim import CachingAllocator

        readings = SimReadings(
            CachingAllocator(), total_bytes=total_bytes, context_bytes=context_bytes
        )
    props = types.SimpleNamespace(
        name=name, total_memory=total_bytes, major=capability[0], minor=capability[1],
        multi_processor_count=1, is_integrated=False, is_multi_gpu_board=False,
    )
    if streams is None:
        streams = Streams(readings.sim)
    patches: dict[str, Any] = {
        "get_device_properties": lambda *a, **k: props,
        "device": lambda *a, **k: contextlib.nullcontext(),
        "stream": lambda stream=None: streams.using(stream),  # timm passes stream=
        "StreamContext": lambda stream=None: streams.using(stream),
        "set_stream": streams.set,
        "Stream": FakeStream,
        "Event": FakeEvent,
        "current_stream": lambda *a, **k: streams.stream(),
        "default_stream": lambda *a, **k: streams.default,
        "is_available": lambda: True,
        "is_current_stream_capturing": lambda: streams.capturing,
        "CUDAGraph": FakeGraph,
        "graph_pool_handle": graph_pool_handle,
        "MemPool": FakeMemPool,
        "use_mem_pool": use_mem_pool,
        "device_count": lambda: devices,
        "current_device": lambda: 0,
        "set_device": lambda *a, **k: None,
        "synchronize": lambda *a, **k: streams.synchronize(),
        "manual_seed": lambda *a, **k: None,
        "manual_seed_all": lambda *a, **k: None,
        "get_device_name": lambda *a, **k: name,
        "get_device_capability": lambda *a, **k: capability,
        "is_bf16_supported": lambda *a, **k: capability >= (8, 0),
        "empty_cache": (lambda: empty_cache()) if empty_cache else (lambda: None),
        "get_rng_state": _rng_state,
        "get_rng_state_all": lambda: [_rng_state()],
        "set_rng_state": lambda *a, **k: None,
        "set_rng_state_all": lambda *a, **k: None,
        "seed": lambda: None,
        "seed_all": lambda: None,
        "initial_seed": lambda: 0,
    }
    own = readings.patches()
    patches.update({k: v for k, v in own.items() if not k.startswith("_")})
    memory_patches = {k: v for k, v in own.items() if hasattr(memory, k)}
    memory_patches["empty_cache"] = patches["empty_cache"]
    memory_patches.update(MemPool=FakeMemPool, use_mem_pool=use_mem_pool)
    saved = {k: getattr(cuda, k) for k in patches if hasattr(cuda, k)}
    memory_saved = {k: getattr(memory, k) for k in memory_patches}
    graphs = torch.cuda.graphs  # make_graphed_callables calls its own graph_pool_handle
    graph_patches = {k: patches[k] for k in ("CUDAGraph", "graph_pool_handle",
                                             "is_current_stream_capturing")}
    graph_saved = {k: getattr(graphs, k) for k in graph_patches}
    module_apply = torch.nn.Module._apply
    init = torch.nn.init
    trunc = init._no_grad_trunc_normal_
    from torch.amp.grad_scaler import GradScaler
    from torch.utils.data import DataLoader, RandomSampler
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    sampler_iter = RandomSampler.__iter__
    loader_iter_init = _BaseDataLoaderIter.__init__
    loader_iter = DataLoader.__iter__

    opt_step = GradScaler._maybe_opt_step
    record_stream = torch.Tensor.record_stream
    accel = torch.accelerator
    accel_patches: dict[str, Any] = {}
    c_patches: dict[str, Any] = {}
    if placement is not None:  # torch.accelerator and FSDP's device choice: the GPU
        cuda0 = torch.device("cuda", 0)
        accel_patches = {
            "current_accelerator": lambda *a, **k: cuda0,
            "current_device_index": patches["current_device"],
            "current_device_idx": patches["current_device"],
            "set_device_index": patches["set_device"],
            "set_device_idx": patches["set_device"],
            "device_index": patches["device"],
            **{k: patches[k] for k in ("is_available", "device_count", "synchronize",
                                       "current_stream", "set_stream", "empty_cache")},
            "get_memory_info": lambda *a, **k: patches["mem_get_info"](),
        }
        for k in ("memory_allocated", "memory_reserved", "max_memory_allocated",
                  "max_memory_reserved", "memory_stats", "reset_peak_memory_stats",
                  "reset_accumulated_memory_stats"):
            if k in patches:
                accel_patches[k] = patches[k]
        accel_patches = {k: v for k, v in accel_patches.items() if hasattr(accel, k)}
        c_patches = {k: (lambda *a, **kw: cuda0) for k in
                     ("_get_accelerator", "_accelerator_getAccelerator") if hasattr(torch._C, k)}
    clear = clear_workspaces if clear_workspaces is not None else (lambda: None)
    c_patches["_cuda_clearCublasWorkspaces"] = lambda: clear()
    c_patches["_host_emptyCache"] = lambda: None  # torch.cuda.graph's (pinned host memory)
    if hasattr(cuda, "_clear_cublas_workspaces"):  # torch.cuda's name for it in later versions
        patches["_clear_cublas_workspaces"] = lambda: clear()
    accel_saved = {k: getattr(accel, k) for k in accel_patches}
    # torch.Stream() / torch.Event(): the current accelerator's (transformers' offloaded cache)
    generic = {"Stream": FakeStream, "Event": FakeEvent} if placement is not None else {}
    generic_saved = {k: getattr(torch, k) for k in generic}
    c_saved = {k: getattr(torch._C, k) for k in c_patches if hasattr(torch._C, k)}
    mode = _CudaToCpu(placement)
    loads: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if placement is not None:  # weights are never read: see _checkpoints
        from torchmem.fit.fakegpu._checkpoints import checkpoints_without_weights

        loads = checkpoints_without_weights(placement)
    from torch._subclasses.fake_tensor import FakeTensor

    fake_device = FakeTensor.__dict__["device"]
    make_subclass = torch.Tensor._make_subclass
    fake_new = FakeTensor.__dict__["__new__"].__func__
    try:
        if placement is not None:
            FakeTensor.device = placement.device_property(fake_device)  # type: ignore[method-assign,assignment]
            FakeTensor.__new__ = staticmethod(_cpu_fake_new(fake_new))  # type: ignore[method-assign,assignment]
        FakeTensor.__format__ = _fake_format  # type: ignore[method-assign,assignment]
        torch.Tensor._make_subclass = staticmethod(_fake_make_subclass(make_subclass))  # type: ignore[method-assign,assignment]
        for k, v in accel_patches.items():
            setattr(accel, k, v)
        for k, v in generic.items():
            setattr(torch, k, v)
        for k, v in c_patches.items():
            setattr(torch._C, k, v)
        for k, v in patches.items():
            setattr(cuda, k, v)
        for k, v in graph_patches.items():
            setattr(graphs, k, v)
        for k, v in memory_patches.items():
            setattr(memory, k, v)
        ACTIVE.append(streams)
        capture_stream = torch.cuda.graph.default_capture_stream
        torch.Tensor.record_stream = fake_record_stream  # type: ignore[method-assign,assignment]
        torch.nn.Module._apply = _fake_apply  # type: ignore[method-assign]
        init._no_grad_trunc_normal_ = _fake_trunc_normal
        GradScaler._maybe_opt_step = _fake_maybe_opt_step(values)  # type: ignore[method-assign]
        RandomSampler.__iter__ = _real_indices(sampler_iter)  # type: ignore[method-assign]
        _BaseDataLoaderIter.__init__ = _real_init(loader_iter_init)  # type: ignore[method-assign]
        DataLoader.__iter__ = _main_process_iter(loader_iter)  # type: ignore[method-assign]
        with loads, mode, _no_hub_kernels():
            yield
    finally:
        FakeTensor.device = fake_device  # type: ignore[method-assign]
        FakeTensor.__new__ = staticmethod(fake_new)  # type: ignore[method-assign,assignment]
        if "__format__" in FakeTensor.__dict__:
            del FakeTensor.__format__
        if "_make_subclass" in torch.Tensor.__dict__:
            del torch.Tensor._make_subclass
        for k, v in accel_saved.items():
            setattr(accel, k, v)
        for k, v in generic_saved.items():
            setattr(torch, k, v)
        for k in c_patches:
            if k in c_saved:
                setattr(torch._C, k, c_saved[k])
            else:
                delattr(torch._C, k)
        torch.nn.Module._apply = module_apply  # type: ignore[method-assign]
        init._no_grad_trunc_normal_ = trunc
        GradScaler._maybe_opt_step = opt_step  # type: ignore[method-assign]
        torch.Tensor.record_stream = record_stream  # type: ignore[method-assign]
        if ACTIVE and ACTIVE[-1] is streams:
            ACTIVE.pop()
            torch.cuda.graph.default_capture_stream = capture_stream  # a real one, or None
        RandomSampler.__iter__ = sampler_iter  # type: ignore[method-assign]
        _BaseDataLoaderIter.__init__ = loader_iter_init  # type: ignore[method-assign]
        DataLoader.__iter__ = loader_iter  # type: ignore[method-assign]
        for k in patches:
            if k in saved:
                setattr(cuda, k, saved[k])
            else:
                delattr(cuda, k)
        for k, v in graph_saved.items():
            setattr(graphs, k, v)
        for k, v in memory_saved.items():
            setattr(memory, k, v)
