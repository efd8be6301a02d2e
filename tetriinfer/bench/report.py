"""Reports over benchmark result JSONs: ratio tables, CDF plots, markdown.

The first result given is the baseline; every other column is shown with its ratio to it
(value / baseline: below 1 is better for latencies, above 1 is better for throughputs).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# (row label, path into the summary, unit scale, unit, higher is better)
COMPARE_ROWS: tuple[tuple[str, tuple[str, ...], float, str, bool], ...] = (
    ("TTFT mean", ("ttft", "mean"), 1e3, "ms", False),
    ("TTFT p99", ("ttft", "p99"), 1e3, "ms", False),
    ("TPOT mean", ("tpot", "mean"), 1e3, "ms", False),
    ("ITL mean", ("itl", "mean"), 1e3, "ms", False),
    ("E2E mean", ("e2e", "mean"), 1e3, "ms", False),
    ("JCT mean", ("jct", "mean"), 1e3, "ms", False),
    ("JCT p99", ("jct", "p99"), 1e3, "ms", False),
    ("request throughput", ("request_throughput",), 1.0, "req/s", True),
    ("output throughput", ("output_throughput",), 1.0, "tok/s", True),
    ("goodput", ("goodput",), 1.0, "req/s", True),
    ("completed", ("completed",), 1.0, "", True),
    ("failed", ("failed",), 1.0, "", False),
    ("rejected", ("rejected",), 1.0, "", False),
)

Result = tuple[str, dict[str, Any]]


def load_result(path: str | Path) -> dict[str, Any]:
    """A results JSON written by ``tetriinfer bench`` (must hold ``summary`` and ``requests``)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"results file not found: {p}")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or "summary" not in data or "requests" not in data:
        raise ValueError(f"{p} is not a tetriinfer bench results file (needs 'summary' and 'requests')")
    return data


def load_results(paths: Sequence[str | Path]) -> list[Result]:
    """(label, result) pairs; labels are the results' own labels unless those collide, then file stems."""
    loaded = [(Path(p), load_result(p)) for p in paths]
    labels = [str(r.get("label") or p.stem) for p, r in loaded]
    if len(set(labels)) != len(labels):
        labels = [
            p.stem if labels.count(lab) > 1 else lab for (p, _), lab in zip(loaded, labels, strict=True)
        ]
    if len(set(labels)) != len(labels):
        labels = [str(p) for p, _ in loaded]
    return list(zip(labels, [r for _, r in loaded], strict=True))


def _get(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = summary
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return None if value is None else float(value)


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if value == int(value) and abs(value) < 1e9:
        return f"{int(value)}"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.1f}"


def ratio(value: float | None, base: float | None) -> float | None:
    """value / base, or None when undefined."""
    if value is None or base is None or base == 0:
        return None
    return value / base


