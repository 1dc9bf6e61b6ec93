#!/usr/bin/python3
"""Golden learning rates for DeepSpeed's schedulers (tests/unit/train/deepspeed_config_test.cpp): the lr
of every step of WarmupLR, WarmupDecayLR and WarmupCosineLR, computed by DeepSpeed's own
deepspeed/runtime/lr_schedules.py (from a DeepSpeed checkout; its one DeepSpeed import, the
logger, stubbed) over a torch optimizer, stepped as DeepSpeed's engine steps it: the scheduler is
built before the first optimizer step (at iteration -1, whose lr is the schedule's start) and
stepped after each, so optimizer step k runs at iteration k - 1.

Regenerate with Debian's python3 (torch, CPU), DeepSpeed's repository checked out at DS:
    /usr/bin/python3 tools/golden/deepspeed_lr_golden.py DS tests/data/deepspeed_lr.json [COMMIT]
"""
import importlib.util
import json
import logging
import subprocess
import sys
import types

import torch


def load_lr_schedules(ds_root):
    utils = types.ModuleType("deepspeed.utils")
    utils.logger = logging.getLogger("deepspeed")
    sys.modules["deepspeed"] = types.ModuleType("deepspeed")
    sys.modules["deepspeed.utils"] = utils
    path = ds_root + "/deepspeed/runtime/lr_schedules.py"
    spec = importlib.util.spec_from_file_location("lr_schedules", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# (DeepSpeed's scheduler type, its params, the optimizer's lr, steps): every warmup type, short
# and long warmups (warmup_num_steps 1 is raised to 2), total steps shorter than the warmup, past
# the total, and DeepSpeed's defaults where params leave them out.
CASES = [
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 10,
                  "warmup_type": "log"}, 1e-3, 16),
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 2e-4, "warmup_num_steps": 7,
                  "warmup_type": "linear"}, 1e-3, 12),
    ("WarmupLR", {"warmup_num_steps": 1}, 5e-4, 4),
    ("WarmupLR", {}, 1e-3, 5),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                       "warmup_num_steps": 5, "warmup_type": "linear"}, 1e-3, 24),
    ("WarmupDecayLR", {"total_num_steps": 30, "warmup_min_lr": 2e-5, "warmup_max_lr": 6e-4,
                       "warmup_num_steps": 8, "warmup_type": "log"}, 1e-3, 30),
        ("WarmupDecayLR", {"total_num_steps": 3, "warmup_num_steps": 6}, 1e-3, 8),
    # No warmup_max_lr: WarmupDecayLR's own 0.001, whatever the optimizer's lr.
    ("WarmupDecayLR", {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_type": "linear"},
     3e-4, 14),
    ("WarmupCosineLR", {"total_num_steps": 25, "warmup_min_ratio": 0.1, "warmup_num_steps": 5,
                        "cos_min_ratio": 0.01, "warmup_type": "linear"}, 3e-4, 28),
    ("WarmupCosineLR", {"total_num_steps": 40, "warmup_num_steps": 12}, 1e-3, 40),
    ("WarmupCosineLR", {"total_num_steps": 4, "warmup_num_steps": 9, "warmup_type": "log"},
     2e-3, 12),
]


def main():
    ds_root, out_path = sys.argv[1], sys.argv[2]
    lr_schedules = load_lr_schedules(ds_root)
    # The checkout's commit, or (an exported file, not a checkout) the one given third.
    commit = subprocess.run(["git", "-C", ds_root, "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    if len(sys.argv) > 3:
        commit = sys.argv[3]
    cases = []
    for kind, params, lr, steps in CASES:
        p = torch.nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.AdamW([p], lr=lr)
        scheduler = getattr(lr_schedules, kind)(optimizer, **params)
        lrs = []
        for _ in range(steps):
            lrs.append(optimizer.param_groups[0]["lr"])
            scheduler.step()
        cases.append({"type": kind, "params": params, "optimizer_lr": lr, "lrs": lrs})
    with open(out_path, "w") as f:
        json.dump({"deepspeed_commit": commit, "cases": cases}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
