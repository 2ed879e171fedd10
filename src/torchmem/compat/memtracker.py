"""``torchmem.compat.MemoryTracker``: PyTorch's ``MemoryTracker`` on any device.

A drop-in for ``torch.distributed._tools.memory_tracker.MemoryTracker``: change the import and
nothing else. It has the same attributes with the same meaning (``memories_allocated``,
``memories_active``, ``memories_reserved``: one ``(operator name, MiB)`` pair per operator call,
keyed by the call's index; ``_operator_names``, ``_markers``, ``_op_index``,
``_num_alloc_retries``, ``_hooks``, ``_cur_module_name``, ``profile_mode``), the same methods
(``start_monitor``, ``stop``, ``summary``, ``show_traces``, ``save_stats``, ``load``) and the
same private helpers, names operators as PyTorch does (``"0.1.forward.relu.default_0"``),
prints the same summary and writes stats files that PyTorch's ``load`` reads.

PyTorch's class reads ``torch.cuda.memory_allocated()`` after every operator, so it fails
without an accelerator (``torch.cpu`` has no ``empty_cache`` nor ``memory_allocated``). This one
runs :func:`torchmem.track` underneath. On a CUDA (or XPU) model it reads the caching
allocator's counters as PyTorch does; on every other device (CPU, ``meta``, fake tensors) the
three series come from torchmem's tracker: exact live bytes of the model's device. Added on top:

- :attr:`MemoryTracker.trace` (the torchmem trace of the run: every allocation and free with
  operator, module, phase and category), :meth:`MemoryTracker.peak` and
  :meth:`MemoryTracker.save_trace` (a ``.tmtrace`` file for ``torchmem summary``/``plot``);
- ``source="torchmem"`` to get torchmem's exact figures on CUDA too;
- ``summary(file=...)``, ``show_traces(output=...)`` (a PNG, no display needed);
- clear :class:`~torchmem.errors.InvalidInputError` messages instead of assertions.

Differences: ``save_stats`` writes PyTorch's pickle (plain dicts instead of defaultdicts, plus
the torchmem trace under ``"torchmem_trace"``, which PyTorch's ``load`` ignores); ``load``
reads it without running code (only dicts, tuples, numbers, strings and ``defaultdict`` are
accepted) and also reads ``.tmtrace`` files; ``stop()`` twice is harmless.

Example:
    >>> import torch, torchmem
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
    >>> mt = torchmem.compat.MemoryTracker()
    >>> mt.start_monitor(net)
    >>> net(torch.randn(4, 8)).sum().backward()
    >>> mt.stop()
    >>> name, mib = mt.memories_allocated[2]
    >>> name, (mib - mt.memories_allocated[1][1]) * 2**20   # the Linear's output: 4 x 16 floats
    ('0.forward.addmm.default_0', 256.0)
    >>> dict(mt._markers)          # the root's forward ran operators 1 to 3
    {'fw_start': 1, 'fw_bw_boundary': 4}
"""

from __future__ import annotations

import io
import operator
import os
import pickle
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Mapping
from itertools import chain
from typing import IO, Any

import torch

from torchmem.capture._fast_mode import FastDispatchMode
from torchmem.errors import FileFormatError, InvalidInputError, MissingFileError
from torchmem.io.snapshot_file import SafeUnpickler
from torchmem.io.tmtrace import MAGIC, PathLike, load_trace, save_trace
from torchmem.model.events import EventKind
from torchmem.model.trace import Trace

__all__ = ["MemoryTracker"]

#: PyTorch's unit: the series hold MiB (``bytes / BYTES_PER_MB``).
BYTES_PER_MB = 1024 * 1024.0

_SOURCES = ("auto", "allocator", "torchmem")
_SERIES = ("memories_allocated", "memories_active", "memories_reserved")
_DETACH = torch.ops.aten.detach.default
_STATS = "a stats file written by MemoryTracker.save_stats (PyTorch's or torchmem's)"


