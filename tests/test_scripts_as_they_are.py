"""Issue 41, scripts as they are: the values a script reads to index its data are real, a 0-d
tensor formats, and a run cut short gives no verdict.

The script here does what nanoGPT's ``train.py`` does (its ``get_batch``: random offsets from
``torch.randint`` on the host, slices of a memmapped token file, ``torch.stack``, pinned and
moved with ``non_blocking=True``; its log line ``f"{loss:.4f}"``); the ground truth is the same
step written as a build function on batches of the same shape, and sums worked out in plain
Python from the same offsets.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch

import torchmem
from torchmem.fit.targets._script import estimate_script

B, T, V, C = 4, 32, 5000, 64  # batch, block size, vocabulary, width

NANO = textwrap.dedent(f"""
    import os, sys
    import numpy as np
    import torch
    import torch.nn.functional as F

    B, T, V, C = {B}, {T}, {V}, {C}
    data_dir = os.path.dirname(os.path.abspath(__file__))
    device = "cuda"
    torch.manual_seed(1337)

    def get_batch():
        data = np.memmap(os.path.join(data_dir, "train.bin"), dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - T, (B,))
        x = torch.stack([torch.from_numpy((data[i:i+T]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i+1:i+1+T]).astype(np.int64)) for i in ix])
        # the host's own arithmetic on what it read: both sides must be the real values
        offsets = ix.tolist()
        assert all(0 <= i < len(data) - T for i in offsets), offsets
        assert int(x.sum()) == sum(int(v) for i in offsets for v in data[i:i+T])
        assert int((y - x).sum()) == B * T      # the file counts up: y is x shifted by one
        print("batch", tuple(x.shape), offsets, file=sys.stderr)
        x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x, y

    emb = torch.nn.Embedding(V, C).to(device)
    head = torch.nn.Linear(C, V).to(device)
    opt = torch.optim.AdamW(list(emb.parameters()) + list(head.parameters()), lr=1e-3)
    X, Y = get_batch()
    for it in range(1000):
        logits = head(emb(X))
        loss = F.cross_entropy(logits.view(-1, V), Y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        X, Y = get_batch()
        print(f"iter {{it}}: loss {{loss:.4f}}")
""")


def build(batch_size: int):
    """The script's step on batches of the same shape (the ground truth)."""
    emb = torch.nn.Embedding(V, C).to("cuda")
    head = torch.nn.Linear(C, V).to("cuda")
    opt = torch.optim.AdamW(list(emb.parameters()) + list(head.parameters()), lr=1e-3)
    state = {"xy": (torch.zeros(batch_size, T, dtype=torch.long, device="cuda"),
                    torch.zeros(batch_size, T, dtype=torch.long, device="cuda"))}

    def step() -> None:
        x, y = state["xy"]
        logits = head(emb(x))
        loss = torch.nn.functional.cross_entropy(logits.view(-1, V), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["xy"] = (torch.zeros(batch_size, T, dtype=torch.long, device="cuda"),
                       torch.zeros(batch_size, T, dtype=torch.long, device="cuda"))
        print(f"loss {loss:.4f}")

    return step


@pytest.fixture()
def nano(tmp_path):
    np.arange(20_000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    path = tmp_path / "train.py"
    path.write_text(NANO)
    return str(path)


def test_a_nanogpt_style_get_batch_reads_real_offsets_and_the_step_equals_the_build(
        nano, capsys):
    e = estimate_script(nano, [], "T4")
    err = capsys.readouterr().err
    assert e.script.stopped == "steps" and e.script.steps_run == 2
    # two batches (the run stops at the second optimizer step), each (B, T), each from offsets
    # inside the file: the real values
    batches = [line for line in err.splitlines() if line.startswith("batch ")]
    assert len(batches) == 2 and all(line.startswith(f"batch ({B}, {T}) [") for line in batches)
    # the same step written by hand: the same peaks to the byte
    ref = torchmem.estimate(build, gpu="T4", batch_size=B, steps=2)
    assert e.peak_requested_bytes == ref.peak_requested_bytes
    assert e.peak_allocated_bytes == ref.peak_allocated_bytes
    # no value of get_batch was assumed; the logged loss was (1.0, listed at its line)
    reads = [(a["where"].rsplit(":", 1)[1], a["op"], a["value"]) for a in e.assumed_values]
    log_line = NANO.splitlines().index('    print(f"iter {it}: loss {loss:.4f}")') + 1
    assert reads == [(str(log_line), "aten.nll_loss_forward.default", 1.0)], reads


def test_shadows_follow_in_place_writes_and_stop_where_a_value_is_unknown(tmp_path, capsys):
    path = tmp_path / "vals.py"
    path.write_text(textwrap.dedent("""
        import torch
        a = torch.zeros(6, dtype=torch.long, device="cuda")
        a[2] = 7                                   # a write into a view of a
        a += torch.arange(6, device="cuda")
        print("a", a.tolist())
        w = torch.randn(6, 6, device="cuda")      # floats: no real values kept
        b = torch.zeros(6, dtype=torch.long, device="cuda")
        b.copy_(w.argmax(1))                       # written from an unknown: a stand-in now
        print("b", int(b.sum()))
        net = torch.nn.Linear(6, 1).cuda()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(2):
            net(w).sum().backward(); opt.step()
    """))
    e = estimate_script(str(path), [], "T4")
    out = capsys.readouterr().out
    assert "a [0, 1, 9, 3, 4, 5]" in out          # 0..5 plus the 7 written at index 2
    assert "b 6" in out                            # the sum of an integer tensor: its numel
    assert [a["value"] for a in e.assumed_values] == [6]


def test_a_0d_tensor_formats_under_the_estimate(tmp_path, capsys):
    path = tmp_path / "fmt.py"
    path.write_text(textwrap.dedent("""
        import torch
        net = torch.nn.Linear(8, 8).cuda()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for it in range(3):
            loss = net(torch.ones(2, 8, device="cuda")).sum()
            print(f"loss {loss:.4f} step {torch.tensor(it):d} {loss:>10.2e}")
            loss.backward(); opt.step()
    """))
    e = estimate_script(str(path), [], "T4")
    out = capsys.readouterr().out
    assert "loss 1.0000 step 0   1.00e+00" in out and "loss 1.0000 step 1" in out
    assert e.script.steps_run == 2
    with pytest.raises(TypeError):  # outside the estimate a fake tensor formats as before
        from torch._subclasses import FakeTensorMode

        with FakeTensorMode():
            f"{torch.ones(()):.4f}"  # noqa: B018


def test_a_time_limit_landing_in_backward_or_a_metadata_query_never_aborts(tmp_path):
    """A stop used to abort the process (``terminate called after throwing an instance of
    'python_error'``) when it landed in the autograd engine or in ``prim.device``: each of
    these limits must end as a time limit, with the peaks so far and no verdict."""
    import json
    import subprocess
    import sys

    loop = tmp_path / "loop.py"
    loop.write_text(textwrap.dedent("""
        import torch
        net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(100)]).cuda()
        x = torch.randn(4, 64, device="cuda")
        while True:
            net(x).sum().backward()
    """))
    code = textwrap.dedent(f"""
        import json
        from torchmem.errors import InvalidInputError
        from torchmem.fit import estimate_script
        out = []
        for i in range(6):
            try:
                e = estimate_script({str(loop)!r}, [], "T4", time_limit=1.5 + 0.35 * i)
            except InvalidInputError as err:   # stopped before the model reached the GPU
                out.append(("error", str(err)))
                continue
            out.append((e.script.stopped, e.incomplete, e.fits, e.peak_requested_bytes))
        print(json.dumps(out))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = json.loads(r.stdout.strip().splitlines()[-1])
    done = [run for run in runs if run[0] != "error"]
    assert len(done) >= 3, runs
    for stopped, incomplete, fits, peak in done:
        assert stopped == "time_limit" and fits is False and incomplete.startswith(
            "stopped at the time limit") and peak > 0
    for run in runs:
        if run[0] == "error":
            assert "before it put anything on the GPU" in run[1] and "raise --time-limit" in run[1]


def test_the_scripts_own_error_is_shown_and_json_says_it_on_stdout(tmp_path, capsys):
    import json

    from torchmem.cli import main

    bare = tmp_path / "bare.py"
    bare.write_text("import torch\nx = torch.ones(2, device='cuda')\nassert x.shape == (3,)\n")
    assert main(["estimate", "--gpu", "T4", str(bare)]) == 2
    err = capsys.readouterr().err
    assert "raised AssertionError at " in err and "bare.py:3 (assert x.shape == (3,)): (no message)" in err
    two = tmp_path / "two.py"
    two.write_text('raise RuntimeError("first line\\nsecond line: how to fix it")\n')
    assert main(["estimate", "--json", "--gpu", "T4", str(two)]) == 2
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["type"] == "ScriptError" and doc["exit_code"] == 2
    assert "first line\nsecond line: how to fix it" in doc["error"]
    assert doc["error"] in captured.err


CONFIGURATOR = textwrap.dedent("""
    import os, sys
    import torch
    batch_size = 8                       # nanoGPT's globals, overridden by a config file and
    width = 512                          # --key=value arguments (its configurator.py)
    for arg in sys.argv[1:]:
        if '=' not in arg:
            exec(open(arg).read())
        else:
            assert arg.startswith('--'), arg
            key, val = arg[2:].split('=')
            assert key in globals(), f"Unknown config key: {key}"
            globals()[key] = type(globals()[key])(eval(val))
    net = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                              torch.nn.Linear(4 * width, width)).cuda()
    opt = torch.optim.AdamW(net.parameters())
    x = torch.randn(batch_size, width, device="cuda")
    for _ in range(10):
        net(x).square().mean().backward(); opt.step(); opt.zero_grad()
""")


def _mlp_build(batch_size: int):
    net = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                              torch.nn.Linear(2048, 512)).cuda()
    opt = torch.optim.AdamW(net.parameters())
    x = torch.randn(batch_size, 512, device="cuda")

    def step() -> None:
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return step


def test_max_on_a_configurator_script_uses_its_spelling_and_starts_at_its_value(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nanoGPT runs from its folder: config files by relative path
    (tmp_path / "train.py").write_text(CONFIGURATOR)
    (tmp_path / "cfg.py").write_text("batch_size = 64\n")
    want = torchmem.estimate(_mlp_build, "2 GiB", max_batch_size=True, margin=0)
    e = estimate_script("train.py", ["cfg.py"], "2 GiB", maximize="batch_size",
                        margin=0)
    assert e.max_value == want.max_batch_size > 64
    assert e.probes[0][0] == 64                       # the config file's value, not 1
    assert e.script.args == ["cfg.py", f"--batch_size={want.max_batch_size}"]
    assert e.peak_reserved_bytes == want.peak_reserved_bytes


def test_paths_the_script_names_under_the_temp_folder_go_to_scratch(tmp_path, capsys):
    """transformers' README runs ``--output_dir /tmp/test-clm``: what a script writes to a path it
    names under the temporary folder is scratch and listed; what ``tempfile`` makes for it is real
    (and the script reads its own writes back in both)."""
    import os
    import tempfile
    import uuid

    out_dir = os.path.join(tempfile.gettempdir(), f"torchmem-test-{uuid.uuid4().hex}")
    script = tmp_path / "writes.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, tempfile
        import torch
        os.makedirs({out_dir!r}, exist_ok=True)
        with open(os.path.join({out_dir!r}, "all_results.json"), "w") as f:
            json.dump({{"loss": 1.0}}, f)
        assert json.load(open(os.path.join({out_dir!r}, "all_results.json"))) == {{"loss": 1.0}}
        with tempfile.TemporaryDirectory() as d:     # the run's own temporary files: real
            with open(os.path.join(d, "part.bin"), "wb") as f:
                f.write(b"x" * 10)
            assert os.path.getsize(os.path.join(d, "part.bin")) == 10
            print("tempdir", d)
        with tempfile.NamedTemporaryFile("w", delete=False) as f:
            f.write("kept")
        print("named", f.name)
        # an atomic save (Lightning's, Fabric.save): a temporary file renamed onto the target
        with tempfile.NamedTemporaryFile("w", delete=False) as f:
            f.write("checkpoint")
        os.makedirs("ckpt", exist_ok=True)
        os.replace(f.name, "ckpt/epoch=0.ckpt")
        assert open("ckpt/epoch=0.ckpt").read() == "checkpoint"      # read back from scratch
        net = torch.nn.Linear(4, 4).cuda()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(2):
            net(torch.ones(1, 4, device="cuda")).sum().backward(); opt.step()
    """))
    os.chdir(tmp_path)
    try:
        e = estimate_script(str(script), [], "T4")
    finally:
        os.chdir(os.path.dirname(os.path.dirname(__file__)))
    out = capsys.readouterr().out
    assert not os.path.exists(out_dir)                      # nothing of it on the real disk
    assert not (tmp_path / "ckpt").exists()
    listed = {(w.what.split(" from ")[0], w.path) for w in e.script.skipped_writes}
    assert listed == {("os.makedirs", out_dir),
                      ("open(mode='w')", os.path.join(out_dir, "all_results.json")),
                      ("os.makedirs", str(tmp_path / "ckpt")),
                      ("os.replace", str(tmp_path / "ckpt" / "epoch=0.ckpt"))}
    named = next(line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("named "))
    try:
        assert open(named).read() == "kept"                 # tempfile's file is real
    finally:
        os.remove(named)


def test_strict_values_refuse_only_what_would_be_assumed(nano):
    """``--strict-values`` refuses reads that would get a stand-in; the real ones of get_batch
    go through, so the run stops at the log line's loss, not in get_batch."""
    from torchmem.errors import InvalidInputError

    with pytest.raises(InvalidInputError) as info:
        estimate_script(nano, [], "T4", strict_values=True)
    log_line = NANO.splitlines().index('    print(f"iter {it}: loss {loss:.4f}")') + 1
    assert f"train.py:{log_line} " in str(info.value), str(info.value)


def test_atomic_saves_lock_files_and_caches_as_trainers_and_datasets_make_them(
        tmp_path, capsys, monkeypatch):
    """fsspec's transaction (Lightning's ``_atomic_save``): a temporary file moved onto the
    target, then ``chmod``; a folder the run makes, then ``statvfs``, ``exists`` and
    ``listdir`` of it (``datasets``' lock files); ``NamedTemporaryFile(dir=D)`` in a folder of
    the user's, moved to its final name. All land in the scratch folder and are listed, the
    real folders stay as they were; the Hugging Face datasets cache is written for real and
    the report says so."""
    import os

    user = tmp_path / "user"
    user.mkdir()
    (user / "old.txt").write_text("mine")
    cache = tmp_path / "hf" / "datasets"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    script = tmp_path / "saves.py"
    script.write_text(textwrap.dedent(f"""
        import os, shutil, tempfile
        import torch
        user = {str(user)!r}
        # fsspec LocalFileOpener.commit: shutil.move of a temporary file, then chmod
        fd, tmp = tempfile.mkstemp()
        os.write(fd, b"checkpoint"); os.close(fd)
        os.makedirs(os.path.join(user, "ckpts"), exist_ok=True)
        target = os.path.join(user, "ckpts", "epoch=0-step=1.ckpt")
        shutil.move(tmp, target)
        os.chmod(target, 0o644)
        assert os.path.exists(target) and os.path.getsize(target) == 10
        # a folder made by the run, then inspected as a lock file's folder is
        os.makedirs(os.path.join(user, "locks"))
        os.statvfs(os.path.join(user, "locks"))
        open(os.path.join(user, "locks", "a.lock"), "w").close()
        assert sorted(os.listdir(user)) == ["ckpts", "locks", "old.txt"]
        assert [e.name for e in os.scandir(os.path.join(user, "locks"))] == ["a.lock"]
        # datasets' writer: a named temporary file in the user's folder, moved into place
        t = tempfile.NamedTemporaryFile("wb", dir=user, delete=False)
        t.write(b"arrow"); t.close()
        shutil.move(t.name, os.path.join(user, "final.arrow"))
        assert open(os.path.join(user, "final.arrow"), "rb").read() == b"arrow"
        os.chmod(os.path.join(user, "old.txt"), 0o600)       # the user's own file: not done
        # the datasets cache: real
        os.makedirs({str(cache)!r}, exist_ok=True)
        open(os.path.join({str(cache)!r}, "x.arrow"), "w").write("cached")
        net = torch.nn.Linear(4, 4).cuda()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(2):
            net(torch.ones(1, 4, device="cuda")).sum().backward(); opt.step()
    """))
    mode = os.stat(user / "old.txt").st_mode
    e = estimate_script(str(script), [], "T4")
    assert e.script.steps_run == 2
    assert sorted(os.listdir(user)) == ["old.txt"]          # nothing else on the real disk
    assert os.stat(user / "old.txt").st_mode == mode
    assert (cache / "x.arrow").read_text() == "cached"      # the datasets cache is real
    listed = {(w.what.split(" from /")[0], w.path) for w in e.script.skipped_writes}
    assert listed == {
        ("os.makedirs", str(user / "ckpts")), ("os.rename", str(user / "ckpts" / "epoch=0-step=1.ckpt")),
        ("os.makedirs", str(user / "locks")),
        ("open(mode='w')", str(user / "locks" / "a.lock")),
        ("os.rename", str(user / "final.arrow")),
        ("os.chmod (not done)", str(user / "old.txt")),
        ("written for real: the Hugging Face datasets cache (pyarrow writes and maps its Arrow "
         "files outside Python, from the real data; a real run writes the same)", str(cache)),
    }
    from torchmem.cli.estimate import script_lines

    lines = script_lines(e)
    assert lines[-1].startswith("written for real: the Hugging Face datasets cache") \
        and lines[-1].endswith(f": {cache}")


RELOAD = textwrap.dedent("""
    import io, os, sys
    import torch

    dev = os.environ["TM_DEVICE"]
    x = torch.empty(1000, 1000, device=dev)      # two 4,000,000-byte blocks, one after the other
    y = torch.empty(1000, 1000, device=dev)
    print("gap", y.data_ptr() - x.data_ptr(), "view", x[10:].data_ptr() - x.data_ptr(),
          "distinct", x.data_ptr() != y.data_ptr())
    del x, y
    net = torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 1000, bias=False),
                              torch.nn.Linear(1000, 10)).to(dev)
    net[1].weight = net[0].weight                # tied, as a language model's head
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def summary(tag, obj):
        flat = []
        def walk(prefix, o):
            if isinstance(o, torch.Tensor):
                flat.append((prefix, o))
            elif isinstance(o, dict):
                for k, v in o.items():
                    walk(f"{prefix}/{k}", v)
            elif isinstance(o, (list, tuple)):
                for i, v in enumerate(o):
                    walk(f"{prefix}/{i}", v)
        walk("", obj)
        by_ptr = {}
        for name, t in flat:
            by_ptr.setdefault(t.untyped_storage().data_ptr(), []).append((name, t))
        shared = sorted(tuple(n for n, _ in group) for group in by_ptr.values() if len(group) > 1)
        sizes = sorted(group[0][1].untyped_storage().nbytes() for group in by_ptr.values())
        print(tag, len(flat), "tensors", [(n, tuple(t.shape), str(t.dtype)) for n, t in flat],
              "storages", sizes, "shared", shared)
        return sizes

    os.makedirs("out", exist_ok=True)
    for it in range(2):
        net(torch.zeros(4, 16, dtype=torch.long, device=dev)).sum().backward()
        opt.step(); opt.zero_grad()
    torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "it": it}, "out/ckpt.pt")
    before = torch.cuda.memory_allocated() if dev == "cuda" else 0
    ck = torch.load("out/ckpt.pt", map_location=dev)
    after = torch.cuda.memory_allocated() if dev == "cuda" else 0
    summary("file", ck)
    print("loaded", ck["it"], "allocated by the load", after - before, file=sys.stderr)
    buf = io.BytesIO(); torch.save(net.state_dict(), buf); buf.seek(0)
    summary("buffer", torch.load(buf))
    net.load_state_dict(ck["model"]); opt.load_state_dict(ck["opt"])
    net(torch.zeros(4, 16, dtype=torch.long, device=dev)).sum().backward(); opt.step()
""")


def test_a_script_loads_back_what_it_saved_and_sees_real_data_pointers(tmp_path, capsys,
                                                                      monkeypatch):
    """A skipped ``torch.save`` leaves an outline the run loads back (a resume, a copy through a
    buffer): the same tensors, shapes, dtypes and tied storages as the real save and load of
    the same script on the CPU (run for real here); on the GPU the load allocates each storage
    once, rounded as the caching allocator rounds. ``data_ptr()`` tells storages apart and
    views share it, as in the real run."""
    import os
    import subprocess
    import sys

    script = tmp_path / "reload.py"
    script.write_text(RELOAD)
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    real = subprocess.run([sys.executable, str(script)], cwd=real_dir, capture_output=True,
                          text=True, env={**os.environ, "TM_DEVICE": "cpu"}, check=True)
    assert (real_dir / "out" / "ckpt.pt").exists()            # the real run's file
    real_lines = [ln for ln in real.stdout.splitlines() if ln.startswith(("file", "buffer"))]
    assert "shared [('/model/0.weight', '/model/1.weight')]" in real_lines[0]

    work = tmp_path / "fake"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("TM_DEVICE", "cuda")
    e = estimate_script(str(script), [], "T4", steps=5)
    cap = capsys.readouterr()
    assert e.script.stopped == "end" and e.script.steps_run == 3
    assert not (work / "out").exists()                       # nothing on the real disk
    fake_lines = [ln for ln in cap.out.splitlines() if ln.startswith(("file", "buffer"))]
    assert fake_lines == real_lines
    # the load on the GPU: one block per saved storage (3 parameters, the tied pair once; per
    # parameter two AdamW moments and its step), each rounded up to
    # 512 bytes; the storages' sizes are the real file's
    sizes = eval(real_lines[0].split(" storages ")[1].split(" shared ")[0])  # noqa: S307
    loaded = int(cap.err.split("allocated by the load ")[1].split()[0])
    assert loaded == sum(-(-n // 512) * 512 for n in sizes if n) and len(sizes) == 12
    # data pointers: two 4,000,000-byte blocks back to back in one 20 MiB segment; a view 10
    # rows in starts 40,000 bytes later
    gap = next(ln for ln in cap.out.splitlines() if ln.startswith("gap "))
    assert gap == "gap 4000256 view 40000 distinct True", gap
    assert any(a["op"] == "Tensor.data_ptr" for a in e.assumed_values)
    saves = [w for w in e.script.skipped_writes if w.what.startswith("torch.save(dict")]
    assert len(saves) == 1 and saves[0].path == str(work / "out" / "ckpt.pt")
    # the listed size counts each storage once (what torch.save writes)
    from torchmem.units import format_bytes

    assert saves[0].what.endswith(f"{format_bytes(sum(sizes))})"), saves[0].what


SAFE = textwrap.dedent("""
    import os, sys
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    dev = os.environ["TM_DEVICE"]
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64)
    model = GPT2LMHeadModel(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.zeros(2, 16, dtype=torch.long, device=dev)
    model(ids, labels=ids).loss.backward(); opt.step(); opt.zero_grad()
    os.makedirs("out", exist_ok=True)
    save_file({"emb": model.transformer.wte.weight.detach().half(),
               "steps": torch.tensor([3, 4])}, "out/part.safetensors", metadata={"step": "3"})
    back = load_file("out/part.safetensors", device=dev)
    print("file", sorted((k, tuple(v.shape), str(v.dtype)) for k, v in back.items()))
    model.save_pretrained("out/model")
    print("folder", sorted(os.listdir("out/model")))
    before = torch.cuda.memory_allocated() if dev == "cuda" else 0
    again = GPT2LMHeadModel.from_pretrained("out/model").to(dev)
    after = torch.cuda.memory_allocated() if dev == "cuda" else 0
    print("pretrained", [(n, tuple(p.shape), str(p.dtype)) for n, p in again.named_parameters()],
          "tied", again.lm_head.weight.data_ptr() == again.transformer.wte.weight.data_ptr())
    print("storages", sorted({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                              for p in again.parameters()}.values()))
    print("allocated by the load", after - before, file=sys.stderr)
    again(ids, labels=ids).loss.backward()
""")


def test_a_script_loads_back_its_safetensors_and_save_pretrained_folder(tmp_path, capsys,
                                                                        monkeypatch):
    """A skipped safetensors ``save_file`` and ``save_pretrained`` leave files with the real
    header and a hole for the data in the scratch folder: ``load_file`` and ``from_pretrained``
    of them give what the same script run for real on the CPU gives (names, shapes, dtypes,
    the folder's files, tied weights tied), and the load allocates each storage once on the
    GPU; nothing reaches the real disk."""
    import os
    import subprocess
    import sys

    script = tmp_path / "safe.py"
    script.write_text(SAFE)
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    real = subprocess.run([sys.executable, str(script)], cwd=real_dir, capture_output=True,
                          text=True, env={**os.environ, "TM_DEVICE": "cpu"})
    assert real.returncode == 0, real.stderr[-3000:]
    assert (real_dir / "out" / "model" / "model.safetensors").exists()
    tags = ("file", "folder", "pretrained", "storages")
    real_lines = [ln for ln in real.stdout.splitlines() if ln.startswith(tags)]
    assert len(real_lines) == 4 and real_lines[2].endswith("tied True"), real_lines

    work = tmp_path / "fake"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("TM_DEVICE", "cuda")
    e = estimate_script(str(script), [], "T4")
    cap = capsys.readouterr()
    assert e.script.stopped == "end", (e.script.stopped, cap.err[-3000:])
    assert not (work / "out").exists()                       # nothing on the real disk
    fake_lines = [ln for ln in cap.out.splitlines() if ln.startswith(tags)]
    assert fake_lines == real_lines
    sizes = eval(real_lines[3].split("storages ")[1])  # noqa: S307 - our own script's list
    loaded = int(cap.err.split("allocated by the load ")[1].split()[0])
    assert loaded == sum(-(-n // 512) * 512 for n in sizes)
    written = {w.what.split("(")[0]: w.path for w in e.script.skipped_writes}
    assert written["safetensors.torch.save_file"] == str(work / "out" / "part.safetensors")
    assert written["PreTrainedModel.save_pretrained"] == str(work / "out" / "model")


def test_stacks_start_at_the_script_and_compiling_brings_no_hook_warning(tmp_path):
    """The out-of-memory point's stack is the script's own frames, from its ``<module>`` line
    in (not the CLI or runpy around it); ``torch.compile(module)`` does not warn about global
    module hooks (the estimate's own tracker's)."""
    import warnings

    path = tmp_path / "oom.py"
    path.write_text(textwrap.dedent("""
        import torch
        net = torch.compile(torch.nn.Linear(64, 64).cuda())
        net(torch.ones(2, 64, device="cuda")).sum().backward()

        def make(n):
            return [torch.empty(1 << 30, device="cuda") for _ in range(n)]

        def main():
            return make(40)

        main()
    """))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        e = estimate_script(str(path), [], "T4")
    assert not [w for w in caught if "global hooks on modules" in str(w.message)]
    assert e.oom is not None and e.script.stopped == "out_of_memory"
    assert [s.rsplit(":", 2)[0] for s in e.oom.stack] == [str(path)] * 4, e.oom.stack
    assert [tuple(s.rsplit(":", 2)[1:]) for s in e.oom.stack] == [
        ("12", "<module>"), ("10", "main"), ("7", "make"), ("7", "<listcomp>")]


PREP = textwrap.dedent("""
    import os, sys, torch

    def tokenize(path):
        word2idx = {}
        with open(path) as f:
            for line in f:
                for word in line.split() + ["<eos>"]:
                    word2idx.setdefault(word, len(word2idx))
        idss = []
        with open(path) as f:
            for line in f:
                ids = [word2idx[w] for w in line.split() + ["<eos>"]]
                idss.append(torch.tensor(ids).type(torch.int64))
        return torch.cat(idss), word2idx

    data, vocab = tokenize(os.path.join(os.path.dirname(os.path.abspath(__file__)), "c.txt"))
    weights = torch.bincount(data).float() / len(data)      # floats from host data: real too
    print("tokens", len(data), "sum", int(data.sum()), "top", round(float(weights.max()), 6))
    emb = torch.nn.Embedding(len(vocab), 32, device="cuda")
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    for i in range(3):
        x = torch.stack([data[j * 8:(j + 1) * 8] for j in range(4 * i, 4 * i + 4)]).to("cuda")
        emb(x).sum().backward(); opt.step()
""")


def test_data_preparation_on_host_data_runs_for_real_and_counts_its_host_memory(tmp_path,
                                                                               capsys):
    """Tensors made from host data (``torch.tensor(ids)``) and what is computed from them alone
    are real (issue 41: data preparation at the speed of a plain run): the values the script
    prints are the plain run's, floats included, nothing is assumed, and the host peak is every
    line's tensor plus their concatenation, 2 x 8 bytes per token."""
    import os
    import random
    import subprocess
    import sys

    rng = random.Random(1)
    (tmp_path / "c.txt").write_text("".join(
        " ".join(f"w{rng.randrange(300)}" for _ in range(rng.choice([0, 3, 12]))) + "\n"
        for _ in range(400)))
    script = tmp_path / "prep.py"
    script.write_text(PREP.replace('device="cuda"', 'device=DEV').replace('.to("cuda")',
                                                                       ".to(DEV)")
                      .replace("import os, sys, torch", "import os, sys, torch\nDEV = "
                               "'cuda' if torch.cuda.is_available() else 'cpu'"))
    real = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          check=True, env=os.environ).stdout.strip()
    e = estimate_script(str(script), [], "T4", steps=5)
    out = capsys.readouterr().out
    assert real.startswith("tokens ") and real in out.splitlines()
    assert e.script.steps_run == 3 and e.assumed_values == []
    tokens = int(real.split()[1])
    assert e.host_peak_bytes == 2 * 8 * tokens


def test_small_integer_draws_on_the_host_are_real_and_large_ones_fake(tmp_path, capsys):
    """Batch indices and shuffles drawn on the host (``torch.randint``, ``torch.randperm``, up
    to 2**20 elements) are real tensors, so a loop over them is plain Python; a larger draw
    stays fake. Both are host memory."""
    script = tmp_path / "draws.py"
    script.write_text(textwrap.dedent("""
        import sys, torch
        small = torch.randint(100, (12,))
        perm = torch.randperm(50)
        big = torch.randint(10, (2048, 1024))  # 2M elements: over the cap
        print("types", type(small).__name__, type(perm).__name__, type(big).__name__,
              [int(i) + 1 for i in small][:1] != [], file=sys.stderr)
        m = torch.nn.Linear(8, 8).cuda()
        m(torch.randn(2, 8, device="cuda")).sum().backward()
    """))
    e = estimate_script(str(script), [], "T4")
    assert "types Tensor Tensor FakeTensor True" in capsys.readouterr().err
    # the three draws live together: 12 and 50 int64s (real) and 2048 x 1024 int64s (fake),
    # with the Linear's host weights (8 x 8 + 8 float32s) made before .cuda()
    assert e.host_peak_bytes == 12 * 8 + 50 * 8 + 2048 * 1024 * 8 + (64 + 8) * 4
