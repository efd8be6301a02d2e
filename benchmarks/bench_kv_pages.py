"""KV block reuse vs cycling through the pool: the cost of never-touched KV pages, same run.

The KV tensors are allocated lazily (``torch.empty``): a page is mapped the first time a block in it is written,
and each 4 KiB page costs a fault (here, a VM, ~5-20 us). The block pool used to hand out every never-used block
before reusing a freed one ("fifo": the least recently freed queue), so for the first ``num_blocks`` blocks of a
run every request's KV writes faulted. It now reuses freed blocks first ("reuse": hot / fresh / cached tiers,
``core.block_pool``), so a run touches only its peak footprint.

Per setting, in a fresh subprocess pinned to one core (one torch thread, as a serving instance): ``--requests``
prompts of ``--prompt-tokens`` tokens, one at a time, each prefilled (one forward through the engine) and freed,
then the same number of KV hand-off installs (``write_blocks`` of one request's KV into blocks the pool
allocates, as a decode instance does on a hand-off). Median per request; settings alternate over ``--rounds``.

    python benchmarks/bench_kv_pages.py [--out report.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, os, random, sys, time
import torch
os.sched_setaffinity(0, {int(sys.argv[5])})
torch.set_num_threads(1)
from tetriinfer.core.block_pool import BlockPool
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.engine.engine_config import EngineConfig
from tetriinfer.engine.llm_engine import LLMEngine

class FifoPool(BlockPool):
    # the former order: never-used blocks first, then freed ones, least recently freed first
    def _take(self):
        if self._frontier < self.num_blocks:
            self._frontier += 1
            return self._frontier - 1
        if self._hot:
            return self._hot.popitem(last=False)[0]
        return self._cached.popitem(last=False)[0]

setting, model, n, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
eng = LLMEngine(EngineConfig(model=model, dtype="bfloat16", num_threads=1, kv_cache_memory_gb=0.25))
kvm = eng.kv_manager
if setting == "fifo":
    kvm.pool = FifoPool(kvm.pool.num_blocks, kvm.pool.block_size)
rng = random.Random(0)
prefill = []
for i in range(n):
    ids = [rng.randrange(10, 8000) for _ in range(tokens)]
    eng.add_request(eng.new_request_id(), None, ids, SamplingParams(max_tokens=1, temperature=0.0))
    t = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    prefill.append(time.perf_counter() - t)
kv = eng.runner.kv
nb = -(-tokens // kv.block_size)
data = [torch.randn(nb, kv.block_size, *kv.k[0].shape[1:]).to(kv.k[0].dtype) for _ in range(2 * len(kv.k))]
install = []
for i in range(n):
    rid = f"h{i}"
    assert kvm.allocate_slots(rid, tokens)
    t = time.perf_counter()
    kv.write_blocks(kvm.block_table(rid)[:nb], data)
    install.append(time.perf_counter() - t)
    kvm.free_request(rid)
print(json.dumps({"prefill": prefill, "install": install, "touched_blocks": kvm.pool.num_blocks - kvm.pool.num_never_used,
                  "pool_blocks": kvm.pool.num_blocks}))
"""


def main() -> None:
    from tetriinfer.engine.make_model import tiny_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the tiny llama from make-model)")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    a = ap.parse_args()
    model = a.model or str(tiny_model_path())
    settings = ("fifo", "reuse")
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    for _ in tqdm(range(a.rounds), desc="rounds"):
        for s in settings:
            out = subprocess.run([sys.executable, "-c", CHILD, s, model, str(a.requests), str(a.prompt_tokens),
                                  str(a.core)], capture_output=True, text=True, check=True, cwd=ROOT)
            runs[s].append(json.loads(out.stdout.strip().splitlines()[-1]))

    def med(s: str, key: str) -> float:
        return 1e3 * statistics.median(x for r in runs[s] for x in r[key][1:])  # the first request warms up

    rows = [
        "| setting | prefill ms (median) | hand-off install ms (median) | blocks touched / pool |",
        "|---|---:|---:|---:|",
    ]
    for s in settings:
        r = runs[s][-1]
        rows.append(f"| {s} | {med(s, 'prefill'):.2f} | {med(s, 'install'):.3f} | {r['touched_blocks']} / {r['pool_blocks']} |")
    ratio_p = med("fifo", "prefill") / med("reuse", "prefill")
    ratio_i = med("fifo", "install") / med("reuse", "install")
    head = (f"`python benchmarks/bench_kv_pages.py --requests {a.requests} --prompt-tokens {a.prompt_tokens} "
            f"--rounds {a.rounds}`: {a.requests} prompts of {a.prompt_tokens} tokens one at a time (bf16, one core), "
            f"then {a.requests} hand-off installs; median per request over {a.rounds} alternating rounds.")
    text = "\n".join([head, "", *rows, "",
                      f"fifo / reuse: prefill {ratio_p:.2f}x, hand-off install {ratio_i:.2f}x"])
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
