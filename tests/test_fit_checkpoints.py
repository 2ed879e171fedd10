"""Checkpoints under an estimate (issue 40): loads give the file's shapes, dtypes and sharing
and read no weights; a model loaded from a checkpoint has the peaks of the same model built
from its config; a Llama-2-70B-shaped checkpoint (a sparse file) is estimated in little memory."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from torchmem.fit.fakegpu._checkpoints import read_safetensors_header
from torchmem.fit.run._engine import run_once
from torchmem.fit.targets._script import ScriptError, estimate_script

sys.path.insert(0, str(Path(__file__).parent))
from _sparse_checkpoint import (  # noqa: E402
    LLAMA2_70B,
    llama_config,
    llama_tensors,
    write_sparse_checkpoint,
)

safetensors = pytest.importorskip("safetensors")
from safetensors import SafetensorError, safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_safetensors_header_is_what_safetensors_reads(tmp_path: Path) -> None:
    tensors = {"a": torch.zeros(3, 5), "b": torch.zeros(7, dtype=torch.bfloat16),
               "c": torch.zeros(2, 2, 2, dtype=torch.int64), "d": torch.zeros((), dtype=torch.bool),
               "e": torch.zeros(0, 4, dtype=torch.float16)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"step": "10"})
    header = read_safetensors_header(path)
    with safe_open(str(path), "pt") as f:
        real = {k: (f.get_tensor(k).dtype, tuple(f.get_tensor(k).shape)) for k in f.keys()}
        meta = f.metadata()
    assert header["tensors"] == real
    assert header["metadata"] == meta == {"step": "10"}
    # the same from bytes
    assert read_safetensors_header(path.read_bytes())["tensors"] == real


@pytest.mark.parametrize("damage", ["truncated", "short", "not json", "huge header", "offsets"])
def test_a_damaged_safetensors_file_fails_as_safetensors_fails(tmp_path: Path,
                                                               damage: str) -> None:
    good = tmp_path / "good.safetensors"
    save_file({"w": torch.zeros(100, 10)}, str(good))
    data = good.read_bytes()
    n = int.from_bytes(data[:8], "little")
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "short":
        data = data[:5]
    elif damage == "not json":
        data = data[:8] + b"{" * n + data[8 + n:]
    elif damage == "huge header":
        data = (10**12).to_bytes(8, "little") + data[8:]
    else:  # offsets that do not match the shape (JSON of the same length)
        head = data[8:8 + n].decode().replace('"shape":[100,10]', '"shape":[100,11]')
        data = data[:8] + head.encode() + data[8 + n:]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(data)
    with pytest.raises(SafetensorError):  # the real reader refuses it too
        with safe_open(str(bad), "pt") as f:
            f.get_tensor("w")
    with pytest.raises(SafetensorError, match="Error while deserializing header") as err:
        read_safetensors_header(bad)
    assert str(bad) in str(err.value) and "expected a safetensors file" in str(err.value)


def _in_estimate(body: Any, gpu: str = "T4") -> Any:
    """Run ``body()`` as the build of an estimate (nothing on the GPU after it) and return what
    it returned, with the estimate."""
    got: dict[str, Any] = {}

    def build(batch_size: int) -> Any:
        got["out"] = body()
        x = torch.ones(1, device="cuda")
        return lambda: x + 1

    e = run_once(build, 1, gpu, steps=1)
    return got["out"], e


def test_torch_load_keeps_sharing_parameters_and_places_storages(tmp_path: Path) -> None:
    w = torch.nn.Parameter(torch.randn(64, 64))
    buf = torch.zeros(1000)
    path = tmp_path / "ck.pt"
    import argparse

    torch.save({"w": w, "tied": w, "view": w[8:], "buf": buf, "step": 7, "nested": [buf],
                "args": argparse.Namespace(lr=0.1, buf=buf)}, path)

    def load() -> dict[str, Any]:
        sd = torch.load(path, map_location="cuda", weights_only=False)  # every storage to the GPU
        host = torch.load(path, weights_only=False)  # saved from the host: stays there
        return {
            "types": (isinstance(sd["w"], torch.nn.Parameter), sd["w"].requires_grad,
                      isinstance(sd["view"], torch.nn.Parameter)),
            "tied": sd["tied"] is sd["w"],
            "view_shares": sd["view"].untyped_storage()._cdata == sd["w"].untyped_storage()._cdata,
            "view_offset": (sd["view"].storage_offset(), tuple(sd["view"].shape)),
            "nested_shares": sd["nested"][0].untyped_storage()._cdata
            == sd["buf"].untyped_storage()._cdata
            == sd["args"].buf.untyped_storage()._cdata,  # inside an object pickled whole
            "devices": (sd["w"].device.type, host["w"].device.type),
            "gpu_bytes": torch.cuda.memory_allocated(),
            "step": sd["step"],
            "index": torch.device(0).type,
        }

    out, _ = _in_estimate(load)
    assert out["types"] == (True, True, False)
    assert out["tied"] and out["view_shares"] and out["nested_shares"]
    assert out["view_offset"] == (8 * 64, (56, 64))
    assert out["devices"] == ("cuda", "cpu")
    assert out["step"] == 7
    assert out["index"] == "cuda"
    # two storages on the GPU: 64 x 64 fp32 and 1000 fp32, each rounded up to 512 bytes
    assert out["gpu_bytes"] == 64 * 64 * 4 + 4096


def test_torch_load_map_location_dict_and_safetensors_devices(tmp_path: Path) -> None:
    path = tmp_path / "ck.pt"
    torch.save({"a": torch.zeros(256)}, path)
    st = tmp_path / "ck.safetensors"
    save_file({"a": torch.zeros(512), "b": torch.zeros(128, dtype=torch.float16)}, str(st))

    def load() -> dict[str, Any]:
        from safetensors.torch import load, load_file

        a = torch.load(path, map_location={"cpu": "cuda:0"})["a"]
        before = torch.cuda.memory_allocated()
        on_gpu = load_file(str(st), device="cuda")
        with safe_open(str(st), "pt") as f:
            part = f.get_slice("a")[10:20]
            shape, dtype = f.get_slice("b").get_shape(), f.get_slice("b").get_dtype()
        from_bytes = load(st.read_bytes())
        return {"a": (a.device.type, before), "gpu": torch.cuda.memory_allocated() - before,
                "on_gpu": sorted((k, v.device.type, v.dtype) for k, v in on_gpu.items()),
                "part": (tuple(part.shape), part.device.type), "slice": (shape, dtype),
                "bytes": {k: tuple(v.shape) for k, v in from_bytes.items()}}

    out, _ = _in_estimate(load)
    assert out["a"] == ("cuda", 1024)
    assert out["gpu"] == 512 * 4 + 512  # 2048 and 256 rounded to 512
    assert out["on_gpu"] == [("a", "cuda", torch.float32), ("b", "cuda", torch.float16)]
    assert out["part"] == ((10,), "cpu")
    assert out["slice"] == ([128], "F16")
    assert out["bytes"] == {"a": (512,), "b": (128,)}


TRAIN = textwrap.dedent("""
    import sys, torch
    from transformers import AutoConfig, AutoModelForCausalLM
    path, how = sys.argv[1], sys.argv[2]
    if how == "config":
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
    model.train()  # from_pretrained returns the model in eval mode (no dropout)
    model.to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(2):
        x = torch.randint(0, 1000, (4, 64), device="cuda")
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
""")


@pytest.fixture(scope="module")
def gpt2_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("gpt2")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000,
                                  n_positions=128, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.save_pretrained(root / "one")
    model.save_pretrained(root / "sharded", max_shard_size="200KB")
    (root / "bin").mkdir()
    (root / "bin" / "config.json").write_text((root / "one" / "config.json").read_text())
    torch.save(model.state_dict(), root / "bin" / "pytorch_model.bin")  # lm_head tied to wte
    (root / "train.py").write_text(TRAIN)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["one", "sharded", "bin"])
def test_from_pretrained_has_the_peaks_of_the_model_built_from_its_config(
    gpt2_checkpoints: Path, kind: str
) -> None:
    root = gpt2_checkpoints
    assert len(list((root / "sharded").glob("*.safetensors"))) > 1
    script = str(root / "train.py")
    ck = estimate_script(script, [str(root / kind), "checkpoint"], "T4", steps=2)
    cf = estimate_script(script, [str(root / kind), "config"], "T4", steps=2)
    assert ck.script.steps_run == cf.script.steps_run == 2
    for key in ("peak_requested_bytes", "peak_allocated_bytes", "peak_reserved_bytes"):
        assert getattr(ck, key) == getattr(cf, key), key
    # the parameters, their gradients and AdamW's two states are on the GPU (not the host)
    params = sum(p.numel() * 4 for p in torch.nn.Module.parameters(
        __import__("transformers").GPT2LMHeadModel.from_pretrained(root / "one")))
    assert ck.peak_requested_bytes > 4 * params
    assert ck.assumed_values == []  # the tied weights' torch.equal is answered, not assumed


def test_a_script_that_fails_while_loading_says_so(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    script = tmp_path / "load.py"
    # a host tensor first: the run then has host memory and nothing on the GPU, which alone
    # would read "put nothing on the GPU"; the script's own error says more
    script.write_text("import torch\nfrom safetensors.torch import load_file\n"
                      f"x = torch.zeros(1000)\nsd = load_file({str(bad)!r})\n")
    with pytest.raises(ScriptError) as err:
        estimate_script(str(script), [], "T4")
    msg = str(err.value)
    assert "raised SafetensorError at" in msg and "load.py:4" in msg
    assert "invalid JSON in header" in msg and str(bad) in msg
    assert "before it put anything on the GPU" in msg and "put nothing on the GPU" not in msg


FORWARD = textwrap.dedent("""
    import json, sys, torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16,
                                                 device_map="cuda")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    print("PARAMS", params, torch.cuda.memory_allocated(), file=sys.stderr)
    x = torch.randint(0, 32000, (1, 16), device="cuda")
    with torch.no_grad():
        model(x)
