"""Colocated schedulers for the baselines: vLLM-style and Sarathi-Serve. Same interface as
``LocalScheduler`` (``add_request``, ``schedule``, ``update -> StepUpdate``, ``abort``, ``finish``).

Lifecycle: WAITING -> (prefill) -> RUNNING -> FINISHED_*; under KV pressure a RUNNING request may be
PREEMPTED by recompute (blocks freed, re-prefilled later as prompt + outputs, ahead of new arrivals).

- ``VLLMScheduler`` (the paper's baseline): prefill first. A step is either a prefill of whole waiting
  prompts, in arrival order, up to ``max_num_batched_tokens`` (a single prompt longer than the budget
  still runs alone), or one decode token for every running request.
- ``SarathiScheduler`` (stall-free batching): every step first schedules one decode token for every
  running request (oldest first, within the budget), then fills the rest of the token budget with
  chunks of waiting prompts in arrival order (unpadded). Kind MIXED when both are present.

Live migration (``core.migration``): as a source, ``detach`` / ``reattach`` / ``release_migrated``
(``Detachable``); as a target, ``admit_migrant`` (a decoding request from another instance: blocks for its
context allocated now, or refused) -> ``on_kv_received`` (it runs from the next step) | ``migrant_failed``.

Invariants: never allocates beyond the pool; running <= ``max_num_seqs``; when a decode needs a block
and none is free, a partially prefilled waiting request gives its blocks back first, then the youngest
running request is preempted; the oldest running request progresses unless it alone exceeds the pool
(then it finishes with FINISHED_LENGTH). Every finished request's blocks are freed when it finishes, and every ending except ``abort`` is
reported in some ``update``'s ``finished`` (also those ``schedule()`` ended with FINISHED_LENGTH).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from tetriinfer.core.chunking import build_chunk
from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.load import InstanceState, LoadReport, Role
from tetriinfer.core.local_scheduler import LocalScheduler, StepUpdate, _segment, prefill_candidates
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


@dataclass(frozen=True)
class ColocatedSchedulerConfig:
    max_num_batched_tokens: int = 2048  # vLLM: prefill budget; Sarathi: the hybrid step's token budget
    max_num_seqs: int = 256
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


class _ColocatedBase(Detachable):
    """Queues, finishing, preemption, migration and result handling shared by both colocated policies."""

    def __init__(self, config: ColocatedSchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: index 0 is the oldest
        self.migrating: dict[str, Request] = {}  # leaving (live migration): blocks held, not scheduled
        self.arriving: dict[str, Request] = {}  # migrated here: blocks allocated, KV on its way
        self._table = RequestTable(kv, forget=self._forget)
        self._step_id = 0
        self._ended_in_schedule: list[Request] = []  # reported by the next ``update``
        self.num_preemptions = 0  # running requests preempted (recompute); partial prefills given back not counted

    @property
    def requests(self) -> Mapping[str, Request]:
        """Unfinished requests by id (read-only, live)."""
        return self._table.view

    def add_request(self, req: Request) -> None:
        self._table.require_new(req.request_id)
        if req.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt of request {req.request_id!r} has {req.num_prompt_tokens} tokens; the model's "
                f"context is {self.config.max_model_len} tokens (prompt + at least one output token)"
            )
        if self.kv.pool.blocks_for_tokens(req.num_prompt_tokens + 1) > self.kv.num_blocks:
            raise ValueError(
                f"prompt of request {req.request_id!r} ({req.num_prompt_tokens} tokens) cannot fit in the "
                f"KV cache ({self.kv.num_blocks} blocks of {self.kv.block_size} tokens)"
            )
        self._table.add(req)
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self._table)

    def admit_migrant(self, req: Request) -> bool:
        """A running decode moving here (first token sampled, all but the last token computed): allocate blocks
        for its context now and hold it until its KV is in. False: no seat or no free blocks (it stays at its
        source). ValueError: malformed, already here, or it can never run here."""
        rid = req.request_id
        self._table.require_new(rid)
        if req.is_finished or not req.output_token_ids or req.num_computed_tokens != req.num_tokens - 1:
            raise ValueError(f"migrant {rid!r} must be decoding (first token sampled, context computed)")
        if req.num_tokens >= self.config.max_model_len:
            raise ValueError(f"migrant {rid!r} ({req.num_tokens} tokens) fills the model context already")
        if self._seats_taken() >= self.config.max_num_seqs:
            return False
        if self.kv.pool.blocks_for_tokens(req.num_tokens) > self.kv.num_free_blocks:
            return False
        ok = self.kv.allocate_slots(rid, req.num_tokens)
        assert ok, "free blocks were checked"
        req.status = RequestStatus.WAITING
        self.arriving[rid] = req
        self._table.add(req)
        return True

    def _seats_taken(self) -> int:
        """Running requests plus those that hold a seat while moving (leaving: may come back; arriving)."""
        return len(self.running) + len(self.migrating) + len(self.arriving)

    def on_kv_received(self, request_id: str) -> None:
        """The migrant's KV is in its blocks: it decodes from the next step (as the youngest)."""
        req = self.arriving.pop(request_id, None)
        if req is None:
            raise KeyError(f"request {request_id!r} is not arriving at this instance")
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def migrant_failed(self, request_id: str) -> None:
        """Its KV never came: free its blocks; it leaves unfinished (it decodes on at its source)."""
        if self.arriving.pop(request_id, None) is None:
            raise KeyError(f"request {request_id!r} is not arriving at this instance")
        self.kv.free_request(request_id)
        self._table.remove(request_id)

    def take_unstarted(self, limit: int) -> list[Request]:
        """Hand up to ``limit`` waiting requests with no progress here (newest first) to the caller, to run on
        another instance: they leave the table unfinished (no status change, nothing to free, not reported)."""
        return self._table.take_unstarted(list(self.waiting), limit, self.waiting.remove)

    def abort(self, request_id: str) -> Request | None:
        return self._table.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def finish(self, request_id: str, status: RequestStatus) -> None:
        self._table.finish(request_id, status)

    def _forget(self, req: Request) -> None:
        """``RequestTable`` hook: take a finishing request out of the queues."""
        self.migrating.pop(req.request_id, None)
        self.arriving.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def _end_in_schedule(self, req: Request) -> None:
        self._table.mark_finished(req, RequestStatus.FINISHED_LENGTH)
        self._ended_in_schedule.append(req)

    def _release_partial(self, req: Request) -> bool:
        """Free a waiting request's partial prefill (recomputed later). True if it held blocks."""
        if not self.kv.num_blocks_of(req.request_id):
            return False
        self.kv.free_request(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        return True

    def _release_match(self, req: Request) -> None:
        """Give back the cached prefix a waiting request matched but could not use this step (the vLLM policy's
        waiting requests hold no blocks otherwise)."""
        self.kv.unmatch_prefix(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free_request(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _decode_running(self, limit: int) -> tuple[list[Request], list[str]]:
        """Allocate one more token for up to ``limit`` running requests, oldest first, freeing blocks
        (partial prefills, then the youngest running request) when none are free."""
        scheduled: list[Request] = []
        preempted: list[str] = []
        running, allocate = self.running, self.kv.allocate_slots
        i = 0
        while i < len(running) and len(scheduled) < limit:
            req = running[i]
            if allocate(req.request_id, len(req.prompt_token_ids) + len(req.output_token_ids)):
                scheduled.append(req)
                i += 1
                continue
            if any(self._release_partial(w) for w in reversed(self.waiting)):
                continue
            victim = self.running[-1]
            if victim is req and len(self.running) == 1:
                self._end_in_schedule(req)  # context larger than the whole pool
                continue
            self._preempt(victim)
            preempted.append(victim.request_id)
        return scheduled, preempted

    def _segments(self, reqs: list[Request]) -> list[ScheduledSegment]:
        block_ids = self.kv.block_ids
        segments = []
        for r in reqs:
            out_ids = r.output_token_ids
            n_out = len(out_ids)
            start = r.num_computed_tokens
            total = len(r.prompt_token_ids) + n_out
            if start == total - 1 and n_out:  # a decode row (the common case): ``_segment``'s own fast path, inline
                segments.append(ScheduledSegment(r.request_id, start, (out_ids[-1],), block_ids(r.request_id), True,
                                                 r.sampling_params, n_out, r.eos_token_id))
            else:
                segments.append(_segment(r, start, total - start, block_ids(r.request_id)))
        return segments

    def _output(
        self, kind: StepKind, segments: list[ScheduledSegment], preempted: list[str] | None = None,
    ) -> SchedulerOutput:
        finished = self._table.drain_finished()
        return SchedulerOutput(
            step_id=self._step_id,
            kind=kind if segments else StepKind.IDLE,
            segments=tuple(segments),
            preempted_request_ids=tuple(preempted or ()),
            finished_request_ids=finished,
        )

    def update(self, output: SchedulerOutput, result: StepResult) -> StepUpdate:
        new_tokens: dict[str, int] = {}
        finished: list[Request] = list(self._ended_in_schedule)
        self._ended_in_schedule.clear()
        held = self._table.get
        caching = self.kv.prefix_caching  # without a prefix cache, cache_computed does nothing
        sampled, logprobs = result.sampled_token_ids, result.logprobs
        max_len = self.config.max_model_len
        for seg in output.segments:
            rid = seg.request_id
            req = held(rid)
            if req is None:  # aborted while the step ran
                continue
            req.num_computed_tokens = seg.start + len(seg.token_ids)
            if caching:
                self.kv.cache_computed(req)
            if not seg.sample:
                continue
            token = sampled[rid]
            status = req.status
            if status.finished:  # ``append_output``, inline (one call less per row and step)
                raise RuntimeError(f"request {rid} already finished")
            req.output_token_ids.append(token)
            if logprobs:
                lp = logprobs.get(rid)
                if lp is not None:
                    req.output_logprobs.append(lp)
            new_tokens[rid] = token
            if status is RequestStatus.WAITING or status is RequestStatus.PREEMPTED:
                self.waiting.remove(req)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
            stop = req.check_stop()
            if stop is None and len(req.prompt_token_ids) + len(req.output_token_ids) >= max_len:
                stop = RequestStatus.FINISHED_LENGTH
            if stop is not None:
                self._table.mark_finished(req, stop)
                finished.append(req)
        return StepUpdate(new_tokens, tuple(finished))

    # ---- steady decode runs (``core.steady_decode``) ----------------------------------------
    _decode_limit_attr = "max_num_seqs"  # the config field that caps the rows of a decode step

    def steady_steps(self, token: int, limit: int) -> int:
        """How many of the next steps (at most ``limit``) are steady: pure decode steps of exactly the running
        requests, each sampling ``token``, with nothing waiting (a new arrival ends the run: the caller must not
        add requests or KV inside it), no prefix cache to name blocks in, nothing preempted or finishing."""
        if (self.waiting or self._ended_in_schedule or self._table.has_finished_to_drain
                or self.kv.prefix_caching or len(self.running) > getattr(self.config, self._decode_limit_attr)):
            return 0
        if not all(map(is_decode_row, self.running)):
            return 0
        return steady_run_length(self.running, self.kv, token, self.config.max_model_len, limit)

    def advance_steady(self, token: int, done: int, to: int) -> None:
        """Apply half steps ``done`` -> ``to`` of a steady run at once (the state step-by-step calls leave)."""
        self._step_id += advance_steady(self.running, self.kv, token, done, to)

    def steady_output(self) -> SchedulerOutput:
        """What ``schedule()`` returned for the steady run's step in flight (after an odd half step)."""
        return steady_step_output(self.running, self.kv, self._step_id)

    def steady_load_report(self, instance_id: str, now: float, utilization: float, state: InstanceState,
                           done: int, to: int, *, step_inflation: float = 0.0) -> LoadReport:
        """``colocated_load_report`` as it will read once ``advance_steady(_, done, to)`` has moved this scheduler
        (now at half step ``done`` of a steady run) to half step ``to``, without moving it: only the blocks the
        rows take (``steady_blocks_taken``) change what it reports (nothing waits inside a run, and it counts one
        token per running request whatever their length)."""
        return colocated_load_report(self, instance_id, now, utilization, state,
                                     blocks_ahead=steady_blocks_taken(self.running, self.kv, done, to),
                                     step_inflation=step_inflation)

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        if self._seats_taken() > self.config.max_num_seqs:
            raise AssertionError("more than max_num_seqs running, leaving or arriving")
        ids = ([r.request_id for r in self.waiting] + [r.request_id for r in self.running] + list(self.migrating)
               + list(self.arriving))
        if len(ids) != len(set(ids)) or set(ids) != set(self._table):
            raise AssertionError("requests table disagrees with waiting + running + migrating + arriving")


class VLLMScheduler(_ColocatedBase):
    def schedule(self) -> SchedulerOutput:
        self._step_id += 1
        cfg = self.config
        batch: list[Request] = []
        tokens = 0
        for req in self.waiting:
            if self._seats_taken() + len(batch) >= cfg.max_num_seqs:
                break
            self.kv.match_prefix(req)
            n = req.num_uncomputed_tokens
            if (batch and tokens + n > cfg.max_num_batched_tokens
                    or not self.kv.allocate_slots(req.request_id, req.num_tokens)):
                self._release_match(req)  # whole prompts only: a request not admitted holds nothing
                if not batch and not self.running and not self.kv.num_used_blocks:
                    self._end_in_schedule(req)  # can never fit the pool
                break
            batch.append(req)
            tokens += n
        if batch:
            return self._output(StepKind.PREFILL, self._segments(batch))
        scheduled, preempted = self._decode_running(cfg.max_num_seqs)
        return self._output(StepKind.DECODE, self._segments(scheduled), preempted)


class SarathiScheduler(_ColocatedBase):
    _decode_limit_attr = "max_num_batched_tokens"  # decode rows share the hybrid step's token budget

    def schedule(self) -> SchedulerOutput:
        self._step_id += 1
        cfg = self.config
        scheduled, preempted = self._decode_running(cfg.max_num_batched_tokens)
        segments = self._segments(scheduled)
        budget = cfg.max_num_batched_tokens - len(scheduled)
        slots = cfg.max_num_seqs - self._seats_taken()
        n_prefill = 0
        if budget > 0 and slots > 0 and self.waiting:
            heads = list(self.waiting)[:slots]
            chunk = build_chunk(prefill_candidates(heads, self.kv), budget, admit=self._admit, pad=False)
            if not chunk.slices and not self.running:
                # Partial prefills hold every block and nothing runs: free the youngest holders.
                for victim in list(reversed(self.waiting))[:-1]:
                    if self._release_partial(victim):
                        chunk = build_chunk(prefill_candidates(heads[:1], self.kv), budget, admit=self._admit,
                                            pad=False)
                        if chunk.slices:
                            break
                if not chunk.slices and not self.kv.num_used_blocks:
                    self._end_in_schedule(self.waiting[0])  # can never fit
            for s in chunk.slices:
                req = self._table[s.request_id]
                segments.append(_segment(req, s.start, s.num_tokens, self.kv.block_ids(s.request_id)))
            n_prefill = len(chunk.slices)
        if n_prefill and scheduled:
            kind = StepKind.MIXED
        else:
            kind = StepKind.PREFILL if n_prefill else StepKind.DECODE
        return self._output(kind, segments, preempted)

    def _admit(self, request_id: str, start: int, n: int) -> int:
        if self.kv.allocate_slots(request_id, start + n):
            return n
        fit = (self.kv.num_blocks_of(request_id) + self.kv.num_free_blocks) * self.kv.block_size - start
        if fit <= 0:
            return 0
        ok = self.kv.allocate_slots(request_id, start + fit)
        assert ok
        return fit


def make_colocated_scheduler(
    kind: str, config: ColocatedSchedulerConfig, kv: KVCacheManager,
) -> VLLMScheduler | SarathiScheduler:
    """``kind``: ``vllm`` or ``sarathi``."""
    if kind == "vllm":
        return VLLMScheduler(config, kv)
    if kind == "sarathi":
        return SarathiScheduler(config, kv)
    raise ValueError(f"unknown colocated scheduler {kind!r}; choose 'vllm' or 'sarathi'")


def colocated_load_report(
    scheduler: _ColocatedBase | LocalScheduler, instance_id: str, now: float, utilization: float = 0.0,
    state: InstanceState = InstanceState.ACTIVE, *, blocks_ahead: int = 0, step_inflation: float = 0.0,
) -> LoadReport:
    """What a colocated instance tells the monitor. It reports the PREFILL role: the global scheduler routes
    new requests to it (least prompt tokens still to prefill first); ``tokens_in_flight`` = prompt tokens still
    to prefill + one per running request. ``blocks_ahead``: blocks counted as used beyond those used now (a
    steady run's, ``_ColocatedBase.steady_load_report``); ``step_inflation``: the instance's
    (``core.step_inflation``), attached as is (the same report as attaching it with ``replace_fields`` after)."""
    kv = scheduler.kv
    waiting = scheduler.waiting
    free = kv.num_free_blocks - blocks_ahead
    return LoadReport(
        instance_id=instance_id,
        role=Role.PREFILL,
        state=state,
        time=now,
        num_queued=len(waiting),
        num_running=len(scheduler.running),
        num_free_blocks=free,
        num_used_blocks=kv.num_blocks - free,  # ``kv.num_used_blocks`` (+ ``blocks_ahead``)
        block_size=kv.block_size,
        tokens_in_flight=(sum(r.num_uncomputed_tokens for r in waiting) if waiting else 0) + len(scheduler.running),
        utilization=utilization,
        step_inflation=step_inflation,
    )
