"""Decode step time with the native CPU decode kernels on vs off (`TETRIINFER_CPU_KERNELS=1/0`), same run.

On CPUs with AVX-512 BF16 a third setting, "no AVX-512", keeps the kernels but turns off the AVX-512 BF16 matmul
(`TETRIINFER_AVX512_BF16=0`: bf16 matmuls of at most 4 rows on the AVX2 kernel, the rest on oneDNN).

For each dtype, model and batch size: one decode step of B requests over a context of --context tokens through
the engine's runner (one torch thread, as a serving instance), best of --repeats, in alternating subprocesses
(kernels on, off, on, off, ... --rounds each; best per setting), so a noisy spell hits both sides.
``--baseline-rev REV`` adds a third setting: the kernels built from ``decode_kernels.c`` as it was at git revision
REV (a kernel change measured against its predecessor in the same run).
Usage: python benchmarks/bench_decode_kernels.py [--baseline-rev HEAD~1] [--out report.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, sys, time, torch
from pathlib import Path
from tetriinfer.engine import cpu_kernels
if len(sys.argv) > 6:
    cpu_kernels.SOURCE = Path(sys.argv[6])  # the baseline's kernels (built and cached under their own digest)
from tetriinfer import LLM
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.core.step import ScheduledSegment, SchedulerOutput, StepKind
torch.set_num_threads(1)
model, dtype, ctx, repeats, batches = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
llm = LLM(model=model, dtype=dtype, num_kv_blocks=max(64, (int(batches.split(",")[-1]) * (ctx + 1)) // 16 + 64))
runner, kv = llm.engine.runner, llm.engine.kv_manager
params = SamplingParams(max_tokens=1, temperature=0.0)
out = {}
for b in [int(x) for x in batches.split(",")]:
    segs = []
    for i in range(b):
        rid = f"r{b}-{i}"
        if not kv.allocate_slots(rid, ctx + 1):
            raise SystemExit("KV cache too small")
        segs.append(ScheduledSegment(rid, ctx, (7,), tuple(kv.block_table(rid)), True, params, 1))
    step = SchedulerOutput(1, StepKind.DECODE, tuple(segs))
    runner.execute(step)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.execute(step)
        best = min(best, time.perf_counter() - t0)
    out[b] = best
    for i in range(b):
        kv.free_request(f"r{b}-{i}")
print(json.dumps(out))
"""


SETTING_ENV = {"on": {"TETRIINFER_CPU_KERNELS": "1", "TETRIINFER_AVX512_BF16": "1"},
               "no-avx512": {"TETRIINFER_CPU_KERNELS": "1", "TETRIINFER_AVX512_BF16": "0"},
               "off": {"TETRIINFER_CPU_KERNELS": "0"},
               "baseline": {"TETRIINFER_CPU_KERNELS": "1", "TETRIINFER_AVX512_BF16": "0"}}
SETTING_TITLE = {"on": "kernels on", "no-avx512": "no AVX-512 gemm", "off": "kernels off"}


