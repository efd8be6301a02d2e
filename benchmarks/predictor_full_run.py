"""Full evaluation of the output-length predictor on held-out AlpacaEval prompts (report: docs/predictor.md).

For each target generator:
1. build a dataset (lengths counted with the target tokenizer; 80/20 train/val split by prompt hash);
2. fine-tune the default base model (all-MiniLM-L6-v2) at each trained granularity;
3. evaluate on the val prompts at g = 100 / 200 / 400 beside the majority and prompt-length baselines
   (a g=100 predictor is also scored at 200/400 by merging bucket probabilities);
4. label shift + online refinement: the predictor of one generator serves another generator's prompts;
   the calibrator sees the first half of the held-out prompts and is scored on the second half;
5. predictor latency on CPU (1 thread) for batches of 1, 8 and 32 prompts.

Run (about 15-20 CPU minutes; use nice on a shared machine):
    nice python benchmarks/predictor_full_run.py --out /tmp/predictor_full_run
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from tetriinfer.predictor.artifact import PredictorMeta
from tetriinfer.predictor.dataset import DatasetConfig, build_dataset, split_unit
from tetriinfer.predictor.evaluate import EvalRows, report_from_probs
from tetriinfer.predictor.inference import LengthPredictor
from tetriinfer.predictor.metrics import expected_calibration_error, nll
from tetriinfer.predictor.model import default_base_model
from tetriinfer.predictor.refine import OnlineCalibrator, RefineConfig
from tetriinfer.predictor.train import TrainConfig, train_predictor

ALPACA = Path("/work/shared/data/alpaca_eval")
SHIPPED_TOKENIZER = Path(__file__).resolve().parents[1] / "tetriinfer" / "data" / "tokenizer.json"


def default_target_tokenizer() -> Path:
    return SHIPPED_TOKENIZER if SHIPPED_TOKENIZER.exists() else default_base_model()


def eval_rows(ds: Any, split: str = "val") -> EvalRows:
    rows = ds.split(split)
    return EvalRows(
        prompts=[r.prompt for r in rows],
        output_tokens=np.array([r.output_tokens for r in rows]),
        prompt_tokens=np.array([r.prompt_tokens for r in rows]),
        excluded_seen=0,
    )


def slim(report: dict[str, Any]) -> dict[str, Any]:
    keep = (
        "accuracy",
        "within_one",
        "spearman",
        "spearman_expected",
        "majority_accuracy",
        "majority_within_one",
        "length_baseline_accuracy",
        "length_baseline_spearman",
        "n",
        "trained_granularity",
        "confusion",
    )
    return {g: {k: r[k] for k in keep if k in r} for g, r in report["granularity"].items()}


def latency(pred: LengthPredictor, prompts: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for bs in (1, 8, 32):
        batch = prompts[:bs]
        pred.predict_probs(batch)  # warm-up
        t = time.perf_counter()
        reps = 3
        for _ in range(reps):
            pred.predict_probs(batch)
        out[str(bs)] = (time.perf_counter() - t) / reps * 1000.0
    return out


def refinement_on_shift(pred: LengthPredictor, ds_other: Any) -> dict[str, Any]:
    """Serve another generator's held-out prompts; calibrate on one half, score on the other."""
    rows = ds_other.split("val")
    first = [r for r in rows if split_unit(r.prompt, 0, salt="refine") < 0.5]
    second = [r for r in rows if split_unit(r.prompt, 0, salt="refine") >= 0.5]
    spec = pred.spec
    cal = OnlineCalibrator(spec, RefineConfig(capacity=1024, min_samples=32))
    for r, p in zip(first, pred.raw_probs([r.prompt for r in first]), strict=True):
        cal.observe(p, r.output_tokens)
    cal.refit()
    probs = pred.raw_probs([r.prompt for r in second])
    after = cal.apply(probs)
    truth = spec.buckets_of([r.output_tokens for r in second])

    def scores(p: np.ndarray) -> dict[str, float]:
        return {
            "accuracy": float(np.mean(p.argmax(1) == truth)),
            "nll": nll(p, truth),
            "ece": expected_calibration_error(p, truth),
        }

    temperature, bias = cal.params or (1.0, np.zeros(spec.num_buckets))
    return {
        "served_generator": ds_other.target,
        "calibration_rows": len(first),
        "scored_rows": len(second),
        "before": scores(probs),
        "after": scores(after),
        "temperature": temperature,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/predictor_full_run")
    ap.add_argument("--generators", nargs="+", default=["Meta-Llama-3-8B-Instruct", "gpt4_1106_preview"])
    ap.add_argument("--train-granularities", type=int, nargs="+", default=[100])
    ap.add_argument("--eval-granularities", type=int, nargs="+", default=[100, 200, 400])
    ap.add_argument("--target-tokenizer", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reuse", action="store_true", help="reuse predictor folders already in --out")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Path(args.target_tokenizer) if args.target_tokenizer else default_target_tokenizer()
    cfg = TrainConfig(epochs=args.epochs, seed=args.seed, num_threads=args.threads, patience=2, max_length=128)
    started = time.perf_counter()
    results: dict[str, Any] = {"target_tokenizer": str(tok), "train_config": cfg.__dict__, "generators": {}}
    datasets: dict[str, Any] = {}
    predictors: dict[tuple[str, int], LengthPredictor] = {}
    for gen in args.generators:
        gen_res: dict[str, Any] = {"trained": {}}
        for g in args.train_granularities:
            ds = build_dataset([ALPACA / f"{gen}.json"], tok, DatasetConfig(granularity=g, seed=args.seed))
            ds.save(out / f"ds_{gen}_g{g}")
            datasets.setdefault(gen, ds)
            counts = ds.meta()["counts"]
            gen_res["train_rows"], gen_res["val_rows"] = counts["train"]["rows"], counts["val"]["rows"]
            lengths = np.array([r.output_tokens for r in ds.rows])
            gen_res["length_stats"] = {
                "mean": float(lengths.mean()),
                "median": float(np.median(lengths)),
                "p90": float(np.percentile(lengths, 90)),
            }
            pdir = out / f"pred_{gen}_g{g}"
            t = time.perf_counter()
            if args.reuse and (pdir / "predictor.json").exists():
                meta = PredictorMeta.load(pdir)
                train_s = float(meta.metrics["train_seconds"])
            else:
                meta = train_predictor(ds, pdir, config=cfg)
                train_s = time.perf_counter() - t
            pred = LengthPredictor.load(pdir, num_threads=args.threads)
            predictors[(gen, g)] = pred
            rows = eval_rows(ds)
            evals = [x for x in args.eval_granularities if x % g == 0]
            report = report_from_probs(meta, pred.raw_probs(rows.prompts), rows, evals)
            gen_res["trained"][str(g)] = {
                "train_seconds": train_s,
                "best_epoch": meta.metrics["best_epoch"],
                "history": meta.metrics["history"],
                "eval": slim(report),
            }
            print(json.dumps({gen: {g: {k: {m: v[m] for m in ("accuracy", "within_one", "spearman",
                                                                   "majority_accuracy", "length_baseline_accuracy")}
                                        for k, v in slim(report).items()}}}), flush=True)
        results["generators"][gen] = gen_res
    # label shift: each generator's finest predictor serves the next generator's prompts
    gens = list(args.generators)
    g0 = min(args.train_granularities)
    shift: dict[str, Any] = {}
    for i, gen in enumerate(gens):
        other = gens[(i + 1) % len(gens)]
        if other == gen:
            continue
        ds_other = build_dataset([ALPACA / f"{other}.json"], tok, DatasetConfig(granularity=g0, seed=args.seed))
        shift[f"{gen}->{other}"] = refinement_on_shift(predictors[(gen, g0)], ds_other)
    results["refinement_under_shift"] = shift
    first_pred_1t = LengthPredictor.load(out / f"pred_{gens[0]}_g{g0}", num_threads=1)
    results["latency_ms_1_thread"] = latency(first_pred_1t, [r.prompt for r in datasets[gens[0]].split("val")])
    results["total_seconds"] = time.perf_counter() - started
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != "generators"}, indent=2))
    print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
