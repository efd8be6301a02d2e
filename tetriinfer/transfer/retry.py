"""Retry policy for sending transfers: a failed or timed-out attempt is re-sent (same transfer id, next attempt
number, every appended payload replayed) up to `max_attempts` times; then the transfer is FAILED with every
attempt's reason, and the caller re-prefills.

Driven by poll() from the caller's loop (no thread). Invariant: after each attempt ends, the inner transfer is
released, so the inner backend holds no records, payload pins or staging for finished attempts.
The receiver keeps its posted region across attempts (a rejected attempt that is not the last resets it), so
post recv() with a timeout longer than the sender's whole retry budget (attempts x attempt timeout + backoff).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tetriinfer.transfer.base import Peer, TransferBackend
from tetriinfer.transfer.buffers import Buffer
from tetriinfer.transfer.state import Role, TransferState, TransferStatus


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 3
    backoff_s: float = 0.0
    attempt_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.backoff_s < 0:
            raise ValueError(f"backoff_s must be >= 0, got {self.backoff_s}")
        if self.attempt_timeout_s is not None and not self.attempt_timeout_s > 0:
            raise ValueError(f"attempt_timeout_s must be > 0, got {self.attempt_timeout_s}")


@dataclass
class _Job:
    peer: Peer
    appends: list[tuple[Sequence[Buffer], Sequence[int] | None]] = field(default_factory=list)
    closed: bool = False
    attempt: int = 0
    inner_open: bool = False
    retry_at: float = 0.0
    state: TransferState = TransferState.PENDING
    reasons: list[str] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)
    last: TransferStatus | None = None


class RetryingSender:
    """Sending side with retries on top of any backend. API mirrors the sender half of TransferBackend."""

    def __init__(self, backend: TransferBackend, policy: RetryPolicy | None = None) -> None:
        self.backend = backend
        self.policy = policy or RetryPolicy()
        self._jobs: dict[str, _Job] = {}

    def _open_attempt(self, tid: str, job: _Job) -> None:
        self.backend.open(tid, job.peer, timeout_s=self.policy.attempt_timeout_s, attempt=job.attempt,
                          max_attempts=self.policy.max_attempts)
        job.inner_open = True
        for bufs, slots in job.appends:
            self.backend.append(tid, bufs, slots=slots)
        if job.closed:
            self.backend.close(tid)

    def open(self, transfer_id: str, peer: Peer) -> None:
        if transfer_id in self._jobs:
            raise ValueError(f"transfer id {transfer_id!r} already in use")
        job = _Job(peer)
        self._jobs[transfer_id] = job
        self._open_attempt(transfer_id, job)

    def append(self, transfer_id: str, buffers: Sequence[Buffer], *,
               slots: Sequence[int] | None = None) -> None:
        job = self._jobs[transfer_id]
        if job.closed:
            raise ValueError(f"transfer {transfer_id!r} is closed")
        job.appends.append((buffers, slots))
        if job.inner_open:
            self.backend.append(transfer_id, buffers, slots=slots)

    def close(self, transfer_id: str) -> None:
        job = self._jobs[transfer_id]
        if job.closed:
            return
        job.closed = True
        if job.inner_open:
            self.backend.close(transfer_id)

    def send(self, transfer_id: str, buffers: Sequence[Buffer], peer: Peer) -> None:
        self.open(transfer_id, peer)
        self.append(transfer_id, buffers)
        self.close(transfer_id)

    def poll(self, transfer_id: str) -> TransferState:
        job = self._jobs[transfer_id]
        if job.state.terminal:
            return job.state
        now = time.monotonic()
        if not job.inner_open:
            if now >= job.retry_at:
                self._open_attempt(transfer_id, job)
            return job.state
        inner = self.backend.poll(transfer_id)
        if inner is TransferState.TRANSFERRING:
            job.state = TransferState.TRANSFERRING
        if not inner.terminal:
            return job.state
        job.last = self.backend.status(transfer_id)
        self.backend.release(transfer_id)
        job.inner_open = False
        if inner is TransferState.DONE:
            job.state = TransferState.DONE
            job.appends.clear()
            return job.state
        job.reasons.append(f"attempt {job.attempt}: {job.last.reason}")
        if job.attempt + 1 >= self.policy.max_attempts:
            job.state = TransferState.FAILED
            job.appends.clear()
            return job.state
        job.attempt += 1
        job.retry_at = now + self.policy.backoff_s
        if self.policy.backoff_s == 0:
            self._open_attempt(transfer_id, job)
        return job.state

    def attempts(self, transfer_id: str) -> int:
        """Attempts started so far (1 = no retry yet)."""
        return self._jobs[transfer_id].attempt + 1

    def status(self, transfer_id: str) -> TransferStatus:
        job = self._jobs[transfer_id]
        last = job.last
        if job.inner_open:
            last = self.backend.status(transfer_id)
        reason = "; ".join(job.reasons) if job.state is TransferState.FAILED else ""
        if job.state is TransferState.FAILED:
            reason = f"failed after {job.attempt + 1} attempt(s): {reason}"
        return TransferStatus(
            transfer_id=transfer_id, role=Role.SENDER, state=job.state, reason=reason,
            bytes_done=last.bytes_done if last else 0, bytes_total=last.bytes_total if last else 0,
            attempt=job.attempt, elapsed_s=time.monotonic() - job.created,
        )

    def release(self, transfer_id: str) -> None:
        job = self._jobs.pop(transfer_id, None)
        if job is not None and job.inner_open:
            self.backend.release(transfer_id)

    def live(self) -> int:
        return len(self._jobs)
