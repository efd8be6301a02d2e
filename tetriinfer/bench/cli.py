"""``tetriinfer bench``: load-test an OpenAI-compatible server and compare results.

- ``tetriinfer bench --base-url URL --model NAME --workload W ...`` (same as ``bench run ...``)
- ``tetriinfer bench compare A.json B.json ... [--plot DIR] [--md FILE]``
- ``tetriinfer bench workload W -n N ...``: print what a workload looks like (no server needed)

- ``tetriinfer bench side-by-side --model DIR --workloads ... --modes ... --out FILE.json``: start our server
  in every mode on the same cores, run the same workloads, write the paper-style comparison
  (``tetriinfer.bench.side_by_side``)
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from tetriinfer.bench.workloads import CLASS_NAMES
from tetriinfer.runtime.priority import parse_cores


def _rate(text: str) -> float | None:
    value = float(text)
    if math.isinf(value) and value > 0:
        return None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"rate must be > 0 or 'inf', got {text}")
    return value


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Options that pick and shape a workload (shared with anything that asks for a workload)."""
    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload",
        "-w",
        default="mixed",
        help=f"{', '.join(CLASS_NAMES)}, trace:FILE (Azure CSV or Mooncake JSONL), alpaca[:FILE] or real:CLASS "
        "(the classes from real chat prompts; needs --tokenizer); default mixed",
    )
    g.add_argument(
        "--num-requests", "-n", type=int, default=200, help="requests to send (first N of a trace)"
    )
    g.add_argument(
        "--rate",
        type=_rate,
        default=None,
        help="mean request rate, req/s ('inf' = all at once; classes default to inf, traces to "
        "their own timestamps, rescaled to this rate when given)",
    )
    g.add_argument(
        "--rate-profile",
        default=None,
        metavar="RATE:SECONDS,...",
        help="classes: Poisson arrivals whose rate steps through these phases (e.g. 0.5:60,3:120,0.5:60, for "
        "autoscaling); replaces --rate and --num-requests",
    )
    g.add_argument(
        "--trace-timescale",
        type=float,
        default=None,
        help="multiply trace inter-arrival gaps by S (2 = half the rate); exclusive with --rate",
    )
    g.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        help="traces: multiply prompt/output lengths (and a Mooncake trace's 512-token hash blocks, so shared "
        "prefixes stay shared) by S, e.g. 0.0625 to replay a long-context trace on a small model",
    )
    g.add_argument(
        "--arrival",
        choices=("poisson", "gamma", "trace"),
        default=None,
        help="arrival process (default: trace timestamps for traces, poisson for classes)",
    )
    g.add_argument(
        "--burstiness-cv", type=float, default=1.0, help="gamma arrivals: CV of the gaps (1 = Poisson)"
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="classes: sample only prompts up to this; traces: clip to this",
    )
    g.add_argument(
        "--max-output-tokens",
        type=int,
        default=None,
        help="classes: sample only outputs up to this; traces: clip to this",
    )
    g.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="requests with prompt+output over this are counted as rejected (default: the "
        "server's max_model_len from /v1/models when it reports one)",
    )
    g.add_argument(
        "--length-source",
        default=None,
        help="trace the classes resample lengths from: azure (default), mooncake, sample, or a path",
    )
    g.add_argument("--output-lengths", choices=("fixed", "natural"), default="fixed",
                   help="fixed: each answer has exactly the workload's output length (ignore_eos); natural: answers "
                   "end at the model's EOS and the workload's length is only the max_tokens cap")
    g.add_argument("--output-cap", type=int, default=1024,
                   help="alpaca[:FILE] workload (real AlpacaEval prompts, chat-rendered): max_tokens of each request")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (default 0: greedy); above 0 each request carries a "
                   "seed derived from --seed and its index, so reruns draw the same answers, and real:CLASS "
                   "workloads class their light prompts by the model's sampled (temperature 0.7) lengths")


def client_cpu_layout(value: str) -> Any:
    """The load client's ``CpuLayout`` from ``--cpu-layout`` (``auto`` resolved for this machine, and logged)."""
    import sys

    from tetriinfer.runtime.cpu_layout import auto_client_layout, load_layout, realtime_permitted

    layout = load_layout(value)
    if layout is None:
        layout = auto_client_layout(os.cpu_count() or 1, realtime_permitted())
    if layout.source != "none":
        print(layout.describe(), *(f"  {n}" for n in layout.notes), sep="\n", file=sys.stderr, flush=True)
    return layout


