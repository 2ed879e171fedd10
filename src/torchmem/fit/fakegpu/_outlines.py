"""Outlines: what a skipped ``torch.save`` leaves behind, so the run can load it back.

A script under an estimate never writes its checkpoints (:mod:`torchmem.fit.targets._saves`), but
many read them back: a resume check (``if os.path.exists(ckpt): torch.load(ckpt)``), a trainer
that reloads its best checkpoint at the end, ``torch.save(state, buf); buf.seek(0);
torch.load(buf)`` to copy a state dict. Where the real run would find its file, the estimate
leaves an *outline*: ``OUTLINE_MAGIC``, then a pickle of the saved object in which every fake
tensor is replaced by what it is (the storage it views, that storage's size and device, dtype,
shape, strides, offset, ``requires_grad``, whether it is an ``nn.Parameter``). It holds no
weights: a few hundred bytes per tensor. A real tensor in the object (an RNG state, a counter)
is kept whole (PyTorch's own format, nested).

:func:`load_outline` (``torch.load`` of an outline, inside
:func:`~torchmem.fit.fakegpu._checkpoints.checkpoints_without_weights`) makes one fake storage per
saved storage, on the device the real load would use (the saved one, or where ``map_location``
sends it), and each tensor a view of it: tensors that shared memory when saved (tied weights,
views) share it again, as the real load's do; host memory and GPU memory are counted as for any
other load. PyTorch's ``weights_only`` check is not applied to outlines.

Example:
    >>> import io, torch
    >>> from torch._subclasses import FakeTensorMode
    >>> from torchmem.fit.fakegpu._checkpoints import _Rebuild, _target
    >>> with FakeTensorMode():
    ...     w = torch.empty(4, 4)
    ...     buf = io.BytesIO()
    ...     write_outline({"w": w, "row": w[1], "step": 3}, buf)
    ...     data = buf.getvalue()[len(OUTLINE_MAGIC):]
    ...     back = load_outline(data, None, torch.load, _Rebuild, _target)
    >>> tuple(back["w"].shape), back["step"], back["row"].storage_offset()
    ((4, 4), 3, 4)
    >>> back["row"].untyped_storage()._cdata == back["w"].untyped_storage()._cdata
    True
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["OUTLINE_MAGIC", "load_outline", "outline_of", "write_outline"]

#: The first bytes of an outline (never the start of a file PyTorch writes: a zip file starts
#: with ``PK``, a legacy one with a pickle opcode).
OUTLINE_MAGIC = b"\x00torchmem outline of a skipped torch.save; no weights\n"


class _OutlinePickler(pickle.Pickler):
    def __init__(self, file: Any, real_save: Callable[..., Any]) -> None:
        super().__init__(file, protocol=pickle.DEFAULT_PROTOCOL)
        self.real_save = real_save
        self.storages: dict[int, int] = {}  # storage _cdata -> its index in the outline

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        from torch._subclasses.fake_tensor import is_fake

        if not is_fake(obj):
            buf = io.BytesIO()
            self.real_save(obj, buf)  # a real tensor: kept whole, in PyTorch's own format
            return ("real", buf.getvalue())
        with torch._C.DisableTorchFunction():
            st = obj.untyped_storage()
            index = self.storages.setdefault(st._cdata, len(self.storages))
            return ("fake", index, st.nbytes(), str(obj.device), str(obj.dtype).split(".")[-1],
                    tuple(obj.shape), tuple(obj.stride()), obj.storage_offset(),
                    bool(obj.requires_grad), isinstance(obj, torch.nn.Parameter))


def write_outline(obj: Any, f: Any, real_save: Callable[..., Any] | None = None) -> None:
    """Write the outline of ``obj`` (what ``torch.save(obj, f)`` would have saved) to the binary
    file object ``f``; ``real_save`` saves the real tensors in it (PyTorch's ``torch.save``,
    the default). Raises what pickling raises for an object that cannot be saved.

    Example:
        >>> import io
        >>> buf = io.BytesIO(); write_outline({"n": 1}, buf)
        >>> buf.getvalue().startswith(OUTLINE_MAGIC)
        True
    """
    data = io.BytesIO()
    _OutlinePickler(data, real_save or torch.serialization.save).dump(obj)
    f.write(OUTLINE_MAGIC + data.getvalue())


def outline_of(f: Any, resolve: Callable[[str], str]) -> bytes | None:
    """The outline (after ``OUTLINE_MAGIC``) that ``torch.load(f)`` is given, or None for any
    other file: ``f`` a path (``resolve`` turns it into the file that holds it: the run's
    scratch copy) or a seekable binary file object (read from where it stands, left there when
    it holds no outline).

    Example:
        >>> import io
        >>> buf = io.BytesIO(OUTLINE_MAGIC + b"x"); outline_of(buf, str)
        b'x'
        >>> outline_of(io.BytesIO(b"PK.."), str) is None
        True
    """
    n = len(OUTLINE_MAGIC)
    if isinstance(f, (str, os.PathLike)):
        try:
            with open(resolve(os.fspath(f)), "rb") as fh:
                return fh.read() if fh.read(n) == OUTLINE_MAGIC else None
        except (OSError, ValueError):
            return None
    read, seek, tell = (getattr(f, k, None) for k in ("read", "seek", "tell"))
    seekable = getattr(f, "seekable", None)
    if read is None or seek is None or tell is None or not (seekable is None or seekable()):
        return None
    try:
        at = tell()
        head = read(n)
        if head == OUTLINE_MAGIC:
            return bytes(read())
        seek(at)
    except (OSError, ValueError, TypeError):
        return None
    return None


def load_outline(data: bytes, map_location: Any, load: Callable[..., Any], rebuild: Any,
                 target: Callable[[str, Any], torch.device]) -> Any:
    """The object an outline stands for, with fake tensors (see the module's text);
    ``load`` loads the real tensors kept in it (the estimate's ``torch.load``), ``rebuild``
    makes fake tensors of meta ones (``rebuild(where).tensor(meta)``, ``where`` mapping a meta
    storage to its device: :class:`~torchmem.fit.fakegpu._checkpoints._Rebuild`) and ``target``
    says where the real load puts a storage saved from a device.

    Example:
        >>> import io, torch
        >>> from torch._subclasses import FakeTensorMode
        >>> from torchmem.fit.fakegpu._checkpoints import _Rebuild, _target
        >>> with FakeTensorMode():
        ...     p = torch.nn.Parameter(torch.empty(3))
        ...     buf = io.BytesIO(); write_outline([p], buf)
        ...     data = buf.getvalue()[len(OUTLINE_MAGIC):]
        ...     q, = load_outline(data, "cpu", torch.load, _Rebuild, _target)
        >>> isinstance(q, torch.nn.Parameter), q.requires_grad, tuple(q.shape)
        (True, True, (3,))
    """
    from torch.utils._python_dispatch import _disable_current_modes

    where: dict[int, torch.device] = {}
    bases: dict[int, torch.Tensor] = {}
    fake = rebuild(where)

    def persistent_load(pid: Any) -> Any:
        if pid[0] == "real":
            return load(io.BytesIO(pid[1]), map_location=map_location, weights_only=False)
        _, index, nbytes, device, dtype_name, size, stride, offset, grad, param = pid
        dtype = getattr(torch, dtype_name)
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            base = bases.get(index)
            if base is None:
                base = bases[index] = torch.empty(nbytes, dtype=torch.uint8, device="meta")
                where[base.untyped_storage()._cdata] = target(device, map_location)
            item = dtype.itemsize
            view = base if dtype == torch.uint8 else base[: nbytes - nbytes % item].view(dtype)
            meta = view.as_strided(size, stride, offset)
            if grad:
                meta.requires_grad_(True)
            if param:
                meta = torch.nn.Parameter(meta, requires_grad=grad)
        return fake.tensor(meta)

    unpickler = pickle.Unpickler(io.BytesIO(data))
    unpickler.persistent_load = persistent_load  # type: ignore[assignment]
    return unpickler.load()
