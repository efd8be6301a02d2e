"""``tetriinfer sim side-by-side``: argparse wiring (imports stay cheap; the work happens in the handler)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

COST_HELP = ("profile:FILE[,FILE...] (`tetriinfer profile` JSONs measured on the engine; several: their lower "
             "envelope) or roofline:HW (analytic; HW one of "
             "v100-32g, a100-40g, a100-80g, h100-80g, h200-141g)")


def _cost_model(args: argparse.Namespace) -> tuple[Any, Any, int]:
    """(cost model, model config, KV bytes per token) from ``--cost`` and ``--model``."""
    from tetriinfer.model_config import DEFAULT_SIM_MODEL
    from tetriinfer.sim.cost_model import (
        HARDWARE_PRESETS,
        ProfileCostModel,
        RooflineCostModel,
        kv_bytes_per_token,
        model_config,
    )

    kind, _, value = args.cost.partition(":")
    model = args.model or DEFAULT_SIM_MODEL
    cfg = model_config(model)
    overhead = args.step_overhead_ms / 1e3 if args.step_overhead_ms >= 0 else None
    if kind == "profile":
        files = [f for f in value.split(",") if f]
        missing = [f for f in files if not Path(f).is_file()]
        if not files or missing:
            raise FileNotFoundError(f"--cost profile:FILE[,FILE...]: no profile at {missing or value!r} (make one "
                                    "with `tetriinfer profile`)")
        dtype_bytes = args.dtype_bytes or 4
        cost = ProfileCostModel.from_profile(list(files), step_overhead_s=overhead or 0.0)
        return cost, cfg, kv_bytes_per_token(cfg, dtype_bytes)
    if kind == "roofline":
        if value not in HARDWARE_PRESETS:
            raise ValueError(f"--cost roofline:HW: unknown hardware {value!r}; one of {', '.join(HARDWARE_PRESETS)}")
        dtype_bytes = args.dtype_bytes or 2
        cost = RooflineCostModel(cfg, HARDWARE_PRESETS[value], dtype_bytes=dtype_bytes, mfu=args.mfu, mbu=args.mbu,
                                 step_overhead_s=0.003 if overhead is None else overhead,
                                 tensor_parallel=args.tensor_parallel)
        return cost, cfg, kv_bytes_per_token(cfg, dtype_bytes)
    raise ValueError(f"--cost must be {COST_HELP}; got {args.cost!r}")


def _side_by_side(args: argparse.Namespace) -> int:
    from tetriinfer.bench.metrics import SLO
    from tetriinfer.bench.side_by_side import parse_columns, save, write_plots
    from tetriinfer.sim.side_by_side import (
        SimSideBySide,
        SimSideBySideConfig,
        cluster_config_for,
        markdown_report,
    )

    cost, mcfg, kv_per_token = _cost_model(args)
    columns = parse_columns(args.modes, (), args.serve_arg)
    max_len = args.max_model_len or mcfg.max_position_embeddings
    probe_cfg = SimSideBySideConfig(tuple(w.strip() for w in args.workloads.split(",") if w.strip()), columns,
                                    num_kv_blocks=1, kv_bytes_per_token=kv_per_token, max_model_len=max_len)
    blocks = _kv_blocks(args, cost, kv_per_token, cluster_config_for(columns[0], probe_cfg).block_size)
    fractions = tuple(float(f) for f in args.rate_fraction.split(","))
    cfg = SimSideBySideConfig(
        probe_cfg.workloads, columns, num_kv_blocks=blocks, kv_bytes_per_token=kv_per_token, max_model_len=max_len,
        model=args.model or "tiny-llama (default)", num_requests=args.num_requests,
        rate=None if args.rate == "auto" else float(args.rate), rate_fractions=fractions,
        probe_requests=args.probe_requests, probe_concurrency=args.probe_concurrency, instances=args.instances,
        prefill_instances=args.prefill_instances, max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens, arrival=args.arrival, burstiness_cv=args.burstiness_cv,
        length_source=args.length_source, length_scale=args.length_scale, seed=args.seed, link_bandwidth=args.link_bandwidth,
        link_latency=args.link_latency, predictor_accuracy=args.predictor_accuracy,
        frontend_delay_s=args.frontend_delay_ms / 1e3, scale_out_s=args.scale_out_s, floor=not args.no_floor,
        slo=SLO(args.slo_ttft, args.slo_tpot, args.slo_e2e), progress=not args.no_progress,
        trace_repeat=args.trace_repeat, jobs=args.jobs, baseline=args.baseline,
    )
    command = "tetriinfer " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    result, raw = SimSideBySide(cfg, cost, command).run()
    save(result, args.out)
    plots = write_plots(result, raw, args.plot) if args.plot else []
    if args.md:
        md_path = Path(args.md)
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(markdown_report(result, plots, md_path.parent), encoding="utf-8")
    if args.raw:
        Path(args.raw).write_text(json.dumps(raw) + "\n", encoding="utf-8")
    from tetriinfer.bench.side_by_side import paper_table

    print(paper_table(result))
    print(f"results written to {args.out}" + (f", report to {args.md}" if args.md else ""))
    return 0


def _kv_blocks(args: argparse.Namespace, cost: Any, kv_per_token: int, block_size: int) -> int:
    """KV blocks per instance: ``--num-kv-blocks``, else the device memory (roofline) or ``--kv-cache-memory-gb``."""
    from tetriinfer.sim.cost_model import RooflineCostModel

    if args.num_kv_blocks:
        return int(args.num_kv_blocks)
    if isinstance(cost, RooflineCostModel):
        return cost.kv_capacity_tokens(args.gpu_memory_utilization) // block_size
    return int(args.kv_cache_memory_gb * 1024**3 // (block_size * kv_per_token))


def _placement(args: argparse.Namespace) -> int:
    from tetriinfer.bench.metrics import SLO
    from tetriinfer.bench.side_by_side import parse_columns, save
    from tetriinfer.sim.placement import (
        PlacementConfig,
        PlacementSearch,
        candidate_layouts,
        layout_cluster_config,
        markdown_report,
        write_plots,
    )

    cost, mcfg, kv_per_token = _cost_model(args)
    columns = parse_columns(args.modes, (), args.serve_arg)  # --serve-arg MODE:ARGS as in side-by-side
    layouts = candidate_layouts([c.label for c in columns], args.instances,
                                {c.label: c.serve_args for c in columns})
    max_len = args.max_model_len or mcfg.max_position_embeddings
    blocks = _kv_blocks(args, cost, kv_per_token, layout_cluster_config(layouts[0], args.model or "sim").block_size)
    cfg = PlacementConfig(
        tuple(w.strip() for w in args.workloads.split(",") if w.strip()), tuple(layouts),
        SLO(args.slo_ttft, args.slo_tpot, args.slo_e2e), num_kv_blocks=blocks, kv_bytes_per_token=kv_per_token,
        max_model_len=max_len, model=args.model or "tiny-llama (default)", attainment=args.attainment,
        num_requests=args.num_requests, min_duration_s=args.min_duration_s, probe_requests=args.probe_requests,
        probe_concurrency=args.probe_concurrency, rel_tol=args.rel_tol, arrival=args.arrival,
        burstiness_cv=args.burstiness_cv, max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens, length_source=args.length_source, length_scale=args.length_scale, seed=args.seed,
        link_bandwidth=args.link_bandwidth, link_latency=args.link_latency,
        predictor_accuracy=args.predictor_accuracy, frontend_delay_s=args.frontend_delay_ms / 1e3,
        target_rate=args.target_rate, progress=not args.no_progress, trace_repeat=args.trace_repeat, jobs=args.jobs,
    )
    command = "tetriinfer " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    result = PlacementSearch(cfg, cost, command).run()
    save(result, args.out)
    plots = write_plots(result, args.plot) if args.plot else []
    if args.md:
        md_path = Path(args.md)
        md_path.parent.mkdir(parents=True, exist_ok=True)
        rel = [str(Path(p).resolve().relative_to(md_path.parent.resolve())) if Path(p).resolve().is_relative_to(
            md_path.parent.resolve()) else p for p in plots]
        md_path.write_text(markdown_report(result, rel), encoding="utf-8")
    for wl, entry in result["workloads"].items():
        top = entry["layouts"][0]
        print(f"{wl}: best {top['label']}: goodput {top['goodput_rps']:.3f} req/s "
              f"({top['goodput_per_instance_rps']:.3f} per instance); "
              + "; ".join(f"{r['label']} {r['goodput_per_instance_rps']:.3f}" for r in entry["layouts"][1:]))
    print(f"results written to {args.out}" + (f", report to {args.md}" if args.md else ""))
    return 0


def _add_cost_args(p: argparse.ArgumentParser) -> None:
    """The cost model, model and memory arguments every simulation subcommand takes."""
    p.add_argument("--cost", required=True, help=COST_HELP)
    p.add_argument("--model", default=None, help="a model preset (llama-2-7b, llama-2-13b, llama-3-8b, mistral-7b, "
                                                 "opt-13b) or an HF model folder (default: the tiny llama)")
    p.add_argument("--dtype-bytes", type=int, default=None, help="bytes per weight/KV element (default: 4 for "
                                                                  "profile, 2 for roofline)")
    p.add_argument("--mfu", type=float, default=0.5, help="roofline: achieved/peak FLOP/s")
    p.add_argument("--mbu", type=float, default=0.7, help="roofline: achieved/peak memory bandwidth")
    p.add_argument("--step-overhead-ms", type=float, default=-1.0,
                   help="per-step overhead (default: 0 for profile, 3 ms for roofline)")
    p.add_argument("--tensor-parallel", type=int, default=1, help="roofline: devices per instance")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per instance (default: from the "
                                                                   "device memory or --kv-cache-memory-gb)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="profile: KV pool per instance")
    p.add_argument("--max-model-len", type=int, default=None)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    """Request shapes, arrivals, links and the front end: what every simulation subcommand takes alike."""
    p.add_argument("--max-prompt-tokens", type=int, default=None)
    p.add_argument("--max-output-tokens", type=int, default=None)
    p.add_argument("--arrival", default="poisson", choices=["poisson", "gamma"])
    p.add_argument("--burstiness-cv", type=float, default=1.0)
    p.add_argument("--length-source", default=None)
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="trace:FILE workloads: multiply lengths (and a Mooncake trace's 512-token hash blocks) by S")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace-repeat", type=int, default=1, metavar="K",
                   help="trace:FILE workloads: play the trace K times back to back (for -n beyond its rows); "
                        "scale:N workloads draw N requests from a trace's lengths and gaps instead")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="simulate up to N columns (side-by-side) or layouts (placement) at once in worker "
                        "processes; the results are identical to --jobs 1")
    p.add_argument("--link-bandwidth", default="200Gbps")
    p.add_argument("--link-latency", default="0")
    p.add_argument("--predictor-accuracy", type=float, default=1.0,
                   help="with --serve-arg '--predictor oracle': share of exact buckets (the rest one bucket off)")
    p.add_argument("--frontend-delay-ms", type=float, default=0.0,
                   help="per request, arrival -> routed (HTTP, tokenization, messaging of a real front end)")
    p.add_argument("--scale-out-s", type=float, default=5.0,
                   help="with --serve-arg '--autoscale ...': seconds from a scale-out decision to the new instance "
                        "taking work (process start + weights load; ~1 s with fast-shm on a warm host)")


def add_subparsers(subparsers: Any) -> None:
    p_sim = subparsers.add_parser("sim", help="simulate clusters with the same scheduling code (no GPU needed)")
    sub = p_sim.add_subparsers(dest="sim_command", metavar="SIM_COMMAND")
    p_sim.set_defaults(handler=lambda args: (p_sim.print_help(), 2)[1])
    p = sub.add_parser("side-by-side", help="the bench side-by-side comparison, on simulated clusters",
                       description="Every column (--modes, --serve-arg as in `bench side-by-side`) is simulated with "
                                   "the real core schedulers and a cost model; writes the same JSON and report.")
    _add_cost_args(p)
    p.add_argument("--workloads", default="lpld,lphd,hpld,hphd,mixed",
                   help="comma-separated: lpld, lphd, hpld, hphd, mixed, trace:FILE, scale:N")
    p.add_argument("--modes", default="tetriinfer,colocated")
    p.add_argument("--serve-arg", action="append", default=[], metavar="[NAME:]ARGS",
                   help="`tetriinfer serve` arguments for every column, or NAME:ARGS for one; repeatable")
    p.add_argument("--num-requests", "-n", type=int, default=200)
    p.add_argument("--rate", default="auto")
    p.add_argument("--rate-fraction", default="0.7", metavar="F[,F...]")
    p.add_argument("--probe-requests", type=int, default=64)
    p.add_argument("--probe-concurrency", type=int, default=16)
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--prefill-instances", type=int, default=None)
    _add_workload_args(p)
    p.add_argument("--no-floor", action="store_true")
    p.add_argument("--baseline", default="colocated", metavar="NAME",
                   help="the column perf/$ and changes are measured against: a column's name (default colocated, "
                        "on the same instance count), or vllm1 = one colocated instance at the same rate (the "
                        "paper's framing)")
    p.add_argument("--slo-ttft", type=float, default=None, metavar="MS")
    p.add_argument("--slo-tpot", type=float, default=None, metavar="MS")
    p.add_argument("--slo-e2e", type=float, default=None, metavar="MS")
    p.add_argument("--out", required=True)
    p.add_argument("--md", default=None)
    p.add_argument("--plot", default=None, metavar="DIR")
    p.add_argument("--raw", default=None)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=_side_by_side)

    p = sub.add_parser("placement", help="DistServe's placement search: the mode and prefill:decode split with the "
                                         "most goodput per instance",
                       description="For each mode and, for disaggregated modes, each prefill:decode split of "
                                   "--instances, find the highest request rate at which --attainment of the requests "
                                   "meet the SLOs (simulated), and rank layouts by goodput per instance.")
    _add_cost_args(p)
    p.add_argument("--workloads", default="mixed",
                   help="comma-separated: lpld, lphd, hpld, hphd, mixed, trace:FILE, scale:N")
    p.add_argument("--modes", default="tetriinfer,colocated")
    p.add_argument("--serve-arg", action="append", default=[], metavar="[MODE:]ARGS",
                   help="`tetriinfer serve` arguments for every mode, or MODE:ARGS for one; repeatable")
    p.add_argument("--instances", type=int, default=4, help="instances per layout (every split is tried)")
    p.add_argument("--slo-ttft", type=float, default=None, metavar="MS")
    p.add_argument("--slo-tpot", type=float, default=None, metavar="MS")
    p.add_argument("--slo-e2e", type=float, default=None, metavar="MS")
    p.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet the SLOs")
    p.add_argument("--target-rate", type=float, default=None, metavar="RPS",
                   help="also say how many replicas of the best layout serve this rate")
    p.add_argument("--num-requests", "-n", type=int, default=300, help="at least this many requests per evaluation")
    p.add_argument("--min-duration-s", type=float, default=60.0,
                   help="and at least this many seconds of arrivals (steady state, not a short burst)")
    p.add_argument("--probe-requests", type=int, default=64)
    p.add_argument("--probe-concurrency", type=int, default=16, help="per instance")
    p.add_argument("--rel-tol", type=float, default=0.03, help="stop bisecting at this relative rate gap")
    _add_workload_args(p)
    p.add_argument("--out", required=True)
    p.add_argument("--md", default=None)
    p.add_argument("--plot", default=None, metavar="DIR")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=_placement)