class MemoryTracker:
    """Operator-level memory series of a model, as PyTorch's ``MemoryTracker``, on any device.

    After :meth:`start_monitor`, every operator call (``aten::detach`` excepted) appends one
    point to each series, keyed by its index ``_op_index``: ``(name, MiB)``, with ``name`` as
    PyTorch makes it: ``<module path>.forward.<overload>_<n>`` (``n`` counts the calls of that
    overload; the module is the last one whose forward started, so backward operators keep the
    last forward module's name, as in PyTorch).

    What the three figures mean:

    - CUDA/XPU model (``source="auto"`` or ``"allocator"``): PyTorch's own readings:
      ``memory_allocated()``, ``memory_stats()["active_bytes.all.current"]`` and
      ``memory_reserved()`` of the device.
    - any other device (CPU, ``meta``, fake tensors), or ``source="torchmem"``: *allocated*
      is the exact live bytes of the storages torchmem tracks on the model's device (the
      device of its first parameter or buffer; every device when it has none): the model's
      parameters, buffers and gradients plus every storage created while monitoring (tensors
      made before ``start_monitor`` that are not the model's are not counted). There is no caching
      allocator, so *active* and *reserved* equal *allocated*, and ``_num_alloc_retries`` is 0.

    Args:
        source: ``"auto"`` (default: the allocator's counters where the device has them,
            torchmem's elsewhere), ``"allocator"`` (always the device module's counters: needs
            CUDA or XPU) or ``"torchmem"`` (always torchmem's exact live bytes).

    Example:
        >>> import torch, torchmem, io
        >>> lin = torch.nn.Linear(4, 4)
        >>> mt = torchmem.compat.MemoryTracker(); mt.start_monitor(lin)
        >>> _ = lin(torch.randn(2, 4)); mt.stop()
        >>> [name for name, mib in mt.memories_allocated.values()]
        ['.randn.default_0', '.forward.t.default_0', '.forward.addmm.default_0']
        >>> torchmem.compat.MemoryTracker(source="gpu")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: MemoryTracker: source='gpu'; expected 'auto', ...
    """

    def __init__(self, source: str = "auto") -> None:
        if source not in _SOURCES:
            raise InvalidInputError(
                f"MemoryTracker: source={source!r}; expected 'auto', 'allocator' (the CUDA/XPU "
                "caching allocator's counters) or 'torchmem' (exact live bytes on any device)"
            )
        self.source = source
        self._hooks: list[Any] = []
        self._operator_names: dict[str, int] = defaultdict(int)
        self.memories_allocated: dict[int, tuple[str, float]] = defaultdict()
        self.memories_active: dict[int, tuple[str, float]] = defaultdict()
        self.memories_reserved: dict[int, tuple[str, float]] = defaultdict()
        self._markers: dict[str, int] = defaultdict(int)
        self._cur_module_name: str = ""
        self._op_index: int = 0
        self._num_alloc_retries: int = 0
        self._device_module: Any = torch.get_device_module()
        self.profile_mode: Any = None
        self._tracker: Any = None
        self._trace: Trace | None = None
        self._device: str | None = None
        self._allocator = False

    # -- recording -------------------------------------------------------------------------

    def start_monitor(self, root_module: Any) -> None:
        """Clear the series, hook every submodule and start recording operators.

        Example:
            >>> import torchmem
            >>> torchmem.compat.MemoryTracker().start_monitor("not a module")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            torchmem.errors.InvalidInputError: start_monitor expects a torch.nn.Module...
        """
        from torchmem.capture.tracker import track

        if not isinstance(root_module, torch.nn.Module):
            raise InvalidInputError(
                f"start_monitor expects a torch.nn.Module (the model to monitor), got "
                f"{type(root_module).__name__}; pass the model: start_monitor(model)"
            )
        if self.profile_mode is not None:
            raise InvalidInputError(
                "start_monitor was called while monitoring; call stop() first"
            )
        self._pick_device(root_module)
        self._clear_state()
        _flag_root(root_module, True)
        try:
            for name, m in root_module.named_modules():
                if m is not root_module:
                    _flag_root(m, False)
                if ".fused_proxy_grouped_embedding_bag" in name:  # no hooks there, as in PyTorch
                    continue
                self._hooks.append(
                    m.register_forward_pre_hook(self._create_pre_forward_hook(name)))
                self._hooks.append(m.register_forward_hook(self._create_post_forward_hook(name)))
            empty_cache = getattr(self._device_module, "empty_cache", None)
            if self._allocator and empty_cache is not None:
                empty_cache()
            tracker = track(root_module, metadata={"producer": "torchmem.compat.MemoryTracker"})
            tracker.__enter__()
            self._tracker, self._trace = tracker, tracker.trace
            mode = MemoryProfileDispatchMode(self)
            mode.__enter__()  # above the tracker's mode: it reads after the tracker recorded
        except BaseException:
            self.stop()  # a failed start leaves no hook and no mode behind
            raise
        self.profile_mode = mode

    def _pick_device(self, root_module: Any) -> None:
        from torchmem.capture.storage import device_str

        first = next(chain(root_module.parameters(), root_module.buffers()), None)
        dev = first.device if first is not None else None
        self._device = None if dev is None else device_str(dev)
        module = None
        if dev is not None and dev.type not in ("cpu", "meta"):
            try:
                module = torch.get_device_module(dev)
            except (RuntimeError, ValueError, AttributeError):
                module = None
        if module is not None:
            self._device_module = module
        counters = module is not None and all(
            hasattr(module, f) for f in ("memory_allocated", "memory_reserved", "memory_stats")
        )
        if self.source == "allocator" and not counters:
            where = "no parameters or buffers" if dev is None else f"on {self._device}"
            raise InvalidInputError(
                f"MemoryTracker(source='allocator') reads a caching allocator's counters, but the "
                f"model has {where} (no allocator counters); move it to CUDA/XPU or use "
                "source='auto' (torchmem's exact live bytes there)"
            )
        self._allocator = counters and self.source != "torchmem"

    def stop(self) -> None:
        """Remove the hooks and stop recording (reads ``_num_alloc_retries``); twice is harmless.

        Example:
            >>> import torch, torchmem
            >>> mt = torchmem.compat.MemoryTracker(); mt.start_monitor(torch.nn.ReLU())
            >>> len(mt._hooks)
            2
            >>> mt.stop(); mt.stop(); len(mt._hooks), mt._num_alloc_retries
            (0, 0)
        """
        if self.profile_mode is None and self._tracker is None and not self._hooks:
            return
        if self._allocator:
            self._num_alloc_retries = self._device_module.memory_stats().get(
                "num_alloc_retries", 0
            )
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        mode, self.profile_mode = self.profile_mode, None
        tracker, self._tracker = self._tracker, None
        try:
            if mode is not None:
                mode.__exit__(None, None, None)
        finally:
            if tracker is not None:
                tracker.__exit__(None, None, None)

    def _create_pre_forward_hook(self, name: str) -> Callable[..., None]:
        """A forward pre-hook: operators are named after ``name``; the root marks ``fw_start``.

        Example:
            >>> import torch, torchmem
            >>> mt = torchmem.compat.MemoryTracker()
            >>> mt._create_pre_forward_hook("enc.0")(torch.nn.ReLU(), ()); mt._cur_module_name
            'enc.0.forward'
        """

        def _pre_forward_hook(module: Any, inputs: Any) -> None:
            self._cur_module_name = f"{name}.forward"
            if getattr(module, "_memory_tracker_is_root", False):
                self._add_marker("fw_start")

        return _pre_forward_hook

    def _create_post_forward_hook(self, name: str) -> Callable[..., None]:
        """A forward hook: at the end of the root's forward it marks ``fw_bw_boundary``.

        Example:
            >>> import torch, torchmem
            >>> mt, root = torchmem.compat.MemoryTracker(), torch.nn.ReLU()
            >>> root._memory_tracker_is_root = True
            >>> mt._create_post_forward_hook("")(root, (), None); dict(mt._markers)
            {'fw_bw_boundary': 0}
        """

        def _post_forward_hook(module: Any, inputs: Any, outputs: Any) -> None:
            if getattr(module, "_memory_tracker_is_root", False):
                self._add_marker("fw_bw_boundary")

        return _post_forward_hook

    def _create_backward_hook(self, name: str) -> Callable[..., None]:
        """A module backward hook naming operators ``<name>.backward`` (unused, as in PyTorch).

        Example:
            >>> import torchmem
            >>> mt = torchmem.compat.MemoryTracker()
            >>> mt._create_backward_hook("fc")(None, None, None); mt._cur_module_name
            'fc.backward'
        """

        def _backward_hook(module: Any, grad_input: Any, grad_output: Any) -> None:
            self._cur_module_name = f"{name}.backward"

        return _backward_hook

    def _record_memory_stats(self, fn_name: str) -> None:
        """Append one point named ``fn_name`` to the three series at ``_op_index``.

        Example:
            >>> import torchmem
            >>> mt = torchmem.compat.MemoryTracker()
            >>> mt._record_memory_stats("x"); mt._op_index, mt.memories_allocated[0]
            (1, ('x', 0.0))
        """
        if self._allocator:
            dm = self._device_module
            allocated = dm.memory_allocated() / BYTES_PER_MB
            reserved = dm.memory_reserved() / BYTES_PER_MB
            active = dm.memory_stats().get("active_bytes.all.current", 0) / BYTES_PER_MB
        else:
            allocated = reserved = active = self._live_bytes() / BYTES_PER_MB
        i = self._op_index
        self.memories_allocated[i] = (fn_name, allocated)
        self.memories_reserved[i] = (fn_name, reserved)
        self.memories_active[i] = (fn_name, active)
        self._op_index = i + 1

    def _live_bytes(self) -> int:
        tracker = self._tracker
        if tracker is None:
            return 0
        if self._device is not None:
            return int(tracker.live_bytes(self._device))
        return sum(tracker.live_bytes().values())

    def _add_marker(self, marker_name: str) -> None:
        """Set marker ``marker_name`` at the index of the next operator.

        Example:
            >>> import torchmem
            >>> mt = torchmem.compat.MemoryTracker(); mt._record_memory_stats("a")
            >>> mt._add_marker("fw_start"); dict(mt._markers)
            {'fw_start': 1}
        """
        self._markers[marker_name] = len(self.memories_allocated)

    def _clear_state(self) -> None:
        """Empty the series, markers and counters (``start_monitor`` does it).

        Example:
            >>> import torchmem
            >>> mt = torchmem.compat.MemoryTracker(); mt._record_memory_stats("a")
            >>> mt._clear_state(); mt._op_index, len(mt.memories_allocated)
            (0, 0)
        """
        self._operator_names.clear()
        self.memories_allocated.clear()
        self.memories_active.clear()
        self.memories_reserved.clear()
        self._markers.clear()
        self._cur_module_name = ""
        self._op_index = 0
        self._num_alloc_retries = 0

    # -- reading ---------------------------------------------------------------------------

    @property
    def trace(self) -> Trace | None:
        """The torchmem trace of the last run (``None`` before one; also restored by ``load``).

        Example:
            >>> import torch, torchmem
            >>> mt = torchmem.compat.MemoryTracker(); mt.start_monitor(torch.nn.ReLU())
            >>> x = torch.ones(10); mt.stop()
            >>> [(e.op, e.nbytes) for e in mt.trace.events()]
            [('aten::ones', 40)]
        """
        return self._trace

    def _need_trace(self) -> Trace:
        if self._trace is None:
            raise InvalidInputError(
                "MemoryTracker has no torchmem trace; call start_monitor(model) and run a step, "
                "or load(path) a file saved by this class"
            )
        return self._trace

    def peak(self) -> dict[str, int]:
        """Peak live bytes per device, from torchmem's trace (parameters included).

        Example:
            >>> import torch, torchmem
            >>> mt = torchmem.compat.MemoryTracker(); mt.start_monitor(torch.nn.Linear(2, 2))
            >>> y = torch.ones(100); mt.stop(); mt.peak()      # 24 bytes of parameters + 400
            {'cpu': 424}
        """
        return self._need_trace().peak()

    def summary(self, top: int = 20, file: IO[str] | None = None) -> None:
        """Print the ``top`` operators that added the most allocated memory (MiB), as PyTorch.

        Each operator's figure is its allocated series minus the previous point's. ``file``
        (default ``sys.stdout``) is a torchmem addition.

        Example:
            >>> import torchmem
            >>> mt = torchmem.compat.MemoryTracker()
            >>> for i, mib in enumerate([1.0, 3.0, 2.5]):
            ...     mt._record_memory_stats(f"op_{i}"); mt.memories_allocated[i] = (f"op_{i}", mib)
            >>> mt.summary(top=1)
            ------------------------------------------------
            The number of alloc retries are: 0
            Top 1 ops that generates memory are:
            op_1: 2.0MB
            ------------------------------------------------
            >>> torchmem.compat.MemoryTracker().summary()  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            torchmem.errors.InvalidInputError: MemoryTracker.summary: nothing recorded yet; ...
        """
        if not isinstance(top, int) or isinstance(top, bool) or top < 0:
            raise InvalidInputError(
                f"MemoryTracker.summary: top should be a non-negative int (how many operators "
                f"to print), got {top!r}"
            )
        if not self.memories_allocated:
            raise InvalidInputError(
                "MemoryTracker.summary: nothing recorded yet; call start_monitor(model), run a "
                "step and stop(), or load(path) a stats file"
            )
        op_diff: dict[str, float] = defaultdict(float)
        _, previous = self.memories_allocated[0]
        for i in range(1, self._op_index):
            op_name, current = self.memories_allocated[i]
            op_diff[op_name] = current - previous
            previous = current
        out = file if file is not None else sys.stdout
        print("------------------------------------------------", file=out)
        print(f"The number of alloc retries are: {self._num_alloc_retries}", file=out)
        print(f"Top {top} ops that generates memory are:", file=out)
        ranked = sorted(op_diff.items(), key=operator.itemgetter(1), reverse=True)
        for k, v in ranked[:top]:
            print(f"{k}: {v}MB", file=out)
        print("------------------------------------------------", file=out)

    def show_traces(self, path: str = "", output: PathLike | None = None) -> str | None:
        """Plot the series as PyTorch does (four matplotlib figures, markers as vertical lines).

        With ``path``, :meth:`load` it first. Like PyTorch's, the figures are left open for
        ``plt.show()`` or a notebook. With ``output`` (a torchmem addition), the first figure
        (all three series) is written there as a PNG, the figures are closed and the path is
        returned.

        Example:
            >>> import torchmem
            >>> torchmem.compat.MemoryTracker().show_traces("/no/such.stats")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            torchmem.errors.MissingFileError: /no/such.stats: no such file; ...
        """
        if path != "":
            self.load(path)
        y_1 = [mib for (_, mib) in self.memories_allocated.values()]
        y_2 = [mib for (_, mib) in self.memories_active.values()]
        y_3 = [mib for (_, mib) in self.memories_reserved.values()]
        if not y_1:
            raise InvalidInputError(
                "MemoryTracker.show_traces: nothing recorded yet; call start_monitor(model), "
                "run a step and stop(), or pass the path of a stats file"
            )
        plt = _pyplot()
        x = list(range(len(y_1)))
        figures = [
            self._plot_figure(plt, x, [y_1, y_2, y_3],
                              ["allocated_memory", "active_memory", "reserved_memory"]),
            self._plot_figure(plt, x, [y_1], ["allocated_memory"]),
            self._plot_figure(plt, x, [y_2], ["active_memory"]),
            self._plot_figure(plt, x, [y_3], ["reserved_memory"]),
        ]
        if output is None:
            return None
        try:
            figures[0].savefig(os.fspath(output), format="png")
        finally:
            for fig in figures:
                plt.close(fig)
        return os.fspath(output)

    def _plot_figure(
        self, plt: Any, x: list[int], y_values: list[list[float]], labels: list[str]
    ) -> Any:
        low = min(chain.from_iterable(y_values)) * 0.999
        high = max(chain.from_iterable(y_values)) * 1.001
        fig = plt.figure()
        for y, label in zip(y_values, labels):
            plt.plot(x, y, label=label)
        plt.xlabel("# Operator Calls")
        plt.ylabel("Memory (MB)")
        plt.legend()
        for marker_name, marker in self._markers.items():
            style = "r" if marker_name == "fw_bw_boundary" else "k-"
            plt.plot([marker, marker], [low, high], style, lw=2, label=marker_name)
        return fig

    # -- files -----------------------------------------------------------------------------

    def save_stats(self, path: PathLike) -> None:
        """Write the series to ``path`` as PyTorch's ``save_stats`` does (a pickle).

        PyTorch's ``MemoryTracker.load`` reads the file. It holds plain dicts (PyTorch pickles
        defaultdicts), the keys PyTorch writes (``memories_*``, ``markers``,
        ``num_alloc_retries``, ``op_index``) and, when a run was recorded, the torchmem trace
        as ``.tmtrace`` bytes under ``"torchmem_trace"`` (PyTorch ignores it; :meth:`load`
        restores :attr:`trace` from it).

        Example:
            >>> import os, tempfile, torchmem
            >>> mt = torchmem.compat.MemoryTracker(); mt._record_memory_stats("op_0")
            >>> p = os.path.join(tempfile.mkdtemp(), "memory.trace"); mt.save_stats(p)
            >>> mt2 = torchmem.compat.MemoryTracker(); mt2.load(p)
            >>> mt2.memories_allocated[0], mt2._op_index
            (('op_0', 0.0), 1)
        """
        name = _path(path, "save_stats")
        stats: dict[str, Any] = {
            "memories_allocated": dict(self.memories_allocated),
            "memories_active": dict(self.memories_active),
            "memories_reserved": dict(self.memories_reserved),
            "markers": dict(self._markers),
            "num_alloc_retries": self._num_alloc_retries,
            "op_index": self._op_index,
        }
        if self._trace is not None:
            stats["torchmem_trace"] = _trace_bytes(self._trace)
        with open(name, "wb") as f:
            pickle.dump(stats, f, pickle.HIGHEST_PROTOCOL)

    def save_trace(self, path: PathLike) -> None:
        """Write torchmem's trace of the run to a ``.tmtrace`` file (``torchmem summary`` reads it).

        Example:
            >>> import os, tempfile, torch, torchmem
            >>> mt = torchmem.compat.MemoryTracker(); mt.start_monitor(torch.nn.ReLU())
            >>> x = torch.ones(4); mt.stop()
            >>> p = os.path.join(tempfile.mkdtemp(), "run.tmtrace"); mt.save_trace(p)
            >>> torchmem.load_trace(p).peak()
            {'cpu': 16}
        """
        save_trace(self._need_trace(), _path(path, "save_trace"))

    def load(self, path: PathLike) -> None:
        """Restore what :meth:`save_stats` saved (PyTorch's files too), so ``summary()`` repeats.

        Restores the three series, the markers, ``_num_alloc_retries`` and ``_op_index``
        (PyTorch files without ``op_index``: the series' length) and, from torchmem's files,
        :attr:`trace`. The pickle is read without importing anything but ``defaultdict``, so
        a file that would run code is refused. A ``.tmtrace`` file (``torchmem run``,
        :meth:`save_trace`) is read too: :attr:`trace` is set and the series get one point per
        allocation or free of the trace (named ``<module>.<operator>_<n>``; the live bytes of
        every device in the trace).

        Example:
            >>> import os, pickle, tempfile, torchmem
            >>> p = os.path.join(tempfile.mkdtemp(), "s.pkl")
            >>> pickle.dump({"memories_allocated": 1}, open(p, "wb"))
            >>> torchmem.compat.MemoryTracker().load(p)  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            torchmem.errors.FileFormatError: ...s.pkl: not a MemoryTracker stats file: ...
        """
        name = _path(path, "load")
        try:
            with open(name, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise MissingFileError(f"{name}: no such file; expected {_STATS}", path=name,
                                   kind="stats") from None
        except IsADirectoryError:
            raise FileFormatError(f"{name}: is a directory; expected {_STATS}", path=name,
                                  kind="stats") from None
        if data.startswith(MAGIC):
            self._load_trace_file(name)
            return
        try:
            stats = _StatsUnpickler(io.BytesIO(data), name).load()
        except FileFormatError:
            raise
        except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
            raise FileFormatError(
                f"{name}: not a MemoryTracker stats file ({type(e).__name__}: {e}); expected "
                f"{_STATS}", path=name, kind="stats"
            ) from None
        series = [_series(name, stats, key) for key in _SERIES]
        markers = _markers(name, stats)
        retries, op_index = stats.get("num_alloc_retries"), stats.get("op_index", len(series[0]))
        for key, value in (("num_alloc_retries", retries), ("op_index", op_index)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise _bad(name, f"{key!r} should be a non-negative int, got {value!r}")
        trace = stats.get("torchmem_trace")
        if trace is not None and not isinstance(trace, bytes):
            raise _bad(name, f"'torchmem_trace' should be bytes, got {type(trace).__name__}")
        self.memories_allocated, self.memories_active, self.memories_reserved = series
        self._markers = markers
        self._num_alloc_retries = retries
        self._op_index = op_index
        self._trace = None if trace is None else _trace_from_bytes(name, trace)

    def _load_trace_file(self, name: str) -> None:
        tr = load_trace(name)
        self._clear_state()
        alloc, free = int(EventKind.ALLOC), int(EventKind.FREE)
        live: dict[int, int] = defaultdict(int)
        s = tr.strings
        for i in range(len(tr)):
            kind = tr.kind[i]
            if kind not in (alloc, free):
                continue
            dev = tr.device[i]
            live[dev] += tr.nbytes[i] if kind == alloc else -tr.nbytes[i]
            op = s[tr.op[i]] or ("free" if kind == free else "initial")
            n = self._operator_names[op]
            self._operator_names[op] = n + 1
            point = (f"{s[tr.module[i]]}.{op}_{n}", sum(live.values()) / BYTES_PER_MB)
            for series in (self.memories_allocated, self.memories_active, self.memories_reserved):
                series[self._op_index] = point
            self._op_index += 1
        self._trace = tr


class MemoryProfileDispatchMode(FastDispatchMode):
    """The dispatch mode behind :class:`MemoryTracker` (PyTorch's name): after each operator
    (``aten::detach`` excepted) it names the call and appends one point to every series.

    Example:
        >>> import torch, torchmem
        >>> mt = torchmem.compat.MemoryTracker()
        >>> with MemoryProfileDispatchMode(mt):
        ...     y = torch.ones(2).detach() * 2
        >>> [name for name, _ in mt.memories_allocated.values()]
        ['.ones.default_0', '.mul.Tensor_0']
    """

    def __init__(self, memory_tracker: MemoryTracker) -> None:
        super().__init__()
        self.memory_tracker = memory_tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        rs = func(*args, **(kwargs or {}))
        if func is _DETACH:
            return rs
        mt = self.memory_tracker
        fname = func.__name__
        n = mt._operator_names[fname]
        mt._operator_names[fname] = n + 1
        mt._record_memory_stats(f"{mt._cur_module_name}.{fname}_{n}")
        return rs


class _StatsUnpickler(SafeUnpickler):
    """Reads stats pickles: plain data plus ``defaultdict`` (PyTorch pickles its series so)."""

    _ALLOWED: Mapping[tuple[str, str], Any] = {
        ("collections", "defaultdict"): defaultdict,
        ("builtins", "int"): int,
        ("builtins", "float"): float,
    }

    def find_class(self, module: str, name: str) -> Any:
        found = self._ALLOWED.get((module, name))
        if found is None:
            raise FileFormatError(
                f"{self._name}: refused to load: the pickle imports {module}.{name}, which a "
                "MemoryTracker stats file never does (it may run code); nothing was executed",
                path=self._name, kind="stats",
            )
        return found


def _flag_root(module: Any, is_root: bool) -> None:
    """PyTorch's flag on every monitored module: is it the root (its forward marks)?"""
    module._memory_tracker_is_root = is_root


def _bad(name: str, why: str) -> FileFormatError:
    return FileFormatError(f"{name}: not a MemoryTracker stats file: {why}; expected {_STATS}",
                           path=name, kind="stats")


def _series(name: str, stats: Any, key: str) -> dict[int, tuple[str, float]]:
    if not isinstance(stats, dict):
        raise _bad(name, f"it holds a {type(stats).__name__}, not a dict")
    if key not in stats:
        raise _bad(name, f"the key {key!r} is missing (it has {sorted(map(str, stats))})")
    value = stats[key]
    if not isinstance(value, dict):
        raise _bad(name, f"{key!r} should be a dict, got {type(value).__name__}")
    out: dict[int, tuple[str, float]] = defaultdict()
    for i, point in value.items():
        if (not isinstance(i, int) or not isinstance(point, tuple) or len(point) != 2
                or not isinstance(point[0], str) or not isinstance(point[1], (int, float))):
            raise _bad(name, f"{key!r}[{i!r}] should be (name, MiB), got {point!r}")
        out[i] = point
    return out


def _markers(name: str, stats: dict[str, Any]) -> dict[str, int]:
    value = stats.get("markers")
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, int) for k, v in value.items()
    ):
        raise _bad(name, f"'markers' should be a dict of name -> operator index, got {value!r}")
    out: dict[str, int] = defaultdict(int)
    out.update(value)
    return out


def _path(path: Any, method: str) -> str:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise InvalidInputError(
            f"MemoryTracker.{method} expects a file path (str or os.PathLike), got {path!r}; "
            f"pass e.g. {method}('memory.trace')"
        )
    return str(os.fspath(path))


def _trace_bytes(trace: Trace) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "t.tmtrace")
        save_trace(trace, p)
        with open(p, "rb") as f:
            return f.read()


def _trace_from_bytes(name: str, data: bytes) -> Trace:
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "t.tmtrace")
        with open(p, "wb") as f:
            f.write(data)
        try:
            return load_trace(p)
        except FileFormatError as e:
            why = str(e).replace(p, "trace")
            raise _bad(name, f"its torchmem trace is unreadable ({why})") from None


def _pyplot() -> Any:
    """matplotlib's pyplot with the user's backend (figures are shown as PyTorch's are)."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        from torchmem.render.plot import MissingPlotDependency

        raise MissingPlotDependency(
            "MemoryTracker.show_traces needs matplotlib, which is not installed; install the "
            "optional extra: pip install 'torchmem[plot]'"
        ) from None
    return plt
