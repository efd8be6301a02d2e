"""Steady decode runs: many identical decode steps of one batch, applied at once.

A scheduler whose next steps cannot change its batch (no request waits, resumes, arrives or finishes, and the
free blocks cover every block the rows will grow into) runs the same rows step after step, each row one token
further. A simulator stepping such a run one event per step spends its time on bookkeeping that says nothing
new; this module lets it jump: ``steady_run_length`` says how many steps are provably steady, and
``advance_steady`` applies any prefix of them at once.

Half steps: a steady run is the sequence schedule(1), update(1), schedule(2), update(2), ...; half step ``h``
counts both (h = 2s - 1: step s scheduled; h = 2s: step s updated). ``advance_steady(.., done, to, ..)`` moves a
scheduler from ``done`` to ``to`` half steps of the run, so a run can be stopped inside a step (scheduled, its
blocks taken, not yet updated) exactly where a step-by-step run would be at that moment.

Invariants (the module's tests compare with ``schedule()`` + ``update()`` called step by step):
- after ``advance_steady`` the requests (outputs, computed tokens, status), the block tables (block for block, in
  the pool's allocation order: rows grow oldest first within a step, steps in order) and the free pool equal
  those of the step-by-step run at the same half step;
- no row finishes, is preempted or waits inside a run of ``steady_run_length`` steps, so nothing is reported
  that the step-by-step run would have reported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.request import Request, RequestStatus
from tetriinfer.core.step import ScheduledSegment, SchedulerOutput, StepKind


def _steps_to_finish(req: Request, token: int, max_model_len: int) -> int:
    """The first step (1-based) after whose update ``req`` would stop when every step samples ``token``."""
    params = req.sampling_params
    n_out = len(req.output_token_ids)
    first = min(params.max_tokens - n_out, max_model_len - len(req.prompt_token_ids) - n_out)
    if (not params.ignore_eos and req.eos_token_id is not None and token == req.eos_token_id) or (
        token in params.stop_token_ids
    ):
        first = min(first, max(1, params.min_tokens - n_out))
    return first


def is_decode_row(req: Request) -> bool:
    """Running, one output token or more, every token but the last computed (its next step is one decode row)."""
    n_out = len(req.output_token_ids)
    return (req.status is RequestStatus.RUNNING and n_out > 0
            and req.num_computed_tokens == len(req.prompt_token_ids) + n_out - 1)


def steady_run_length(running: Sequence[Request], kv: KVCacheManager, token: int, max_model_len: int,
                      limit: int) -> int:
    """How many of the next steps (at most ``limit``) are steady for ``running`` (every one a decode row; the
    caller checks that nothing else can enter its batch): no row finishes before the step after them and the
    free blocks cover every block the rows grow into meanwhile. 0 when ``running`` is empty."""
    if not running or limit < 1:
        return 0
    k = limit
    for req in running:
        k = min(k, _steps_to_finish(req, token, max_model_len) - 1)
        if k < 1:
            return 0
    bs = kv.block_size
    free = kv.num_free_blocks
    rows = [(len(r.prompt_token_ids) + len(r.output_token_ids), kv.num_blocks_of(r.request_id)) for r in running]

    def blocks_needed(steps: int) -> int:  # step s schedules each row's context at total + s - 1 tokens
        return sum(max(0, -(-(total + steps - 1) // bs) - held) for total, held in rows)

    if blocks_needed(k) <= free:
        return k
    lo, hi = 0, k  # blocks_needed grows with steps: the largest steps that fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks_needed(mid) <= free:
            lo = mid
        else:
            hi = mid - 1
    return lo


def advance_steady(running: Sequence[Request], kv: KVCacheManager, token: int, done: int, to: int,
                   on_grow: Callable[[str, int], None] | None = None) -> int:
    """Move ``running`` from ``done`` to ``to`` half steps of a steady run (see the module docstring) whose every
    step samples ``token``; ``to`` must be within the run ``steady_run_length`` allowed. ``on_grow(request_id,
    blocks_held)`` is called after each block a row takes, in allocation order. Returns the number of steps
    scheduled (the caller's step counter moves by as many)."""
    if to < done:
        raise ValueError(f"a steady run cannot go back ({done} -> {to} half steps)")
    s0, s1 = (done + 1) // 2, (to + 1) // 2  # steps scheduled before / after
    u0, u1 = done // 2, to // 2  # steps updated before / after
    if s1 > s0:
        grow = kv.grow
        for _, _, rid, tokens in _block_grows(running, kv, done, to):
            held = grow(rid, tokens)
            if held < 0:
                raise AssertionError(f"steady run outgrew the free blocks at {rid}")
            if on_grow is not None:
                on_grow(rid, held)
    n = u1 - u0
    if n:
        more = [token] * n
        for req in running:
            req.output_token_ids.extend(more)
            req.num_computed_tokens += n
    return s1 - s0


def _block_grows(running: Sequence[Request], kv: KVCacheManager, done: int,
                 to: int) -> list[tuple[int, int, str, int]]:
    """The blocks the rows take between half steps ``done`` and ``to`` of a steady run (``running`` and ``kv`` as
    they are at ``done``), one ``(step, row, request id, tokens the row then needs)`` per block, in allocation
    order: steps in order, rows oldest first within a step."""
    s0, s1 = (done + 1) // 2, (to + 1) // 2  # steps scheduled before / after
    u0 = done // 2  # steps updated before
    bs = kv.block_size
    grows: list[tuple[int, int, str, int]] = []
    for i, req in enumerate(running):
        base = len(req.prompt_token_ids) + len(req.output_token_ids) - 1 - u0  # step s: context base + s
        held = kv.num_blocks_of(req.request_id)
        s = max(held * bs - base + 1, s0 + 1)  # the first step whose context needs one more block
        while s <= s1:
            grows.append((s, i, req.request_id, base + s))
            s += bs
    grows.sort()
    return grows


def steady_blocks_taken(running: Sequence[Request], kv: KVCacheManager, done: int, to: int) -> int:
    """How many free blocks ``advance_steady(running, kv, _, done, to)`` will take, without taking them: the
    number of ``_block_grows``, counted row by row (a row takes a block at its first step needing one, then every
    ``block_size`` steps)."""
    s0, s1 = (done + 1) // 2, (to + 1) // 2  # steps scheduled before / after
    if s1 <= s0:
        return 0
    u0 = done // 2
    bs = kv.block_size
    held_of = kv.num_blocks_of
    taken = 0
    for req in running:
        base = len(req.prompt_token_ids) + len(req.output_token_ids) - 1 - u0  # step s: context base + s
        first = held_of(req.request_id) * bs - base + 1  # the first step whose context needs one more block
        if first <= s0:
            first = s0 + 1
        if first <= s1:
            taken += (s1 - first) // bs + 1
    return taken


def steady_step_output(running: Sequence[Request], kv: KVCacheManager, step_id: int) -> SchedulerOutput:
    """The ``SchedulerOutput`` that ``schedule()`` returned for the step of a steady run that is scheduled and not
    yet updated (an odd half step): one decode row per running request, oldest first, as ``schedule`` builds it."""
    block_ids = kv.block_ids
    segments = tuple(
        ScheduledSegment(r.request_id, r.num_computed_tokens, (r.output_token_ids[-1],), block_ids(r.request_id),
                         True, r.sampling_params, len(r.output_token_ids), r.eos_token_id)
        for r in running
    )
    return SchedulerOutput(step_id=step_id, kind=StepKind.DECODE, segments=segments)
