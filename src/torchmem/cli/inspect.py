"""``torchmem inspect``: exact storage report of a module, optimizer, tensors or live tensors.

Without a spec it builds a built-in example (``--example``, default ``tied-lm``), runs one Adam
training step on it (so gradients and optimizer state appear; ``--no-step`` skips it) and
reports it. With ``path/to/file.py:factory`` or ``package.module:attr`` it reports your object.

Example:
    >>> from torchmem.cli import main
    >>> main(["inspect", "--example", "mlp", "--no-step", "--format", "plain", "--top", "1"])  # doctest: +ELLIPSIS
    == Devices
    device  unique    storage bytes  naive sum  #tensors  #storages
    cpu     2.01 MiB  2.01 MiB       2.01 MiB   16        16
    ...
    0
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``torchmem inspect``.

    Example:
        >>> import argparse; p = argparse.ArgumentParser(); add_arguments(p)
        >>> p.parse_args(["--json"]).json
        True
    """
    parser.add_argument(
        "spec", nargs="?",
        help="object to inspect: path/to/file.py:factory or package.module:attr (a module, an "
             "optimizer, a tensor, a (module, optimizer) tuple, or a no-argument callable "
             "returning one); default: a built-in example",
    )
    parser.add_argument("--example", default="tied-lm",
                        help="built-in example when no spec is given (see --list-examples)")
    parser.add_argument("--list-examples", action="store_true", help="list built-in examples")
    parser.add_argument("--no-step", action="store_true",
                        help="for examples: skip the Adam training step (no grads/optimizer state)")
    parser.add_argument("--format", choices=("rich", "plain", "json"), default=None,
                        help="output format (default: rich on a terminal, plain otherwise)")
    parser.add_argument("--json", action="store_true", help="same as --format json")
    parser.add_argument("--device", default=None, help="only this device, e.g. cpu or cuda:0")
    parser.add_argument("--live", action="store_true",
                        help="also report every live tensor in the process after building")
    parser.add_argument("--collect", action="store_true",
                        help="with --live: run gc.collect() first (drops unreachable cycles)")
    parser.add_argument("--top", type=int, default=50,
                        help="tensor rows to show, largest first (0 = all; default 50)")
    parser.add_argument("--why", type=int, default=0, metavar="N",
                        help="also print what holds the N largest storages (retention paths from "
                             "the inspected object and the process's roots)")
    parser.add_argument("--decimal", action="store_true",
                        help="decimal units (kB/MB/GB, base 1000) instead of KiB/MiB/GiB")


def run(args: argparse.Namespace) -> int:
    """Build or load the object, take the census, render it.

    Example:
        >>> import argparse
        >>> ns = argparse.Namespace(spec=None, example="mlp", list_examples=True)
        >>> run(ns)  # doctest: +ELLIPSIS
        mlp          8 x Linear(256, 256) ...
        0
    """
    from torchmem.examples import list_examples

    if getattr(args, "list_examples", False):
        for name, desc in list_examples():
            print(f"{name:<12} {desc}")
        return 0

    import torch

    from torchmem.capture.census import inspect_memory
    from torchmem.capture.storage import device_str, resolve_device
    from torchmem.cli._objects import classify, load_object
    from torchmem.errors import InvalidInputError
    from torchmem.examples import build_example, train_step
    from torchmem.render.table import render

    fmt = "json" if args.json else args.format
    if fmt is None:
        fmt = "rich" if sys.stdout.isatty() else "plain"
    if args.top is not None and args.top < 0:
        raise InvalidInputError(f"--top expects a count >= 0, got {args.top}")
    why_n = getattr(args, "why", 0) or 0
    if why_n < 0:
        raise InvalidInputError(f"--why expects a count >= 0, got {why_n}")
    progress = sys.stderr.isatty()

    def note(msg: str) -> None:
        if progress:
            print(msg, file=sys.stderr, flush=True)

    if args.spec:
        note(f"loading {args.spec} ...")
        target = classify(load_object(args.spec))
    else:
        note(f"building example {args.example!r} ...")
        module = build_example(args.example)
        optimizer = None
        if not args.no_step:
            optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
            train_step(args.example, module, optimizer)
        target = classify((module, optimizer) if optimizer is not None else module)
    if args.live:
        note("scanning live tensors ...")
    report = inspect_memory(
        module=target.module, optimizer=target.optimizer, tensors=target.tensors,
        all_live=args.live,
        collect_garbage=bool(getattr(args, "collect", False)),
    )
    if args.device:
        report = report.select(device=device_str(resolve_device(args.device)))
    if fmt == "json":
        json.dump(report.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render(report, sys.stdout, fmt=fmt, top=None if args.top == 0 else args.top,
               decimal=args.decimal)
    if why_n:
        from torchmem.cli._leaks import explain_largest

        name = args.spec or args.example
        inspected = (target.module, target.optimizer, *(target.tensors or ()))
        labels = [name, f"{name} optimizer", *(f"{name} tensor {i}" for i in range(len(inspected)))]
        roots = {label: o for label, o in zip(labels, inspected) if o is not None}
        note("explaining what holds the largest storages ...")
        print("\n== Why alive (retention paths, shortest first)")
        for line in explain_largest(inspected, why_n, roots, live=args.live):
            print(line)
    return 0
