"""A small CUDA training run for the GPU check of the CLI (scripts/gpu/check.sh).

Trains a 4-layer MLP on the GPU for a few AdamW steps; with an output path as its argument it
also records the allocator history with torchmem.record_history and writes the snapshot there.

Run:  python scripts/gpu/cli_workload.py [snapshot.pickle]
"""

import sys

import torch

import torchmem


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("cli_workload: needs a CUDA GPU (torch.cuda.is_available() is False)")
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU())
                                  for _ in range(4))).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(512, 2048, device="cuda")
    rec = torchmem.record_history(device="cuda") if len(sys.argv) > 1 else None
    if rec is not None:
        rec.start()
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    if rec is not None:
        torchmem.write_snapshot(sys.argv[1], rec.stop())
    print("peak allocated", torch.cuda.max_memory_allocated())


if __name__ == "__main__":
    main()
