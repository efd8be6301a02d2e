"""Routing cost of the global scheduler: a burst of requests routed between two load reports, before and after.

"Before" is the original ``GlobalPolicy`` (kept verbatim as ``tests/fixtures/reference/quadratic_global_policy.py``):
each ``route`` rebuilt every instance's list of routings not yet in a report and summed it, so a burst of n requests
between two reports cost O(n^2). "After" is ``tetriinfer.core.global_policy`` (heap-pruned routings, running
totals). Both route the same burst (prompt lengths drawn with one seed) over the same load reports; the table gives
front-end CPU seconds (``time.process_time``) per burst size, the cost per request, and the ratio. Both policies
must make identical decisions (checked). Then ``--http`` sends a burst of single-prompt requests at once to a real
server (tiny model, 1 prefill + 1 decode) with ``max_tokens=1`` and reports the front end's CPU seconds (its own
process, not the instances) and the slowest ``/health`` answer while the burst was in flight.

    python benchmarks/bench_routing.py --sizes 1000,5000,20000 --http 2000 --out docs/reliability_routing.md
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from tetriinfer.core.global_policy import GlobalPolicy, LocalPrefillConfig
from tetriinfer.core.load import LoadReport, Role

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "tests" / "fixtures" / "reference" / "quadratic_global_policy.py"


def _reference() -> object:
    spec = importlib.util.spec_from_file_location("quadratic_global_policy", REF)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _burst(policy: object, n: int, seed: int, instances: int) -> tuple[float, list[str | None]]:
    """Route ``n`` requests arriving 1 us apart after reports built at t=0; returns CPU seconds and decisions."""
    rng = random.Random(seed)
    loads = [LoadReport(f"p{i}", Role.PREFILL, time=0.0, tokens_in_flight=rng.randint(0, 500), num_free_blocks=100)
             for i in range(instances)]
    loads += [LoadReport(f"d{i}", Role.DECODE, time=0.0, num_running=3, num_free_blocks=1000, num_used_blocks=5)
              for i in range(2)]
    lengths = [rng.randint(16, 2048) for _ in range(n)]
    picks: list[str | None] = []
    t0 = time.process_time()
    for i, length in enumerate(lengths):
        now = 1.0 + i * 1e-6
        policy.add(f"r{i}", now, length)  # type: ignore[attr-defined]
        picks.append(policy.route(f"r{i}", loads, now))  # type: ignore[attr-defined]
    return time.process_time() - t0, picks


def policy_table(sizes: list[int], seed: int, instances: int, local: bool) -> list[str]:
    ref = _reference()
    rows = ["| burst (requests) | before: CPU s | after: CPU s | before: us/request | after: us/request | "
            "before / after |", "|---:|---:|---:|---:|---:|---:|"]
    for n in tqdm(sizes, desc="policy bursts"):
        cfg_old = ref.LocalPrefillConfig(enabled=local)  # type: ignore[attr-defined]
        old_s, old_picks = _burst(ref.GlobalPolicy(cfg_old), n, seed, instances)  # type: ignore[attr-defined]
        new_s, new_picks = _burst(GlobalPolicy(LocalPrefillConfig(enabled=local)), n, seed, instances)
        if old_picks != new_picks:
            raise SystemExit(f"decisions differ at burst size {n}")
        rows.append(f"| {n:,} | {old_s:.2f} | {new_s:.3f} | {1e6 * old_s / n:.1f} | {1e6 * new_s / n:.1f} | "
                    f"{old_s / max(new_s, 1e-9):.0f}x |")
    return rows


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _http_burst(base: str, n: int) -> tuple[int, dict[int, int], float]:
    import httpx

    model = (await asyncio.to_thread(httpx.get, f"{base}/v1/models", timeout=30)).json()["data"][0]["id"]
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    codes: dict[int, int] = {}
    slowest_health = 0.0
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        async def one(i: int) -> None:
            body = {"model": model, "prompt": f"burst {i}", "max_tokens": 1, "temperature": 0.0}
            r = await client.post(f"{base}/v1/completions", json=body)
            codes[r.status_code] = codes.get(r.status_code, 0) + 1

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        bar = tqdm(total=n, desc="http burst")
        while not all(t.done() for t in tasks):
            t0 = time.perf_counter()
            async with httpx.AsyncClient(timeout=600) as probe:
                ok = (await probe.get(f"{base}/health")).status_code
            slowest_health = max(slowest_health, time.perf_counter() - t0)
            if ok != 200:
                raise SystemExit(f"/health answered {ok} during the burst")
            bar.n = sum(t.done() for t in tasks)
            bar.refresh()
            await asyncio.sleep(0.2)
        bar.close()
        await asyncio.gather(*tasks)
    return n, codes, slowest_health


def http_table(n: int, model: str | None) -> list[str]:
    sys.path.insert(0, str(ROOT))
    from tests.serve_helpers import ServeProcess

    if model is None:
        from tetriinfer.engine.make_model import default_model_path

        model = str(default_model_path())
    srv = ServeProcess(Path(model), "--mode", "tetriinfer", "--max-pending-requests", str(2 * n),
                       "--max-pending-tokens", str(10_000_000))
    try:
        before = _cpu_s(srv.proc.pid)
        t0 = time.perf_counter()
        sent, codes, slowest = asyncio.run(_http_burst(srv.base_url, n))
        wall = time.perf_counter() - t0
        cpu = _cpu_s(srv.proc.pid) - before
    finally:
        srv.stop()
    return ["| requests at once | answered (status: count) | wall s | front-end CPU s | front-end CPU ms/request | "
            "slowest /health during the burst (s) |", "|---:|---|---:|---:|---:|---:|",
            f"| {sent:,} | {', '.join(f'{k}: {v}' for k, v in sorted(codes.items()))} | {wall:.1f} | {cpu:.1f} | "
            f"{1e3 * cpu / sent:.2f} | {slowest:.2f} |"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1000,5000,20000", help="burst sizes for the policy-level comparison")
    ap.add_argument("--instances", type=int, default=4, help="prefill instances")
    ap.add_argument("--local-prefill", action="store_true", help="with conditional disaggregation (backlogs read)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--http", type=int, default=0, help="also send this many requests at once to a real server")
    ap.add_argument("--model", default=None, help="model folder for --http (default: the tiny llama)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = [f"Command: `python benchmarks/bench_routing.py {' '.join(sys.argv[1:])}`", "",
             f"Machine: {os.cpu_count()} CPUs ({subprocess.run(['uname', '-m'], capture_output=True, text=True).stdout.strip()}), "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             f"Routing a burst between two load reports ({args.instances} prefill instances"
             f"{', conditional disaggregation on' if args.local_prefill else ''}); identical decisions checked:", ""]
    lines += policy_table([int(x) for x in args.sizes.split(",")], args.seed, args.instances, args.local_prefill)
    if args.http:
        lines += ["", "A burst of single-prompt HTTP requests (max_tokens=1) at a real server:", ""]
        lines += http_table(args.http, args.model)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
