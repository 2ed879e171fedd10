"""``torchmem estimate train.py ARGS`` / :func:`torchmem.estimate_script`: an unmodified script
under the estimate, checked against the same training step written as a build function."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
import torch

import torchmem
from torchmem.cli import main
from torchmem.errors import InvalidInputError
from torchmem.fit.run._engine import run_once
from torchmem.fit.targets._script import ScriptError, estimate_script

WIDTH = 256

TRAIN = textwrap.dedent("""
    import argparse, sys
    import torch

    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=1000)
    a = p.parse_args()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear({w}, 4 * {w}), torch.nn.GELU(),
                              torch.nn.Linear(4 * {w}, {w})).cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x = torch.randn(a.batch_size, {w}, device="cuda")
    SEEN = []
    try:
        for i in range(a.steps):
            opt.zero_grad()
            loss = net(x).square().mean()
            loss.backward()
            opt.step()
            SEEN.append(i)
            print(f"step {{i}} loss {{loss.item():.3f}}")
    except Exception:      # the estimate's stop is not an Exception: it is not swallowed here
        print("swallowed", file=sys.stderr)
        raise SystemExit(5)
""").format(w=WIDTH)


def build(batch_size: int):
    """The script's training step as a build function (the ground truth)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                              torch.nn.Linear(4 * WIDTH, WIDTH)).cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x = torch.randn(batch_size, WIDTH, device="cuda")

    def step():
        opt.zero_grad()
        loss = net(x).square().mean()
        loss.backward()
        opt.step()
        print(f"loss {loss.item():.3f}")
    return step


