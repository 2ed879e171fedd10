"""``torchmem run`` under ``torch.distributed``: one tracked trace per rank.

Two ways in, one result (``NAME.rank{R}.tmtrace`` per rank, ``NAME`` from ``-o`` without its
``.tmtrace``):

* ``torchmem run --nproc-per-node N script.py args``: the parent starts the script through
  PyTorch's own launcher (``torch.distributed.run``'s parser, config and ``elastic_launch``,
  in-process; single node, c10d rendezvous on a free local port, no restarts), each worker
  being ``python -u -m torchmem run script.py args``. The parent passes the run's options to
  the workers in ``TORCHMEM_RUN_OPTIONS`` (JSON) and one job id in ``TORCHMEM_JOB_ID`` (also
  the launcher's run id). When the launcher returns, the parent prints each rank's peak from
  its trace file, names a rank that failed (with its exit code; the job exits non-zero) and a
  rank that wrote no trace, and says so when a rank never called
  ``torch.distributed.init_process_group``.
* ``torchrun --nproc-per-node N -m torchmem run script.py args``: the worker finds
  ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` in its environment; its job id is
  ``TORCHMEM_JOB_ID`` or else the launcher's ``TORCHELASTIC_RUN_ID``.

In each rank the tracker streams its trace to the rank's file (a killed rank leaves a readable
prefix) with the metadata ``rank``, ``world_size``, ``local_rank``, ``job_id`` and ``backend``
(recorded when the script calls ``init_process_group``: it is wrapped while the script runs).
SIGTERM (what the launcher sends the other ranks when one fails) ends the script like an
exception, so the rank still writes its complete trace (metadata ``terminated``).

Example:
    >>> rank_trace_path("out/run.tmtrace", 3)
    'out/run.rank3.tmtrace'
    >>> rank_info({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    RankInfo(rank=1, world_size=2, local_rank=1, job_id=None)
    >>> rank_info({}) is None
    True
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torchmem._environ import environ_set
from torchmem.errors import InvalidInputError

__all__ = [
    "RankInfo",
    "rank_info",
    "rank_trace_path",
    "rank_context",
    "RankState",
    "launch",
    "OPTIONS_ENV",
    "JOB_ENV",
    "merged_path",
    "write_merged",
    "wait_for_ranks",
    "merge_after_rank",
]

#: environment variable carrying the parent's ``torchmem run`` options (JSON) to every rank
OPTIONS_ENV = "TORCHMEM_RUN_OPTIONS"
#: environment variable carrying the job id every rank of one job records
JOB_ENV = "TORCHMEM_JOB_ID"
# options of the parent that do not go to the ranks (the script and its arguments go on the
# ranks' command line; the rest is the parent's own business)
_STOPPED = (-signal.SIGTERM, 128 + signal.SIGTERM)  # exit codes of a rank the launcher stopped
_NOT_PASSED = ("script", "args", "module", "nproc_per_node", "output", "json", "quiet", "plot",
               "live", "example", "as_module")


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in a ``torch.distributed`` job, from the launcher's environment.

    Example:
        >>> RankInfo(0, 2, 0, "job-1").metadata()
        {'rank': 0, 'world_size': 2, 'local_rank': 0, 'job_id': 'job-1'}
    """

    rank: int
    world_size: int
    local_rank: int
    job_id: str | None

    def metadata(self) -> dict[str, Any]:
        """The trace metadata this rank records (``backend`` is added when the group starts).

        Example:
            >>> RankInfo(1, 4, 1, None).metadata()["world_size"]
            4
        """
        return {"rank": self.rank, "world_size": self.world_size,
                "local_rank": self.local_rank, "job_id": self.job_id}


