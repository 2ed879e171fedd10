"""``torchmem estimate path/to/file.py:build --gpu H100-80GB``: will a step fit, and how big?

``build(batch_size, **params)`` (in a file or an importable module) builds the model, optimizer
and data and returns a zero-argument ``step()``; torchmem runs it under fake tensors through a
simulation of PyTorch's CUDA caching allocator (see :func:`torchmem.estimate`). Nothing is
allocated and no GPU is needed.

- ``--set NAME=VALUE`` (repeatable) passes a keyword to ``build``: the value is read as an int
  (``32768``, ``32_768``), then a float (``0.5``), then ``true``/``false`` or ``none``, else kept
  as a string; ``--set batch_size=8`` is ``--batch-size 8``.
- ``--max NAME`` searches for the largest integer value of ``NAME`` that fits (doubling from
  ``--range LO:HI``'s low end, or the build's default, then where the memory curve puts the
  boundary; progress on stderr);
  ``--max-batch-size`` is ``--max batch_size``. The JSON gives ``max_<NAME>``.
- ``--margin`` sets the error margin a FITS verdict keeps free (default: 1 % of the peak
  reserved bytes + 256 MiB for the CUDA context's uncertainty; ``0`` judges the simulation
  alone). The report shows the margin and the attention kernel assumed.

``-o estimate.pickle`` writes the simulated run as a PyTorch memory snapshot (for ``torchmem
view``/``stats``/``peak``; it ends at the out-of-memory point when the step does not fit),
atomically, and never when the estimate fails with an error. Exit codes: 0 fits, 3 does not
fit (``--max``: not even 1), 2 bad input (an unknown parameter, a value of the wrong type, a
search range in which nothing fits, ...). ``--hf-config config.json --task
forward|generate|train`` estimates a transformers model from its config alone instead of a
build function (:mod:`torchmem.cli._estimate_hf`); ``--max seq_len`` works there too.
``--world-size N`` estimates rank 0 of an N-rank job (``--rank R`` another rank): ``build`` may
call ``fully_shard`` or wrap in DDP (a fake process group of N ranks; see
:func:`torchmem.estimate`); the report adds the model state at the end of ``optimizer.step()``
and the collectives with their largest buffers.

``--what-if`` (``--levers a,b+c`` to choose them) also tries the memory levers on the step, each applied
by torchmem to the model and optimizer ``build`` makes (:mod:`torchmem.fit.levers._whatif`): a table
sorted by peak reserved, the levers the step cannot take with the reason, and the cheapest
combination that fits (``what_if``/``what_if_best`` in the JSON); with ``--max`` the largest
value each of the three best levers allows. The exit code stays the step's own verdict.
With ``--hf-config ... --task train`` the levers apply to the model the config builds and its
AdamW; the inference tasks (``forward``, ``generate``) take no levers (an error says so).

``torchmem estimate [options] train.py ARGS`` (or ``-m package.module ARGS``) estimates an
unmodified script instead (:func:`torchmem.fit.estimate_script`): torchmem's options before the
script, the script's own after it; it is stopped after ``--steps`` optimizer steps (default 2),
at its end or at ``--time-limit`` seconds (default 300), and the report says which; ``--max
batch-size`` searches the script's ``--batch-size``; saves of the fake run are skipped and listed
(``"script"`` in the JSON). ``--batch-size``/``--set``/``--world-size``/``--hf-config`` are
build-function options and refused for a script, with the fix.

Example:
    >>> from torchmem.cli import main
    >>> main(["estimate", "--list-gpus"])  # doctest: +ELLIPSIS
    A100-40GB ...
    0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from typing import Any

from torchmem.errors import InvalidInputError

__all__ = ["add_arguments", "assumed_lines", "run", "render_text", "parse_value", "parse_sets",
           "parse_range", "script_lines"]


def add_arguments(parser: argparse.ArgumentParser, positionals: bool = True) -> None:
    """Options of ``torchmem estimate`` (``positionals=False``: the options alone, to read
    the ones given after ``FILE:build``).

    Example:
        >>> import argparse; p = argparse.ArgumentParser(); add_arguments(p)
        >>> ns = p.parse_args(["--gpu", "T4", "--batch-size", "8", "train.py:build"])
        >>> ns.gpu, ns.batch_size, ns.steps, ns.spec
        ('T4', 8, None, 'train.py:build')
        >>> ns = p.parse_args(["--gpu", "T4", "train.py", "--batch-size", "8"])
        >>> ns.spec, ns.script_args, ns.batch_size
        ('train.py', ['--batch-size', '8'], None)
    """
    if positionals:
        parser.add_argument(
            "spec", nargs="?",
            help="the build function: path/to/file.py:build or package.module:build; "
                 "build(batch_size) returns a zero-argument step(); or a script, run as "
                 "'python SCRIPT ARGS' (torchmem's options before it, the script's after it)",
        )
        parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                            help="a script's own arguments (after the script); after "
                                 "FILE:build, torchmem's options as before")
        parser.add_argument(
            "-m", dest="module", nargs=argparse.REMAINDER, default=None, metavar="MODULE ARGS",
            help="estimate a module run like 'python -m MODULE ARGS' (the rest of the line "
                 "goes to it; put torchmem's options before -m)",
        )
    parser.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                        help="scripts: stop the script after SECONDS (default 300) when it has "
                             "not made --steps optimizer steps by then; the report says so")
    parser.add_argument("--gpu", default="H100-80GB",
                        help="a GPU from the catalog (see --list-gpus) or a size such as "
                             "'23.5 GiB' (default H100-80GB)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--batch-size", type=int, default=None, metavar="N",
                       help="the batch size passed to build (default 1)")
    group.add_argument("--max-batch-size", action="store_true",
                       help="search for the largest batch size that fits (= --max batch_size)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        dest="set_params",
                        help="a keyword for build(batch_size, NAME=VALUE), repeatable; VALUE is "
                             "read as an int (32768, 32_768), a float (0.5, 1e-3), a bool "
                             "(true/false) or none, else kept as a string; "
                             "--set batch_size=8 sets the batch size")
    parser.add_argument("--max", default=None, metavar="NAME", dest="maximize",
                        help="search for the largest integer value of build's parameter NAME "
                             "that fits (seq_len, batch_size, ...): doubling, then probes where "
                             "the memory curve puts the boundary")
    parser.add_argument("--range", default=None, metavar="LO:HI[:STEP]", dest="search_range",
                        help="bounds for --max: start at LO, never probe above HI (e.g. "
                             "1024:131072); an error when LO does not fit. STEP searches "
                             "multiples of STEP only (the answer fits, answer + STEP does not)")
    parser.add_argument("--margin", default=None, metavar="M",
                        help="error margin kept free for a FITS verdict: a size ('1 GiB'), a "
                             "share of the peak reserved ('2%%') or 0; default 1%% of the peak "
                             "reserved + 256 MiB for the CUDA context's uncertainty")
    parser.add_argument("--steps", type=int, default=None, metavar="N",
                        help="training steps to run (default 2: the second sees optimizer "
                             "state and cached blocks; --hf-config forward/generate: 1 call; "
                             "a script is stopped after N optimizer steps)")
    parser.add_argument("--world-size", type=_world_size, default=None, metavar="N",
                        help="estimate one rank (rank 0) of an N-rank job: build (or the script) runs with a "
                             "fake process group of N ranks, so it may call fully_shard (FSDP2) "
                             "or wrap in DistributedDataParallel; shards, all-gathers, "
                             "reduce-scatters and DDP buckets get their per-rank sizes and the "
                             "collectives' buffers are reported as 'communication'")
    parser.add_argument("--rank", type=_rank, default=None, metavar="R",
                        help="with --world-size N: the rank to estimate, 0 to N-1 (default 0; "
                             "a plan that splits a dimension unevenly gives the last ranks "
                             "fewer rows), or 'all': each rank in turn, a table of their peaks "
                             "and the worst rank's report")
    parser.add_argument("--alloc-conf", default=None, metavar="CONF",
                        help="PYTORCH_CUDA_ALLOC_CONF to simulate, e.g. "
                             "'expandable_segments:True'")
    parser.add_argument("--routing", choices=("balanced", "worst"), default=None,
                        help="tokens per expert for mixture-of-experts routing masks "
                             "(one_hot + where): each expert its share (balanced, the "
                             "default) or every token (worst)")
    parser.add_argument("--default-device", choices=("cpu", "cuda"), default=None,
                        help="where tensors created without a device go (default: the host, "
                             "as in PyTorch; 'cuda' for a device-agnostic build)")
    parser.add_argument("--strict-values", action="store_true",
                        help="refuse values read from tensors (.item(), float(t), if t:) instead "
                             "of answering them with the documented stand-ins (listed as "
                             "'assumed values')")
    parser.add_argument("--no-replay", action="store_true",
                        help="run every call of the model: by default calls that repeat earlier "
                             "ones with the same shapes (accumulation micro-steps, evaluation "
                             "forwards) are replayed into the simulator once two did the same "
                             "(same peaks, much faster)")
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")
    parser.add_argument("-o", "--output", default=None, metavar="PICKLE",
                        help="also write the simulated run as a PyTorch memory snapshot")
    parser.add_argument("--list-gpus", action="store_true", help="list the GPU catalog and exit")
    parser.add_argument("--suggest", action="store_true",
                        help="also replay the estimated run under the documented allocator "
                             "settings and print the best PYTORCH_CUDA_ALLOC_CONF (torchmem whatif)")
    parser.add_argument("--what-if", action="store_true",
                        help="also try the memory levers on the step, each applied by torchmem "
                             "to your model and optimizer (activation checkpointing, gradient "
                             "accumulation, bf16, the optimizer's implementations, 8-bit Adam, "
                             "Adafactor, FSDP over 2/4/8 GPUs, CPU offload, allocator "
                             "settings): a table sorted by peak reserved and the cheapest "
                             "combination that fits")
    parser.add_argument("--levers", default=None, metavar="LEVER,LEVER+LEVER",
                        help="with --what-if: the levers to try (comma-separated; '+' joins "
                             "levers into one combination), e.g. "
                             "activation_checkpointing,adafactor,grad_accumulation_4+adafactor")
    from torchmem.cli._estimate_hf import add_arguments as add_hf_arguments

    add_hf_arguments(parser)


def _int_at_least(text: str, low: int, expected: str) -> int:
    """``text`` as an int >= ``low``; else argparse's error, which names the option."""
    try:
        n = int(text)
    except ValueError:
        n = low - 1
    if n < low:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return n


