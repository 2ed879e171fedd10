"""Checkpoints under an estimate: loaded with their shapes and dtypes, never their weight bytes.

A fine-tuning script loads weights (``torch.load``, safetensors, ``from_pretrained``). The
estimate needs only what each tensor is (shape, dtype, which tensors share storage) and where the
code puts it, never its values, so inside :func:`checkpoints_without_weights`:

- **safetensors** (``safe_open``, ``safetensors.torch.load_file``, ``load``, ``load_model``,
  and transformers' ``from_pretrained``, which reads through ``safe_open``): the file's header
  (8 bytes of length, then JSON) is parsed and checked as safetensors does; each tensor asked for
  is a new fake tensor of the header's shape and dtype on the device the call names (``"cpu"``
  by default: host memory, as the real load's copy is). A header that does not parse, or a file
  shorter than its header says, raises safetensors' own ``SafetensorError`` with the file named.
- **torch.load**: the pickle is read for real (it holds the structure), the weights are not: a
  file in PyTorch's zip format is memory-mapped and its storages handed over as empty ``meta``
  storages (nothing is read; a sparse 140 GB file costs nothing), then each storage becomes one
  fake storage where the real load would put it: the device it was saved from, or where
  ``map_location`` (a device, a string, a dict of locations) sends it. Tensors that shared a
  storage in the file share one here (tied weights, views), ``nn.Parameter`` stays one, with its
  ``requires_grad``. An open file at its start is mapped from its path (Lightning opens
  checkpoints through fsspec). Files that cannot be mapped (the legacy format, a buffer) go
  through PyTorch's own load under the fake mode, which does not read weights either (sharing
  between tensors is then not kept, and a callable ``map_location`` leaves each tensor on the
  device it was saved from).
- a save the run itself skipped (an *outline*, :mod:`torchmem.fit.fakegpu._outlines`): fake
  tensors of the saved shapes and sharing, where the real load would put them. A path the script
  wrote is looked up where the run's writes went (:data:`PATH_RESOLVERS`: the scratch folder).
- Lightning's lazy load (``_lazy_load``: ``Fabric.load``, litgpt's checkpoints): each tensor
  asked for is a new host tensor, as the real one reads its record anew each time.
- transformers' ``from_pretrained`` of a model whose weights are not at hand (a Hugging Face
  cache entry or folder with ``config.json`` alone): the model is loaded from a stand-in
  checkpoint with the shapes its state dict has (floating tensors in the config's dtype), and
  the report says so in a note. Without a ``config.json`` either, the error says which file to
  fetch (``hf download NAME config.json``): the estimate needs no weights.
- transformers loads on the calling thread (``HF_DEACTIVATE_ASYNC_LOAD=1``): its loader's worker
  threads would run outside the estimate's modes.

The host side of a load (the rule the host peak follows): every loaded tensor is host memory
from the call that makes it until nothing references it, as with the real load's copy
(``torch.load`` without ``mmap=True`` and safetensors' ``get_tensor``); transformers asks for one
tensor at a time, moves or converts it, and drops it. ``torch.load(..., mmap=True)`` keeps its
tensors as host memory too (page cache the process maps; the real run reads those pages when it
copies them).

Example:
    >>> import os, tempfile, torch
    >>> from safetensors.torch import save_file
    >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    >>> save_file({"w": torch.zeros(3, 5, dtype=torch.bfloat16)}, path)
    >>> from torch._subclasses import FakeTensorMode
    >>> with FakeTensorMode(), checkpoints_without_weights():
    ...     from safetensors.torch import load_file
    ...     w = load_file(path)["w"]
    >>> type(w).__name__, tuple(w.shape), w.dtype
    ('FakeTensor', (3, 5), torch.bfloat16)
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import pickle
import struct
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from torchmem.fit.fakegpu._outlines import load_outline, outline_of

__all__ = ["checkpoints_without_weights", "read_safetensors_header", "safetensors_layout"]

#: safetensors' own limit on a header's size (bytes)
HEADER_MAX = 100_000_000

#: safetensors' dtype names (its ``safetensors.torch._TYPES``)
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "C64": torch.complex64,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16,
}
#: a dtype's safetensors name
_NAMES = {v: k for k, v in _DTYPES.items()}


def _safetensor_error(message: str) -> Exception:
    """safetensors' own error type (what the real load raises), else ``ValueError``."""
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - safetensors is what calls us
        return ValueError(message)
    return SafetensorError(message)


