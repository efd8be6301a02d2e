"""Engine step times by thread count: the native kernels split over the engine's threads vs torch's own kernels.

For a model folder (``--model``, e.g. SmolLM2-135M-Instruct as an HF folder), each dtype and each thread count, one
subprocess per setting builds an `LLM` with that many threads and times single steps through its runner: decode
steps of B requests over a context of ``--context`` tokens (B from ``--batches``) and one prefill chunk of
``--chunk`` fresh tokens, best of ``--repeats``. Settings: ``kernels`` (the native CPU kernels, as shipped) and
``torch`` (``TETRIINFER_CPU_KERNELS=0``: torch's kernels only, the engine's path before its kernels ran on
several threads). Printed: each time, N threads over 1 thread per setting, kernels over torch per thread count.

Thread scaling needs the cores to itself: on a shared machine run it where nothing else competes (the numbers in
docs/engine.md were taken at real-time priority, ``chrt -f 10``, a few seconds per setting).

    python benchmarks/bench_engine_threads.py --model PATH [--threads 1,2] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time, torch
from tetriinfer import LLM
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.core.step import ScheduledSegment, SchedulerOutput, StepKind
model, dtype, threads, ctx, chunk, repeats, batches = (sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                                                       int(sys.argv[5]), int(sys.argv[6]), sys.argv[7])
bs = [int(x) for x in batches.split(",")]
llm = LLM(model=model, dtype=dtype, num_threads=threads, chunk_size=chunk, max_model_len=2048,
          num_kv_blocks=(max(bs) * (ctx + 1) + chunk) // 16 + 64)
assert torch.get_num_threads() == threads
runner, kv = llm.engine.runner, llm.engine.kv_manager
params = SamplingParams(max_tokens=1, temperature=0.0)

def best_of(step, n):
    runner.execute(step)
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        runner.execute(step)
        best = min(best, time.perf_counter() - t0)
    return best

out = {}
for b in bs:
    segs = []
    for i in range(b):
        rid = f"d{b}-{i}"
        assert kv.allocate_slots(rid, ctx + 1), "KV cache too small"
        segs.append(ScheduledSegment(rid, ctx, (7,), tuple(kv.block_table(rid)), True, params, 1))
    out[f"decode b={b}"] = best_of(SchedulerOutput(1, StepKind.DECODE, tuple(segs)), repeats)
    for i in range(b):
        kv.free_request(f"d{b}-{i}")
assert kv.allocate_slots("p", chunk)
seg = ScheduledSegment("p", 0, tuple(range(5, 5 + chunk)), tuple(kv.block_table("p")), True, params, 0)
out[f"prefill {chunk}"] = best_of(SchedulerOutput(1, StepKind.PREFILL, (seg,)), max(2, repeats // 4))
print("RESULT " + json.dumps(out), flush=True)
"""

SETTINGS = {"kernels": {}, "torch": {"TETRIINFER_CPU_KERNELS": "0"}}


def run_child(model: Path, dtype: str, threads: int, setting: str, a: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, **SETTINGS[setting], "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    cmd = [sys.executable, "-c", CHILD, str(model), dtype, str(threads), str(a.context), str(a.chunk),
           str(a.repeats), a.batches]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    raise RuntimeError(f"{dtype} x{threads} {setting} failed: {done.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="an HF model folder")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batches", default="1,16,48")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=12)
    a = ap.parse_args(argv)
    if not (a.model / "config.json").is_file():
        raise SystemExit(f"--model must be an HF model folder (no config.json in {a.model})")
    threads = [int(t) for t in a.threads.split(",")]
    dtypes = [d for d in a.dtypes.split(",") if d]
    start = time.perf_counter()
    res: dict[tuple[str, int, str], dict[str, float]] = {}
    for dtype in dtypes:
        for t in threads:
            for setting in SETTINGS:
                res[dtype, t, setting] = run_child(a.model.absolute(), dtype, t, setting, a)
                print(f"{dtype} x{t} {setting}: " + ", ".join(f"{k} {v * 1e3:.1f} ms"
                                                             for k, v in res[dtype, t, setting].items()), flush=True)
    t1 = min(threads)
    lines = [f"`python benchmarks/bench_engine_threads.py {' '.join(sys.argv[1:])}` "
             f"({time.strftime('%Y-%m-%d', time.gmtime())}, {(time.perf_counter() - start) / 60:.1f} min; "
             f"load average at end {' '.join(f'{x:.1f}' for x in os.getloadavg())})", "",
             "| dtype | step | threads | kernels ms | torch ms | kernels speed vs torch | kernels vs "
             f"{t1} thread | torch vs {t1} thread |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for dtype in dtypes:
        for step in res[dtype, t1, "kernels"]:
            for t in threads:
                k, p = res[dtype, t, "kernels"][step], res[dtype, t, "torch"][step]
                k1, p1 = res[dtype, t1, "kernels"][step], res[dtype, t1, "torch"][step]
                lines.append(f"| {dtype} | {step} | {t} | {k * 1e3:.1f} | {p * 1e3:.1f} | {p / k:.2f}x | "
                             f"{k1 / k:.2f}x | {p1 / p:.2f}x |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
