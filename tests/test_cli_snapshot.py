"""CLI subcommands over snapshots: stats, peak, diff, trace, flame (text and --json)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import snapshot_synth as synth
from torchmem.cli import main
from torchmem.units import format_bytes

DATA = Path(__file__).resolve().parent / "data"
DECOMFL = str(DATA / "DeComFL__memory.pickle")
MiB = 1024**2


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _raw(name: str):
    with open(DATA / name, "rb") as f:
        return pickle.load(f)


def test_stats_json_has_required_keys_and_true_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "stats", DECOMFL, "--json")
    assert code == 0
    d = json.loads(out)
    dev = d["devices"][0]
    raw = _raw("DeComFL__memory.pickle")
    blocks = [b for s in raw["segments"] for b in s["blocks"]]
    assert dev["device"] == 0
    assert dev["reserved_bytes"] == sum(s["total_size"] for s in raw["segments"])
    assert dev["allocated_bytes"] == sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    assert dev["active_bytes"] == sum(b["size"] for b in blocks if b["state"] != "inactive")
    assert dev["segments"] == 61 and dev["blocks"] == len(blocks)
    assert dev["trace_actions"]["alloc"] == 7946 and dev["trace_actions"]["segment_alloc"] == 61
    assert d["allocator_settings"]["max_split_size"] == -1
    assert d["oom"] == []


def test_stats_text_and_oom_report(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    p = tmp_path / "oom.pickle"
    p.write_bytes(pickle.dumps(synth.oom(fragmented=True), protocol=4))
    code, out, _ = _run(capsys, "stats", str(p))
    assert code == 0
    assert "reserved" in out and "40.00 MiB" in out
    assert "OOM on cuda:0" in out and "fragmentation" in out
    code, out, _ = _run(capsys, "stats", str(p), "--json")
    o = json.loads(out)["oom"][0]
    assert (o["requested_bytes"], o["device_free_bytes"], o["verdict"]) == (20 * MiB, 5 * MiB, "fragmentation")


def test_peak_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "peak", DECOMFL, "--json", "--top", "3", "--depth", "2")
    assert code == 0
    d = json.loads(out)["devices"][0]
    # complete trace from empty: the running maximum of a plain forward replay
    cur = best = 0
    for e in _raw("DeComFL__memory.pickle")["device_traces"][0]:
        cur += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        best = max(best, cur)
    assert d["peak_allocated_bytes"] == best
    assert len(d["at_peak"]) == 3 and all(len(g["stack"]) <= 2 for g in d["at_peak"])
    code, out, _ = _run(capsys, "peak", DECOMFL)
    assert "peak allocated" in out and "live at the peak" in out


def test_diff_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    a = str(DATA / "LLM-inference__1.3b_snapshot_6a8eab0.pickle")
    b = str(DATA / "LLM-inference__oom_snapshot_41810ba.pickle")
    code, out, _ = _run(capsys, "diff", a, b, "--json", "--top", "0", "--at", "end")
    assert code == 0
    d = json.loads(out)
    assert d["kind"] == "snapshot" and d["at"] == "end"
    ra, rb = _raw(Path(a).name), _raw(Path(b).name)

    def alloc(raw):
        return sum(x["size"] for s in raw["segments"] for x in s["blocks"] if x["state"] == "active_allocated")

    assert sum(r["delta_bytes"] for r in d["rows"]) == alloc(rb) - alloc(ra)
    code, out, _ = _run(capsys, "diff", a, b, "--at", "end")
    assert out.startswith("device 0: reserved")
    assert f"allocated {format_bytes(alloc(ra))} -> {format_bytes(alloc(rb))} (+" in out


def test_trace_head_tail_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "trace", DECOMFL, "--tail", "3")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 4 and lines[0].lstrip().startswith("23102")
    assert lines[-1] == ("device 0: after entry #23104 (the last of 23105): allocated 964.63 MiB, "
                         "reserved 1.77 GiB")
    code, out, _ = _run(capsys, "trace", DECOMFL, "--head", "2", "--jsonl")
    rows = [json.loads(ln) for ln in out.splitlines()]
    assert rows[-1]["summary"]["0"]["entries"] == 23105
    raw = _raw("DeComFL__memory.pickle")["device_traces"][0]
    assert [r["action"] for r in rows[:2]] == [raw[0]["action"], raw[1]["action"]]
    assert rows[1]["allocated_bytes"] == raw[1]["size"]  # trace starts from empty
    assert rows[1]["reserved_bytes"] == raw[0]["size"]


def test_flame_file_and_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_file = tmp_path / "m.folded"
    code, _, err = _run(capsys, "flame", DECOMFL, "-o", str(out_file))
    assert code == 0 and "folded stacks" in err
    lines = out_file.read_text().splitlines()
    raw = _raw("DeComFL__memory.pickle")
    assert sum(int(ln.rsplit(" ", 1)[1]) for ln in lines) == sum(
        b["size"] for s in raw["segments"] for b in s["blocks"] if b["state"] != "inactive")
    code, out, _ = _run(capsys, "flame", DECOMFL, "--json", "--at", "peak")
    d = json.loads(out)
    assert d["at"] == "peak" and all(r["stack"][0] == "cuda:0" for r in d["stacks"])


def test_errors_exit_2_without_traceback(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = _run(capsys, "stats", str(tmp_path / "nope.pickle"))
    assert code == 2 and "no such file" in err and "Traceback" not in err
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(b"cos\nsystem\n(S'true'\ntR.")
    code, out, err = _run(capsys, "peak", str(evil))
    assert code == 2 and "refused to load" in err and "os.system" in err


def test_device_without_data_is_an_error_not_zeros(capsys: pytest.CaptureFixture[str]) -> None:
    # Regression: --device 5 on a one-device snapshot printed "peak allocated 0 B" (and an empty
    # flame graph / trace) as if the device had been idle.
    for cmd in ("peak", "flame", "trace"):
        code, out, err = _run(capsys, cmd, DECOMFL, "--device", "5")
        assert code == 2 and out == "" and "Traceback" not in err, cmd
        assert "device 5 has no segments or trace entries" in err and "expected one of: 0" in err
    # the device that exists still gives the brute-force peak of a forward replay
    cur = best = 0
    for e in _raw("DeComFL__memory.pickle")["device_traces"][0]:
        cur += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        best = max(best, cur)
    code, out, _ = _run(capsys, "peak", DECOMFL, "--device", "0", "--json")
    assert code == 0 and json.loads(out)["devices"][0]["peak_allocated_bytes"] == best
    code, out, _ = _run(capsys, "flame", DECOMFL, "--device", "0", "--at", "peak")
    assert code == 0 and sum(int(ln.rsplit(" ", 1)[1]) for ln in out.splitlines()) == best


def test_flame_unwritable_output_is_a_user_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Regression: an unwritable -o ended as "internal error ... a bug in torchmem" (exit 1).
    target = tmp_path / "no_such_dir" / "m.folded"
    code, out, err = _run(capsys, "flame", DECOMFL, "-o", str(target))
    assert code == 2 and "could not write the folded stacks" in err and "internal error" not in err
    assert not target.exists()


def test_negative_counts_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    # Regression: "peak --top -1" silently dropped the last stack group (a [:-1] slice) and
    # "trace --head -2" / "--tail -1" ended as "internal error ... a bug in torchmem".
    for argv in (("peak", DECOMFL, "--top", "-1"), ("trace", DECOMFL, "--head", "-2"),
                 ("trace", DECOMFL, "--tail", "-1"), ("diff", DECOMFL, DECOMFL, "--depth", "-1")):
        code, out, err = _run(capsys, *argv)
        assert code == 2 and out == "" and "expected a count >= 0" in err, argv
        assert "internal error" not in err and "Traceback" not in err
    # --top 0 still means all groups: as many as distinct stacks live at the end
    code, out, _ = _run(capsys, "peak", DECOMFL, "--json", "--top", "0", "--depth", "0")
    groups = json.loads(out)["devices"][0]["at_end"]
    code1, out1, _ = _run(capsys, "peak", DECOMFL, "--json", "--top", "1", "--depth", "0")
    assert code == code1 == 0 and len(json.loads(out1)["devices"][0]["at_end"]) == 1
    raw = _raw("DeComFL__memory.pickle")
    assert sum(g["bytes"] for g in groups) == sum(
        b["requested_size"] for s in raw["segments"] for b in s["blocks"] if b["state"] != "inactive")


def test_snapshot_subcommands_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from torchmem.cli import main\n"
        f"for cmd in (['stats', {DECOMFL!r}, '--json'], ['peak', {DECOMFL!r}, '--json'],\n"
        f"            ['trace', {DECOMFL!r}, '--head', '1'], ['flame', {DECOMFL!r}],\n"
        f"            ['diff', {DECOMFL!r}, {DECOMFL!r}]):\n"
        "    assert main(cmd) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_stats_of_a_cpu_snapshot_names_the_device_and_says_what_it_is(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import torch

    import torchmem

    p = tmp_path / "cpu.pickle"
    with torchmem.record_history(device="cpu"):
        a = torch.empty(1000)
        b = torch.empty(10, dtype=torch.int8)
        torchmem.write_snapshot(p, torchmem.snapshot())
    code, out, _ = _run(capsys, "stats", str(p), "--json")
    d = json.loads(out)
    dev = d["devices"][0]
    assert dev["name"] == "cpu"
    assert dev["reserved_bytes"] == dev["allocated_bytes"] == a.untyped_storage().nbytes() + b.untyped_storage().nbytes()
    assert dev["segments"] == 2 and dev["free_bytes"] == 0
    assert any("no caching allocator" in n for n in d["notes"])


def test_one_numbering_peak_trace_and_summary_name_the_same_entry(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Regression: one peak was "after trace entry 11206" in `peak` (peak_index 11206), #11205 in
    # `trace` and the viewer, and "event 763" in the tracker summary.
    import torch

    import torchmem

    run = tmp_path / "run.tmtrace"
    net = torch.nn.Linear(64, 64)
    with torchmem.track(net) as tr:
        for _ in range(2):
            net(torch.randn(8, 64)).sum().backward()
    tr.save(run)
    for path in (DECOMFL, str(run)):
        code, out, _ = _run(capsys, "peak", path, "--json")
        dev = json.loads(out)["devices"][0]
        k, peak = dev["peak_index"], dev["peak_allocated_bytes"]
        code, out, _ = _run(capsys, "trace", path, "--jsonl")
        rows = [json.loads(ln) for ln in out.splitlines()[:-1]]
        first = next(r for r in rows if r["allocated_bytes"] == peak)  # ground truth: the log
        assert max(r["allocated_bytes"] for r in rows) == peak
        assert first["index"] == k == rows.index(first)
        code, out, _ = _run(capsys, "peak", path)
        assert f"at trace entry #{k} " in out.splitlines()[0]
        code, out, _ = _run(capsys, "trace", path, "--head", str(k + 1))
        assert out.splitlines()[k].split()[0] == str(k) and f"alloc {format_bytes(peak)}" in out.splitlines()[k]
    code, out, _ = _run(capsys, "summary", str(run), "--json")
    s = json.loads(out)
    assert s["peak_index"] == k and s["peak"]["cpu"] == peak
    code, out, _ = _run(capsys, "summary", str(run))
    assert f"at trace entry #{k} " in out.splitlines()[0]


def test_trace_json_is_one_document_and_tail_zero_prints_no_rows(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, _ = _run(capsys, "trace", DECOMFL, "--json", "--tail", "2")
    doc = json.loads(out)  # one document, not JSON lines
    raw = _raw("DeComFL__memory.pickle")["device_traces"][0]
    assert [r["index"] for r in doc["entries"]] == [len(raw) - 2, len(raw) - 1]
    assert [r["action"] for r in doc["entries"]] == [raw[-2]["action"], raw[-1]["action"]]
    assert doc["devices"]["0"]["entries"] == len(raw) and doc["file"] == DECOMFL
    code, out, _ = _run(capsys, "trace", DECOMFL, "--tail", "0")
    assert code == 0 and out.splitlines() == [
        "device 0: after entry #23104 (the last of 23105): allocated 964.63 MiB, reserved 1.77 GiB"]
    code, out, _ = _run(capsys, "trace", DECOMFL, "--head", "0", "--jsonl")
    assert len(out.splitlines()) == 1 and "summary" in json.loads(out)
    code, out, err = _run(capsys, "trace", DECOMFL, "--json", "--jsonl")
    assert code == 2 and "pass one of them" in err


def test_trace_of_a_snapshot_without_a_trace_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    raw = _raw("DeComFL__memory.pickle")
    raw["device_traces"] = [[]]
    p = tmp_path / "no_trace.pickle"
    p.write_bytes(pickle.dumps(raw, protocol=4))
    for extra in ((), ("--json",), ("--jsonl",)):
        code, out, err = _run(capsys, "trace", str(p), *extra)
        assert code == 2 and "has no trace entries" in err and "_record_memory_history" in err
        if extra == ("--json",):  # stdout stays a JSON document: the error, as on stderr
            doc = json.loads(out)
            assert doc["exit_code"] == 2 and doc["type"] == "InvalidInputError"
            assert f"torchmem trace: error: {doc['error']}" in err
        else:
            assert out == ""
