"""Prefill ordering policies (TetriInfer section 3.3): FCFS, SJF, LJF with ``PrefillSchedBatch``, and SRTF.

``PrefillQueue`` owns the *order* of the requests queued at one prefill instance; it never touches KV
blocks or request progress (the ``PrefillScheduler`` does).

- FCFS / SJF / LJF: requests arrive in a raw FIFO queue. When the scheduled queue runs short of a
  chunk's worth of tokens, the next ``sched_batch`` raw requests are taken as one *batch*, sorted (SJF:
  ascending tokens, LJF: descending, FCFS: unchanged; ties by arrival) and appended to the scheduled
  queue. Batches are served in formation order.
  Starvation bound: a request is never overtaken by a request that arrived after its batch was formed;
  it is overtaken by at most ``sched_batch - 1`` requests (members of its own batch).
- SRTF: shortest remaining prefill first over the whole queue, re-sorted before every chunk, so a
  shorter arrival preempts a partially prefilled request at the next chunk boundary. Aging bounds
  starvation: once a request has been passed over by ``sched_batch`` chunks that served requests which
  arrived after it, it becomes *urgent*; urgent requests go first, in arrival order.
  Bound: a request is passed over by at most ``sched_batch`` such chunks.

"Tokens" above are the prefill work left: ``order(..., work=...)`` may count it without the prompt's cached
prefix (``KVCacheManager.cached_prefix_tokens``), so with prefix caching SJF/SRTF rank a long prompt that is
mostly cached as the short job it is (SGLang's longest-prefix-match ordering, folded into shortest-first).
Without ``work`` it is ``num_uncomputed_tokens``.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterable

from tetriinfer.core.request import Request


class PrefillPolicy(enum.Enum):
    FCFS = "fcfs"
    SJF = "sjf"
    LJF = "ljf"
    SRTF = "srtf"


def parse_prefill_policy(value: PrefillPolicy | str) -> PrefillPolicy:
    if isinstance(value, PrefillPolicy):
        return value
    try:
        return PrefillPolicy(str(value).lower())
    except ValueError:
        names = ", ".join(p.value for p in PrefillPolicy)
        raise ValueError(f"unknown prefill policy {value!r}; choose one of: {names}") from None


class PrefillQueue:
    """Order of queued (not fully prefilled) requests. Invariant: every request is in exactly one of
    the raw queue and the scheduled queue; ``order()`` lists each queued request exactly once."""

    def __init__(self, policy: PrefillPolicy | str, sched_batch: int) -> None:
        if sched_batch < 1:
            raise ValueError(f"prefill_sched_batch must be >= 1, got {sched_batch}")
        self.policy = parse_prefill_policy(policy)
        self.sched_batch = sched_batch
        self._raw: deque[Request] = deque()
        self._scheduled: list[Request] = []
        self._seq: dict[str, int] = {}  # arrival sequence number at this queue
        self._batch_of: dict[str, int] = {}  # batch index once a batch was formed (batch policies)
        self._passed_over: dict[str, int] = {}  # SRTF aging counters
        self._next_seq = 0
        self._next_batch = 0

    def __len__(self) -> int:
        return len(self._raw) + len(self._scheduled)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._seq

    def push(self, req: Request) -> None:
        if req.request_id in self._seq:
            raise ValueError(f"request {req.request_id!r} already queued")
        self._seq[req.request_id] = self._next_seq
        self._next_seq += 1
        if self.policy is PrefillPolicy.SRTF:
            self._passed_over[req.request_id] = 0
            self._scheduled.append(req)
        else:
            self._raw.append(req)

    def remove(self, request_id: str) -> Request | None:
        """Take a request out of the queue (fully prefilled, aborted). Unknown ids return None."""
        if self._seq.pop(request_id, None) is None:
            return None
        self._batch_of.pop(request_id, None)
        self._passed_over.pop(request_id, None)
        for container in (self._scheduled, self._raw):
            for req in container:
                if req.request_id == request_id:
                    container.remove(req)
                    return req
        raise AssertionError(f"request {request_id} had a sequence number but was in no queue")

    def requests(self) -> list[Request]:
        return list(self._scheduled) + list(self._raw)

    def arrival_order(self) -> list[Request]:
        """Every queued request, oldest arrival at this queue first."""
        return sorted(self.requests(), key=lambda r: self._seq[r.request_id])

    def batch_index(self, request_id: str) -> int | None:
        """Index of the batch the request was sorted in (None before its batch is formed, or SRTF)."""
        return self._batch_of.get(request_id)

    def passed_over(self, request_id: str) -> int:
        return self._passed_over.get(request_id, 0)

    # ---- ordering ---------------------------------------------------------------------------
    def order(self, min_tokens: int, work: Callable[[Request], int] | None = None) -> list[Request]:
        """The queued requests in service order, forming batches until the scheduled ones hold at
        least ``min_tokens`` tokens of work (so one chunk can be filled) or the raw queue is empty.
        Requests still in the raw queue are not returned (their batch is not formed yet). ``work(r)``: the
        prefill tokens left for ``r`` (default ``num_uncomputed_tokens``); SJF/LJF sort by it when a batch
        forms, SRTF before every chunk."""
        left = work or _uncomputed
        if self.policy is PrefillPolicy.SRTF:
            return sorted(self._scheduled, key=lambda r: self._srtf_key(r, left(r)))
        while self._raw and sum(left(r) for r in self._scheduled) < min_tokens:
            self._form_batch(left)
        return list(self._scheduled)

    def _form_batch(self, left: Callable[[Request], int]) -> None:
        batch = [self._raw.popleft() for _ in range(min(self.sched_batch, len(self._raw)))]
        if self.policy is PrefillPolicy.SJF:
            batch.sort(key=lambda r: (left(r), self._seq[r.request_id]))
        elif self.policy is PrefillPolicy.LJF:
            batch.sort(key=lambda r: (-left(r), self._seq[r.request_id]))
        for r in batch:
            self._batch_of[r.request_id] = self._next_batch
        self._next_batch += 1
        self._scheduled.extend(batch)

    def _srtf_key(self, r: Request, left: int) -> tuple[int, int, int]:
        seq = self._seq[r.request_id]
        if self._passed_over[r.request_id] >= self.sched_batch:
            return (0, 0, seq)  # urgent: arrival order, ahead of everything else
        return (1, left, seq)

    def note_served(self, served_ids: Iterable[str]) -> None:
        """Record one chunk's service (SRTF aging): every queued request not in the chunk that arrived
        before some request in the chunk has been passed over once more."""
        if self.policy is not PrefillPolicy.SRTF:
            return
        served = set(served_ids)
        if not served:
            return
        seqs = [self._seq[i] for i in served if i in self._seq]
        if not seqs:
            return
        newest = max(seqs)
        for rid, seq in self._seq.items():
            if rid not in served and seq < newest:
                self._passed_over[rid] += 1


def _uncomputed(r: Request) -> int:
    return r.num_uncomputed_tokens
