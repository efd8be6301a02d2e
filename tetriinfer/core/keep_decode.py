"""Decode at a prefill instance (the reverse of conditional disaggregation): pure keep-or-dispatch rule.

On a small cluster a fixed prefill/decode split leaves one side idle: with light prompts and long outputs
(LPHD) the prefill instance is mostly idle while the decode instance's batch grows past the size where a
decode step is still memory-bound (on a CPU that is a handful of rows). A prefill instance may then *keep*
a request it just prefilled and decode it itself (no KV transfer), with prefill keeping priority there: its
own decodes only run in steps where no prompt is queued.

The rule, for a request that has just been prefilled (first token sampled):
keep iff enabled, no other prompt is queued here (during a burst the prefill instance stays a prefill
instance), fewer than ``max_running`` kept decodes run here, the kept decodes' KV at full length (prompt +
``max_tokens``) stays within ``max_kv_fraction`` of this instance's pool, and
``own_running + 1 <= ratio * least`` where ``least`` = requests (running + queued) at the least-loaded
ACTIVE decode instance. With ``ratio`` r the prefill instance carries about r / (1 + r) of the decodes in
steady state; an idle decode tier (``least`` = 0) gets every request (disaggregation is the better choice
whenever the decode side has room).

The ``cost`` rule (``rule="cost"``, the P:D controller's default): keep when the decode tier's memory is the
bottleneck and this instance has room, i.e. iff no prompt is queued here, the least KV-pressured ACTIVE decode
instance would be at least ``min_decode_pressure`` with this request added (``core.pd_controller.kv_pressure``
+ its blocks), and this instance's kept decodes at full length, this one included, would fill a smaller share
of its pool than that (and at most ``cost_max_kv_fraction`` of it). A decode tier with memory to spare gets
every request (no interference with prompts here); a full one shares its decodes with the prefill instance,
which a fixed split cannot do (on two instances a 1:1 split halves the KV capacity for decodes). The same
holds for compute: when the least loaded decode instance's steps are inflated by batching (``step_inflation``
at least ``min_step_inflation``), a request is kept while this instance runs fewer kept decodes than that
instance runs decodes (and its kept KV stays below half its pool, or the decode tier's pressure if higher).
A lone prefill instance (fewer than two ACTIVE prefill instances) is every prompt's only way in: each decode step
it runs for a kept request delays the prompts that arrive meanwhile, and its own busy time grows by a whole
step's weight read, while the decode tier adds the same row to a step it runs anyway. There it shares the batch
for compute only once the decode tier's steps take at least twice a batch-1 step (``lone_min_step_inflation``
0.5: batching is no longer nearly free); beside a prompt-only prefill instance prompts have a free path, and
``min_step_inflation`` applies.

What the kept decodes commit of this instance's pool (``keep_commitment``, ``KeepDecodeConfig.commitment``):
``full`` counts every kept decode at its full length (prompt + ``max_tokens``) at once, as if all reached it
together; ``peak`` (the cost rule's default) counts the most blocks they hold at any one step if each decodes
one token per step until it reaches its full length and ends (``kv_peak_blocks``): the kept decodes that end
first give their blocks back before the longer ones reach their peak, so a pool committed by ``full`` sits
partly idle while requests wait for a decode slot (bursts of long prompts with long answers on a small pool).
Both are upper bounds on what the kept decodes will hold (``max_tokens`` bounds each request's length), so
neither lets kept decodes preempt each other.

A prompt-only prefill instance (``KeepDecodeConfig.prompt_instance``, on by default under the cost rule): with two or
more ACTIVE prefill instances, the first of them in id order (``prompt_only_instance``) keeps no decodes. A prefill
instance that keeps decodes steps them whenever no prompt is queued, so a prompt that reaches it waits for the
decode step in flight (about a whole weight read on an accelerator, ~22 ms for a 13B model on an A100) and its
chunks carry the kept rows; the least-loaded routing (``core.load.load_key``) sends a prompt to the instance holding
fewer prefilled requests when backlogs tie, i.e. to the prompt-only one when it is free. One prefill instance cannot
be spared (a single one keeps as before).

The prompt-only instance prefills most prompts (it is picked when backlogs tie), so a keeping instance that only kept
what it prefilled itself would keep few of them while the decode instances batch more rows than colocated ones.
With ``offer_to_keepers`` (``--keep-offer``) the prompt-only instance offers each request it prefilled to the
keeping prefill instances (``keep_offer_targets``) before the decode tier: the one that would keep it by the same
rule, judged on its own state when the offer arrives, reserves its blocks and takes its KV over the link as a decode
instance would; one refused by all goes to the decode tier.

With chunk-wise KV transfer (``--kv-transfer chunk``) a request's decode instance is chosen when its first chunk
starts, after which it can no longer be kept; the prefill instance asks this rule at that moment too (the request
itself not counted as a queued prompt): a request it would keep opens no transfer and is decided again once
prefilled, one it would not keep streams to a decode instance.

Invariants: pure (``decode_loads`` and counts are passed in); never keeps while prompts wait here; never
commits more than ``max_kv_fraction`` (``cost_max_kv_fraction`` under the cost rule) of the pool to kept
decodes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tetriinfer.core.dispatcher import DecodeViews
from tetriinfer.core.load import LoadReport, Role, accepting
from tetriinfer.core.pd_controller import kv_pressure
from tetriinfer.core.request import Request

KEEP_RULES = ("ratio", "cost")
KEEP_COMMITMENTS = ("full", "peak")


@dataclass(frozen=True)
class KeepDecodeConfig:
    enabled: bool = False
    ratio: float = 0.5
    max_running: int = 32
    max_kv_fraction: float = 0.5
    rule: str = "ratio"  # ratio | cost (see the module docstring)
    min_decode_pressure: float = 0.5
    min_step_inflation: float = 0.0
    lone_min_step_inflation: float = 0.5  # the cost rule's compute threshold at a lone prefill instance
    cost_max_kv_fraction: float = 0.9
    # what kept decodes commit of the pool (module docstring): full | peak; None: peak under the cost rule, else full
    commitment: str | None = None
    # one of two or more prefill instances keeps no decodes (module docstring); None: on under the cost rule
    prompt_instance: bool | None = None
    # the prompt-only instance offers what it prefills to the keeping ones (module docstring)
    offer_to_keepers: bool = False

    def __post_init__(self) -> None:
        if self.rule not in KEEP_RULES:
            raise ValueError(f"keep-decode rule must be one of {', '.join(KEEP_RULES)}, got {self.rule!r}")
        if self.commitment is None:
            object.__setattr__(self, "commitment", "peak" if self.rule == "cost" else "full")
        if self.prompt_instance is None:
            object.__setattr__(self, "prompt_instance", self.rule == "cost")
        if self.commitment not in KEEP_COMMITMENTS:
            raise ValueError(f"keep-decode commitment must be one of {', '.join(KEEP_COMMITMENTS)}, "
                             f"got {self.commitment!r}")
        if not 0.0 <= self.min_decode_pressure <= 2.0:
            raise ValueError(f"keep-decode min_decode_pressure must be in [0, 2], got {self.min_decode_pressure}")
        if not 0.0 <= self.min_step_inflation <= 1.0:
            raise ValueError(f"keep-decode min_step_inflation must be in [0, 1], got {self.min_step_inflation}")
        if not 0.0 <= self.lone_min_step_inflation <= 1.0:
            raise ValueError("keep-decode lone_min_step_inflation must be in [0, 1], "
                             f"got {self.lone_min_step_inflation}")
        if not 0.0 < self.cost_max_kv_fraction <= 1.0:
            raise ValueError(f"keep-decode cost_max_kv_fraction must be in (0, 1], got {self.cost_max_kv_fraction}")
        if not self.ratio > 0:
            raise ValueError(f"keep-decode ratio must be > 0, got {self.ratio}")
        if self.max_running < 1:
            raise ValueError(f"keep-decode max_running must be >= 1, got {self.max_running}")
        if not 0.0 < self.max_kv_fraction <= 1.0:
            raise ValueError(f"keep-decode max_kv_fraction must be in (0, 1], got {self.max_kv_fraction}")


def prompt_only_instance(prefill_ids: Iterable[str]) -> str | None:
    """The prefill instance that keeps no decodes under ``KeepDecodeConfig.prompt_instance``: the first of the ACTIVE
    prefill instances ``prefill_ids`` in id order when there are two or more, else None (a lone prefill instance
    keeps).

    A tuple's answer is remembered for the very same tuple object (immutable: the answer cannot change; held, so
    its id is not reused): a caller that passes one tuple per monitor broadcast (the simulator's prefill
    instances, once per prefilled request) pays the O(I log I) sort once per broadcast, not per request."""
    memo = _prompt_only_memo
    if memo[0] is prefill_ids:
        return memo[1]
    ids = sorted(set(prefill_ids))
    answer = ids[0] if len(ids) >= 2 else None
    if prefill_ids.__class__ is tuple:
        _remember_prompt_only(prefill_ids, answer)  # type: ignore[arg-type]
    return answer


_prompt_only_memo: tuple[tuple[str, ...] | None, str | None] = (None, None)  # (the last tuple asked about, answer)


def _remember_prompt_only(prefill_ids: tuple[str, ...], answer: str | None) -> None:
    global _prompt_only_memo
    _prompt_only_memo = (prefill_ids, answer)  # one assignment: a reader sees the old pair or the new one


def keep_offer_targets(config: KeepDecodeConfig, instance_id: str, prefill_ids: Iterable[str]) -> tuple[str, ...]:
    """The prefill instances ``instance_id`` offers a request it just prefilled to, in order, before the decode tier
    (``KeepDecodeConfig.offer_to_keepers``): when keep-decode is on and ``instance_id`` is the
    ``prompt_only_instance`` of the ACTIVE prefill instances ``prefill_ids``, the others (the ones that keep) in id
    order; else none. Each decides with its own ``should_keep`` when the offer arrives (its kept decodes, its queue,
    its pool, its view of the decode tier) and takes the KV over the link as a decode instance would; a request
    every one of them refuses is dispatched to the decode tier as before."""
    if not (config.enabled and config.prompt_instance and config.offer_to_keepers):
        return ()
    ids = sorted(set(prefill_ids))
    if instance_id != prompt_only_instance(ids):
        return ()
    return tuple(i for i in ids if i != instance_id)


def keep_row(req: Request, max_model_len: int) -> tuple[int, int]:
    """``req`` as ``keep_commitment`` counts it: (tokens it holds KV for now, most tokens it may still add), its
    full length being prompt + ``max_tokens`` within the model's context."""
    now = req.num_tokens
    full = max(now, min(req.num_prompt_tokens + req.sampling_params.max_tokens, max_model_len))
    return now, full - now


