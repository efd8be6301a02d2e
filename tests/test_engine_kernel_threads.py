"""The native CPU kernels on several threads (`tetriinfer.engine.cpu_kernels`): every kernel split over 2 and 3
threads returns exactly the single-thread result over shapes that hit every tail of the split (weight groups of 4,
a ragged last part, x-row passes, K tails, (sequence, head) pairs, causal query blocks), the engine's default
thread count, and the off switch for the threads (single-threaded kernels, routed only at one torch thread)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tetriinfer.engine import cpu_kernels
from tetriinfer.engine.device import default_num_threads

needs_kernel = pytest.mark.skipif(not cpu_kernels.kernels_available(),
                                  reason="no AVX2/FMA CPU or no C compiler: the kernels are not built here")
needs_avx512 = pytest.mark.skipif(not cpu_kernels.avx512_bf16_available(),
                                  reason="no AVX-512 BF16 CPU: those kernels are not built here")
THREADS = (2, 3)


def _openmp_compiles(tmp_path: Path) -> bool:
    """Whether this machine's C compiler builds an OpenMP shared object (then the kernels must be threaded)."""
    cc = cpu_kernels._compiler()
    if cc is None:
        return False
    src = tmp_path / "omp.c"
    src.write_text("#include <omp.h>\nint f(void) { return omp_get_max_threads(); }\n")
    done = subprocess.run([cc, "-fopenmp", "-fPIC", "-shared", "-o", str(tmp_path / "omp.so"), str(src)],
                          capture_output=True, timeout=60)
    return done.returncode == 0


@needs_kernel
def test_kernels_are_threaded_where_the_compiler_has_openmp(tmp_path: Path) -> None:
    """Threaded exactly when the compiler builds OpenMP and the kernels share torch's runtime (one thread pool);
    a second runtime mapped beside torch's would mean two pools spinning against each other: single-threaded."""
    one_runtime = len(cpu_kernels._openmp_runtimes()) == 1
    assert cpu_kernels.kernels_threaded() is (_openmp_compiles(tmp_path) and one_runtime)


# (M, N, K): N from 197 (3 parts of 64+ rows, ragged last group of 1) to 1030; M over the x-row pass tails; K tails
MATMUL_SHAPES = [(1, 197, 40), (1, 1030, 576), (2, 259, 383), (5, 390, 100), (7, 1030, 576), (13, 258, 64),
                 (64, 515, 33)]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_on_threads_equals_one_thread(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    for m, n, k in MATMUL_SHAPES:
        x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
        b = torch.randn(n, generator=g).to(dtype)
        one = cpu_kernels.gemv(x, w, b, num_threads=1)
        want = torch.nn.functional.linear(x.float(), w.float(), b.float())
        torch.testing.assert_close(one.float(), want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=5e-2 if dtype == torch.bfloat16 else 1e-4)
        for t in THREADS:
            assert torch.equal(cpu_kernels.gemv(x, w, b, num_threads=t), one), (m, n, k, t)
            assert torch.equal(cpu_kernels.gemv(x, w, None, num_threads=t), cpu_kernels.gemv(x, w, None, 1))


@needs_avx512
def test_avx512_bf16_gemm_on_threads_equals_one_thread() -> None:
    g = torch.Generator().manual_seed(1)
    for m, n, k in [*MATMUL_SHAPES, (6, 260, 32), (8, 775, 31), (48, 1030, 1536)]:
        x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
        b = torch.randn(n, generator=g).bfloat16()
        one = cpu_kernels.gemm_bf16_avx512(x, w, b, num_threads=1)
        want = torch.nn.functional.linear(x.float(), w.float(), b.float())
        torch.testing.assert_close(one.float(), want, rtol=1e-2, atol=5e-2)
        for t in THREADS:
            assert torch.equal(cpu_kernels.gemm_bf16_avx512(x, w, b, num_threads=t), one), (m, n, k, t)


@needs_avx512
def test_avx512_f32_gemm_matches_torch_and_on_threads_equals_one_thread() -> None:
    g = torch.Generator().manual_seed(2)
    for m, n, k in [*MATMUL_SHAPES, (6, 260, 16), (8, 775, 15)]:
        x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        one = cpu_kernels.gemm_f32_avx512(x, w, b, num_threads=1)
        torch.testing.assert_close(one, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)
        for t in THREADS:
            assert torch.equal(cpu_kernels.gemm_f32_avx512(x, w, b, num_threads=t), one), (m, n, k, t)
    with pytest.raises(ValueError, match="gemm_f32_avx512"):
        cpu_kernels.gemm_f32_avx512(torch.zeros(cpu_kernels.MAX_ROWS + 1, 4), torch.zeros(3, 4), None)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("b", "h", "hkv", "d"), [(1, 9, 3, 64), (3, 6, 2, 20), (5, 4, 4, 72)])