@pytest.fixture()
def train(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    return str(path)


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.mark.parametrize("gpu,batch", [("T4", 64), ("H100-80GB", 512)])
def test_script_equals_the_build_function(train, gpu, batch):
    """The script, stopped after 2 optimizer steps, gives exactly the peaks of the same step
    run twice as a build function."""
    want = run_once(build, batch, gpu, steps=2)
    got = estimate_script(train, ["--batch-size", str(batch)], gpu, steps=2)
    assert got.script.steps_run == 2 and got.script.stopped == "steps"
    assert (got.peak_requested_bytes, got.peak_allocated_bytes, got.peak_reserved_bytes) == (
        want.peak_requested_bytes, want.peak_allocated_bytes, want.peak_reserved_bytes)
    assert got.peak_allocated_bytes > 0 and got.fits == want.fits
    assert got.by_category["optimizer_state"] == want.by_category["optimizer_state"]
    # the loss read after the first step is answered and listed at the script's line (the
    # second step stops the script inside opt.step(), before its print)
    assert [(a["where"], a["value"], a["count"]) for a in got.assumed_values] == [
        (f"{train}:22", 1.0, 1)]


def test_steps_stop_the_script_and_the_environment_is_restored(train, capsys):
    argv, path0 = sys.argv[:], sys.path[:]
    e = estimate_script(train, ["--batch-size", "4"], "T4", steps=3)
    out = capsys.readouterr()
    assert e.script.steps_run == 3 and e.script.stopped == "steps"
    assert out.out.count("loss 1.000") == 2  # the third step stops inside opt.step()
    assert "swallowed" not in out.err
    assert sys.argv == argv and sys.path == path0
    assert e.to_dict()["script"]["steps_run"] == 3 and e.steps == 3


def test_script_runs_as_python_would(tmp_path, capsys):
    path = _write(tmp_path, "who.py", """
        import os, sys, torch
        print("NAME", __name__, "ARGV", sys.argv, "PATH0", sys.path[0] == os.path.dirname(__file__))
        torch.ones(256, device="cuda")
    """)
    e = estimate_script(path, ["a", "--b"], "T4")
    out = capsys.readouterr().out
    assert f"NAME __main__ ARGV ['{path}', 'a', '--b'] PATH0 True" in out
    assert e.script.stopped == "end" and e.script.steps_run == 0
    assert e.peak_requested_bytes == 1024


def test_a_module_runs_like_python_m(tmp_path, monkeypatch, capsys):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(TRAIN)
    monkeypatch.chdir(tmp_path)
    code = main(["estimate", "--gpu", "T4", "--json", "-m", "mypkg.train", "--batch-size", "16"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0
    assert d["script"]["module"] and d["script"]["target"] == "mypkg.train"
    assert d["script"]["args"] == ["--batch-size", "16"] and d["script"]["steps_run"] == 2
    want = run_once(build, 16, "T4")
    assert d["peak_reserved_bytes"] == want.peak_reserved_bytes


def test_skipped_saves_are_listed_and_nothing_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, "ckpt.py", """
        import torch
        from torch import save as torch_save
        net = torch.nn.Linear(64, 64).cuda()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for i in range(5):
            net(torch.randn(8, 64, device="cuda")).sum().backward()
            torch.save({"model": net.state_dict(), "step": i}, f"ckpt-{i}.pt")
            opt.step()
        torch_save(net, "never.pt")
    """)
    code = main(["estimate", "--gpu", "T4", "--steps", "2", "--json", path])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["script"]["stopped"] == "steps"
    assert d["script"]["skipped_writes"] == [
        {"where": f"{path}:8", "what": "torch.save(dict of 2 tensors, 16.25 KiB)",
         "path": str(tmp_path / f"ckpt-{i}.pt")} for i in range(2)]
    assert os.listdir(tmp_path) == ["ckpt.py"]
    assert torch.save.__module__ == "torch.serialization"  # restored
    main(["estimate", "--gpu", "T4", "--steps", "2", path])
    out = capsys.readouterr().out
    assert "skipped writes" in out and f"{path}:8  torch.save(dict of 2 tensors" in out


def test_skipped_safetensors_and_an_alias_imported_before(tmp_path, monkeypatch):
    st = pytest.importorskip("safetensors.torch")
    monkeypatch.chdir(tmp_path)
    mod = type(sys)("_torchmem_alias_test")
    mod.safe_save_file = st.save_file  # a library that did `from safetensors.torch import ...`
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    path = _write(tmp_path, "st.py", """
        import torch, _torchmem_alias_test as lib
        from safetensors.torch import save_file
        w = {"w": torch.zeros(1024, device="cuda")}
        save_file(w, "a.safetensors")
        lib.safe_save_file(w, "b.safetensors")
    """)
    e = estimate_script(path, [], "T4")
    assert [(w.what, w.path) for w in e.script.skipped_writes] == [
        ("safetensors.torch.save_file(dict of 1 tensor, 4.00 KiB)", str(tmp_path / "a.safetensors")),
        ("safetensors.torch.save_file(dict of 1 tensor, 4.00 KiB)", str(tmp_path / "b.safetensors"))]
    assert os.listdir(tmp_path) == ["st.py"]
    assert mod.safe_save_file is st.save_file


def test_other_writes_go_to_a_scratch_folder_and_real_files_stay(tmp_path, monkeypatch, capsys):
    """Files and folders the script writes (open, pathlib, json, numpy, logging, makedirs) go to
    a scratch folder: the script reads its own writes back, the disk is unchanged afterwards
    (listing and contents compared with before), deletions and renames of existing files are
    skipped, and each call is listed once per path."""
    pytest.importorskip("numpy")
    import tempfile

    # the scratch folder is made in the system's temporary folder: one of the test's own
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "systemp"))
    (tmp_path / "systemp").mkdir()
    work = tmp_path / "work"
    (work / "old").mkdir(parents=True)
    (work / "keep.txt").write_text("precious")
    (work / "old" / "checkpoint-1.bin").write_bytes(b"weights")
    (work / "log.txt").write_text("line 0\n")
    monkeypatch.chdir(work)
    path = _write(work, "writer.py", """
        import json, logging, os, pathlib, shutil
        import numpy as np, torch
        os.makedirs("runs/exp1", exist_ok=True)
        pathlib.Path("runs/exp1/config.json").write_text(json.dumps({"lr": 0.1}))
        assert json.loads(open("runs/exp1/config.json").read()) == {"lr": 0.1}   # reads back
        with open("log.txt", "a") as f:                                          # appends
            f.write("line 1\\n")
        assert open("log.txt").read() == "line 0\\nline 1\\n"
        logging.basicConfig(filename="runs/train.log", level=logging.INFO, force=True)
        np.save("runs/array.npy", np.zeros(4))
        os.remove("keep.txt")
        shutil.rmtree("old")
        os.replace("runs/exp1/config.json", "runs/config.json")                  # a scratch copy
        assert json.load(open("runs/config.json")) == {"lr": 0.1}                 # moved copy
        import tempfile
        open("runs/tmp.txt", "w").write("x")
        os.replace("runs/tmp.txt", os.path.join(tempfile.gettempdir(), "moved.txt"))
        net = torch.nn.Linear(64, 64).cuda()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for i in range(3):
            loss = net(torch.randn(8, 64, device="cuda")).sum()
            loss.backward()
            logging.info("step %d loss %.3f", i, loss.item())
            opt.step()
    """)
    before = sorted(str(p.relative_to(work)) for p in work.rglob("*"))
    assert main(["estimate", "--gpu", "T4", "--steps", "2", "--json", path]) == 0
    d = json.loads(capsys.readouterr().out)
    logging_root = __import__("logging").getLogger()
    for h in list(logging_root.handlers):  # the script's basicConfig handler (on the scratch copy)
        logging_root.removeHandler(h)
        h.close()
    assert d["script"]["stopped"] == "steps" and d["script"]["steps_run"] == 2
    assert sorted(str(p.relative_to(work)) for p in work.rglob("*")) == before
    assert (work / "keep.txt").read_text() == "precious"
    assert (work / "old" / "checkpoint-1.bin").read_bytes() == b"weights"
    assert (work / "log.txt").read_text() == "line 0\n"
    got = {(w["what"], os.path.relpath(w["path"], work)) for w in d["script"]["skipped_writes"]}
    assert got == {
        ("os.makedirs", "runs/exp1"), ("open(mode='w')", "runs/exp1/config.json"),
        ("open(mode='a')", "log.txt"), ("open(mode='a')", "runs/train.log"),
        ("open(mode='wb')", "runs/array.npy"), ("os.remove (not done)", "keep.txt"),
        ("shutil.rmtree (not done)", "old"), ("open(mode='w')", "runs/tmp.txt"),
    }
    # moved into the temporary folder: a path the script names there is scratch too (issue 41)
    assert not (tmp_path / "systemp" / "moved.txt").exists()
    assert len(d["script"]["skipped_writes"]) == len(got)  # once per call and path
    wheres = {w["where"] for w in d["script"]["skipped_writes"]}
    assert f"{path}:4" in wheres and f"{path}:12" in wheres
    assert not [p for p in os.listdir(tmp_path / "systemp") if p.startswith("torchmem-scratch")]
    import builtins
    import io
    import shutil
    assert builtins.open is io.open and os.makedirs.__module__ == "os"
    assert shutil.rmtree.__module__ == "shutil"


