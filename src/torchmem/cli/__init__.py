"""The ``torchmem`` command line: one module per subcommand, one place for exit codes.

Each subcommand module in this package defines ``add_arguments(parser)`` and ``run(args) -> int``.
Only the chosen subcommand's module is imported, so ``torchmem stats`` does not pay for torch.

Exit codes: 0 success; 1 an unexpected internal error; 2 bad usage or bad input (a
:class:`~torchmem.errors.TorchmemError`, or a file that cannot be read or written); 130
interrupted. ``torchmem run`` passes on the exit code of the user's script; ``torchmem
estimate`` exits 3 when the step does not fit.

Example:
    >>> from torchmem.cli import main
    >>> main(["--version"])  # doctest: +ELLIPSIS
    torchmem ...
    0
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import traceback
from collections.abc import Sequence

from torchmem._version import __version__
from torchmem.errors import TorchmemError

__all__ = ["main", "entry_point", "SUBCOMMANDS", "subcommand_parser"]

# name -> (module, one-line help). Keep in the order shown by --help.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "inspect": ("torchmem.cli.inspect", "exact storage report of a module, optimizer or live tensors"),
    "run": ("torchmem.cli.run", "run a Python script under the memory tracker and summarise it"),
    "summary": ("torchmem.cli.summary", "summarise a saved torchmem trace (several rank traces: merged)"),
    "merge": ("torchmem.cli.merge", "merge a distributed job's rank traces into one view"),
    "plot": ("torchmem.cli.plot", "plot a trace's memory timeline to a PNG"),
    "stats": ("torchmem.cli.stats", "per-device allocator statistics of a memory snapshot"),
    "peak": ("torchmem.cli.peak", "what was live at the peak of a snapshot, grouped by stack"),
    "diff": ("torchmem.cli.diff", "what grew and shrank between two snapshots"),
    "trace": ("torchmem.cli.trace", "a snapshot's event log with running totals"),
    "flame": ("torchmem.cli.flame", "folded stacks of a snapshot for flame-graph tools"),
    "oom": ("torchmem.cli.oom", "why a snapshot ran out of memory (or how close it came), with the fix"),
    "replay": ("torchmem.cli.replay", "replay a snapshot's trace through the allocator simulator and compare"),
    "whatif": ("torchmem.cli.whatif", "replay a snapshot's requests under other allocator settings or GPU"),
    "view": ("torchmem.cli.view", "write a self-contained offline HTML viewer for a snapshot or trace"),
    "ledger": ("torchmem.cli.ledger", "device usage and ledger figures"),
    "gpu": ("torchmem.cli.gpu", "the gap between nvidia-smi and PyTorch, line by line, per GPU"),
    "estimate": ("torchmem.cli.estimate", "will a training step fit on a GPU? (fake run, no GPU needed)"),
}


def _top_parser() -> argparse.ArgumentParser:
    lines = [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items() if _available(name)]
    p = argparse.ArgumentParser(
        prog="torchmem",
        description="Make PyTorch memory visible and manageable.",
        epilog="subcommands:\n" + "\n".join(lines) + "\n\nRun 'torchmem SUBCOMMAND --help' for its options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"torchmem {__version__}")
    p.add_argument("subcommand", nargs="?", help="one of the subcommands below")
    return p


def subcommand_parser(name: str) -> argparse.ArgumentParser:
    """The argument parser of ``torchmem NAME`` (the one ``main`` parses with).

    The command reference of the documentation is generated from these parsers.

    Example:
        >>> subcommand_parser("stats").prog
        'torchmem stats'
    """
    module = importlib.import_module(SUBCOMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"torchmem {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(parser)
    return parser


def _available(name: str) -> bool:
    module = SUBCOMMANDS[name][0]
    return importlib.util.find_spec(module) is not None


def _debug() -> bool:
    return os.environ.get("TORCHMEM_DEBUG", "") not in ("", "0")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``) and return the exit code.

    Example:
        >>> main(["no-such-command"])  # doctest: +SKIP
        2
    """
    args = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not args or args[0].startswith("-"):
        try:
            top.parse_args(args)
        except SystemExit as e:  # --help / --version / bad flag
            return int(e.code or 0)
        top.print_help()
        return 0
    name = args[0]
    if name not in SUBCOMMANDS or not _available(name):
        known = ", ".join(n for n in SUBCOMMANDS if _available(n))
        print(f"torchmem: error: unknown subcommand {name!r}; expected one of: {known}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    parser = subcommand_parser(name)
    try:
        ns = parser.parse_args(args[1:])
    except SystemExit as e:
        return int(e.code or 0)
    try:
        return int(module.run(ns) or 0)
    except TorchmemError as e:
        if _debug():
            traceback.print_exc()
        print(f"torchmem {name}: error: {e}", file=sys.stderr)
        _json_error(ns, e)
        return 2
    except KeyboardInterrupt:
        print(f"torchmem {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except OSError as e:  # a file the user named cannot be read or written: not a torchmem bug
        if _debug():
            traceback.print_exc()
        where = f": {e.filename}" if e.filename else ""
        print(
            f"torchmem {name}: error: {e.strerror or e}{where}. "
            "Check that the path exists and is readable/writable.",
            file=sys.stderr,
        )
        return 2
    except Exception as e:  # noqa: BLE001 - the one place that turns errors into exit codes
        if _debug():
            traceback.print_exc()
        print(
            f"torchmem {name}: internal error: {type(e).__name__}: {e}\n"
            "This is a bug in torchmem; rerun with TORCHMEM_DEBUG=1 for the traceback and report it.",
            file=sys.stderr,
        )
        return 1


def _json_error(ns: argparse.Namespace, e: BaseException) -> None:
    """With ``--json``, stdout is a JSON document even when the command fails: ``{"error":
    message, "type": the error's class, "exit_code": 2}`` (a program reading stdout sees why)."""
    if getattr(ns, "json", False) is True:
        print(json.dumps({"error": str(e), "type": type(e).__name__, "exit_code": 2}, indent=2))


def entry_point() -> None:
    """Console-script entry: ``sys.exit(main())``.

    Example:
        $ torchmem --help
    """
    sys.exit(main())
