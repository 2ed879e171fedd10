"""What a script saves under the estimate: checkpoints and weights recorded, never written.

While a script runs under :func:`~torchmem.fit.targets._script.estimate_script`, the save
functions of :data:`_SAVES` (``torch.save``, safetensors, transformers' ``save_pretrained``,
Lightning's checkpoints) are replaced by stand-ins that record a :class:`SkippedWrite` (where,
what, which file) instead of writing; :class:`_Writes` installs them (in modules that imported a
save function by name too) and puts the originals back. What the run may load back is left in
its scratch folder: a ``torch.save`` leaves an outline (:mod:`torchmem.fit.fakegpu._outlines`), a
safetensors save a file with the real header and a hole for the data, ``save_pretrained`` a
folder with the model's config files and such a ``model.safetensors``.
"""

from __future__ import annotations

import importlib.util
import io
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torchmem.fit.fakegpu._checkpoints import safetensors_layout
from torchmem.fit.fakegpu._outlines import write_outline
from torchmem.fit.fakegpu._values import _where
from torchmem.units import format_bytes


@dataclass
class SkippedWrite:
    """A write the fake run did not make: ``where`` (``file:line`` of the caller), ``what``
    (the call and what it would have written) and ``path`` (the file, or ``<BytesIO>`` for a
    file object).

    Example:
        >>> SkippedWrite("train.py:9", "torch.save(dict of 2 tensors, 1.00 KiB)", "ckpt.pt").to_dict()
        {'where': 'train.py:9', 'what': 'torch.save(dict of 2 tensors, 1.00 KiB)', 'path': 'ckpt.pt'}
    """

    where: str
    what: str
    path: str

    def to_dict(self) -> dict[str, str]:
        """JSON-ready form (the entries of ``script.skipped_writes``).

        Example:
            >>> sorted(SkippedWrite("a.py:1", "torch.save(list)", "x.pt").to_dict())
            ['path', 'what', 'where']
        """
        return {"where": self.where, "what": self.what, "path": self.path}


def _describe(obj: Any) -> str:
    """What a save would have written: ``dict of 4 tensors, 1.00 MiB``. The size is that of the
    storages, each once, as ``torch.save`` writes them (tied weights and views share one).

    Example:
        >>> w = torch.zeros(256)
        >>> _describe({"a": w, "b": w[:10], "c": torch.zeros(256)})
        'dict of 3 tensors, 2.00 KiB'
    """
    count, size, seen = 0, 0, 0
    storages: set[int] = set()
    stack = [obj]
    while stack and seen < 100_000:
        x = stack.pop()
        seen += 1
        if isinstance(x, torch.Tensor):
            count += 1
            with torch._C.DisableTorchFunction():
                st = x.untyped_storage()
                if st._cdata not in storages:
                    storages.add(st._cdata)
                    size += st.nbytes()
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, torch.nn.Module):
            stack.extend(x.state_dict().values())
    kind = type(obj).__name__
    if not count:
        return kind
    return f"{kind} of {count} tensor{'s' * (count != 1)}, {format_bytes(size)}"


