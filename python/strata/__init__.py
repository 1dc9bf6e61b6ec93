"""Strata from Python: its CPU Adam as a torch optimizer (strata.optim.CPUAdam).

The native part (strata._core) takes tensors by address, element count and dtype, so it works
with any torch version; it is built by the project's CMake for Debian's python3. Importing
strata needs no torch; strata.optim does.
"""

import importlib

from ._core import __version__

__all__ = ["__version__", "optim"]


def __getattr__(name):
    if name == "optim":
        return importlib.import_module(".optim", __name__)
    raise AttributeError(f"module 'strata' has no attribute '{name}'")
