"""A KV handoff whose sender is gone or whose request already ended must not hold blocks at the receiver.

When a prefill instance dies right after sending a ``Handoff``, the front end sends the request again (as a
continuation, under a new engine id) and tells every survivor to ``Abort`` the old attempt. The decode instance gets
the ``Abort`` from the front end and the ``Handoff`` from the dead sender on different connections, so it may read
the ``Abort`` first (the same happens when a client goes away while its request is being dispatched). Shown, with
real role workers and KV tensors in one process (``tests.test_runtime_handoff.Node``):

- a ``Handoff`` that arrives after its request's ``Abort`` reserves no block and posts no memory; the sender is told
  ``KVDone`` (a live one frees its staged copy);
- a ``Handoff`` from a sender that is no longer in the peer table (dead and replaced, or retired) frees its
  reservation at once instead of waiting for transfer timeouts, and the decode instance does not fail;
- a prefill instance whose chosen decode instance left the peer table (its load report was older than the death)
  does not fail either: the request goes to a live decode instance, whole, and every block is freed.
"""

from __future__ import annotations

import time
from collections import deque

import pytest

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


def _run_to_end(nodes: dict[str, Node], rid: str, rounds: int = 400) -> list[int]:
    """Deliver the wire and step every node until ``rid`` has finished; its streamed token ids."""
    wire = next(iter(nodes.values())).wire
    for _ in range(rounds):
        while wire:
            peer, data = wire.popleft()
            if peer in nodes:
                nodes[peer].worker.handle(decode(data))
        for node in nodes.values():
            if hasattr(node.worker, "poll_transfers"):
                node.worker.poll_transfers()
            node.worker.step()
        items = [it for node in nodes.values() for it in node.items() if it.request_id == rid]
        if any(it.finished for it in items):
            return [t for it in sorted(items, key=lambda it: it.index) for t in it.token_ids]
        time.sleep(0.001)
    raise AssertionError(f"{rid} never finished")


@pytest.mark.parametrize(("kv_transfer", "gone_at"), [("chunk", "dispatch"), ("request", "dispatch"),
                                                      ("chunk", "mid_stream")])  # per-request has no stream
def test_a_decode_instance_gone_from_the_peer_table_does_not_fail_the_prefill_instance(
        kv_transfer: str, gone_at: str) -> None:
    wire: deque = deque()
    p, d = Node("p", "prefill", wire, kv_transfer), Node("d", "decode", wire, kv_transfer)
    x = Node("x", "decode", wire, kv_transfer)  # the decode instance that dies
    for node in (p, d, x):
        node.wire = wire  # type: ignore[attr-defined]
    gone: set[str] = set()
    send = p.ctx.send_peer

    def send_peer(peer: str, msg: object) -> None:
        if peer in gone:
            raise RuntimeError(f"unknown peer instance {peer!r}")  # as Instance._send_peer after a PeerTable update
        send(peer, msg)

    p.ctx.send_peer = send_peer  # type: ignore[assignment]
    try:
        if gone_at == "dispatch":
            gone.add("x")
        p.worker.decode_loads = [x.worker.load_report(time.time(), 0.0, InstanceState.ACTIVE)]
        params = WireParams.from_params(SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0))
        p.worker.handle(NewRequest("one", [3] * 80, params, 0.0))  # three 32-token chunks
        assert p.worker.step()  # the first chunk: the stream (chunk-wise) would open to x here
        if gone_at == "mid_stream":
            assert "one" in p.worker.streams and p.worker.streams["one"].decode_id == "x"
            wire.clear()  # x died with what it was sent
            gone.add("x")
        for _ in range(4):
            p.worker.step()
        assert all(r.instance_id != "x" for r in p.worker.decode_loads)  # x is out of dispatch
        dispatched = [m.decode_id for m in p.front if type(m).__name__ == "Dispatched"]
        assert "x" not in dispatched[1 if gone_at == "mid_stream" else 0:]
        p.worker.decode_loads = [d.worker.load_report(time.time(), 0.0, InstanceState.ACTIVE)]  # the next broadcast
        tokens = _run_to_end({"p": p, "d": d}, "one")
        assert len(tokens) == 5
        assert [m.decode_id for m in p.front if type(m).__name__ == "Dispatched"][-1] == "d"
        for _ in range(50):  # the prefill side frees its copy once d says KVDone
            while wire:
                peer, data = wire.popleft()
                if peer in ("p", "d"):
                    {"p": p, "d": d}[peer].worker.handle(decode(data))
            p.worker.step()
            d.worker.step()
            if p.ctx.kv_manager.num_used_blocks == 0 and not p.worker.staged and not p.worker.streams:
                break
        assert p.ctx.kv_manager.num_used_blocks == 0 and not p.worker.staged and not p.worker.streams
        assert d.ctx.kv_manager.num_used_blocks == 0 and d.worker.is_empty()
    finally:
        for node in (p, d, x):
            node.backend.shutdown()
