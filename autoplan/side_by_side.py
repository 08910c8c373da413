"""Planning work run side by side on the machine's cores: HiGHS lets go of Python's lock
while it solves, so ILPs in threads (a stage's layers, the one-stage meshes) solve in
parallel (`mapped`), counting their phases (`autoplan.phases`) in the `counted` block of
the caller, each thread its own seconds. Tracing holds the lock throughout: the step at the
first microbatch count the pipeline search asks for is traced in a forked child (`Forked`)
while this process traces the whole step.

The one-stage search and the pipeline search run one after the other: ILPs' time limits are
wall-clock, and one search's ILPs beside the other's would each have less of the machine (a
pipeline layer's ILP stops at 2 s).
"""

from __future__ import annotations

import contextvars
import multiprocessing
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

import torch

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


class Forked(Generic[R]):
    """``fn()`` computed ahead in a forked child process, for work that holds Python's lock
    throughout (tracing a step): `result` is its value, or None where it could not be had
    (the child failed, or this process cannot fork safely: no "fork" start method, or CUDA
    already initialized, which a forked child cannot use); the caller then does the work
    itself, and raises its errors itself. `close` ends a child whose result is not wanted."""

    def __init__(self, fn: Callable[[], R]) -> None:
        self._child: multiprocessing.process.BaseProcess | None = None
        if "fork" not in multiprocessing.get_all_start_methods() or torch.cuda.is_initialized():
            return
        context = multiprocessing.get_context("fork")
        self._receive, send = context.Pipe(duplex=False)

        def child() -> None:
            torch.set_num_threads(1)  # a forked child's first op may hang on the parent's OpenMP
            try:
                value: R | None = fn()
            except BaseException:  # the parent does the work again and raises the error itself
                value = None  # (Ctrl-C reaches the child too: the parent stops on its own)
            send.send(value)

        self._child = context.Process(target=child, daemon=True)
        self._child.start()
        send.close()

    def result(self, timeout: float | None = None) -> R | None:
        """The child's value; None where it failed, or sent nothing within ``timeout``
        seconds (a child stuck on a lock some other thread held when it was forked: it is
        ended)."""
        if self._child is None:
            return None
        value: R | None = None
        try:
            if self._receive.poll(timeout):
                value = self._receive.recv()
        except EOFError:  # the child died without sending
            pass
        self.close()
        return value

    def close(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.join()
            self._child = None
