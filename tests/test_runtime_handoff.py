"""The prefill -> decode handoff between two real role workers in one process: real schedulers, real KV tensors, a
real (in-process ZeroMQ) transfer backend, messages through the wire codec; the model is replaced by a runner that
samples a fixed token and records what was already on the wire when each forward ran.

Shown: with chunk-wise transfer a prompt is dispatched *before* its first chunk's forward, also when it fits in one
chunk (the decode side reserves and posts its memory while the prefill computes); per-request transfer dispatches
after the forward. Either way the decode side receives the prefill's KV bytes, the client sees indices 0..n-1
exactly once and one end, and every block is freed on both sides. The first token leaves the prefill instance in the
step that computed it, before the KV staging of that step.
"""

from __future__ import annotations

import time
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.load import InstanceState
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.engine.kv_cache import KVCacheTensors
from tetriinfer.engine.sampler import Sampler
from tetriinfer.runtime.decode_worker import DecodeWorker
from tetriinfer.runtime.instance_spec import InstanceSpec
from tetriinfer.runtime.messages import Handoff, NewRequest, Tokens, WireParams, decode, encode
from tetriinfer.runtime.prefill_worker import PrefillWorker
from tetriinfer.runtime.worker_base import InstanceContext
from tetriinfer.sim.instances import synthetic_result
from tetriinfer.transfer import AgentConfig, InprocBackend, make_backend

BLOCK = 4


class RecordingRunner:
    """KV tensors with random content, a sampler, and ``execute`` noting the wire's Handoffs at each forward."""

    def __init__(self, num_blocks: int, wire: deque) -> None:
        cfg = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=4)
        self.kv = KVCacheTensors(cfg, num_blocks, BLOCK, torch.float32, "cpu")  # type: ignore[arg-type]
        for t in [*self.kv.k, *self.kv.v]:
            t.normal_()
        self.sampler = Sampler()
        self.wire = wire
        self.handoffs_at_forward: list[set[str]] = []

    def execute(self, out):  # noqa: ANN001, ANN201 - a SchedulerOutput in, a StepResult out
        seen = {m.request_id for _, data in self.wire if isinstance(m := decode(data), Handoff)}
        self.handoffs_at_forward.append(seen)
        return synthetic_result(out)


class Node:
    def __init__(self, iid: str, role: str, wire: deque, kv_transfer: str, kv_backend: str = "inproc",
                 kv_handoff: str = "auto") -> None:
        spec = InstanceSpec(iid, role, "ipc://unused", "fake", block_size=BLOCK, chunk_size=32, max_num_seqs=8,
                            kv_backend=kv_backend, kv_transfer=kv_transfer, kv_handoff=kv_handoff,
                            transfer_timeout_s=2.0, pad_last_chunk=False)
        self.backend = (InprocBackend(name=f"handoff-{iid}-{id(wire)}") if kv_backend == "inproc"
                        else make_backend(kv_backend, config=AgentConfig(timeout_s=2.0)))
        self.runner = RecordingRunner(64, wire)
        self.front: list = []
        self.ctx = InstanceContext(spec, self.runner, KVCacheManager(64, BLOCK), 512, self.backend,  # type: ignore[arg-type]
                                   lambda m: self.front.append(decode(encode(m))),
                                   lambda peer, m: wire.append((peer, encode(m))))
        self.worker = PrefillWorker(self.ctx) if role == "prefill" else DecodeWorker(self.ctx)

    def items(self) -> list:
        return [it for m in self.front if isinstance(m, Tokens) for it in m.items] + list(self.ctx.outbox)


def record_installs(d: Node) -> dict[str, list[torch.Tensor]]:
    """Copies of every KV payload the decode node installs, by request id."""
    received: dict[str, list[torch.Tensor]] = {}
    install = d.worker.receiver.install

    def spy(rcv, table):  # noqa: ANN001 - the decode side's copy of what arrived
        received[rcv.handoff.request_id] = [t.clone() for t in rcv.staging]
        install(rcv, table)

    d.worker.receiver.install = spy  # type: ignore[method-assign]
    return received