def read_safetensors_header(source: str | os.PathLike[str] | bytes) -> dict[str, Any]:
    """The header of a safetensors file (a path) or buffer (bytes), checked as safetensors does:
    ``{"tensors": {name: (dtype, shape)}, "metadata": dict | None}``, the tensors in the file's
    order (by data offset). Reads the header only.

    Raises safetensors' ``SafetensorError`` (with the file named) when the header is too small,
    too large, not JSON, names an unknown dtype, gives offsets that disagree with a tensor's
    shape, or promises more data than the file holds.

    Example:
        >>> import os, tempfile, torch
        >>> from safetensors.torch import save_file
        >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
        >>> save_file({"w": torch.zeros(2, 3)}, path, metadata={"format": "pt"})
        >>> h = read_safetensors_header(path)
        >>> h["tensors"]["w"], h["metadata"]
        ((torch.float32, (2, 3)), {'format': 'pt'})
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        what, size = "the buffer", len(source)
        head = bytes(source[:8])
    else:
        what = resolve_path(os.fspath(source))  # the run's own copy where it wrote one
        size = os.path.getsize(what)
        with open(what, "rb") as f:
            head = f.read(8)

    def bad(reason: str) -> Exception:
        return _safetensor_error(f"Error while deserializing header: {reason} ({what}, "
                                 f"{size:,} bytes; expected a safetensors file: 8 bytes of header "
                                 "length, a JSON header, then the tensors' data)")

    if len(head) < 8:
        raise bad("header too small")
    (n,) = struct.unpack("<Q", head)
    if n > HEADER_MAX:
        raise bad("header too large")
    if 8 + n > size:
        raise bad(f"invalid header length: the header says {n:,} bytes")
    if isinstance(source, (bytes, bytearray, memoryview)):
        raw = bytes(source[8:8 + n])
    else:
        with open(what, "rb") as f:
            f.seek(8)
            raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"invalid JSON in header: {e}") from None
    if not isinstance(header, dict):
        raise bad("invalid JSON in header: not an object")
    metadata = header.pop("__metadata__", None)
    entries: list[tuple[int, str, torch.dtype, tuple[int, ...]]] = []
    end = 0
    for name, info in header.items():
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, stop = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name!r} has no valid dtype, shape and data_offsets: "
                      f"{info!r}") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if stop - begin != nbytes:
            raise bad(f"tensor {name!r}: data_offsets {begin}..{stop} hold {stop - begin:,} "
                      f"bytes, its shape {list(shape)} of {info['dtype']} needs {nbytes:,}")
        entries.append((begin, name, dtype, shape))
        end = max(end, stop)
    if 8 + n + end != size:
        raise bad("incomplete metadata, file not fully covered: the tensors end at byte "
                  f"{8 + n + end:,} of the file")
    entries.sort(key=lambda e: e[0])  # the file's order (safetensors' offset_keys)
    return {"tensors": {name: (dtype, shape) for _, name, dtype, shape in entries},
            "metadata": metadata}


def safetensors_layout(tensors: Iterable[tuple[str, torch.dtype, Sequence[int]]],
                       metadata: dict[str, str] | None = None) -> tuple[bytes, int]:
    """The start of a safetensors file holding ``(name, dtype, shape)`` tensors in that order
    (8 bytes of header length, the JSON header padded to 8 bytes, as safetensors writes it) and
    the file's whole size: a file of that size that starts with these bytes and has a hole for
    the data is read as a checkpoint of these shapes by :func:`read_safetensors_header`.

    Example:
        >>> head, size = safetensors_layout([("w", torch.float16, (2, 3))], {"format": "pt"})
        >>> size - len(head), read_safetensors_header(head + bytes(size - len(head)))["tensors"]
        (12, {'w': (torch.float16, (2, 3))})
    """
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    at = 0
    for name, dtype, shape in tensors:
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": [int(d) for d in shape],
                        "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, 8 + len(raw) + at


def _device(device: Any) -> torch.device:
    """safetensors' ``device`` argument (``"cpu"``, ``"cuda:0"``, ``0``) as a torch device."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)
    return torch.device(device)


