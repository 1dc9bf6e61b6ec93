#!/usr/bin/python3
"""Golden data for NF4 with double quantization (tests/unit/device/nf4_test.cpp), written from the
QLoRA paper (Dettmers et al., 2023, section 3 and appendix E) and nothing of Strata's code:

- NF4: 16 levels, the quantiles of N(0, 1) at evenly spaced probabilities with offset 0.9677 (8
  positive, 7 negative, and an exact 0), scaled into [-1, 1]. The paper's float32 values are
  checked here against that derivation (statistics.NormalDist) and then used as they are.
- Blocks of 64 elements: each element divided by its block's absolute maximum (float32) and
  replaced by the index of the nearest level (a tie takes the lower; midpoints in double).
- Double quantization: the blocks' maxima, less their mean (a float64 sum in order, rounded to
  float32), in groups of 256, divided by the group's absolute maximum and replaced by the index of
  the nearest of 256 signed dynamic 8-bit floats (Dettmers' dynamic map: for i = 0..6 the 2^i
  midpoints of linspace(0.1, 1, 2^i + 1) times 10^(i - 6), both signs, then 0 and 1; formed in
  float64, rounded to float32, ascending).
- Packing: codes two a byte, element 2j in the high nibble; then the 8-bit codes; then the group
  scales (float32); then the mean (float32); each part from a 16-byte boundary.
- Decode: block max = code value * group scale + mean (two float32 operations), element = level *
  block max (one float32 product), then rounded to bfloat16 (nearest even).

The inputs are drawn from a formula of float32 operations on splitmix64 bits, which
nf4_test.cpp repeats, so the file need not hold them.

Regenerate with Debian's python3 (torch, CPU):
    /usr/bin/python3 tools/golden/nf4_golden.py tests/data/nf4
"""
import bisect
import json
import os
import statistics
import struct
import sys

import torch

LEVELS = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
          -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
          0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
          0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
M64 = (1 << 64) - 1
CASES = {
    "one": (1, 11),
    "block": (64, 12),
    "zero-block": (130, 13),
    "groups": (16384 + 64 * 3 + 37, 14),
}


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def check_levels():
    """The paper's levels from the normal quantiles (float32 differences only)."""
    nd = statistics.NormalDist()
    offset = 0.9677083
    pos = [nd.inv_cdf(offset + (0.5 - offset) * k / 8) for k in range(8)]
    neg = [-nd.inv_cdf(offset + (0.5 - offset) * k / 7) for k in range(7)]
    values = sorted(pos + neg + [0.0])
    top = max(abs(v) for v in values)
    for want, got in zip([v / top for v in values], LEVELS):
        assert abs(want - got) < 1e-6, (want, got)
    assert all(f32(v) == v for v in LEVELS)


def absmax_code():
    pow10 = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0]
    values = []
    for i in range(7):
        items = 2 ** i + 1
        step = (1.0 - 0.1) / (items - 1)
        for k in range(items - 1):
            lo = 0.1 + k * step
            hi = 0.1 + (k + 1) * step
            mean = (lo + hi) / 2.0
            values.append(pow10[i] * mean)
            values.append(-(pow10[i] * mean))
    values += [0.0, 1.0]
    assert len(values) == 256
    return sorted(f32(v) for v in values)


def splitmix64_at(key, i):
    z = (key + (i + 1) * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def inputs(n, seed):
    """u = (top 24 bits - 2^23) / 2^23, x = 0.05 * u^3 (float32); every 997th element 0.75;
    elements 64..127 zero (a block whose maximum is 0)."""
    top = torch.tensor([(splitmix64_at(seed, i) >> 40) - (1 << 23) for i in range(n)],
                       dtype=torch.float64)
    u = (top / float(1 << 23)).to(torch.float32)
    x = (u * u) * u
    x = x * torch.tensor(0.05, dtype=torch.float32)
    for i in range(0, n, 997):
        x[i] = 0.75
    x[64:128] = 0.0
    return x


def nearest(mids, v):
    return bisect.bisect_left(mids, v)


def align16(x):
    return (x + 15) // 16 * 16


def quantize(x):
    n = x.numel()
    blocks = (n + 63) // 64
    groups = (blocks + 255) // 256
    level_mids = [(LEVELS[j] + LEVELS[j + 1]) / 2.0 for j in range(15)]
    code = absmax_code()
    code_mids = [(code[j] + code[j + 1]) / 2.0 for j in range(255)]
    absmax = torch.zeros(blocks, dtype=torch.float32)
    codes4 = []
    for b in range(blocks):
        blk = x[b * 64:(b + 1) * 64]
        m = blk.abs().max()
        absmax[b] = m
        v = blk / m if m.item() > 0 else torch.zeros_like(blk)
        codes4 += [nearest(level_mids, float(e)) for e in v.tolist()]
    total = 0.0
    for a in absmax.tolist():
        total += a
    mean = torch.tensor(f32(total / blocks), dtype=torch.float32)
    scales = torch.zeros(groups, dtype=torch.float32)
    codes8 = []
    for g in range(groups):
        r = absmax[g * 256:(g + 1) * 256] - mean
        s = r.abs().max()
        scales[g] = s
        v = r / s if s.item() > 0 else torch.zeros_like(r)
        codes8 += [nearest(code_mids, float(e)) for e in v.tolist()]
    at_absmax = align16((n + 1) // 2)
    at_scales = align16(at_absmax + blocks)
    at_mean = at_scales + 4 * groups
    out = bytearray(align16(at_mean + 4))
    for i, c in enumerate(codes4):
        out[i // 2] |= (c << 4) if i % 2 == 0 else c
    out[at_absmax:at_absmax + blocks] = bytes(codes8)
    out[at_scales:at_mean] = struct.pack("<%df" % groups, *scales.tolist())
    out[at_mean:at_mean + 4] = struct.pack("<f", mean.item())

    # Decode.
    code_t = torch.tensor(code, dtype=torch.float32)
    scale_of_block = scales.repeat_interleave(256)[:blocks]
    block_max = code_t[torch.tensor(codes8)] * scale_of_block + mean
    levels = torch.tensor(LEVELS, dtype=torch.float32)
    dq = levels[torch.tensor(codes4)] * block_max.repeat_interleave(64)[:n]
    return bytes(out), dq, block_max


def bits_hex(t, dtype):
    if dtype == torch.float32:
        return "".join("%08x" % v for v in t.view(torch.int32).tolist() for v in [v & 0xFFFFFFFF])
    return "".join("%04x" % (v & 0xFFFF) for v in t.to(torch.bfloat16).view(torch.int16).tolist())


def main(out_dir):
    check_levels()
    os.makedirs(out_dir, exist_ok=True)
    result = {"absmax_code": bits_hex(torch.tensor(absmax_code(), dtype=torch.float32),
                                      torch.float32), "cases": {}}
    for name, (n, seed) in CASES.items():
        x = inputs(n, seed)
        packed, dq, block_max = quantize(x)
        case = {"n": n, "seed": seed, "packed": packed.hex(),
                "block_max": bits_hex(block_max, torch.float32),
                "bf16": bits_hex(dq, torch.bfloat16)}
        if n <= 1024:
            case["f32"] = bits_hex(dq, torch.float32)
        # How far the decode is from the input, for the loss-bound arithmetic in the tests.
        case["max_abs_error"] = float((dq - x).abs().max())
        result["cases"][name] = case
    with open(os.path.join(out_dir, "nf4.json"), "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/nf4")
