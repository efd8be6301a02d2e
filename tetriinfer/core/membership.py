"""One pool member's lifecycle, as the front end sees it: a single state instead of loose flags.

    STARTING --connected--> SERVING --remove--> DRAINING --Retired--> RETIRED
        |                      |  ^                 |
        +------exited----------+--+---give back-----+--exited (no Retired)--> DEAD

- STARTING: placed and started; not yet heard from and connected. Never routed or dispatched to (an added
  instance can report before the front end has connected to it).
- SERVING: connected; routed and dispatched to once it has reported.
- DRAINING: being removed: nothing new reaches it; it finishes (or hands over) what it holds. A drain that takes
  too long gives it back (-> SERVING) rather than kill what it holds.
- RETIRED: drained and told the front end so (``Retired``); its exit is expected.
- DEAD: exited without retiring -- from any live state, also while draining: the requests it held end with an
  error (a crash during a drain must not leave them hanging).

Invariants: RETIRED and DEAD are final; every other move not drawn above raises ``ValueError``. Pure: no clock
(``now`` is passed in), no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class MemberState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    RETIRED = "retired"
    DEAD = "dead"

    @property
    def final(self) -> bool:
        return self in (MemberState.RETIRED, MemberState.DEAD)


_ALLOWED: dict[MemberState, frozenset[MemberState]] = {
    MemberState.STARTING: frozenset({MemberState.SERVING, MemberState.DEAD}),
    MemberState.SERVING: frozenset({MemberState.DRAINING, MemberState.DEAD}),
    MemberState.DRAINING: frozenset({MemberState.SERVING, MemberState.RETIRED, MemberState.DEAD}),
    MemberState.RETIRED: frozenset(),
    MemberState.DEAD: frozenset(),
}


@dataclass
class Membership:
    state: MemberState = MemberState.STARTING
    since: float = 0.0  # when the current state began (the caller's clock)
    history: list[tuple[str, float]] = field(default_factory=list)  # (state, since), oldest first

    def to(self, new: MemberState, now: float) -> None:
        """Move to ``new``; ValueError if the lifecycle does not allow it (staying put is allowed for no state)."""
        if new not in _ALLOWED[self.state]:
            raise ValueError(f"member cannot go from {self.state.value} to {new.value}")
        self.history.append((self.state.value, self.since))
        self.state, self.since = new, now

    @property
    def serving(self) -> bool:
        return self.state is MemberState.SERVING

    @property
    def draining(self) -> bool:
        return self.state is MemberState.DRAINING
