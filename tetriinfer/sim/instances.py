"""Simulated instances: the real ``tetriinfer.core`` schedulers, stepped on a virtual clock.

Each instance runs one step at a time, like the runtime's workers (``runtime/*_worker.py``): it asks its
scheduler for a ``SchedulerOutput``, the cost model says how long the step takes, and when the step ends the
scheduler is updated with a synthetic ``StepResult`` (token ``SAMPLED_TOKEN`` for every sampled row; the
front end builds requests with ``ignore_eos`` so each ends at its ``max_tokens``, the workload's length).
Nothing here decides *what* runs: order, chunks, admission, dispatch and keeping are the core policies'.

Lifecycle of a disaggregated request here (as in ``runtime/prefill_worker.py`` and ``decode_worker.py``):
queued at a prefill instance -> chunks prefilled -> first token -> KV staged, prefill blocks freed ->
dispatched (or kept to decode here) -> handoff reaches the decode instance -> blocks reserved (FIFO) -> KV
crosses the link -> decoding -> finished. Every KV block a request held is freed on both sides.

With chunk-wise transfer (``kv_transfer == "chunk"``, the runtime's ``KVStream``): the decode instance is chosen
when the request's first chunk starts (by the same dispatcher; a prompt that one step prefills is left to the
per-request path when keep-decode may keep it) and reserves blocks for it then; each chunk's full KV blocks go on
the link as the chunk ends, so after the last chunk only its own blocks remain to send. The prefill instance keeps
the blocks (no staging copy) until the decode side has them all.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

from tetriinfer.core.colocated_scheduler import (
    ColocatedSchedulerConfig,
    colocated_load_report,
    make_colocated_scheduler,
)
from tetriinfer.core.decode_scheduler import DecodeScheduler, DecodeSchedulerConfig
from tetriinfer.core.dispatcher import Dispatcher, DispatcherConfig
from tetriinfer.core.keep_decode import (
    KeepDecodeConfig,
    keep_commitment,
    keep_offer_targets,
    keep_row,
    should_keep,
)
from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.load import (
    InstanceState,
    LoadReport,
    decode_instance_report,
    prefill_instance_report,
    restamped,
)
from tetriinfer.core.prefill_scheduler import PrefillScheduler, PrefillSchedulerConfig
from tetriinfer.core.request import Request, RequestStatus
from tetriinfer.core.step import (
    ScheduledSegment,
    SchedulerOutput,
    StepKind,
    StepResult,
    merge_steps,
    split_result,
)
from tetriinfer.core.step_inflation import StepInflation, decode_segments
from tetriinfer.sim.cost_model import CostModel
from tetriinfer.sim.events import EventLoop, Timer

SAMPLED_TOKEN = 1
MAX_STEADY_STEPS = 256  # longest steady decode run
FIRST_PRICED_STEPS = 32  # a steady run's first chunk of priced steps (``SteadyRun.price_more``)


class Host(Protocol):
    """What an instance calls back into (the simulated cluster: front end, links, peers)."""

    loop: EventLoop

    def on_tokens(self, new_tokens: dict[str, int], finished: tuple[Request, ...]) -> None: ...

    # optional: ``on_token_run(request_ids, times)``: each request streamed one token at each of ``times`` (a
    # steady decode run's steps, in order); a host without it gets no steady runs.
    # optional: ``first_tokens_streamed(request_ids) -> bool``: every one has streamed its first token; then a steady
    # run's tokens may reach ``on_token_run`` late (in one call per sync of the instance), as nothing reads a
    # request's later token times before it ends

    def on_failed(self, request_id: str, reason: str) -> None: ...

    def on_dispatched(self, request_id: str, decode_id: str) -> None: ...

    def handoff(self, prefill_id: str, decode_id: str, req: Request, num_blocks: int) -> None: ...

    def transfer(self, prefill_id: str, decode_id: str, request_id: str, num_blocks: int,
                 done: Callable[[], None]) -> None: ...

    # keep offers (``KeepDecodeConfig.offer_to_keepers``; see ``sim.cluster.SimCluster.offer``)
    def offer(self, prefill_id: str, keepers: tuple[str, ...], req: Request, num_blocks: int) -> None: ...

    # chunk-wise transfer (``kv_transfer == "chunk"``; see ``sim.cluster.SimCluster.open_stream``)
    def open_stream(self, prefill_id: str, decode_id: str, req: Request, num_blocks: int) -> None: ...

    def stream_ready(self, prefill_id: str, request_id: str) -> None: ...

    def send_kv(self, prefill_id: str, decode_id: str, num_blocks: int) -> float: ...

    def close_stream(self, prefill_id: str, decode_id: str, request_id: str, last_arrival: float) -> None: ...

    def cancel_stream(self, decode_id: str, request_id: str) -> None: ...

    def stream_failed(self, prefill_id: str, request_id: str) -> None: ...


@dataclass(frozen=True)
class InstancePolicies:
    """Everything an instance's schedulers are configured with (from ``ClusterConfig.role_policies``)."""

    prefill_policy: str = "fcfs"
    prefill_sched_batch: int = 16
    cache_aware_prefill_order: bool = True
    prefill_merge_limit: int | None = None
    prefill_tail_tokens: int = 0
    chunk_size: int = 512
    pad_last_chunk: bool = False
    dispatch_policy: str = "length-aware"
    decode_policy: str = "greedy"
    colocated_policy: str = "vllm"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    heavy_decode_tokens: int = 128
    keep_decode: bool = False
    keep_decode_ratio: float = 0.5
    keep_decode_rule: str = "ratio"
    prompt_only_prefill: bool | None = None
    keep_offer: bool = False  # core.keep_decode.KeepDecodeConfig.offer_to_keepers
    dispatch_when_full: str = "least-loaded"  # core.dispatcher.DispatcherConfig.alpha_empty
    kv_transfer: str = "request"  # request (after prefill) | chunk (block-wise while later chunks prefill)
    seed: int = 0


