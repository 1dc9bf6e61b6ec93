"""A model's weights saved and loaded tensor by tensor through strata.io.AIOHandle (DeepNVMe's
aio_handle verbs over Strata's io_uring engine): every write queued at once, one wait; the same
for the reads into a fresh model; then the two models' outputs compared.

    PYTHONPATH=build/python /usr/bin/python3 examples/python/save_load_aio.py [--dir DIR]
"""

import argparse
import json
import pathlib
import tempfile
import time

import torch
from torch import nn

from strata.io import AIOHandle


def model():
    return nn.Sequential(nn.Embedding(1000, 256), nn.Linear(256, 1024), nn.GELU(),
                         nn.Linear(1024, 256), nn.LayerNorm(256), nn.Linear(256, 1000))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="")
    a = ap.parse_args()
    directory = pathlib.Path(a.dir or tempfile.mkdtemp(prefix="strata-aio-"))
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    source = model()
    handle = AIOHandle(block_size=1 << 20, queue_depth=32)

    state = {name: t.detach().contiguous() for name, t in source.state_dict().items()}
    start = time.perf_counter()
    for name, tensor in state.items():
        handle.async_pwrite(tensor, directory / f"{name}.bin")
    done = handle.wait()
    saved = time.perf_counter() - start
    index = {name: {"shape": list(t.shape), "dtype": str(t.dtype)} for name, t in state.items()}
    (directory / "index.json").write_text(json.dumps(index, indent=1))
    total = sum(t.numel() * t.element_size() for t in state.values())
    print(f"saved {done} tensors ({total} bytes) to {directory} in {saved * 1e3:.1f} ms "
          f"({handle.engine})")

    target = model()
    loaded = {}
    start = time.perf_counter()
    for name, meta in json.loads((directory / "index.json").read_text()).items():
        dtype = getattr(torch, meta["dtype"].removeprefix("torch."))
        loaded[name] = torch.empty(meta["shape"], dtype=dtype)
        handle.async_pread(loaded[name], directory / f"{name}.bin")
    done = handle.wait()
    print(f"loaded {done} tensors in {(time.perf_counter() - start) * 1e3:.1f} ms")
    target.load_state_dict(loaded)

    tokens = torch.randint(0, 1000, (4, 16))
    same = torch.equal(source(tokens), target(tokens))
    print("the loaded model's outputs equal the saved one's:", same)
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
