"""Live migration (`--migrate`) against a decode hotspot, simulated at GPU scale, same run.

Long decodes (the LPHD class: light prompts, heavy outputs) arrive as Poisson traffic at each of `--rates` on 1 prefill +
2 decode instances whose KV pools are what the hardware leaves after the weights. Columns: `--dispatch-policy
imbalanced` (every light decode to one instance: the hotspot TetriInfer's dispatcher exists to avoid; without a
predictor every decode is light) with and without `--migrate` (the hot instance sheds running decodes, with their
KV, to the other once its KV usage passes 0.85), and the paper's length-aware dispatcher (with the oracle
predictor) with and without `--migrate`. Reports TTFT / JCT / TPOT, preemptions (recompute) and requests moved,
with ratios against the same dispatch without migration.

    python benchmarks/sim_migration.py --out docs/sim/migration.md
"""

from __future__ import annotations

import argparse

from tqdm import tqdm

from tetriinfer.bench.metrics import summarize
from tetriinfer.bench.report import publish_markdown
from tetriinfer.bench.workloads import load_workload
from tetriinfer.runtime.cluster_config import ClusterConfig
from tetriinfer.sim.cluster import SimCluster, SimConfig
from tetriinfer.sim.cost_model import HARDWARE_PRESETS, RooflineCostModel, kv_bytes_per_token, model_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hardware", default="a100-80g")
    ap.add_argument("--model", default="llama-2-13b")
    ap.add_argument("--workload", default="lphd")
    ap.add_argument("--rates", default="16,30", help="req/s, comma-separated: one table each")
    ap.add_argument("--requests", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    mcfg = model_config(args.model)
    cost = RooflineCostModel(mcfg, HARDWARE_PRESETS[args.hardware])
    blocks = cost.kv_capacity_tokens() // 16
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    base = dict(mode="tetriinfer", model=args.model, prefill_instances=1, decode_instances=2, prefill_policy="sjf")
    columns = {
        "imbalanced": ClusterConfig(dispatch_policy="imbalanced", **base),
        "imbalanced --migrate": ClusterConfig(dispatch_policy="imbalanced", migrate=True, **base),
        "length-aware": ClusterConfig(predictor="oracle", decode_policy="reserve-dynamic", **base),
        "length-aware --migrate": ClusterConfig(predictor="oracle", decode_policy="reserve-dynamic", migrate=True,
                                                **base),
    }
    lines = [
        "# Live migration against a decode hotspot (simulated)", "",
        f"- {cost.describe()}; `{args.model}`; KV pool {blocks} blocks of 16 tokens per instance; 1 prefill + 2 "
        f"decode instances, SJF prefill; `--migrate` with its defaults (KV usage above 0.85 sheds to an instance "
        "below 0.6).",
        f"- Workload: `{args.workload}`, {args.requests} requests, Poisson arrivals.",
        f"- Command: `python benchmarks/sim_migration.py --rates {args.rates} --requests {args.requests}`.",
    ]
    bar = tqdm(total=len(rates) * len(columns), desc="columns")
    for rate in rates:
        wl = load_workload(args.workload, args.requests, rate, args.seed)
        rows = {}
        for label, cc in columns.items():
            cfg = SimConfig(cc, num_kv_blocks=blocks, kv_bytes_per_token=kv_bytes_per_token(mcfg, 2),
                            max_model_len=mcfg.max_position_embeddings, predictor_accuracy=0.75)
            res = SimCluster(cfg, cost).run(wl)
            s = summarize(res.records)
            rows[label] = {"ttft": s["ttft"]["mean"], "jct": s["jct"]["mean"], "tpot": s["tpot"]["mean"],
                           "jct_p99": s["jct"]["p99"], "preemptions": res.preemptions,
                           "moved": res.migration.get("moved", 0),
                           "steps": {k: v for k, v in res.steps.items() if k.startswith("decode")}}
            bar.update(1)
        lines += [
            "", f"## {rate:g} req/s", "",
            "| column | TTFT mean s | JCT mean s | JCT p99 s | TPOT ms | preemptions | live-migrated | decode steps |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for label, r in rows.items():
            steps = ", ".join(f"{k}: {v}" for k, v in sorted(r["steps"].items()))
            lines.append(f"| {label} | {r['ttft']:.3f} | {r['jct']:.2f} | {r['jct_p99']:.2f} | "
                         f"{r['tpot'] * 1e3:.1f} | {r['preemptions']} | {r['moved']} | {steps} |")
        lines.append("")
        for plain in ("imbalanced", "length-aware"):
            a, b = rows[plain + " --migrate"], rows[plain]
            lines.append(f"- `{plain} --migrate` vs `{plain}`: JCT x{a['jct'] / b['jct']:.2f}, TPOT "
                         f"x{a['tpot'] / b['tpot']:.2f}, TTFT x{a['ttft'] / b['ttft']:.2f}, preemptions "
                         f"{b['preemptions']} -> {a['preemptions']}.")
    bar.close()
    publish_markdown(lines, args.out)


if __name__ == "__main__":
    main()
