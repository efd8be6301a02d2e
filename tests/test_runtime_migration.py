"""The live-migration protocol between two real role workers in one process (runtime.emigration / immigration /
kv_receiver): real schedulers, real KV tensors and a real (in-process ZeroMQ) transfer backend; the model is
replaced by a runner that samples a fixed token. Messages go through the wire codec, as between processes.

Shown: the KV bytes that arrive are the source's, the request continues at the target from the next output index
and ends exactly once; a refusal, a failed transfer and an abort each leave the request decoding at its source (or
ended) with every block freed on both sides.
"""

from __future__ import annotations

import time
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.engine.kv_cache import KVCacheTensors
from tetriinfer.engine.sampler import Sampler
from tetriinfer.runtime.colocated_worker import ColocatedWorker
from tetriinfer.runtime.decode_worker import DecodeWorker
from tetriinfer.runtime.instance_spec import InstanceSpec
from tetriinfer.runtime.messages import (
    Abort,
    Migrate,
    Migrating,
    MigrationDone,
    NewRequest,
    WireParams,
    decode,
    encode,
)
from tetriinfer.runtime.worker_base import InstanceContext
from tetriinfer.sim.instances import synthetic_result
from tetriinfer.transfer import FaultPlan, FaultyBackend, InprocBackend

BLOCK = 4


class FakeRunner:
    """The model runner's surface the workers use: KV tensors (random content), a sampler, ``execute``."""

    def __init__(self, num_blocks: int) -> None:
        cfg = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=4)
        self.kv = KVCacheTensors(cfg, num_blocks, BLOCK, torch.float32, "cpu")  # type: ignore[arg-type]
        for t in [*self.kv.k, *self.kv.v]:
            t.normal_()
        self.sampler = Sampler()

    def execute(self, out):  # noqa: ANN001, ANN201 - a SchedulerOutput in, a StepResult out
        return synthetic_result(out)


class Node:
    def __init__(self, iid: str, role: str, wire: deque, *, max_num_seqs: int = 8, faulty: bool = False,
                 blocks: int = 64) -> None:
        spec = InstanceSpec(iid, role, "ipc://unused", "fake", block_size=BLOCK, max_num_seqs=max_num_seqs,
                            colocated_policy="vllm", kv_backend="inproc", transfer_timeout_s=0.3,
                            transfer_attempts=2)
        backend = InprocBackend(name=f"mig-{iid}-{id(wire)}")
        self.backend = FaultyBackend(backend, FaultPlan(drop_p=1.0)) if faulty else backend
        self.runner = FakeRunner(blocks)
        self.front: list = []
        self.ctx = InstanceContext(spec, self.runner, KVCacheManager(blocks, BLOCK), 512, self.backend,  # type: ignore[arg-type]
                                   lambda m: self.front.append(decode(encode(m))),
                                   lambda peer, m: wire.append((peer, encode(m))))
        self.worker = DecodeWorker(self.ctx) if role == "decode" else ColocatedWorker(self.ctx)
        self.items: list = []  # every TokenItem this instance streamed

    def step(self) -> None:
        self.worker.poll_transfers()
        self.worker.step()
        self.items += self.ctx.outbox
        self.ctx.outbox = []

    def done(self) -> list[MigrationDone]:
        return [m for m in self.front if isinstance(m, MigrationDone)]


class Pair:
    def __init__(self, role: str, **target_kw: object) -> None:
        self.wire: deque = deque()
        self.src = Node("a", role, self.wire, faulty=bool(target_kw.pop("faulty_source", False)))
        self.dst = Node("b", role, self.wire, **target_kw)  # type: ignore[arg-type]
        self.nodes = {"a": self.src, "b": self.dst}

    def pump(self, until, timeout_s: float = 10.0) -> None:  # noqa: ANN001 - a predicate
        deadline = time.monotonic() + timeout_s
        while not until():
            assert time.monotonic() < deadline, "the migration never settled"
            while self.wire:
                peer, data = self.wire.popleft()
                self.nodes[peer].worker.handle(decode(data))
            for node in self.nodes.values():
                node.worker.poll_transfers()
            time.sleep(0.002)

    def close(self) -> None:
        for node in self.nodes.values():
            node.backend.shutdown()


