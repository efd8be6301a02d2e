"""``tetriinfer sim placement``: DistServe's placement search on simulated clusters.

Question it answers: *I have N instances (GPUs, or cores here) and a workload with TTFT/TPOT SLOs; which mode,
and how many prefill vs decode instances, serve the most requests per second per instance within the SLOs?*

Definitions (DistServe's): a layout's **goodput** is the highest request rate at which at least ``attainment``
(default 90%) of the workload's requests meet every given SLO (failed and rejected requests are misses);
**per-instance goodput** = goodput / instances, the number placement maximizes (the best layout is then
replicated to reach a target rate). Unlike DistServe, which models each phase separately, every layout is
simulated whole (front end, prefill and decode instances, KV transfers over the links) with the real core
schedulers, so routing, dispatch, admission and transfer effects are in the number.

Search per layout (``max_rate_meeting``): start at the layout's closed-loop throughput (a probe with
``probe_concurrency`` in flight), double or halve until the target is bracketed, then bisect to ``rel_tol``.
Each evaluation simulates the workload from the same seed (same lengths, the same arrival sequence scaled to
the rate) with at least ``num_requests`` requests and ``min_duration_s`` seconds of arrivals: a short burst
at a rate the layout cannot sustain would otherwise pass (queues never reach steady state in a few seconds).
Attainment counts the requests that fit the model's context (rejected ones are the same for every layout). Attainment is not strictly monotone in the rate (queues form differently); the search returns the
highest *evaluated* rate that met the target below the lowest evaluated rate that did not, and every evaluated
point is kept in the result.

Invariants: pure given its inputs (deterministic); a layout whose SLOs fail even at ``min_rate_fraction`` of
its throughput gets goodput 0, never an extrapolation.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from tetriinfer.bench.metrics import SLO, summarize
from tetriinfer.bench.side_by_side import COLOCATED_MODES, DISAGGREGATED_MODES, SERVER_MODES, closed_loop_rate
from tetriinfer.bench.workloads import Workload, check_length_scale, load_workload
from tetriinfer.runtime.cluster_config import ClusterConfig
from tetriinfer.sim.cluster import SimCluster, SimConfig
from tetriinfer.sim.cost_model import CostModel
from tetriinfer.sim.jobs import run_jobs


@dataclass(frozen=True)
class RatePoint:
    rate_rps: float
    attainment: float
    ttft_p90_s: float | None = None
    tpot_p90_s: float | None = None
    num_requests: int = 0


@dataclass(frozen=True)
class RateSearch:
    """Result of ``max_rate_meeting``: ``rate_rps`` is 0 when no evaluated rate met the target."""

    rate_rps: float
    points: tuple[RatePoint, ...]


def max_rate_meeting(
    evaluate: Callable[[float], RatePoint], target: float, start_rps: float, *, rel_tol: float = 0.03,
    max_doublings: int = 6, max_halvings: int = 6,
) -> RateSearch:
    """The highest rate whose ``evaluate(rate).attainment >= target`` (see the module docstring).

    Invariant: the returned rate is 0 or an evaluated rate that met the target, and (unless ``max_doublings``
    ran out) some evaluated rate at most ``(1 + rel_tol)`` times higher, or exactly the next bisection bound,
    did not."""
    if not 0 < target <= 1:
        raise ValueError(f"target attainment must be in (0, 1], got {target}")
    if not start_rps > 0:
        raise ValueError(f"start_rps must be > 0, got {start_rps}")
    if not 0 < rel_tol < 1:
        raise ValueError(f"rel_tol must be in (0, 1), got {rel_tol}")
    points: dict[float, RatePoint] = {}

    def meets(rate: float) -> bool:
        if rate not in points:
            points[rate] = evaluate(rate)
        return points[rate].attainment >= target

    lo: float | None = None  # highest rate known to meet the target
    hi: float | None = None  # lowest rate known to miss it
    rate = start_rps
    if meets(rate):
        lo = rate
        for _ in range(max_doublings):
            rate *= 2
            if not meets(rate):
                hi = rate
                break
            lo = rate
    else:
        hi = rate
        for _ in range(max_halvings):
            rate /= 2
            if meets(rate):
                lo = rate
                break
            hi = rate
    if lo is None:
        return RateSearch(0.0, tuple(sorted(points.values(), key=lambda p: p.rate_rps)))
    while hi is not None and (hi - lo) / hi > rel_tol:
        mid = (lo + hi) / 2
        if meets(mid):
            lo = mid
        else:
            hi = mid
    return RateSearch(lo, tuple(sorted(points.values(), key=lambda p: p.rate_rps)))


@dataclass(frozen=True)
class Layout:
    """One candidate: ``mode`` on ``prefill + decode`` instances (colocated modes: ``decode == 0``)."""

    mode: str
    prefill: int
    decode: int = 0
    serve_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in SERVER_MODES:
            raise ValueError(f"unknown mode {self.mode!r}; one of {', '.join(SERVER_MODES)}")
        if self.mode in DISAGGREGATED_MODES and (self.prefill < 1 or self.decode < 1):
            raise ValueError(f"{self.mode} needs >= 1 prefill and >= 1 decode instance")
        if self.mode in COLOCATED_MODES and (self.prefill < 1 or self.decode != 0):
            raise ValueError(f"{self.mode} takes instances as prefill=N, decode=0")

    @property
    def instances(self) -> int:
        return self.prefill + self.decode

    @property
    def label(self) -> str:
        if self.mode in COLOCATED_MODES:
            return f"{self.mode} x{self.prefill}"
        return f"{self.mode} {self.prefill}P+{self.decode}D"

    def layout_args(self) -> list[str]:
        if self.mode in COLOCATED_MODES:
            return ["--instances", str(self.prefill), "--cores-per-instance", "1"]
        return ["--prefill-instances", str(self.prefill), "--decode-instances", str(self.decode),
                "--cores-per-instance", "1"]

    def serve_command(self) -> str:
        return " ".join(["tetriinfer serve --mode", self.mode, *self.layout_args(), *self.serve_args])


def candidate_layouts(modes: Sequence[str], instances: int, serve_args: dict[str, tuple[str, ...]] | None = None,
                      ) -> list[Layout]:
    """Every way to run ``instances`` instances in each mode: colocated modes once, disaggregated modes at
    every prefill:decode split (1:N-1 ... N-1:1)."""
    if instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}")
    serve_args = serve_args or {}
    out: list[Layout] = []
    for mode in modes:
        extra = serve_args.get(mode, ())
        if mode in COLOCATED_MODES:
            out.append(Layout(mode, instances, 0, extra))
        elif mode in DISAGGREGATED_MODES:
            if instances < 2:
                raise ValueError(f"{mode} needs at least 2 instances")
            out.extend(Layout(mode, p, instances - p, extra) for p in range(1, instances))
        else:
            raise ValueError(f"unknown mode {mode!r}; one of {', '.join(SERVER_MODES)}")
    return out


def layout_cluster_config(layout: Layout, model: str) -> ClusterConfig:
    """The layout's ``tetriinfer serve`` arguments parsed by the serve CLI's own parser."""
    from tetriinfer.sim.side_by_side import cluster_from_serve_args

    return cluster_from_serve_args(f"layout {layout.label}", layout.mode, [*layout.layout_args(), *layout.serve_args],
                                   model)


@dataclass(frozen=True)
class PlacementConfig:
    workloads: tuple[str, ...]
    layouts: tuple[Layout, ...]
    slo: SLO
    num_kv_blocks: int
    kv_bytes_per_token: int
    max_model_len: int
    model: str = "sim"
    attainment: float = 0.9
    num_requests: int = 300
    min_duration_s: float = 60.0
    probe_requests: int = 64
    probe_concurrency: int = 16
    rel_tol: float = 0.03
    arrival: str = "poisson"
    burstiness_cv: float = 1.0
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    length_source: str | None = None
    length_scale: float = 1.0  # trace workloads: lengths (and Mooncake hash blocks) times this
    seed: int = 0
    link_bandwidth: str | float = "200Gbps"
    link_latency: str | float = 0.0
    predictor_accuracy: float = 1.0
    frontend_delay_s: float = 0.0
    target_rate: float | None = None
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    trace_repeat: int = 1  # trace workloads: the trace played this many times back to back
    jobs: int = 1  # layouts searched in this many processes at once (the same result as one)

    def __post_init__(self) -> None:
        if not self.workloads:
            raise ValueError("give at least one workload")
        check_length_scale(self.length_scale)
        if not self.layouts:
            raise ValueError("give at least one layout")
        if self.slo.ttft_ms is None and self.slo.e2e_ms is None:
            raise ValueError("placement needs a TTFT or E2E SLO (--slo-ttft / --slo-e2e, with --slo-tpot as you "
                             "like): a TPOT SLO alone is met at any rate while the prefill queue grows without bound")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if self.min_duration_s < 0:
            raise ValueError(f"min_duration_s must be >= 0, got {self.min_duration_s}")
        if not 1 <= self.probe_concurrency < self.probe_requests:
            raise ValueError("probe_concurrency must be in [1, probe_requests)")
        if self.target_rate is not None and not self.target_rate > 0:
            raise ValueError(f"target_rate must be > 0, got {self.target_rate}")
        if self.trace_repeat < 1 or self.jobs < 1:
            raise ValueError(f"trace_repeat and jobs must be >= 1, got {self.trace_repeat}, {self.jobs}")


def _attainment(summary: dict[str, Any]) -> float:
    sent = summary["num_requests"] - summary["rejected"]
    return (summary["good_requests"] or 0) / sent if sent else 0.0


class PlacementSearch:
    def __init__(self, config: PlacementConfig, cost: CostModel, command: str = "") -> None:
        self.config = config
        self.cost = cost
        self.command = command
        self.clusters = {lay.label: layout_cluster_config(lay, config.model) for lay in config.layouts}
        self.num_simulations = 0

    def _workload(self, name: str, n: int, rate: float | None, seed: int) -> Workload:
        c = self.config
        is_trace = name.lower().startswith(("trace:", "scale:"))
        return load_workload(name, n, rate, seed, arrival="trace" if is_trace and rate is None else c.arrival,
                             burstiness_cv=c.burstiness_cv, max_prompt_tokens=c.max_prompt_tokens,
                             max_output_tokens=c.max_output_tokens, max_context=c.max_model_len,
                             length_source=c.length_source, length_scale=c.length_scale if is_trace else 1.0,
                             trace_repeat=c.trace_repeat if name.lower().startswith("trace:") else 1)

    def _simulate(self, cluster: ClusterConfig, wl: Workload, max_concurrency: int | None = None) -> list[Any]:
        c = self.config
        sim = SimConfig(cluster, num_kv_blocks=c.num_kv_blocks, kv_bytes_per_token=c.kv_bytes_per_token,
                        max_model_len=c.max_model_len, link_bandwidth=c.link_bandwidth, link_latency=c.link_latency,
                        predictor_accuracy=c.predictor_accuracy, frontend_delay_s=c.frontend_delay_s,
                        max_concurrency=max_concurrency)
        self.num_simulations += 1
        return SimCluster(sim, self.cost).run(wl).records

    def throughput(self, layout: Layout, workload: str) -> float:
        """The layout's closed-loop sustainable rate (the search's starting point)."""
        c = self.config
        # ``probe_concurrency`` in flight per instance keeps every instance of a larger layout as busy as one,
        # and at least 4x that many requests keep the (N - C) window long enough to measure.
        conc = c.probe_concurrency * layout.instances
        wl = self._workload(workload, max(c.probe_requests, 4 * conc), None, c.seed + 1000)
        sent = len(wl) - wl.num_rejected
        conc = max(1, min(conc, sent - 1))
        records = self._simulate(self.clusters[layout.label], wl, max_concurrency=conc)
        finishes = [r.last_token_s for r in records if r.success and r.last_token_s is not None]
        return closed_loop_rate(finishes, sent, conc)

    def requests_at(self, rate: float) -> int:
        """Requests per evaluation: at least ``num_requests`` and ``min_duration_s`` of arrivals."""
        c = self.config
        return max(c.num_requests, math.ceil(rate * c.min_duration_s))

    def simulate_records(self, layout: Layout, workload: str, rate: float) -> list[Any]:
        """Per-request records of the layout at ``rate`` (``requests_at(rate)`` requests of the seeded workload)."""
        c = self.config
        return self._simulate(self.clusters[layout.label], self._workload(workload, self.requests_at(rate), rate,
                                                                          c.seed))

    def attainment(self, records: list[Any], slo: SLO | None = None) -> float:
        """Share of the requests that fit the model (rejected ones are the same for every layout) meeting ``slo``
        (default: the configured one)."""
        return _attainment(summarize(records, slo=slo or self.config.slo))

    def evaluate(self, layout: Layout, workload: str, rate: float) -> RatePoint:
        records = self.simulate_records(layout, workload, rate)
        s = summarize(records, slo=self.config.slo)
        return RatePoint(rate, _attainment(s), s["ttft"]["p90"], s["tpot"]["p90"], len(records))

    def search(self, layout: Layout, workload: str) -> dict[str, Any]:
        start = self.throughput(layout, workload)
        found = max_rate_meeting(lambda r: self.evaluate(layout, workload, r), self.config.attainment, start,
                                 rel_tol=self.config.rel_tol)
        return {
            "label": layout.label, "mode": layout.mode, "prefill": layout.prefill, "decode": layout.decode,
            "instances": layout.instances, "serve_command": layout.serve_command(), "throughput_rps": start,
            "goodput_rps": found.rate_rps, "goodput_per_instance_rps": found.rate_rps / layout.instances,
            "points": [vars(p) for p in found.points],
        }

    def run(self) -> dict[str, Any]:
        c = self.config
        t0 = time.monotonic()
        out: dict[str, Any] = {}
        bar = tqdm(total=len(c.workloads) * len(c.layouts), desc="placement", disable=not c.progress)
        tasks = [(name, layout) for name in c.workloads for layout in c.layouts]
        found: dict[tuple[str, str], dict[str, Any]] = {}
        simulations = self.num_simulations  # counted here: a worker's count stays in its copy of the search
        for (name, layout), (row, sims) in zip(tasks, run_jobs(_search_task, [(self, n, lay) for n, lay in tasks],
                                                               c.jobs), strict=True):
            found[(name, layout.label)] = row
            simulations += sims
            bar.set_postfix(workload=name, layout=layout.label, goodput=f"{row['goodput_rps']:.2f}")
            bar.update(1)
        self.num_simulations = simulations
        for name in c.workloads:
            rows = [found[(name, layout.label)] for layout in c.layouts]
            rows.sort(key=lambda r: (-r["goodput_per_instance_rps"], r["instances"], r["label"]))
            best = rows[0]
            entry: dict[str, Any] = {"layouts": rows, "best": best["label"]}
            if c.target_rate is not None and best["goodput_per_instance_rps"] > 0:
                units = -(-c.target_rate // best["goodput_rps"])  # ceil: replicas of the best layout
                entry["for_target_rate"] = {"target_rps": c.target_rate, "replicas": int(units),
                                            "instances": int(units) * best["instances"]}
            out[name] = entry
        bar.close()
        meta = {
            "simulated": True, "command": self.command, "model": c.model,
            "cost_model": getattr(self.cost, "describe", lambda: type(self.cost).__name__)(),
            "slo": {"ttft_ms": c.slo.ttft_ms, "tpot_ms": c.slo.tpot_ms, "e2e_ms": c.slo.e2e_ms},
            "attainment": c.attainment, "num_requests": c.num_requests, "min_duration_s": c.min_duration_s,
            "arrival": c.arrival,
            "burstiness_cv": c.burstiness_cv, "rel_tol": c.rel_tol, "num_kv_blocks": c.num_kv_blocks,
            "link_bandwidth": str(c.link_bandwidth), "predictor_accuracy": c.predictor_accuracy,
            "frontend_delay_s": c.frontend_delay_s, "simulations": self.num_simulations,
            "wall_s": time.monotonic() - t0, **c.extra,
        }
        return {"workloads": out, "meta": meta}


def _search_task(search: PlacementSearch, workload: str, layout: Layout) -> tuple[dict[str, Any], int]:
    """One layout's search (in a worker process under ``--jobs``): its row and how many simulations it ran."""
    before = search.num_simulations
    row = search.search(layout, workload)
    return row, search.num_simulations - before


