"""The native decode kernels (`tetriinfer.engine.cpu_kernels`): the few-row matmul (bf16 and fp32) and paged decode
attention against fp32 references over shapes that exercise every remainder path, their use by `Linear` and the
engine, and the fallbacks when they are off or cannot build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tetriinfer.engine import cpu_kernels
from tetriinfer.engine.cpu_info import cpu_flags
from tetriinfer.engine.models.layers import Linear, f32_native_matmul_max_rows, use_gemv

needs_kernel = pytest.mark.skipif(not cpu_kernels.kernels_available(),
                                  reason="no AVX2/FMA CPU or no C compiler: the kernel is not built here")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ w.float().T
    if b is not None:
        y = y + b.float()
    return y.to(torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 1), (1, 7, 15), (1, 33, 16), (1, 5, 77), (1, 6, 2100),
                                           (2, 5, 17), (3, 64, 100), (4, 9, 48), (5, 130, 768), (15, 257, 96),
                                           (64, 3, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_bf16_matches_fp32_reference(m: int, n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    got = cpu_kernels.gemv(x, w, b)
    want = reference(x, w, b)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # same products in fp32, different summation order: at most one bf16 rounding step apart
    ulp = want.float().abs().clamp_min(1e-3) * 2.0**-7
    assert bool(((got.float() - want.float()).abs() <= ulp).all())


@needs_kernel
def test_gemv_bf16_is_exact_on_representable_sums_and_rounds_to_nearest_even() -> None:
    x = torch.tensor([[1.0, 2.0, -3.0, 0.5]]).bfloat16()
    w = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [256.0, 1.0, 0.0, 0.0]]).bfloat16()
    got = cpu_kernels.gemv(x, w, None)
    assert got.tolist() == [[0.5, 0.0, 258.0]]
    # 256 + 1.5 = 257.5 is not a bf16 (neighbours 256, 258): rounded exactly as torch rounds the fp32 sum
    x2 = torch.tensor([[1.0, 1.5]]).bfloat16()
    w2 = torch.tensor([[256.0, 1.0]]).bfloat16()
    assert cpu_kernels.gemv(x2, w2, None).item() == torch.tensor(257.5).bfloat16().item()


@needs_kernel
def test_gemv_bf16_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="gemv"):
        cpu_kernels.gemv(torch.zeros(1, 4).bfloat16(), torch.zeros(3, 5).bfloat16(), None)
    with pytest.raises(ValueError, match="gemv"):
        cpu_kernels.gemv(torch.zeros(1, 4).bfloat16(), torch.zeros(3, 4).bfloat16(), torch.zeros(2).bfloat16())
    with pytest.raises(ValueError, match="gemv"):  # mixed dtypes
        cpu_kernels.gemv(torch.zeros(1, 4), torch.zeros(3, 4).bfloat16(), None)
    with pytest.raises(ValueError, match="gemv"):  # unsupported dtype
        cpu_kernels.gemv(torch.zeros(1, 4).half(), torch.zeros(3, 4).half(), None)


@needs_kernel
@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 1), (1, 7, 15), (1, 5, 77), (1, 6, 1100), (2, 5, 17),
                                           (3, 64, 100), (4, 9, 48), (5, 130, 768), (7, 6, 8), (15, 257, 96),
                                           (32, 70, 384), (64, 3, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_fp32_matches_torch(m: int, n: int, k: int, bias: bool) -> None:
    """Every (weight rows % 4, x rows % 3, K % 8) remainder path, and one x row over short rows (the linear
    row-at-a-time path, K % 32 and K % 8 tails) and long rows (the tile path), against an fp64 reference: the
    kernel's error is an fp32 summation-order error, no larger than torch's own."""
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k + 7)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = cpu_kernels.gemv(x, w, b)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    assert got.shape == (m, n) and got.dtype == torch.float32
    bound = 1e-6 * (x.double().abs() @ w.double().abs().T).clamp_min(1.0) * max(k, 1) ** 0.5
    assert bool(((got.double() - want).abs() <= bound).all())


@needs_kernel
def test_linear_uses_the_fp32_kernel_for_decode_batches_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 matmuls of at most `f32_native_matmul_max_rows()` rows take a native kernel (the AVX-512 one where it is
    built, one row included, else the AVX2 one) and match torch; more rows take torch's GEMM."""
    import tetriinfer.engine.models.layers as layers

    lin = Linear(40, 24, bias=True)
    limit = f32_native_matmul_max_rows()
    avx512 = cpu_kernels.avx512_bf16_available()
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(layers, "gemv", lambda x, w, b: calls.append(("avx2", x.shape[0])) or cpu_kernels.gemv(x, w, b))
    monkeypatch.setattr(layers, "gemm_f32_avx512", lambda x, w, b: calls.append(("avx512", x.shape[0]))
                        or cpu_kernels.gemm_f32_avx512(x, w, b))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    want = [("avx512" if avx512 else "avx2", r) for r in (1, 3, limit)]
    try:
        with torch.inference_mode():
            for rows in (1, 3, limit):
                x = torch.randn(rows, 40)
                assert use_gemv(x, lin.weight)
                torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias),
                                           rtol=1e-5, atol=1e-5)
            assert calls == want
            lin(torch.randn(limit + 1, 40))  # prefill-sized: torch's blocked GEMM
            assert calls == want
        torch.set_num_threads(2)
        with torch.inference_mode():
            lin(torch.randn(2, 40))  # several threads: the kernel splits its rows, or torch's parallel kernels
        two = [("avx512" if avx512 else "avx2", 2)] if cpu_kernels.kernels_threaded() else []
        assert calls == want + two
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_linear_uses_the_kernel_for_few_bf16_rows_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import tetriinfer.engine.models.layers as layers

    monkeypatch.setattr(layers, "cpu_has_native", lambda dtype: dtype == torch.float32)  # as on an AVX2 CPU
    lin = Linear(48, 20, bias=True).to(torch.bfloat16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            x = torch.randn(3, 48).bfloat16()
            assert use_gemv(x, lin.weight)
            got = lin(x)
            ulp = reference(x, lin.weight, lin.bias).float().abs().clamp_min(1e-3) * 2.0**-7
            assert bool(((got.float() - reference(x, lin.weight, lin.bias).float()).abs() <= ulp).all())
            assert not use_gemv(x, lin.weight.float())  # mixed dtypes: torch
        torch.set_num_threads(2)
        with torch.inference_mode():
            assert use_gemv(x, lin.weight) is cpu_kernels.kernels_threaded()  # several threads: only if split
    finally:
        torch.set_num_threads(threads)


needs_avx512 = pytest.mark.skipif(not cpu_kernels.avx512_bf16_available(),
                                  reason="no AVX-512 BF16 CPU (or no C compiler): that matmul is not built here")


@needs_avx512
@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 1), (1, 7, 15), (1, 33, 32), (1, 5, 77), (1, 6, 2100),
                                           (2, 5, 31), (3, 64, 100), (4, 9, 48), (5, 130, 768), (6, 8, 33),
                                           (7, 12, 64), (8, 640, 384), (13, 257, 96), (16, 384, 1024),
                                           (37, 11, 65), (64, 3, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_bf16_avx512_matches_fp32_reference(m: int, n: int, k: int, bias: bool) -> None:
    """Every weight-group remainder (N % 4), pass split of the rows (ceil(M / 6) near-equal passes) and K tail
    (K % 32, masked loads) against an fp32 reference: at most one bf16 rounding step apart (exact products, fp32
    sums in another order)."""
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    got = cpu_kernels.gemm_bf16_avx512(x, w, b)
    want = reference(x, w, b)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    ulp = want.float().abs().clamp_min(1e-3) * 2.0**-7
    assert bool(((got.float() - want.float()).abs() <= ulp).all())


@needs_avx512
@pytest.mark.parametrize(("n", "k"), [(8, 64), (12, 77), (130, 576), (7, 1536), (64, 33), (603, 1100)])
@pytest.mark.parametrize("bias", [False, True])
def test_avx512_gemms_give_each_row_the_same_bits_at_every_batch_size(n: int, k: int, bias: bool) -> None:
    """A row's output does not depend on the rows beside it: 1-3 rows read each weight group row by row, more rows
    in interleaved passes of up to 6, group by group or (x past L1: 603 x 1100) panel by panel, and every split
    gives the same bits (same products, same order)."""
    g = torch.Generator().manual_seed(n * 31 + k)
    x = torch.randn(13, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    whole = cpu_kernels.gemm_bf16_avx512(x, w, b)
    for m in (1, 2, 3, 4, 7):
        for start in (0, 13 - m):
            part = cpu_kernels.gemm_bf16_avx512(x[start : start + m].contiguous(), w, b)
            assert torch.equal(part.view(torch.int16), whole[start : start + m].view(torch.int16)), (m, start)
    xf, wf = x.float(), w.float()
    bf = None if b is None else b.float()
    whole_f32 = cpu_kernels.gemm_f32_avx512(xf, wf, bf)
    for m in (1, 2, 3, 4, 7):
        for start in (0, 13 - m):
            part = cpu_kernels.gemm_f32_avx512(xf[start : start + m].contiguous(), wf, bf)
            assert torch.equal(part, whole_f32[start : start + m]), (m, start)


@needs_avx512
def test_gemm_bf16_avx512_is_exact_on_representable_sums_and_rounds_to_nearest_even() -> None:
    x = torch.tensor([[1.0, 2.0, -3.0, 0.5]]).bfloat16()
    w = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [256.0, 1.0, 0.0, 0.0]]).bfloat16()
    assert cpu_kernels.gemm_bf16_avx512(x, w, None).tolist() == [[0.5, 0.0, 258.0]]
    x2 = torch.tensor([[1.0, 1.5], [1.0, 2.5]]).bfloat16()  # 257.5 and 258.5: ties, to even (256 / 258 / 260)
    w2 = torch.tensor([[256.0, 1.0]]).bfloat16()
    want = [[torch.tensor(257.5).bfloat16().item()], [torch.tensor(258.5).bfloat16().item()]]
    assert cpu_kernels.gemm_bf16_avx512(x2, w2, None).tolist() == want
    assert cpu_kernels.gemm_bf16_avx512(x2, w2, torch.tensor([0.0]).bfloat16()).tolist() == want


