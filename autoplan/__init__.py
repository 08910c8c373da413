"""autoplan: automatic parallelization planning for PyTorch."""

from autoplan.api import plan
from autoplan.baseline import baseline
from autoplan.cluster import Cluster
from autoplan.estimate import estimate
from autoplan.parallel import Step, parallelize
from autoplan.plan.schema import Plan
from autoplan.workload import Workload

__all__ = ["Cluster", "Plan", "Step", "Workload", "baseline", "estimate", "parallelize", "plan"]
__version__ = "0.1.0"
