"""``torchmem run script.py [args...]``: run a script under the tracker, save and summarise.

The script runs like ``python script.py args`` (``__name__ == "__main__"``, ``sys.argv`` set,
the script's folder first on ``sys.path``; a folder with a ``__main__.py`` runs that file, as
python does). ``torchmem run [options] -m package.module args`` runs a module like
``python -m``: everything after the module name goes to it, so torchmem's own options come
before ``-m`` (the module's parent packages are imported, and the module compiled, before
tracking starts). The trace is written even when the script raises; the script's exit code is
passed on (an exception prints the script's traceback and exits 1). A script that does not
compile prints Python's ``SyntaxError`` and exits 1 before anything runs: no trace is written.
``torchmem run --example`` runs a built-in training example instead (giving a script too is an
error).

``--json`` prints the summary as one JSON document on stdout and nothing else: while the script
runs, its standard output (``print``, and everything written to file descriptor 1, by child
processes too) goes to stderr, so ``torchmem run --json train.py > summary.json`` stays
parseable. torchmem's own messages always go to stderr with ``--json``.
``--live`` shows a live panel on stderr while it runs (:mod:`torchmem.cli._live`).

Long runs are aggregated (bounded memory, :mod:`torchmem.model.aggregate`): once the trace
holds ``--aggregate-after`` events (default 5,000,000, about 225 MiB of events) finished
iterations are folded into per-iteration figures and counters at step markers and their events
dropped, keeping every event of the peak iteration, of the last ``--keep-last`` iterations and
of the storages still alive. ``--aggregate`` does so from the start, ``--no-aggregate`` never.
The summary says when a run was aggregated; its figures cover the whole run.

Example:
    >>> from torchmem.cli import main
    >>> main(["run", "--help"])  # doctest: +ELLIPSIS
    usage: torchmem run ...
    0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import runpy
import sys
import traceback
from collections.abc import Iterator
from typing import Any

from torchmem._scripts import module_command, script_file
from torchmem.errors import InvalidInputError

__all__ = ["add_arguments", "run"]

DEFAULT_TRACE = "torchmem-trace.tmtrace"
DEFAULT_PLOT = "torchmem-timeline.png"
#: Events a run's trace holds before ``torchmem run`` aggregates it (about 225 MiB of events).
DEFAULT_AGGREGATE_AFTER = 5_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``torchmem run``.

    Example:
        >>> import argparse
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> p.parse_args(["s.py", "--lr", "1"]).args
        ['--lr', '1']
    """
    parser.add_argument("script", nargs="?", help="Python script to run (like 'python script.py')")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    parser.add_argument(
        "-m", dest="module", nargs=argparse.REMAINDER, default=None, metavar="MODULE ARGS",
        help="run a module like 'python -m MODULE ARGS' (the rest of the line goes to it; put "
             "torchmem's options before -m)",
    )
    parser.add_argument(
        "--example", action="store_true", help="run torchmem's built-in training example instead"
    )
    parser.add_argument(
        "-o", "--output", default=DEFAULT_TRACE, help=f"trace file to write (default {DEFAULT_TRACE})"
    )
    parser.add_argument(
        "--stack-depth", type=int, default=6, metavar="N",
        help="Python frames kept per event (default 6; torch/torchmem frames are skipped)",
    )
    parser.add_argument("--no-stacks", action="store_true", help="do not record Python stacks")
    parser.add_argument(
        "--plot", metavar="PNG", default=None,
        help=f"also write a timeline PNG (default for --example: {DEFAULT_PLOT})",
    )
    parser.add_argument("--top", type=int, default=8, help="rows per summary table (default 8)")
    parser.add_argument(
        "--json", action="store_true",
        help="print the summary as JSON on stdout (the script's own output goes to stderr)",
    )
    parser.add_argument("--quiet", action="store_true", help="do not print the summary")
    parser.add_argument(
        "--host-interval", type=float, default=0.2, metavar="S",
        help="seconds between samples of the process tree's host memory (default 0.2)",
    )
    parser.add_argument("--no-host", action="store_true", help="do not sample host memory")
    parser.add_argument(
        "--live", action="store_true",
        help="show a live panel on stderr (live and peak bytes by category, iterations, growth, "
             "leak warning, host memory per process), redrawn twice a second",
    )
    agg = parser.add_mutually_exclusive_group()
    agg.add_argument(
        "--aggregate", action="store_true",
        help="aggregate from the start: fold finished iterations into counters and drop their "
             "events (bounded memory; the summary's figures still cover the whole run)",
    )
    agg.add_argument("--no-aggregate", action="store_true",
                     help="keep every event however long the run")
    agg.add_argument(
        "--aggregate-after", type=int, default=DEFAULT_AGGREGATE_AFTER, metavar="N",
        help=f"aggregate once the trace holds N events (default {DEFAULT_AGGREGATE_AFTER:,})",
    )
    parser.add_argument(
        "--keep-last", type=int, default=5, metavar="N",
        help="aggregated runs: complete iterations kept in full besides the peak's (default 5)",
    )
    parser.add_argument(
        "--mode", choices=("ops", "fast"), default="ops",
        help="tracker: 'ops' (default; operators' outputs, Python call sites, trace streamed as "
             "it runs, --live and --why) or 'fast' (allocator-level in C++, about 1.2x the "
             "untracked run instead of about 2x, same peak/categories/modules/phases; CPU "
             "memory only, no call sites, the trace written when the run ends)",
    )
    parser.add_argument(
        "--why", type=int, default=3, metavar="N",
        help="when memory leaks, explain what holds the N largest leaked storages (default 3; 0: "
             "off)",
    )
    parser.add_argument(
        "--nproc-per-node", type=int, default=None, metavar="N",
        help="run the script on N ranks through torch.distributed.run, each rank tracked "
             "(NAME.rank{R}.tmtrace); under torchrun ('torchrun ... -m torchmem run script.py') "
             "each rank is found from RANK/WORLD_SIZE/LOCAL_RANK",
    )


