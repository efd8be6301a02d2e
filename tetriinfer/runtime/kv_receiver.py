"""The receiving end of a KV handoff (prefill -> decode, or a live migration's source -> target), shared by the
decode and colocated workers.

For each handoff: memory posted (backend-allocated staging, so a shared-memory sender copies straight in, once)
and ``KVReady`` sent to the sender (or, when the handoff names a ``kv_region``, a one-sided read of it: the
sender does nothing until ``KVDone``) -> polled -> all bytes in: ``on_done`` | failed or timed out: re-posted up to
``transfer_attempts`` times, then ``on_gave_up(handoff, reason)`` (at once when the sender is no longer in the
peer table: it is gone, no byte will come). Every outcome is reported to the front end as a
``TransferStat``. ``install`` writes a received payload into the request's blocks (and restores a migrated seeded
request's sampler state).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tetriinfer.core.request import Request
from tetriinfer.runtime.messages import Handoff, KVReady, TransferStat
from tetriinfer.runtime.worker_base import InstanceContext


def request_from_handoff(h: Handoff) -> Request:
    """The request a decode-capable instance admits for a handoff: prefilled (``num_computed_tokens ==
    num_tokens - 1``), with its prediction."""
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


@dataclass
class Receiving:
    handoff: Handoff
    staging: list[torch.Tensor]  # 2 * num_layers tensors [num_kv_blocks, block_size, Hkv, D]
    transfer_id: str
    attempt: int
    started: float


class KVReceiver:
    def __init__(self, ctx: InstanceContext, on_done: Callable[[Receiving], None],
                 on_gave_up: Callable[[Handoff, str], None]) -> None:
        self.ctx = ctx
        self.on_done = on_done
        self.on_gave_up = on_gave_up
        self.receiving: dict[str, Receiving] = {}

    def post(self, h: Handoff, attempt: int = 0) -> None:
        kv = self.ctx.runner.kv
        ref = kv.k[0]
        shape = (h.num_kv_blocks, kv.block_size, *ref.shape[1:])
        staging = self.ctx.backend.alloc_like([shape] * (2 * len(kv.k)), ref.dtype)
        # The id names the region the sender must write into; its random part travels only in KVReady over the
        # authenticated control channel, so the KV port accepts bytes only from the expected sender.
        tid = f"{h.request_id}#{'m' if h.migrated else ''}{attempt}.{secrets.token_hex(8)}"
        self.receiving[h.request_id] = Receiving(h, staging, tid, attempt, time.perf_counter())
        if h.kv_region is not None:  # pull: read the prefill instance's staged KV (shm: done on return)
            self.ctx.backend.read(tid, h.kv_region, staging, timeout_s=self.ctx.spec.transfer_timeout_s)
            return
        # Chunk-wise: one slot per (layer tensor, block) so blocks can arrive as chunks complete.
        slots = [t[b] for t in staging for b in range(h.num_kv_blocks)] if h.early else staging
        region = self.ctx.backend.recv(tid, slots, timeout_s=self.ctx.spec.transfer_timeout_s)
        if not self.ctx.reply_peer(h.prefill_id, KVReady(h.request_id, tid, region)):
            # the sender left the peer table (dead and replaced, or retired): no byte will come, free it now
            self.drop(h.request_id)
            self.on_gave_up(h, f"sender {h.prefill_id} is gone")

    def poll(self) -> None:
        from tetriinfer.transfer import TransferState

        backend = self.ctx.backend
        for rid, rcv in list(self.receiving.items()):
            state = backend.poll(rcv.transfer_id)
            if state is TransferState.DONE:
                self.drop(rid)
                self._report(rcv, "done")
                self.on_done(rcv)
            elif state is TransferState.FAILED:
                reason = backend.status(rcv.transfer_id).reason or "transfer failed"
                self.drop(rid)
                self._report(rcv, "failed")
                if rcv.attempt + 1 < self.ctx.spec.transfer_attempts:
                    self.post(rcv.handoff, rcv.attempt + 1)
                else:
                    self.on_gave_up(rcv.handoff, reason)

    def drop(self, request_id: str) -> None:
        """Stop receiving for this request (done, failed, or it ended) and release the transfer."""
        rcv = self.receiving.pop(request_id, None)
        if rcv is None:
            return
        self.ctx.release_transfer(rcv.transfer_id)

    def install(self, rcv: Receiving, block_table: list[int]) -> None:
        """Write the received KV into the request's first ``num_kv_blocks`` blocks; a migrated seeded request
        samples on where it stopped."""
        h = rcv.handoff
        self.ctx.runner.kv.write_blocks(block_table[: h.num_kv_blocks], rcv.staging)
        if h.rng_state and h.params.seed is not None:
            self.ctx.runner.sampler.import_state(h.request_id, h.params.seed, h.rng_state)

    def _report(self, rcv: Receiving, outcome: str) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in rcv.staging)
        secs = time.perf_counter() - rcv.started  # memory posted -> all bytes in (includes the KVReady hop)
        self.ctx.send_front(TransferStat(self.ctx.instance_id, nbytes, secs, outcome, self.ctx.spec.kv_backend))
