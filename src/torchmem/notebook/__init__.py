"""torchmem in Jupyter: ``%load_ext torchmem``, then ``%%torchmem`` and ``%torchmem_snapshot``.

- ``%%torchmem [--top N] [--name VAR] [--no-stacks] [-o FILE.tmtrace]``: runs the cell under
  :func:`torchmem.track` and shows the summary tables (operators, modules and call sites live at
  the peak) and a timeline of live tensor memory, inline. ``--name`` keeps the
  :class:`~torchmem.capture.Tracker` in a variable; ``-o`` saves the trace.
- ``%torchmem_snapshot [EXPR] [--height PX]``: the interactive viewer, inline and offline, for
  the last ``%%torchmem`` cell, or for ``EXPR``: a Snapshot, a Trace, a Tracker, an Estimate made
  with ``keep_snapshot=True``, PyTorch's ``torch.cuda.memory._snapshot()`` dict, or a path to a
  snapshot or ``.tmtrace`` file.
- Rich display: :class:`~torchmem.model.MemoryReport`, :class:`~torchmem.analysis.TraceSummary`,
  :class:`~torchmem.model.Snapshot` and :class:`~torchmem.fit.Estimate` render as HTML (their
  ``_repr_html_``), with or without the extension.

Without ``%load_ext torchmem`` IPython answers ``UsageError: Cell magic `%%torchmem` not
found.``: load the extension first.

Example:
    >>> from IPython.core.interactiveshell import InteractiveShell
    >>> ip = InteractiveShell.instance(); load_ipython_extension(ip)
    >>> "torchmem" in ip.magics_manager.magics["cell"]
    True
"""

from __future__ import annotations

import ast
import os
from typing import Any, Optional

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from torchmem.notebook._html import estimate_html, timeline_svg, trace_html, viewer_html

__all__ = [
    "TorchmemMagics",
    "estimate_html",
    "load_ipython_extension",
    "timeline_svg",
    "trace_html",
    "unload_ipython_extension",
    "viewer_html",
]


def _display_html(text: str) -> None:
    from IPython.display import HTML, display

    display(HTML(text))


@magics_class
class TorchmemMagics(Magics):
    """The ``%%torchmem`` cell magic and the ``%torchmem_snapshot`` line magic.

    Example:
        >>> from IPython.core.interactiveshell import InteractiveShell
        >>> m = TorchmemMagics(InteractiveShell.instance()); m.last is None
        True
    """

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.last: Any = None

    @magic_arguments()
    @argument("--top", type=int, default=8, help="rows per table (default 8)")
    @argument("--name", default=None, help="keep the Tracker in this variable")
    @argument("--no-stacks", action="store_true", help="do not record call sites")
    @argument("-o", "--output", default=None, help="also save the trace to this .tmtrace file")
    @cell_magic
    def torchmem(self, line: str, cell: str) -> Any:
        """Track the cell's tensor memory; show the summary tables and the timeline.

        Example:
            >>> from IPython.core.interactiveshell import InteractiveShell
            >>> m = TorchmemMagics(InteractiveShell.instance())
            >>> m.torchmem("--top 0", "x = 1")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            IPython.core.error.UsageError: %%torchmem --top expects a whole number >= 1, got 0
        """
        args = parse_argstring(self.torchmem, line)
        if args.top < 1:
            raise UsageError(f"%%torchmem --top expects a whole number >= 1, got {args.top}")
        if args.name is not None and not args.name.isidentifier():
            raise UsageError(f"%%torchmem --name expects a Python variable name, got {args.name!r}")
        if args.output:
            folder = os.path.dirname(os.path.abspath(args.output))
            if not os.path.isdir(folder) or os.path.isdir(args.output):
                raise UsageError(
                    f"%%torchmem -o {args.output!r} cannot be written: expected a file path in an "
                    "existing folder"
                )
        from torchmem.capture.tracker import track

        shell: Any = self.shell
        # Like %%time: the cell runs here (IPython syntax transformed first), so an exception
        # fails this cell (Run All stops) and the last expression's value is the cell's output.
        tree = ast.parse(shell.transform_cell(cell))
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        tracker = track(stacks=not args.no_stacks, stack_depth=6,
                        metadata={"source": "%%torchmem"})
        value = None
        try:
            with tracker:
                exec(compile(tree, "<%%torchmem cell>", "exec"), shell.user_ns)
                if last is not None:
                    value = eval(compile(last, "<%%torchmem cell>", "eval"), shell.user_ns)
        finally:  # the tables are shown even when the cell raised (an out-of-memory error)
            self.last = tracker
            if args.name:
                shell.user_ns[args.name] = tracker
            if args.output:
                tracker.save(args.output)
            _display_html(trace_html(tracker.trace, top=args.top))
        return value

    @magic_arguments()
    @argument("source", nargs="?", default=None,
              help="a Snapshot, Trace, Tracker, Estimate, snapshot dict, or a file path")
    @argument("--height", type=int, default=640, help="height of the viewer in pixels")
    @line_magic
    def torchmem_snapshot(self, line: str) -> None:
        """Show the interactive viewer inline (no network access).

        Example:
            >>> from IPython.core.interactiveshell import InteractiveShell
            >>> TorchmemMagics(InteractiveShell.instance()).torchmem_snapshot("")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            IPython.core.error.UsageError: %torchmem_snapshot: nothing to show yet...
        """
        args = parse_argstring(self.torchmem_snapshot, line)
        source = self._resolve(args.source)
        from torchmem.errors import InvalidInputError

        try:
            page = viewer_html(source, height=args.height)
        except InvalidInputError as e:
            raise UsageError(f"%torchmem_snapshot: {e}") from None
        _display_html(page)

    def _resolve(self, expr: Optional[str]) -> Any:
        if expr is None:
            if self.last is None:
                raise UsageError(
                    "%torchmem_snapshot: nothing to show yet; run a cell with %%torchmem first, "
                    "or pass what to show: %torchmem_snapshot snap (a Snapshot, Trace, Tracker, "
                    "Estimate or a file path)"
                )
            return self.last.trace
        try:
            shell: Any = self.shell
            value = shell.ev(expr)
        except Exception as e:  # noqa: BLE001 - the user's expression; say what went wrong
            raise UsageError(f"%torchmem_snapshot: could not evaluate {expr!r}: "
                             f"{type(e).__name__}: {e}") from None
        if isinstance(value, (str, os.PathLike)):
            from torchmem.errors import TorchmemError
            from torchmem.io import load_snapshot

            try:
                return load_snapshot(value)
            except TorchmemError as e:
                raise UsageError(f"%torchmem_snapshot: {e}") from None
        trace = getattr(value, "trace", None)
        if trace is not None and type(value).__name__ == "Tracker":
            return trace
        if type(value).__name__ == "Estimate":
            if value.snapshot is None:
                raise UsageError(
                    "%torchmem_snapshot: this Estimate has no snapshot; fix: call "
                    "torchmem.estimate(..., keep_snapshot=True)"
                )
            return value.snapshot
        return value


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext torchmem``: the magics.

    Example:
        >>> from IPython.core.interactiveshell import InteractiveShell
        >>> load_ipython_extension(InteractiveShell.instance())
        >>> "torchmem_snapshot" in InteractiveShell.instance().magics_manager.magics["line"]
        True
    """
    ipython.register_magics(TorchmemMagics)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext torchmem``: nothing to undo (IPython has no way to remove magics, and the
    rich displays are the objects' own ``_repr_html_``).

    Example:
        >>> from IPython.core.interactiveshell import InteractiveShell
        >>> unload_ipython_extension(InteractiveShell.instance())
    """
    del ipython