def kv_peak_blocks(rows: Iterable[tuple[int, int]], block_size: int) -> int:
    """The most KV blocks ``rows`` = (tokens now, tokens still to add) hold at one step if each adds one token per
    step until it has added all and then ends (freeing its blocks).

    Usage only grows between two ends, so the peak is at a step ``t`` where a row reaches its full length: the rows
    with at least ``t`` tokens to add then hold ``now + t`` tokens each. Each row's blocks are counted as
    ``(tokens + block_size - 1) / block_size`` summed before flooring, so the result is at least the exact block
    count (above it by less than one block per row) and never more than every row at its full length at once.
    O(n log n) for n rows."""
    ordered = sorted(rows, key=lambda r: -r[1])
    peak = held_now = 0
    for k, (now, left) in enumerate(ordered, start=1):
        held_now += now
        # rows 1..k are the ones with at least ``left`` tokens to add (ties are complete at the last of them)
        peak = max(peak, (held_now + k * left + k * (block_size - 1)) // block_size)
    full = sum((now + left + block_size - 1) // block_size for now, left in ordered)
    return min(peak, full)


def keep_commitment(config: KeepDecodeConfig, kept: Iterable[tuple[int, int]], row: tuple[int, int],
                    block_size: int) -> tuple[int, int]:
    """``should_keep``'s ``own_committed_blocks`` and ``request_blocks`` for a request ``row`` (``keep_row``) at an
    instance whose kept decodes are ``kept``: ``request_blocks`` = the request's blocks at its full length;
    ``own_committed_blocks`` = what the kept decodes commit under ``config.commitment`` (every one at its full
    length, or the peak of the kept decodes and this request together, less ``request_blocks``), so that their
    sum is what keeping the request would commit."""
    req_blocks = (row[0] + row[1] + block_size - 1) // block_size
    rows = list(kept)
    if config.commitment == "peak":
        return max(0, kv_peak_blocks([*rows, row], block_size) - req_blocks), req_blocks
    return sum((now + left + block_size - 1) // block_size for now, left in rows), req_blocks


def should_keep(
    config: KeepDecodeConfig,
    *,
    own_running: int,
    own_queued: int,
    own_committed_blocks: int,
    request_blocks: int,
    pool_blocks: int,
    decode_loads: Sequence[LoadReport],
    views: DecodeViews | None = None,
    instance_id: str | None = None,
    prefill_ids: Sequence[str] = (),
) -> bool:
    """Keep this just-prefilled request here? ``own_committed_blocks`` = blocks the kept decodes need at full
    length; ``request_blocks`` = this request's blocks at full length (prompt + max_tokens).

    ``views``: the dispatcher's (``Dispatcher.views``): the ACTIVE decode instances and the least loaded of them
    are then read from the view of ``decode_loads`` (O(1) once known, also after ``Dispatcher.charge``) instead
    of a sort and a scan per request; the decision is the same either way.

    ``instance_id`` / ``prefill_ids``: this instance and the ACTIVE prefill instances as the monitor last reported
    them; under ``config.prompt_instance`` the ``prompt_only_instance`` of them keeps nothing."""
    if not config.enabled or own_queued > 0 or own_running >= config.max_running or pool_blocks < 1:
        return False
    if config.prompt_instance and instance_id is not None and instance_id == prompt_only_instance(prefill_ids):
        return False
    cap = config.cost_max_kv_fraction if config.rule == "cost" else config.max_kv_fraction
    if own_committed_blocks + request_blocks > cap * pool_blocks:
        return False
    view = views.get(decode_loads) if views is not None else None
    active = view.cands if view is not None else accepting(decode_loads, Role.DECODE)
    if not active:
        return False  # no decode tier to compare with: the dispatcher's own waiting rule applies
    if config.rule == "cost":
        least = view.min_candidate(_pressure_key) if view is not None else min(active, key=_pressure_key)
        assert least is not None
        kv_after = kv_pressure(least) + request_blocks / max(1, least.num_blocks)
        own_after = (own_committed_blocks + request_blocks) / pool_blocks
        if kv_after >= config.min_decode_pressure and own_after < kv_after:
            return True  # memory-bound decode tier: share the pools
        lone = prompt_only_instance(prefill_ids) is None  # no other prefill instance takes the prompts
        min_inflation = config.lone_min_step_inflation if lone else config.min_step_inflation
        return (least.step_inflation >= min_inflation and own_after < max(kv_after, 0.5)
                and own_running + 1 <= least.num_running)  # compute-bound: share the batch
    if view is not None:
        fewest = view.min_candidate(_requests_key)
        assert fewest is not None
        least_requests = fewest.num_running + fewest.num_queued
    else:
        least_requests = min(r.num_running + r.num_queued for r in active)
    return own_running + 1 <= config.ratio * least_requests


def _pressure_key(r: LoadReport) -> tuple[float, int, str]:
    """The cost rule's "least loaded decode instance": least KV pressure, then fewest requests, then id."""
    return (kv_pressure(r), r.num_running + r.num_queued, r.instance_id)


def _requests_key(r: LoadReport) -> tuple[int, str]:
    """The ratio rule's "least loaded": fewest requests (running + queued), then id."""
    return (r.num_running + r.num_queued, r.instance_id)
