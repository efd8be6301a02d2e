"""Cold start: how fast a new instance has its weights, per load format (ServerlessLLM's question), same run.

Each measurement is a fresh process that (after its imports) loads the weights, builds a model runner with a
small KV pool and runs one 16-token prefill forward; we record the load time and the time to that first
forward's end (lazily mapped pages are paid for there). Formats:

- ``transformers``: ``AutoModelForCausalLM.from_pretrained`` on the HF folder (what most stacks do; the HF model
  then runs the forward);
- ``safetensors``: our loader on the HF folder (``--load-format auto``);
- ``fast``: the loading-optimized checkpoint (``--load-format fast``), read with parallel large reads;
- ``fast-shm (first)``: ``--load-format fast-shm`` when no instance on the host has the weights yet (reads them
  into /dev/shm); ``fast-shm (next)``: a further instance on the same host (maps them).

Cold = the OS page cache dropped before the process starts (``/proc/sys/vm/drop_caches`` when writable, else
``posix_fadvise(DONTNEED)`` on every weight file); warm = files already cached. Ratios are against
``safetensors`` in the same condition. A second section starts two instances at once and sums their
proportional set size (PSS): with ``fast-shm`` the weights are in memory once per host.

    python benchmarks/cold_start.py --preset medium --dtype bfloat16 --repeats 3 --out report.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm.auto import tqdm

WORKER = r"""
import json, os, sys, time
import torch
torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
mode, model, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
from transformers import AutoModelForCausalLM
from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.core.step import ScheduledSegment, SchedulerOutput, StepKind
from tetriinfer.engine.kv_cache import KVCacheTensors
from tetriinfer.engine.loader import load_model, parse_dtype
from tetriinfer.engine.model_runner import ModelRunner
t0 = time.perf_counter()  # imports done: what follows is the weights and the first forward
if mode == "transformers":
    m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
    t1 = time.perf_counter()
    with torch.inference_mode():
        m(torch.arange(5, 21).unsqueeze(0))
else:
    fmt = {"safetensors": "auto", "fast": "fast", "fast-shm": "fast-shm"}[mode]
    m, cfg = load_model(model, dtype, "cpu", fmt)
    t1 = time.perf_counter()
    runner = ModelRunner(m, cfg, KVCacheTensors(cfg, 8, 16, parse_dtype(dtype), "cpu"), "cpu")
    kv = KVCacheManager(8, 16)
    assert kv.allocate_slots("r", 16)
    seg = ScheduledSegment("r", 0, tuple(range(5, 21)), tuple(kv.block_table("r")), True,
                           SamplingParams(max_tokens=1, temperature=0.0), 0)
    runner.execute(SchedulerOutput(1, StepKind.PREFILL, (seg,)))
t2 = time.perf_counter()
def smaps(key):
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
print(json.dumps({"load_s": t1 - t0, "first_forward_s": t2 - t0, "rss": smaps("Rss"), "pss": smaps("Pss")}),
      flush=True)
if os.environ.get("BENCH_HOLD"):
    sys.stdin.readline()