def _world_size(text: str) -> int:
    """``--world-size`` as an int >= 1 (argparse reports the error with the option's name).

    Example:
        >>> _world_size("64")
        64
    """
    return _int_at_least(text, 1, "the number of ranks, an int >= 1 (e.g. --world-size 8)")


def _rank(text: str) -> int | str:
    """``--rank`` as an int >= 0 (whether it is below the world size is checked with it), or
    ``"all"`` (every rank, :mod:`torchmem.cli._estimate_ranks`).

    Example:
        >>> _rank("3"), _rank("all")
        (3, 'all')
    """
    if text == "all":
        return text
    return _int_at_least(text, 0, "a rank of the job, an int >= 0 (e.g. --rank 3), or all")


def _fmt(n: int) -> str:
    from torchmem.units import format_bytes

    return format_bytes(n)


def render_text(est: Any, file: Any = None) -> None:
    """Print an :class:`~torchmem.fit.Estimate` as tables (rich; plain text when piped).

    Example:
        >>> from torchmem.fit import Estimate
        >>> render_text(Estimate("T4", 8, True, 100 << 20, 10 << 20, 1 << 20, 2 << 20, 4 << 20),
        ...             file=sys.stdout)  # doctest: +ELLIPSIS
        T4, batch 8: FITS ...
    """
    from rich.console import Console
    from rich.table import Table

    con = Console(file=file or sys.stdout, highlight=False, soft_wrap=True)
    con.print(est.verdict_line())
    if est.searched:
        con.print(est.search_line())
    t = Table(title="memory", show_header=True)
    t.add_column("line")
    t.add_column("bytes", justify="right")
    t.add_column("what it is")
    t.add_row("GPU total", _fmt(est.capacity_bytes), "cudaMemGetInfo total of the card")
    t.add_row("CUDA context", _fmt(est.overhead_bytes),
              "driver + kernels, outside PyTorch's allocator (per GPU generation, approximate)")
    t.add_row("usable", _fmt(est.usable_bytes), "what cudaMalloc can get: the simulated capacity")
    t.add_row("peak requested", _fmt(est.peak_requested_bytes), "sum of live tensor storages")
    t.add_row("peak allocated", _fmt(est.peak_allocated_bytes),
              "allocator blocks (rounded requests + workspaces)")
    t.add_row("peak reserved", _fmt(est.peak_reserved_bytes), "cudaMalloc'd segments")
    if est.peak_reserved_lower_bytes is not None:
        t.add_row("peak reserved, lower", _fmt(est.peak_reserved_lower_bytes),
                  "the least it can be (the range's causes below); the verdict takes the "
                  "figure above")
    t.add_row("fragmentation", _fmt(est.fragmentation_bytes),
              "reserved but unallocated at the peak of allocated")
    t.add_row("cuBLAS workspaces", _fmt(est.workspace_bytes),
              "one block per (thread, stream) doing GEMMs; inside allocated")
    t.add_row("error margin", _fmt(est.margin_bytes),
              f"kept free for a FITS verdict ({est.margin_rule or 'none'})")
    t.add_row("headroom after margin", _fmt(est.headroom_after_margin_bytes),
              "usable - peak reserved - margin (negative: short by that much)")
    t.add_row("host peak", _fmt(getattr(est, "host_peak_bytes", 0)),
              "tensors on the host (CPU RAM: built before .to('cuda'), batches, offload); "
              "not GPU memory")
    con.print(t)
    c = Table(title="live at the peak, by category", show_header=True)
    c.add_column("category")
    c.add_column("bytes", justify="right")
    for k, v in est.by_category.items():
        if v:
            c.add_row(k, _fmt(v))
    con.print(c)
    _render_ranks(est, con)
    if est.by_module:
        m = Table(title="live at the peak, by module (top 15)", show_header=True)
        m.add_column("module")
        m.add_column("bytes", justify="right")
        for k, v in list(est.by_module.items())[:15]:
            m.add_row(k, _fmt(v))
        con.print(m)
        if len(est.by_module) > 15:
            con.print(f"... and {len(est.by_module) - 15} more modules (--json lists all)")
    if est.oom is not None:
        o = est.oom
        con.print(f"out of memory at: {o.op or '?'} in module {o.module or '(none)'} "
                  f"({o.phase}), requesting {_fmt(o.requested_bytes)} with "
                  f"{_fmt(o.allocated_bytes)} allocated, {_fmt(o.reserved_bytes)} reserved")
        for line in o.stack:
            con.print(f"    {line}")
    from torchmem.cli._estimate_hf import kv_lines

    for line in kv_lines(est):
        con.print(line)
    for line in script_lines(est):
        con.print(line)
    if est.attention_kernel:
        con.print(f"attention kernel: {est.attention_kernel} (CUDA's choice; see the notes)")
    if est.calls_replayed:
        con.print(f"repeated calls: {est.calls_replayed:,} model calls repeated earlier ones and "
                  "were replayed into the simulator (the same requests; --no-replay runs them)")
    for line in assumed_lines(est):
        con.print(line)
    for cause in est.range_causes:
        con.print(f"range: {cause}")
    for note in est.notes:
        con.print(f"note: {note}")


