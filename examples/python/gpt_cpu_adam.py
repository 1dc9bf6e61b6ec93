"""A small GPT-style model in plain PyTorch, its parameters on the CPU, trained with Strata's
CPU Adam (strata.optim.CPUAdam) and 8-bit moments: the one line a PyTorch script changes.

    PYTHONPATH=build/python /usr/bin/python3 examples/python/gpt_cpu_adam.py [--steps 100]
        [--state-dtype int8|bf16|fp32] [--save state.pt]

It learns the bytes of the GPL's text (examples/data/gpl-3.0.txt) and prints the loss every
20 steps, from about 5.6 (a uniform guess over 256 bytes is 5.55) to about 2.5 at step 100.
"""

import argparse
import math
import pathlib
import time

import torch
from torch import nn

from strata.optim import CPUAdam

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "gpl-3.0.txt"


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Gpt(nn.Module):
    def __init__(self, vocab=256, dim=128, heads=4, layers=4, context=128):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        x = self.embed(tokens) + self.position[:t]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--save", default="", help="a file for the model's and optimizer's state")
    ap.add_argument("--state-dtype", default="int8", choices=["fp32", "bf16", "int8"])
    a = ap.parse_args()
    torch.manual_seed(0)
    data = torch.tensor(list(DATA.read_bytes()), dtype=torch.long)
    model = Gpt(context=a.context)
    # The one line: DeepSpeedCPUAdam's arguments, Strata's 8-bit moments.
    opt = CPUAdam(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01,
                  state_dtype=a.state_dtype)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params} parameters, CPUAdam on {opt.simd} with {opt.threads} threads, moments "
          f"{a.state_dtype}")
    start = time.perf_counter()
    for step in range(1, a.steps + 1):
        starts = torch.randint(0, data.numel() - a.context - 1, (a.batch,))
        batch = torch.stack([data[s:s + a.context + 1] for s in starts.tolist()])
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step == 1 or step % 20 == 0 or step == a.steps:
            print(f"step {step}/{a.steps} | loss {loss.item():.4f} | "
                  f"{time.perf_counter() - start:.1f} s")
        if not math.isfinite(loss.item()):
            raise SystemExit("the loss is not finite")
    if a.save:
        # The optimizer's state in torch's layout (every moment widened to fp32): what
        # torch.optim.AdamW or CPUAdam.load_state_dict reads back.
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, a.save)
        print(f"saved {a.save}")


if __name__ == "__main__":
    main()