@needs_avx512
def test_gemm_bf16_avx512_rejects_what_it_cannot_run() -> None:
    w = torch.zeros(3, 4).bfloat16()
    for x, weight, bias in [(torch.zeros(1, 5).bfloat16(), w, None),  # K mismatch
                            (torch.zeros(1, 4).bfloat16(), w, torch.zeros(2).bfloat16()),  # bias length
                            (torch.zeros(1, 4), w, None),  # fp32 x
                            (torch.zeros(cpu_kernels.MAX_ROWS + 1, 4).bfloat16(), w, None),  # too many rows
                            (torch.zeros(0, 4).bfloat16(), w, None)]:  # no rows
        with pytest.raises(ValueError, match="gemm_bf16_avx512"):
            cpu_kernels.gemm_bf16_avx512(x, weight, bias)


def causal_reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, rows: torch.Tensor,
                     ctx_start: int) -> torch.Tensor:
    """fp32 causal attention with a position offset: query i (position ctx_start + i) sees keys 0..ctx_start + i."""
    lq, h, d = q.shape
    group = h // kc.shape[1]
    k = kc[rows].float().repeat_interleave(group, dim=1)  # [Lk, H, D]
    v = vc[rows].float().repeat_interleave(group, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q.float(), k) / d**0.5
    visible = torch.arange(rows.shape[0])[None, :] <= (ctx_start + torch.arange(lq))[:, None]  # [Lq, Lk]
    p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hij,jhd->ihd", p, v)


