"""How fast the simulator runs: simulated requests per wall second, memory peak, and the scaling curve.

Every point runs in its own Python process on one core (so its memory peak is its own), as
``tetriinfer sim side-by-side`` runs one column: Llama-3-8B on simulated A100-80GB (roofline cost model), the
KV pool from the device memory, the columns' ``serve`` defaults. Sections:

- ``micro``: per-step time of the runtime's own core schedulers (decode, prefill, vLLM-style and Sarathi
  colocated) in a steady state, this tree vs ``--baseline-ref`` (a git ref of this repository, extracted to a
  temporary folder) in the same run: what the real server gains per step.
- ``trace``: the shared Azure conversation trace (all rows by default), 16 instances (8P+8D for tetriinfer, 16
  colocated), the rate as ``sim side-by-side --rate auto`` picks it (70% of the probed colocated capacity):
  wall seconds and req/s per column, vs the baseline ref on the same points when given.
- ``scale``: ``scale:N`` workloads (lengths and gaps drawn from the same trace) at the trace's per-instance
  rate times the instance count: wall time vs requests (``--requests``) at ``--instances-max`` instances, and vs
  instances (``--instances``) at ``--requests-fixed`` requests; per-request cost and memory peak (and the
  baseline's per-request cost on the same points, each measured right after this tree's, when given).

Prints tables (and ratios against the baseline measured in the same run), writes JSON and a PNG plot:

    python benchmarks/sim_speed.py --baseline-ref main --out docs/sim/speed
    python benchmarks/sim_speed.py --tree build/native --baseline-tree .   # compiled copy vs interpreted
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "data" / "AzureLLMInferenceTrace_conv.csv"
MODEL, HARDWARE = "llama-3-8b", "a100-80g"


# ------------------------------------------------------------------------------------------ child side
def _sim_parts(mode: str, instances: int, prefill: int, n: int, workload: str) -> tuple[Any, Any, Any]:
    from tetriinfer.bench.side_by_side import parse_columns
    from tetriinfer.sim.cost_model import (
        HARDWARE_PRESETS,
        RooflineCostModel,
        kv_bytes_per_token,
        model_config,
    )
    from tetriinfer.sim.side_by_side import SimSideBySide, SimSideBySideConfig

    mcfg = model_config(MODEL)
    cost = RooflineCostModel(mcfg, HARDWARE_PRESETS[HARDWARE], dtype_bytes=2, step_overhead_s=0.003)
    cols = parse_columns(f"{mode},colocated" if mode != "colocated" else "colocated", [], [])
    cfg = SimSideBySideConfig((workload,), cols, num_kv_blocks=cost.kv_capacity_tokens(0.9) // 16,
                              kv_bytes_per_token=kv_bytes_per_token(mcfg, 2), max_model_len=mcfg.max_position_embeddings,
                              model=MODEL, num_requests=n, instances=instances, prefill_instances=prefill,
                              floor=False, progress=False, length_source=str(TRACE))
    return SimSideBySide(cfg, cost, ""), cfg, cost


def run_point(point: dict[str, Any]) -> dict[str, Any]:
    """One measurement, in this process: a simulated column, or the scheduler micro-benchmark."""
    if point["kind"] == "micro":
        return micro(point.get("steps", 2000))
    from tetriinfer.bench.metrics import summarize

    sbs, cfg, _ = _sim_parts(point["mode"], point["instances"], point["prefill"], point["n"], point["workload"])
    t0 = time.perf_counter()
    rate = point.get("rate")
    if rate is None:  # as sim side-by-side --rate auto: 70% of the probed colocated capacity
        rate = sbs.probe(point["workload"]) * 0.7
    t_probe = time.perf_counter() - t0
    wl = sbs.workload(point["workload"], point["n"], rate, cfg.seed)
    t_wl = time.perf_counter() - t0 - t_probe
    t1, c1 = time.perf_counter(), time.process_time()
    res = sbs.simulate(sbs.clusters[point["mode"]], wl)
    t_sim, cpu_sim = time.perf_counter() - t1, time.process_time() - c1
    s = summarize(res.records)
    t_sum = time.perf_counter() - t1 - t_sim
    return {**point, "rate": rate, "probe_s": t_probe, "workload_s": t_wl, "sim_s": t_sim, "summary_s": t_sum,
            "cpu_s": cpu_sim, "wall_s": time.perf_counter() - t0, "completed": s["completed"], "events": res.events,
            "req_per_s": point["n"] / t_sim, "req_per_cpu_s": point["n"] / cpu_sim,
            "ttft_mean": s["ttft"]["mean"], "jct_mean": s["jct"]["mean"],
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def micro(steps: int) -> dict[str, Any]:
    """Per-step seconds of each core scheduler in a steady state (requests that never finish in the window)."""
    from tetriinfer.core.colocated_scheduler import ColocatedSchedulerConfig, make_colocated_scheduler
    from tetriinfer.core.decode_scheduler import DecodeScheduler, DecodeSchedulerConfig
    from tetriinfer.core.kv_cache_manager import KVCacheManager
    from tetriinfer.core.prefill_scheduler import PrefillScheduler, PrefillSchedulerConfig
    from tetriinfer.core.request import Request
    from tetriinfer.core.sampling_params import SamplingParams
    from tetriinfer.core.step import StepResult

    def req(i: int, prompt: int, out: int) -> Request:
        return Request(f"r{i}", [3] * prompt, SamplingParams(max_tokens=out, ignore_eos=True))

    def loop(sched: Any, n: int, refill: Any = None) -> float:
        """CPU seconds per schedule + update (the refill between steps is not counted)."""
        spent = 0.0
        for _ in range(n):
            t = time.process_time()
            out = sched.schedule()
            sched.update(out, StepResult(out.step_id, {s.request_id: 1 for s in out.segments if s.sample}))
            spent += time.process_time() - t
            if refill is not None:
                refill()
        return spent / n

    res: dict[str, Any] = {"kind": "micro"}
    for batch in (16, 128):
        kv = KVCacheManager(200_000, 16)
        dec = DecodeScheduler(DecodeSchedulerConfig(max_num_seqs=256, max_model_len=1 << 20), kv)
        for i in range(batch):
            r = req(i, 1000, 1 << 19)
            r.output_token_ids.append(1)
            r.num_computed_tokens = r.num_tokens - 1
            assert dec.reserve(r)
            dec.on_kv_received(r.request_id)
        loop(dec, 50)
        res[f"decode_b{batch}_us"] = loop(dec, steps) * 1e6
    for policy in ("vllm", "sarathi"):
        kv = KVCacheManager(200_000, 16)
        col = make_colocated_scheduler(policy, ColocatedSchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64,
                                                                        max_model_len=1 << 20), kv)
        for i in range(64):
            col.add_request(req(i, 200, 1 << 19))
        loop(col, 200)
        res[f"colocated_{policy}_b64_us"] = loop(col, steps) * 1e6
    kv = KVCacheManager(200_000, 16)
    pre = PrefillScheduler(PrefillSchedulerConfig(policy="sjf", chunk_size=512, max_model_len=1 << 20), kv)
    counter = iter(range(10**9))

    def refill() -> None:  # keep 64 prompts queued; prefilled ones leave (as a prefill instance releases them)
        while pre.num_queued < 64:
            pre.add_request(req(next(counter), 300 + next(counter) % 700, 8))
        for rid in [r for r, q in pre.requests.items() if not q.in_prefill]:
            pre.release(rid)

    refill()
    res["prefill_sjf_q64_us"] = loop(pre, steps // 4, refill) * 1e6
    return res


# ------------------------------------------------------------------------------------------ parent side
def measure(point: dict[str, Any], tree: Path, timeout: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--point", json.dumps(point)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tree)
    except subprocess.TimeoutExpired:
        return {**point, "error": f"over {timeout:.0f} s"}
    if proc.returncode:
        return {**point, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def baseline_tree(ref: str, into: Path) -> Path:
    """``tetriinfer/`` of ``ref`` (a git ref of this repository) extracted under ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "tetriinfer"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[list[str]], head: list[str]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(head))) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--point", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sections", default="micro,trace,scale")
    ap.add_argument("--baseline-ref", default=None, help="git ref to compare against in the same run (e.g. main)")
    ap.add_argument("--baseline-tree", default=None, help="or a folder holding the baseline's tetriinfer/")
    ap.add_argument("--tree", default=None,
                    help="a folder holding the tetriinfer/ to measure as 'this tree' (default: this checkout), e.g. "
                         "a compiled copy from scripts/build_native_sim.py (then --baseline-tree . compares it "
                         "with the interpreted sources)")
    ap.add_argument("--trace-requests", type=int, default=19366)
    ap.add_argument("--baseline-trace-requests", type=int, default=None,
                    help="requests for the baseline's trace columns (default: --trace-requests)")
    ap.add_argument("--modes", default="tetriinfer,colocated")
    ap.add_argument("--requests", default="10000,100000,1000000", help="scaling curve: requests at --instances-max")
    ap.add_argument("--instances", default="16,128,1000", help="scaling curve: instances at --requests-fixed")
    ap.add_argument("--instances-max", type=int, default=1000)
    ap.add_argument("--requests-fixed", type=int, default=20000)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per point")
    ap.add_argument("--micro-steps", type=int, default=2000)
    ap.add_argument("--parallel", type=int, default=1,
                    help="points measured at once (each in its own process; times are its own CPU seconds)")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.png")
    args = ap.parse_args()
    if args.point:
        print(json.dumps(run_point(json.loads(args.point))))
        return
    if not TRACE.is_file():
        sys.exit(f"needs the Azure conversation trace at {TRACE}")
    sections = set(args.sections.split(","))
    modes = args.modes.split(",")
    trace_rate = 19366 / 3600.0  # the trace's own rate on 16 instances
    jobs: list[tuple[str, dict[str, Any], bool]] = []  # (section, point, on the baseline tree)
    with_base = args.baseline_ref is not None or args.baseline_tree is not None
    if "micro" in sections:
        jobs.append(("micro", {"kind": "micro", "steps": args.micro_steps}, False))
        if with_base:
            jobs.append(("micro", {"kind": "micro", "steps": args.micro_steps}, True))
    if "trace" in sections:
        for mode in modes:
            pt = {"kind": "column", "workload": f"trace:{TRACE}", "mode": mode, "instances": 16, "prefill": 8,
                  "n": args.trace_requests}
            jobs.append(("trace", pt, False))
            if with_base:
                jobs.append(("trace", {**pt, "n": args.baseline_trace_requests or args.trace_requests}, True))
    if "scale" in sections:
        for mode in modes:
            for n in [int(x) for x in args.requests.split(",") if x]:
                k = args.instances_max
                pt = {"kind": "column", "workload": f"scale:{n}", "mode": mode, "instances": k, "prefill": k // 2,
                      "n": n, "rate": trace_rate * k / 16}
                jobs += [("requests", pt, False)] + ([("requests", pt, True)] if with_base else [])
            for k in [int(x) for x in args.instances.split(",") if x]:
                n = args.requests_fixed
                pt = {"kind": "column", "workload": f"scale:{n}", "mode": mode, "instances": k, "prefill": k // 2,
                      "n": n, "rate": trace_rate * k / 16}
                jobs += [("instances", pt, False)] + ([("instances", pt, True)] if with_base else [])
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as tmp:
        base = (Path(args.baseline_tree) if args.baseline_tree else baseline_tree(args.baseline_ref, Path(tmp))
                if with_base else None)
        keys = [(json.dumps(pt, sort_keys=True), on_base) for _, pt, on_base in jobs]
        unique = list(dict.fromkeys(keys))  # a point in two series is measured once
        done: dict[tuple[str, bool], dict[str, Any]] = {}
        with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as ex:
            tree = Path(args.tree).resolve() if args.tree else ROOT
            futures = {ex.submit(measure, json.loads(k), base if b and base is not None else tree, args.timeout):
                       (k, b) for k, b in unique}
            for fut in tqdm(as_completed(futures), total=len(futures), desc="points", unit="point"):
                done[futures[fut]] = fut.result()
        results = [(section, done[key], on_base) for (section, _, on_base), key in zip(jobs, keys, strict=True)]
    print(f"\nsimulator speed, {started}, one process per point, {os.cpu_count()} CPUs (shared)\n")
    micro_rows = [(r, b) for s, r, b in results if s == "micro"]
    if micro_rows:
        now = next((r for r, b in micro_rows if not b), {})
        old = next((r for r, b in micro_rows if b), {})
        rows = []
        for key in [k for k in now if k.endswith("_us")]:
            ratio = old.get(key) / now[key] if old.get(key) and now.get(key) else None
            rows.append([key[:-3], fmt(old.get(key)), fmt(now.get(key)), fmt(ratio, ".2f") + "x" if ratio else "-"])
        print("per-step scheduler time (us), runtime core schedulers\n")
        print(table(rows, ["scheduler, steady state", "baseline", "this tree", "speed-up"]) + "\n")
    trace_rows = [(r, b) for s, r, b in results if s == "trace"]
    if trace_rows:
        rows = []
        for mode in modes:
            now = next((r for r, b in trace_rows if r.get("mode") == mode and not b), {})
            old = next((r for r, b in trace_rows if r.get("mode") == mode and b), {})
            old_r, now_r = old.get("req_per_cpu_s"), now.get("req_per_cpu_s")
            ratio = now_r / old_r if old_r and now_r else None
            rows.append([mode, str(old.get("n", "-")), fmt(old.get("cpu_s")), fmt(old_r, ".0f"), str(now.get("n", "-")),
                         fmt(now.get("cpu_s")), fmt(now_r, ".0f"), fmt(ratio, ".2f") + "x" if ratio else "-",
                         fmt(now.get("sim_s")), fmt(now.get("peak_rss_mb"), ".0f"), now.get("error", "")])
        print("Azure conversation trace, 16 instances (8P+8D / 16 colocated), rate auto (CPU seconds of the run)\n")
        print(table(rows, ["column", "baseline requests", "baseline CPU s", "baseline req/CPU-s", "requests", "CPU s",
                           "req/CPU-s", "speed-up", "wall s", "peak MB", "note"]) + "\n")
    for section, label in (("requests", "requests"), ("instances", "instances")):
        pts = [r for s, r, b in results if s == section and not b]
        if not pts:
            continue
        olds = {(r["mode"], r["n"], r["instances"]): r for s, r, b in results if s == section and b}

        def us(r: dict[str, Any]) -> float | None:
            return r["cpu_s"] / r["n"] * 1e6 if r.get("cpu_s") else None

        rows = []
        for r in pts:
            old = olds.get((r["mode"], r["n"], r["instances"]), {})
            ratio = us(old) / us(r) if us(old) and us(r) else None  # type: ignore[operator]
            rows.append([r["mode"], str(r["n"]), str(r["instances"]), fmt(r.get("rate"), ".0f"), fmt(r.get("cpu_s")),
                         fmt(r.get("req_per_cpu_s"), ".0f"), fmt(us(r), ".0f")]
                        + ([fmt(us(old), ".0f"), fmt(ratio, ".2f") + "x" if ratio else "-"] if olds else [])
                        + [fmt(r.get("sim_s")), fmt(r.get("peak_rss_mb"), ".0f"), r.get("error", "") or old.get("error", "")])
        print(f"scaling vs {label} (scale:N workload at the trace's per-instance rate)\n")
        print(table(rows, ["column", "requests", "instances", "req/s offered", "CPU s", "req/CPU-s", "CPU us/request"]
                    + (["baseline CPU us/request", "speed-up"] if olds else [])
                    + ["wall s", "peak MB", "note"]) + "\n")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(
            {"started": started, "results": [{"section": s, "baseline": b, **r} for s, r, b in results]}, indent=1))
        plot(results, out.with_suffix(".png"))
        print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def plot(results: list[tuple[str, dict[str, Any], bool]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, section, xkey in ((axes[0], "requests", "n"), (axes[1], "instances", "instances")):
        for mode in sorted({r["mode"] for s, r, _ in results if s == section}):
            pts = sorted((r[xkey], r["cpu_s"]) for s, r, b in results if s == section and r["mode"] == mode
                         and r.get("cpu_s") and not b)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("simulated requests" if section == "requests" else "simulated instances")
        ax.set_ylabel("CPU seconds (one process)")
        ax.set_title(f"simulator wall time vs {section}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
