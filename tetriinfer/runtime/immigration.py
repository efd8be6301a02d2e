"""The target side of live migration (decode and colocated workers).

Lifecycle of a migrant here: ``Handoff(migrated=True)`` -> admitted at once (``admit_migrant``: blocks for its
context allocated) or refused (``KVDone(failed)``: it decodes on at its source) -> memory posted, ``KVReady`` to
the source -> KV in: written into its blocks, its seeded sampler state restored, ``on_kv_received`` (it runs from
the next step), ``KVDone`` -> the source frees its copy. A failed or timed-out receive is re-posted up to
``transfer_attempts`` times, then the blocks are freed (``migrant_failed``) and the source told (``KVDone
failed``), which puts the request back into its own batch. An abort frees everything, and a migrant offered after
its abort (the source sent it before it heard the abort) is refused.
"""

from __future__ import annotations

from typing import Any

from tetriinfer.runtime.kv_receiver import KVReceiver, Receiving, request_from_handoff
from tetriinfer.runtime.messages import Handoff, KVDone
from tetriinfer.runtime.worker_base import InstanceContext, RecentIds


class Immigration:
    def __init__(self, ctx: InstanceContext, scheduler: Any) -> None:
        """``scheduler``: has ``admit_migrant``, ``on_kv_received``, ``migrant_failed`` (the colocated and decode
        schedulers)."""
        self.ctx = ctx
        self.scheduler = scheduler
        self.receiver = KVReceiver(ctx, on_done=self._activate, on_gave_up=self._gave_up)
        self.ended = RecentIds()  # aborted here: a migrant offered after its Abort is refused

    @property
    def arriving(self) -> dict[str, Receiving]:
        return self.receiver.receiving

    def offer(self, h: Handoff) -> None:
        """Admit the migrant now or refuse it (it decodes on at its source)."""
        if h.request_id in self.ended:
            self.ctx.reply_peer(h.prefill_id, KVDone(h.request_id, failed=True, reason="aborted at the target"))
            return
        try:
            ok = self.scheduler.admit_migrant(request_from_handoff(h))
            reason = "" if ok else "no room at the target"
        except ValueError as exc:
            ok, reason = False, str(exc)
        if not ok:
            self.ctx.reply_peer(h.prefill_id, KVDone(h.request_id, failed=True, reason=reason))
            return
        self.receiver.post(h)

    def poll(self) -> None:
        self.receiver.poll()

    def _activate(self, rcv: Receiving) -> None:
        rid = rcv.handoff.request_id
        self.receiver.install(rcv, self.ctx.kv_manager.block_table(rid))
        self.scheduler.on_kv_received(rid)
        self.ctx.reply_peer(rcv.handoff.prefill_id, KVDone(rid))

    def _gave_up(self, h: Handoff, reason: str) -> None:
        self.scheduler.migrant_failed(h.request_id)
        self.ctx.reply_peer(h.prefill_id, KVDone(h.request_id, failed=True, reason=reason))

    def abort(self, request_id: str) -> None:
        """The request ended (the scheduler frees its blocks): drop the receive; a later offer of it is refused."""
        self.ended.add(request_id)
        self.receiver.drop(request_id)
