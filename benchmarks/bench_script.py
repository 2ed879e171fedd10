"""An unmodified script under the estimate against the same step written as a build function,
side by side in one process (issue 24's speed goal: the script at most 1.5x the build function).

Workloads (each estimated both ways, interleaved, ``--repeats`` times; the minimum wall time
of each is compared, and the peaks must be equal):

  mlp       a 3-layer MLP (width ``--width``, batch ``--batch``) trained with AdamW, printing
            ``loss.item()`` each step; the script loops 1000 steps and is stopped after 2
            optimizer steps, the build function's step runs twice
  trainer   transformers' ``Trainer.train()`` on a 2-layer BERT classifier (hidden 128, 64
            tokens, 32 random rows): the script (``max_steps=4``) stopped after 2 optimizer
            steps, the build function's step a ``Trainer.train()`` with ``max_steps=2``
            (``save_strategy="no"``: a build function cannot save fake weights at the end of
            training, the script is stopped before it would)

Run:  python benchmarks/bench_script.py              (about a minute on our 2 cores)
      python benchmarks/bench_script.py --smoke      (checks that it runs; figures are noise)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from typing import Any

import torch

from torchmem.fit import estimate_script
from torchmem.fit.run._engine import run_once

MLP_SETUP = """
import argparse, torch
p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--width", type=int, default=256)
a, _ = p.parse_known_args()
w = a.width
net = torch.nn.Sequential(torch.nn.Linear(w, 4 * w), torch.nn.GELU(), torch.nn.Linear(4 * w, 4 * w),
                          torch.nn.GELU(), torch.nn.Linear(4 * w, w)).cuda()
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
x = torch.randn(a.batch_size, w, device="cuda")
"""
MLP_STEP = """
opt.zero_grad()
loss = net(x).square().mean()
loss.backward()
opt.step()
print(f"loss {loss.item():.3f}")
"""
#: the script: the set-up, then the step in a loop of 1000
MLP = MLP_SETUP + "for i in range(1000):\n" + textwrap.indent(MLP_STEP.strip(), "    ") + "\n"


def mlp_build(width: int) -> Callable[..., Any]:
    """The script's set-up as build(batch_size), its loop body as the step."""
    step_code = compile(MLP_STEP, "<mlp step>", "exec")

    def build(batch_size: int) -> Callable[[], None]:
        ns: dict[str, Any] = {}
        saved = sys.argv
        sys.argv = ["mlp", "--batch-size", str(batch_size), "--width", str(width)]
        try:
            exec(compile(MLP_SETUP, "<mlp set-up>", "exec"), ns)
        finally:
            sys.argv = saved
        return lambda: exec(step_code, ns)
    return build


TRAINER_SETUP = """
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

def make_trainer(out, max_steps):
    cfg = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=256, max_position_embeddings=64, num_labels=2)
    model = BertForSequenceClassification(cfg)
    rows = [{"input_ids": torch.randint(0, 1000, (64,)),
             "attention_mask": torch.ones(64, dtype=torch.long),
             "labels": torch.tensor(i % 2)} for i in range(32)]
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, max_steps=max_steps,
                             logging_steps=1, report_to="none", dataloader_num_workers=0,
                             save_strategy="no", disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=rows)
"""
TRAINER = TRAINER_SETUP + """
import sys
make_trainer(sys.argv[1], 4).train()
"""


def trainer_build(out: str) -> Callable[..., Any]:
    ns: dict[str, Any] = {}
    exec(compile(TRAINER_SETUP, "<trainer setup>", "exec"), ns)

    def build(batch_size: int) -> Callable[[], None]:
        trainer = ns["make_trainer"](out, 2)
        return lambda: trainer.train()
    return build


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--gpu", default="H100-80GB")
    ap.add_argument("--workloads", default="mlp,trainer")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat")
    a = ap.parse_args()
    if a.smoke:
        a.repeats, a.width, a.batch = 1, 64, 4
    folder = tempfile.mkdtemp(prefix="bench-script-")
    workloads: list[tuple[str, str, list[str], Callable[..., Any], int]] = []
    names = a.workloads.split(",")
    if "mlp" in names:
        path = os.path.join(folder, "mlp.py")
        with open(path, "w") as f:
            f.write(MLP)
        workloads.append(("mlp", path, ["--batch-size", str(a.batch), "--width", str(a.width)],
                          mlp_build(a.width), 2))
    if "trainer" in names:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("trainer: skipped (transformers is not installed)")
        else:
            path = os.path.join(folder, "hf_train.py")
            with open(path, "w") as f:
                f.write(TRAINER)
            out = os.path.join(folder, "out")
            workloads.append(("trainer", path, [out], trainer_build(out), 1))
    print(f"torch {torch.__version__}, {a.gpu}, {a.repeats} interleaved repeats, min wall time")
    print(f"{'workload':<10} {'build function':>15} {'script':>10} {'ratio':>7}  peaks equal")
    worst = 0.0
    for name, path, args, build, steps in workloads:
        times: dict[str, list[float]] = {"build": [], "script": []}
        peaks: dict[str, tuple[int, int]] = {}
        quiet = open(os.devnull, "w")
        for _ in range(a.repeats):
            saved, sys.stdout = sys.stdout, quiet
            try:
                tb, eb = timed(run_once, build, a.batch, a.gpu, steps=steps)
                ts, es = timed(estimate_script, path, args, a.gpu, steps=2, margin=0)
            finally:
                sys.stdout = saved
            times["build"].append(tb)
            times["script"].append(ts)
            peaks["build"] = (eb.peak_allocated_bytes, eb.peak_reserved_bytes)
            peaks["script"] = (es.peak_allocated_bytes, es.peak_reserved_bytes)
        b, s = min(times["build"]), min(times["script"])
        ratio = s / b
        worst = max(worst, ratio)
        print(f"{name:<10} {b:>14.3f}s {s:>9.3f}s {ratio:>6.2f}x  "
              f"{'yes' if peaks['build'] == peaks['script'] else 'no: ' + str(peaks)}")
    verdict = "met" if worst <= 1.5 else "NOT met"
    print(f"goal (script <= 1.5x the build function): {verdict} (worst ratio {worst:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