""")


@pytest.mark.slow
def test_a_llama2_70b_shaped_checkpoint_is_estimated_without_its_weights(tmp_path: Path) -> None:
    """A sparse checkpoint (27 shards, 128.5 GiB of holes) loaded in bf16 onto an H200 and run
    forward: the parameters on the simulated GPU are the header's bytes, and the estimator's
    own peak RSS stays far below the checkpoint."""
    pytest.importorskip("transformers")
    folder = tmp_path / "llama70b"
    total = write_sparse_checkpoint(folder, llama_config(**LLAMA2_70B), llama_tensors(**LLAMA2_70B))
    assert total == 137_953_296_384  # 68.98 B parameters x 2 bytes
    assert sum(f.stat().st_blocks for f in folder.iterdir()) * 512 < 2**20  # holes on disk
    script = tmp_path / "fwd.py"
    script.write_text(FORWARD)
    # a fresh parent whose only child is the estimate: its children's peak RSS is the estimate's
    wrapper = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
               "print('RSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
               "file=sys.stderr); sys.exit(r.returncode)")
    res = subprocess.run(
        [sys.executable, "-c", wrapper, sys.executable, "-m", "torchmem", "estimate", "--json",
         "--gpu", "H200", str(script), str(folder)], capture_output=True, text=True,
        timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(ln for ln in res.stderr.splitlines() if ln.startswith("PARAMS"))
    params, allocated = (int(v) for v in line.split()[1:])
    assert params == total
    assert total <= allocated < total + 2**20  # the weights are on the GPU (plus a rope buffer)
    data = json.loads(res.stdout[res.stdout.index("{"):])
    assert data["fits"] is True and data["peak_requested_bytes"] >= total
    rss_kib = int(next(ln for ln in res.stderr.splitlines() if ln.startswith("RSS")).split()[1])
    assert rss_kib * 1024 < 2 * 2**30, rss_kib


LORA = textwrap.dedent("""
    import sys, torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM
    path, how = sys.argv[1], sys.argv[2]
    if how == "config":
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
    if how == "adapter":  # the adapter saved by a LoRA run, loaded for more training
        model = PeftModel.from_pretrained(model, sys.argv[3], is_trainable=True)
    else:
        model = get_peft_model(model, LoraConfig(r=8, target_modules=["c_attn"],
                                                 task_type="CAUSAL_LM"))
    model.train()
    model.to("cuda")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    for _ in range(2):
        x = torch.randint(0, 1000, (4, 64), device="cuda")
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
""")


@pytest.mark.slow
def test_lora_on_a_loaded_model_and_a_loaded_adapter_have_the_config_models_peaks(
    gpt2_checkpoints: Path, tmp_path: Path
) -> None:
    peft = pytest.importorskip("peft")
    import transformers

    root = gpt2_checkpoints
    adapter = tmp_path / "adapter"
    base = transformers.GPT2LMHeadModel.from_pretrained(root / "one")
    peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=["c_attn"],
                                              task_type="CAUSAL_LM")).save_pretrained(adapter)
    script = tmp_path / "lora.py"
    script.write_text(LORA)
    runs = {how: estimate_script(str(script), [str(root / "one"), how, str(adapter)], "T4")
            for how in ("config", "checkpoint", "adapter")}
    keys = ("peak_requested_bytes", "peak_allocated_bytes", "peak_reserved_bytes")
    want = [getattr(runs["config"], k) for k in keys]
    for how in ("checkpoint", "adapter"):
        assert [getattr(runs[how], k) for k in keys] == want, how
        assert runs[how].script.steps_run == 2


DISPATCH = textwrap.dedent("""
    import sys, torch
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import AutoConfig, AutoModelForCausalLM
    path, device = sys.argv[1], sys.argv[2]
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path),
                                                 dtype=torch.bfloat16)
    model = load_checkpoint_and_dispatch(model, path, dtype=torch.bfloat16,
                                         device_map={"": 0 if device == "cuda" else "cpu"})
    x = torch.randint(0, 256, (2, 32), device=device)
    with torch.no_grad():
        model(x)