class OneRowCosts:
    """The price of a one-row decode step (a segment of one new token at context ``start``, sampled, with
    ``padding`` tokens of padding), cached by ``(start, padding)``: all such a step's cost depends on, given a
    pure cost model (``CostModel.step_seconds`` a function of the step's segments and padding only, as both the
    roofline and the profile model are). One cache serves every instance of a cluster (they share the model).

    Invariant: ``get(seg, padding) == cost.step_seconds(SchedulerOutput(_, _, (seg,), padding))`` bit for bit,
    for ``seg`` a decode row (``num_tokens == 1``, ``start > 0``, ``sample``)."""

    __slots__ = ("cost", "_cache")

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self._cache: dict[tuple[int, int], float] = {}

    def get(self, seg: ScheduledSegment, padding: int = 0) -> float:
        key = (seg.start, padding)
        secs = self._cache.get(key)
        if secs is None:
            secs = self._cache[key] = self.cost.step_seconds(SchedulerOutput(0, StepKind.DECODE, (seg,), padding))
        return secs


def synthetic_result(out: SchedulerOutput) -> StepResult:
    return StepResult(out.step_id, {s.request_id: SAMPLED_TOKEN for s in out.segments if s.sample})


class SteadyRun:
    """A steady decode run in flight (``core.steady_decode``): steps 1..``length`` of the same rows, the scheduler
    and the bookkeeping brought forward lazily (``SimInstance.sync``) to whatever step the clock is in.

    Steps are priced in chunks as the clock reaches them (``price_more``: ``FIRST_PRICED_STEPS`` first, then as many
    as are priced already), not all at once: a run is often cut short by an arrival, and what it would have cost
    past that is never needed. ``costs`` / ``ones`` / ``ends`` hold the steps priced so far: ``ends[s - 1]`` is the
    end of step ``s``, ``ends[s - 1] = ends[s - 2] + costs[s - 1]`` (``t0`` before step 1), the float additions a
    step-by-step run makes; ``ones[s - 1]`` the price of that step with only the first row (what step inflation
    compares with; ``costs`` itself when there is one row or nobody reads it). ``started`` / ``ended`` count steps
    whose start / end bookkeeping is done, ``done`` the scheduler's half steps, ``half_steps`` where the clock's
    last sync puts them (``done`` lags it between a ``_sync_books`` and the next ``sync``), ``streamed`` the steps
    whose tokens the host has (``ended`` or, with ``defer_streams``, as far as the last ``sync``), ``spans_from`` the
    first started step whose busy span is still to be counted by a report (``SimInstance.take_utilization``: steps
    ``spans_from..started - 1`` are the instance's utilization spans after its ``_spans``, read from ``ends``
    instead of stored as pairs; moved to ``_spans`` when the run ends).

    Invariant: every sync leaves ``ends[-1] > now`` unless all ``length`` steps are priced, so whatever it reads of
    the steps up to the one in flight is what pricing the whole run at once would give; and since step prices are
    positive, the last chunk is priced before the clock reaches the run's end (where its end event is placed)."""

    __slots__ = ("scheduler", "request_ids", "t0", "length", "costs", "ones", "ends", "started", "ended", "done",
                 "half_steps", "streamed", "spans_from", "defer_streams", "timer", "end_seq", "synced_at", "_price",
                 "_context_sum", "_one_context")

    def __init__(self, scheduler: SteadyScheduler, request_ids: list[str], t0: float, length: int,
                 price: Callable[[int, int, int], list[float] | None], context_sum: int,
                 one_context: int | None) -> None:
        """``price``: the cost model's ``decode_run_seconds``, exact for all ``length`` steps (checked by the
        caller); ``context_sum``: the rows' ``start + 1`` summed at step 1; ``one_context``: the first row's
        ``start + 1`` at step 1, or None when ``ones`` is ``costs``."""
        self.scheduler, self.request_ids, self.t0, self.length = scheduler, request_ids, t0, length
        self._price, self._context_sum, self._one_context = price, context_sum, one_context
        self.costs: list[float] = []
        self.ones: list[float] = self.costs if one_context is None else []
        self.ends: list[float] = []
        self.started = self.ended = self.done = self.half_steps = self.streamed = self.spans_from = 0
        self.defer_streams = False  # stream tokens at ``sync`` only, not at every ``_sync_books`` (set by the owner)
        self.timer: Timer | None = None
        self.end_seq = -1  # the event order reserved for the run's end when it began (``EventLoop.reserve``)
        self.synced_at = -1.0  # the clock at the last ``SimInstance._sync_books`` (one at the same instant: a no-op)
        self.price_more()

    @property
    def fully_priced(self) -> bool:
        return len(self.costs) == self.length

    def price_more(self) -> None:
        """Price the next chunk of steps (as many as are priced already, ``FIRST_PRICED_STEPS`` at first)."""
        done, rows = len(self.costs), len(self.request_ids)
        n = min(self.length - done, max(FIRST_PRICED_STEPS, done))
        costs = self._price(self._context_sum + rows * done, rows, n)
        if costs is None:
            raise AssertionError("a steady run's pricing stopped being exact within its length")
        self.costs.extend(costs)
        if self._one_context is not None:
            ones = self._price(self._one_context + done, 1, n)
            if ones is None:
                raise AssertionError("a steady run's pricing stopped being exact within its length")
            self.ones.extend(ones)
        self.ends.extend(accumulate(costs, initial=self.ends[-1] if self.ends else self.t0))
        del self.ends[done]  # the initial value accumulate starts from: ends[s - 1] = ends[s - 2] + costs[s - 1]


class SteadyScheduler(Protocol):
    """What a steady run needs of a scheduler (``DecodeScheduler`` and the colocated ones have it)."""

    running: list[Request]

    def steady_steps(self, token: int, limit: int) -> int: ...

    def advance_steady(self, token: int, done: int, to: int) -> None: ...

    def steady_output(self) -> SchedulerOutput: ...


