"""Estimate an unmodified script: ``python train.py args`` run under the estimate's fake GPU.

:func:`estimate_script` runs a script (or a module, like ``python -m``) as Python would:
``sys.argv`` is the script and its arguments, ``__name__ == "__main__"``, the script's folder (for
a module: the current folder) is first on ``sys.path``; all three are restored afterwards. It runs
exactly as a build function's step does in :func:`~torchmem.fit.run._engine.run_once` (the script's
whole run is the step): fake tensors, fake CUDA, the simulated caching allocator, value reads
answered and listed.

When the run stops:

- after ``steps`` optimizer steps (``torch.optim.Optimizer.step`` calls of any optimizer,
  counted by a global step post hook): the hook raises a ``BaseException`` that is not an
  ``Exception`` (so the script's own ``except Exception`` does not swallow it) and the run ends
  there, as a normal end;
- at its end, or at ``sys.exit(0)``, when it steps fewer times (a script with no optimizer);
- at ``time_limit`` seconds (the figures are then the peak until that point, and the report
  says so);
- at the simulated out-of-memory point (the estimate does not fit).

The result is a :class:`ScriptEstimate`: an :class:`~torchmem.fit.Estimate` whose ``script``
(:class:`ScriptRun`) says which steps ran, why the run stopped and which writes were skipped.

Nothing the fake run writes lands on disk: while the script runs, ``torch.save``
(``torch.serialization.save``) and safetensors' ``save_file`` / ``save_model`` (also where a
library imported them under another name, such as transformers' ``safe_save_file``) are skipped;
other files it writes (``open(...).write``, ``json.dump``, ``numpy.save``, logs, TensorBoard
event files) and folders it makes (``os.makedirs``, transformers' ``output_dir``) go to a scratch
folder deleted after the run (reads of them in the same run see the scratch copies), and
deletions or renames of existing files (a trainer rotating old checkpoints) are skipped
(:mod:`torchmem.fit.targets._sandbox`). Each is listed once per path (``ScriptRun.skipped_writes``:
where, what, the path). Left alone: the system's temporary folder and functions a library bound
under another name before the run (``from os import makedirs``).

Bad input raises :class:`~torchmem.errors.InvalidInputError` (a missing script:
:class:`~torchmem.errors.MissingFileError`) with one line saying what was expected and how to fix
it: a script that does not compile (``file:line``), a module that cannot be imported, arguments
the script's argparse rejects (its usage message in the error), a script that exits early with
nothing simulated, or a non-zero ``sys.exit``. A script that crashes under the estimate raises
:class:`ScriptError`: where (``file:line`` of the script) and why, and what had been simulated up
to then (``ScriptError.estimate``: the peaks so far).

Example:
    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp(); path = os.path.join(folder, "train.py")
    >>> _ = open(path, "w").write('''
    ... import argparse, os, torch
    ... p = argparse.ArgumentParser(); p.add_argument("--batch-size", type=int, default=8)
    ... a = p.parse_args()
    ... net = torch.nn.Linear(64, 64).cuda()
    ... opt = torch.optim.AdamW(net.parameters())
    ... for i in range(1000):
    ...     loss = net(torch.randn(a.batch_size, 64, device="cuda")).square().mean()
    ...     loss.backward(); opt.step(); opt.zero_grad()
    ...     torch.save(net.state_dict(), os.path.join(os.path.dirname(__file__), "ckpt.pt"))
    ... ''')
    >>> e = estimate_script(path, ["--batch-size", "32"], gpu="T4", steps=2)
    >>> e.fits, e.script.steps_run, e.script.stopped
    (True, 2, 'steps')
    >>> [w.what for w in e.script.skipped_writes], os.listdir(folder)
    (['torch.save(OrderedDict of 2 tensors, 16.25 KiB)'], ['train.py'])
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

from torchmem._scripts import script_file
from torchmem.capture.tracker._sites import BOUNDARIES
from torchmem.errors import InvalidInputError
from torchmem.fit.fakegpu._dispatch import _Abort
from torchmem.fit.fakegpu._dist import check_rank, check_world_size, levers_on_rank_0
from torchmem.fit.run._engine import _hint, _user_frame, run_once
from torchmem.fit.search._bracket import _search
from torchmem.fit.search._checks import _apply_margin, _check_range
from torchmem.fit.targets._options import (
    SELF_ACCUMULATING,
    _current,
    _default,
    _option,
    litgpt_command,
    makes_hf_trainer,
    script_accumulation,
    script_batch,
    script_devices,
    with_option,
)
from torchmem.fit.targets._sandbox import ScratchFiles
from torchmem.fit.targets._saves import SkippedWrite, _Writes
from torchmem.fit.targets._stop import _argparse_errors, _ArgparseRejected, _StopScript, _time_limit
from torchmem.fit.verdict._catalog import GPU
from torchmem.fit.verdict._catalog import gpu as _gpu
from torchmem.fit.verdict._estimate import Estimate
from torchmem.fit.verdict._margin import check_margin, margin_for
from torchmem.units import format_bytes

__all__ = ["ScriptError", "ScriptEstimate", "ScriptRun", "SkippedWrite", "estimate_script"]

#: Seconds a script may run under the estimate before it is stopped (``time_limit``).
DEFAULT_TIME_LIMIT = 300.0

#: ``ScriptRun.stopped`` -> what it means.
STOP_REASONS = {
    "steps": "stopped after the requested optimizer steps",
    "end": "ran to its end",
    "exit": "exited with status 0 (sys.exit)",
    "time_limit": "stopped at the time limit",
    "out_of_memory": "stopped at the simulated out-of-memory point",
}


def _statement(path: str, first: int, last: int | None, line: str | None,
               limit: int = 160) -> str:
    r"""The code a traceback frame ran: lines ``first`` to ``last`` (a call spread over several
    lines, ``load_dataset(\n  name,\n  ...)``) joined on one line, at most ``limit``
    characters (cut with "..."); the frame's own first line when the file cannot be read.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "s.py")
        >>> _ = open(path, "w").write("x = load(\n    'a',\n    b=2,\n)\n")
        >>> _statement(path, 1, 4, "x = load(")
        "x = load( 'a', b=2, )"
    """
    import linecache

    last = first if last is None or last < first else min(last, first + 20)
    lines = [linecache.getline(path, n).strip() for n in range(first, last + 1)]
    text = " ".join(x for x in lines if x) or (line or "").strip()
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."


def _clip(text: str, limit: int = 2000) -> str:
    """``text`` whole up to ``limit`` characters, else cut at the last line or word end before
    it, with how much was left out (never mid-word: a size-mismatch list stays readable).

    Example:
        >>> _clip("one two three", 9)
        'one two [... 5 more characters]'
    """
    if len(text) <= limit:
        return text
    cut = max(text.rfind("\n", 0, limit), text.rfind(" ", 0, limit))
    cut = cut if cut > limit // 2 else limit
    return f"{text[:cut].rstrip()} [... {len(text[cut:].strip()):,} more characters]"


class ScriptError(InvalidInputError):
    """The script crashed under the estimate: the message says where (``file:line``) and why;
    ``estimate`` holds what had been simulated up to then (the peaks so far).

    Example:
        >>> issubclass(ScriptError, InvalidInputError), ScriptError("boom").estimate
        (True, None)
    """

    def __init__(self, message: str, estimate: Estimate | None = None) -> None:
        super().__init__(message)
        self.estimate = estimate


@dataclass
class ScriptRun:
    """How the script ran under the estimate.

    ``target`` is the script's path (or the module's name, ``module=True``), ``args`` its
    arguments; ``steps_requested`` the optimizer steps after which it is stopped;
    ``steps_run`` the optimizer steps it made; ``stopped`` why it stopped (a key of
    :data:`STOP_REASONS`: ``"steps"``, ``"end"``, ``"exit"``, ``"time_limit"``,
    ``"out_of_memory"``) and ``reason`` the same in words, with where; ``time_limit_s`` the
    limit and ``elapsed_s`` the run's time; ``skipped_writes`` the writes not made.

    Example:
        >>> r = ScriptRun("train.py", ["--lr", "1"], steps_requested=2, steps_run=2,
        ...               stopped="steps", reason="stopped after 2 optimizer steps (steps=2)")
        >>> r.to_dict()["stopped"], r.line()
        ('steps', 'script: train.py --lr 1: stopped after 2 optimizer steps (steps=2)')
    """

    target: str
    args: list[str]
    module: bool = False
    steps_requested: int = 2
    steps_run: int = 0
    stopped: str = "end"
    reason: str = ""
    time_limit_s: float = DEFAULT_TIME_LIMIT
    elapsed_s: float = 0.0
    skipped_writes: list[SkippedWrite] = field(default_factory=list)

    def command(self) -> str:
        """The script and its arguments as typed (``-m name`` for a module).

        Example:
            >>> ScriptRun("pkg.train", ["--x", "1"], module=True).command()
            '-m pkg.train --x 1'
        """
        head = f"-m {self.target}" if self.module else self.target
        return " ".join([head, *self.args])

    def line(self) -> str:
        """The report's line: the command and why the run stopped.

        Example:
            >>> ScriptRun("t.py", [], stopped="end", reason="ran to its end (0 optimizer steps)").line()
            'script: t.py: ran to its end (0 optimizer steps)'
        """
        return f"script: {self.command()}: {self.reason or STOP_REASONS.get(self.stopped, '')}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the ``script`` key of :meth:`ScriptEstimate.to_dict`).

        Example:
            >>> list(ScriptRun("t.py", []).to_dict())[:4]
            ['target', 'module', 'args', 'steps_requested']
        """
        return {
            "target": self.target,
            "module": self.module,
            "args": list(self.args),
            "steps_requested": self.steps_requested,
            "steps_run": self.steps_run,
            "stopped": self.stopped,
            "reason": self.reason,
            "time_limit_s": self.time_limit_s,
            "elapsed_s": round(self.elapsed_s, 3),
            "skipped_writes": [w.to_dict() for w in self.skipped_writes],
        }


