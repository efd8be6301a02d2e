"""``tetriinfer sim side-by-side``: the bench's side-by-side comparison on simulated clusters.

Same inputs as ``tetriinfer bench side-by-side`` (``--modes``, ``--serve-arg``, workloads, rates, caps), the
same JSON shape and report tables (``bench.side_by_side``), but each column is a ``SimCluster`` driven by a cost
model instead of a server: it runs in seconds, at any scale, on hardware you do not have. Columns are built
from their ``serve`` arguments with the serve CLI's own parser (``server.cli``), so a column means the same
policies in both tools.

Definitions as in ``bench.side_by_side``: ``--rate auto`` probes the simulated colocated column closed-loop
(``probe_requests`` requests, ``probe_concurrency`` in flight, rate = ``(N - C) / t_(N-C)``); the floor is each
workload's requests alone on one simulated colocated instance; resource = the instances' summed step seconds.
A simulation is deterministic: the same inputs give the same numbers, so there are no rounds.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from tetriinfer.bench.metrics import SLO, summarize
from tetriinfer.bench.side_by_side import (
    BASELINE,
    Column,
    build_cell,
    closed_loop_rate,
    finalize,
    floor_table,
    layout_args,
    paper_table,
    perf_per_dollar,
    plot_section,
    workload_table,
)
from tetriinfer.bench.workloads import Workload, check_length_scale, load_workload, workload_summary_line
from tetriinfer.runtime.cluster_config import ClusterConfig
from tetriinfer.sim.cluster import SimCluster, SimConfig, SimResult
from tetriinfer.sim.cost_model import CostModel
from tetriinfer.sim.jobs import run_jobs
from tetriinfer.sim.shift import SHIFT_PREFIX, phased_workload

VLLM1 = "vllm1"  # the baseline column of one colocated instance at the same rate (the paper's framing)


def provisioned_perf_per_dollar(jct: float | None, jct_base: float | None, instance_s: float | None,
                                instance_s_base: float | None) -> float | None:
    """perf/$ on what is paid for: the same speed term as ``bench.side_by_side.perf_per_dollar`` over the ratio
    of instance-seconds provisioned (instances x run duration) instead of busy seconds. On equal hardware at
    the same rate the cost ratio is about 1, so this is the speed ratio: an idle prefill instance is paid for
    too (busy seconds count it as free)."""
    return perf_per_dollar(jct, jct_base, instance_s, instance_s_base)


@dataclass(frozen=True)
class SimSideBySideConfig:
    workloads: tuple[str, ...]
    columns: tuple[Column, ...]
    num_kv_blocks: int  # per instance
    kv_bytes_per_token: int
    max_model_len: int
    model: str = "sim"
    num_requests: int = 200
    rate: float | None = None  # None: auto (probe)
    rate_fractions: tuple[float, ...] = (0.7,)
    probe_requests: int = 64
    probe_concurrency: int = 16
    instances: int = 2
    prefill_instances: int | None = None
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    arrival: str = "poisson"
    burstiness_cv: float = 1.0
    length_source: str | None = None
    length_scale: float = 1.0  # trace workloads: lengths (and Mooncake hash blocks) times this
    seed: int = 0
    link_bandwidth: str | float = "200Gbps"
    link_latency: str | float = 0.0
    predictor_accuracy: float = 1.0
    frontend_delay_s: float = 0.0
    scale_out_s: float = 5.0
    floor: bool = True
    slo: SLO = field(default_factory=SLO)
    progress: bool = True
    trace_repeat: int = 1  # trace workloads: the trace played this many times back to back
    jobs: int = 1  # columns simulated in this many processes at once (the same result as one)
    baseline: str = BASELINE  # perf/$ and changes vs this column; VLLM1: one colocated instance (paper's framing)

    def __post_init__(self) -> None:
        if not self.workloads:
            raise ValueError("give at least one workload")
        check_length_scale(self.length_scale)
        labels = [c.label for c in self.columns]
        if BASELINE not in labels:
            raise ValueError(f"the columns need the baseline {BASELINE!r} (got {labels})")
        if any(c.external for c in self.columns):
            raise ValueError("external servers cannot be simulated; drop --extra-server")
        if self.num_requests < 1 or self.probe_requests < 2:
            raise ValueError("num_requests must be >= 1 and probe_requests >= 2")
        if not 1 <= self.probe_concurrency < self.probe_requests:
            raise ValueError("probe_concurrency must be in [1, probe_requests)")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if not self.rate_fractions or any(not f > 0 for f in self.rate_fractions):
            raise ValueError("rate_fractions must be positive")
        if self.instances < 2:
            raise ValueError("instances must be >= 2 (disaggregation needs one of each role)")
        if self.trace_repeat < 1 or self.jobs < 1:
            raise ValueError(f"trace_repeat and jobs must be >= 1, got {self.trace_repeat}, {self.jobs}")
        if self.baseline != VLLM1 and self.baseline not in labels:
            raise ValueError(f"baseline {self.baseline!r} is neither a column ({', '.join(labels)}) nor {VLLM1!r}")

    @property
    def num_prefill(self) -> int:
        return self.prefill_instances if self.prefill_instances is not None else max(1, self.instances // 2)

    def cell_key(self, workload: str, fraction: float) -> str:
        return workload if len(self.rate_fractions) == 1 or self.rate is not None else f"{workload}@{fraction:.0%}"


def cluster_from_serve_args(name: str, mode: str, argv: Sequence[str], model: str) -> ClusterConfig:
    """``tetriinfer serve --mode MODE ARGV`` parsed by the serve CLI's own parser: a simulated cluster means the
    same policies as the real one."""
    from tetriinfer.server.cli import add_cluster_args, cluster_config_from_args

    parser = argparse.ArgumentParser(prog=name, add_help=False)
    add_cluster_args(parser)
    return cluster_config_from_args(parser.parse_args(["--mode", mode, *argv]), model)


def cluster_config_for(column: Column, cfg: SimSideBySideConfig) -> ClusterConfig:
    """The column's ``tetriinfer serve`` arguments (layout first, then the column's own) parsed by the serve CLI."""
    assert column.mode is not None
    return cluster_from_serve_args(f"column {column.label}", column.mode,
                                   [*layout_args(column.mode, cfg.instances, cfg.num_prefill), *column.serve_args],
                                   cfg.model)


class SimSideBySide:
    def __init__(self, config: SimSideBySideConfig, cost: CostModel, command: str = "") -> None:
        self.config = config
        self.cost = cost
        self.command = command
        self.clusters = {c.label: cluster_config_for(c, config) for c in config.columns}
        if config.baseline == VLLM1:
            self.clusters[VLLM1] = replace(self.clusters[BASELINE], instances=1)

    def sim_config(self, cluster: ClusterConfig, **over: Any) -> SimConfig:
        c = self.config
        return SimConfig(cluster, num_kv_blocks=c.num_kv_blocks, kv_bytes_per_token=c.kv_bytes_per_token,
                         max_model_len=c.max_model_len, link_bandwidth=c.link_bandwidth, link_latency=c.link_latency,
                         predictor_accuracy=c.predictor_accuracy, frontend_delay_s=c.frontend_delay_s,
                         scale_out_s=c.scale_out_s, **over)

    def workload(self, name: str, n: int, rate: float | None, seed: int, burst: bool = False) -> Workload:
        c = self.config
        is_trace = name.lower().startswith(("trace:", "scale:"))
        if name.lower().startswith(SHIFT_PREFIX):
            return phased_workload(name, n, None if burst else rate, seed, arrival=c.arrival,
                                   burstiness_cv=c.burstiness_cv, max_prompt_tokens=c.max_prompt_tokens,
                                   max_output_tokens=c.max_output_tokens, max_context=c.max_model_len,
                                   length_source=c.length_source)
        return load_workload(
            name, n, None if burst else rate, seed,
            arrival="trace" if is_trace and not burst else c.arrival, burstiness_cv=c.burstiness_cv,
            max_prompt_tokens=c.max_prompt_tokens, max_output_tokens=c.max_output_tokens,
            max_context=c.max_model_len, length_source=c.length_source,
            length_scale=c.length_scale if is_trace else 1.0,
            trace_repeat=c.trace_repeat if name.lower().startswith("trace:") else 1,
        )

    def simulate(self, cluster: ClusterConfig, wl: Workload, **over: Any) -> SimResult:
        return SimCluster(self.sim_config(cluster, **over), self.cost).run(wl)

    def probe(self, name: str) -> float:
        c = self.config
        wl = self.workload(name, c.probe_requests, None, c.seed + 1000, burst=True)
        res = self.simulate(self.clusters[BASELINE], wl, max_concurrency=c.probe_concurrency)
        finishes = [r.last_token_s for r in res.records if r.success and r.last_token_s is not None]
        sent = len(wl) - wl.num_rejected
        return closed_loop_rate(finishes, sent, min(c.probe_concurrency, sent - 1))

    def floor(self, name: str, rate: float) -> dict[str, Any]:
        """Each request alone on one colocated instance: TTFT, TPOT and JCT with nothing else running."""
        c = self.config
        wl = self.workload(name, c.num_requests, rate, c.seed)
        single = replace(self.clusters[BASELINE], instances=1)
        res = self.simulate(single, wl, max_concurrency=1)
        s = summarize(res.records)
        return {"mean_s": s["ttft"]["mean"], "median_s": s["ttft"]["median"], "requests": s["completed"],
                "tpot_mean_s": s["tpot"]["mean"], "jct_mean_s": s["e2e"]["mean"]}

    def column(self, name: str, rate: float, label: str) -> tuple[dict[str, Any], ...]:
        """One column on one workload at ``rate``: (workload description, paper-table cell, details, raw
        per-request records) as plain values (what a ``--jobs`` worker sends back)."""
        c = self.config
        wl = self.workload(name, c.num_requests, rate, c.seed)
        res = self.simulate(self.clusters[label], wl)
        s = summarize(res.records, slo=c.slo)
        good = s["good_requests"] if s["good_requests"] is not None else s["completed"]
        n_inst = len(res.busy_s)
        detail = {
            "busy_per_instance_s": res.busy_s, "steps_per_instance": res.steps,
            "duration_s": s["duration_s"], "goodput_rps": s["goodput"],
            "goodput_per_instance_s": good / (n_inst * s["duration_s"]) if s["duration_s"] > 0 else None,
            "local_prefills": res.local_prefills, "kept_decodes": res.kept_decodes,
            "flips": res.flips, "transfer_bytes": res.transfer_bytes, "events": res.events,
            "output_len_mismatch": s["output_len_mismatch"], "rejected": s["rejected"],
            "instance_s": res.instance_s, "scaling": res.scaling, "migrated": res.migrated,
            "live_migration": res.migration,
            "prefix_hit_tokens": res.prefix_hit_tokens,
            "prefix_queried_tokens": res.prefix_queried_tokens,
            "split": [list(x) for x in res.split], "preemptions": res.preemptions,
        }
        raw_col = {"requests": [r.to_dict() for r in res.records], "summary": s, "workload": wl.describe()}
        wl_meta = {"name": wl.name, "summary_line": workload_summary_line(wl), "describe": wl.describe()}
        return wl_meta, build_cell(s, res.resource_s), detail, raw_col

    def run(self) -> tuple[dict[str, Any], dict[str, dict[str, dict[str, Any]]]]:
        c = self.config
        t0 = time.monotonic()
        started = datetime.now(UTC).isoformat(timespec="seconds")
        cells: dict[str, dict[str, dict[str, Any]]] = {}
        details: dict[str, dict[str, dict[str, Any]]] = {}
        raw: dict[str, dict[str, dict[str, Any]]] = {}
        rates: dict[str, dict[str, Any]] = {}
        wmeta: dict[str, dict[str, Any]] = {}
        floors: dict[str, dict[str, Any]] = {}
        probed: dict[str, float | None] = {}
        total = len(c.workloads) * len(c.rate_fractions) * len(self.clusters)
        bar = tqdm(total=total, desc="simulate", disable=not c.progress)
        tasks: list[tuple[str, float, float, str]] = []  # (workload, rate fraction, rate, column)
        for name in c.workloads:
            probed[name] = self.probe(name) if c.rate is None else None
            if c.floor:
                floors[name] = self.floor(name, c.rate or (probed[name] or 1.0) * c.rate_fractions[0])
            for fraction in c.rate_fractions:
                rate = c.rate if c.rate is not None else (probed[name] or 1.0) * fraction
                tasks += [(name, fraction, rate, label) for label in self.clusters]
        results = run_jobs(_column_task, [(self, name, rate, label) for name, _, rate, label in tasks], c.jobs)
        for (name, fraction, rate, label), (wl_meta, cell, detail, raw_col) in zip(tasks, results, strict=True):
            key = c.cell_key(wl_meta["name"], fraction)
            rates[key] = {"probed_rps": probed[name], "rate_rps": rate, "requests": c.num_requests,
                          "rate_fraction": fraction if c.rate is None else None}
            wmeta[key] = {"summary_line": wl_meta["summary_line"], "describe": wl_meta["describe"], "key": name,
                          "rate_fraction": fraction if c.rate is None else None}
            cells.setdefault(key, {})[label] = cell
            details.setdefault(key, {})[label] = detail
            raw.setdefault(key, {})[label] = raw_col
            bar.update(1)
        bar.close()
        meta = {
            "simulated": True, "command": self.command, "started_at": started, "wall_s": time.monotonic() - t0,
            "cost_model": getattr(self.cost, "describe", lambda: type(self.cost).__name__)(),
            "model": c.model, "instances": c.instances, "prefill_instances": c.num_prefill,
            "num_kv_blocks": c.num_kv_blocks, "kv_bytes_per_token": c.kv_bytes_per_token,
            "max_model_len": c.max_model_len, "link_bandwidth": str(c.link_bandwidth),
            "link_latency": str(c.link_latency), "predictor_accuracy": c.predictor_accuracy,
            "frontend_delay_s": c.frontend_delay_s, "scale_out_s": c.scale_out_s, "caps": {"max_prompt_tokens": c.max_prompt_tokens, "max_output_tokens": c.max_output_tokens},
            "columns": [{"label": col.label, "mode": col.mode, "serve_args": list(col.serve_args)}
                        for col in c.columns],
            "rate_mode": "auto" if c.rate is None else "fixed", "rate_fractions": list(c.rate_fractions),
            "probe_requests": c.probe_requests, "probe_concurrency": c.probe_concurrency, "arrival": c.arrival,
            "burstiness_cv": c.burstiness_cv, "rates": rates, "workloads": wmeta, "details": details,
            "floor": floors, "slo": {"ttft_ms": c.slo.ttft_ms, "tpot_ms": c.slo.tpot_ms, "e2e_ms": c.slo.e2e_ms},
        }
        meta["baseline"] = c.baseline
        workloads = finalize(cells, c.baseline)
        for key, per in details.items():
            base_cell, base_d = workloads[key].get(c.baseline), per.get(c.baseline)
            for label, d in per.items():
                d["perf_per_dollar_provisioned"] = None if base_cell is None or base_d is None else \
                    provisioned_perf_per_dollar(workloads[key][label]["jct_mean"], base_cell["jct_mean"],
                                                d["instance_s"], base_d["instance_s"])
        return {"workloads": workloads, "meta": meta}, raw


def _column_task(sbs: SimSideBySide, name: str, rate: float, label: str) -> tuple[dict[str, Any], ...]:
    return sbs.column(name, rate, label)


def markdown_report(result: dict[str, Any], plots: Sequence[Path] = (), relative_to: Path | None = None) -> str:
    """Setup, rates, the paper-style table, the floor, per-workload tables (the bench report's tables)."""
    meta = result.get("meta", {})
    lines = ["# Simulated side-by-side: TetriInfer vs its baselines", ""]
    lines.append(f"- Command: `{meta.get('command', '?')}`")
    lines.append(f"- Simulated {meta.get('started_at', '?')} in {meta.get('wall_s', 0):.1f} s wall time "
                 "(deterministic: the same inputs give the same numbers).")
    lines.append(f"- Cost model: {meta.get('cost_model', '?')}.")
    lines.append(f"- Model: `{meta.get('model', '?')}`; context {meta.get('max_model_len')} tokens; KV pool "
                 f"{meta.get('num_kv_blocks')} blocks per instance; {meta.get('kv_bytes_per_token')} KV bytes per "
                 f"token; link {meta.get('link_bandwidth')}, latency {meta.get('link_latency')}; caps "
                 f"{meta.get('caps', {})}.")
    inst, pre = meta.get("instances") or 0, meta.get("prefill_instances") or 0
    lines.append(f"- Layout: {inst} instances; disaggregated modes use {pre} prefill + {inst - pre} decode.")
    for col in meta.get("columns", []):
        lines.append(f"  - **{col['label']}**: `tetriinfer serve --mode {col['mode']} {' '.join(col['serve_args'])}`")
    lines += ["", "## Request rates", ""]
    if meta.get("rate_mode") == "auto":
        lines.append(
            f"`--rate auto`: closed-loop probe on the simulated colocated column ({meta.get('probe_requests')} "
            f"requests, {meta.get('probe_concurrency')} in flight), then {meta.get('arrival')} arrivals at "
            + " / ".join(f"{f * 100:.0f}%" for f in meta.get("rate_fractions", [])) + " of it.")
    else:
        lines.append("Fixed rate given on the command line.")
    lines += ["", "| workload | probed sustainable req/s | run req/s | requests |", "|---|---:|---:|---:|"]
    for wl, r in meta.get("rates", {}).items():
        probed = r.get("probed_rps")
        lines.append(f"| {wl} | {'-' if probed is None else f'{probed:.3f}'} | {r['rate_rps']:.3f} | "
                     f"{r['requests']} |")
    baseline = meta.get("baseline", BASELINE)
    lines += ["", f"## Paper-style summary (change vs {baseline})", "", paper_table(result), "",
              "TTFT and JCT are means; resource = summed step seconds of all instances; perf/$ = speed / "
              "(resource ratio), r = JCT / baseline JCT, speed = 2 - r (the paper's 1 + JCT reduction) when "
              "r <= 1, 1 / r when r > 1. perf/$ (provisioned) below divides by instance-seconds paid for "
              "instead of busy seconds: on equal hardware that is the speed ratio."]
    table = floor_table(result)
    if table:
        lines += ["", "## Floor: each request alone on one instance", "", table]
    for wl in result["workloads"]:
        lines += ["", f"## {wl}", "", meta.get("workloads", {}).get(wl, {}).get("summary_line", ""), "",
                  workload_table(result, wl)]
        extra = meta.get("details", {}).get(wl, {})
        notes = [f"{label}: {d['local_prefills']} local prefills, {d['kept_decodes']} kept decodes, "
                 f"{len(d['flips'])} flips" for label, d in extra.items()
                 if d.get("local_prefills") or d.get("kept_decodes") or d.get("flips")]
        for label, d in extra.items():
            if d.get("scaling"):
                acts = [e["action"] for e in d["scaling"]]
                notes.append(f"{label}: autoscaled ({acts.count('autoscale-add')} added, "
                             f"{acts.count('autoscale-remove')} removed), {d['instance_s']:.1f} instance-seconds "
                             f"provisioned")
            if d.get("migrated"):
                notes.append(f"{label}: {d['migrated']} queued requests moved to idle peers (--rebalance)")
            if d.get("prefix_queried_tokens"):
                notes.append(f"{label}: prefix cache found {d['prefix_hit_tokens']} of "
                             f"{d['prefix_queried_tokens']} prompt tokens "
                             f"({d['prefix_hit_tokens'] / d['prefix_queried_tokens']:.0%})")
            live = d.get("live_migration") or {}
            if live.get("moved") or live.get("returned"):
                notes.append(f"{label}: {live['moved']} running decodes live-migrated ({live['returned']} refused; "
                             f"--migrate)")
        for label, d in extra.items():
            if d.get("perf_per_dollar_provisioned") is not None and label != baseline:
                notes.append(f"{label}: perf/$ (provisioned) {d['perf_per_dollar_provisioned']:.2f}x")
            if len(d.get("split") or []) > 1:
                notes.append(f"{label}: prefill:decode split " + " -> ".join(
                    f"{p}:{q} at {t:.0f} s" for t, p, q in d["split"]))
        if notes:
            lines += ["", "; ".join(notes) + "."]
    lines += plot_section(plots, relative_to)
    return "\n".join(lines) + "\n"
