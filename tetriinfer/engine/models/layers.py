"""Building blocks shared by the model families: linear layers, norms and rotary embeddings."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tetriinfer.engine import cpu_kernels
from tetriinfer.engine.cpu_info import cpu_flags, cpu_has_amx, cpu_has_native
from tetriinfer.engine.cpu_kernels import (
    MAX_ROWS,
    avx512_bf16_available,
    gemm_bf16_avx512,
    gemm_f32_avx512,
    gemv,
    kernels_available,
    kernels_threaded,
)
from tetriinfer.engine.onednn_packing import packed_linear

# Below this many rows a reduced-precision matmul stays native: it is memory-bound (decode), and reading
# the weights once in bf16 beats converting them to fp32 first.
UPCAST_MIN_ROWS = 16
# fp32 matmuls of at most this many rows (decode batches) go to the native kernel: it reads the weights once at
# the memory bandwidth for the whole batch; past ~48 rows torch's blocked GEMM catches up (measured at parity at 64
# on an AVX2 CPU).
GEMV_F32_MAX_ROWS = 48
# On AVX-512 CPUs torch's fp32 GEMM runs 16-lane FMAs while the native fp32 kernel runs 8-lane ones: measured on
# Zen 4 (SmolLM2-135M's four decoder matmuls, one thread), the kernel took 0.92 / 0.72 / 0.88x torch's time at
# 1 / 4 / 8 rows and 1.03 / 1.08 / 1.10 / 1.56x at 16 / 32 / 48 / 64 rows, so it keeps the fewest rows only.
GEMV_F32_MAX_ROWS_AVX512 = 8
# Where the AVX-512 kernels are built, fp32 matmuls of 2 to this many rows take the 16-lane fp32 kernel instead (one
# row keeps the AVX2 kernel's single linear weight stream, 9% faster there): on Zen 4, SmolLM2-135M's four decoder
# matmuls ran 2.1 / 1.6 / 1.4 / 1.3 / 1.2 / 1.2x faster than torch at 4 / 8 / 16 / 32 / 48 / 64 rows on one thread
# and 3.8 / 2.3 / 1.9 / 1.7 / 1.65 / 1.7x on two.
GEMM_F32_AVX512_MAX_ROWS = 64
# On CPUs with bf16 instructions but no AMX (AVX-512 BF16, e.g. AMD Zen 4), bf16 matmuls of at most this many rows
# use the native kernel too; from ~8 rows oneDNN's native bf16 GEMM wins (measured on Zen 4: whole decode steps of
# the tiny llama at batch 1/4/8/16 were fastest with 4).
GEMV_BF16_NATIVE_CPU_MAX_ROWS = 4
# Where the AVX-512 BF16 matmul (vdpbf16ps) is built, bf16 matmuls of at most this many rows take it instead (CPUs
# without AMX): on Zen 4 it ran the tiny llama's decode matmuls 3.3-3.6x faster than oneDNN at 1-8 rows, 2.3x at 16,
# 1.13x at 64 and at parity at 96 (one core, benchmarks/bench_decode_kernels.py has the whole steps). Split over
# two threads it kept its lead: SmolLM2-135M's four decoder matmuls ran 1.56 / 1.57 / 1.45x faster than oneDNN's
# two-thread GEMM at 32 / 48 / 64 rows (2.3 / 1.4 / 1.2x at 1 / 16 / 64 rows on one thread).
GEMM_BF16_AVX512_MAX_ROWS = 64
# On CPUs with AMX, oneDNN's bf16 GEMM runs on the tiles with ~57 us of fixed cost per call and almost no cost per
# row up to 16 rows; the AVX-512 BF16 kernel still wins below that: on a Sapphire Rapids core, the tiny llama's 33
# decode matmuls alone took 0.84 / 1.43 / 2.03 ms native against 2.33 / 2.39 / 2.38 ms oneDNN at 1 / 4 / 6 rows, and
# whole decode steps were fastest with this threshold (B = 8 / 10 / 12: 6.4 / 7.6 / 8.5 ms, against 7.4 / 9.1 / 8.8
# ms with 6; benchmarks/bench_decode_kernels.py).
GEMM_BF16_AVX512_MAX_ROWS_AMX = 10
# RMSNorm and RoPE of at most this many tokens (decode steps) use the fused native kernels; prefill chunks keep
# torch's vectorized ops, which win on many rows.
FUSED_MAX_ROWS = 64


def native_ok(x: torch.Tensor) -> bool:
    """The conditions every native decode kernel shares: a CPU tensor in fp32 or bf16, inference mode, kernels
    built, and either kernels that split their work over torch's threads (OpenMP builds) or one torch thread (a
    single-threaded build would leave the other threads idle while torch's parallel kernels use them all)."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and not torch.is_grad_enabled()
            and kernels_available() and (kernels_threaded() or torch.get_num_threads() == 1))


