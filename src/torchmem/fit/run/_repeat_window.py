"""What one call of the outermost module did, and its replay (:mod:`torchmem.fit.run._repeat`).

:class:`_Window` is the record of one call: its forward's requests to the simulator and, when
its outputs require grad, its backward's, with its outputs' shapes; :class:`_Call` replays a
record (its backward through :class:`_Replayed`, a stand-in autograd node); :func:`_signature`
is the key under which calls repeat each other, :func:`_hooked` says where a replay would skip a
hook.

Example:
    >>> import torch
    >>> _strided_bytes(torch.empty(2, 3)), _signature(torch.nn.Linear(2, 2), (), {}) is None
    (24, False)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten

__all__: list[str] = []

_SIMPLE = (int, float, bool, str, type(None), torch.dtype, torch.device)
_OP = "repeated call (replayed)"


def _fsdp_module() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build without torch.distributed
        return None
    return FSDPModule  # type: ignore[no-any-return]


def _hooked(mod: torch.nn.Module, grad: bool, sharded: bool) -> bool:
    """Whether ``mod``, a submodule or a parameter carries a hook the replay would not run.

    A parameter's hooks run only in a backward (``grad``). Under the fake ranks (``sharded``),
    FSDP2's own module hooks are allowed in a call without grad: what they do (all-gather
    each group's parameters, free them after its forward, the result at the root's end) is in
    the record, and they leave FSDP's state as they found it."""
    fsdp = _fsdp_module() if sharded and not grad else None
    for m in mod.modules():
        if (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or m._backward_pre_hooks) and (fsdp is None or not isinstance(m, fsdp)):
            return True
    if grad:
        for p in mod.parameters():
            if getattr(p, "_post_accumulate_grad_hooks", None) or p._backward_hooks:
                return True
    return False