def test_max_batch_size_equals_the_build_function_search(train, capsys):
    want = torchmem.estimate(build, "1 GiB", max_batch_size=True, margin=0)
    capsys.readouterr()
    code = main(["estimate", "--gpu", "1 GiB", "--margin", "0", "--max", "batch-size",
                 "--json", train, "--steps", "1000"])
    captured = capsys.readouterr()
    d = json.loads(captured.out)
    assert code == 0
    assert d["max_batch_size"] == want.max_batch_size > 1000
    assert d["peak_reserved_bytes"] == want.peak_reserved_bytes
    assert d["params"] == {"batch-size": want.max_batch_size}
    # appended as one word (what configurator scripts accept too)
    assert d["script"]["args"] == ["--steps", "1000", f"--batch-size={want.max_batch_size}"]
    # the search starts at the script's own default (argparse default=8), not at 1 (issue 41)
    assert "torchmem estimate: batch 8: fits" in captured.err  # progress, as for build functions
    assert d["probes"][0]["batch_size"] == 8
    assert {p["batch_size"] for p in d["probes"] if p["fits"]} <= {v for v in range(1, want.max_batch_size + 1)}


def test_a_script_without_optimizer_runs_to_its_end_or_to_the_time_limit(tmp_path, capsys):
    path = _write(tmp_path, "infer.py", """
        import torch
        net = torch.nn.Linear(128, 128).cuda()
        with torch.no_grad():
            for _ in range(3):
                net(torch.randn(32, 128, device="cuda"))
    """)
    e = estimate_script(path, [], "T4")
    assert e.script.stopped == "end" and e.script.reason == "ran to its end after 0 optimizer steps"
    forever = _write(tmp_path, "forever.py", """
        import torch
        keep = torch.ones(1 << 20, device="cuda")
        while True:
            y = keep * 2
    """)
    # 3 s: the limit counts from the script's start (a loaded machine may still be setting up)
    code = main(["estimate", "--gpu", "T4", "--time-limit", "3", forever])
    out = capsys.readouterr().out
    # no optimizer step of the 2 asked for: no verdict (issue 41), exit 4
    assert code == 4, capsys.readouterr().err
    assert "stopped at the time limit (3 s) after 0 optimizer steps" in out
    assert ("T4: INCOMPLETE, no verdict (stopped at the time limit (3 s) after 0 of 2 "
            "optimizer steps; raise --time-limit); peak reserved so far") in out
    assert ": FITS" not in out and "DOES NOT FIT" not in out
    # long enough for the loop to run twice even on a loaded machine (the limit counts from the
    # script's start: under load 0.5 s could pass before its first tensor)
    e = estimate_script(forever, [], "T4", time_limit=3)
    assert e.script.stopped == "time_limit" and e.peak_requested_bytes == 3 * (4 << 20)  # keep, y, the next y
    assert "the script was stopped at the time limit (3 s)" in e.notes
    assert e.fits is False and e.incomplete is not None and e.to_dict()["incomplete"] == (
        "stopped at the time limit (3 s) after 0 of 2 optimizer steps; raise --time-limit")
    # the same loop after 2 optimizer steps is complete: a verdict
    stepped = _write(tmp_path, "stepped.py", """
        import torch
        net = torch.nn.Linear(256, 256).cuda()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        while True:
            net(torch.ones(8, 256, device="cuda")).sum().backward()
            opt.step()
    """)
    e = estimate_script(stepped, [], "T4", time_limit=300)
    assert e.script.stopped == "steps" and e.fits is True and e.incomplete is None


