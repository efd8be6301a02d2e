"""A prefilled request that no decode instance has room for waits, staged, at its prefill instance; with the
cost keep rule that instance then decodes it itself (``--dispatch-when-full wait``, the P:D controller's default).

Shown with a real prefill worker, real KV tensors and schedulers in one process (the model is a runner that samples
a fixed token): the staged KV goes back, byte for byte, into blocks of the prefill instance's own pool; nothing is
sent to a decode instance; the client sees every token once and one end; the staging copy and every block are
freed. With ``least-loaded`` (the paper's) the same request is handed to the full decode instance instead.
"""

from __future__ import annotations

from collections import deque

import pytest
import torch

from tests.test_runtime_handoff import BLOCK, RecordingRunner
from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.load import LoadReport, Role
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.runtime.instance_spec import InstanceSpec
from tetriinfer.runtime.messages import Dispatched, Handoff, NewRequest, Tokens, WireParams, decode, encode
from tetriinfer.runtime.prefill_worker import PrefillWorker
from tetriinfer.runtime.worker_base import InstanceContext
from tetriinfer.transfer import InprocBackend

FULL_DECODE = LoadReport("d", Role.DECODE, num_running=2, num_queued=3, num_used_blocks=64, num_free_blocks=0,
                         block_size=BLOCK)


def prefill_node(when_full: str, wire: deque) -> tuple[PrefillWorker, InstanceContext, list, InprocBackend]:
    spec = InstanceSpec("p", "prefill", "ipc://unused", "fake", block_size=BLOCK, chunk_size=32, max_num_seqs=8,
                        kv_backend="inproc", kv_transfer="request", transfer_timeout_s=2.0, pad_last_chunk=False,
                        keep_decode=True, keep_decode_rule="cost", dispatch_when_full=when_full)
    backend = InprocBackend(name=f"keep-staged-{when_full}-{id(wire)}")
    front: list = []
    ctx = InstanceContext(spec, RecordingRunner(64, wire), KVCacheManager(64, BLOCK), 512, backend,  # type: ignore[arg-type]
                          lambda m: front.append(decode(encode(m))), lambda peer, m: wire.append((peer, encode(m))))
    return PrefillWorker(ctx), ctx, front, backend


@pytest.mark.parametrize("when_full", ["wait", "least-loaded"])
def test_a_staged_request_no_decode_instance_can_take_is_decoded_where_it_was_prefilled(when_full: str) -> None:
    wire: deque = deque()
    worker, ctx, front, backend = prefill_node(when_full, wire)
    try:
        params = WireParams.from_params(SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))
        worker.decode_loads = [FULL_DECODE]
        worker.handle(NewRequest("one", [3] * 30, params, 0.0))
        worker.handle(NewRequest("other", [5] * 30, params, 0.0))  # still queued when "one" is prefilled
        assert worker.step()
        if when_full == "least-loaded":  # the paper's: queue it at the least loaded (full) decode instance
            sent = [decode(d) for peer, d in wire if peer == "d"]
            assert [m.request_id for m in sent if isinstance(m, Handoff)] == ["one"]
            assert "one" not in worker.kept.requests
            return
        assert not wire and list(worker.staged) == ["one"] and list(worker.awaiting_dispatch) == ["one"]
        for _ in range(40):
            worker.step()
            if not worker.has_work() and not worker.kept.requests:
                break
        assert not wire, "nothing goes to the full decode instance"
        assert not worker.staged and not worker.awaiting_dispatch and ctx.kv_manager.num_used_blocks == 0
        assert {m.request_id: m.decode_id for m in front if isinstance(m, Dispatched)} == {"one": "p", "other": "p"}
        items = [it for m in front if isinstance(m, Tokens) for it in m.items] + list(ctx.outbox)
        for rid in ("one", "other"):
            mine = sorted((it for it in items if it.request_id == rid), key=lambda it: it.index)
            assert [i for it in mine for i in range(it.index, it.index + len(it.token_ids))] == list(range(6))
            assert sum(it.finished for it in mine) == 1
    finally:
        backend.shutdown()


def test_the_kept_blocks_hold_the_staged_bytes() -> None:
    wire: deque = deque()
    worker, ctx, _, backend = prefill_node("wait", wire)
    try:
        params = WireParams.from_params(SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))
        worker.decode_loads = []  # no decode instance reported yet: nothing to keep against, nowhere to send
        worker.handle(NewRequest("one", [3] * 10, params, 0.0))
        assert worker.step()
        assert "one" in worker.staged and list(worker.awaiting_dispatch) == ["one"]
        expect = [t.clone() for t in worker.staged["one"].tensors]  # 2L x [n, bs, H, D]
        n = worker.staged["one"].num_blocks
        worker.decode_loads = [FULL_DECODE]  # the decode tier reports a full pool: keep it here
        worker._retry_dispatch()
        assert "one" not in worker.staged and "one" in worker.kept.requests
        got = ctx.runner.kv.read_blocks(worker.kept.block_table("one")[:n])
        assert all(torch.equal(a, b) for a, b in zip(got, expect, strict=True))
        assert not wire
    finally:
        backend.shutdown()


@pytest.mark.parametrize("prefill_ids", [["p", "q"], ["o", "p"], ["p"]])
def test_the_prompt_only_prefill_instance_named_by_the_broadcast_keeps_nothing(prefill_ids: list[str]) -> None:
    """The monitor's ``DecodeLoads`` names the ACTIVE prefill instances; the first of two or more keeps no decode
    (``core.keep_decode.prompt_only_instance``), the others and a lone one keep as before."""
    from tetriinfer.runtime.messages import DecodeLoads, encode_load
    from tetriinfer.runtime.worker_base import wire_load

    wire: deque = deque()
    worker, _, front, backend = prefill_node("wait", wire)
    try:
        params = WireParams.from_params(SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))
        worker.handle(DecodeLoads([encode_load(wire_load(FULL_DECODE, 0.0, 0))], prefill_ids))
        assert worker.prefill_ids == prefill_ids
        worker.handle(NewRequest("one", [3] * 30, params, 0.0))
        for _ in range(3):
            worker.step()
        kept = "one" in worker.kept.requests or any(isinstance(m, Dispatched) and m.decode_id == "p" for m in front)
        assert kept == (prefill_ids != ["p", "q"])
    finally:
        backend.shutdown()
