"""The contract between a scheduler and whatever executes its decisions.

A scheduler returns a ``SchedulerOutput`` (plain, immutable value); an executor (the real model runner
or the simulator's cost model) returns a ``StepResult``. Neither side reaches into the other's state.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tetriinfer.core.frozen import fast_init
from tetriinfer.core.sampling_params import SamplingParams


class StepKind(enum.Enum):
    IDLE = "idle"
    PREFILL = "prefill"  # a fixed-size chunk of prompt tokens (TetriInfer) or whole prompts (vLLM)
    DECODE = "decode"  # one token for each running request
    MIXED = "mixed"  # decodes + prefill chunks under one token budget (Sarathi-Serve)


@fast_init
@dataclass(frozen=True)
class ScheduledSegment:
    """Compute K/V (and hidden states) for positions ``[start, start + len(token_ids))`` of one request.

    ``block_table`` covers at least ``start + len(token_ids)`` positions. When ``sample`` is true the
    executor samples one token from the last position's logits.
    """

    request_id: str
    start: int
    token_ids: tuple[int, ...]
    block_table: tuple[int, ...]
    sample: bool
    sampling_params: SamplingParams
    num_output_tokens: int  # outputs already generated (for min_tokens)
    eos_token_id: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@fast_init
@dataclass(frozen=True)
class SchedulerOutput:
    """One step's work. ``num_padding_tokens`` pads a prefill chunk up to the fixed chunk size.

    ``finished_request_ids`` lists requests that ended since the previous output, so the executor can
    drop per-request state (e.g. sampling generators).
    """

    step_id: int
    kind: StepKind
    segments: tuple[ScheduledSegment, ...] = ()
    num_padding_tokens: int = 0
    preempted_request_ids: tuple[str, ...] = ()
    finished_request_ids: tuple[str, ...] = ()
    # Swap preemption (decode instances): before running the step, the executor first copies each
    # ``swapped_out`` request's blocks to host memory, then each ``swapped_in`` request's saved K/V into
    # its listed blocks. Both are empty unless a scheduler swaps.
    swapped_out: tuple[tuple[str, tuple[int, ...]], ...] = ()
    swapped_in: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.segments)

    @property
    def is_empty(self) -> bool:
        return not self.segments

    @property
    def is_decode_only(self) -> bool:
        """Non-empty, and every segment is one new token continuing a request (no prompt tokens)."""
        for s in self.segments:  # one plain loop: this runs once per decode step
            if len(s.token_ids) != 1 or s.start <= 0 or not s.sample:
                return False
        return bool(self.segments)


@fast_init
@dataclass(frozen=True)
class StepResult:
    """What the executor computed for one ``SchedulerOutput``.

    ``sampled_token_ids`` has one entry per segment with ``sample=True``.
    """

    step_id: int
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    elapsed_s: float = 0.0


def merge_steps(first: SchedulerOutput, second: SchedulerOutput) -> SchedulerOutput:
    """One forward for two schedulers' steps on the same instance (a prefill chunk with decodes riding along):
    ``first``'s step id, kind MIXED, both steps' segments and bookkeeping. ``split_result`` gives each scheduler
    its share of the result."""
    return SchedulerOutput(
        step_id=first.step_id, kind=StepKind.MIXED, segments=first.segments + second.segments,
        num_padding_tokens=first.num_padding_tokens + second.num_padding_tokens,
        preempted_request_ids=first.preempted_request_ids + second.preempted_request_ids,
        finished_request_ids=first.finished_request_ids + second.finished_request_ids,
        swapped_out=first.swapped_out + second.swapped_out, swapped_in=first.swapped_in + second.swapped_in,
    )


def split_result(result: StepResult, out: SchedulerOutput) -> StepResult:
    """The share of a merged step's ``result`` that belongs to one scheduler's ``out``: its step id and the
    samples of its own segments."""
    ids = {s.request_id for s in out.segments if s.sample}
    return StepResult(
        out.step_id,
        {r: t for r, t in result.sampled_token_ids.items() if r in ids},
        {r: lp for r, lp in result.logprobs.items() if r in ids},
        result.elapsed_s,
    )
