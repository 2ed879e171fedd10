"""Values read from tensors during an estimate are answered by the documented policy and listed
(``Estimate.assumed_values``); ``strict_values=True`` refuses them. Ground truth: the same step
without the read (a value read on the host allocates nothing on the device, so the peaks must be
equal), the real H100 run of the step that reads its own loss
(``tests/data/gpu/gpt_phase_readings``), the source lines of the reads and a meta-device count
of the parameters."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

import gpu_cases
import torchmem
from torchmem.cli import main
from torchmem.errors import InvalidInputError
from torchmem.fit.fakegpu._values import ValueReads


def _mlp_build(read: str):
    """An SGD step that logs a value read from tensors (``read`` is a Python expression over
    ``loss``, ``out``, ``mask``)."""
    def build(batch: int):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        x = torch.randn(batch, 64, device="cuda")
        net.to("cuda")
        # a mask computed from floats: its values are unknown (a mask of ones made directly
        # would carry its real values: tests/test_scripts_as_they_are.py)
        mask = torch.randn(batch, device="cuda") > -100
        seen: list = []

        def step() -> None:
            out = net(x)
            loss = out.square().mean()
            loss.backward()
            seen.append(eval(read, {"torch": torch}, {"loss": loss, "out": out, "mask": mask}))
            opt.step()
            opt.zero_grad()
        step.seen = seen  # type: ignore[attr-defined]
        return step
    return build


@pytest.mark.parametrize("read,value", [
    ("loss.item()", 1.0),
    ("float(loss)", 1.0),
    ("bool(torch.isnan(loss).any())", False),
    ("bool(torch.isfinite(out).all())", True),
    ("int(mask.sum())", 16),                       # a count over a mask: all ones
    ("(mask.sum() == mask.numel()).item()", True),  # transformers' fast_all
    ("bool(loss > 1e6)", False),
    ("out.argmax().item()", 1),
])
def test_reads_are_answered_listed_and_do_not_change_the_peak(read, value):
    base = torchmem.estimate(_mlp_build("None"), gpu="T4", batch_size=16, margin=0, default_device="cuda")
    est = torchmem.estimate(_mlp_build(read), gpu="T4", batch_size=16, margin=0, default_device="cuda")
    # a value read on the host allocates nothing on the device
    assert est.peak_allocated_bytes == base.peak_allocated_bytes
    assert est.peak_requested_bytes == base.peak_requested_bytes
    (a,) = est.assumed_values
    assert a["value"] == value and type(a["value"]) is type(value)
    assert a["where"].endswith(f"{__file__.rsplit('/', 1)[-1]}:{_READ_LINE}")
    assert a["count"] == est.steps == 2
    assert base.assumed_values == []


# the line of ``eval(read, ...)`` in _mlp_build's step (where the read happens)
_READ_LINE = next(i for i, line in enumerate(open(__file__).read().splitlines(), 1)
                  if "seen.append(eval(read" in line)


def test_tolist_gets_stand_ins_of_the_right_shape():
    def build(batch: int):
        x = torch.randn(batch, 3, device="cuda")
        got: list = []

        def step() -> None:
            got.append(((x > 0).tolist(), x.sum().tolist()))
        step.got = got  # type: ignore[attr-defined]
        return step
    est = torchmem.estimate(build, gpu="T4", batch_size=2, steps=1, default_device="cuda")
    values = sorted((a["op"], a["value"], a["count"]) for a in est.assumed_values)
    # (x > 0).tolist() reads its 2 x 3 elements one by one; x.sum().tolist() one float
    assert values == [("aten.sum.default", 1.0, 1), ("aten.unbind.int", False, 6)]


def test_strict_values_refuses_reads_and_names_the_line():
    with pytest.raises(InvalidInputError, match=r"reads a tensor's value") as ei:
        torchmem.estimate(_mlp_build("loss.item()"), gpu="T4", batch_size=4, strict_values=True, default_device="cuda")
    assert f":{_READ_LINE}" in str(ei.value)


def test_control_flow_on_a_read_follows_the_stand_in_and_is_listed():
    """An early stop on the loss: the stand-in (1.0) does not stop; the line is listed."""
    def build(batch: int):
        w = torch.nn.Parameter(torch.randn(batch, 8, device="cuda"))
        ran: list = []

        def step() -> None:
            loss = (w ** 2).mean()
            if loss.item() < 0.5:       # early stop: never taken with the stand-in
                return
            ran.append(torch.zeros(1024, device="cuda"))  # 4 KiB kept per step that goes on
        return step
    est = torchmem.estimate(build, gpu="T4", batch_size=2, steps=3, margin=0, default_device="cuda")
    (a,) = est.assumed_values
    assert a["value"] == 1.0 and a["count"] == 3
    assert est.by_category.get("temporary", 0) + est.by_category.get("other", 0) >= 3 * 4096


def test_the_real_gpu_step_that_reads_its_loss():
    """tests/data/gpu/gpt_phase_readings: the H100 ran the GPT step that reads ``loss.item()``;
    the estimate now runs it, within the goals, and lists the read."""
    name = "gpt_phase_readings"
    st = gpu_cases.recorded(name)["stats"]
    est = gpu_cases.estimate_case(name)
    real_alloc, real_res = st["allocated_bytes.all.peak"], st["reserved_bytes.all.peak"]
    assert abs(est.peak_allocated_bytes - real_alloc) <= 0.01 * real_alloc
    assert abs(est.peak_reserved_bytes - real_res) <= 0.05 * real_res
    reads = [a for a in est.assumed_values if "gpu_cases.py" in a["where"]]
    assert reads and reads[0]["value"] == 1.0 and reads[0]["count"] == gpu_cases.CASES[name].steps


def test_an_unmodified_transformers_trainer_runs_and_lists_its_reads():
    """``Trainer.train()`` logs the loss and the gradient norm (value reads inside transformers):
    it runs under the estimate, the reads are listed at transformers' lines, and the parameters
    are the model's (counted on a meta copy)."""
    pytest.importorskip("transformers")
    name = "hf_trainer"
    est = gpu_cases.estimate_case(name)
    wheres = {a["where"].rsplit("/", 1)[-1].split(":")[0] for a in est.assumed_values}
    assert "trainer.py" in wheres
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**{k: v for k, v in gpu_cases.HF_LLAMA.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    # the parameter category holds the module's buffers too (here the rotary inv_freq pair)
    state = [*model.parameters(), *model.buffers()]
    assert est.by_category["parameter"] == sum(t.numel() * t.element_size() for t in state)


def test_cli_lists_assumed_values_and_refuses_them_with_strict(tmp_path, capsys):
    path = tmp_path / "train_log.py"
    path.write_text(textwrap.dedent("""
        import torch
        def build(batch):
            net = torch.nn.Linear(32, 32).cuda()
            x = torch.randn(batch, 32, device="cuda")
            def step():
                loss = net(x).square().mean()
                loss.backward()
                print(f"loss {loss.item():.3f}")
            return step
    """))
    assert main(["estimate", f"{path}:build", "--gpu", "T4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["assumed_values"] == [{"where": f"{path}:9", "op": "aten.mean.default",
                                    "value": 1.0, "count": 2}] or (
        d["assumed_values"][0]["where"].endswith("train_log.py:9")
        and d["assumed_values"][0]["value"] == 1.0 and d["assumed_values"][0]["count"] == 2)
    assert main(["estimate", f"{path}:build", "--gpu", "T4"]) == 0
    out = capsys.readouterr().out
    assert "values assumed where the step read tensors" in out and "train_log.py:9" in out
    assert main(["estimate", f"{path}:build", "--gpu", "T4", "--strict-values"]) == 2
    assert "reads a tensor's value" in capsys.readouterr().err


def test_policy_table():
    """The documented stand-ins, one per rule, on fake tensors."""
    from torch._subclasses import FakeTensorMode

    v = ValueReads()
    with FakeTensorMode():
        m = torch.ones(3, 4, dtype=torch.bool)
        f = torch.ones(3, 4)
        cases = [
            (torch.ops.aten.all.default, (m,), True),
            (torch.ops.aten.any.default, (m,), False),
            (torch.ops.aten.sum.default, (m,), 12),
            (torch.ops.aten.sum.default, (f,), 1.0),
            (torch.ops.aten.mean.default, (f,), 1.0),
        ]
        for op, args, want in cases:
            out = op(*args)
            v.note_output(op, out, args)
            assert v.answer(out) == want, op
        assert v.answer(torch.zeros((), dtype=torch.int32)) == 1
        assert v.answer(m[0, 0] == m[0, 1]) is False


def _infer_build(read: str):
    """A forward pass under ``torch.inference_mode()`` that reads a value (litgpt's generate
    reads each new token with ``token.item()`` so): ``item()`` and ``bool()`` reach the
    estimate whole there, not as ``_local_scalar_dense``."""
    def build(batch: int):
        net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                  torch.nn.Linear(256, 8)).to("cuda")
        x = torch.randn(batch, 64, device="cuda")

        def step() -> None:
            with torch.inference_mode():
                out = net(x)
                eval(read, {"torch": torch}, {"out": out})
        return step
    return build