def _aggregate_option(args: argparse.Namespace) -> bool | int:
    """``track(aggregate=...)`` from the options: True, False or the event count.

    Example:
        >>> ns = argparse.Namespace(aggregate=False, no_aggregate=False, aggregate_after=10)
        >>> _aggregate_option(ns)
        10
        >>> _aggregate_option(argparse.Namespace(aggregate_after=0, keep_last=5))
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: --aggregate-after must be an event count >= 1, got 0; use --no-aggregate to keep every event
    """
    keep_last = getattr(args, "keep_last", 5)
    if keep_last < 0:
        raise InvalidInputError(f"--keep-last must be a count of iterations >= 0, got {keep_last}")
    if getattr(args, "aggregate", False):
        return True
    if getattr(args, "no_aggregate", False):
        return False
    after = getattr(args, "aggregate_after", DEFAULT_AGGREGATE_AFTER)
    if after < 1:
        raise InvalidInputError(
            f"--aggregate-after must be an event count >= 1, got {after}; use --no-aggregate to "
            "keep every event"
        )
    return int(after)


def _user_traceback(exc: BaseException, script: str) -> str:
    """The traceback without torchmem's and runpy's frames."""
    tb = exc.__traceback__
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    while tb is not None:
        raw = tb.tb_frame.f_code.co_filename
        fn = os.path.abspath(raw)
        if not fn.startswith(here) and "runpy" not in raw:
            break
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _run_script(
    script: str, argv: list[str], namespace: dict[str, Any] | None = None, *, module: bool = False
) -> tuple[int, BaseException | None]:
    """Run like python (``module=True``: like ``python -m``); the script's globals are copied
    into ``namespace`` when it returns."""
    old_argv = sys.argv[:]
    folder = os.getcwd() if module else os.path.dirname(os.path.abspath(script))
    sys.argv = [script, *argv]
    sys.path.insert(0, folder)
    try:
        if module:
            result = runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            result = runpy.run_path(script, run_name="__main__")
        if namespace is not None:
            namespace.update(result)
        return 0, None
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0, None
        if isinstance(code, int):
            return code, None
        print(code, file=sys.stderr)
        return 1, None
    except KeyboardInterrupt as e:
        return 130, e
    except Exception as e:  # noqa: BLE001 - the user's script failed; report it like python
        return 1, e
    finally:
        sys.argv = old_argv
        if sys.path and sys.path[0] == folder:
            del sys.path[0]


def _script_source(script: str) -> str:
    """The file ``python script`` would run: the script, or a folder's ``__main__.py``."""
    return script_file(script, "run")


def _module_code(name: str) -> Any:
    """Compile module ``name`` (a package: its ``__main__``) as ``python -m`` would find it."""
    import importlib.util

    sys.path.insert(0, os.getcwd())
    try:
        try:
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.submodule_search_locations is not None:
                spec = importlib.util.find_spec(name + ".__main__")
        except SyntaxError:
            raise  # in a parent package: Python's message, as for the module itself
        except Exception as e:  # noqa: BLE001 - a parent package failed to import: say so
            spec, why = None, f" (importing its package failed: {type(e).__name__}: {e})"
        else:
            why = ""
        if spec is None or spec.loader is None or not hasattr(spec.loader, "get_code"):
            raise InvalidInputError(
                f"no module named {name!r}{why}; expected a module importable from here, as "
                f"'python -m {name}' would find it (check the name and the current folder)"
            )
        return spec.loader.get_code(spec.name)
    finally:
        if sys.path and sys.path[0] == os.getcwd():
            del sys.path[0]