def script_lines(est: Any, top: int = 10) -> list[str]:
    """The report's lines for a script's run: which steps ran, why it stopped, the writes
    skipped (nothing for a build function).

    Example:
        >>> from torchmem.fit.targets._script import ScriptRun, SkippedWrite
        >>> run = ScriptRun("train.py", [], steps_run=2, stopped="steps",
        ...                 reason="stopped after 2 optimizer steps (steps=2)",
        ...                 skipped_writes=[SkippedWrite("train.py:9", "torch.save(dict)", "c.pt")])
        >>> from types import SimpleNamespace
        >>> for line in script_lines(SimpleNamespace(script=run)): print(line)
        script: train.py: stopped after 2 optimizer steps (steps=2)
        skipped writes (none reached the disk; files and folders went to a scratch folder):
            train.py:9  torch.save(dict) -> c.pt
    """
    run = getattr(est, "script", None)
    if run is None:
        return []
    lines = [run.line()]
    real = [w for w in run.skipped_writes if w.what.startswith("written for real")]
    skipped = [w for w in run.skipped_writes if w not in real]
    if skipped:
        lines.append("skipped writes (none reached the disk; files and folders went to a "
                     "scratch folder):")
        for w in skipped[:top]:
            lines.append(f"    {w.where}  {w.what} -> {w.path}")
        if len(skipped) > top:
            lines.append(f"    ... and {len(skipped) - top} more (--json lists all)")
    for w in real:
        lines.append(f"{w.what}: {w.path}")
    return lines


