"""Global scheduler's pure policy: the request status table and prefill routing.

Request lifecycle as the global scheduler tracks it (``Phase``):
ARRIVED -> PREFILL (routed to a prefill instance: queued, predicted, chunks prefilled) -> DECODE
(dispatched to a decode instance: KV transferring, then decoding) -> FINISHED | ABORTED | FAILED.

Routing: each request goes to the least-loaded ACTIVE prefill instance (draining or flipping
instances are skipped). Load = prompt tokens still to prefill from the instance's latest report plus
the tokens this policy routed there after that report was built (so a burst between two reports is
spread instead of piling onto one instance); ties by queue length, then by the prefilled requests the instance
still holds (staged for a transfer or kept to decode there, ``load_key``), then by instance id. With prefix-aware
routing (``core.prefix_affinity``, on with prefix caching), the key is that backlog plus the request's own prompt tokens
*not* already cached at the instance (as far as the front end knows), and what an instance is charged for a
routed request is only its uncached part.

Conditional disaggregation (``LocalPrefillConfig``, off by default; Dynamo's "prefill locally when the
remote queue is long", Splitwise's mixed pool): a request may instead be prefilled *on a decode
instance* (ARRIVED -> DECODE directly, no KV transfer) when that is expected to cut its wait. With
``B`` = backlog tokens (prompt tokens queued ahead), ``P`` = this prompt,
``R`` = the decode instance's running requests, the request goes local iff
``B_prefill >= min_prefill_backlog_tokens`` and
``B_decode + interference_weight * R * P < B_prefill`` for the decode instance minimizing the left side
(among ACTIVE ones with free blocks for the prompt). The left side prices the interference: a local
prefill of ``P`` tokens delays each of the ``R`` running decodes by about ``P`` tokens' worth of
compute; ``interference_weight`` says how much such delay counts against this request's own wait.

Backlog of an instance (``backlog_tokens``): the smaller of two upper bounds on the prompt tokens it still has to
prefill: its latest report plus what was routed there since (stale by up to a report interval: a prompt finished
after the report still counts), and the prompts routed there that have not streamed their first token yet
(exact as of the last message, but a prompt part-way through its chunks counts whole).

Cost: routing is O(I log n) per request for I instances and n routings not yet covered by a report. Each
instance keeps its routings since its latest report in a heap by routing time with a running token total
(pruned incrementally as newer reports arrive), and its awaiting-first-token prompts in a dict with a running
total, so ``_extra`` and ``backlog_tokens`` are O(1) amortized instead of sums over every routed request.

Invariants: a request id is added once; phases only move forward (except ``reroute`` and ``restart``, which send a
routed request back to ARRIVED when its instance drained it away or died); every request reaches exactly one
terminal phase (a second terminal transition is refused); nothing reads a clock (``now`` is passed).
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from tetriinfer.core.load import LoadKey, LoadReport, Role, accepting, load_key
from tetriinfer.core.prefix_affinity import PrefixAffinity


class Phase(enum.Enum):
    ARRIVED = "arrived"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"

    terminal: bool  # a plain attribute, set once per member below (read per streamed token)


for _phase in Phase:
    _phase.terminal = _phase.value in ("finished", "aborted", "failed")


@dataclass
class RequestRecord:
    """One row of the status table; mutated only by ``GlobalPolicy``."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    phase: Phase = Phase.ARRIVED
    prefill_instance: str | None = None
    decode_instance: str | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_output_tokens: int = 0
    finish_reason: str | None = None
    prefix_digests: tuple[bytes, ...] = ()  # block names for prefix-aware routing (empty: not used)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def jct(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)

    def meets_slo(self) -> bool:
        """Finished and within both SLOs (an unset SLO always holds)."""
        if self.phase is not Phase.FINISHED:
            return False
        if self.ttft_slo_s is not None and (self.ttft is None or self.ttft > self.ttft_slo_s):
            return False
        tpot = self.tpot
        return self.tpot_slo_s is None or tpot is None or tpot <= self.tpot_slo_s


