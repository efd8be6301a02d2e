"""Decode role: admit (reserve blocks) -> receive KV -> continuous-batching decode -> stream tokens.

Conditional disaggregation: the front end may also send a ``NewRequest`` here (the prefill tier is
backed up); it waits in ``local_pending`` (FIFO) until ``DecodeScheduler.admit_local`` takes it, then
prefills here chunk by chunk within the decode steps and decodes in place (no KV transfer).

Lifecycle of a request here: Handoff -> pending admission (FIFO; the admission policy may make it
wait; a Handoff for a request already aborted here is refused at once) -> reserved (blocks allocated *before*
bytes move) -> receiving (memory posted, KVReady sent)
-> KV written into its blocks -> decoding -> finished | aborted. A failed or timed-out receive is
re-posted up to ``transfer_attempts`` times (blocks stay reserved), then the blocks are freed and the
prefill instance told (KVDone failed) so it re-dispatches.

Live migration (``core.migration``): as a target, a ``Handoff(migrated=True)`` is a running decode moving here
from another decode instance (its sender plays the prefill side of the same protocol); it is admitted at once or
refused (``KVDone(failed)``: it decodes on at its source), never queued (``runtime.immigration``). As a source,
``Migrate`` hands running decodes over (``runtime.emigration``). Receiving KV, for both: ``runtime.kv_receiver``.
"""

from __future__ import annotations

import time
from collections import deque

from tetriinfer.core.decode_scheduler import DecodeScheduler, DecodeSchedulerConfig
from tetriinfer.core.load import InstanceState, LoadReport, decode_instance_report
from tetriinfer.core.request import Request
from tetriinfer.core.step_inflation import StepInflation
from tetriinfer.runtime.emigration import Emigration
from tetriinfer.runtime.immigration import Immigration
from tetriinfer.runtime.kv_receiver import KVReceiver, Receiving, request_from_handoff
from tetriinfer.runtime.messages import (
    Abort,
    Handoff,
    KVDone,
    KVReady,
    Migrate,
    NewRequest,
    PrefillDone,
)
from tetriinfer.runtime.worker_base import InstanceContext, RecentIds, apply_decode_step, schedule_decode