def assumed_lines(est: Any, top: int = 10) -> list[str]:
    """The report's lines for the values the estimate assumed where the step read tensors.

    Example:
        >>> from types import SimpleNamespace
        >>> est = SimpleNamespace(assumed_values=[
        ...     {"where": "train.py:9", "op": "aten.mean.default", "value": 1.0, "count": 2}])
        >>> for line in assumed_lines(est): print(line)
        values assumed where the step read tensors (fake tensors have none; --strict-values refuses them):
            train.py:9  aten.mean.default -> 1.0  (2 reads)
    """
    reads = list(getattr(est, "assumed_values", []) or [])
    if not reads:
        return []
    lines = ["values assumed where the step read tensors (fake tensors have none; "
             "--strict-values refuses them):"]
    for r in reads[:top]:
        n = r.get("count", 1)
        lines.append(f"    {r['where']}  {r['op']} -> {r['value']!r}" + (f"  ({n} reads)" if n > 1 else ""))
    if len(reads) > top:
        lines.append(f"    ... and {len(reads) - top} more places (--json lists all)")
    return lines


def _render_ranks(est: Any, con: Any) -> None:
    """A per-rank estimate's model state and collectives (nothing for a one-GPU estimate)."""
    from rich.table import Table

    if getattr(est, "world_size", None) is None:
        return
    if est.model_state:
        t = Table(title=f"rank {getattr(est, 'rank', 0)} of {est.world_size}: model state at the end of "
                        "optimizer.step()", show_header=True)
        t.add_column("category")
        t.add_column("bytes", justify="right")
        for k, v in est.model_state.items():
            t.add_row(k, _fmt(v))
        con.print(t)
    if est.collectives:
        c = Table(title="collectives (per rank)", show_header=True)
        c.add_column("operator")
        c.add_column("calls", justify="right")
        c.add_column("largest buffer", justify="right")
        for name, stat in est.collectives.items():
            c.add_row(name, str(stat["calls"]), _fmt(stat["largest_buffer_bytes"]))
        con.print(c)