@pytest.mark.parametrize("read,value", [
    ("out.sum().item()", 1.0),
    ("bool(out.max() > 1e6)", False),
    ("out.argmax().item()", 1),
    ("None", None),
])
def test_reads_under_inference_mode_are_answered_as_with_autograd(read, value):
    base = torchmem.estimate(_infer_build("None"), gpu="T4", batch_size=16, margin=0, steps=1)
    est = torchmem.estimate(_infer_build(read), gpu="T4", batch_size=16, margin=0, steps=1)
    assert est.peak_requested_bytes == base.peak_requested_bytes
    assert [a["value"] for a in est.assumed_values] == ([] if value is None else [value])
    if value is not None:
        # the same read with autograd on is answered with the same stand-in
        (a,) = torchmem.estimate(_mlp_build(read.replace("out.sum()", "loss")), gpu="T4",
                                 batch_size=16, margin=0, default_device="cuda").assumed_values
        assert a["value"] == value


def test_a_gradient_scalers_finite_gradients_are_listed_once_per_step():
    """``GradScaler.step`` skips the optimizer when a gradient was inf/NaN; fake gradients
    have none, so the estimate steps: an assumption, listed at the line of each step."""
    import torchmem

    def build(batch_size):
        net = torch.nn.Linear(64, 64).cuda()
        opt = torch.optim.AdamW(net.parameters())
        scaler = torch.amp.GradScaler("cuda")
        x = torch.randn(batch_size, 64, device="cuda")

        def step():
            with torch.autocast("cuda", dtype=torch.float16):
                loss = net(x).square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return step

    e = torchmem.estimate(build, gpu="T4", batch_size=8, steps=3)
    found = [a for a in e.assumed_values if a["op"] == "GradScaler found_inf"]
    assert [(a["value"], a["count"]) for a in found] == [(0.0, 3)], e.assumed_values
    assert e.by_category["optimizer_state"] == 2 * (64 * 64 + 64) * 4  # AdamW stepped
