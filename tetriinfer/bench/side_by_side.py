"""``tetriinfer bench side-by-side``: every serving mode on the same cores, the same model, the same requests.

For each mode (a *column*), one ``tetriinfer serve`` process is started with the same number of instances,
each pinned to its own core (disaggregated modes: ``P`` prefill + ``K - P`` decode instances; colocated
modes: ``K`` instances), every workload is run against it in turn, and the server is stopped. External
servers (``--extra-server NAME=URL``, e.g. ``vllm serve`` from its own venv) are driven as extra columns
but never started or stopped by us and report no resource usage.

Definitions (all relative metrics are against the ``colocated`` column, the paper's vLLM baseline):

- ``resource_s`` = resource usage time = the sum over the server's instances of their busy seconds during
  the workload (``GET /cluster`` ``busy_s`` read when the server is idle before and after the workload).
- ``JCT reduction`` = ``1 - jct_mean / jct_mean_colocated``; ``resource ratio`` =
  ``resource_s / resource_s_colocated``.
- ``perf_per_dollar`` = ``speed / resource ratio`` with ``r = jct_mean / jct_mean_colocated`` and
  ``speed = 2 - r`` when ``r <= 1`` (= ``1 + JCT reduction``, the form the paper's Figure 12 numbers fit) and
  ``1 / r`` when ``r > 1`` (the paper's form reaches 0 when JCT doubles and goes negative beyond; ``1 / r``
  meets it with the same value and slope at ``r = 1`` and stays positive: a column twice as slow is worth
  half). 1.0 for the baseline itself; None when either side is undefined.
- ``goodput_per_instance_s`` = requests that met every SLO / (instances x run duration): good requests per
  provisioned instance-second (without SLOs, every completed request counts).
- ``--rate auto``: the *probe* runs on the colocated column first. For each workload it sends
  ``probe_requests`` requests drawn from the same distribution (another seed) closed-loop with
  ``probe_concurrency`` in flight (a new request starts whenever one finishes). With ``N`` requests and
  ``C`` in flight, the loop is full until the ``(N - C)``-th completion, so the sustainable rate is
  ``(N - C) / t_(N-C)`` (completions per second while the loop was full, ``t`` from the start). Every mode
  is then run open-loop (Poisson) at ``rate_fraction`` (default 70%) of that rate.
- Load sweep: ``rate_fractions`` with several values (``--rate-fraction 0.7,1.0,1.3``) runs every workload at
  each fraction of the same probed rate (one probe per workload; the same requests, only the arrival times
  scaled); the cells are then keyed ``WORKLOAD@PCT%`` (``mixed@100%``), with one fraction just ``WORKLOAD``.

Invariants: every (workload, column) cell in the output holds exactly the ``CELL_KEYS``; the baseline
column is run first; each workload's requests (lengths and arrival times) are identical in every column.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from tetriinfer.bench.client import check_temperature
from tetriinfer.bench.metrics import SLO, RequestRecord, flat_summary
from tetriinfer.bench.real_workloads import lengths_for
from tetriinfer.bench.workloads import (
    Workload,
    WorkloadRequest,
    check_length_scale,
    load_workload,
    workload_summary_line,
)
from tetriinfer.net import announced_base_url
from tetriinfer.runtime.priority import parse_cores

BASELINE = "colocated"
MAX_RATE_FRACTION = 4.0  # a sweep may go past the probed rate (overload is part of the curve), not without bound
DISAGGREGATED_MODES = ("tetriinfer", "distserve")
COLOCATED_MODES = ("colocated", "sarathi")
SERVER_MODES = DISAGGREGATED_MODES + COLOCATED_MODES
CELL_KEYS: tuple[str, ...] = (
    "ttft_mean",
    "ttft_p99",
    "tpot_mean",
    "jct_mean",
    "jct_p99",
    "throughput_rps",
    "resource_s",
    "perf_per_dollar",
    "completed",
    "failed",
)
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


# ------------------------------------------------------------------------------------------ configuration


@dataclass(frozen=True)
class Column:
    """One column of the report: our server in ``mode`` (``url is None``) or an external server at ``url``."""

    label: str
    mode: str | None = None
    url: str | None = None
    serve_args: tuple[str, ...] = ()
    # the load client pinned to these cores while it measures this column (None: SideBySideConfig.client_cores)
    client_cores: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not _LABEL_RE.match(self.label):
            raise ValueError(f"column name {self.label!r} must be letters, digits, '_', '.', '+', '-'")
        if (self.mode is None) == (self.url is None):
            raise ValueError(f"column {self.label}: give exactly one of a mode or an external URL")
        if self.mode is not None and self.mode not in SERVER_MODES:
            raise ValueError(f"column {self.label}: unknown mode {self.mode!r}; one of {', '.join(SERVER_MODES)}")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"external server {self.label}: URL must start with http(s)://, got {self.url!r}")

    @property
    def external(self) -> bool:
        return self.url is not None


@dataclass(frozen=True)
class SideBySideConfig:
    """Everything one side-by-side run needs. ``rate=None`` means ``auto`` (probe the baseline)."""

    model: str
    workloads: tuple[str, ...]
    columns: tuple[Column, ...]
    num_requests: int = 50
    rate: float | None = None
    rate_fractions: tuple[float, ...] = (0.7,)  # of the probed rate; several = a load sweep
    probe_requests: int = 16
    probe_concurrency: int = 8
    instances: int = 2
    prefill_instances: int = 1
    max_prompt_tokens: int | None = 1536
    max_output_tokens: int | None = 384
    max_context: int | None = None
    arrival: str = "poisson"
    burstiness_cv: float = 1.0
    length_source: str | None = None
    length_scale: float = 1.0  # trace workloads: lengths (and Mooncake hash blocks) times this
    output_lengths: str = "fixed"  # "natural": answers end at EOS, the workload's length is a max_tokens cap
    output_cap: int = 1024  # alpaca[:FILE] workload: max_tokens of each request
    temperature: float = 0.0  # > 0: sampled answers, the same seed per request in every column (client.request_seed)
    seed: int = 0
    slo: SLO = field(default_factory=SLO)
    request_timeout_s: float = 900.0
    startup_timeout_s: float = 600.0
    kv_cache_memory_gb: float = 0.25
    progress: bool = True
    rounds: int = 1  # every column runs every workload this many times, column order rotated; records pooled
    floor: bool = True  # measure each workload's requests alone on the baseline (TTFT/JCT floors, measure_floor)
    client_transport: str = "raw"  # the load client's transport (bench.client.ClientConfig.transport)
    client_rt_priority: int | None = None  # the load client under SCHED_FIFO (bench.client.run_client)
    client_cores: tuple[int, ...] | None = None  # the load client pinned to these cores (bench.client.run_client)
    # Start every local column's server once, before round 1, and keep them all up (idle but for the column being
    # measured) until the end: rounds then cost no server start, so many short rounds alternate the columns every
    # few seconds and a drifting machine averages out of the paired comparison.
    keep_servers: bool = False

    def __post_init__(self) -> None:
        if not self.workloads:
            raise ValueError("side-by-side needs at least one workload")
        if self.client_transport not in ("raw", "httpx"):
            raise ValueError(f"client_transport must be raw or httpx, got {self.client_transport!r}")
        check_length_scale(self.length_scale)
        if len(set(self.workloads)) != len(self.workloads):
            raise ValueError(f"workloads given twice: {self.workloads}")
        labels = [c.label for c in self.columns]
        if len(set(labels)) != len(labels):
            raise ValueError(f"column names must be unique, got {labels}")
        if not any(c.label == BASELINE and c.mode == BASELINE for c in self.columns):
            raise ValueError(
                "side-by-side needs the 'colocated' mode: it is the baseline of every relative metric "
                "and of --rate auto"
            )
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.rate is not None and not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate must be a positive number of requests/s or auto, got {self.rate}")
        if not self.rate_fractions or not all(0 < f <= MAX_RATE_FRACTION for f in self.rate_fractions):
            raise ValueError(f"rate_fraction values must be in (0, {MAX_RATE_FRACTION:g}], got {self.rate_fractions}")
        if len(set(self.rate_fractions)) != len(self.rate_fractions):
            raise ValueError(f"rate_fraction values given twice: {self.rate_fractions}")
        if self.rate is not None and len(self.rate_fractions) > 1:
            raise ValueError("a load sweep (several rate fractions) scales the probed rate: use --rate auto")
        if self.probe_concurrency < 1 or self.probe_requests <= self.probe_concurrency:
            raise ValueError(
                f"the probe needs probe_requests ({self.probe_requests}) > probe_concurrency "
                f"({self.probe_concurrency}) >= 1 (the loop must be full for at least one completion)"
            )
        if self.instances < 2:
            raise ValueError(f"instances must be >= 2 (a prefill and a decode instance), got {self.instances}")
        if not 1 <= self.prefill_instances < self.instances:
            raise ValueError(
                f"prefill_instances must be in [1, instances - 1] = [1, {self.instances - 1}], "
                f"got {self.prefill_instances}"
            )
        if self.arrival not in ("poisson", "gamma"):
            raise ValueError(f"arrival must be poisson or gamma, got {self.arrival!r}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        check_temperature(self.temperature)
        if self.request_timeout_s <= 0 or self.startup_timeout_s <= 0 or self.kv_cache_memory_gb <= 0:
            raise ValueError("timeouts and kv_cache_memory_gb must be positive")

    def cell_key(self, workload_name: str, fraction: float) -> str:
        """The output key of one workload at one rate fraction: the name alone unless this is a load sweep."""
        return workload_name if len(self.rate_fractions) == 1 else f"{workload_name}@{fraction * 100:.0f}%"

    @property
    def baseline(self) -> Column:
        return next(c for c in self.columns if c.label == BASELINE)

    def ordered_columns(self) -> list[Column]:
        """Baseline first (the probe runs on it), then our other modes, then external servers."""
        rest = [c for c in self.columns if c.label != BASELINE]
        return [self.baseline] + [c for c in rest if not c.external] + [c for c in rest if c.external]


def parse_columns(
    modes: str,
    extra_servers: Sequence[str] = (),
    serve_args: Sequence[str] = (),
    client_cores: Sequence[str] = (),
) -> tuple[Column, ...]:
    """Columns from ``--modes a,b,NAME=MODE``, ``--extra-server NAME=URL``, ``--serve-arg [NAME:]ARGS`` and
    ``client_cores = ["NAME:LIST"]`` of ``--cpu-layout FILE``.

    A ``--serve-arg`` without a ``NAME:`` prefix goes to every one of our columns; with one, only to that
    column (``tetriinfer:--prefill-policy sjf``). Arguments are split like a shell would. A ``client_cores``
    with a prefix pins the load client to ``LIST`` while it measures that column (``tetriinfer:0``; ``NAME:all``
    leaves it unpinned there); one without a prefix is the run-wide default (``SideBySideConfig.client_cores``)
    and is not handled here.
    """
    specs: list[tuple[str, str]] = []
    for item in (m.strip() for m in modes.split(",")):
        if not item:
            continue
        label, _, mode = item.partition("=")
        specs.append((label, mode or label))
    if not specs:
        raise ValueError("--modes is empty")
    labels = {label for label, _ in specs}
    common: list[str] = []
    scoped: dict[str, list[str]] = {}
    for raw in serve_args:
        prefix, sep, rest = raw.partition(":")
        if sep and not prefix.startswith("-") and " " not in prefix:
            if prefix not in labels:
                raise ValueError(f"--serve-arg {raw!r}: no column named {prefix!r} (columns: {sorted(labels)})")
            scoped.setdefault(prefix, []).extend(shlex.split(rest))
        else:
            common.extend(shlex.split(raw))
    externals: list[tuple[str, str]] = []
    for raw in extra_servers:
        name, sep, url = raw.partition("=")
        if not sep or not name or not url:
            raise ValueError(f"--extra-server must be NAME=URL, got {raw!r}")
        externals.append((name, url.rstrip("/")))
        labels.add(name)
    cores: dict[str, tuple[int, ...]] = {}
    for raw in client_cores:
        name, sep, spec = raw.partition(":")
        if not sep:
            raise ValueError(f"client_cores {raw!r}: a column's cores are NAME:LIST (e.g. tetriinfer:0)")
        if name not in labels:
            raise ValueError(f"client_cores {raw!r}: no column named {name!r} (columns: {sorted(labels)})")
        if name in cores:
            raise ValueError(f"client_cores names column {name!r} twice")
        cores[name] = tuple(range(os.cpu_count() or 1)) if spec.strip() == "all" else parse_cores(spec)
    cols = [
        Column(label, mode, None, tuple(common + scoped.get(label, [])), cores.get(label)) for label, mode in specs
    ]
    cols += [Column(name, None, url, client_cores=cores.get(name)) for name, url in externals]
    return tuple(cols)


def layout_args(mode: str, instances: int, prefill_instances: int) -> list[str]:
    """``serve`` arguments that give every mode the same ``instances`` cores, one instance per core."""
    if mode in DISAGGREGATED_MODES:
        return [
            "--prefill-instances",
            str(prefill_instances),
            "--decode-instances",
            str(instances - prefill_instances),
            "--cores-per-instance",
            "1",
        ]
    if mode in COLOCATED_MODES:
        return ["--instances", str(instances), "--cores-per-instance", "1"]
    raise ValueError(f"unknown mode {mode!r}")


# --------------------------------------------------------------------------------- pure computations


def perf_per_dollar(
    jct_mean: float | None, jct_base: float | None, resource_s: float | None, resource_base: float | None
) -> float | None:
    """perf/$ vs the baseline: ``speed / (resource/resource_base)``, ``r = jct/jct_base``, ``speed = 2 - r``
    (the paper's ``1 + JCT reduction``) for ``r <= 1`` and ``1 / r`` above (positive however slow; see the
    module docstring).

    Checks against the paper's table: JCT -47% with resource -38% gives 2.37 (LPHD, "2.4x").
    """
    if None in (jct_mean, jct_base, resource_s, resource_base):
        return None
    assert jct_mean is not None and jct_base is not None and resource_s is not None and resource_base is not None
    if jct_base <= 0 or resource_base <= 0 or resource_s <= 0:
        return None
    r = jct_mean / jct_base
    speed = 2.0 - r if r <= 1.0 else 1.0 / r
    return speed / (resource_s / resource_base)


def pct_change(value: float | None, base: float | None) -> float | None:
    """``value / base - 1`` (-0.85 = 85% lower), or None when undefined."""
    if value is None or base is None or base == 0:
        return None
    return value / base - 1.0


def closed_loop_rate(finish_times_s: Sequence[float], num_requests: int, concurrency: int) -> float:
    """Sustainable rate from a closed-loop probe: ``(N - C) / t_(N-C)`` (see the module docstring).

    ``finish_times_s`` are the completion times (from the start) of the successful requests. Failed
    requests shorten the full-loop window: ``k = min(N - C, completed)``.
    """
    if concurrency < 1 or num_requests <= concurrency:
        raise ValueError(f"need num_requests ({num_requests}) > concurrency ({concurrency}) >= 1")
    done = sorted(t for t in finish_times_s if t is not None)
    k = min(num_requests - concurrency, len(done))
    if k < 1 or done[k - 1] <= 0:
        raise ValueError("the rate probe completed no request; is the server working?")
    return k / done[k - 1]


def resource_seconds(before: dict[str, float], after: dict[str, float]) -> tuple[float, dict[str, float]]:
    """Total and per-instance busy seconds between two ``{instance id: busy_s}`` readings."""
    per = {iid: max(0.0, after.get(iid, 0.0) - before.get(iid, 0.0)) for iid in sorted(set(before) | set(after))}
    return sum(per.values()), per


def build_cell(summary: dict[str, Any], resource_s: float | None) -> dict[str, Any]:
    """The output cell (exactly ``CELL_KEYS``) from a bench summary; perf/$ is filled in by ``finalize``."""
    flat = flat_summary(summary)
    cell = {k: flat[k] for k in CELL_KEYS if k in flat}
    cell["resource_s"] = resource_s
    cell["perf_per_dollar"] = None
    return {k: cell[k] for k in CELL_KEYS}


def finalize(workloads: dict[str, dict[str, dict[str, Any]]],
             baseline: str = BASELINE) -> dict[str, dict[str, dict[str, Any]]]:
    """Fill ``perf_per_dollar`` of every cell relative to the workload's ``baseline`` cell (returns a copy)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for wl, cells in workloads.items():
        base = cells.get(baseline)
        out[wl] = {}
        for label, cell in cells.items():
            new = dict(cell)
            if base is not None:
                new["perf_per_dollar"] = perf_per_dollar(
                    cell["jct_mean"], base["jct_mean"], cell["resource_s"], base["resource_s"]
                )
            out[wl][label] = new
    return out


