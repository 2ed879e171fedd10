"""``torchmem run script.py [args...]``: run a script under the tracker, save and summarise.

The script runs like ``python script.py args`` (``__name__ == "__main__"``, ``sys.argv`` set,
the script's folder first on ``sys.path``). The trace is written even when the script raises;
the script's exit code is passed on (an exception prints the script's traceback and exits 1).
``torchmem run --example`` runs a built-in training example instead. ``--live`` shows a live
panel on stderr while it runs (:mod:`torchmem.cli._live`).

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
from typing import Any

from torchmem.errors import InvalidInputError, MissingFileError

__all__ = ["add_arguments", "run"]

DEFAULT_TRACE = "torchmem-trace.tmtrace"
DEFAULT_PLOT = "torchmem-timeline.png"


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
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
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
    parser.add_argument(
        "--why", type=int, default=3, metavar="N",
        help="when memory leaks, explain what holds the N largest leaked storages (default 3; 0: "
             "off)",
    )


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
    script: str, argv: list[str], namespace: dict[str, Any] | None = None
) -> tuple[int, BaseException | None]:
    """Run like python; the script's globals are copied into ``namespace`` when it returns."""
    old_argv = sys.argv[:]
    folder = os.path.dirname(os.path.abspath(script))
    sys.argv = [script, *argv]
    sys.path.insert(0, folder)
    try:
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


def run(args: argparse.Namespace) -> int:
    """Run the script (or the example) under :func:`torchmem.track`; return its exit code.

    Example:
        >>> import argparse
        >>> run(argparse.Namespace(script=None, example=False))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: expected a script to run...
    """
    if not args.example and not args.script:
        raise InvalidInputError(
            "expected a script to run, e.g. 'torchmem run train.py --epochs 1', or "
            "'torchmem run --example' for the built-in training example"
        )
    if args.script and not args.example:
        if not os.path.isfile(args.script):
            raise MissingFileError(
                f"script {args.script!r} not found; expected a path to a Python file",
                path=args.script,
                kind="script",
            )
    if args.stack_depth < 1:
        raise InvalidInputError(f"--stack-depth must be >= 1, got {args.stack_depth}")
    host_interval = getattr(args, "host_interval", 0.2)
    if not host_interval > 0:
        raise InvalidInputError(f"--host-interval must be a number of seconds > 0, got {host_interval}")
    why_n = getattr(args, "why", 0)
    if why_n < 0:
        raise InvalidInputError(f"--why expects a count >= 0, got {why_n}")
    # checked before the script runs, so a long run is not lost to an unwritable output path
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if os.path.isdir(args.output) or not os.path.isdir(out_dir):
        raise InvalidInputError(
            f"-o/--output {args.output!r} cannot be written: expected a file path in an existing "
            "folder; create the folder or pass another path"
        )

    from torchmem.capture.tracker import track

    label = "torchmem example (MLP + Adam, 4 steps)" if args.example else args.script
    print(f"torchmem: tracking {label} ...", file=sys.stderr)
    meta: dict[str, Any] = {"command": ["torchmem", "run", *sys.argv[2:]] if sys.argv else []}
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
    tracker = track(stacks=not args.no_stacks, stack_depth=args.stack_depth, metadata=meta,
                    listeners=listeners)
    if sampler is not None:
        sampler.start()
    namespace: dict[str, Any] = {}
    try:
        with tracker, (live if live is not None else contextlib.nullcontext()):
            if args.example:
                from torchmem._example_train import main as example_main

                example_main()
            else:
                code, exc = _run_script(args.script, list(args.args), namespace)
    finally:
        if sampler is not None:
            sampler.stop()
    if exc is not None:
        if isinstance(exc, KeyboardInterrupt):
            print("torchmem run: the script was interrupted", file=sys.stderr)
        else:
            sys.stderr.write(_user_traceback(exc, args.script))
    tracker.save(args.output)

    from torchmem.analysis.summary import summarize_trace
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
        leaks = watch.explain(why_n, roots)
    namespace.clear()
    if args.json:
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
    print(f"\ntrace written to {os.path.abspath(args.output)} ({len(tracker.trace)} events)", file=stream)
    if written_plot:
        print(f"timeline plot written to {os.path.abspath(written_plot)}", file=stream)
    print(
        f"next: torchmem summary {args.output}   |   torchmem plot {args.output} -o timeline.png",
        file=stream,
    )
    return code
