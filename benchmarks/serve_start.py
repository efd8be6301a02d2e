"""Time from `tetriinfer serve` to a healthy cluster, per load format, and the instances' memory (same run).

Starts the server (`--mode colocated --instances N`, one instance process per core) on one model for each
`--load-format`, measures seconds until `/health` answers 200 (every instance has loaded its weights and
reported in), sends one request per instance, sums the proportional set size (PSS) of the instance processes,
and stops it. Formats run
interleaved, `--repeats` times; ratios are against `auto` (the HF folder). The fast checkpoint is made before
timing (first-use conversion is a one-time cost, reported separately); `fast-shm` is timed both as the first
server on the host (reads the weights into /dev/shm) and as a later one (maps them).

    python benchmarks/serve_start.py --model /path/to/medium-llama --dtype bfloat16 --out report.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from tqdm.auto import tqdm


def pss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def start_once(model: str, dtype: str, fmt: str, instances: int) -> dict[str, float]:
    from tetriinfer.bench.side_by_side import serve

    args = ["--dtype", dtype, "--instances", str(instances), "--load-format", fmt, "--kv-cache-memory-gb", "0.25"]
    t0 = time.perf_counter()
    with serve(model, "colocated", args, startup_timeout_s=600, poll_s=0.05) as base_url:
        ready = time.perf_counter() - t0
        # One request per instance (sent together: the front end spreads them), so every instance has run its
        # weights once before its memory is read: mapped pages count in PSS only once touched.
        body = {"model": Path(model).name, "prompt": "Hello there", "max_tokens": 2, "temperature": 0}
        with ThreadPoolExecutor(instances) as pool:
            codes = list(pool.map(lambda _: httpx.post(f"{base_url}/v1/completions", json=body,
                                                       timeout=120).status_code, range(instances)))
        if codes != [200] * instances:
            raise RuntimeError(f"completions failed: {codes}")
        pids = [i["pid"] for i in httpx.get(f"{base_url}/cluster", timeout=10).json()["instances"]]
        return {"ready_s": ready, "instances_pss": float(sum(pss(p) for p in pids))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from tetriinfer.engine import fast_checkpoint as fc
    from tetriinfer.engine.loader import ensure_checkpoint, parse_dtype

    t0 = time.perf_counter()
    ckpt, made_s = ensure_checkpoint(args.model, parse_dtype(args.dtype))
    convert_s = made_s or 0.0
    labels = ["auto", "fast", "fast-shm (first)", "fast-shm (next)"]
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in labels}
    bar = tqdm(total=len(labels) * args.repeats, desc="serve start")
    for _ in range(args.repeats):
        for fmt in ("auto", "fast"):
            runs[fmt].append(start_once(args.model, args.dtype, fmt, args.instances))
            bar.update(1)
        fc.evict_shm(ckpt)
        runs["fast-shm (first)"].append(start_once(args.model, args.dtype, "fast-shm", args.instances))
        runs["fast-shm (next)"].append(start_once(args.model, args.dtype, "fast-shm", args.instances))
        fc.evict_shm(ckpt)
        bar.update(2)
    bar.close()
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("ready_s", "instances_pss")} for k, v in runs.items()}
    gib = fc.read_index(ckpt).total_bytes / 2**30
    lines = ["# Server start: `tetriinfer serve` to healthy, per load format (same run)", "",
             f"`--mode colocated --instances {args.instances}`, model `{args.model}` ({gib:.2f} GiB of {args.dtype} "
             f"weights), {args.repeats} starts per format (interleaved), medians. Fast checkpoint made beforehand"
             + (f" ({convert_s:.1f} s, once)" if convert_s else " (already cached)")
             + f"; setup took {time.perf_counter() - t0:.0f} s in all.", "",
             "| load format | start to healthy s | vs auto | instances' PSS GiB (after a request each) |", "|---|---:|---:|---:|"]
    for k in labels:
        lines.append(f"| {k} | {med[k]['ready_s']:.2f} | {med['auto']['ready_s'] / med[k]['ready_s']:.2f}x faster | "
                     f"{med[k]['instances_pss'] / 2**30:.2f} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        out = Path(args.out)
        out.write_text(report + f"\nCommand: `{' '.join(sys.argv)}`\n", encoding="utf-8")
        out.with_suffix(".json").write_text(json.dumps({"medians": med, "runs": runs, "weights_gib": gib,
                                                        "convert_s": convert_s}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