def test_decode_attention_on_threads_equals_one_thread(dtype: torch.dtype, b: int, h: int, hkv: int, d: int) -> None:
    g = torch.Generator().manual_seed(b * 100 + d)
    slots_total, length = 97, 41
    q = torch.randn(b, h, d, generator=g).to(dtype)
    kc, vc = (torch.randn(slots_total, hkv, d, generator=g).to(dtype) for _ in range(2))
    slots = torch.randint(0, slots_total, (b, length), generator=g)
    lengths = torch.tensor([length - 7 * i for i in range(b)], dtype=torch.long)  # ragged: 41, 34, 27, ...
    one = cpu_kernels.decode_attn(q, kc, vc, slots, lengths, num_threads=1)
    for i in range(b):  # against SDPA on the gathered context
        n = int(lengths[i])
        ks, vs = kc[slots[i, :n]].float().transpose(0, 1), vc[slots[i, :n]].float().transpose(0, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(q[i].float()[:, None], ks, vs,
                                                               enable_gqa=h != hkv)[:, 0]
        torch.testing.assert_close(one[i].float(), ref, rtol=2e-2, atol=2e-2)
    for t in THREADS:
        assert torch.equal(cpu_kernels.decode_attn(q, kc, vc, slots, lengths, num_threads=t), one), t


@needs_avx512
@pytest.mark.parametrize(("lq", "ctx", "h", "hkv", "d"), [(37, 0, 4, 2, 48), (9, 23, 9, 3, 64), (6, 5, 2, 1, 144)])
def test_prefill_attention_on_threads_equals_one_thread(lq: int, ctx: int, h: int, hkv: int, d: int) -> None:
    g = torch.Generator().manual_seed(lq + ctx)
    total = ctx + lq
    q = torch.randn(lq, h, d, generator=g).bfloat16()
    kb, vb = (torch.randn(total + 11, hkv, d, generator=g).bfloat16() for _ in range(2))
    rows = torch.randperm(total + 11, generator=g)[:total].contiguous()
    one = cpu_kernels.prefill_attn_bf16(q, kb, vb, rows, ctx, num_threads=1)
    ks, vs = kb[rows].float().transpose(0, 1)[None], vb[rows].float().transpose(0, 1)[None]
    mask = torch.arange(total)[None, :] <= (ctx + torch.arange(lq))[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q.float().transpose(0, 1)[None], ks, vs, attn_mask=mask,
                                                           enable_gqa=h != hkv)[0].transpose(0, 1)
    torch.testing.assert_close(one.float(), ref, rtol=3e-2, atol=3e-2)
    for t in THREADS:
        assert torch.equal(cpu_kernels.prefill_attn_bf16(q, kb, vb, rows, ctx, num_threads=t), one), t


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_and_rope_on_threads_equal_one_thread(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    for rows, dim in ((400, 577), (48, 576), (3, 64)):  # split in 2 or 3 (a ragged last part), too small to split
        x, w = torch.randn(rows, dim, generator=g).to(dtype), torch.randn(dim, generator=g).to(dtype)
        one = cpu_kernels.rmsnorm(x, w, 1e-5, num_threads=1)
        for t in THREADS:
            assert torch.equal(cpu_kernels.rmsnorm(x, w, 1e-5, num_threads=t), one), (rows, dim, t)
    qkv = torch.randn(45, 15 * 64, generator=g).to(dtype)  # 45 tokens x (9 + 2 x 3 heads) x 64, a column slice
    cos, sin = (torch.randn(45, 1, 64, generator=g).to(dtype) for _ in range(2))
    x = qkv[:, : 9 * 64].view(45, 9, 64)
    one = cpu_kernels.rope(x, cos, sin, num_threads=1)
    assert torch.equal(one, x * cos + torch.cat((-x[..., 32:], x[..., :32]), dim=-1) * sin)
    for t in THREADS:
        assert torch.equal(cpu_kernels.rope(x, cos, sin, num_threads=t), one), t


@needs_kernel
def test_bad_thread_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="num_threads"):
        cpu_kernels.gemv(torch.zeros(1, 4), torch.zeros(3, 4), None, num_threads=0)


def test_default_thread_count_follows_omp_num_threads_else_the_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_num_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5, 7})
    assert default_num_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "not a number")  # ignored, as torch ignores it
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1})
    assert default_num_threads() == 1


def test_llm_takes_its_thread_count_from_the_affinity_mask(tiny_llama: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`LLM()` not told its thread count uses one thread per core of its affinity mask (stood in for here: three
    cores); told, it uses what it is told. The count is torch's, which the native kernels split over."""
    from tetriinfer import LLM

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    threads = torch.get_num_threads()
    try:
        LLM(model=str(tiny_llama), num_kv_blocks=8, max_model_len=64)
        assert torch.get_num_threads() == 3
        LLM(model=str(tiny_llama), num_kv_blocks=8, max_model_len=64, num_threads=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_thread_switch_off_gives_single_threaded_kernels_routed_at_one_thread_only(tmp_path: Path) -> None:
    """``TETRIINFER_KERNEL_THREADS=0`` builds the kernels without OpenMP: they still compute the same results,
    report themselves single-threaded, and at two torch threads the layers route to torch instead."""
    code = ("import sys, torch; from tetriinfer.engine import cpu_kernels as c; "
            "from tetriinfer.engine.models.layers import Linear, use_gemv; "
            "torch.manual_seed(0); x = torch.randn(3, 200); w = torch.randn(300, 200); "
            "assert c.kernels_available() and not c.kernels_threaded(); "
            "y = c.gemv(x, w, None, num_threads=2); "
            "torch.save(y, sys.argv[1]); "
            "torch.set_grad_enabled(False); "
            "torch.set_num_threads(1); ok1 = use_gemv(x, w); torch.set_num_threads(2); ok2 = use_gemv(x, w); "
            "sys.exit(0 if ok1 and not ok2 else 3)")
    out = tmp_path / "y.pt"
    env = {**os.environ, "TETRIINFER_KERNEL_THREADS": "0", "PYTHONPATH": ":".join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    torch.manual_seed(0)
    x, w = torch.randn(3, 200), torch.randn(300, 200)
    assert torch.equal(torch.load(out), cpu_kernels.gemv(x, w, None, num_threads=1))  # same bits either build
