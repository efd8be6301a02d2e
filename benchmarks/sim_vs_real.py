"""How close is the simulator to the real system? Replay real side-by-side runs in the simulator.

For every cell of one or more real ``tetriinfer bench side-by-side`` results (JSON), simulate the same workload
(same generator, seed, request count and rate) on the same columns (same ``serve`` arguments, so the same
policies) with a cost model profiled on this machine's engine (``tetriinfer profile``), then print real vs
simulated mean TTFT, mean JCT and resource usage, and -- what the simulator is for -- each column's change vs
colocated, real vs simulated. Writes a markdown report (and JSON with ``--json``).

    python benchmarks/sim_vs_real.py --real docs/side_by_side_rounds4.json --profile docs/sim/tiny_llama_profile.json \
        --out report.md

The real runs are noisy (a shared 2-core machine: the same comparison moves 5-10 points between runs); read
the error columns against that spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tetriinfer.bench.metrics import summarize
from tetriinfer.bench.side_by_side import BASELINE, Column, pct_change
from tetriinfer.sim.cost_model import ProfileCostModel, kv_bytes_per_token, model_config
from tetriinfer.sim.side_by_side import SimSideBySide, SimSideBySideConfig, cluster_config_for


def replay(real: dict[str, Any], cost: ProfileCostModel, model: str, dtype_bytes: int,
           frontend_delay_s: float = 0.0, run: str = "") -> list[dict[str, Any]]:
    meta = real["meta"]
    mcfg = model_config(model)
    kv_tok = kv_bytes_per_token(mcfg, dtype_bytes)
    cols = tuple(Column(c["label"], c["mode"], None, tuple(c["serve_args"])) for c in meta["columns"] if c.get("mode"))
    caps = meta.get("caps", {})
    base = SimSideBySideConfig(
        tuple({w["key"] for w in meta["workloads"].values()}), cols, num_kv_blocks=1, kv_bytes_per_token=kv_tok,
        max_model_len=caps.get("max_context") or mcfg.max_position_embeddings, model=model,
        instances=meta["instances"], prefill_instances=meta["prefill_instances"],
        max_prompt_tokens=caps.get("max_prompt_tokens"), max_output_tokens=caps.get("max_output_tokens"),
        arrival=meta.get("arrival", "poisson"), burstiness_cv=meta.get("burstiness_cv", 1.0),
        seed=meta.get("seed", 0), frontend_delay_s=frontend_delay_s, progress=False,
    )
    rows = []
    for key, cells in tqdm(real["workloads"].items(), desc="cells"):
        name = meta["workloads"][key]["key"]
        rate = meta["rates"][key]["rate_rps"]
        n = meta["rates"][key]["requests"]
        sim_cells: dict[str, dict[str, float]] = {}
        for col in cols:
            cluster = cluster_config_for(col, base)
            blocks = int((cluster.kv_cache_memory_gb or 1.0) * 1024**3 // (cluster.block_size * kv_tok))
            runner = SimSideBySide(replace(base, num_kv_blocks=blocks), cost)
            res = runner.simulate(cluster, runner.workload(name, n, rate, base.seed))
            s = summarize(res.records)
            sim_cells[col.label] = {"ttft_mean": s["ttft"]["mean"], "jct_mean": s["jct"]["mean"],
                                    "resource_s": res.resource_s * meta.get("rounds", 1)}
        for label, cell in cells.items():
            if label not in sim_cells:
                continue
            sim = sim_cells[label]
            row = {"cell": f"{run}: {key}" if run else key, "column": label}
            for k in ("ttft_mean", "jct_mean", "resource_s"):
                row[f"real_{k}"], row[f"sim_{k}"] = cell[k], sim[k]
                row[f"err_{k}"] = pct_change(sim[k], cell[k])
            if label != BASELINE:
                for k in ("ttft_mean", "jct_mean", "resource_s"):
                    row[f"real_change_{k}"] = pct_change(cell[k], cells[BASELINE][k])
                    row[f"sim_change_{k}"] = pct_change(sim[k], sim_cells[BASELINE][k])
            rows.append(row)
    return rows


def _p(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:+.0f}%"


def markdown(rows: list[dict[str, Any]], sources: list[str], cost: ProfileCostModel, frontend_ms: float) -> str:
    out = ["# Simulator vs real side-by-side runs", "",
           f"- Real runs: {', '.join(f'`{s}`' for s in sources)}.",
           f"- Cost model: {cost.describe()}; front-end delay {frontend_ms:.0f} ms per request.",
           "- Same workloads (generator, seed, count, rate), same columns (`serve` arguments) as the real runs.", "",
           "## Absolute means: real, simulated, error", "",
           "| cell | column | TTFT real s | sim s | err | JCT real s | sim s | err | resource real s | sim s | err |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['cell']} | {r['column']} | " + " | ".join(
            f"{r[f'real_{k}']:.3f} | {r[f'sim_{k}']:.3f} | {_p(r[f'err_{k}'])}"
            for k in ("ttft_mean", "jct_mean", "resource_s")) + " |")
    out += ["", "## Change vs colocated: real vs simulated", "",
            "| cell | column | TTFT real | TTFT sim | JCT real | JCT sim | resource real | resource sim |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    changes = [r for r in rows if "real_change_ttft_mean" in r]
    for r in changes:
        out.append(f"| {r['cell']} | {r['column']} | " + " | ".join(
            f"{_p(r[f'real_change_{k}'])} | {_p(r[f'sim_change_{k}'])}" for k in ("ttft_mean", "jct_mean", "resource_s"))
            + " |")
    out += ["", "## Summary", ""]
    for k, name in (("ttft_mean", "TTFT"), ("jct_mean", "JCT"), ("resource_s", "resource")):
        errs = [abs(r[f"err_{k}"]) for r in rows if r[f"err_{k}"] is not None]
        gaps = [abs(r[f"sim_change_{k}"] - r[f"real_change_{k}"]) for r in changes
                if r[f"sim_change_{k}"] is not None and r[f"real_change_{k}"] is not None]
        signs = sum((r[f"sim_change_{k}"] or 0) * (r[f"real_change_{k}"] or 0) > 0 for r in changes)
        out.append(f"- {name}: mean |error| of the absolute means {statistics.fmean(errs) * 100:.0f}% "
                   f"(max {max(errs) * 100:.0f}%); change vs colocated off by {statistics.fmean(gaps) * 100:.0f} "
                   f"points on average (max {max(gaps) * 100:.0f}); same sign in {signs} of {len(changes)} cells.")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--real", action="append", required=True, help="a bench side-by-side JSON (repeatable)")
    ap.add_argument("--profile", action="append", required=True,
                    help="`tetriinfer profile` JSON of the same engine (repeatable: their lower envelope)")
    ap.add_argument("--model", default=None, help="model folder (default: the tiny llama)")
    ap.add_argument("--dtype-bytes", type=int, default=4)
    ap.add_argument("--step-overhead-ms", type=float, default=0.0)
    ap.add_argument("--frontend-delay-ms", type=float, default=0.0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from tetriinfer.engine.make_model import tiny_model_path

    model = args.model or str(tiny_model_path())
    cost = ProfileCostModel.from_profile(args.profile, step_overhead_s=args.step_overhead_ms / 1e3)
    rows: list[dict[str, Any]] = []
    for path in args.real:
        rows += replay(json.loads(Path(path).read_text()), cost, model, args.dtype_bytes, args.frontend_delay_ms / 1e3,
                       run=Path(path).stem)
    md = markdown(rows, args.real, cost, args.frontend_delay_ms)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(md)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print(md)


if __name__ == "__main__":
    main()
