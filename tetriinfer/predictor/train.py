"""Fine-tuning the length classifier.

The dataset's ``train`` split is divided (by prompt hash, salt ``dev``) into a fitting part and a
small dev part used only for early stopping; the ``val`` split is never looked at during training, so
it stays an honest held-out set (its metrics are computed once, at the end, for ``predictor.json``).

Determinism: with the same dataset, base model, config and thread count, two runs produce identical
weights (seeded torch/numpy RNGs, deterministic algorithms, fixed intra-op thread count).
"""

from __future__ import annotations

import copy
import hashlib
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from tetriinfer.predictor.artifact import PredictorMeta
from tetriinfer.predictor.buckets import BucketSpec
from tetriinfer.predictor.dataset import LengthDataset, LengthRow, prompt_hash, split_unit
from tetriinfer.predictor.metrics import LengthBaseline, granularity_report, nll
from tetriinfer.predictor.model import (
    DEFAULT_MAX_LENGTH,
    encode,
    length_sorted_batches,
    load_classifier,
    pad_batch,
    predict_probs,
    resolve_base_model,
)


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 8
    batch_size: int = 16
    lr: float = 1e-4
    head_lr_mult: float = 10.0
    weight_decay: float = 0.01
    warmup_fraction: float = 0.1
    seed: int = 0
    patience: int = 3
    dev_fraction: float = 0.15
    max_length: int = DEFAULT_MAX_LENGTH
    train_layers: int = 2
    neighbor_smoothing: float = 0.1
    select: str = "loss"
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not self.lr > 0 or not self.head_lr_mult > 0:
            raise ValueError("lr and head_lr_mult must be > 0")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1, got {self.patience}")
        if not 0.0 <= self.dev_fraction < 1.0:
            raise ValueError(f"dev_fraction must be in [0, 1), got {self.dev_fraction}")
        if self.max_length < 8:
            raise ValueError(f"max_length must be >= 8, got {self.max_length}")
        if self.train_layers < -1:
            raise ValueError("train_layers must be -1 (all, embeddings included), 0 (head only) or a count")
        if not 0.0 <= self.neighbor_smoothing < 1.0:
            raise ValueError(f"neighbor_smoothing must be in [0, 1), got {self.neighbor_smoothing}")
        if self.select not in ("loss", "accuracy"):
            raise ValueError(f"select must be 'loss' or 'accuracy', got {self.select!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")


def dev_split(rows: list[LengthRow], seed: int, fraction: float) -> tuple[list[LengthRow], list[LengthRow]]:
    """(fit, dev) by prompt hash; falls back to no dev set when it would be empty or everything."""
    if fraction <= 0:
        return rows, []
    dev = [r for r in rows if split_unit(r.prompt, seed, salt="dev") < fraction]
    fit = [r for r in rows if split_unit(r.prompt, seed, salt="dev") >= fraction]
    if not dev or not fit:
        return rows, []
    return fit, dev


def soft_targets(buckets: np.ndarray, num_buckets: int, smoothing: float) -> np.ndarray:
    """One-hot rows with ``smoothing`` of the mass moved to the neighbouring buckets (ordinal prior)."""
    t = np.zeros((len(buckets), num_buckets), dtype=np.float32)
    for i, b in enumerate(buckets):
        nbrs = [x for x in (b - 1, b + 1) if 0 <= x < num_buckets]
        t[i, b] = 1.0 - smoothing if nbrs else 1.0
        for x in nbrs:
            t[i, x] = smoothing / len(nbrs)
    return t


def _transformer_blocks(model: Any) -> list[Any]:
    """The longest ``ModuleList`` in the base model: its transformer blocks, bottom first."""
    import torch

    best: list[Any] = []
    for module in model.base_model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > len(best):
            best = list(module)
    return best


def freeze_for(model: Any, train_layers: int) -> tuple[list[Any], list[Any]]:
    """Freeze embeddings and all but the top ``train_layers`` blocks; return (encoder, head) params.

    ``train_layers == -1`` trains everything. Head parameters are those outside the base model.
    """
    import torch

    base_ids = {id(p) for p in model.base_model.parameters()}
    frozen: set[int] = set()
    if train_layers >= 0:
        for name, module in model.base_model.named_modules():
            if isinstance(module, torch.nn.Embedding) or name.split(".")[-1] in (
                "embeddings",
                "embed_tokens",
            ):
                frozen.update(id(p) for p in module.parameters())
        blocks = _transformer_blocks(model)
        for block in blocks[: max(0, len(blocks) - train_layers)]:
            frozen.update(id(p) for p in block.parameters())
    encoder, head = [], []
    for p in model.parameters():
        p.requires_grad = id(p) not in frozen
        if p.requires_grad:
            (encoder if id(p) in base_ids else head).append(p)
    return encoder, head


class _Determinism:
    """Seeds RNGs and pins torch threads / deterministic algorithms; restores them on exit."""

    def __init__(self, seed: int, num_threads: int | None) -> None:
        self.seed = seed
        self.num_threads = num_threads

    def __enter__(self) -> _Determinism:
        import torch

        self._threads = torch.get_num_threads()
        self._det = torch.are_deterministic_algorithms_enabled()
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        torch.use_deterministic_algorithms(True)
        torch.manual_seed(self.seed)
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.set_num_threads(self._threads)
        torch.use_deterministic_algorithms(self._det)


