"""bf16 prefill with the native AVX-512 BF16 causal attention on vs off (`TETRIINFER_AVX512_BF16=1/0`), same run.

Two measurements per prompt length, one torch thread (as a serving instance):
- the attention op alone: `cpu_kernels.prefill_attn_bf16` vs torch's `scaled_dot_product_attention` (is_causal,
  grouped-query) on the tiny llama's head layout (6 query heads, 2 kv heads, head size 64), best of 3 x 10 calls;
- whole prefill forwards of one prompt through the engine's runner (first chunk, no cache), in alternating
  subprocesses (on, off, on, off, ... --rounds each; best per setting), so a noisy spell hits both sides.
Only on CPUs with AVX-512 BF16 and no AMX (elsewhere the kernel is not used): it prints that and exits 1.
Usage: python benchmarks/bench_prefill_attention.py [--lengths 128,256,512,1024] [--out report.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, sys, time, torch
from tetriinfer import LLM
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.core.step import ScheduledSegment, SchedulerOutput, StepKind
torch.set_num_threads(1)
model, lengths, repeats = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
llm = LLM(model=model, dtype="bfloat16", num_kv_blocks=max(lengths) // 16 + 64, chunk_size=max(lengths))
runner, kv = llm.engine.runner, llm.engine.kv_manager
params = SamplingParams(max_tokens=1, temperature=0.0)
out = {}
for n in lengths:
    kv.allocate_slots("p", n + 1)
    seg = ScheduledSegment("p", 0, tuple(5 + (7 * j) % 4000 for j in range(n)), tuple(kv.block_table("p")), True,
                           params, 0)
    step = SchedulerOutput(1, StepKind.PREFILL, (seg,))
    runner.execute(step)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.execute(step)
        best = min(best, time.perf_counter() - t0)
    out[n] = best
    kv.free_request("p")
print(json.dumps(out))
"""


def run_child(model: str, lengths: str, repeats: int, native: bool) -> dict[int, float]:
    env = {**os.environ, "TETRIINFER_AVX512_BF16": "1" if native else "0", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, model, lengths, str(repeats)], env=env,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def time_op(fn, calls: int = 10) -> float:  # noqa: ANN001 - a zero-argument callable
    fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def main() -> int:
    import torch
    import torch.nn.functional as F

    from tetriinfer.engine import cpu_kernels
    from tetriinfer.engine.cpu_info import bf16_decode_wants_native_kernels, isa_summary
    from tetriinfer.engine.make_model import tiny_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="128,256,512,1024")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "prefill_attention.md")
    args = ap.parse_args()
    if not (cpu_kernels.avx512_bf16_available() and bf16_decode_wants_native_kernels()):
        print("no AVX-512 BF16 kernels here (or an AMX CPU, where torch's path stays): nothing to compare")
        return 1
    torch.set_num_threads(1)
    lengths = [int(x) for x in args.lengths.split(",")]
    op: dict[int, tuple[float, float]] = {}
    for n in tqdm(lengths, desc="attention op", unit="length"):
        g = torch.Generator().manual_seed(n)
        q = torch.randn(n, 6, 64, generator=g).bfloat16()
        k = torch.randn(n, 2, 64, generator=g).bfloat16()
        v = torch.randn(n, 2, 64, generator=g).bfloat16()
        rows = torch.arange(n)
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        t_native = time_op(lambda: cpu_kernels.prefill_attn_bf16(q, k, v, rows, 0))  # noqa: B023
        t_torch = time_op(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True))  # noqa: B023
        op[n] = (t_native, t_torch)
    best: dict[str, dict[int, float]] = {}
    jobs = [s for _ in range(args.rounds) for s in ("on", "off")]
    for setting in tqdm(jobs, desc="prefill forwards", unit="run"):
        got = run_child(str(tiny_model_path()), args.lengths, args.repeats, setting == "on")
        best[setting] = {n: min(t, best.get(setting, {}).get(n, float("inf"))) for n, t in got.items()}
    lines = ["# bf16 prefill: native AVX-512 BF16 causal attention vs torch's", "",
             f"`python benchmarks/bench_prefill_attention.py` on {os.cpu_count()} CPU cores ({isa_summary()}), one "
             "torch thread, tiny llama (8 layers, 6 query heads, 2 kv heads, head size 64).", "",
             "| prompt tokens | attention op native ms | torch SDPA ms | op speedup | prefill forward native ms | "
             "torch attention ms | forward speedup |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for n in lengths:
        t_native, t_torch = op[n]
        on, off = best["on"][n], best["off"][n]
        lines.append(f"| {n} | {t_native * 1e3:.2f} | {t_torch * 1e3:.2f} | {t_torch / t_native:.2f}x | "
                     f"{on * 1e3:.1f} | {off * 1e3:.1f} | {off / on:.2f}x |")
    lines += ["", f"Attention op: best of 3 x 10 calls of one layer's attention. Prefill forward: one prompt through "
              f"the runner, best of {args.repeats} x {args.rounds} alternating rounds per setting; off = "
              "`TETRIINFER_AVX512_BF16=0` (torch's flash attention; bf16 matmuls of that many rows are torch's "
              "either way).", ""]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