""")
PRETRAINED = textwrap.dedent("""
    import sys, torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16,
                                                 device_map={"": 0})
    x = torch.randint(0, 256, (2, 32), device="cuda")
    with torch.no_grad():
        model(x)
""")


@pytest.mark.slow
def test_accelerate_init_empty_weights_and_dispatch(tmp_path: Path, gpt2_checkpoints: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Untied weights: the same peaks as ``from_pretrained(device_map={"": 0})``. GPT-2's tied
    head stays on the meta device under accelerate's dispatch (the checkpoint stores it once),
    and moving it fails as it fails for real (checked on the CPU here)."""
    pytest.importorskip("accelerate")
    tiny = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=256)
    folder = tmp_path / "llama"
    write_sparse_checkpoint(folder, llama_config(**tiny), llama_tensors(**tiny))
    (tmp_path / "dispatch.py").write_text(DISPATCH)
    (tmp_path / "pretrained.py").write_text(PRETRAINED)
    a = estimate_script(str(tmp_path / "dispatch.py"), [str(folder), "cuda"], "T4")
    b = estimate_script(str(tmp_path / "pretrained.py"), [str(folder)], "T4")
    weights = sum(math.prod(s) * 2 for _, s in llama_tensors(**tiny).values())
    assert a.peak_requested_bytes == b.peak_requested_bytes >= weights
    # the tied GPT-2: the real run on the CPU and the estimate fail alike
    monkeypatch.setattr(sys, "argv", ["dispatch.py", str(gpt2_checkpoints / "one"), "cpu"])
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor") as real:
        exec(compile(DISPATCH, "dispatch.py", "exec"), {"__name__": "__main__"})
    with pytest.raises(ScriptError, match="Cannot copy out of meta tensor") as est:
        estimate_script(str(tmp_path / "dispatch.py"), [str(gpt2_checkpoints / "one"), "cuda"],
                        "T4")
    assert "NotImplementedError" in str(est.value) and real.value is not None


