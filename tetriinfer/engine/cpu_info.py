"""What this CPU can do, read once from /proc/cpuinfo."""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_has_native(dtype: torch.dtype) -> bool:
    """Whether this CPU has matmul instructions for ``dtype`` (fp32 always; bf16 / fp16 need AVX-512 or
    AMX extensions). Unknown CPUs (no /proc/cpuinfo) count as native, so nothing changes there."""
    flags = cpu_flags()
    if dtype == torch.float32 or not flags:
        return True
    if dtype == torch.bfloat16:
        return bool(flags & {"avx512_bf16", "amx_bf16"})
    if dtype == torch.float16:
        return bool(flags & {"avx512_fp16", "amx_fp16"})
    return True