class SimInstance:
    """Stepping, busy-time accounting and state shared by every role.

    Steady decode runs: when an instance's next steps cannot change its batch (``steady_scheduler`` and the
    scheduler's ``steady_steps``), it prices them without stepping (``SteadyRun``) and schedules one event for the
    run's end (and one per chunk of steps priced) instead of one per step. Everything that reads or changes the
    instance meanwhile first brings it to the present: reads with ``sync``, or ``_sync_books`` where the
    scheduler's own state is not read or is read ahead (``take_utilization``; ``report`` through the schedulers'
    ``steady_load_report`` / ``steady_blocks_taken``); changes (a request or KV arriving, a migration) with
    ``interrupt``, which ends the run after the step in flight, as a step-by-step run would take the change at
    that step's end. Invariant: a run changes no simulated number (the same steps, prices, token times and
    state at every event that can observe them; ``tests/test_sim_steady_runs.py``)."""

    role: str = ""
    inflation: StepInflation | None = None  # roles that measure step inflation set their own

    def __init__(self, iid: str, kv: KVCacheManager, cost: CostModel, host: Host, pol: InstancePolicies) -> None:
        self.iid, self.kv, self.cost, self.host, self.pol = iid, kv, cost, host, pol
        self._quiet_key: tuple[InstanceState, int] | None = None  # ``monitor_report``'s cached idle report
        self._quiet_report: LoadReport | None = None
        self.state = InstanceState.ACTIVE
        self.stepping = False
        self._start_pending = False
        self.busy_s = 0.0  # total seconds spent in steps (resource usage time)
        self._spans: list[tuple[float, float]] = []  # steps (start, end) not yet wholly counted in a report
        self.steps = 0
        self.step_seconds = 0.0  # the running (or last) step's cost
        self.between_steps: list[Callable[[], None]] = []  # run once the running step ends (live migration)
        shared = getattr(host, "one_row_costs", None)  # the cluster's, when it prices with the same model
        self.one_row: OneRowCosts = shared if isinstance(shared, OneRowCosts) and shared.cost is cost else OneRowCosts(cost)
        self._run: SteadyRun | None = None
        self.steady_runs = (getattr(host, "steady_runs", True) and hasattr(host, "on_token_run")
                            and hasattr(cost, "decode_run_seconds") and hasattr(cost, "decode_run_exact"))
        self.num_steady_runs = 0

    # subclass hooks
    def next_step(self) -> SchedulerOutput | None:
        raise NotImplementedError

    def end_step(self, out: SchedulerOutput, result: StepResult) -> None:
        raise NotImplementedError

    def report(self, now: float, utilization: float) -> LoadReport:
        raise NotImplementedError

    def is_empty(self) -> bool:
        raise NotImplementedError

    def take_unstarted(self, limit: int) -> list[Request]:
        """Queue rebalancing: queued requests with no progress here leave (the runtime's ``Yield``); roles whose
        requests all hold KV here (decode) give none."""
        return []

    def steady_scheduler(self) -> SteadyScheduler | None:
        """The scheduler whose next steps may form a steady run now (its own ``steady_steps`` decides), or None
        when something besides it could change the next step (requests waiting at the instance)."""
        return None

    # ---- steady decode runs
    def _begin_run(self, sched: SteadyScheduler) -> bool:
        k = sched.steady_steps(SAMPLED_TOKEN, MAX_STEADY_STEPS)
        if k < 2:
            return False
        rows = sched.running
        n = len(rows)
        price = self.cost.decode_run_seconds  # type: ignore[attr-defined]
        context_sum = sum(r.num_computed_tokens for r in rows) + n
        # ones: the batch-1 prices step inflation reads (not a prefill's keeps); ``costs`` itself for one row
        one_context = rows[0].num_computed_tokens + 1 if n > 1 and getattr(self, "inflation", None) is not None else None
        exact = self.cost.decode_run_exact  # type: ignore[attr-defined]  # for the run, so for every chunk of it
        if not exact(context_sum, n, k) or (one_context is not None and not exact(one_context, 1, k)):
            return False
        loop = self.host.loop
        run = self._run = SteadyRun(sched, [r.request_id for r in rows], loop.now, k, price, context_sum, one_context)
        # The host may hear of the run's tokens late (at the run's next change or end) when nothing reads them
        # before: every row streamed its first token already (a first token settles the routing's prefill backlog)
        streamed_first = getattr(self.host, "first_tokens_streamed", None)
        run.defer_streams = streamed_first is not None and streamed_first(run.request_ids)
        self.stepping = True
        self.num_steady_runs += 1
        run.end_seq = loop.reserve()  # the run's end runs where an end event scheduled now would
        self._arm(run)
        self.sync()
        return True

    def _arm(self, run: SteadyRun) -> None:
        """The run's next event: its end (in the order reserved when it began) once every step is priced, else
        the end of its last priced step, where it prices more (``_run_chunk_end``)."""
        loop = self.host.loop
        if run.fully_priced:
            run.timer = loop.timer_reserved(run.ends[-1], run.end_seq, self._end_run)
        else:
            run.timer = loop.timer(run.ends[-1], self._run_chunk_end)

    def _run_chunk_end(self) -> None:
        """The clock reached the run's last priced step end: price on (``_sync_books``) and arm the next event."""
        run = self._sync_books()
        assert run is not None
        self._arm(run)

    def sync(self) -> None:
        """Bring a steady run in flight forward to now: the steps ended by now are done (scheduler updated,
        tokens streamed at their times, inflation observed); the step in flight is started and scheduled."""
        run = self._sync_books()
        if run is None:
            return
        h = run.half_steps
        if h > run.done:
            run.scheduler.advance_steady(SAMPLED_TOKEN, run.done, h)
            run.done = h
        if run.ended > run.streamed:  # deferred streams (``defer_streams``)
            self.host.on_token_run(run.request_ids, run.ends[run.streamed:run.ended])  # type: ignore[attr-defined]
            run.streamed = run.ended

    def _sync_books(self) -> SteadyRun | None:
        """``sync`` but for the scheduler (left at ``run.done`` half steps; ``run.half_steps`` is where ``sync``
        would take it) and, with ``run.defer_streams``, the host's token times: the steps started and ended by
        now are accounted (busy time, utilization spans, step inflation, their tokens streamed unless deferred), as
        ``_start`` and ``end_step`` do step by step, pricing more steps when the clock passed the priced ones.
        Enough for every reader but the scheduler's state (``take_utilization``; the reports read that state
        ahead). Returns the run in flight, if any."""
        run = self._run
        if run is None:
            return None
        now = self.host.loop.now
        if now == run.synced_at:  # brought to this instant already (a report right after its utilization)
            return run
        run.synced_at = now
        ends, costs = run.ends, run.costs
        while ends[-1] <= now and len(costs) < run.length:  # passed the priced steps (not ``fully_priced``): price on
            run.price_more()
        k = len(costs)
        e = bisect_right(ends, now)  # steps ended by now
        if e > k:
            e = k
        b = e + 1 if e < k else k
        if b > run.started:  # step starts: as ``_start`` accounts each step (its span: steps from ``spans_from``)
            busy = self.busy_s
            for c in costs[run.started:b]:
                busy += c
            self.busy_s = busy
            self.steps += b - run.started
            self.step_seconds = costs[b - 1]
            run.started = b
        run.half_steps = 2 * e + 1 if e < k else 2 * k  # the step in flight scheduled, or the last one updated
        if e > run.ended:  # step ends: as ``end_step`` observes and streams each step
            inflation = self.inflation  # roles that measure step inflation (not a prefill's keeps)
            if inflation is not None:  # ``observe(rows, costs[s], ones[s])`` for each step s that ended
                inflation.observe_steps(len(run.request_ids), costs[run.ended:e], run.ones[run.ended:e])
            if not run.defer_streams:
                self.host.on_token_run(run.request_ids, ends[run.ended:e])  # type: ignore[attr-defined]
                run.streamed = e
            run.ended = e
        return run

    def _end_run(self) -> None:
        """The run's last step ended: as ``_finish`` after a step."""
        self.sync()
        self._drop_run()
        self.stepping = False
        self._between_steps_then_start()

    def _drop_run(self) -> None:
        """The run in flight is over: the spans of its steps not yet counted by a report join ``_spans`` (after the
        ones there, as ``_start`` would have appended them step by step)."""
        run = self._run
        assert run is not None
        if run.spans_from < run.started:
            ends = run.ends
            s0 = run.spans_from
            first = run.t0 if s0 == 0 else ends[s0 - 1]
            self._spans.extend(zip([first, *ends[s0:run.started - 1]], ends[s0:run.started], strict=True))
        self._run = None

    def interrupt(self) -> None:
        """Something is about to change this instance: end a steady run in flight after its current step, which
        becomes an ordinary step (its ``SchedulerOutput``, its end event), as if it had been stepped all along."""
        run = self._run
        if run is None:
            return
        self.sync()
        self._drop_run()
        assert run.timer is not None
        run.timer.cancel()
        if run.ended == len(run.costs):  # its last step ended at this very instant: the next one starts first
            self.stepping = False
            self._between_steps_then_start()
            self.interrupt()  # the step just started may itself be a run
            return
        out = run.scheduler.steady_output()
        self._adopt_step(out)
        self.host.loop.at(run.ends[run.ended], lambda: self._finish(out))

    def _adopt_step(self, out: SchedulerOutput) -> None:
        """A steady run's step in flight becomes ``out``, an ordinary step: what ``next_step`` would have noted."""

    def kick(self) -> None:
        """Start the next step once the events of this instant are handled (as the runtime's instance loop
        drains its socket before it steps), unless a step is running."""
        if not self.stepping and not self._start_pending:
            self._start_pending = True
            self.host.loop.after(0.0, self._start)

    def claim_start(self) -> bool:
        """``kick`` without its event: True when this instance needs a start (the caller must then call
        ``_start`` in an event it schedules now, in the order claimed: back-to-back kicks of several instances
        queue consecutive events of one instant, which one event running their starts in turn replaces)."""
        if self.stepping or self._start_pending:
            return False
        self._start_pending = True
        return True

    def _start(self) -> None:
        """An empty step (nothing runnable) is settled at once (it may report requests its ``schedule`` ended);
        nothing more starts until an event kicks again, or at once when it ended requests (their blocks are free:
        a request preempted for want of them resumes)."""
        self._start_pending = False
        if self.stepping:
            return
        if self.steady_runs:
            sched = self.steady_scheduler()
            if sched is not None and self._begin_run(sched):
                return
        out = self.next_step()
        if out is None:
            return
        if out.is_empty:
            self.end_step(out, synthetic_result(out))
            if out.finished_request_ids:  # it ended requests and freed their blocks: what waited for them may run
                self.kick()
            return
        segs = out.segments
        if len(segs) == 1:  # a one-row decode step costs what its cached one-row price says (the same float)
            seg = segs[0]
            if len(seg.token_ids) == 1 and seg.start > 0 and seg.sample:
                secs = self.step_seconds = self.one_row.get(seg, out.num_padding_tokens)
            else:
                secs = self.step_seconds = self.cost.step_seconds(out)
        else:
            secs = self.step_seconds = self.cost.step_seconds(out)
        self.stepping = True
        self.busy_s += secs
        now = self.host.loop.now
        self._spans.append((now, now + secs))
        self.steps += 1
        self.host.loop.after(secs, lambda: self._finish(out))

    def at_step_boundary(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` now if no step is running, else as soon as the running step ends (the runtime's instance
        handles control messages between steps: a request is never taken out of a step in flight)."""
        self.interrupt()
        if self.stepping:
            self.between_steps.append(fn)
        else:
            fn()

    def _finish(self, out: SchedulerOutput) -> None:
        self.stepping = False
        self.end_step(out, synthetic_result(out))
        self._between_steps_then_start()

    def _between_steps_then_start(self) -> None:
        """After a step: what waited for its end runs (live migration), then the next step starts."""
        pending, self.between_steps = self.between_steps, []
        for fn in pending:
            fn()
        self._start()

    def monitor_report(self, now: float, interval_s: float) -> LoadReport:
        """``report(now, take_utilization(interval_s))``: what the monitor reads of this instance each pass.

        An idle instance (``is_quiet``: nothing held, queued or waiting, no step running or since the last
        report, no step inflation observed since) reports zeros for every count, utilization 0.0 and step
        inflation 0.0, so its report is a function of its id, role, state, the clock and its pool's free blocks
        alone (``is_empty`` covers everything ``report`` counts; the pool's size and block size never change).
        The last such report is kept with its ``(state, free blocks)``; while they stay the same, the next
        report is that one restamped to ``now`` (``core.load.restamped``: equal to building it again). Invariant:
        the result equals ``report(now, take_utilization(interval_s))`` field for field, and leaves the
        instance as that would (nothing to take: no span, no inflation window)."""
        if self._run is None and self.is_quiet():  # (never quiet with a steady run in flight)
            key = (self.state, self.kv.num_free_blocks)
            if key == self._quiet_key:
                return restamped(self._quiet_report, now)  # type: ignore[arg-type]
            rep = self.report(now, self.take_utilization(interval_s))
            self._quiet_key, self._quiet_report = key, rep
            return rep
        return self.report(now, self.take_utilization(interval_s))

    def is_quiet(self) -> bool:
        """Nothing for a report to count or take: no steady run or step running, no utilization span since the
        last report, nothing observed for step inflation since, and ``is_empty``."""
        infl = self.inflation
        return (self._run is None and not self.stepping and not self._spans
                and (infl is None or infl.window_empty) and self.is_empty())

    def take_utilization(self, interval_s: float) -> float:
        """Busy fraction of the last ``interval_s`` (the report interval) before now, in [0, 1]: each step counts
        for the part of it inside the interval (a step longer than the interval keeps the instance busy in every
        report it spans, as the real instance, which cannot report mid-step, shows)."""
        if interval_s <= 0:
            return 0.0
        run = self._run
        if run is not None:
            self._sync_books()
            if run.spans_from == run.started:
                run = None  # no span of the run to count
        spans = self._spans
        if not spans and run is None:  # no step since the last report: idle (what the sum below gives)
            return min(1.0, 0.0 / interval_s)
        now = self.host.loop.now
        lo = now - interval_s
        busy = 0.0
        kept = []
        for start, end in spans:  # the same terms, added in the same order as ``sum`` over them
            part = (end if end < now else now) - (start if start > lo else lo)  # min(end, now) - max(start, lo)
            if part > 0:  # max(0.0, part): a term of 0.0 leaves the (nonnegative) sum as it is
                busy += part
            if end > now:
                kept.append((start, end))
        self._spans = kept
        if run is not None:  # then the run's steps, after ``_spans`` (``_drop_run``): the same terms in order
            ends, s0, stop = run.ends, run.spans_from, run.started
            start = run.t0 if s0 == 0 else ends[s0 - 1]
            first_kept = stop
            for s in range(s0, stop):
                end = ends[s]
                part = (end if end < now else now) - (start if start > lo else lo)
                if part > 0:
                    busy += part
                if end > now and first_kept == stop:
                    first_kept = s  # ends grow: every later step is kept too
                start = end
            run.spans_from = first_kept
        return min(1.0, busy / interval_s)


class SimPrefill(SimInstance):
    role = "prefill"

    def __init__(self, iid: str, kv: KVCacheManager, cost: CostModel, host: Host, pol: InstancePolicies) -> None:
        super().__init__(iid, kv, cost, host, pol)
        self.scheduler = PrefillScheduler(
            PrefillSchedulerConfig(policy=pol.prefill_policy, prefill_sched_batch=pol.prefill_sched_batch,
                                   chunk_size=pol.chunk_size, pad_last_chunk=pol.pad_last_chunk,
                                   max_model_len=pol.max_model_len,
                                   cache_aware_order=pol.cache_aware_prefill_order,
                                   merge_limit=pol.prefill_merge_limit, tail_tokens=pol.prefill_tail_tokens),
            kv,
        )
        self.dispatcher = Dispatcher(DispatcherConfig(policy=pol.dispatch_policy,
                                                      heavy_decode_tokens=pol.heavy_decode_tokens, seed=pol.seed,
                                                      alpha_empty=pol.dispatch_when_full),
                                     views=getattr(host, "decode_views", None))  # shared: one broadcast, one view
        self.keep_config = KeepDecodeConfig(enabled=pol.keep_decode, ratio=pol.keep_decode_ratio,
                                            rule=pol.keep_decode_rule, prompt_instance=pol.prompt_only_prefill,
                                            offer_to_keepers=pol.keep_offer)
        self.kept = DecodeScheduler(
            DecodeSchedulerConfig(policy="greedy", max_num_seqs=pol.max_num_seqs, max_model_len=pol.max_model_len,
                                  heavy_decode_tokens=pol.heavy_decode_tokens),
            kv,
        )
        self.decode_loads: list[LoadReport] = []  # the monitor's latest broadcast (+ this dispatcher's charges)
        self.prefill_ids: tuple[str, ...] = ()  # ACTIVE prefill instances, with that broadcast
        self.awaiting: deque[tuple[Request, int]] = deque()  # staged, no decode instance chosen yet
        self.staged: set[str] = set()  # KV held in staging until the decode side has it
        self.chunk_mode = pol.kv_transfer == "chunk"
        self.streams: dict[str, KVStream] = {}  # chunk-wise transfers, by request id
        self._parts: tuple[SchedulerOutput | None, SchedulerOutput | None] = (None, None)

    def add(self, req: Request) -> None:
        self.interrupt()
        self.scheduler.add_request(req)
        self.kick()

    def take_unstarted(self, limit: int) -> list[Request]:
        taken = self.scheduler.take_unstarted(limit)
        if self.streams and any(r.request_id in self.streams for r in taken):
            # preempted back to nothing computed, but dispatched already (its decode instance holds blocks for
            # it): it stays
            for req in taken:
                if req.request_id in self.streams:
                    self.scheduler.add_request(req)
            taken = [r for r in taken if r.request_id not in self.streams]
        return taken

    def is_empty(self) -> bool:
        return not (self.scheduler.has_unfinished() or self.kept.has_unfinished() or self.staged or self.streams)

    def _start(self) -> None:
        """As ``SimInstance._start``, settled at once when there is nothing to step (no prompt queued, nothing
        waiting for a decode instance, no kept decode running or suspended): then ``next_step`` finds no step
        and no steady run can begin, so the base would change nothing either (the monitor kicks every prefill
        instance at every report)."""
        if not (self.scheduler.num_queued or self.awaiting or self.kept.running or self.kept.suspended):
            self._start_pending = False
            return
        super()._start()

    def _adopt_step(self, out: SchedulerOutput) -> None:
        self._parts = (None, out)

    def steady_scheduler(self) -> DecodeScheduler | None:
        """Only kept decodes to run (no prompt queued, nothing waiting for a decode instance): their steps are the
        kept scheduler's alone."""
        return None if self.scheduler.num_queued or self.awaiting else self.kept

    def _kept_step(self) -> SchedulerOutput | None:
        if not (self.kept.running or self.kept.suspended):
            return None
        out = self.kept.schedule()
        if out.swapped_out or out.swapped_in:
            raise RuntimeError("swap preemption is not simulated; use recompute")
        return out

    def next_step(self) -> SchedulerOutput | None:
        self.retry_dispatch()
        if self.scheduler.num_queued:
            out = self.scheduler.schedule()
            if not out.is_empty:
                if self.chunk_mode:
                    self._open_streams(out, before_forward=True)
                dec = self._kept_step()
                self._parts = (out, dec)
                return merge_steps(out, dec) if dec is not None and not dec.is_empty else out
        dec = self._kept_step()
        self._parts = (None, dec)
        return dec

    def end_step(self, out: SchedulerOutput, result: StepResult) -> None:
        pre, dec = self._parts
        self._parts = (None, None)
        # with one part only, ``out`` is that part and ``result`` all its own (what ``split_result`` would give)
        if pre is not None:
            upd = self.scheduler.update(pre, result if dec is None else split_result(result, pre))
            self.host.on_tokens(upd.new_tokens, upd.finished)
            if self.streams:
                for req in upd.finished:  # ended by its first token: the decode side frees its reservation
                    stream = self.streams.pop(req.request_id, None)
                    if stream is not None:
                        self.host.cancel_stream(stream.decode_id, req.request_id)
            if self.chunk_mode:
                self._open_streams(pre)
            for req in upd.prefilled:
                self.stage(req)
            if self.streams:
                for stream in list(self.streams.values()):
                    self.pump(stream)
        if dec is not None:
            upd_d = self.kept.update(dec, result if pre is None else split_result(result, dec))
            self.host.on_tokens(upd_d.new_tokens, upd_d.finished)

    def _may_keep(self, req: Request, prefilling: bool = False) -> bool:
        """``core.keep_decode.should_keep`` for ``req`` here, now; ``prefilling``: asked while ``req`` is still
        queued here (a chunk-wise transfer about to open), which then does not count as a prompt waiting."""
        if not self.keep_config.enabled or self.state is not InstanceState.ACTIVE:
            return False
        cap = self.pol.max_model_len
        own, blocks = keep_commitment(self.keep_config, (keep_row(r, cap) for r in self.kept.requests.values()),
                                      keep_row(req, cap), self.kv.block_size)
        return should_keep(
            self.keep_config, own_running=len(self.kept.running) + len(self.kept.suspended),
            own_queued=self.scheduler.num_queued - prefilling, own_committed_blocks=own, request_blocks=blocks,
            pool_blocks=self.kv.num_blocks, decode_loads=self.decode_loads, views=self.dispatcher.views,
            instance_id=self.iid, prefill_ids=self.prefill_ids,
        )

    def _try_keep(self, req: Request) -> bool:
        if not self._may_keep(req):
            return False
        self.kept.adopt(self.scheduler.keep(req.request_id))
        self.host.on_dispatched(req.request_id, self.iid)
        return True

    def _keep_staged(self, req: Request) -> bool:
        """Decode here a staged request that waits for a decode instance with room (``dispatch_when_full`` =
        wait), when the keep rule allows it now: its KV goes back from staging into blocks of this instance
        (a local copy; its time is not modelled) instead of over a link later."""
        if not self._may_keep(req) or not self.kept.reserve(req):
            return False
        self.kept.on_kv_received(req.request_id)
        self.staged.discard(req.request_id)
        self.host.on_dispatched(req.request_id, self.iid)
        return True

    def stage(self, req: Request) -> None:
        """Keep the request here, or copy its KV out (the device blocks are freed at once) and dispatch it; a
        request with a chunk-wise transfer open sends the rest of its blocks instead."""
        stream = self.streams.get(req.request_id)
        if stream is not None:
            stream.prefilled = True
            self.pump(stream)
            return
        if self._try_keep(req):
            return
        n = self.kv.pool.blocks_for_tokens(req.num_computed_tokens)
        self.scheduler.release(req.request_id)
        self.staged.add(req.request_id)
        keepers = keep_offer_targets(self.keep_config, self.iid, self.prefill_ids)
        if keepers and self.state is InstanceState.ACTIVE:
            self.host.offer(self.iid, keepers, req, n)  # refused by all: ``refused`` dispatches it
            return
        self.dispatch(req, n)

    # ---- offers (``KeepDecodeConfig.offer_to_keepers``): the prompt-only instance -> a keeping one
    def take_offer(self, req: Request) -> bool:
        """An offer from the prompt-only prefill instance (``req``: the receiver's copy, prefilled there): keep it
        if the keep rule keeps it here now, reserving its blocks for the KV to come over the link."""
        self.interrupt()
        try:
            ok = self._may_keep(req) and self.kept.reserve(req)
        except ValueError:  # can never run here: the decode tier takes it
            ok = False
        self.kick()
        return ok

    def offered_kv_arrived(self, request_id: str) -> None:
        """An offered request's KV is in its reserved blocks: it decodes here from the next step."""
        self.interrupt()
        if request_id in self.kept.reserved:
            self.kept.on_kv_received(request_id)
        self.kick()

    def refused(self, req: Request, num_blocks: int) -> None:
        """Every keeping instance refused the offer: dispatch to the decode tier (its KV is still staged here)."""
        self.interrupt()
        self.dispatch(req, num_blocks)
        self.kick()

    def dispatch(self, req: Request, num_blocks: int) -> None:
        decision = self.dispatcher.choose(self.decode_loads, req.num_tokens, req.predicted_lower)
        if decision.instance_id is None:
            self.awaiting.append((req, num_blocks))
            return
        self.decode_loads = self.dispatcher.charge(self.decode_loads, decision.instance_id, req.num_tokens,
                                                   req.predicted_lower)  # ``charge_dispatch``, found in O(1)
        self.host.on_dispatched(req.request_id, decision.instance_id)
        self.host.handoff(self.iid, decision.instance_id, req, num_blocks)

    def retry_dispatch(self) -> None:
        for _ in range(len(self.awaiting)):
            req, n = self.awaiting.popleft()
            if not self._keep_staged(req):
                self.dispatch(req, n)

    def kv_done(self, request_id: str) -> None:
        """The decode side has the KV (or gave up on it): drop the staging copy."""
        self.staged.discard(request_id)

    # ---- chunk-wise transfer (as ``runtime.prefill_worker``: ``_open_streams``, ``_pump_stream``, KVDone)
    def _open_streams(self, out: SchedulerOutput, before_forward: bool = False) -> None:
        """Choose a decode instance for each request of this prefill step that has none yet and is still being
        prefilled (before the step's forward, or after it for those the dispatcher found no room for): the
        early handoff leaves now. With keep-decode on, a request this very step prefills is left to the
        per-request path (keep here or dispatch after its first token)."""
        requests, streams = self.scheduler.requests, self.streams
        for seg in out.segments:
            rid = seg.request_id
            req = requests.get(rid)
            if req is None or rid in streams or rid in self.staged:
                continue
            if before_forward and self.keep_config.enabled and seg.end >= req.num_tokens:
                continue
            if req.status is not RequestStatus.WAITING or req.output_token_ids:
                continue
            if self.scheduler.ends_with_first_token(req):
                continue  # nothing to decode: its first token ends it here
            if self._may_keep(req, prefilling=True):
                continue  # the keep rule would keep it now: decided again once prefilled (core.keep_decode)
            decision = self.dispatcher.choose(self.decode_loads, req.num_tokens + 1, req.predicted_lower)
            if decision.instance_id is None:
                continue
            n = self.kv.pool.blocks_for_tokens(req.num_prompt_tokens)
            self.decode_loads = self.dispatcher.charge(self.decode_loads, decision.instance_id, req.num_tokens,
                                                       req.predicted_lower)
            streams[rid] = KVStream(req, decision.instance_id, n)
            self.host.on_dispatched(rid, decision.instance_id)
            self.host.open_stream(self.iid, decision.instance_id, req, n)

    def stream_ready(self, request_id: str) -> None:
        """KVReady: the decode side reserved the blocks; what is computed so far goes out once the running step
        ends (the runtime's loop reads the reply between forwards)."""
        stream = self.streams.get(request_id)
        if stream is None:
            return

        def ready() -> None:
            if self.streams.get(request_id) is stream:
                stream.ready = True
                self.pump(stream)

        self.at_step_boundary(ready)

    def pump(self, stream: KVStream) -> None:
        """Send the stream's full blocks computed so far (all of them once prefilled); close it when all are
        sent."""
        if not stream.ready or stream.closed:
            return
        req = stream.request
        upto = (stream.num_blocks if stream.prefilled
                else min(stream.num_blocks, req.num_computed_tokens // self.kv.block_size))
        if upto > stream.sent_blocks:
            stream.last_arrival = self.host.send_kv(self.iid, stream.decode_id, upto - stream.sent_blocks)
            stream.sent_blocks = upto
        if stream.prefilled and stream.sent_blocks == stream.num_blocks:
            stream.closed = True
            self.host.close_stream(self.iid, stream.decode_id, req.request_id, stream.last_arrival)

    def stream_done(self, request_id: str) -> None:
        """KVDone: the decode side has every block; free them here."""
        if self.streams.pop(request_id, None) is not None and request_id in self.scheduler.handed_over:
            self.interrupt()
            self.scheduler.release(request_id)
            self.kick()

    def drop_stream(self, request_id: str) -> None:
        """The decode side can never run the request (it failed): drop it and whatever it holds here."""
        if self.streams.pop(request_id, None) is None:
            return
        self.interrupt()
        if request_id in self.scheduler.handed_over:
            self.scheduler.release(request_id)
        elif request_id in self.scheduler.requests:
            self.scheduler.abort(request_id)
        self.kick()

    def report(self, now: float, utilization: float) -> LoadReport:
        run = self._sync_books()
        ahead = 0 if run is None else self.kept.steady_blocks_taken(run.done, run.half_steps)  # read ahead (kept run)
        rep = self.scheduler.load_report(self.iid, now, utilization, self.state, blocks_ahead=ahead)
        return prefill_instance_report(rep, len(self.staged) + len(self.kept.running) + len(self.kept.suspended))


@dataclass
class KVStream:
    """A chunk-wise transfer in progress (``runtime.prefill_worker.KVStream``): ``ready`` once the decode side
    reserved its blocks; ``sent_blocks`` of ``num_blocks`` on the link, the last of them landing at
    ``last_arrival``; ``prefilled`` once the last chunk ran; ``closed`` once every block is sent."""

    request: Request
    decode_id: str
    num_blocks: int
    ready: bool = False
    sent_blocks: int = 0
    prefilled: bool = False
    closed: bool = False
    last_arrival: float = 0.0


@dataclass
class Handoff:
    request: Request  # the decode side's copy: prompt + first token, KV for all but the last token
    prefill_id: str
    num_blocks: int
    early: bool = False  # chunk-wise transfer: sent before prefill ends; the KV follows chunk by chunk


class SimDecode(SimInstance):
    role = "decode"

    def __init__(self, iid: str, kv: KVCacheManager, cost: CostModel, host: Host, pol: InstancePolicies) -> None:
        super().__init__(iid, kv, cost, host, pol)
        self.scheduler = DecodeScheduler(
            DecodeSchedulerConfig(policy=pol.decode_policy, max_num_seqs=pol.max_num_seqs,
                                  max_model_len=pol.max_model_len, heavy_decode_tokens=pol.heavy_decode_tokens,
                                  local_prefill_chunk=pol.chunk_size),
            kv,
        )
        self.pending: deque[Handoff] = deque()
        self.local_pending: deque[Request] = deque()  # conditional disaggregation: prefilled here
        self.receiving: set[str] = set()
        self.inflation = StepInflation()

    def steady_scheduler(self) -> DecodeScheduler | None:
        return None if self.pending or self.local_pending else self.scheduler

    def receive(self, h: Handoff) -> None:
        self.interrupt()
        self.pending.append(h)
        self.admit()
        self.kick()

    def add_local(self, req: Request) -> None:
        self.interrupt()
        self.local_pending.append(req)
        self.admit_local()
        self.kick()

    def admit(self) -> None:
        while self.pending:
            h = self.pending[0]
            rid = h.request.request_id
            try:
                ok = self.scheduler.reserve(h.request)
            except ValueError as exc:  # can never run here
                self.pending.popleft()
                self.host.on_failed(rid, str(exc))
                if h.early:
                    self.host.stream_failed(h.prefill_id, rid)
                continue
            if not ok:
                return
            self.pending.popleft()
            self.receiving.add(rid)
            if h.early:  # chunk-wise: the prefill instance sends as its chunks end
                self.host.stream_ready(h.prefill_id, rid)
            else:
                self.host.transfer(h.prefill_id, self.iid, rid, h.num_blocks, lambda rid=rid: self.kv_arrived(rid))  # type: ignore[misc]

    def kv_arrived(self, rid: str) -> None:
        self.interrupt()
        self.receiving.discard(rid)
        if rid in self.scheduler.reserved:
            self.scheduler.on_kv_received(rid)
        self.kick()

    def cancel(self, rid: str) -> None:
        """A chunk-wise transfer's request ended at its prefill instance: free what it holds or waits for here."""
        self.interrupt()
        for h in self.pending:
            if h.request.request_id == rid:
                self.pending.remove(h)
                break
        self.receiving.discard(rid)
        if rid in self.scheduler.reserved:
            self.scheduler.abort(rid)
        self.kick()

    def admit_local(self) -> None:
        while self.local_pending:
            req = self.local_pending[0]
            try:
                ok = self.scheduler.admit_local(req)
            except ValueError as exc:
                self.local_pending.popleft()
                self.host.on_failed(req.request_id, str(exc))
                continue
            if not ok:
                return
            self.local_pending.popleft()

    def is_empty(self) -> bool:
        return not (self.scheduler.has_unfinished() or self.pending or self.local_pending or self.receiving)

    def next_step(self) -> SchedulerOutput | None:
        self.admit()
        self.admit_local()
        if not (self.scheduler.running or self.scheduler.suspended):
            return None
        out = self.scheduler.schedule()
        if out.swapped_out or out.swapped_in:
            raise RuntimeError("swap preemption is not simulated; use recompute")
        return out

    def end_step(self, out: SchedulerOutput, result: StepResult) -> None:
        if out.is_decode_only:  # as the runtime's decode worker; the cost model also prices its batch-1 version
            one_s = self.one_row.get(out.segments[0], out.num_padding_tokens)  # priced once per context length
            self.inflation.observe(len(out.segments), self.step_seconds, one_s)  # type: ignore[union-attr]
        upd = self.scheduler.update(out, result)
        self.host.on_tokens(upd.new_tokens, upd.finished)
        if upd.finished and (self.pending or self.local_pending):
            self.admit()
            self.admit_local()

    def report(self, now: float, utilization: float) -> LoadReport:
        run = self._sync_books()
        pending, local = self.pending, self.local_pending
        # Nothing waits for admission (the usual case): ``decode_instance_report(rep, 0, 0, inflation, 0)`` is the
        # scheduler's report with the inflation attached, which the scheduler builds in one go.
        infl = 0.0 if pending or local else self.inflation.take()  # type: ignore[union-attr]
        if run is None:
            rep = self.scheduler.load_report(self.iid, now, utilization, self.state, step_inflation=infl)
        else:  # read ahead: the scheduler moves on at the run's next change or end (``sync``), not per report
            rep = self.scheduler.steady_load_report(self.iid, now, utilization, self.state, run.done, run.half_steps,
                                                    step_inflation=infl)
        if not (pending or local):
            return rep
        blocks = self.kv.pool.blocks_for_tokens
        waiting_blocks = (sum(blocks(h.request.num_tokens) for h in pending)
                          + sum(blocks(r.num_prompt_tokens + 1) for r in local))
        return decode_instance_report(rep, len(pending) + len(local),
                                      sum(r.num_prompt_tokens for r in local), self.inflation.take(),  # type: ignore[union-attr]
                                      waiting_blocks)


class SimColocated(SimInstance):
    role = "colocated"

    def __init__(self, iid: str, kv: KVCacheManager, cost: CostModel, host: Host, pol: InstancePolicies) -> None:
        super().__init__(iid, kv, cost, host, pol)
        self.scheduler = make_colocated_scheduler(
            pol.colocated_policy,
            ColocatedSchedulerConfig(max_num_batched_tokens=pol.max_num_batched_tokens,
                                     max_num_seqs=pol.max_num_seqs, max_model_len=pol.max_model_len),
            kv,
        )
        self.inflation = StepInflation()

    def add(self, req: Request) -> None:
        self.interrupt()
        self.scheduler.add_request(req)
        self.kick()

    def take_unstarted(self, limit: int) -> list[Request]:
        self.sync()
        return self.scheduler.take_unstarted(limit)

    def is_empty(self) -> bool:
        return not self.scheduler.has_unfinished()

    def steady_scheduler(self) -> SteadyScheduler | None:
        return self.scheduler

    def next_step(self) -> SchedulerOutput | None:
        return self.scheduler.schedule() if self.scheduler.waiting or self.scheduler.running else None

    def end_step(self, out: SchedulerOutput, result: StepResult) -> None:
        rows = decode_segments(out)
        one = self.one_row.get(rows[0]) if rows else None  # a one-row decode step, priced once per context
        self.inflation.observe_colocated(out, self.step_seconds, self.scheduler.running, one,  # type: ignore[union-attr]
                                         rows=len(rows))  # as the runtime
        upd = self.scheduler.update(out, result)
        self.host.on_tokens(upd.new_tokens, upd.finished)

    def report(self, now: float, utilization: float) -> LoadReport:
        run = self._sync_books()
        infl = self.inflation.take()  # type: ignore[union-attr]
        if run is None:
            return colocated_load_report(self.scheduler, self.iid, now, utilization, self.state, step_inflation=infl)
        # read ahead, as ``SimDecode.report``
        return self.scheduler.steady_load_report(self.iid, now, utilization, self.state, run.done, run.half_steps,
                                                 step_inflation=infl)

