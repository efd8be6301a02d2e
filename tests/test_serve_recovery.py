"""Instance failure: kill -9 a decode instance, then a prefill instance, during concurrent greedy streams.

Every stream completes, its text equals the undisturbed run's, no request hangs, new requests succeed, and the
survivors' KV blocks return to 0 (tiny model, loopback, small sizes; the 100-stream version is
``scripts/soak.py``). Then frames from a peer without the cluster's control key are dropped by the survivors."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import zmq

from tests.serve_helpers import ServeProcess, stream_completion
from tetriinfer.runtime import messages as m

STREAMS = 12
MAX_TOKENS = 32


def _prompt(i: int) -> str:
    return f"request {i} " + "tell me more about the weather " * (1 + i % 4)


async def _stream(client: httpx.AsyncClient, url: str, model: str, i: int) -> tuple[str, str | None, int]:
    body = {"model": model, "prompt": _prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    return await stream_completion(client, url, body)


def _instances(srv: ServeProcess) -> dict[str, dict]:
    return {i["id"]: i for i in srv.cluster()["instances"]}


def _run_with_kill(srv: ServeProcess, model: str, ids: range, victim: str | None,
                   ready: str) -> list[tuple[str, str | None, int]]:
    """Run the streams ``ids`` at once and kill -9 ``victim`` while it holds some of them.

    ``ready="queued"``: the victim is frozen (SIGSTOP) before the streams start, so whatever the router sends it waits
    unread in its queue; it is killed once the router counts a stream it holds. ``ready="running"``: once the victim
    reports a running request, it is frozen and, after the router has taken in what it sent before (a prefill handed
    on, a last token), killed only if the router still counts a stream it holds; else it resumes and the wait goes on.
    Either way the kill always lands on held streams, so every one of them must be recovered."""

    async def held_by_victim(client: httpx.AsyncClient) -> tuple[dict, int]:
        info = (await client.get(f"{srv.base_url}/cluster", timeout=10)).json()
        inst = {i["id"]: i for i in info["instances"]}[victim]
        return info | {"victim": inst}, inst["streams_held"]

    async def go() -> list[tuple[str, str | None, int]]:
        async with httpx.AsyncClient() as client:
            pid = _instances(srv)[victim]["pid"] if victim is not None else None
            if pid is not None and ready == "queued":
                os.kill(pid, signal.SIGSTOP)
            tasks = [asyncio.create_task(_stream(client, srv.base_url, model, i)) for i in ids]
            if pid is not None:
                deadline = time.monotonic() + 60
                while True:
                    info, held = await held_by_victim(client)
                    if ready == "queued":
                        if held >= 1 or time.monotonic() > deadline:
                            assert held >= 1, f"{victim} was never sent a stream"
                            os.kill(pid, signal.SIGKILL)
                            break
                    elif (info["victim"][ready] >= 1 and info["requests_in_flight"] >= len(ids) // 2
                          or time.monotonic() > deadline):
                        os.kill(pid, signal.SIGSTOP)
                        await asyncio.sleep(0.3)
                        _, held = await held_by_victim(client)
                        if held >= 1 or time.monotonic() > deadline:
                            assert held >= 1, f"{victim} never held a stream"
                            os.kill(pid, signal.SIGKILL)
                            break
                        os.kill(pid, signal.SIGCONT)
                    await asyncio.sleep(0.02)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=180)

    return asyncio.run(go())


def _wait_blocks_free(srv: ServeProcess, timeout: float = 5.0) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        live = {k: v for k, v in _instances(srv).items() if v["state"] != "dead"}
        if all(v["kv_blocks_used"] == 0 for v in live.values()) or time.monotonic() > deadline:
            return live
        time.sleep(0.1)


def test_killed_decode_then_prefill_instance_streams_continue_unchanged(tiny_llama: Path) -> None:
    # the fixed split: with 12 streams, prompts queue only at the prefill instances (the default would prefill some at
    # decode instances once prefill backs up, leaving too short a queue to kill into; the 120-stream load test
    # covers the default)
    srv = ServeProcess(tiny_llama, "--mode", "tetriinfer", "--pd-controller", "static", "--prefill-instances", "2",
                       "--decode-instances", "2", "--kv-backend", "tcp", "--chunk-size", "32", "--report-interval",
                       "0.05")
    try:
        model = httpx.get(f"{srv.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        baseline = _run_with_kill(srv, model, range(STREAMS), None, "running")
        assert all(f == "length" and n == MAX_TOKENS for _, f, n in baseline)

        after_decode_kill = _run_with_kill(srv, model, range(STREAMS), "decode-0", "running")
        assert after_decode_kill == baseline  # same text, finish reason and token count for every stream
        live = _wait_blocks_free(srv)
        assert set(live) == {"prefill-0", "prefill-1", "decode-1"}
        assert all(v["kv_blocks_used"] == 0 for v in live.values()), live
        recovered = srv.cluster()["recovered"]
        assert recovered > 0

        after_prefill_kill = _run_with_kill(srv, model, range(STREAMS), "prefill-0", "queued")
        assert after_prefill_kill == baseline
        live = _wait_blocks_free(srv)
        assert set(live) == {"prefill-1", "decode-1"}
        assert all(v["kv_blocks_used"] == 0 for v in live.values()), live
        assert srv.cluster()["recovered"] > recovered
        assert srv.cluster()["requests_in_flight"] == 0
        assert srv.cluster()["dropped_control_frames"] == 0  # every instance's frames carried a valid tag
        assert httpx.get(f"{srv.base_url}/health", timeout=5).status_code == 200
        assert _run_with_kill(srv, model, range(2), None, "running") == baseline[:2]  # new requests succeed

        # An unknown peer (no control key) tells every survivor to shut down and aborts nothing: all dropped.
        ctx = zmq.Context()
        for inst in _instances(srv).values():
            if inst["state"] != "dead":
                sock = ctx.socket(zmq.PUSH)
                sock.connect(inst["address"])
                sock.send(m.encode(m.Shutdown()))  # unsigned: this process holds no key
                sock.send(b"\x00garbage")
                sock.close(linger=1000)
        ctx.term()
        assert _run_with_kill(srv, model, range(2), None, "running") == baseline[:2]
        assert {k for k, v in _instances(srv).items() if v["state"] != "dead"} == {"prefill-1", "decode-1"}
    finally:
        srv.stop()
