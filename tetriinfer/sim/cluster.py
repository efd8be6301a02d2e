"""A simulated cluster: front end (global scheduler), monitor, instances and links on one virtual clock.

The same core code as ``tetriinfer serve`` decides everything: ``GlobalPolicy`` routes arrivals (least-loaded
prefill instance, or a decode instance under conditional disaggregation) from the monitor's latest load
reports; the monitor builds every instance's ``LoadReport`` each ``report_interval_s``, runs ``FlipPolicy``
(drain, then switch role in place) and ``ScalePolicy`` (``--autoscale``: add an instance after ``scale_out_s``;
remove one by draining it, as the runtime's drain-then-retire), and broadcasts decode loads to the prefill
instances' dispatchers. What is simulated: step times (a ``CostModel``), KV transfers (``Links``: per request
after prefill, or chunk-wise while later chunks prefill), role-switch and instance-start times, and the model's
tokens.

Request lifecycle and invariants: every request of the workload ends in exactly one terminal state
(finished, or failed with a reason; rejected ones -- too long for the model -- are never sent); at the end
every instance's KV pool is whole again. A run that stops making progress raises ``SimulationStuck``
instead of returning partial numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import random
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tetriinfer.bench.metrics import RequestRecord
from tetriinfer.bench.workloads import Workload, WorkloadRequest
from tetriinfer.core.dispatcher import DecodeViews
from tetriinfer.core.flip_policy import FlipAction
from tetriinfer.core.frozen import python_class
from tetriinfer.core.global_policy import GlobalPolicy, LocalPrefillConfig, Phase
from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.load import InstanceState, LoadReport, Role, accepting
from tetriinfer.core.migration import MIGRATION_ROLES, MigrateCommand, MigrationPlanner, pick_migrants
from tetriinfer.core.pd_controller import PDController
from tetriinfer.core.rebalance import Rebalancer
from tetriinfer.core.request import Request, RequestStatus
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.core.scale_policy import ScaleAction, ScaleCommand, ScalePolicy
from tetriinfer.runtime.cluster_config import ClusterConfig
from tetriinfer.sim.cost_model import CostModel
from tetriinfer.sim.events import EventLoop
from tetriinfer.sim.instances import (
    SAMPLED_TOKEN,
    Handoff,
    InstancePolicies,
    OneRowCosts,
    SimColocated,
    SimDecode,
    SimInstance,
    SimPrefill,
)
from tetriinfer.sim.link import Links

PREDICTION_GRANULARITY = 200  # the paper's bucket width (runtime/predictor_hook.py)


@python_class  # an exception: a builtin base
class SimulationStuck(RuntimeError):
    """Requests are unfinished but no event is left to run (a scheduling deadlock)."""


@dataclass(frozen=True)
class SimConfig:
    """``cluster``: mode, instance counts and policies, exactly as ``tetriinfer serve`` takes them.

    ``num_kv_blocks``: KV blocks per instance; ``kv_bytes_per_token``: bytes a transfer moves per token;
    ``predictor_accuracy``: with ``cluster.predictor == "oracle"``, the share of requests whose predicted
    bucket is the true one (the rest land one bucket off, either way); ``switch_s``: a role flip's switch time
    once the instance is empty; ``max_concurrency``: closed loop (a request is sent when one of at most this
    many in flight finishes) instead of the workload's arrival times."""

    cluster: ClusterConfig
    num_kv_blocks: int
    kv_bytes_per_token: int
    max_model_len: int
    link_bandwidth: str | float = "200Gbps"
    link_latency: str | float = 0.0
    predictor_accuracy: float = 1.0
    switch_s: float = 0.01
    frontend_delay_s: float = 0.0  # arrival -> routed: HTTP, tokenization, messaging in the real front end
    scale_out_s: float = 5.0  # --autoscale: decision -> a new instance takes work (process start + weights load)
    max_concurrency: int | None = None
    max_sim_s: float = 7 * 24 * 3600.0
    steady_runs: bool = True  # price steady decode runs at once (sim.instances.SteadyRun); False: every step an
    # event (the same numbers, slower; for checking)

    def __post_init__(self) -> None:
        if self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_bytes_per_token < 1:
            raise ValueError(f"kv_bytes_per_token must be >= 1, got {self.kv_bytes_per_token}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0.0 <= self.predictor_accuracy <= 1.0:
            raise ValueError(f"predictor_accuracy must be in [0, 1], got {self.predictor_accuracy}")
        if self.scale_out_s < 0:
            raise ValueError(f"scale_out_s must be >= 0, got {self.scale_out_s}")
        if self.switch_s < 0 or self.frontend_delay_s < 0:
            raise ValueError(f"switch_s and frontend_delay_s must be >= 0, got {self.switch_s}, {self.frontend_delay_s}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        c = self.cluster
        if c.role_policies().predictor not in ("none", "oracle"):
            raise ValueError("a trained predictor is not simulated: use '--predictor oracle' with --predictor-accuracy "
                             "(its measured bucket accuracy)")
        if c.fault_drop_p or c.fault_delay_p or c.fault_corrupt_p:
            raise ValueError("fault injection is not simulated")

    def policies(self, index: int) -> InstancePolicies:
        c = self.cluster
        pol = c.role_policies()
        return InstancePolicies(
            prefill_policy=pol.prefill_policy, prefill_sched_batch=c.prefill_sched_batch, chunk_size=c.chunk_size,
            cache_aware_prefill_order=c.cache_aware_prefill_order, prefill_merge_limit=c.prefill_merge_limit,
            prefill_tail_tokens=c.prefill_tail_tokens, pad_last_chunk=c.pad_last_chunk, dispatch_policy=pol.dispatch_policy, decode_policy=pol.decode_policy,
            colocated_policy=pol.colocated_policy, max_num_batched_tokens=pol.max_num_batched_tokens,
            max_num_seqs=c.max_num_seqs, max_model_len=self.max_model_len, heavy_decode_tokens=c.heavy_decode_tokens,
            keep_decode=pol.keep_decode, keep_decode_ratio=c.keep_decode_ratio, keep_decode_rule=c.keep_decode_rule,
            prompt_only_prefill=c.prompt_only_prefill, keep_offer=c.keep_offer, dispatch_when_full=c.dispatch_when_full,
            kv_transfer=c.kv_transfer, seed=c.seed + index,
        )


@dataclass
class SimResult:
    records: list[RequestRecord]
    busy_s: dict[str, float]  # per instance: seconds spent in steps
    steps: dict[str, int]
    duration_s: float
    local_prefills: int = 0
    kept_decodes: int = 0
    flips: list[dict[str, Any]] = field(default_factory=list)
    transfer_bytes: int = 0
    events: int = 0
    alive_s: dict[str, float] = field(default_factory=dict)  # per instance: seconds provisioned (start to retire)
    scaling: list[dict[str, Any]] = field(default_factory=list)
    migrated: int = 0  # requests handed back unstarted and routed again (--rebalance)
    migration: dict[str, Any] = field(default_factory=dict)  # live migration of running decodes (--migrate)
    preemptions: int = 0  # running decodes preempted (recompute) anywhere: decode, colocated, kept at prefill
    prefix_hit_tokens: int = 0  # prompt tokens found in a prefix cache (--enable-prefix-caching), all instances
    prefix_queried_tokens: int = 0  # prompt tokens looked up there
    split: list[tuple[float, int, int]] = field(default_factory=list)  # (time, prefill, decode) at each change

    @property
    def resource_s(self) -> float:
        return sum(self.busy_s.values())

    @property
    def instance_s(self) -> float:
        """Instance-seconds provisioned until the last request ended (what a fixed pool pays for whether busy or
        not; what autoscaling saves)."""
        return sum(self.alive_s.values())


@dataclass
class _Tracked:
    wreq: WorkloadRequest
    record: RequestRecord
    prompt_token_ids: list[int] | None = None  # made once, at arrival


class _ArrivalFeed:
    """A workload's arrivals, put on the event loop one at a time: each enters the heap when the one before it
    runs, at the place in the event order it reserved when the run began. So the events run in exactly the order
    they would if every arrival were scheduled at the start (the next arrival is always in the heap before any
    event it precedes could run), while the heap holds what is in flight rather than the whole workload (a million
    pending arrivals made every push and pop of a run slower, and each held a callback)."""

    def __init__(self, loop: EventLoop, arrivals: list[tuple[float, int, str]], arrive: Callable[[str], None]) -> None:
        arrivals.sort()  # by (when, place): the order the loop runs them in (places are unique)
        self._arrivals = arrivals
        self._next = 0
        self._loop = loop
        self._arrive = arrive

    def start(self) -> None:
        if self._arrivals:
            when, place, _ = self._arrivals[0]
            self._loop.at_reserved(when, place, self)

    def __call__(self) -> None:
        arrivals, i = self._arrivals, self._next
        self._next = i + 1
        if i + 1 < len(arrivals):
            when, place, _ = arrivals[i + 1]
            self._loop.at_reserved(when, place, self)
        self._arrive(arrivals[i][2])


class SimCluster:
    """One simulated run of one workload on one cluster layout. ``run()`` once."""

    def __init__(self, config: SimConfig, cost: CostModel) -> None:
        self.config = config
        self.cost = cost
        c = config.cluster
        self.loop = EventLoop()
        self.steady_runs = config.steady_runs  # read by every instance made (``SimInstance.steady_runs``)
        self.links = Links(config.link_bandwidth, config.link_latency)
        self._oracle = c.role_policies().predictor == "oracle"  # length predictions (read per request)
        self.policy = GlobalPolicy(LocalPrefillConfig(enabled=c.local_prefill and c.disaggregated,
                                                      interference_weight=c.local_prefill_weight),
                                   c.prefix_affinity())
        self.flips = PDController(c.pd_controller_config())  # the monitor's P:D controller (core.pd_controller)
        self.scale = ScalePolicy(c.scale_config())
        self.rebalancer = Rebalancer(c.rebalance_config())
        self.num_migrated = 0
        self.migration = MigrationPlanner(c.migration_config())
        self.migration_log: dict[str, Any] = {"moves": 0, "moved": 0, "returned": 0, "bytes": 0,
                                              "moved_by_reason": {}}
        self.decode_views = DecodeViews()  # what prefill instances' dispatchers derive from each decode broadcast
        self.one_row_costs = OneRowCosts(cost)  # one-row decode step prices, shared by every instance
        self.instances: dict[str, SimInstance] = {}
        self._next_id: dict[str, int] = {}
        self._started_at: dict[str, float] = {}
        self._retiring: set[str] = set()
        self._retired: dict[str, SimInstance] = {}  # removed by scale-in: kept for busy-time accounting
        self._alive_s: dict[str, float] = {}
        self._inbound: dict[str, int] = {}  # handoffs on the wire to each decode instance (it cannot retire then)
        self.scale_log: list[dict[str, Any]] = []
        for role in c.roles():
            self._add(role, at=0.0)
        self.loads: list[LoadReport] = []
        self._rng = random.Random(c.seed)
        self._tracked: dict[str, _Tracked] = {}
        self._records: dict[str, Any] = {}  # RequestRecord, its token times in arrays; request id -> its record (the same as in ``_tracked``)
        self._unrouted: deque[str] = deque()
        self._backlog: deque[str] = deque()  # closed loop: not yet sent
        self._in_flight = 0
        self._open = 0  # sent and not terminal
        self._ended: set[str] = set()
        self.num_kept = 0
        self._num_prompts = 0
        self.flip_log: list[dict[str, Any]] = []

    # ---- construction -------------------------------------------------------------------
    def _make(self, role: str, iid: str, index: int, kv: KVCacheManager | None = None) -> SimInstance:
        """An instance of ``role``; ``kv``: the pool it keeps (a role switch, as the runtime's in-place switch
        keeps its KV manager: cached prefixes and hit counts survive), else a fresh one."""
        if kv is None:
            kv = KVCacheManager(self.config.num_kv_blocks, self.config.cluster.block_size,
                                enable_prefix_caching=self.config.cluster.enable_prefix_caching)
        cls = {"prefill": SimPrefill, "decode": SimDecode, "colocated": SimColocated}[role]
        return cls(iid, kv, self.cost, self, self.config.policies(index))

    def _add(self, role: str, at: float) -> SimInstance:
        """A new instance of ``role`` (ids as the runtime gives them: never reused), provisioned from ``at``."""
        n = self._next_id.get(role, 0)
        self._next_id[role] = n + 1
        iid = f"{'instance' if role == 'colocated' else role}-{n}"
        inst = self._make(role, iid, len(self._started_at))
        self.instances[iid] = inst
        self._started_at[iid] = at
        return inst

    def _active_roles(self) -> dict[str, str]:
        """Instance id -> role of every instance not being retired (what the scaling and rebalancing rules see)."""
        return {iid: inst.role for iid, inst in self.instances.items() if iid not in self._retiring}

    # ---- running --------------------------------------------------------------------------
    def run(self, workload: Workload) -> SimResult:
        cfg = self.config
        arrivals: list[tuple[float, int, str]] = []  # (when, place in the event order, request id)
        for wreq in workload.requests:
            # token times as packed doubles (8 bytes a token, not a list of float objects: a million requests'
            # records fit in memory); they read, compare and serialize (to_dict) as the lists the client fills
            rec = RequestRecord(wreq.request_id, wreq.prompt_tokens, wreq.output_tokens, wreq.arrival_s,
                                chunk_times_s=array("d"), chunk_tokens=array("b"))  # type: ignore[arg-type]
            self._tracked[wreq.request_id] = _Tracked(wreq, rec)
            self._records[wreq.request_id] = rec
            if wreq.rejected:
                rec.rejected, rec.error = True, wreq.reject_reason or "rejected"
                continue
            if cfg.max_concurrency is not None:
                self._backlog.append(wreq.request_id)
            else:
                arrivals.append((wreq.arrival_s, self.loop.reserve(), wreq.request_id))
            self._open += 1
        _ArrivalFeed(self.loop, arrivals, self._arrive).start()
        self._monitor()  # the first reports exist before anything is routed
        if cfg.max_concurrency is not None:
            self._fill_closed_loop()
        # The event loop allocates millions of short-lived acyclic objects (steps, reports, results) next to a
        # heap that only grows (records): the cyclic collector's full passes over it cost about a quarter of the
        # run at 1,000 instances and find little. It is off while the loop runs (reference counting still frees
        # everything acyclic at once) and back as it was afterwards; nothing simulated depends on it.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            self.loop.run(until=cfg.max_sim_s)
        finally:
            if gc_was_enabled:
                gc.enable()
        if self._open:
            raise SimulationStuck(
                f"{self._open} requests unfinished at t={self.loop.now:.3f}s with no event left "
                f"(instances: {', '.join(f'{i.iid}: {type(i).__name__}' for i in self.instances.values())})")
        for inst in self.instances.values():
            if inst.kv.num_free_blocks != inst.kv.num_blocks:
                raise AssertionError(f"{inst.iid} still holds {inst.kv.num_used_blocks} KV blocks after the run")
        records = [t.record for t in self._tracked.values()]
        ends = [r.finish_s for r in records if r.finish_s is not None]
        duration = max(ends) if ends else 0.0
        everyone = {**self._retired, **self.instances}
        alive = dict(self._alive_s)
        for iid in self.instances:
            alive[iid] = max(0.0, duration - self._started_at[iid])
        return SimResult(
            records=records, busy_s={i.iid: i.busy_s for i in everyone.values()},
            steps={i.iid: i.steps for i in everyone.values()}, duration_s=duration,
            local_prefills=self.policy.num_local_prefills, kept_decodes=self.num_kept, flips=self.flip_log,
            transfer_bytes=self.links.bytes_sent, events=self.loop.num_events, alive_s=alive,
            scaling=self.scale_log, migrated=self.num_migrated, migration=dict(self.migration_log),
            preemptions=sum(i.scheduler.num_preemptions for i in everyone.values()
                            if isinstance(i, SimDecode | SimColocated))
            + sum(i.kept.num_preemptions for i in everyone.values() if isinstance(i, SimPrefill)),
            prefix_hit_tokens=sum(i.kv.prefix_cache_stats()["prefix_cache_hit_tokens"] for i in everyone.values()),
            prefix_queried_tokens=sum(i.kv.prefix_cache_stats()["prefix_cache_queried_tokens"]
                                      for i in everyone.values()),
            split=list(self.flips.timeline),
        )

    def _fill_closed_loop(self) -> None:
        limit = self.config.max_concurrency or 0
        while self._backlog and self._in_flight < limit:
            self._arrive(self._backlog.popleft(), closed_loop=True)

    # ---- front end ------------------------------------------------------------------------
    def _prompt_token_ids(self, wreq: WorkloadRequest) -> list[int]:
        """Stand-in prompt tokens (no model runs here). Without prefix caching every prompt is the same token;
        with it, a trace's hash blocks (``WorkloadRequest.prefix_blocks``) become the same tokens wherever the
        same id appears, and everything else is this request's alone, so only the trace's sharing is found."""
        n = wreq.prompt_tokens
        if not self.config.cluster.enable_prefix_caching:
            return [SAMPLED_TOKEN + 1] * n
        bt = wreq.prefix_block_tokens
        ids = [SAMPLED_TOKEN + 2 + h * bt + j for h in wreq.prefix_blocks[: -(-n // bt) if bt else 0]
               for j in range(bt)][:n]
        self._num_prompts += 1
        return ids + [-self._num_prompts] * (n - len(ids))

    def _new_request(self, wreq: WorkloadRequest, now: float) -> Request:
        t = self._tracked[wreq.request_id]
        if t.prompt_token_ids is None:
            t.prompt_token_ids = self._prompt_token_ids(wreq)
        req = Request(
            request_id=wreq.request_id, prompt_token_ids=t.prompt_token_ids,
            sampling_params=SamplingParams(max_tokens=wreq.output_tokens, temperature=0.0, ignore_eos=True),
            arrival_time=now, eos_token_id=None,
        )
        if self._oracle:
            g = PREDICTION_GRANULARITY
            bucket = wreq.output_tokens // g
            if self._rng.random() >= self.config.predictor_accuracy:
                bucket = max(0, bucket + self._rng.choice((-1, 1)))
            req.predicted_bucket, req.predicted_lower, req.predicted_upper = bucket, bucket * g, (bucket + 1) * g
        return req

    def _arrive(self, rid: str, closed_loop: bool = False) -> None:
        now = self.loop.now
        t = self._tracked[rid]
        if closed_loop:
            t.record.arrival_s = now
        t.record.send_s = now
        self._in_flight += 1
        if t.prompt_token_ids is None:
            t.prompt_token_ids = self._prompt_token_ids(t.wreq)
        self.policy.add(rid, now, t.wreq.prompt_tokens, prompt_token_ids=t.prompt_token_ids)
        if self.config.frontend_delay_s > 0:
            self.loop.after(self.config.frontend_delay_s, lambda: self._enqueue(rid))
        else:
            self._enqueue(rid)

    def _enqueue(self, rid: str) -> None:
        self._unrouted.append(rid)
        self._route_pending()

    def _route_pending(self) -> None:
        now = self.loop.now
        for _ in range(len(self._unrouted)):
            rid = self._unrouted.popleft()
            target = self.policy.route(rid, self.loads, now)
            if target is None:
                self._unrouted.append(rid)
                continue
            t = self._tracked[rid]
            inst = self.instances[target]
            try:
                self._admit(inst, self._new_request(t.wreq, now))  # ValueError: e.g. max_tokens 0, as a server
            except ValueError as exc:
                self.on_failed(rid, str(exc))

    @staticmethod
    def _admit(inst: SimInstance, req: Request) -> None:
        if isinstance(inst, SimDecode):
            inst.add_local(req)  # conditional disaggregation: prefilled where it decodes
        elif isinstance(inst, SimPrefill | SimColocated):
            inst.add(req)
        else:  # pragma: no cover - roles are closed
            raise AssertionError(type(inst))

    # ---- Host: called by instances ----------------------------------------------------------
    def on_tokens(self, new_tokens: dict[str, int], finished: tuple[Request, ...]) -> None:
        now = self.loop.now
        records, streamed = self._records, self.policy.on_tokens
        for rid in new_tokens:
            rec = records[rid]
            if rec.first_token_s is None:
                rec.first_token_s = now
            rec.chunk_times_s.append(now)
            rec.chunk_tokens.append(1)
            rec.output_tokens += 1
            streamed(rid, 1, now)
        for req in finished:  # ended by length (max_tokens, or the model's context): delivered, complete
            if req.status is not RequestStatus.FINISHED_ABORTED:
                self._end(req.request_id, success=True, reason=None)

    def on_token_run(self, request_ids: list[str], times: list[float]) -> None:
        """``on_tokens`` for a steady decode run: each request streamed one token at each of ``times`` (none
        finishes within a run; each has streamed its first token before)."""
        n = len(times)
        if not n:
            return
        records, streamed, last = self._records, self.policy.on_tokens, times[-1]
        ones = array("b", bytes([1])) * n
        for rid in request_ids:
            rec = records[rid]
            if rec.first_token_s is None:  # not so in a run; what ``on_tokens`` token by token would leave
                rec.first_token_s = times[0]
                streamed(rid, 1, times[0])
                if n > 1:
                    streamed(rid, n - 1, last)
            else:
                streamed(rid, n, last)
            rec.chunk_times_s.extend(times)
            rec.chunk_tokens.extend(ones)
            rec.output_tokens += n

    def first_tokens_streamed(self, request_ids: list[str]) -> bool:
        """Every one of these requests has streamed its first token (its TTFT is known; what it streams next is
        read only once it ends: the records, the global policy's token counts)."""
        records = self._records
        return all(records[rid].first_token_s is not None for rid in request_ids)

    def on_failed(self, request_id: str, reason: str) -> None:
        self._end(request_id, success=False, reason=reason)

    def on_dispatched(self, request_id: str, decode_id: str) -> None:
        self.policy.on_dispatched(request_id, decode_id)
        if isinstance(self.instances.get(decode_id), SimPrefill):
            self.num_kept += 1

    @staticmethod
    def _receiver_copy(req: Request, early: bool = False) -> Request:
        """What the receiving instance builds from a handoff: prompt + outputs so far, all but the last computed.
        ``early`` (chunk-wise transfer): sent before the first token exists; a placeholder first token sizes the
        reservation (as ``runtime.kv_receiver.request_from_handoff``; here it is the token every step samples)."""
        copy = Request(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, sampling_params=req.sampling_params,
            arrival_time=req.arrival_time, eos_token_id=req.eos_token_id,
            output_token_ids=[SAMPLED_TOKEN] if early else list(req.output_token_ids),
            predicted_bucket=req.predicted_bucket, predicted_lower=req.predicted_lower,
            predicted_upper=req.predicted_upper,
        )
        copy.num_computed_tokens = copy.num_tokens - 1
        return copy

    def handoff(self, prefill_id: str, decode_id: str, req: Request, num_blocks: int) -> None:
        copy = self._receiver_copy(req)

        self._inbound[decode_id] = self._inbound.get(decode_id, 0) + 1

        def deliver() -> None:
            self._inbound[decode_id] -= 1
            dst = self.instances[decode_id]
            if not isinstance(dst, SimDecode):  # flipped meanwhile (cannot happen: it drains first)
                self.on_failed(req.request_id, f"{decode_id} is no longer a decode instance")
                self._kv_done(prefill_id, req.request_id)
                return
            dst.receive(Handoff(copy, prefill_id, num_blocks))

        self.loop.at(self.links.message(self.loop.now), deliver)

    def offer(self, prefill_id: str, keepers: tuple[str, ...], req: Request, num_blocks: int) -> None:
        """The prompt-only prefill instance offers a request it prefilled to the keeping ones (``keepers``, in
        order; ``core.keep_decode.keep_offer_targets``): each, when the offer reaches it, keeps it by its own rule
        (then the KV crosses the link as to a decode instance) or passes it on; refused by all, it goes back and is
        dispatched to the decode tier. One control message per hop."""
        copy = self._receiver_copy(req)
        rid = req.request_id

        def arrive(i: int) -> None:
            dst = self.instances.get(keepers[i])
            if isinstance(dst, SimPrefill) and dst.take_offer(copy):
                self.on_dispatched(rid, dst.iid)
                self.transfer(prefill_id, dst.iid, rid, num_blocks, lambda: dst.offered_kv_arrived(rid))
            elif i + 1 < len(keepers):
                self.loop.at(self.links.message(self.loop.now), lambda: arrive(i + 1))
            else:
                self.loop.at(self.links.message(self.loop.now), back)

        def back() -> None:
            src = self.instances.get(prefill_id)
            if isinstance(src, SimPrefill):
                src.refused(req, num_blocks)
            else:  # cannot happen: an instance drains (its staged KV included) before it leaves
                self.on_failed(rid, f"{prefill_id} left with the request's KV")

        self.loop.at(self.links.message(self.loop.now), lambda: arrive(0))

    def transfer(self, prefill_id: str, decode_id: str, request_id: str, num_blocks: int,
                 done: Callable[[], None]) -> None:
        arrive = self.send_kv(prefill_id, decode_id, num_blocks)

        def finish() -> None:
            self._kv_done(prefill_id, request_id)
            done()

        self.loop.at(arrive, finish)

    def send_kv(self, prefill_id: str, decode_id: str, num_blocks: int) -> float:
        """Put ``num_blocks`` KV blocks on the ``prefill_id -> decode_id`` link now; returns when they have landed."""
        nbytes = num_blocks * self.config.cluster.block_size * self.config.kv_bytes_per_token
        return self.links.send(prefill_id, decode_id, nbytes, self.loop.now)

    # chunk-wise transfer (``--kv-transfer chunk``; ``runtime.prefill_worker.KVStream``): the early handoff (prompt
    # only) reaches the decode instance a message later, which reserves blocks for it (FIFO, as any handoff) and
    # posts them (KVReady, a message back); the prefill instance then sends each finished chunk's full blocks as
    # the chunk ends (``SimPrefill.pump``) and, once prefilled, the rest; the request decodes when its last bytes
    # and its first token (PrefillDone) are in; the decode side's KVDone, a message later, frees the prefill
    # instance's blocks (held until then: no staging copy).
    def open_stream(self, prefill_id: str, decode_id: str, req: Request, num_blocks: int) -> None:
        copy = self._receiver_copy(req, early=True)
        rid = req.request_id
        self._inbound[decode_id] = self._inbound.get(decode_id, 0) + 1

        def deliver() -> None:
            self._inbound[decode_id] -= 1
            dst = self.instances[decode_id]
            if not isinstance(dst, SimDecode):  # flipped meanwhile (cannot happen: it drains first)
                self.on_failed(rid, f"{decode_id} is no longer a decode instance")
                self.stream_failed(prefill_id, rid)
                return
            dst.receive(Handoff(copy, prefill_id, num_blocks, early=True))

        self.loop.at(self.links.message(self.loop.now), deliver)

    def _tell(self, iid: str, kind: type[SimInstance], call: Callable[[Any], None]) -> None:
        """A control message to instance ``iid``: ``call(instance)`` a message latency from now, if it is still a
        ``kind`` then."""
        def deliver() -> None:
            inst = self.instances.get(iid)
            if isinstance(inst, kind):
                call(inst)

        self.loop.at(self.links.message(self.loop.now), deliver)

    def stream_ready(self, prefill_id: str, request_id: str) -> None:
        """KVReady: the decode side reserved the stream's blocks."""
        self._tell(prefill_id, SimPrefill, lambda src: src.stream_ready(request_id))

    def close_stream(self, prefill_id: str, decode_id: str, request_id: str, last_arrival: float) -> None:
        """Prefilled and every block sent: the decode side has the request once the last bytes (``last_arrival``)
        and the first token (PrefillDone, sent now) are in; its KVDone reaches the prefill instance a message
        later."""
        def landed() -> None:
            dst = self.instances.get(decode_id)
            if isinstance(dst, SimDecode):
                dst.kv_arrived(request_id)
            self._tell(prefill_id, SimPrefill, lambda src: src.stream_done(request_id))

        self.loop.at(max(last_arrival, self.links.message(self.loop.now)), landed)

    def cancel_stream(self, decode_id: str, request_id: str) -> None:
        """The request ended at the prefill instance (by its first token): the decode side frees its reservation
        (the runtime's Abort to the stream's decode instance)."""
        self._tell(decode_id, SimDecode, lambda dst: dst.cancel(request_id))

    def stream_failed(self, prefill_id: str, request_id: str) -> None:
        """The decode side refused the stream's request for good (it can never run there; the request failed):
        the prefill instance drops it and frees what it holds."""
        self._tell(prefill_id, SimPrefill, lambda src: src.drop_stream(request_id))

    def _kv_done(self, prefill_id: str, request_id: str) -> None:
        src = self.instances.get(prefill_id)
        if isinstance(src, SimPrefill):
            src.kv_done(request_id)

    # ---- terminal bookkeeping -------------------------------------------------------------
    def _end(self, rid: str, success: bool, reason: str | None) -> None:
        if rid in self._ended:
            raise AssertionError(f"request {rid!r} ended twice")
        self._ended.add(rid)
        now = self.loop.now
        tracked = self._tracked[rid]
        tracked.prompt_token_ids = None  # never needed again: only requests in flight hold stand-in prompts
        rec = tracked.record
        rec.finish_s = now
        rec.success = success and rec.output_tokens >= 1
        rec.error = reason
        phase = Phase.FINISHED if rec.success else Phase.FAILED
        self.policy.on_terminal(rid, phase, now, reason)
        self._open -= 1
        self._in_flight -= 1
        if self.config.max_concurrency is not None:
            self._fill_closed_loop()

    # ---- monitor ------------------------------------------------------------------------------
    def _monitor(self) -> None:
        c = self.config.cluster
        now = self.loop.now
        self._retire_drained(now)
        interval = c.report_interval_s
        reports = [inst.monitor_report(now, interval) for inst in self.instances.values()]
        retiring = self._retiring
        if c.disaggregated:
            observed = [r for r in reports if r.instance_id not in retiring] if retiring else reports
            for cmd in self.flips.observe(observed, now):
                inst = self.instances[cmd.instance_id]
                if cmd.action is FlipAction.DRAIN:
                    inst.state = self.flips.state(inst.iid)
                else:
                    self._switch(inst, cmd.to_role)
            reports = self.flips.annotate(reports)
            states, active = self.flips.states, InstanceState.ACTIVE  # ``flips.state(iid)``, looked up
            for iid, inst in self.instances.items():
                inst.state = states.get(iid, active)
        if retiring:
            for iid in retiring:  # scale-in: not routed or dispatched to, whatever the flip policy thinks
                self.instances[iid].state = InstanceState.DRAINING
            reports = [r if r.instance_id not in retiring else
                       dataclasses.replace(r, state=InstanceState.DRAINING) for r in reports]
        if c.autoscale:
            for scale_cmd in self.scale.observe(reports, self._active_roles(), now):
                self._scale(scale_cmd, now)
        self.loads = reports
        if c.rebalance:  # after scaling: an instance it just started draining gives nothing and takes nothing
            for move in self.rebalancer.plan(reports, self._active_roles()):
                self._move(move.donor, move.count, now)
        if c.migrate:  # live migration: evacuate leaving instances, balance the rest (as the runtime's monitor)
            roles = {iid: inst.role for iid, inst in self.instances.items()}
            evacuate = {r.instance_id for r in reports if r.state is not InstanceState.ACTIVE
                        and roles.get(r.instance_id) in MIGRATION_ROLES}
            for mig in self.migration.plan(reports, roles, evacuate):
                self.instances[mig.source].at_step_boundary(lambda mig=mig: self._migrate(mig))  # type: ignore[misc]
        decode_loads = [r for r in reports if r.role is Role.DECODE]
        prefill_ids = tuple(r.instance_id for r in accepting(reports, Role.PREFILL))
        kicked: list[SimInstance] = []
        for inst in self.instances.values():
            if isinstance(inst, SimPrefill):
                inst.decode_loads = decode_loads  # shared: a dispatcher's charges make it a new list, never mutate
                inst.prefill_ids = prefill_ids
                if inst.claim_start():  # kicked: dispatches waiting for a decode instance retry on fresh loads
                    kicked.append(inst)
        if kicked:  # one event for the back-to-back start events the kicks would queue (nothing runs between them)
            self.loop.after(0.0, lambda: self._start_kicked(kicked))
        self._route_pending()
        if self._open:
            self.loop.after(c.report_interval_s, self._monitor)

    @staticmethod
    def _start_kicked(kicked: list[SimInstance]) -> None:
        """The starts of instances the monitor kicked (``SimInstance.claim_start``), in the order kicked."""
        for inst in kicked:
            inst._start()

    def _move(self, donor: str, count: int, now: float) -> None:
        """Queue rebalancing, as the runtime does it (its Yield / Yielded round trip taken as instant): the donor
        hands back up to ``count`` unstarted requests; each is routed again with the donor avoided (back to the
        donor only if nothing else accepts it now)."""
        taken = self.instances[donor].take_unstarted(count)
        self.rebalancer.done(donor)
        others = [r for r in self.loads if r.instance_id != donor]
        for req in taken:
            self.policy.reroute(req.request_id)
            target = self.policy.route(req.request_id, others, now) or self.policy.route(req.request_id, self.loads, now)
            if target is None:
                raise AssertionError(f"{req.request_id}: its donor {donor} accepted it a moment ago")
            self.num_migrated += target != donor
            self._admit(self.instances[target], req)

    def _migrate(self, cmd: MigrateCommand) -> None:
        """Live migration, as the runtime does it (``runtime.emigration`` / ``immigration``), between two steps of
        the source: its picked decodes leave the batch (blocks held); each handoff reaches the target after a
        message latency, which admits it at once (blocks for its context) or refuses (back into the source's
        batch); the KV crosses the link; the target runs it from its next step and its KVDone, a message later,
        frees the source's blocks. The planner hears once every picked request is settled."""
        src = self.instances.get(cmd.source)
        if src is None or not isinstance(src, SimDecode | SimColocated):
            self.migration.done(cmd.source)
            return
        picked = iter(pick_migrants(src.scheduler.running, cmd.count))
        unsettled: set[str] = set()
        log = self.migration_log
        log["moves"] += 1

        def settled(rid: str, moved: bool) -> None:
            unsettled.discard(rid)
            log["moved" if moved else "returned"] += 1
            if moved:
                log["moved_by_reason"][cmd.reason] = log["moved_by_reason"].get(cmd.reason, 0) + 1
            if not unsettled:
                self.migration.done(cmd.source)

        for target, count in cmd.targets:
            for req in [r for _, r in zip(range(count), picked, strict=False)]:
                src.scheduler.detach(req.request_id)
                unsettled.add(req.request_id)
                self._send_migrant(src, target, req, settled)
        if not unsettled:
            self.migration.done(cmd.source)

    def _send_migrant(self, src: SimDecode | SimColocated, target: str, req: Request,
                      settled: Callable[[str, bool], None]) -> None:
        rid = req.request_id
        num_blocks = src.kv.pool.blocks_for_tokens(req.num_computed_tokens)
        self._inbound[target] = self._inbound.get(target, 0) + 1

        def back_to_source() -> None:
            src.interrupt()
            src.scheduler.reattach(rid)
            src.kick()
            settled(rid, False)

        def kv_done() -> None:
            src.interrupt()
            src.scheduler.release_migrated(rid)
            src.kick()
            settled(rid, True)

        def arrive() -> None:
            self._inbound[target] -= 1
            dst = self.instances.get(target)
            if dst is not None:
                dst.interrupt()
            try:
                ok = (isinstance(dst, SimDecode | SimColocated) and dst.state is InstanceState.ACTIVE
                      and dst.scheduler.admit_migrant(self._receiver_copy(req)))
            except ValueError:
                ok = False
            if not ok:
                self.loop.at(self.links.message(self.loop.now), back_to_source)
                return
            assert isinstance(dst, SimDecode | SimColocated)
            nbytes = num_blocks * self.config.cluster.block_size * self.config.kv_bytes_per_token
            self.migration_log["bytes"] += nbytes

            def kv_in() -> None:
                dst.interrupt()
                dst.scheduler.on_kv_received(rid)
                dst.kick()
                with contextlib.suppress(KeyError, ValueError):
                    self.policy.on_dispatched(rid, target)
                self.loop.at(self.links.message(self.loop.now), kv_done)

            self.loop.at(self.links.send(src.iid, target, nbytes, self.loop.now), kv_in)

        self.loop.at(self.links.message(self.loop.now), arrive)

    def _scale(self, cmd: ScaleCommand, now: float) -> None:
        """Autoscaling, as the runtime does it: ADD -> ``cmd.count`` new instances report (and take work) after
        ``scale_out_s``, provisioned (paid for) from the decision on; REMOVE -> the instance drains (DRAINING from
        this report on: not routed or dispatched to; the policy goes on at once), and leaves once empty
        (``_retire_drained``)."""
        if cmd.action is ScaleAction.ADD:
            def start() -> None:
                for _ in range(cmd.count):
                    inst = self._add(cmd.role, at=now)
                    self.scale_log.append({"action": "autoscale-add", "instance": inst.iid, "role": cmd.role,
                                           "decided_s": now, "started_s": self.loop.now, "mean_load": cmd.mean_load})
                self.scale.finished(self.loop.now)

            self.loop.after(self.config.scale_out_s, start)
        else:
            assert cmd.instance_id is not None
            self._retiring.add(cmd.instance_id)
            self.flips.remove(cmd.instance_id)
            self.instances[cmd.instance_id].state = InstanceState.DRAINING
            self.scale_log.append({"action": "autoscale-remove", "instance": cmd.instance_id, "role": cmd.role,
                                   "decided_s": now, "retired_s": None, "mean_load": cmd.mean_load})
            self.scale.finished(now)  # as the runtime: the policy goes on once the instance drains

    def _retire_drained(self, now: float) -> None:
        """Retiring instances that hold nothing leave the pool (their KV pool whole, their busy time kept)."""
        for iid in sorted(self._retiring):
            inst = self.instances[iid]
            if not inst.is_empty() or inst.kv.num_used_blocks or self._inbound.get(iid, 0):
                continue
            if inst.kv.num_free_blocks != inst.kv.num_blocks:
                raise AssertionError(f"{iid} retires holding KV blocks")
            self._retiring.discard(iid)
            del self.instances[iid]
            self.policy.forget_instance(iid)
            self._retired[iid] = inst
            self._alive_s[iid] = now - self._started_at[iid]
            for entry in self.scale_log:
                if entry["instance"] == iid and entry["action"] == "autoscale-remove":
                    entry["retired_s"] = now

    def _switch(self, inst: SimInstance, to_role: Role) -> None:
        if not inst.is_empty() or inst.kv.num_used_blocks:
            raise AssertionError(f"{inst.iid} switches role while holding work")
        decided = self.loop.now

        def done() -> None:
            new = self._make(to_role.value, inst.iid, list(self._started_at).index(inst.iid), kv=inst.kv)
            new.busy_s, new.steps = inst.busy_s, inst.steps
            self.instances[inst.iid] = new
            self.policy.forget_instance(inst.iid)  # as the runtime: routing forgets what it sent there
            rec = self.flips.on_switched(inst.iid, self.loop.now)
            self.flip_log.append({"instance": inst.iid, "from": rec.from_role.value, "to": rec.to_role.value,
                                  "decided_s": rec.decided_at, "drained_s": rec.drained_at,
                                  "switched_s": self.loop.now, "switch_s": self.loop.now - decided})

        self.loop.after(self.config.switch_s, done)
