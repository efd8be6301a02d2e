"""Instance flips when the load shifts, simulated at GPU scale (TetriInfer section 3.5).

A workload whose mix changes halfway: heavy prompts with light outputs (HPLD) for the first phase, then light
prompts with heavy outputs (LPHD). Four simulated instances; columns: static 2 prefill + 2 decode, the same with
``--flip`` (the monitor drains an idle instance and switches its role in place), and 4 colocated instances.
Prints per-phase mean TTFT and JCT, resource usage and the flips, in the same run.

    python benchmarks/sim_flip.py --out docs/sim/flip.md
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from tqdm import tqdm

from tetriinfer.bench.metrics import summarize
from tetriinfer.bench.report import publish_markdown
from tetriinfer.bench.workloads import Workload, load_workload
from tetriinfer.runtime.cluster_config import ClusterConfig
from tetriinfer.sim.cluster import SimCluster, SimConfig
from tetriinfer.sim.cost_model import HARDWARE_PRESETS, RooflineCostModel, kv_bytes_per_token, model_config


def phased(first: str, second: str, rate1: float, rate2: float, phase_s: float, seed: int) -> Workload:
    a = load_workload(first, max(1, int(rate1 * phase_s)), rate1, seed)
    b = load_workload(second, max(1, int(rate2 * phase_s)), rate2, seed + 1)
    reqs = [replace(r, request_id=f"a-{r.request_id}") for r in a.requests]
    reqs += [replace(r, request_id=f"b-{r.request_id}", arrival_s=r.arrival_s + phase_s) for r in b.requests]
    reqs.sort(key=lambda r: r.arrival_s)
    return Workload(f"{first}->{second}", tuple(reqs), "phased", "poisson", None, seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hardware", default="a100-80g")
    ap.add_argument("--model", default="llama-2-13b")
    ap.add_argument("--rate1", type=float, default=3.0, help="req/s of the first phase (HPLD)")
    ap.add_argument("--rate2", type=float, default=10.0, help="req/s of the second phase (LPHD)")
    ap.add_argument("--phase-s", type=float, default=90.0)
    ap.add_argument("--flip-window", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    mcfg = model_config(args.model)
    cost = RooflineCostModel(mcfg, HARDWARE_PRESETS[args.hardware])
    blocks = cost.kv_capacity_tokens() // 16
    wl = phased("hpld", "lphd", args.rate1, args.rate2, args.phase_s, args.seed)
    common = dict(model=args.model, prefill_policy="sjf", predictor="oracle", decode_policy="reserve-dynamic")
    columns = {
        "2P+2D static": ClusterConfig(mode="tetriinfer", prefill_instances=2, decode_instances=2, **common),
        "2P+2D --flip": ClusterConfig(mode="tetriinfer", prefill_instances=2, decode_instances=2, flip=True,
                                      flip_window_s=args.flip_window, **common),
        "2P+2D --flip --flip-decode-load kv": ClusterConfig(
            mode="tetriinfer", prefill_instances=2, decode_instances=2, flip=True, flip_window_s=args.flip_window,
            flip_decode_load="kv", **common),
        "2P+2D --flip --flip-decode-load inflation": ClusterConfig(
            mode="tetriinfer", prefill_instances=2, decode_instances=2, flip=True, flip_window_s=args.flip_window,
            flip_decode_load="inflation", **common),
        "2P+2D --flip --flip-decode-load inflation --flip-busy-threshold 0.3": ClusterConfig(
            mode="tetriinfer", prefill_instances=2, decode_instances=2, flip=True, flip_window_s=args.flip_window,
            flip_decode_load="inflation", flip_busy_threshold=0.3, **common),
        "2P+2D --flip --flip-decode-load inflation --flip-busy-threshold 0.3 --flip-idle-by mean": ClusterConfig(
            mode="tetriinfer", prefill_instances=2, decode_instances=2, flip=True, flip_window_s=args.flip_window,
            flip_decode_load="inflation", flip_busy_threshold=0.3, flip_idle_by="mean", **common),
        "2P+2D --flip --flip-decode-load inflation --flip-busy-threshold 0.3 --flip-idle-by mean --migrate":
            ClusterConfig(mode="tetriinfer", prefill_instances=2, decode_instances=2, flip=True,
                          flip_window_s=args.flip_window, flip_decode_load="inflation", flip_busy_threshold=0.3,
                          flip_idle_by="mean", migrate=True, **common),
        "4 colocated": ClusterConfig(mode="colocated", instances=4, model=args.model),
    }
    rows = []
    flips_out = {}
    for label, cc in tqdm(columns.items(), desc="columns"):
        cfg = SimConfig(cc, num_kv_blocks=blocks, kv_bytes_per_token=kv_bytes_per_token(mcfg, 2),
                        max_model_len=mcfg.max_position_embeddings, predictor_accuracy=0.75)
        res = SimCluster(cfg, cost).run(wl)
        row = {"column": label, "resource_s": res.resource_s, "flips": len(res.flips),
               "live": res.migration.get("moved", 0)}
        for phase in ("a", "b"):
            s = summarize([r for r in res.records if r.request_id.startswith(f"{phase}-")])
            row[f"{phase}_ttft"], row[f"{phase}_jct"] = s["ttft"]["mean"], s["jct"]["mean"]
        rows.append(row)
        flips_out[label] = res.flips
    base = rows[0]
    lines = [
        "# Flips under a shifting load (simulated)", "",
        f"- {cost.describe()}; `{args.model}`; KV pool {blocks} blocks of 16 tokens per instance.",
        f"- Workload: HPLD at {args.rate1} req/s for {args.phase_s:.0f} s, then LPHD at {args.rate2} req/s for "
        f"{args.phase_s:.0f} s ({len(wl)} requests); TetriInfer columns: SJF prefill, length-aware dispatch, "
        "reserve-dynamic decode, predictor at 75% bucket accuracy; flip threshold 10%, window "
        f"{args.flip_window:.0f} s, cooldown 5 s.",
        "- Command: `python benchmarks/sim_flip.py` (defaults).", "",
        "- `--migrate`: a decode instance draining for a flip hands its running decodes to the other decode "
        "instances (live migration) instead of waiting for them to finish.", "",
        "| column | phase 1 (HPLD) TTFT s | JCT s | phase 2 (LPHD) TTFT s | JCT s | resource s | flips | "
        "live-migrated |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['column']} | {r['a_ttft']:.3f} | {r['a_jct']:.2f} | {r['b_ttft']:.3f} | {r['b_jct']:.2f} | "
                     f"{r['resource_s']:.0f} | {r['flips']} | {r['live']} |")
    for flip in rows[1:-1]:
        lines += ["", f"`{flip['column']}` vs static 2P+2D: phase 1 TTFT {flip['a_ttft'] / base['a_ttft'] - 1:+.0%}, "
                  f"JCT {flip['a_jct'] / base['a_jct'] - 1:+.0%}; phase 2 TTFT {flip['b_ttft'] / base['b_ttft'] - 1:+.0%}, "
                  f"JCT {flip['b_jct'] / base['b_jct'] - 1:+.0%}."]
    for label in list(columns)[1:-1]:
        lines += ["", f"Flips of `{label}`:", "",
                  "| instance | from | to | decided s | drained s | switched s |", "|---|---|---|---:|---:|---:|"]
        for f in flips_out[label]:
            lines.append(f"| {f['instance']} | {f['from']} | {f['to']} | {f['decided_s']:.1f} | {f['drained_s']:.1f} | "
                         f"{f['switched_s']:.1f} |")
    publish_markdown(lines, args.out)


if __name__ == "__main__":
    main()
