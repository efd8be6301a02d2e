"""Chunk-wise KV transfer in the simulator (``--kv-transfer chunk``, the runtime's ``KVStream``): the decode
instance is chosen when a request's first chunk starts and reserves its blocks then; each chunk's full blocks
cross the link as the chunk ends, so after prefill only the last chunk's bytes are left to wait for. Requests kept
at their prefill instance or prefilled at a decode instance move nothing; every block comes back and every
request ends once."""

from __future__ import annotations

from tests.sim_helpers import COST
from tetriinfer.bench.workloads import Workload, WorkloadRequest
from tetriinfer.runtime.cluster_config import ClusterConfig
from tetriinfer.sim.cluster import SimCluster, SimConfig
from tetriinfer.sim.instances import Handoff, SimDecode

BLOCK, KV_BYTES, LINK_BPS = 16, 8192, 1e9 / 8  # 1 Gbps: a 512-token chunk's blocks take 34 ms, its prefill 220 ms


def _cluster(kv_transfer: str, blocks: int = 400, **over: object) -> SimCluster:
    cc = ClusterConfig(model="sim", mode="tetriinfer", prefill_instances=1, decode_instances=1, block_size=BLOCK,
                       kv_transfer=kv_transfer, **over)  # type: ignore[arg-type]
    return SimCluster(SimConfig(cc, num_kv_blocks=blocks, kv_bytes_per_token=KV_BYTES, max_model_len=2048,
                                link_bandwidth="1Gbps"), COST)


def _workload(reqs: list[tuple[float, int, int]]) -> Workload:
    return Workload("t", tuple(WorkloadRequest(f"r{i}", a, p, o) for i, (a, p, o) in enumerate(reqs)), "test",
                    "trace", None, 0)


def _wire_s(num_blocks: int) -> float:
    return num_blocks * BLOCK * KV_BYTES / LINK_BPS


def _check_ended_once(wl: Workload, records: list) -> None:
    by_id = {r.request_id: r for r in records}
    assert set(by_id) == {w.request_id for w in wl.requests}
    for w in wl.requests:
        r = by_id[w.request_id]
        assert r.success, (w.request_id, r.error)
        assert r.output_tokens == w.output_tokens == len(r.chunk_times_s)
        assert r.arrival_s <= r.first_token_s <= r.finish_s


def test_a_long_prompt_waits_after_prefill_only_for_its_last_chunks_blocks() -> None:
    """A 2,000-token prompt in chunks of 512 (512 + 512 + 512 + 464): per request, all 125 blocks cross the link
    after the first token; chunk-wise, 96 crossed while the later chunks ran and only the last chunk's 29 are
    left. The decode instance reserves the request's blocks when the first chunk starts (chunk-wise), not after
    the first token."""
    wl = _workload([(0.0, 2000, 4)])
    gap, handoffs = {}, {}
    for mode in ("request", "chunk"):
        cluster = _cluster(mode)
        dec = cluster.instances["decode-0"]
        assert isinstance(dec, SimDecode)
        seen: list[tuple[float, int, bool]] = []
        receive = dec.receive

        def recording_receive(h: Handoff, dec: SimDecode = dec, seen: list = seen, receive=receive,
                              loop=cluster.loop) -> None:
            receive(h)
            seen.append((loop.now, dec.kv.num_used_blocks, h.early))

        dec.receive = recording_receive  # type: ignore[method-assign]
        res = cluster.run(wl)
        _check_ended_once(wl, res.records)
        (r,) = res.records
        gap[mode] = r.chunk_times_s[1] - r.first_token_s  # KV wait + one one-row decode step
        handoffs[mode] = (seen, r.first_token_s)
        assert res.transfer_bytes == 125 * BLOCK * KV_BYTES  # the same bytes either way
    step = COST.decode_seconds(1)
    assert abs(gap["request"] - (_wire_s(125) + step)) < 1e-9
    assert abs(gap["chunk"] - (_wire_s(29) + step)) < 1e-9
    (req_at, req_blocks, req_early), = handoffs["request"][0]
    assert not req_early and req_at == handoffs["request"][1] and req_blocks == 126  # prompt + first token
    (ch_at, ch_blocks, ch_early), = handoffs["chunk"][0]
    assert ch_early and ch_at == 0.0 < handoffs["chunk"][1] and ch_blocks == 126


