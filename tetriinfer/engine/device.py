"""Placing an engine on hardware: CUDA device checks, CPU threads and core pinning."""

from __future__ import annotations

import os

import torch

from tetriinfer.allocator import tune_cpu_allocator


def configure_device(device: str, num_threads: int | None, cpu_cores: tuple[int, ...] | None) -> None:
    """Pin this process to ``cpu_cores`` and set torch's intra-op threads (one engine per core stands in
    for one accelerator on CPU machines)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' requested but CUDA is not available on this machine")
    if cpu_cores:
        available = os.sched_getaffinity(0)
        bad = [c for c in cpu_cores if c not in available and c >= (os.cpu_count() or 1)]
        if bad:
            raise ValueError(f"cpu cores {bad} do not exist (this machine has {os.cpu_count()})")
        os.sched_setaffinity(0, set(cpu_cores))
        if num_threads is None:
            num_threads = len(cpu_cores)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    if device == "cpu":
        tune_cpu_allocator()
