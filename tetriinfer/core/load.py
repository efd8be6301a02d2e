"""Load-report value types: what every instance tells the cluster monitor (paper: every 100 ms).

A ``LoadReport`` is a plain immutable value; instances build them from their scheduler's state
(``PrefillScheduler.load_report``, ``DecodeScheduler.load_report``), the monitor aggregates and
broadcasts them, and the pure policies (dispatcher, global policy, flip policy) read them.

Conventions (the same for the real runtime and the simulator):
- prefill instance: ``num_queued`` = requests not yet fully prefilled, ``num_running`` = prefilled
  requests whose KV blocks are still held (waiting for / in KV transfer), ``tokens_in_flight`` =
  ``num_prefill_tokens`` = prompt tokens still to prefill;
- decode instance: ``num_queued`` = requests reserved but not yet runnable (KV arriving) plus preempted
  ones, ``num_running`` = requests decoding, ``tokens_in_flight`` = tokens held in the KV cache,
  ``num_prefill_tokens`` = prompt tokens of requests prefilled here (conditional disaggregation) and of
  preempted ones still to (re)compute;
- ``utilization`` = busy fraction of the instance since its previous report, in ``[0, 1]``.

Invariants (checked in ``__post_init__``): every count is ``>= 0``; ``0 <= utilization <= 1``.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tetriinfer.core.frozen import fast_init, replace_fields


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def other(self) -> Role:
        return Role.DECODE if self is Role.PREFILL else Role.PREFILL


class InstanceState(enum.Enum):
    ACTIVE = "active"  # accepts new work in its role
    DRAINING = "draining"  # no new work is routed to it; finishing what it has
    FLIPPING = "flipping"  # empty; switching role in place


DEFAULT_HEAVY_DECODE_TOKENS = 128  # paper: ShareGPT median output length


def is_heavy_decode(predicted_lower: int | None, threshold: int = DEFAULT_HEAVY_DECODE_TOKENS) -> bool:
    """Heavy decode = predicted output > ``threshold`` tokens, judged on the bucket's lower bound.

    A request without a prediction counts as light (nothing is known about it)."""
    return predicted_lower is not None and predicted_lower > threshold


@fast_init
@dataclass(frozen=True)
class LoadReport:
    instance_id: str
    role: Role
    state: InstanceState = InstanceState.ACTIVE
    time: float = 0.0  # the reporter's ``now`` when the report was built
    num_queued: int = 0
    num_running: int = 0
    num_free_blocks: int = 0
    num_used_blocks: int = 0
    block_size: int = 16
    tokens_in_flight: int = 0
    num_heavy_decodes: int = 0
    num_light_decodes: int = 0
    utilization: float = 0.0
    num_prefill_tokens: int = 0  # prompt tokens waiting to be prefilled here (decode: local prefills)
    step_inflation: float = 0.0  # decode: 1 - batch-1 step time / mean step time (core.step_inflation), in [0, 1]
    num_waiting_blocks: int = 0  # decode: blocks the requests waiting for admission (not yet reserved) need now

    def __post_init__(self) -> None:
        if (self.num_queued >= 0 and self.num_running >= 0 and self.num_free_blocks >= 0 and self.num_used_blocks >= 0
                and self.tokens_in_flight >= 0 and self.num_heavy_decodes >= 0 and self.num_light_decodes >= 0
                and self.num_prefill_tokens >= 0 and self.block_size >= 1 and 0.0 <= self.utilization <= 1.0
                and 0.0 <= self.step_inflation <= 1.0 and self.num_waiting_blocks >= 0):
            return  # all valid (the common case, one pass); otherwise name the first bad field below
        for name in ("num_queued", "num_running", "num_free_blocks", "num_used_blocks", "tokens_in_flight",
                     "num_heavy_decodes", "num_light_decodes", "num_prefill_tokens", "num_waiting_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"load report {self.instance_id!r}: {name} must be >= 0")
        if self.block_size < 1:
            raise ValueError(f"load report {self.instance_id!r}: block_size must be >= 1")
        if not 0.0 <= self.utilization <= 1.0:
            raise ValueError(f"load report {self.instance_id!r}: utilization must be in [0, 1]")
        if not 0.0 <= self.step_inflation <= 1.0:
            raise ValueError(f"load report {self.instance_id!r}: step_inflation must be in [0, 1]")

    @property
    def num_blocks(self) -> int:
        return self.num_free_blocks + self.num_used_blocks

    @property
    def kv_usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def load(self) -> float:
        """Load fraction used by the flip policy: ``max(utilization, kv_usage)``, in ``[0, 1]``."""
        return max(self.utilization, self.kv_usage)

    @property
    def accepting(self) -> bool:
        """Only ACTIVE instances receive new work."""
        return self.state is InstanceState.ACTIVE

    @property
    def is_empty(self) -> bool:
        """Nothing queued, nothing running, no KV block held: safe to switch role."""
        return self.num_queued == 0 and self.num_running == 0 and self.num_used_blocks == 0

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


LoadKey = tuple[float, int, int, str]


def load_key(report: LoadReport, extra_tokens: int = 0) -> LoadKey:
    """Sort key for "least loaded" (smaller is less loaded), deterministic via the instance id.

    Prefill: prompt tokens still to prefill (+ ``extra_tokens`` routed since the report), then queue
    length, then prefilled requests it still holds (staged for a transfer, or kept to decode there: a prompt
    waits for the decode step in flight and its chunks carry the kept decodes' rows). Decode: KV usage, then
    requests queued + running."""
    if report.role is Role.PREFILL:
        return (float(report.tokens_in_flight + extra_tokens), report.num_queued, report.num_running,
                report.instance_id)
    return (report.kv_usage, report.num_queued + report.num_running, 0, report.instance_id)


def accepting(reports: Iterable[LoadReport], role: Role, *, ordered: bool = True) -> list[LoadReport]:
    """The reports of ACTIVE instances of ``role``, sorted by instance id (``ordered=False``: in the order given,
    for a caller whose result does not depend on the order)."""
    active = InstanceState.ACTIVE
    out = [r for r in reports if r.role is role and r.state is active]
    if ordered:
        out.sort(key=_instance_id)
    return out


_instance_id = operator.attrgetter("instance_id")


def least_loaded(reports: Sequence[LoadReport]) -> LoadReport | None:
    return min(reports, key=load_key) if reports else None


def restamped(report: LoadReport, now: float) -> LoadReport:
    """``report`` as built at ``now`` instead: equal to ``replace_fields(report, time=now)`` (``time`` is not
    validated, and every other field was when ``report`` was built), without the constructor's call and checks.
    For a reporter whose every other field is known unchanged (``SimInstance.monitor_report``)."""
    fields = getattr(report, "__dict__", None)
    if fields is None:  # a native class of a compiled build: its constructor is the fast way
        r = report
        return LoadReport(r.instance_id, r.role, r.state, now, r.num_queued, r.num_running, r.num_free_blocks,
                          r.num_used_blocks, r.block_size, r.tokens_in_flight, r.num_heavy_decodes,
                          r.num_light_decodes, r.utilization, r.num_prefill_tokens, r.step_inflation,
                          r.num_waiting_blocks)
    new = object.__new__(LoadReport)
    d = new.__dict__
    d.update(fields)
    d["time"] = now
    return new


def prefill_instance_report(report: LoadReport, held: int) -> LoadReport:
    """A prefill scheduler's report for its instance: ``held`` prefilled requests whose KV the instance still
    holds outside the scheduler (staged for transfer, or kept to decode here) count as running. Used by the
    runtime's prefill worker and the simulator's prefill instance alike."""
    return replace_fields(report, num_running=report.num_running + held) if held else report


def decode_instance_report(report: LoadReport, waiting: int, waiting_prompt_tokens: int,
                           step_inflation: float, waiting_blocks: int = 0) -> LoadReport:
    """A decode scheduler's report for its instance: ``waiting`` requests not admitted yet (handoffs and local
    prefills waiting for blocks) count as queued, their prompt tokens (local prefills) as prefill work, the
    blocks they need to be admitted as ``num_waiting_blocks``, and the instance's step inflation
    (``core.step_inflation``) is attached. Used by the runtime and the simulator."""
    return replace_fields(report, num_queued=report.num_queued + waiting,
                               num_prefill_tokens=report.num_prefill_tokens + waiting_prompt_tokens,
                               step_inflation=step_inflation, num_waiting_blocks=waiting_blocks)
