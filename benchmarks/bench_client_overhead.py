"""What the load generator costs the machine it measures: CPU per streamed token, raw transport vs httpx.

The bench client runs on the same cores as the server under test, so every microsecond it spends per streamed
token is taken from the server, and a client that waits for a core records tokens late (several "arrive" in the
same millisecond). This benchmark starts a fake OpenAI-style streaming server in a child process pinned to one
core (events shaped like ``tetriinfer serve``'s: one chunk per token with continuous usage), runs the same
workload through ``tetriinfer.bench.client`` with each client in turn (``ClientConfig.transport`` and the event
loop: the lean transport on uvloop is the default, httpx on asyncio's loop was the client before it), the client
pinned to the other core, and reports per client:
- client CPU seconds (user + system, ``getrusage``) per 1,000 streamed tokens;
- *late* token gaps: the share of inter-token gaps under 1 ms, although the server sends tokens ``--itl-ms`` apart
  (the client fell behind and read several at once);
- mean TTFT as the client saw it against the server's fixed ``--ttft-ms``.
Clients alternate over ``--rounds`` so machine drift does not favour one; the ratio line compares their means.

    python benchmarks/bench_client_overhead.py --requests 64 --rate 8 --tokens 128 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import uvloop
from tqdm.auto import tqdm

from tetriinfer.bench.client import ClientConfig, run_client
from tetriinfer.bench.workloads import Workload, WorkloadRequest


async def _serve(port_file: Path, ttft_s: float, itl_s: float) -> None:
    """A streaming completion server: ``max_tokens`` chunks, the first after ``ttft_s``, then every ``itl_s``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(h.split(b":", 1)[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
            body = json.loads(await reader.readexactly(length))
            if head.startswith(b"GET"):
                raise ConnectionResetError  # no /v1/models or /metrics here: the client copes without them
            n, prompt = int(body["max_tokens"]), len(body["prompt"])
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            start = time.perf_counter() + ttft_s
            for k in range(1, n + 1):
                await asyncio.sleep(max(0.0, start + (k - 1) * itl_s - time.perf_counter()))
                chunk = {"id": "cmpl-x", "object": "text_completion", "created": 0, "model": "fake",
                         "choices": [{"index": 0, "text": " tok", "logprobs": None,
                                      "finish_reason": "length" if k == n else None}],
                         "usage": {"prompt_tokens": prompt, "completion_tokens": k, "total_tokens": prompt + k}}
                data = b"data: " + json.dumps(chunk).encode() + b"\n\n"
                writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            data = b"data: [DONE]\n\n"
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, StopIteration):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
    port_file.write_text(str(server.sockets[0].getsockname()[1]))
    await server.serve_forever()


def _start_server(args: argparse.Namespace, core: int) -> tuple[subprocess.Popen[bytes], str]:
    port_file = Path(f"/tmp/bench_client_overhead.{os.getpid()}.port")
    port_file.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--serve", str(port_file), "--ttft-ms", str(args.ttft_ms), "--itl-ms",
           str(args.itl_ms)]
    proc = subprocess.Popen(["taskset", "-c", str(core), *cmd])
    for _ in range(200):
        if port_file.exists() and port_file.read_text():
            return proc, f"http://127.0.0.1:{int(port_file.read_text())}"
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("fake server did not start")


# (name, transport, event loop): the client before this benchmark was httpx on asyncio's loop
CLIENTS = (("raw + uvloop", "raw", uvloop.new_event_loop), ("httpx + uvloop", "httpx", uvloop.new_event_loop),
           ("httpx + asyncio", "httpx", asyncio.new_event_loop))


def _one(url: str, transport: str, loop_factory: Any, workload: Workload) -> dict[str, float]:
    """One run of the workload; CPU counted over the sending and streaming only (not the summaries after)."""
    cfg = ClientConfig(url, "fake", transport=transport, progress=False, server_usage=False, detect_max_context=False)
    before = resource.getrusage(resource.RUSAGE_SELF)
    reqs, _, _ = run_client(cfg, workload, loop_factory)
    after = resource.getrusage(resource.RUSAGE_SELF)
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    failed = [r.error for r in reqs if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    tokens = sum(sum(r.chunk_tokens) for r in reqs)
    gaps = [g for r in reqs for g in r.itls_s]
    ttfts = [r.ttft_s for r in reqs]
    return {"tokens": tokens, "cpu_s": user + system, "sys_s": system, "late": sum(g < 0.001 for g in gaps) / max(1, len(gaps)),
            "ttft_ms": statistics.mean(ttfts) * 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=8.0, help="requests per second (uniform arrivals)")
    p.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--itl-ms", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        asyncio.run(_serve(Path(args.serve), args.ttft_ms / 1e3, args.itl_ms / 1e3))
        return 0
    cores = sorted(os.sched_getaffinity(0))
    server_core, client_core = cores[0], cores[-1]
    os.sched_setaffinity(0, {client_core})
    proc, url = _start_server(args, server_core)
    reqs = tuple(WorkloadRequest(f"r{i}", i / args.rate, 200, args.tokens) for i in range(args.requests))
    workload = Workload("client-overhead", reqs, "fixed lengths", "uniform", args.rate, 0)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in CLIENTS}
    try:
        order = [c for r in range(args.rounds) for c in (CLIENTS if r % 2 == 0 else CLIENTS[::-1])]
        for name, transport, loop_factory in tqdm(order, desc="runs", unit="run"):
            runs[name].append(_one(url, transport, loop_factory, workload))
    finally:
        proc.kill()
        proc.wait()
    concurrent = args.rate * (args.ttft_ms + args.itl_ms * (args.tokens - 1)) / 1e3
    print(f"\n{args.requests} requests x {args.tokens} tokens at {args.rate} req/s (~{concurrent:.0f} streams at once), "
          f"server TTFT {args.ttft_ms} ms, ITL {args.itl_ms} ms; server on core {server_core}, client on core "
          f"{client_core}; {args.rounds} round(s) per client, alternating\n")
    print("| client | client CPU ms per 1k tokens | of which system | late gaps (< 1 ms) | client-seen TTFT ms |")
    print("|---|---:|---:|---:|---:|")
    mean: dict[str, dict[str, float]] = {}
    for t, rs in runs.items():
        mean[t] = {k: statistics.mean(r[k] for r in rs) for k in ("cpu_s", "sys_s", "tokens", "late", "ttft_ms")}
        m = mean[t]
        print(f"| {t} | {m['cpu_s'] / m['tokens'] * 1e6:.0f} | {m['sys_s'] / m['tokens'] * 1e6:.0f} | {m['late']:.1%} "
              f"| {m['ttft_ms']:.1f} |")
    per_token = {name: m["cpu_s"] / m["tokens"] for name, m in mean.items()}
    base = CLIENTS[0][0]
    print()
    for name in per_token:
        if name != base:
            print(f"{base}: {per_token[name] / per_token[base]:.2f}x less client CPU per token than {name}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