def _hub_cache(home: Path, repo: str, files: dict[str, Path]) -> None:
    """A Hugging Face cache entry for ``repo`` (``HF_HOME=home``) holding ``files``."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    entry = home / "hub" / f"models--{repo.replace('/', '--')}"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(sha)
    snap = entry / "snapshots" / sha
    snap.mkdir(parents=True)
    for name, src in files.items():
        (snap / name).write_bytes(src.read_bytes())


@pytest.mark.slow
def test_a_hub_name_from_the_offline_cache_with_or_without_weights(
    gpt2_checkpoints: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``from_pretrained("org/name")`` with ``HF_HUB_OFFLINE=1``: from the cached weights, and
    from a cached ``config.json`` alone (a note says so), the same peaks as the local folder;
    with nothing cached, one error naming the file to fetch."""
    one = gpt2_checkpoints / "one"
    home = tmp_path / "hf"
    _hub_cache(home, "acme/gpt2-full", {"config.json": one / "config.json",
                                        "model.safetensors": one / "model.safetensors"})
    _hub_cache(home, "acme/gpt2-config", {"config.json": one / "config.json"})
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(home / "hub"))
    import transformers.utils.hub as thub

    monkeypatch.setattr(thub, "TRANSFORMERS_CACHE", str(home / "hub"), raising=False)
    script = str(gpt2_checkpoints / "train.py")
    local = estimate_script(script, [str(one), "checkpoint"], "T4")
    full = estimate_script(script, ["acme/gpt2-full", "checkpoint"], "T4")
    config = estimate_script(script, ["acme/gpt2-config", "checkpoint"], "T4")
    keys = ("peak_requested_bytes", "peak_allocated_bytes", "peak_reserved_bytes")
    assert [getattr(full, k) for k in keys] == [getattr(local, k) for k in keys]
    assert [getattr(config, k) for k in keys] == [getattr(local, k) for k in keys]
    assert not any("no weights at hand" in n for n in full.notes)
    assert any(n.startswith("acme/gpt2-config: no weights at hand") and "float32" in n
               for n in config.notes), config.notes
    with pytest.raises(ScriptError) as err:
        estimate_script(script, ["acme/missing", "checkpoint"], "T4")
    assert "acme/missing: no config.json in the local Hugging Face cache" in str(err.value)
    assert "`hf download acme/missing config.json`" in str(err.value)


