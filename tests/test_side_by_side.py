"""Planning work side by side: results in order, the phases of work in other threads counted
in the caller's block, and the step traced ahead in a forked child the same as traced here."""

from __future__ import annotations

import os
import threading
import time

from autoplan import Cluster, PlanOptions
from autoplan.errors import TraceError
from autoplan.graph.capture import batch_size, capture_microbatches
from autoplan.graph.ir import Graph
from autoplan.phases import counted, timed
from autoplan.search.ahead import TracedAhead
from autoplan.search.pipeline_search import first_microbatches
from autoplan.side_by_side import Forked, mapped
from tests.conftest import example


def _solve(x: int) -> int:
    with timed("solve"):
        time.sleep(0.05)
    return x * x


def test_mapped_keeps_the_order_and_counts_each_threads_phases() -> None:
    with counted() as seconds:
        assert mapped(_solve, range(6)) == [0, 1, 4, 9, 16, 25]
    # every call's 0.05 s, whichever thread ran it (nothing is counted outside `counted`)
    assert seconds["solve"] >= 6 * 0.05


def test_a_phase_inside_another_counts_once_per_thread() -> None:
    def nested(x: int) -> int:
        with timed("solve"), timed("pricing"):
            time.sleep(0.02)
        return x

    with counted() as seconds:
        mapped(nested, range(4))
    assert seconds["solve"] >= 4 * 0.02
    assert "pricing" not in seconds


def test_the_step_traced_ahead_in_a_child_is_the_step_traced_here(a100: Cluster) -> None:
    w = example("gpt", size="small", num_layers=2, batch_size=16, seq_len=64, device="meta")
    traced = capture_microbatches(w.model, w.example_inputs, w.loss_fn, w.example_target)
    options = PlanOptions()
    batch = batch_size(w.example_inputs, w.example_target)
    ahead = TracedAhead(traced, a100, options, batch)
    count = ahead.count
    assert count == first_microbatches(a100, options, batch) and count is not None and count > 1
    assert ahead.take(count + 1) is None  # not the count traced ahead
    found = ahead.take(count)
    assert found is not None and found == traced(count)
    assert ahead.take(count) is None  # handed over once


def test_a_child_that_cannot_trace_leaves_the_tracing_here(a100: Cluster) -> None:
    def fails(count: int) -> Graph:
        raise TraceError(f"cannot trace at {count} microbatches")

    ahead = TracedAhead(fails, a100, PlanOptions(), batch=16)
    assert ahead.count is not None
    assert ahead.take(ahead.count) is None
    ahead.close()


def test_work_runs_on_several_threads_where_there_are_cores() -> None:
    here = threading.get_ident()
    ran_on = mapped(lambda _: threading.get_ident(), range(3))
    assert (here in ran_on) == ((os.cpu_count() or 1) == 1)


def test_a_child_that_sends_nothing_in_time_is_ended() -> None:
    stuck = Forked(lambda: time.sleep(60))
    child = stuck._child
    assert child is not None and child.is_alive()
    start = time.perf_counter()
    assert stuck.result(timeout=0.2) is None
    assert time.perf_counter() - start < 10 and not child.is_alive()
