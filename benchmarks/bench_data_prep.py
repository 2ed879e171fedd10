"""Data preparation under the estimate against the same script run plainly, in one process
(issue 41's goal: data preparation like Lightning's WikiText2 demo within 2x of its plain time).

The script tokenizes a text corpus the way Lightning's ``WikiText2`` demo and PyTorch's
word-language-model example do (a dictionary of words, then one ``torch.tensor(ids)`` per line,
``.type(torch.int64)``, ``torch.cat``), then trains an embedding and a linear head on batches
sliced from the token stream. The corpus is generated (seeded): ``--lines`` lines (36,718, as
WikiText-2's training split) of 0 to 120 words from a 30,000-word vocabulary. The script times
its own preparation (``prep S s`` on stderr); the plain run and the estimate (``T4``, stopped
after 2 optimizer steps) alternate ``--repeats`` times and the minimum of each is compared.

The host memory the estimate reports is checked against arithmetic: while ``torch.cat`` runs,
every line's tensor and the concatenation are live, 2 x 8 bytes per token, and nothing else is
on the host (the model is made on the GPU).

Run:  python benchmarks/bench_data_prep.py            (about a minute on our 2 cores)
      python benchmarks/bench_data_prep.py --smoke    (checks that it runs; figures are noise)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import runpy
import sys
import tempfile
import textwrap

SCRIPT = textwrap.dedent("""
    import os, sys, time, torch

    def tokenize(path):
        word2idx = {}
        with open(path, encoding="utf8") as f:
            for line in f:
                for word in line.split() + ["<eos>"]:
                    word2idx.setdefault(word, len(word2idx))
        idss = []
        with open(path, encoding="utf8") as f:
            for line in f:
                ids = [word2idx[w] for w in line.split() + ["<eos>"]]
                idss.append(torch.tensor(ids).type(torch.int64))
        return torch.cat(idss), word2idx

    t0 = time.perf_counter()
    data, vocab = tokenize(os.environ["CORPUS"])
    print(f"prep {time.perf_counter() - t0:.4f} s {len(data)} tokens", file=sys.stderr)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    V, T, B = len(vocab), 35, 16
    emb = torch.nn.Embedding(V, 64, device=dev)
    head = torch.nn.Linear(64, V, device=dev)
    opt = torch.optim.SGD(list(emb.parameters()) + list(head.parameters()), lr=0.1)
    for i in range(3):
        x = torch.stack([data[j * T:(j + 1) * T] for j in range(i * B, (i + 1) * B)]).to(dev)
        y = torch.stack([data[j * T + 1:(j + 1) * T + 1] for j in range(i * B, (i + 1) * B)]).to(dev)
        loss = torch.nn.functional.cross_entropy(head(emb(x)).view(-1, V), y.view(-1))
        loss.backward(); opt.step(); opt.zero_grad()
""")


def corpus(path: str, lines: int) -> None:
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(30_000)]
    with open(path, "w", encoding="utf8") as f:
        for _ in range(lines):
            n = rng.choice([0, 0, 5, 20, 60, 120])
            f.write(" ".join(rng.choice(vocab) for _ in range(n)) + "\n")


def prep_seconds(err: str) -> tuple[float, int]:
    line = next(ln for ln in err.splitlines() if ln.startswith("prep "))
    parts = line.split()
    return float(parts[1]), int(parts[3])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lines", type=int, default=36_718)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="2,000 lines, one repeat")
    a = ap.parse_args()
    if a.smoke:
        a.lines, a.repeats = 2_000, 1
    from torchmem.fit import estimate_script

    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "prep.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        os.environ["CORPUS"] = os.path.join(d, "train.txt")
        corpus(os.environ["CORPUS"], a.lines)
        plain, fake = [], []
        est = None
        tokens = 0
        for r in range(a.repeats):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                runpy.run_path(script, run_name="__main__")
            s, tokens = prep_seconds(err.getvalue())
            plain.append(s)
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                est = estimate_script(script, [], "T4")
            fake.append(prep_seconds(err.getvalue())[0])
            print(f"  repeat {r + 1}/{a.repeats}: plain {plain[-1]:.2f} s, under the estimate "
                  f"{fake[-1]:.2f} s", file=sys.stderr)
        assert est is not None and est.script.steps_run == 2
        expected = 2 * 8 * tokens
        print(f"data preparation of {a.lines:,} lines ({tokens:,} tokens), min of {a.repeats}:")
        print(f"  plain run            {min(plain):8.2f} s")
        print(f"  under the estimate   {min(fake):8.2f} s   ({min(fake) / min(plain):.2f}x the "
              "plain run)")
        print(f"  host peak: estimate {est.host_peak_bytes:,} B, arithmetic (every line's "
              f"tensor and their concatenation) {expected:,} B")
        if est.host_peak_bytes != expected:
            print("  !! the host peaks differ", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
