"""A request's progress through the system: which tokens exist and how many are in the KV cache.

The scheduler schedules *tokens, not phases*: a request has ``num_tokens`` (prompt + generated) and
``num_computed_tokens`` (those whose K/V are in the cache). Prefill and decode are the same arithmetic:
a step computes tokens ``[num_computed_tokens, end)`` and, when ``end == num_tokens``, samples one more.

Only the scheduler that owns a request mutates it (through the methods here); executors see copies of
the values they need inside ``SchedulerOutput``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tetriinfer.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, some prompt tokens not yet computed
    RUNNING = "running"  # all tokens but the last sampled one are computed (decoding)
    PREEMPTED = "preempted"  # KV dropped; will recompute
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_FAILED = "finished_failed"

    # a plain attribute, set once per member below (read per token: no property call, no enum hash);
    # invariant: ``status.finished == (status in FINISHED_STATUSES)``
    finished: bool


for _status in RequestStatus:
    _status.finished = _status.value.startswith("finished_")


FINISHED_STATUSES = frozenset({
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_FAILED,
})

FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_FAILED: "error",
}


@dataclass
class Request:
    """Mutable progress of one request, owned by exactly one scheduler at a time.

    Invariants: ``0 <= num_computed_tokens <= num_tokens``; ``output_token_ids`` only grows (until a
    terminal status); ``status.finished`` is set at most once.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    # Length prediction (bucket index and the bucket's token bounds); None when no predictor.
    predicted_bucket: int | None = None
    predicted_lower: int | None = None
    predicted_upper: int | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if len(self.prompt_token_ids) == 0:
            raise ValueError(f"request {self.request_id}: prompt must contain at least one token")

    # ---- token arithmetic -------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """True while more than the last sampled token is missing from the KV cache."""
        return not self.output_token_ids or self.num_uncomputed_tokens > 1

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output (without joining the two lists: a decode step asks for one
        output token, and copying the whole prompt for it cost more than the rest of its scheduling)."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n_prompt]

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    # ---- mutation (called by the owning scheduler only) -------------------------------
    def append_output(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        if self.is_finished:
            raise RuntimeError(f"request {self.request_id} already finished")
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def check_stop(self) -> RequestStatus | None:
        """Token-level stop conditions after the newest token. Stop *strings* are checked by the
        detokenizing layer, which then calls the scheduler's ``finish``."""
        params = self.sampling_params
        n_out = len(self.output_token_ids)
        if n_out == 0:
            return None
        last = self.output_token_ids[-1]
        if n_out >= params.min_tokens:
            if not params.ignore_eos and self.eos_token_id is not None and last == self.eos_token_id:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if n_out >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
