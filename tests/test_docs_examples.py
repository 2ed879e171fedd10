"""Every example of the README and the guides runs (issue 27: docs that cannot rot).

Each page's ```python blocks run in order in one namespace (later blocks build on earlier ones),
in a fresh working folder. Every ``torchmem ...`` command line of a shell block is parsed by that
subcommand's own parser (fast: an option that no longer exists fails here) and run, page by page
in one folder, as ``python -m torchmem ...``: it must exit 0. The files the lines name are real:
the stand-ins of ``tests/docs_commands`` (``train.py``, ``mypkg``...), the snapshots of
``tests/data`` under the names the guides use (``SNAPSHOTS``), a trace of the built-in example,
the page's ``file:`` blocks and what earlier lines wrote; ``WORDS`` maps the reader's words
(``NAME``, a pid) to real ones.

What a page may say to this test, in an HTML comment right before a block (invisible on the
site; docs/contributing.md documents them):

- ``<!-- skip: REASON -->``: the block is not run; the reason is required (a CUDA GPU, a
  fragment with ``...`` for your own arguments; for a shell block, a download).
- ``<!-- exit: N -->`` (shell blocks): its command lines must exit N, an error shown on purpose;
  ``<!-- exit: N without a CUDA GPU -->``: N here, 0 on a machine with one.
- ``<!-- raises: ExceptionName -->``: the block must raise that exception (an OOM shown on
  purpose).
- ``<!-- file: NAME.py -->``: the block is also written to NAME.py in the working folder (a
  later block imports it).
- ``<!-- setup:`` code ``-->``: code run (unseen) before the block: the stand-ins for what a
  snippet takes as given (your model, a snapshot file).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import sys
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from torchmem.cli import SUBCOMMANDS, subcommand_parser

# one worker runs this file (bash scripts/test.sh: pytest -n auto --dist loadgroup): its module
# fixtures and caches are built once, not once per worker
pytestmark = pytest.mark.xdist_group("docs_examples")

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                    re.M | re.S)
_MARK = re.compile(r"<!--\s*(?P<kind>skip|raises|file|setup|exit):?(?P<arg>.*?)-->\s*$", re.S)


@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    marks: dict[str, str]


def _marks(before: str) -> dict[str, str]:
    """The ``<!-- kind: arg -->`` comments right above a block (blank lines between allowed)."""
    marks: dict[str, str] = {}
    text = before.rstrip()
    while text.endswith("-->"):
        start = text.rfind("<!--")
        m = _MARK.match(text[start:])
        if not m:
            break
        marks[m["kind"]] = m["arg"].strip("\n") if m["kind"] == "setup" else m["arg"].strip()
        text = text[:start].rstrip()
    return marks


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    out = []
    for m in _FENCE.finditer(text):
        body = "\n".join(line[len(m["indent"]):] for line in m["body"].splitlines())
        out.append(Block(path.relative_to(ROOT).as_posix(), text[:m.start()].count("\n") + 1,
                         m["lang"], body, _marks(text[:m.start()])))
    return out


ALL = [b for p in PAGES for b in blocks(p)]


def test_blocks_are_found_and_marks_are_well_formed() -> None:
    python = [b for b in ALL if b.lang == "python"]
    assert len(python) >= 35, len(python)
    for b in ALL:
        where = f"{b.page}:{b.line}"
        if "skip" in b.marks:
            assert len(b.marks["skip"]) >= 10, f"{where}: a skip needs its reason"
        if "raises" in b.marks:
            assert re.fullmatch(r"\w+", b.marks["raises"]), f"{where}: raises names one exception"
        if b.lang == "python":
            assert "exit" not in b.marks, f"{where}: exit applies to shell blocks"
        else:
            assert set(b.marks) <= {"skip", "exit"}, f"{where}: shell blocks take skip and exit"
            assert not b.marks or _commands(b.code), f"{where}: a mark on a block without commands"
        if "exit" in b.marks:
            assert re.fullmatch(r"\d+( without a CUDA GPU)?", b.marks["exit"]), f"{where}: {b.marks}"
    skipped = [b for b in python if "skip" in b.marks]
    assert len(skipped) <= len(python) // 4, [f"{b.page}:{b.line}" for b in skipped]
    # the command lines run too: few are left out, each with its reason
    lines = [(b, c) for b in ALL if b.lang != "python" for c in _commands(b.code)]
    left_out = [f"{b.page}:{b.line}: {c}" for b, c in lines if "skip" in b.marks]
    assert len(left_out) <= len(lines) // 20, left_out


@contextlib.contextmanager
def _in(folder: Path):
    old = os.getcwd()
    os.chdir(folder)
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        os.chdir(old)
        sys.path.remove(str(folder))


@pytest.mark.slow
@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in PAGES])
def test_python_blocks_run(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPLBACKEND", "Agg")
    todo = [b for b in ALL if b.page == page and b.lang == "python"]
    if not todo:
        assert not [b for b in ALL if b.page == page and b.lang in ("py", "python3", "pycon")]
        return
    ns: dict[str, object] = {"__name__": "__main__"}
    before = {t.ident for t in threading.enumerate()}
    with _in(tmp_path):
        for b in todo:
            where = f"{page}:{b.line}"
            if "skip" in b.marks:
                continue
            if "setup" in b.marks:
                setup = textwrap.dedent(b.marks["setup"]).strip()  # one line or several
                exec(compile(setup, f"{where} (setup)", "exec"), ns)  # noqa: S102
            if "file" in b.marks:
                Path(b.marks["file"]).write_text(b.code)
            code = compile(b.code, where, "exec")
            if "raises" in b.marks:
                with pytest.raises(BaseException) as info:  # noqa: B017 - the name is checked below
                    exec(code, ns)  # noqa: S102
                assert type(info.value).__name__ == b.marks["raises"] or any(
                    k.__name__ == b.marks["raises"] for k in type(info.value).__mro__), (where, info.value)
            else:
                exec(code, ns)  # noqa: S102
    # an example closes what it starts (later test files count torchmem's poller threads)
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("torchmem")]
    assert not left, f"{page} leaves threads running: {left}"


def _commands(code: str) -> list[str]:
    """The ``torchmem ...`` command lines of a shell block (continuations joined)."""
    out = []
    lines = [line.strip() for line in code.replace("\\\n", " ").splitlines()]
    if any(line.startswith("$ ") for line in lines):  # a session: the rest is output
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    for line in lines:
        for part in re.split(r"\s+(?:;|&&|\||>)\s+|;\s+", line):
            if part.startswith("torchmem "):
                out.append(part)
    return out


def _parse(command: str) -> None:
    words = shlex.split(command, comments=True)
    words = [w for w in words if not w.startswith(">")][1:]
    if words and words[0] in SUBCOMMANDS:
        parser = subcommand_parser(words[0])
        try:
            parser.parse_args(words[1:])
        except SystemExit as e:
            raise AssertionError(f"`{command}` is refused by its parser (exit {e.code})") from None
    else:
        assert not words or words[0].startswith("-"), f"`{command}`: no subcommand {words[0]!r}"


def test_every_documented_command_line_parses(capsys: pytest.CaptureFixture[str]) -> None:
    commands = [(f"{b.page}:{b.line}", c) for b in ALL if b.lang != "python" for c in _commands(b.code)]
    assert len(commands) >= 60, len(commands)
    with pytest.raises(AssertionError, match="refused by its parser"):  # the check can fail
        _parse("torchmem stats mem.pickle --no-such-option")
    failures = []
    for where, command in commands:
        try:
            _parse(command)
        except (AssertionError, argparse.ArgumentError, ValueError) as e:
            failures.append(f"{where}: {e}")
    capsys.readouterr()
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------------
# The command lines run: every ``torchmem ...`` line of a shell block, page by page in one
# folder (a later line reads what an earlier one wrote), as ``python -m torchmem``.

COMMAND_FILES = ROOT / "tests" / "docs_commands"  # train.py, mypkg, infer.py...: its README.md
DATA = ROOT / "tests" / "data"
# The snapshot files the guides name, and the real snapshot (tests/data) each one is.
SNAPSHOTS = {
    "mem.pickle": "MAGMA27_a2__memory_snapshot.pickle",
    "memory.pickle": "DeComFL__memory.pickle",  # a complete trace: whatif, trace and replay need one
    "before.pickle": "SketchKV2__my_snapshot.pickle",
    "after.pickle": "MAGMA27_a2__memory_snapshot.pickle",
    "oom.pickle": "LLM-inference__oom_snapshot_41810ba.pickle",
    "DeComFL__memory.pickle": "DeComFL__memory.pickle",
}
# Words of a command line that stand for something of the reader's, and what they become here.
WORDS = {
    "NAME.rank*": "job.rank*",  # many-ranks.md: the `-o job` run of its first block
    "--pid 4242": "--pid {pid}",  # a process that exists: this one
}


class WarmTorchmem:
    """``python -m torchmem ARGS`` in a fresh process per command, forked from one that has
    imported torch already (tests/_warm_torchmem.py: the import is most of a short command)."""

    def __init__(self) -> None:
        from _warm_torchmem import WarmClient

        self.client = WarmClient(_env(), ROOT)

    def run(self, argv: list[str], cwd: Path) -> tuple[int, str, str]:
        out, err = cwd / ".torchmem-stdout", cwd / ".torchmem-stderr"
        code = self.client.run({"argv": argv, "cwd": str(cwd), "stdout": str(out),
                                "stderr": str(err)})
        assert code is not None
        return code, out.read_text(), err.read_text()

    def close(self) -> None:
        self.client.close()


@pytest.fixture(scope="module")
def torchmem_cli() -> Iterator[WarmTorchmem]:
    warm = WarmTorchmem()
    yield warm
    warm.close()


@pytest.fixture(scope="module")
def command_folder(tmp_path_factory: pytest.TempPathFactory, torchmem_cli: WarmTorchmem) -> Path:
    """The files every page's command lines start from (copied per page)."""
    import pickle

    from test_oom_explain import _decomfl_oom

    base = tmp_path_factory.mktemp("commands")
    shutil.copytree(COMMAND_FILES, base, dirs_exist_ok=True, ignore=shutil.ignore_patterns("README.md"))
    for name, real in SNAPSHOTS.items():
        shutil.copyfile(DATA / real, base / name)
    from _sparse_checkpoint import llama_config, llama_tensors, write_sparse_checkpoint

    tiny = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=256)
    # README: `finetune.py ./Llama-2-7b-hf`, a downloaded checkpoint (here tiny, weights as holes)
    write_sparse_checkpoint(base / "Llama-2-7b-hf", llama_config(**tiny), llama_tensors(**tiny))
    (base / "tests").mkdir()
    (base / "tests" / "data").symlink_to(DATA)
    with open(base / "decomfl_oom.pickle", "wb") as f:  # oom.md: DeComFL's trace ended by an OOM
        pickle.dump(_decomfl_oom(800 << 20, 700 << 20)[0], f)
    code, _, err = torchmem_cli.run(["run", "--example", "-o", "run.tmtrace", "--quiet"], base)
    assert code == 0, err
    code, _, err = torchmem_cli.run(["stats", "no-such.pickle"], base)  # a failure is seen
    assert code == 2 and "no-such.pickle" in err, (code, err)
    shutil.copyfile(base / "run.tmtrace", base / "small.tmtrace")
    (base / ".torchmem-stdout").unlink()
    (base / ".torchmem-stderr").unlink()
    return base


