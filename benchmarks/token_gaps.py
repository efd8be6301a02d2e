"""Where a side-by-side's JCT goes, per column: TTFT, the gap to the second token (in disaggregated modes: the KV
hand-off to the decode instance), the mean later gap (decode step time as the client sees it), and how often the
client saw tokens bunched (< 1 ms apart: held up somewhere, then delivered together) or stalled (> 50 ms).

    python benchmarks/token_gaps.py RAW.json [--md OUT.md]

RAW.json is what `tetriinfer bench side-by-side --raw` writes (every request's token arrival times). Output: one
markdown table, rows per (workload, column); nothing is timed here, so it runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics as st
from pathlib import Path
from typing import Any

BUNCHED_S = 0.001
STALL_S = 0.050


def column_gaps(run: dict[str, Any]) -> dict[str, float]:
    """Means (ms) over the column's successful requests of TTFT, second-token gap, later gaps and JCT; the share of
    later gaps under ``BUNCHED_S`` and the count over ``STALL_S``."""
    reqs = [r for r in run["requests"] if r["success"] and len(r["chunk_times_s"]) >= 2]
    if not reqs:
        raise ValueError(f"column {run.get('label')!r} has no successful request with two or more tokens")
    later = [b - a for r in reqs for a, b in zip(r["chunk_times_s"][1:], r["chunk_times_s"][2:], strict=False)]
    return {
        "requests": len(reqs),
        "ttft_ms": 1e3 * st.mean(r["first_token_s"] - r["arrival_s"] for r in reqs),
        "second_gap_ms": 1e3 * st.mean(r["chunk_times_s"][1] - r["chunk_times_s"][0] for r in reqs),
        "second_gap_p50_ms": 1e3 * st.median(r["chunk_times_s"][1] - r["chunk_times_s"][0] for r in reqs),
        "later_gap_ms": 1e3 * st.mean(later) if later else float("nan"),
        "jct_ms": 1e3 * st.mean(r["finish_s"] - r["arrival_s"] for r in reqs),
        "bunched_share": sum(g < BUNCHED_S for g in later) / len(later) if later else 0.0,
        "stalls": sum(g > STALL_S for g in later),
    }


def table(raw: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = ["| workload | column | requests | TTFT ms | 2nd-token gap ms (mean / median) | later gap ms | JCT ms "
             "| bunched (< 1 ms) | stalls (> 50 ms) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for workload, columns in raw.items():
        for column, run in columns.items():
            g = column_gaps(run)
            lines.append(f"| {workload} | {column} | {g['requests']} | {g['ttft_ms']:.1f} | {g['second_gap_ms']:.1f} / "
                         f"{g['second_gap_p50_ms']:.1f} | {g['later_gap_ms']:.2f} | {g['jct_ms']:.0f} | "
                         f"{g['bunched_share']:.1%} | {g['stalls']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", type=Path)
    ap.add_argument("--md", type=Path, default=None, help="also write the table here")
    args = ap.parse_args()
    out = table(json.loads(args.raw.read_text()))
    print(out, end="")
    if args.md is not None:
        args.md.write_text(out)


if __name__ == "__main__":
    main()