def _build_workload(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from tetriinfer.bench.real_workloads import lengths_for
    from tetriinfer.bench.workloads import (
        load_workload,
        parse_rate_profile,
        stepped_workload,
        with_max_context,
    )

    if args.rate_profile:
        if args.rate is not None or args.workload.startswith("trace:"):
            raise ValueError("--rate-profile shapes a class workload's arrivals: not with --rate or a trace")
        wl = stepped_workload(args.workload, parse_rate_profile(args.rate_profile), args.seed,
                              max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_output_tokens,
                              length_source=args.length_source)
        return with_max_context(wl, args.max_context)
    arrival = args.arrival
    if args.burstiness_cv != 1.0 and arrival is None:
        arrival = "gamma"
    return load_workload(
        args.workload,
        args.num_requests,
        args.rate,
        args.seed,
        arrival=arrival,
        burstiness_cv=args.burstiness_cv,
        trace_timescale=args.trace_timescale,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        max_context=args.max_context,
        length_source=args.length_source,
        length_scale=args.length_scale,
        tokenizer=getattr(args, "tokenizer", None),
        output_cap=args.output_cap,
        real_lengths=lengths_for(getattr(args, "temperature", 0.0)),
    )


def _add_run_args(p: argparse.ArgumentParser, required: bool) -> None:
    s = p.add_argument_group("server")
    s.add_argument("--base-url", required=required, default=None, help="e.g. http://127.0.0.1:8000")
    s.add_argument("--model", required=required, default=None, help="model name the server serves")
    s.add_argument("--endpoint", default="/v1/completions")
    s.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer dir (or tokenizer.json) of the served model: prompts are exact-length "
        "token-id lists cut from real text; without it, random token ids are sent",
    )
    s.add_argument(
        "--random-token-range",
        default="100:1000",
        help="LO:HI range of random prompt token ids when no tokenizer is given",
    )
    s.add_argument(
        "--no-vllm-extras",
        action="store_true",
        help="do not send ignore_eos/min_tokens/continuous_usage_stats (for strict OpenAI servers)",
    )
    s.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    s.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    s.add_argument("--client-transport", choices=("raw", "httpx"), default="raw",
                   help="the load client's HTTP transport: raw (lean asyncio protocol on uvloop, the least CPU per "
                   "streamed token) or httpx (benchmarks/bench_client_overhead.py compares them)")
    s.add_argument("--cpu-layout", default="none", metavar="auto|none|FILE",
                   help="on a machine the client shares with the server: none (unchanged), auto (the load client "
                   "on core 0, beside `serve --cpu-layout auto`'s front end, under SCHED_FIFO where permitted; "
                   "logged), or a TOML FILE with client_rt_priority and client_cores (docs/side_by_side.md#cpu-layout)")
    s.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    s.add_argument("--slo-ttft", type=float, default=None, metavar="MS", help="TTFT SLO for goodput (ms)")
    s.add_argument("--slo-tpot", type=float, default=None, metavar="MS", help="TPOT SLO for goodput (ms)")
    s.add_argument(
        "--slo-e2e", type=float, default=None, metavar="MS", help="E2E latency SLO for goodput (ms)"
    )
    s.add_argument("--label", default=None, help="name of this run in reports")
    s.add_argument("--out", default=None, help="write results JSON (per-request records + summary) here")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--no-server-usage", action="store_true",
                   help="do not read the server's /metrics before and after (busy seconds, prefix-cache hits)")
    add_workload_args(p)


