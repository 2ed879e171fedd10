"""``--what-if`` from the page's vanilla run alone: the published bert-large ``Trainer`` variants
(a V100 16 GB, transformers docs 2022) reproduced by torchmem's levers, beside the figures the
page printed and the variants estimated directly.

The vanilla run of ``tests/public_truth_cases.py`` (batch 4, AdamW) is estimated once with
``what_if=[...]``: each of the page's other Trainer variants is a lever or a combination of
levers applied by torchmem to the vanilla run's model, optimizer and ``Trainer``
(``grad_accumulation_4`` for ``per_device_train_batch_size=1, gradient_accumulation_steps=4``,
``activation_checkpointing``, ``fp16_autocast``, ``adafactor``, ``optimizer_8bit``; see
``public_truth_cases.WHAT_IF``). Goal (issue 25): each within 5% of the published figure, as
the variants estimated directly are (``benchmarks/bench_public_truth.py``). Each row's figure is
its peak reserved memory plus the CUDA context the page measured (1343 MiB).

Run:  python benchmarks/bench_whatif_public.py [VARIANT ...] [--max-steps N]
      (about 10 minutes on our 2 cores for the eight)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import public_truth_cases as cases  # noqa: E402


def main(argv: list[str]) -> int:
    """Print each variant's what-if figure beside the published one, and whether the worst is
    within the 5% goal (with ``--max-steps 1`` the figures are not the page's: a smoke run);
    1 when the goal is missed in a run at the variants' own steps.

    Example:
        >>> main(["--help"])  # doctest: +SKIP
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="*", choices=[[], *cases.WHAT_IF], default=[],
                    help="variants to reproduce (default: all eight)")
    ap.add_argument("--max-steps", type=int, default=None,
                    help="optimizer steps per run (default: the variants' own, two)")
    a = ap.parse_args(argv)
    names = list(a.variants) or list(cases.WHAT_IF)
    t = time.perf_counter()
    e = cases.what_if(names, progress=lambda m: print(
        f"  [{time.perf_counter() - t:6.0f} s] {m}", file=sys.stderr, flush=True),
        max_steps=a.max_steps)
    print(f"vanilla (as written): {cases.estimated_mib(e):8.0f} MiB, published "
          f"{cases.VARIANTS['vanilla'].published_mib}")
    print(f"{'variant':<27} {'levers':<70} {'what-if':>8} {'published':>9}  error")
    worst = 0.0
    for v in names:
        got, pub = cases.what_if_mib(e, v), cases.VARIANTS[v].published_mib
        err = (got - pub) / pub
        worst = max(worst, abs(err))
        print(f"{v:<27} {cases.WHAT_IF[v]:<70} {got:8.0f} {pub:9d}  {err:+6.2%}")
    verdict = "met" if worst <= 0.05 else "NOT met"
    print(f"worst {worst:.2%} (goal 5%: {verdict}); {time.perf_counter() - t:.0f} s for the "
          "what-if")
    # a run at the variants' own steps is judged (exit 1 when the goal is missed); a smoke run
    # with --max-steps is not the page's run
    return 0 if worst <= 0.05 or a.max_steps is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