def relative_rows(workloads: dict[str, dict[str, dict[str, Any]]], baseline: str = BASELINE) -> list[dict[str, Any]]:
    """Paper-style rows: per (workload, non-baseline column) the % changes of TTFT, JCT, resource, and perf/$."""
    rows: list[dict[str, Any]] = []
    for wl, cells in workloads.items():
        base = cells.get(baseline)
        if base is None:
            continue
        for label, cell in cells.items():
            if label == baseline:
                continue
            rows.append({
                "workload": wl,
                "column": label,
                "ttft": pct_change(cell["ttft_mean"], base["ttft_mean"]),
                "jct": pct_change(cell["jct_mean"], base["jct_mean"]),
                "resource": pct_change(cell["resource_s"], base["resource_s"]),
                "perf_per_dollar": cell["perf_per_dollar"],
            })
    return rows


# ------------------------------------------------------------------------------------------ markdown


def round_of(request_id: str) -> int:
    """The round a pooled record came from (``_pool`` suffixes later rounds' ids with ``#rN``)."""
    head, sep, tail = request_id.rpartition("#r")
    return int(tail) if sep and head and tail.isdigit() else 0


def round_changes(cell_raw: dict[str, dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """Per column of one cell: the change of mean TTFT and mean JCT vs the baseline *within each round*
    (rounds run the same requests; pairing by round takes the machine's drift between rounds out of the
    comparison). ``{column: {"ttft": [pct per round], "jct": [...]}}``; the baseline and columns without
    every round are left out."""
    def per_round(res: dict[str, Any]) -> dict[int, tuple[float, float]]:
        groups: dict[int, list[RequestRecord]] = {}
        for r in res.get("requests", []):
            rec = RequestRecord.from_dict(r)
            if rec.success and rec.ttft_s is not None and rec.jct_s is not None:
                groups.setdefault(round_of(rec.request_id), []).append(rec)
        return {k: (sum(r.ttft_s for r in v) / len(v), sum(r.jct_s for r in v) / len(v))  # type: ignore[misc]
                for k, v in groups.items()}

    if BASELINE not in cell_raw:
        return {}
    base = per_round(cell_raw[BASELINE])
    out: dict[str, dict[str, list[float]]] = {}
    for label, res in cell_raw.items():
        if label == BASELINE:
            continue
        mine = per_round(res)
        if not base or set(mine) != set(base):
            continue
        rounds = sorted(base)
        out[label] = {"ttft": [mine[k][0] / base[k][0] - 1 for k in rounds],
                      "jct": [mine[k][1] / base[k][1] - 1 for k in rounds]}
    return out


def _mean_sd(xs: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def round_changes_table(result: dict[str, Any]) -> str:
    changes = result.get("meta", {}).get("round_changes", {})
    rows = [(cell, label, ch) for cell, cols in changes.items() for label, ch in cols.items() if len(ch["ttft"]) > 1]
    if not rows:
        return ""
    out = ["| workload | column | TTFT change per round | TTFT mean +- sd (se) | JCT change per round "
           "| JCT mean +- sd (se) |", "|---|---|---|---:|---|---:|"]
    for cell, label, ch in rows:
        cols = []
        for key in ("ttft", "jct"):
            m, sd = _mean_sd(ch[key])
            se = sd / math.sqrt(len(ch[key]))
            cols += [" ".join(f"{v * 100:+.0f}%" for v in ch[key]),
                     f"{m * 100:+.1f}% +- {sd * 100:.1f} ({se * 100:.1f})"]
        out.append(f"| {cell} | {label} | " + " | ".join(cols) + " |")
    return "\n".join(out)


def floor_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per cell with a measured floor (each request alone, ``SideBySide.measure_floor``): the TTFT and JCT floors,
    the baseline's means, the best possible change vs the baseline for a design that serves each request on one
    core (``floor / baseline - 1``), and every column's mean / floor. Older results carry only a TTFT floor (under
    ``meta.ttft_floor``); their JCT entries are None."""
    meta = result.get("meta", {})
    floors, wmeta = meta.get("floor") or meta.get("ttft_floor", {}), meta.get("workloads", {})
    rows = []
    for key, cols in result["workloads"].items():
        fl = floors.get(wmeta.get(key, {}).get("key", key), {})
        ttft, jct = fl.get("mean_s"), fl.get("jct_mean_s")
        if not ttft:
            continue
        base = cols.get(BASELINE, {})
        b_ttft, b_jct = base.get("ttft_mean"), base.get("jct_mean")
        rows.append({
            "workload": key, "floor_s": ttft, "baseline_ttft_s": b_ttft,
            "best_change": ttft / b_ttft - 1 if b_ttft else None,
            "over_floor": {label: c["ttft_mean"] / ttft for label, c in cols.items() if c.get("ttft_mean")},
            "jct_floor_s": jct, "baseline_jct_s": b_jct,
            "best_jct_change": jct / b_jct - 1 if jct and b_jct else None,
            "jct_over_floor": {label: c["jct_mean"] / jct for label, c in cols.items() if jct and c.get("jct_mean")},
        })
    return rows


def floor_table(result: dict[str, Any]) -> str:
    rows = floor_rows(result)
    if not rows:
        return ""
    labels = list(rows[0]["over_floor"])
    head = ("| workload | floor TTFT (s) | colocated TTFT (s) | best possible TTFT change | floor JCT (s) | "
            "colocated JCT (s) | best possible JCT change | "
            + " | ".join(f"{lab} TTFT / JCT over floor" for lab in labels) + " |")
    out = [head, "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(labels)]
    for r in rows:
        over = [f"{_num(r['over_floor'].get(lab))}x / {_num(r['jct_over_floor'].get(lab))}x" for lab in labels]
        out.append(f"| {r['workload']} | {_num(r['floor_s'], 3)} | {_num(r['baseline_ttft_s'], 3)} | "
                   f"{_pct(r['best_change'])} | {_num(r['jct_floor_s'], 3)} | {_num(r['baseline_jct_s'], 3)} | "
                   f"{_pct(r['best_jct_change'])} | " + " | ".join(over) + " |")
    return "\n".join(out)


def _mean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:+.0f}%"


def _num(v: float | None, digits: int = 2) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}"


def paper_table(result: dict[str, Any]) -> str:
    """The paper's Figure-12-style table: changes vs the baseline (``meta.baseline``, default colocated), one row
    per (workload, column)."""
    rows = relative_rows(result["workloads"], result.get("meta", {}).get("baseline", BASELINE))
    lines = [
        "| workload | column | TTFT | JCT | resource | perf/$ |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        ppd = r["perf_per_dollar"]
        lines.append(
            f"| {r['workload']} | {r['column']} | {_pct(r['ttft'])} | {_pct(r['jct'])} | "
            f"{_pct(r['resource'])} | {'-' if ppd is None else f'{ppd:.2f}x'} |"
        )
    return "\n".join(lines)


def workload_table(result: dict[str, Any], workload: str) -> str:
    """Absolute numbers of one workload, every column, with changes vs colocated."""
    cells = result["workloads"][workload]
    details = result.get("meta", {}).get("details", {}).get(workload, {})
    baseline = result.get("meta", {}).get("baseline", BASELINE)
    base = cells.get(baseline)
    lines = [
        "| column | TTFT mean s | TTFT p99 s | TPOT mean s | JCT mean s | JCT p99 s | resource s | "
        "busy per instance s | req/s | goodput/inst-s | perf/$ | completed | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for label, c in cells.items():
        d = details.get(label, {})
        busy = d.get("busy_per_instance_s") or {}
        busy_text = ", ".join(f"{k}: {v:.1f}" for k, v in busy.items()) or "-"

        def with_delta(key: str, c: dict[str, Any] = c, label: str = label) -> str:
            v = c[key]
            if label == baseline or base is None:
                return _num(v)
            return f"{_num(v)} ({_pct(pct_change(v, base[key]))})"

        ppd = c["perf_per_dollar"]
        lines.append(
            f"| {label} | {with_delta('ttft_mean')} | {with_delta('ttft_p99')} | {_num(c['tpot_mean'], 3)} | "
            f"{with_delta('jct_mean')} | {with_delta('jct_p99')} | {with_delta('resource_s')} | {busy_text} | "
            f"{_num(c['throughput_rps'], 3)} | {_num(d.get('goodput_per_instance_s'), 3)} | "
            f"{'-' if ppd is None else f'{ppd:.2f}x'} | {c['completed']} | {c['failed']} |"
        )
    return "\n".join(lines)


def markdown_report(result: dict[str, Any], plots: Sequence[Path] = (), relative_to: Path | None = None) -> str:
    """The whole report: setup, rates, the paper-style table, per-workload tables, plots."""
    meta = result.get("meta", {})
    m = meta.get("machine", {})
    lines = ["# Side-by-side: TetriInfer vs its baselines on the same cores", ""]
    lines.append(f"- Command: `{meta.get('command', '?')}`")
    lines.append(f"- Started {meta.get('started_at', '?')}, took {_num(meta.get('wall_s'), 0)} s wall time.")
    lines.append(
        f"- Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, Python {m.get('python', '?')}, "
        f"torch {m.get('torch', '?')}; load average at start {m.get('loadavg_start', '?')}, "
        f"at end {m.get('loadavg_end', '?')} (the machine is shared: compare columns, not absolute times)."
    )
    lines.append(f"- Model: `{meta.get('model', '?')}`; caps: {meta.get('caps', {})}.")
    transport = meta.get("client_transport", "httpx")  # reports from before the raw transport used httpx
    rt = meta.get("client_rt_priority")
    lines.append(f"- Load client: `tetriinfer bench`, {transport} transport" + (" on uvloop" if transport == "raw" else "")
                 + (f", under SCHED_FIFO priority {rt}" if rt is not None else "")
                 + (f", pinned to cores {meta['client_cores']}" if meta.get("client_cores") else "") + ".")
    lines.append(
        f"- Layout: {meta.get('instances', '?')} instances, one core each; disaggregated modes use "
        f"{meta.get('prefill_instances', '?')} prefill + "
        f"{(meta.get('instances') or 0) - (meta.get('prefill_instances') or 0)} decode instance(s)."
    )
    for col in meta.get("columns", []):
        where = col.get("url") or f"`tetriinfer serve {' '.join(col.get('serve_args', []))}`"
        pinned = col.get("client_cores")
        lines.append(f"  - **{col['label']}**: {where}"
                     + (f"; load client pinned to cores {pinned}" if pinned is not None else ""))
    lines.append(f"- SLOs for goodput: {meta.get('slo', {})} (none set: every completed request counts).")
    lines += ["", "## Request rates", ""]
    rates = meta.get("rates", {})
    if meta.get("rate_mode") == "auto":
        lines.append(
            f"`--rate auto`: closed-loop probe on the colocated baseline ({meta.get('probe_requests')} requests, "
            f"{meta.get('probe_concurrency')} in flight; sustainable rate = (N - C) / t_(N-C)), then every "
            f"column runs open-loop {meta.get('arrival', 'poisson')} arrivals at "
            + " / ".join(f"{f * 100:.0f}%" for f in meta.get("rate_fractions", [meta.get("rate_fraction", 0)]))
            + " of it" + (" (a load sweep: cells keyed WORKLOAD@PCT%)." if len(meta.get("rate_fractions", [])) > 1
                          else ".")
        )
    else:
        lines.append("Fixed rate given on the command line.")
    lines += ["", "| workload | probed sustainable req/s | fraction | run req/s | requests |",
              "|---|---:|---:|---:|---:|"]
    for wl, r in rates.items():
        frac = r.get("rate_fraction")
        lines.append(f"| {wl} | {_num(r.get('probed_rps'), 3)} | {'-' if frac is None else f'{frac:.0%}'} | "
                     f"{_num(r.get('rate_rps'), 3)} | {r.get('requests')} |")
    lines += [
        "",
        "## Paper-style summary (change vs colocated)",
        "",
        paper_table(result),
        "",
        "TTFT and JCT are means; resource = total busy seconds of all instances during the workload; "
        "perf/$ = speed / (resource ratio), speed = 1 + JCT reduction (the paper's form) when JCT is lower and "
        "colocated JCT / JCT when higher (stays positive); 1.0 = colocated.",
    ]
    rounds_table = round_changes_table(result)
    if rounds_table:
        lines += [
            "", "## Change vs colocated within each round", "",
            "Every round runs the same requests (column order rotated); the change of each column's mean TTFT and "
            "JCT against colocated in the same round, then their mean, standard deviation and standard error (sd / "
            "sqrt(rounds)) over rounds: the spread says how much of a difference this machine can resolve.", "",
            rounds_table,
        ]
    table = floor_table(result)
    if table:
        lines += [
            "", "## Floor: how much of TTFT and JCT is waiting and interference", "",
            "Each workload's requests sent again to the colocated baseline one at a time (same prompt and output "
            "lengths): the TTFT and JCT each request gets with nothing else queued or running (the floor: prefill "
            "alone, then decode at batch 1). A column's mean over the floor is waiting and interference; "
            "`floor / colocated - 1` is the largest change any design can show against colocated here while it "
            "serves each request on one core at this engine's speed.", "",
            table,
        ]
    for wl in result["workloads"]:
        wl_meta = meta.get("workloads", {}).get(wl, {})
        lines += ["", f"## {wl}", ""]
        if wl_meta:
            lines.append(f"{wl_meta.get('summary_line', '')}")
            lines.append("")
        lines.append(workload_table(result, wl))
        cached = [f"{label}: {d['prefix_cache_hit_tokens']} of {d['prefix_cache_queried_tokens']} prompt tokens "
                  f"({d['prefix_cache_hit_tokens'] / d['prefix_cache_queried_tokens']:.0%})"
                  for label, d in meta.get("details", {}).get(wl, {}).items() if d.get("prefix_cache_queried_tokens")]
        if cached:
            lines += ["", "Found in a prefix cache (server /metrics): " + "; ".join(cached) + "."]
    lines += plot_section(plots, relative_to)
    return "\n".join(lines) + "\n"


def plot_section(plots: Sequence[Path], relative_to: Path | None = None) -> list[str]:
    """Markdown lines embedding ``plots`` (paths relative to the report's folder when inside it)."""
    if not plots:
        return []
    lines = ["", "## Plots", ""]
    for p in plots:
        rel = p.relative_to(relative_to) if relative_to and p.is_relative_to(relative_to) else p
        lines.append(f"![{p.parent.name}/{p.stem}]({rel.as_posix()})")
    return lines


# ------------------------------------------------------------------------------------------- servers


def cluster_busy(base_url: str) -> dict[str, Any]:
    """``GET /cluster`` of our server."""
    resp = httpx.get(base_url.rstrip("/") + "/cluster", timeout=30)
    resp.raise_for_status()
    return resp.json()


def wait_idle(base_url: str, timeout_s: float = 120.0, settle_s: float = 0.35) -> dict[str, float]:
    """Wait until no request is in flight or queued anywhere, let one load report pass, return busy_s."""
    deadline = time.monotonic() + timeout_s
    info = cluster_busy(base_url)
    while time.monotonic() < deadline:
        info = cluster_busy(base_url)
        idle = info.get("requests_in_flight", 0) == 0 and all(
            i["queued"] == 0 and i["running"] == 0 for i in info["instances"]
        )
        if idle:
            break
        time.sleep(0.25)
    time.sleep(settle_s)
    info = cluster_busy(base_url)
    return {i["id"]: float(i["busy_s"]) for i in info["instances"]}


@contextmanager
def serve(model: str, mode: str, args: Sequence[str], startup_timeout_s: float, poll_s: float = 0.5) -> Iterator[str]:
    """Start ``tetriinfer serve`` in ``mode`` on a port it picks itself (``--port 0``: nothing can take the port
    between choosing and binding it); yield its base URL, read from its start-up line, once ``/health`` answers
    (checked every ``poll_s``); stop it (SIGINT, then kill)."""
    cmd = [sys.executable, "-m", "tetriinfer.cli", "serve", "--model", model, "--mode", mode, "--port", "0", *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    log = tempfile.NamedTemporaryFile("w+", prefix=f"side_by_side_{mode}_", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    base_url: str | None = None

    def text() -> str:
        log.flush()
        return Path(log.name).read_text(encoding="utf-8", errors="replace")

    def tail() -> str:
        return text()[-3000:]

    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tetriinfer serve ({mode}) exited with {proc.returncode}:\n{tail()}")
            base_url = base_url or announced_base_url(text())
            try:
                if base_url is not None and httpx.get(base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"tetriinfer serve ({mode}) not healthy after {startup_timeout_s} s:\n{tail()}")
            time.sleep(poll_s)
        assert base_url is not None
        yield base_url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        Path(log.name).unlink(missing_ok=True)


def served_model_id(base_url: str) -> str:
    """The first model id from ``GET /v1/models`` (how an external server names its model)."""
    resp = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data or not data[0].get("id"):
        raise ValueError(f"{base_url}/v1/models lists no model")
    return str(data[0]["id"])


# ------------------------------------------------------------------------------------------- running


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # pragma: no cover - torch is a dependency
        torch_version = "?"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch_version,
        "platform": platform.platform(),
    }


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


class SideBySide:
    """Runs a ``SideBySideConfig``; ``run()`` returns ``(result, raw)`` where ``raw[workload][column]`` is the
    full bench results dict (per-request records) of that cell, for plots."""

    def __init__(self, config: SideBySideConfig, command: str = "") -> None:
        self.config = config
        self.command = command
        self.probed: dict[str, float | None] = {}  # workload as given -> the probe's sustainable req/s
        self.rates: dict[str, dict[str, Any]] = {}  # cell key -> probed and run rates
        self.cells: dict[str, dict[str, dict[str, Any]]] = {}
        self.details: dict[str, dict[str, dict[str, Any]]] = {}
        self.raw: dict[str, dict[str, dict[str, Any]]] = {}
        self.workload_meta: dict[str, dict[str, Any]] = {}
        self.floors: dict[str, dict[str, Any]] = {}  # workload as given -> its TTFT floor (measure_floor)
        # (workload cell, column) -> [prompt tokens found in a prefix cache, looked up], summed over rounds
        self._prefix_hits: dict[tuple[str, str], list[int]] = {}
        # (workload, column) -> records of every round so far, summed durations, busy seconds, rounds
        self._pooled: dict[tuple[str, str], dict[str, Any]] = {}

    # -- workloads
    def _workload(self, name: str, n: int, rate: float | None, seed: int, burst: bool = False) -> Workload:
        c = self.config
        is_trace = name.lower().startswith("trace:")
        arrival = "trace" if is_trace and not burst else c.arrival  # traces keep their own timestamps
        return load_workload(
            name,
            n,
            None if burst else rate,
            seed,
            arrival=arrival,
            burstiness_cv=c.burstiness_cv,
            max_prompt_tokens=c.max_prompt_tokens,
            max_output_tokens=c.max_output_tokens,
            max_context=c.max_context,
            length_source=c.length_source,
            length_scale=c.length_scale if is_trace else 1.0,
            tokenizer=c.model if (Path(c.model) / "tokenizer.json").is_file() else None,
            output_cap=c.output_cap,
            real_lengths=lengths_for(c.temperature),
        )

    def _client_options(self, column: Column) -> dict[str, Any]:
        c = self.config
        return {
            # real-text prompts with the model's tokenizer where it ships one, else random token ids
            "tokenizer": c.model if not column.external and (Path(c.model) / "tokenizer.json").is_file() else None,
            "max_context": c.max_context,
            "request_timeout_s": c.request_timeout_s,
            "seed": c.seed,
            "progress": c.progress,
            "transport": c.client_transport,
            "rt_priority": c.client_rt_priority,
            "cores": column.client_cores if column.client_cores is not None else c.client_cores,
            "output_lengths": c.output_lengths,
            "temperature": c.temperature,
        }

    def _bench(self, url: str, model: str, column: Column, workload: Workload, **extra: Any) -> dict[str, Any]:
        from tetriinfer.bench.client import ClientConfig, run_benchmark

        cfg = ClientConfig(base_url=url, model=model, **{**self._client_options(column), **extra})
        return run_benchmark(cfg, workload, self.config.slo, column.label)

    # -- probe
    def probe(self, url: str, model: str, column: Column, name: str) -> float:
        c = self.config
        wl = self._workload(name, c.probe_requests, None, c.seed + 1000, burst=True)
        res = self._bench(url, model, column, wl, max_concurrency=c.probe_concurrency)
        records = [RequestRecord.from_dict(r) for r in res["requests"]]
        finishes = [r.last_token_s for r in records if r.success and r.last_token_s is not None]
        sent = len(wl) - wl.num_rejected
        return closed_loop_rate(finishes, sent, min(c.probe_concurrency, sent - 1))

    # -- floor: each request alone
    def measure_floor(self, url: str, model: str, column: Column, name: str) -> dict[str, Any]:
        """The workload's own requests (same prompt and output lengths as its cells) sent to the baseline one at
        a time (``user="floor"``): the TTFT, TPOT and JCT each request gets with nothing else queued or running.
        A cell's mean over its floor is waiting and interference; ``floor / baseline - 1`` is the largest change
        any design can show here while it serves each request on one core at this engine's speed (prefill alone,
        then decode at batch 1)."""
        c = self.config
        rate = c.rate if c.rate is not None else (self.probed[name] or 1.0) * c.rate_fractions[0]
        wl = self._workload(name, c.num_requests, rate, c.seed)
        single = replace(wl, name=f"{wl.name}-floor",
                         requests=tuple(replace(r, arrival_s=0.0) for r in wl.requests))
        res = self._bench(url, model, column, single, max_concurrency=1, user="floor")
        records = [RequestRecord.from_dict(r) for r in res["requests"]]
        ttfts = [t for r in records if (t := r.ttft_s) is not None]
        tpots = [t for r in records if (t := r.tpot_s) is not None]
        e2es = [t for r in records if (t := r.e2e_s) is not None]  # alone, JCT = E2E (nothing queued)
        floor = {"mean_s": _mean(ttfts), "median_s": sorted(ttfts)[len(ttfts) // 2] if ttfts else None,
                 "requests": len(ttfts), "tpot_mean_s": _mean(tpots), "jct_mean_s": _mean(e2es)}
        print(f"{name}: floor (one request at a time on {column.label}) over {len(ttfts)} requests: TTFT "
              f"{_num(floor['mean_s'], 3)} s, TPOT {_num(floor['tpot_mean_s'], 4)} s, JCT "
              f"{_num(floor['jct_mean_s'], 3)} s", flush=True)
        return floor

    # -- one column
    def _run_column(self, column: Column, url: str, ours: bool) -> None:
        c = self.config
        model = served_model_id(url)
        if ours:  # warm-up (first forwards, connections), not measured
            warm = Workload("warmup", tuple(WorkloadRequest(f"warm-{i}", 0.0, 16, 4) for i in range(2)),
                            "warm-up", "burst", None, c.seed)
            self._bench(url, model, column, warm, progress=False)
        for name in c.workloads:
            if name not in self.probed:
                self.probed[name] = self.probe(url, model, column, name) if c.rate is None else None
            if ours and c.floor and column.label == BASELINE and name not in self.floors:
                self.floors[name] = self.measure_floor(url, model, column, name)
            for fraction in c.rate_fractions:
                self._run_cell(column, url, model, name, fraction, ours)

    def _run_cell(self, column: Column, url: str, model: str, name: str, fraction: float, ours: bool) -> None:
        """One workload at one rate fraction against one running column."""
        c = self.config
        instances = c.instances
        probed = self.probed[name]
        rate = c.rate if c.rate is not None else probed * fraction  # type: ignore[operator]
        wl = self._workload(name, c.num_requests, rate, c.seed)
        key = c.cell_key(wl.name, fraction)
        if key not in self.rates:
            self.rates[key] = {"probed_rps": probed, "rate_rps": rate, "requests": c.num_requests,
                               "rate_fraction": fraction if c.rate is None else None}
            if probed is not None:
                print(f"{name}: colocated sustains {probed:.3f} req/s (closed-loop probe); running every "
                      f"column at {rate:.3f} req/s ({fraction:.0%})", flush=True)
        self.workload_meta.setdefault(key, {
            "summary_line": workload_summary_line(wl), "describe": wl.describe(), "key": name,
            "rate_fraction": fraction if c.rate is None else None,
        })
        before = wait_idle(url) if ours else {}
        load_start = _loadavg()
        res = self._bench(url, model, column, wl)
        after = wait_idle(url) if ours else {}
        usage = res.get("server_usage") or {}
        hits = self._prefix_hits.setdefault((key, column.label), [0, 0])  # summed over rounds
        hits[0] += usage.get("prefix_cache_hit_tokens") or 0
        hits[1] += usage.get("prefix_cache_queried_tokens") or 0
        total, per = resource_seconds(before, after) if ours else (None, {})
        res, total, per = self._pool(key, column.label, res, total, per)
        s = res["summary"]
        good = s["good_requests"] if s["good_requests"] is not None else s["completed"]
        duration = s["duration_s"]
        self.cells.setdefault(key, {})[column.label] = build_cell(s, total)
        self.details.setdefault(key, {})[column.label] = {
            "busy_per_instance_s": per,
            "utilization_per_instance": {k: v / duration for k, v in per.items()} if duration > 0 else {},
            "duration_s": duration,
            "goodput_rps": s["goodput"],
            "goodput_per_instance_s": good / (instances * duration) if duration > 0 else None,
            "send_lag_p99_s": s["send_lag"]["p99"],
            "e2e_mean_s": s["e2e"]["mean"],
            "itl_mean_s": s["itl"]["mean"],
            "output_len_mismatch": s["output_len_mismatch"],
            "rejected": s["rejected"],
            "errors": s["errors"],
            "loadavg_start": load_start,
            "loadavg_end": _loadavg(),
            "prefix_cache_hit_tokens": hits[0],  # from the server's /metrics (ours or vLLM's); 0: no cache
            "prefix_cache_queried_tokens": hits[1],
        }
        self.raw.setdefault(key, {})[column.label] = res
        print(f"{key} / {column.label}: completed {s['completed']}, failed {s['failed']}, TTFT mean "
              f"{s['ttft']['mean']}, JCT mean {s['jct']['mean']}, resource {total}", flush=True)

    def _pool(self, workload: str, label: str, res: dict[str, Any], total: float | None,
              per: dict[str, float]) -> tuple[dict[str, Any], float | None, dict[str, float]]:
        """Add one round's result of a cell to the earlier rounds'; returns the pooled (results, resource seconds,
        busy seconds per instance). Pooled summary = every round's records over the summed durations (means
        weight each request equally); request ids of later rounds get a ``#rN`` suffix."""
        from tetriinfer.bench.metrics import summarize

        key = (workload, label)
        pool = self._pooled.setdefault(key, {"records": [], "duration_s": 0.0, "resource_s": 0.0, "per": {},
                                             "rounds": 0, "has_resource": total is not None})
        records = [RequestRecord.from_dict(r) for r in res["requests"]]
        if pool["rounds"]:
            for r in records:
                r.request_id = f"{r.request_id}#r{pool['rounds']}"
        pool["records"].extend(records)
        pool["duration_s"] += res["summary"]["duration_s"]
        pool["rounds"] += 1
        if total is not None:
            pool["resource_s"] += total
            for k, v in per.items():
                pool["per"][k] = pool["per"].get(k, 0.0) + v
        if pool["rounds"] == 1:
            return res, total, per
        summary = summarize(pool["records"], duration_s=pool["duration_s"], slo=self.config.slo)
        pooled = {**res, "summary": summary, "requests": [r.to_dict() for r in pool["records"]],
                  "rounds": pool["rounds"]}
        return pooled, (pool["resource_s"] if pool["has_resource"] else None), dict(pool["per"])

    def run(self) -> tuple[dict[str, Any], dict[str, dict[str, dict[str, Any]]]]:
        c = self.config
        started = datetime.now(UTC).isoformat(timespec="seconds")
        t0 = time.monotonic()
        machine = {**_machine(), "loadavg_start": _loadavg()}
        for name in c.workloads:  # fail on a bad workload before any server starts
            self._workload(name, min(c.num_requests, 4), c.rate or 1.0, c.seed)
        ordered = c.ordered_columns()
        schedule = [col for r in range(c.rounds) for col in (ordered[r % len(ordered):] + ordered[:r % len(ordered)])]

        def start(stack: ExitStack, column: Column) -> str:
            assert column.mode is not None
            args = [*layout_args(column.mode, c.instances, c.prefill_instances),
                    "--kv-cache-memory-gb", str(c.kv_cache_memory_gb), *column.serve_args]
            return stack.enter_context(serve(c.model, column.mode, args, c.startup_timeout_s))

        with ExitStack() as kept:
            urls = {col.label: start(kept, col) for col in ordered if not col.external} if c.keep_servers else {}
            for column in schedule:  # round 1 starts with the baseline (its probe sets the rates); later rounds rotate
                if column.external:
                    assert column.url is not None
                    self._run_column(column, column.url, ours=False)
                elif column.label in urls:
                    self._run_column(column, urls[column.label], ours=True)
                else:
                    with ExitStack() as one:
                        self._run_column(column, start(one, column), ours=True)
        machine["loadavg_end"] = _loadavg()
        order = [col.label for col in c.columns]
        cells = {wl: {lab: row[lab] for lab in order if lab in row} for wl, row in self.cells.items()}
        meta = {
            "command": self.command,
            "started_at": started,
            "wall_s": time.monotonic() - t0,
            "machine": machine,
            "model": c.model,
            "baseline": BASELINE,
            "instances": c.instances,
            "prefill_instances": c.prefill_instances,
            "client_transport": c.client_transport,
            "client_rt_priority": c.client_rt_priority,
            "client_cores": list(c.client_cores) if c.client_cores is not None else None,
            "columns": [
                {
                    "label": col.label,
                    "mode": col.mode,
                    "url": col.url,
                    "client_cores": list(col.client_cores) if col.client_cores is not None else None,
                    "serve_args": (
                        [*layout_args(col.mode, c.instances, c.prefill_instances),
                         "--kv-cache-memory-gb", str(c.kv_cache_memory_gb), *col.serve_args]
                        if col.mode else []
                    ),
                }
                for col in c.columns
            ],
            "rate_mode": "auto" if c.rate is None else "fixed",
            "rate_fraction": c.rate_fractions[0],
            "rate_fractions": list(c.rate_fractions),
            "probe_requests": c.probe_requests,
            "probe_concurrency": c.probe_concurrency,
            "rounds": c.rounds,
            "keep_servers": c.keep_servers,
            "arrival": c.arrival,
            "rates": dict(self.rates),
            "caps": {
                "max_prompt_tokens": c.max_prompt_tokens,
                "max_output_tokens": c.max_output_tokens,
                "max_context": c.max_context,
            },
            "slo": asdict(c.slo),
            "seed": c.seed,
            "definitions": {
                "resource_s": "sum over instances of busy seconds during the workload (GET /cluster busy_s)",
                "perf_per_dollar": "speed / (resource_s/resource_s_colocated), r = jct_mean/jct_mean_colocated, speed = 2 - r if r <= 1 else 1 / r",
                "goodput_per_instance_s": "requests meeting every SLO / (instances x run duration)",
                "rate_auto": "(N - C) / t_(N-C) of a closed-loop probe on colocated, times rate_fraction",
            },
            "workloads": self.workload_meta,
            "details": self.details,
            "floor": dict(self.floors),
            "round_changes": {cell: round_changes(cols) for cell, cols in self.raw.items()} if c.rounds > 1 else {},
        }
        return {"workloads": finalize(cells), "meta": meta}, self.raw


# --------------------------------------------------------------------------------------------- plots


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def load_sweep_points(result: dict[str, Any]) -> dict[tuple[str, str], list[tuple[float, float, float]]]:
    """(workload, column) -> [(rate fraction, mean TTFT s, mean JCT s)] sorted by fraction, for a load sweep
    (cells keyed ``WORKLOAD@PCT%`` with a ``rate_fraction`` in the run's metadata); {} otherwise."""
    meta = result.get("meta", {})
    if len(meta.get("rate_fractions", [])) < 2:
        return {}
    points: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for key, cells in result["workloads"].items():
        wmeta = meta.get("workloads", {}).get(key, {})
        frac = wmeta.get("rate_fraction")
        if frac is None:
            continue
        for col, cell in cells.items():
            if cell.get("ttft_mean") is not None and cell.get("jct_mean") is not None:
                points.setdefault((wmeta.get("key", key), col), []).append((frac, cell["ttft_mean"], cell["jct_mean"]))
    return {k: sorted(v) for k, v in points.items()}


def write_plots(
    result: dict[str, Any], raw: dict[str, dict[str, dict[str, Any]]], out_dir: str | Path
) -> list[Path]:
    """``summary.png`` (TTFT/JCT/resource change and perf/$ per workload) and per-workload CDFs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from tetriinfer.bench.report import plot_cdfs

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    rows = relative_rows(result["workloads"])
    if rows:
        workloads = list(dict.fromkeys(r["workload"] for r in rows))
        columns = list(dict.fromkeys(r["column"] for r in rows))
        fig, axes = plt.subplots(1, 4, figsize=(16, 4))
        width = 0.8 / max(1, len(columns))
        x = np.arange(len(workloads))
        for ax, (key, title) in zip(
            axes,
            (("ttft", "TTFT change vs colocated"), ("jct", "JCT change vs colocated"),
             ("resource", "resource change vs colocated"), ("perf_per_dollar", "perf/$ (colocated = 1)")),
            strict=True,
        ):
            for j, col in enumerate(columns):
                vals = []
                for wl in workloads:
                    r = next((r for r in rows if r["workload"] == wl and r["column"] == col), None)
                    v = None if r is None else r[key]
                    vals.append(np.nan if v is None else (v if key == "perf_per_dollar" else v * 100))
                ax.bar(x + j * width - 0.4 + width / 2, vals, width, label=col)
            ax.axhline(1.0 if key == "perf_per_dollar" else 0.0, color="k", lw=0.8)
            ax.set_xticks(x, workloads, rotation=20)
            ax.set_title(title)
            ax.set_ylabel("x" if key == "perf_per_dollar" else "%")
            ax.grid(alpha=0.3, axis="y")
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(out / "summary.png", dpi=100)
        plt.close(fig)
        written.append(out / "summary.png")
    sweep = load_sweep_points(result)
    if sweep:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for (wl, col), pts in sweep.items():
            fr = [p[0] * 100 for p in pts]
            for ax, i in zip(axes, (1, 2), strict=True):
                ax.plot(fr, [p[i] for p in pts], marker="o", label=f"{wl} / {col}",
                        ls="-" if col == BASELINE else "--")
        for ax, title in zip(axes, ("mean TTFT (s)", "mean JCT (s)"), strict=True):
            ax.set_xlabel("load, % of the colocated probe's sustainable rate")
            ax.set_title(title)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "load_sweep.png", dpi=100)
        plt.close(fig)
        written.append(out / "load_sweep.png")
    for wl, cols in raw.items():
        results = [(label, res) for label, res in cols.items()]
        if results:
            written += [p for p in plot_cdfs(results, out / _safe(wl)) if p.name != "inflight.png"]
            (out / _safe(wl) / "inflight.png").unlink(missing_ok=True)
    return written


def save(result: dict[str, Any], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return p