def _signature(mod: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The key under which calls repeat each other, or None when this call cannot be replayed."""
    leaves, spec = tree_flatten((args, kwargs))
    key: list[Any] = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if x.requires_grad or x.layout is not torch.strided:
                return None
            key.append((tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.device.type))
        elif isinstance(x, _SIMPLE):
            key.append((type(x), x))
        else:
            return None
    params = tuple((id(p), p.dtype, p.requires_grad, p.grad is None) for p in mod.parameters())
    return (id(mod), mod.training, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
            repr(spec), tuple(key), params)


class _Out(NamedTuple):
    """A tensor output of a recorded call: what makes it again, and what made it (the
    operator and rule a read of its value is answered by, one-element outputs)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    grad: bool
    handle: int
    made: tuple[str, Any] | None


class _Window:
    """What one call did to the simulator: its forward's requests (``fwd``) and, when its
    outputs require grad, its backward's (``bwd``).

    A request is ``("m", size, handle)`` (``("m", size, handle, stream)`` on a stream other
    than the default one), ``("f", handle)``, ``("r", delta, tag)`` (requested
    bytes; ``tag`` the storage's tracker id while recording, its label index once finished),
    ``("h", delta)`` (host bytes), ``("e",)`` (``empty_cache``) or, in backward, ``("g", k)``:
    the gradient arriving for output ``k`` is freed (its ``"r"`` just before it names it)."""

    def __init__(self, key: Any, start: int) -> None:
        self.key = key
        self.start = start  # the trace's length when the call began
        self.fwd: list[tuple[Any, ...]] = []
        self.bwd: list[tuple[Any, ...]] = []
        self.cur = self.fwd
        self.handle: dict[int, int] = {}  # address -> handle, for the blocks live now
        self.n = 0
        self.bad: str | None = None
        self.flops = 0
        #: per output leaf: (shape, stride, dtype, requires_grad, handle) or a constant
        self.outs: list[Any] = []
        self.spec: Any = None
        self.out_handles: set[int] = set()
        #: the trace row of each output's storage (its module, category and stack)
        self.out_rows: dict[int, int] = {}
        #: the storages of the gradients arriving in backward: tracker id -> output index
        self.grads_in: dict[int, int] = {}
        self.done = False  # its backward ended (or it has none)
        self.labels: list[tuple[str, str]] = []
        self.bwd_flops = 0
        #: the attention calls the CUDA emulation counted in the forward and the backward
        self.calls_f: dict[Any, int] = {}
        self.calls_b: dict[Any, int] = {}
        #: the storages of the call's tensor arguments: tracker id -> leaf index
        self.inputs: dict[int, int] = {}
        #: blocks freed by the autocast cache's clear after the call, in order; whether the
        #: window waits for that clear to be finished; each block's (bytes, label)
        self.cleared: list[int] = []
        self.wait_clear = False
        self.size_of: dict[int, tuple[int, int]] = {}
        #: the trace row of each block's storage (an out-of-memory point in a replay names it)
        self.site_of: dict[int, int] = {}


class _Call:
    """One replayed call: the blocks it holds in the simulator until its backward frees them."""

    def __init__(self, owner: Any, w: _Window, leaves: list[Any]) -> None:
        self.owner, self.w = owner, w
        self.addr: dict[int, int] = {}  # handle -> address
        self.backwards = 0
        #: the arguments the recorded graph kept until its backward released them
        kept = {ev[1] for ev in (*w.fwd, *w.bwd) if ev[0] == "i"}
        self.kept: dict[int, Any] = {j: leaves[j] for j in kept}

    def forward(self) -> list[torch.Tensor | Any]:
        """Replay the forward; the outputs (tensors made where the record made them)."""
        w, o = self.w, self.owner
        made: dict[int, torch.Tensor] = {}
        skip = -1
        for ev in w.fwd:
            kind = ev[0]
            if kind == "m" and ev[2] in w.out_handles:
                h = ev[2]
                streams = o.st.streams
                before = streams.current if streams is not None else 0
                if streams is not None and len(ev) > 3:  # made on another stream's pool
                    streams.current = ev[3]
                try:
                    made[h] = o.make_output(w, h)
                finally:
                    if streams is not None:
                        streams.current = before
                skip = h
            elif kind == "r" and skip >= 0:
                skip = -1  # the output's own requested bytes: counted as it was made
            elif kind == "i":
                self.kept.pop(ev[1], None)
            elif kind == "r" and ev[2] < 0:
                continue
            else:
                o.apply(ev, self.addr, w)
        o._add_flops(w.flops)
        o._add_calls(w.calls_f)
        if w.cleared:
            o.pending.append(self)
        out: list[Any] = []
        for leaf in w.outs:
            out.append(made[leaf.handle] if isinstance(leaf, _Out) else leaf[1])
        return out

    def backward(self, grads: tuple[Any, ...]) -> None:
        o, w = self.owner, self.w
        self.backwards += 1
        if o.rec is not None:  # a call being recorded has its backward in the same pass
            o.rec.bad = o.rec.bad or "its backward ran beside a replayed call's"
        arriving = {k for k, g in enumerate(grads) if g is not None}
        if arriving != set(w.grads_in.values()) or self.backwards > 1:
            o.invalid("a replayed call's backward got gradients for other outputs than "
                      "recorded, or ran twice")
            return
        gone: list[tuple[str, str, int]] = []
        for ev in w.bwd:
            if ev[0] == "g":
                g = grads[ev[1]]
                o.free_real(g, gone)
            elif ev[0] == "i":
                self.kept.pop(ev[1], None)  # its real death (if nothing else holds it)
            elif ev[0] == "r" and ev[2] < 0:
                continue  # an arriving gradient's or argument's: counted as it is freed
            else:
                o.apply(ev, self.addr, w)
        o._add_flops(w.bwd_flops)
        o._add_calls(w.calls_b)
        for key, mod, n in gone:  # the gradients' real deaths follow: the trace drops them
            o.held(key, mod, n)

    def clear(self) -> None:
        """The autocast cache is cleared: free the blocks the record's clear freed."""
        o, w, st = self.owner, self.w, self.owner.st
        for h in w.cleared:
            a = self.addr.pop(h, None)
            if a is None:
                continue
            n, tag = w.size_of[h]
            st._requested(-n)
            key, mod = w.labels[tag]
            o.held(key, mod, -n)
            st.sim.free(a)

    def __del__(self) -> None:
        o = self.owner
        if self.addr and o.st.oom is None:  # the graph died without a backward: give back
            try:
                for addr in reversed(list(self.addr.values())):
                    o.st.sim.free(addr)
                o.invalid("a replayed call's graph was dropped without its backward")
            except Exception:  # noqa: BLE001 - a destructor must not raise
                pass


class _Replayed(torch.autograd.Function):
    """A replayed call's outputs in autograd: its backward replays the recorded backward."""

    @staticmethod
    def forward(ctx: Any, call: _Call, anchor: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.set_materialize_grads(False)
        ctx.call = call
        outs = call.forward()
        tensors = tuple(t for t in outs if isinstance(t, torch.Tensor))
        fixed = [t for t, leaf in zip(tensors, (x for x in call.w.outs if isinstance(x, _Out)))
                 if not leaf.grad]
        if fixed:
            ctx.mark_non_differentiable(*fixed)
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[None, None]:  # type: ignore[override]
        ctx.call.backward(grads)
        return None, None


_ALLOC_KIND = 0
#: the most signatures whose records are kept
_KEPT = 256


def _with_global_hooks(mod: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                       forward: Any) -> Any:
    """``forward()`` between the global module hooks (the tracker's module scope), without
    ``mod``'s own."""
    from torch.nn.modules import module as m

    for hook in list(m._global_forward_pre_hooks.values()):
        r = hook(mod, args)
        if r is not None:
            args = r if isinstance(r, tuple) else (r,)
    out = forward()
    for hid, hook in list(m._global_forward_hooks.items()):
        r = (hook(mod, args, kwargs, out) if hid in m._global_forward_hooks_with_kwargs
             else hook(mod, args, out))
        if r is not None:
            out = r
    return out


def _strided_bytes(t: torch.Tensor) -> int:
    """The bytes ``torch.empty_strided`` allocates for ``t``'s shape and strides."""
    if t.numel() == 0:
        return 0
    return (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()
