"""Live migration of running decodes (`--migrate`) vs none, same run, same server settings.

Three experiments, each run once without and once with `--migrate` (`--kv-backend tcp`):

- **scale-in** (`--mode tetriinfer`, 1 prefill + 2 decode instances; and the same with `--mode colocated
  --instances 2`, removing instance-1): `--requests` long decodes (`--max-tokens`, `ignore_eos`) are sent at once; as soon as decode-0
  runs at least 2 of them it is removed (`DELETE /cluster/instances/decode-0`). Reported: the removal's time
  (the server's `total_s`: mark retiring -> drained -> exited; and `drain_s`, Retire -> empty), and the requests'
  mean TTFT / TPOT / JCT. Without migration the removal waits for decode-0's longest decode; with it, decode-0's
  running requests move to decode-1 with their KV.
- **imbalance**: `--dispatch-policy imbalanced` (without a predictor every decode lands on decode-1, the hotspot
  the paper's dispatcher avoids) and `--num-kv-blocks` per instance = 60% of what all requests need at full length:
  decode-1 runs out of KV and preempts (recompute) while decode-0 idles; with `--migrate` (default `kv` signal)
  decode-1 sheds running requests to decode-0 once its KV usage passes 0.85. Reported: mean TPOT / JCT, the
  decode instances' steps.

Prints a table with ratios (migrate / none) and writes it with `--out`.

    python benchmarks/migration.py --out report.md
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from tqdm.auto import tqdm

from tetriinfer.bench.report import publish_markdown
from tetriinfer.bench.side_by_side import serve, served_model_id

BASE = ["--kv-backend", "tcp", "--kv-cache-memory-gb", "0.25"]
DISAGG = ["--prefill-instances", "1", "--decode-instances", "2"]


def stream_one(base_url: str, model: str, i: int, max_tokens: int) -> dict[str, float]:
    body = {"model": model, "prompt": "migrate me please " * (4 + 3 * (i % 5)), "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True}
    t0 = time.perf_counter()
    first, n = None, 0
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                first = first or time.perf_counter()
                n += 1
    end = time.perf_counter()
    if first is None:
        raise RuntimeError(f"request {i} produced no token")
    return {"ttft_s": first - t0, "jct_s": end - t0, "tpot_s": (end - first) / max(1, n - 1), "chunks": n}


def decode_running(base_url: str, instance: str) -> int:
    for inst in httpx.get(f"{base_url}/cluster", timeout=10).json()["instances"]:
        if inst["id"] == instance:
            return int(inst["running"])
    return 0


def scale_in(base_url: str, model: str, n: int, max_tokens: int, victim: str = "decode-0") -> dict[str, Any]:
    removal: dict[str, Any] = {}

    def remove_when_busy() -> None:
        deadline = time.monotonic() + 120
        while decode_running(base_url, victim) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        t0 = time.perf_counter()
        r = httpx.delete(f"{base_url}/cluster/instances/{victim}", timeout=900)
        r.raise_for_status()
        removal.update(r.json(), call_s=time.perf_counter() - t0)

    remover = threading.Thread(target=remove_when_busy)
    remover.start()
    with ThreadPoolExecutor(max_workers=n) as pool:
        reqs = list(pool.map(lambda i: stream_one(base_url, model, i, max_tokens), range(n)))
    remover.join()
    info = httpx.get(f"{base_url}/cluster", timeout=10).json()
    return {"requests": reqs, "removal": removal, "migration": info.get("migration", {})}


def imbalance(base_url: str, model: str, n: int, max_tokens: int) -> dict[str, Any]:
    with ThreadPoolExecutor(max_workers=n) as pool:
        reqs = list(pool.map(lambda i: stream_one(base_url, model, i, max_tokens), range(n)))
    info = httpx.get(f"{base_url}/cluster", timeout=10).json()
    steps = {i["id"]: i["steps"] for i in info["instances"]}
    return {"requests": reqs, "steps": steps, "migration": info.get("migration", {})}


def mean(run: dict[str, Any], key: str) -> float:
    return statistics.fmean(r[key] for r in run["requests"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the tiny llama)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--kv-blocks", type=int, default=None,
                    help="imbalance: KV blocks per instance (default: 60%% of what every request needs at full "
                         "length, so one instance preempts and two do not)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.kv_blocks is None:
        args.kv_blocks = math.ceil(0.6 * args.requests * (args.max_tokens + 64) / 16)
    if args.model is None:
        from tetriinfer.engine.make_model import tiny_model_path

        args.model = str(tiny_model_path())
    runs: dict[tuple[str, str], dict[str, Any]] = {}
    experiments = {
        "scale-in": ("tetriinfer", DISAGG, scale_in),
        "colocated-scale-in": ("colocated", ["--instances", "2"],
                               lambda *a: scale_in(*a, victim="instance-1")),
        "imbalance": ("tetriinfer", [*DISAGG, "--dispatch-policy", "imbalanced", "--num-kv-blocks",
                                     str(args.kv_blocks)], imbalance),
    }
    bar = tqdm(total=2 * len(experiments), desc="migration")
    for name, (mode, extra, fn) in experiments.items():
        for label, flag in (("none", "--no-migrate"), ("migrate", "--migrate")):
            with serve(args.model, mode, [*BASE, *extra, flag], startup_timeout_s=600, poll_s=0.1) as url:
                runs[(name, label)] = fn(url, served_model_id(url), args.requests, args.max_tokens)
            bar.update(1)
    bar.close()

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b else "-"

    lines = [
        "# Live migration of running decodes (`--migrate`)", "",
        f"- Model `{args.model}`; `tetriinfer serve {' '.join(BASE)}` with `--mode tetriinfer {' '.join(DISAGG)}` "
        f"or `--mode colocated --instances 2`; {args.requests} streamed "
        f"requests of {args.max_tokens} output tokens (`ignore_eos`, greedy), sent at once; each experiment once "
        "with `--no-migrate` and once with `--migrate`, one after the other in the same run.",
        "- Command: `python benchmarks/migration.py" + (f" --requests {args.requests}" if args.requests != 8 else "")
        + (f" --max-tokens {args.max_tokens}" if args.max_tokens != 512 else "") + "`.", "",
    ]
    for name, title in (("scale-in", "Scale-in: remove decode-0 (of 1 prefill + 2 decode) while it decodes"),
                        ("colocated-scale-in", "Scale-in, colocated: remove instance-1 (of 2, `--mode colocated`) "
                                               "while it decodes")):
        lines += [
            f"## {title}", "",
            "| | removal total_s | drain_s (Retire -> empty) | moved (evacuate) | mean TTFT | mean TPOT | mean JCT |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for label in ("none", "migrate"):
            r = runs[(name, label)]
            rem, mig = r["removal"], r["migration"]
            lines.append(f"| {label} | {rem.get('total_s', float('nan')):.2f} s | {rem.get('drain_s') or 0:.2f} s | "
                         f"{(mig.get('moved_by_reason') or {}).get('evacuate', 0)} | "
                         f"{mean(r, 'ttft_s') * 1e3:.0f} ms | {mean(r, 'tpot_s') * 1e3:.1f} ms | "
                         f"{mean(r, 'jct_s'):.2f} s |")
        a, b = runs[(name, "migrate")], runs[(name, "none")]
        lines += [f"| **migrate / none** | **{ratio(a['removal']['total_s'], b['removal']['total_s'])}** | "
                  f"{ratio(a['removal'].get('drain_s') or 0, b['removal'].get('drain_s') or 0)} | | "
                  f"{ratio(mean(a, 'ttft_s'), mean(b, 'ttft_s'))} | {ratio(mean(a, 'tpot_s'), mean(b, 'tpot_s'))} | "
                  f"{ratio(mean(a, 'jct_s'), mean(b, 'jct_s'))} |", ""]
    lines += [
        "## Imbalance: every decode dispatched to decode-1 (`--dispatch-policy imbalanced`)", "",
        f"`--num-kv-blocks {args.kv_blocks}` (block size 16) per instance.", "",
        "| | moved (balance) | decode-0 steps | decode-1 steps | mean TTFT | mean TPOT | mean JCT |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label in ("none", "migrate"):
        r = runs[("imbalance", label)]
        mig = r["migration"]
        lines.append(f"| {label} | {(mig.get('moved_by_reason') or {}).get('balance', 0)} | "
                     f"{r['steps'].get('decode-0', 0)} | {r['steps'].get('decode-1', 0)} | "
                     f"{mean(r, 'ttft_s') * 1e3:.0f} ms | {mean(r, 'tpot_s') * 1e3:.1f} ms | {mean(r, 'jct_s'):.2f} s |")
    a, b = runs[("imbalance", "migrate")], runs[("imbalance", "none")]
    lines.append(f"| **migrate / none** | | | | {ratio(mean(a, 'ttft_s'), mean(b, 'ttft_s'))} | "
                 f"**{ratio(mean(a, 'tpot_s'), mean(b, 'tpot_s'))}** | **{ratio(mean(a, 'jct_s'), mean(b, 'jct_s'))}** |")
    mig = runs[("scale-in", "migrate")]["migration"]
    if mig.get("moves"):
        lines += ["", f"Migration cost (scale-in run): {mig['moved']} requests, {mig['bytes'] / 2**20:.1f} MiB of KV, "
                  f"{mig['seconds'] / mig['moves'] * 1e3:.0f} ms per move (Migrate -> last KVDone)."]
    publish_markdown(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