@needs_avx512
@pytest.mark.parametrize(("lq", "ctx_start", "heads", "kv_heads", "head_dim"),
                         [(1, 0, 1, 1, 16), (3, 0, 6, 2, 64), (4, 0, 2, 2, 32), (17, 0, 4, 1, 64),
                          (33, 0, 6, 2, 64), (100, 0, 6, 2, 64), (5, 7, 4, 2, 64), (31, 33, 6, 2, 64),
                          (64, 64, 2, 1, 128), (9, 200, 3, 3, 256), (130, 0, 2, 1, 80)])
def test_prefill_attention_matches_fp32_reference(lq: int, ctx_start: int, heads: int, kv_heads: int,
                                                  head_dim: int) -> None:
    """Every query-pass remainder (Lq % 4), key-step remainder (Lk % 32, odd key pairs), position offsets (chunks
    after the first), grouped-query heads and head sizes up to 256 (past 128 the output sums live in memory),
    K/V read through a scattered row table, against fp32 math."""
    g = torch.Generator().manual_seed(lq * 100 + ctx_start + head_dim)
    slots = 3 * (ctx_start + lq) + 5
    kc = torch.randn(slots, kv_heads, head_dim, generator=g).bfloat16()
    vc = torch.randn(slots, kv_heads, head_dim, generator=g).bfloat16()
    rows = torch.randperm(slots, generator=g)[: ctx_start + lq].contiguous()
    qkv = torch.randn(lq, heads + 7, head_dim, generator=g).bfloat16()
    q = qkv[:, 2:2 + heads]  # a strided slice, as the fused qkv projection gives
    got = cpu_kernels.prefill_attn_bf16(q, kc, vc, rows, ctx_start)
    want = causal_reference(q, kc, vc, rows, ctx_start)
    assert got.shape == (lq, heads, head_dim) and got.dtype == torch.bfloat16
    # softmax weights rounded to bf16 for the sum over V, output rounded once: a few bf16 steps of |v| ~ 1
    assert (got.float() - want).abs().max().item() < 3e-2


