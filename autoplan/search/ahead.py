"""The step traced ahead at the first microbatch count the pipeline search will ask for, in
a forked child (`autoplan.side_by_side.Forked`) while this process traces the whole step:
tracing holds Python's lock throughout, and the two traces of a model that plans pipelines
are then done side by side. Only a guess made before tracing: where the search asks for
another count, or the child could not trace, the step is traced here as before."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from autoplan.cluster.model import Cluster
from autoplan.graph.ir import Graph
from autoplan.options import PlanOptions
from autoplan.search.pipeline_search import first_microbatches
from autoplan.side_by_side import Forked


class TracedAhead:
    """``traced(count)`` begun in a child for the count `first_microbatches` gives, where
    pipelines are weighed; `take` hands it over, `close` ends a child not needed."""

    def __init__(
        self, traced: Callable[[int], Graph], cluster: Cluster, options: PlanOptions, batch: int
    ) -> None:
        count = first_microbatches(cluster, options, batch)
        self.count = count
        self._started = time.perf_counter()
        self._child = (
            Forked(functools.partial(traced, count)) if count is not None and count > 1 else None
        )

    def take(self, count: int) -> Graph | None:
        """The step traced at ``count`` microbatches, if that was the count traced ahead and
        the child traced it; else None (trace it here). A child that began with this
        process's own trace of the whole step and has not sent its graph in as long again
        is taken to be stuck."""
        if self._child is None or count != self.count:
            return None
        child, self._child = self._child, None
        return child.result(timeout=max(10.0, time.perf_counter() - self._started))

    def close(self) -> None:
        if self._child is not None:
            self._child.close()
            self._child = None