@dataclass(frozen=True)
class LocalPrefillConfig:
    """Conditional disaggregation (see the module docstring). ``enabled=False``: always disaggregate."""

    enabled: bool = False
    interference_weight: float = 0.25
    min_prefill_backlog_tokens: int = 1  # never prefill locally while the prefill tier is idle
    max_prompt_tokens: int | None = None  # longer prompts always go to a prefill instance

    def __post_init__(self) -> None:
        if self.interference_weight < 0:
            raise ValueError(f"interference_weight must be >= 0, got {self.interference_weight}")
        if self.min_prefill_backlog_tokens < 0:
            raise ValueError(f"min_prefill_backlog_tokens must be >= 0, got {self.min_prefill_backlog_tokens}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1 or None, got {self.max_prompt_tokens}")


class _RoutedSince:
    """Prompt tokens routed to one instance, keyed by routing time, with their running total.

    Invariant: ``total == sum(n for _, n in heap)``; every entry has ``t > horizon`` once pruned to ``horizon``
    (entries at or before the latest report's time are already reflected in that report)."""

    __slots__ = ("heap", "total")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int]] = []
        self.total = 0

    def add(self, t: float, tokens: int) -> None:
        heapq.heappush(self.heap, (t, tokens))
        self.total += tokens

    def prune(self, horizon: float) -> int:
        """Drop routings at or before ``horizon``; the tokens routed after it."""
        heap = self.heap
        while heap and heap[0][0] <= horizon:
            self.total -= heapq.heappop(heap)[1]
        return self.total


class _Awaiting:
    """Request id -> prompt tokens routed to one instance with no first token yet, with the running total.

    Invariant: ``total == sum(by_id.values())``."""

    __slots__ = ("by_id", "total")

    def __init__(self) -> None:
        self.by_id: dict[str, int] = {}
        self.total = 0

    def add(self, request_id: str, tokens: int) -> None:
        self.total += tokens - self.by_id.get(request_id, 0)
        self.by_id[request_id] = tokens

    def pop(self, request_id: str) -> None:
        self.total -= self.by_id.pop(request_id, 0)


class _PrefillIndex:
    """The least-loaded pick over one ``loads`` sequence, kept as a heap with lazy invalidation.

    Built when ``route`` first sees a sequence (a monitor broadcast); reused while later calls pass the very same
    object (a broadcast is never mutated in place: a newer one is a new sequence). Only the routings since the
    reports change a candidate's key, so each route re-keys only the instances whose routings changed (``dirty``).

    Invariants: ``key[iid]`` is candidate ``iid``'s current ``load_key`` (with its routings since the report) for
    every iid not in ``dirty``; ``heap`` holds ``(key[iid], iid)`` for every candidate, plus stale pairs (a key no
    longer current) that are dropped when they reach the top; ``horizon[iid]`` is the newest report time for
    ``iid`` in ``loads`` (what the full scan prunes its routings to)."""

    __slots__ = ("loads", "size", "reports", "horizon", "key", "heap", "dirty")

    def __init__(self, loads: Sequence[LoadReport], reports: dict[str, LoadReport], horizon: dict[str, float],
                 key: dict[str, LoadKey]) -> None:
        self.loads, self.size = loads, len(loads)
        self.reports, self.horizon, self.key = reports, horizon, key
        self.heap = [(k, iid) for iid, k in key.items()]
        heapq.heapify(self.heap)
        self.dirty: set[str] = set()