@needs_avx512
def test_prefill_attention_rejects_what_it_cannot_run() -> None:
    kc = torch.zeros(8, 2, 64).bfloat16()
    q = torch.zeros(2, 4, 64).bfloat16()
    rows = torch.arange(2)
    for args in [(q.float(), kc, kc, rows, 0), (q, kc, kc, rows[:1], 0), (q, kc, kc, rows.int(), 0),
                 (torch.zeros(2, 3, 64).bfloat16(), kc, kc, rows, 0),  # heads not a multiple of kv heads
                 (torch.zeros(2, 4, 24).bfloat16(), torch.zeros(8, 2, 24).bfloat16(),
                  torch.zeros(8, 2, 24).bfloat16(), rows, 0)]:  # head size not a multiple of 16
        with pytest.raises(ValueError, match="prefill_attn_bf16"):
            cpu_kernels.prefill_attn_bf16(*args)
    import tetriinfer.engine.attention as attention

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # the engine routes only what the kernel can run (head size <= 256, a multiple of 16), else torch's SDPA
        for d, ok in ((64, True), (256, True), (272, False), (24, False)):
            qd, kd = torch.zeros(2, 2, d).bfloat16(), torch.zeros(4, 1, d).bfloat16()
            assert attention._use_prefill_kernel(qd, kd) is (ok and attention.bf16_decode_wants_native_kernels())
        assert not attention._use_prefill_kernel(torch.zeros(2, 2, 64), torch.zeros(4, 1, 64))  # fp32: torch
    finally:
        torch.set_num_threads(threads)


@needs_avx512
def test_bf16_prefill_takes_the_native_attention_and_generates_as_torch_does(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    """bf16 prefill segments (a first chunk and a continuation chunk) go through the kernel where the routing wants
    it (CPUs without AMX; on AMX CPUs oneDNN's attention is kept and the kernel is never called), and with the
    kernel forced on, greedy generations agree with the kernel off until a near-tie (as for the decode kernels)."""
    import tetriinfer.engine.attention as attention
    from tetriinfer import LLM, SamplingParams
    from tetriinfer.engine.make_model import tiny_model_path

    calls: list[int] = []
    real = attention.prefill_attn_bf16
    monkeypatch.setattr(attention, "prefill_attn_bf16",
                        lambda q, k, v, rows, start, *a: calls.append(start) or real(q, k, v, rows, start, *a))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(model=str(tiny_model_path()), dtype="bfloat16", chunk_size=32)
        prompt = [5 + (7 * i) % 900 for i in range(50)]  # two chunks: 32 + 18 tokens
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, ignore_eos=True))
        assert bool(calls) == attention.bf16_decode_wants_native_kernels(), calls  # the routing as declared
        calls.clear()
        monkeypatch.setattr(attention, "bf16_decode_wants_native_kernels", lambda: True)
        on = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
        assert 0 in calls and 32 in calls  # the first chunk and the continuation both took the kernel
        monkeypatch.setattr(attention, "_use_prefill_kernel", lambda q, k: False)
        off = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
    finally:
        torch.set_num_threads(threads)
    split = next((i for i, (a, b) in enumerate(zip(on.token_ids, off.token_ids, strict=True)) if a != b), None)
    assert split is None or split >= 1, (on.token_ids, off.token_ids)
    if split is not None:
        top = off.logprobs[split]
        assert on.token_ids[split] in top and top[off.token_ids[split]] - top[on.token_ids[split]] <= 0.1