def compare_table(results: Sequence[Result]) -> str:
    """Markdown table of the key metrics per result, with ratios to the first (baseline) result."""
    if not results:
        raise ValueError("compare needs at least one result")
    base_label, base = results[0]
    header = ["metric", f"{base_label} (baseline)"]
    for label, _ in results[1:]:
        header += [label, f"{label} / baseline"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, path, scale, unit, _higher in COMPARE_ROWS:
        b = _get(base["summary"], path)
        row = [f"{name} ({unit})" if unit else name, _fmt(None if b is None else b * scale)]
        for _, res in results[1:]:
            v = _get(res["summary"], path)
            r = ratio(v, b)
            row += [_fmt(None if v is None else v * scale), "-" if r is None else f"{r:.2f}x"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _successful(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in result["requests"] if r.get("success") and r.get("chunk_times_s")]


def ttft_values(result: dict[str, Any]) -> list[float]:
    return [r["first_token_s"] - r["send_s"] for r in _successful(result)]


def jct_values(result: dict[str, Any]) -> list[float]:
    return [r["chunk_times_s"][-1] - r["arrival_s"] for r in _successful(result)]


def inflight_timeline(result: dict[str, Any]) -> tuple[list[float], list[int]]:
    """Client-side in-flight requests over time (a step function: times, counts after each event)."""
    events: list[tuple[float, int]] = []
    for r in result["requests"]:
        if r.get("send_s") is not None and r.get("finish_s") is not None:
            events.append((r["send_s"], 1))
            events.append((r["finish_s"], -1))
    events.sort()
    times, counts, level = [0.0], [0], 0
    for t, d in events:
        level += d
        times.append(t)
        counts.append(level)
    return times, counts


def plot_cdfs(results: Sequence[Result], out_dir: str | Path) -> list[Path]:
    """Write ``ttft_cdf.png``, ``jct_cdf.png`` and ``inflight.png`` into ``out_dir``; return the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for fname, title, getter in (("ttft_cdf.png", "TTFT", ttft_values), ("jct_cdf.png", "JCT", jct_values)):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, res in results:
            vals = np.sort(np.asarray(getter(res), dtype=float))
            if vals.size:
                ax.step(vals, np.arange(1, vals.size + 1) / vals.size, where="post", label=label)
        ax.set_xlabel(f"{title} (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{title} CDF")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        written.append(out / fname)
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, res in results:
        times, counts = inflight_timeline(res)
        ax.step(times, counts, where="post", label=label)
    ax.set_xlabel("time since run start (s)")
    ax.set_ylabel("requests in flight (client view)")
    ax.set_title("Outstanding requests over time")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "inflight.png", dpi=110)
    plt.close(fig)
    written.append(out / "inflight.png")
    return written


def markdown_report(
    results: Sequence[Result],
    title: str = "Benchmark report",
    plots: Sequence[Path] = (),
    relative_to: Path | None = None,
) -> str:
    """A markdown report: what was run (workload, server, SLOs), the ratio table, and plot links."""
    lines = [f"# {title}", ""]
    for label, res in results:
        wl = res.get("workload", {})
        cfg = res.get("config", {})
        s = res["summary"]
        rate = wl.get("observed_rate")
        lines.append(
            f"- **{label}**: workload `{wl.get('name', '?')}` ({wl.get('num_requests', '?')} requests, "
            f"{wl.get('arrival_process', '?')} arrivals"
            + (f" at {rate:.3f} req/s" if isinstance(rate, int | float) else "")
            + f"), server `{cfg.get('base_url', '?')}` model `{cfg.get('model', '?')}`, "
            f"run {s['duration_s']:.1f} s; completed {s['completed']}, failed {s['failed']}, "
            f"rejected {s['rejected']}" + (f"; SLOs {s['slo']}" if s.get("good_requests") is not None else "")
        )
    lines += ["", compare_table(results), ""]
    lines.append(
        "Ratios are value / baseline (first column): lower is better for latencies, higher for "
        "throughputs. TTFT, TPOT, ITL and E2E follow `vllm bench serve` (measured from the client's "
        "send time); JCT is measured from the scheduled arrival."
    )
    for p in plots:
        rel = p.relative_to(relative_to) if relative_to and p.is_relative_to(relative_to) else p
        lines += ["", f"![{p.stem}]({rel.as_posix()})"]
    return "\n".join(lines) + "\n"


def write_markdown_report(
    path: str | Path, results: Sequence[Result], title: str = "Benchmark report", plots: Sequence[Path] = ()
) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(markdown_report(results, title, plots, p.parent.resolve()), encoding="utf-8")
    return p


def summary_text(result: dict[str, Any]) -> str:
    """A short vLLM-style text block for the terminal."""
    s = result["summary"]

    def ms(path: tuple[str, ...]) -> str:
        v = _get(s, path)
        return "-" if v is None else f"{v * 1e3:.2f}"

    rows = [
        ("Successful requests", str(s["completed"])),
        ("Failed requests", str(s["failed"])),
        ("Rejected requests", str(s["rejected"])),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Request throughput (req/s)", _fmt(s["request_throughput"])),
        ("Output token throughput (tok/s)", _fmt(s["output_throughput"])),
        ("Total token throughput (tok/s)", _fmt(s["total_token_throughput"])),
    ]
    if s.get("good_requests") is not None:
        rows.append(("Request goodput (req/s)", _fmt(s["goodput"])))
    for name in ("ttft", "tpot", "itl", "e2e", "jct"):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {name.upper()} (ms)", ms((name, stat))))
    rows.append(("P99 send lag behind schedule (ms)", ms(("send_lag", "p99"))))
    if s.get("output_len_mismatch"):
        rows.append(("Outputs not of the requested length", str(s["output_len_mismatch"])))
    usage = result.get("server_usage")
    if usage:
        if usage.get("resource_s") is not None:
            rows.append(("Server busy time, all instances (s)", f"{usage['resource_s']:.2f}"))
            for inst, busy in usage["busy_per_instance_s"].items():
                rows.append((f"  busy {inst} (s)", f"{busy:.2f}"))
        if usage.get("prefix_cache_queried_tokens"):
            rows.append(("Prefix cache hit rate (prompt tokens)", f"{usage['prefix_cache_hit_rate']:.1%}"))
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join(f"{k:<{width}}{v:>12}" for k, v in rows)


def publish_markdown(lines: Sequence[str], out: str | Path | None) -> str:
    """Join report ``lines``, print them, and write them to ``out`` (parents created) when given."""
    md = "\n".join(lines) + "\n"
    print(md)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(md)
    return md
