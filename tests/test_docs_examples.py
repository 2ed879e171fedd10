"""Every example of the README and the guides runs (issue 27: docs that cannot rot).

Each page's ```python blocks run in order in one namespace (later blocks build on earlier ones),
in a fresh working folder. Shell blocks are not run, but every ``torchmem ...`` command line in
them is parsed by that subcommand's own parser, so an option that no longer exists fails here.

What a page may say to this test, in an HTML comment right before a block (invisible on the
site; docs/contributing.md documents them):

- ``<!-- skip: REASON -->``: the block is not run; the reason is required (a CUDA GPU, a
  fragment with ``...`` for your own arguments).
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
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from torchmem.cli import SUBCOMMANDS, subcommand_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                    re.M | re.S)
_MARK = re.compile(r"<!--\s*(?P<kind>skip|raises|file|setup):?(?P<arg>.*?)-->\s*$", re.S)


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
        assert b.lang == "python" or not b.marks, f"{where}: marks apply to python blocks"
    skipped = [b for b in python if "skip" in b.marks]
    assert len(skipped) <= len(python) // 4, [f"{b.page}:{b.line}" for b in skipped]


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
                exec(compile(b.marks["setup"], f"{where} (setup)", "exec"), ns)  # noqa: S102
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
