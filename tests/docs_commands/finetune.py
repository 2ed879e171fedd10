"""Fine-tune a downloaded checkpoint (the README's stand-in: the folder it is given is a tiny
Llama-shaped checkpoint whose weights are holes, made by tests/test_docs_examples.py)."""

import sys

import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
model.train()
model.to("cuda")
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
for _ in range(2):
    x = torch.randint(0, model.config.vocab_size, (2, 64), device="cuda")
    model(x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
