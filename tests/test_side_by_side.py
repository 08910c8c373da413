"""Planning work side by side: results in order, exceptions handed back, and the phases of
work in other threads counted in the caller's block."""

from __future__ import annotations

import time

import pytest

from autoplan.phases import counted, timed
from autoplan.side_by_side import Started, mapped


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


def test_started_work_gives_its_value_or_raises_its_error() -> None:
    with counted() as seconds:
        running = Started(lambda: _solve(3))
        assert running.result() == 9
    assert seconds["solve"] >= 0.05

    def fails() -> int:
        raise ValueError("no plan")

    with pytest.raises(ValueError, match="no plan"):
        Started(fails).result()
