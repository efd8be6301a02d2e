"""TTFT on an idle server, per serving mode: the request path without any queueing.

Starts ``tetriinfer serve`` in each mode (the side-by-side layouts: 2 colocated instances vs 1 prefill + 1
decode instance, one core each), sends one request at a time (closed loop, concurrency 1) with prompts of a few
fixed lengths (random token ids, ``max_tokens=2``), and reports the median and best time to the first streamed
token per (mode, prompt length). Modes alternate over ``--rounds`` so a drifting machine does not favour one.
With nothing queued, this is prefill compute plus the front end -> instance -> client hops: any TTFT gap
between modes under load beyond this one comes from queueing and interference, not from the path.

    python benchmarks/bench_ttft_path.py --rounds 2 --repeats 8
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import httpx
from tqdm.auto import tqdm

from tetriinfer.bench import side_by_side as sbs
from tetriinfer.engine.make_model import default_model_path

MODES: dict[str, list[str]] = {
    "colocated": ["--instances", "2", "--cores-per-instance", "1", "--kv-cache-memory-gb", "0.25"],
    "tetriinfer": ["--prefill-instances", "1", "--decode-instances", "1", "--cores-per-instance", "1",
                   "--kv-cache-memory-gb", "0.25", "--chunk-size", "512", "--prefill-policy", "srtf",
                   "--kv-backend", "shm"],
}


def first_token_s(client: httpx.Client, url: str, model: str, ids: list[int]) -> float:
    """Seconds from sending the request to its first streamed token (the stream is then read to the end)."""
    body = {"model": model, "prompt": ids, "max_tokens": 2, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft: float | None = None
    with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if ttft is None and line.startswith("data: ") and '"text"' in line:
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("the stream ended without a token")
    return ttft


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model folder (default: the tiny llama)")
    ap.add_argument("--lengths", default="128,400,900", help="prompt lengths in tokens")
    ap.add_argument("--repeats", type=int, default=8, help="requests per length per round (the first is warm-up)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.repeats < 2 or a.rounds < 1:
        raise SystemExit("--repeats must be >= 2 and --rounds >= 1")
    lengths = [int(x) for x in a.lengths.split(",") if x.strip()]
    model = a.model or str(default_model_path())
    rng = random.Random(a.seed)
    times: dict[tuple[str, int], list[float]] = {}
    order = list(MODES)
    with tqdm(total=a.rounds * len(order) * a.repeats * len(lengths), desc="requests") as bar:
        for rnd in range(a.rounds):
            for mode in order[rnd % len(order):] + order[:rnd % len(order)]:
                with sbs.serve(model, mode, MODES[mode], 600) as url, httpx.Client(timeout=120) as client:
                    served = sbs.served_model_id(url)
                    for rep in range(a.repeats):
                        for n in lengths:
                            t = first_token_s(client, url, served, [rng.randrange(10, 2000) for _ in range(n)])
                            if rep:  # the first request of each length warms the path up
                                times.setdefault((mode, n), []).append(t)
                            bar.update(1)
    print("\n| prompt tokens | " + " | ".join(f"{m} median / best ms" for m in order) + " | tetriinfer / colocated |")
    print("|---:|" + "---:|" * (len(order) + 1))
    for n in lengths:
        med = {m: statistics.median(times[(m, n)]) for m in order}
        cells = " | ".join(f"{med[m] * 1e3:.1f} / {min(times[(m, n)]) * 1e3:.1f}" for m in order)
        print(f"| {n} | {cells} | {med['tetriinfer'] / med['colocated']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