def _compiles(script: str, module: bool) -> bool:
    """Compile the script before anything runs; on a SyntaxError print Python's message."""
    try:
        if module:
            _module_code(script)
        else:
            path = _script_source(script)
            with open(path, "rb") as f:
                compile(f.read(), path, "exec")
    except SyntaxError as e:  # IndentationError, TabError too
        sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
        return False
    return True


@contextlib.contextmanager
def _stdout_to_stderr(active: bool) -> Iterator[None]:
    """While active, everything written to stdout (Python's and file descriptor 1, child
    processes' too) goes to stderr, so stdout carries only torchmem's JSON."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved_fd = None
    try:
        saved_fd = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no real descriptors (an embedding host): Python-level only
        saved_fd = None
    saved, sys.stdout = sys.stdout, sys.stderr
    try:
        yield
    finally:
        sys.stderr.flush()
        sys.stdout = saved
        if saved_fd is not None:
            os.dup2(saved_fd, 1)
            os.close(saved_fd)


def run(args: argparse.Namespace) -> int:
    """Run the script (or the example) under :func:`torchmem.track`; return its exit code.

    Example:
        >>> import argparse
        >>> run(argparse.Namespace(script=None, example=False))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: expected a script to run...
    """
    from torchmem.cli import _dist

    module_argv = getattr(args, "module", None)
    if module_argv is not None:
        args.script, args.args = module_command(module_argv, args.script, "run")
    as_module = module_argv is not None
    if args.example and args.script:
        raise InvalidInputError(
            f"--example runs torchmem's built-in example, and {args.script!r} was given too; "
            "pass either --example or a script to run, not both"
        )
    if not args.example and not args.script:
        raise InvalidInputError(
            "expected a script to run, e.g. 'torchmem run train.py --epochs 1', "
            "'torchmem run -m package.module', or 'torchmem run --example' for the built-in "
            "training example"
        )
    if args.script and not as_module:
        _script_source(args.script)  # a clear error for a missing file or a plain folder
    if getattr(args, "nproc_per_node", None) is not None:
        args.as_module = as_module
        return _dist.launch(args)  # the parent: the launcher starts this command per rank
    rank = _dist.rank_info()
    if rank is not None:  # a rank of a distributed job: its own trace, its own metadata
        _dist.apply_parent_options(args)
        job_output, args.output = args.output, _dist.rank_trace_path(args.output, rank.rank)
        args.quiet = args.quiet or rank.rank != 0
    if args.stack_depth < 1:
        raise InvalidInputError(f"--stack-depth must be >= 1, got {args.stack_depth}")
    host_interval = getattr(args, "host_interval", 0.2)
    if not host_interval > 0:
        raise InvalidInputError(f"--host-interval must be a number of seconds > 0, got {host_interval}")
    why_n = getattr(args, "why", 0)
    if why_n < 0:
        raise InvalidInputError(f"--why expects a count >= 0, got {why_n}")
    aggregate = _aggregate_option(args)
    # checked before the script runs, so a long run is not lost to an unwritable output path
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if os.path.isdir(args.output) or not os.path.isdir(out_dir):
        raise InvalidInputError(
            f"-o/--output {args.output!r} cannot be written: expected a file path in an existing "
            "folder; create the folder or pass another path"
        )

    mode = getattr(args, "mode", "ops")
    if mode == "fast" and getattr(args, "live", False):
        raise InvalidInputError(
            "--live needs --mode ops: the live panel follows events as they happen, and "
            "--mode fast turns its records into events when the run ends"
        )
    if mode == "fast":
        why_n = 0  # what holds a leaked storage is found from the storages themselves (mode ops)

    if args.script and not _compiles(args.script, as_module):
        return 1  # Python's SyntaxError is printed; nothing ran, so no trace is written

    from torchmem.capture.tracker import track

    label = ("torchmem example (MLP + Adam, 4 steps)" if args.example
             else f"-m {args.script}" if as_module else args.script)
    print(f"torchmem: tracking {label} ...", file=sys.stderr)
    meta: dict[str, Any] = {"command": ["torchmem", "run", *sys.argv[2:]] if sys.argv else []}
    if rank is not None:
        meta.update(rank.metadata())
    code = 0
    exc: BaseException | None = None
    from torchmem.cli._leaks import LeakWatch

    watch = LeakWatch() if why_n else None
    sampler = None
    if not getattr(args, "no_host", False):
        from torchmem.capture.host import HostSampler

        sampler = HostSampler(interval=host_interval)
    live = None
    if getattr(args, "live", False):
        from torchmem.cli._live import LiveView

        live = LiveView(label, sampler)
    listeners = [f.on_event for f in (watch, live) if f is not None]
    # the trace streams to the output as the script runs (a killed run leaves a readable file);
    # the complete trace replaces it when tracking ends
    if mode == "fast":
        tracker: Any = track(metadata=meta, path=args.output, mode="fast")
    else:
        tracker = track(stacks=not args.no_stacks, stack_depth=args.stack_depth, metadata=meta,
                        listeners=listeners, path=args.output, aggregate=aggregate,
                        keep_last=getattr(args, "keep_last", 5))
    dist_ctx: Any = (_dist.rank_context(rank, tracker.trace.metadata) if rank is not None
                     else contextlib.nullcontext(_dist.RankState()))
    if sampler is not None:
        sampler.start()
    namespace: dict[str, Any] = {}
    try:
        # a rank's SIGTERM handler stays on until the trace is written (dist_ctx outside)
        with dist_ctx as rank_state, tracker, (live if live is not None else contextlib.nullcontext()):
            if args.example:
                from torchmem._example_train import main as example_main

                example_main()
            else:
                with _stdout_to_stderr(bool(args.json)):
                    code, exc = _run_script(args.script, list(args.args), namespace,
                                            module=as_module)
                    rank_state.script_running = False
    finally:
        if sampler is not None:
            sampler.stop()
    if exc is not None:
        if isinstance(exc, KeyboardInterrupt):
            print("torchmem run: the script was interrupted", file=sys.stderr)
        else:
            sys.stderr.write(_user_traceback(exc, args.script))
    if rank is not None and os.environ.get(_dist.OPTIONS_ENV):
        return code  # a rank of 'torchmem run --nproc-per-node': the parent reports its trace

    from torchmem.analysis.summary import NO_SITE, summarize_trace
    from torchmem.render.summary import render_summary, summary_json

    summary = summarize_trace(tracker.trace, top=args.top)
    if live is not None:
        live.finish(tracker.trace)
    host = sampler.summary() if sampler is not None else None
    leaks = []
    if watch is not None and summary.leak_suspect:
        script_name = os.path.basename(args.script) if args.script and not args.example else "script"
        roots = {f"{script_name} global {k}": v for k, v in namespace.items()
                 if not k.startswith("__")}
        if exc is not None:
            roots[f"{script_name}'s uncaught {type(exc).__name__}"] = exc
        g = summary.growth
        sites = {gg.name for gg in g.growing if gg.grouping == "call_site"} if g else set()
        sites.discard(NO_SITE)
        leaks = watch.explain(why_n, roots, sites=sites or None,
                              start_step=max(0, g.start_step) if g else 0)
    elif summary.leak_suspect and mode == "fast":
        print("torchmem run: memory grows every iteration; run again with --mode ops to see "
              "the call sites and what holds the leaked storages", file=sys.stderr)
    namespace.clear()
    if args.json and (rank is None or rank.rank == 0):  # under torchrun: one JSON document
        data = json.loads(summary_json(summary))
        if host is not None:
            data["host"] = host.to_dict()
        if watch is not None:
            data["leak_paths"] = [leak.to_dict() for leak in leaks]
        print(json.dumps(data, indent=2))
    elif not args.quiet:
        render_summary(summary)
        for leak in leaks:
            print(leak.text())
        if host is not None:
            print()
            print(host.text())
    plot_path = args.plot or (DEFAULT_PLOT if args.example else None)
    written_plot = None
    if plot_path and len(tracker.trace):
        from torchmem.render.plot import plot_timeline

        try:
            written_plot = plot_timeline(tracker.trace, plot_path)
        except Exception as e:  # noqa: BLE001 - a missing plot must not lose the trace
            print(f"torchmem run: could not write the plot: {e}", file=sys.stderr)
    stream = sys.stderr if args.json else sys.stdout
    agg = tracker.trace.aggregate
    held = (f"{len(tracker.trace)} of {agg.events} events held, aggregated" if agg is not None
            and agg.compactions else f"{len(tracker.trace)} events")
    print(f"\ntrace written to {os.path.abspath(args.output)} ({held})", file=stream)
    if written_plot:
        print(f"timeline plot written to {os.path.abspath(written_plot)}", file=stream)
    print(
        f"next: torchmem summary {args.output}   |   torchmem plot {args.output} -o timeline.png",
        file=stream,
    )
    if rank is not None and "backend" not in tracker.trace.metadata:  # under plain torchrun
        raise InvalidInputError(_dist.never_initialised([rank.rank]))
    if rank is not None:  # under plain torchrun: rank 0 merges the job's traces
        _dist.merge_after_rank(job_output, rank, view=not (args.quiet or args.json))
    return code
