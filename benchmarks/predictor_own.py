"""The served model's own predictor (``predictor/own.py``): held-out evaluation over split seeds.

Runs the served model once over every instruction (as a served chat request: chat template plus
generation prompt), keeping the hidden states of several layers (last token and mean over the prompt)
and the next-token entropy / top-1 probability / token of ``--steps`` greedy steps; these raw features
are cached in ``--features`` (an ``.npz``) so that variants are compared without rerunning the model.
Every variant is then scored like ``benchmarks/predictor_smollm2.py``: instructions split 80/20 by the
hash of their served form (``dataset.split_of``, seeds 0 1 2), the head fit on the training part only
(regularisation by 5-fold CV inside it), accuracy at g=100 (open last bucket at 1000 tokens) and at
g=200 against the majority bucket of the training part, and Spearman between the predicted bucket's
midpoint and the true length (``metrics.granularity_report``).

    nice python benchmarks/predictor_own.py --features /tmp/own_feats.npz --out docs/predictor_own.json
    nice python benchmarks/predictor_own.py --features /tmp/own_feats.npz --lengths sampled \
        --out /tmp/predictor_own_sampled.json       # the answers sampled at temperature 0.7

Columns per granularity: accuracy, majority accuracy, Spearman of the predicted bucket's midpoint, Spearman of
the expected length under the predicted probabilities (mean ± standard deviation over the split seeds), each
against the first answer of every held-out prompt. Where every prompt has several answers (``--lengths
sampled``: three sampled answers each), the head fits all answers of the training prompts (``--train-on
first`` for the first only), and further columns (g=100) score against each answer (averaged) and against the
mean of a prompt's answers, next to how well one answer ranks the mean of the others (the ceiling of a
predictor scored on one answer).

    nice python benchmarks/predictor_own.py --features /tmp/own_l20.npz --steps 0 --lengths sampled \
        --variants "L20 last, multinomial" --seeds 0 3 4 5 6 7 8 9
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

LAYERS = (4, 8, 12, 16, 20, 24, 27, 30)


def extract_raw(model_dir: Path, instructions: list[str], steps: int, out: Path) -> None:
    """Hidden states (``LAYERS``, last token and mean) and ``steps`` greedy steps of every instruction."""
    import torch

    from tetriinfer.predictor.own import FeatureExtractor, OwnFeatureConfig, served_prompt_ids

    ex = FeatureExtractor(model_dir, OwnFeatureConfig(layers=LAYERS, pooling=("last", "mean"), prefix_steps=steps),
                          num_threads=1)
    last, mean, ent, top1, gen, ptok, secs = [], [], [], [], [], [], []
    with torch.inference_mode():
        for i, text in enumerate(instructions):
            ids = served_prompt_ids(ex.tokenizer, text)
            t0 = time.perf_counter()
            o = ex.model(torch.tensor([ids]), output_hidden_states=True, use_cache=True)
            last.append(np.stack([o.hidden_states[x][0, -1].numpy() for x in LAYERS]))
            mean.append(np.stack([o.hidden_states[x][0].mean(0).numpy() for x in LAYERS]))
            logits, cache = o.logits[0, -1], o.cache
            e, p, g = [], [], []
            for _ in range(steps):
                logp = torch.log_softmax(logits.double(), -1)
                e.append(float(-(logp.exp() * logp).sum()))
                p.append(float(logp.exp().max()))
                g.append(int(torch.argmax(logits)))
                s = ex.model(torch.tensor([[g[-1]]]), cache=cache, use_cache=True)
                logits, cache = s.logits[0, -1], s.cache
            secs.append(time.perf_counter() - t0)
            ent.append(e)
            top1.append(p)
            gen.append(g)
            ptok.append(len(ids))
            if i % 100 == 0:
                print(f"{i}/{len(instructions)} {secs[-1]:.2f}s", flush=True)
    np.savez(out, last=np.array(last, np.float32), mean=np.array(mean, np.float32), ent=np.array(ent),
             top1=np.array(top1), gen=np.array(gen), ptok=np.array(ptok), layers=np.array(LAYERS),
             secs=np.array(secs), end_ids=np.array(sorted(ex.end_ids)))


def feature_matrix(f: Any, layers: tuple[int, ...], pooling: tuple[str, ...], steps: int,
                   end_ids: set[int]) -> np.ndarray:
    """The same columns, in the same order, as ``FeatureExtractor`` with this config."""
    from tetriinfer.predictor.own import prefix_statistics

    index = {int(x): i for i, x in enumerate(f["layers"])}
    cols = [f[pool][:, index[x]] for x in layers for pool in pooling]
    if steps:
        cols.append(np.stack([prefix_statistics(f["ent"][i, :steps], f["top1"][i, :steps], f["gen"][i, :steps],
                                                end_ids) for i in range(len(f["ptok"]))]))
    cols.append(np.log(f["ptok"].astype(np.float64))[:, None])
    return np.concatenate([np.asarray(c, np.float64) for c in cols], axis=1)


def main() -> int:
    from tetriinfer.engine.make_model import default_model_path
    from tetriinfer.predictor.buckets import BucketSpec
    from tetriinfer.predictor.dataset import split_of
    from tetriinfer.predictor.default import (
        DEFAULT_GRANULARITY,
        DEFAULT_MAX_LENGTH_TOKENS,
        SHIPPED_LENGTHS,
        read_length_samples,
        served_prompt_text,
        shipped_sample_paths,
    )
    from tetriinfer.predictor.metrics import LengthBaseline, granularity_report, spearman
    from tetriinfer.predictor.own import fit_head
    from tetriinfer.predictor.target_tokenizer import load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", default=["greedy"],
                    help="collected JSONL files (a prompt answered in several files has several answers), or the "
                         "shipped lengths of the default model: greedy (default) or sampled (three answers each)")
    ap.add_argument("--train-on", choices=("first", "all"), default="all",
                    help="fit on the first answer of each training prompt only, or on all of its answers")
    ap.add_argument("--model", default=None, help="served model folder (default: the default model)")
    ap.add_argument("--features", required=True, help="raw feature cache (.npz); made when missing")
    ap.add_argument("--steps", type=int, default=32, help="greedy steps kept in the cache")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", default=None, help="names of variants to run (default: all)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    model = Path(a.model) if a.model else default_model_path()
    files = [p for name in a.lengths
             for p in (shipped_sample_paths(name) if name in SHIPPED_LENGTHS else [Path(name)])]
    instructions, samples = read_length_samples(files)
    n_answers = min(len(v) for v in samples)
    answers = np.array([v[:n_answers] for v in samples], dtype=np.int64)  # (prompts, n_answers)
    y = answers[:, 0]  # scored against the first answer, as one-answer datasets are
    feats = Path(a.features)
    if not feats.exists():
        extract_raw(model, instructions, a.steps, feats)
    f = dict(np.load(feats))
    if len(f["ptok"]) != len(instructions):
        raise SystemExit(f"{feats} has {len(f['ptok'])} rows, the lengths {len(instructions)} prompts")
    end_ids = {int(x) for x in f.get("end_ids", [2])}
    tok = load_tokenizer(model)
    served = [served_prompt_text(tok, s) for s in instructions]
    spec = BucketSpec.for_granularity(DEFAULT_GRANULARITY, DEFAULT_MAX_LENGTH_TOKENS)
    variants: dict[str, tuple[tuple[int, ...], tuple[str, ...], int, str]] = {
        "prefix16 only, two-stage": ((), (), 16, "two-stage"),
        "prefix32 only, two-stage": ((), (), 32, "two-stage"),
        "prefix32 only, multinomial": ((), (), 32, "multinomial"),
        **{f"L{x} last+mean, two-stage": ((x,), ("last", "mean"), 0, "two-stage") for x in (8, 16, 20, 24, 30)},
        **{f"L{x} last+mean + prefix{k}, two-stage": ((x,), ("last", "mean"), k, "two-stage")
           for x in (16, 24) for k in (16, 32)},
        **{f"L{x} last+mean, multinomial": ((x,), ("last", "mean"), 0, "multinomial") for x in (20, 24)},
        **{f"L{x} last, multinomial": ((x,), ("last",), 0, "multinomial") for x in (16, 20, 24)},
        "L16+20+24 last, multinomial": ((16, 20, 24), ("last",), 0, "multinomial"),
    }
    if a.variants:
        variants = {k: v for k, v in variants.items() if k in a.variants}
    results: dict[str, Any] = {}
    extra = ("spearman_each", "spearman_expected_each", "spearman_mean", "spearman_expected_mean",
             "answer_vs_other_answers") if n_answers > 1 else ()
    print("| features | " + " | ".join(f"{k} g={g}" for g in (100, 200)
                                       for k in ("acc", "majority", "Spearman", "Spearman_E"))
          + "".join(f" | {k} g=100" for k in extra) + " |")
    print("|---|" + "---|" * (8 + len(extra)), flush=True)
    for name, (layers, pooling, steps, head_kind) in variants.items():
        x = feature_matrix(f, layers, pooling, steps, end_ids)
        runs = []
        for seed in a.seeds:
            val = np.array([split_of(s, seed, 0.2) == "val" for s in served])
            train = np.flatnonzero(~val)
            cols = range(n_answers) if a.train_on == "all" else range(1)
            rows_t = np.concatenate([train for _ in cols])
            y_t = np.concatenate([answers[train, c] for c in cols])
            head = fit_head(x[rows_t], y_t, spec, head_kind, groups=rows_t)
            probs = head.probs(x[val])
            hist = np.bincount(spec.buckets_of(y_t), minlength=spec.num_buckets).astype(np.float64)
            base = LengthBaseline.fit(f["ptok"][~val], y[~val])
            rep: dict[str, Any] = {}
            for g in (100, 200):
                s2 = spec if g == spec.granularity else spec.coarser(g)
                p2 = probs if g == spec.granularity else spec.coarsen_probs(probs, s2)
                h2 = hist if g == spec.granularity else spec.coarsen_probs(hist, s2)
                rep[str(g)] = granularity_report(p2, y[val], f["ptok"][val], s2, h2, base)
            cap_true = y[val] >= DEFAULT_MAX_LENGTH_TOKENS
            cap_pred = probs.argmax(1) == spec.num_buckets - 1
            if n_answers > 1:  # against every answer of the held-out prompts, and against their mean (less label noise)
                mids = spec.midpoints()
                pred, expected = mids[probs.argmax(1)], probs @ mids
                rep["answers"] = {
                    "answers": n_answers,
                    "spearman_each": statistics.mean(spearman(pred, answers[val, c]) for c in range(n_answers)),
                    "spearman_expected_each": statistics.mean(spearman(expected, answers[val, c])
                                                              for c in range(n_answers)),
                    "spearman_mean": spearman(pred, answers[val].mean(axis=1)),
                    "spearman_expected_mean": spearman(expected, answers[val].mean(axis=1)),
                    # how well one answer ranks the others: the ceiling of any predictor scored on one answer
                    "answer_vs_other_answers": statistics.mean(
                        spearman(answers[val, c], np.delete(answers[val], c, axis=1).mean(axis=1))
                        for c in range(n_answers)),
                }
            rep["cap"] = {"true_cap_pred_cap": int(np.sum(cap_true & cap_pred)),
                          "true_cap_pred_short": int(np.sum(cap_true & ~cap_pred)),
                          "true_short_pred_cap": int(np.sum(~cap_true & cap_pred)),
                          "true_short_pred_short": int(np.sum(~cap_true & ~cap_pred)),
                          "short_bucket_accuracy": float(np.mean(probs.argmax(1)[~cap_true]
                                                                 == spec.buckets_of(y[val][~cap_true])))}
            runs.append({"seed": seed, "n": int(val.sum()), "report": rep})
        results[name] = {"layers": list(layers), "pooling": list(pooling), "prefix_steps": steps,
                         "head": head_kind, "features": int(x.shape[1]), "runs": runs}
        print(f"| {name} | " + " | ".join(_cell(runs, g, k) for g in ("100", "200")
                                         for k in ("accuracy", "majority_accuracy", "spearman", "spearman_expected"))
              + "".join(f" | {_cell(runs, 'answers', k)}" for k in extra) + " |",
              flush=True)
    cost = {"steps_cached": int(f["ent"].shape[1])}
    if "secs" in f:
        cost["mean_s_per_prompt_prefill_plus_steps"] = float(np.mean(f["secs"]))
    if "t_prefill" in f:  # a cache with the two parts timed apart
        cost["mean_s_prefill"] = float(np.mean(f["t_prefill"]))
        cost["mean_s_per_step"] = float(np.mean(f["t_step"]))
    if a.out:
        Path(a.out).write_text(json.dumps({"cost": cost, "variants": results}, indent=1) + "\n", encoding="utf-8")
    return 0


def _cell(runs: list[dict[str, Any]], g: str, key: str) -> str:
    vals = [r["report"][g][key] for r in runs if r["report"][g][key] is not None]
    if not vals:
        return "n/a"
    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return f"{statistics.mean(vals):.3f} ± {sd:.3f}"


if __name__ == "__main__":
    raise SystemExit(main())
