"""The guides' ``infer.py``: inference only, no optimizer (an estimate runs it to its end)."""

import torch

model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
dev = "cuda" if torch.cuda.is_available() else "cpu"
model = model.to(dev).eval()
with torch.no_grad():
    for _ in range(3):
        y = model(torch.randn(8, 64, device=dev))
print(tuple(y.shape))
