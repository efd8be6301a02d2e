"""Instance failure under real concurrency: kill -9 instances while 120 greedy completions stream at once.

One server (tiny model, loopback, 3 prefill + 3 decode instances, TCP KV link) serves every test of this module; each
test runs the same 120 streaming completions (``MAX_TOKENS`` tokens each) and kills one instance meanwhile:

- ``test_decode_killed_mid_decode``: a decode instance while it runs decodes;
- ``test_prefill_killed_with_prompts_queued``: a prefill instance while prompts are queued on it;
- ``test_sender_killed_mid_kv_transfer``: a prefill instance held (``runtime.fault_hooks``) with half of a KV
  payload queued to a decode instance, which has reserved blocks and posted memory for it;
- ``test_receiver_killed_mid_kv_transfer``: the decode instance a held send goes to; the sender is released
  after the front end saw the receiver die, and finishes its send into a dead peer.

Each test requires: every stream completes (none hangs: bounded waits), its text, finish reason and token count
equal the undisturbed run's (token for token), new requests succeed afterwards, and within 5 s every survivor's KV
blocks used are back to 0. No timing is asserted beyond those liveness bounds."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.serve_helpers import ServeProcess, StreamResult, stream_completion
from tetriinfer.runtime.fault_hooks import HOLD_KV_SEND_ENV, arm_file, held_file

STREAMS = 120
MAX_TOKENS = 16
Result = StreamResult


def _prompt(i: int) -> str:
    return f"request {i} " + "tell me more about the weather " * (1 + i % 3)


async def _stream(client: httpx.AsyncClient, url: str, model: str, i: int) -> Result:
    body = {"model": model, "prompt": _prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    return await stream_completion(client, url, body)


@dataclass
class Served:
    srv: ServeProcess
    model: str
    hold_dir: Path
    baseline: list[Result]

    def instances(self) -> dict[str, dict]:
        return {i["id"]: i for i in self.srv.cluster()["instances"]}

    def live(self, role: str) -> list[str]:
        return sorted(k for k, v in self.instances().items() if v["state"] != "dead" and v["role"] == role)


def _run(s: Served, n: int, during=None) -> list[Result]:
    """``n`` streams at once; ``during(client)`` (a coroutine function) runs beside them."""

    async def go() -> list[Result]:
        limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
        async with httpx.AsyncClient(limits=limits) as client:
            tasks = [asyncio.create_task(_stream(client, s.srv.base_url, s.model, i)) for i in range(n)]
            if during is not None:
                try:
                    await during(client)
                except BaseException:
                    for t in tasks:
                        t.cancel()
                    raise
            return list(await asyncio.wait_for(asyncio.gather(*tasks), timeout=240))

    return asyncio.run(go())


async def _cluster(client: httpx.AsyncClient, s: Served) -> dict:
    return (await client.get(f"{s.srv.base_url}/cluster", timeout=10)).json()


async def _wait_for(cond, what: str, timeout: float = 60.0, every: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(every)


def _check_after_kill(s: Served, results: list[Result], victim: str, recovered_before: int) -> None:
    """Every stream equals the undisturbed run, the victim is dead, survivors' KV is back to 0 within 5 s, nothing is
    left in flight, the cluster is healthy and serves new requests."""
    assert results == s.baseline  # same text, finish reason and token count for every stream
    deadline = time.monotonic() + 5.0
    while True:
        inst = s.instances()
        live = {k: v for k, v in inst.items() if v["state"] != "dead"}
        if all(v["kv_blocks_used"] == 0 for v in live.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert inst[victim]["state"] == "dead"
    assert all(v["kv_blocks_used"] == 0 for v in live.values()), live
    info = s.srv.cluster()
    # every unfinished request the victim held was sent again, at most once each for this one death
    assert recovered_before < info["recovered"] <= recovered_before + STREAMS
    assert info["requests_in_flight"] == 0
    assert info["dropped_control_frames"] == 0
    assert httpx.get(f"{s.srv.base_url}/health", timeout=5).status_code == 200
    assert _run(s, 4) == s.baseline[:4]  # new requests succeed


@pytest.fixture(scope="module")
def served(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    hold_dir = tmp_path_factory.mktemp("kv-hold")
    srv = ServeProcess(tiny_llama, "--mode", "tetriinfer", "--prefill-instances", "3", "--decode-instances", "3",
                       "--kv-backend", "tcp", "--chunk-size", "32", "--report-interval", "0.05",
                       env={HOLD_KV_SEND_ENV: str(hold_dir)})
    try:
        model = httpx.get(f"{srv.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        s = Served(srv, model, hold_dir, [])
        s.baseline = _run(s, STREAMS)  # undisturbed
        assert all(f == "length" and n == MAX_TOKENS for _, f, n in s.baseline)
        assert len({t for t, _, _ in s.baseline}) > 1
        yield s
    finally:
        srv.stop()


def _kill_when(s: Served, role: str, field: str) -> tuple[str, list[Result]]:
    """Run the streams; once a live ``role`` instance (one of at least two) reports ``field`` >= 1 with half the
    streams in flight, kill -9 it."""
    live = s.live(role)
    assert len(live) >= 2, f"need two live {role} instances, have {live}"
    victim = live[0]

    async def kill(client: httpx.AsyncClient) -> None:
        async def ready() -> bool:
            info = await _cluster(client, s)
            inst = {i["id"]: i for i in info["instances"]}[victim]
            return inst[field] >= 1 and info["requests_in_flight"] >= STREAMS // 2

        await _wait_for(ready, f"{victim} to report {field}")
        os.kill({i["id"]: i for i in (await _cluster(client, s))["instances"]}[victim]["pid"], signal.SIGKILL)

    return victim, _run(s, STREAMS, kill)


def test_decode_killed_mid_decode(served: Served) -> None:
    before = served.srv.cluster()["recovered"]
    victim, results = _kill_when(served, "decode", "running")
    _check_after_kill(served, results, victim, before)


def test_prefill_killed_with_prompts_queued(served: Served) -> None:
    before = served.srv.cluster()["recovered"]
    victim, results = _kill_when(served, "prefill", "queued")
    _check_after_kill(served, results, victim, before)


def _held(s: Served, iid: str) -> dict | None:
    try:
        return json.loads(held_file(s.hold_dir, iid).read_text())
    except FileNotFoundError:
        return None


def test_sender_killed_mid_kv_transfer(served: Served) -> None:
    """The prefill instance is killed while its KV send is half queued: the receiver's reserved blocks are freed
    (by the abort of the old attempt) and every request it held continues elsewhere."""
    senders = served.live("prefill")
    assert len(senders) >= 2 and served.live("decode")
    sender = senders[0]
    before = served.srv.cluster()["recovered"]
    arm_file(served.hold_dir, sender).write_text("")  # its next KV send, to any decode instance
    seen: dict = {}

    async def kill(client: httpx.AsyncClient) -> None:
        async def held() -> bool:
            return _held(served, sender) is not None

        await _wait_for(held, f"{sender} to hold a KV send")
        seen.update(_held(served, sender) or {})
        inst = {i["id"]: i for i in (await _cluster(client, served))["instances"]}
        assert inst[seen["decode_id"]]["state"] != "dead"
        await asyncio.sleep(0.2)  # the queued half leaves
        os.kill(inst[sender]["pid"], signal.SIGKILL)

    results = _run(served, STREAMS, kill)
    assert 0 < seen["queued_bytes"] < seen["total_bytes"]
    assert not arm_file(served.hold_dir, sender).exists()
    _check_after_kill(served, results, sender, before)


def test_receiver_killed_mid_kv_transfer(served: Served) -> None:
    """The decode instance a held KV send goes to is killed; the sender, released once the front end saw the death,
    finishes its send into the dead peer. Every request either held completes."""
    senders, receivers = served.live("prefill"), served.live("decode")
    assert senders and len(receivers) >= 2
    sender, receiver = senders[0], receivers[0]
    before = served.srv.cluster()["recovered"]
    arm_file(served.hold_dir, sender).write_text(receiver)  # its next KV send to ``receiver``

    async def kill(client: httpx.AsyncClient) -> None:
        async def held() -> bool:
            return _held(served, sender) is not None

        await _wait_for(held, f"{sender} to hold a KV send to {receiver}")
        inst = {i["id"]: i for i in (await _cluster(client, served))["instances"]}
        await asyncio.sleep(0.2)  # the queued half leaves
        os.kill(inst[receiver]["pid"], signal.SIGKILL)

        async def dead() -> bool:
            info = await _cluster(client, served)
            return {i["id"]: i for i in info["instances"]}[receiver]["membership"] == "dead"

        await _wait_for(dead, f"the front end to see {receiver} dead")
        await asyncio.sleep(0.2)
        held_file(served.hold_dir, sender).unlink()  # release the sender

    try:
        results = _run(served, STREAMS, kill)
    finally:
        arm_file(served.hold_dir, sender).unlink(missing_ok=True)
        held_file(served.hold_dir, sender).unlink(missing_ok=True)
    _check_after_kill(served, results, receiver, before)
