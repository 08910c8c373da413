"""How `autoplan profile` times an operation, on every rank of a torchrun job at once.

Every point of every curve is timed the same way (`Timer.seconds`): after one untimed call (first
calls set things up), all ranks start together (barrier), one call is timed to choose how many calls
make one timed run (enough for ~20 ms, so small sizes are not lost in timer and barrier noise; a
slow first call timed here left tiny ops ~50x too slow), then `repeats` runs are timed and each
run's time per call is the slowest rank's (all_reduce MAX), because a step waits for its slowest
rank; the median run is kept. A run of local ops (matmul, element-wise, activation, op chains) ends
with a barrier inside the clock: ranks that share cores (CPU ranks) start their clocks only when
scheduled, so without it each would time itself alone and miss the contention (the barrier adds its
latency, a few % of a run). Collectives wait for their group anyway. The decisions (calls per run,
when a curve stops) use the agreed times, so every rank takes the same path.

`op_overhead` is the slope between chains of 8 and 64 tiny ops run forward and backward (what one
more op adds beyond its compute); `redistribute_overhead` what an all-reduce of each size costs
through DTensor's redistribution beyond the raw all-reduce; `sync_overhead` what a tiny such
redistribution costs after a few ms of compute beyond its cost alone. Each is the median over
rounds of runs of its operations, one right after the other (`Timer.paired`,
`Timer.sync_overhead`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from autoplan.cluster.measured import monotone
from autoplan.profile.operations import Op, Operations, cold_matmul, redistribution
from autoplan.profile.tasks import Settings, Task

__all__ = ["Timer", "matmul_seconds"]

# redistribute_overhead's points up to 1 MiB take this many times the pairs of runs: cheap there,
# and noisy (by hand, on 4 CPU ranks sharing 2 cores, 15 pairs spread ~2x, 45 pairs ~1.5x)
SMALL_REDISTRIBUTION_FACTOR = 3

RUN_SECONDS = 0.02  # aim of one timed run: enough calls of a small op to outweigh noise
MAX_CALLS = 10_000  # calls per timed run at most (a ~2 us op on CPU)

# told the number of a task's points measured so far, as each point starts and when all are done
Report = Callable[[int], None]


def matmul_seconds(n: int, device: torch.device) -> float:
    """Seconds of one n x n float32 matmul, timed as `autoplan profile` times its matmul curve
    (every rank at once, cold operands, the slowest rank, the median of the default repeats);
    every rank calls this. A probe of the host's speed now against its profile."""
    timer = Timer(device, Settings())
    return timer.seconds(cold_matmul(n, device), timer.settings.repeats)


