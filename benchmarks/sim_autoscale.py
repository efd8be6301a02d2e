"""Autoscaling under a load that rises and falls, simulated at GPU scale.

The load follows a compressed day: Poisson arrivals of the mixed workload at a rate that steps through
``--profile`` (``RATE:SECONDS,...``). Columns, for colocated (vLLM) and TetriInfer pools: the smallest pool, a fixed
pool of the peak size, and the smallest pool with ``--autoscale`` up to the peak size (the runtime's own
``core.scale_policy`` rule, on the simulated clock; a new instance serves ``--scale-out-s`` after the decision and
is paid for from the decision on). Prints, in the same run, TTFT / JCT / TPOT, provisioned instance-seconds and
the ratios against the fixed peak pool; writes a markdown table and a PNG of instances over time.

    python benchmarks/sim_autoscale.py --out docs/sim/autoscale.md --plot docs/sim/autoscale.png
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tetriinfer.bench.metrics import summarize
from tetriinfer.bench.report import publish_markdown
from tetriinfer.bench.workloads import parse_rate_profile, stepped_workload
from tetriinfer.runtime.cluster_config import ClusterConfig
from tetriinfer.sim.cluster import SimCluster, SimConfig, SimResult
from tetriinfer.sim.cost_model import HARDWARE_PRESETS, RooflineCostModel, kv_bytes_per_token, model_config


def alive_over_time(res: SimResult, initial: list[str], end_s: float) -> list[tuple[float, int]]:
    """(time, instances provisioned) steps: the initial pool, +1 at each add decision, -1 at each retirement."""
    deltas = [(0.0, len(initial))]
    for e in res.scaling:
        if e["action"] == "autoscale-add":
            deltas.append((e["decided_s"], 1))
        elif e.get("retired_s") is not None:
            deltas.append((e["retired_s"], -1))
    deltas.sort()
    out, n = [], 0
    for t, d in deltas:
        n += d
        out.append((t, n))
    out.append((end_s, n))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hardware", default="a100-80g")
    ap.add_argument("--model", default="llama-2-13b")
    ap.add_argument("--workload", default="mixed")
    ap.add_argument("--profile", default="2:120,6:120,12:120,6:120,2:120",
                    help="RATE:SECONDS,... (req/s held for that long)")
    ap.add_argument("--min", type=int, default=1, help="colocated: the smallest pool (TetriInfer: 1P+1D)")
    ap.add_argument("--max", type=int, default=4, help="the peak pool size (TetriInfer: max/2 P + max/2 D)")
    ap.add_argument("--high", type=float, default=0.6)
    ap.add_argument("--low", type=float, default=0.15)
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--cooldown", type=float, default=10.0)
    ap.add_argument("--max-step", type=int, default=4, help="most instances one scale-out adds")
    ap.add_argument("--scale-out-s", type=float, default=15.0,
                    help="decision -> serving (process start + 26 GB of weights; ServerlessLLM-style loading "
                         "is a few seconds, a plain safetensors load tens)")
    ap.add_argument("--rebalance", action=argparse.BooleanOptionalAction, default=True,
                    help="also run each autoscaling column with --rebalance (queued requests move to new instances)")
    ap.add_argument("--migrate", action=argparse.BooleanOptionalAction, default=True,
                    help="also run each autoscaling column with --rebalance --migrate (an instance being removed "
                         "hands its running decodes to the others)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    mcfg = model_config(args.model)
    cost = RooflineCostModel(mcfg, HARDWARE_PRESETS[args.hardware])
    blocks = cost.kv_capacity_tokens() // 16
    try:
        phases = parse_rate_profile(args.profile)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    wl = stepped_workload(args.workload, phases, args.seed)
    auto = dict(autoscale=True, autoscale_high=args.high, autoscale_low=args.low, autoscale_window_s=args.window,
                autoscale_cooldown_s=args.cooldown, autoscale_max_instances=args.max,
                autoscale_max_step=args.max_step)
    half = max(1, args.max // 2)
    tetri = dict(mode="tetriinfer", model=args.model, prefill_policy="sjf", predictor="oracle",
                 decode_policy="reserve-dynamic")
    columns: dict[str, ClusterConfig] = {
        f"colocated x{args.min}": ClusterConfig(mode="colocated", instances=args.min, model=args.model),
        f"colocated x{args.max}": ClusterConfig(mode="colocated", instances=args.max, model=args.model),
        f"colocated x{args.min}..{args.max} --autoscale": ClusterConfig(
            mode="colocated", instances=args.min, model=args.model, **auto),
        "tetriinfer 1P+1D": ClusterConfig(prefill_instances=1, decode_instances=1, **tetri),
        f"tetriinfer {half}P+{half}D": ClusterConfig(prefill_instances=half, decode_instances=half, **tetri),
        f"tetriinfer 1P+1D..{args.max} --autoscale": ClusterConfig(prefill_instances=1, decode_instances=1,
                                                                   **tetri, **auto),
    }
    for label in [k for k in columns if k.endswith("--autoscale")]:
        if args.rebalance:
            columns[label + " --rebalance"] = replace(columns[label], rebalance=True)
        if args.migrate:
            columns[label + " --rebalance --migrate"] = replace(columns[label], rebalance=True, migrate=True)
    rows: list[dict[str, Any]] = []
    timelines: dict[str, list[tuple[float, int]]] = {}
    for label, cc in tqdm(columns.items(), desc="columns"):
        cfg = SimConfig(cc, num_kv_blocks=blocks, kv_bytes_per_token=kv_bytes_per_token(mcfg, 2),
                        max_model_len=mcfg.max_position_embeddings, predictor_accuracy=0.75,
                        scale_out_s=args.scale_out_s)
        res = SimCluster(cfg, cost).run(wl)
        s = summarize(res.records)
        acts = [e["action"] for e in res.scaling]
        rows.append({"column": label, "ttft": s["ttft"]["mean"], "ttft_p99": s["ttft"]["p99"],
                     "jct": s["jct"]["mean"], "tpot": s["tpot"]["mean"], "instance_s": res.instance_s,
                     "busy_s": res.resource_s, "adds": acts.count("autoscale-add"),
                     "removes": acts.count("autoscale-remove"), "completed": s["completed"],
                     "moved": res.migrated, "live": res.migration.get("moved", 0), "mode": cc.mode})
        if cc.autoscale:
            initial = [i for i in res.alive_s if not any(e["instance"] == i and e["action"] == "autoscale-add"
                                                         for e in res.scaling)]
            timelines[label] = alive_over_time(res, initial, res.duration_s)
    total_s = sum(secs for _, secs in phases)
    lines = [
        "# Autoscaling under a rising and falling load (simulated)", "",
        f"- {cost.describe()}; `{args.model}`; KV pool {blocks} blocks of 16 tokens per instance.",
        f"- Workload: `{args.workload}`, Poisson arrivals stepping through "
        + ", ".join(f"{r:g} req/s for {s:.0f} s" for r, s in phases) + f" ({len(wl)} requests, {total_s:.0f} s).",
        f"- `--autoscale`: high {args.high}, low {args.low}, window {args.window:.0f} s, cooldown "
        f"{args.cooldown:.0f} s, at most {args.max} instances, at most {args.max_step} per scale-out; a new instance serves {args.scale_out_s:.0f} s after "
        "the decision and is paid for from the decision on. TetriInfer columns: SJF prefill, length-aware dispatch, "
        "reserve-dynamic decode, predictor at 75% bucket accuracy.",
        "- Instance-seconds: provisioned (what a pool that grows and shrinks pays); busy: seconds spent in steps.",
        f"- Command: `python benchmarks/sim_autoscale.py --profile {args.profile} --max {args.max} "
        f"--max-step {args.max_step} --scale-out-s {args.scale_out_s:g}`.", "",
        "- `--rebalance`: each monitor round, the instance with the most queued requests hands up to half of its "
        "unstarted ones back to be routed again when a peer of its tier has an empty queue (a new instance, typically).",
        "",
        "- `--migrate`: an instance being removed hands its running decodes (with their KV, over the simulated "
        "link) to the instances that stay, and an instance whose KV usage passes 0.85 sheds to one below 0.6.",
        "",
        "| column | TTFT mean s | TTFT p99 s | JCT mean s | TPOT ms | instance-s | busy s | added | removed | moved "
        "| live-migrated |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['column']} | {r['ttft']:.3f} | {r['ttft_p99']:.2f} | {r['jct']:.2f} | "
                     f"{r['tpot'] * 1e3:.1f} | {r['instance_s']:.0f} | {r['busy_s']:.0f} | {r['adds']} | "
                     f"{r['removes']} | {r['moved']} | {r['live']} |")
    lines.append("")
    by_mode = {mode: [r for r in rows if r["mode"] == mode] for mode in ("colocated", "tetriinfer")}
    for small, peak, *scaled_rows in by_mode.values():
        for scaled in scaled_rows:
            lines.append(f"- `{scaled['column']}` vs `{peak['column']}`: instance-seconds x"
                         f"{scaled['instance_s'] / peak['instance_s']:.2f}, TTFT x{scaled['ttft'] / peak['ttft']:.2f}, "
                         f"JCT x{scaled['jct'] / peak['jct']:.2f}; vs `{small['column']}`: JCT "
                         f"x{scaled['jct'] / small['jct']:.2f}, TTFT p99 x{scaled['ttft_p99'] / small['ttft_p99']:.2f}.")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        for label, steps in timelines.items():
            ax.step([t for t, _ in steps], [n for _, n in steps], where="post", label=label,
                    linestyle=":" if "migrate" in label else "--" if "rebalance" in label else "-")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("instances provisioned")
        rate_ax = ax.twinx()
        edges, t = [], 0.0
        for rate, secs in phases:
            edges += [(t, rate), (t + secs, rate)]
            t += secs
        rate_ax.plot([e[0] for e in edges], [e[1] for e in edges], color="grey", linestyle=":", label="req/s")
        rate_ax.set_ylabel("arrival rate (req/s, dotted)")
        ax.legend(loc="upper left", fontsize=8)
        ax.set_title(f"--autoscale on {args.hardware} / {args.model} (simulated)")
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
        lines += ["", f"![instances over time]({Path(args.plot).name})"]
    publish_markdown(lines, args.out)


if __name__ == "__main__":
    main()