def parse_value(text: str) -> Any:
    """A ``--set`` value: int, then float, then bool or none, else the string itself.

    Example:
        >>> [parse_value(t) for t in ["32768", "32_768", "0.5", "True", "none", "static"]]
        [32768, 32768, 0.5, True, None, 'static']
    """
    t = text.strip()
    for kind in (int, float):
        try:
            return kind(t)
        except ValueError:
            pass
    low = t.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    return t


def parse_sets(items: list[str]) -> dict[str, Any]:
    """``--set NAME=VALUE`` options as keyword arguments (the last one wins for a name).

    Example:
        >>> parse_sets(["seq_len=4096", "cache=static", "batch_size=8"])
        {'seq_len': 4096, 'cache': 'static', 'batch_size': 8}
    """
    out: dict[str, Any] = {}
    for item in items:
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or not name.isidentifier() or not value.strip():
            raise InvalidInputError(
                f"--set {item!r}: expected NAME=VALUE with NAME a Python identifier, e.g. "
                "--set seq_len=32768 (values: int, float, true/false, none, or a string)"
            )
        out[name] = parse_value(value)
    return out


def parse_range(text: str | None) -> tuple[int, ...] | None:
    """``--range LO:HI`` or ``LO:HI:STEP`` as a tuple of ints.

    Example:
        >>> parse_range("1024:131072"), parse_range("1024:131072:256"), parse_range(None)
        ((1024, 131072), (1024, 131072, 256), None)
    """
    if text is None:
        return None
    parts = text.split(":")
    try:
        got = tuple(int(p) for p in parts) if len(parts) in (2, 3) else None
    except ValueError:
        got = None
    if got is None or not 1 <= got[0] <= got[1] or (len(got) == 3 and got[2] < 1):
        raise InvalidInputError(
            f"--range {text!r}: expected LO:HI or LO:HI:STEP, integers with 1 <= LO <= HI and "
            "STEP >= 1, e.g. --range 1024:131072 or --range 1024:131072:256"
        )
    return got


