"""The package version, apart so that modules can record it without importing the whole API,
and the torch release at hand, which plans record beside it."""

import torch

__version__ = "0.1.0"


def torch_release() -> str:
    """This torch's release, without its build tag: "2.13.0", not "2.13.0+cpu"."""
    return torch.__version__.split("+")[0]
