"""Colocated role (the baselines): one instance runs both phases with a colocated scheduler.

``vllm``: prefill-first continuous batching, whole prompts. ``sarathi``: stall-free hybrid batches
(decodes first, then prompt chunks within a token budget). ``chunked``: TetriInfer's fixed-size prefill
chunks alternating with decode steps on one instance (what the offline ``LLM`` runs).

Live migration (``core.migration``, ``vllm`` and ``sarathi``): ``Migrate`` hands running decodes to a peer
(``runtime.emigration``); a ``Handoff(migrated=True)`` from a peer is admitted at once or refused
(``runtime.immigration``). ``KVReady`` / ``KVDone`` go to whichever side the request is on.
"""

from __future__ import annotations

import time

from tetriinfer.core.colocated_scheduler import (
    ColocatedSchedulerConfig,
    colocated_load_report,
    make_colocated_scheduler,
)
from tetriinfer.core.load import InstanceState, LoadReport
from tetriinfer.core.local_scheduler import LocalScheduler, LocalSchedulerConfig
from tetriinfer.core.request import Request
from tetriinfer.core.step_inflation import StepInflation
from tetriinfer.runtime.emigration import Emigration
from tetriinfer.runtime.immigration import Immigration
from tetriinfer.runtime.messages import Abort, Handoff, KVDone, KVReady, Migrate, MigrationDone, NewRequest
from tetriinfer.runtime.worker_base import InstanceContext


class ColocatedWorker:
    role = "colocated"

    def __init__(self, ctx: InstanceContext) -> None:
        spec = ctx.spec
        self.ctx = ctx
        self.inflation = StepInflation()  # TPOT vs batch 1, prefill stalls included (autoscaler signal)
        if spec.colocated_policy == "chunked":
            self.scheduler = LocalScheduler(
                LocalSchedulerConfig(
                    chunk_size=spec.chunk_size, max_num_seqs=spec.max_num_seqs, max_model_len=ctx.max_model_len,
                    pad_last_chunk=spec.pad_last_chunk,
                ),
                ctx.kv_manager,
            )
        else:
            self.scheduler = make_colocated_scheduler(
                spec.colocated_policy,
                ColocatedSchedulerConfig(
                    max_num_batched_tokens=spec.max_num_batched_tokens,
                    max_num_seqs=spec.max_num_seqs,
                    max_model_len=ctx.max_model_len,
                ),
                ctx.kv_manager,
            )
        self.migratable = not isinstance(self.scheduler, LocalScheduler)
        self.emigration = Emigration(ctx, self.scheduler) if self.migratable else None  # type: ignore[arg-type]
        self.immigration = Immigration(ctx, self.scheduler) if self.migratable else None

    def handle(self, msg: object) -> None:
        if isinstance(msg, NewRequest):
            try:
                self.scheduler.add_request(msg.to_request())
            except ValueError as exc:
                self.ctx.emit_error(msg.request_id, 0, str(exc))
        elif isinstance(msg, Abort):
            self.scheduler.abort(msg.request_id)
            if self.emigration is not None and self.immigration is not None:
                self.emigration.abort(msg.request_id)
                self.immigration.abort(msg.request_id)
        elif isinstance(msg, Migrate):
            if self.emigration is None:
                self.ctx.send_front(MigrationDone(self.ctx.instance_id, [], [], 0.0, 0, msg.reason))
            else:
                self.emigration.start(msg)
        elif isinstance(msg, Handoff) and msg.migrated:
            if self.immigration is None:
                self.ctx.send_peer(msg.prefill_id, KVDone(msg.request_id, failed=True,
                                                          reason="the chunked colocated policy takes no migrants"))
            else:
                self.immigration.offer(msg)
        elif isinstance(msg, KVReady) and self.emigration is not None:
            self.emigration.on_kv_ready(msg)
        elif isinstance(msg, KVDone) and self.emigration is not None:
            self.emigration.on_kv_done(msg)

    def poll_transfers(self) -> None:
        if self.emigration is not None and self.immigration is not None:
            self.emigration.poll()
            self.immigration.poll()

    def take_unstarted(self, limit: int) -> list[Request]:
        return self.scheduler.take_unstarted(limit)

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def is_empty(self) -> bool:
        moving = self.emigration is not None and self.immigration is not None and bool(
            self.emigration.outgoing or self.immigration.arriving)
        return not self.scheduler.has_unfinished() and not moving

    def step(self) -> bool:
        if not self.has_work():
            return False
        out = self.scheduler.schedule()
        t0 = time.perf_counter()
        result = self.ctx.runner.execute(out)
        self.inflation.observe_colocated(out, time.perf_counter() - t0, self.scheduler.running)
        upd = self.scheduler.update(out, result)
        self.ctx.emit_update(self.scheduler.requests, upd.new_tokens, upd.finished)
        return not out.is_empty

    def load_report(self, now: float, utilization: float, state: InstanceState) -> LoadReport:
        return colocated_load_report(self.scheduler, self.ctx.instance_id, now, utilization, state,
                                     step_inflation=self.inflation.take())