"""


def weight_files(paths: list[Path]) -> list[Path]:
    out = []
    for p in paths:
        if p.is_dir():
            out += [f for f in p.rglob("*") if f.is_file() and f.suffix in (".safetensors", ".bin")]
    return out


def drop_page_cache(files: list[Path]) -> str:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "drop_caches"
    except OSError:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"


def run_worker(mode: str, model: str, dtype: str, env: dict[str, str]) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", WORKER, mode, model, dtype], env=env, capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="an HF folder (default: make one with --preset/--dtype)")
    ap.add_argument("--preset", default="medium", choices=["tiny", "small", "medium"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="transformers,safetensors,fast,fast-shm")
    ap.add_argument("--out", default=None, help="markdown report (a .json and a .png are written beside it)")
    args = ap.parse_args()

    from tetriinfer.engine import fast_checkpoint as fc
    from tetriinfer.engine.loader import ensure_checkpoint, parse_dtype
    from tetriinfer.engine.make_model import make_model

    work = Path(tempfile.mkdtemp(prefix="cold-start-"))
    env = {**os.environ, "TETRIINFER_CACHE": str(work / "cache"), "HF_HUB_OFFLINE": "1", "BENCH_THREADS": "1"}
    model = args.model
    if model is None:
        model = str(work / f"{args.preset}-llama")
        print(f"making {args.preset} llama ({args.dtype}) in {model} ...", flush=True)
        make_model("llama", args.preset, Path(model), seed=0, dtype=args.dtype)
    os.environ["TETRIINFER_CACHE"] = env["TETRIINFER_CACHE"]
    t0 = time.perf_counter()
    ckpt, _ = ensure_checkpoint(model, parse_dtype(args.dtype))
    convert_s = time.perf_counter() - t0
    ckpt_bytes = fc.read_index(ckpt).total_bytes
    files = weight_files([Path(model), ckpt])
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    labels: list[str] = []
    for m in modes:
        labels += [f"{m} (first)", f"{m} (next)"] if m == "fast-shm" else [m]
    results: dict[str, dict[str, list[dict[str, float]]]] = {"cold": {}, "warm": {}}
    how = ""
    bar = tqdm(total=2 * args.repeats * len(labels), desc="cold start")
    for cond in ("cold", "warm"):
        for rep in range(args.repeats):
            for mode in modes:  # interleaved: drift on this shared machine hits every format alike
                if mode == "fast-shm":
                    fc.evict_shm(ckpt)
                    if cond == "cold":
                        how = drop_page_cache(files)
                    results[cond].setdefault("fast-shm (first)", []).append(run_worker(mode, model, args.dtype, env))
                    results[cond].setdefault("fast-shm (next)", []).append(run_worker(mode, model, args.dtype, env))
                    fc.evict_shm(ckpt)
                    bar.update(2)
                    continue
                if cond == "cold":
                    how = drop_page_cache(files)
                elif rep == 0:
                    run_worker(mode, model, args.dtype, env)  # bring its files into the page cache
                results[cond].setdefault(mode, []).append(run_worker(mode, model, args.dtype, env))
                bar.update(1)
    bar.close()

    # Memory: two instances at once, each holding its model; PSS splits shared pages between them.
    memory: dict[str, dict[str, float]] = {}
    for mode in [m for m in ("safetensors", "fast-shm") if m in modes]:
        fc.evict_shm(ckpt)
        hold = {**env, "BENCH_HOLD": "1"}
        procs = []
        for _ in range(2):
            p = subprocess.Popen([sys.executable, "-c", WORKER, mode, model, args.dtype], env=hold,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            p.stdout.readline()  # loaded (sequential: the second finds the first's shm copy)
            procs.append(p)
        pss = []
        for p in procs:
            for line in open(f"/proc/{p.pid}/smaps_rollup"):
                if line.startswith("Pss:"):
                    pss.append(int(line.split()[1]) * 1024)
        for p in procs:
            p.communicate("\n", timeout=60)
        memory[mode] = {"pss_total": float(sum(pss)), "pss_each": [float(x) for x in pss]}
    fc.evict_shm(ckpt)

    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    lines = ["# Cold start: load formats (same run)", "",
             f"Model: `{args.preset}` llama, {args.dtype}, {ckpt_bytes / 2**30:.2f} GiB of weights "
             f"(fast checkpoint made once in {convert_s:.1f} s); {args.repeats} runs per cell, medians; each run a "
             f"fresh process, 1 torch thread, {fc.default_readers()} readers. Cold: page cache dropped ({how}).", ""]
    table: dict[str, dict[str, dict[str, float]]] = {}
    for cond in ("cold", "warm"):
        base = results[cond].get("safetensors")
        lines += [f"## {cond}", "", "| format | load s | load + first forward s | GiB/s | vs safetensors (load) |",
                  "|---|---:|---:|---:|---:|"]
        for label in labels:
            rows = results[cond][label]
            load, first = med(rows, "load_s"), med(rows, "first_forward_s")
            ratio = f"{med(base, 'load_s') / load:.1f}x faster" if base else "-"
            table.setdefault(cond, {})[label] = {"load_s": load, "first_forward_s": first}
            lines.append(f"| {label} | {load:.3f} | {first:.3f} | {ckpt_bytes / load / 2**30:.2f} | {ratio} |")
        lines.append("")
    if memory:
        lines += ["## Memory of two instances on one host (PSS, summed)", "", "| format | PSS total GiB | per "
                  "instance GiB |", "|---|---:|---:|"]
        for mode, m in memory.items():
            lines.append(f"| {mode} | {m['pss_total'] / 2**30:.2f} | "
                         + " / ".join(f"{x / 2**30:.2f}" for x in m["pss_each"]) + " |")
        lines.append("")
    report = "\n".join(lines)
    print(report)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"model": args.preset, "dtype": args.dtype, "weights_bytes": ckpt_bytes, "convert_s": convert_s,
                   "cache_drop": how, "medians": table, "runs": results, "memory": memory,
                   "command": " ".join(sys.argv)}
        out.with_suffix(".json").write_text(json.dumps(payload, indent=1), encoding="utf-8")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.8))
        width = 0.38
        for i, cond in enumerate(("cold", "warm")):
            vals = [table[cond][lab]["load_s"] for lab in labels]
            ax.bar([x + i * width for x in range(len(labels))], vals, width, label=cond)
        ax.set_xticks([x + width / 2 for x in range(len(labels))], labels, fontsize=8)
        ax.set_ylabel("load seconds (median)")
        ax.set_title(f"Cold start, {ckpt_bytes / 2**30:.1f} GiB of weights")
        ax.legend()
        fig.tight_layout()
        png = out.with_suffix(".png")
        fig.savefig(png, dpi=110)
        out.write_text(report + f"\n![load time]({png.name})\n\nCommand: `{payload['command']}`\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