def _check_output(path: str) -> None:
    out_dir = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(out_dir):
        raise InvalidInputError(
            f"-o/--output {path!r} cannot be written: expected a file path in an existing "
            "folder; create the folder or pass another path"
        )


def _write_atomic(path: str, snapshot: Any) -> None:
    from torchmem.io import write_snapshot

    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".torchmem-estimate-", suffix=".pickle", dir=folder)
    os.close(fd)
    try:
        write_snapshot(tmp, snapshot)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def run(args: argparse.Namespace) -> int:
    """Load the build function, estimate, print; exit code 0 when it fits, 3 when it does not,
    4 when a script stopped at its time limit before its optimizer steps (no verdict).

    Example:
        >>> run(argparse.Namespace(list_gpus=False, spec=None))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        torchmem.errors.InvalidInputError: expected a build function...
    """
    from torchmem.fit import GPUS, gpu

    if getattr(args, "list_gpus", False):
        for g in GPUS.values():
            print(f"{g.name:<10} {g.total_bytes / 2**30:7.2f} GiB total  "
                  f"{g.usable_bytes / 2**30:7.2f} GiB usable  sm_{g.compute_capability[0]}"
                  f"{g.compute_capability[1]}  {g.marketed}; source: {g.source}")
        return 0
    script = _script_of(args)
    rest = getattr(args, "script_args", None) or []
    if script is None and rest:  # FILE:build --gpu T4 ...: torchmem's options, as before
        try:
            after = argparse.ArgumentParser(prog="torchmem estimate")
            add_arguments(after, positionals=False)
            after.parse_args(rest, namespace=args)
        except SystemExit as e:
            return int(e.code or 0)
    if not args.spec and not getattr(args, "hf_config", None) and script is None:
        raise InvalidInputError(
            "expected a build function or a script, e.g. 'torchmem estimate train.py:build "
            "--gpu H100-80GB' (build(batch_size) returns a zero-argument step()) or "
            "'torchmem estimate --gpu H100-80GB train.py --batch-size 16' (the script's own "
            "arguments after it)"
        )
    card = gpu(args.gpu)  # unknown names fail before the user's file runs
    if script is not None:
        _check_script_options(args)
    elif getattr(args, "time_limit", None) is not None:
        raise InvalidInputError("--time-limit stops a script; a build function runs --steps "
                                "steps; fix: drop --time-limit")
    if args.steps is not None and args.steps < 1:
        raise InvalidInputError(f"--steps must be >= 1, got {args.steps}")
    if args.batch_size is not None and args.batch_size < 1:
        raise InvalidInputError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.output:
        _check_output(args.output)
    params = parse_sets(getattr(args, "set_params", None) or [])
    maximize = getattr(args, "maximize", None)
    if args.max_batch_size:
        if maximize not in (None, "batch_size"):
            raise InvalidInputError(
                f"--max-batch-size and --max {maximize} both ask for a search; one parameter "
                "is maximized at a time"
            )
        maximize = "batch_size"
    search_range = parse_range(getattr(args, "search_range", None))
    if search_range is not None and maximize is None:
        raise InvalidInputError(
            "--range bounds a search; fix: add --max NAME (e.g. --max seq_len) or drop --range"
        )
    if maximize is not None and maximize in params:
        raise InvalidInputError(
            f"--set {maximize}=... and --max {maximize}: a parameter is either set or searched; "
            "fix: drop one"
        )
    if maximize == "batch_size" and args.batch_size is not None and not getattr(
            args, "what_if", False):
        raise InvalidInputError(
            "--batch-size and --max batch_size: the batch size is either set or searched; "
            "fix: drop one"
        )
    margin = getattr(args, "margin", None)
    if margin is not None:
        from torchmem.fit.verdict._margin import check_margin

        margin = check_margin(margin.strip())

    def say(msg: str) -> None:
        print(f"torchmem estimate: {msg}", file=sys.stderr, flush=True)

    keep = bool(args.output) or bool(getattr(args, "suggest", False))  # --suggest replays it
    options: dict[str, Any] = dict(search_range=search_range, alloc_conf=args.alloc_conf,
                                   keep_snapshot=keep, margin=margin,
                                   strict_values=getattr(args, "strict_values", False))
    if not getattr(args, "hf_config", None):
        if getattr(args, "no_replay", False):
            options["replay_repeats"] = False
        if getattr(args, "default_device", None):
            options["default_device"] = args.default_device
        if getattr(args, "routing", None):
            options["routing"] = args.routing
    every_rank = getattr(args, "rank", None) == "all"
    if every_rank:
        from torchmem.cli._estimate_ranks import check_all_ranks

        check_all_ranks(getattr(args, "world_size", None), {
            "--what-if": bool(getattr(args, "what_if", False)), "--max": maximize is not None,
            "-o": bool(args.output), "--suggest": bool(getattr(args, "suggest", False)),
            "--hf-config": bool(getattr(args, "hf_config", None))})
    elif getattr(args, "rank", None) is not None:
        if getattr(args, "world_size", None) is None:
            raise InvalidInputError(
                f"--rank {args.rank} names one rank of a job, but no --world-size was given; "
                "fix: add --world-size N (the job's number of ranks), or drop --rank"
            )
        if not getattr(args, "hf_config", None):
            options["rank"] = args.rank
    if getattr(args, "hf_config", None) and getattr(args, "world_size", None) is not None:
        raise InvalidInputError(
            "--world-size runs a build function's sharding (fully_shard, DDP) on a fake process "
            "group; --hf-config builds an unsharded model; fix: drop --world-size, or write a "
            "build(batch_size) that shards the model and pass it as FILE:build"
        )
    what_if = getattr(args, "what_if", False)
    levers = getattr(args, "levers", None)
    if levers is not None and not what_if:
        raise InvalidInputError("--levers chooses the levers of --what-if; fix: add --what-if")
    if what_if:
        task = getattr(args, "task", None) or "forward"
        if getattr(args, "hf_config", None) and task != "train":
            raise InvalidInputError(
                f"--what-if tries memory levers on a training step, got --hf-config with "
                f"--task {task}, which runs no backward pass and makes no optimizer; fix: "
                "--task train (the levers apply to the model the config builds and its AdamW), "
                "or drop --what-if"
            )
        from torchmem.fit.levers._whatif import check_levers

        names = None if levers is None else [n.strip() for n in levers.split(",") if n.strip()]
        check_levers(names)
        options["what_if"] = True if names is None else names
    # with --json, stdout is the JSON document: what the user's code prints goes to stderr
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    if every_rank:
        from torchmem.cli._estimate_ranks import run_all_ranks

        def one(rank: int) -> Any:
            with quiet:
                return _estimate(args, card, params, maximize, say, {**options, "rank": rank})
        return run_all_ranks(args.world_size, one, say, args.json, render_text)
    with quiet:
        est = _estimate(args, card, params, maximize, say, options)
    if args.output:
        if est.snapshot is None:
            raise InvalidInputError("the simulator returned no snapshot; nothing was written")
        _write_atomic(args.output, est.snapshot)
    whatif = None
    if getattr(args, "suggest", False):
        from torchmem.cli.whatif import render as render_whatif
        from torchmem.cli.whatif import suggest_estimate

        whatif = suggest_estimate(est)
    if args.json:
        print(json.dumps({**est.to_dict(), **({"whatif": whatif.to_dict()} if whatif else {})},
                         indent=2))
    else:
        render_text(est)
        if est.what_if:
            from torchmem.fit.levers._whatif import what_if_lines

            print("\n".join(what_if_lines(est.what_if, est.what_if_best, est)))
        if whatif is not None:
            sys.stdout.write(render_whatif(whatif))
    if maximize is not None:
        return 0 if est.max_value else 3
    if est.incomplete:
        return 4  # no verdict: a script stopped before its steps
    return 0 if est.fits else 3


