"""Per-request limits and front-end admission (bounded work per request, bounded queues, 429 on overload).

``ServerLimits`` (frozen, validated) says how much one HTTP request may ask for and how much the front end holds at
once. ``Admission`` owns the one piece of state: the requests and tokens admitted and not yet finished.

Invariants:
- A request is checked against the per-request limits before any prompt is tokenized or any engine request is
  opened, so a huge body is a 400 at once (no work proportional to its size beyond JSON parsing).
- ``Admission.held_requests`` / ``held_tokens`` are the sums over admitted, unreleased tickets; every ticket is
  released exactly once (``release`` is idempotent per ticket), so both return to 0 when the server is idle.
- A request that would push either sum over its bound is refused with 429 and ``Retry-After`` before it is
  submitted; memory held by the front end stays bounded by the two bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_PROMPTS_PER_REQUEST = 64
DEFAULT_MAX_PROMPT_TOKENS_PER_REQUEST = 262_144  # summed over a request's prompts
DEFAULT_MAX_PENDING_REQUESTS = 4096
PENDING_TOKENS_PER_KV_TOKEN = 4  # default token bound: this many times the cluster's KV capacity in tokens
MIN_PENDING_TOKENS = 65_536


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for, and what the front end admits at once.

    ``max_prompts_per_request``: prompts in one completions request (each becomes one engine request).
    ``max_prompt_tokens_per_request``: prompt tokens summed over a request's prompts.
    ``max_tokens_default``: caps ``max_tokens`` when a request leaves it out (None: completions 16, chat the
    rest of the context, as vLLM). ``max_tokens_limit``: the largest ``max_tokens`` accepted (None: the context).
    ``max_pending_requests`` / ``max_pending_tokens``: engine requests / tokens (prompt + ``max_tokens``)
    admitted and unfinished; beyond them 429. ``max_pending_tokens=None``: derived from the KV capacity
    (``PENDING_TOKENS_PER_KV_TOKEN`` x the cluster's KV tokens, at least ``MIN_PENDING_TOKENS``).
    ``retry_after_s``: the ``Retry-After`` a 429 carries.
    """

    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_prompt_tokens_per_request: int = DEFAULT_MAX_PROMPT_TOKENS_PER_REQUEST
    max_tokens_default: int | None = None
    max_tokens_limit: int | None = None
    max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS
    max_pending_tokens: int | None = None
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        for name in ("max_prompts_per_request", "max_prompt_tokens_per_request", "max_pending_requests",
                     "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_tokens_default", "max_tokens_limit", "max_pending_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {v}")


def default_pending_tokens(kv_tokens: int) -> int:
    """The token bound derived from the cluster's KV capacity in tokens."""
    return max(MIN_PENDING_TOKENS, PENDING_TOKENS_PER_KV_TOKEN * kv_tokens)


class Admission:
    """Counts admitted, unfinished engine requests and their tokens against the bounds.

    ``max_tokens`` is resolved on first use through ``capacity_tokens`` (the KV capacity is known only once the
    client has started)."""

    def __init__(self, max_requests: int, max_tokens: int | None) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.held_requests = 0
        self.held_tokens = 0
        self.num_refused = 0

    def try_admit(self, num_requests: int, num_tokens: int) -> bool:
        """Admit (and count) a request of ``num_requests`` engine requests holding ``num_tokens``, or refuse it.

        An idle front end admits any single request that passed the per-request limits, so a request never waits
        for capacity it can never get."""
        idle = self.held_requests == 0
        over_requests = self.held_requests + num_requests > self.max_requests
        over_tokens = self.max_tokens is not None and self.held_tokens + num_tokens > self.max_tokens
        if not idle and (over_requests or over_tokens):
            self.num_refused += 1
            return False
        self.held_requests += num_requests
        self.held_tokens += num_tokens
        return True

    def release(self, num_requests: int, num_tokens: int) -> None:
        self.held_requests -= num_requests
        self.held_tokens -= num_tokens
        assert self.held_requests >= 0 and self.held_tokens >= 0, "released more than admitted"
