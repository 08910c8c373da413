"""`autoplan profile`: measure a cluster's compute and collectives, and write its cluster file.

- `tasks`: which curves, sizes and rank groups are measured (plain data);
- `run`: the profile on every rank of a torchrun job: the tasks in order, progress
  (`autoplan.progress`), the result;
- `timer`: how each point is timed, every rank at once (torch.distributed);
- `ops`: the operations timed, one per point of a curve;
- `fit`: the analytic constants fitted to the curves (plain data).

The curves land in the cluster file's `measured` section (schema in `autoplan/cluster/fileio.py`,
interpolation in `autoplan/cluster/measured.py`), where `autoplan.costmodel.timing` uses them.
"""

from autoplan.profile.run import base_refusal, profile_cluster
from autoplan.profile.tasks import Settings

__all__ = ["Settings", "base_refusal", "profile_cluster"]
