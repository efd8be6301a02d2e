"""A KV handoff whose sender is gone or whose request already ended must not hold blocks at the receiver.

When a prefill instance dies right after sending a ``Handoff``, the front end sends the request again (as a
continuation, under a new engine id) and tells every survivor to ``Abort`` the old attempt. The decode instance gets
the ``Abort`` from the front end and the ``Handoff`` from the dead sender on different connections, so it may read
the ``Abort`` first (the same happens when a client goes away while its request is being dispatched). Shown, with
real role workers and KV tensors in one process (``tests.test_runtime_handoff.Node``):

- a ``Handoff`` that arrives after its request's ``Abort`` reserves no block and posts no memory; the sender is told
  ``KVDone`` (a live one frees its staged copy);
- a ``Handoff`` from a sender that is no longer in the peer table (dead and replaced, or retired) frees its
  reservation at once instead of waiting for transfer timeouts, and the decode instance does not fail.
"""

from __future__ import annotations

import time
from collections import deque

from tests.test_runtime_handoff import Node
from tetriinfer.core.load import InstanceState
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.runtime.messages import Abort, Handoff, KVDone, NewRequest, WireParams, decode


def _handoff(wire: deque) -> tuple[Node, Node, Handoff]:
    """A prefill and a decode node; the prefill node has prefilled ``one`` and sent its Handoff (returned, taken
    off the wire)."""
    p, d = Node("p", "prefill", wire, "request"), Node("d", "decode", wire, "request")
    p.worker.decode_loads = [d.worker.load_report(time.time(), 0.0, InstanceState.ACTIVE)]
    params = WireParams.from_params(SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0))
    p.worker.handle(NewRequest("one", [3] * 10, params, 0.0))
    assert p.worker.step()
    sent = [decode(data) for peer, data in wire if peer == "d"]
    wire.clear()
    assert [type(m) for m in sent] == [Handoff]
    return p, d, sent[0]


def _settle(d: Node, rounds: int = 20) -> None:
    for _ in range(rounds):
        d.worker.poll_transfers()
        d.worker.step()


def test_a_handoff_after_its_abort_reserves_nothing() -> None:
    wire: deque = deque()
    p, d, handoff = _handoff(wire)
    try:
        d.worker.handle(Abort("one"))  # the front end's abort overtook the dead (or slow) sender's Handoff
        d.worker.handle(handoff)
        _settle(d)
        assert d.ctx.kv_manager.num_used_blocks == 0 and d.worker.is_empty()
        assert not d.worker.receiver.receiving and d.backend.stats().active == 0
        told = [decode(data) for peer, data in wire if peer == "p"]
        assert [type(m) for m in told] == [KVDone] and not told[0].failed  # no KVReady: nothing posted
        p.worker.handle(told[0])  # a live sender that has not yet seen the abort frees its staged copy
        assert not p.worker.staged
        assert not [it for it in d.items() if it.request_id == "one"]  # nothing streamed for the ended attempt
    finally:
        for node in (p, d):
            node.backend.shutdown()


def test_a_handoff_from_a_sender_no_longer_in_the_peer_table_is_freed_at_once() -> None:
    wire: deque = deque()
    p, d, handoff = _handoff(wire)

    def send_peer(peer: str, msg: object) -> None:
        raise RuntimeError(f"unknown peer instance {peer!r}")  # as Instance._send_peer after a PeerTable update

    d.ctx.send_peer = send_peer  # type: ignore[assignment]
    try:
        d.worker.handle(handoff)
        _settle(d)
        assert d.ctx.kv_manager.num_used_blocks == 0 and d.worker.is_empty()
        assert not d.worker.receiver.receiving and d.backend.stats().active == 0
        d.worker.handle(Abort("one"))  # the front end's abort, later: nothing left to free
        assert d.ctx.kv_manager.num_used_blocks == 0
    finally:
        for node in (p, d):
            node.backend.shutdown()