def use_fused(x: torch.Tensor) -> bool:
    """Whether this decode-sized activation can take the fused native RMSNorm / RoPE."""
    return 0 < x.shape[0] <= FUSED_MAX_ROWS and native_ok(x)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) that, on CPUs without native bf16 / fp16 instructions, computes
    reduced-precision matmuls of >= UPCAST_MIN_ROWS rows in fp32 (AVX2: torch's bf16 GEMM runs ~5x slower than
    fp32 there) and bf16 matmuls of fewer rows (decode) with the native AVX2 kernel of
    `tetriinfer.engine.cpu_kernels` when it is available (see `native_ok`); fp32 matmuls of at
    most `f32_native_matmul_max_rows()` rows (decode batches) use a native fp32 kernel under the same conditions
    (the AVX-512 one where it is built, else AVX2); on CPUs with bf16
    instructions, bf16 matmuls of at most `bf16_native_matmul_max_rows()` rows take the AVX-512 BF16 kernel (where
    it is built; fewer rows on AMX CPUs), else the AVX2 one (not on AMX CPUs). Same arithmetic as
    torch's GEMM (products and sums in fp32, output rounded to the model dtype); only the summation order differs.
    CUDA is untouched. A layer whose weight `tetriinfer.engine.onednn_packing` packed (bf16 on AMX CPUs) runs every
    matmul on the packed weight (its ``weight`` parameter may then be empty)."""

    packed_weight: torch.Tensor | None = None  # oneDNN's blocked layout of ``weight`` [out, in], set once at load

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.packed_weight is not None:
            flat = x.reshape(-1, x.shape[-1])
            return packed_linear(flat, self.packed_weight, self.bias).reshape(*x.shape[:-1], -1)
        if x.device.type == "cpu" and x.dim() == 2:
            kernel = self.native_kernel(x)
            if kernel == "gemm_bf16_avx512":  # names looked up per call: tests wrap them
                return gemm_bf16_avx512(x.contiguous(), self.weight, self.bias)
            if kernel == "gemm_f32_avx512":
                return gemm_f32_avx512(x.contiguous(), self.weight, self.bias)
            if kernel == "gemv":
                return gemv(x.contiguous(), self.weight, self.bias)
            if x.dtype != torch.float32 and not cpu_has_native(x.dtype) and x.shape[0] >= UPCAST_MIN_ROWS:
                bias = None if self.bias is None else self.bias.float()
                return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)

    def native_kernel(self, x: torch.Tensor) -> str | None:
        """The native matmul ("gemv", "gemm_bf16_avx512" or "gemm_f32_avx512", the `cpu_kernels` function) this layer runs on the CPU activation ``x`` [T, in], or
        None for torch's. The one routing decision: `forward` and the fused decode step
        (`tetriinfer.engine.fused_decode`) both follow it."""
        if self.packed_weight is not None:
            return None
        rows = x.shape[0]
        if x.dtype == torch.float32:
            if rows <= f32_native_matmul_max_rows() and use_gemv(x, self.weight):
                return "gemm_f32_avx512" if avx512_bf16_available() else "gemv"
        elif not cpu_has_native(x.dtype):
            if rows < UPCAST_MIN_ROWS and use_gemv(x, self.weight):
                return "gemv"
        elif x.dtype == torch.bfloat16 and rows <= bf16_native_matmul_max_rows() and use_gemv(x, self.weight):
            return "gemm_bf16_avx512" if avx512_bf16_available() else "gemv"
        return None


def f32_native_matmul_max_rows() -> int:
    """The most rows an fp32 matmul may have to take a native kernel: GEMM_F32_AVX512_MAX_ROWS where the AVX-512
    kernels are built, else `gemv_f32_max_rows()` (the AVX2 kernel)."""
    return GEMM_F32_AVX512_MAX_ROWS if avx512_bf16_available() else gemv_f32_max_rows()


def gemv_f32_max_rows() -> int:
    """The most rows an fp32 matmul may have to take the native kernel: fewer on AVX-512 CPUs, where torch's GEMM
    is twice as wide (a shape threshold per instruction set, the same at every thread count: both sides split
    their work over the engine's threads)."""
    return GEMV_F32_MAX_ROWS_AVX512 if "avx512f" in cpu_flags() else GEMV_F32_MAX_ROWS


def bf16_native_matmul_max_rows() -> int:
    """The most rows a bf16 matmul may have to take a native kernel on a CPU with bf16 instructions: the AVX-512 BF16
    kernel up to GEMM_BF16_AVX512_MAX_ROWS rows without AMX (GEMM_BF16_AVX512_MAX_ROWS_AMX with AMX, where oneDNN's
    tile GEMM wins sooner), else the AVX2 kernel up to GEMV_BF16_NATIVE_CPU_MAX_ROWS (never on AMX CPUs: 0)."""
    if avx512_bf16_available():
        return GEMM_BF16_AVX512_MAX_ROWS_AMX if cpu_has_amx() else GEMM_BF16_AVX512_MAX_ROWS
    return 0 if cpu_has_amx() else GEMV_BF16_NATIVE_CPU_MAX_ROWS


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a few-row matmul of `x` [T, in] by `weight` [out, in] (both bf16 or both fp32) can go to a native
    kernel: `native_ok` (kernels built, inference mode, threads they can use) and a contiguous weight."""
    return x.dtype == weight.dtype and 0 < x.shape[0] <= MAX_ROWS and weight.is_contiguous() and native_ok(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, dim] -> [T, dim]
        # Normalize in fp32 (as HF does), then scale in the model dtype.
        if x.dim() == 2 and x.dtype == self.weight.dtype and x.is_contiguous() and use_fused(x):
            return cpu_kernels.rmsnorm(x, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, with optional linear / llama3 scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, scale low ones, blend in between
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) RoPE, as in HF Llama."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T] -> cos, sin [T, 1, head_dim]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, heads, head_dim]
    if (x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] and x.dtype == cos.dtype and cos.is_contiguous()
            and sin.is_contiguous() and x.shape[-1] % 2 == 0 and use_fused(x)):
        return cpu_kernels.rope(x, cos, sin)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
