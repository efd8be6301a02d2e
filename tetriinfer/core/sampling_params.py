"""Per-request sampling parameters (vLLM-compatible field names).

Pure value object: validated once at construction, never mutated afterwards.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

MAX_SEED = 0x7FFFFFFF  # request seeds are 31-bit: every OpenAI-compatible server accepts them


def derived_seed(key: str) -> int:
    """A request seed that is a function of ``key`` only (its SHA-256, cut to 31 bits): the same key draws the same
    sampled answer from any server that honours ``seed``."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") & MAX_SEED


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples its output tokens.

    Invariants (checked in ``__post_init__``): ``max_tokens >= 1``, ``0 <= min_tokens <= max_tokens``,
    ``temperature >= 0`` (0 means greedy), ``0 < top_p <= 1``, ``top_k == -1 or top_k >= 1``,
    ``logprobs is None or logprobs >= 0``.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    n: int = 1
    # Filled from the request for ablations (oracle predictor); never read by sampling itself.
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Accept lists / single strings like vLLM does, but store tuples so the value stays immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", ())
        else:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.top_k is None or self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.n != 1:
            raise ValueError("only n=1 is supported")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
