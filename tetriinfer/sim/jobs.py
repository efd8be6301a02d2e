"""``--jobs N``: independent simulations (side-by-side columns, placement layouts) in worker processes.

Each task is a plain function of picklable arguments and a simulation is deterministic, so a task's result is the
same in a worker as in the parent: results come back in task order, identical to running them one by one. With
``jobs == 1`` (or a single task) nothing is started. Workers are forked where the platform can (they start at once
and need no importable ``__main__``; the simulator keeps no threads whose locks a fork could copy held), else
spawned, and stopped when the last result is read.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

R = TypeVar("R")


def _call(task: tuple[Callable[..., Any], tuple[Any, ...]]) -> Any:
    fn, args = task
    return fn(*args)


def run_jobs(fn: Callable[..., R], tasks: Sequence[tuple[Any, ...]], jobs: int) -> Iterator[R]:
    """``fn(*args)`` for every ``args`` in ``tasks``, yielded in task order as each becomes available; up to
    ``jobs`` at once in worker processes. ``fn`` must be a module-level function (workers import it by name)."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if jobs == 1 or len(tasks) <= 1:
        for args in tasks:
            yield fn(*args)
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=multiprocessing.get_context(method)) as ex:
        yield from ex.map(_call, [(fn, tuple(args)) for args in tasks])