def markdown_report(result: dict[str, Any], plots: Sequence[str] = ()) -> str:
    meta = result["meta"]
    slo = meta["slo"]
    slo_text = ", ".join(f"{k.split('_')[0].upper()} <= {v:g} ms" for k, v in slo.items() if v is not None)
    lines = ["# Placement search (simulated): goodput per instance", "",
             f"- Command: `{meta.get('command', '')}`",
             f"- Cost model: {meta['cost_model']}; model `{meta['model']}`.",
             f"- SLOs: {slo_text}; goodput = highest rate with >= {meta['attainment']:.0%} of requests meeting "
             f"them, among requests that fit the model's context (each evaluation: {meta['arrival']} arrivals, at least "
             f"{meta['num_requests']} requests and {meta['min_duration_s']:g} s of them; "
             f"{meta['simulations']} simulations in all).", ""]
    for wl, entry in result["workloads"].items():
        lines += [f"## {wl}", "",
                  "| layout | instances | throughput req/s | goodput req/s | goodput / instance | vs best |",
                  "|---|---:|---:|---:|---:|---:|"]
        best = entry["layouts"][0]["goodput_per_instance_rps"]
        for r in entry["layouts"]:
            rel = f"{r['goodput_per_instance_rps'] / best:.2f}x" if best > 0 else "-"
            name = f"**{r['label']}**" if r["label"] == entry["best"] else r["label"]
            lines.append(f"| {name} | {r['instances']} | {r['throughput_rps']:.2f} | {r['goodput_rps']:.2f} | "
                         f"{r['goodput_per_instance_rps']:.3f} | {rel} |")
        top = entry["layouts"][0]
        lines += ["", f"Best: `{top['serve_command']}`."]
        if "for_target_rate" in entry:
            t = entry["for_target_rate"]
            lines.append(f"For {t['target_rps']:g} req/s: {t['replicas']} x this layout = {t['instances']} instances.")
        lines.append("")
    for p in plots:
        lines += [f"![attainment vs rate]({p})", ""]
    return "\n".join(lines)


def write_plots(result: dict[str, Any], directory: str) -> list[str]:
    """One PNG per workload: SLO attainment against request rate for every layout."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    target = result["meta"]["attainment"]
    for wl, entry in result["workloads"].items():
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for r in entry["layouts"]:
            pts = sorted((p["rate_rps"] / r["instances"], p["attainment"]) for p in r["points"])
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ms=3, label=r["label"])
        ax.axhline(target, color="grey", ls="--", lw=1)
        ax.set_xlabel("request rate per instance (req/s)")
        ax.set_ylabel("SLO attainment")
        ax.set_title(f"{wl}: SLO attainment vs rate")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"placement_{wl.replace(':', '_').replace('/', '_')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths
