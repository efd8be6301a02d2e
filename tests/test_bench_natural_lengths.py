"""Natural output lengths in the load client, and the real-prompt (AlpacaEval) workload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tetriinfer.bench.client import BenchmarkClient, ClientConfig
from tetriinfer.bench.workloads import load_workload


def test_natural_lengths_drop_ignore_eos_and_keep_the_cap(tiny_llama: Path, tmp_path: Path) -> None:
    data = tmp_path / "alpaca.json"
    data.write_text(json.dumps([{"instruction": f"Question number {i}?"} for i in range(3)]))
    wl = load_workload(f"alpaca:{data}", 5, rate=2.0, seed=1, tokenizer=str(tiny_llama), output_cap=300)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    assert len(wl) == 5 and {r.output_tokens for r in wl} == {300}
    for r in wl:
        assert r.prompt_text is not None and r.prompt_text.endswith("<|im_start|>assistant\n")
        assert r.prompt_tokens == len(tok.encode(r.prompt_text, add_special_tokens=False))
    assert len({r.prompt_text for r in list(wl)[:3]}) == 3  # without replacement while the file lasts
    req = next(iter(wl))
    natural = BenchmarkClient(ClientConfig("http://x", "m", output_lengths="natural")).payload(0, req)
    fixed = BenchmarkClient(ClientConfig("http://x", "m")).payload(0, req)
    assert natural["max_tokens"] == fixed["max_tokens"] == 300
    assert "ignore_eos" not in natural and "min_tokens" not in natural and natural["prompt"] == req.prompt_text
    assert fixed["ignore_eos"] is True and fixed["min_tokens"] == 300
    with pytest.raises(ValueError, match="output_lengths"):
        ClientConfig("http://x", "m", output_lengths="exact")
    with pytest.raises(ValueError, match="tokenizer"):
        load_workload("alpaca", 2, tokenizer=None)


def test_real_class_workloads_use_held_out_prompts_of_the_named_class(smollm2: Path) -> None:
    from transformers import AutoTokenizer

    from tetriinfer.bench.real_workloads import HEAVY_PREFILL_TOKENS, TASKS, _known_lengths
    from tetriinfer.predictor.dataset import split_of
    from tetriinfer.predictor.default import served_prompt_text

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    known = _known_lengths()
    rendered = {tok.apply_chat_template([{"role": "user", "content": k}], tokenize=False,
                                        add_generation_prompt=True): k for k in known}
    lphd = load_workload("real:lphd", 40, rate=1.0, seed=3, tokenizer=str(smollm2), max_output_tokens=256)
    assert lphd.name == "real:lphd" and len(lphd) == 40
    assert len({r.prompt_text for r in lphd}) == 40  # without replacement while the pool lasts
    for r in lphd:
        instruction = rendered[r.prompt_text]  # a real AlpacaEval instruction, chat-rendered
        assert known[instruction] > 128 and r.output_tokens == 256 and r.prompt_tokens <= HEAVY_PREFILL_TOKENS
        assert split_of(served_prompt_text(tok, instruction), 0, 0.2) == "val"  # never trained on
        assert r.prompt_tokens == len(tok.encode(r.prompt_text, add_special_tokens=False))
    mixed = load_workload("real:mixed", 10, rate=1.0, seed=3, tokenizer=str(smollm2), max_output_tokens=256,
                          max_prompt_tokens=1024)
    classes = [r.request_id.split("-")[1] for r in mixed]
    assert sorted(classes.count(c) for c in ("lpld", "lphd", "hpld", "hphd")) == [2, 2, 3, 3]
    for r, c in zip(mixed, classes, strict=True):
        assert (r.prompt_tokens > HEAVY_PREFILL_TOKENS) == (c[:2] == "hp") and r.prompt_tokens <= 1024
        assert r.output_tokens == (256 if c[2:] == "hd" else 128)
        assert (TASKS["ld"] in r.prompt_text) == (c == "hpld") and (TASKS["hd"] in r.prompt_text) == (c == "hphd")
    again = load_workload("real:mixed", 10, rate=1.0, seed=3, tokenizer=str(smollm2), max_output_tokens=256,
                          max_prompt_tokens=1024)
    assert [r.to_dict() for r in again] == [r.to_dict() for r in mixed]
    with pytest.raises(ValueError, match="real:CLASS"):
        load_workload("real:chat", 2, tokenizer=str(smollm2))
    with pytest.raises(ValueError, match="tokenizer"):
        load_workload("real:lphd", 2, tokenizer=None)
    with pytest.raises(ValueError, match="heavy_cap"):
        load_workload("real:lphd", 2, tokenizer=str(smollm2), max_output_tokens=100)


def test_sampled_requests_carry_a_seed_per_request_that_every_run_repeats(tiny_llama: Path) -> None:
    from tetriinfer.bench.client import request_seed

    wl = load_workload("lpld", 6, rate=1.0, seed=2)
    sampled = BenchmarkClient(ClientConfig("http://x", "m", temperature=0.7, seed=5))
    bodies = [sampled.payload(i, r) for i, r in enumerate(wl)]
    assert all(b["temperature"] == 0.7 for b in bodies)
    seeds = [b["seed"] for b in bodies]
    assert seeds == [request_seed(5, i) for i in range(6)] and len(set(seeds)) == 6
    assert all(0 <= s < 2**31 for s in seeds)
    again = BenchmarkClient(ClientConfig("http://x", "m", temperature=0.7, seed=5))  # another column, same draws
    assert [again.payload(i, r)["seed"] for i, r in enumerate(wl)] == seeds
    other = BenchmarkClient(ClientConfig("http://x", "m", temperature=0.7, seed=6))
    assert [other.payload(i, r)["seed"] for i, r in enumerate(wl)] != seeds
    greedy = BenchmarkClient(ClientConfig("http://x", "m")).payload(0, next(iter(wl)))
    assert "seed" not in greedy and greedy["temperature"] == 0.0
    for bad in (-0.1, 2.5):
        with pytest.raises(ValueError, match="temperature"):
            ClientConfig("http://x", "m", temperature=bad)


def test_sampled_real_workloads_class_light_prompts_by_sampled_lengths(smollm2: Path) -> None:
    from transformers import AutoTokenizer

    from tetriinfer.bench.real_workloads import _known_lengths

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    greedy, sampled = _known_lengths("greedy"), _known_lengths("sampled")
    assert greedy.keys() == sampled.keys()
    rendered = {tok.apply_chat_template([{"role": "user", "content": k}], tokenize=False,
                                        add_generation_prompt=True): k for k in sampled}
    by_kind = {}
    for kind in ("greedy", "sampled"):
        wl = load_workload("real:lpld", 60, rate=1.0, seed=4, tokenizer=str(smollm2), max_output_tokens=256,
                           real_lengths=kind)
        by_kind[kind] = [rendered[r.prompt_text] for r in wl]
        assert all((sampled if kind == "sampled" else greedy)[k] <= 128 for k in by_kind[kind])
        assert any(kind in note for note in wl.notes)
    # the two decodings disagree on some prompts' class, so the pools differ
    assert any(greedy[k] > 128 for k in by_kind["sampled"])