LIGHTNING = textwrap.dedent("""
    import sys, torch
    from lightning.fabric import Fabric
    from lightning.fabric.utilities.load import _lazy_load
    net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256))
    if sys.argv[1] == "lazy":
        net.load_state_dict(_lazy_load(sys.argv[2]))
    elif sys.argv[1] == "fabric":
        Fabric(accelerator="cuda", devices=1).load(sys.argv[2], {"model": net})
    net.to("cuda")
    opt = torch.optim.AdamW(net.parameters())
    x = torch.randn(64, 256, device="cuda")
    net(x).sum().backward()
    opt.step()
""")


def test_lightning_lazy_load_and_fabric_load_read_no_weights(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from lightning.fabric import Fabric

    net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256))
    torch.save(net.state_dict(), tmp_path / "sd.pt")
    Fabric(accelerator="cpu", devices=1).save(tmp_path / "fabric.ckpt", {"model": net})
    script = tmp_path / "l.py"
    script.write_text(LIGHTNING)
    runs = {how: estimate_script(str(script), [how, str(tmp_path / f)], "T4")
            for how, f in (("none", "sd.pt"), ("lazy", "sd.pt"), ("fabric", "fabric.ckpt"))}
    keys = ("peak_requested_bytes", "peak_allocated_bytes", "peak_reserved_bytes")
    want = [getattr(runs["none"], k) for k in keys]
    for how in ("lazy", "fabric"):
        assert [getattr(runs[how], k) for k in keys] == want, how
    # the lazy state dict reads one tensor at a time when load_state_dict copies it: the host
    # peak is the model's own weights plus the largest tensor (as a real lazy load holds)
    weights = sum(p.numel() * 4 for p in net.parameters())
    assert runs["none"].host_peak_bytes == weights
    assert runs["lazy"].host_peak_bytes == weights + 1024 * 256 * 4