def _cmd_run(args: argparse.Namespace) -> int:
    from tetriinfer.bench.client import ClientConfig, run_benchmark, save_results
    from tetriinfer.bench.metrics import SLO
    from tetriinfer.bench.report import summary_text
    from tetriinfer.bench.workloads import workload_summary_line

    if args.base_url is None or args.model is None:
        raise ValueError("bench run needs --base-url and --model")
    try:
        lo, hi = (int(x) for x in args.random_token_range.split(":"))
    except ValueError as exc:
        raise ValueError(f"--random-token-range must be LO:HI, got {args.random_token_range!r}") from exc
    slo = SLO(args.slo_ttft, args.slo_tpot, args.slo_e2e)
    layout = client_cpu_layout(args.cpu_layout)
    workload = _build_workload(args)
    config = ClientConfig(
        base_url=args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        tokenizer=args.tokenizer,
        max_context=args.max_context,
        vllm_extras=not args.no_vllm_extras,
        request_timeout_s=args.request_timeout,
        max_concurrency=args.max_concurrency,
        random_token_range=(lo, hi),
        api_key=args.api_key,
        seed=args.seed,
        progress=not args.no_progress,
        server_usage=not args.no_server_usage,
        transport=args.client_transport,
        rt_priority=layout.client_rt_priority,
        cores=layout.client_cores_for_run(),
        output_lengths=args.output_lengths,
        temperature=args.temperature,
    )
    print(workload_summary_line(workload))
    result = run_benchmark(config, workload, slo, args.label)
    print(summary_text(result))
    lag = result["summary"]["send_lag"]["p99"]
    if lag is not None and lag > 0.05:
        print(
            f"warning: the client sent requests up to {lag * 1e3:.0f} ms (p99) behind schedule; the load "
            "generator is saturated (try fewer requests/s, or a less loaded machine)"
        )
    if args.out:
        print(f"results written to {save_results(result, args.out)}")
    return 0 if result["summary"]["completed"] > 0 else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.base_url is None:
        args._bench_parser.print_help()
        return 2
    return _cmd_run(args)


def _cmd_compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tetriinfer.bench.report import compare_table, load_results, plot_cdfs, write_markdown_report

    results = load_results(args.results)
    print(compare_table(results))
    plots: list[Path] = []
    if args.plot:
        plots = plot_cdfs(results, args.plot)
        print("plots: " + ", ".join(str(p) for p in plots))
    if args.md:
        print(f"report written to {write_markdown_report(args.md, results, args.title, plots)}")
    return 0


def _cmd_workload(args: argparse.Namespace) -> int:
    from tetriinfer.bench.workloads import workload_summary_line

    workload = _build_workload(args)
    print(workload_summary_line(workload))
    desc: dict[str, Any] = workload.describe()
    print(json.dumps(desc, indent=1))
    if args.out:
        from pathlib import Path

        Path(args.out).write_text(
            json.dumps({"workload": desc, "requests": [r.to_dict() for r in workload]}, indent=1) + "\n",
            encoding="utf-8",
        )
        print(f"requests written to {args.out}")
    return 0


def _auto_rate(text: str) -> float | None:
    if text.strip().lower() == "auto":
        return None
    value = _rate(text)
    if value is None:
        raise argparse.ArgumentTypeError("side-by-side needs a finite rate or 'auto'")
    return value


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one rate fraction")
    return values


