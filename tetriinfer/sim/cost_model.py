"""How long one scheduled step takes: the simulator's executor of a ``SchedulerOutput``.

Two models, both pure functions of the step (no clock, no torch):

- ``ProfileCostModel``: measured on a real engine (``tetriinfer profile``: prefill seconds per forward size,
  decode seconds per batch size). A step with any prompt tokens costs the prefill curve at its total token
  count (decode rows in a mixed step count as tokens); a pure decode step costs the decode curve at its batch
  size. Linear interpolation between measured points, linear extrapolation past the ends. Attention's growth
  with context is only what the profile saw (prefill from position 0, decode at the profile's context).
- ``RooflineCostModel``: analytic, for accelerators you cannot profile here. Each part of the forward costs
  ``max(FLOPs / (peak x mfu), bytes / (bandwidth x mbu))``; parts: the layers' linear weights (read once per
  step, 2 FLOPs per weight per token), the LM head (sampled rows only), attention (causal FLOPs over each
  segment's context; the context's K/V read once), plus a fixed per-step overhead (scheduler, launch).
  Presets for common GPUs and models; efficiencies are assumptions, stated in the report.

Invariants: a step's cost is > 0 for a non-empty step, 0 for an empty one, and never decreases when a token
or a row is added to a step of the same kind.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

from tetriinfer.core.step import SchedulerOutput
from tetriinfer.model_config import MODEL_PRESETS, ModelConfig, model_config  # noqa: F401 - re-exported


class CostModel(Protocol):
    def step_seconds(self, out: SchedulerOutput) -> float: ...

    # optional: ``decode_run_seconds(context_sum, rows, steps) -> list[float] | None``, the prices of a steady
    # decode run (``core.steady_decode``) equal to ``step_seconds`` of each of its steps bit for bit


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (sorted xs), extended linearly past both ends; >= 0."""
    if len(xs) == 1:
        return max(0.0, ys[0] * x / xs[0]) if xs[0] else ys[0]
    i = bisect.bisect_left(xs, x)
    lo = min(max(i - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[lo], xs[lo + 1], ys[lo], ys[lo + 1]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _reduce_by_init_fields(obj: Any) -> tuple[Any, tuple[Any, ...]]:
    """``__reduce__`` of a frozen dataclass with derived ``init=False`` fields: rebuilt from its constructor
    arguments (its ``__post_init__`` derives the rest again), so it pickles the same whether the class is an
    ordinary one or a native class of a compiled build (``scripts/build_native_sim.py``), which cannot restore a
    frozen instance attribute by attribute."""
    return type(obj), tuple(getattr(obj, f.name) for f in fields(obj) if f.init)


def _envelope(points: dict[int, float]) -> tuple[tuple[int, float], ...]:
    """Sorted (size, seconds) with each time capped by every larger size's time (non-decreasing)."""
    out: list[tuple[int, float]] = []
    cap = float("inf")
    for x in sorted(points, reverse=True):
        cap = min(cap, points[x])
        out.append((x, cap))
    return tuple(reversed(out))


@dataclass(frozen=True)
class ProfileCostModel:
    """``prefill``: (tokens per forward, seconds) points; ``decode``: (batch, seconds) points."""

    prefill: tuple[tuple[int, float], ...]
    decode: tuple[tuple[int, float], ...]
    step_overhead_s: float = 0.0
    source: str = ""
    # derived in __post_init__: the curves as (sizes, seconds) float lists (step_seconds runs for every step)
    _prefill_xy: tuple[list[float], list[float]] = field(init=False, repr=False, compare=False)
    _decode_xy: tuple[list[float], list[float]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            pts = getattr(self, name)
            if not pts:
                raise ValueError(f"{name} needs at least one measured point")
            xs = [x for x, _ in pts]
            if xs != sorted(set(xs)) or any(x < 1 for x in xs) or any(not y > 0 for _, y in pts):
                raise ValueError(f"{name} points must have distinct increasing sizes >= 1 and seconds > 0")
        if self.step_overhead_s < 0:
            raise ValueError(f"step_overhead_s must be >= 0, got {self.step_overhead_s}")
        object.__setattr__(self, "_prefill_xy", ([float(x) for x, _ in self.prefill], [y for _, y in self.prefill]))
        object.__setattr__(self, "_decode_xy", ([float(x) for x, _ in self.decode], [y for _, y in self.decode]))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _reduce_by_init_fields(self)

    @classmethod
    def from_profile(cls, profile: dict[str, Any] | str | Path | list[dict[str, Any] | str | Path],
                     step_overhead_s: float = 0.0) -> ProfileCostModel:
        """From ``tetriinfer profile`` JSON (its ``prefill``/``decode`` lists), parsed dicts, or several of them.

        Timing noise on a shared machine only ever adds time, so the model takes the lower envelope: the fastest
        measurement of each size over all profiles, then, since a larger step never costs less, each size's time
        capped by every larger size's (a non-decreasing curve)."""
        profiles = profile if isinstance(profile, list) else [profile]
        pre: dict[int, float] = {}
        dec: dict[int, float] = {}
        sources = []
        for prof in profiles:
            if not isinstance(prof, dict):
                sources.append(str(prof))
                prof = json.loads(Path(prof).read_text())
            else:
                sources.append(str(prof.get("model", "")))
            for r in prof["prefill"]:
                n = int(r["tokens"])
                pre[n] = min(pre.get(n, float("inf")), float(r["seconds"]))
            for r in prof["decode"]:
                b = int(r["batch"])
                dec[b] = min(dec.get(b, float("inf")), float(r["seconds"]))
        return cls(_envelope(pre), _envelope(dec), step_overhead_s, ", ".join(sources))

    def prefill_seconds(self, num_tokens: int) -> float:
        xs, ys = self._prefill_xy
        return _interp(xs, ys, float(num_tokens))

    def decode_seconds(self, batch: int) -> float:
        xs, ys = self._decode_xy
        return _interp(xs, ys, float(batch))

    def step_seconds(self, out: SchedulerOutput) -> float:
        if out.is_empty:
            return 0.0
        if out.is_decode_only:
            return self.decode_seconds(len(out.segments)) + self.step_overhead_s
        return self.prefill_seconds(out.num_scheduled_tokens + out.num_padding_tokens) + self.step_overhead_s

    def decode_run_seconds(self, context_sum: int, rows: int, steps: int) -> list[float] | None:
        """``step_seconds`` of ``steps`` consecutive pure decode steps of ``rows`` rows (a decode step's price here
        depends on its batch only): the same float for every step."""
        return [self.decode_seconds(rows) + self.step_overhead_s] * steps

    def decode_run_exact(self, context_sum: int, rows: int, steps: int) -> bool:
        """``decode_run_seconds`` always prices a run here."""
        return True

    def describe(self) -> str:
        return f"profile {self.source or '(inline)'}, step overhead {self.step_overhead_s * 1e3:.1f} ms"


# ------------------------------------------------------------------------------------------ roofline


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense FLOP/s at the serving dtype
    mem_bandwidth_Bps: float
    memory_bytes: float

    def __post_init__(self) -> None:
        if not (self.peak_flops > 0 and self.mem_bandwidth_Bps > 0 and self.memory_bytes > 0):
            raise ValueError(f"hardware {self.name!r}: peak_flops, mem_bandwidth_Bps and memory_bytes must be > 0")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _reduce_by_init_fields(self)


GIB = 1024**3
# Datasheet dense fp16/bf16 tensor-core peaks and HBM bandwidths.
HARDWARE_PRESETS: dict[str, Hardware] = {
    "v100-32g": Hardware("V100 32GB", 125e12, 900e9, 32 * GIB),
    "a100-40g": Hardware("A100 40GB", 312e12, 1.555e12, 40 * GIB),
    "a100-80g": Hardware("A100 80GB", 312e12, 2.039e12, 80 * GIB),
    "h100-80g": Hardware("H100 SXM 80GB", 989e12, 3.35e12, 80 * GIB),
    "h200-141g": Hardware("H200 141GB", 989e12, 4.8e12, 141 * GIB),
}


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int) -> int:
    """K and V of every layer for one token."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


@dataclass(frozen=True)
class RooflineCostModel:
    model: ModelConfig
    hardware: Hardware
    dtype_bytes: int = 2
    mfu: float = 0.5  # achieved / peak FLOP/s on compute-bound parts (assumption)
    mbu: float = 0.7  # achieved / peak bandwidth on memory-bound parts (assumption)
    step_overhead_s: float = 0.003  # scheduling + launch per step (assumption)
    tensor_parallel: int = 1
    # derived in __post_init__: the constants of every step's arithmetic (step_seconds runs for every step)
    _peak: float = field(init=False, repr=False, compare=False)  # FLOP/s achieved, all TP ranks
    _bw: float = field(init=False, repr=False, compare=False)  # bytes/s achieved, all TP ranks
    _linear_flops: float = field(init=False, repr=False, compare=False)  # per token
    _linear_read_s: float = field(init=False, repr=False, compare=False)  # per step
    _head_flops: float = field(init=False, repr=False, compare=False)  # per sampled row
    _head_read_s: float = field(init=False, repr=False, compare=False)  # per step
    _attn_flops: float = field(init=False, repr=False, compare=False)  # per (query token x context token)
    _kv_per_token: int = field(init=False, repr=False, compare=False)  # K and V bytes of one token

    def __post_init__(self) -> None:
        if self.dtype_bytes not in (1, 2, 4):
            raise ValueError(f"dtype_bytes must be 1, 2 or 4, got {self.dtype_bytes}")
        if not (0 < self.mfu <= 1 and 0 < self.mbu <= 1):
            raise ValueError("mfu and mbu must be in (0, 1]")
        if self.step_overhead_s < 0:
            raise ValueError("step_overhead_s must be >= 0")
        if self.tensor_parallel < 1:
            raise ValueError("tensor_parallel must be >= 1")
        # constants of every step's arithmetic, computed once (step_seconds runs for every simulated step); the
        # same expressions in the same order as spelled out in ``step_seconds``, so the floats are identical
        tp, m = self.tensor_parallel, self.model
        lm_head = m.vocab_size * m.hidden_size
        layer = m.num_params() - lm_head * (1 if m.tie_word_embeddings else 2)
        peak = self.hardware.peak_flops * self.mfu * tp
        bw = self.hardware.mem_bandwidth_Bps * self.mbu * tp
        set_const = object.__setattr__
        set_const(self, "_peak", peak)
        set_const(self, "_bw", bw)
        set_const(self, "_linear_flops", 2.0 * layer)
        set_const(self, "_linear_read_s", layer * self.dtype_bytes / bw)
        set_const(self, "_head_flops", 2.0 * lm_head)
        set_const(self, "_head_read_s", lm_head * self.dtype_bytes / bw)
        set_const(self, "_attn_flops", 4.0 * m.num_layers * (m.num_heads * m.head_dim))
        set_const(self, "_kv_per_token", kv_bytes_per_token(m, self.dtype_bytes))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _reduce_by_init_fields(self)

    @property
    def lm_head_params(self) -> int:
        return self.model.vocab_size * self.model.hidden_size

    @property
    def layer_params(self) -> int:
        """Weights the layers read per step: everything but the embedding table(s)."""
        tied = self.model.tie_word_embeddings
        return self.model.num_params() - self.lm_head_params * (1 if tied else 2)

    @property
    def weight_bytes(self) -> int:
        return self.model.num_params() * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model, self.dtype_bytes)

    def _roofline(self, flops: float, nbytes: float) -> float:
        tp = self.tensor_parallel
        peak, bw = self.hardware.peak_flops * self.mfu * tp, self.hardware.mem_bandwidth_Bps * self.mbu * tp
        return max(flops / peak, nbytes / bw)

    def step_seconds(self, out: SchedulerOutput) -> float:
        """``linear + head + attn + step_overhead_s``: linear = roofline(2 x layer weights x tokens FLOPs, layer
        weight bytes); head = roofline(2 x LM-head weights x sampled rows, LM-head bytes); attn = roofline(sum over
        segments of 4 x layers x heads x head_dim x q x (start + (q + 1) / 2), (sum of segment ends + tokens) x KV
        bytes per token). Tokens include padding."""
        segments = out.segments
        if not segments:
            return 0.0
        peak = self._peak
        per_token = self._kv_per_token
        attn_c = self._attn_flops
        tokens = sampled = 0
        attn_flops = 0.0
        kv_read = 0.0
        for s in segments:
            q = len(s.token_ids)
            start = s.start
            tokens += q
            sampled += s.sample
            attn_flops += attn_c * q * (start + (q + 1) / 2.0)  # QK^T and PV, causal
            kv_read += (start + q) * per_token
        tokens += out.num_padding_tokens
        linear = max(self._linear_flops * tokens / peak, self._linear_read_s)
        head = max(self._head_flops * sampled / peak, self._head_read_s)
        attn = max(attn_flops / peak, (kv_read + tokens * per_token) / self._bw)
        return linear + head + attn + self.step_overhead_s

    def decode_run_seconds(self, context_sum: int, rows: int, steps: int) -> list[float] | None:
        """``step_seconds`` of ``steps`` consecutive pure decode steps of ``rows`` rows (one sampled token each, no
        padding) whose ``start + 1`` sum to ``context_sum`` at the first step and grow by ``rows`` per step, bit
        for bit, without building the steps: ``step_seconds`` adds integer-valued floats there (each row's
        ``attn x (start + 1)`` and ``(start + 1) x KV bytes``), which is exact below 2**53, so the sums equal
        ``attn x context_sum`` and ``context_sum x KV bytes``. None when a sum could reach 2**53 (or the attention
        constant is not an integer): then only ``step_seconds`` gives the exact float."""
        if not self.decode_run_exact(context_sum, rows, steps):
            return None
        peak, bw = self._peak, self._bw
        per_token, attn_c = self._kv_per_token, self._attn_flops
        last = context_sum + rows * (steps - 1)
        linear = max(self._linear_flops * rows / peak, self._linear_read_s)
        head = max(self._head_flops * rows / peak, self._head_read_s)
        overhead, tail = self.step_overhead_s, rows * per_token
        base = linear + head  # ``linear + head + attn + overhead`` adds left to right: this sum comes first
        # attn = max(attn_c * ctx / peak, (ctx * KV bytes + tail) / bw) per step; the integer sums are below 2**53,
        # so they convert to float exactly, as the per-row float sums of ``step_seconds`` are exact
        out: list[float] = []
        append = out.append
        for ctx in range(context_sum, last + 1, rows):
            flops_s, read_s = attn_c * ctx / peak, (ctx * per_token + tail) / bw
            append(base + (flops_s if flops_s >= read_s else read_s) + overhead)  # max(flops_s, read_s)
        return out

    def decode_run_exact(self, context_sum: int, rows: int, steps: int) -> bool:
        """Whether ``decode_run_seconds(context_sum, rows, steps)`` prices the run (bit for bit) rather than
        returning None: every sum it takes stays below 2**53. True for any shorter run or chunk of it."""
        per_token, attn_c = self._kv_per_token, self._attn_flops
        last = context_sum + rows * (steps - 1)
        return attn_c.is_integer() and attn_c * last < 2.0**53 and (last + rows) * per_token < 2**53

    def kv_capacity_tokens(self, memory_fraction: float = 0.9) -> int:
        """Tokens of KV that fit next to the weights in ``memory_fraction`` of the device memory (x TP)."""
        free = self.hardware.memory_bytes * self.tensor_parallel * memory_fraction - self.weight_bytes
        if free <= 0:
            raise ValueError(f"{self.model.architecture} weights ({self.weight_bytes / GIB:.1f} GiB) do not fit on "
                             f"{self.tensor_parallel} x {self.hardware.name}")
        return int(free // self.kv_bytes_per_token)

    def describe(self) -> str:
        return (f"roofline {self.hardware.name} x{self.tensor_parallel}, {self.dtype_bytes}-byte weights, "
                f"mfu {self.mfu:.2f}, mbu {self.mbu:.2f}, step overhead {self.step_overhead_s * 1e3:.1f} ms")