def rank_info(env: Mapping[str, str] | None = None) -> RankInfo | None:
    """The rank this process is, from ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``; ``None`` outside
    a launcher. The job id is ``TORCHMEM_JOB_ID``, else ``TORCHELASTIC_RUN_ID``.

    Example:
        >>> rank_info({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
        ...            "TORCHELASTIC_RUN_ID": "abc"}).job_id
        'abc'
        >>> rank_info({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: expected integer RANK, WORLD_SIZE and LOCAL_RANK ...
    """
    env = os.environ if env is None else env
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    if not all(n in env for n in names):
        return None
    try:
        rank, world, local = (int(env[n]) for n in names)
    except ValueError:
        got = ", ".join(f"{n}={env[n]!r}" for n in names)
        raise InvalidInputError(
            f"expected integer RANK, WORLD_SIZE and LOCAL_RANK in the environment (as torchrun "
            f"sets them), got {got}; unset them to run one process"
        ) from None
    if world < 1 or not 0 <= rank < world:
        raise InvalidInputError(
            f"expected 0 <= RANK < WORLD_SIZE in the environment, got RANK={rank}, "
            f"WORLD_SIZE={world}; check the launcher's settings"
        )
    job = env.get(JOB_ENV) or env.get("TORCHELASTIC_RUN_ID") or None
    return RankInfo(rank, world, local, job)


def rank_trace_path(output: str, rank: int) -> str:
    """The trace file of ``rank`` for the output name ``output`` (``NAME[.tmtrace]``).

    Example:
        >>> rank_trace_path("torchmem-trace.tmtrace", 0), rank_trace_path("run", 12)
        ('torchmem-trace.rank0.tmtrace', 'run.rank12.tmtrace')
    """
    return f"{_job_base(output)}.rank{rank}.tmtrace"


def _job_base(output: str) -> str:
    return output[: -len(".tmtrace")] if output.endswith(".tmtrace") else output


def merged_path(output: str) -> str:
    """Where the merged summary of the job named by ``output`` goes.

    Example:
        >>> merged_path("out/run.tmtrace"), merged_path("job")
        ('out/run.merged.json', 'job.merged.json')
    """
    return f"{_job_base(output)}.merged.json"


# ------------------------------------------------------------------------------------ the rank


class _Terminated(SystemExit):
    """SIGTERM from the launcher, raised in the script so the tracker writes its trace."""


class RankState:
    """What :func:`rank_context` knows while a rank runs: ``script_running`` (SIGTERM raises
    in the script only while it runs; later it is noted, and the trace is still saved) and
    ``terminated`` (SIGTERM was received).

    Example:
        >>> RankState().script_running, RankState().terminated
        (True, False)
    """

    def __init__(self) -> None:
        self.script_running = True
        self.terminated = False


@contextlib.contextmanager
def rank_context(info: RankInfo, metadata: dict[str, Any]) -> Iterator[RankState]:
    """While a rank runs: record the backend in ``metadata`` when the script calls
    ``torch.distributed.init_process_group``, and turn SIGTERM into an exit of the script
    (while it runs) that still writes the trace (``metadata["terminated"]``).

    Example:
        >>> meta = {}
        >>> with rank_context(RankInfo(0, 1, 0, "j"), meta) as state:
        ...     state.script_running = False
        >>> meta
        {'rank': 0, 'world_size': 1, 'local_rank': 0, 'job_id': 'j'}
    """
    metadata.update(info.metadata())
    state = RankState()
    import torch.distributed as dist

    saved: list[tuple[Any, str, Any]] = []
    if dist.is_available():
        from torch.distributed import distributed_c10d as c10d

        original = c10d.init_process_group

        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            with contextlib.suppress(Exception):  # the group is up: its backend is known
                metadata["backend"] = str(dist.get_backend())
            return out

        init_process_group.__doc__ = original.__doc__
        init_process_group.__wrapped__ = original  # type: ignore[attr-defined]
        for owner in (c10d, dist):
            saved.append((owner, "init_process_group", owner.init_process_group))
            owner.init_process_group = init_process_group  # type: ignore[attr-defined]

    def on_term(signum: int, frame: Any) -> None:
        metadata["terminated"] = "SIGTERM"
        state.terminated = True
        if not state.script_running:
            return  # the script is over: the trace is being written; exit after it
        print(f"torchmem run: rank {info.rank} got SIGTERM (the launcher stops the other ranks "
              "when one fails); writing its trace", file=sys.stderr, flush=True)
        raise _Terminated(128 + signal.SIGTERM)

    old_term = None
    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        old_term = signal.signal(signal.SIGTERM, on_term)
    try:
        yield state
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        for owner, name, value in saved:
            setattr(owner, name, value)
        if "backend" not in metadata and dist.is_available() and dist.is_initialized():
            metadata["backend"] = str(dist.get_backend())  # initialised some other way


