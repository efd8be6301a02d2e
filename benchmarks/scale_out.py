"""Scale-out time with and without warm spares (`--warm-spares`), same run, same server settings.

Starts `tetriinfer serve --mode colocated --instances 1` twice (cold: `--warm-spares 0`; warm: `--warm-spares 1`).
On each, `--repeats` times: wait until the pool is quiet (and, warm, the spare has finished its imports), then
`POST /cluster/instances {"role": "colocated"}` and record the server's own `startup_s` (placement -> the new
instance's hello: process start, imports, weight load, KV allocation) and the client-side time of the call; one
request then checks the new instance serves, and `DELETE` removes it again (drain-then-retire). Prints the mean
of each and the ratio warm / cold.

    python benchmarks/scale_out.py --out report.md
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx
from tqdm.auto import tqdm

from tetriinfer.bench.report import publish_markdown
from tetriinfer.bench.side_by_side import serve, served_model_id


def spares_ready(wait_s: float) -> None:
    """A spare imports torch and the engine (~2-3 s on this machine); give it time before timing an add."""
    time.sleep(wait_s)


def add_remove(base_url: str, model: str) -> dict[str, float]:
    t0 = time.perf_counter()
    r = httpx.post(f"{base_url}/cluster/instances", json={"role": "colocated"}, timeout=600)
    call_s = time.perf_counter() - t0
    r.raise_for_status()
    entry = r.json()
    body = {"model": model, "prompt": "scale out", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    codes = {httpx.post(f"{base_url}/v1/completions", json=body, timeout=120).status_code for _ in range(2)}
    if codes != {200}:
        raise RuntimeError(f"completions after the add failed: {codes}")
    httpx.delete(f"{base_url}/cluster/instances/{entry['instance']}", timeout=600).raise_for_status()
    return {"startup_s": entry["startup_s"], "call_s": call_s, "warm": float(bool(entry.get("warm")))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the tiny llama)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--settle-s", type=float, default=6.0, help="quiet time before each add")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.model is None:
        from tetriinfer.engine.make_model import tiny_model_path

        args.model = str(tiny_model_path())
    runs: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    bar = tqdm(total=2 * args.repeats, desc="scale-out")
    for label, spares in (("cold", 0), ("warm", 1)):
        extra = ["--instances", "1", "--kv-cache-memory-gb", "0.25", "--warm-spares", str(spares)]
        with serve(args.model, "colocated", extra, startup_timeout_s=600, poll_s=0.1) as base_url:
            model = served_model_id(base_url)
            for _ in range(args.repeats):
                spares_ready(args.settle_s)
                runs[label].append(add_remove(base_url, model))
                bar.update(1)
    bar.close()
    mean = {k: {m: statistics.fmean(r[m] for r in v) for m in ("startup_s", "call_s", "warm")} for k, v in runs.items()}
    lines = [
        "# Scale-out with warm spares", "",
        f"- Model `{args.model}`, `tetriinfer serve --mode colocated --instances 1 --kv-cache-memory-gb 0.25`; "
        f"{args.repeats} adds each (each followed by 2 requests and a DELETE), {args.settle_s:.0f} s quiet before "
        "each add.",
        "- Command: `python benchmarks/scale_out.py" + (f" --repeats {args.repeats}" if args.repeats != 4 else "")
        + "`.", "",
        "| | startup_s (server: placement -> hello) | POST /cluster/instances (client) | adds served by a spare |",
        "|---|---:|---:|---:|",
    ]
    for label in ("cold", "warm"):
        m = mean[label]
        lines.append(f"| {label} (`--warm-spares {0 if label == 'cold' else 1}`) | {m['startup_s']:.2f} s | "
                     f"{m['call_s']:.2f} s | {m['warm'] * 100:.0f}% |")
    lines += ["", f"Warm / cold: startup x{mean['warm']['startup_s'] / mean['cold']['startup_s']:.2f}, "
              f"call x{mean['warm']['call_s'] / mean['cold']['call_s']:.2f}.",
              "", "Per add (startup_s): " + "; ".join(
                  f"{k}: " + ", ".join(f"{r['startup_s']:.2f}" for r in v) for k, v in runs.items())]
    publish_markdown(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
