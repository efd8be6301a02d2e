"""Decentralized dispatcher at each prefill instance (TetriInfer section 3.4): choose a decode instance.

Input: the monitor's latest broadcast of decode load reports and one prefilled request's prompt length
and predicted output bucket. Only ACTIVE decode instances are candidates (draining/flipping ones are
skipped). Policies:

- ``length-aware`` (the paper's): split candidates into *alpha* (free KV blocks >= blocks for
  ``prompt + predicted lower bound``, capped at the instance's pool) and *beta*. Pick ``num_choices`` (default 2: power of two
  choices) at random from alpha and send to the one with the least interference: fewest decodes of
  this request's class (heavy or light), so each class is spread evenly and the heavy:light ratios
  stay even across instances (ties: fewer decodes, more free blocks, then the draw order). If alpha is empty: ``wait`` (no decision) or
  ``least-loaded`` over beta, as configured. With ``wait`` an instance's free blocks count net of what the requests
  already waiting there for admission need (``num_waiting_blocks``): a request is sent only where it can be admitted
  now, and otherwise stays (staged) at its prefill instance, which may decode it itself (``core.keep_decode``).
  Invariant: an instance in beta is never chosen while alpha is non-empty.
- ``random``, ``round-robin``, ``least-loaded``: length-unaware ablations over all candidates.
- ``imbalanced``: the hotspot the paper avoids, for ablations: every heavy decode goes to the first
  candidate (by id), light ones round-robin over the others.

Deterministic given ``seed``: the only randomness is the dispatcher's own ``random.Random``.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tetriinfer.core.frozen import python_class, replace_fields
from tetriinfer.core.load import (
    DEFAULT_HEAVY_DECODE_TOKENS,
    LoadReport,
    Role,
    accepting,
    is_heavy_decode,
    least_loaded,
)


class DispatchPolicy(enum.Enum):
    LENGTH_AWARE = "length-aware"
    RANDOM = "random"
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"
    IMBALANCED = "imbalanced"


class AlphaEmptyAction(enum.Enum):
    WAIT = "wait"
    LEAST_LOADED = "least-loaded"


@dataclass(frozen=True)
class DispatcherConfig:
    policy: DispatchPolicy | str = DispatchPolicy.LENGTH_AWARE
    heavy_decode_tokens: int = DEFAULT_HEAVY_DECODE_TOKENS
    alpha_empty: AlphaEmptyAction | str = AlphaEmptyAction.LEAST_LOADED
    num_choices: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "policy", DispatchPolicy(self.policy))
        except ValueError:
            names = ", ".join(p.value for p in DispatchPolicy)
            raise ValueError(f"unknown dispatch policy {self.policy!r}; choose one of: {names}") from None
        try:
            object.__setattr__(self, "alpha_empty", AlphaEmptyAction(self.alpha_empty))
        except ValueError:
            raise ValueError(f"alpha_empty must be 'wait' or 'least-loaded', got {self.alpha_empty!r}") from None
        if self.heavy_decode_tokens < 0:
            raise ValueError(f"heavy_decode_tokens must be >= 0, got {self.heavy_decode_tokens}")
        if self.num_choices < 1:
            raise ValueError(f"num_choices must be >= 1, got {self.num_choices}")


@dataclass(frozen=True)
class DispatchDecision:
    """``instance_id`` is None when the request must wait (no candidate, or alpha empty with WAIT).
    ``alpha`` lists the alpha set (length-aware only); ``choices`` the instances drawn at random."""

    instance_id: str | None
    reason: str
    heavy: bool
    alpha: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()


@python_class  # ``Dispatcher.charge`` derives views with ``__new__``
class _DecodeView:
    """What ``choose`` derives from one decode-loads sequence, kept while the same sequence is passed again.

    Invariants: ``cands == accepting(loads, Role.DECODE)``; ``ids`` their instance ids in that order; ``pos`` maps
    an instance id to its index in ``loads`` and ``cand_pos`` to its index in ``cands``; ``min_free`` is the least
    ``num_free_blocks`` among ``cands``, ``min_room`` the least ``num_free_blocks - num_waiting_blocks``, and
    ``block_size`` their common block size (None if they differ or there are none); ``mins`` maps a key function to
    ``min(cands, key=key)`` once asked (``min_candidate``)."""

    __slots__ = ("loads", "size", "cands", "ids", "pos", "cand_pos", "min_free", "min_room", "block_size", "mins")

    def __init__(self, loads: Sequence[LoadReport], cands: list[LoadReport], ids: tuple[str, ...],
                 pos: dict[str, int], cand_pos: dict[str, int]) -> None:
        self.loads, self.size, self.cands, self.ids, self.pos, self.cand_pos = loads, len(loads), cands, ids, pos, cand_pos
        self.min_free = min((r.num_free_blocks for r in cands), default=0)
        self.min_room = min((r.num_free_blocks - r.num_waiting_blocks for r in cands), default=0)
        sizes = {r.block_size for r in cands}
        self.block_size = sizes.pop() if len(sizes) == 1 else None
        self.mins: dict[Callable[[LoadReport], Any], LoadReport] = {}

    def min_candidate(self, key: Callable[[LoadReport], Any]) -> LoadReport | None:
        """``min(self.cands, key=key)`` (None without candidates), computed once per view and key. ``key`` must
        order candidates totally (end with the instance id): a view derived by ``Dispatcher.charge`` gets it from
        its parent's in O(1) unless the charged instance was the minimum."""
        best = self.mins.get(key)
        if best is None and self.cands:
            best = self.mins[key] = min(self.cands, key=key)
        return best