def never_initialised(ranks: list[int]) -> str:
    """The message for ranks that ran without a process group.

    Example:
        >>> never_initialised([1])[:59]
        'rank 1 never called torch.distributed.init_process_group: e'
        >>> never_initialised([0, 1])[:20]
        'ranks 0, 1 never cal'
    """
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return (
        f"{who} never called torch.distributed.init_process_group: each rank ran the "
        "script as one process, and their traces do not describe a distributed job; call "
        "torch.distributed.init_process_group() in the script (e.g. backend='gloo' on CPU, "
        "'nccl' on GPUs), or run it without --nproc-per-node"
    )


def apply_parent_options(args: argparse.Namespace) -> None:
    """Under ``torchmem run --nproc-per-node``: take the parent's options from the environment.

    Example:
        >>> ns = argparse.Namespace(top=8)
        >>> os.environ[OPTIONS_ENV] = '{"top": 3}'; apply_parent_options(ns); del os.environ[OPTIONS_ENV]
        >>> ns.top
        3
    """
    raw = os.environ.get(OPTIONS_ENV)
    if not raw:
        return
    try:
        options = json.loads(raw)
    except ValueError:
        raise InvalidInputError(
            f"{OPTIONS_ENV} is not JSON ({raw[:80]!r}); it is set by 'torchmem run "
            f"--nproc-per-node' for its ranks: unset it"
        ) from None
    for key, value in options.items():
        setattr(args, key, value)


# ---------------------------------------------------------------------------------- the parent


def launch(args: argparse.Namespace) -> int:
    """``torchmem run --nproc-per-node N``: run the script on N tracked ranks through
    PyTorch's launcher, then report each rank's peak. Returns the job's exit code.

    Example:
        >>> launch(argparse.Namespace(nproc_per_node=0))
        Traceback (most recent call last):
        ...
        torchmem.errors.InvalidInputError: --nproc-per-node expects a number of ranks >= 1, got 0...
    """
    n = args.nproc_per_node
    if not isinstance(n, int) or n < 1:
        raise InvalidInputError(
            f"--nproc-per-node expects a number of ranks >= 1, got {n}; e.g. "
            "'torchmem run --nproc-per-node 2 train.py'"
        )
    for flag, name in (("--example", "example"), ("--live", "live"), ("--plot", "plot")):
        if getattr(args, name, None):
            raise InvalidInputError(
                f"{flag} is not available with --nproc-per-node (each rank writes its own "
                f"trace); run 'torchmem summary/plot NAME.rank0.tmtrace' on a rank's trace"
            )
    if not args.script:
        raise InvalidInputError(
            "expected a script to run on each rank, e.g. 'torchmem run --nproc-per-node 2 "
            "train.py' or 'torchmem run --nproc-per-node 2 -m mypkg.train'"
        )
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    job_id = uuid.uuid4().hex[:12]
    target = ["-m", args.script] if args.as_module else [args.script]
    launcher_argv = [
        "--nnodes", "1", "--nproc-per-node", str(n), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "localhost:0", "--rdzv-id", job_id, "--max-restarts", "0",
        "--module", "torchmem", "run", "-o", args.output, *target, *args.args,
    ]
    config, cmd, cmd_args = config_from_args(parse_args(launcher_argv))
    options = {k: v for k, v in vars(args).items() if k not in _NOT_PASSED and _jsonable(v)}
    options["quiet"] = True  # the parent reports; ranks print only their own lines
    paths = [rank_trace_path(args.output, r) for r in range(n)]
    for p in paths:  # a trace left by an earlier run must not pass for this run's
        with contextlib.suppress(FileNotFoundError):
            os.remove(p)
    label = f"-m {args.script}" if args.as_module else args.script
    print(f"torchmem: launching {label} on {n} rank(s) through torch.distributed.run (job "
          f"{job_id}) ...", file=sys.stderr, flush=True)
    failures: dict[int, int] = {}
    with environ_set({OPTIONS_ENV: json.dumps(options), JOB_ENV: job_id}):
        try:
            elastic_launch(config, cmd)(*cmd_args)
        except ChildFailedError as e:
            # the rank that failed first, then the ranks the launcher stopped after it
            # (a rank ended by the launcher's SIGTERM comes after the one that failed)
            by_time = sorted(e.failures.items(), key=lambda kv: (
                kv[1].timestamp, kv[1].exitcode in _STOPPED, kv[0]))
            failures = {rank: f.exitcode for rank, f in by_time}
    return _report(args, paths, job_id, failures)


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        return False
    return True