class Timer:
    """Times the points of the curves, one task after another, on every rank."""

    def __init__(self, device: torch.device, settings: Settings) -> None:
        self.device = device
        self.settings = settings
        self.operations = Operations(device)

    def curve(self, task: Task, report: Report) -> list[list[float]]:
        """[[x, seconds], ...] of `task`, up to where the next size is predicted to take longer
        than max_seconds per call (at large sizes time grows at most linearly with size)."""
        xs: list[float] = []
        seconds: list[float] = []
        for i, (size, x) in enumerate(zip(task.sizes, task.xs, strict=True)):
            report(i)
            op = self.operations.for_task(task, size)
            xs.append(x)
            seconds.append(self.seconds(op, self._repeats(task)) * op.scale)
            del op  # free this size's tensors before the next, larger ones
            nxt = i + 1
            if nxt < len(task.xs) and seconds[-1] * task.xs[nxt] / x > self.settings.max_seconds:
                break
        report(len(task.sizes))
        return [[x, s] for x, s in zip(xs, monotone(seconds), strict=True)]

    def overhead(self, task: Task, report: Report) -> float:
        """Seconds per unit of x that the operation at `task.sizes[1]` takes beyond the one at
        `task.sizes[0]` (>= 0; see `paired`)."""
        report(0)
        without, with_ = (self.operations.for_task(task, size) for size in task.sizes)
        seconds = self.paired(without, with_, self._repeats(task))
        report(len(task.sizes))
        return max(0.0, seconds / (task.xs[1] - task.xs[0]))

    def redistribute_overhead(self, task: Task, report: Report) -> list[list[float]]:
        """[[bytes, seconds], ...]: at each size, what the all-reduce costs through DTensor
        beyond the raw one (>= 0, made monotone)."""
        seconds = []
        for i, size in enumerate(task.sizes):
            report(i)
            raw, dtensor = (
                redistribution(size, dtensor=d, device=self.device) for d in (False, True)
            )
            repeats = self._repeats(task) * (SMALL_REDISTRIBUTION_FACTOR if size <= 2**20 else 1)
            seconds.append(max(0.0, self.paired(raw, dtensor, repeats)))
        report(len(task.sizes))
        return [[x, s] for x, s in zip(task.xs, monotone(seconds), strict=True)]

    def sync_overhead(self, task: Task, report: Report) -> float:
        """What the tiny redistribution costs right after compute beyond its cost alone,
        called back to back (>= 0): per repeat, (compute then it) - compute - it alone."""
        report(0)
        compute, then_sync, alone = (self.operations.for_task(task, size) for size in task.sizes)
        runs = self._runs((compute, then_sync, alone), self._repeats(task))
        report(len(task.sizes))
        return max(0.0, statistics.median(b - a - c for a, b, c in zip(*runs, strict=True)))

    def paired(self, without: Op, with_: Op, repeats: int) -> float:
        """Seconds per call that `with_` takes beyond `without`: the median over `repeats` of
        the difference of two runs timed one right after the other (`_runs`)."""
        first, second = self._runs((without, with_), repeats)
        return statistics.median(b - a for a, b in zip(first, second, strict=True))

    def seconds(self, op: Op, repeats: int) -> float:
        """Median over the timed runs of the slowest rank's seconds per call of `op`."""
        calls = self._calls(op)
        return statistics.median(self._slowest([self._timed(op, calls) for _ in range(repeats)]))

    def _runs(self, ops: tuple[Op, ...], repeats: int) -> list[list[float]]:
        """Per op, the slowest rank's seconds per call in each of `repeats` rounds, each round
        one run of every op, one right after the other. Differences taken within a round
        cancel the host's drift, which the difference of two medians kept (it varied 50-fold
        between profiles of one host)."""
        calls = [self._calls(op) for op in ops]
        runs: list[list[float]] = [[] for _ in ops]
        for _ in range(repeats):
            for op, count, found in zip(ops, calls, runs, strict=True):
                found.append(self._timed(op, count))
        return [self._slowest(found) for found in runs]

    def _repeats(self, task: Task) -> int:
        """Timed runs per point: `Settings.repeats`, or the task's own minimum if higher."""
        return max(task.repeats, self.settings.repeats)

    def _calls(self, op: Op) -> int:
        """How many calls of `op` make one timed run."""
        op.call()  # the first call may set things up (kernels, caches): never timed
        dist.barrier()
        # one call alone, without the closing barrier, which may take far longer than a small
        # op and would leave too few calls per run to outweigh it
        first = self._slowest([self._run(op, 1, closing_barrier=False)])[0]
        return max(1, min(MAX_CALLS, math.ceil(RUN_SECONDS / max(first, 1e-9))))

    def _timed(self, op: Op, calls: int) -> float:
        """This rank's seconds per call over one run of `calls` calls, started together."""
        dist.barrier()
        return self._run(op, calls, closing_barrier=op.local) / calls

    def _run(self, op: Op, calls: int, *, closing_barrier: bool) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            op.call()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if closing_barrier:
            dist.barrier()
        return time.perf_counter() - start

    def _slowest(self, values: list[float]) -> list[float]:
        found = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return [float(v) for v in found.tolist()]
