"""Routing cost of the global scheduler: a burst of requests routed between two load reports, before and after.

"Before" is the original ``GlobalPolicy`` (kept verbatim as ``tests/fixtures/reference/quadratic_global_policy.py``):
each ``route`` rebuilt every instance's list of routings not yet in a report and summed it, so a burst of n requests
between two reports cost O(n^2). "After" is ``tetriinfer.core.global_policy`` (heap-pruned routings, running
totals). Both route the same burst (prompt lengths drawn with one seed) over the same load reports; the table gives
front-end CPU seconds (``time.process_time``) per burst size, the cost per request, and the ratio. Both policies
must make identical decisions (checked). Then ``--http`` sends a burst of single-prompt requests at once to a real
server (tiny model, 1 prefill + 1 decode) with ``max_tokens=1`` and reports the front end's CPU seconds (its own
process, not the instances) and the slowest ``/health`` answer while the burst was in flight.

    python benchmarks/bench_routing.py --sizes 1000,5000,20000 --http 3000 --http-before
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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


async def _post(host: str, port: int, body: bytes) -> int:
    """One HTTP/1.1 request on its own connection with a minimal client (the load generator must stay light)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body))
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    while await reader.read(65536):
        pass
    writer.close()
    return status


def _probe_health(url: str, stop: Any, out: Any) -> None:
    """In its own process: GET /health back to back on one kept-alive connection (as a load balancer's health check
    does; a new connection per probe would also time the kernel's full accept queue) until ``stop`` is set; report
    the slowest answer and the status codes."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
    slowest, codes = 0.0, {}
    while not stop.is_set():
        t0 = time.perf_counter()
        conn.request("GET", parts.path)
        resp = conn.getresponse()
        resp.read()
        slowest = max(slowest, time.perf_counter() - t0)
        codes[resp.status] = codes.get(resp.status, 0) + 1
        time.sleep(0.05)
    conn.close()
    out.put((slowest, codes))


async def _http_burst(host: str, port: int, model: str, n: int) -> dict[int, int]:
    codes: dict[int, int] = {}
    bodies = [json.dumps({"model": model, "prompt": f"burst {i}", "max_tokens": 1, "temperature": 0.0}).encode()
              for i in range(n)]
    tasks = [asyncio.create_task(_post(host, port, b)) for b in bodies]
    with tqdm(total=n, desc="http burst") as bar:
        for fut in asyncio.as_completed(tasks):
            code = await fut
            codes[code] = codes.get(code, 0) + 1
            bar.update(1)
    return codes


_SITECUSTOMIZE = """
import sys
import types

import tetriinfer.core.global_policy as g

src = open({ref!r}).read().replace("class Phase(enum.Enum):", "class _UnusedPhase(enum.Enum):")
src = src.replace("from __future__ import annotations\\n", "from __future__ import annotations\\n"
                  "from tetriinfer.core.global_policy import Phase\\n", 1)
mod = types.ModuleType("quadratic_global_policy")
sys.modules[mod.__name__] = mod
exec(compile(src, {ref!r}, "exec"), mod.__dict__)
g.GlobalPolicy = mod.GlobalPolicy  # the front end imports it after this runs
"""


def http_table(n: int, model: str | None, before: bool) -> list[str]:
    """The HTTP burst against a server with the current routing, and (``before``) with the original one (loaded in
    the server process through a ``sitecustomize`` on its path; the instances ignore it)."""
    import tempfile

    sys.path.insert(0, str(ROOT))
    rows = ["| routing | requests at once | answered (status: count) | wall s | front-end CPU s | "
            "front-end CPU ms/request | slowest /health during the burst, s (answers) |",
            "|---|---:|---|---:|---:|---:|---:|"]
    for label in (["before", "after"] if before else ["after"]):
        old_path = os.environ.get("PYTHONPATH", "")
        with tempfile.TemporaryDirectory() as shim:
            if label == "before":
                Path(shim, "sitecustomize.py").write_text(_SITECUSTOMIZE.format(ref=str(REF)))
                os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (shim, old_path) if p)
            try:
                rows.append(f"| {label} | " + _http_row(n, model))
            finally:
                os.environ["PYTHONPATH"] = old_path
    return rows


def _http_row(n: int, model: str | None) -> str:
    from tests.serve_helpers import ServeProcess

    if model is None:
        from tetriinfer.engine.make_model import default_model_path

        model = str(default_model_path())
    import multiprocessing as mp

    import httpx

    srv = ServeProcess(Path(model), "--mode", "tetriinfer", "--max-pending-requests", str(2 * n),
                       "--max-pending-tokens", str(10_000_000))
    try:
        served = httpx.get(f"{srv.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        stop, out = mp.Event(), mp.Queue()
        probe = mp.Process(target=_probe_health, args=(f"{srv.base_url}/health", stop, out))
        probe.start()
        before = _cpu_s(srv.proc.pid)
        t0 = time.perf_counter()
        codes = asyncio.run(_http_burst("127.0.0.1", srv.port, served, n))
        wall = time.perf_counter() - t0
        cpu = _cpu_s(srv.proc.pid) - before
        stop.set()
        slowest, health_codes = out.get(timeout=300)
        probe.join(30)
    finally:
        srv.stop()
    sent = n
    return (f"{sent:,} | {', '.join(f'{k}: {v}' for k, v in sorted(codes.items()))} | {wall:.1f} | {cpu:.1f} | "
            f"{1e3 * cpu / sent:.2f} | {slowest:.2f} ({', '.join(f'{k}: {v}' for k, v in health_codes.items())}) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1000,5000,20000", help="burst sizes for the policy-level comparison ('': none)")
    ap.add_argument("--instances", type=int, default=4, help="prefill instances")
    ap.add_argument("--local-prefill", action="store_true", help="with conditional disaggregation (backlogs read)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--http", type=int, default=0, help="also send this many requests at once to a real server")
    ap.add_argument("--model", default=None, help="model folder for --http (default: the tiny llama)")
    ap.add_argument("--http-before", action="store_true", help="also run the HTTP burst with the original routing")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = [f"Command: `python benchmarks/bench_routing.py {' '.join(sys.argv[1:])}`", "",
             f"Machine: {os.cpu_count()} CPUs ({subprocess.run(['uname', '-m'], capture_output=True, text=True).stdout.strip()}), "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             f"Routing a burst between two load reports ({args.instances} prefill instances"
             f"{', conditional disaggregation on' if args.local_prefill else ''}); identical decisions checked:", ""]
    if args.sizes:
        lines += policy_table([int(x) for x in args.sizes.split(",")], args.seed, args.instances, args.local_prefill)
        print("\n".join(lines), flush=True)
    if args.http:
        lines += ["", "A burst of single-prompt HTTP requests (max_tokens=1) at a real server:", ""]
        lines += http_table(args.http, args.model, args.http_before)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
