"""The table of requests a scheduler holds, and the ids that finished since its last step.

Every scheduler in ``core`` (local, prefill, decode, colocated) keeps one ``RequestTable`` (composition:
the scheduler owns its queues, the table owns membership and the finished-id list). The table knows
nothing of queues; when a request finishes it frees the request's KV blocks through the scheduler's
``KVCacheManager`` and calls the scheduler's ``forget`` hook so it drops the request from its own queues.

A request leaves the table in exactly one of two ways:
- ``mark_finished`` (or ``finish``, which looks it up first): a terminal status is set, its blocks are
  freed, ``forget`` runs, it is deleted and its id is recorded; the next ``drain_finished`` returns that
  id exactly once (it then goes into ``SchedulerOutput.finished_request_ids``).
- ``remove``: deleted without a status change, without freeing and without being recorded. Used where
  the request lives on elsewhere: ``PrefillScheduler.release`` (KV handed over to a decode instance;
  the scheduler frees the blocks itself) and ``DecodeScheduler.transfer_failed`` (handed back to the
  caller to retry or re-prefill).

Invariants: ids are unique (``add`` refuses a duplicate); every request added leaves exactly once,
by one of the two ways above; a request in the table is never removed twice, and an id is recorded in
the finished list at most once per time it was added; ``drain_finished`` returns ids in the order they
finished and empties the list. ``view`` is a live read-only mapping for callers outside the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence, ValuesView
from types import MappingProxyType

from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.request import Request, RequestStatus


class RequestTable:
    """Unfinished requests of one scheduler by id, plus the ids finished since the last drain.

    ``kv``: the scheduler's block manager (a finished request's blocks are freed through it).
    ``forget``: the scheduler's hook that takes a finishing request out of its queues; it is called after
    the status is set and the blocks are freed, while the request is still in the table.
    """

    def __init__(self, kv: KVCacheManager, forget: Callable[[Request], None]) -> None:
        self._kv = kv
        self._forget = forget
        self._requests: dict[str, Request] = {}
        self._finished_since_last: list[str] = []

    # ---- reading -------------------------------------------------------------------------
    @property
    def view(self) -> Mapping[str, Request]:
        """Read-only live mapping id -> request (what schedulers expose as ``requests``)."""
        return MappingProxyType(self._requests)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def __getitem__(self, request_id: str) -> Request:
        return self._requests[request_id]

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[str]:
        return iter(self._requests)

    def values(self) -> ValuesView[Request]:
        return self._requests.values()

    def unfinished(self, request_id: str) -> Request | None:
        """The request if it is held here and not finished, else None."""
        req = self._requests.get(request_id)
        if req is None or req.is_finished:
            return None
        return req

    # ---- membership ----------------------------------------------------------------------
    def require_new(self, request_id: str) -> None:
        """Raise ValueError if ``request_id`` is already held (schedulers check this before anything else)."""
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id!r}")

    def add(self, req: Request) -> None:
        """Hold ``req``; raises ValueError on a duplicate id (nothing changes then)."""
        self.require_new(req.request_id)
        self._requests[req.request_id] = req

    def remove(self, request_id: str) -> Request:
        """Forget a request that leaves unfinished (handed over, handed back): no status change, no
        freeing, not recorded as finished. Unknown ids raise KeyError."""
        return self._requests.pop(request_id)

    def take_unstarted(self, queued: Sequence[Request], limit: int, unqueue: Callable[[Request], None]) -> list[Request]:
        """Remove up to ``limit`` of ``queued`` that made no progress (``unstarted_newest_first``): ``unqueue``
        takes each out of the scheduler's queue, then it leaves the table unfinished (``remove``)."""
        picked = unstarted_newest_first(queued, self._kv, limit)
        for req in picked:
            unqueue(req)
            self.remove(req.request_id)
        return picked

    # ---- finishing -----------------------------------------------------------------------
    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish a held, unfinished request (``mark_finished``) and return it; None (and no change) for
        an unknown or already finished id."""
        req = self.unfinished(request_id)
        if req is not None:
            self.mark_finished(req, status)
        return req

    def mark_finished(self, req: Request, status: RequestStatus) -> None:
        """Set the terminal ``status``, free the request's blocks, run ``forget``, delete it and record its
        id for the next ``drain_finished``. ``req`` must be the request held under its id."""
        rid = req.request_id
        if not status.finished:
            raise ValueError(f"{status} is not a terminal status")
        if self._requests.get(rid) is not req:
            raise KeyError(f"request {rid!r} is not held in this table")
        req.status = status
        self._kv.free_request(rid)
        self._forget(req)
        del self._requests[rid]
        self._finished_since_last.append(rid)

    @property
    def has_finished_to_drain(self) -> bool:
        """Whether some id waits for the next ``drain_finished``."""
        return bool(self._finished_since_last)

    def drain_finished(self) -> tuple[str, ...]:
        """Ids finished since the previous drain, in finishing order; the list is emptied."""
        ids = tuple(self._finished_since_last)
        self._finished_since_last.clear()
        return ids


def unstarted_newest_first(queued: Sequence[Request], kv: KVCacheManager, limit: int) -> list[Request]:
    """Up to ``limit`` of ``queued`` (in arrival order) that made no progress on this instance -- nothing
    computed, no output token, no KV block -- newest first: requests another instance can take as if they had
    just arrived (``take_unstarted`` of the prefill and colocated schedulers; the queue rebalancer)."""
    picked: list[Request] = []
    for req in reversed(queued):
        if len(picked) >= limit:
            break
        if (req.num_computed_tokens == 0 and not req.output_token_ids and not req.is_finished
                and not kv.num_blocks_of(req.request_id)):
            picked.append(req)
    return picked