def _code_in(path: str, inner=None):
    """A function compiled as if written in ``path``: it returns its own frame, or calls
    ``inner`` (so that ``inner``'s frame is called from ``path``)."""
    ns: dict = {"sys": sys, "inner": inner}
    exec(compile("def f():\n    return inner() if inner else sys._getframe()\n", path, "exec"), ns)
    return ns["f"]


def test_a_stop_is_never_raised_inside_torchmem_bookkeeping():
    from torchmem.fit.targets._sandbox import _STDLIB_DIR, _TORCH_DIR, _TORCHMEM_DIR
    from torchmem.fit.targets._stop import _safe_to_stop

    tracker = os.path.join(_TORCHMEM_DIR, "capture", "tracker", "_hotpath.py")
    dispatch = os.path.join(_TORCH_DIR, "_subclasses", "fake_tensor.py")
    public = os.path.join(_TORCH_DIR, "nn", "modules", "module.py")
    stdlib = os.path.join(_STDLIB_DIR, "contextlib.py")
    assert not _safe_to_stop(_code_in(tracker)())  # in a weakref callback of the tracker
    # torch's dispatch internals and the standard library are looked through to their caller
    assert not _safe_to_stop(_code_in(tracker, _code_in(dispatch))())
    assert not _safe_to_stop(_code_in(tracker, _code_in(stdlib, _code_in(dispatch)))())
    assert _safe_to_stop(_code_in(dispatch)())  # called from this test: user code
    assert _safe_to_stop(_code_in(stdlib)())
    # torchmem further out (a wrapper that calls the user's forward) does not matter
    assert _safe_to_stop(_code_in(tracker, _code_in(public))())
    assert _safe_to_stop(_code_in(tracker, _code_in("/somewhere/train.py"))())
    assert _safe_to_stop(None)


@pytest.mark.slow
def test_time_limit_stops_always_end_as_time_limit(tmp_path):
    # a stop that landed in the tracker's weakref callback was swallowed ("Exception ignored")
    # and the script then ran forever; each of these limits must end the run as a time limit
    forever = _write(tmp_path, "forever.py", """
        import torch
        keep = torch.ones(1 << 20, device="cuda")
        while True:
            y = keep * 2
    """)
    code = textwrap.dedent(f"""
        import json
        from torchmem.fit import estimate_script
        out = []
        for i in range(16):
            e = estimate_script({forever!r}, [], "T4", time_limit=0.02 + 0.015 * i)
            out.append((e.script.stopped, e.peak_requested_bytes))
        print(json.dumps(out))
    """)
    import subprocess
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Exception ignored" not in r.stderr, r.stderr[-2000:]
    runs = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(runs) == 16
    mib4 = 4 << 20  # keep; keep and y; keep, y and the next y
    assert all(stopped == "time_limit" and peak in (mib4, 2 * mib4, 3 * mib4)
               for stopped, peak in runs), runs


