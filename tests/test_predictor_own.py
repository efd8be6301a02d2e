"""The served-model predictor: train on a small fixture, save, load, predict deterministically; bad folders
fail with a clear error; the prefill hook feeds it the prompt's token ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tetriinfer.predictor.buckets import BucketSpec
from tetriinfer.predictor.own import (
    HEAD_FILE,
    ArtifactError,
    LinearHead,
    OwnFeatureConfig,
    OwnModelPredictor,
    fit_head,
    group_folds,
    is_own_predictor,
    prefix_statistics,
    train_own_predictor,
)

SPEC = BucketSpec.for_granularity(100, 1000)
CONFIG = OwnFeatureConfig(layers=(1,), pooling=("last", "mean"), prefix_steps=3)


def _fixture() -> tuple[list[str], list[int]]:
    prompts = [f"Question {i}: " + "word " * (i % 11) for i in range(30)]
    lengths = [1024 if i % 3 == 0 else 10 + 37 * (i % 7) for i in range(30)]
    return prompts, lengths


@pytest.fixture(scope="module")
def trained(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("own") / "pred"
    prompts, lengths = _fixture()
    train_own_predictor(prompts, lengths, tiny_llama, out, SPEC, target="tiny", feature_config=CONFIG)
    return out


def test_train_save_load_predict_is_deterministic(trained: Path, tiny_llama: Path) -> None:
    assert is_own_predictor(trained) and (trained / HEAD_FILE).is_file()
    meta = json.loads((trained / "predictor.json").read_text(encoding="utf-8"))
    assert meta["train_config"]["kind"] == "served-model" and meta["granularity"] == 100
    assert sum(meta["train_histogram"]) == 30 and len(meta["train_prompt_hashes"]) == 30
    a = OwnModelPredictor.load(trained, num_threads=1)
    ids = [[1, 2, 3, 4, 5], [7, 8, 9]]
    p1 = a.predict_ids_probs(ids)
    p2 = OwnModelPredictor.load(trained, model_dir=tiny_llama, num_threads=1).predict_ids_probs(ids)
    assert p1.shape == (2, SPEC.num_buckets)
    np.testing.assert_allclose(p1.sum(axis=1), 1.0, atol=1e-9)
    assert np.array_equal(p1, p2)  # same weights, same features, same head
    preds = a.predict_ids(ids)
    assert [p.bucket for p in preds] == [int(np.argmax(r)) for r in p1]
    assert all(p.lower == SPEC.lower(p.bucket) for p in preds)
    assert len(a.predict(["hello there"])) == 1


def test_bad_folders_fail_clearly(trained: Path, tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    broken = tmp_path / "no_head"
    shutil.copytree(trained, broken)
    (broken / HEAD_FILE).unlink()
    with pytest.raises(ArtifactError, match="missing its head file"):
        OwnModelPredictor.load(broken)

    garbled = tmp_path / "garbled"
    shutil.copytree(trained, garbled)
    (garbled / HEAD_FILE).write_bytes(b"not an npz")
    with pytest.raises(ArtifactError, match="not a readable head file"):
        OwnModelPredictor.load(garbled)

    wrong_shape = tmp_path / "wrong_shape"
    shutil.copytree(trained, wrong_shape)
    with np.load(trained / HEAD_FILE) as data:
        arrays = {k: data[k] for k in data.files}
    arrays["scale"] = arrays["scale"][:-1]
    np.savez(wrong_shape / HEAD_FILE, **arrays)
    with pytest.raises(ArtifactError, match="disagree on the feature count"):
        OwnModelPredictor.load(wrong_shape)

    with pytest.raises(ArtifactError, match="not the one this predictor was trained with"):
        OwnModelPredictor.load(trained, model_dir=tiny_models["qwen2"])
    with pytest.raises(ArtifactError, match="not a predictor folder"):
        OwnModelPredictor.load(tmp_path)


def test_two_stage_head_puts_cap_mass_in_the_open_bucket() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 3))
    loops = x[:, 0] > 0  # the first feature decides whether the answer runs to the cap
    lengths = np.where(loops, 1024, np.exp(3.5 + 0.8 * x[:, 1]).astype(np.int64))
    head = fit_head(x, lengths, SPEC, "two-stage")
    probs = head.probs(np.array([[3.0, 0.0, 0.0], [-3.0, 0.0, 0.0]]))
    assert probs[0].argmax() == SPEC.num_buckets - 1 and probs[1].argmax() == 0
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-9)
    with pytest.raises(ArtifactError, match="unknown head kind"):
        LinearHead("nope", SPEC, {})


def test_folds_keep_every_answer_of_a_prompt_on_one_side() -> None:
    from sklearn.model_selection import KFold

    groups = np.repeat(np.arange(20), 3)  # 20 prompts answered 3 times each
    folds = group_folds(groups, 5, seed=0)
    assert len(folds) == 5
    assert sorted(np.concatenate([test for _, test in folds]).tolist()) == list(range(60))  # each row tested once
    for train, test in folds:
        assert not set(groups[train]) & set(groups[test])
    # one answer per prompt: exactly the row folds the head was always fit with
    single = group_folds(np.arange(30), 5, seed=3)
    for (a, b), (c, d) in zip(single, KFold(5, shuffle=True, random_state=3).split(np.zeros(30)), strict=True):
        assert a.tolist() == c.tolist() and b.tolist() == d.tolist()
    with pytest.raises(ValueError, match="at least 2 groups"):
        group_folds(np.zeros(10), 5, seed=0)
    with pytest.raises(ValueError, match="group ids"):
        fit_head(np.zeros((12, 2)), np.arange(12), SPEC, "multinomial", groups=np.arange(11))


def test_multinomial_head_on_repeated_answers_is_the_weighted_fit() -> None:
    """Several answers per prompt fit as one weighted row per (prompt, bucket): the probabilities follow how
    often each bucket was answered, not one draw."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(60, 2))
    # each prompt answered 4 times: short (bucket 0) with probability sigmoid(3 * x0), else long (bucket 5)
    p_short = 1 / (1 + np.exp(-3 * x[:, 0]))
    answers = np.where(rng.random((60, 4)) < p_short[:, None], 30, 520)
    rows = np.repeat(np.arange(60), 4)
    head = fit_head(x[rows], answers.ravel(), SPEC, "multinomial", groups=rows)
    probs = head.probs(np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 0.0]]))
    assert probs[0, 0] > 0.8 and probs[1, 5] > 0.8 and 0.25 < probs[2, 0] < 0.75
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-9)


