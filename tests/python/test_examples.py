"""examples/python run as a user runs them, shortened."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_gpt_trains_with_cpu_adam_and_int8_moments(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "examples/python/gpt_cpu_adam.py"),
                          "--steps", "40", "--save", str(tmp_path / "state.pt")],
                         check=True, capture_output=True, text=True).stdout
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert losses[0] > 5.0, out  # a uniform guess over 256 bytes is 5.55
    assert losses[-1] < 3.2, out  # it learned the bytes' statistics
    assert "moments int8" in out
    import torch

    state = torch.load(tmp_path / "state.pt")
    moments = state["optimizer"]["state"][0]
    assert moments["exp_avg"].dtype == torch.float32  # widened, torch's layout


def test_save_and_load_through_aio_handle(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "examples/python/save_load_aio.py"),
                          "--dir", str(tmp_path)], check=True, capture_output=True,
                         text=True).stdout
    assert "the loaded model's outputs equal the saved one's: True" in out, out
    assert (tmp_path / "index.json").exists()