def _report(args: argparse.Namespace, paths: list[str], job_id: str,
            failures: dict[int, int]) -> int:
    """Print each rank's peak from its trace; name failed ranks and missing traces."""
    from torchmem.io.tmtrace import load_trace
    from torchmem.units import format_bytes

    rows: list[dict[str, Any]] = []
    missing, uninitialised = [], []
    for rank, path in enumerate(paths):
        row: dict[str, Any] = {"rank": rank, "trace": os.path.abspath(path),
                               "exit_code": failures.get(rank, 0)}
        try:
            trace = load_trace(path)
        except Exception as e:  # noqa: BLE001 - a missing or unreadable trace is reported
            missing.append(rank)
            row.update(peak=None, events=0, error=f"{type(e).__name__}: {e}")
            rows.append(row)
            continue
        meta = trace.metadata
        row.update(peak=trace.peak(), events=len(trace), backend=meta.get("backend"),
                   job_id=meta.get("job_id"), cut_short=bool(meta.get("cut_short")),
                   terminated=meta.get("terminated"))
        if meta.get("backend") is None and rank not in failures:
            uninitialised.append(rank)
        rows.append(row)
    failed = list(failures)  # the first to fail first
    stream = sys.stderr if args.json else sys.stdout
    # no merge of ranks that never formed a job; a merge of crashed ranks says what is missing
    merging = not uninitialised and len(missing) < len(paths)
    if args.json:
        from torchmem.render.ranks import merge_json

        merged = write_merged(paths, args.output, view=False) if merging else None
        print(json.dumps({"job_id": job_id, "world_size": len(paths), "ranks": rows,
                          "failed_ranks": failed, "missing_ranks": missing,
                          "merged": json.loads(merge_json(merged)) if merged else None},
                         indent=2))
    elif not args.quiet:
        backends = sorted({str(r.get("backend")) for r in rows if r.get("backend")})
        print(f"\nper-rank peaks (job {job_id}, {len(paths)} ranks, backend "
              f"{', '.join(backends) or 'unknown'}):")
        print(f"  {'rank':>4}  {'peak':>12}  {'events':>9}  trace")
        for row in rows:
            if row["peak"] is None:
                print(f"  {row['rank']:>4}  {'-':>12}  {'-':>9}  (no trace: {row['error']})")
                continue
            peak = sum(row["peak"].values())
            note = " (cut short)" if row["cut_short"] else ""
            note += " (terminated)" if row["terminated"] else ""
            print(f"  {row['rank']:>4}  {format_bytes(peak):>12}  {row['events']:>9}  "
                  f"{row['trace']}{note}")
    for i, rank in enumerate(failed):
        code = failures[rank]
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        if i == 0:
            print(f"torchmem run: rank {rank} failed ({how}); the other ranks' traces are "
                  "written", file=sys.stderr)
        else:
            print(f"torchmem run: rank {rank} ended after rank {failed[0]} failed ({how})",
                  file=sys.stderr)
    for rank in missing:
        if rank not in failures:
            print(f"torchmem run: rank {rank} wrote no trace ({paths[rank]})", file=sys.stderr)
    print(f"traces written to {_job_base(args.output)}.rank*.tmtrace", file=stream)
    if merging and not args.json:
        write_merged(paths, args.output, view=not args.quiet)
    if failed:
        code = failures[failed[0]]
        return code if 0 < code < 256 else 1
    if uninitialised:
        raise InvalidInputError(never_initialised(uninitialised))
    return 0


# ------------------------------------------------------------------------------- the merged view


#: seconds rank 0 waits under plain torchrun for the other ranks' traces (env overrides)
WAIT_ENV = "TORCHMEM_MERGE_TIMEOUT"
_WAIT_DEFAULT = 120.0


