"""Every cell of ``tetriinfer sim side-by-side`` results against the P:D controller's goals, met or not.

Usage: ``python benchmarks/pd_controller_table.py RESULT.json [RESULT.json ...] [--column tetriinfer]
[--baseline colocated]``. For each (file, workload at a rate) it prints the column's change vs the baseline in
mean TTFT and mean JCT, perf/$ on busy seconds (the paper's resource) and on instance-seconds provisioned, and
whether the goals hold: JCT <= baseline and perf/$ >= 1.0 everywhere, TTFT <= baseline on LPHD, HPHD and
Mixed. The numbers come from the JSON ``tetriinfer sim side-by-side --out`` wrote (one simulation each, so the
comparison is within one run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

TTFT_GOAL = ("lphd", "hphd", "mixed")


def pct(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base - 1.0


def rows(result: dict[str, Any], column: str, baseline: str) -> list[dict[str, Any]]:
    out = []
    details = result.get("meta", {}).get("details", {})
    for key, cells in result["workloads"].items():
        if column not in cells or baseline not in cells:
            continue
        c, b = cells[column], cells[baseline]
        d = details.get(key, {}).get(column, {})
        name = key.split("@")[0]
        short = "azure-conv" if "Azure" in name else name
        ttft, jct = pct(c["ttft_mean"], b["ttft_mean"]), pct(c["jct_mean"], b["jct_mean"])
        ppd, prov = c.get("perf_per_dollar"), d.get("perf_per_dollar_provisioned")
        ok_jct = jct is not None and jct <= 0.0
        ok_ppd = ppd is not None and ppd >= 1.0
        ok_ttft = short not in TTFT_GOAL or (ttft is not None and ttft <= 0.0)
        out.append({"cell": short + ("@" + key.split("@")[1] if "@" in key else ""), "ttft": ttft, "jct": jct,
                    "ppd": ppd, "prov": prov, "met": ok_jct and ok_ppd and ok_ttft,
                    "flips": len(d.get("flips", [])), "kept": d.get("kept_decodes", 0),
                    "local": d.get("local_prefills", 0)})
    return out


def fmt(v: float | None, kind: str) -> str:
    if v is None:
        return "-"
    return f"{v * 100:+.0f}%" if kind == "pct" else f"{v:.2f}x"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--column", default="tetriinfer")
    ap.add_argument("--baseline", default=None, help="default: the run's own baseline (meta.baseline)")
    ap.add_argument("--versus", default=None, metavar="COLUMN",
                    help="also show this column's changes (e.g. static, the fixed split) beside each cell")
    args = ap.parse_args()
    if args.versus:
        return versus(args)
    print("| run | cell | TTFT | JCT | perf/$ (busy) | perf/$ (provisioned) | flips | kept | local prefills | goals |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    met = total = 0
    for path in args.results:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
        baseline = args.baseline or result.get("meta", {}).get("baseline", "colocated")
        for r in rows(result, args.column, baseline):
            total += 1
            met += r["met"]
            print(f"| {Path(path).stem} | {r['cell']} | {fmt(r['ttft'], 'pct')} | {fmt(r['jct'], 'pct')} | "
                  f"{fmt(r['ppd'], 'x')} | {fmt(r['prov'], 'x')} | {r['flips']} | {r['kept']} | {r['local']} | "
                  f"{'met' if r['met'] else '**not met**'} |")
    print(f"\n{met} of {total} cells meet every goal.")
    return 0


def versus(args: argparse.Namespace) -> int:
    print(f"| run | cell | TTFT | JCT | perf/$ (busy / provisioned) | {args.versus} TTFT | {args.versus} JCT | "
          f"{args.versus} perf/$ (busy / provisioned) | goals |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    met = total = 0
    for path in args.results:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
        baseline = args.baseline or result.get("meta", {}).get("baseline", "colocated")
        other = {r["cell"]: r for r in rows(result, args.versus, baseline)}
        for r in rows(result, args.column, baseline):
            o = other.get(r["cell"], {})
            total += 1
            met += r["met"]
            print(f"| {Path(path).stem} | {r['cell']} | {fmt(r['ttft'], 'pct')} | {fmt(r['jct'], 'pct')} | "
                  f"{fmt(r['ppd'], 'x')} / {fmt(r['prov'], 'x')} | {fmt(o.get('ttft'), 'pct')} | "
                  f"{fmt(o.get('jct'), 'pct')} | {fmt(o.get('ppd'), 'x')} / {fmt(o.get('prov'), 'x')} | "
                  f"{'met' if r['met'] else '**not met**'} |")
    print(f"\n{met} of {total} cells meet every goal ({args.column}).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