class DecodeViews:
    """A cache of ``_DecodeView`` by loads sequence, shareable by every dispatcher that reads the same broadcasts
    (the simulator's prefill instances all receive one list per report interval).

    A sequence is recognized by identity (the cache holds it, so its id cannot be reused) and length: callers must
    not mutate a sequence in place after passing it (a load broadcast is a new list; ``Dispatcher.charge`` makes a
    new one). Holds the ``capacity`` most recently added views; a miss only costs the view's O(I log I) build."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._views: dict[int, _DecodeView] = {}

    def get(self, loads: Sequence[LoadReport]) -> _DecodeView:
        view = self._views.get(id(loads))
        if view is not None and view.loads is loads and view.size == len(loads):
            return view
        cands = accepting(loads, Role.DECODE)
        pos: dict[str, int] = {}
        for i, r in enumerate(loads):
            pos.setdefault(r.instance_id, i)  # the first report of an id, as ``charge_dispatch`` finds it
        view = _DecodeView(loads, cands, tuple(r.instance_id for r in cands), pos,
                           {r.instance_id: i for i, r in enumerate(cands)})
        if len(view.cand_pos) != len(cands):  # an id twice among the candidates: never derived from (see charge)
            view.cand_pos = {}
        self._put(view)
        return view

    def _put(self, view: _DecodeView) -> None:
        views = self._views
        views.pop(id(view.loads), None)
        views[id(view.loads)] = view
        if len(views) > self.capacity:
            del views[next(iter(views))]


class Dispatcher:
    """Owns only its random generator and round-robin cursor; reads load reports, never mutates them.

    ``views``: where it keeps what it derives from a loads sequence (share one among dispatchers that read the same
    broadcasts); decisions are the same with or without a hit."""

    def __init__(self, config: DispatcherConfig, views: DecodeViews | None = None) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._rr = 0
        self._views = views if views is not None else DecodeViews(capacity=4)

    @property
    def views(self) -> DecodeViews:
        """Where this dispatcher keeps what it derives from loads sequences (``should_keep`` reads them too)."""
        return self._views

    def charge(self, loads: Sequence[LoadReport], decode_id: str, num_tokens: int,
               predicted_lower: int | None) -> list[LoadReport]:
        """``charge_dispatch`` with this dispatcher's heavy threshold (the same new list), in O(I) list copies
        only: the instance is found through the view of ``loads``, and the new list's view is derived from it."""
        view = self._views.get(loads)
        i = view.pos.get(decode_id)
        out = list(loads)
        if i is None:
            return out
        r = _charged(loads[i], num_tokens, predicted_lower, self.config.heavy_decode_tokens)
        out[i] = r
        j = view.cand_pos.get(decode_id)
        if j is not None and view.cands[j] is loads[i]:  # the charged report is a candidate: derive its view
            cands = list(view.cands)
            cands[j] = r
            derived = _DecodeView.__new__(_DecodeView)
            derived.loads, derived.size, derived.cands, derived.ids = out, len(out), cands, view.ids
            derived.pos, derived.cand_pos, derived.block_size = view.pos, view.cand_pos, view.block_size
            derived.min_free = min(view.min_free, r.num_free_blocks)
            derived.min_room = min(view.min_room, r.num_free_blocks - r.num_waiting_blocks)
            # the other candidates are unchanged: a known minimum that is not the charged instance stays a
            # candidate for it, against the charged report (keys are total orders: ties cannot arise)
            derived.mins = {key: min(best, r, key=key) for key, best in view.mins.items()
                            if best.instance_id != decode_id}
            self._views._put(derived)
        return out

    def choose(
        self, loads: Sequence[LoadReport], prompt_tokens: int, predicted_lower: int | None = None,
    ) -> DispatchDecision:
        """Pick a decode instance for a request with ``prompt_tokens`` of context and the predicted
        bucket's lower bound ``predicted_lower`` (None: no prediction; light, need = prompt + 1)."""
        if prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
        cfg = self.config
        heavy = is_heavy_decode(predicted_lower, cfg.heavy_decode_tokens)
        view = self._views.get(loads)
        cands = view.cands
        if not cands:
            return DispatchDecision(None, "no active decode instance", heavy)
        policy = cfg.policy
        if policy is DispatchPolicy.RANDOM:
            return DispatchDecision(self._rng.choice(cands).instance_id, "random", heavy)
        if policy is DispatchPolicy.ROUND_ROBIN:
            pick = cands[self._rr % len(cands)]
            self._rr += 1
            return DispatchDecision(pick.instance_id, "round-robin", heavy)
        if policy is DispatchPolicy.LEAST_LOADED:
            return DispatchDecision(least_loaded(cands).instance_id, "least-loaded", heavy)  # type: ignore[union-attr]
        if policy is DispatchPolicy.IMBALANCED:
            if heavy or len(cands) == 1:
                return DispatchDecision(cands[0].instance_id, "imbalanced: heavy hotspot", heavy)
            pick = cands[1 + self._rr % (len(cands) - 1)]
            self._rr += 1
            return DispatchDecision(pick.instance_id, "imbalanced: light", heavy)
        return self._length_aware(view, prompt_tokens, predicted_lower, heavy)

    def _length_aware(
        self, view: _DecodeView, prompt_tokens: int, predicted_lower: int | None, heavy: bool,
    ) -> DispatchDecision:
        cands = view.cands
        decode_tokens = max(1, predicted_lower or 0)
        # A need above an instance's whole pool is capped at the pool (as the decode reservation is):
        # an empty instance is always in alpha, so a request never waits for memory that cannot exist.
        need = prompt_tokens + decode_tokens  # tokens; each instance's blocks_for_tokens, inline (one pass per request)
        wait = self.config.alpha_empty is AlphaEmptyAction.WAIT
        least_room = view.min_room if wait else view.min_free
        if view.block_size is not None and least_room >= -(-need // view.block_size):
            alpha, alpha_ids = cands, view.ids  # every candidate has the blocks: no scan
        else:  # with wait, only where it is admitted now: free blocks net of what already waits there
            alpha = [
                r for r in cands
                if r.num_free_blocks - (r.num_waiting_blocks if wait else 0)
                >= min(r.num_free_blocks + r.num_used_blocks, -(-need // r.block_size))
            ]
            alpha_ids = tuple(r.instance_id for r in alpha)
        if not alpha:
            if wait:
                return DispatchDecision(None, "alpha empty: wait", heavy)
            pick = least_loaded(cands)
            assert pick is not None
            return DispatchDecision(pick.instance_id, "alpha empty: least-loaded", heavy)
        choices = self._rng.sample(alpha, min(self.config.num_choices, len(alpha)))

        def interference(item: tuple[int, LoadReport]) -> tuple[int, int, int, int]:
            draw, r = item
            same_class = r.num_heavy_decodes if heavy else r.num_light_decodes
            return (same_class, r.num_heavy_decodes + r.num_light_decodes, -r.num_free_blocks, draw)

        _, best = min(enumerate(choices), key=interference)
        return DispatchDecision(
            best.instance_id, "length-aware", heavy, alpha_ids, tuple(r.instance_id for r in choices)
        )


def charge_dispatch(
    loads: Sequence[LoadReport], decode_id: str, num_tokens: int, predicted_lower: int | None,
    heavy_decode_tokens: int = DEFAULT_HEAVY_DECODE_TOKENS,
) -> list[LoadReport]:
    """The dispatcher's view after sending a request of ``num_tokens`` (context) to ``decode_id``: that
    instance's report charged optimistically (blocks for the context plus the predicted lower bound, one more
    queued request of its class) until its next real report, so a burst between two broadcasts is spread
    instead of herding onto one instance. Returns new reports; the inputs are not mutated."""
    out = list(loads)
    for i, r in enumerate(out):
        if r.instance_id == decode_id:
            out[i] = _charged(r, num_tokens, predicted_lower, heavy_decode_tokens)
            break
    return out


def _charged(r: LoadReport, num_tokens: int, predicted_lower: int | None, heavy_decode_tokens: int) -> LoadReport:
    """``r`` charged for one dispatched request (see ``charge_dispatch``)."""
    need = min(r.num_free_blocks, r.blocks_for_tokens(num_tokens + max(1, predicted_lower or 1)))
    heavy = (predicted_lower or 0) > heavy_decode_tokens
    return replace_fields(
        r,
        num_free_blocks=r.num_free_blocks - need,
        num_used_blocks=r.num_used_blocks + need,
        num_queued=r.num_queued + 1,
        num_heavy_decodes=r.num_heavy_decodes + int(heavy),
        num_light_decodes=r.num_light_decodes + int(not heavy),
    )