class GlobalPolicy:
    def __init__(self, local_prefill: LocalPrefillConfig | None = None,
                 affinity: PrefixAffinity | None = None) -> None:
        self.local_prefill = local_prefill or LocalPrefillConfig()
        self.affinity = affinity  # prefix-aware routing when set
        self._table: dict[str, RequestRecord] = {}
        self._routed: dict[str, _RoutedSince] = {}  # instance -> (routed at, tokens) not yet in a report
        # instance -> {request id: prompt tokens} routed there to be prefilled, no first token seen yet
        self._awaiting_first: dict[str, _Awaiting] = {}
        self.num_local_prefills = 0
        self._index: _PrefillIndex | None = None  # least-loaded pick over the latest loads sequence

    def add(
        self, request_id: str, now: float, num_prompt_tokens: int,
        ttft_slo_s: float | None = None, tpot_slo_s: float | None = None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> RequestRecord:
        """A new ARRIVED request; ``prompt_token_ids`` (needed only for prefix-aware routing) name its blocks."""
        if request_id in self._table:
            raise ValueError(f"duplicate request id {request_id!r}")
        if num_prompt_tokens < 1:
            raise ValueError(f"num_prompt_tokens must be >= 1, got {num_prompt_tokens}")
        rec = RequestRecord(request_id, now, num_prompt_tokens, ttft_slo_s, tpot_slo_s)
        if self.affinity is not None and prompt_token_ids is not None:
            rec.prefix_digests = self.affinity.digests(prompt_token_ids)
        self._table[request_id] = rec
        return rec

    def get(self, request_id: str) -> RequestRecord:
        return self._table[request_id]

    def records(self) -> list[RequestRecord]:
        return list(self._table.values())

    def active(self) -> list[RequestRecord]:
        return [r for r in self._table.values() if not r.phase.terminal]

    def forget(self, request_id: str) -> RequestRecord:
        """Drop a terminal request's row (after its outputs were delivered)."""
        rec = self._table[request_id]
        if not rec.phase.terminal:
            raise ValueError(f"request {request_id!r} is still {rec.phase.value}")
        return self._table.pop(request_id)

    # ---- routing ---------------------------------------------------------------------------
    def pick_prefill(self, loads: Sequence[LoadReport], digests: Sequence[bytes] = ()) -> str | None:
        """The least-loaded ACTIVE prefill instance (None if none accepts); with prefix-aware routing and block
        names, the one where backlog + this prompt's uncached tokens is least. Pure, records nothing."""
        cands = accepting(loads, Role.PREFILL)
        if not cands:
            return None

        def key(r: LoadReport) -> LoadKey:
            return load_key(r, extra_tokens=self._extra(r) - self._cached(r.instance_id, digests))

        return min(cands, key=key).instance_id

    def _cached(self, instance_id: str, digests: Sequence[bytes]) -> int:
        return self.affinity.matched_tokens(instance_id, digests) if self.affinity is not None and digests else 0

    def forget_instance(self, instance_id: str) -> None:
        """The instance left or changed role: its routing history (and cache model) no longer applies."""
        self._routed.pop(instance_id, None)
        self._changed(instance_id)
        self._awaiting_first.pop(instance_id, None)
        if self.affinity is not None:
            self.affinity.forget(instance_id)

    def _extra(self, report: LoadReport) -> int:
        """Prompt tokens routed to ``report``'s instance after the report was built (amortized O(log n): routings
        a report already covers are dropped for good, as a newer report covers them too)."""
        routed = self._routed.get(report.instance_id)
        if routed is None:
            return 0
        before = routed.total
        after = routed.prune(report.time)
        if after != before:
            self._changed(report.instance_id)
        return after

    def _changed(self, instance_id: str) -> None:
        """``instance_id``'s routings since its report changed: the pick index re-keys it on the next route."""
        if self._index is not None:
            self._index.dirty.add(instance_id)

    def _pick_indexed(self, loads: Sequence[LoadReport]) -> str | None:
        """``pick_prefill(loads)`` without block names (the same instance), after the same pruning as ``route``'s
        full scan, in O(log I) per call while ``loads`` is the sequence the index was built on (O(I log I) to
        build it, once per new sequence). Falls back to the full scan when an instance id repeats in ``loads``."""
        idx = self._index
        if idx is None or idx.loads is not loads or idx.size != len(loads):
            self._index = None
            horizon = {r.instance_id: r.time for r in loads}  # each instance's one report
            if len(horizon) != len(loads):  # the same instance twice: leave it to the full scan
                for r in loads:  # forget routings already reflected in a newer report
                    routed = self._routed.get(r.instance_id)
                    if routed is not None:
                        routed.prune(r.time)
                return self.pick_prefill(loads)
            for iid, routed in self._routed.items():  # forget routings already reflected in the report
                if routed.heap:
                    t = horizon.get(iid)
                    if t is not None:
                        routed.prune(t)
            # the candidates (``accepting``'s, in any order: the heap's least key is the same) keyed by
            # ``load_key(r, extra_tokens=self._extra(r))``, which after the pruning above is ``total`` routed since
            reports = {r.instance_id: r for r in accepting(loads, Role.PREFILL, ordered=False)}
            routed_of = self._routed.get
            key = {}
            for iid, r in reports.items():
                routed = routed_of(iid)
                key[iid] = load_key(r, extra_tokens=0 if routed is None else routed.total)
            idx = self._index = _PrefillIndex(loads, reports, horizon, key)
        elif idx.dirty:
            reports, key, heap = idx.reports, idx.key, idx.heap
            dirty, idx.dirty = idx.dirty, set()
            for iid in dirty:
                routed = self._routed.get(iid)
                if routed is not None and iid in idx.horizon:
                    routed.prune(idx.horizon[iid])
                rep = reports.get(iid)  # None: not among this index's candidates
                if rep is not None:
                    k = key[iid] = load_key(rep, extra_tokens=0 if routed is None else routed.total)
                    heapq.heappush(heap, (k, iid))
        heap, key = idx.heap, idx.key
        while heap and heap[0][0] != key[heap[0][1]]:
            heapq.heappop(heap)
        return heap[0][1] if heap else None

    def backlog_tokens(self, report: LoadReport) -> int:
        """Prompt tokens ``report``'s instance still has to prefill (see the module docstring)."""
        reported = (report.tokens_in_flight if report.role is Role.PREFILL else report.num_prefill_tokens)
        from_reports = reported + self._extra(report)
        awaiting = self._awaiting_first.get(report.instance_id)
        if awaiting is None:  # nothing routed there through this policy: the reports are all there is
            return from_reports
        return min(from_reports, awaiting.total)

    def _settle_prefill(self, rec: RequestRecord) -> None:
        """``rec`` streamed its first token, ended or left its prefill instance: no longer part of a backlog."""
        if rec.prefill_instance is not None:
            awaiting = self._awaiting_first.get(rec.prefill_instance)
            if awaiting is not None:
                awaiting.pop(rec.request_id)

    def pick_local(self, num_prompt_tokens: int, loads: Sequence[LoadReport], prefill_iid: str | None) -> str | None:
        """The decode instance that should prefill this prompt itself (conditional disaggregation), or None
        to disaggregate as usual; pure, records nothing. ``prefill_iid``: the prefill instance it would get."""
        cfg = self.local_prefill
        if not cfg.enabled or (cfg.max_prompt_tokens is not None and num_prompt_tokens > cfg.max_prompt_tokens):
            return None
        idx = self._index  # the pick index of this very ``loads`` holds every accepting prefill instance's report
        if idx is not None and idx.loads is loads and prefill_iid in idx.reports:
            remote: LoadReport | None = idx.reports[prefill_iid]
        else:
            remote = next((r for r in loads if r.instance_id == prefill_iid), None)
        backlog = float("inf") if remote is None else self.backlog_tokens(remote)
        if backlog < cfg.min_prefill_backlog_tokens:
            return None
        best: tuple[float, str] | None = None
        for d in accepting(loads, Role.DECODE):
            if d.num_free_blocks < d.blocks_for_tokens(num_prompt_tokens + 1):
                continue
            cost = self.backlog_tokens(d) + cfg.interference_weight * d.num_running * num_prompt_tokens
            if cost < backlog and (best is None or cost < best[0]):
                best = (cost, d.instance_id)
        return None if best is None else best[1]

    def route(self, request_id: str, loads: Sequence[LoadReport], now: float) -> str | None:
        """Route an ARRIVED request: to a prefill instance (-> PREFILL), or, under conditional
        disaggregation, to a decode instance that prefills it itself (-> DECODE, ``prefill_instance ==
        decode_instance``). None: no instance accepts now, retry later."""
        rec = self._table[request_id]
        if rec.phase is not Phase.ARRIVED:
            raise ValueError(f"request {request_id!r} is {rec.phase.value}, not arrived")
        if self.affinity is not None and rec.prefix_digests:  # keys depend on this prompt's blocks: full scan
            self._index = None
            for r in loads:  # forget routings already reflected in a newer report
                routed = self._routed.get(r.instance_id)
                if routed is not None:
                    routed.prune(r.time)
            iid = self.pick_prefill(loads, rec.prefix_digests)
        else:
            iid = self._pick_indexed(loads)
        local = self.pick_local(rec.num_prompt_tokens, loads, iid)
        if local is not None:
            self._routed.setdefault(local, _RoutedSince()).add(now, rec.num_prompt_tokens)
            self._changed(local)
            rec.phase = Phase.DECODE
            rec.prefill_instance = rec.decode_instance = local
            self._awaiting_first.setdefault(local, _Awaiting()).add(request_id, rec.num_prompt_tokens)
            self.num_local_prefills += 1
            return local
        if iid is None:
            return None
        cached = self._cached(iid, rec.prefix_digests)
        self._routed.setdefault(iid, _RoutedSince()).add(now, rec.num_prompt_tokens - cached)
        self._changed(iid)
        if self.affinity is not None and rec.prefix_digests:
            report = next(r for r in loads if r.instance_id == iid)
            self.affinity.record(iid, rec.prefix_digests, report.num_blocks or None)
        rec.phase = Phase.PREFILL
        rec.prefill_instance = iid
        self._awaiting_first.setdefault(iid, _Awaiting()).add(request_id, rec.num_prompt_tokens - cached)
        return iid

    def reroute(self, request_id: str) -> None:
        """Send a PREFILL request back to ARRIVED (its prefill instance failed or drained it away)."""
        rec = self._table[request_id]
        if rec.phase is not Phase.PREFILL:
            raise ValueError(f"request {request_id!r} is {rec.phase.value}, not in prefill")
        self._settle_prefill(rec)
        rec.phase = Phase.ARRIVED
        rec.prefill_instance = None

    def restart(self, request_id: str, num_prompt_tokens: int) -> None:
        """Send a PREFILL or DECODE request back to ARRIVED to be prefilled again from ``num_prompt_tokens``
        (its prompt plus the tokens already streamed): an instance holding it died. The only backward move of a
        phase besides ``reroute``; its first-token time and output count are kept (the client's stream goes on)."""
        rec = self._table[request_id]
        if rec.phase not in (Phase.PREFILL, Phase.DECODE):
            raise ValueError(f"request {request_id!r} is {rec.phase.value}; only a routed request can restart")
        if num_prompt_tokens < 1:
            raise ValueError(f"num_prompt_tokens must be >= 1, got {num_prompt_tokens}")
        self._settle_prefill(rec)
        rec.phase = Phase.ARRIVED
        rec.prefill_instance = rec.decode_instance = None
        rec.num_prompt_tokens = num_prompt_tokens
        rec.prefix_digests = ()

    # ---- progress --------------------------------------------------------------------------
    def on_dispatched(self, request_id: str, decode_instance: str) -> None:
        rec = self._table[request_id]
        if rec.phase not in (Phase.PREFILL, Phase.DECODE):  # DECODE again: re-dispatch after a failed transfer
            raise ValueError(f"request {request_id!r} is {rec.phase.value}; cannot dispatch")
        rec.phase = Phase.DECODE
        rec.decode_instance = decode_instance

    def on_tokens(self, request_id: str, num_new: int, now: float) -> None:
        """``num_new`` output tokens streamed at ``now`` (the first one sets TTFT)."""
        rec = self._table[request_id]
        if rec.phase.terminal or num_new <= 0:
            return
        if rec.first_token_time is None:
            rec.first_token_time = now
            self._settle_prefill(rec)
        rec.last_token_time = now
        rec.num_output_tokens += num_new

    def on_terminal(self, request_id: str, phase: Phase, now: float, reason: str | None = None) -> bool:
        """Move to a terminal phase; returns False (and changes nothing) if it already ended."""
        if not phase.terminal:
            raise ValueError(f"{phase.value} is not a terminal phase")
        rec = self._table[request_id]
        if rec.phase.terminal:
            return False
        self._settle_prefill(rec)
        rec.phase = phase
        rec.finish_time = now
        rec.finish_reason = reason
        return True
