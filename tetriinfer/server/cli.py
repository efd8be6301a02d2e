"""``tetriinfer serve``: the OpenAI-compatible server over a cluster of instance processes."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
from pathlib import Path
from typing import Any

from tetriinfer.net import bind_listener, url_host
from tetriinfer.runtime.cluster_config import MODES, ClusterConfig
from tetriinfer.runtime.predictor_hook import PREDICTOR_MODES


def add_cluster_args(p: argparse.ArgumentParser) -> dict[str, Any]:
    """Every flag that shapes the cluster (shared by `serve` and the simulator's columns), in help groups;
    returns the groups by name so that `serve` adds its own flags to them."""
    model = p.add_argument_group("model")
    model.add_argument("--model", default=None, help="HF model folder, or a name: smollm2-135m-instruct (the default, converted on first use) "
                       "or tiny-llama (seeded random weights)")
    model.add_argument("--served-model-name", default=None)
    model.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    model.add_argument("--device", default="cpu")
    model.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy", "fast", "fast-shm"],
                       help="auto: the HF folder; dummy: random weights; fast: a loading-optimized copy cached on first "
                            "use (ServerlessLLM-style cold start); fast-shm: the same, mapped from one host-memory copy "
                            "that every instance on this host shares")
    model.add_argument("--max-model-len", type=int, default=None)
    model.add_argument("--seed", type=int, default=0)
    par = p.add_argument_group("parallelism and modes")
    par.add_argument("--mode", default="tetriinfer", choices=[*MODES, "single"],
                     help="tetriinfer (disaggregated), distserve, colocated (vLLM-style), sarathi, single (in-process)")
    par.add_argument("--prefill-instances", type=int, default=1)
    par.add_argument("--decode-instances", type=int, default=1)
    par.add_argument("--instances", type=int, default=2, help="instances in colocated modes")
    par.add_argument("--cores-per-instance", type=int, default=1)
    par.add_argument("--launcher", default="local", choices=["local", "ray"],
                     help="where instance processes run: this machine (local) or the nodes of a Ray cluster (ray: one "
                          "actor per instance holding --cores-per-instance CPUs, and a GPU on CUDA; control and KV "
                          "traffic go between the nodes' addresses over our own TCP/NIXL path)")
    par.add_argument("--ray-address", default="auto",
                     help="with --launcher ray: auto (the cluster `ray start` made here), local (a private "
                          "single-node Ray), or HOST:PORT of the head")
    par.add_argument("--instance-host", default="127.0.0.1",
                     help="--launcher local: the address instances bind for control and KV traffic (::1: IPv6)")
    par.add_argument("--startup-timeout", type=float, default=180.0,
                     help="seconds to place every instance and hear from it before giving up (and stopping them all)")
    par.add_argument("--cpu-layout", default="none", metavar="auto|none|FILE",
                     help="CPU hosts: placement and priority of the instance and front-end processes. none: "
                          "unchanged; auto: the layout measured best (front end pinned beside the first "
                          "(prefill) instance, SCHED_FIFO where permitted; logged at start); FILE: a TOML file of "
                          "the individual knobs (docs/side_by_side.md#cpu-layout)")
    sched = p.add_argument_group("scheduling", "chunked prefill, length-aware dispatch, decode admission, KV memory")
    sched.add_argument("--chunk-size", type=int, default=512)
    sched.add_argument("--chunk-padding", default="auto", choices=["auto", "full", "none"],
                       help="pad the last, partly filled prefill chunk to --chunk-size: full (the paper), none, or "
                       "auto (pad on accelerators, not on CPU where every padded token costs compute)")
    sched.add_argument("--prefill-merge-limit", type=int, default=None, metavar="TOKENS",
                       help="prefill instances: a prompt joins a chunk behind another only while the chunk holds fewer "
                            "than TOKENS tokens (and up to TOKENS in all); set it to the device's saturation threshold "
                            "where every token past it costs time (a CPU: ~128), so merged tokens do not delay the first "
                            "prompt's first token. Default: fill every chunk (the paper)")
    sched.add_argument("--prefill-tail-tokens", type=int, default=None, metavar="TOKENS",
                       help="prefill instances: a chunk takes every queued prompt token when they exceed --chunk-size by "
                            "at most TOKENS, instead of leaving a tail to a step of its own that runs below the device's "
                            "saturation point (a whole step's cost for a few tokens). 0: the paper's fixed chunks. "
                            "Default: chunk size / 4 under --pd-controller adaptive, else 0")
    sched.add_argument("--max-num-seqs", type=int, default=256)
    sched.add_argument("--max-num-batched-tokens", type=int, default=2048)
    sched.add_argument("--prefill-policy", default="fcfs", choices=["fcfs", "sjf", "ljf", "srtf"])
    sched.add_argument("--prefill-sched-batch", type=int, default=16)
    sched.add_argument("--dispatch-policy", default="length-aware",
                       choices=["length-aware", "random", "round-robin", "least-loaded", "imbalanced"])
    sched.add_argument("--decode-policy", default="greedy", choices=["greedy", "reserve-static", "reserve-dynamic"])
    sched.add_argument("--heavy-decode-tokens", type=int, default=128)
    sched.add_argument("--predictor", default="auto", help="auto (default: the sampled-serving predictor for the default "
                       "model, which predicts in-band at no cost; none for other models) | none | oracle | default (trained on "
                       "the default model's greedy lengths) | sampled (on its lengths sampled at temperature 0.7) | a predictor folder")
    sched.add_argument("--predictor-mode", default="auto", choices=PREDICTOR_MODES,
                       help="in-band: a served-model predictor reads its features from the serving prefill itself "
                       "(no second model runs); parallel: the predictor runs on a thread beside the prefill; "
                       "sequential: before it; auto (default): in-band where the predictor allows it, else parallel")
    sched.add_argument("--local-prefill", action=argparse.BooleanOptionalAction, default=None,
                       help="conditional disaggregation: a decode instance prefills a request itself when the prefill "
                            "tier's backlog exceeds the interference that costs (disaggregated modes)")
    sched.add_argument("--local-prefill-weight", type=float, default=0.25,
                       help="weight of the running decodes' delay against the request's own wait (0: TTFT only)")
    sched.add_argument("--keep-decode", action=argparse.BooleanOptionalAction, default=None,
                       help="the reverse of --local-prefill: a prefill instance with no prompt queued keeps a request it "
                            "just prefilled and decodes it itself (no KV transfer) while its own decodes are fewer than "
                            "--keep-decode-ratio x the least-loaded decode instance's; prefill keeps priority there")
    sched.add_argument("--keep-decode-ratio", type=float, default=0.5)
    sched.add_argument("--keep-decode-rule", default=None, choices=["ratio", "cost"],
                       help="when a prefill instance keeps a decode: ratio (--keep-decode-ratio) or cost (the decode "
                            "tier's memory is tighter than here); default: cost under --pd-controller adaptive")
    sched.add_argument("--prompt-only-prefill", action=argparse.BooleanOptionalAction, default=None,
                       help="with --keep-decode and two or more prefill instances, the first of them keeps no decodes, "
                            "so prompts routed there never wait behind a decode step (core.keep_decode); default: on "
                            "under --keep-decode-rule cost")
    sched.add_argument("--keep-offer", action=argparse.BooleanOptionalAction, default=False,
                       help="with --prompt-only-prefill, that instance offers each request it prefilled to the prefill "
                            "instances that keep decodes before the decode tier; one that would keep it by its own "
                            "keep rule takes its KV over the link (core.keep_decode.keep_offer_targets); simulated "
                            "only: the runtime's prefill worker does not take a KV handoff")
    sched.add_argument("--dispatch-when-full", default=None, choices=["wait", "least-loaded"],
                       help="a prefilled request that no decode instance has free KV for: wait (its KV stays staged at "
                            "the prefill instance, which may decode it itself under --keep-decode once it has room) or "
                            "least-loaded (queue it at the least loaded decode instance, the paper's); default: wait "
                            "under --pd-controller adaptive")
    sched.add_argument("--block-size", type=int, default=16)
    sched.add_argument("--num-kv-blocks", type=int, default=None)
    sched.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    sched.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                       help="automatic prefix caching: a prompt's full KV blocks that an earlier request already "
                            "computed (same leading tokens) are reused instead of prefilled again; freed cached blocks "
                            "are evicted least recently used first (prefill and colocated instances)")
    sched.add_argument("--prefix-routing", action=argparse.BooleanOptionalAction, default=True,
                       help="with --enable-prefix-caching: route each request to the prefill/colocated instance where "
                            "queued prompt tokens + its own uncached prompt tokens are fewest (the front end models each "
                            "instance's cache from what it routed there); --no-prefix-routing: least-loaded only")
    sched.add_argument("--cache-aware-prefill-order", action=argparse.BooleanOptionalAction, default=True,
                       help="with --enable-prefix-caching: --prefill-policy sjf/ljf/srtf rank a prompt by its tokens not "
                            "found in the prefix cache (a long, mostly cached prompt is a short job); "
                            "--no-cache-aware-prefill-order: by all its tokens")
    kv = p.add_argument_group("KV transfer", "links between prefill and decode instances; fault injection for tests "
                           "(--kv-backend faulty[:tcp|shm])")
    kv.add_argument("--kv-backend", default="tcp", help="tcp | shm | torchdist | nixl | faulty[:tcp|shm|torchdist]")
    kv.add_argument("--kv-transfer", default="request", choices=["request", "chunk"],
                    help="send KV per request after prefill (paper) or block-wise while later chunks prefill")
    kv.add_argument("--kv-handoff", default="auto", choices=["auto", "push", "pull"],
                    help="per-request KV path: push (the decode instance posts memory, the prefill instance sends "
                         "into it), pull (the decode instance reads the staged KV one-sided, never waiting for a "
                         "prefill forward to end), auto: pull on shm, push elsewhere")
    kv.add_argument("--link-bandwidth", default=None, help="emulate a link, e.g. 200Gbps, 300GB/s")
    kv.add_argument("--transfer-timeout", type=float, default=10.0)
    kv.add_argument("--fault-drop-p", type=float, default=0.0)
    kv.add_argument("--fault-delay-p", type=float, default=0.0)
    kv.add_argument("--fault-corrupt-p", type=float, default=0.0)
    elastic = p.add_argument_group("elasticity", "flips, autoscaling (core.scale_policy; the same paths as "
                                "POST/DELETE /cluster/instances), rebalancing and live migration")
    elastic.add_argument("--pd-controller", default=None, choices=["adaptive", "paper", "static"],
                         help="what moves the prefill:decode split (disaggregated modes): adaptive = flips that "
                              "follow the prefill backlog and decode memory, decodes kept at prefill instances and "
                              "prompts prefilled at decode instances by cost; paper = the paper's idle-instance flip "
                              "rule; static = the fixed split. Default: adaptive for --mode tetriinfer, else static "
                              "(docs/scheduling.md)")
    elastic.add_argument("--flip", action=argparse.BooleanOptionalAction, default=None,
                         help="flip instances between roles (default: on unless --pd-controller static; --flip "
                              "alone means the paper's rule)")
    elastic.add_argument("--flip-threshold", type=float, default=0.1)
    elastic.add_argument("--flip-window", type=float, default=2.0)
    elastic.add_argument("--flip-busy-threshold", type=float, default=0.5,
                         help="flip only while the other role's mean load is at least this")
    elastic.add_argument("--flip-idle-by", default="every", choices=["every", "mean"],
                         help="an instance is idle for the window when every load report is below --flip-threshold "
                              "(every) or their mean is (mean)")
    elastic.add_argument("--flip-decode-load", default="busy", choices=["busy", "kv", "inflation"],
                         help="what makes a decode instance count as loaded for flips: busy = max(busy fraction, KV usage) "
                              "(a decode instance holding any request is busy), kv = KV usage only, inflation = max(KV "
                              "usage, how much batching slows each step vs batch 1)")
    elastic.add_argument("--replace-dead", action=argparse.BooleanOptionalAction, default=False,
                         help="start a new instance in place of one that dies (its in-flight requests still end with an "
                              "error); /cluster lists the events under 'scaling'")
    elastic.add_argument("--autoscale", action=argparse.BooleanOptionalAction, default=False,
                         help="add instances to a role whose mean load over the window is >= --autoscale-high "
                              "(enough to bring it to the band's middle, at most --autoscale-max-step), remove the "
                              "least-loaded of a role whose mean is <= --autoscale-low (drained first)")
    elastic.add_argument("--autoscale-high", type=float, default=0.8)
    elastic.add_argument("--autoscale-low", type=float, default=0.2)
    elastic.add_argument("--autoscale-window", type=float, default=5.0, help="seconds of load behind a decision")
    elastic.add_argument("--autoscale-cooldown", type=float, default=10.0, help="seconds after a change before the next")
    elastic.add_argument("--autoscale-max-instances", type=int, default=8)
    elastic.add_argument("--autoscale-max-step", type=int, default=4, help="most instances one scale-out adds")
    elastic.add_argument("--autoscale-decode-load", default="inflation", choices=["busy", "kv", "inflation"],
                         help="how a decode instance's load is judged (see --flip-decode-load)")
    elastic.add_argument("--warm-spares", type=int, default=0,
                         help="keep this many instance processes pre-started (modules imported) so that scale-out "
                              "and --replace-dead skip the ~2 s of imports (on Ray: one actor each, placed when there is room)")
    elastic.add_argument("--rebalance", action=argparse.BooleanOptionalAction, default=False,
                         help="move queued requests that have not started from a backed-up prefill (or colocated) "
                              "instance to an idle peer, e.g. one just added (core.rebalance)")
    elastic.add_argument("--rebalance-min-queued", type=int, default=2,
                         help="queued requests an instance needs before it gives any away")
    elastic.add_argument("--rebalance-max-move", type=int, default=16, help="most requests one move hands over")
    elastic.add_argument("--migrate", action=argparse.BooleanOptionalAction, default=False,
                         help="live-migrate running decodes with their KV between decode instances (or between "
                              "colocated ones): an instance being removed or flipped hands them to its peers instead "
                              "of waiting for them to finish, and an overloaded one sheds some to the least loaded "
                              "(core.migration)")
    elastic.add_argument("--migrate-signal", default="kv", choices=["kv", "running"],
                         help="what balancing evens out: KV usage (above --migrate-high sheds to one below "
                              "--migrate-low) or running requests (a gap of --migrate-min-gap or more)")
    elastic.add_argument("--migrate-high", type=float, default=0.85)
    elastic.add_argument("--migrate-low", type=float, default=0.6)
    elastic.add_argument("--migrate-min-gap", type=int, default=4)
    elastic.add_argument("--migrate-max-per-move", type=int, default=8,
                         help="most running requests one balancing move hands over")
    obs = p.add_argument_group("observability")
    obs.add_argument("--report-interval", type=float, default=0.1)
    return {"model": model, "parallelism": par, "scheduling": sched, "kv": kv, "elasticity": elastic,
            "observability": obs}


def serve_cpu_layout(args: argparse.Namespace) -> Any:
    """The ``CpuLayout`` that ``--cpu-layout`` names for this deployment (``auto`` resolved here)."""
    from tetriinfer.runtime.cpu_layout import auto_layout, load_layout, realtime_permitted

    layout = load_layout(args.cpu_layout)
    if layout is not None:
        return layout
    disaggregated = args.mode in ("tetriinfer", "distserve")
    instances = args.prefill_instances + args.decode_instances if disaggregated else args.instances
    return auto_layout(mode=args.mode, instances=instances, cores_per_instance=args.cores_per_instance,
                       device=args.device, launcher=args.launcher, keep_decode=args.keep_decode,
                       ncpu=os.cpu_count() or 1, realtime_ok=realtime_permitted())


def resolve_pd_defaults(args: argparse.Namespace, prefill_rt_priority: int | None = None) -> dict[str, Any]:
    """``--pd-controller`` and the flags it sets by default (explicit flags win): adaptive turns flips,
    cost-based keep-decode (not with a real-time prefill priority from ``--cpu-layout``), waiting dispatch (a request
    no decode instance has room for stays staged where it was prefilled), local prefill (not with prefix caching) and
    tail merges of prefill chunks (a quarter chunk) on; ``--flip`` alone means the paper's rule."""
    controller = args.pd_controller or ("paper" if args.flip else "adaptive" if args.mode == "tetriinfer" else "static")
    adaptive = controller == "adaptive"
    return {
        "pd_controller": controller,
        "flip": args.flip if args.flip is not None else controller != "static",
        "keep_decode": args.keep_decode if args.keep_decode is not None else adaptive and prefill_rt_priority is None,
        "keep_decode_rule": args.keep_decode_rule or ("cost" if adaptive else "ratio"),
        "dispatch_when_full": args.dispatch_when_full or ("wait" if adaptive else "least-loaded"),
        # prompts whose blocks a prefill instance's prefix cache holds are cheaper there than prefilled locally
        "local_prefill": args.local_prefill if args.local_prefill is not None else adaptive and not
        args.enable_prefix_caching,
        "prefill_tail_tokens": (args.prefill_tail_tokens if args.prefill_tail_tokens is not None
                                else args.chunk_size // 4 if adaptive else 0),
    }


def cluster_config_from_args(args: argparse.Namespace, model: str, layout: Any = None) -> Any:
    """The ``ClusterConfig`` of parsed serve flags; ``layout``: an already resolved ``--cpu-layout``."""
    layout = layout if layout is not None else serve_cpu_layout(args)
    pd = resolve_pd_defaults(args, layout.prefill_rt_priority)
    return ClusterConfig(**pd,
        model=model, mode=args.mode, dtype=args.dtype, device=args.device, load_format=args.load_format,
        prefill_instances=args.prefill_instances, decode_instances=args.decode_instances,
        instances=args.instances, chunk_size=args.chunk_size, chunk_padding=args.chunk_padding,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory_gb=args.kv_cache_memory_gb,
        enable_prefix_caching=args.enable_prefix_caching, prefix_routing=args.prefix_routing,
        cache_aware_prefill_order=args.cache_aware_prefill_order, prefill_merge_limit=args.prefill_merge_limit,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, prefill_policy=args.prefill_policy,
        prefill_sched_batch=args.prefill_sched_batch, dispatch_policy=args.dispatch_policy,
        decode_policy=args.decode_policy, heavy_decode_tokens=args.heavy_decode_tokens,
        predictor=_predictor_spec(args.predictor, model),
        predictor_mode=args.predictor_mode,
        kv_backend=args.kv_backend, kv_transfer=args.kv_transfer, kv_handoff=args.kv_handoff,
        link_bandwidth=args.link_bandwidth, transfer_timeout_s=args.transfer_timeout,
        local_prefill_weight=args.local_prefill_weight, keep_decode_ratio=args.keep_decode_ratio,
        prompt_only_prefill=args.prompt_only_prefill, keep_offer=args.keep_offer,
        flip_threshold=args.flip_threshold, flip_window_s=args.flip_window,
        flip_decode_load=args.flip_decode_load, flip_busy_threshold=args.flip_busy_threshold,
        flip_idle_by=args.flip_idle_by,
        report_interval_s=args.report_interval, cores_per_instance=args.cores_per_instance,
        instance_nice=layout.instance_nice, prefill_rt_priority=layout.prefill_rt_priority, seed=args.seed,
        launcher=args.launcher, ray_address=args.ray_address, startup_timeout_s=args.startup_timeout,
        replace_dead=args.replace_dead, autoscale=args.autoscale, autoscale_high=args.autoscale_high,
        autoscale_low=args.autoscale_low, autoscale_window_s=args.autoscale_window,
        autoscale_cooldown_s=args.autoscale_cooldown, autoscale_max_instances=args.autoscale_max_instances,
        autoscale_decode_load=args.autoscale_decode_load, autoscale_max_step=args.autoscale_max_step,
        instance_host=args.instance_host, warm_spares=args.warm_spares, rebalance=args.rebalance, rebalance_min_queued=args.rebalance_min_queued,
        rebalance_max_move=args.rebalance_max_move, migrate=args.migrate, migrate_signal=args.migrate_signal,
        migrate_high=args.migrate_high, migrate_low=args.migrate_low, migrate_min_gap=args.migrate_min_gap,
        migrate_max_per_move=args.migrate_max_per_move,
        fault_drop_p=args.fault_drop_p, fault_delay_p=args.fault_delay_p, fault_corrupt_p=args.fault_corrupt_p,
    )


def _predictor_spec(spec: str, model: str) -> str:
    """``default`` / ``sampled``: a predictor trained on the default model's own lengths, greedy or sampled at
    temperature 0.7 (made on first use); ``auto``: the sampled one for the model it was shipped for, else none."""
    from tetriinfer.predictor.default import resolve_predictor

    return resolve_predictor(spec, model if Path(model).is_dir() else None)


def build_client(args: argparse.Namespace, layout: Any = None) -> Any:
    from tetriinfer.engine.make_model import resolve_model

    model = resolve_model(args.model)  # None: the real default model; "tiny-llama": the seeded test model
    if not os.path.isdir(model):
        raise FileNotFoundError(f"model folder {model!r} does not exist")
    name = args.served_model_name or os.path.basename(os.path.normpath(model))
    if args.mode == "single":
        from tetriinfer.engine.engine_config import EngineConfig
        from tetriinfer.runtime.cluster_config import pads_last_chunk
        from tetriinfer.runtime.inprocess import InProcessEngineClient

        cfg = EngineConfig(model=model, dtype=args.dtype, device=args.device, chunk_size=args.chunk_size,
                           block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                           kv_cache_memory_gb=args.kv_cache_memory_gb, max_num_seqs=args.max_num_seqs,
                           max_model_len=args.max_model_len, load_format=args.load_format,
                           enable_prefix_caching=args.enable_prefix_caching,
                           pad_last_chunk=pads_last_chunk(args.chunk_padding, args.device))
        return InProcessEngineClient(cfg, model_name=name), name
    from tetriinfer.runtime.cluster import ClusterEngineClient

    return ClusterEngineClient(cluster_config_from_args(args, model, layout), model_name=name), name


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tetriinfer.runtime.priority import apply_affinity, apply_nice, apply_realtime
    from tetriinfer.server.app import build_app

    layout = serve_cpu_layout(args)
    if not layout.is_empty or layout.source != "none":
        print(layout.describe(), file=sys.stderr, flush=True)
        for note in layout.notes:
            print(f"  {note}", file=sys.stderr, flush=True)
    frontend_cores = layout.frontend_cores
    apply_nice(layout.frontend_nice, "front end")
    rt = layout.frontend_rt_priority

    def take_realtime() -> None:  # at start, and again once the client has started its threads (ZeroMQ I/O)
        apply_realtime(rt, "front end", reset_on_fork=True)

    def after_start() -> None:  # the instances run on their own cores by now: only the front end's threads move
        if rt is not None:
            take_realtime()
        apply_affinity(frontend_cores, "front end")

    if rt is not None:
        take_realtime()
    limits = limits_from_args(args)
    listener = _listen(args.host, args.port)  # before any instance starts: nothing they open can take this port
    port = int(listener.getsockname()[1])
    client, name = build_client(args, layout)
    app = build_app(client, served_model_name=name, api_key=args.api_key, limits=limits,
                    after_start=after_start if rt is not None or frontend_cores is not None else None)
    if hasattr(client, "metrics"):
        client.metrics = app.state.metrics
    desc = args.mode
    if args.mode in ("tetriinfer", "distserve"):
        desc += f" ({args.prefill_instances} prefill + {args.decode_instances} decode instances)"
    elif args.mode != "single":
        desc += f" ({args.instances} instances)"
    print(f"TetriInfer serving {name!r} in mode {desc} at http://{url_host(args.host)}:{port}/v1", flush=True)
    config = getattr(client, "config", None)  # a ClusterConfig for cluster modes, an EngineConfig in mode single
    if isinstance(config, ClusterConfig) and config.disaggregated:
        predictor = config.role_policies().predictor
        print(f"  length predictor: {predictor}" + (f" (--predictor-mode {config.predictor_mode})"
                                                    if predictor != "none" else ""), flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5))
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the SIGINT it stopped on, once it stopped
        server.run(sockets=[listener])
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """The API's listening socket; a port that cannot be bound is a clear error (exit 2), not a traceback."""
    try:
        return bind_listener(host, port)
    except OSError as exc:
        raise ValueError(str(exc.strerror)) from exc


def add_subparsers(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="start the OpenAI-compatible server")
    groups = add_cluster_args(p)
    api = p.add_argument_group("API and security")
    api.add_argument("--host", default="127.0.0.1")
    api.add_argument("--port", type=int, default=8000,
                     help="0: a free port chosen at start (the start-up line names it)")
    api.add_argument("--api-key", default=None, help="require this bearer token on every /v1 request")
    groups["observability"].add_argument("--log-level", default="warning")
    add_limit_args(p)
    p.set_defaults(handler=_serve)


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """Request limits and overload bounds (``server.limits.ServerLimits``)."""
    from tetriinfer.server import limits as lim

    g = p.add_argument_group("request limits and overload (400 above a per-request limit, 429 beyond the bounds)")
    g.add_argument("--max-prompts-per-request", type=int, default=lim.DEFAULT_MAX_PROMPTS_PER_REQUEST)
    g.add_argument("--max-prompt-tokens-per-request", type=int, default=lim.DEFAULT_MAX_PROMPT_TOKENS_PER_REQUEST,
                   help="prompt tokens summed over one request's prompts")
    g.add_argument("--max-tokens-default", type=int, default=None, metavar="N",
                   help="cap on max_tokens when a request leaves it out (default: 16 for completions, the rest "
                        "of the context for chat, as vLLM)")
    g.add_argument("--max-tokens-limit", type=int, default=None, metavar="N",
                   help="largest max_tokens accepted (default: whatever fits in the context)")
    g.add_argument("--max-pending-requests", type=int, default=lim.DEFAULT_MAX_PENDING_REQUESTS,
                   help="engine requests admitted and unfinished at once; beyond: 429 with Retry-After")
    g.add_argument("--max-pending-tokens", type=int, default=None, metavar="N",
                   help="prompt + max_tokens tokens admitted and unfinished at once (default: "
                        f"{lim.PENDING_TOKENS_PER_KV_TOKEN}x the KV capacity in tokens); beyond: 429")


def limits_from_args(args: argparse.Namespace) -> Any:
    from tetriinfer.server.limits import ServerLimits

    return ServerLimits(
        max_prompts_per_request=args.max_prompts_per_request,
        max_prompt_tokens_per_request=args.max_prompt_tokens_per_request,
        max_tokens_default=args.max_tokens_default, max_tokens_limit=args.max_tokens_limit,
        max_pending_requests=args.max_pending_requests, max_pending_tokens=args.max_pending_tokens,
    )


if __name__ == "__main__":
    from tetriinfer.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