def _script_of(args: argparse.Namespace) -> tuple[str, list[str], bool] | None:
    """``(script or module, its arguments, module?)`` when a script is estimated; ``None`` for
    a build function (``FILE:build``, ``package.module:build``) or ``--hf-config``.

    Example:
        >>> ns = argparse.Namespace(spec="train.py", script_args=["--lr", "1"], module=None)
        >>> _script_of(ns), _script_of(argparse.Namespace(spec="t.py:build", module=None))
        (('train.py', ['--lr', '1'], False), None)
    """
    module = getattr(args, "module", None)
    if module is not None:
        from torchmem._scripts import module_command

        return (*module_command(module, args.spec, "estimate"), True)
    spec = args.spec
    if not spec:
        return None
    where, colon, attr = spec.rpartition(":")
    if colon and where and attr.isidentifier():
        return None  # FILE:build
    return spec, list(getattr(args, "script_args", None) or []), False


def _check_script_options(args: argparse.Namespace) -> None:
    """Options that belong to build functions are refused for a script, saying where the
    script's own arguments go."""
    name = args.module[0] if getattr(args, "module", None) else args.spec
    if args.batch_size is not None:
        raise InvalidInputError(
            f"--batch-size before the script is build(batch_size)'s; a script takes its own "
            f"arguments after its name: 'torchmem estimate {name} --batch-size "
            f"{args.batch_size}'"
        )
    if getattr(args, "set_params", None):
        raise InvalidInputError(
            "--set passes keywords to build(); a script takes its own arguments after its name "
            f"('torchmem estimate {name} --seq-len 4096'); fix: move them there"
        )
    for option, value in (("--hf-config", "hf_config"), ("--kv-cache-attr", "kv_cache_attr")):
        if getattr(args, value, None):
            raise InvalidInputError(
                f"{option} is not available for scripts (yet); fix: drop it, or write a "
                "build(batch_size) function and estimate FILE:build"
            )
    if args.time_limit is not None and not args.time_limit > 0:
        raise InvalidInputError(f"--time-limit must be a number of seconds > 0, got "
                                f"{args.time_limit:g}")


