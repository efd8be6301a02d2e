"""The default length predictor: trained on the default model's own output lengths, made on first use.

The package ships ``data/smollm2_lengths.jsonl``: one line per AlpacaEval instruction with the number of
tokens SmolLM2-135M-Instruct (the default served model) generated for it through our own server
(chat endpoint, greedy, natural ending, ``max_tokens`` 1024; all 805 instructions, half of them cut at the
1024 cap by the 135M model's repetition loops), collected with
``tetriinfer predictor build-dataset --collect-from URL --chat``. ``default_predictor_path`` turns it into a
trained predictor in the cache (``<cache>/predictors/smollm2-135m-instruct-g100``) the first time it is
asked for; ``tetriinfer predictor build-default`` does the same explicitly; ``serve --predictor default``
uses it.

Invariants:
- The predictor is trained on prompts in the form it sees when serving: the serving hook decodes a
  request's prompt ids with ``skip_special_tokens=True``, so each instruction is rendered through the
  model's chat template (one user turn, generation prompt) and decoded the same way before training.
- The split into training and held-out prompts is by instruction (prompt hash, seed 0), as for every
  dataset; the held-out prompts never reach training.
- A predictor folder is published atomically (built in a temporary sibling, renamed into place), so a
  concurrent or interrupted build never leaves a half-written folder that looks complete.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_GRANULARITY = 100
DEFAULT_MAX_LENGTH_TOKENS = 1000  # answers capped at 1024 tokens share the open last bucket [1000, inf)
LENGTHS_FILE = "smollm2_lengths.jsonl"
# The default model's answers to the 805 AlpacaEval instructions (chat endpoint, natural endings, max_tokens
# 1024), by how they were decoded: greedy, or sampled at temperature 0.7 (each prompt's seed derived from its
# text: ``collect.prompt_seed(prompt, s)``). Same prompts, same order in every file.
SHIPPED_LENGTHS = {"greedy": LENGTHS_FILE, "sampled": "smollm2_lengths_t07.jsonl"}
# Every shipped answer set of a kind, first the one ``SHIPPED_LENGTHS`` names: sampled serving has three
# answers per prompt (sample seeds s = 0, 1, 2), since one sampled length is a noisy label of a prompt.
SHIPPED_SAMPLES = {"greedy": (LENGTHS_FILE,),
                   "sampled": ("smollm2_lengths_t07.jsonl", "smollm2_lengths_t07_seed1.jsonl",
                               "smollm2_lengths_t07_seed2.jsonl")}
HELD_OUT_SEED = 0  # the default predictor's split of the shipped prompts (``dataset.DatasetConfig`` defaults)
HELD_OUT_FRACTION = 0.2


def shipped_lengths_path(kind: str = "greedy") -> Path:
    """The shipped lengths of the default model, ``kind`` one of ``SHIPPED_LENGTHS``."""
    if kind not in SHIPPED_LENGTHS:
        raise ValueError(f"no shipped lengths named {kind!r}; expected one of {', '.join(SHIPPED_LENGTHS)}")
    path = Path(str(resources.files("tetriinfer").joinpath("data", SHIPPED_LENGTHS[kind])))
    if not path.is_file():
        raise FileNotFoundError(f"shipped length data missing: {path}")
    return path


def shipped_sample_paths(kind: str = "greedy") -> list[Path]:
    """Every shipped answer set of ``kind`` (``SHIPPED_SAMPLES``), the one ``shipped_lengths_path`` gives first."""
    shipped_lengths_path(kind)  # the name check
    paths = [Path(str(resources.files("tetriinfer").joinpath("data", name))) for name in SHIPPED_SAMPLES[kind]]
    missing = [str(x) for x in paths if not x.is_file()]
    if missing:
        raise FileNotFoundError(f"shipped length data missing: {', '.join(missing)}")
    return paths


def read_length_samples(paths: list[Path]) -> tuple[list[str], list[list[int]]]:
    """The prompts of JSONL length files (``prompt`` + ``output_tokens`` per line), in order of first appearance,
    and each prompt's lengths in file order: a prompt answered several times (in one file or across files) has
    several. ValueError for a file with no lengths or a line without those fields."""
    lengths: dict[str, list[int]] = {}
    for path in paths:
        rows = [json.loads(x) for x in Path(path).read_text(encoding="utf-8").splitlines() if x.strip()]
        if not rows:
            raise ValueError(f"{path} holds no lengths")
        for i, row in enumerate(rows):
            try:
                prompt, n = str(row["prompt"]), int(row["output_tokens"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}: line {i + 1} needs prompt and output_tokens: {exc}") from exc
            lengths.setdefault(prompt, []).append(n)
    return list(lengths), list(lengths.values())


def served_prompt_text(tokenizer: Any, instruction: str) -> str:
    """What the serving predictor hook sees for a chat request holding ``instruction`` as the user turn."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": instruction}], add_generation_prompt=True)
    if not isinstance(ids, list):
        ids = list(ids["input_ids"])
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def write_served_form(lengths_file: Path, model_dir: Path, out_file: Path) -> int:
    """Rewrite a collected JSONL with every prompt in its served form; returns the line count."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    n = 0
    with lengths_file.open(encoding="utf-8") as src, out_file.open("w", encoding="utf-8") as dst:
        for line in src:
            if not line.strip():
                continue
            obj = json.loads(line)
            obj["prompt"] = served_prompt_text(tok, obj["prompt"])
            obj.pop("response_text", None)
            dst.write(json.dumps(obj, ensure_ascii=False) + "\n")
            n += 1
    return n


@contextmanager
def _written_whole(out: str | Path) -> Iterator[tuple[Path, Path]]:
    """Build a folder that appears at ``out`` whole or not at all: yields ``(staging, final)``, a scratch folder
    beside ``out`` and the path inside it to build the result at; on success ``final`` is renamed to ``out``, and
    the scratch folder is removed either way. ValueError: ``out`` exists and is not empty."""
    out = Path(out).expanduser().absolute()
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield staging, staging / "final"
        if out.exists():
            out.rmdir()
        (staging / "final").rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def build_default_predictor(out: str | Path, model_dir: str | Path | None = None, *,
                            num_threads: int | None = 1, epochs: int = 5) -> Path:
    """Build the served-form dataset from the shipped lengths and train the predictor into ``out``.

    Training fine-tunes every layer (lr 2e-4, 5 epochs, selection by accuracy on the dev part carved from
    the training prompts): the recipe evaluated on held-out instructions in docs/predictor.md."""
    from tetriinfer.engine.make_model import default_model_path
    from tetriinfer.predictor.dataset import DatasetConfig, build_dataset
    from tetriinfer.predictor.train import TrainConfig, train_predictor

    model = Path(model_dir) if model_dir is not None else default_model_path()
    with _written_whole(out) as (staging, final):
        served = staging / "lengths_served.jsonl"
        write_served_form(shipped_lengths_path(), model, served)
        config = DatasetConfig(granularity=DEFAULT_GRANULARITY, max_tokens=DEFAULT_MAX_LENGTH_TOKENS)
        dataset = build_dataset([served], model, config, target=DEFAULT_TARGET)
        dataset.save(staging / "dataset")
        train_predictor(dataset, staging / "predictor",
                        config=TrainConfig(epochs=epochs, num_threads=num_threads, max_length=128,
                                           train_layers=-1, lr=2e-4, select="accuracy"))
        served.unlink()
        (staging / "predictor").rename(final)
        shutil.move(str(staging / "dataset"), str(final / "dataset"))
    return Path(out).expanduser().absolute()


def _cached_predictor(name: str, build: Callable[[Path], Path], cache: str | Path | None) -> Path:
    """``predictors/name`` in the cache, made by ``build`` (which writes it whole or not at all) unless there."""
    from tetriinfer.engine.make_model import cache_dir
    from tetriinfer.predictor.artifact import META_FILE

    root = Path(cache).expanduser() if cache is not None else cache_dir()
    target = (root / "predictors" / name).absolute()
    if (target / META_FILE).is_file():
        return target
    try:
        build(target)
    except (ValueError, OSError):
        if not (target / META_FILE).is_file():  # not a lost race: a real failure
            raise
    return target


def default_predictor_path(cache: str | Path | None = None) -> Path:
    """The default predictor in the cache, trained on first use (minutes on a CPU; progress is shown)."""
    return _cached_predictor(f"{DEFAULT_TARGET}-g{DEFAULT_GRANULARITY}", build_default_predictor, cache)


# The served-model predictor for sampled serving (docs/predictor.md, "Sampled lengths"): layer 20's hidden state at
# the last prompt token (one prefill of the served model per prompt, no decoding), multinomial head over the buckets.
SAMPLED_LAYERS = (20,)
SAMPLED_POOLING = ("last",)
SAMPLED_HEAD = "multinomial"


def training_part(instructions: list[str], model_dir: str | Path, val_fraction: float = HELD_OUT_FRACTION,
                  seed: int = HELD_OUT_SEED) -> tuple[list[int], list[str]]:
    """The indices of the instructions in the training part of the split by served-form prompt hash
    (``dataset.split_of``; the defaults are the default predictor's split), and every instruction's served form."""
    from transformers import AutoTokenizer

    from tetriinfer.predictor.dataset import split_of

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    served = [served_prompt_text(tok, text) for text in instructions]
    keep = [i for i, text in enumerate(served) if val_fraction == 0 or split_of(text, seed, val_fraction) == "train"]
    return keep, served


SAMPLED_NAME = f"{DEFAULT_TARGET}-sampled-g{DEFAULT_GRANULARITY}"


def shipped_sampled_predictor() -> Path | None:
    """The sampled-serving predictor as shipped in the package (``data/predictors/``; made by
    ``build_sampled_predictor(..., reuse_shipped=False)`` on the default model), or None when it is missing."""
    path = Path(str(resources.files("tetriinfer").joinpath("data", "predictors", SAMPLED_NAME)))
    return path if (path / "predictor.json").is_file() else None


def shipped_predictor_fits(model_dir: str | Path) -> bool:
    """Whether the shipped sampled-serving predictor was trained with the model in ``model_dir`` (same
    fingerprint: config and weights)."""
    from tetriinfer.predictor.own import model_fingerprint

    shipped = shipped_sampled_predictor()
    if shipped is None or not (Path(model_dir) / "config.json").is_file():
        return False
    meta = json.loads((shipped / "predictor.json").read_text(encoding="utf-8"))
    return str(meta.get("train_config", {}).get("model_fingerprint")) == model_fingerprint(model_dir)


def build_sampled_predictor(out: str | Path, model_dir: str | Path | None = None, *,
                            num_threads: int | None = 1, reuse_shipped: bool = True) -> Path:
    """Train the served-model predictor on the default model's sampled (temperature 0.7) lengths of the training
    prompts (the default predictor's split; all three shipped answers of each) into ``out``, written whole or not
    at all (a staging folder renamed into place). For the model the package's copy was trained with, that copy is
    used (``reuse_shipped``) instead of training again (one prefill per prompt plus the fit: minutes)."""
    from tetriinfer.engine.make_model import default_model_path
    from tetriinfer.predictor.buckets import BucketSpec
    from tetriinfer.predictor.own import OwnFeatureConfig, train_own_predictor

    model = Path(model_dir) if model_dir is not None else default_model_path()
    shipped = shipped_sampled_predictor()
    if reuse_shipped and shipped is not None and shipped_predictor_fits(model):  # the same recipe, already run
        with _written_whole(out) as (_, final):
            shutil.copytree(shipped, final)
        return Path(out).expanduser().absolute()
    prompts, samples = read_length_samples(shipped_sample_paths("sampled"))
    # the default predictor's split: its held-out prompts stay unseen here too, so a benchmark on them
    # (bench.real_workloads) meets the predictor's real errors
    keep, served = training_part(prompts, model)
    config = OwnFeatureConfig(layers=SAMPLED_LAYERS, pooling=SAMPLED_POOLING, prefix_steps=0)
    spec = BucketSpec.for_granularity(DEFAULT_GRANULARITY, DEFAULT_MAX_LENGTH_TOKENS)
    with _written_whole(out) as (_, final):
        train_own_predictor([prompts[i] for i in keep], [samples[i] for i in keep], model,
                            final, spec, target=DEFAULT_TARGET, feature_config=config, head_kind=SAMPLED_HEAD,
                            num_threads=num_threads, hash_texts=[served[i] for i in keep])
    return Path(out).expanduser().absolute()


def sampled_predictor_path(cache: str | Path | None = None) -> Path:
    """The sampled-serving predictor in the cache, trained on first use (one prefill per shipped prompt: minutes)."""
    return _cached_predictor(SAMPLED_NAME, build_sampled_predictor, cache)


def resolve_predictor(spec: str, model_dir: str | Path | None = None) -> str:
    """``default`` -> the default predictor folder, ``sampled`` -> the sampled-serving one (each made on first
    use); ``auto`` -> the sampled-serving one where ``model_dir`` holds the model it was shipped for (it then
    predicts in-band, about 15 us per request), else ``none``; other specs unchanged."""
    if spec == "auto":
        return str(sampled_predictor_path()) if model_dir is not None and shipped_predictor_fits(model_dir) else "none"
    made = {"default": default_predictor_path, "sampled": sampled_predictor_path}.get(spec)
    return spec if made is None else str(made())
