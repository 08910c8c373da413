"""`autoplan profile`: measure a cluster's compute and collectives, and write its cluster file.

- `tasks`: which curves, sizes and rank groups are measured (plain data);
- `bench`: the timing, on every rank of a torchrun job (torch.distributed);
- `fit`: the analytic constants fitted to the curves (plain data).

The curves land in the cluster file's `measured` section (schema in `autoplan/cluster/fileio.py`,
interpolation in `autoplan/cluster/measured.py`), where `autoplan.cluster.timing` uses them.
"""

from autoplan.profile.bench import base_refusal, profile_cluster
from autoplan.profile.tasks import Progress, Settings

__all__ = ["Progress", "Settings", "base_refusal", "profile_cluster"]