def test_prefix_statistics_see_the_end_token() -> None:
    ended = prefix_statistics(np.ones(4), np.full(4, 0.95), [5, 6, 2, 9], {2})
    running = prefix_statistics(np.ones(4), np.full(4, 0.95), [5, 5, 5, 5], {2})
    assert ended[8] == 1.0 and ended[9] == 0.5 and ended[10] == 1.0
    assert running[8] == 0.0 and running[9] == 1.0 and running[10] == 0.25


def test_prefill_hook_feeds_token_ids(trained: Path, tiny_llama: Path) -> None:
    from tetriinfer.runtime.predictor_hook import make_predictor_hook

    hook = make_predictor_hook(str(trained), None, str(tiny_llama))
    assert hook is not None and getattr(hook, "takes_ids", False)
    direct = OwnModelPredictor.load(trained).predict_ids([[1, 2, 3]])[0]
    bucket, lower, _upper = hook.predict_one([1, 2, 3], None)
    assert (bucket, lower) == (direct.bucket, direct.lower)
    assert len(hook.predict_many([[1, 2], [3, 4, 5]], [None, None])) == 2


def test_server_uses_a_served_model_predictor(trained: Path, tiny_llama: Path) -> None:
    import httpx

    from tests.serve_helpers import ServeProcess

    srv = ServeProcess(tiny_llama, "--mode", "tetriinfer", "--prefill-instances", "1", "--decode-instances", "1",
                       "--predictor", str(trained), "--predictor-mode", "sequential")
    try:
        for i in range(3):
            body = {"model": "llama", "prompt": f"p {i}", "max_tokens": 8, "temperature": 0}
            r = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
        assert srv.predictions(at_least=3) >= 3
    finally:
        assert srv.stop() == 0


