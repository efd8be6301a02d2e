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
import statistics

from tqdm.auto import tqdm

from tetriinfer.bench import side_by_side as sbs
from tetriinfer.bench.client import ClientConfig, run_benchmark
from tetriinfer.bench.metrics import SLO, RequestRecord
from tetriinfer.bench.workloads import Workload, WorkloadRequest
from tetriinfer.engine.make_model import tiny_model_path

# the side-by-side layouts (2 instances, one core each), with the side-by-side runs' TetriInfer flags
EXTRA_ARGS: dict[str, list[str]] = {
    "colocated": [],
    "tetriinfer": ["--chunk-size", "512", "--prefill-policy", "srtf", "--kv-backend", "shm"],
}


def closed_loop_ttfts(url: str, lengths: list[int], repeats: int, seed: int) -> dict[int, list[float]]:
    """TTFT (send -> first token) of ``repeats`` requests per prompt length, one in flight at a time (the bench
    client with ``max_concurrency=1``); the first request of each length is a warm-up and is dropped."""
    reqs = tuple(WorkloadRequest(f"r{rep}-{n}", 0.0, n, 2) for rep in range(repeats) for n in lengths)
    wl = Workload("ttft-path", reqs, "fixed lengths", "burst", None, seed)
    cfg = ClientConfig(base_url=url, model=sbs.served_model_id(url), max_concurrency=1, seed=seed, progress=False)
    records = [RequestRecord.from_dict(r) for r in run_benchmark(cfg, wl, SLO(), "ttft-path")["requests"]]
    out: dict[int, list[float]] = {}
    for r in records:
        if r.ttft_s is None:
            raise RuntimeError(f"request {r.request_id} failed: {r.error}")
        if not r.request_id.startswith("r0-"):
            out.setdefault(r.prompt_tokens, []).append(r.ttft_s)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model folder (default: the tiny llama)")
    ap.add_argument("--lengths", default="128,400,900", help="prompt lengths in tokens")
    ap.add_argument("--repeats", type=int, default=8, help="requests per length per round (the first is warm-up)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-arg", action="append", default=[], metavar="[MODE:]ARGS",
                    help="extra 'tetriinfer serve' arguments for both modes, or MODE:ARGS for one (repeatable)")
    a = ap.parse_args()
    if a.repeats < 2 or a.rounds < 1:
        raise SystemExit("--repeats must be >= 2 and --rounds >= 1")
    lengths = [int(x) for x in a.lengths.split(",") if x.strip()]
    extra = {c.label: list(c.serve_args) for c in sbs.parse_columns(",".join(EXTRA_ARGS), serve_args=a.serve_arg)}
    model = a.model or str(tiny_model_path())
    times: dict[tuple[str, int], list[float]] = {}
    order = list(EXTRA_ARGS)
    with tqdm(total=a.rounds * len(order), desc="servers") as bar:
        for rnd in range(a.rounds):
            for mode in order[rnd % len(order):] + order[:rnd % len(order)]:
                args = [*sbs.layout_args(mode, 2, 1), "--kv-cache-memory-gb", "0.25", *EXTRA_ARGS[mode],
                        *extra[mode]]
                with sbs.serve(model, mode, args, 600) as url:
                    for n, ts in closed_loop_ttfts(url, lengths, a.repeats, a.seed + rnd).items():
                        times.setdefault((mode, n), []).extend(ts)
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