@dataclass
class ScriptEstimate(Estimate):
    """An :class:`~torchmem.fit.Estimate` of a script's run, with ``script``
    (:class:`ScriptRun`): the steps that ran, why the run stopped, the writes skipped;
    :meth:`to_dict` adds it as the ``script`` key.

    Example:
        >>> e = ScriptEstimate("T4", None, True, 100, 30, 1, 2, 3, script=ScriptRun("t.py", []))
        >>> e.to_dict()["script"]["target"], e.verdict_line().startswith("T4: FITS")
        ('t.py', True)
    """

    script: ScriptRun | None = None

    def to_dict(self) -> dict[str, Any]:
        """:meth:`Estimate.to_dict` plus ``script``.

        Example:
            >>> ScriptEstimate("x", None, True, 10, 1, 0, 0, 0).to_dict()["script"] is None
            True
        """
        d = super().to_dict()
        d["script"] = self.script.to_dict() if self.script is not None else None
        return d


# -- the script, found and compiled before anything runs --------------------------------------


@dataclass
class _Target:
    """What runs: a file (``path``, the file Python runs) or a module (``name``)."""

    name: str
    module: bool
    path: str  # the file that runs (a module's file, a folder's __main__.py)
    source: str


def _find(script: str, module: bool) -> _Target:
    """The script's file, compiled (a ``SyntaxError`` is bad input naming ``file:line``)."""
    path = _module_file(script) if module else script_file(script, "estimate")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        compile(raw, path, "exec")
    except SyntaxError as e:  # IndentationError, TabError too
        raise InvalidInputError(
            f"{e.filename or path}:{e.lineno}: {type(e).__name__}: {e.msg}; the script does not "
            "compile, so nothing ran; expected a script that 'python' runs: fix that line"
        ) from None
    return _Target(script, module, path, raw.decode("utf-8", "replace"))