def write_merged(paths: list[str], output: str, *, view: bool = True) -> Any:
    """Merge the rank traces ``paths`` (``torchmem merge``'s merge), write
    ``NAME.merged.json`` and, with ``view``, print the merged view (missing and cut-short ranks
    on stderr). Returns the :class:`~torchmem.analysis.RankMerge`, or ``None`` when no trace
    is there.

    Example:
        >>> import contextlib, io, os, tempfile
        >>> from torchmem.model.trace import Trace
        >>> from torchmem.model.events import EventKind as K
        >>> from torchmem.io.tmtrace import save_trace
        >>> d = tempfile.mkdtemp()
        >>> tr = Trace({"rank": 0, "world_size": 2, "job_id": "j"})
        >>> _ = tr.append(K.ALLOC, 0, "cpu", 4096, 1)
        >>> save_trace(tr, os.path.join(d, "j.rank0.tmtrace"))
        >>> with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ...     m = write_merged([os.path.join(d, f"j.rank{r}.tmtrace") for r in (0, 1)],
        ...                      os.path.join(d, "j.tmtrace"))
        >>> m.missing, os.path.exists(os.path.join(d, "j.merged.json"))
        ([1], True)
    """
    from torchmem.cli.merge import merge_files, show

    present = [p for p in paths if os.path.isfile(p)]
    if not present:
        return None
    out = merged_path(output)
    merged = merge_files(present, out)
    if view:
        print()
        show(merged, prog="torchmem run")
    print(f"merged summary written to {os.path.abspath(out)}",
          file=sys.stdout if view else sys.stderr)
    return merged


def wait_for_ranks(output: str, info: RankInfo, timeout: float | None = None,
                   poll: float = 0.2) -> list[str]:
    """Under plain torchrun, rank 0 waits (at most ``timeout`` seconds, default
    ``TORCHMEM_MERGE_TIMEOUT`` or 120) until every rank of its job has written its complete
    trace; returns the ranks' paths (a rank still running when time is up is merged as it
    stands, and reported cut short or missing).

    Example:
        >>> import os, tempfile
        >>> from torchmem.model.trace import Trace
        >>> from torchmem.io.tmtrace import save_trace
        >>> d = tempfile.mkdtemp(); out = os.path.join(d, "j.tmtrace")
        >>> save_trace(Trace({"rank": 1, "job_id": "j"}), os.path.join(d, "j.rank1.tmtrace"))
        >>> len(wait_for_ranks(out, RankInfo(0, 2, 0, "j"), timeout=5))
        2
        >>> save_trace(Trace({"rank": 1, "job_id": "old"}), os.path.join(d, "j.rank1.tmtrace"))
        >>> import time; t = time.time(); _ = wait_for_ranks(out, RankInfo(0, 2, 0, "j"), timeout=0.3)
        >>> time.time() - t >= 0.3        # another job's file: waited until the time was up
        True
    """
    import time

    from torchmem.io.tmtrace import read_header

    if timeout is None:
        try:
            timeout = float(os.environ.get(WAIT_ENV, _WAIT_DEFAULT))
        except ValueError:
            raise InvalidInputError(
                f"{WAIT_ENV} must be a number of seconds, got {os.environ[WAIT_ENV]!r}"
            ) from None
    paths = [rank_trace_path(output, r) for r in range(info.world_size)]
    pending = {r: p for r, p in enumerate(paths) if r != info.rank}
    seen: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    told = False
    while pending:
        for r, p in list(pending.items()):
            try:
                mtime = os.stat(p).st_mtime
            except OSError:
                continue
            if seen.get(r) == mtime:
                continue  # an old file already looked at
            header = read_header(p)  # the metadata, without the events
            if header is None or header.get("layout") == "stream":
                continue  # being replaced right now, or still streaming: look again
            seen[r] = mtime
            if (header.get("metadata") or {}).get("job_id") == info.job_id:
                del pending[r]
        if not pending or time.monotonic() >= deadline:
            break
        if not told:
            print(f"torchmem run: rank {info.rank} waits for the traces of rank(s) "
                  f"{', '.join(map(str, sorted(pending)))} to merge them (at most "
                  f"{timeout:.0f} s)", file=sys.stderr, flush=True)
            told = True
        time.sleep(poll)
    return paths


def merge_after_rank(output: str, info: RankInfo, *, view: bool = True) -> None:
    """Under plain torchrun: rank 0 waits for the other ranks' traces, then writes and prints
    the merged summary (other ranks do nothing).

    Example:
        >>> merge_after_rank("x.tmtrace", RankInfo(1, 2, 1, "j"))   # not rank 0: nothing
    """
    if info.rank != 0:
        return
    write_merged(wait_for_ranks(output, info), output, view=view)
