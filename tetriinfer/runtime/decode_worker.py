"""Decode role: admit (reserve blocks) -> receive KV -> continuous-batching decode -> stream tokens.

Conditional disaggregation: the front end may also send a ``NewRequest`` here (the prefill tier is
backed up); it waits in ``local_pending`` (FIFO) until ``DecodeScheduler.admit_local`` takes it, then
prefills here chunk by chunk within the decode steps and decodes in place (no KV transfer).

Lifecycle of a request here: Handoff -> pending admission (FIFO; the admission policy may make it
wait) -> reserved (blocks allocated *before* bytes move) -> receiving (memory posted, KVReady sent)
-> KV written into its blocks -> decoding -> finished | aborted. A failed or timed-out receive is
re-posted up to ``transfer_attempts`` times (blocks stay reserved), then the blocks are freed and the
prefill instance told (KVDone failed) so it re-dispatches.

Live migration (``core.migration``): as a target, a ``Handoff(migrated=True)`` is a running decode moving here
from another decode instance (its sender plays the prefill side of the same protocol); it is admitted at once or
refused (``KVDone(failed)``: it decodes on at its source), never queued. As a source, ``Migrate`` hands running
decodes over (``runtime.emigration``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from tetriinfer.core.decode_scheduler import DecodeScheduler, DecodeSchedulerConfig
from tetriinfer.core.load import InstanceState, LoadReport, decode_instance_report
from tetriinfer.core.request import Request
from tetriinfer.core.step_inflation import StepInflation
from tetriinfer.runtime.emigration import Emigration
from tetriinfer.runtime.messages import (
    Abort,
    Handoff,
    KVDone,
    KVReady,
    Migrate,
    NewRequest,
    PrefillDone,
    TransferStat,
)
from tetriinfer.runtime.worker_base import InstanceContext, apply_decode_step, schedule_decode


@dataclass
class Receiving:
    handoff: Handoff
    staging: list[torch.Tensor]
    transfer_id: str
    attempt: int
    started: float


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
        self.receiving: dict[str, Receiving] = {}
        # chunk-wise transfers: first tokens that arrived (PrefillDone) and KV that completed first
        self.first_tokens: dict[str, list[int]] = {}
        self.kv_complete: dict[str, Receiving] = {}
        self.inflation = StepInflation()  # how much batching slows each step (flip policy's decode load)
        self.emigration = Emigration(ctx, self.scheduler)  # running decodes leaving (live migration)

    # ---- messages ------------------------------------------------------------------------
    def handle(self, msg: object) -> None:
        if isinstance(msg, Handoff):
            if msg.migrated:
                self._admit_migrant(msg)
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
            self.first_tokens[msg.request_id] = list(msg.output_token_ids)
            rcv = self.kv_complete.pop(msg.request_id, None)
            if rcv is not None:
                self._activate(rcv)
        elif isinstance(msg, Abort):
            self.abort(msg.request_id)

    def _admit(self) -> None:
        while self.pending:
            h = self.pending[0]
            req = self._request(h)
            try:
                ok = self.scheduler.reserve(req)
            except ValueError as exc:  # can never run here: fail cleanly, let the prefill side free its copy
                self.pending.popleft()
                self.ctx.emit_error(h.request_id, len(h.output_token_ids), str(exc))
                self.ctx.send_peer(h.prefill_id, KVDone(h.request_id, failed=False, reason=str(exc)))
                continue
            if not ok:
                return
            self.pending.popleft()
            self._post_receive(h, attempt=0)

    def _admit_migrant(self, h: Handoff) -> None:
        """A running decode moving here: reserve now or refuse (it then decodes on at its source)."""
        try:
            ok = self.scheduler.reserve(self._request(h))
            reason = "" if ok else "no room at the target"
        except ValueError as exc:
            ok, reason = False, str(exc)
        if not ok:
            self.ctx.send_peer(h.prefill_id, KVDone(h.request_id, failed=True, reason=reason))
            return
        self._post_receive(h, attempt=0)

    def _request(self, h: Handoff) -> Request:
        req = Request(
            request_id=h.request_id,
            prompt_token_ids=list(h.prompt_token_ids),
            sampling_params=h.params.to_params(),
            arrival_time=h.arrival_time,
            eos_token_id=h.eos_token_id,
            # Chunk-wise handoffs arrive before the first token exists: a placeholder sizes the
            # reservation and is replaced by PrefillDone before the request ever runs.
            output_token_ids=list(h.output_token_ids) if not h.early else [0],
        )
        req.num_computed_tokens = req.num_tokens - 1
        if h.prediction is not None:
            req.predicted_bucket = h.prediction.bucket
            req.predicted_lower, req.predicted_upper = h.prediction.lower, h.prediction.upper
        return req

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

    def _post_receive(self, h: Handoff, attempt: int) -> None:
        kv = self.ctx.runner.kv
        ref = kv.k[0]
        shape = (h.num_kv_blocks, kv.block_size, *ref.shape[1:])
        # Backend-allocated memory (a shared-memory arena on `shm`) lets the sender copy straight in, once.
        staging = self.ctx.backend.alloc_like([shape] * (2 * len(kv.k)), ref.dtype)
        tid = f"{h.request_id}#{attempt}"
        # Chunk-wise: one slot per (layer tensor, block) so blocks can arrive as chunks complete.
        slots = [t[b] for t in staging for b in range(h.num_kv_blocks)] if h.early else staging
        region = self.ctx.backend.recv(tid, slots, timeout_s=self.ctx.spec.transfer_timeout_s)
        self.receiving[h.request_id] = Receiving(h, staging, tid, attempt, time.perf_counter())
        self.ctx.send_peer(h.prefill_id, KVReady(h.request_id, tid, region))

    def poll_transfers(self) -> None:
        from tetriinfer.transfer import TransferState

        self.emigration.poll()
        backend = self.ctx.backend
        for rid, rcv in list(self.receiving.items()):
            state = backend.poll(rcv.transfer_id)
            if state is TransferState.DONE:
                del self.receiving[rid]
                self._release_tid(rcv.transfer_id)
                self._report_transfer(rcv, "done")
                if rcv.handoff.early and rid not in self.first_tokens:
                    self.kv_complete[rid] = rcv  # KV is in; the first token is still on its way
                else:
                    self._activate(rcv)
            elif state is TransferState.FAILED:
                reason = backend.status(rcv.transfer_id).reason or "transfer failed"
                self._report_transfer(rcv, "failed")
                del self.receiving[rid]
                self._release_tid(rcv.transfer_id)
                if rcv.attempt + 1 < self.ctx.spec.transfer_attempts:
                    self._post_receive(rcv.handoff, rcv.attempt + 1)
                else:
                    self.scheduler.transfer_failed(rid)
                    self.ctx.send_peer(rcv.handoff.prefill_id, KVDone(rid, failed=True, reason=reason))

    def _activate(self, rcv: Receiving) -> None:
        rid = rcv.handoff.request_id
        if rid not in self.scheduler.reserved:  # aborted meanwhile
            self.first_tokens.pop(rid, None)
            return
        if rcv.handoff.early:
            req = self.scheduler.reserved[rid]
            req.output_token_ids = self.first_tokens.pop(rid)
            req.num_computed_tokens = req.num_tokens - 1
        table = self.scheduler.block_table(rid)
        self.ctx.runner.kv.write_blocks(table[: rcv.handoff.num_kv_blocks], rcv.staging)
        seed = rcv.handoff.params.seed
        if rcv.handoff.rng_state and seed is not None:  # a migrated seeded request samples on where it stopped
            self.ctx.runner.sampler.import_state(rid, seed, rcv.handoff.rng_state)
        self.scheduler.on_kv_received(rid)
        self.ctx.send_peer(rcv.handoff.prefill_id, KVDone(rid))

    def _report_transfer(self, rcv: Receiving, outcome: str) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in rcv.staging)
        secs = time.perf_counter() - rcv.started  # memory posted -> all bytes in (includes the KVReady hop)
        self.ctx.send_front(TransferStat(self.ctx.instance_id, nbytes, secs, outcome, self.ctx.spec.kv_backend))

    def _release_tid(self, tid: str) -> None:
        try:
            self.ctx.backend.release(tid)
        except KeyError:
            pass

    # ---- stepping ------------------------------------------------------------------------
    def take_unstarted(self, limit: int) -> list[Request]:
        """Nothing to give back: what a decode instance holds already has KV here (not a rebalancing tier)."""
        return []

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.suspended)

    def is_empty(self) -> bool:
        return (not self.scheduler.has_unfinished() and not self.pending and not self.receiving
                and not self.kv_complete and not self.local_pending and not self.emigration.outgoing)

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
        for h in list(self.pending):
            if h.request_id == rid:
                self.pending.remove(h)
        for m in list(self.local_pending):
            if m.request_id == rid:
                self.local_pending.remove(m)
        rcv = self.receiving.pop(rid, None)
        if rcv is not None:
            self._release_tid(rcv.transfer_id)
        self.kv_complete.pop(rid, None)
        self.first_tokens.pop(rid, None)
        self.scheduler.abort(rid)
        self.emigration.abort(rid)

    def load_report(self, now: float, utilization: float, state: InstanceState) -> LoadReport:
        rep = self.scheduler.load_report(self.ctx.instance_id, now, utilization, state)
        return decode_instance_report(rep, len(self.pending) + len(self.local_pending),
                                      sum(len(m.prompt_token_ids) for m in self.local_pending), self.inflation.take())