@pytest.mark.parametrize("kv_transfer", ["chunk", "request"])
def test_handoff_timing_and_a_clean_end_on_both_sides(kv_transfer: str) -> None:
    wire: deque = deque()
    p, d = Node("p", "prefill", wire, kv_transfer), Node("d", "decode", wire, kv_transfer)
    nodes = {"p": p, "d": d}
    received = record_installs(d)
    try:
        p.worker.decode_loads = [d.worker.load_report(time.time(), 0.0, InstanceState.ACTIVE)]
        params = WireParams.from_params(SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0))
        p.worker.handle(NewRequest("one", [3] * 10, params, 0.0))  # fits in one 32-token chunk
        assert p.worker.step()
        handoffs = p.runner.handoffs_at_forward[0]
        assert handoffs == ({"one"} if kv_transfer == "chunk" else set())
        assert not p.ctx.outbox  # the first token left within the step that computed it
        kinds = [type(m).__name__ for m in p.front if type(m).__name__ in ("Tokens", "Dispatched")]
        # chunk-wise: dispatched before the forward; per-request: the first token goes before the staging's dispatch
        assert kinds == (["Dispatched", "Tokens"] if kv_transfer == "chunk" else ["Tokens", "Dispatched"])
        assert [it.index for it in p.items() if it.request_id == "one" and it.token_ids] == [0]
        staged = p.worker.staged.get("one")
        if staged is not None:  # per-request: the staging copy; chunk-wise: the device blocks, held until KVDone
            expect = [t.clone() for t in staged.tensors]
        else:
            expect = [t.clone() for t in p.runner.kv.read_blocks(p.ctx.kv_manager.block_table("one")[:3])]
        deadline = time.monotonic() + 10.0
        while d.worker.scheduler.has_unfinished() or p.worker.staged or p.worker.streams or not received:
            assert time.monotonic() < deadline, "the handoff never settled"
            while wire:
                peer, data = wire.popleft()
                nodes[peer].worker.handle(decode(data))
            for node in nodes.values():
                node.worker.poll_transfers()
            d.worker.step()
            time.sleep(0.001)
        for got, want in zip(received["one"], expect, strict=True):
            assert torch.equal(got[: want.shape[0]], want)
        items = p.items() + d.items()
        assert sorted(it.index for it in items if it.token_ids) == list(range(5))
        assert sum(1 for it in items if it.finished) == 1
        for node in nodes.values():
            assert node.ctx.kv_manager.num_used_blocks == 0 and node.worker.is_empty()
    finally:
        for node in nodes.values():
            node.backend.shutdown()


@pytest.mark.parametrize("prompt", [10, 40])  # one chunk, two chunks of 32
def test_a_request_its_first_token_ends_is_never_dispatched_chunk_wise(prompt: int) -> None:
    """Chunk-wise transfer, ``max_tokens`` 1: the prefill instance's first token ends the request, so no decode
    instance is chosen for it (no Handoff, no Dispatched: a decode instance would refuse a request with all its
    output tokens and the client would get an error); the client sees the token and one clean end, and nothing is
    held on either side."""
    wire: deque = deque()
    p, d = Node("p", "prefill", wire, "chunk"), Node("d", "decode", wire, "chunk")
    try:
        p.worker.decode_loads = [d.worker.load_report(time.time(), 0.0, InstanceState.ACTIVE)]
        params = WireParams.from_params(SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0))
        p.worker.handle(NewRequest("one", [3] * prompt, params, 0.0))
        while p.worker.step():
            pass
        assert not wire and all(not seen for seen in p.runner.handoffs_at_forward)
        assert not [m for m in p.front if type(m).__name__ == "Dispatched"]
        items = [it for it in p.items() if it.request_id == "one"]
        assert [it.index for it in items if it.token_ids] == [0]
        assert [(it.finished, it.error) for it in items if it.finished] == [(True, None)]
        assert p.ctx.kv_manager.num_used_blocks == 0 and p.worker.is_empty() and d.worker.is_empty()
    finally:
        for node in (p, d):
            node.backend.shutdown()


@pytest.mark.parametrize("kv_handoff", ["pull", "push"])
def test_a_pull_handoff_completes_while_the_prefill_instance_is_busy(kv_handoff: str) -> None:
    """shm, per-request transfer. After the prompt's forward the prefill instance is frozen (as if in its next
    forward: nothing it is sent is handled). Pull: the decode instance reads the staged KV itself and decodes the
    rest, with the prefill's bytes; only the final KVDone waits, and then the region is closed and the staging
    freed. Push: the decode instance waits for a KVReady answer that a busy prefill instance cannot give."""
    wire: deque = deque()
    p = Node("p", "prefill", wire, "request", "shm", kv_handoff)
    d = Node("d", "decode", wire, "request", "shm", kv_handoff)
    received = record_installs(d)
    try:
        assert p.worker.pull_kv is (kv_handoff == "pull")
        p.worker.decode_loads = [d.worker.load_report(time.time(), 0.0, InstanceState.ACTIVE)]
        params = WireParams.from_params(SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))
        p.worker.handle(NewRequest("one", [3] * 10, params, 0.0))
        assert p.worker.step()
        staged = p.worker.staged["one"]
        expect = [t.clone() for t in staged.tensors]
        assert (staged.region is not None) is (kv_handoff == "pull")
        held_for_p: list = []
        for _ in range(50):  # the prefill instance is frozen: its messages wait
            while wire:
                peer, data = wire.popleft()
                (held_for_p.append(data) if peer == "p" else d.worker.handle(decode(data)))
            d.worker.poll_transfers()
            d.worker.step()
        done = sorted(it.index for it in d.items() if it.token_ids)
        if kv_handoff == "push":
            assert done == [] and [type(decode(m)).__name__ for m in held_for_p] == ["KVReady"]
            return
        assert done == [1, 2, 3, 4, 5] and sum(1 for it in d.items() if it.finished) == 1
        for got, want in zip(received["one"], expect, strict=True):
            assert torch.equal(got, want)
        assert [type(decode(m)).__name__ for m in held_for_p] == ["KVDone"]
        assert p.backend.stats().regions == 1  # still registered until the prefill instance hears KVDone
        for data in held_for_p:
            p.worker.handle(decode(data))
        assert not p.worker.staged and p.backend.stats().regions == 0
        for node in (p, d):
            assert node.ctx.kv_manager.num_used_blocks == 0 and node.worker.is_empty()
    finally:
        for node in (p, d):
            node.backend.shutdown()