def test_cli_train_own_takes_the_pooling_and_head_it_is_given(tmp_path: Path, tiny_llama: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from tetriinfer.cli import main

    prompts, lengths = _fixture()
    data = tmp_path / "lengths.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "output_tokens": n}) + "\n" for p, n in zip(prompts, lengths, strict=True)),
                    encoding="utf-8")
    out = tmp_path / "pred"
    assert main(["predictor", "train-own", "--lengths", str(data), "--model", str(tiny_llama), "--out", str(out),
                 "--layers", "1", "--pooling", "last", "--prefix-steps", "0", "--head", "multinomial"]) == 0
    tc = json.loads((out / "predictor.json").read_text(encoding="utf-8"))["train_config"]
    assert tc["head"] == "multinomial"
    assert tc["features"]["layers"] == [1] and tc["features"]["pooling"] == ["last"] and tc["features"]["prefix_steps"] == 0
    pred = OwnModelPredictor.load(out, num_threads=1)
    hidden = json.loads((tiny_llama / "config.json").read_text(encoding="utf-8"))["hidden_size"]
    assert pred.extractor.num_features == hidden + 1  # the last token's state and the log prompt length
    capsys.readouterr()
    assert main(["predictor", "train-own", "--lengths", str(data), "--model", str(tiny_llama), "--out",
                 str(tmp_path / "p2"), "--pooling", "last"]) != 0
    assert "--pooling applies to hidden-state layers" in capsys.readouterr().err
    assert main(["predictor", "train-own", "--lengths", str(tmp_path / "missing.jsonl"), "--model", str(tiny_llama),
                 "--out", str(tmp_path / "p3")]) != 0
    assert "no such file" in capsys.readouterr().err
    assert main(["predictor", "train-own", "--lengths", str(data), "--model", str(tiny_llama), "--out",
                 str(tmp_path / "p4"), "--layers", "1", "--hold-out", "1.5"]) != 0
    assert "--hold-out must be in [0, 1)" in capsys.readouterr().err
    assert not any((tmp_path / p).exists() for p in ("p2", "p3", "p4"))  # nothing written


def test_cli_train_own_trains_on_every_answer_of_prompts_answered_several_times(tmp_path: Path,
                                                                              tiny_llama: Path) -> None:
    from tetriinfer.cli import main

    prompts, lengths = _fixture()
    files = []
    for seed in range(2):  # two sampled answer sets of the same prompts, the second one a little longer
        f = tmp_path / f"seed{seed}.jsonl"
        f.write_text("".join(json.dumps({"prompt": p, "output_tokens": n + 50 * seed}) + "\n"
                             for p, n in zip(prompts, lengths, strict=True)), encoding="utf-8")
        files.append(str(f))
    out = tmp_path / "pred"
    assert main(["predictor", "train-own", "--lengths", *files, "--model", str(tiny_llama), "--out", str(out),
                 "--layers", "1", "--pooling", "last", "--prefix-steps", "0", "--head", "multinomial"]) == 0
    meta = json.loads((out / "predictor.json").read_text(encoding="utf-8"))
    assert meta["train_config"]["train_prompts"] == len(prompts) and meta["train_config"]["train_answers"] == 2 * len(prompts)
    both = np.concatenate([np.array(lengths), np.array(lengths) + 50])
    assert meta["train_histogram"] == np.bincount(SPEC.buckets_of(both), minlength=SPEC.num_buckets).tolist()


def test_cli_train_own_holds_out_the_split_it_is_asked_to(tmp_path: Path, tiny_llama: Path) -> None:
    from transformers import AutoTokenizer

    from tetriinfer.cli import main
    from tetriinfer.predictor.dataset import prompt_hash, split_of
    from tetriinfer.predictor.default import served_prompt_text

    prompts, lengths = _fixture()
    data = tmp_path / "lengths.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "output_tokens": n}) + "\n" for p, n in zip(prompts, lengths, strict=True)),
                    encoding="utf-8")
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    served = [served_prompt_text(tok, p) for p in prompts]
    held = {prompt_hash(s) for s in served if split_of(s, 0, 0.3) == "val"}
    assert 0 < len(held) < len(prompts)
    for fraction, out in ((0.3, tmp_path / "part"), (0.0, tmp_path / "all")):
        assert main(["predictor", "train-own", "--lengths", str(data), "--model", str(tiny_llama), "--out", str(out),
                     "--layers", "1", "--pooling", "last", "--prefix-steps", "0", "--head", "multinomial",
                     "--hold-out", str(fraction)]) == 0
    part = json.loads((tmp_path / "part" / "predictor.json").read_text(encoding="utf-8"))
    whole = json.loads((tmp_path / "all" / "predictor.json").read_text(encoding="utf-8"))
    assert set(part["train_prompt_hashes"]) == {prompt_hash(s) for s in served} - held
    assert part["train_config"]["train_prompts"] == len(prompts) - len(held)
    assert set(whole["train_prompt_hashes"]) == {prompt_hash(s) for s in served}
