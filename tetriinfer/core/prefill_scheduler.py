"""Scheduler of one prefill instance: fixed-size chunks of prompt tokens, in policy order.

Request lifecycle (disaggregated mode) and the part this module owns:
arrive (global scheduler) -> **queued here -> predicted -> chunks prefilled -> handed over** ->
dispatched (decode instance chosen, blocks reserved there) -> KV transferring -> **released here** ->
decoding -> finished | aborted | failed.

- ``add_request`` queues a request (WAITING). Each ``schedule()`` returns one PREFILL step: exactly one
  chunk of ``chunk_size`` tokens sliced and merged from queued requests in ``PrefillQueue`` order
  (padded), or IDLE. With ``tail_tokens`` the chunk that empties the queue may hold up to ``chunk_size +
  tail_tokens`` tokens instead of leaving the rest to a step of its own (``core.chunking``, tail merge).
- When a request's context is fully computed, the step samples its first token (``update``). If that
  token ends it (EOS, ``max_tokens == 1``), it finishes here and its blocks are freed at once.
  Otherwise it is *handed over* (status RUNNING): it stays in ``handed_over`` with its blocks held so
  the KV can be transferred, and is reported as ``prefilled`` (ready for dispatch) once it is also
  predicted (only if ``require_prediction``; see ``set_prediction``).
- ``release(request_id)`` (after the KV transfer, or its final failure) frees its blocks and forgets it.

Invariants: a step never allocates beyond the pool; chunks hold prompt(/context) tokens only; every
request held here is in exactly one of the queue and ``handed_over``; every block of a request is freed
exactly once (finish, abort or release); a request is never overtaken beyond the queue policy's bound.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tetriinfer.core.chunking import build_chunk, chunk_budget
from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.load import InstanceState, LoadReport, Role
from tetriinfer.core.local_scheduler import _segment, prefill_candidates
from tetriinfer.core.prefill_policy import PrefillPolicy, PrefillQueue, parse_prefill_policy
from tetriinfer.core.request import Request, RequestStatus
from tetriinfer.core.request_table import RequestTable
from tetriinfer.core.step import SchedulerOutput, StepKind, StepResult


@dataclass(frozen=True)
class PrefillSchedulerConfig:
    policy: PrefillPolicy | str = PrefillPolicy.FCFS
    prefill_sched_batch: int = 16
    chunk_size: int = 512
    pad_last_chunk: bool = True
    max_model_len: int = 2048
    require_prediction: bool = False  # hold prefilled requests until ``set_prediction``
    # with prefix caching: SJF/LJF/SRTF rank a prompt by its uncached tokens (False: by all its tokens)
    cache_aware_order: bool = True
    # later requests join a chunk only while it holds fewer tokens than this (core.chunking; None: fill it)
    merge_limit: int | None = None
    # a chunk takes all queued prompt tokens when they exceed chunk_size by at most this (core.chunking; 0: never)
    tail_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", parse_prefill_policy(self.policy))
        if self.prefill_sched_batch < 1:
            raise ValueError(f"prefill_sched_batch must be >= 1, got {self.prefill_sched_batch}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.merge_limit is not None and self.merge_limit < 1:
            raise ValueError(f"merge_limit must be >= 1 or None, got {self.merge_limit}")
        if self.tail_tokens < 0:
            raise ValueError(f"tail_tokens must be >= 0, got {self.tail_tokens}")


@dataclass(frozen=True)
class PrefillStepUpdate:
    """``prefilled``: handed over and ready for dispatch (blocks held until ``release``);
    ``finished``: ended by their first token (blocks already freed)."""

    new_tokens: dict[str, int]
    prefilled: tuple[Request, ...]
    finished: tuple[Request, ...]


class PrefillScheduler:
    def __init__(self, config: PrefillSchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.queue = PrefillQueue(config.policy, config.prefill_sched_batch)
        self.handed_over: dict[str, Request] = {}
        self._table = RequestTable(kv, forget=self._forget)
        self._awaiting_prediction: set[str] = set()
        self._step_id = 0

    @property
    def requests(self) -> Mapping[str, Request]:
        """Requests held here (queued or handed over) by id (read-only, live)."""
        return self._table.view

    # ---- queue management ----------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request whose context ``[0, num_tokens)`` must be prefilled (normally its prompt;
        a re-prefill after a failed transfer may include outputs). It must hold no KV here."""
        self._table.require_new(req.request_id)
        if req.is_finished:
            raise ValueError(f"request {req.request_id!r} is already finished")
        if req.num_computed_tokens != 0:
            raise ValueError(f"request {req.request_id!r} must arrive with num_computed_tokens == 0")
        if req.num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt of request {req.request_id!r} has {req.num_tokens} tokens; the model's context is "
                f"{self.config.max_model_len} tokens (prompt + at least one output token)"
            )
        if self.kv.pool.blocks_for_tokens(req.num_tokens) > self.kv.num_blocks:
            raise ValueError(
                f"prompt of request {req.request_id!r} ({req.num_tokens} tokens) cannot fit in the KV cache "
                f"({self.kv.num_blocks} blocks of {self.kv.block_size} tokens)"
            )
        req.status = RequestStatus.WAITING
        self._table.add(req)
        self.queue.push(req)

    def set_prediction(self, request_id: str, bucket: int, lower: int, upper: int) -> Request | None:
        """Mark a request predicted (length bucket and its token bounds). Returns the request if this
        made it ready for dispatch (it was prefilled and waiting for its prediction), else None."""
        if lower < 0 or upper < lower:
            raise ValueError(f"prediction bounds must satisfy 0 <= lower <= upper, got [{lower}, {upper}]")
        req = self._table.get(request_id)
        if req is None:
            raise KeyError(f"unknown request {request_id!r}")
        req.predicted_bucket, req.predicted_lower, req.predicted_upper = bucket, lower, upper
        if request_id in self._awaiting_prediction:
            self._awaiting_prediction.discard(request_id)
            return req
        return None

    def has_unfinished(self) -> bool:
        return bool(self._table)

    def take_unstarted(self, limit: int) -> list[Request]:
        """Hand up to ``limit`` waiting requests with no progress here (newest first) to the caller, to run on
        another instance: they leave the table unfinished (no status change, nothing to free, not reported)."""
        def unqueue(req: Request) -> None:
            self.queue.remove(req.request_id)
            self._awaiting_prediction.discard(req.request_id)

        return self._table.take_unstarted(self.queue.arrival_order(), limit, unqueue)

    @property
    def num_queued(self) -> int:
        return len(self.queue)

    def ends_with_first_token(self, req: Request) -> bool:
        """The first token this instance samples for ``req`` ends it by length (``max_tokens`` reached, or the
        model's context full; ``update`` finishes it here): nothing is left to decode, so no decode instance is to
        be chosen or hold blocks for it (a chunk-wise transfer opens no stream for it)."""
        return (req.num_output_tokens + 1 >= req.sampling_params.max_tokens
                or req.num_tokens + 1 >= self.config.max_model_len)

    def block_table(self, request_id: str) -> list[int]:
        return self.kv.block_table(request_id)

    def release(self, request_id: str) -> int:
        """Free a handed-over request's blocks (after its KV transfer) and forget it; returns how many
        blocks were freed. Unknown or not-yet-prefilled ids raise KeyError."""
        self.keep(request_id)
        return self.kv.free_request(request_id)

    def keep(self, request_id: str) -> Request:
        """Hand a prefilled request over *with its blocks* to a decode scheduler on this same instance
        (``DecodeScheduler.adopt``): it is forgotten here, nothing is freed. Unknown or not-yet-prefilled
        ids raise KeyError."""
        req = self.handed_over.pop(request_id, None)
        if req is None:
            raise KeyError(f"request {request_id!r} is not handed over at this prefill instance")
        self._awaiting_prediction.discard(request_id)
        self._table.remove(request_id)  # leaves unfinished: not reported in finished_request_ids
        return req

    def abort(self, request_id: str) -> Request | None:
        return self._table.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def finish(self, request_id: str, status: RequestStatus) -> None:
        self._table.finish(request_id, status)

    def _forget(self, req: Request) -> None:
        """``RequestTable`` hook: take a finishing request out of the queue / ``handed_over``."""
        self.queue.remove(req.request_id)
        self.handed_over.pop(req.request_id, None)
        self._awaiting_prediction.discard(req.request_id)

    # ---- scheduling ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._step_id += 1
        cfg = self.config
        aware = self.kv.prefix_caching and cfg.cache_aware_order
        order = self.queue.order(cfg.chunk_size, self._work_left if aware else None)
        chunk = self._build(order)
        if not chunk.slices and order and not any(self.kv.num_blocks_of(r) for r in self.handed_over):
            # Partially prefilled requests hold every block and no release will come: drop the lowest
            # priority holders (recomputed later) until the head of the order can progress.
            for victim in reversed(order[1:]):
                if self.kv.num_blocks_of(victim.request_id):
                    self.kv.free_request(victim.request_id)
                    victim.num_computed_tokens = 0
                    victim.num_preemptions += 1
                    chunk = self._build(order)
                    if chunk.slices:
                        break
        finished_ids = self._table.drain_finished()
        if not chunk.slices:
            return SchedulerOutput(self._step_id, StepKind.IDLE, finished_request_ids=finished_ids)
        self.queue.note_served(s.request_id for s in chunk.slices)
        segments = tuple(
            _segment(self._table[s.request_id], s.start, s.num_tokens, self.kv.block_ids(s.request_id))
            for s in chunk.slices
        )
        return SchedulerOutput(
            step_id=self._step_id,
            kind=StepKind.PREFILL,
            segments=segments,
            num_padding_tokens=chunk.num_padding,
            finished_request_ids=finished_ids,
        )

    def _work_left(self, req: Request) -> int:
        """Prefill tokens left for ``req``, its prompt's cached prefix not counted (prefix caching on)."""
        return req.num_uncomputed_tokens - self.kv.cached_prefix_tokens(req)

    def _build(self, order: list[Request]):  # -> Chunk
        bs = self.kv.block_size

        def admit(request_id: str, start: int, n: int) -> int:
            if self.kv.allocate_slots(request_id, start + n):
                return n
            fit = (self.kv.num_blocks_of(request_id) + self.kv.num_free_blocks) * bs - start
            if fit <= 0:
                return 0
            ok = self.kv.allocate_slots(request_id, start + fit)
            assert ok
            return fit

        cfg = self.config
        budget = None
        if cfg.tail_tokens:
            budget = chunk_budget(cfg.chunk_size, sum(r.num_uncomputed_tokens for r in order), cfg.tail_tokens)
        return build_chunk(prefill_candidates(order, self.kv), cfg.chunk_size, admit=admit,
                           pad=cfg.pad_last_chunk, merge_limit=cfg.merge_limit, budget=budget)

    # ---- results -------------------------------------------------------------------------
    def update(self, output: SchedulerOutput, result: StepResult) -> PrefillStepUpdate:
        new_tokens: dict[str, int] = {}
        prefilled: list[Request] = []
        finished: list[Request] = []
        for seg in output.segments:
            req = self._table.get(seg.request_id)
            if req is None or req.request_id not in self.queue:  # aborted while the step ran
                continue
            req.num_computed_tokens = seg.end
            self.kv.cache_computed(req)
            if not seg.sample:
                continue
            token = result.sampled_token_ids[seg.request_id]
            req.append_output(token, result.logprobs.get(seg.request_id))
            new_tokens[req.request_id] = token
            stop = req.check_stop()
            if stop is None and req.num_tokens >= self.config.max_model_len:
                stop = RequestStatus.FINISHED_LENGTH
            if stop is not None:
                self._table.mark_finished(req, stop)
                finished.append(req)
                continue
            self.queue.remove(req.request_id)
            req.status = RequestStatus.RUNNING
            self.handed_over[req.request_id] = req
            if self.config.require_prediction and req.predicted_bucket is None:
                self._awaiting_prediction.add(req.request_id)
            else:
                prefilled.append(req)
        return PrefillStepUpdate(new_tokens, tuple(prefilled), tuple(finished))

    # ---- reporting -----------------------------------------------------------------------
    def load_report(
        self, instance_id: str, now: float, utilization: float = 0.0,
        state: InstanceState = InstanceState.ACTIVE, *, blocks_ahead: int = 0,
    ) -> LoadReport:
        """``blocks_ahead``: blocks of the shared pool counted as used beyond those used now (a steady run of the
        instance's kept decodes, read ahead: ``DecodeScheduler.steady_blocks_taken``)."""
        queued = len(self.queue)
        todo = sum(r.num_uncomputed_tokens for r in self.queue.requests()) if queued else 0
        kv = self.kv
        free = kv.num_free_blocks - blocks_ahead
        return LoadReport(
            instance_id=instance_id,
            role=Role.PREFILL,
            state=state,
            time=now,
            num_queued=queued,
            num_running=len(self.handed_over),
            num_free_blocks=free,
            num_used_blocks=kv.num_blocks - free,  # ``kv.num_used_blocks``
            block_size=kv.block_size,
            tokens_in_flight=todo,
            utilization=utilization,
            num_prefill_tokens=todo,
        )

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        queued = {r.request_id for r in self.queue.requests()}
        if queued & set(self.handed_over):
            raise AssertionError("a request is both queued and handed over")
        if queued | set(self.handed_over) != set(self._table):
            raise AssertionError("requests table disagrees with queue + handed_over")
        for rid in self.kv.request_ids():
            if rid not in self._table:
                raise AssertionError(f"blocks held for unknown request {rid}")
