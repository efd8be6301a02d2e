"""Does the placement search rank layouts as the real system does? SLO attainment, simulated vs measured.

Reads a real `tetriinfer bench side-by-side` run made with SLOs (`--slo-ttft/--slo-tpot`, several
`--rate-fraction`s, `--raw`), re-simulates every (workload, rate, column) cell with `sim/placement.py`'s
evaluation -- the same requests (workload, seed, count, caps), the same rate, the column's serve arguments -- and
prints, per cell, the measured and simulated share of requests meeting every SLO, plus whether the two agree on
the best column at each rate. Cost model: a `tetriinfer profile` JSON plus the step overhead and front-end delay
that docs/simulator.md read off this machine's floors.

    python benchmarks/placement_vs_real.py --real /tmp/sbs.json --raw /tmp/raw.json \
        --profile docs/sim/tiny_llama_profile.json --out report.md
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from tetriinfer.bench.metrics import SLO, RequestRecord, summarize
from tetriinfer.sim.cost_model import ProfileCostModel, kv_bytes_per_token, model_config
from tetriinfer.sim.placement import Layout, PlacementConfig, PlacementSearch


def real_attainment(raw_cell: dict, slo: SLO) -> float:
    records = [RequestRecord.from_dict(r) for r in raw_cell["requests"]]
    s = summarize(records, slo=slo)
    sent = s["num_requests"] - s["rejected"]
    return (s["good_requests"] or 0) / sent if sent else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--real", required=True)
    ap.add_argument("--raw", required=True, help="the run's --raw records (.json, or .json.gz)")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--step-overhead-ms", type=float, default=4.0)
    ap.add_argument("--frontend-delay-ms", type=float, default=50.0)
    ap.add_argument("--slo", action="append", default=[], metavar="TTFT_MS,TPOT_MS",
                    help="judge under these SLOs instead of the run's own (repeatable: a grid; the real records are "
                         "re-scored, nothing is rerun)")
    ap.add_argument("--tie", type=float, default=0.02, help="real attainments within this of the best tie for best")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    real = json.loads(Path(args.real).read_text())
    raw_bytes = Path(args.raw).read_bytes()
    raw = json.loads(gzip.decompress(raw_bytes) if args.raw.endswith(".gz") else raw_bytes)
    meta = real["meta"]
    slos = [SLO(*(float(x) for x in item.split(","))) for item in args.slo] or [
        SLO(meta["slo"]["ttft_ms"], meta["slo"]["tpot_ms"], meta["slo"]["e2e_ms"])]
    cost = ProfileCostModel.from_profile(args.profile, step_overhead_s=args.step_overhead_ms / 1e3)
    cfg = model_config(meta["model"])
    kv = kv_bytes_per_token(cfg, 4)
    layouts = []
    for col in meta["columns"]:
        sa = list(col["serve_args"])
        if col["mode"] in ("tetriinfer", "distserve"):
            p = int(sa[sa.index("--prefill-instances") + 1])
            d = int(sa[sa.index("--decode-instances") + 1])
        else:
            p, d = int(sa[sa.index("--instances") + 1]), 0
        layout_only = {"--prefill-instances", "--decode-instances", "--instances", "--cores-per-instance",
                       "--kv-cache-memory-gb"}
        extra, skip = [], False
        for a in sa:
            if skip:
                skip = False
                continue
            if a in layout_only:
                skip = True
                continue
            extra.append(a)
        layouts.append((col["label"], Layout(col["mode"], p, d, tuple(extra))))
    gb = 0.25
    blocks = int(gb * 1024**3 // (16 * kv))
    caps = meta.get("caps", {})
    lines = ["# Placement search vs the real system: SLO attainment per layout", "",
             f"Real run: `{meta.get('command', '')}`", "",
             f"Simulated: the same requests and rates, cost model = `{args.profile}` + {args.step_overhead_ms:g} ms "
             f"per step, {args.frontend_delay_ms:g} ms front end (docs/simulator.md). Real attainment is the "
             "run's records re-scored under each SLO. Best: the highest attainment; real attainments within "
             f"{args.tie:.0%} of the best tie.", "",
             "| SLO TTFT / TPOT ms | workload @ load | rate req/s | "
             + " | ".join(f"{label} real / sim" for label, _ in layouts) + " | real best | sim best | agree |",
             "|---|---|---:|" + "---:|" * len(layouts) + "---|---|---|"]
    agree = total = 0
    sims: dict[tuple[str, str, str], list] = {}
    for slo in slos:
        for key, cells in real["workloads"].items():
            rate = meta["rates"][key]["rate_rps"]
            wl_name = meta["workloads"][key]["key"]
            pc = PlacementConfig((wl_name,), tuple(lay for _, lay in layouts), slo, num_kv_blocks=blocks,
                                 kv_bytes_per_token=kv, max_model_len=cfg.max_position_embeddings,
                                 model=meta["model"], num_requests=meta["rates"][key]["requests"],
                                 min_duration_s=0.0, max_prompt_tokens=caps.get("max_prompt_tokens"),
                                 max_output_tokens=caps.get("max_output_tokens"), seed=meta.get("seed", 0),
                                 frontend_delay_s=args.frontend_delay_ms / 1e3, progress=False)
            search = PlacementSearch(pc, cost)
            rows = []
            for label, lay in layouts:
                if label not in cells:
                    continue
                r_att = real_attainment(raw[key][label], slo)
                if (key, label, "records") not in sims:  # simulate once; re-score per SLO
                    sims[(key, label, "records")] = search.simulate_records(lay, wl_name, rate)
                s_att = search.attainment(sims[(key, label, "records")])
                rows.append((label, r_att, s_att))
            top = max(r for _, r, _ in rows)
            real_best = [label for label, r, _ in rows if r >= top - args.tie]
            sim_best = max(rows, key=lambda r: r[2])[0]
            ok = sim_best in real_best
            agree += ok
            total += 1
            lines.append(f"| {slo.ttft_ms:g} / {slo.tpot_ms:g} | {key} | {rate:.2f} | "
                         + " | ".join(f"{r:.0%} / {a:.0%}" for _, r, a in rows)
                         + f" | {', '.join(real_best)} | {sim_best} | {'yes' if ok else 'no'} |")
    lines += ["", f"The simulated best is among the real best in {agree} of {total} (SLO, load) cases."]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
