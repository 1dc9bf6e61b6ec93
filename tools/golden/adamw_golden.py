#!/usr/bin/python3
"""Golden data for tests/unit/optim/adamw_golden_test.cpp: several steps of torch.optim.AdamW
(decoupled weight decay) and torch.optim.Adam with weight_decay (L2 added to the gradient,
Strata's adamw_mode=false), single-tensor path (foreach=False), float32.

Every float32 is stored as its IEEE-754 bit pattern (an unsigned integer), so the file is exact
and small. Cases:
  adamw_exact_hyper  hyperparameters exactly representable in float32, and 1 - beta too, so the
                     only differences left are torch's own arithmetic (its vectorized add uses FMA)
  adamw_defaults     lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2: torch's defaults
  adam_l2            torch.optim.Adam(weight_decay=0.1)

Regenerate with Debian's python3 (torch 1.13, CPU), not a pyenv python:
    /usr/bin/python3 tools/golden/adamw_golden.py tests/data/adamw_golden.json
"""
import json
import struct
import sys

import torch

N = 50          # not a multiple of 16: torch's scalar tail runs too
STEPS = 4
SEED = 1234

CASES = [
    dict(name="adamw_exact_hyper", optimizer="AdamW", lr=2.0**-7, betas=(0.875, 1.0 - 2.0**-10),
         eps=2.0**-20, weight_decay=0.0625),
    dict(name="adamw_defaults", optimizer="AdamW", lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
         weight_decay=1e-2),
    dict(name="adam_l2", optimizer="Adam", lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
         weight_decay=0.1),
]


def bits(t):
    """float32 tensor -> list of uint32 bit patterns."""
    raw = t.detach().contiguous().numpy().tobytes()
    return list(struct.unpack("<%dI" % t.numel(), raw))


def cpu_capability():
    """The ATen kernel set in use ("AVX2", "AVX512", "DEFAULT"): its vectorized add uses FMA."""
    for line in torch.__config__.show().splitlines():
        if "CPU capability usage:" in line:
            return line.split(":", 1)[1].strip()
    return "unknown"


def run_case(case, gen):
    param0 = torch.randn(N, generator=gen, dtype=torch.float32)
    # Gradients over several decades so the moments see small and large values.
    grads = [torch.randn(N, generator=gen, dtype=torch.float32) *
             torch.pow(10.0, torch.empty(N).uniform_(-3, 1, generator=gen)).float()
             for _ in range(STEPS)]
    p = torch.nn.Parameter(param0.clone())
    kwargs = dict(lr=case["lr"], betas=case["betas"], eps=case["eps"],
                  weight_decay=case["weight_decay"], foreach=False)
    opt = (torch.optim.AdamW if case["optimizer"] == "AdamW" else torch.optim.Adam)([p], **kwargs)
    steps = []
    for g in grads:
        p.grad = g.clone()
        opt.step()
        st = opt.state[p]
        steps.append(dict(grad=bits(g), param=bits(p.data), exp_avg=bits(st["exp_avg"]),
                          exp_avg_sq=bits(st["exp_avg_sq"])))
    return dict(name=case["name"], optimizer=case["optimizer"],
                adamw_mode=case["optimizer"] == "AdamW", lr=case["lr"], beta1=case["betas"][0],
                beta2=case["betas"][1], eps=case["eps"], weight_decay=case["weight_decay"], n=N,
                param=bits(param0), steps=steps)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/data/adamw_golden.json"
    gen = torch.Generator().manual_seed(SEED)
    data = dict(generator="tools/golden/adamw_golden.py", torch=torch.__version__,
                cpu_capability=cpu_capability(),
                format="float32 values are IEEE-754 bit patterns (uint32)",
                cases=[run_case(c, gen) for c in CASES])
    with open(out, "w") as f:
        json.dump(data, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