def _sliced_shape(shape: tuple[int, ...], index: Any) -> tuple[int, ...]:
    """The shape of ``tensor[index]`` for a tensor of ``shape`` (ints, slices, ``...``)."""
    idx = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in idx):
        at = next(k for k, i in enumerate(idx) if i is Ellipsis)
        fill = len(shape) - (len(idx) - 1)
        idx = idx[:at] + (slice(None),) * fill + idx[at + 1:]
    if len(idx) > len(shape):
        raise IndexError(f"too many indices: {len(idx)} for a tensor of {len(shape)} dims")
    out: list[int] = []
    for k, n in enumerate(shape):
        i = idx[k] if k < len(idx) else slice(None)
        if isinstance(i, slice):
            out.append(len(range(*i.indices(n))))
        elif isinstance(i, int):
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for dimension {k} of size {n}")
        else:
            raise TypeError(f"a safetensors slice takes ints, slices and ..., got {i!r}")
    return tuple(out)


class _Slice:
    """``safe_open(...).get_slice(name)``: its shape and dtype; ``[index]`` makes a fake tensor
    of the indexed part (only that part is host memory, as the real slice reads only it)."""

    def __init__(self, dtype: torch.dtype, dtype_name: str, shape: tuple[int, ...],
                 device: torch.device) -> None:
        self._dtype, self._name, self._shape, self._device = dtype, dtype_name, shape, device

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def get_dtype(self) -> str:
        return self._name

    def __getitem__(self, index: Any) -> torch.Tensor:
        return torch.empty(_sliced_shape(self._shape, index), dtype=self._dtype,
                           device=self._device)


