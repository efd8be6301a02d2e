"""Scheduler of one decode instance: admission by predicted memory, continuous-batching decode.

Request lifecycle (disaggregated mode) and the part this module owns:
arrive -> queued at prefill -> predicted -> chunks prefilled -> dispatched: **``reserve`` (blocks
allocated here before any byte moves) -> KV transferring -> ``on_kv_received`` (runnable) -> decoding
-> finished | aborted**; a failed transfer is ``transfer_failed`` (blocks freed, request handed back to
the caller to retry or re-prefill).

A request arrives prefilled: its first token is sampled, ``num_computed_tokens == num_tokens - 1``.
Conditional disaggregation (``admit_local``): the global scheduler may instead send an unprefilled
request here when the prefill tier is backed up; it is admitted by the same policy, runs its prompt as
prefill segments of at most ``local_prefill_chunk`` tokens per step (piggybacked on the decode batch, so
one step never stalls the running decodes for more than a chunk), samples its first token here and
then decodes like any other request. No KV moves.

Admission (``reserve``), with *target* = blocks for ``prompt + predicted output`` (bucket bound per
``prediction_bound``; ``max_tokens`` without a prediction) and *committed* = blocks that admitted
requests were promised but do not hold yet:
- ``greedy`` (vLLM): admit if the blocks for the current context are free; no reservation.
- ``reserve-static``: admit only if target <= free - committed; the target is allocated at once.
- ``reserve-dynamic``: admit if target <= free - committed, or if it will fit once the running request
  with the shortest predicted remaining output finishes (target <= free - committed + its blocks);
  it then holds what fits now and is committed the rest.
Every policy refuses while ``max_num_seqs`` requests are running or reserved, or while preempted
requests wait (they resume first).

Decode steps: every running request (oldest first) computes its next token; a request that needs a
block takes a free one (growing within, or *extending*, its reservation); when none is free the
youngest running request is preempted: ``recompute`` frees its blocks and later re-prefills prompt +
outputs here as one prefill segment; ``swap`` frees its blocks after the executor copies them to host
memory (``SchedulerOutput.swapped_out``) and copies them back on resume (``swapped_in``).

Live migration (``core.migration.Detachable``): ``detach`` / ``reattach`` / ``release_migrated`` move a running
decode out (the target side is ``reserve`` + ``on_kv_received``, like any dispatched request).

Invariants: never more blocks than the pool (allocation is all-or-nothing); running + reserved <=
``max_num_seqs``; the oldest running request always progresses or is the last holder and its context
exceeds the pool (then it finishes with FINISHED_LENGTH): no deadlock; every block of a request is
freed exactly once (finish, abort, preemption, transfer failure).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.load import DEFAULT_HEAVY_DECODE_TOKENS, InstanceState, LoadReport, Role
from tetriinfer.core.local_scheduler import _segment
from tetriinfer.core.migration import Detachable
from tetriinfer.core.request import Request, RequestStatus
from tetriinfer.core.request_table import RequestTable
from tetriinfer.core.steady_decode import (
    advance_steady,
    is_decode_row,
    steady_blocks_taken,
    steady_run_length,
    steady_step_output,
)
from tetriinfer.core.step import ScheduledSegment, SchedulerOutput, StepKind, StepResult


class DecodePolicy(enum.Enum):
    GREEDY = "greedy"
    RESERVE_STATIC = "reserve-static"
    RESERVE_DYNAMIC = "reserve-dynamic"


class PreemptionMode(enum.Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"


@dataclass(frozen=True)
class DecodeSchedulerConfig:
    policy: DecodePolicy | str = DecodePolicy.GREEDY
    preemption: PreemptionMode | str = PreemptionMode.RECOMPUTE
    max_num_seqs: int = 256
    max_model_len: int = 2048
    prediction_bound: str = "lower"  # which end of the predicted bucket sizes a reservation
    max_recompute_tokens: int = 2048  # recompute-prefill tokens per step (at least one request always)
    heavy_decode_tokens: int = DEFAULT_HEAVY_DECODE_TOKENS
    local_prefill_chunk: int = 512  # prefill tokens per step of requests prefilled here (admit_local)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "policy", DecodePolicy(self.policy))
        except ValueError:
            names = ", ".join(p.value for p in DecodePolicy)
            raise ValueError(f"unknown decode policy {self.policy!r}; choose one of: {names}") from None
        try:
            object.__setattr__(self, "preemption", PreemptionMode(self.preemption))
        except ValueError:
            raise ValueError(f"preemption must be 'recompute' or 'swap', got {self.preemption!r}") from None
        if self.prediction_bound not in ("lower", "upper"):
            raise ValueError(f"prediction_bound must be 'lower' or 'upper', got {self.prediction_bound!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_recompute_tokens < 1:
            raise ValueError(f"max_recompute_tokens must be >= 1, got {self.max_recompute_tokens}")
        if self.local_prefill_chunk < 1:
            raise ValueError(f"local_prefill_chunk must be >= 1, got {self.local_prefill_chunk}")


@dataclass(frozen=True)
class DecodeStepUpdate:
    """``finished`` also lists requests the preceding ``schedule()`` ended (FINISHED_LENGTH when a
    context outgrew the whole pool), so every ending except ``abort`` is reported by some update."""

    new_tokens: dict[str, int]
    finished: tuple[Request, ...]


class DecodeScheduler(Detachable):
    def __init__(self, config: DecodeSchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.reserved: dict[str, Request] = {}  # awaiting KV, in reservation order
        self.running: list[Request] = []  # admission order: index 0 is the oldest
        self.suspended: deque[Request] = deque()  # preempted (recompute or swapped), resume FIFO
        self.migrating: dict[str, Request] = {}  # detached for live migration: blocks held, not scheduled
        self._table = RequestTable(kv, forget=self._forget)
        self._target: dict[str, int] = {}  # reservation target in blocks
        self._swapped: set[str] = set()
        self._step_id = 0
        self._ended_in_schedule: list[Request] = []  # reported by the next ``update``
        self.num_extensions = 0  # reservations grown past their target (mispredictions)
        self.num_preemptions = 0

    @property
    def requests(self) -> Mapping[str, Request]:
        """Requests held here (reserved, running or suspended) by id (read-only, live)."""
        return self._table.view

    # ---- admission -----------------------------------------------------------------------
    def predicted_output_tokens(self, req: Request) -> int:
        bound = req.predicted_lower if self.config.prediction_bound == "lower" else req.predicted_upper
        pred = req.sampling_params.max_tokens if bound is None else bound
        return max(1, min(pred, req.sampling_params.max_tokens))

    def target_blocks(self, req: Request) -> int:
        total = min(req.num_prompt_tokens + self.predicted_output_tokens(req), self.config.max_model_len)
        want = max(self.kv.pool.blocks_for_tokens(total), self.kv.pool.blocks_for_tokens(req.num_tokens))
        return min(want, self.kv.num_blocks)  # a reservation larger than the pool could never be granted

    def committed_blocks(self) -> int:
        """Blocks promised to running or reserved requests beyond what they hold."""
        ids = [r.request_id for r in self.running] + list(self.reserved)
        return sum(max(0, self._target[r] - self.kv.num_blocks_of(r)) for r in ids)

    def _blocks_after_shortest(self) -> int:
        """Blocks the running request with the shortest predicted remaining output will give back."""
        if not self.running:
            return 0

        def remaining(r: Request) -> int:
            return max(1, self.predicted_output_tokens(r) - r.num_output_tokens)

        shortest = min(self.running, key=remaining)
        return max(self._target[shortest.request_id], self.kv.num_blocks_of(shortest.request_id))

    def _check_prefilled(self, req: Request) -> None:
        """ValueError unless ``req`` is new here, prefilled (first token sampled, context computed) and unfinished."""
        rid = req.request_id
        self._table.require_new(rid)
        if req.is_finished or not req.output_token_ids or req.num_computed_tokens != req.num_tokens - 1:
            raise ValueError(f"request {rid!r} must arrive prefilled (first token sampled, context computed)")
        if req.num_output_tokens >= req.sampling_params.max_tokens:
            raise ValueError(f"request {rid!r} already has all its {req.num_output_tokens} output tokens")

    def reserve(self, req: Request) -> bool:
        """Admit a prefilled request and allocate its blocks before its KV is transferred.

        Returns False when the admission policy refuses (try later or elsewhere); raises ValueError if
        the request can never run here (malformed, or its context exceeds the model or the pool)."""
        rid = req.request_id
        self._check_prefilled(req)
        if req.num_tokens >= self.config.max_model_len:
            raise ValueError(f"request {rid!r} ({req.num_tokens} tokens) fills the model context already")
        now_blocks = self.kv.pool.blocks_for_tokens(req.num_tokens)
        if now_blocks > self.kv.num_blocks:
            raise ValueError(f"request {rid!r} ({req.num_tokens} tokens) cannot fit in this instance's KV cache")
        if not self._allocate(req, now_blocks):
            return False
        req.status = RequestStatus.WAITING
        self.reserved[rid] = req
        self._table.add(req)
        return True

    def admit_local(self, req: Request) -> bool:
        """Admit a request that was *not* prefilled elsewhere (conditional disaggregation): it prefills here,
        in chunks of ``local_prefill_chunk`` tokens per step, then decodes. Admission is ``reserve``'s (same
        policy, seats and refusals), sized for prompt + its first output token now.

        Returns False when the admission policy refuses (try later); raises ValueError if the request can
        never run here (not fresh, or its prompt exceeds the model or the pool)."""
        rid = req.request_id
        self._table.require_new(rid)
        if req.is_finished or req.output_token_ids or req.num_computed_tokens != 0:
            raise ValueError(f"request {rid!r} must arrive unprefilled (no output, nothing computed)")
        if req.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt of request {rid!r} has {req.num_prompt_tokens} tokens; the model's context is "
                f"{self.config.max_model_len} tokens (prompt + at least one output token)"
            )
        now_blocks = self.kv.pool.blocks_for_tokens(req.num_prompt_tokens + 1)
        if now_blocks > self.kv.num_blocks:
            raise ValueError(f"prompt of request {rid!r} ({req.num_prompt_tokens} tokens) cannot fit in this "
                             "instance's KV cache")
        if not self._allocate(req, now_blocks):
            return False
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._table.add(req)
        return True

    def adopt(self, req: Request) -> None:
        """Take over a request prefilled *on this instance* whose KV blocks this KV manager already holds under
        its id (a prefill instance keeping a decode, ``core.keep_decode``): it decodes from the next step, in the
        blocks it has; no admission check (the caller's rule bounds what it keeps). Raises ValueError if it is
        not prefilled here or already held."""
        rid = req.request_id
        self._check_prefilled(req)
        held = self.kv.num_blocks_of(rid)
        if held < self.kv.pool.blocks_for_tokens(req.num_computed_tokens):
            raise ValueError(f"request {rid!r} holds {held} blocks here, fewer than its computed context needs")
        self._target[rid] = held
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._table.add(req)

    def _allocate(self, req: Request, now_blocks: int) -> bool:
        """The admission decision shared by ``reserve`` and ``admit_local``: on yes, the request's blocks are
        allocated and its reservation target recorded (the caller files it in a queue)."""
        if len(self.running) + len(self.reserved) + len(self.migrating) >= self.config.max_num_seqs or self.suspended:
            return False
        free = self.kv.num_free_blocks
        if now_blocks > free:
            return False
        policy = self.config.policy
        target = max(self.target_blocks(req), now_blocks)
        avail = free - self.committed_blocks()
        if policy is DecodePolicy.GREEDY:
            target, take = now_blocks, now_blocks
        elif policy is DecodePolicy.RESERVE_STATIC:
            if target > avail:
                return False
            take = target
        else:
            if target <= avail:
                take = target
            elif target <= avail + self._blocks_after_shortest():
                take = max(now_blocks, min(target, avail))
            else:
                return False
        ok = self.kv.allocate_slots(req.request_id, take * self.kv.block_size)
        assert ok, "admission checked free blocks"
        self._target[req.request_id] = target
        return True

    def on_kv_received(self, request_id: str) -> None:
        """The request's K/V is in its reserved blocks: it decodes from the next step on."""
        req = self.reserved.pop(request_id, None)
        if req is None:
            raise KeyError(f"request {request_id!r} is not reserved at this decode instance")
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def transfer_failed(self, request_id: str) -> Request:
        """Free a reserved request's blocks and hand it back (retry elsewhere or re-prefill)."""
        req = self.reserved.pop(request_id, None)
        if req is None:
            raise KeyError(f"request {request_id!r} is not reserved at this decode instance")
        self.kv.free_request(request_id)
        del self._target[request_id]
        self._table.remove(request_id)  # leaves unfinished: not reported in finished_request_ids
        return req

    def block_table(self, request_id: str) -> list[int]:
        return self.kv.block_table(request_id)

    def admit_migrant(self, req: Request) -> bool:
        """Live migration target: a running decode from another instance is admitted like any handoff."""
        return self.reserve(req)

    def migrant_failed(self, request_id: str) -> None:
        self.transfer_failed(request_id)

    def _released(self, request_id: str) -> None:  # Detachable: a migrated request's reservation goes with it
        del self._target[request_id]

    def has_unfinished(self) -> bool:
        return bool(self._table)

    # ---- finishing -----------------------------------------------------------------------
    def abort(self, request_id: str) -> Request | None:
        return self._table.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def finish(self, request_id: str, status: RequestStatus) -> None:
        self._table.finish(request_id, status)

    def _forget(self, req: Request) -> None:
        """``RequestTable`` hook: take a finishing request out of every queue and drop its target."""
        rid = req.request_id
        self.reserved.pop(rid, None)
        self.migrating.pop(rid, None)
        if req in self.running:
            self.running.remove(req)
        if req in self.suspended:
            self.suspended.remove(req)
        self._swapped.discard(rid)
        self._target.pop(rid, None)

    # ---- scheduling ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._step_id += 1
        swapped_in: list[tuple[str, tuple[int, ...]]] = []
        swapped_out: list[tuple[str, tuple[int, ...]]] = []
        preempted: list[str] = []
        resumed = self._resume(swapped_in)
        # One pass, oldest first: each request takes the block its next token needs (preempting the youngest when
        # none is free) and its segment is built at once: a scheduled request's table no longer changes this step
        # (victims are always younger than every request scheduled so far).
        kv, target, running = self.kv, self._target, self.running
        grow, block_ids = kv.grow, kv.block_ids
        segments: list[ScheduledSegment] = []
        prefill_budget = self.config.local_prefill_chunk
        n_prefill = 0
        i = 0
        while i < len(running):
            req = running[i]
            rid = req.request_id
            out_ids = req.output_token_ids
            n_out = len(out_ids)
            total = len(req.prompt_token_ids) + n_out
            held = grow(rid, total)
            if held >= 0:
                if held > target[rid]:
                    target[rid] = held
                    self.num_extensions += 1
                i += 1
                start = req.num_computed_tokens
                n = total - start
                if n == 1 and n_out:  # a decode row (the common case): ``_segment``'s own fast path, inline
                    segments.append(ScheduledSegment(rid, start, (out_ids[-1],), block_ids(rid), True,
                                                     req.sampling_params, n_out, req.eos_token_id))
                    continue
                if not n_out:  # prefilling here (admit_local): a chunk per step, within the budget
                    n = min(n, prefill_budget)
                    if n == 0:
                        continue  # the budget went to older requests' prompts; it keeps its blocks and waits
                    prefill_budget -= n
                n_prefill += n > 1 or start == 0
                segments.append(_segment(req, start, n, block_ids(rid)))
                continue
            victim = self.running[-1]
            if victim is req and len(self.running) == 1 and kv.pool.blocks_for_tokens(total) > kv.num_blocks:
                # Alone and still out of memory: its context is larger than the whole pool. (Alone but within the
                # pool, the blocks it lacks are held elsewhere: reservations, requests leaving by migration, or
                # the prefill side of a shared pool when it is kept at a prefill instance. It is preempted then,
                # below, and resumes once they are back; it never ends short.)
                self._table.mark_finished(req, RequestStatus.FINISHED_LENGTH)
                self._ended_in_schedule.append(req)
                continue
            if victim.request_id in resumed:  # undo this step's resume instead of preempting
                swapped_in[:] = [s for s in swapped_in if s[0] != victim.request_id]
                self._suspend(victim, front=True, swap=resumed.pop(victim.request_id))
                continue
            if self.config.preemption is PreemptionMode.SWAP:
                swapped_out.append((victim.request_id, tuple(self.kv.block_table(victim.request_id))))
            self._suspend(victim, front=True, swap=self.config.preemption is PreemptionMode.SWAP)
            self.num_preemptions += 1
            victim.num_preemptions += 1
            preempted.append(victim.request_id)
        if not segments:
            kind = StepKind.IDLE
        elif n_prefill == 0:
            kind = StepKind.DECODE
        else:
            kind = StepKind.PREFILL if n_prefill == len(segments) else StepKind.MIXED
        finished = self._table.drain_finished()
        return SchedulerOutput(
            step_id=self._step_id,
            kind=kind,
            segments=tuple(segments),
            preempted_request_ids=tuple(preempted),
            finished_request_ids=finished,
            swapped_out=tuple(swapped_out),
            swapped_in=tuple(swapped_in),
        )

    def _resume(self, swapped_in: list[tuple[str, tuple[int, ...]]]) -> dict[str, bool]:
        """Bring suspended requests back (FIFO) while seats, uncommitted blocks and the recompute
        budget allow. Returns the ids resumed in this step -> whether each was swapped."""
        resumed: dict[str, bool] = {}
        budget = self.config.max_recompute_tokens
        while self.suspended and len(self.running) + len(self.reserved) + len(self.migrating) < self.config.max_num_seqs:
            req = self.suspended[0]
            rid = req.request_id
            need = self.kv.pool.blocks_for_tokens(req.num_tokens)
            if need > self.kv.num_blocks or req.num_tokens >= self.config.max_model_len:
                self._table.mark_finished(req, RequestStatus.FINISHED_LENGTH)
                self._ended_in_schedule.append(req)
                continue
            if need > self.kv.num_free_blocks - self.committed_blocks():
                break
            swapped = rid in self._swapped
            if not swapped:
                if req.num_uncomputed_tokens > budget and budget < self.config.max_recompute_tokens:
                    break
                budget -= req.num_uncomputed_tokens
            ok = self.kv.allocate_slots(rid, req.num_tokens)
            assert ok
            self.suspended.popleft()
            if swapped:
                self._swapped.discard(rid)
                n_cached = self.kv.pool.blocks_for_tokens(req.num_computed_tokens)
                swapped_in.append((rid, tuple(self.kv.block_table(rid)[:n_cached])))
            self._target[rid] = max(self._target[rid], need)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            resumed[rid] = swapped
        return resumed

    def _suspend(self, req: Request, front: bool, swap: bool) -> None:
        """Take a running request out: free its blocks; recompute resets its progress, swap keeps it
        (its K/V lives in host memory until ``swapped_in``)."""
        self.running.remove(req)
        self.kv.free_request(req.request_id)
        req.status = RequestStatus.PREEMPTED
        if swap:
            self._swapped.add(req.request_id)
        else:
            req.num_computed_tokens = 0
        if front:
            self.suspended.appendleft(req)
        else:
            self.suspended.append(req)

    # ---- steady decode runs (``core.steady_decode``) ----------------------------------------
    def steady_steps(self, token: int, limit: int) -> int:
        """How many of the next steps (at most ``limit``) are steady: pure decode steps of exactly the running
        requests, each sampling ``token``, in which nothing resumes, is preempted or finishes (reserved
        requests do not run before ``on_kv_received``, which the caller must not call inside the run)."""
        if self.suspended or self._ended_in_schedule or self._table.has_finished_to_drain:
            return 0
        if not all(map(is_decode_row, self.running)):
            return 0
        return steady_run_length(self.running, self.kv, token, self.config.max_model_len, limit)

    def advance_steady(self, token: int, done: int, to: int) -> None:
        """Apply half steps ``done`` -> ``to`` of a steady run at once: the state ``schedule()`` / ``update()``
        called step by step would leave (reservations extended as ``schedule`` extends them)."""
        target = self._target

        def extended(rid: str, held: int) -> None:
            if held > target[rid]:
                target[rid] = held
                self.num_extensions += 1

        self._step_id += advance_steady(self.running, self.kv, token, done, to, extended)

    def steady_blocks_taken(self, done: int, to: int) -> int:
        """The free blocks ``advance_steady(_, done, to)`` will take (this scheduler at half step ``done`` of a
        steady run), without taking them."""
        return steady_blocks_taken(self.running, self.kv, done, to)

    def steady_load_report(self, instance_id: str, now: float, utilization: float, state: InstanceState,
                           done: int, to: int, *, step_inflation: float = 0.0) -> LoadReport:
        """``load_report`` as it will read once ``advance_steady(_, done, to)`` has moved this scheduler (now at
        half step ``done`` of a steady run) to half step ``to``, without moving it: the rows take the blocks
        ``steady_blocks_taken`` counts and hold one more token per step updated; nothing else a report shows
        changes inside a run (no row ends, waits or resumes)."""
        return self._load_report(instance_id, now, utilization, state,
                                 steady_blocks_taken(self.running, self.kv, done, to),
                                 len(self.running) * (to // 2 - done // 2), step_inflation)

    def steady_output(self) -> SchedulerOutput:
        """What ``schedule()`` returned for the steady run's step in flight (after an odd half step)."""
        return steady_step_output(self.running, self.kv, self._step_id)

    # ---- results -------------------------------------------------------------------------
    def update(self, output: SchedulerOutput, result: StepResult) -> DecodeStepUpdate:
        new_tokens: dict[str, int] = {}
        finished: list[Request] = list(self._ended_in_schedule)
        self._ended_in_schedule.clear()
        held = self._table.get
        sampled, logprobs = result.sampled_token_ids, result.logprobs
        max_len = self.config.max_model_len
        running = RequestStatus.RUNNING
        for seg in output.segments:
            rid = seg.request_id
            req = held(rid)
            if req is None or req.status is not running:  # aborted while the step ran
                continue
            req.num_computed_tokens = seg.start + len(seg.token_ids)
            if not seg.sample:
                continue
            token = sampled[rid]
            # ``append_output``, inline: the request is RUNNING (checked above), so not finished
            req.output_token_ids.append(token)
            if logprobs:
                lp = logprobs.get(rid)
                if lp is not None:
                    req.output_logprobs.append(lp)
            new_tokens[rid] = token
            stop = req.check_stop()
            if stop is None and len(req.prompt_token_ids) + len(req.output_token_ids) >= max_len:
                stop = RequestStatus.FINISHED_LENGTH
            if stop is not None:
                self._table.mark_finished(req, stop)
                finished.append(req)
        return DecodeStepUpdate(new_tokens, tuple(finished))

    # ---- reporting -----------------------------------------------------------------------
    def load_report(
        self, instance_id: str, now: float, utilization: float = 0.0,
        state: InstanceState = InstanceState.ACTIVE, *, step_inflation: float = 0.0,
    ) -> LoadReport:
        """``step_inflation``: the instance's (``core.step_inflation``), attached as is (the same report as
        ``decode_instance_report(report, 0, 0, step_inflation)`` when nothing waits for admission)."""
        return self._load_report(instance_id, now, utilization, state, 0, 0, step_inflation)

    def _load_report(self, instance_id: str, now: float, utilization: float, state: InstanceState,
                     blocks_ahead: int, tokens_ahead: int, step_inflation: float = 0.0) -> LoadReport:
        """``load_report`` with ``blocks_ahead`` more blocks used and ``tokens_ahead`` more tokens held than now."""
        threshold = self.config.heavy_decode_tokens
        heavy = 0
        for r in self._table.values():  # ``is_heavy_decode(r.predicted_lower, threshold)``, inline
            lower = r.predicted_lower
            if lower is not None and lower > threshold:
                heavy += 1
        tokens = prefill_tokens = 0
        for r in self.running:  # tokens held, and the prompt tokens of rows not prefilled yet (local prefills)
            n = len(r.prompt_token_ids) + len(r.output_token_ids)  # ``num_tokens``
            tokens += n
            if not r.output_token_ids:
                prefill_tokens += n - r.num_computed_tokens  # ``num_uncomputed_tokens``
        for r in self.suspended:
            prefill_tokens += r.num_tokens
        kv = self.kv
        free = kv.num_free_blocks - blocks_ahead
        return LoadReport(
            instance_id=instance_id,
            role=Role.DECODE,
            state=state,
            time=now,
            num_queued=len(self.reserved) + len(self.suspended),
            num_running=len(self.running),
            num_free_blocks=free,
            num_used_blocks=kv.num_blocks - free,  # ``kv.num_used_blocks``
            block_size=kv.block_size,
            tokens_in_flight=tokens + tokens_ahead,
            num_heavy_decodes=heavy,
            num_light_decodes=len(self._table) - heavy,
            utilization=utilization,
            num_prefill_tokens=prefill_tokens,
            step_inflation=step_inflation,
        )

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        ids_run = [r.request_id for r in self.running]
        ids_sus = [r.request_id for r in self.suspended]
        groups = [set(self.reserved), set(ids_run), set(ids_sus), set(self.migrating)]
        if sum(len(g) for g in groups) != len(self._table) or set().union(*groups) != set(self._table):
            raise AssertionError("requests table disagrees with reserved + running + suspended + migrating")
        if len(self.running) + len(self.reserved) + len(self.migrating) > self.config.max_num_seqs:
            raise AssertionError("more than max_num_seqs requests running, reserved or leaving")
        for rid in ids_sus:
            if self.kv.num_blocks_of(rid):
                raise AssertionError(f"suspended request {rid} holds blocks")
        if set(self._target) != set(self._table):
            raise AssertionError("reservation targets disagree with the requests table")
