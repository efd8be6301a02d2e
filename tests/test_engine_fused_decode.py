"""The fused decode step (`tetriinfer.engine.fused_decode`): a Llama-family layer stack in one native call for
decode-only steps. It must give the per-op path's hidden states and KV cache bit for bit (same kernels, same
rounding), at any thread count, for models with and without biases, and step aside for every step it does not
cover; the SiLU-times-up kernel it shares with the per-op path must match torch's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tetriinfer.engine import cpu_kernels

needs_kernel = pytest.mark.skipif(not cpu_kernels.kernels_available(),
                                  reason="no AVX2/FMA CPU or no C compiler: the kernels are not built here")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "inter"), [(1, 8), (1, 1536), (3, 13), (5, 100), (64, 96)])
def test_silu_mul_matches_torch_and_is_the_same_on_any_thread_count(rows: int, inter: int,
                                                                   dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + inter)
    gu = (4 * torch.randn(rows, 2 * inter, generator=g)).to(dtype)
    gu[0, 0] = -100.0  # exp(-g) overflows: silu -> -0 in torch, a tiny negative here; both round to ~0
    gate, up = gu.split(inter, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = cpu_kernels.silu_mul(gu, num_threads=1)
    assert got.shape == (rows, inter) and got.dtype == dtype
    if dtype == torch.float32:  # exp within a couple of ulps of torch's
        torch.testing.assert_close(got, want, rtol=3e-7, atol=1e-30)
    else:  # at most one bf16 rounding step apart
        ulp = want.float().abs().clamp_min(1e-30) * 2.0**-7
        assert bool(((got.float() - want.float()).abs() <= ulp).all())
    for threads in (2, 3):
        assert torch.equal(cpu_kernels.silu_mul(gu, num_threads=threads), got)
    with pytest.raises(ValueError, match="silu_mul"):
        cpu_kernels.silu_mul(gu[0])  # one row, not [M, 2 * inter]


def _engine(path: Path, dtype: str, threads: int):
    from tetriinfer import LLM

    torch.set_num_threads(threads)
    return LLM(model=str(path), dtype=dtype, num_threads=threads, chunk_size=64)


def _decode_step(llm, contexts: list[int]):
    """A decode-only step of len(contexts) rows (row b: one new token after contexts[b] cached ones), the KV of
    each context filled with deterministic values -> (runner, step)."""
    from tetriinfer.core.sampling_params import SamplingParams
    from tetriinfer.core.step import ScheduledSegment, SchedulerOutput, StepKind

    runner, kv = llm.engine.runner, llm.engine.kv_manager
    g = torch.Generator().manual_seed(sum(contexts))
    for k, v in runner._kv_layers:
        k.copy_(torch.randn(k.shape, generator=g).to(k.dtype))
        v.copy_(torch.randn(v.shape, generator=g).to(v.dtype))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    segs = []
    for b, ctx in enumerate(contexts):
        rid = f"r{b}"
        assert kv.allocate_slots(rid, ctx + 1)
        segs.append(ScheduledSegment(rid, ctx, (5 + 3 * b,), tuple(kv.block_table(rid)), True, params, 1))
    return runner, SchedulerOutput(1, StepKind.DECODE, tuple(segs))


def _forward(runner, step, fused: bool, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TETRIINFER_FUSED_DECODE", "1" if fused else "0")
    saved = [(k.clone(), v.clone()) for k, v in runner._kv_layers]
    with torch.inference_mode():
        ids, pos, meta, _ = runner.build_inputs(step)
        hidden = runner.model(ids, pos, runner._kv_layers, meta)
    caches = [(k.clone(), v.clone()) for k, v in runner._kv_layers]
    for (k, v), (k0, v0) in zip(runner._kv_layers, saved, strict=True):  # the next run starts from the same KV
        k.copy_(k0)
        v.copy_(v0)
    return hidden, caches


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_decode_step_equals_the_per_op_path_bit_for_bit(tiny_models: dict[str, Path], arch: str, dtype: str,
                                                              threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """qwen2 has qkv biases; contexts of 1 to 300 tokens cross block boundaries; every row count the native
    matmuls take up to a whole batch of 9."""
    if threads > 1 and not cpu_kernels.kernels_threaded():
        pytest.skip("single-threaded kernel build: the engine runs them only on one thread")
    from tetriinfer.engine.fused_decode import FusedDecode

    before = torch.get_num_threads()
    try:
        llm = _engine(tiny_models[arch], dtype, threads)
        ran: list[int] = []
        real_run = FusedDecode.run
        monkeypatch.setattr(FusedDecode, "run", lambda self, x, *a: ran.append(x.shape[0]) or real_run(self, x, *a))
        for contexts in ([1], [17], [300, 2, 64, 15, 16, 33, 1, 120, 7]):
            runner, step = _decode_step(llm, contexts)
            per_op, per_op_kv = _forward(runner, step, False, monkeypatch)
            fused, fused_kv = _forward(runner, step, True, monkeypatch)
            assert ran and ran[-1] == len(contexts)  # the fused path really ran
            assert torch.equal(fused, per_op), (contexts, (fused.float() - per_op.float()).abs().max())
            for (k, v), (k2, v2) in zip(fused_kv, per_op_kv, strict=True):
                assert torch.equal(k, k2) and torch.equal(v, v2)
            for b in range(len(contexts)):
                llm.engine.kv_manager.free_request(f"r{b}")
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_fused_decode_steps_aside_for_steps_it_does_not_cover(tiny_models: dict[str, Path],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill and mixed steps, the switch, and OPT models run per op; greedy generation gives the same tokens
    with the fused step on and off."""
    from tetriinfer import SamplingParams
    from tetriinfer.engine.fused_decode import FusedDecode

    before = torch.get_num_threads()
    try:
        llm = _engine(tiny_models["llama"], "float32", 1)
        ran: list[int] = []
        real_run = FusedDecode.run
        monkeypatch.setattr(FusedDecode, "run", lambda self, x, *a: ran.append(x.shape[0]) or real_run(self, x, *a))
        prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 90, 30)]
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        on = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert ran and max(ran) <= len(prompts)  # decode steps only (prefill chunks have more rows)
        monkeypatch.setenv("TETRIINFER_FUSED_DECODE", "0")
        ran.clear()
        off = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert not ran and off == on
        opt = _engine(tiny_models["opt"], "float32", 1)
        monkeypatch.setenv("TETRIINFER_FUSED_DECODE", "1")
        opt.generate(prompts, params)
        assert not ran and not hasattr(opt.engine.runner.model, "fused_decode")
    finally:
        torch.set_num_threads(before)
