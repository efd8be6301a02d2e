"""Offline API behaviour: sampling options, stop conditions, bad input, block accounting."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tetriinfer import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), chunk_size=64)


def _ids(out):
    return out.outputs[0].token_ids


def test_greedy_is_deterministic_and_top_k1_equals_greedy(llm):
    p = ["Once upon a time", "def add(a, b):"]
    a = llm.generate(p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    b = llm.generate(p, SamplingParams(max_tokens=10, temperature=0.9, top_k=1, ignore_eos=True))
    assert [_ids(x) for x in a] == [_ids(x) for x in b]


def test_seeded_sampling_reproducible_and_seed_sensitive(llm):
    mk = lambda seed: SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)  # noqa: E731
    a = llm.generate(["Tell me a story"] * 2, mk(7))
    b = llm.generate(["Tell me a story"], mk(7))
    c = llm.generate(["Tell me a story"], mk(8))
    assert _ids(a[0]) == _ids(a[1]) == _ids(b[0])
    assert _ids(b[0]) != _ids(c[0])


def test_max_tokens_min_tokens_and_stop_token_ids(llm):
    out = llm.generate(["abc"], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))[0]
    assert len(_ids(out)) == 7 and out.outputs[0].finish_reason == "length"
    greedy = _ids(out)
    stop_id = greedy[3]
    first = greedy.index(stop_id)
    out = llm.generate(["abc"], SamplingParams(max_tokens=7, temperature=0.0, stop_token_ids=[stop_id]))[0]
    assert _ids(out) == greedy[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    # min_tokens suppresses the stop token until reached
    out = llm.generate(["abc"], SamplingParams(max_tokens=7, min_tokens=first + 2, temperature=0.0,
                                               stop_token_ids=[stop_id]))[0]
    assert stop_id not in _ids(out)[: first + 2]


def test_stop_strings_truncate_text(llm):
    full = llm.generate(["The sea"], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    text = full.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate(["The sea"], SamplingParams(max_tokens=20, temperature=0.0, stop=[stop], ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop
    assert out.outputs[0].text == text[: text.find(stop)]


def test_logprobs_match_log_softmax(llm):
    llm.engine.runner.logits_sink = {}
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, ignore_eos=True))[0]
    logits = llm.engine.runner.logits_sink[out.request_id]
    llm.engine.runner.logits_sink = None
    for step, lp in enumerate(out.outputs[0].logprobs):
        ref = torch.log_softmax(logits[step], -1)
        tok = out.outputs[0].token_ids[step]
        assert abs(lp[tok] - ref[tok].item()) < 1e-5
        assert len(lp) in (2, 3)


def test_all_blocks_freed_after_generate(llm):
    llm.generate(["x " * 100] * 5, SamplingParams(max_tokens=5, temperature=0.0))
    kv = llm.engine.kv_manager
    assert kv.num_used_blocks == 0
    kv.check_invariants()


def test_bad_input_gives_clear_errors(llm, tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="context"):
        llm.generate([{"prompt_token_ids": [5] * 5000}], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="at least one prompt"):
        llm.generate([], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.engine.add_request("bad", None, [10**7], SamplingParams(max_tokens=2))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"))
    # a folder with an unknown architecture
    bad = tmp_path / "bad_arch"
    shutil.copytree(tiny_llama, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="supported: .*LlamaForCausalLM"):
        LLM(model=str(bad))
    # a folder without weights
    noweights = tmp_path / "no_weights"
    shutil.copytree(tiny_llama, noweights)
    (noweights / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights"):
        LLM(model=str(noweights))
    # the engine still works after all of that: nothing was left queued
    assert not llm.engine.has_unfinished()
    out = llm.generate(["ok"], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(_ids(out[0])) >= 1


def test_dummy_load_format_needs_only_config(tiny_llama, tmp_path):
    cfg_only = tmp_path / "cfg_only"
    cfg_only.mkdir()
    shutil.copy(tiny_llama / "config.json", cfg_only / "config.json")
    llm = LLM(model=str(cfg_only), load_format="dummy")
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(_ids(out[0])) == 3


def test_cli_errors_are_clean(capsys, tmp_path):
    from tetriinfer.cli import main

    rc = main(["profile", "--model", str(tmp_path / "missing")])
    assert rc == 2
    assert "does not exist" in capsys.readouterr().err
