"""Length predictor for the served model, on its own lengths: repeated held-out evaluation.

Input: JSONL files of (prompt, output_tokens) collected from our own server running the default model
(``tetriinfer predictor build-dataset --collect-from URL --chat``; ``tetriinfer/data/smollm2_lengths.jsonl``
is such a file). Prompts are put in their served form (``predictor.default.served_prompt_text``), split by
instruction 80/20 with several split seeds; for each seed a predictor is trained at g=100 (open last bucket
at 1000 tokens) on the training prompts and scored on the held-out ones at g=100 and g=200 (exact merges),
beside the majority-class and prompt-length baselines. Prints a markdown table (mean and standard deviation
over seeds) and writes every number to ``--out``.

    python benchmarks/predictor_smollm2.py --out docs/predictor_smollm2.json --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

METRICS = ("accuracy", "within_one", "spearman", "majority_accuracy", "majority_within_one",
           "length_baseline_accuracy", "length_baseline_spearman")


def main() -> int:
    from tetriinfer.engine.make_model import default_model_path
    from tetriinfer.predictor.dataset import DatasetConfig, build_dataset
    from tetriinfer.predictor.default import (
        DEFAULT_GRANULARITY,
        DEFAULT_MAX_LENGTH_TOKENS,
        shipped_lengths_path,
        write_served_form,
    )
    from tetriinfer.predictor.evaluate import evaluate_predictor
    from tetriinfer.predictor.train import TrainConfig, train_predictor

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", default=None, help="collected JSONL (default: the shipped file)")
    ap.add_argument("--model", default=None, help="served model folder (default: the default model)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--granularities", type=int, nargs="+", default=[100, 200])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--train-layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--select", choices=("loss", "accuracy"), default="loss")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    model = Path(a.model) if a.model else default_model_path()
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="predictor_smollm2-"))
    work.mkdir(parents=True, exist_ok=True)
    merged = work / "lengths.jsonl"
    seen: set[str] = set()
    with merged.open("w", encoding="utf-8") as out:
        for f in a.lengths or [str(shipped_lengths_path())]:
            for line in Path(f).read_text(encoding="utf-8").splitlines():
                if line.strip() and (obj := json.loads(line))["prompt"] not in seen:
                    seen.add(obj["prompt"])
                    out.write(json.dumps({k: obj[k] for k in ("prompt", "output_tokens")}, ensure_ascii=False) + "\n")
    served = work / "lengths_served.jsonl"
    n = write_served_form(merged, model, served)
    print(f"{n} prompts; work dir {work}")
    runs: list[dict[str, Any]] = []
    for seed in a.seeds:
        config = DatasetConfig(granularity=DEFAULT_GRANULARITY, max_tokens=DEFAULT_MAX_LENGTH_TOKENS, seed=seed)
        ds = build_dataset([served], model, config, target="smollm2-135m-instruct")
        ds_dir = ds.save(work / f"dataset_s{seed}")
        t0 = time.perf_counter()
        train_predictor(ds, work / f"predictor_s{seed}",
                        config=TrainConfig(epochs=a.epochs, num_threads=1, max_length=128, seed=0,
                                           train_layers=a.train_layers, lr=a.lr, select=a.select))
        train_s = time.perf_counter() - t0
        report = evaluate_predictor(work / f"predictor_s{seed}", ds_dir, granularities=a.granularities)
        runs.append({"seed": seed, "train_s": train_s, "report": report})
        for g, r in report["granularity"].items():
            print(f"seed {seed} g={g}: " + ", ".join(f"{k} {r[k]}" for k in (*METRICS, "n")))
    table = ["| g | accuracy | within-one | Spearman | majority acc | majority within-one | prompt-length acc "
             "| prompt-length Spearman | held-out n per seed |", "|---|---|---|---|---|---|---|---|---|"]
    summary: dict[str, Any] = {}
    for g in map(str, a.granularities):
        cells = []
        summary[g] = {}
        for k in METRICS:
            vals = [r["report"]["granularity"][g][k] for r in runs if r["report"]["granularity"][g][k] is not None]
            mean = statistics.fmean(vals) if vals else None
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            summary[g][k] = {"mean": mean, "sd": sd, "values": vals}
            cells.append("n/a" if mean is None else f"{mean:.3f} ± {sd:.3f}")
        ns = [r["report"]["granularity"][g]["n"] for r in runs]
        table.append(f"| {g} | " + " | ".join(cells) + f" | {', '.join(map(str, ns))} |")
    print("\n".join(table))
    if a.out:
        train = {"epochs": a.epochs, "train_layers": a.train_layers, "lr": a.lr, "select": a.select}
        Path(a.out).write_text(json.dumps({"prompts": n, "seeds": a.seeds, "train": train, "summary": summary,
                                           "runs": runs},
                                          indent=1) + "\n", encoding="utf-8")
        print(f"written to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
