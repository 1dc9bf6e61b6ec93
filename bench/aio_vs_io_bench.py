"""strata.io.AIOHandle against `strata io-bench` on the same directory, alternated run by run
(A B B A A B ...) because the drive's speed swings between runs: a pinned tensor of --size bytes
written and read back through AIOHandle (one request, split into --block-size chunks, --qd in
flight on one io_uring ring) over a file whose blocks a first write allocated, and io-bench's
write and read (over its preallocated swap file) of the same size, block size, queue
depth and ring count. Reports each's median GB/s and the medians of the pairs' ratios.

    PYTHONPATH=build/python /usr/bin/python3 bench/aio_vs_io_bench.py --dir /path/on/nvme
        [--size 1GiB] [--block-size 1MiB] [--qd 32] [--pairs 5] [--strata build/strata]
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import tempfile
import time

import torch

import strata
from strata.io import AIOHandle

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def size(text):
    for unit, scale in UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def aio_run(handle, tensor, path):
    t0 = time.perf_counter()
    handle.sync_pwrite(tensor, path)
    t1 = time.perf_counter()
    handle.sync_pread(tensor, path)
    t2 = time.perf_counter()
    n = tensor.numel()
    return n / (t1 - t0) / 1e9, n / (t2 - t1) / 1e9


def io_bench_run(cli, directory, a):
    out = subprocess.run([cli, "io-bench", "--path", directory, "--size", str(a.size),
                          "--block-size", str(a.block_size), "--queue-depth", str(a.qd),
                          "--threads", "1", "--json"], check=True, capture_output=True,
                         text=True).stdout
    rates = {}
    for line in out.splitlines():
        if not line.startswith("{"):
            continue
        point = json.loads(line)
        rates[point["op"]] = point["MBps"] / 1e3
    return rates["write"], rates["read"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--size", type=size, default=1 << 30)
    ap.add_argument("--block-size", type=size, default=1 << 20)
    ap.add_argument("--qd", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--strata", default=str(pathlib.Path(__file__).resolve().parents[1] /
                                            "build" / "strata"))
    a = ap.parse_args()
    handle = AIOHandle(block_size=a.block_size, queue_depth=a.qd, threads=1)
    tensor = handle.new_pinned_tensor(a.size, torch.uint8)
    tensor.copy_(torch.randint(0, 256, (a.size,), dtype=torch.uint8))
    path = os.path.join(a.dir, f"strata-aio-bench-{os.getpid()}.bin")
    # Warm-up: the file's blocks allocated once, as io-bench's swap file is preallocated (the
    # later writes overwrite them, as io-bench's do).
    aio_run(handle, tensor, path)
    rows = []
    try:
        for i in range(a.pairs):
            # Each goes first in every other pair: what the run before leaves the drive doing
            # (io-bench removes its 1 GiB swap file as it ends) falls on both alike.
            if i % 2 == 0:
                aw, ar = aio_run(handle, tensor, path)
                bw, br = io_bench_run(a.strata, a.dir, a)
            else:
                bw, br = io_bench_run(a.strata, a.dir, a)
                aw, ar = aio_run(handle, tensor, path)
            rows.append((aw, ar, bw, br))
    finally:
        os.remove(path)
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    print(f"strata {strata.__version__}: AIOHandle ({handle.engine}, block {a.block_size}, "
          f"queue depth {a.qd}, 1 ring) against strata io-bench, {a.size} bytes in {a.dir}, "
          f"{a.pairs} pairs")
    print(f"  write GB/s: AIOHandle {med(0):.2f}, io-bench {med(2):.2f}; AIOHandle / io-bench "
          f"{statistics.median(r[0] / r[2] for r in rows):.2f} "
          f"({min(r[0] / r[2] for r in rows):.2f}-{max(r[0] / r[2] for r in rows):.2f})")
    print(f"  read  GB/s: AIOHandle {med(1):.2f}, io-bench {med(3):.2f}; AIOHandle / io-bench "
          f"{statistics.median(r[1] / r[3] for r in rows):.2f} "
          f"({min(r[1] / r[3] for r in rows):.2f}-{max(r[1] / r[3] for r in rows):.2f})")


if __name__ == "__main__":
    main()
