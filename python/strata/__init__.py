"""Strata from Python: its CPU Adam as a torch optimizer (strata.optim.CPUAdam), its swap engine
as DeepNVMe's aio_handle (strata.io.AIOHandle), and the CLI's runs (strata.train,
strata.train_steps, strata.estimate) on a config's path or a dict.

The native part (strata._core) takes tensors by address, element count and dtype, so it works
with any torch version; it is built by the project's CMake for Debian's python3. Importing
strata needs no torch; strata.optim and strata.io do.
"""

import importlib

from ._core import __version__
from ._run import estimate, train, train_steps

__all__ = ["__version__", "estimate", "io", "optim", "train", "train_steps"]


def __getattr__(name):
    if name in ("optim", "io"):
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'strata' has no attribute '{name}'")
