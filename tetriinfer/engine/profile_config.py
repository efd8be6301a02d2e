"""What ``tetriinfer profile`` sweeps (torch-free, so the CLI can show its defaults without importing torch)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFILL_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class ProfileConfig:
    prefill_tokens: tuple[int, ...] = DEFAULT_PREFILL_TOKENS
    decode_batches: tuple[int, ...] = DEFAULT_DECODE_BATCHES
    decode_context: int = 128
    repeats: int = 3
    saturation_gain: float = 0.05

    def __post_init__(self) -> None:
        if not self.prefill_tokens or any(n < 1 for n in self.prefill_tokens):
            raise ValueError("prefill_tokens must be positive sizes")
        if not self.decode_batches or any(b < 1 for b in self.decode_batches):
            raise ValueError("decode_batches must be positive sizes")
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")
        if self.decode_context < 1:
            raise ValueError("decode_context must be >= 1")