def run_child(model: str, dtype: str, ctx: int, repeats: int, batches: str, setting: str,
              source: Path | None = None) -> dict[int, float]:
    env = {**os.environ, **SETTING_ENV[setting], "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-c", CHILD, model, dtype, str(ctx), str(repeats), batches]
    done = subprocess.run(argv + ([str(source)] if source is not None else []), env=env,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def main() -> int:
    from tetriinfer.engine.cpu_info import isa_summary
    from tetriinfer.engine.cpu_kernels import avx512_bf16_available, kernels_available
    from tetriinfer.engine.make_model import cache_dir, make_model, tiny_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline-rev", default=None,
                    help="also time the kernels of decode_kernels.c at this git revision (e.g. HEAD~1)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "decode_kernels.md")
    args = ap.parse_args()
    baseline_source: Path | None = None
    if args.baseline_rev is not None:
        rel = "tetriinfer/engine/csrc/decode_kernels.c"
        text = subprocess.run(["git", "show", f"{args.baseline_rev}:{rel}"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout
        baseline_source = Path(tempfile.mkdtemp(prefix="tetri-kernels-")) / "decode_kernels.c"
        baseline_source.write_text(text)
    if not kernels_available():
        print("the native kernels are not available here (no AVX2/FMA or no C compiler): nothing to compare")
        return 1
    small = cache_dir() / "models" / "small-llama"
    if not (small / "config.json").exists():
        make_model("llama", "small", small, seed=0)
    cases = [("tiny-llama", str(tiny_model_path()), "float32", "1,4,8,16,64"),
             ("tiny-llama", str(tiny_model_path()), "bfloat16", "1,4,8,16,32,64"),
             ("small-llama", str(small), "float32", "1,4,16"),
             ("small-llama", str(small), "bfloat16", "1,4,8,16")]
    settings = (["on"] + (["no-avx512"] if avx512_bf16_available() else []) + ["off"]
                + (["baseline"] if baseline_source is not None else []))
    best: dict[tuple[str, str, str], dict[int, float]] = {}
    jobs = [(c, k) for c in cases for _ in range(args.rounds) for k in settings]
    for (name, path, dtype, batches), setting in tqdm(jobs, desc="decode steps", unit="run"):
        if setting == "no-avx512" and dtype != "bfloat16":
            continue  # the AVX-512 BF16 matmul only runs bf16
        got = run_child(path, dtype, args.context, args.repeats, batches, setting,
                        baseline_source if setting == "baseline" else None)
        key = (name, dtype, setting)
        best[key] = {b: min(t, best.get(key, {}).get(b, float("inf"))) for b, t in got.items()}
    isa = isa_summary()
    lines = ["# Native CPU decode kernels: decode step time on vs off", "",
             f"`python benchmarks/bench_decode_kernels.py` on {os.cpu_count()} CPU cores ({isa}), one torch thread; "
             "one decode "
             f"step of B requests over {args.context}-token contexts through the engine's runner; best of "
             f"{args.repeats} steps x {args.rounds} alternating rounds per setting (same run)."
             + (f" Baseline: the kernels of git revision `{args.baseline_rev}`." if baseline_source else ""), ""]
    shown = [x for x in settings if x != "baseline"] + (["baseline"] if baseline_source is not None else [])
    titles = [f"{args.baseline_rev} kernels" if x == "baseline" else SETTING_TITLE[x] for x in shown]
    lines += ["| model | dtype | batch | " + " | ".join(f"{t} ms" for t in titles) + " | "
              + " | ".join(f"on vs {t}" for t in titles[1:]) + " |",
              "|---|---|---:|" + "---:|" * (2 * len(shown) - 1)]
    for name, _, dtype, batches in cases:
        for b in (int(x) for x in batches.split(",")):
            ms = {x: best[(name, dtype, x)][b] for x in shown if (name, dtype, x) in best}
            on = ms["on"]
            lines.append(f"| {name} | {dtype} | {b} | "
                         + " | ".join(f"{ms[x] * 1e3:.1f}" if x in ms else "-" for x in shown) + " | "
                         + " | ".join(f"{ms[x] / on:.2f}x" if x in ms else "-" for x in shown[1:]) + " |")
    lines += ["", "Kernels on: fp32 and bf16 decode attention read K/V in place from the paged cache; linear "
              "layers of few rows use the native matmul (fp32: up to 48 rows; bf16: fewer than 16 rows on CPUs "
              "without bf16 instructions; on CPUs with AVX-512 BF16 but no AMX up to 64 rows on the AVX-512 BF16 "
              "matmul, or without it at most 4 rows on the AVX2 one; bf16 attention and matmuls stay with torch "
              "on AMX CPUs), which reads each group of four weight rows once and applies it to the whole batch. "
              "No AVX-512 gemm: the same without the AVX-512 BF16 matmul (the routing before it). Off: torch's "
              "gather + SDPA and torch's linear layers.", ""]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
