"""Cost of serving the length predictor: TTFT and throughput with the predictor in parallel (and
sequential) mode vs ``--predictor none``, in one run on the same machine, same workload.

Usage: python benchmarks/bench_predictor_serving.py --predictor DIR [--model DIR] [--num-requests N]

Each configuration serves the same workload (arrivals at time 0 = "extreme load", as the paper measured
its ~10% cost, plus an open-loop rate) through `tetriinfer serve --mode tetriinfer` (1 prefill + 1 decode
instance, each pinned to one core). Prints a markdown table with ratios to ``none`` and writes it to
docs/predictor.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from tetriinfer.bench.client import benchmark_server
from tetriinfer.bench.metrics import flat_summary
from tetriinfer.bench.side_by_side import serve, served_model_id, wait_idle
from tetriinfer.bench.workloads import load_workload

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--predictor", required=True, help="a folder from `tetriinfer predictor train`")
    ap.add_argument("--model", default=None)
    ap.add_argument("--workload", default="mixed")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--rates", default="inf,2", help="comma-separated request rates; inf = all at t=0")
    ap.add_argument("--modes", default="none,parallel,sequential")
    ap.add_argument("--out", default=str(ROOT / "docs" / "predictor_serving.md"))
    args = ap.parse_args()
    if not Path(args.predictor, "predictor.json").exists():
        print(f"error: {args.predictor} is not a predictor folder (train one with `tetriinfer predictor train`)",
              file=sys.stderr)
        return 2
    model = args.model
    if model is None:
        from tetriinfer.engine.make_model import tiny_model_path

        model = str(tiny_model_path())
    rates = [None if r == "inf" else float(r) for r in args.rates.split(",")]
    modes = args.modes.split(",")
    rows: dict[tuple[str, str], dict] = {}
    bar = tqdm(total=len(modes) * len(rates), desc="predictor cost")
    for mode in modes:
        serve_args = ["--chunk-size", "256", "--kv-cache-memory-gb", "0.5"]
        if mode != "none":
            serve_args += ["--predictor", args.predictor, "--predictor-mode", mode]
        with serve(model, "tetriinfer", serve_args, startup_timeout_s=300) as url:
            name = served_model_id(url)
            for rate in rates:
                wl = load_workload(args.workload, args.num_requests, rate=rate, seed=0,
                                   max_prompt_tokens=1024, max_output_tokens=128)
                before = wait_idle(url)
                t0 = time.perf_counter()
                res = benchmark_server(url, name, [wl], progress=False)[wl.name]
                wall = time.perf_counter() - t0
                after = wait_idle(url)
                row = flat_summary(res["summary"])
                row["busy_s"] = sum(after.values()) - sum(before.values())
                row["wall_s"] = wall
                row["output_tok_s"] = res["summary"]["output_throughput"]
                rows[(mode, "inf" if rate is None else str(rate))] = row
                bar.update(1)
    bar.close()
    lines = [
        "# Serving cost of the length predictor\n",
        f"Workload `{args.workload}`, {args.num_requests} requests, tiny model, 1 prefill + 1 decode instance "
        f"(one core each), predictor `{args.predictor}`. Ratios are to `--predictor none` in the same run.\n",
        "| predictor | rate (req/s) | TTFT mean (s) | TTFT ratio | throughput (req/s) | throughput ratio | "
        "output tok/s | failed |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (mode, rate), row in rows.items():
        base = rows[("none", rate)]
        lines.append(
            f"| {mode} | {rate} | {row['ttft_mean']:.3f} | {row['ttft_mean'] / base['ttft_mean']:.2f} | "
            f"{row['throughput_rps']:.3f} | {row['throughput_rps'] / base['throughput_rps']:.3f} | "
            f"{row['output_tok_s']:.1f} | {row['failed']} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    Path(args.out).write_text(table)
    Path(args.out).with_suffix(".json").write_text(
        json.dumps({f"{m}@{r}": v for (m, r), v in rows.items()}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
