"""Prefix caching in the real engine: prompts that share leading blocks reuse the cached K/V and still produce
exactly HF transformers' greedy tokens and logits (fp32), with and without eviction."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tetriinfer import LLM, SamplingParams

NEW_TOKENS = 5
BLOCK = 16


def hf_reference(path: Path, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens, logits = [], []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                return_dict_in_generate=True, pad_token_id=hf.config.pad_token_id or 0,
            )
        tokens.append(out.sequences[0, len(p):].tolist())
        logits.append(torch.stack([lg[0] for lg in out.logits]).float())
    return tokens, logits


def shared_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    stem = [rng.randrange(5, vocab) for _ in range(160)]  # 10 full blocks
    return [
        stem + [rng.randrange(5, vocab) for _ in range(37)],
        stem + [rng.randrange(5, vocab) for _ in range(5)],   # 10 blocks cached
        stem[:96],                                            # fully cached prompt: its last block is recomputed
        [rng.randrange(5, vocab) for _ in range(200)],        # nothing shared (in a small pool: evicts the stem)
        stem[:50] + [rng.randrange(5, vocab) for _ in range(30)],  # 3 blocks cached, then diverges
        stem + [rng.randrange(5, vocab) for _ in range(80)],
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt"])
@pytest.mark.parametrize("num_kv_blocks", [None, 16])
def test_cached_prefixes_give_exactly_the_uncached_results(tiny_models, arch: str, num_kv_blocks: int | None):
    path = tiny_models[arch]
    llm = LLM(model=str(path), chunk_size=64, block_size=BLOCK, num_kv_blocks=num_kv_blocks,
              enable_prefix_caching=True)
    vocab = llm.engine.model_config.vocab_size
    prompts = shared_prompts(vocab)
    ref_tokens, ref_logits = hf_reference(path, prompts)
    llm.engine.runner.logits_sink = {}
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = [llm.generate([{"prompt_token_ids": p}], params)[0] for p in prompts]  # one at a time: later ones hit
    for i, o in enumerate(outs):
        assert o.outputs[0].token_ids == ref_tokens[i], f"prompt {i} diverged"
        got = torch.stack(llm.engine.runner.logits_sink[o.request_id])
        diff = (got - ref_logits[i]).abs().max().item()
        assert diff < 1e-4, f"prompt {i}: max |logit diff| {diff}"
    kv = llm.engine.kv_manager
    assert kv.prefix_cache is not None
    if num_kv_blocks is None:  # room for everything: each prompt finds every full block an earlier one computed
        assert kv.prefix_cache.hit_tokens == 160 + 80 + 160 + 48
    else:  # 16 blocks: the unshared prompt evicts cached blocks; hits shrink, results stay exact
        assert 0 < kv.prefix_cache.hit_tokens < 160 + 80 + 160 + 48
    assert kv.num_used_blocks == 0
    kv.check_invariants()


def test_a_multi_turn_conversation_reuses_its_earlier_turns(tiny_llama: Path) -> None:
    """Turn 2's prompt is turn 1's prompt + its answer + a new message: turn 1's prompt *and* answer blocks
    (computed while decoding) are found again."""
    llm = LLM(model=str(tiny_llama), chunk_size=64, block_size=BLOCK, enable_prefix_caching=True)
    rng = random.Random(3)
    turn1 = [rng.randrange(5, 500) for _ in range(70)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    answer = llm.generate([{"prompt_token_ids": turn1}], params)[0].outputs[0].token_ids
    turn2 = turn1 + list(answer) + [rng.randrange(5, 500) for _ in range(20)]
    kv = llm.engine.kv_manager
    assert kv.prefix_cache is not None
    before = kv.prefix_cache.hit_tokens
    cached = llm.generate([{"prompt_token_ids": turn2}], params)[0].outputs[0].token_ids
    # Turn 1 computed K/V for 70 + 39 tokens (the last answer token is sampled, never fed back): 6 full blocks.
    assert kv.prefix_cache.hit_tokens - before == 6 * BLOCK
    plain = LLM(model=str(tiny_llama), chunk_size=64, block_size=BLOCK)
    assert plain.generate([{"prompt_token_ids": turn2}], params)[0].outputs[0].token_ids == cached
