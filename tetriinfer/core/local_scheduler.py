"""Single-instance scheduler used by the offline ``LLM`` engine: fixed-size prefill chunks + decode.

Each step is either one prefill chunk of exactly ``chunk_size`` tokens (prompt tokens only, sliced and
merged from waiting requests in queue order, padded at the end) or one continuous-batching decode step
over all running requests. Prefill has priority, as in vLLM's default.

Lifecycle of a request here: WAITING -> (chunks) -> RUNNING -> FINISHED_* ; under KV pressure a
RUNNING request may become PREEMPTED (blocks freed, recomputed later as a prefill of prompt+outputs).

Invariants: every finished request's blocks are freed in the same call that finishes it; a step never
allocates beyond the pool; the youngest running request is preempted first; the oldest never is
while another request could be preempted instead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from tetriinfer.core.chunking import build_chunk
from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.request import Request, RequestStatus
from tetriinfer.core.request_table import RequestTable
from tetriinfer.core.step import ScheduledSegment, SchedulerOutput, StepKind, StepResult


@dataclass(frozen=True)
class LocalSchedulerConfig:
    chunk_size: int = 512
    max_num_seqs: int = 256
    pad_last_chunk: bool = True
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class StepUpdate:
    """What changed for callers (streaming, detokenization) after one step."""

    new_tokens: dict[str, int]
    finished: tuple[Request, ...]


def prefill_candidates(order: Iterable[Request], kv: KVCacheManager) -> Iterator[tuple[str, int, int]]:
    """``build_chunk`` candidates (request id, first uncomputed token, tokens left) in ``order``, produced as the
    chunk fills: a request's cached prefix is matched (``KVCacheManager.match_prefix``) just before it is
    offered, so only requests that reach the chunk pin cached blocks."""
    for r in order:
        kv.match_prefix(r)
        yield r.request_id, r.num_computed_tokens, r.num_uncomputed_tokens


def _segment(req: Request, start: int, n: int, table: tuple[int, ...]) -> ScheduledSegment:
    """Positions ``[start, start + n)`` of ``req`` with its block table (``KVCacheManager.block_ids``)."""
    end = start + n
    n_prompt = len(req.prompt_token_ids)
    n_out = len(req.output_token_ids)
    if start == n_prompt + n_out - 1 and n == 1 and n_out:  # a decode row: the newest output token
        token_ids: tuple[int, ...] = (req.output_token_ids[-1],)
    else:
        token_ids = tuple(req.token_ids_range(start, end))
    return ScheduledSegment(req.request_id, start, token_ids, table, end == n_prompt + n_out, req.sampling_params,
                            n_out, req.eos_token_id)


class LocalScheduler:
    def __init__(self, config: LocalSchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: index 0 is the oldest
        self._table = RequestTable(kv, forget=self._forget)
        self._step_id = 0

    @property
    def requests(self) -> Mapping[str, Request]:
        """Unfinished requests by id (read-only, live)."""
        return self._table.view

    # ---- queue management ----------------------------------------------------------------
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
        return bool(self.waiting or self.running)

    def take_unstarted(self, limit: int) -> list[Request]:
        """Hand up to ``limit`` waiting requests with no progress here (newest first) to the caller, to run on
        another instance: they leave the table unfinished (no status change, nothing to free, not reported)."""
        return self._table.take_unstarted(list(self.waiting), limit, self.waiting.remove)

    def abort(self, request_id: str) -> Request | None:
        return self._table.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def finish(self, request_id: str, status: RequestStatus) -> None:
        """Finish a request for a reason found outside the scheduler (e.g. a stop string)."""
        self._table.finish(request_id, status)

    def _forget(self, req: Request) -> None:
        """``RequestTable`` hook: take a finishing request out of the queues."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    # ---- scheduling ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._step_id += 1
        out = self._schedule_prefill() if self.waiting else None
        if out is None:
            out = self._schedule_decode()
        return out

    def _schedule_prefill(self) -> SchedulerOutput | None:
        cfg = self.config
        free_seq_slots = cfg.max_num_seqs - len(self.running)
        if free_seq_slots <= 0:
            return None
        bs = self.kv.block_size

        def admit(request_id: str, start: int, n: int) -> int:
            if self.kv.allocate_slots(request_id, start + n):
                return n
            # Take as many tokens as fit in the blocks we already have plus the free ones.
            have = self.kv.num_blocks_of(request_id) + self.kv.num_free_blocks
            fit = have * bs - start
            if fit <= 0:
                return 0
            ok = self.kv.allocate_slots(request_id, start + fit)
            assert ok
            return fit

        heads = list(self.waiting)[:free_seq_slots]
        chunk = build_chunk(prefill_candidates(heads, self.kv), cfg.chunk_size, admit=admit, pad=cfg.pad_last_chunk)
        if not chunk.slices and not self.running:
            # Partially prefilled waiting requests hold every block and nothing runs that could free
            # any: release the youngest holders (recompute later) so the queue head can progress.
            for victim in reversed(self.waiting):
                if victim is self.waiting[0]:
                    break
                if self.kv.num_blocks_of(victim.request_id):
                    self.kv.free_request(victim.request_id)
                    victim.num_computed_tokens = 0
                    victim.num_preemptions += 1
                    chunk = build_chunk(prefill_candidates(heads[:1], self.kv), cfg.chunk_size, admit=admit,
                                        pad=cfg.pad_last_chunk)
                    if chunk.slices:
                        break
        if not chunk.slices:
            return None
        segments = []
        for s in chunk.slices:
            req = self._table[s.request_id]
            segments.append(_segment(req, s.start, s.num_tokens, self.kv.block_ids(s.request_id)))
        return SchedulerOutput(
            step_id=self._step_id,
            kind=StepKind.PREFILL,
            segments=tuple(segments),
            num_padding_tokens=chunk.num_padding,
            finished_request_ids=self._table.drain_finished(),
        )

    def _schedule_decode(self) -> SchedulerOutput:
        preempted: list[str] = []
        scheduled: list[Request] = []
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if self.kv.allocate_slots(req.request_id, req.num_tokens):
                scheduled.append(req)
                i += 1
                continue
            victim = self.running[-1]
            if victim is req and len(self.running) == 1:
                if self._release_youngest_waiting_holder():
                    continue  # retry: a partly prefilled waiting request gave its blocks back
                # Alone and still out of memory: the pool is smaller than this request's context.
                self._table.mark_finished(req, RequestStatus.FINISHED_LENGTH)
                continue
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                continue
        segments = tuple(
            _segment(r, r.num_computed_tokens, 1, self.kv.block_ids(r.request_id)) for r in scheduled
        )
        kind = StepKind.DECODE if segments else StepKind.IDLE
        return SchedulerOutput(
            step_id=self._step_id,
            kind=kind,
            segments=segments,
            preempted_request_ids=tuple(preempted),
            finished_request_ids=self._table.drain_finished(),
        )

    def _release_youngest_waiting_holder(self) -> bool:
        """Free the blocks of the youngest waiting request that holds any (it recomputes later); False if none
        does. Used before giving up on the last running request for lack of memory."""
        for victim in reversed(self.waiting):
            if self.kv.num_blocks_of(victim.request_id):
                self.kv.free_request(victim.request_id)
                victim.num_computed_tokens = 0
                victim.num_preemptions += 1
                return True
        return False

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free_request(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- results -------------------------------------------------------------------------
    def update(self, output: SchedulerOutput, result: StepResult) -> StepUpdate:
        new_tokens: dict[str, int] = {}
        finished: list[Request] = []
        for seg in output.segments:
            req = self._table.get(seg.request_id)
            if req is None:  # aborted while the step ran
                continue
            req.num_computed_tokens = seg.end
            self.kv.cache_computed(req)
            if not seg.sample:
                continue
            token = result.sampled_token_ids[seg.request_id]
            req.append_output(token, result.logprobs.get(seg.request_id))
            new_tokens[req.request_id] = token
            if req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                self.waiting.remove(req)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
            stop = req.check_stop()
            if stop is None and req.num_tokens >= self.config.max_model_len:
                stop = RequestStatus.FINISHED_LENGTH
            if stop is not None:
                self._table.mark_finished(req, stop)
                finished.append(req)
        return StepUpdate(new_tokens, tuple(finished))
