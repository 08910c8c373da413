"""autoplan: automatic parallelization planning for PyTorch."""

from autoplan.workload import Workload

__all__ = ["Workload"]
__version__ = "0.1.0"
