"""Decode at a prefill instance (the reverse of conditional disaggregation): pure keep-or-dispatch rule.

On a small cluster a fixed prefill/decode split leaves one side idle: with light prompts and long outputs
(LPHD) the prefill instance is mostly idle while the decode instance's batch grows past the size where a
decode step is still memory-bound (on a CPU that is a handful of rows). A prefill instance may then *keep*
a request it just prefilled and decode it itself (no KV transfer), with prefill keeping priority there: its
own decodes only run in steps where no prompt is queued.

The rule, for a request that has just been prefilled (first token sampled):
keep iff enabled, no other prompt is queued here (during a burst the prefill instance stays a prefill
instance), fewer than ``max_running`` kept decodes run here, the kept decodes' KV at full length (prompt +
``max_tokens``) stays within ``max_kv_fraction`` of this instance's pool, and
``own_running + 1 <= ratio * least`` where ``least`` = requests (running + queued) at the least-loaded
ACTIVE decode instance. With ``ratio`` r the prefill instance carries about r / (1 + r) of the decodes in
steady state; an idle decode tier (``least`` = 0) gets every request (disaggregation is the better choice
whenever the decode side has room).

Invariants: pure (``decode_loads`` and counts are passed in); never keeps while prompts wait here; never
commits more than ``max_kv_fraction`` of the pool to kept decodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tetriinfer.core.load import LoadReport, Role, accepting


@dataclass(frozen=True)
class KeepDecodeConfig:
    enabled: bool = False
    ratio: float = 0.5
    max_running: int = 32
    max_kv_fraction: float = 0.5

    def __post_init__(self) -> None:
        if not self.ratio > 0:
            raise ValueError(f"keep-decode ratio must be > 0, got {self.ratio}")
        if self.max_running < 1:
            raise ValueError(f"keep-decode max_running must be >= 1, got {self.max_running}")
        if not 0.0 < self.max_kv_fraction <= 1.0:
            raise ValueError(f"keep-decode max_kv_fraction must be in (0, 1], got {self.max_kv_fraction}")


def should_keep(
    config: KeepDecodeConfig,
    *,
    own_running: int,
    own_queued: int,
    own_committed_blocks: int,
    request_blocks: int,
    pool_blocks: int,
    decode_loads: Sequence[LoadReport],
) -> bool:
    """Keep this just-prefilled request here? ``own_committed_blocks`` = blocks the kept decodes need at full
    length; ``request_blocks`` = this request's blocks at full length (prompt + max_tokens)."""
    if not config.enabled or own_queued > 0 or own_running >= config.max_running:
        return False
    if own_committed_blocks + request_blocks > config.max_kv_fraction * pool_blocks:
        return False
    active = accepting(decode_loads, Role.DECODE)
    if not active:
        return False  # no decode tier to compare with: the dispatcher's own waiting rule applies
    least = min(r.num_running + r.num_queued for r in active)
    return own_running + 1 <= config.ratio * least
