"""Placing an engine on hardware: CUDA device checks, CPU threads and core pinning."""

from __future__ import annotations

import os

import torch

from tetriinfer.allocator import tune_cpu_allocator


def _pin_every_thread(cores: set[int]) -> None:
    """Confine every thread of this process to ``cores``: ``sched_setaffinity(0)`` moves only the calling thread,
    and a process has threads before it gets here (one made at start-up ran on every core of the machine, next to
    the pinned engines). Threads made later inherit the mask."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # the thread ended meanwhile
            continue


def default_num_threads() -> int:
    """The threads an engine uses when not told: ``OMP_NUM_THREADS`` where it is set (the usual knob, which torch
    also reads at start-up), else one per core this process may run on (``os.sched_getaffinity``: a container's or
    a ``taskset``'s cores, not the machine's)."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) >= 1:
        return int(env)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API on this platform
        return max(1, os.cpu_count() or 1)


def configure_device(device: str, num_threads: int | None, cpu_cores: tuple[int, ...] | None) -> None:
    """Pin this process to ``cpu_cores`` and set torch's intra-op threads, which the native CPU kernels split
    their work over too: ``num_threads``, else one per pinned core, else `default_num_threads()` on CPU (one
    engine per core stands in for one accelerator on CPU serving layouts; an offline ``LLM()`` uses its cores)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' requested but CUDA is not available on this machine")
    if cpu_cores:
        available = os.sched_getaffinity(0)
        bad = [c for c in cpu_cores if c not in available and c >= (os.cpu_count() or 1)]
        if bad:
            raise ValueError(f"cpu cores {bad} do not exist (this machine has {os.cpu_count()})")
        _pin_every_thread(set(cpu_cores))
        if num_threads is None:
            num_threads = len(cpu_cores)
    if num_threads is None and device == "cpu":
        num_threads = default_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    if device == "cpu":
        tune_cpu_allocator()
