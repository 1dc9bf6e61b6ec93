#!/usr/bin/python3
"""Forward + backward of a LLaMA model in PyTorch on the CPU, the side of bench/cpu_vs_torch.sh
that Strata is compared with: Debian's python3-torch, eager, plain softmax attention (as
transformers' "eager" LlamaAttention), random weights, one batch of random tokens, cross-entropy
over every position. Prints one JSON line: the median seconds of the last three of four steps.

    /usr/bin/python3 bench/torch_llama_step.py CONFIG_JSON DTYPE(fp32|bf16) THREADS BATCH SEQ
"""
import json
import math
import statistics
import sys
import time

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, self.nh, self.nkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        self.d = h // self.nh
        f = c["intermediate_size"]
        self.ln1, self.ln2 = RMSNorm(h, c["rms_norm_eps"]), RMSNorm(h, c["rms_norm_eps"])
        self.q = nn.Linear(h, self.nh * self.d, bias=False)
        self.k = nn.Linear(h, self.nkv * self.d, bias=False)
        self.v = nn.Linear(h, self.nkv * self.d, bias=False)
        self.o = nn.Linear(self.nh * self.d, h, bias=False)
        self.gate, self.up = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.down = nn.Linear(f, h, bias=False)

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        a = self.ln1(x)
        q = self.q(a).view(b, s, self.nh, self.d).transpose(1, 2)
        k = self.k(a).view(b, s, self.nkv, self.d).transpose(1, 2)
        v = self.v(a).view(b, s, self.nkv, self.d).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.nh // self.nkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        p = torch.softmax(q @ k.transpose(2, 3) / math.sqrt(self.d) + mask, dim=-1)
        x = x + self.o((p @ v).transpose(1, 2).reshape(b, s, -1))
        m = self.ln2(x)
        return x + self.down(nn.functional.silu(self.gate(m)) * self.up(m))


class Llama(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.blocks = nn.ModuleList(Block(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)

    def forward(self, ids, targets):
        s, d = ids.shape[1], self.c["hidden_size"] // self.c["num_attention_heads"]
        inv = 1.0 / (self.c.get("rope_theta", 10000.0) ** (torch.arange(0, d, 2).float() / d))
        f = torch.outer(torch.arange(s).float(), inv)
        emb = torch.cat((f, f), -1)
        x = self.embed(ids)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        mask = torch.triu(torch.full((s, s), float("-inf")), 1).to(x.dtype)
        for blk in self.blocks:
            x = blk(x, cos, sin, mask)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]).float(),
                                           targets.view(-1))


def main():
    c, dtype, threads = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    batch, seq = int(sys.argv[4]), int(sys.argv[5])
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = Llama(c)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    ids = torch.randint(0, c["vocab_size"], (batch, seq))
    targets = torch.randint(0, c["vocab_size"], (batch, seq))
    times = []
    for _ in range(4):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        model(ids, targets).backward()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"torch": torch.__version__, "dtype": dtype, "threads": threads,
                      "seconds": statistics.median(times[1:]), "steps": times}))


if __name__ == "__main__":
    main()
