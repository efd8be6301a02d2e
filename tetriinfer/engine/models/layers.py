"""Building blocks shared by the model families: linear layers, norms and rotary embeddings."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

# Below this many rows a reduced-precision matmul stays native: it is memory-bound (decode), and reading
# the weights once in bf16 beats converting them to fp32 first.
UPCAST_MIN_ROWS = 16


@functools.cache
def _cpu_flags() -> frozenset[str]:
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
    flags = _cpu_flags()
    if dtype == torch.float32 or not flags:
        return True
    if dtype == torch.bfloat16:
        return bool(flags & {"avx512_bf16", "amx_bf16"})
    if dtype == torch.float16:
        return bool(flags & {"avx512_fp16", "amx_fp16"})
    return True


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) that computes bf16 / fp16 matmuls of >= UPCAST_MIN_ROWS
    rows in fp32 on CPUs without native instructions for them (AVX2: torch's bf16 GEMM runs ~5x slower
    than fp32 there). Same arithmetic as a native reduced-precision GEMM (products and sums in fp32,
    output rounded to the model dtype); only the summation order differs. fp32 and CUDA are untouched."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if (
            x.dtype != torch.float32
            and x.device.type == "cpu"
            and x.dim() == 2
            and x.shape[0] >= UPCAST_MIN_ROWS
            and not cpu_has_native(x.dtype)
        ):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, dim] -> [T, dim]
        # Normalize in fp32 (as HF does), then scale in the model dtype.
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
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
