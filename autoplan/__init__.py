"""autoplan: automatic parallelization planning for PyTorch."""

from autoplan.api import plan
from autoplan.baselines import baseline
from autoplan.cluster import Cluster
from autoplan.estimate import estimate
from autoplan.options import PlanOptions, TrainOptions
from autoplan.parallel import Step, parallelize
from autoplan.planfile.schema import Plan
from autoplan.version import __version__
from autoplan.workload import Workload

__all__ = [
    "Cluster",
    "Plan",
    "PlanOptions",
    "Step",
    "TrainOptions",
    "Workload",
    "__version__",
    "baseline",
    "estimate",
    "parallelize",
    "plan",
]