def _cmd_side_by_side(args: argparse.Namespace) -> int:
    import shlex
    import signal
    import sys

    from tetriinfer.bench.metrics import SLO
    from tetriinfer.bench.side_by_side import (
        SideBySide,
        SideBySideConfig,
        markdown_report,
        paper_table,
        parse_columns,
        save,
        write_plots,
    )
    from tetriinfer.engine.make_model import resolve_model

    model = resolve_model(args.model)
    if not os.path.isdir(model):
        raise FileNotFoundError(f"model folder {model!r} does not exist")
    layout = client_cpu_layout(args.cpu_layout)
    client_cores = list(layout.client_cores)
    default_cores = [spec for spec in client_cores if ":" not in spec]
    if len(default_cores) > 1:
        raise ValueError(f"--cpu-layout client_cores: a LIST without a column name given twice: {default_cores}")
    columns = parse_columns(
        args.modes, args.extra_server or (), args.serve_arg or (), [spec for spec in client_cores if ":" in spec]
    )
    config = SideBySideConfig(
        model=model,
        workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
        columns=columns,
        num_requests=args.num_requests,
        rate=args.rate,
        rate_fractions=args.rate_fraction,
        probe_requests=args.probe_requests,
        probe_concurrency=args.probe_concurrency,
        instances=args.instances,
        prefill_instances=args.prefill_instances if args.prefill_instances is not None else args.instances // 2,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        max_context=args.max_context,
        arrival=args.arrival,
        burstiness_cv=args.burstiness_cv,
        length_source=args.length_source,
        length_scale=args.length_scale,
        output_lengths=args.output_lengths, output_cap=args.output_cap, temperature=args.temperature,
        seed=args.seed,
        slo=SLO(args.slo_ttft, args.slo_tpot, args.slo_e2e),
        request_timeout_s=args.request_timeout,
        startup_timeout_s=args.startup_timeout,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        progress=not args.no_progress,
        rounds=args.rounds,
        keep_servers=args.keep_servers,
        floor=not args.no_floor,
        client_transport=args.client_transport,
        client_rt_priority=layout.client_rt_priority,
        client_cores=parse_cores(default_cores[0]) if default_cores else None,
    )
    command = "tetriinfer " + " ".join(shlex.quote(a) for a in sys.argv[1:])

    def _terminate(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through serve(): the servers we started are stopped

    signal.signal(signal.SIGTERM, _terminate)
    result, raw = SideBySide(config, command).run()
    print(paper_table(result))
    print(f"results written to {save(result, args.out)}")
    from pathlib import Path

    plots = write_plots(result, raw, args.plot) if args.plot else []
    if args.md:
        md = Path(args.md)
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(markdown_report(result, plots, md.parent.resolve()), encoding="utf-8")
        print(f"report written to {md}")
    if args.raw:
        Path(args.raw).write_text(json.dumps(raw) + "\n", encoding="utf-8")
    failed = any(cell["completed"] == 0 for cells in result["workloads"].values() for cell in cells.values())
    return 1 if failed else 0


def _add_side_by_side(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "side-by-side",
        help="start our server in each mode on the same cores and compare them on the same workloads",
        description="For each mode: start 'tetriinfer serve' with the same number of instances (one core "
        "each), run every workload, read resource usage from /cluster, stop it. Writes the paper-style "
        "table (TTFT, JCT, resource, perf/$ vs colocated). See tetriinfer/bench/side_by_side.py.",
    )
    p.add_argument("--model", default=None, help="HF model folder or name (default: smollm2-135m-instruct; tiny-llama: seeded random)")
    p.add_argument("--workloads", default=",".join(CLASS_NAMES),
                   help="comma-separated: lpld,lphd,hpld,hphd,mixed, trace:FILE, alpaca[:FILE] and/or real:CLASS "
                   "(the classes from real chat prompts, for --output-lengths natural)")
    p.add_argument("--modes", default="tetriinfer,colocated,sarathi,distserve",
                   help="comma-separated modes; NAME=MODE adds a named variant (e.g. tetri-sjf=tetriinfer); "
                   "'colocated' is required (the baseline)")
    p.add_argument("--extra-server", action="append", metavar="NAME=URL",
                   help="an already running OpenAI-compatible server as one more column (repeatable)")
    p.add_argument("--serve-arg", action="append", metavar="[NAME:]ARGS",
                   help="extra 'tetriinfer serve' arguments for every column, or NAME:ARGS for one column "
                   "(e.g. --serve-arg='tetriinfer:--prefill-policy sjf'); repeatable")
    p.add_argument("--num-requests", "-n", type=int, default=50)
    p.add_argument("--rate", type=_auto_rate, default=None,
                   help="req/s for every workload and mode, or 'auto' (default): a closed-loop probe on "
                   "colocated measures the sustainable rate and every mode runs at --rate-fraction of it")
    p.add_argument("--rate-fraction", type=_fractions, default=(0.7,), metavar="F[,F...]",
                   help="with --rate auto: run at this fraction of the probed rate (default 0.7); several "
                   "(e.g. 0.7,1.0,1.3) = a load sweep, cells keyed WORKLOAD@PCT%%")
    p.add_argument("--probe-requests", type=int, default=16)
    p.add_argument("--probe-concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every column this many times (the same requests each round; column order rotated so "
                        "no mode always runs last on a drifting machine); cells pool every round's requests")
    p.add_argument("--keep-servers", action="store_true",
                   help="start every column's server once and keep all of them up through every round (idle but "
                        "for the column being measured): no restart per round, so many short rounds (e.g. -n 48 "
                        "--rounds 12) alternate the columns every few seconds and a drifting machine averages out")
    p.add_argument("--no-floor", "--no-ttft-floor", dest="no_floor", action="store_true",
                   help="skip the floor (each workload's requests once more on colocated, one at a time: the TTFT "
                        "and JCT each gets alone, i.e. how much of a column's TTFT and JCT is waiting)")
    p.add_argument("--instances", type=int, default=2, help="instances (= cores) per mode")
    p.add_argument("--prefill-instances", type=int, default=None,
                   help="prefill instances in disaggregated modes (default: half)")
    p.add_argument("--max-prompt-tokens", type=int, default=1536)
    p.add_argument("--output-lengths", choices=("fixed", "natural"), default="fixed",
                   help="natural: answers end at EOS (no ignore_eos); the workload's output length is only a cap")
    p.add_argument("--output-cap", type=int, default=1024, help="alpaca[:FILE] workload: max_tokens of each request")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default 0: greedy); above 0 every column gets the same seed per "
                   "request (from --seed and its index) and real:CLASS workloads class their light prompts by the "
                   "model's sampled (temperature 0.7) lengths")
    p.add_argument("--max-output-tokens", type=int, default=384)
    p.add_argument("--max-context", type=int, default=None,
                   help="reject prompt+output over this (default: the server's max_model_len)")
    p.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    p.add_argument("--burstiness-cv", type=float, default=1.0)
    p.add_argument("--length-source", default=None)
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="trace:FILE workloads: multiply lengths (and a Mooncake trace's 512-token hash blocks) by S")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=None, metavar="MS")
    p.add_argument("--slo-tpot", type=float, default=None, metavar="MS")
    p.add_argument("--slo-e2e", type=float, default=None, metavar="MS")
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--client-transport", choices=("raw", "httpx"), default="raw",
                   help="the load client's HTTP transport: raw (lean asyncio protocol on uvloop, the least CPU per "
                   "streamed token) or httpx (benchmarks/bench_client_overhead.py compares them)")
    p.add_argument("--cpu-layout", default="none", metavar="auto|none|FILE",
                   help="where the load client runs: none (unchanged), auto (core 0 under SCHED_FIFO where "
                   "permitted, for every column), or a TOML FILE with client_rt_priority and client_cores: a list "
                   "of [NAME:]LIST (NAME: that column only, NAME:all leaves it unpinned; a bare LIST for the other "
                   "columns). Each column's server takes its own through --serve-arg 'NAME:--cpu-layout FILE'")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--kv-cache-memory-gb", type=float, default=0.25, help="per instance")
    p.add_argument("--out", required=True, help="results JSON")
    p.add_argument("--md", default=None, help="markdown report")
    p.add_argument("--plot", default=None, metavar="DIR", help="summary bar chart and per-workload CDF PNGs")
    p.add_argument("--raw", default=None, metavar="FILE", help="also write every per-request record here")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=_cmd_side_by_side)


