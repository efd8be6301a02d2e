"""The default predictor's data: the shipped lengths of the default model, and prompts in their served form."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tetriinfer.predictor.default import (
    resolve_predictor,
    served_prompt_text,
    shipped_lengths_path,
    write_served_form,
)
from tetriinfer.server.chat_template import render_chat, special_tokens_of


def test_shipped_lengths_are_the_default_models_own(tmp_path: Path, smollm2: Path) -> None:
    from transformers import AutoTokenizer

    rows = [json.loads(line) for line in shipped_lengths_path().read_text(encoding="utf-8").splitlines()]
    assert len(rows) >= 60
    assert len({r["prompt"] for r in rows}) == len(rows)  # one line per instruction
    assert {r["model"] for r in rows} == {"smollm2-135m-instruct"}
    assert all(isinstance(r["output_tokens"], int) and 1 <= r["output_tokens"] <= 1024 for r in rows)
    assert all(r["finish_reason"] == "stop" or r["output_tokens"] == 1024 for r in rows)  # cut only at the cap

    # The text the predictor trains on is exactly what the serving hook decodes from a chat request's ids.
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    instruction = rows[0]["prompt"]
    served_ids = tok.encode(render_chat(tok.chat_template, [{"role": "user", "content": instruction}],
                                        add_generation_prompt=True, special_tokens=special_tokens_of(tok)),
                            add_special_tokens=False)
    assert served_prompt_text(tok, instruction) == tok.decode(served_ids, skip_special_tokens=True)
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({**r, "response_text": "x"}) for r in rows[:3]) + "\n", encoding="utf-8")
    assert write_served_form(src, smollm2, tmp_path / "out.jsonl") == 3
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [o["output_tokens"] for o in out] == [r["output_tokens"] for r in rows[:3]]
    assert all("response_text" not in o and o["prompt"].startswith("system\n") for o in out)
    assert resolve_predictor("oracle") == "oracle" and resolve_predictor("/some/dir") == "/some/dir"


def test_shipped_sampled_lengths_answer_the_same_prompts_with_their_seeds() -> None:
    from tetriinfer.predictor.collect import prompt_seed

    greedy = [json.loads(line) for line in shipped_lengths_path("greedy").read_text(encoding="utf-8").splitlines()]
    sampled = [json.loads(line) for line in shipped_lengths_path("sampled").read_text(encoding="utf-8").splitlines()]
    assert [r["prompt"] for r in sampled] == [r["prompt"] for r in greedy]  # same prompts, same order
    assert {r["model"] for r in sampled} == {"smollm2-135m-instruct"} and {r["temperature"] for r in sampled} == {0.7}
    assert all(r["seed"] == prompt_seed(r["prompt"], 0) for r in sampled)  # reproducible: the collector's seeds
    assert all(r["finish_reason"] == "stop" or r["output_tokens"] == 1024 for r in sampled)
    # sampling ends more answers than greedy decoding does (greedy loops to the cap on about half the prompts)
    assert sum(r["output_tokens"] == 1024 for r in sampled) < sum(r["output_tokens"] == 1024 for r in greedy)


def test_sampled_serving_ships_three_answers_per_prompt_with_their_seeds() -> None:
    from tetriinfer.predictor.collect import prompt_seed
    from tetriinfer.predictor.default import read_length_samples, shipped_sample_paths

    paths = shipped_sample_paths("sampled")
    assert paths[0] == shipped_lengths_path("sampled") and len(paths) == 3
    sets = [[json.loads(x) for x in p.read_text(encoding="utf-8").splitlines() if x.strip()] for p in paths]
    assert all([r["prompt"] for r in rows] == [r["prompt"] for r in sets[0]] for rows in sets)  # same order
    for seed, rows in enumerate(sets):
        assert all(r["seed"] == prompt_seed(r["prompt"], seed) and r["temperature"] == 0.7 for r in rows)
        assert all(r["finish_reason"] == "stop" or r["output_tokens"] == 1024 for r in rows)
    prompts, samples = read_length_samples(paths)
    assert prompts == [r["prompt"] for r in sets[0]] and all(len(v) == 3 for v in samples)
    assert samples[0] == [rows[0]["output_tokens"] for rows in sets]
    # three draws of one prompt differ: one sampled length is a noisy label
    assert sum(len(set(v)) > 1 for v in samples) > 0.8 * len(samples)
    assert shipped_sample_paths("greedy") == [shipped_lengths_path("greedy")]


def test_length_samples_reader_rejects_bad_files(tmp_path: Path) -> None:
    from tetriinfer.predictor.default import read_length_samples

    empty, bad = tmp_path / "empty.jsonl", tmp_path / "bad.jsonl"
    empty.write_text("\n", encoding="utf-8")
    bad.write_text(json.dumps({"prompt": "a"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="holds no lengths"):
        read_length_samples([empty])
    with pytest.raises(ValueError, match="line 1 needs prompt and output_tokens"):
        read_length_samples([bad])


def test_unknown_shipped_lengths_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="greedy, sampled"):
        shipped_lengths_path("nucleus")


def test_sampled_predictor_is_made_once_in_the_cache_with_its_recipe(tmp_path: Path, tiny_llama: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from tetriinfer.predictor import default
    from tetriinfer.predictor.own import OwnModelPredictor

    mp = monkeypatch
    mp.setattr(default, "SAMPLED_LAYERS", (1,))  # the tiny model has 2 layers; the recipe's is 20 of 30
    mp.setattr("tetriinfer.engine.make_model.default_model_path", lambda: tiny_llama)
    path = default.sampled_predictor_path(tmp_path)
    assert path == tmp_path / "predictors" / "smollm2-135m-instruct-sampled-g100"
    tc = json.loads((path / "predictor.json").read_text(encoding="utf-8"))["train_config"]
    from transformers import AutoTokenizer

    from tetriinfer.predictor.dataset import prompt_hash, split_of

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    served = [default.served_prompt_text(tok, json.loads(x)["prompt"])
              for x in shipped_lengths_path("sampled").read_text(encoding="utf-8").splitlines() if x.strip()]
    held_out = {prompt_hash(s) for s in served if split_of(s, 0, 0.2) == "val"}  # the default predictor's split
    trained = set(json.loads((path / "predictor.json").read_text(encoding="utf-8"))["train_prompt_hashes"])
    assert 100 < len(held_out) < 250 and not trained & held_out  # a benchmark on held-out prompts meets real errors
    assert tc["head"] == "multinomial" and tc["train_prompts"] == len(trained) == 805 - len(held_out)
    assert tc["train_answers"] == 3 * tc["train_prompts"]  # every shipped sampled answer of those prompts
    assert tc["features"]["pooling"] == ["last"] and tc["features"]["prefix_steps"] == 0
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no staging folder left behind
    stamp = (path / "predictor.json").stat().st_mtime_ns
    assert default.sampled_predictor_path(tmp_path) == path  # made once: the second call reuses it
    assert (path / "predictor.json").stat().st_mtime_ns == stamp
    assert OwnModelPredictor.load(path, num_threads=1).predict_ids([[1, 2, 3]])[0].bucket >= 0


def test_shipped_sampled_predictor_follows_its_recipe_and_is_the_serve_default_for_its_model(
        smollm2: Path, tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoTokenizer

    from tetriinfer.predictor import default
    from tetriinfer.predictor.dataset import prompt_hash, split_of
    from tetriinfer.server.cli import add_cluster_args, cluster_config_from_args

    shipped = default.shipped_sampled_predictor()
    assert shipped is not None and shipped.name == default.SAMPLED_NAME
    meta = json.loads((shipped / "predictor.json").read_text(encoding="utf-8"))
    tc = meta["train_config"]
    assert tc["features"] == {"layers": list(default.SAMPLED_LAYERS), "pooling": list(default.SAMPLED_POOLING),
                              "prefix_steps": 0, "max_prompt_tokens": 1024}
    assert tc["head"] == default.SAMPLED_HEAD and tc["train_answers"] == 3 * tc["train_prompts"]
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    prompts, _ = default.read_length_samples(default.shipped_sample_paths("sampled"))
    served = [default.served_prompt_text(tok, p) for p in prompts]
    held_out = {prompt_hash(s) for s in served if split_of(s, 0, 0.2) == "val"}
    assert set(meta["train_prompt_hashes"]) == {prompt_hash(s) for s in served} - held_out
    # it fits the real model converted afresh, not another model
    assert default.shipped_predictor_fits(smollm2) and not default.shipped_predictor_fits(tiny_llama)

    monkeypatch.setenv("TETRIINFER_CACHE", str(tmp_path))
    resolved = default.resolve_predictor("auto", smollm2)
    assert Path(resolved) == tmp_path / "predictors" / default.SAMPLED_NAME
    # reused, not trained again: the cache holds the shipped files byte for byte
    assert (Path(resolved) / "head.npz").read_bytes() == (shipped / "head.npz").read_bytes()
    assert default.resolve_predictor("auto", tiny_llama) == "none" and default.resolve_predictor("auto") == "none"

    p = argparse.ArgumentParser()
    add_cluster_args(p)
    assert cluster_config_from_args(p.parse_args([]), str(smollm2)).predictor == resolved  # serve's default
    assert cluster_config_from_args(p.parse_args([]), str(tiny_llama)).predictor == "none"
    assert cluster_config_from_args(p.parse_args(["--predictor", "none"]), str(smollm2)).predictor == "none"
