"""`torchmem merge` and `merge_files`: rank trace files in, the merged view out; bad sets of
files give clear errors, a missing rank is reported as missing, a killed rank as cut short."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_merge import _hand_rank, random_rank
from torchmem.analysis.summary import summarize_trace
from torchmem.cli import main
from torchmem.cli.merge import merge_files
from torchmem.errors import InvalidInputError, MissingFileError, TraceFormatError
from torchmem.io.tmtrace import TraceStreamer, load_trace, save_trace
from torchmem.model.events import EventKind as K
from torchmem.model.trace import Trace


def _write(d: Path, ranks: list[int], world: int, job: str = "job", n: int = 400) -> list[Path]:
    paths = []
    for r in ranks:
        p = d / f"{job}.rank{r}.tmtrace"
        save_trace(random_rank(r, world, n, seed=r, job=job), p)
        paths.append(p)
    return paths


def test_merge_files_equal_summaries_of_each_file(tmp_path: Path) -> None:
    paths = _write(tmp_path, [0, 1, 2, 3], 4)
    out = tmp_path / "merged.json"
    m = merge_files([str(tmp_path / "job.rank*.tmtrace")], out)
    assert [r.name for r in m.ranks] == [str(p) for p in paths]
    for p, r in zip(paths, m.ranks):
        s = summarize_trace(load_trace(p), top=10**6)  # each file alone, another way
        assert (r.peak, r.final_live, r.iterations) == (s.peak[s.device], s.final_live[s.device],
                                                        s.iterations)
    d = json.loads(out.read_text())
    assert d["complete"] and d["world_size"] == 4
    assert [r["peak"] for r in d["ranks"]] == [r.peak for r in m.ranks]
    peaks = {r.rank: r.peak for r in m.ranks}
    assert d["heaviest"] == max(peaks, key=peaks.__getitem__)
    assert d["imbalance"] == pytest.approx(max(peaks.values()) / min(peaks.values()))


def test_cli_prints_the_view_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for r in (0, 1):
        save_trace(_hand_rank(r), tmp_path / f"hand.rank{r}.tmtrace")
    out = tmp_path / "m.json"
    code = main(["merge", str(tmp_path / "hand.rank0.tmtrace"), str(tmp_path / "hand.rank1.tmtrace"),
                 "-o", str(out)])
    cap = capsys.readouterr()
    assert code == 0
    assert "Job hand: 2 of 2 rank(s), complete" in cap.out
    assert "Why rank 0 uses more than rank 1: +1.66 KiB" in cap.out
    assert "communication | Net.l1 | fsdp.py:10:gather" in cap.out
    assert "reading" in cap.err and "wrote" in cap.err
    assert json.loads(out.read_text())["difference"]["bytes"] == 1700
    assert main(["merge", str(tmp_path / "hand.rank*.tmtrace"), "--json", "-q"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["ranks_present"] == [0, 1] and cap.err == ""


def test_missing_rank_is_reported_not_complete(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, [0, 1, 3], 4)
    out = tmp_path / "m.json"
    assert main(["merge", str(tmp_path / "job.rank*.tmtrace"), "-o", str(out), "-q"]) == 0
    cap = capsys.readouterr()
    assert "MISSING rank(s) 2 of world size 4" in cap.err
    assert "3 of 4 rank(s), INCOMPLETE" in cap.out and "MISSING: rank 2" in cap.out
    d = json.loads(out.read_text())
    assert d["missing"] == [2] and d["complete"] is False


def test_cut_short_rank_is_marked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_trace(_hand_rank(0), tmp_path / "hand.rank0.tmtrace")
    tr = Trace({"rank": 1, "world_size": 2, "job_id": "hand"})
    st = TraceStreamer(tr, tmp_path / "hand.rank1.tmtrace", interval=0.1)
    st.start()
    tr.append(K.ALLOC, 0, "cpu", 4096, 1, op="aten::empty")
    st.close()  # killed here: no save_trace, the streamed file stays
    m = merge_files([tmp_path / "hand.rank0.tmtrace", tmp_path / "hand.rank1.tmtrace"])
    assert m.cut_short == [1] and not m.complete and m.ranks[1].peak == 4096
    assert main(["merge", str(tmp_path / "hand.rank*.tmtrace"), "-q"]) == 0
    cap = capsys.readouterr()
    assert "rank 1" in cap.err and "cut short" in cap.err
    assert "CUT SHORT: rank 1" in cap.out and "INCOMPLETE" in cap.out


def test_bad_sets_of_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _write(tmp_path, [0], 2, job="a")[0]
    b = _write(tmp_path, [1], 2, job="b")[0]
    with pytest.raises(InvalidInputError, match="not from the same job"):
        merge_files([a, b])
    assert main(["merge", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert "torchmem merge: error:" in err and "job_id 'b'" in err and "Traceback" not in err
    c = _write(tmp_path, [1], 4, job="a")[0]  # same job id, another world size
    with pytest.raises(InvalidInputError, match="world_size 4"):
        merge_files([a, c])
    plain = tmp_path / "plain.tmtrace"
    save_trace(Trace(), plain)
    assert main(["merge", str(plain)]) == 2
    assert "expected an integer 'rank'" in capsys.readouterr().err
    copy = tmp_path / "copy.tmtrace"
    copy.write_bytes(a.read_bytes())
    with pytest.raises(InvalidInputError, match="rank 0 is given twice"):
        merge_files([a, copy])
    with pytest.raises(MissingFileError):
        merge_files([tmp_path / "nope.rank0.tmtrace"])
    junk = tmp_path / "junk.tmtrace"
    junk.write_text("hello")
    with pytest.raises(TraceFormatError, match="junk.tmtrace"):
        merge_files([junk])
    with pytest.raises(InvalidInputError, match="no rank trace matches"):
        merge_files([str(tmp_path / "none*.tmtrace")])
    assert main(["merge", str(a), "--top", "0"]) == 2
    assert "--top must be at least 1" in capsys.readouterr().err


def test_jobs_give_the_same_merge(tmp_path: Path) -> None:
    _write(tmp_path, [0, 1, 2, 3, 5], 6, n=600)
    one = merge_files([str(tmp_path / "job.rank*.tmtrace")], top=5)
    two = merge_files([str(tmp_path / "job.rank*.tmtrace")], top=5, jobs=2)
    assert one.to_dict() == two.to_dict() and two.missing == [4]
    with pytest.raises(InvalidInputError, match="jobs must be"):
        merge_files([str(tmp_path / "job.rank0.tmtrace")], jobs=0)


def test_summary_of_several_rank_traces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for r in (0, 1):
        save_trace(_hand_rank(r), tmp_path / f"hand.rank{r}.tmtrace")
    a, b = str(tmp_path / "hand.rank0.tmtrace"), str(tmp_path / "hand.rank1.tmtrace")
    assert main(["summary", a, b]) == 0
    out = capsys.readouterr().out
    assert "Job hand: 2 of 2 rank(s), complete" in out and "imbalance 1.29x" in out
    assert main(["summary", a, b, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["difference"]["bytes"] == 1700 and d["ranks_present"] == [0, 1]
    assert main(["summary", a, b, "--device", "cpu"]) == 2
    assert "--device picks the device of one trace" in capsys.readouterr().err
    assert main(["summary", a]) == 0  # one trace: the summary of that trace, as before
    assert "Peak 7.39 KiB on cpu" in capsys.readouterr().out
    save_trace(random_rank(1, 3, 100, 0, job="hand"), tmp_path / "other.tmtrace")
    assert main(["summary", a, str(tmp_path / "other.tmtrace")]) == 2
    assert "not from the same job" in capsys.readouterr().err