def add_subparsers(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``bench`` and its sub-subcommands ``run``, ``compare``, ``workload``, ``side-by-side``."""
    bench = subparsers.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible server (vllm bench serve metrics)",
        description="Open-loop load test of an OpenAI-compatible /v1/completions server. Without a "
        "sub-command, the options below run one benchmark (same as 'bench run').",
    )
    _add_run_args(bench, required=False)
    bench.set_defaults(handler=_cmd_bench, _bench_parser=bench)
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")

    run = sub.add_parser("run", help="run one workload against a server")
    _add_run_args(run, required=True)
    run.set_defaults(handler=_cmd_run)

    cmp = sub.add_parser("compare", help="ratio table (first file = baseline), CDF plots, markdown report")
    cmp.add_argument("results", nargs="+", help="results JSON files from bench runs")
    cmp.add_argument("--plot", default=None, metavar="DIR", help="write TTFT/JCT CDF and in-flight PNGs here")
    cmp.add_argument("--md", default=None, metavar="FILE", help="write a markdown report here")
    cmp.add_argument("--title", default="Benchmark report")
    cmp.set_defaults(handler=_cmd_compare)

    wl = sub.add_parser("workload", help="generate a workload and print its statistics (no server)")
    add_workload_args(wl)
    wl.add_argument("--out", default=None, help="write the request list as JSON here")
    wl.set_defaults(handler=_cmd_workload)

    _add_side_by_side(sub)
