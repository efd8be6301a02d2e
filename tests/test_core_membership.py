"""A pool member's lifecycle (core.membership): the moves the front end makes, and the ones it must never make."""

from __future__ import annotations

import itertools

import pytest

from tetriinfer.core.membership import Membership, MemberState

S = MemberState
LEGAL = {(S.STARTING, S.SERVING), (S.STARTING, S.DEAD), (S.SERVING, S.DRAINING), (S.SERVING, S.DEAD),
         (S.DRAINING, S.SERVING), (S.DRAINING, S.RETIRED), (S.DRAINING, S.DEAD)}


def test_a_removal_that_drains_and_one_that_is_given_back() -> None:
    m = Membership()
    assert m.state is S.STARTING and not m.serving
    m.to(S.SERVING, 1.0)
    m.to(S.DRAINING, 2.0)
    assert m.draining and not m.serving
    m.to(S.SERVING, 3.0)  # the drain took too long: it keeps serving
    m.to(S.DRAINING, 4.0)
    m.to(S.RETIRED, 5.0)
    assert m.state.final and m.since == 5.0
    assert [h[0] for h in m.history] == ["starting", "serving", "draining", "serving", "draining"]


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(S, S)))
def test_only_the_drawn_moves_are_allowed(src: MemberState, dst: MemberState) -> None:
    m = Membership(state=src)
    if (src, dst) in LEGAL:
        m.to(dst, 1.0)
        assert m.state is dst
    else:
        with pytest.raises(ValueError, match="cannot go"):
            m.to(dst, 1.0)
        assert m.state is src


def test_final_states_and_a_crash_while_draining() -> None:
    m = Membership(state=S.DRAINING)
    m.to(S.DEAD, 1.0)  # crashed mid-drain: its requests must end with an error
    assert m.state.final and S.RETIRED.final and not S.DRAINING.final