def test_kept_and_locally_prefilled_requests_move_nothing_and_every_block_comes_back() -> None:
    """With the adaptive controller's keep-decode and local prefill, chunk-wise transfer moves exactly the
    prompt blocks of the requests decoded away from where they were prefilled (none of those kept at their prefill
    instance or prefilled at their decode instance); a prompt the keep rule would keep when its first chunk starts
    opens no stream (it is decided again once prefilled); ``run`` itself asserts every pool is whole at the end."""
    reqs = [(0.02 * i, 100 + (i * 397) % 1300, 2 + (i * 131) % 300) for i in range(80)]
    wl = _workload(reqs)
    cluster = _cluster("chunk", blocks=200, keep_decode=True, keep_decode_rule="cost", dispatch_when_full="wait",
                       local_prefill=True, prefill_tail_tokens=128)
    res = cluster.run(wl)
    _check_ended_once(wl, res.records)
    recs = cluster.policy.records()
    prompt = {f"r{i}": p for i, (_, p, _) in enumerate(reqs)}
    moved = [r.request_id for r in recs if r.prefill_instance != r.decode_instance]
    stayed = [r for r in recs if r.prefill_instance == r.decode_instance]
    assert moved and res.kept_decodes > 0 and res.local_prefills > 0
    assert len(stayed) == res.kept_decodes + res.local_prefills
    # the keep rule is asked when a stream would open, too: prompts of several chunks are kept, not streamed away
    kept = [r.request_id for r in stayed if r.decode_instance.startswith("prefill")]
    assert max(prompt[rid] for rid in kept) > 512 + 128
    assert res.transfer_bytes == sum(-(-prompt[rid] // BLOCK) for rid in moved) * BLOCK * KV_BYTES
    for inst in cluster.instances.values():
        assert inst.is_empty() and inst.kv.num_used_blocks == 0


def test_requests_their_first_token_ends_open_no_stream() -> None:
    """Multi-chunk prompts with ``max_tokens`` 1 end at their prefill instance with their first token: no decode
    instance is chosen for them or reserves blocks (``PrefillScheduler.ends_with_first_token``); the others
    stream, and every request ends once with its length."""
    reqs = [(0.01 * i, 1200, 1 if i % 2 == 0 else 40) for i in range(16)]
    wl = _workload(reqs)
    cluster = _cluster("chunk", blocks=160)  # the decode pool holds two 1,200-token prompts at a time
    dec = cluster.instances["decode-0"]
    assert isinstance(dec, SimDecode)
    received: list[str] = []
    receive = dec.receive

    def recording_receive(h: Handoff) -> None:
        received.append(h.request.request_id)
        receive(h)

    dec.receive = recording_receive  # type: ignore[method-assign]
    res = cluster.run(wl)
    _check_ended_once(wl, res.records)
    assert sorted(received) == sorted(f"r{i}" for i in range(1, 16, 2))
    by_id = {r.request_id: r for r in cluster.policy.records()}
    assert all(by_id[f"r{i}"].decode_instance is None for i in range(0, 16, 2))
    assert not dec.scheduler.reserved and not dec.receiving and dec.kv.num_used_blocks == 0
    assert res.transfer_bytes == 8 * 75 * BLOCK * KV_BYTES


def test_a_prompt_the_keep_rule_would_keep_opens_no_stream() -> None:
    """When a multi-chunk prompt's first chunk starts, a prefill instance that keeps decodes asks the keep rule
    first (the prompt itself not counted as waiting): one it would keep opens no stream (it is decided again once
    prefilled); one it would not keep streams to a decode instance."""
    from tetriinfer.core.kv_cache_manager import KVCacheManager
    from tetriinfer.core.load import LoadReport, Role
    from tetriinfer.core.request import Request
    from tetriinfer.core.sampling_params import SamplingParams
    from tetriinfer.sim.events import EventLoop
    from tetriinfer.sim.instances import InstancePolicies, SimPrefill

    class Host:
        loop = EventLoop()

        def __init__(self) -> None:
            self.opened: list[str] = []

        def on_dispatched(self, request_id: str, decode_id: str) -> None: ...

        def open_stream(self, prefill_id: str, decode_id: str, req: Request, num_blocks: int) -> None:
            self.opened.append(req.request_id)

    # ratio rule (keep_decode_ratio 0.5): keep while own decodes + 1 <= 0.5 x the least loaded decode instance's
    for decode_running, streamed in ((6, False), (0, True)):
        host = Host()
        pol = InstancePolicies(chunk_size=512, keep_decode=True, kv_transfer="chunk", max_model_len=2048)
        inst = SimPrefill("prefill-0", KVCacheManager(400, BLOCK), COST, host, pol)  # type: ignore[arg-type]
        inst.decode_loads = [LoadReport("decode-0", Role.DECODE, num_running=decode_running, num_free_blocks=400,
                                        block_size=BLOCK)]
        inst.add(Request("r", [2] * 1500, SamplingParams(max_tokens=50, ignore_eos=True, temperature=0.0)))
        out = inst.next_step()  # the first of three chunks; a stream opens before its forward, or not
        assert out is not None and [s.num_tokens for s in out.segments] == [512]
        assert host.opened == (["r"] if streamed else [])
        assert set(inst.streams) == ({"r"} if streamed else set())