class _SafeOpen:
    """``safetensors.safe_open(path, framework="pt", device=...)`` over the header alone."""

    def __init__(self, filename: Any, framework: str = "pt", device: Any = "cpu",
                 backend: str | None = None) -> None:
        self._path = os.fspath(filename)
        header = read_safetensors_header(self._path)
        self._tensors = header["tensors"]
        self._metadata = header["metadata"]
        self._device = _device(device)

    def __enter__(self) -> _SafeOpen:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def keys(self) -> list[str]:
        return sorted(self._tensors)

    def offset_keys(self) -> list[str]:
        return list(self._tensors)  # in the file's order

    def metadata(self) -> dict[str, str] | None:
        return self._metadata

    def _entry(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        try:
            return self._tensors[name]
        except KeyError:
            raise _safetensor_error(f"File does not contain tensor {name}") from None

    def get_tensor(self, name: str) -> torch.Tensor:
        dtype, shape = self._entry(name)
        return torch.empty(shape, dtype=dtype, device=self._device)

    def get_slice(self, name: str) -> _Slice:
        dtype, shape = self._entry(name)
        return _Slice(dtype, _NAMES[dtype], shape, self._device)

    def get_tensors(self) -> dict[str, torch.Tensor]:
        return {k: self.get_tensor(k) for k in self.offset_keys()}


def _safe_open(filename: Any, framework: str = "pt", device: Any = "cpu",
               backend: str | None = None, _real: Any = None) -> Any:
    if framework not in ("pt", "torch", "pytorch"):  # numpy, flax: not ours to fake
        return _real(filename, framework=framework, device=device)
    return _SafeOpen(filename, framework, device, backend)


def _load_bytes(data: bytes) -> dict[str, torch.Tensor]:
    """``safetensors.torch.load(data)``: host tensors from the header in ``data``."""
    header = read_safetensors_header(data)
    return {k: torch.empty(shape, dtype=dtype) for k, (dtype, shape) in header["tensors"].items()}


# -- torch.load ----------------------------------------------------------------------------------

def _target(location: str, map_location: Any) -> torch.device:
    """Where the real ``torch.load`` puts a storage saved from ``location``."""
    if map_location is None:
        return torch.device(location)
    if isinstance(map_location, dict):
        return torch.device(map_location.get(location, location))
    if isinstance(map_location, (str, torch.device, int)):
        return _device(map_location)
    if callable(map_location):  # called with an empty storage: where it says it goes
        with torch._C.DisableTorchFunction():
            got = map_location(torch.UntypedStorage(0, device="meta"), location)
        dev = getattr(got, "device", None)
        return torch.device(location) if dev is None or dev.type == "meta" else dev
    return torch.device(location)


def _file_path(f: Any) -> str | None:
    """The path of the file ``torch.load`` was given: a path, or an open file at its start
    (Lightning opens checkpoints through fsspec: its file object wraps the real one in ``.f``)."""
    for _ in range(3):
        if isinstance(f, (str, os.PathLike)):
            return os.fspath(f)
        for attr in ("name", "path"):
            name = getattr(f, attr, None)
            if isinstance(name, str) and os.path.isfile(name):
                try:
                    at_start = f.tell() == 0
                except (AttributeError, OSError, ValueError):
                    at_start = False
                return name if at_start else None
        f = getattr(f, "f", None)
        if f is None:
            return None
    return None


#: While a script runs, where its own writes are (:class:`~torchmem.fit.targets._sandbox.ScratchFiles`
#: adds one): each takes a path and gives the file that holds it, or None
PATH_RESOLVERS: list[Callable[[str], str | None]] = []


def resolve_path(path: str) -> str:
    """The file that holds ``path`` for the running script: its scratch copy where the run
    wrote one, else ``path`` itself.

    Example:
        >>> resolve_path("/data/model.pt")
        '/data/model.pt'
    """
    for resolver in PATH_RESOLVERS:
        got = resolver(path)
        if got is not None:
            return got
    return path


def _mapped_load(original: Any, f: Any, map_location: Any, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[Any, dict[int, torch.device]] | None:
    """The real ``torch.load`` on the memory-mapped file with every storage handed over empty
    (``meta``); ``None`` when the file cannot be mapped (then PyTorch's fake load is used)."""
    f = _file_path(f)
    if f is None:
        return None
    f = resolve_path(f)
    import zipfile

    if not zipfile.is_zipfile(f):
        return None
    where: dict[int, torch.device] = {}
    # PyTorch keeps a loaded storage for the next tensor on it only when it has data; an empty
    # one is asked for again, with the same mapped bytes: the same empty storage comes back
    handed: dict[tuple[int, int], Any] = {}

    def hand_over(storage: Any, location: str) -> Any:
        key = (storage.data_ptr(), storage.nbytes())
        empty = handed.get(key)
        if empty is None:
            empty = handed[key] = torch.UntypedStorage(storage.nbytes(), device="meta")
            where[empty._cdata] = _target(location, map_location)
        return empty

    from torch.utils._python_dispatch import _disable_current_modes

    kwargs = {**kwargs, "mmap": True}
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        out = original(f, hand_over, *args, **kwargs)
    return out, where


class _Rebuild:
    """Meta tensors from :func:`_mapped_load` made into fake tensors on their devices, one fake
    storage per file storage."""

    def __init__(self, where: dict[int, torch.device], every: bool = False) -> None:
        self.where = where
        #: rebuild every tensor (PyTorch's own fake load: fake tensors the run did not make, on
        #: the device they report), not only the meta ones
        self.every = every
        self.bases: dict[int, torch.Tensor] = {}
        self.memo: dict[int, Any] = {}

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        with torch._C.DisableTorchFunction():
            st = t.untyped_storage()
            key, nbytes = st._cdata, st.nbytes()
            size, stride, offset = tuple(t.shape), t.stride(), t.storage_offset()
            dtype, grad = t.dtype, t.requires_grad
        base = self.bases.get(key)
        if base is None:
            with torch._C.DisableTorchFunction():
                own = t.device if self.every else None
            dev = self.where.get(key, own if own is not None else torch.device("cpu"))
            base = self.bases[key] = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        item = dtype.itemsize
        view = base if dtype == torch.uint8 else base[: nbytes - nbytes % item].view(dtype)
        out = view.as_strided(size, stride, offset)
        if isinstance(t, torch.nn.Parameter):
            return torch.nn.Parameter(out, requires_grad=grad)
        if grad and (dtype.is_floating_point or dtype.is_complex):
            out.requires_grad_(True)
        return out

    def __call__(self, obj: Any) -> Any:
        memo = self.memo.get(id(obj))
        if memo is not None:
            return memo
        out: Any
        if isinstance(obj, torch.Tensor):
            with torch._C.DisableTorchFunction():
                meta = obj.device.type == "meta"
            out = self.tensor(obj) if meta or self.every else obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                obj[k] = self(v)
            out = obj
        elif isinstance(obj, list):
            obj[:] = [self(v) for v in obj]
            out = obj
        elif isinstance(obj, tuple):
            items = [self(v) for v in obj]
            out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        elif isinstance(obj, torch.nn.Module):
            for m in obj.modules():
                for k, p in m._parameters.items():
                    if p is not None:
                        m._parameters[k] = self(p)
                for k, b in m._buffers.items():
                    if b is not None:
                        m._buffers[k] = self(b)
            out = obj
        elif isinstance(getattr(obj, "__dict__", None), dict) and not isinstance(
                obj, (type, types.ModuleType, types.FunctionType)):
            # an object pickled whole (argparse.Namespace, a dataclass): its tensors too
            self.memo[id(obj)] = obj
            for k, v in list(vars(obj).items()):
                new = self(v)
                if new is not v:
                    vars(obj)[k] = new
            out = obj
        else:
            out = obj
        self.memo[id(obj)] = out
        return out


def _torch_load(original: Any) -> Any:
    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        outline = outline_of(f, resolve_path)  # a save the run skipped: see _outlines
        if outline is not None:
            return load_outline(outline, map_location, load, _Rebuild, _target)
        try:
            mapped = _mapped_load(original, f, map_location, args, kwargs)
            if mapped is None:  # PyTorch's own load under the fake mode: reads no weights
                # (it refuses a callable map_location; the tensors keep their saved devices)
                plain = original(f, None if callable(map_location) else map_location,
                                 *args, **kwargs)
        except (RuntimeError, EOFError, pickle.UnpicklingError, OSError) as e:
            if isinstance(e, OSError) and type(e) is not OSError:
                raise  # a missing file, a folder, no permission: PyTorch's words name it
            # a damaged file: PyTorch's own error, with the file named
            path = _file_path(f) or repr(f)
            raise type(e)(f"torch.load({path!r}): {e} (expected a file written by "
                          "torch.save; is it complete?)") from e
        if mapped is None:
            return _Rebuild({}, every=True)(plain)  # storages the run knows, on those devices
        out, where = mapped
        return _Rebuild(where)(out)

    load.__wrapped__ = original  # type: ignore[attr-defined]
    return load


# -- Lightning's lazy load ---------------------------------------------------------------------------

def _lazy_tensor(self: Any) -> torch.Tensor:
    """Lightning's ``_NotYetLoadedTensor._load_tensor`` (``_lazy_load``, ``Fabric.load``, litgpt):
    a new host tensor per call, as the real one reads its storage's record anew each time."""
    meta = self.metatensor
    size = self.storageinfo[4]
    offset, shape, stride, requires_grad = self.rebuild_args[:4]
    # read inside the operator that uses it (load_state_dict's copy_ into a GPU parameter),
    # where new storages would go to that operator's device: the record is read to the host
    force = PLACEMENT.force(False) if PLACEMENT is not None else contextlib.nullcontext()
    with force:
        base = torch.empty(size, dtype=meta.dtype)
    out = base.as_strided(shape, stride, offset)
    if requires_grad:
        out.requires_grad_(True)
    return out


def _patch_lazy_load(module: Any) -> Any:
    cls = getattr(module, "_NotYetLoadedTensor", None)
    if cls is None:
        return None
    original = cls.__dict__["_load_tensor"]
    cls._load_tensor = _lazy_tensor
    return lambda: setattr(cls, "_load_tensor", original)


# -- transformers: a model with no weights at hand ---------------------------------------------------

#: what transformers says when a model's folder or cache entry has no weights
_NO_WEIGHTS = ("does not appear to have a file named", "Error no file named")

#: notes for the estimate's report, from the last :func:`checkpoints_without_weights`
NOTES: list[str] = []

#: the estimate's placement (host or GPU per storage) while :func:`checkpoints_without_weights`
#: is active, when it was given one
PLACEMENT: Any = None


def _stand_in(klass: Any, name: str, config: Any) -> str:
    """A folder with ``config`` and a sparse safetensors checkpoint of ``klass``'s state dict
    (floating tensors in the config's dtype, float32 without one): the shapes a checkpoint of
    this model has, to load in place of weights that are not at hand."""
    import tempfile

    from torch.utils._python_dispatch import _disable_current_modes

    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype):
        dtype = torch.float32
    with _disable_current_modes(), torch.device("meta"):
        model = klass._from_config(config)
    entries: dict[str, tuple[str, list[int]]] = {}
    seen: set[int] = set()
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:  # tied weights: stored once, as save_pretrained does
            continue
        seen.add(id(t))
        d = dtype if t.dtype.is_floating_point else t.dtype
        entries[key] = (_NAMES[d], list(t.shape))
    folder = tempfile.mkdtemp(prefix="torchmem-weights-")
    config.save_pretrained(folder)
    head, size = safetensors_layout(
        [(key, _DTYPES[dname], shape) for key, (dname, shape) in entries.items()],
        {"format": "pt"})
    path = os.path.join(folder, "model.safetensors")
    with open(path, "wb") as f:
        f.write(head)
    os.truncate(path, size)  # the weights: a hole
    NOTES.append(f"{name}: no weights at hand, so the model was loaded from its config.json with "
                 f"the shapes its checkpoint has ({str(dtype).replace('torch.', '')} weights, "
                 "the config's dtype); a checkpoint stored in another dtype loads with that one")
    return folder


def _on_oserror(cls: Any, attr: str, handle: Any) -> Any:
    """Wrap the classmethod ``cls.attr(name, ...)``: an ``OSError`` it raises goes to
    ``handle(func, klass, name, args, kwargs, error)`` (``func``: the original function);
    returns what puts the original back."""
    original = cls.__dict__[attr]
    func = original.__func__

    def wrapper(klass: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(klass, name, *args, **kwargs)
        except OSError as e:
            return handle(func, klass, name, args, kwargs, e)

    setattr(cls, attr, classmethod(wrapper))
    return lambda: setattr(cls, attr, original)


def _without_weights(func: Any, klass: Any, name: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any], e: OSError) -> Any:
    """``from_pretrained`` of a model with no weights at hand: from a stand-in checkpoint with
    its config's shapes (deleted once the model is loaded: only its header is ever read)."""
    if not any(m in str(e) for m in _NO_WEIGHTS) or kwargs.get("state_dict") is not None:
        raise e
    config = kwargs.pop("config", None)
    if not hasattr(config, "save_pretrained"):
        from transformers import AutoConfig

        keys = ("revision", "cache_dir", "token", "local_files_only", "subfolder",
                "trust_remote_code")
        config = AutoConfig.from_pretrained(name, **{k: kwargs[k] for k in keys if k in kwargs})
    folder = _stand_in(klass, str(name), config)
    kwargs.pop("subfolder", None)
    try:
        return func(klass, folder, *args, config=config, **kwargs)
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def _no_config(func: Any, klass: Any, name: Any, args: tuple[Any, ...],
               kwargs: dict[str, Any], e: OSError) -> Any:
    """``get_config_dict`` of a name with no ``config.json`` at hand: say which file to fetch."""
    if os.path.isdir(str(name)) or "config.json" in str(e) and str(name) in str(e):
        raise e
    raise OSError(
        f"{name}: no config.json in the local Hugging Face cache, and it could not be "
        f"fetched; the estimate needs that file alone, no weights: `hf download {name} "
        "config.json` (or give a folder holding it)") from e


def _patch_from_pretrained(module: Any) -> Any:
    return _on_oserror(module.PreTrainedModel, "from_pretrained", _without_weights)


def _patch_config_dict(module: Any) -> Any:
    cls = module.PreTrainedConfig if hasattr(module, "PreTrainedConfig") else module.PretrainedConfig
    return _on_oserror(cls, "get_config_dict", _no_config)


# -- installing ------------------------------------------------------------------------------------

#: module name -> (its dict's id, the names in it that held a replaced function when it was
#: scanned): a module is scanned once per process; later estimates look at those names only
_SCANNED: dict[str, tuple[int, tuple[str, ...]]] = {}


def _replace_everywhere(replace: dict[int, tuple[Any, Any]], undo: list[Any]) -> None:
    """Every module attribute that is one of the ``old`` functions of ``replace`` (``{id(old):
    (old, new)}``; ``from safetensors import safe_open`` copies it into the importing module)
    becomes its ``new``; ``undo`` gets what puts them back."""
    for name, mod in list(sys.modules.items()):
        d = getattr(mod, "__dict__", None)
        if not isinstance(d, dict):
            continue
        seen = _SCANNED.get(name)
        if seen is not None and seen[0] == id(d):
            keys: Any = seen[1]
        else:
            keys = tuple(k for k, v in list(d.items()) if id(v) in replace)
            _SCANNED[name] = (id(d), keys)
        for k in keys:
            v = d.get(k)
            hit = replace.get(id(v))
            if hit is not None and hit[0] is v:
                d[k] = hit[1]
                undo.append((d, k, v))


def _restore_imported(restore: dict[int, tuple[Any, Any]]) -> None:
    """Modules imported inside (never scanned): a name bound to one of the stand-ins
    (``restore``: ``{id(new): (new, old)}``) gets the original back, so that nothing imported
    during an estimate keeps a stand-in after it."""
    for name, mod in list(sys.modules.items()):
        d = getattr(mod, "__dict__", None)
        if not isinstance(d, dict):
            continue
        seen = _SCANNED.get(name)
        if seen is not None and seen[0] == id(d):
            continue
        keys = []
        for k, v in list(d.items()):
            hit = restore.get(id(v))
            if hit is not None and hit[0] is v:
                d[k] = hit[1]
                keys.append(k)
        _SCANNED[name] = (id(d), tuple(keys))


@contextlib.contextmanager
def checkpoints_without_weights(placement: Any = None) -> Iterator[None]:
    """Inside, ``torch.load`` and safetensors' loaders give fake tensors with the file's shapes,
    dtypes and sharing, and read no weight bytes (see the module's text); restored on exit.

    Example:
        >>> import os, tempfile, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "m.pt")
        >>> torch.save({"w": torch.zeros(4, 4)}, path)
        >>> from torch._subclasses import FakeTensorMode
        >>> with FakeTensorMode(), checkpoints_without_weights():
        ...     w = torch.load(path)["w"]
        >>> type(w).__name__, tuple(w.shape)
        ('FakeTensor', (4, 4))
    """
    undo: list[Any] = []
    real_load = torch.load
    fake_load = _torch_load(real_load)
    replace: dict[int, tuple[Any, Any]] = {id(real_load): (real_load, fake_load)}
    if importlib.util.find_spec("safetensors") is not None:
        import safetensors
        import safetensors.torch as st

        real_open = safetensors.safe_open

        def fake_open(filename: Any, framework: str = "pt", device: Any = "cpu",
                      backend: str | None = None) -> Any:
            return _safe_open(filename, framework, device, backend, _real=real_open)

        replace[id(real_open)] = (real_open, fake_open)
        replace[id(st.load)] = (st.load, _load_bytes)
    _replace_everywhere(replace, undo)
    torch.load = fake_load  # type: ignore[assignment]
    async_load = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    NOTES.clear()
    global PLACEMENT
    PLACEMENT = placement
    from torchmem.fit.fakegpu._bnb import imported_without_cuda, patch_bitsandbytes
    from torchmem.fit.fakegpu._imports import when_imported

    libraries: dict[str, Any] = {
        "lightning.fabric.utilities.load": _patch_lazy_load,
        "lightning_fabric.utilities.load": _patch_lazy_load,
        "transformers.modeling_utils": _patch_from_pretrained,
        "transformers.configuration_utils": _patch_config_dict,
        "bitsandbytes": patch_bitsandbytes,
    }
    try:
        with when_imported(libraries, around={"bitsandbytes": imported_without_cuda}):
            yield
    finally:
        PLACEMENT = None
        torch.load = real_load  # type: ignore[assignment]
        for d, k, old in reversed(undo):
            d[k] = old
        _restore_imported({id(new): (new, old) for old, new in replace.values()})
        if async_load is None:
            os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD", None)
        else:
            os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = async_load
