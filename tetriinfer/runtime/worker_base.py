"""What every role worker (prefill, decode, colocated) shares inside one instance process.

A worker owns its scheduler and the per-request bookkeeping of its role; the ``InstanceContext`` owns
the engine (model runner + KV tensors), sockets and the transfer backend, which survive a role flip.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tetriinfer.core.decode_scheduler import DecodeScheduler
from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.load import InstanceState, LoadReport
from tetriinfer.core.request import FINISH_REASON, Request
from tetriinfer.core.step import SchedulerOutput, StepResult
from tetriinfer.runtime.instance_spec import InstanceSpec
from tetriinfer.runtime.messages import Message, TokenItem, Tokens, WireLoad
from tetriinfer.runtime.priority import yield_if_realtime

if TYPE_CHECKING:  # the front end imports this module's wire helpers and must not pay for torch
    from tetriinfer.engine.model_runner import ModelRunner


@dataclass
class InstanceContext:
    spec: InstanceSpec
    runner: ModelRunner
    kv_manager: KVCacheManager
    max_model_len: int
    backend: Any  # tetriinfer.transfer.TransferBackend
    send_front: Callable[[Message], None]
    send_peer: Callable[[str, Message], None]
    predictor: Any = None
    outbox: list[TokenItem] = field(default_factory=list)

    @property
    def instance_id(self) -> str:
        return self.spec.instance_id

    @staticmethod
    def now() -> float:
        return time.time()

    def let_io_run(self) -> None:
        """Let this process's ZeroMQ I/O thread send what the loop has queued (first tokens, Handoffs) now.

        ZeroMQ writes to the socket from its own I/O thread. Under ``SCHED_FIFO`` (a prefill instance with
        ``prefill_rt_priority``) that thread has the loop's priority on the loop's one core, and equal-priority
        FIFO threads never preempt each other: a message queued just before a forward would leave only when the
        forward ends, tens of ms later. ``sched_yield`` puts the loop behind the runnable I/O thread for one turn
        (a no-op when nothing else is runnable). Under the normal scheduler the I/O thread preempts on wake-up."""
        yield_if_realtime()

    def flush_outbox(self) -> None:
        """Send the streamed items collected so far to the front end now (the loop also flushes after every
        step; a worker calls this to let first tokens leave before slower bookkeeping of the same step)."""
        if self.outbox:
            self.send_front(Tokens(self.spec.instance_id, self.outbox))
            self.outbox = []

    def emit_tokens(self, req: Request, new_tokens: list[int]) -> None:
        if new_tokens:
            index = req.num_output_tokens - len(new_tokens)
            self.outbox.append(TokenItem(req.request_id, index, list(new_tokens)))

    def emit_finished(self, req: Request) -> None:
        stop = req.stop_reason if isinstance(req.stop_reason, int) else None
        self.outbox.append(
            TokenItem(req.request_id, req.num_output_tokens, [], True, FINISH_REASON[req.status], stop)
        )

    def emit_update(self, live: Mapping[str, Request], new_tokens: dict[str, int], finished: tuple[Request, ...]) -> None:
        """Stream one step's new tokens, then its finished requests. ``live`` is the scheduler's table of
        unfinished requests (requests that finished in this step are found in ``finished``)."""
        ended = {r.request_id: r for r in finished}
        for rid, tok in new_tokens.items():
            req = live.get(rid) or ended.get(rid)
            if req is not None:
                self.emit_tokens(req, [tok])
        for req in finished:
            self.emit_finished(req)

    def release_transfer(self, transfer_id: str) -> None:
        """Forget a KV transfer at the backend (cancelling it if still live); unknown ids are fine."""
        try:
            self.backend.release(transfer_id)
        except KeyError:
            pass

    def reply_peer(self, instance_id: str, msg: Message) -> bool:
        """Send ``msg`` to a peer that may be gone: False (nothing sent) when ``instance_id`` is no longer in this
        instance's peer table (dead and replaced, or retired), where ``send_peer`` raises. For answers to a KV
        sender, which a gone sender has no use for."""
        try:
            self.send_peer(instance_id, msg)
        except RuntimeError:
            return False
        return True

    def emit_error(self, request_id: str, index: int, message: str) -> None:
        self.outbox.append(TokenItem(request_id, index, [], True, "error", None, message))


class RecentIds:
    """The last ``capacity`` ids added (a bounded set, oldest forgotten first).

    A receiver remembers the requests it was told to abort, so a ``Handoff`` for one that arrives after the
    ``Abort`` (they come from different senders: the front end and the prefill instance) holds nothing. Engine ids are
    never reused (a request sent again gets a new one), so a remembered id can only name an ended attempt."""

    def __init__(self, capacity: int = 8192) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._ids[request_id] = None
        self._ids.move_to_end(request_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)


def schedule_decode(scheduler: DecodeScheduler) -> SchedulerOutput:
    """The decode scheduler's next step (the runtime runs recompute preemption only, never swap)."""
    out = scheduler.schedule()
    if out.swapped_out or out.swapped_in:
        raise RuntimeError("swap preemption is not wired into the runtime; use recompute")
    return out


def apply_decode_step(ctx: InstanceContext, scheduler: DecodeScheduler, out: SchedulerOutput,
                      result: StepResult) -> None:
    """Update ``scheduler`` with its executed step and stream what it produced (an empty step only reports the
    requests its ``schedule`` ended)."""
    upd = scheduler.update(out, result)
    if out.is_empty:
        for req in upd.finished:
            ctx.emit_finished(req)
    else:
        ctx.emit_update(scheduler.requests, upd.new_tokens, upd.finished)


def wire_load(report: LoadReport, busy_s: float, steps: int, kv: KVCacheManager | None = None) -> WireLoad:
    """The report on the wire; ``kv`` (the instance's own) adds its prefix-cache counters."""
    stats = kv.prefix_cache_stats() if kv is not None else {}
    return WireLoad(
        instance_id=report.instance_id, role=report.role.value, state=report.state.value, time=report.time,
        num_queued=report.num_queued, num_running=report.num_running, num_free_blocks=report.num_free_blocks,
        num_used_blocks=report.num_used_blocks, block_size=report.block_size,
        tokens_in_flight=report.tokens_in_flight, num_heavy_decodes=report.num_heavy_decodes,
        num_light_decodes=report.num_light_decodes, utilization=report.utilization, busy_s=busy_s, steps=steps,
        num_prefill_tokens=report.num_prefill_tokens, step_inflation=report.step_inflation,
        prefix_hit_tokens=stats.get("prefix_cache_hit_tokens", 0),
        prefix_queried_tokens=stats.get("prefix_cache_queried_tokens", 0),
        prefix_cached_blocks=stats.get("prefix_cache_blocks", 0), num_waiting_blocks=report.num_waiting_blocks,
    )


def load_from_wire(w: WireLoad) -> LoadReport:
    from tetriinfer.core.load import Role

    role = Role(w.role) if w.role in ("prefill", "decode") else Role.DECODE
    return LoadReport(
        instance_id=w.instance_id, role=role, state=InstanceState(w.state), time=w.time,
        num_queued=w.num_queued, num_running=w.num_running, num_free_blocks=w.num_free_blocks,
        num_used_blocks=w.num_used_blocks, block_size=w.block_size, tokens_in_flight=w.tokens_in_flight,
        num_heavy_decodes=w.num_heavy_decodes, num_light_decodes=w.num_light_decodes,
        utilization=w.utilization, num_prefill_tokens=w.num_prefill_tokens, step_inflation=w.step_inflation,
        num_waiting_blocks=w.num_waiting_blocks,
    )