def _module_file(name: str) -> str:
    """The file ``python -m name`` runs (a package: its ``__main__``)."""
    sys.path.insert(0, os.getcwd())
    why = ""
    try:
        try:
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.submodule_search_locations is not None:
                spec = importlib.util.find_spec(name + ".__main__")
        except SyntaxError as e:
            raise InvalidInputError(
                f"{e.filename}:{e.lineno}: {type(e).__name__}: {e.msg}; a package of module "
                f"{name!r} does not compile; fix that line"
            ) from None
        except Exception as e:  # noqa: BLE001 - a parent package failed to import: say so
            spec, why = None, f" (importing its package failed: {type(e).__name__}: {e})"
    finally:
        if sys.path and sys.path[0] == os.getcwd():
            del sys.path[0]
    origin = getattr(spec, "origin", None) if spec is not None else None
    if spec is None or not origin or not os.path.isfile(origin):
        raise InvalidInputError(
            f"no module named {name!r}{why}; expected a module importable from here, as "
            f"'python -m {name}' would find it (check the name, the current folder and the "
            "environment)"
        )
    return str(origin)


# -- one run -------------------------------------------------------------------------------------


class _Run:
    """One run of the script under :func:`run_once`: ``build`` returns ``step``, which runs
    the script once, counting optimizer steps and skipping writes."""

    def __init__(self, target: _Target, args: list[str], steps: int, time_limit: float) -> None:
        self.target = target
        self.record = ScriptRun(target.name, list(args), module=target.module,
                                steps_requested=steps, time_limit_s=time_limit)
        self.exit: BaseException | None = None  # a SystemExit, or the script's exception

    def build(self, batch_size: int, **params: Any) -> Callable[[], None]:
        if "transformers" in self.target.source and importlib.util.find_spec("transformers"):
            # the engine patches transformers' own value reads once it is imported, before the
            # step (as for a build function that imports it)
            import transformers.generation.stopping_criteria  # noqa: F401
            import transformers.generation.utils  # noqa: F401
            import transformers.modeling_utils  # noqa: F401 - its saves are skipped
            if "Trainer" in self.target.source:
                import transformers.trainer  # noqa: F401
        return self.step

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        rec = self.record
        rec.steps_run += 1
        if rec.steps_run >= rec.steps_requested:
            rec.stopped = "steps"
            raise _StopScript()

    def _skipped(self, where: str, what: str, path: str) -> None:
        self.record.skipped_writes.append(SkippedWrite(where, what, path))

    def _timeout(self) -> BaseException:
        self.record.stopped = "time_limit"
        return _StopScript()

    def step(self) -> None:
        t = self.target
        rec = self.record
        old_argv, old_path0 = sys.argv[:], list(sys.path)
        sys.argv = [t.path if t.module else t.name, *rec.args]
        sys.path.insert(0, os.getcwd() if t.module else os.path.dirname(os.path.abspath(t.path)))
        hook = register_optimizer_step_post_hook(self._on_step)
        start = time.perf_counter()
        try:
            with ScratchFiles(self._skipped) as scratch, _Writes(rec.skipped_writes, scratch), \
                    _argparse_errors(), _time_limit(rec.time_limit_s, self._timeout):
                if t.module:
                    runpy.run_module(t.name, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(t.path, run_name="__main__")
            rec.stopped = "end"
        except _StopScript:
            pass  # stopped (steps or time limit): a normal end
        except _Abort:
            rec.stopped = "out_of_memory"
            raise
        except SystemExit as e:
            self.exit = e
            rec.stopped = "exit"
        except Exception as e:  # noqa: BLE001 - the script crashed: reported with the peaks
            self.exit = e
            rec.stopped = "crash"
        finally:
            hook.remove()
            rec.elapsed_s = time.perf_counter() - start
            sys.argv = old_argv
            sys.path[:] = old_path0

    # -- after the run -----------------------------------------------------------------------------

    def _at(self, exc: BaseException) -> str:
        prefer = {os.path.abspath(self.target.path), self.target.path}
        package = self._package_dir()
        if package:  # a package run with -m: where in the package it raised (the innermost)
            import traceback

            prefer |= {fr.filename for fr in traceback.extract_tb(exc.__traceback__)
                       if os.path.abspath(fr.filename).startswith(package)}
        fr = _user_frame(exc, prefer)
        if fr is None:
            return ""
        code = _statement(fr.filename, fr.lineno or 0, getattr(fr, "end_lineno", None), fr.line)
        return f" at {fr.filename}:{fr.lineno}" + (f" ({code})" if code else "")

    def _package_dir(self) -> str:
        """The folder of the top-level package a ``-m`` run belongs to (with a trailing
        separator), or ``""``."""
        if not self.target.module:
            return ""
        try:
            spec = importlib.util.find_spec(self.target.name.split(".")[0])
        except (ImportError, ValueError):
            return ""
        places = list(spec.submodule_search_locations or ()) if spec is not None else []
        if not places or self.target.name.split(".")[0] in ("torch", "torchmem"):
            return ""  # (torch's own launchers: the frames of the code they run say more)
        return os.path.join(os.path.abspath(places[0]), "")

    def raise_bad_end(self, peak: str, e: Estimate | None = None) -> None:
        """Raise what the script's own bad end says (rejected arguments, a non-zero exit, an
        exception), with ``peak`` (what was simulated up to then); nothing for a good end."""
        name = self.record.command()
        exc = self.exit
        if isinstance(exc, _ArgparseRejected):
            raise InvalidInputError(
                f"{self.target.name} rejected its arguments {self.record.args!r}: {exc.message} "
                f"({exc.usage}); expected arguments the script accepts: fix them after the "
                "script's name (torchmem's own options go before it)"
            )
        if isinstance(exc, SystemExit) and exc.code not in (None, 0):
            raise InvalidInputError(
                f"{name} exited with status {exc.code!r}{self._at(exc)} ({peak}); expected a "
                "script that runs to its end or to its optimizer steps; fix what makes it exit "
                "(run it with python to see its own message)"
            )
        if exc is not None and not isinstance(exc, SystemExit):
            err = ScriptError(
                f"{name} raised {type(exc).__name__}{self._at(exc)}: "
                f"{_clip(str(exc).strip()) or '(no message)'} "
                f"({peak}).{_hint(exc)} (torchmem runs it under fake tensors; set "
                "TORCHMEM_DEBUG=1 for the full traceback)", estimate=e)
            err.__cause__ = exc
            raise err

    def finish(self, e: Estimate) -> ScriptEstimate:
        """The estimate with the script's run; bad ends raise (see the module docstring)."""
        rec = self.record
        n = rec.steps_run
        steps = f"{n} optimizer step{'s' * (n != 1)}"
        name = rec.command()
        peak = (f"simulated up to then: peak allocated {format_bytes(e.peak_allocated_bytes)}, "
                f"peak reserved {format_bytes(e.peak_reserved_bytes)} on {e.gpu} after {steps}")
        self.raise_bad_end(peak, e)
        exc = self.exit
        if n == 0 and e.peak_requested_bytes == 0 and e.oom is None and rec.stopped != "time_limit":
            how = (f"exited with status 0{self._at(exc)}" if exc is not None
                   else "ran to its end")
            fix = (f"; it defines build(): to estimate that, run 'torchmem estimate "
                   f"{self.target.name}:build'" if "def build(" in self.target.source else "")
            raise InvalidInputError(
                f"{name} {how} before it made any tensor or optimizer step, so there is "
                "nothing to estimate; expected a script that trains or runs a model (check its "
                f"arguments: does it stop early, e.g. on --help or a dry run?){fix}"
            )
        if rec.stopped == "steps":
            rec.reason = f"stopped after {steps} (steps={rec.steps_requested})"
        elif rec.stopped == "time_limit":
            rec.reason = (f"stopped at the time limit ({rec.time_limit_s:g} s) after {steps}; "
                          "the figures are the peaks until then (raise the limit to see more)")
        elif rec.stopped == "out_of_memory":
            rec.reason = f"stopped at the simulated out-of-memory point after {steps}"
        elif rec.stopped == "exit":
            rec.reason = f"exited with status 0{self._at(exc) if exc else ''} after {steps}"
        else:
            rec.reason = f"ran to its end after {steps}"
        values = {f.name: getattr(e, f.name) for f in fields(Estimate)}
        values.update(batch_size=None, steps=n)
        if rec.stopped == "time_limit" and n < rec.steps_requested and e.oom is None:
            # peaks of a part of the step: no verdict on them (an OOM already reached stands)
            values.update(fits=False, incomplete=(
                f"stopped at the time limit ({rec.time_limit_s:g} s) after {n} of "
                f"{rec.steps_requested} optimizer steps; raise --time-limit"))
        out = ScriptEstimate(**values, script=rec)
        if rec.stopped == "time_limit":
            out.notes.append(f"the script was stopped at the time limit ({rec.time_limit_s:g} s)")
        return out


# the script's stacks (an out-of-memory point, a snapshot's frames) start at its own <module>:
# the CLI, runpy and worker processes around it are not the program
BOUNDARIES.add(_Run.step.__code__)


def estimate_script(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    gpu: str | int | GPU = "H100-80GB",
    *,
    module: bool = False,
    steps: int = 2,
    time_limit: float = DEFAULT_TIME_LIMIT,
    maximize: str | None = None,
    search_range: tuple[int, ...] | None = None,
    alloc_conf: str | None = None,
    margin: int | str | None = None,
    strict_values: bool = False,
    keep_snapshot: bool = False,
    progress: Callable[[str], None] | None = None,
    default_device: str | None = None,
    routing: str = "balanced",
    what_if: bool | Sequence[str] = False,
    world_size: int | None = None,
    rank: int = 0,
    replay_repeats: bool = True,
) -> ScriptEstimate:
    """Will this unmodified script fit on ``gpu``? Run it as ``python script args`` (or
    ``python -m script args`` with ``module=True``) under the estimate (see the module
    docstring) and stop it after ``steps`` optimizer steps, at its end or at ``time_limit``
    seconds.

    The run is the one of :func:`torchmem.estimate` for a build function whose step is the
    whole script: the same fake CUDA, simulated allocator, error ``margin`` (``fits`` keeps it
    free), ``alloc_conf``, ``strict_values``, ``keep_snapshot``, ``default_device`` and
    ``routing``. ``maximize="batch-size"``
    searches the script's integer option ``--batch-size`` (replaced in ``args``, or appended, per
    probe) for the largest value that fits, with the search of :func:`torchmem.estimate`
    (``search_range=(lo, hi[, step])``, ``progress(message)`` told each probe); the answer is
    ``max_value`` (and ``max_batch_size`` for ``batch-size``), its option in ``params``.
    ``world_size=N`` runs the script as rank ``rank`` (default 0) of an ``N``-rank job (a fake
    process group: ``init_process_group``, device meshes and FSDP2 work as on ``N`` GPUs;
    ``RANK`` and ``LOCAL_RANK`` are the rank), as for a build function.
    ``replay_repeats`` (default True) replays the model calls that repeat earlier ones, as
    :func:`torchmem.estimate` does; False runs every one.

    Returns a :class:`ScriptEstimate`; ``.script`` (:class:`ScriptRun`) says how many optimizer
    steps ran, why the run stopped and which writes (``torch.save``, safetensors) were skipped.
    Bad input raises :class:`~torchmem.errors.InvalidInputError`; a crash of the script raises
    :class:`ScriptError` with the peaks simulated until then.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "fit.py")
        >>> _ = open(path, "w").write('''
        ... import sys, torch
        ... net = torch.nn.Linear(256, 256, device="cuda")
        ... opt = torch.optim.SGD(net.parameters(), lr=0.1)
        ... for _ in range(10):
        ...     net(torch.randn(int(sys.argv[2]), 256, device="cuda")).sum().backward()
        ...     opt.step()
        ... ''')
        >>> e = estimate_script(path, ["--batch", "16"], gpu="T4")
        >>> e.script.steps_run, e.peak_requested_bytes > 2 * 256 * 256 * 4
        (2, True)
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise InvalidInputError(f"steps must be an int >= 1, got {steps!r}")
    if not isinstance(time_limit, (int, float)) or isinstance(time_limit, bool) or not time_limit > 0:
        raise InvalidInputError(f"time_limit must be a number of seconds > 0, got {time_limit!r}")
    if isinstance(args, str) or not all(isinstance(a, str) for a in args):
        raise InvalidInputError(
            f"args must be a list of strings (the script's command line), got {args!r}")
    card = _gpu(gpu)
    spec = check_margin(margin)
    world_size = check_world_size(world_size)
    rank = check_rank(rank, world_size)
    target = _find(os.fspath(script), module)
    lo, hi, step = _check_range(search_range, maximize)

    if what_if is not False:
        levers_on_rank_0(rank)
        return _script_what_if(target, list(args), card, steps, float(time_limit), what_if,
                               maximize, spec, progress, keep_snapshot, search_range,
                               dict(alloc_conf=alloc_conf, strict_values=strict_values,
                                    default_device=default_device, routing=routing,
                                    world_size=world_size, replay_repeats=replay_repeats))

    def run(argv: list[str], snap: bool, shown: dict[str, Any] | None = None,
            lower: bool = False) -> ScriptEstimate:
        r = _Run(target, argv, steps, float(time_limit))
        try:
            e = run_once(r.build, 1, card, steps=1, alloc_conf=alloc_conf, keep_snapshot=snap,
                         strict_values=strict_values, default_device=default_device,
                         routing=routing, world_size=world_size, rank=rank,
                         replay_repeats=replay_repeats, lower=lower, progress=progress)
        except InvalidInputError as err:
            if "put nothing on the GPU" not in str(err):
                raise
            # the script's own error (or exit) before it reached the GPU says more
            r.raise_bad_end("before it put anything on the GPU")
            if r.record.stopped != "time_limit":
                raise
            raise ScriptError(
                f"{r.record.command()} was stopped at the time limit ({float(time_limit):g} s) "
                "before it put anything on the GPU: nothing to estimate yet (it spent the time "
                "on the host: imports, data preparation, building the model); expected a run "
                "that reaches its training step; fix: raise --time-limit") from None
        out = r.finish(_apply_margin(e, spec, card))
        out.params = dict(shown or {})
        return out

    if maximize is None:  # a plain estimate: with its lower figure (a search's probes without)
        return run(list(args), keep_snapshot, lower=True)
    flag = _option(maximize, args, target.source)
    ident = flag.lstrip("-").replace("-", "_")
    current = _current(flag, args)
    if current is None:  # the value the script itself sets (argparse default, config file)
        current = _default(flag, target.source, args)  # config files: relative to the cwd
    start = lo if lo is not None else current or 1

    def probe(v: int, snap: bool = False) -> ScriptEstimate:
        return run(with_option(args, flag, v), snap, {flag.lstrip("-"): v})

    def fits_at(reserved: float) -> bool:
        r = max(0, int(reserved))
        return r + margin_for(spec, card, r) <= card.usable_bytes

    best = _search(ident, probe, start, lo, hi, card, progress, keep_snapshot,
                   lambda v: probe(v, keep_snapshot), fits_at, step)
    assert isinstance(best, ScriptEstimate)
    return best


def _script_what_if(target: Any, argv: list[str], card: GPU, steps: int, time_limit: float,
                    what_if: bool | Sequence[str], maximize: str | None, spec: Any,
                    progress: Callable[[str], None] | None, keep_snapshot: bool,
                    search_range: Any, opts: dict[str, Any]) -> ScriptEstimate:
    """``estimate_script(..., what_if=...)``: the script as written, then each lever applied to
    the model and optimizer it makes (:mod:`torchmem.fit.levers._whatif`; FSDP levers run the script
    as rank 0 of the sharded job; accumulation runs it with its batch option divided
    (:func:`~torchmem.fit.targets._options.script_batch`) and its own accumulation option
    multiplied where it has one, else makes every k-th optimizer step)."""
    from torchmem.fit.levers._whatif import TRAINER_BATCH, check_levers
    from torchmem.fit.search._lever_runs import what_if_runs

    chosen = check_levers(None if isinstance(what_if, bool) else what_if)
    batch = script_batch(argv, target.source)
    # a batch set in code for a transformers Trainer: the Trainer's own is divided
    trainer_batch = batch is None and makes_hf_trainer(target.source)
    own = script_accumulation(argv, target.source)
    devices = script_devices(argv, target.name, target.module, target.source)
    litgpt = litgpt_command(argv, target.name, target.module, target.source)
    flag = ident = None
    first: int | None = None
    if maximize is not None:  # the script's own option, searched as --max alone searches it
        flag = _option(maximize, argv, target.source)
        ident = flag.lstrip("-").replace("-", "_")
        first = _current(flag, argv)
        if first is None:
            first = _default(flag, target.source, argv)

    def one(on: GPU, lr: Any, b: int | None, extra: Any, snap: bool, stacks: bool,
            world_size: int | None, alloc_conf: str | None) -> Estimate:
        if (lr.accumulate > 1 or lr.autocast is not None) and "lightning" in target.source:
            # Lightning's Trainer accumulates and mixes precision itself: imported before the
            # levers are put on, so that those levers find its Trainer to adjust
            for name in ("lightning.pytorch", "pytorch_lightning"):
                if importlib.util.find_spec(name.split(".")[0]) is not None:
                    importlib.import_module(name)
        run_argv = argv
        if flag is not None:  # a probe of the search: the option's value to try
            value = b if ident == "batch_size" else (extra or {}).get(ident)
            if value is not None:
                run_argv = with_option(run_argv, flag, int(value))
        if lr.accumulate > 1 and batch is not None:
            # micro-batches: the script's batch divided; the script's own accumulation option
            # multiplied where it has one (nanoGPT), nothing more where it derives it from a
            # global batch (litgpt), else every k-th optimizer step made
            k = lr.accumulate
            run_argv = with_option(argv, batch[0], batch[1] // k)
            if batch[0] in SELF_ACCUMULATING:
                lr.accumulated_by = (f"by the program: {batch[0]} divided (it accumulates to "
                                     "its global batch)")
            elif own is not None:
                run_argv = with_option(run_argv, own[0], own[1] * k)
                lr.accumulated_by = f"by the script: {own[0]}={own[1]} -> {own[1] * k}"
            else:
                lr.script_accumulates = True
        if lr.accumulate > 1 and trainer_batch:
            lr.trainer_batch = True
        if lr.fsdp is True and devices == 1 and world_size is not None and world_size > 1:
            # the program's own sharding over N GPUs (litgpt: FSDP around every block)
            run_argv = with_option(run_argv, "--devices", world_size)
            lr.trainer_shards = f"by the program: --devices 1 -> {world_size}"
        if lr.lora and litgpt in ("finetune_full", "finetune_adapter", "finetune_adapter_v2"):
            # litgpt's own LoRA: its finetune_lora command (rank r on query and value)
            run_argv = ["finetune_lora", *with_option(run_argv[1:], "--lora_r", lr.lora)]
            lr.lora_by = f"by the program: {litgpt} -> finetune_lora --lora_r {lr.lora}"
        r = _Run(target, run_argv, steps, time_limit)
        o = dict(opts)
        if alloc_conf is not None:
            o["alloc_conf"] = alloc_conf
        if world_size is not None:
            o["world_size"] = world_size  # FSDP levers: rank 0 of the sharded job
        try:
            try:
                e = run_once(r.build, 1, on, steps=1, keep_snapshot=snap, levers=lr,
                             stacks=stacks, lower=False, **o)
            except InvalidInputError as err:
                if "put nothing on the GPU" not in str(err):
                    raise
                # the script's own error (or exit) before it reached the GPU says more (a
                # sharding lever's ranks: nanoGPT asserts its accumulation divides them)
                r.raise_bad_end("before it put anything on the GPU")
                raise
            if lr.trainer_batch and not lr.accumulated_by:
                raise InvalidInputError(
                    "no batch option in the script's arguments or defaults, and it made no "
                    "transformers Trainer whose per_device_train_batch_size could be divided")
            return r.finish(e)
        except InvalidInputError as err:
            # a row's reason: "the script", not the whole command line again
            said = str(err).replace(r.record.command(), "the script", 1)
            if said == str(err):
                raise
            raise type(err)(said) from err

    out = what_if_runs(one, card, 1 if batch is None else batch[1], chosen, ident, spec,
                       progress, keep_snapshot, search_range,
                       script=(TRAINER_BATCH if trainer_batch else True) if batch is None
                       else batch[0], start=first)
    assert isinstance(out, ScriptEstimate)
    return out
