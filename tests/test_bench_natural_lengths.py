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
