#!/usr/bin/python3
"""strata plot: a run's metrics (metrics_file, JSON lines) as one picture: the loss and the held-out
loss, the learning rate, tokens per second, and each memory tier's peak against its plan.

Run by `strata plot METRICS.jsonl [MORE.jsonl...] -o loss.png`; each file is one run, drawn in its
own colour and named by its file. Needs matplotlib (Debian: python3-matplotlib).
"""
import argparse
import json
import os
import sys


def fail(message):
    """Bad input: the message, and exit code 2 (as every strata usage or input error)."""
    print("strata plot: " + message, file=sys.stderr)
    sys.exit(2)


def read_run(path):
    steps = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                fail(f"{path}:{number}: not a JSON object ({e.msg}); expected the "
                     "metrics_file strata train writes")
            if not isinstance(record, dict) or "step" not in record:
                fail(f"{path}:{number}: no \"step\": expected the metrics_file strata train "
                     "writes")
            steps.append(record)
    if not steps:
        fail(f"{path} has no steps")
    return steps


def series(run, key):
    xs, ys = [], []
    for r in run:
        value = r.get(key)
        if isinstance(value, (int, float)) and value == value:  # skips NaN (a skipped step)
            xs.append(r["step"])
            ys.append(value)
    return xs, ys


def main():
    parser = argparse.ArgumentParser(prog="strata plot", description=__doc__.splitlines()[0])
    parser.add_argument("metrics", nargs="+", help="metrics files (JSON lines), one per run")
    parser.add_argument("-o", "--output", required=True, help="the picture: .png, .svg or .pdf")
    parser.add_argument("--title", default=None, help="a title above the panels")
    args = parser.parse_args()
    runs = [(os.path.basename(p), read_run(p)) for p in args.metrics]

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    loss, lr, speed, memory = axes[0][0], axes[0][1], axes[1][0], axes[1][1]
    # GiB, or MiB where no run's memory reaches a GiB.
    most = max((v for _, run in runs for key in ("peak_device_bytes", "peak_host_bytes",
                                                    "peak_nvme_bytes")
                for v in series(run, key)[1]), default=0)
    unit, unit_name = (float(1 << 30), "GiB") if most >= (1 << 30) else (float(1 << 20), "MiB")
    for i, (name, run) in enumerate(runs):
        colour = f"C{i}"
        label = name if len(runs) > 1 else None
        loss.plot(*series(run, "loss"), color=colour, lw=1.2, label=(label or "train"))
        ex, ey = series(run, "eval_loss")
        if ex:
            loss.plot(ex, ey, "o--", color=colour, ms=4, lw=1,
                      label=(name + " eval" if label else "held-out"))
        lr.plot(*series(run, "lr"), color=colour, lw=1.2, label=label)
        speed.plot(*series(run, "tokens_per_s"), color=colour, lw=1, label=label)
        for tier, style in (("device", "-"), ("host", "--"), ("nvme", ":")):
            x, y = series(run, f"peak_{tier}_bytes")
            if y and max(y) > 0:
                memory.plot(x, [v / unit for v in y], style, color=colour, lw=1.2,
                            label=(f"{name} {tier}" if label else f"{tier} peak"))
            px, py = series(run, f"planned_{tier}_bytes")
            if py and max(py) > 0 and len(runs) == 1:
                memory.plot(px, [v / unit for v in py], style, color="0.6", lw=0.8,
                            label=f"{tier} planned")
    loss.set_title("loss")
    lr.set_title("learning rate")
    speed.set_title("tokens per second")
    memory.set_title(f"memory peaks ({unit_name})")
    for ax in (loss, lr, speed, memory):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if args.title:
        fig.suptitle(args.title)
    fig.savefig(args.output, dpi=110)
    print(f"strata plot: wrote {args.output} ({len(runs)} run{'s' if len(runs) > 1 else ''}, "
          f"{sum(len(r) for _, r in runs)} steps)")


if __name__ == "__main__":
    main()
