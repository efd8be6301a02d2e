"""Greedy outputs and logits of the paged, chunked engine equal HF transformers (fp32)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tetriinfer import LLM, SamplingParams
from tetriinfer.core.step import StepKind

PROMPT_LENS = [1, 2, 3, 7, 16, 17, 31, 64, 100, 129, 200, 333, 511, 513, 777, 1000]
NEW_TOKENS = 6


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def references(tiny_models: dict[str, Path]) -> dict[str, tuple[list[list[int]], list[list[int]], list[torch.Tensor]]]:
    """Per arch: prompts, HF greedy continuations, HF logits [NEW_TOKENS, V] per prompt."""
    from transformers import AutoModelForCausalLM

    refs = {}
    for arch, path in tiny_models.items():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompts = _prompts(hf.config.vocab_size)
        tokens, logits = [], []
        for p in prompts:
            with torch.no_grad():
                out = hf.generate(
                    torch.tensor([p]),
                    attention_mask=torch.ones(1, len(p), dtype=torch.long),
                    max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=hf.config.pad_token_id or 0,
                )
            tokens.append(out.sequences[0, len(p) :].tolist())
            logits.append(torch.stack([lg[0] for lg in out.logits]).float())
        refs[arch] = (prompts, tokens, logits)
    return refs


def _run(path: Path, prompts, chunk_size: int, block_size: int, num_threads: int | None = None):
    llm = LLM(model=str(path), dtype="float32", chunk_size=chunk_size, block_size=block_size, num_threads=num_threads)
    runner = llm.engine.runner
    runner.logits_sink = {}
    shapes: list[tuple[int, int]] = []  # (segments, padding) of each prefill step
    execute = runner.execute

    def spy(out):
        if out.kind == StepKind.PREFILL:
            shapes.append((len(out.segments), out.num_padding_tokens))
            assert out.num_scheduled_tokens + out.num_padding_tokens == chunk_size
        return execute(out)

    runner.execute = spy
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    sink = runner.logits_sink
    logits = [torch.stack(sink[o.request_id]) for o in outs]
    assert llm.engine.kv_manager.num_used_blocks == 0
    return outs, logits, shapes


@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt"])
@pytest.mark.parametrize("chunk_size,block_size", [(16, 8), (16, 16), (64, 8), (64, 16), (512, 8), (512, 16)])
def test_greedy_and_logits_match_transformers(tiny_models, references, arch, chunk_size, block_size):
    prompts, ref_tokens, ref_logits = references[arch]
    outs, logits, shapes = _run(tiny_models[arch], prompts, chunk_size, block_size)
    for i, (o, ref) in enumerate(zip(outs, ref_tokens, strict=True)):
        assert o.prompt_token_ids == prompts[i]
        assert o.outputs[0].token_ids == ref, f"prompt {i} (len {len(prompts[i])}) diverged"
        assert o.outputs[0].finish_reason == "length"
        diff = (logits[i] - ref_logits[i]).abs().max().item()
        assert diff < 1e-4, f"prompt {i}: max |logit diff| {diff}"
    # Several requests shared a chunk, and the last chunk was padded.
    assert max(n for n, _ in shapes) > 1
    assert any(pad > 0 for _, pad in shapes)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt"])
def test_one_thread_serving_layout_matches_transformers(tiny_models, references, arch):
    """One torch thread, as a serving instance runs: decode matmuls and attention go to the native kernels where
    this CPU has them (`tetriinfer.engine.cpu_kernels`); greedy tokens and logits must still match HF."""
    from tetriinfer.engine import cpu_kernels

    prompts, ref_tokens, ref_logits = references[arch]
    threads = torch.get_num_threads()
    calls: list[int] = []
    real_gemv, real_avx512 = cpu_kernels.gemv, cpu_kernels.gemm_f32_avx512
    import tetriinfer.engine.models.layers as layers

    layers.gemv = lambda x, w, b: calls.append(1) or real_gemv(x, w, b)
    layers.gemm_f32_avx512 = lambda x, w, b: calls.append(1) or real_avx512(x, w, b)
    try:
        outs, logits, _ = _run(tiny_models[arch], prompts, 64, 16, num_threads=1)
    finally:
        layers.gemv, layers.gemm_f32_avx512 = real_gemv, real_avx512
        torch.set_num_threads(threads)
    assert bool(calls) == cpu_kernels.kernels_available()  # the kernel path really ran (where it can)
    for i, (o, ref) in enumerate(zip(outs, ref_tokens, strict=True)):
        assert o.outputs[0].token_ids == ref, f"prompt {i} (len {len(prompts[i])}) diverged"
        diff = (logits[i] - ref_logits[i]).abs().max().item()
        assert diff < 1e-4, f"prompt {i}: max |logit diff| {diff}"


def test_native_kernels_on_two_threads_match_transformers(tiny_models, references):
    """Two torch threads, as an offline `LLM()` or a two-core serving instance runs: the native kernels split their
    work over both threads (`tetriinfer.engine.cpu_kernels`, where the compiler has OpenMP) and greedy tokens and
    logits still match HF. The first ten prompts (1-129 tokens: one and several chunks, decode at every length
    class) keep this short on a loaded two-core machine, where every barrier of two threads waits for a core."""
    from tetriinfer.engine import cpu_kernels

    prompts, ref_tokens, ref_logits = (r[:10] for r in references["llama"])
    threads = torch.get_num_threads()
    calls: list[int] = []
    real_gemv, real_avx512 = cpu_kernels.gemv, cpu_kernels.gemm_f32_avx512
    import tetriinfer.engine.models.layers as layers

    layers.gemv = lambda x, w, b: calls.append(1) or real_gemv(x, w, b)
    layers.gemm_f32_avx512 = lambda x, w, b: calls.append(1) or real_avx512(x, w, b)
    try:
        outs, logits, _ = _run(tiny_models["llama"], prompts, 64, 16, num_threads=2)
        assert torch.get_num_threads() == 2
    finally:
        layers.gemv, layers.gemm_f32_avx512 = real_gemv, real_avx512
        torch.set_num_threads(threads)
    assert bool(calls) == (cpu_kernels.kernels_available() and cpu_kernels.kernels_threaded())
    for i, (o, ref) in enumerate(zip(outs, ref_tokens, strict=True)):
        assert o.outputs[0].token_ids == ref, f"prompt {i} (len {len(prompts[i])}) diverged"
        diff = (logits[i] - ref_logits[i]).abs().max().item()
        assert diff < 1e-4, f"prompt {i}: max |logit diff| {diff}"


def test_padding_changes_nothing(tiny_llama):
    prompts = _prompts(8000)[:6]
    a, la, _ = _run(tiny_llama, prompts, 64, 16)
    llm = LLM(model=str(tiny_llama), chunk_size=64, block_size=16, pad_last_chunk=False)
    llm.engine.runner.logits_sink = {}
    b = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
    for i, o in enumerate(b):
        lb = torch.stack(llm.engine.runner.logits_sink[o.request_id])
        assert torch.allclose(la[i][: len(lb)], lb, atol=1e-5)


def test_preemption_by_recompute_keeps_greedy_output(tiny_llama, references):
    prompts, ref_tokens, _ = references["llama"]
    small = prompts[:8]
    # 40 blocks of 16 tokens: not enough for all 8 requests at once -> preemption and recompute.
    llm = LLM(model=str(tiny_llama), chunk_size=64, block_size=16, num_kv_blocks=40)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in small], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    )
    for o, ref in zip(outs, ref_tokens[:8], strict=True):
        assert o.outputs[0].token_ids == ref
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0 or llm.engine.kv_manager.num_blocks < 60
    assert llm.engine.kv_manager.num_used_blocks == 0
    llm.engine.kv_manager.check_invariants()
