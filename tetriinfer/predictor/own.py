"""The served model's own length predictor: features from the served model itself, a linear head.

The served model runs over each prompt's token ids exactly as the server feeds them (for a chat request:
the rendered chat template with the generation prompt). Features are

- its hidden states at chosen layers: the last prompt token and/or the mean over the prompt tokens;
- optionally, statistics of its first ``prefix_steps`` greedy decoding steps (next-token entropy and
  top-1 probability, whether it already emitted an end token, the share of distinct tokens): the model's
  own uncertainty, which is signal for whether it will fall into a repetition loop;
- the log of the prompt length.

A linear head on standardized features gives bucket probabilities (``HEAD_KINDS``):

- ``two-stage``: ``p`` = P(the answer reaches the open last bucket) by logistic regression; for the other
  answers a ridge regression of ``log(1 + length)`` with a Gaussian residual (its spread measured by
  cross-validation on the training prompts) spreads ``1 - p`` over the closed buckets;
- ``multinomial``: logistic regression over the buckets.

Regularisation strengths are chosen by 5-fold cross-validation on the training prompts only.

Artifact (a predictor folder): ``predictor.json`` (``PredictorMeta`` with ``train_config["kind"] ==
"served-model"``, the feature config, the head kind and the served model's fingerprint) and ``head.npz``
(the head's arrays). The served model's weights are not copied: ``base_model`` records its folder, and
loading checks the model found there against the recorded fingerprint.

Invariants: features of a prompt depend only on its token ids, the model weights and the feature config
(one prompt per forward pass, no padding; fp32), so prediction is deterministic for a fixed thread count;
``predict`` returns one ``Prediction`` per prompt, in order.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tetriinfer.predictor.artifact import META_FILE, PredictorMeta
from tetriinfer.predictor.buckets import BucketSpec
from tetriinfer.predictor.dataset import prompt_hash
from tetriinfer.predictor.inference import Prediction
from tetriinfer.predictor.metrics import LengthBaseline

KIND = "served-model"
HEAD_FILE = "head.npz"
HEAD_KINDS = ("two-stage", "multinomial")
POOLINGS = ("last", "mean")
NUM_PREFIX_STATS = 11


class ArtifactError(ValueError):
    """A served-model predictor folder is malformed, incomplete or made for another model."""


@dataclass(frozen=True)
class OwnFeatureConfig:
    """Which features the served model contributes (default: the statistics of 32 greedy steps, the best
    recipe evaluated in docs/predictor.md; hidden states added nothing on top of them there).

    ``layers`` index the model's hidden states (0: embeddings, ``num_hidden_layers``: the final, normed
    one); ``prefix_steps`` greedy decoding steps are run after the prompt (0: none);
    ``max_prompt_tokens`` keeps only the last so many prompt tokens (where the question and the
    generation prompt are)."""

    layers: tuple[int, ...] = ()
    pooling: tuple[str, ...] = ()
    prefix_steps: int = 32
    max_prompt_tokens: int = 1024

    def __post_init__(self) -> None:
        if not self.layers and self.prefix_steps == 0:
            raise ValueError("the feature config selects no features")
        if any(p not in POOLINGS for p in self.pooling) or (bool(self.layers) != bool(self.pooling)):
            raise ValueError(f"pooling must be a non-empty subset of {POOLINGS} when layers are given (and empty "
                             f"otherwise), got {self.pooling!r}")
        if self.prefix_steps < 0 or self.max_prompt_tokens < 8:
            raise ValueError("prefix_steps must be >= 0 and max_prompt_tokens >= 8")

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OwnFeatureConfig:
        return cls(layers=tuple(int(x) for x in data["layers"]), pooling=tuple(str(x) for x in data["pooling"]),
                   prefix_steps=int(data["prefix_steps"]), max_prompt_tokens=int(data["max_prompt_tokens"]))


def prefix_statistics(entropy: np.ndarray, top1: np.ndarray, tokens: Sequence[int],
                      end_ids: set[int]) -> np.ndarray:
    """``NUM_PREFIX_STATS`` numbers from the first greedy steps: entropy (mean, max, min, first, mean of
    log), top-1 probability (mean, min, share above 0.9), whether an end token came, at which step
    (as a share of the steps), and the share of distinct tokens before it."""
    k = len(tokens)
    ends = [j for j, t in enumerate(tokens) if int(t) in end_ids]
    first = ends[0] if ends else k
    before = list(tokens[:first]) or list(tokens[:1])
    e, p = np.asarray(entropy, dtype=np.float64), np.asarray(top1, dtype=np.float64)
    return np.array([e.mean(), e.max(), e.min(), e[0], np.log(e + 1e-6).mean(), p.mean(), p.min(),
                     (p > 0.9).mean(), 1.0 if ends else 0.0, first / k, len(set(before)) / len(before)])


def model_fingerprint(model_dir: str | Path) -> str:
    """Identity of a served model folder: its config plus the size and head of its weights file."""
    d = Path(model_dir)
    h = hashlib.sha256((d / "config.json").read_bytes())
    for w in sorted(d.glob("*.safetensors")):
        h.update(f"{w.name}:{w.stat().st_size}".encode())
        with w.open("rb") as fh:
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def served_prompt_ids(tokenizer: Any, instruction: str) -> list[int]:
    """The ids the server feeds the model for a chat request with ``instruction`` as the one user turn
    (the model's template rendered as transformers does, generation prompt, no extra special tokens);
    a model without a chat template gets the plain-text encoding, as ``/v1/completions`` would."""
    from tetriinfer.server.chat_template import render_chat, special_tokens_of

    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:
        text = render_chat(template, [{"role": "user", "content": instruction}], add_generation_prompt=True,
                           special_tokens=special_tokens_of(tokenizer))
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(instruction))


class FeatureExtractor:
    """Runs the served model (fp32, CPU, one prompt at a time) and returns feature rows."""

    def __init__(self, model_dir: str | Path, config: OwnFeatureConfig, num_threads: int | None = 1) -> None:
        import os

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.model_dir = Path(model_dir)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True,
                                                          dtype=torch.float32).eval()
        n_layers = int(self.model.config.num_hidden_layers)
        bad = [x for x in config.layers if not 0 <= x <= n_layers]
        if bad:
            raise ValueError(f"layers {bad} out of range [0, {n_layers}] for {model_dir}")
        self.end_ids = self._end_ids()

    def _end_ids(self) -> set[int]:
        ids = {int(self.tokenizer.eos_token_id)} if self.tokenizer.eos_token_id is not None else set()
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif isinstance(gen_eos, list):
            ids.update(int(x) for x in gen_eos)
        return ids

    @property
    def num_features(self) -> int:
        c = self.config
        hidden = int(self.model.config.hidden_size)
        return len(c.layers) * len(c.pooling) * hidden + (NUM_PREFIX_STATS if c.prefix_steps else 0) + 1

    def features(self, prompts: Sequence[Sequence[int]], progress: bool = False) -> np.ndarray:
        """One row per prompt (token ids), ``(len(prompts), num_features)`` float64; ``progress`` shows a bar."""
        if not prompts:
            return np.zeros((0, self.num_features))
        from tqdm import tqdm

        return np.stack([self._one(list(p)) for p in tqdm(prompts, desc="served-model features", unit="prompt",
                                                          disable=not progress)])

    def _one(self, ids: list[int]) -> np.ndarray:
        import torch

        if not ids:
            raise ValueError("an empty prompt has no features")
        c = self.config
        ids = ids[-c.max_prompt_tokens:]
        parts: list[np.ndarray] = []
        with torch.inference_mode():
            out = self.model(torch.tensor([ids]), output_hidden_states=bool(c.layers), use_cache=c.prefix_steps > 0)
            for layer in c.layers:
                h = out.hidden_states[layer][0]
                for pool in c.pooling:
                    parts.append((h[-1] if pool == "last" else h.mean(0)).double().numpy())
            if c.prefix_steps:
                logits, cache = out.logits[0, -1], out.cache
                ent, top1, toks = [], [], []
                for _ in range(c.prefix_steps):
                    logp = torch.log_softmax(logits.double(), -1)
                    prob = logp.exp()
                    ent.append(float(-(prob * logp).sum()))
                    top1.append(float(prob.max()))
                    nxt = int(torch.argmax(logits))
                    toks.append(nxt)
                    step = self.model(torch.tensor([[nxt]]), cache=cache, use_cache=True)
                    logits, cache = step.logits[0, -1], step.cache
                parts.append(prefix_statistics(np.array(ent), np.array(top1), toks, self.end_ids))
        parts.append(np.array([math.log(len(ids))]))
        return np.concatenate(parts)


@dataclass
class LinearHead:
    """Standardization plus the head's arrays; ``probs`` maps feature rows to bucket probabilities."""

    kind: str
    spec: BucketSpec
    arrays: dict[str, np.ndarray]

    REQUIRED = {
        "two-stage": ("mean", "scale", "cap_w", "cap_b", "reg_w", "reg_b", "reg_sd"),
        "multinomial": ("mean", "scale", "w", "b", "classes"),
    }

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise ArtifactError(f"unknown head kind {self.kind!r}; expected one of {HEAD_KINDS}")
        missing = [k for k in self.REQUIRED[self.kind] if k not in self.arrays]
        if missing:
            raise ArtifactError(f"{self.kind} head is missing arrays {missing}")
        d = self.arrays["mean"].shape[0]
        w = self.arrays["cap_w"] if self.kind == "two-stage" else self.arrays["w"]
        if self.arrays["scale"].shape != (d,) or w.shape[-1] != d:
            raise ArtifactError(f"head arrays disagree on the feature count ({d})")

    @property
    def num_features(self) -> int:
        return int(self.arrays["mean"].shape[0])

    def probs(self, x: np.ndarray) -> np.ndarray:
        """``(n, spec.num_buckets)`` probabilities for ``(n, num_features)`` feature rows."""
        x = np.atleast_2d(np.asarray(x, dtype=np.float64))
        if x.shape[1] != self.num_features:
            raise ValueError(f"got {x.shape[1]} features, the head expects {self.num_features}")
        a = self.arrays
        z = (x - a["mean"]) / a["scale"]
        nb = self.spec.num_buckets
        if self.kind == "multinomial":
            logits = z @ a["w"].T + a["b"]
            logits -= logits.max(axis=1, keepdims=True)
            p = np.exp(logits)
            p /= p.sum(axis=1, keepdims=True)
            out = np.zeros((x.shape[0], nb))
            out[:, a["classes"].astype(np.int64)] = p
            return out
        from scipy.stats import norm

        p_cap = 1.0 / (1.0 + np.exp(-(z @ a["cap_w"] + float(a["cap_b"]))))
        mu = z @ a["reg_w"] + float(a["reg_b"])
        edges = np.log1p(np.arange(1, nb) * self.spec.granularity)  # upper edges of the closed buckets
        cdf = norm.cdf((edges[None, :] - mu[:, None]) / float(a["reg_sd"]))
        closed = np.diff(np.concatenate([np.zeros((len(mu), 1)), cdf], axis=1), axis=1)
        out = np.zeros((x.shape[0], nb))
        out[:, :-1] = (1.0 - p_cap)[:, None] * closed
        out[:, -1] = p_cap + (1.0 - p_cap) * (1.0 - cdf[:, -1])
        return out

    def save(self, path: Path) -> None:
        np.savez(path, **self.arrays)

    @classmethod
    def load(cls, path: Path, kind: str, spec: BucketSpec) -> LinearHead:
        if not path.is_file():
            raise ArtifactError(f"served-model predictor is missing its head file {path}")
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {k: np.asarray(data[k]) for k in data.files}
        except (OSError, ValueError) as exc:
            raise ArtifactError(f"{path}: not a readable head file: {exc}") from exc
        return cls(kind=kind, spec=spec, arrays=arrays)


def group_folds(groups: np.ndarray, k: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``k`` (train rows, test rows) splits in which all rows of one group (one prompt answered several times)
    fall on the same side, groups shuffled by ``seed``; ``k`` is capped at the number of groups."""
    from sklearn.model_selection import KFold

    groups = np.asarray(groups)
    uniq = np.unique(groups)
    k = min(k, len(uniq))
    if k < 2:
        raise ValueError("cross-validation needs at least 2 groups")
    out = []
    for _, test_groups in KFold(k, shuffle=True, random_state=seed).split(uniq):
        test = np.isin(groups, uniq[test_groups])
        out.append((np.flatnonzero(~test), np.flatnonzero(test)))
    return out


def fit_head(x: np.ndarray, lengths: np.ndarray, spec: BucketSpec, kind: str = "two-stage",
             seed: int = 0, groups: np.ndarray | None = None) -> LinearHead:
    """Fit a head on training rows; regularisation chosen by 5-fold CV on these rows only.

    ``groups`` (one id per row, default: every row its own) keeps the rows of one prompt in one fold, so a
    prompt answered several times (several sampled lengths, one row each) never scores its own answers."""
    from sklearn.linear_model import LogisticRegressionCV, RidgeCV

    if kind not in HEAD_KINDS:
        raise ValueError(f"unknown head kind {kind!r}; expected one of {HEAD_KINDS}")
    x = np.asarray(x, dtype=np.float64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if x.ndim != 2 or x.shape[0] != lengths.shape[0] or x.shape[0] < 10:
        raise ValueError("need a 2-d feature matrix with one row per length and at least 10 rows")
    groups = np.arange(len(lengths)) if groups is None else np.asarray(groups)
    if groups.shape != lengths.shape:
        raise ValueError(f"{groups.shape[0]} group ids for {lengths.shape[0]} rows")
    mean, scale = x.mean(axis=0), x.std(axis=0)
    scale[scale == 0] = 1.0
    z = (x - mean) / scale
    cs = np.logspace(-4, 1, 8)
    buckets = spec.buckets_of(lengths)
    if kind == "multinomial":
        # one row per (prompt, bucket), weighted by its count: the same fit as one row per answer, fewer rows
        codes = np.unique(groups, return_inverse=True)[1]
        _, first, counts = np.unique(np.stack([codes, buckets], axis=1), axis=0, return_index=True,
                                     return_counts=True)
        clf = LogisticRegressionCV(Cs=cs, cv=group_folds(codes[first], 5, seed), max_iter=3000,
                                   scoring="neg_log_loss", l1_ratios=(0.0,), use_legacy_attributes=True)
        clf.fit(z[first], buckets[first], sample_weight=counts.astype(np.float64))
        w, b = clf.coef_, clf.intercept_
        if len(clf.classes_) == 2:  # a binary fit has one logit (class 1 vs 0): softmax over (0, logit) is the same
            w, b = np.vstack([np.zeros_like(w), w]), np.concatenate([np.zeros_like(b), b])
        return LinearHead(kind, spec, {"mean": mean, "scale": scale, "w": w, "b": b,
                                       "classes": clf.classes_.astype(np.int64)})
    cap = (buckets == spec.num_buckets - 1).astype(np.int64)
    if cap.min() == cap.max():
        raise ValueError("the two-stage head needs training answers both in and below the open last bucket")
    clf = LogisticRegressionCV(Cs=cs, cv=group_folds(groups, 5, seed), max_iter=3000, scoring="neg_log_loss",
                               l1_ratios=(0.0,), use_legacy_attributes=True).fit(z, cap)
    rest = cap == 0
    target = np.log1p(lengths[rest].astype(np.float64))
    alphas = np.logspace(-1, 4, 12)
    reg = RidgeCV(alphas=alphas).fit(z[rest], target)
    resid = []
    for a, b in group_folds(groups[rest], 5, seed):
        r = RidgeCV(alphas=alphas).fit(z[rest][a], target[a])
        resid.append(r.predict(z[rest][b]) - target[b])
    sd = max(float(np.std(np.concatenate(resid))), 1e-3)
    return LinearHead(kind, spec, {"mean": mean, "scale": scale, "cap_w": clf.coef_[0],
                                   "cap_b": np.array(clf.intercept_[0]), "reg_w": reg.coef_,
                                   "reg_b": np.array(reg.intercept_), "reg_sd": np.array(sd)})


def train_own_predictor(instructions: Sequence[str], lengths: Sequence[int | Sequence[int]], model_dir: str | Path,
                        out: str | Path, spec: BucketSpec, *, target: str, features: np.ndarray | None = None,
                        feature_config: OwnFeatureConfig | None = None, head_kind: str = "two-stage",
                        num_threads: int | None = 1, hash_texts: Sequence[str] | None = None) -> PredictorMeta:
    """Extract features of every instruction (as a served chat request) with the served model, fit the
    head, and write the predictor folder ``out``.

    ``lengths`` gives each instruction's answer length, or several (sampled answers): the head then fits one
    row per answer, the rows of one instruction kept in one cross-validation fold.
    ``features`` (rows in instruction order, made with ``feature_config``) skips the extraction;
    ``hash_texts`` are the texts whose hashes mark the training prompts (default: the instructions;
    pass the served-form texts to match a length dataset's prompts)."""
    from tetriinfer.predictor.target_tokenizer import load_tokenizer, tokenizer_info

    config = feature_config or OwnFeatureConfig()
    if len(instructions) != len(lengths):
        raise ValueError(f"{len(instructions)} instructions but {len(lengths)} lengths")
    model_dir = Path(model_dir).absolute()
    tok = load_tokenizer(model_dir)
    ids = [served_prompt_ids(tok, s) for s in instructions]
    if features is None:
        features = FeatureExtractor(model_dir, config, num_threads).features(ids, progress=len(ids) >= 50)
    if features.shape[0] != len(ids):
        raise ValueError(f"{features.shape[0]} feature rows for {len(ids)} instructions")
    per_prompt = [[int(v)] if isinstance(v, (int, np.integer)) else [int(n) for n in v] for v in lengths]
    if any(not v for v in per_prompt):
        raise ValueError("every instruction needs at least one length")
    rows = np.concatenate([np.full(len(v), i) for i, v in enumerate(per_prompt)])  # the instruction of each answer
    y = np.array([n for v in per_prompt for n in v], dtype=np.int64)
    head = fit_head(features[rows], y, spec, head_kind, groups=rows)
    ptoks = np.array([len(ids[i]) for i in rows])
    meta = PredictorMeta(
        spec=spec, target=target, target_tokenizer=tokenizer_info(model_dir, tok), base_model=str(model_dir),
        max_length=config.max_prompt_tokens,
        train_histogram=tuple(int(c) for c in np.bincount(spec.buckets_of(y), minlength=spec.num_buckets)),
        length_baseline=LengthBaseline.fit(ptoks, y),
        train_prompt_hashes=frozenset(prompt_hash(t) for t in (hash_texts or instructions)),
        train_config={"kind": KIND, "head": head_kind, "features": config.to_json(),
                      "model_fingerprint": model_fingerprint(model_dir), "train_prompts": len(ids),
                      "train_answers": int(len(y))},
    )
    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    head.save(dest / HEAD_FILE)
    meta.save(dest)
    return meta


def is_own_predictor(folder: str | Path) -> bool:
    """Whether ``folder`` holds a served-model predictor (as opposed to a fine-tuned classifier)."""
    path = Path(folder) / META_FILE
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("train_config", {}).get("kind") == KIND
    except (json.JSONDecodeError, AttributeError):
        return False


def _load_meta(folder: str | Path) -> PredictorMeta:
    try:
        return PredictorMeta.load(folder)
    except (ValueError, FileNotFoundError) as exc:
        raise ArtifactError(str(exc)) from exc


class OwnModelPredictor:
    """A served-model predictor folder ready to predict from prompt token ids (``predict_ids``) or text
    (``predict``: each text is encoded as a plain-text prompt). Thread-safe (one prompt at a time)."""

    def __init__(self, extractor: FeatureExtractor, head: LinearHead, meta: PredictorMeta) -> None:
        self.extractor = extractor
        self.head = head
        self.meta = meta
        self.spec = meta.spec
        self._lock = threading.Lock()

    @classmethod
    def load(cls, folder: str | Path, model_dir: str | Path | None = None,
             num_threads: int | None = 1) -> OwnModelPredictor:
        """Load ``folder``; the served model comes from ``model_dir`` (default: the recorded folder) and
        must match the recorded fingerprint. Raises ``ArtifactError`` on a malformed or mismatched folder."""
        meta = _load_meta(folder)
        tc = meta.train_config
        if tc.get("kind") != KIND:
            raise ArtifactError(f"{folder} is not a served-model predictor (train_config kind {tc.get('kind')!r})")
        try:
            config = OwnFeatureConfig.from_json(tc["features"])
            head_kind, fingerprint = str(tc["head"]), str(tc["model_fingerprint"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(f"{folder}/{META_FILE}: bad served-model train_config: {exc}") from exc
        head = LinearHead.load(Path(folder) / HEAD_FILE, head_kind, meta.spec)
        mdir = Path(model_dir) if model_dir is not None else Path(meta.base_model)
        if not (mdir / "config.json").is_file():
            raise ArtifactError(f"served model folder {mdir} not found; pass the model folder explicitly")
        if model_fingerprint(mdir) != fingerprint:
            raise ArtifactError(f"the model in {mdir} is not the one this predictor was trained with")
        extractor = FeatureExtractor(mdir, config, num_threads)
        if extractor.num_features != head.num_features:
            raise ArtifactError(f"the head expects {head.num_features} features, the model gives "
                                f"{extractor.num_features}")
        return cls(extractor, head, meta)

    def predict_ids_probs(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        with self._lock:
            return self.head.probs(self.extractor.features(prompts))

    def predict_ids(self, prompts: Sequence[Sequence[int]]) -> list[Prediction]:
        return [Prediction.from_probs(self.spec, row) for row in self.predict_ids_probs(prompts)]

    def predict(self, prompts: Sequence[str]) -> list[Prediction]:
        ids = [list(self.extractor.tokenizer.encode(p)) for p in prompts]
        return self.predict_ids(ids)


def in_band_layers(config: OwnFeatureConfig, num_layers: int) -> tuple[int, ...] | None:
    """The decoder layers whose outputs a serving prefill must keep (at each prompt's last token) to compute
    ``config``'s features itself, or None when it cannot: the features must be last-token hidden states of
    inner layers only (``1 <= layer < num_layers``: the raw residual stream after that many layers), with no
    mean pooling (it needs every prompt position) and no greedy steps (they need decoding)."""
    if (config.prefix_steps or config.pooling != ("last",) or not config.layers
            or not all(1 <= x < num_layers for x in config.layers)):
        return None
    return config.layers


class InBandHead:
    """A served-model predictor that rides the serving prefill: the prefill keeps the hidden states of
    ``layers`` at each prompt's last token (``ModelRunner.capture``), and this head turns them into the
    prediction, so no second model runs. Same features as ``FeatureExtractor`` (the states, then the log of
    the prompt length capped at ``max_prompt_tokens``) except for numerics: the serving model's dtype, and the
    whole prompt attended to where the extractor keeps the last ``max_prompt_tokens``."""

    def __init__(self, head: LinearHead, meta: PredictorMeta, config: OwnFeatureConfig,
                 layers: tuple[int, ...]) -> None:
        self.head, self.meta, self.config, self.layers = head, meta, config, layers
        self.spec = meta.spec

    @classmethod
    def load(cls, folder: str | Path, model_dir: str | Path) -> InBandHead | None:
        """The head of ``folder`` for the model in ``model_dir``, or None when its features cannot be taken
        from a serving prefill (``in_band_layers``). ``ArtifactError`` on a malformed folder or another model."""
        meta = _load_meta(folder)
        tc = meta.train_config
        if tc.get("kind") != KIND:
            return None
        try:
            config = OwnFeatureConfig.from_json(tc["features"])
            head_kind, fingerprint = str(tc["head"]), str(tc["model_fingerprint"])
            num_layers = int(json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
                             ["num_hidden_layers"])
        except (KeyError, TypeError, ValueError, OSError) as exc:
            raise ArtifactError(f"{folder}: bad served-model predictor or model config: {exc}") from exc
        layers = in_band_layers(config, num_layers)
        if layers is None:
            return None
        if model_fingerprint(model_dir) != fingerprint:
            raise ArtifactError(f"the model in {model_dir} is not the one this predictor was trained with")
        head = LinearHead.load(Path(folder) / HEAD_FILE, head_kind, meta.spec)
        return cls(head, meta, config, layers)

    def features(self, states: np.ndarray, prompt_tokens: int) -> np.ndarray:
        """``states``: ``(len(layers) * hidden,)`` last-token states in ``layers`` order -> one feature row."""
        if prompt_tokens < 1:
            raise ValueError("an empty prompt has no features")
        n = min(prompt_tokens, self.config.max_prompt_tokens)
        return np.concatenate([np.asarray(states, dtype=np.float64).ravel(), np.array([math.log(n)])])

    def predict(self, states: np.ndarray, prompt_tokens: int) -> Prediction:
        return Prediction.from_probs(self.spec, self.head.probs(self.features(states, prompt_tokens))[0])
