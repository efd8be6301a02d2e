"""The benchmark client against a fake streaming OpenAI server (raw asyncio HTTP on 127.0.0.1).

The fake server streams ``max_tokens`` one-token chunks after ``TTFT`` seconds, ``ITL`` seconds apart.
String prompts select failure modes: ``fail500``, ``disconnect`` (socket closed mid-stream), ``nodone``
(clean end without [DONE]), ``multi`` (two tokens per chunk), ``slow`` (first token after 2 s).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tetriinfer.bench.client import (
    TRANSPORTS,
    BenchmarkClient,
    ClientConfig,
    PromptBuilder,
    run_benchmark,
    save_results,
)
from tetriinfer.bench.client import run_client as _run_client
from tetriinfer.bench.metrics import SLO, summarize
from tetriinfer.bench.workloads import Workload, WorkloadRequest

TTFT = 0.15
ITL = 0.04


class FakeServer:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.policies: list[int] = []  # the serving thread's scheduling policy at each completion
        self.metrics: Any = None  # () -> Prometheus text for GET /metrics (None: no such route)
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> str:
        self._thread.start()
        server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self.loop
        )
        self._server = server.result(5)
        self.port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        async def shutdown() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await reader.readline()
            if not request_line:
                return
            method, path, _ = request_line.decode().split(" ", 2)
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                key, value = line.decode().split(":", 1)
                headers[key.strip().lower()] = value.strip()
            raw = await reader.readexactly(int(headers.get("content-length", "0")))
            if method == "GET" and path == "/metrics" and self.metrics is not None:
                payload = self.metrics().encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                    + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                    + payload
                )
                await writer.drain()
                return
            if method == "GET" and path == "/v1/models":
                payload = json.dumps(
                    {"object": "list", "data": [{"id": "fake", "max_model_len": 4096}]}
                ).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                    + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                    + payload
                )
                await writer.drain()
                return
            body = json.loads(raw)
            self.bodies.append(body)
            await self._complete(body, writer)
        finally:
            writer.close()

    async def _complete(self, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        self.policies.append(os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK)
        prompt = body["prompt"]
        mode = prompt if isinstance(prompt, str) else "ok"
        if mode == "fail500":
            msg = b'{"error": "internal"}'
            writer.write(
                b"HTTP/1.1 500 Internal Server Error\r\nConnection: close\r\n"
                + f"Content-Length: {len(msg)}\r\n\r\n".encode()
                + msg
            )
            await writer.drain()
            return
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\n"
        )
        await writer.drain()

        async def event(obj: Any) -> None:
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()

        n = int(body["max_tokens"])
        opts = body.get("stream_options") or {}
        per_chunk = 2 if mode == "multi" else 1
        await asyncio.sleep(2.0 if mode == "slow" else TTFT)
        sent = 0
        while sent < n:
            if sent and mode == "disconnect" and sent >= 3:
                return  # close without the terminating zero-length chunk
            if sent and mode == "nodone" and sent >= 2:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                return
            if sent:
                await asyncio.sleep(ITL)
            k = min(per_chunk, n - sent)
            sent += k
            chunk: dict[str, Any] = {
                "choices": [{"index": 0, "text": "ab"[:k], "finish_reason": "length" if sent == n else None}]
            }
            if opts.get("continuous_usage_stats"):
                chunk["usage"] = {"prompt_tokens": 1, "completion_tokens": sent}
            await event(chunk)
        if opts.get("include_usage"):
            await event({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": sent}})
        await event(b"[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()


@pytest.fixture()
def server() -> Iterator[FakeServer]:
    s = FakeServer()
    s.start()
    yield s
    s.stop()


def _workload(reqs: list[WorkloadRequest]) -> Workload:
    return Workload("test", tuple(reqs), "test", "trace", None, 0)


def _run(cfg: ClientConfig, workload: Workload):  # type: ignore[no-untyped-def]
    return asyncio.run(BenchmarkClient(cfg).run(workload))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_timing_bookkeeping_and_payload(server: FakeServer, transport: str) -> None:
    reqs = [
        WorkloadRequest("r0", 0.0, 50, 5),
        WorkloadRequest("r1", 0.05, 60, 1),
        WorkloadRequest("r2", 0.1, 70, 8),
    ]
    cfg = ClientConfig(f"http://127.0.0.1:{server.port}", "fake", progress=False, transport=transport)
    records, duration, max_ctx = _run(cfg, _workload(reqs))
    assert max_ctx == 4096
    assert all(r.success for r in records), [r.error for r in records]
    assert [r.output_tokens for r in records] == [5, 1, 8]
    assert [len(r.chunk_times_s) for r in records] == [5, 1, 8]
    for rec, req in zip(records, reqs, strict=True):
        assert rec.send_s is not None and 0 <= rec.send_s - req.arrival_s < 0.1
        assert TTFT - 0.01 <= rec.ttft_s <= TTFT + 0.25
        assert all(ITL - 0.01 <= g <= ITL + 0.1 for g in rec.itls_s)
        if rec.output_tokens > 1:
            assert ITL - 0.01 <= rec.tpot_s <= ITL + 0.06
        assert rec.e2e_s == pytest.approx(TTFT + ITL * (rec.output_tokens - 1), abs=0.3)
        assert rec.jct_s >= rec.e2e_s
    assert duration >= 0.1 + TTFT + 7 * ITL
    by_id = {b["prompt"] if isinstance(b["prompt"], str) else len(b["prompt"]): b for b in server.bodies}
    for req in reqs:
        body = by_id[req.prompt_tokens]  # token-id prompt of exactly prompt_tokens ids
        assert body["max_tokens"] == req.output_tokens == body["min_tokens"]
        assert body["ignore_eos"] is True and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert all(isinstance(t, int) and 100 <= t < 1000 for t in body["prompt"])
    s = summarize(records, duration, SLO(ttft_ms=2000, tpot_ms=500))
    assert s["completed"] == 3 and s["failed"] == 0 and s["good_requests"] == 3
    assert s["itl"]["count"] == 4 + 7 and s["tpot"]["count"] == 2


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_failures_are_counted_not_raised(server: FakeServer, transport: str) -> None:
    reqs = [
        WorkloadRequest("ok", 0.0, 10, 4),
        WorkloadRequest("500", 0.0, 10, 4, prompt_text="fail500"),
        WorkloadRequest("cut", 0.0, 10, 8, prompt_text="disconnect"),
        WorkloadRequest("nodone", 0.0, 10, 8, prompt_text="nodone"),
        WorkloadRequest("long", 0.01, 5000, 4),  # over the server's max_model_len 4096
        WorkloadRequest("slow", 0.01, 10, 2, prompt_text="slow"),
    ]
    cfg = ClientConfig(f"http://127.0.0.1:{server.port}", "fake", progress=False, request_timeout_s=0.6,
                       transport=transport)
    records, duration, _ = _run(cfg, _workload(reqs))
    rec = {r.request_id: r for r in records}
    assert rec["ok"].success and rec["ok"].output_tokens == 4
    assert (
        not rec["500"].success and rec["500"].http_status == 500 and rec["500"].error.startswith("HTTP 500")
    )
    assert not rec["cut"].success and rec["cut"].output_tokens == 3 and "Protocol" in rec["cut"].error
    assert not rec["nodone"].success and "before [DONE]" in rec["nodone"].error
    assert rec["long"].rejected and rec["long"].send_s is None and "4096" in rec["long"].error
    assert not rec["slow"].success and rec["slow"].error.startswith("timeout")
    assert len(server.bodies) == 5  # the rejected request was never sent
    s = summarize(records, duration)
    assert (s["completed"], s["failed"], s["rejected"]) == (1, 4, 1)
    assert s["errors"]["HTTP 500"] == 1 and s["errors"]["timeout"] == 1


def test_multi_token_chunks_and_usage(server: FakeServer) -> None:
    reqs = [WorkloadRequest("m", 0.0, 10, 6, prompt_text="multi")]
    base = f"http://127.0.0.1:{server.port}"
    records, _, _ = _run(ClientConfig(base, "fake", progress=False), _workload(reqs))
    (r,) = records
    assert r.success and r.output_tokens == 6 and r.chunk_tokens == [2, 2, 2] and len(r.itls_s) == 2
    # without vLLM extras: no per-chunk usage, so chunks count one each, but the final usage is exact
    records, _, _ = _run(ClientConfig(base, "fake", progress=False, vllm_extras=False), _workload(reqs))
    (r,) = records
    assert r.success and r.output_tokens == 6 and r.chunk_tokens == [1, 1, 1]
    assert "ignore_eos" not in server.bodies[-1] and "min_tokens" not in server.bodies[-1]


def _word_tokenizer(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tetriinfer.bench.client import _BASE_TEXT

    words = sorted(set(_BASE_TEXT.replace(",", " ").replace(".", " ").split()))
    vocab = {"[UNK]": 0, ",": 1, ".": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_prompt_builder_with_tokenizer(tmp_path: Path) -> None:
    tok_dir = _word_tokenizer(tmp_path)
    pb = PromptBuilder(str(tok_dir), seed=1)
    for n in (1, 7, 100, 3000):
        ids = pb.build(0, n)
        assert len(ids) == n and all(1 <= t < 200 for t in ids)  # never [UNK]
    assert pb.build(0, 50) == PromptBuilder(str(tok_dir), seed=1).build(0, 50)
    assert pb.build(0, 50)[:8] != pb.build(1, 50)[:8]  # per-request prefixes
    no_tok = PromptBuilder(None, seed=1, random_token_range=(5, 9))
    assert set(no_tok.build(3, 200)) <= {5, 6, 7, 8}


def test_run_benchmark_results_json(server: FakeServer, tmp_path: Path) -> None:
    tok_dir = _word_tokenizer(tmp_path)
    reqs = [WorkloadRequest(f"r{i}", 0.02 * i, 20 + i, 3) for i in range(4)]
    cfg = ClientConfig(f"http://127.0.0.1:{server.port}", "fake", tokenizer=str(tok_dir), progress=False)
    res = run_benchmark(cfg, _workload(reqs), SLO(ttft_ms=5000))
    assert [len(b["prompt"]) for b in server.bodies] == sorted(20 + i for i in range(4))
    assert res["summary"]["completed"] == 4 and res["summary"]["good_requests"] == 4
    assert res["config"]["max_context_used"] == 4096 and len(res["requests"]) == 4
    path = save_results(res, tmp_path / "out" / "r.json")
    loaded = json.loads(path.read_text())
    assert loaded["summary"]["ttft"]["mean"] == pytest.approx(res["summary"]["ttft"]["mean"])


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="transport"):
        ClientConfig("http://x", "m", transport="curl")
    with pytest.raises(ValueError, match="base_url"):
        ClientConfig("localhost:8000", "m")
    with pytest.raises(FileNotFoundError):
        ClientConfig("http://x", "m", tokenizer="/nonexistent/tok")


def test_cli_run_then_compare(server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tetriinfer.cli import main

    trace = Path(__file__).parent / "fixtures" / "azure_conv_head6.csv"
    outs = []
    for i, scale in enumerate((0.02, 0.01)):
        out = tmp_path / f"run{i}.json"
        rc = main(
            [
                "bench",
                "--base-url",
                f"http://127.0.0.1:{server.port}",
                "--model",
                "fake",
                "--workload",
                f"trace:{trace}",
                "--num-requests",
                "4",
                "--trace-timescale",
                str(scale),
                "--max-output-tokens",
                "3",
                "--slo-ttft",
                "3000",
                "--no-progress",
                "--label",
                f"run{i}",
                "--out",
                str(out),
            ]
        )
        assert rc == 0
        outs.append(out)
    data = json.loads(outs[0].read_text())
    assert data["summary"]["completed"] == 4 and data["summary"]["good_requests"] == 4
    assert [len(b["prompt"]) for b in server.bodies[:4]] == [374, 396, 879, 91]
    assert all(b["max_tokens"] == 3 for b in server.bodies)  # clipped to --max-output-tokens
    assert data["workload"]["duration_s"] == pytest.approx(0.02 * (51.3910170 - 46.6805900))
    assert "Mean TTFT (ms)" in capsys.readouterr().out
    rc = main(
        [
            "bench",
            "compare",
            str(outs[0]),
            str(outs[1]),
            "--plot",
            str(tmp_path / "plots"),
            "--md",
            str(tmp_path / "report.md"),
        ]
    )
    assert rc == 0
    md = (tmp_path / "report.md").read_text()
    assert "| TTFT mean (ms) |" in md and "run1 / baseline" in md and "![ttft_cdf](plots/ttft_cdf.png)" in md
    assert (tmp_path / "plots" / "jct_cdf.png").stat().st_size > 1000
    assert main(["bench", "compare", str(tmp_path / "missing.json")]) == 2


def test_run_benchmark_reads_our_servers_busy_time_and_prefix_hits_from_metrics(server: FakeServer) -> None:
    """The fake server exports our /metrics names: every completed request adds 0.5 busy seconds to instance
    p0 and 0.25 to d0, and 10 of its 40 prompt tokens as cache hits; the run's share is exactly that, whatever
    the counters held before it."""
    from tetriinfer.server.metrics import ServerMetrics

    def exposition() -> str:
        n = len(server.bodies) + 4  # 4 requests' worth before the run
        m = ServerMetrics()
        m.update_cluster({"instances": [
            {"id": "p0", "role": "prefill", "busy_s": 0.5 * n, "prefix_cache_hit_tokens": 10 * n,
             "prefix_cache_queried_tokens": 40 * n},
            {"id": "d0", "role": "decode", "busy_s": 0.25 * n},
        ]})
        return m.render()[0].decode()

    server.metrics = exposition
    reqs = [WorkloadRequest(f"r{i}", 0.01 * i, 10, 2) for i in range(6)]
    res = run_benchmark(ClientConfig(f"http://127.0.0.1:{server.port}", "fake", progress=False), _workload(reqs))
    usage = res["server_usage"]
    assert usage["server"] == "tetriinfer" and usage["resource_s"] == pytest.approx(6 * 0.75)
    assert usage["busy_per_instance_s"] == pytest.approx({"d0": 1.5, "p0": 3.0})
    assert (usage["prefix_cache_hit_tokens"], usage["prefix_cache_queried_tokens"]) == (60, 240)
    assert usage["prefix_cache_hit_rate"] == pytest.approx(0.25) and usage["instances_lost"] == []
    from tetriinfer.bench.report import summary_text

    text = summary_text(res)
    assert "Server busy time" in text and "25.0%" in text
    off = run_benchmark(ClientConfig(f"http://127.0.0.1:{server.port}", "fake", progress=False,
                                     server_usage=False), _workload(reqs))
    assert off["server_usage"] is None


def test_servers_without_usage_metrics_give_no_usage(server: FakeServer) -> None:
    reqs = [WorkloadRequest("r0", 0.0, 10, 2)]
    res = run_benchmark(ClientConfig(f"http://127.0.0.1:{server.port}", "fake", progress=False), _workload(reqs))
    assert res["server_usage"] is None and res["summary"]["completed"] == 1  # no /metrics route: no usage
    server.metrics = lambda: "# HELP other_total x\n# TYPE other_total counter\nother_total 3\n"
    assert run_benchmark(ClientConfig(f"http://127.0.0.1:{server.port}", "fake", progress=False),
                         _workload(reqs))["server_usage"] is None


def test_the_client_runs_real_time_for_the_run_only(server: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    """``rt_priority``: every thread of the client's process (here also the fake server's, which shares it) is
    SCHED_FIFO while requests stream, and back under the normal scheduler afterwards; without the privilege the run
    goes on under the normal scheduler with a warning."""
    from tests.serve_helpers import realtime_allowed

    cfg = ClientConfig(f"http://127.0.0.1:{server.port}", "fake", progress=False, rt_priority=3)
    records, _, _ = _run_client(cfg, _workload([WorkloadRequest("a", 0.0, 10, 3), WorkloadRequest("b", 0.02, 10, 2)]))
    assert all(r.success for r in records)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    if realtime_allowed():
        assert server.policies == [os.SCHED_FIFO, os.SCHED_FIFO]
    else:
        assert server.policies == [os.SCHED_OTHER, os.SCHED_OTHER] and "load client" in capsys.readouterr().err
    with pytest.raises(ValueError, match="real-time priority"):
        ClientConfig("http://x", "m", rt_priority=0)
