"""Fixed-size chunk building (TetriInfer section 3.3).

Prompt tokens of several requests are sliced and merged, in the scheduler's order, into chunks of
exactly ``chunk_size`` tokens; the last chunk is padded. Each request keeps a pointer to its last
prefilled token (``num_computed_tokens``), so a request may span several chunks.

Merge limit (``merge_limit``, off by default): the paper fills every chunk because below the accelerator's
saturation threshold extra tokens are free. Where a forward's cost grows with every token past a low threshold
(a CPU saturates at ~128 tokens), tokens merged in behind the first request only delay its first token, so a
later request joins a chunk only while the chunk holds fewer than ``merge_limit`` tokens, and only up to
``merge_limit`` tokens in all; the first request's slice is bounded by ``chunk_size`` alone.

Tail merge (``chunk_budget``, off by default): when everything queued exceeds one chunk by at most ``tail_tokens``,
the chunk takes it all instead of leaving a tail that would run alone in the next step. Such a tail sits below the
accelerator's saturation point, where a step costs about the same whatever its size (every weight is read once, plus
the step's fixed overhead), so a prompt alone in the queue pays a whole extra step for a few dozen tokens: a 1087-token
prompt as 512 + 512 + 63 tokens costs 8% more than in one forward on a simulated A100 (Llama-2-13B), and that is its
time to first token. A chunk grows only past ``chunk_size`` when it empties the queue, so no request waits behind the
extra tokens; padding never fills past ``chunk_size``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkSlice:
    request_id: str
    start: int  # first token position of the slice in the request
    num_tokens: int


@dataclass(frozen=True)
class Chunk:
    """Invariant: ``sum(s.num_tokens for s in slices) + num_padding == max(chunk_size, num_real_tokens)`` (when
    padded; more real tokens than ``chunk_size`` only under a tail merge, ``chunk_budget``)."""

    slices: tuple[ChunkSlice, ...]
    chunk_size: int
    num_padding: int

    @property
    def num_real_tokens(self) -> int:
        return sum(s.num_tokens for s in self.slices)


def chunk_budget(chunk_size: int, queued_tokens: int, tail_tokens: int) -> int:
    """Tokens the next chunk may hold (module docstring, tail merge): ``queued_tokens`` (all prompt tokens still to
    prefill) when they exceed ``chunk_size`` by at most ``tail_tokens``, else ``chunk_size``."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if tail_tokens < 0:
        raise ValueError(f"tail_tokens must be >= 0, got {tail_tokens}")
    return queued_tokens if chunk_size < queued_tokens <= chunk_size + tail_tokens else chunk_size


def build_chunk(
    candidates: Iterable[tuple[str, int, int]],
    chunk_size: int,
    admit: Callable[[str, int, int], int] | None = None,
    pad: bool = True,
    merge_limit: int | None = None,
    budget: int | None = None,
) -> Chunk:
    """Fill one chunk from ``candidates`` = (request_id, start, num_remaining) in priority order.

    ``admit(request_id, start, n)`` may shrink a slice (e.g. to the KV blocks available) by returning
    how many of the ``n`` tokens it accepts; returning 0 stops filling (order is preserved: a later
    request never overtakes an earlier one that could not get memory). ``merge_limit``: see the module
    docstring (None: fill the whole chunk). ``budget``: tokens the chunk may hold when a tail merge lets it hold
    more than ``chunk_size`` (``chunk_budget``; None: ``chunk_size``); padding fills up to ``chunk_size`` only.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if merge_limit is not None and merge_limit < 1:
        raise ValueError(f"merge_limit must be >= 1 or None, got {merge_limit}")
    if budget is not None and budget < chunk_size:
        raise ValueError(f"budget must be >= chunk_size ({chunk_size}), got {budget}")
    full = chunk_size if budget is None else budget
    budget = full
    slices: list[ChunkSlice] = []
    for request_id, start, remaining in candidates:  # lazily: no candidate is drawn once the chunk is full
        if remaining <= 0:
            continue
        n = min(budget, remaining)
        if slices and merge_limit is not None:
            n = min(n, merge_limit - (full - budget))
            if n <= 0:
                break
        if admit is not None:
            n = min(n, admit(request_id, start, n))
            if n <= 0:
                break
        slices.append(ChunkSlice(request_id, start, n))
        budget -= n
        if budget == 0:
            break
    num_padding = max(0, chunk_size - (full - budget)) if (pad and slices) else 0
    return Chunk(tuple(slices), chunk_size, num_padding)
