"""Soak test: normal load, client disconnects, overload bursts and instance kills against a real server, bounded.

Starts ``tetriinfer serve`` (tiny model by default; ``--prefill-instances`` + ``--decode-instances``, with
``--replace-dead`` so a killed instance is replaced and a small ``--max-pending-requests`` so bursts meet 429s) and
for ``--minutes`` runs:
- normal load: ``--workers`` clients sending greedy completions back to back (streaming or not, 8-48 tokens, prompts
  from a fixed pool, so a prompt's output must always be the same: a differing one counts as ``diverged``);
- disconnects: some streams are closed by the client after two chunks;
- overload bursts: every ``--burst-every`` seconds ``--burst`` requests at once;
- instance kills: every ``--kill-every`` seconds ``kill -9`` of one live instance (prefill and decode in turn).
Then it waits for the server to go idle and prints: sent / completed / refused (429) / disconnected (by the client,
on purpose) / errored / lost (no answer: must be 0) / diverged (must be 0) / KV blocks leaked (used blocks on live
instances once idle: must be 0). Exit status 1 if lost, diverged or leaked is not 0.

    python scripts/soak.py --minutes 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.serve_helpers import ServeProcess  # noqa: E402

PROMPTS = [f"soak prompt {i}: " + "tell me about the sea and the wind " * (1 + i % 6) for i in range(24)]
REQUEST_TIMEOUT_S = 300.0


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    refused: int = 0
    disconnected: int = 0
    errored: int = 0
    lost: int = 0
    diverged: int = 0
    kills: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    outputs: dict[tuple[int, int], str] = field(default_factory=dict)  # (prompt, max_tokens) -> text

    def check(self, key: tuple[int, int], text: str) -> None:
        seen = self.outputs.setdefault(key, text)
        if seen != text:
            self.diverged += 1


async def one(client: httpx.AsyncClient, url: str, model: str, t: Tally, rng: random.Random, *,
              stream: bool, disconnect: bool = False) -> None:
    p, n = rng.randrange(len(PROMPTS)), rng.choice((8, 16, 32, 48))
    body = {"model": model, "prompt": PROMPTS[p], "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "stream": stream}
    t.sent += 1
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            if not stream:
                r = await client.post(f"{url}/v1/completions", json=body)
                if r.status_code == 429:
                    t.refused += 1
                elif r.status_code == 200 and r.json()["usage"]["completion_tokens"] == n:
                    t.completed += 1
                    t.check((p, n), r.json()["choices"][0]["text"])
                else:
                    t.errored += 1
                    t.errors.append(f"{r.status_code}: {r.text[:200]}")
                return
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                if r.status_code == 429:
                    await r.aread()
                    t.refused += 1
                    return
                if r.status_code != 200:
                    t.errored += 1
                    t.errors.append(f"{r.status_code}: {(await r.aread())[:200]!r}")
                    return
                text, chunks, finish, failed = "", 0, None, None
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        failed = ev["error"]["message"]
                        continue
                    chunks += 1
                    for ch in ev["choices"]:
                        text += ch["text"]
                        finish = ch["finish_reason"] or finish
                    if disconnect and chunks >= 2:
                        t.disconnected += 1
                        return  # leaving the block closes the connection mid-stream
                if failed is None and finish == "length":
                    t.completed += 1
                    t.check((p, n), text)
                else:
                    t.errored += 1
                    t.errors.append(f"stream ended with {finish!r}: {failed}")
    except TimeoutError:
        t.lost += 1
    except httpx.HTTPError as e:
        t.errored += 1
        t.errors.append(f"{type(e).__name__}: {e}")


def _live(info: dict) -> list[dict]:
    return [i for i in info["instances"] if i["state"] not in ("dead", "starting") and i["membership"] == "serving"]


async def soak(srv: ServeProcess, args: argparse.Namespace, t: Tally) -> None:
    rng = random.Random(args.seed)
    # idle connections expire before the server's keep-alive timeout (5 s), so none is reused while it closes
    limits = httpx.Limits(max_connections=args.burst + args.workers + 8, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S + 30, limits=limits) as client:
        model = (await client.get(f"{srv.base_url}/v1/models")).json()["data"][0]["id"]
        end = time.monotonic() + 60 * args.minutes
        background: set[asyncio.Task] = set()

        async def worker(w: int) -> None:
            wr = random.Random(args.seed * 1000 + w)
            while time.monotonic() < end:
                await one(client, srv.base_url, model, t, wr, stream=wr.random() < 0.6,
                          disconnect=wr.random() < 0.1)

        workers = [asyncio.create_task(worker(w)) for w in range(args.workers)]
        next_burst = time.monotonic() + args.burst_every
        next_kill = time.monotonic() + args.kill_every
        role_turn = 0
        with tqdm(total=int(60 * args.minutes), desc="soak (s)") as bar:
            start = time.monotonic()
            while time.monotonic() < end:
                await asyncio.sleep(1.0)
                bar.n = int(time.monotonic() - start)
                bar.set_postfix(sent=t.sent, done=t.completed, r429=t.refused, err=t.errored, kills=len(t.kills))
                if time.monotonic() >= next_burst:
                    next_burst += args.burst_every
                    for _ in range(args.burst):
                        task = asyncio.create_task(one(client, srv.base_url, model, t, rng, stream=False))
                        background.add(task)
                        task.add_done_callback(background.discard)
                if time.monotonic() >= next_kill:
                    next_kill += args.kill_every
                    info = (await client.get(f"{srv.base_url}/cluster")).json()
                    role = ("decode", "prefill")[role_turn % 2]
                    role_turn += 1
                    live = [i for i in _live(info) if i["role"] == role]
                    if len(live) >= 2 or (live and args.kill_last):  # keep one serving while its replacement starts
                        victim = rng.choice(live)
                        os.kill(victim["pid"], signal.SIGKILL)
                        t.kills.append(victim["id"])
        await asyncio.gather(*workers, *background)


def leaked_blocks(srv: ServeProcess, wait_s: float) -> tuple[int, dict]:
    deadline = time.monotonic() + wait_s
    while True:
        info = srv.cluster()
        used = sum(i["kv_blocks_used"] for i in info["instances"] if i["state"] != "dead")
        if (used == 0 and info["requests_in_flight"] == 0) or time.monotonic() > deadline:
            return used, info
        time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--model", default=None, help="model folder (default: the tiny llama)")
    ap.add_argument("--prefill-instances", type=int, default=2)
    ap.add_argument("--decode-instances", type=int, default=2)
    ap.add_argument("--workers", type=int, default=12, help="clients sending back to back")
    ap.add_argument("--burst", type=int, default=150, help="requests in one overload burst")
    ap.add_argument("--burst-every", type=float, default=25.0)
    ap.add_argument("--kill-every", type=float, default=40.0)
    ap.add_argument("--kill-last", action="store_true", help="also kill the last live instance of a role")
    ap.add_argument("--max-pending-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = args.model
    if model is None:
        from tetriinfer.engine.make_model import default_model_path

        model = str(default_model_path())
    srv = ServeProcess(Path(model), "--mode", "tetriinfer", "--prefill-instances", str(args.prefill_instances),
                       "--decode-instances", str(args.decode_instances), "--kv-backend", "tcp", "--replace-dead",
                       "--max-pending-requests", str(args.max_pending_requests), "--report-interval", "0.05")
    t = Tally()
    t0 = time.perf_counter()
    try:
        asyncio.run(soak(srv, args, t))
        leaked, info = leaked_blocks(srv, 30.0)
        healthy = httpx.get(f"{srv.base_url}/health", timeout=10).status_code == 200
    finally:
        srv.stop()
    print(f"soak: {args.minutes:g} min, {args.prefill_instances} prefill + {args.decode_instances} decode instances "
          f"(--replace-dead), {args.workers} workers, bursts of {args.burst} every {args.burst_every:g} s, a kill "
          f"every {args.kill_every:g} s; wall {time.perf_counter() - t0:.0f} s")
    print(f"sent {t.sent} | completed {t.completed} | refused (429) {t.refused} | disconnected {t.disconnected} | "
          f"errored {t.errored} | lost {t.lost} | diverged {t.diverged} | KV blocks leaked {leaked}")
    print(f"instances killed: {len(t.kills)} ({', '.join(t.kills)}); requests recovered: {info.get('recovered')}; "
          f"replacements: {sum(1 for e in info['scaling'] if e['action'] == 'replace')}; healthy at the end: {healthy}")
    for err in t.errors[:10]:
        print("  error:", err)
    return 0 if t.lost == 0 and t.diverged == 0 and leaked == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
