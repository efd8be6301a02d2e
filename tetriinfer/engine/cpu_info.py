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


def isa_summary() -> str:
    """The instruction-set extensions that pick the engine's CPU paths, for reports ("unknown" without cpuinfo)."""
    flags = cpu_flags()
    return ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags) or "unknown"


@functools.cache
def onednn_bf16_packing_supported() -> bool:
    """Whether oneDNN can reorder bf16 weights into its packed layout on this CPU: torch refuses
    ``mkldnn._reorder_linear_weight`` for bf16 without AVX-512 BW/VL/DQ or AVX-NE-CONVERT (e.g. on AVX2-only CPUs).
    Every AMX CPU has them."""
    flags = cpu_flags()
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags


@functools.cache
def cpu_has_amx() -> bool:
    """Whether this CPU has AMX bf16 tile instructions (where torch's oneDNN bf16 kernels are tuned)."""
    return "amx_bf16" in cpu_flags()


def bf16_decode_wants_native_kernels() -> bool:
    """Whether bf16 decode (few-row matmuls, single-query attention) should take this project's native kernels
    over torch's: on every CPU without AMX. Without bf16 instructions (AVX2) torch emulates bf16; with AVX-512 BF16
    but no AMX (AMD Zen 4, measured there) oneDNN's small-M bf16 GEMM carries ~20 us of fixed cost per call and
    torch's bf16 SDPA gathers K/V first, so a tiny model's bf16 decode step took 2x the fp32 one. AMX CPUs keep
    torch's kernels (not measured here)."""
    return not cpu_has_amx()