def _env() -> dict[str, str]:
    src = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": src, "MPLBACKEND": "Agg"}


def _argv(command: str, cwd: Path) -> list[str]:
    """The words after ``torchmem``, as a shell gives them: the reader's words replaced
    (WORDS), comments dropped, ``*`` patterns expanded in ``cwd``."""
    for word, real in WORDS.items():
        command = command.replace(word, real.format(pid=os.getpid()))
    words = shlex.split(command, comments=True)
    assert words[0] == "torchmem", command
    out = []
    for w in words[1:]:
        out += sorted(p.name for p in cwd.glob(w)) or [w] if "*" in w else [w]
    return out


def _expected_exit(b: Block) -> int:
    mark = b.marks.get("exit", "0")
    if mark.endswith("without a CUDA GPU"):
        import torch

        return 0 if torch.cuda.is_available() else int(mark.split()[0])
    return int(mark)


@pytest.mark.slow
@pytest.mark.parametrize("page", sorted({b.page for b in ALL if b.lang != "python" and _commands(b.code)}))
def test_command_lines_run(page: str, command_folder: Path, torchmem_cli: WarmTorchmem,
                           tmp_path: Path) -> None:
    import time

    shutil.copytree(command_folder, tmp_path, dirs_exist_ok=True, symlinks=True)
    failures = []
    for b in [b for b in ALL if b.page == page]:
        if b.lang == "python":
            if "file" in b.marks:  # written where the page's python runs; its commands use it too
                (tmp_path / b.marks["file"]).write_text(b.code)
            continue
        if "skip" in b.marks:
            continue
        for command in _commands(b.code):
            t0 = time.perf_counter()
            code, out, err = torchmem_cli.run(_argv(command, tmp_path), tmp_path)
            print(f"{page}:{b.line} {time.perf_counter() - t0:5.1f}s exit {code}: {command}")
            if code != _expected_exit(b):
                failures.append(f"{page}:{b.line}: `{command}` exited {code}, not "
                                f"{_expected_exit(b)}:\n{out[-1500:]}\n{err[-1500:]}")
    assert not failures, "\n\n".join(failures)
