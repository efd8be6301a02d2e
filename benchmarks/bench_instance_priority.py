"""Who waits for a CPU while serving: instance processes vs the front end, at four priority settings.

Each instance process is pinned to its own core and stands in for an accelerator, but the front end (HTTP, SSE,
detokenization) and the load client are not pinned, and Linux runs them wherever a core looks least busy. This
script serves one workload per (mode, priority) server -- the side-by-side layouts: 1 prefill + 1 decode instance
vs 2 colocated, one core each; priority (``--cpu-layout FILE`` knobs): the default, ``instance_nice = N`` (instances
only) and ``frontend_nice = N`` (the front end, and the instances that inherit it) and, TetriInfer only,
``prefill_rt_priority = P`` (the prefill instance under SCHED_FIFO, nothing else changed) -- and reads ``/proc/PID/schedstat`` of every instance process and of the front end
before and after: *run* = seconds on a CPU, *wait* = seconds runnable but not running (every thread of the
process summed). A prefill instance's wait is added to its prompts' TTFT one for one. Mean TTFT and JCT of the
run come from the same requests. Servers alternate over ``--rounds`` so a drifting machine favours none.

    python benchmarks/bench_instance_priority.py --workload mixed --rate 5 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from tqdm.auto import tqdm

from tetriinfer.bench import side_by_side as sbs
from tetriinfer.bench.client import ClientConfig, run_benchmark
from tetriinfer.bench.metrics import SLO
from tetriinfer.bench.workloads import load_workload
from tetriinfer.engine.make_model import tiny_model_path

TETRI_ARGS = ["--chunk-size", "2048", "--prefill-merge-limit", "128", "--prefill-policy", "srtf", "--kv-backend",
              "shm", "--local-prefill"]


def schedstat(pid: int) -> tuple[float, float]:
    """(run s, wait s) summed over every thread of ``pid`` (``/proc/PID/task/TID/schedstat``, nanoseconds)."""
    run = wait = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
        except OSError:
            continue
        run, wait = run + int(fields[0]), wait + int(fields[1])
    return run / 1e9, wait / 1e9


def frontend_pid(url: str) -> int:
    """The ``tetriinfer serve`` process behind ``url`` (``/cluster`` names it; the instances list their own)."""
    return int(httpx.get(f"{url}/cluster", timeout=10).json()["frontend_pid"])


# who gets a higher priority: nobody, the instances (nice), front end + instances (nice), the prefill instance
# (SCHED_FIFO; a colocated instance never holds the prefill role)
PRIORITIES = {"tetriinfer": ("default", "instances", "all", "prefill-rt"), "colocated": ("default", "instances", "all")}


def priority_args(priority: str, nice: int, rt_priority: int) -> list[str]:
    """``--cpu-layout FILE`` for one priority setting (the file is written to a temporary folder)."""
    knob = {"default": None, "instances": f"instance_nice = {nice}", "all": f"frontend_nice = {nice}",
            "prefill-rt": f"prefill_rt_priority = {rt_priority}"}[priority]
    if knob is None:
        return []
    path = Path(tempfile.mkdtemp(prefix="cpu-layout-")) / f"{priority}.toml"
    path.write_text(knob + "\n")
    return ["--cpu-layout", str(path)]


def one_server(model: str, mode: str, prio: list[str], workload_name: str, n: int, rate: float, seed: int) -> dict:
    args = [*sbs.layout_args(mode, 2, 1), "--kv-cache-memory-gb", "0.25", "--dtype", "bfloat16",
            *(TETRI_ARGS if mode == "tetriinfer" else []), *prio]
    wl = load_workload(workload_name, n, rate, seed, max_prompt_tokens=1024, max_output_tokens=192)
    with sbs.serve(model, mode, args, 600) as url:
        procs = {i["id"]: i["pid"] for i in sbs.cluster_busy(url)["instances"]}
        procs["front end"] = frontend_pid(url)
        before = {name: schedstat(pid) for name, pid in procs.items()}
        tokenizer = model if (Path(model) / "tokenizer.json").is_file() else None  # real text, as side-by-side
        cfg = ClientConfig(base_url=url, model=sbs.served_model_id(url), tokenizer=tokenizer, seed=seed,
                           progress=False)
        res = run_benchmark(cfg, wl, SLO(), f"{mode} {' '.join(prio) or 'default'}")
        time.sleep(0.3)
        after = {name: schedstat(pid) for name, pid in procs.items()}
    reqs = [r for r in res["requests"] if r["success"]]
    return {
        "ttft": statistics.mean(r["first_token_s"] - r["arrival_s"] for r in reqs),
        "jct": statistics.mean(r["finish_s"] - r["arrival_s"] for r in reqs),
        "failed": len(res["requests"]) - len(reqs),
        "procs": {name: (after[name][0] - before[name][0], after[name][1] - before[name][1]) for name in procs},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model folder (default: the tiny llama)")
    ap.add_argument("--workload", default="lphd")
    ap.add_argument("-n", "--num-requests", type=int, default=96)
    ap.add_argument("--rate", type=float, default=2.8, help="req/s (Poisson)")
    ap.add_argument("--nice", type=int, default=-10, help="the nice value of the 'instances' and 'all' rows")
    ap.add_argument("--rt-priority", type=int, default=10, help="the SCHED_FIFO priority of the 'prefill-rt' row")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("a negative nice value and SCHED_FIFO need root (or CAP_SYS_NICE)")
    model = a.model or str(tiny_model_path())
    cells = [(mode, prio) for mode, prios in PRIORITIES.items() for prio in prios]
    results: dict[tuple[str, str], list[dict]] = {}
    with tqdm(total=a.rounds * len(cells), desc="servers") as bar:
        for rnd in range(a.rounds):
            for mode, prio in cells[rnd % len(cells):] + cells[:rnd % len(cells)]:
                results.setdefault((mode, prio), []).append(
                    one_server(model, mode, priority_args(prio, a.nice, a.rt_priority), a.workload, a.num_requests, a.rate, a.seed))
                bar.update(1)
    lines = [f"{a.workload}, {a.num_requests} requests at {a.rate} req/s (Poisson), bf16, {a.rounds} rounds per row "
             "(means over rounds); run / wait = CPU seconds on a core / runnable but waiting, per process", "",
             f"| mode | raised priority (nice {a.nice}; prefill-rt: SCHED_FIFO {a.rt_priority}) | TTFT mean ms | JCT mean ms | process: run s / wait s |",
             "|---|---|---:|---:|---|"]
    for mode, prio in cells:
        rs = results[(mode, prio)]
        procs = sorted(rs[0]["procs"])
        proc_cells = ", ".join(
            f"{p}: {statistics.mean(r['procs'][p][0] for r in rs):.2f} / {statistics.mean(r['procs'][p][1] for r in rs):.2f}"
            for p in procs)
        lines.append(f"| {mode} | {prio} | {statistics.mean(r['ttft'] for r in rs) * 1e3:.1f} | "
                     f"{statistics.mean(r['jct'] for r in rs) * 1e3:.1f} | {proc_cells} |")
    table = "\n".join(lines)
    print("\n" + table)
    if a.out:
        Path(a.out).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
