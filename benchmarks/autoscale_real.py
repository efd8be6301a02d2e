"""Autoscaling on the real runtime: a load that rises and falls, fixed pools vs `--autoscale`, same run.

The mixed workload (prompts <= 1024, outputs <= 192 tokens) arrives as Poisson traffic whose rate steps through
`--profile` (RATE:SECONDS,...). Columns, each a fresh `tetriinfer serve --mode colocated` on the tiny model, one
core per instance: 1 instance, 2 instances, and 1..2 with `--autoscale` (plus `--rebalance` and a warm spare, what
a user would turn on with it). Prints TTFT / JCT per phase and overall, and provisioned instance-seconds over the
run (fixed: instances x duration; autoscaled: integrated from the server's own scaling log, an instance counting
from its add decision to the end of its drain), with ratios against the fixed pool of 2.

    python benchmarks/autoscale_real.py --out report.md
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import httpx
from tqdm.auto import tqdm

from tetriinfer.bench.client import ClientConfig, run_benchmark
from tetriinfer.bench.metrics import summarize
from tetriinfer.bench.report import publish_markdown
from tetriinfer.bench.side_by_side import serve, served_model_id
from tetriinfer.bench.workloads import parse_rate_profile, stepped_workload


def instance_seconds(scaling: list[dict[str, Any]], initial: int, t0: float, t1: float) -> float:
    """Instances provisioned over wall-clock [t0, t1]: ``initial`` throughout, +1 from each add's decision
    (its entry time minus its startup) and -1 after each removal's end (its entry time)."""
    events = [(t0, initial)]
    for e in scaling:
        if e["action"] in ("add", "autoscale-add"):
            events.append((max(t0, e["time"] - e.get("startup_s", 0.0)), 1))
        elif e["action"] in ("remove", "autoscale-remove"):
            events.append((min(t1, e["time"]), -1))
    events.sort()
    total, n, last = 0.0, 0, t0
    for t, d in events:
        t = min(max(t, t0), t1)
        total += n * (t - last)
        n, last = n + d, t
    return total + n * (t1 - last)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the tiny llama)")
    ap.add_argument("--profile", default="0.3:60,2.6:90,0.3:60", help="RATE:SECONDS,... of the mixed workload")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--high", type=float, default=0.6)
    ap.add_argument("--low", type=float, default=0.15)
    ap.add_argument("--window", type=float, default=5.0)
    ap.add_argument("--cooldown", type=float, default=5.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.model is None:
        from tetriinfer.engine.make_model import tiny_model_path

        args.model = str(tiny_model_path())
    phases = parse_rate_profile(args.profile)
    wl = stepped_workload("mixed", phases, args.seed, max_prompt_tokens=1024, max_output_tokens=192)
    common = ["--cores-per-instance", "1", "--kv-cache-memory-gb", "0.25"]
    auto = ["--autoscale", "--autoscale-high", str(args.high), "--autoscale-low", str(args.low),
            "--autoscale-window", str(args.window), "--autoscale-cooldown", str(args.cooldown),
            "--autoscale-max-instances", "2", "--rebalance", "--warm-spares", "1"]
    columns = {"1 instance": ["--instances", "1"], "2 instances": ["--instances", "2"],
               "1..2 --autoscale": ["--instances", "1", *auto]}
    rows: dict[str, dict[str, Any]] = {}
    for label, extra in tqdm(columns.items(), desc="columns"):
        with serve(args.model, "colocated", [*common, *extra], startup_timeout_s=600, poll_s=0.2) as base_url:
            time.sleep(3.0)  # a warm spare finishes its imports before the load starts
            config = ClientConfig(base_url=base_url, model=served_model_id(base_url), progress=False)
            t0 = time.time()
            result = run_benchmark(config, wl, label=label)
            t1 = time.time()
            cluster = httpx.get(f"{base_url}/cluster", timeout=30).json()
            initial = int(extra[extra.index("--instances") + 1])
            rows[label] = {
                "summary": result["summary"],
                "phases": [summarize([r for r in _records(result) if r.request_id.startswith(f"p{i}-")])
                           for i in range(len(phases))],
                "instance_s": instance_seconds(cluster["scaling"], initial, t0, t1),
                "duration_s": t1 - t0,
                "scaling": [(e["action"], round(e["time"] - t0, 1), round(e.get("mean_load", 0.0), 2))
                            for e in cluster["scaling"]],
                "migrated": cluster.get("rebalance", {}).get("migrated", 0),
            }
    lines = [
        "# Autoscaling on the real runtime (tiny model, this machine)", "",
        f"- `tetriinfer serve --mode colocated {' '.join(common)}` per column; workload `mixed` (prompts <= 1024, "
        f"outputs <= 192 tokens), Poisson at " + ", ".join(f"{r:g} req/s for {s:g} s" for r, s in phases)
        + f" ({len(wl)} requests).",
        f"- `--autoscale`: high {args.high}, low {args.low}, window {args.window:g} s, cooldown {args.cooldown:g} s, "
        "1..2 instances, with `--rebalance --warm-spares 1`.",
        "- Command: `python benchmarks/autoscale_real.py`. One run; the machine is shared (compare columns).", "",
        "| column | TTFT mean s | TTFT p99 s | JCT mean s | " + " | ".join(
            f"phase {i + 1} TTFT / JCT s" for i in range(len(phases))) + " | instance-s | failed |",
        "|---|---:|---:|---:|" + "---:|" * len(phases) + "---:|---:|",
    ]
    for label, r in rows.items():
        s = r["summary"]
        lines.append(f"| {label} | {s['ttft']['mean']:.2f} | {s['ttft']['p99']:.2f} | {s['jct']['mean']:.2f} | "
                     + " | ".join(f"{p['ttft']['mean']:.2f} / {p['jct']['mean']:.2f}" for p in r["phases"])
                     + f" | {r['instance_s']:.0f} | {s['failed']} |")
    base, scaled = rows["2 instances"], rows["1..2 --autoscale"]
    lines += ["", f"`1..2 --autoscale` vs `2 instances`: instance-seconds x{scaled['instance_s'] / base['instance_s']:.2f}, "
              f"TTFT x{scaled['summary']['ttft']['mean'] / base['summary']['ttft']['mean']:.2f}, "
              f"JCT x{scaled['summary']['jct']['mean'] / base['summary']['jct']['mean']:.2f}; "
              f"scaling (action, seconds into the run, window mean load): {scaled['scaling']}; "
              f"{scaled['migrated']} requests moved by --rebalance."]
    publish_markdown(lines, args.out)
    return 0


def _records(result: dict[str, Any]) -> list[Any]:
    from tetriinfer.bench.metrics import RequestRecord

    return [RequestRecord.from_dict(d) for d in result["requests"]]


if __name__ == "__main__":
    raise SystemExit(main())
