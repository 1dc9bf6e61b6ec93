"""strata.optim.CPUAdam against torch.optim.AdamW (foreach) on the same CPU parameters, one step
each in turn (A B A B ...) in one process, so both see the same machine state. Reports each's
median step time and the median of the pairs' ratios torch / strata.

    PYTHONPATH=build/python /usr/bin/python3 bench/cpu_adam_vs_torch.py [--elems 16777216]
        [--pairs 9] [--state fp32|bf16|int8] [--dtype float32|bfloat16] [--torch-threads N]
"""

import argparse
import os
import statistics
import time

import torch

import strata
from strata.optim import CPUAdam


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--elems", type=int, default=1 << 24)
    ap.add_argument("--tensors", type=int, default=16, help="the elements split over this many")
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--state", default="fp32", choices=["fp32", "bf16", "int8"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--torch-threads", type=int, default=os.cpu_count(),
                    help="torch's intra-op threads (its default may be fewer than the cores)")
    a = ap.parse_args()
    torch.set_num_threads(a.torch_threads)
    dtype = getattr(torch, a.dtype)
    each = a.elems // a.tensors

    def params():
        g = torch.Generator().manual_seed(0)
        ps = [torch.randn(each, generator=g).to(dtype).requires_grad_() for _ in range(a.tensors)]
        for p in ps:
            p.grad = torch.randn(each, generator=g).mul_(1e-3).to(dtype)
        return ps

    ours, theirs = params(), params()
    opt = CPUAdam(ours, lr=1e-4, weight_decay=0.01, state_dtype=a.state)
    torch_opt = torch.optim.AdamW(theirs, lr=1e-4, weight_decay=0.01, foreach=True)
    opt.step()  # first steps: state allocated and touched, the engine's calibration
    torch_opt.step()
    ours_ms, theirs_ms, ratios = [], [], []
    for _ in range(a.pairs):
        t0 = time.perf_counter()
        torch_opt.step()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        theirs_ms.append((t1 - t0) * 1e3)
        ours_ms.append((t2 - t1) * 1e3)
        ratios.append(theirs_ms[-1] / ours_ms[-1])
    print(f"strata {strata.__version__} CPUAdam ({opt.simd}, {opt.threads} threads, "
          f"state {a.state}) vs torch {torch.__version__} AdamW foreach, torch threads "
          f"{torch.get_num_threads()}: {a.elems} {a.dtype} parameters in {a.tensors} tensors, "
          f"{a.pairs} pairs")
    print(f"  torch AdamW   median {statistics.median(theirs_ms):8.1f} ms "
          f"(min {min(theirs_ms):.1f}, max {max(theirs_ms):.1f})")
    print(f"  strata CPUAdam median {statistics.median(ours_ms):7.1f} ms "
          f"(min {min(ours_ms):.1f}, max {max(ours_ms):.1f})")
    print(f"  torch / strata: median {statistics.median(ratios):.2f} "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f})")


if __name__ == "__main__":
    main()