def test_avx512_bf16_kernels_need_every_flag_and_have_their_own_switch(tmp_path: Path) -> None:
    assert not cpu_kernels.avx512_bf16_available() or cpu_kernels.AVX512_FLAGS <= cpu_flags()
    code = ("from tetriinfer.engine import cpu_kernels as c; import sys; "
            "sys.exit(0 if (not c.avx512_bf16_available() and c.kernels_available() == (sys.argv[1] == '1')) "
            "else 1)")
    for env, base in (({"TETRIINFER_AVX512_BF16": "0"}, cpu_kernels.kernels_available()),
                      ({"TETRIINFER_CPU_KERNELS": "0"}, False)):
        env = {**os.environ, **env, "PYTHONPATH": ":".join(sys.path)}
        done = subprocess.run([sys.executable, "-c", code, "1" if base else "0"], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, (env, done.stderr[-2000:])


@needs_kernel
@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("avx512", [True, False])
def test_bf16_decode_routing_on_cpus_with_bf16_instructions(monkeypatch: pytest.MonkeyPatch,
                                                            amx: bool, avx512: bool) -> None:
    """With bf16 instructions (cpu_has_native), few-row bf16 matmuls take a native kernel up to
    `bf16_native_matmul_max_rows()` rows: the AVX-512 BF16 one where it is built (GEMM_BF16_AVX512_MAX_ROWS rows
    without AMX, GEMM_BF16_AVX512_MAX_ROWS_AMX with it), else the AVX2 one up to GEMV_BF16_NATIVE_CPU_MAX_ROWS (never
    on AMX CPUs); bigger matmuls never do, and results match torch's either way. bf16 decode attention takes the
    native kernel on every CPU (AMX included)."""
    import tetriinfer.engine.attention as attention
    import tetriinfer.engine.models.layers as layers

    if avx512 and not cpu_kernels.avx512_bf16_available():
        pytest.skip("no AVX-512 BF16 CPU here: the AVX-512 route cannot run")
    monkeypatch.setattr(layers, "cpu_has_native", lambda dtype: True)
    monkeypatch.setattr(layers, "cpu_has_amx", lambda: amx)
    monkeypatch.setattr(layers, "avx512_bf16_available", lambda: avx512)
    limit = {(False, True): layers.GEMM_BF16_AVX512_MAX_ROWS, (True, True): layers.GEMM_BF16_AVX512_MAX_ROWS_AMX,
             (False, False): layers.GEMV_BF16_NATIVE_CPU_MAX_ROWS, (True, False): 0}[(amx, avx512)]
    assert layers.bf16_native_matmul_max_rows() == limit
    calls: list[int] = []
    calls512: list[int] = []
    monkeypatch.setattr(layers, "gemv", lambda x, w, b: calls.append(x.shape[0]) or cpu_kernels.gemv(x, w, b))
    monkeypatch.setattr(layers, "gemm_bf16_avx512",
                        lambda x, w, b: calls512.append(x.shape[0]) or cpu_kernels.gemm_bf16_avx512(x, w, b))
    lin = Linear(48, 20, bias=True).to(torch.bfloat16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    all_rows = sorted({1, 2, layers.GEMV_BF16_NATIVE_CPU_MAX_ROWS + 1, layers.GEMM_BF16_AVX512_MAX_ROWS_AMX,
                       layers.GEMM_BF16_AVX512_MAX_ROWS_AMX + 1, layers.GEMM_BF16_AVX512_MAX_ROWS,
                       layers.GEMM_BF16_AVX512_MAX_ROWS + 1})
    try:
        with torch.inference_mode():
            for rows in all_rows:
                x = torch.randn(rows, 48).bfloat16()
                got = lin(x)
                want = reference(x, lin.weight, lin.bias).float()
                assert bool(((got.float() - want).abs() <= want.abs().clamp_min(1e-2) * 2.0**-6).all())
            q = torch.randn(2, 4, 16).bfloat16()
            assert attention._use_decode_kernel(q, torch.zeros(8, 2, 16, dtype=torch.bfloat16))
            assert attention._use_decode_kernel(q.float(), torch.zeros(8, 2, 16))  # fp32: always native
    finally:
        torch.set_num_threads(threads)
    native = [r for r in all_rows if r <= limit]
    assert (calls, calls512) == (([], native) if avx512 else (native, []))


def test_kernels_can_be_turned_off_and_a_missing_compiler_falls_back(tmp_path: Path) -> None:
    code = ("from tetriinfer.engine import cpu_kernels as c; import sys; "
            "sys.exit(0 if not c.kernels_available() else 1)")
    for env in ({"TETRIINFER_CPU_KERNELS": "0"}, {"CC": "/nonexistent/cc", "PATH": "/nonexistent"}):
        env = {**env, "HOME": str(tmp_path), "TETRIINFER_CACHE": str(tmp_path / "cache"),
               "PYTHONPATH": ":".join(sys.path)}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (env, done.stderr[-2000:])


def test_kernel_needs_avx2_and_fma() -> None:
    assert cpu_kernels.kernels_available() is False or {"avx2", "fma"} <= cpu_flags()


def attention_reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor,
                        lengths: torch.Tensor) -> torch.Tensor:
    b, h, d = q.shape
    group = h // kc.shape[1]
    out = torch.empty(b, h, d)
    for i in range(b):
        n = int(lengths[i])
        k = kc[slots[i, :n]].float().repeat_interleave(group, dim=1)  # [n, H, D]
        v = vc[slots[i, :n]].float().repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].float(), k) / d**0.5, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", p, v)
    return out


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(12, 4, 64), (8, 8, 16), (7, 1, 24), (16, 2, 13),
                                                             (6, 3, 8), (4, 4, 5), (4, 2, 128), (3, 1, 76)])
