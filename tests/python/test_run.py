"""strata.train, strata.train_steps and strata.estimate against the CLI's own runs of the quick
start's config: the same plan, the same losses to the bit, the same stops and checkpoints."""

import json
import os
import pathlib
import signal
import subprocess

import pytest

import strata

ROOT = pathlib.Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.json"
CLI = os.environ.get("STRATA_CLI", str(ROOT / "build" / "strata"))


def config(tmp_path, **changes):
    """The quick start's config as a dict, its data path absolute, its outputs under tmp_path."""
    c = json.loads(QUICKSTART.read_text())
    c["data"]["path"] = str(ROOT / c["data"]["path"])
    c["save_dir"] = str(tmp_path / "ckpt")
    c["metrics_file"] = str(tmp_path / "metrics.jsonl")
    c.update(changes)
    return c


def test_estimate_is_the_clis_json():
    ours = strata.estimate(QUICKSTART, max_steps=3)
    cli = json.loads(subprocess.run([CLI, "estimate", str(QUICKSTART), "--set", "max_steps=3",
                                     "--json"], check=True, capture_output=True, text=True).stdout)
    assert ours["fits"] is True
    # The plan's bytes are the same; the step time is measured, so it differs run to run.
    for key in ("device_bytes", "host_bytes", "nvme_bytes", "budgets", "offload_param",
                "offload_optimizer", "parameters"):
        assert ours[key] == cli[key], key


def test_estimate_refusals_and_bad_keys():
    refused = strata.estimate(QUICKSTART, host_memory_limit="64KiB")
    assert refused["fits"] is False
    assert "host_memory_limit 64.00 KiB is too small" in refused["error"]
    assert refused["exit_code"] == 1
    with pytest.raises(ValueError, match=r"'optimizer.lrr' \(from --set optimizer.lrr\): unknown "
                                         r"key; did you mean 'optimizer.lr'"):
        strata.estimate(QUICKSTART, **{"optimizer.lrr": 1e-3})
    with pytest.raises(TypeError, match="a path or a dict"):
        strata.estimate(42)


def test_train_matches_the_cli_to_the_bit(tmp_path):
    records = strata.train(config(tmp_path, max_steps=3), progress=False)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert (tmp_path / "ckpt" / "step-00000003").is_dir()
    cli_dir = tmp_path / "cli"
    cli_dir.mkdir()
    path = cli_dir / "config.json"
    path.write_text(json.dumps(config(cli_dir, max_steps=3)))
    subprocess.run([CLI, "train", str(path)], check=True, capture_output=True)
    cli = [json.loads(line) for line in (cli_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records] == [r["loss"] for r in cli]
    assert [r["grad_norm"] for r in records] == [r["grad_norm"] for r in cli]


def test_on_step_stops_the_run_with_a_checkpoint_and_resume_continues_it(tmp_path):
    straight = strata.train(config(tmp_path / "a", max_steps=4), progress=False)
    seen = []
    stopped = strata.train(config(tmp_path / "b", max_steps=4), progress=False,
                           on_step=lambda r: seen.append(r["step"]) or r["step"] == 2)
    assert seen == [1, 2] and len(stopped) == 2
    assert (tmp_path / "b" / "ckpt" / "step-00000002").is_dir()
    resumed = strata.train(config(tmp_path / "b", max_steps=4), progress=False,
                           resume=tmp_path / "b" / "ckpt")
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in stopped + resumed] == [r["loss"] for r in straight]


def test_ctrl_c_saves_then_raises_keyboard_interrupt(tmp_path):
    def interrupt(record):
        if record["step"] == 2:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        strata.train(config(tmp_path, max_steps=6), progress=False, on_step=interrupt)
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-"))
    assert saved and saved[-1] <= "step-00000003", saved


def test_train_steps_yields_each_step_and_stops_when_left(tmp_path):
    steps = []
    for record in strata.train_steps(config(tmp_path, max_steps=8)):
        steps.append(record["step"])
        if record["step"] == 2:
            break
    assert steps == [1, 2]
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-"))
    assert saved and saved[-1] < "step-00000008", saved


def test_train_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="<dict>"):
        strata.train(config(tmp_path, max_steps=0, batch_size=-1), progress=False)
    with pytest.raises(ValueError, match="unknown key"):
        strata.train(config(tmp_path), progress=False, **{"optimizer.bogus": 1})