def _estimate(args: argparse.Namespace, card: Any, params: dict[str, Any], maximize: str | None,
              say: Any, options: dict[str, Any]) -> Any:
    """Run the estimate the arguments ask for (a config with --hf-config, else FILE:build)."""
    from torchmem.fit import estimate, estimate_script

    script = _script_of(args)
    if script is not None:
        name, argv, as_module = script
        if args.time_limit is not None:
            options["time_limit"] = args.time_limit
        return estimate_script(name, argv, card, module=as_module,
                               steps=2 if args.steps is None else args.steps, progress=say,
                               maximize=maximize, world_size=getattr(args, "world_size", None),
                               **options)
    if getattr(args, "hf_config", None):
        from torchmem.cli._estimate_hf import estimate_from_args

        return estimate_from_args(args, card, params=params, maximize=maximize, progress=say,
                                  **options)

    from torchmem.cli._objects import load_object

    build = load_object(args.spec, call=False)
    if not callable(build):
        raise InvalidInputError(
            f"{args.spec} is a {type(build).__name__}, expected a function build(batch_size) "
            "returning a zero-argument step()"
        )
    return estimate(
        build, card, args.batch_size, params=params, maximize=maximize,
        steps=2 if args.steps is None else args.steps, progress=say,
        kv_cache_attr=getattr(args, "kv_cache_attr", None) or None,
        world_size=getattr(args, "world_size", None), **options,
    )