def test_decode_attention_matches_fp32_reference(heads: int, kv_heads: int, head_dim: int,
                                                 dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + head_dim)
    slots_total = 300
    kc = (2 * torch.randn(slots_total, kv_heads, head_dim, generator=g)).to(dtype)
    vc = torch.randn(slots_total, kv_heads, head_dim, generator=g).to(dtype)
    lengths = torch.tensor([1, 2, 9, 100, 17, 8, 16])  # 8-key passes, their tails, and tails alone
    slots = torch.zeros(len(lengths), int(lengths.max()), dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        slots[i, :n] = torch.randperm(slots_total, generator=g)[:n]  # scattered blocks, padding left at slot 0
    q = torch.randn(len(lengths), heads, head_dim, generator=g).to(dtype)
    got = cpu_kernels.decode_attn(q, kc, vc, slots, lengths)
    want = attention_reference(q, kc, vc, slots, lengths)
    assert got.shape == q.shape and got.dtype == dtype
    if dtype == torch.float32:  # same math, another summation order and a ~1 ulp exp
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        tol = want.abs().clamp_min(1e-2) * 2.0**-7 + 1e-4
        assert bool(((got.float() - want).abs() <= tol).all())


@needs_avx512
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (16, 2, 128), (10, 2, 256),
                                                             (14, 2, 64), (24, 3, 96), (6, 3, 16), (8, 1, 48)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_decode_attention_matches_the_reference_and_itself_on_threads(heads: int, kv_heads: int,
                                                                              head_dim: int, dtype: torch.dtype) -> None:
    """The grouped AVX-512 kernels (one work item per sequence and kv head), bf16 and fp32: every 16-key tile tail,
    an empty context, 1 to 8 query heads per kv head; the same bits on 1, 2 and 3 threads. fp32 within fp32
    rounding of the reference; head dims that are not a multiple of 32 are fp32-only (bf16 keeps the AVX2 kernel)."""
    if dtype == torch.bfloat16 and head_dim % 32:
        assert not cpu_kernels.grouped_decode_attn_ok(heads, kv_heads, head_dim, dtype)
        return
    assert cpu_kernels.grouped_decode_attn_ok(heads, kv_heads, head_dim, dtype)
    g = torch.Generator().manual_seed(heads * 1000 + head_dim)
    slots_total = 400
    kc = (2 * torch.randn(slots_total, kv_heads, head_dim, generator=g)).to(dtype)
    vc = torch.randn(slots_total, kv_heads, head_dim, generator=g).to(dtype)
    lengths = torch.tensor([1, 15, 16, 17, 33, 0, 150, 47])
    slots = torch.zeros(len(lengths), int(lengths.max()), dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        slots[i, :n] = torch.randperm(slots_total, generator=g)[:n]
    q = torch.randn(len(lengths), heads, head_dim, generator=g).to(dtype)
    one = cpu_kernels.decode_attn(q, kc, vc, slots, lengths, num_threads=1)
    assert one.dtype == dtype
    want = attention_reference(q, kc, vc, slots, lengths.clamp_min(1))
    want[lengths == 0] = 0.0  # no keys: zeros, as the AVX2 kernel writes
    tol = want.abs().clamp_min(1e-2) * 2.0**-7 + 1e-4 if dtype == torch.bfloat16 else want.abs() * 1e-5 + 1e-5
    assert bool(((one.float() - want).abs() <= tol).all())
    for t in (2, 3):
        assert torch.equal(cpu_kernels.decode_attn(q, kc, vc, slots, lengths, num_threads=t), one), t


def test_grouped_decode_attention_takes_only_the_shapes_it_was_written_for() -> None:
    if not cpu_kernels.avx512_bf16_available():
        assert not cpu_kernels.grouped_decode_attn_ok(9, 3, 64)
        return
    assert cpu_kernels.grouped_decode_attn_ok(9, 3, 64) and cpu_kernels.grouped_decode_attn_ok(32, 4, 128)
    assert not cpu_kernels.grouped_decode_attn_ok(9, 3, 48)  # head_dim not a multiple of 32
    assert not cpu_kernels.grouped_decode_attn_ok(8, 2, 512)  # head_dim past 256
    assert not cpu_kernels.grouped_decode_attn_ok(18, 2, 64)  # 9 query heads per kv head
    assert cpu_kernels.grouped_decode_attn_ok(9, 3, 48, torch.float32)  # fp32: a multiple of 16 suffices
    assert not cpu_kernels.grouped_decode_attn_ok(9, 3, 40, torch.float32)
    assert not cpu_kernels.grouped_decode_attn_ok(18, 2, 64, torch.float32)


@needs_kernel
def test_decode_attention_rejects_bad_shapes() -> None:
    q = torch.zeros(2, 6, 8).bfloat16()
    kc = torch.zeros(10, 4, 8).bfloat16()  # 6 heads cannot share 4 kv heads
    with pytest.raises(ValueError, match="decode_attn"):
        cpu_kernels.decode_attn(q, kc, kc, torch.zeros(2, 3, dtype=torch.long), torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="decode_attn"):  # mixed dtypes
        ok = torch.zeros(10, 2, 8)
        cpu_kernels.decode_attn(q, ok, ok, torch.zeros(2, 3, dtype=torch.long), torch.ones(2, dtype=torch.long))


@needs_kernel
def test_engine_bf16_decode_uses_the_kernels_and_matches_torch_paths(tmp_path: Path) -> None:
    """The same greedy bf16 generation with the kernels on and off (separate processes): the kernels change only
    the summation order, so both runs emit the same tokens until the first step where the kernels-off run itself
    sees a near-tie (its top two logprobs within a few bf16 roundings), and there the kernels pick one of those."""
    code = ("import json, sys, torch; from tetriinfer import LLM, SamplingParams; torch.set_num_threads(1); "
            "from tetriinfer.engine.make_model import tiny_model_path; "
            "llm = LLM(model=str(tiny_model_path()), dtype='bfloat16'); "
            "outs = llm.generate(['the quick brown fox', 'hello world, this is a test of'], "
            "SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)); "
            "print(json.dumps([[o.outputs[0].token_ids, [{str(k): v for k, v in lp.items()} "
            "for lp in o.outputs[0].logprobs]] for o in outs]))")
    runs = {}
    for flag in ("1", "0"):
        env = {**os.environ, "TETRIINFER_CPU_KERNELS": flag}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[flag] = json.loads(done.stdout.strip().splitlines()[-1])
    agreed = 0
    for (on_ids, _), (off_ids, off_lps) in zip(runs["1"], runs["0"], strict=True):
        assert len(on_ids) == len(off_ids) == 24
        split = next((i for i, (a, b) in enumerate(zip(on_ids, off_ids, strict=True)) if a != b), None)
        agreed += 24 if split is None else split
        if split is not None:
            top = off_lps[split]
            assert str(on_ids[split]) in top, (split, on_ids[split], top)
            assert top[str(off_ids[split])] - top[str(on_ids[split])] <= 0.1, (split, top)
    assert agreed >= 12, runs  # the first tokens agree: a broken kernel diverges at once


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "dim"), [(1, 1), (1, 768), (3, 13), (7, 384), (64, 96)])
def test_fused_rmsnorm_matches_torch(rows: int, dim: int, dtype: torch.dtype) -> None:
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(rows * 100 + dim)
    x = (3 * torch.randn(rows, dim, generator=g)).to(dtype)
    w = (1 + 0.1 * torch.randn(dim, generator=g)).to(dtype)
    want = w * F.rms_norm(x.float(), (dim,), eps=1e-6).to(dtype)
    got = cpu_kernels.rmsnorm(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:  # only the sum of squares is ordered differently
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # at most one bf16 rounding step apart
        ulp = want.float().abs().clamp_min(1e-3) * 2.0**-7
        assert bool(((got.float() - want.float()).abs() <= ulp).all())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_is_bit_identical_to_torch_on_a_qkv_slice(dtype: torch.dtype) -> None:
    from tetriinfer.engine.models.layers import RotaryEmbedding

    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d = 6, 2, 64
    qkv = torch.randn(5, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    cos, sin = RotaryEmbedding(d, 10000.0, None).cos_sin(torch.tensor([0, 1, 17, 500, 2047]), dtype)
    for x in (qkv[:, : heads * d].view(5, heads, d), qkv[:, heads * d: (heads + kv_heads) * d].view(5, kv_heads, d)):
        half = d // 2
        want = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
        got = cpu_kernels.rope(x, cos, sin)
        assert got.is_contiguous() and torch.equal(got, want)
    with pytest.raises(ValueError, match="rope"):
        cpu_kernels.rope(qkv[:, :heads * d].view(5, heads, d), cos.float() if dtype != torch.float32 else cos.half(),
                         sin)
    with pytest.raises(ValueError, match="rmsnorm"):
        cpu_kernels.rmsnorm(qkv, torch.ones(3, dtype=dtype), 1e-6)


@needs_kernel
def test_norm_and_rope_use_the_fused_kernels_for_decode_rows_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import tetriinfer.engine.models.layers as layers

    calls: list[str] = []
    real_norm, real_rope = cpu_kernels.rmsnorm, cpu_kernels.rope
    monkeypatch.setattr(cpu_kernels, "rmsnorm", lambda *a: calls.append("norm") or real_norm(*a))
    monkeypatch.setattr(cpu_kernels, "rope", lambda *a: calls.append("rope") or real_rope(*a))
    norm = layers.RMSNorm(32, 1e-5)
    rot = layers.RotaryEmbedding(8, 10000.0, None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for rows, fused in ((1, True), (layers.FUSED_MAX_ROWS, True), (layers.FUSED_MAX_ROWS + 1, False)):
                calls.clear()
                x = torch.randn(rows, 32)
                cos, sin = rot.cos_sin(torch.arange(rows), torch.float32)
                torch.testing.assert_close(norm(x), norm.weight * torch.nn.functional.rms_norm(x, (32,), eps=1e-5))
                layers.apply_rope(x.view(rows, 4, 8), cos, sin)
                assert calls == (["norm", "rope"] if fused else []), rows
        torch.set_num_threads(2)
        calls.clear()
        with torch.inference_mode():
            norm(torch.randn(1, 32))
        assert calls == (["norm"] if cpu_kernels.kernels_threaded() else [])  # several threads: OpenMP builds
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_decode_rows_of_very_different_lengths_are_attended_in_one_native_call(tiny_llama: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """With the native decode kernel, every decode row of a step goes to one call in batch order (the kernel reads
    each row's own length; no padded length buckets, no gather of q), and the tokens equal the bucketed path's."""
    from tetriinfer import LLM, SamplingParams
    from tetriinfer.engine import attention, model_runner

    monkeypatch.setenv("TETRIINFER_FUSED_DECODE", "0")  # the per-op path (the fused step passes the same group)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (2, 300, 9, 120, 40)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(tiny_llama), chunk_size=512, dtype="bfloat16", num_threads=1)
    batches: list[int] = []
    real = attention.decode_attn

    def recording(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        batches.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(attention, "decode_attn", recording)
    one_group = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    layers = llm.engine.model_config.num_layers
    assert batches and len(batches) % layers == 0
    assert max(batches) == len(prompts)  # the whole batch at once, 2 and 300 tokens of context side by side
    batches.clear()
    monkeypatch.setattr(model_runner, "native_decode_attention", lambda *_: False)  # the bucketed grouping
    bucketed = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert max(batches) < len(prompts)
    assert bucketed == one_group


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_picks_what_torch_picks(dtype: torch.dtype) -> None:
    """The greedy token from the model-dtype logits equals ``x.float().argmax(-1)``: on random rows of every length
    class (vector body, tail, shorter than a vector), on ties (the first maximum wins), -0.0 against 0.0, rows of
    -inf, and NaN (the first NaN wins, as in torch); and at 1, 2 and 3 threads alike."""
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(m, n, generator=g) for m, n in ((1, 1), (3, 7), (5, 8), (4, 9), (48, 4099), (2, 17))]
    rows += [torch.randint(-3, 3, (m, n), generator=g).float() for m, n in ((6, 40), (3, 8), (2, 5))]
    inf, nan = float("inf"), float("nan")
    rows += [torch.tensor([r]) for r in ([-inf] * 10, [-inf] * 3, [-0.0, 0.0, -0.0] * 5, [-inf] * 9 + [-1.0],
                                         [1.0, nan, 5.0, nan] + [0.0] * 12, [0.0] * 12 + [nan], [nan] * 9,
                                         [-5.0] * 8 + [inf, inf])]
    for x in rows:
        x = x.to(dtype)
        want = x.float().argmax(dim=-1).tolist()
        for t in (1, 2, 3):
            assert cpu_kernels.argmax_rows(x, num_threads=t) == want, (x, t)
    with pytest.raises(ValueError, match="argmax_rows"):
        cpu_kernels.argmax_rows(torch.zeros(2, 0))