@pytest.mark.slow
@pytest.mark.parametrize("command", ["finetune_lora", "finetune_full", "finetune_adapter"])
def test_litgpt_finetune_scripts_load_their_checkpoint_without_weights(
    tmp_path: Path, command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """litgpt's own CLI, unmodified (``python -m litgpt finetune_lora CKPT ...``), on a
    pythia-14m checkpoint: two optimizer steps; its weights read one tensor at a time through
    Lightning's lazy load (the host peak is the largest tensor, the embedding) and on the GPU."""
    pytest.importorskip("litgpt")
    from dataclasses import asdict

    import yaml
    from litgpt import GPT, Config
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = Config.from_name("pythia-14m")
    ck = tmp_path / "checkpoints" / "EleutherAI" / "pythia-14m"
    ck.mkdir(parents=True)
    model = GPT(cfg)
    torch.save(model.state_dict(), ck / "lit_model.pth")
    (ck / "model_config.yaml").write_text(yaml.dump(asdict(cfg)))
    words = "the a of to and in is it you that".split()
    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "<unk>": 1,
                                      **{w: i + 2 for i, w in enumerate(words)}},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(ck / "tokenizer.json"))
    (ck / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "add_bos_token": False,
         "tokenizer_class": "GPTNeoXTokenizer"}))
    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"instruction": "say it", "input": "",
                                 "output": "the a of to and in is it " * 4}] * 16))
    monkeypatch.chdir(tmp_path)
    args = [command, str(ck), "--data", "JSON", "--data.json_path", str(data),
            "--data.val_split_fraction", "0.25", "--train.max_steps", "2",
            "--train.micro_batch_size", "2", "--train.global_batch_size", "2",
            "--eval.interval", "1000", "--eval.initial_validation", "false",
            "--eval.final_validation", "false", "--devices", "1", "--precision", "bf16-true",
            "--logger_name", "csv", "--out_dir", str(tmp_path / "out")]
    est = estimate_script("litgpt", args, "A100-40GB", module=True)
    assert est.script.steps_run == 2
    weights = {k: v.numel() * v.element_size() for k, v in model.state_dict().items()}
    assert est.host_peak_bytes == max(weights.values())  # one fp32 tensor read at a time
    assert est.peak_requested_bytes > sum(weights.values()) // 2  # bf16 weights on the GPU


def test_a_truncated_torch_save_file_fails_as_torch_load_fails_with_the_file_named(
    tmp_path: Path,
) -> None:
    good = tmp_path / "good.pt"
    torch.save({"w": torch.zeros(64, 64)}, good)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises((RuntimeError, OSError)) as real:  # where it is cut decides which
        torch.load(bad)
    script = tmp_path / "load.py"
    script.write_text(f"import torch\nsd = torch.load({str(bad)!r})\n")
    with pytest.raises(ScriptError) as err:
        estimate_script(str(script), [], "T4")
    msg = str(err.value)
    assert f"raised {type(real.value).__name__} at" in msg
    assert f"torch.load({str(bad)!r})" in msg and "expected a file written by torch.save" in msg
    assert str(real.value).split(":")[0] in msg  # PyTorch's own words


def test_modules_imported_during_an_estimate_keep_no_stand_in(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A module the script imports binds the loaders by name while they are stand-ins; after
    the estimate it holds the originals again (the next estimate patches it again)."""
    import safetensors

    (tmp_path / "myloader.py").write_text(
        "from safetensors import safe_open\nfrom torch import load\n")
    script = tmp_path / "s.py"
    script.write_text("import sys, torch, myloader\n"
                      "print('IN', myloader.safe_open.__name__, myloader.load.__module__,"
                      " file=sys.stderr)\n"
                      "x = torch.ones(4, device='cuda')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "myloader", raising=False)
    for _ in range(2):
        estimate_script(str(script), [], "T4")
        mod = sys.modules["myloader"]
        assert mod.safe_open is safetensors.safe_open and mod.load is torch.load
        assert torch.load.__module__ == "torch.serialization"
    from torchmem.fit.fakegpu._checkpoints import checkpoints_without_weights

    with checkpoints_without_weights():  # scanned once: patched again on the next estimate
        assert mod.safe_open.__name__ == "fake_open" and mod.load is torch.load
