"""Chunked prefill cost on this CPU: one prompt prefilled whole (the vLLM-style baseline's one forward) vs in
fixed-size chunks (TetriInfer's prefill instance, `--chunk-size`).

For each dtype, prompt length and chunk size: the engine's runner (one torch thread, as a serving instance) runs
the prompt's chunks back to back (the last one samples); best of --repeats, whole and chunked alternating within
each repeat so a noisy spell hits both. Prints a markdown table of ms and the chunked / whole ratio (what chunking
adds to a lone prompt's TTFT on this device), and writes it to --out.

    python benchmarks/bench_chunked_prefill.py --out report.md
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.core.step import ScheduledSegment, SchedulerOutput, StepKind
from tetriinfer.engine.cpu_info import isa_summary
from tetriinfer.engine.engine_config import EngineConfig
from tetriinfer.engine.llm_engine import build_runner
from tetriinfer.engine.make_model import tiny_model_path


def prefill_seconds(runner, kv, n: int, chunk: int) -> float:  # noqa: ANN001 (engine parts)
    """Wall time of prefilling an ``n``-token prompt as chunks of ``chunk`` tokens, in order."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    assert kv.allocate_slots("p", n)
    table = tuple(kv.block_table("p"))
    t0 = time.perf_counter()
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        seg = ScheduledSegment("p", start, tuple(range(5 + start, 5 + end)), table, end == n, params, 0)
        runner.execute(SchedulerOutput(1, StepKind.PREFILL, (seg,)))
    seconds = time.perf_counter() - t0
    kv.free_request("p")
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF model folder (default: the tiny llama)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--lengths", default="400,900,1800")
    ap.add_argument("--chunks", default="128,256,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    lengths = [int(x) for x in a.lengths.split(",")]
    chunks = [int(x) for x in a.chunks.split(",")]
    model = a.model or str(tiny_model_path())
    rows: list[str] = []
    cases = [(d, n, c) for d in a.dtypes.split(",") for n in lengths for c in chunks if c < n]
    bar = tqdm(total=len(cases), desc="chunked prefill")
    for dtype in a.dtypes.split(","):
        parts = build_runner(EngineConfig(model=model, dtype=dtype))
        runner, kv = parts.runner, parts.kv_manager
        with torch.inference_mode():
            for n in lengths:
                if n >= parts.max_model_len:
                    continue
                prefill_seconds(runner, kv, n, n)  # warm-up
                for c in (c for c in chunks if c < n):
                    whole, chunked = float("inf"), float("inf")
                    for _ in range(a.repeats):
                        whole = min(whole, prefill_seconds(runner, kv, n, n))
                        chunked = min(chunked, prefill_seconds(runner, kv, n, c))
                    rows.append(f"| {dtype} | {n} | {c} | {whole * 1e3:.1f} | {chunked * 1e3:.1f} | "
                                f"{chunked / whole:.2f}x |")
                    bar.update(1)
    bar.close()
    isa = isa_summary()
    lines = ["# Chunked prefill on CPU: whole prompt vs fixed-size chunks", "",
             f"`python benchmarks/bench_chunked_prefill.py` on {os.cpu_count()} CPU cores ({isa}), one torch thread, "
             f"model `{model}`; best of {a.repeats} per cell, whole and chunked alternating.", "",
             "| dtype | prompt tokens | chunk | whole ms | chunked ms | chunked / whole |",
             "|---|---:|---:|---:|---:|---:|", *rows, ""]
    text = "\n".join(lines)
    print(text)
    if a.out is not None:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
