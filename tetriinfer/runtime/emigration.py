"""The source side of live migration (``core.migration``): running decodes leaving this instance with their KV.

Lifecycle of one migrant here: ``Migrate`` -> picked (``pick_migrants``) -> detached from the batch between
two steps (blocks held, nothing scheduled) -> KV copied out and a ``Handoff(migrated=True)`` sent to the target
-> ``KVReady`` (the target reserved blocks and posted memory) -> KV sent -> ``KVDone``: success frees the
blocks here (the request is the target's now; it decodes on from the next output index) | failure or refusal
puts it back into this batch. An abort at any point ends it here like any running request. A target that never
answers (it died) is given up after ``deadline_s``: the request is put back (and the target told to drop it).

The protocol is the prefill -> decode handoff's, with this instance as the sender, so the target's code path,
retries and timeouts are the ones every dispatched request uses. One ``MigrationDone`` per ``Migrate`` when
every request it picked moved, came back or ended.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tetriinfer.core.migration import Detachable, pick_migrants
from tetriinfer.core.request import Request
from tetriinfer.runtime.messages import (
    Abort,
    Handoff,
    KVDone,
    KVReady,
    Migrate,
    Migrating,
    MigrationDone,
    Prediction,
    WireParams,
)
from tetriinfer.runtime.worker_base import InstanceContext


@dataclass
class _Move:
    """One ``Migrate`` being carried out."""

    reason: str
    started: float
    open: set[str] = field(default_factory=set)
    moved: list[str] = field(default_factory=list)
    returned: list[str] = field(default_factory=list)
    num_bytes: int = 0


@dataclass
class _Outgoing:
    request: Request
    target: str
    tensors: list[torch.Tensor]  # 2 * num_layers copies [num_blocks, block_size, Hkv, D]
    num_blocks: int
    move: _Move
    deadline: float
    sending_tid: str | None = None


class Emigration:
    def __init__(self, ctx: InstanceContext, scheduler: Detachable) -> None:
        self.ctx = ctx
        self.scheduler = scheduler
        self.outgoing: dict[str, _Outgoing] = {}
        spec = ctx.spec
        self.deadline_s = (spec.transfer_attempts + 1) * spec.transfer_timeout_s + 5.0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.outgoing

    def start(self, msg: Migrate) -> None:
        """Pick, detach and hand off the requests ``msg`` asks for; answer ``Migrating`` per target at once."""
        now = time.perf_counter()
        move = _Move(msg.reason, now)
        total = sum(max(0, n) for _, n in msg.targets)
        picked = iter(pick_migrants(self.scheduler.running, total))
        for target, count in msg.targets:
            sent = []
            for req in [r for _, r in zip(range(max(0, count)), picked, strict=False)]:
                if self._hand_off(req, target, move, now):
                    sent.append(req.request_id)
            if sent:
                self.ctx.send_front(Migrating(self.ctx.instance_id, target, sent))
        self._maybe_done(move)

    def _hand_off(self, req: Request, target: str, move: _Move, now: float) -> bool:
        rid = req.request_id
        kv = self.ctx.kv_manager
        self.scheduler.detach(rid)
        num_blocks = kv.pool.blocks_for_tokens(req.num_computed_tokens)
        tensors = self.ctx.runner.kv.read_blocks(kv.block_table(rid)[:num_blocks])
        pred = None
        if req.predicted_bucket is not None:
            pred = Prediction(req.predicted_bucket, req.predicted_lower or 0, req.predicted_upper or 0)
        rng = self.ctx.runner.sampler.export_state(rid) if req.sampling_params.seed is not None else b""
        handoff = Handoff(
            request_id=rid, prefill_id=self.ctx.instance_id, prompt_token_ids=req.prompt_token_ids,
            output_token_ids=list(req.output_token_ids), params=WireParams.from_params(req.sampling_params),
            arrival_time=req.arrival_time, eos_token_id=req.eos_token_id, num_kv_blocks=num_blocks,
            prediction=pred, migrated=True, rng_state=rng,
        )
        try:
            self.ctx.send_peer(target, handoff)
        except RuntimeError:  # the target left the peer table meanwhile: it stays here
            self.scheduler.reattach(rid)
            move.returned.append(rid)
            return False
        self.outgoing[rid] = _Outgoing(req, target, tensors, num_blocks, move, now + self.deadline_s)
        move.open.add(rid)
        return True

    def on_kv_ready(self, msg: KVReady) -> None:
        out = self.outgoing.get(msg.request_id)
        if out is None:  # ended meanwhile; the target times out and frees its blocks
            return
        if out.sending_tid is not None:  # a re-posted receive: send again
            self.ctx.release_transfer(out.sending_tid)
        out.sending_tid = msg.transfer_id
        try:
            self.ctx.backend.send(msg.transfer_id, out.tensors, msg.region, timeout_s=self.ctx.spec.transfer_timeout_s)
        except (ValueError, RuntimeError):
            out.sending_tid = None  # the target times out and re-posts or gives up

    def on_kv_done(self, msg: KVDone) -> None:
        out = self.outgoing.pop(msg.request_id, None)
        if out is None:
            return
        self._end(out, moved=not msg.failed)

    def poll(self) -> None:
        """Free finished sends; give up on targets that never answered."""
        from tetriinfer.transfer import TransferState

        now = time.perf_counter()
        for rid, out in list(self.outgoing.items()):
            if out.sending_tid is not None and self.ctx.backend.poll(out.sending_tid) in (
                    TransferState.DONE, TransferState.FAILED):
                self.ctx.release_transfer(out.sending_tid)
                out.sending_tid = None
            if now > out.deadline:
                del self.outgoing[rid]
                try:
                    self.ctx.send_peer(out.target, Abort(rid))
                except RuntimeError:
                    pass
                self._end(out, moved=False)

    def abort(self, request_id: str) -> None:
        """The request ended (the scheduler frees its blocks): forget the move's part of it."""
        out = self.outgoing.pop(request_id, None)
        if out is None:
            return
        if out.sending_tid is not None:
            self.ctx.release_transfer(out.sending_tid)
        out.move.open.discard(request_id)
        self._maybe_done(out.move)

    def _end(self, out: _Outgoing, moved: bool) -> None:
        rid = out.request.request_id
        if out.sending_tid is not None:
            self.ctx.release_transfer(out.sending_tid)
        if moved:
            self.scheduler.release_migrated(rid)
            self.ctx.runner.sampler.drop([rid])
            out.move.moved.append(rid)
            out.move.num_bytes += sum(t.numel() * t.element_size() for t in out.tensors)
        else:
            self.scheduler.reattach(rid)
            out.move.returned.append(rid)
        out.move.open.discard(rid)
        self._maybe_done(out.move)

    def _maybe_done(self, move: _Move) -> None:
        if move.open:
            return
        self.ctx.send_front(MigrationDone(self.ctx.instance_id, list(move.moved), list(move.returned),
                                          time.perf_counter() - move.started, move.num_bytes, move.reason))

