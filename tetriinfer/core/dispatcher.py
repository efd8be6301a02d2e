"""Decentralized dispatcher at each prefill instance (TetriInfer section 3.4): choose a decode instance.

Input: the monitor's latest broadcast of decode load reports and one prefilled request's prompt length
and predicted output bucket. Only ACTIVE decode instances are candidates (draining/flipping ones are
skipped). Policies:

- ``length-aware`` (the paper's): split candidates into *alpha* (free KV blocks >= blocks for
  ``prompt + predicted lower bound``, capped at the instance's pool) and *beta*. Pick ``num_choices`` (default 2: power of two
  choices) at random from alpha and send to the one with the least interference: fewest decodes of
  this request's class (heavy or light), so each class is spread evenly and the heavy:light ratios
  stay even across instances (ties: fewer decodes, more free blocks, then the draw order). If alpha is empty: ``wait`` (no decision) or
  ``least-loaded`` over beta, as configured.
  Invariant: an instance in beta is never chosen while alpha is non-empty.
- ``random``, ``round-robin``, ``least-loaded``: length-unaware ablations over all candidates.
- ``imbalanced``: the hotspot the paper avoids, for ablations: every heavy decode goes to the first
  candidate (by id), light ones round-robin over the others.

Deterministic given ``seed``: the only randomness is the dispatcher's own ``random.Random``.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tetriinfer.core.load import (
    DEFAULT_HEAVY_DECODE_TOKENS,
    LoadReport,
    Role,
    accepting,
    is_heavy_decode,
    least_loaded,
)


class DispatchPolicy(enum.Enum):
    LENGTH_AWARE = "length-aware"
    RANDOM = "random"
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"
    IMBALANCED = "imbalanced"


class AlphaEmptyAction(enum.Enum):
    WAIT = "wait"
    LEAST_LOADED = "least-loaded"


@dataclass(frozen=True)
class DispatcherConfig:
    policy: DispatchPolicy | str = DispatchPolicy.LENGTH_AWARE
    heavy_decode_tokens: int = DEFAULT_HEAVY_DECODE_TOKENS
    alpha_empty: AlphaEmptyAction | str = AlphaEmptyAction.LEAST_LOADED
    num_choices: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "policy", DispatchPolicy(self.policy))
        except ValueError:
            names = ", ".join(p.value for p in DispatchPolicy)
            raise ValueError(f"unknown dispatch policy {self.policy!r}; choose one of: {names}") from None
        try:
            object.__setattr__(self, "alpha_empty", AlphaEmptyAction(self.alpha_empty))
        except ValueError:
            raise ValueError(f"alpha_empty must be 'wait' or 'least-loaded', got {self.alpha_empty!r}") from None
        if self.heavy_decode_tokens < 0:
            raise ValueError(f"heavy_decode_tokens must be >= 0, got {self.heavy_decode_tokens}")
        if self.num_choices < 1:
            raise ValueError(f"num_choices must be >= 1, got {self.num_choices}")


@dataclass(frozen=True)
class DispatchDecision:
    """``instance_id`` is None when the request must wait (no candidate, or alpha empty with WAIT).
    ``alpha`` lists the alpha set (length-aware only); ``choices`` the instances drawn at random."""

    instance_id: str | None
    reason: str
    heavy: bool
    alpha: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()


class Dispatcher:
    """Owns only its random generator and round-robin cursor; reads load reports, never mutates them."""

    def __init__(self, config: DispatcherConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._rr = 0

    def choose(
        self, loads: Sequence[LoadReport], prompt_tokens: int, predicted_lower: int | None = None,
    ) -> DispatchDecision:
        """Pick a decode instance for a request with ``prompt_tokens`` of context and the predicted
        bucket's lower bound ``predicted_lower`` (None: no prediction; light, need = prompt + 1)."""
        if prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
        cfg = self.config
        heavy = is_heavy_decode(predicted_lower, cfg.heavy_decode_tokens)
        cands = accepting(loads, Role.DECODE)
        if not cands:
            return DispatchDecision(None, "no active decode instance", heavy)
        policy = cfg.policy
        if policy is DispatchPolicy.RANDOM:
            return DispatchDecision(self._rng.choice(cands).instance_id, "random", heavy)
        if policy is DispatchPolicy.ROUND_ROBIN:
            pick = cands[self._rr % len(cands)]
            self._rr += 1
            return DispatchDecision(pick.instance_id, "round-robin", heavy)
        if policy is DispatchPolicy.LEAST_LOADED:
            return DispatchDecision(least_loaded(cands).instance_id, "least-loaded", heavy)  # type: ignore[union-attr]
        if policy is DispatchPolicy.IMBALANCED:
            if heavy or len(cands) == 1:
                return DispatchDecision(cands[0].instance_id, "imbalanced: heavy hotspot", heavy)
            pick = cands[1 + self._rr % (len(cands) - 1)]
            self._rr += 1
            return DispatchDecision(pick.instance_id, "imbalanced: light", heavy)
        return self._length_aware(cands, prompt_tokens, predicted_lower, heavy)

    def _length_aware(
        self, cands: list[LoadReport], prompt_tokens: int, predicted_lower: int | None, heavy: bool,
    ) -> DispatchDecision:
        decode_tokens = max(1, predicted_lower or 0)
        # A need above an instance's whole pool is capped at the pool (as the decode reservation is):
        # an empty instance is always in alpha, so a request never waits for memory that cannot exist.
        need = prompt_tokens + decode_tokens  # tokens; each instance's blocks_for_tokens, inline (one pass per request)
        alpha = [
            r for r in cands
            if r.num_free_blocks >= min(r.num_free_blocks + r.num_used_blocks, -(-need // r.block_size))
        ]
        alpha_ids = tuple(r.instance_id for r in alpha)
        if not alpha:
            if self.config.alpha_empty is AlphaEmptyAction.WAIT:
                return DispatchDecision(None, "alpha empty: wait", heavy)
            pick = least_loaded(cands)
            assert pick is not None
            return DispatchDecision(pick.instance_id, "alpha empty: least-loaded", heavy)
        choices = self._rng.sample(alpha, min(self.config.num_choices, len(alpha)))

        def interference(item: tuple[int, LoadReport]) -> tuple[int, int, int, int]:
            draw, r = item
            same_class = r.num_heavy_decodes if heavy else r.num_light_decodes
            return (same_class, r.num_heavy_decodes + r.num_light_decodes, -r.num_free_blocks, draw)

        _, best = min(enumerate(choices), key=interference)
        return DispatchDecision(
            best.instance_id, "length-aware", heavy, alpha_ids, tuple(r.instance_id for r in choices)
        )


def charge_dispatch(
    loads: Sequence[LoadReport], decode_id: str, num_tokens: int, predicted_lower: int | None,
    heavy_decode_tokens: int = DEFAULT_HEAVY_DECODE_TOKENS,
) -> list[LoadReport]:
    """The dispatcher's view after sending a request of ``num_tokens`` (context) to ``decode_id``: that
    instance's report charged optimistically (blocks for the context plus the predicted lower bound, one more
    queued request of its class) until its next real report, so a burst between two broadcasts is spread
    instead of herding onto one instance. Returns new reports; the inputs are not mutated."""
    out = list(loads)
    for i, r in enumerate(out):
        if r.instance_id == decode_id:
            need = min(r.num_free_blocks, r.blocks_for_tokens(num_tokens + max(1, predicted_lower or 1)))
            heavy = (predicted_lower or 0) > heavy_decode_tokens
            out[i] = replace(
                r,
                num_free_blocks=r.num_free_blocks - need,
                num_used_blocks=r.num_used_blocks + need,
                num_queued=r.num_queued + 1,
                num_heavy_decodes=r.num_heavy_decodes + int(heavy),
                num_light_decodes=r.num_light_decodes + int(not heavy),
            )
            break
    return out