def _stored_once(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's state dict with each storage once, under its first name (tied weights are
    saved once by ``save_pretrained`` and safetensors' ``save_model``; the load ties them again).

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> net = torch.nn.Sequential(lin, lin)
        >>> [k for k, _ in _stored_once(net)]
        ['0.weight', '0.bias']
    """
    out, seen = [], set()
    for key, t in model.state_dict().items():
        with torch._C.DisableTorchFunction():
            st = t.untyped_storage()._cdata
        if st not in seen:
            seen.add(st)
            out.append((key, t))
    return out


def _path_of(f: Any) -> str:
    """The file a save names, absolute (as the scratch folder lists the other writes), or
    ``<BytesIO>`` for a file object without a name.

    Example:
        >>> import os
        >>> _path_of("ckpt.pt") == os.path.join(os.getcwd(), "ckpt.pt"), _path_of(None)
        (True, '<NoneType>')
    """
    if isinstance(f, (str, bytes, os.PathLike)):
        return os.path.abspath(os.fsdecode(f))
    name = getattr(f, "name", None)
    return name if isinstance(name, str) else f"<{type(f).__name__}>"


def _save_call(obj_at: int, path_at: int, path_key: str) -> Callable[..., tuple[Any, Any]]:
    """For a save function: ``(what it saves, where)`` from its arguments."""
    def read(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        obj = args[obj_at] if len(args) > obj_at else next(
            (kwargs[k] for k in ("obj", "tensors", "model") if k in kwargs), None)
        return obj, args[path_at] if len(args) > path_at else kwargs.get(path_key)
    return read


def _checkpoint(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``Trainer._save_checkpoint(self, model, trial)``: the model, the checkpoint folder."""
    trainer = args[0]
    step = getattr(getattr(trainer, "state", None), "global_step", "?")
    return (args[1] if len(args) > 1 else kwargs.get("model"),
            os.path.join(str(trainer.args.output_dir), f"checkpoint-{step}"))


def _save_model(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``Trainer.save_model(self, output_dir=None)``: the model, the folder."""
    trainer = args[0]
    out = args[1] if len(args) > 1 else kwargs.get("output_dir")
    return getattr(trainer, "model", None), out or trainer.args.output_dir


def _save_pretrained(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``PreTrainedModel.save_pretrained(self, save_directory)``: the model, the folder."""
    return args[0], args[1] if len(args) > 1 else kwargs.get("save_directory")


#: (module, owner in it or "", attribute, label, reader): the writes skipped while a script runs
#: (transformers' own: its checkpoint code inspects the fake tensors' data pointers before it
#: gets to safetensors)
_SAVES: list[tuple[str, str, str, str, Callable[..., tuple[Any, Any]]]] = [
    ("torch", "", "save", "torch.save", _save_call(0, 1, "f")),
    ("torch.serialization", "", "save", "torch.save", _save_call(0, 1, "f")),
    ("safetensors.torch", "", "save_file", "safetensors.torch.save_file",
     _save_call(0, 1, "filename")),
    ("safetensors.torch", "", "save_model", "safetensors.torch.save_model",
     _save_call(0, 1, "filename")),
    ("transformers.trainer", "Trainer", "_save_checkpoint", "Trainer._save_checkpoint",
     _checkpoint),
    ("transformers.trainer", "Trainer", "save_model", "Trainer.save_model", _save_model),
    ("transformers.modeling_utils", "PreTrainedModel", "save_pretrained",
     "PreTrainedModel.save_pretrained", _save_pretrained),
]


#: module name -> (id of the module, its globals that held a save function when it was read):
#: each module is read once per process (imports after that are read when they appear)
_HOLDERS: dict[str, tuple[int, tuple[str, ...]]] = {}


def _globals(mod: Any) -> dict[str, Any]:
    d = getattr(mod, "__dict__", None)
    return d if isinstance(d, dict) else {}


def _rebind(replace: dict[int, Any], modules: list[Any]) -> list[tuple[Any, str, Any]]:
    """In ``modules``, a global whose ``id`` is a key of ``replace`` becomes its value;
    ``(module, name, old value)`` of each."""
    done = []
    for mod in modules:
        d = _globals(mod)
        for k, v in list(d.items()):
            new = replace.get(id(v)) if callable(v) else None
            if new is not None and new is not v:
                done.append((mod, k, v))
                d[k] = new
    return done


class _Writes:
    """While active, the save functions of :data:`_SAVES` record what they would write
    instead of writing it; on exit every place that holds a stand-in (a module that imported
    it by name) gets the original back."""

    def __init__(self, skipped: list[SkippedWrite], scratch: Any = None) -> None:
        self.skipped = skipped
        #: the run's :class:`~torchmem.fit.targets._sandbox.ScratchFiles`: a skipped
        #: ``torch.save`` to a path leaves its outline there, for the run to load back
        self.scratch = scratch
        self.saved: list[tuple[Any, str, Any]] = []
        self.stand_ins: dict[int, Any] = {}  # id(stand-in) -> original
        self.before: dict[str, int] = {}  # the modules loaded when the run started

    def _stand_in(self, label: str, original: Any, read: Callable[..., tuple[Any, Any]]) -> Any:
        active = self

        def skipped_save(*args: Any, **kwargs: Any) -> Any:
            if active.stand_ins.get(id(skipped_save)) is not original:
                return original(*args, **kwargs)  # held after the estimate: write for real
            obj, dest = read(args, kwargs)
            active.skipped.append(SkippedWrite(_where(), f"{label}({_describe(obj)})",
                                               _path_of(dest)))
            if label == "torch.save":
                active._leave_outline(obj, dest, original)
            elif active.scratch is not None and isinstance(dest, (str, bytes, os.PathLike)):
                try:
                    active._leave_layout(label, obj, dest, args, kwargs)
                except Exception:  # noqa: BLE001 - what the real save refuses: no file, as before
                    pass
            return None

        skipped_save.__wrapped__ = original  # type: ignore[attr-defined]
        self.stand_ins[id(skipped_save)] = original
        return skipped_save

    def _leave_outline(self, obj: Any, dest: Any, real_save: Any) -> None:
        """Where ``torch.save(obj, dest)`` would have written, the outline of ``obj``
        (:mod:`torchmem.fit.fakegpu._outlines`): the run can load it back. An object the outline
        cannot hold leaves nothing (a later load fails as the file is missing)."""
        buf = io.BytesIO()
        try:
            write_outline(obj, buf, real_save)
        except Exception:  # noqa: BLE001 - an object pickle refuses: no outline, as before
            return
        if isinstance(dest, (str, bytes, os.PathLike)):
            if self.scratch is not None:
                self.scratch.write_for_run(dest, buf.getvalue())
        elif callable(getattr(dest, "write", None)):
            dest.write(buf.getvalue())

    def _leave_layout(self, label: str, obj: Any, dest: Any, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> None:
        """Where a safetensors or ``save_pretrained`` save would have written, files the run
        can load back: each safetensors file with its real header and a hole for the data
        (:func:`~torchmem.fit.fakegpu._checkpoints.safetensors_layout`), and for a model folder
        its ``config.json`` (and ``generation_config.json``) as transformers writes them."""
        if label == "safetensors.torch.save_file":
            meta = args[2] if len(args) > 2 else kwargs.get("metadata")
            self._leave_safetensors(list(obj.items()), dest, meta)
        elif label == "safetensors.torch.save_model":
            meta = args[2] if len(args) > 2 else kwargs.get("metadata")
            self._leave_safetensors(_stored_once(obj), dest, meta)
        else:  # save_pretrained and the Trainer's saves: a model folder
            model = getattr(obj, "module", obj)  # DistributedDataParallel's
            config: Any = getattr(model, "config", None)
            if not isinstance(model, torch.nn.Module) or not hasattr(config, "to_json_string") \
                    or hasattr(model, "peft_config"):  # PEFT writes its own files (save_file)
                return
            folder = os.fspath(dest)
            self.scratch.write_for_run(os.path.join(folder, "config.json"),
                                       config.to_json_string(use_diff=True).encode())
            gen: Any = getattr(model, "generation_config", None)
            can = getattr(model, "can_generate", None)
            if hasattr(gen, "to_json_string") and callable(can) and can():
                self.scratch.write_for_run(os.path.join(folder, "generation_config.json"),
                                           gen.to_json_string(use_diff=True).encode())
            self._leave_safetensors(_stored_once(model), os.path.join(folder, "model.safetensors"),
                                    {"format": "pt"})

    def _leave_safetensors(self, tensors: list[tuple[str, Any]], dest: Any,
                           metadata: dict[str, str] | None) -> None:
        # safetensors stores the widest elements first, then by name
        tensors = sorted(tensors, key=lambda kt: (-kt[1].dtype.itemsize, str(kt[0])))
        head, size = safetensors_layout(
            [(str(k), t.dtype, tuple(t.shape)) for k, t in tensors], metadata)
        self.scratch.write_for_run(dest, head, size=size)

    def __enter__(self) -> _Writes:
        if "safetensors.torch" not in sys.modules and importlib.util.find_spec("safetensors"):
            import safetensors.torch  # noqa: F401 - patched before the script imports it
        by_original: dict[int, Any] = {}
        for module, owner_name, attr, label, read in _SAVES:
            owner = sys.modules.get(module)
            if owner is not None and owner_name:
                owner = getattr(owner, owner_name, None)
            original = getattr(owner, attr, None) if owner is not None else None
            if original is None:
                continue
            stand_in = by_original.get(id(original))
            if stand_in is None:
                stand_in = by_original[id(original)] = self._stand_in(label, original, read)
            self.saved.append((owner, attr, original))
            setattr(owner, attr, stand_in)
        # modules that imported a save function by name (``from safetensors.torch import
        # save_file as safe_save_file``) hold the original: they get the stand-in too (each
        # module's globals are read once per process: reading them all takes 0.1-0.3 s)
        self.before = {name: id(mod) for name, mod in list(sys.modules.items())}
        for name, mod in list(sys.modules.items()):
            seen = _HOLDERS.get(name)
            if seen is None or seen[0] != id(mod):
                held = tuple(k for k, v in list(_globals(mod).items())
                             if callable(v) and id(v) in by_original)
                _HOLDERS[name] = seen = (id(mod), held)
            for k in seen[1]:
                v = _globals(mod).get(k)
                stand_in = by_original.get(id(v))
                if stand_in is not None and stand_in is not v:
                    self.saved.append((mod, k, v))
                    setattr(mod, k, stand_in)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, attr, original in reversed(self.saved):
            setattr(owner, attr, original)
        # modules imported during the run may hold a stand-in under any name
        new = [mod for name, mod in list(sys.modules.items())
               if self.before.get(name) != id(mod)]
        _rebind(self.stand_ins, new)
        self.stand_ins.clear()