def _fsdp_build(batch):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl")
    net = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]).cuda()
    for m in net:
        fully_shard(m)
    fully_shard(net)
    opt = torch.optim.AdamW(net.parameters())

    def step():
        net(torch.randn(batch, 512, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
    return step


def test_world_size_runs_a_distributed_script_as_rank_0(tmp_path, capsys):
    """``--world-size N`` on a script that shards its own model (init_process_group,
    fully_shard): rank 0 of N, equal to the same code as a build function."""
    import inspect

    # the script: the build function's own source, then its step in a loop
    path = _write(tmp_path, "fsdp_train.py", "import torch\n" + inspect.getsource(_fsdp_build)
                  + "step = _fsdp_build(8)\nfor i in range(10):\n    step()\n")
    assert main(["estimate", "--gpu", "T4", "--world-size", "4", "--margin", "0", "--json",
                 path]) == 0
    d = json.loads(capsys.readouterr().out)
    want = torchmem.estimate(_fsdp_build, "T4", 8, world_size=4, margin=0)
    assert d["world_size"] == 4 and d["script"]["steps_run"] == 2
    assert (d["peak_requested_bytes"], d["peak_allocated_bytes"], d["peak_reserved_bytes"]) == (
        want.peak_requested_bytes, want.peak_allocated_bytes, want.peak_reserved_bytes)
    two = estimate_script(path, [], "T4", world_size=2, margin=0)
    assert two.peak_requested_bytes > d["peak_requested_bytes"]  # a shard of 2 is larger
    with pytest.raises(InvalidInputError, match="world_size"):
        estimate_script(path, [], "T4", world_size=0)


def _estimate_in_a_thread(script: str, time_limit: float):
    """``estimate_script(script)`` on T4 run off the main thread (which must end in 120 s)."""
    import threading
    got: list = []
    t = threading.Thread(target=lambda: got.append(estimate_script(script, [], "T4",
                                                                    time_limit=time_limit)),
                         daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive() and len(got) == 1
    return got[0]


# off the main thread the stop is raised by the estimate's dispatch before the thread's next
# operator; a thread that runs no operator gets an asynchronous exception instead
def test_time_limit_in_another_thread_is_reported_as_the_time_limit(tmp_path):
    # it was reported as "end" (the reason was never recorded)
    forever = _write(tmp_path, "forever.py", """
        import torch
        keep = torch.ones(1 << 20, device="cuda")
        while True:
            y = keep * 2
    """)
    e = _estimate_in_a_thread(forever, 0.5)
    assert e.script.stopped == "time_limit" and e.peak_requested_bytes >= 4 << 20
    assert "the script was stopped at the time limit (0.5 s)" in e.notes


def test_a_requested_stop_lands_before_the_next_operator(tmp_path):
    """The stop asked for from another thread is raised before the thread's next operator
    starts: the operator after the request allocates nothing (peak: the first tensor only)."""
    script = _write(tmp_path, "asks.py", """
        import threading, torch
        from torchmem.fit.fakegpu._dispatch import request_stop
        from torchmem.fit.targets._stop import _StopScript
        keep = torch.ones(1 << 20, device="cuda")
        request_stop(threading.get_ident(), _StopScript)
        y = keep * 2
        raise AssertionError("not stopped")
    """)
    e = estimate_script(script, [], "T4", time_limit=60)
    assert e.peak_requested_bytes == 4 << 20
    from torchmem.fit.fakegpu._dispatch import stop_pending
    assert not stop_pending(__import__("threading").get_ident())


def test_time_limit_in_another_thread_stops_a_loop_without_operators(tmp_path):
    spin = _write(tmp_path, "spin.py", """
        import torch
        keep = torch.ones(1 << 20, device="cuda")
        n = 0
        while True:
            n += 1
    """)
    e = _estimate_in_a_thread(spin, 0.3)
    assert e.script.stopped == "time_limit" and e.peak_requested_bytes == 4 << 20


@pytest.mark.parametrize("text,args,needle", [
    (None, [], "script '{missing}' not found; expected a path to a Python file"),
    ("import torch\nx = (1,\n", [], "{path}:2: SyntaxError: "),
    (TRAIN, ["--batch-size", "big"], "rejected its arguments ['--batch-size', 'big']: argument "
     "--batch-size: invalid int value: 'big' (usage: "),
    ("import sys\nsys.exit(0)\n", [], "exited with status 0 at {path}:2 (sys.exit(0)) before it "
     "made any tensor or optimizer step"),
    ("import sys, torch\nx = torch.ones(8, device='cuda')\nsys.exit(3)\n", [],
     "exited with status 3 at {path}:3"),
    ("def build(batch):\n    pass\n", [], "run 'torchmem estimate {path}:build'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, text, args, needle):
    path = str(tmp_path / "bad.py")
    missing = str(tmp_path / "missing.py")
    if text is not None:
        _write(tmp_path, "bad.py", text)
    code = main(["estimate", "--gpu", "T4", path if text is not None else missing, *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle.format(path=path, missing=missing) in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_module_that_cannot_be_imported(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["estimate", "-m", "no_such_pkg.train", "--lr", "1"]) == 2
    err = capsys.readouterr().err
    assert "no module named 'no_such_pkg.train'" in err and "python -m no_such_pkg.train" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("kw,needle", [
    ({"steps": 0}, "steps must be an int >= 1"),
    ({"time_limit": 0}, "time_limit must be a number of seconds > 0"),
    ({"args": "--lr 1"}, "args must be a list of strings"),
    ({"maximize": "batch size"}, "expected the name of one of the script's integer options"),
])
def test_api_bad_arguments(train, kw, needle):
    kw = {"args": [], **kw}
    with pytest.raises(InvalidInputError, match=needle):
        estimate_script(train, kw.pop("args"), "T4", **kw)


def test_build_options_before_a_script_are_refused(train, capsys):
    assert main(["estimate", "--batch-size", "8", train]) == 2
    err = capsys.readouterr().err
    assert f"'torchmem estimate {train} --batch-size 8'" in err


def test_a_crash_says_where_and_what_was_simulated(tmp_path, capsys):
    path = _write(tmp_path, "crash.py", """
        import torch
        net = torch.nn.Linear(1024, 1024).cuda()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for i in range(3):
            net(torch.randn(16, 1024, device="cuda")).sum().backward()
            opt.step()
            if i == 1:
                raise RuntimeError("disk full")
    """)
    with pytest.raises(ScriptError) as info:
        estimate_script(path, [], "T4", steps=5)
    e = info.value
    assert e.estimate is not None and e.estimate.peak_allocated_bytes >= 2 * 1024 * 1024 * 4
    assert f"raised RuntimeError at {path}:9 (raise RuntimeError(\"disk full\")): disk full" in str(e)
    assert "after 2 optimizer steps" in str(e) and "peak allocated" in str(e)
    assert main(["estimate", "--gpu", "T4", "--steps", "5", path]) == 2
    err = capsys.readouterr().err
    assert f"{path}:9" in err and "peak reserved" in err and "Traceback" not in err


def test_does_not_fit_exits_3_with_the_oom_point(train, capsys):
    code = main(["estimate", "--gpu", "1 GiB", "--json", train, "--batch-size", "1000000"])
    d = json.loads(capsys.readouterr().out)
    assert code == 3 and d["fits"] is False and d["oom"] is not None
    assert d["script"]["stopped"] == "out_of_memory"


def test_build_specs_keep_their_options_after_the_spec(tmp_path, capsys):
    path = _write(tmp_path, "b.py", """
        import torch
        def build(batch):
            x = torch.zeros(batch, 1024, device="cuda")
            return lambda: x + 1
    """)
    assert main(["estimate", f"{path}:build", "--gpu", "T4", "--batch-size", "4", "--json",
                 "--steps", "1"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["gpu"] == "T4" and d["batch_size"] == 4 and d["peak_requested_bytes"] == 32768
    assert "script" not in d


TRAINER = textwrap.dedent("""
    import sys
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    out = sys.argv[1]
    cfg = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128, max_position_embeddings=64, num_labels=2)
    model = BertForSequenceClassification(cfg)
    rows = [{"input_ids": torch.randint(0, 512, (32,)), "attention_mask": torch.ones(32, dtype=torch.long),
             "labels": torch.tensor(i % 2)} for i in range(16)]
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=4,
                             logging_steps=1, save_steps=1, report_to="none",
                             dataloader_num_workers=0, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=rows).train()
""")


def test_transformers_trainer_script_stops_after_two_steps(tmp_path, capsys):
    pytest.importorskip("transformers")
    path = _write(tmp_path, "hf_train.py", TRAINER)
    out_dir = tmp_path / "out"
    code = main(["estimate", "--gpu", "T4", "--steps", "2", "--json", path, str(out_dir)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    d = json.loads(captured.out)
    assert d["script"]["steps_run"] == 2 and d["script"]["stopped"] == "steps"
    assert d["by_category"]["optimizer_state"] > 0 and d["fits"]
    assert not out_dir.exists() or not any(out_dir.rglob("*"))
    # a save every step: the first step's checkpoint was skipped, not written
    assert any("out" in w["path"] for w in d["script"]["skipped_writes"]), d["script"]
