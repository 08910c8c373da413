"""Planning work run side by side on the machine's cores: HiGHS lets go of Python's lock
while it solves, so ILPs in threads (a stage's layers, the one-stage meshes) solve in
parallel, and the one-stage search runs beside the pipeline search, which traces the step
at its microbatches' shape meanwhile.

Work run here counts its phases (`autoplan.phases`) in the `counted` block of the caller,
each thread its own seconds.
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def mapped(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``[fn(x) for x in items]``, on as many threads as there are cores (one: in this
    thread); the results in the order of ``items``."""
    todo = list(items)
    workers = min(len(todo), os.cpu_count() or 1)
    if workers <= 1:
        return [fn(x) for x in todo]
    # each call in a copy of this thread's context (a context is entered by one thread at once)
    calls = [(contextvars.copy_context(), x) for x in todo]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda call: call[0].run(fn, call[1]), calls))


class Started(Generic[R]):
    """``fn()`` running in a thread of its own from the moment it is made; `result` waits
    for it and returns its value or raises its exception. The thread is a daemon: a
    program interrupted meanwhile exits without waiting for an ILP to finish."""

    def __init__(self, fn: Callable[[], R]) -> None:
        self._value: R | None = None
        self._error: BaseException | None = None
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._run, fn), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], R]) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # handed to the caller of `result`, whatever it is
            self._error = e

    def result(self) -> R:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]