class DecodeWorker:
    role = "decode"

    def __init__(self, ctx: InstanceContext) -> None:
        spec = ctx.spec
        self.ctx = ctx
        self.scheduler = DecodeScheduler(
            DecodeSchedulerConfig(
                policy=spec.decode_policy,
                max_num_seqs=spec.max_num_seqs,
                max_model_len=ctx.max_model_len,
                heavy_decode_tokens=spec.heavy_decode_tokens,
                local_prefill_chunk=spec.chunk_size,
            ),
            ctx.kv_manager,
        )
        self.pending: deque[Handoff] = deque()
        self.local_pending: deque[NewRequest] = deque()  # conditional disaggregation: prefilled here
        self.receiver = KVReceiver(ctx, on_done=self._kv_in, on_gave_up=self._gave_up)
        self.ended = RecentIds()  # aborted here: a Handoff that comes after its Abort holds nothing
        # chunk-wise transfers: first tokens that arrived (PrefillDone) and KV that completed first
        self.first_tokens: dict[str, PrefillDone] = {}  # early hand-offs: first token(s) in before the KV
        self.kv_complete: dict[str, Receiving] = {}
        self.inflation = StepInflation()  # how much batching slows each step (flip policy's decode load)
        self.emigration = Emigration(ctx, self.scheduler)  # running decodes leaving (live migration)
        self.immigration = Immigration(ctx, self.scheduler)  # running decodes arriving (live migration)

    # ---- messages ------------------------------------------------------------------------
    def handle(self, msg: object) -> None:
        if isinstance(msg, Handoff):
            if msg.migrated:
                self.immigration.offer(msg)
                return
            if msg.request_id in self.ended:  # aborted before its Handoff arrived: a live sender frees its copy
                self.ctx.reply_peer(msg.prefill_id, KVDone(msg.request_id, reason="aborted"))
                return
            self.pending.append(msg)
            self._admit()
        elif isinstance(msg, Migrate):
            self.emigration.start(msg)
        elif isinstance(msg, KVReady):
            self.emigration.on_kv_ready(msg)
        elif isinstance(msg, KVDone):
            self.emigration.on_kv_done(msg)
        elif isinstance(msg, NewRequest):
            self.local_pending.append(msg)
            self._admit_local()
        elif isinstance(msg, PrefillDone):
            self.first_tokens[msg.request_id] = msg
            rcv = self.kv_complete.pop(msg.request_id, None)
            if rcv is not None:
                self._activate(rcv)
        elif isinstance(msg, Abort):
            self.abort(msg.request_id)

    def _admit(self) -> None:
        while self.pending:
            h = self.pending[0]
            req = request_from_handoff(h)
            try:
                ok = self.scheduler.reserve(req)
            except ValueError as exc:  # can never run here: fail cleanly, let the prefill side free its copy
                self.pending.popleft()
                self.ctx.emit_error(h.request_id, len(h.output_token_ids), str(exc))
                self.ctx.reply_peer(h.prefill_id, KVDone(h.request_id, failed=False, reason=str(exc)))
                continue
            if not ok:
                return
            self.pending.popleft()
            self.receiver.post(h)

    def _admit_local(self) -> None:
        while self.local_pending:
            msg = self.local_pending[0]
            try:
                ok = self.scheduler.admit_local(msg.to_request())
            except ValueError as exc:  # can never run here: a clean error, nothing held
                self.local_pending.popleft()
                self.ctx.emit_error(msg.request_id, 0, str(exc))
                continue
            if not ok:
                return
            self.local_pending.popleft()

    def poll_transfers(self) -> None:
        self.emigration.poll()
        self.immigration.poll()
        self.receiver.poll()

    def _kv_in(self, rcv: Receiving) -> None:
        rid = rcv.handoff.request_id
        if rcv.handoff.early and rid not in self.first_tokens:
            self.kv_complete[rid] = rcv  # KV is in; the first token is still on its way
        else:
            self._activate(rcv)

    def _gave_up(self, h: Handoff, reason: str) -> None:
        self.scheduler.transfer_failed(h.request_id)
        self.ctx.reply_peer(h.prefill_id, KVDone(h.request_id, failed=True, reason=reason))

    def _activate(self, rcv: Receiving) -> None:
        rid = rcv.handoff.request_id
        if rid not in self.scheduler.reserved:  # aborted meanwhile
            self.first_tokens.pop(rid, None)
            return
        if rcv.handoff.early:
            req = self.scheduler.reserved[rid]
            done = self.first_tokens.pop(rid)
            req.output_token_ids = list(done.output_token_ids)
            req.num_computed_tokens = req.num_tokens - 1
            if done.rng_state and req.sampling_params.seed is not None:  # sample on where the prefill side stopped
                self.ctx.runner.sampler.import_state(rid, req.sampling_params.seed, done.rng_state)
        self.receiver.install(rcv, self.scheduler.block_table(rid))
        self.scheduler.on_kv_received(rid)
        self.ctx.reply_peer(rcv.handoff.prefill_id, KVDone(rid))

    # ---- stepping ------------------------------------------------------------------------
    def take_unstarted(self, limit: int) -> list[Request]:
        """Nothing to give back: what a decode instance holds already has KV here (not a rebalancing tier)."""
        return []

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.suspended)

    def is_empty(self) -> bool:
        return (not self.scheduler.has_unfinished() and not self.pending and not self.receiver.receiving
                and not self.kv_complete and not self.local_pending and not self.emigration.outgoing
                and not self.immigration.arriving)

    def step(self) -> bool:
        if self.pending:
            self._admit()
        if self.local_pending:
            self._admit_local()
        if not self.has_work():
            return False
        out = schedule_decode(self.scheduler)
        t0 = time.perf_counter()
        result = self.ctx.runner.execute(out)
        if out.is_decode_only:  # feeds the step inflation the flip policy may read
            self.inflation.observe(len(out.segments), time.perf_counter() - t0)
        apply_decode_step(self.ctx, self.scheduler, out, result)
        return not out.is_empty

    def abort(self, rid: str) -> None:
        self.ended.add(rid)
        for h in list(self.pending):
            if h.request_id == rid:
                self.pending.remove(h)
        for m in list(self.local_pending):
            if m.request_id == rid:
                self.local_pending.remove(m)
        self.receiver.drop(rid)
        self.immigration.abort(rid)
        self.kv_complete.pop(rid, None)
        self.first_tokens.pop(rid, None)
        self.scheduler.abort(rid)
        self.emigration.abort(rid)

    def load_report(self, now: float, utilization: float, state: InstanceState) -> LoadReport:
        rep = self.scheduler.load_report(self.ctx.instance_id, now, utilization, state)
        blocks = self.ctx.kv_manager.pool.blocks_for_tokens
        waiting_blocks = (sum(blocks(len(m.prompt_token_ids) + len(m.output_token_ids)) for m in self.pending)
                          + sum(blocks(len(m.prompt_token_ids) + 1) for m in self.local_pending))
        return decode_instance_report(rep, len(self.pending) + len(self.local_pending),
                                      sum(len(m.prompt_token_ids) for m in self.local_pending), self.inflation.take(),
                                      waiting_blocks)


