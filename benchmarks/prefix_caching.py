"""Automatic prefix caching (`--enable-prefix-caching`) vs none, same run, same server settings, on real
multi-turn conversations from the Mooncake trace.

Workload: the Mooncake conversation trace names each 512-token block of a prompt by a hash id (equal ids, equal
content). Conversations are the trace's requests grouped by their first two hash ids (the shared system block,
then the conversation's own first block); the script takes the first `--conversations` groups with at least 3
turns, all their turns in trace order, scales every length (and the 512-token blocks) by `--length-scale` so
they fit the tiny model, and sends them open-loop with Poisson arrivals at `--rate` req/s. Prompts are built
block by block from the hash ids (`PromptBuilder.build_from_blocks`), so a later turn starts with exactly the
tokens of the earlier turn's prompt, as in the trace. Output tokens are forced (`ignore_eos`).

Columns: each `--modes` entry without and with `--enable-prefix-caching` (same cores, same KV pool); colocated
(2 instances) also with caching but `--no-prefix-routing` (least-loaded routing, blind to where prefixes are
cached). Reported: TTFT / JCT mean and p99, the prompt tokens the server found cached (`/cluster`), the instances' busy
seconds, and the ratios cached / uncached.

    python benchmarks/prefix_caching.py --out docs/prefix_caching.md
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm.auto import tqdm

from tetriinfer.bench.client import ClientConfig, run_benchmark
from tetriinfer.bench.report import publish_markdown
from tetriinfer.bench.side_by_side import serve, served_model_id
from tetriinfer.bench.workloads import (
    TRACE_HASH_BLOCK_TOKENS,
    Workload,
    WorkloadRequest,
    load_trace,
    shared_data_dir,
)

MODES = {
    "tetriinfer": ["--mode", "tetriinfer", "--prefill-instances", "1", "--decode-instances", "1"],
    "colocated": ["--mode", "colocated", "--instances", "2"],
}
COMMON = ["--cores-per-instance", "1", "--kv-cache-memory-gb", "0.25"]


def conversation_workload(path: Path, conversations: int, min_turns: int, scale: float, max_prompt: int,
                          rate: float, seed: int) -> Workload:
    rows = load_trace(path)
    groups: dict[tuple[int, ...], list[int]] = collections.defaultdict(list)
    for i, row in enumerate(rows):
        if len(row.hash_ids) >= 2:
            groups[row.hash_ids[:2]].append(i)
    chosen = [idx for idx in groups.values() if len(idx) >= min_turns][:conversations]
    if len(chosen) < conversations:
        raise ValueError(f"{path} has only {len(chosen)} conversations with >= {min_turns} turns")
    order = sorted(i for idx in chosen for i in idx)
    gaps = np.random.default_rng([seed, 5]).exponential(1.0 / rate, size=len(order))
    arrivals = np.cumsum(gaps) - gaps[0]
    block = max(1, round(TRACE_HASH_BLOCK_TOKENS * scale))
    reqs = []
    for k, (i, t) in enumerate(zip(order, arrivals, strict=True)):
        row = rows[i]
        prompt = min(max_prompt, max(1, round(row.prompt_tokens * scale)))
        output = max(1, round(row.output_tokens * scale))
        reqs.append(WorkloadRequest(f"conv-{k}", float(t), prompt, output, None, False, None, row.hash_ids, block))
    note = (f"{len(chosen)} conversations ({len(order)} turns) of {path.name}, lengths x{scale:g}, "
            f"{block}-token hash blocks, prompts capped at {max_prompt}")
    return Workload("mooncake-conversations", tuple(reqs), str(path), "poisson", rate, seed, (note,))


def ideal_hit_fraction(workload: Workload) -> float:
    """Prompt tokens an unbounded cache could serve (leading blocks seen before, never a prompt's last token)."""
    seen: set[int] = set()
    hit = total = 0
    for r in workload.requests:
        n = 0
        for h in r.prefix_blocks:
            if h not in seen or (n + 1) * r.prefix_block_tokens > r.prompt_tokens - 1:
                break
            n += 1
        hit += n * r.prefix_block_tokens
        total += r.prompt_tokens
        seen.update(r.prefix_blocks[: -(-r.prompt_tokens // r.prefix_block_tokens)])
    return hit / total


VARIANTS = {
    "uncached": ["--no-enable-prefix-caching"],
    "cached, least-loaded routing": ["--enable-prefix-caching", "--no-prefix-routing"],
    "cached": ["--enable-prefix-caching"],
}


def variants(mode: str) -> list[str]:
    """Routing matters only with more than one instance that prefills."""
    return list(VARIANTS) if mode == "colocated" else ["uncached", "cached"]


def run_column(model: str, mode: str, variant: str, workload: Workload) -> dict[str, Any]:
    flags = VARIANTS[variant]
    with serve(model, MODES[mode][1], [*MODES[mode][2:], *COMMON, *flags], startup_timeout_s=600) as url:
        config = ClientConfig(base_url=url, model=served_model_id(url), progress=False)
        before = httpx.get(f"{url}/cluster", timeout=30).json()
        result = run_benchmark(config, workload, label=f"{mode} {variant}")
        time.sleep(1.5)  # one more load report from every instance
        after = httpx.get(f"{url}/cluster", timeout=30).json()

    def total(info: dict[str, Any], key: str) -> float:
        return float(sum(i.get(key, 0) or 0 for i in info["instances"]))

    s = result["summary"]
    return {
        "ttft_mean": s["ttft"]["mean"], "ttft_p99": s["ttft"]["p99"], "jct_mean": s["jct"]["mean"],
        "jct_p99": s["jct"]["p99"], "tpot_mean": s["tpot"]["mean"], "completed": s["completed"],
        "failed": s["failed"],
        "hit_tokens": total(after, "prefix_cache_hit_tokens") - total(before, "prefix_cache_hit_tokens"),
        "queried_tokens": total(after, "prefix_cache_queried_tokens") - total(before, "prefix_cache_queried_tokens"),
        "busy_s": total(after, "busy_s") - total(before, "busy_s"),
        "ttfts": [r["ttft_s"] for r in result["requests"] if r.get("ttft_s") is not None],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the tiny llama)")
    ap.add_argument("--trace", default=str(shared_data_dir() / "mooncake_conversation_trace.jsonl"))
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--min-turns", type=int, default=4)
    ap.add_argument("--length-scale", type=float, default=1 / 16)
    ap.add_argument("--max-prompt-tokens", type=int, default=1536)
    ap.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals, req/s")
    ap.add_argument("--modes", default="tetriinfer,colocated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="markdown report (a .json and a .png are written beside it)")
    args = ap.parse_args(argv)
    if args.model is None:
        from tetriinfer.engine.make_model import default_model_path

        args.model = str(default_model_path())
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown modes {unknown}; choose from {sorted(MODES)}")
    wl = conversation_workload(Path(args.trace), args.conversations, args.min_turns, args.length_scale,
                               args.max_prompt_tokens, args.rate, args.seed)
    ideal = ideal_hit_fraction(wl)
    rows: dict[str, dict[str, Any]] = {}
    columns = [(m, v) for m in modes for v in variants(m)]
    started = time.time()
    for mode, variant in tqdm(columns, desc="columns"):
        rows[f"{mode} {variant}"] = run_column(args.model, mode, variant, wl)
    prompt_tokens = sum(r.prompt_tokens for r in wl.requests)
    lines = [
        "# Automatic prefix caching on multi-turn conversations (real runtime, tiny model, this machine)", "",
        f"- Workload: {wl.notes[0]}; {len(wl)} requests, {prompt_tokens} prompt tokens, Poisson at "
        f"{args.rate:g} req/s; outputs forced to the trace's (scaled) lengths.",
        f"- An unbounded cache could serve {ideal:.0%} of the prompt tokens (leading blocks seen in an earlier "
        "request).",
        f"- Servers: `tetriinfer serve {' '.join(COMMON)}` plus the mode's flags, with and without "
        "`--enable-prefix-caching`. One run, {:.0f} s; the machine is shared (compare columns, not absolute "
        "times).".format(time.time() - started),
        f"- Command: `python benchmarks/{Path(__file__).name} {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        "| column | TTFT mean s | TTFT p99 s | JCT mean s | JCT p99 s | TPOT mean ms | cached prompt tokens | "
        "busy s | completed | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        hit = f"{r['hit_tokens']:.0f} ({r['hit_tokens'] / prompt_tokens:.0%})"
        lines.append(f"| {name} | {r['ttft_mean']:.3f} | {r['ttft_p99']:.3f} | {r['jct_mean']:.3f} | "
                     f"{r['jct_p99']:.3f} | {1000 * r['tpot_mean']:.1f} | {hit} | {r['busy_s']:.1f} | "
                     f"{r['completed']} | {r['failed']} |")
    lines += ["", "## Ratios to the same mode uncached", "", "| column | TTFT mean | TTFT p99 | JCT mean | busy s |",
              "|---|---:|---:|---:|---:|"]
    for mode, variant in columns:
        if variant == "uncached":
            continue
        a, b = rows[f"{mode} uncached"], rows[f"{mode} {variant}"]
        lines.append(f"| {mode} {variant} | {b['ttft_mean'] / a['ttft_mean']:.2f}x | "
                     f"{b['ttft_p99'] / a['ttft_p99']:.2f}x | {b['jct_mean'] / a['jct_mean']:.2f}x | "
                     f"{b['busy_s'] / max(a['busy_s'], 1e-9):.2f}x |")
    report = publish_markdown(lines, None)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "ideal_hit_fraction": ideal,
                                                        "columns": rows}, indent=1) + "\n", encoding="utf-8")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for name, r in rows.items():
            xs = np.sort(np.asarray(r["ttfts"]))
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name,
                    linestyle="--" if name.endswith("uncached") else "-")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title("TTFT CDF, with and without prefix caching")
        ax.legend()
        fig.tight_layout()
        png = out.with_suffix(".png")
        fig.savefig(png, dpi=110)
        out.write_text(report + f"\n![TTFT CDF]({png.name})\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