def submit(node: Node, rid: str, prompt: int, max_tokens: int) -> None:
    params = WireParams.from_params(SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    node.worker.handle(NewRequest(rid, [3] * prompt, params, 0.0))


def scheduler(node: Node):  # noqa: ANN201
    return node.worker.scheduler


def check_streams(pair: Pair, lengths: dict[str, int]) -> None:
    """Every request streamed indices 0..n-1 exactly once across the two instances and ended exactly once."""
    for rid, n in lengths.items():
        items = [it for node in pair.nodes.values() for it in node.items if it.request_id == rid]
        indices = sorted(it.index for it in items if it.token_ids)
        assert indices == list(range(n)), (rid, indices)
        assert sum(1 for it in items if it.finished) == 1, rid


def run_out(pair: Pair) -> None:
    for _ in range(2000):
        if not any(scheduler(n).has_unfinished() for n in pair.nodes.values()):
            break
        for node in pair.nodes.values():
            node.step()
    for node in pair.nodes.values():
        assert node.ctx.kv_manager.num_used_blocks == 0 and node.worker.is_empty()


@pytest.mark.parametrize("role", ["colocated", "decode"])
def test_a_migrated_request_carries_its_kv_and_continues_at_the_next_index(role: str) -> None:
    pair = Pair(role)
    try:
        lengths = {f"r{i}": 30 for i in range(3)}
        for i, rid in enumerate(lengths):
            submit(pair.src, rid, 9 + 4 * i, 30)
        for _ in range(6):
            pair.src.step()
        running = [r.request_id for r in scheduler(pair.src).running]
        assert len(running) == 3
        kv_src, sched = pair.src.ctx.kv_manager, scheduler(pair.src)
        before = {}
        for r in sched.running:
            n = kv_src.pool.blocks_for_tokens(r.num_computed_tokens)
            before[r.request_id] = (r.num_output_tokens, pair.src.runner.kv.read_blocks(kv_src.block_table(r.request_id)[:n]))
        pair.src.worker.handle(decode(encode(Migrate([("b", 2)], "balance"))))
        pair.pump(lambda: pair.src.done())
        [done] = pair.src.done()
        assert len(done.moved) == 2 and done.returned == [] and done.num_bytes > 0
        assert [m.request_ids for m in pair.src.front if isinstance(m, Migrating)] == [done.moved]
        kv_dst = pair.dst.ctx.kv_manager
        for rid in done.moved:
            outputs, blocks = before[rid]
            assert kv_src.num_blocks_of(rid) == 0 and rid not in scheduler(pair.src).requests
            moved = scheduler(pair.dst).requests[rid]
            assert moved.num_output_tokens == outputs and moved.num_computed_tokens == moved.num_tokens - 1
            got = pair.dst.runner.kv.read_blocks(kv_dst.block_table(rid)[: blocks[0].shape[0]])
            assert all(torch.equal(a, b) for a, b in zip(got, blocks, strict=True))  # the source's bytes
        run_out(pair)
        check_streams(pair, lengths)
        assert {it.request_id for it in pair.dst.items if it.token_ids} == set(done.moved)
    finally:
        pair.close()


def test_a_target_without_a_seat_refuses_and_the_request_decodes_on_at_its_source() -> None:
    pair = Pair("colocated", max_num_seqs=1)
    try:
        submit(pair.dst, "busy", 5, 40)
        pair.dst.step()
        submit(pair.src, "x", 7, 20)
        for _ in range(3):
            pair.src.step()
        pair.src.worker.handle(Migrate([("b", 1)], "balance"))
        assert scheduler(pair.src).migrating  # out of the batch while the target decides
        pair.pump(lambda: pair.src.done())
        [done] = pair.src.done()
        assert done.moved == [] and done.returned == ["x"]
        assert [r.request_id for r in scheduler(pair.src).running] == ["x"]
        run_out(pair)
        check_streams(pair, {"x": 20, "busy": 40})
    finally:
        pair.close()


def test_a_failed_transfer_puts_the_request_back_and_frees_the_targets_blocks() -> None:
    pair = Pair("decode", faulty_source=True)  # every send from the source is dropped
    try:
        params = WireParams.from_params(SamplingParams(max_tokens=25, ignore_eos=True, temperature=0.0))
        pair.src.worker.handle(NewRequest("y", [4] * 10, params, 0.0))  # prefilled here (conditional disagg.)
        for _ in range(4):
            pair.src.step()
        pair.src.worker.handle(Migrate([("b", 1)], "evacuate"))
        pair.pump(lambda: pair.src.done(), timeout_s=20)
        [done] = pair.src.done()
        assert done.returned == ["y"] and done.moved == []
        assert pair.dst.ctx.kv_manager.num_used_blocks == 0 and pair.dst.worker.is_empty()
        run_out(pair)
        check_streams(pair, {"y": 25})
    finally:
        pair.close()


def test_an_abort_during_the_move_ends_it_everywhere() -> None:
    pair = Pair("colocated")
    try:
        submit(pair.src, "z", 12, 30)
        for _ in range(3):
            pair.src.step()
        pair.src.worker.handle(Migrate([("b", 1)], "balance"))
        while pair.wire:  # the handoff reaches the target, which reserves and posts its receive
            peer, data = pair.wire.popleft()
            pair.nodes[peer].worker.handle(decode(data))
        for node in pair.nodes.values():  # the client went away: the front end tells every instance
            node.worker.handle(Abort("z"))
        pair.pump(lambda: pair.src.done())
        [done] = pair.src.done()
        assert done.moved == [] and done.returned == []
        for node in pair.nodes.values():
            node.step()
            assert node.ctx.kv_manager.num_used_blocks == 0 and node.worker.is_empty()
    finally:
        pair.close()