def _dev_scores(model: Any, tokenizer: Any, rows: list[LengthRow], cfg: TrainConfig) -> tuple[float, float]:
    probs = predict_probs(
        model, tokenizer, [r.prompt for r in rows], batch_size=64, max_length=cfg.max_length
    )
    buckets = np.array([r.bucket for r in rows])
    return float(np.mean(probs.argmax(1) == buckets)), nll(probs, buckets)


def train_predictor(
    dataset: LengthDataset,
    out_dir: str | Path,
    base_model: str | Path | None = None,
    config: TrainConfig | None = None,
    show_progress: bool = True,
) -> PredictorMeta:
    """Fine-tune, early-stop on the dev part of ``train``, save weights + tokenizer + predictor.json."""
    import torch

    cfg = config or TrainConfig()
    base = resolve_base_model(base_model)
    spec: BucketSpec = dataset.spec
    train_rows = dataset.split("train")
    if not train_rows:
        raise ValueError("dataset has no training rows")
    fit_rows, dev_rows = dev_split(train_rows, cfg.seed, cfg.dev_fraction)
    started = time.perf_counter()
    with _Determinism(cfg.seed, cfg.num_threads):
        model, tokenizer = load_classifier(base, num_labels=spec.num_buckets)
        encoder_params, head_params = freeze_for(model, cfg.train_layers)
        ids = encode(tokenizer, [r.prompt for r in fit_rows], cfg.max_length)
        labels = np.array([r.bucket for r in fit_rows])
        targets = torch.from_numpy(soft_targets(labels, spec.num_buckets, cfg.neighbor_smoothing))
        rng = np.random.default_rng(cfg.seed)
        steps_per_epoch = math.ceil(len(fit_rows) / cfg.batch_size)
        total = steps_per_epoch * cfg.epochs
        warmup = int(total * cfg.warmup_fraction)
        opt = torch.optim.AdamW(
            [
                {"params": encoder_params, "lr": cfg.lr},
                {"params": head_params, "lr": cfg.lr * cfg.head_lr_mult},
            ],
            weight_decay=cfg.weight_decay,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt,
            lambda s: (
                (s + 1) / (warmup + 1) if s < warmup else max(0.0, (total - s) / max(1, total - warmup))
            ),
        )
        history: list[dict[str, float]] = []
        best_state: dict[str, Any] | None = None
        best_key: tuple[float, float] | None = None
        best_epoch, bad = 0, 0
        bar = tqdm(total=total, desc="train", unit="step", disable=not show_progress)
        for epoch in range(1, cfg.epochs + 1):
            model.train()
            losses = []
            for batch in length_sorted_batches([len(r) for r in ids], cfg.batch_size, rng):
                input_ids, mask = pad_batch([ids[i] for i in batch], tokenizer.pad_token_id)
                logits = model(input_ids=input_ids, attention_mask=mask).logits
                loss = -(targets[batch] * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(encoder_params + head_params, 1.0)
                opt.step()
                sched.step()
                losses.append(float(loss.detach()))
                bar.update(1)
                bar.set_postfix(epoch=epoch, loss=f"{np.mean(losses):.3f}")
            entry = {"epoch": float(epoch), "train_loss": float(np.mean(losses))}
            if dev_rows:
                acc, dev_loss = _dev_scores(model, tokenizer, dev_rows, cfg)
                entry.update(dev_accuracy=acc, dev_loss=dev_loss)
                key = (dev_loss, -acc) if cfg.select == "loss" else (-acc, dev_loss)
                if best_key is None or key < best_key:
                    best_key, best_epoch, bad = key, epoch, 0
                    best_state = copy.deepcopy(model.state_dict())
                else:
                    bad += 1
            history.append(entry)
            if dev_rows and bad >= cfg.patience:
                break
        bar.close()
        if best_state is not None:
            model.load_state_dict(best_state)
        else:
            best_epoch = len(history)
    train_seconds = time.perf_counter() - started

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))

    hist = [0] * spec.num_buckets
    for r in train_rows:
        hist[r.bucket] += 1
    baseline = LengthBaseline.fit(
        [r.prompt_tokens for r in train_rows], [r.output_tokens for r in train_rows]
    )
    metrics: dict[str, Any] = {
        "history": history,
        "best_epoch": best_epoch,
        "train_seconds": train_seconds,
        "fit_rows": len(fit_rows),
        "dev_rows": len(dev_rows),
    }
    val_rows = dataset.split("val")
    if val_rows:
        probs = predict_probs(model, tokenizer, [r.prompt for r in val_rows], max_length=cfg.max_length)
        report = granularity_report(
            probs,
            np.array([r.output_tokens for r in val_rows]),
            np.array([r.prompt_tokens for r in val_rows]),
            spec,
            np.array(hist),
            baseline,
        )
        report.pop("confusion")
        metrics["val"] = report
    meta = PredictorMeta(
        spec=spec,
        target=dataset.target,
        target_tokenizer=dataset.target_tokenizer,
        base_model=str(base),
        max_length=cfg.max_length,
        train_histogram=tuple(hist),
        length_baseline=baseline,
        train_prompt_hashes=frozenset(prompt_hash(r.prompt) for r in train_rows),
        metrics=metrics,
        train_config={
            **asdict(cfg),
            "dataset_seed": dataset.seed,
            "val_fraction": dataset.val_fraction,
            "weights_sha256": _weights_digest(out),
        },
    )
    meta.save(out)
    return meta


def _weights_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]
