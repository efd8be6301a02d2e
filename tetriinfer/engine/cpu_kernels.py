"""Native CPU kernels (AVX2, AVX-512 BF16) for decode, where torch is slow: bf16 on CPUs without bf16 instructions, and attention.

`gemv(x, weight, bias)`: the few-row (decode) linear layer, y = x @ weight.T + bias, in bf16 (products and sums in
fp32, output rounded to bf16) or fp32. torch's bf16 GEMV reads ~6 GB/s on such a CPU and its fp32 GEMM with 1-16 rows
~4-6 GB/s (per-row cost grows fast: it is not written for few rows); this kernel streams the weights once at close
to the memory bandwidth and applies them to every row while they are in cache.
`decode_attn(q, k_cache, v_cache, slots, lengths)`: decode attention over the paged KV cache (bf16 or fp32), reading
K/V in place (torch needs a gather, two fp32 copies and small batched matmuls: ~250 us per layer at batch 1).
`rmsnorm(x, w, eps)` and `rope(x, cos, sin)`: a decode step's per-token RMSNorm and rotary embedding as one call each
(torch spends 4 and 6 small ops on them, a few microseconds each, per layer), with torch's per-op rounding.
On AVX-512 BF16 CPUs a bf16 `decode_attn` takes a grouped kernel instead: one (sequence, kv head) pair per work item,
its query heads sharing every K and V row read (vdpbf16ps scores, fp32 softmax and weighted sum).
`prefill_attn_bf16(q, k, v, rows, ctx_start)`: causal prefill attention in bf16 on vdpbf16ps (torch's CPU flash
attention runs bf16 at ~18 GFLOP/s without AMX), for the same CPUs.
`gemm_bf16_avx512(x, weight, bias)`: the same few-row bf16 matmul with AVX-512 BF16's vdpbf16ps (32 bf16 pairs per
instruction), for CPUs that have it (AMD Zen 4, Intel Cooper Lake / Sapphire Rapids): 3-7x the AVX2 kernel and
1.1-3.6x oneDNN's bf16 GEMM from 1 to 64 rows on Zen 4 (`benchmarks/bench_decode_kernels.py`).
`gemm_f32_avx512(x, weight, bias)`: the few-row fp32 matmul on 16-lane FMAs, same layout (1.2-2.1x torch's fp32
GEMM from 4 to 64 rows on one Zen 4 core, 1.65-3.8x on two).
Sources: `csrc/decode_kernels.c` (AVX2 + FMA), `csrc/avx512_bf16.c` (the AVX-512 ones, built only where the CPU
has AVX-512 BF16), and `csrc/kernel_threads.h`, the threading helpers both include.

The C source is compiled at first use with the system C compiler (`$CC`, else `cc`/`gcc`; about a second)
into `<cache>/kernels/` (once per source version and flags) and loaded with ctypes -- no torch headers, no build
step at install. Every failure (no compiler, no AVX2/FMA, a compile error) leaves `kernels_available()` False and
callers keep torch's path. `TETRIINFER_CPU_KERNELS=0` turns the kernels off; `TETRIINFER_AVX512_BF16=0` only the
AVX-512 BF16 ones (matmuls, prefill and grouped decode attention).

Threads: the sources are built with ``-fopenmp`` where the compiler supports it and link ``libgomp.so.1`` by soname,
so in this process they share the OpenMP runtime torch already loaded: one pool of threads for torch's ops and the
kernels, never two pools spinning against each other. Each call takes ``num_threads`` (default: torch's current
intra-op thread count) and splits its work: matmuls over the rows of the weight (output features, whole groups of
4), decode attention over (sequence, query head) pairs, prefill attention over (query head, query block) pairs.
Every output element is computed by the same code whatever the split, so any thread count gives bit-identical
results. Without OpenMP (the compile with ``-fopenmp`` failed, or a second OpenMP runtime got mapped) the kernels
build without it and `kernels_threaded()` is False: they then run on one thread and the engine routes to them only
when it runs one torch thread.

Invariants: the kernels only read their inputs and write a fresh output tensor; they run with the GIL released
(ctypes).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from tetriinfer.engine.cpu_info import cpu_flags

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"  # the kernel sources and the header they share
SOURCE = CSRC / "decode_kernels.c"
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fPIC", "-shared", "-std=c11"]
AVX512_SOURCE = SOURCE.with_name("avx512_bf16.c")
AVX512_CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-fPIC", "-shared",
                 "-std=c11"]
AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})
LIBS = ["-lm"]
OPENMP_FLAGS = ["-fopenmp"]
MAX_ROWS = 64  # the kernel's x stays in cache up to here; callers use it for far fewer rows
LLAMA_LAYER_WORDS = 12  # addresses per layer in `llama_decode_layers`' table (the C enum LW_*)


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _library_path(source: Path = SOURCE, cflags: list[str] = CFLAGS) -> Path:
    from tetriinfer.engine.make_model import cache_dir

    headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))  # what the sources include
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join(cflags).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"{source.stem}-{digest}.so"


def _build(cc: str, lib: Path, source: Path = SOURCE, cflags: list[str] = CFLAGS) -> None:
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *cflags, "-I", str(CSRC), "-o", tmp, str(source), *LIBS], check=True,
                       capture_output=True, timeout=120)
        os.replace(tmp, lib)  # atomic: concurrent first uses (one per instance process) never see half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open_one(source: Path, cflags: list[str]) -> ctypes.CDLL | None:
    lib = _library_path(source, cflags)
    if not lib.exists():  # built once per source version; a cached build needs no compiler
        cc = _compiler()
        if cc is None:
            log.info("no C compiler found: decode matmuls use torch's kernels")
            return None
        _build(cc, lib, source, cflags)
    return ctypes.CDLL(str(lib))


def _open_library(source: Path, cflags: list[str]) -> ctypes.CDLL | None:
    """The compiled ``source`` (built on first use, once per source version and flags), or None without a compiler:
    with OpenMP (``cflags + OPENMP_FLAGS``) where that builds and loads and `TETRIINFER_KERNEL_THREADS` is not 0,
    else without. Raises OSError / SubprocessError when the plain build or its load fails."""
    if os.environ.get("TETRIINFER_KERNEL_THREADS", "1") != "0":
        try:
            return _open_one(source, [*cflags, *OPENMP_FLAGS])
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            log.info("%s: no OpenMP build (%s %s): its kernels run on one thread", source.name, e,
                     detail.decode(errors="replace")[:300])
    return _open_one(source, cflags)


def _openmp_runtimes() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process (libgomp / libomp / libiomp), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if line.rstrip().endswith((".so", ".so.1", ".so.5"))}
    except OSError:
        return set()
    return {p for p in paths if any(n in os.path.basename(p) for n in ("libgomp", "libomp", "libiomp"))}


@functools.cache
def _load() -> ctypes.CDLL | None:
    if os.environ.get("TETRIINFER_CPU_KERNELS", "1") == "0":
        return None
    if not {"avx2", "fma"} <= cpu_flags():
        return None
    try:
        dll = _open_library(SOURCE, CFLAGS)
        if dll is None:
            return None
        gemvs = (dll.tetri_gemv_bf16, dll.tetri_gemv_f32)
        attns = (dll.tetri_decode_attn_bf16, dll.tetri_decode_attn_f32)
        norms = (dll.tetri_rmsnorm_bf16, dll.tetri_rmsnorm_f32)
        ropes = (dll.tetri_rope_bf16, dll.tetri_rope_f32)
        fused = dll.tetri_llama_decode_layers
        silus = (dll.tetri_silu_mul_bf16, dll.tetri_silu_mul_f32)
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("bf16 CPU kernel unavailable (%s %s): torch's kernels are used", e,
                    detail.decode(errors="replace")[:500])
        return None
    for fn in gemvs:
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4  # ..., M, N, K, nthreads
        fn.restype = ctypes.c_int
    for fn in norms:
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int64]
        fn.restype = ctypes.c_int
    for fn in ropes:
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5  # ..., T, H, D, token stride, nthreads
        fn.restype = ctypes.c_int
    for fn in attns:
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int64]
        fn.restype = ctypes.c_int
    for fn in silus:
        fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3  # gu, act, M, inter, nthreads
        fn.restype = ctypes.c_int
    dll.tetri_argmax_rows.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64]
    dll.tetri_argmax_rows.restype = ctypes.c_int
    fused.argtypes = ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 6
                      + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_float, ctypes.c_int64, ctypes.c_void_p,
                                               ctypes.c_int64])
    fused.restype = ctypes.c_int
    dll.tetri_llama_decode_scratch.argtypes = [ctypes.c_int64] * 6
    dll.tetri_llama_decode_scratch.restype = ctypes.c_int64
    dll.tetri_llama_decode_layer_words.restype = ctypes.c_int64
    assert dll.tetri_llama_decode_layer_words() == LLAMA_LAYER_WORDS, "the C enum LW_* and this module disagree"
    dll.threaded = _threaded(dll, "tetri_openmp")
    return dll


def _threaded(dll: ctypes.CDLL, probe: str) -> bool:
    """Whether `dll` was built with OpenMP and shares this process's only OpenMP runtime (torch's)."""
    fn = getattr(dll, probe, None)
    if fn is None or fn() != 1:
        return False
    runtimes = _openmp_runtimes()
    if len(runtimes) > 1:
        log.warning("two OpenMP runtimes are loaded (%s): the native kernels run on one thread", sorted(runtimes))
        return False
    return True


def kernels_available() -> bool:
    return _load() is not None


def kernels_threaded() -> bool:
    """Whether every built native kernel splits its work over several threads (OpenMP builds sharing torch's
    runtime); False when the kernels are unavailable or single-threaded."""
    dll = _load()
    if dll is None or not dll.threaded:
        return False
    avx = _load_avx512()
    return avx is None or avx.threaded


def _threads(dll: ctypes.CDLL, num_threads: int | None) -> int:
    """The threads a call may use: ``num_threads`` (default torch's intra-op count), 1 for a single-threaded build."""
    n = torch.get_num_threads() if num_threads is None else num_threads
    if n < 1:
        raise ValueError(f"num_threads must be >= 1, got {n}")
    return n if dll.threaded else 1


@functools.cache
def _load_avx512() -> ctypes.CDLL | None:
    """The AVX-512 BF16 matmul library, or None: kernels off (either switch), a CPU without every flag it is built
    for, no compiler, or a failed build (logged; callers keep the other paths)."""
    if os.environ.get("TETRIINFER_AVX512_BF16", "1") == "0" or _load() is None:
        return None
    if not AVX512_FLAGS <= cpu_flags():
        return None
    try:
        dll = _open_library(AVX512_SOURCE, AVX512_CFLAGS)
        if dll is None:
            return None
        fn = dll.tetri_gemm_bf16_avx512
        fn32 = dll.tetri_gemm_f32_avx512
        attn = dll.tetri_prefill_attn_bf16
        gqa = dll.tetri_decode_attn_gqa_bf16
        gqa32 = dll.tetri_decode_attn_gqa_f32
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("AVX-512 BF16 matmul unavailable (%s %s): the other kernels are used", e,
                    detail.decode(errors="replace")[:500])
        return None
    for f in (fn, fn32):
        f.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4  # ..., M, N, K, nthreads
        f.restype = ctypes.c_int
    attn.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p]
                     + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int64])
    attn.restype = ctypes.c_int
    for f in (gqa, gqa32):
        f.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int64]
        f.restype = ctypes.c_int
    dll.threaded = _threaded(dll, "tetri_avx512_openmp")
    return dll


def avx512_bf16_available() -> bool:
    """Whether `gemm_bf16_avx512` and `prefill_attn_bf16` can run here (AVX-512 BF16 CPU, kernels built, neither
    switch off)."""
    return _load_avx512() is not None


def gemm_bf16_avx512(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     num_threads: int | None = None) -> torch.Tensor:
    """[M, K] @ [N, K].T (+ [N]) -> [M, N], all bf16 (products exact, sums in fp32, output rounded to nearest even);
    M <= MAX_ROWS; the weight rows split over up to ``num_threads`` threads (default torch's count; bit-identical
    for any count). Call only when `avx512_bf16_available()`; contiguous CPU tensors."""
    dll = _load_avx512()
    assert dll is not None
    m, k = x.shape
    n = weight.shape[0]
    if (weight.shape[1] != k or (bias is not None and bias.shape != (n,)) or not 0 < m <= MAX_ROWS
            or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16
            or (bias is not None and bias.dtype != torch.bfloat16)):
        raise ValueError(f"gemm_bf16_avx512: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
                         f"{weight.dtype}, bias {None if bias is None else (tuple(bias.shape), bias.dtype)}")
    y = torch.empty((m, n), dtype=torch.bfloat16)
    dll.tetri_gemm_bf16_avx512(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                               y.data_ptr(), m, n, k, _threads(dll, num_threads))
    return y


def gemm_f32_avx512(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    num_threads: int | None = None) -> torch.Tensor:
    """[M, K] @ [N, K].T (+ [N]) -> [M, N], all fp32 on 16-lane FMAs (only the summation order differs from
    torch); M <= MAX_ROWS; the weight rows split over up to ``num_threads`` threads (default torch's count;
    bit-identical for any count). Call only when `avx512_bf16_available()`; contiguous CPU tensors."""
    dll = _load_avx512()
    assert dll is not None
    m, k = x.shape
    n = weight.shape[0]
    if (weight.shape[1] != k or (bias is not None and bias.shape != (n,)) or not 0 < m <= MAX_ROWS
            or x.dtype != torch.float32 or weight.dtype != torch.float32
            or (bias is not None and bias.dtype != torch.float32)):
        raise ValueError(f"gemm_f32_avx512: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
                         f"{weight.dtype}, bias {None if bias is None else (tuple(bias.shape), bias.dtype)}")
    y = torch.empty((m, n), dtype=torch.float32)
    dll.tetri_gemm_f32_avx512(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                              y.data_ptr(), m, n, k, _threads(dll, num_threads))
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         num_threads: int | None = None) -> torch.Tensor:
    """[M, K] @ [N, K].T (+ [N]) -> [M, N] on CPU, all bf16 or all fp32; M <= MAX_ROWS; the weight rows split over
    up to ``num_threads`` threads (default torch's count; bit-identical for any count). Call only when
    `kernels_available()`; inputs must be contiguous CPU tensors of one dtype."""
    dll = _load()
    assert dll is not None
    m, k = x.shape
    n = weight.shape[0]
    dtype = x.dtype
    if (weight.shape[1] != k or (bias is not None and bias.shape != (n,)) or m > MAX_ROWS
            or dtype not in (torch.bfloat16, torch.float32) or weight.dtype != dtype
            or (bias is not None and bias.dtype != dtype)):
        raise ValueError(f"gemv: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}, "
                         f"bias {None if bias is None else (tuple(bias.shape), bias.dtype)}")
    y = torch.empty((m, n), dtype=dtype)
    fn = dll.tetri_gemv_f32 if dtype == torch.float32 else dll.tetri_gemv_bf16
    rc = fn(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
            _threads(dll, num_threads))
    if rc != 0:
        raise MemoryError("gemv: out of memory for its scratch buffer")
    return y


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, num_threads: int | None = None) -> torch.Tensor:
    """[M, N] -> [M, N], ``weight * rms_norm(x.float(), eps).to(x.dtype)`` (torch's rounding), fp32 or bf16; contiguous
    CPU tensors of one dtype; rows split over up to ``num_threads`` threads when there are enough (bit-identical
    for any count). Call only when `kernels_available()`."""
    dll = _load()
    assert dll is not None
    if (x.dim() != 2 or weight.shape != (x.shape[1],) or x.dtype != weight.dtype
            or x.dtype not in (torch.bfloat16, torch.float32)):
        raise ValueError(f"rmsnorm: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    y = torch.empty_like(x)
    fn = dll.tetri_rmsnorm_f32 if x.dtype == torch.float32 else dll.tetri_rmsnorm_bf16
    fn(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps, _threads(dll, num_threads))
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """Rotate-half RoPE: x [T, H, D] (heads and dims contiguous, any token stride: a column slice of the fused qkv
    projection), cos / sin [T, 1, D] contiguous -> [T, H, D] contiguous, ``x * cos + cat(-x2, x1) * sin`` with torch's
    per-op rounding (fp32 bit-identical); (token, head) pairs split over up to ``num_threads`` threads when there
    are enough (bit-identical for any count). Call only when `kernels_available()`."""
    dll = _load()
    assert dll is not None
    t, h, d = x.shape
    if (d % 2 or x.stride(2) != 1 or x.stride(1) != d or cos.shape != (t, 1, d) or sin.shape != cos.shape
            or not cos.is_contiguous() or not sin.is_contiguous() or not x.dtype == cos.dtype == sin.dtype
            or x.dtype not in (torch.bfloat16, torch.float32)):
        raise ValueError(f"rope: x {tuple(x.shape)} strides {x.stride()} {x.dtype}, cos {tuple(cos.shape)} {cos.dtype}")
    out = torch.empty((t, h, d), dtype=x.dtype)
    fn = dll.tetri_rope_f32 if x.dtype == torch.float32 else dll.tetri_rope_bf16
    fn(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), t, h, d, x.stride(0), _threads(dll, num_threads))
    return out


def silu_mul(gu: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """[M, 2 * inter] ([gate | up], the fused gate_up projection) -> [M, inter] = ``F.silu(gate) * up`` with torch's
    per-op rounding (fp32 math, each op rounded to the dtype; exp within about one fp32 ulp of torch's), fp32 or bf16,
    contiguous; rows split over up to ``num_threads`` threads when there are enough (bit-identical for any count).
    Call only when `kernels_available()`."""
    dll = _load()
    assert dll is not None
    if gu.dim() != 2 or gu.shape[1] % 2 or not gu.is_contiguous() or gu.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"silu_mul: gu {tuple(gu.shape)} {gu.dtype}")
    m, inter = gu.shape[0], gu.shape[1] // 2
    act = torch.empty((m, inter), dtype=gu.dtype)
    fn = dll.tetri_silu_mul_f32 if gu.dtype == torch.float32 else dll.tetri_silu_mul_bf16
    fn(gu.data_ptr(), act.data_ptr(), m, inter, _threads(dll, num_threads))
    return act


def argmax_rows(x: torch.Tensor, num_threads: int | None = None) -> list[int]:
    """The index of each row's first maximum, as ``x.float().argmax(dim=-1).tolist()`` gives it (NaN counts as the
    largest, the first NaN wins), for a contiguous [M, N] fp32 or bf16 tensor, without the fp32 copy (torch's bf16
    argmax is slower still). Rows split over up to ``num_threads`` threads. Call only when `kernels_available()`."""
    dll = _load()
    assert dll is not None
    if x.dim() != 2 or not x.is_contiguous() or x.dtype not in (torch.bfloat16, torch.float32) or x.shape[1] == 0:
        raise ValueError(f"argmax_rows: x {tuple(x.shape)} {x.dtype}")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    dll.tetri_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], int(x.dtype == torch.float32), out.data_ptr(),
                          _threads(dll, num_threads))
    return out.tolist()


GQA_DECODE_MAX_GROUP = 8  # query heads per kv head the grouped decode kernels take (their accumulators)


def grouped_decode_attn_ok(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a `decode_attn` of this shape and dtype takes a grouped AVX-512 kernel (else the AVX2 one): bf16
    head dims a multiple of 32, fp32 a multiple of 16, at most 256."""
    return (head_dim % (32 if dtype == torch.bfloat16 else 16) == 0 and head_dim <= 256
            and heads // kv_heads <= GQA_DECODE_MAX_GROUP and _load_avx512() is not None)


def decode_attn(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                lengths: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """q [B, H, D]; k_cache, v_cache [S, Hkv, D] (bf16 or fp32, as q); slots [B, L] int64 (row b: its first
    lengths[b] entries are its context's slots); lengths [B] int64 -> [B, H, D] in q's dtype (softmax(q k^T /
    sqrt(D)) v per head, grouped-query, fp32 math); (sequence, head) pairs split over up to ``num_threads`` threads
    (default torch's count; bit-identical for any count). Shapes that `grouped_decode_attn_ok` accepts take an
    AVX-512 kernel over (sequence, kv head) pairs: bf16 scores from vdpbf16ps (exact products, fp32 sums), fp32 from
    16-lane FMAs, each K and V row read once for all the query heads of its group. Call only
    when `kernels_available()`; contiguous CPU tensors. Slots must lie in [0, S) (the engine's own block tables; not checked per call)."""
    dll = _load()
    assert dll is not None
    b, h, d = q.shape
    s, hkv, dk = k_cache.shape
    length = slots.shape[1]
    if (dk != d or v_cache.shape != k_cache.shape or h % hkv or slots.shape[0] != b or lengths.shape != (b,)
            or slots.dtype != torch.int64 or lengths.dtype != torch.int64
            or not q.dtype == k_cache.dtype == v_cache.dtype or q.dtype not in (torch.bfloat16, torch.float32)):
        raise ValueError(f"decode_attn: q {tuple(q.shape)} {q.dtype}, k/v cache {tuple(k_cache.shape)} "
                         f"{k_cache.dtype}, slots {tuple(slots.shape)} {slots.dtype}, lengths {tuple(lengths.shape)}")
    out = torch.empty_like(q)
    fn = dll.tetri_decode_attn_f32 if q.dtype == torch.float32 else dll.tetri_decode_attn_bf16
    if grouped_decode_attn_ok(h, hkv, d, q.dtype):
        dll = _load_avx512()
        fn = dll.tetri_decode_attn_gqa_f32 if q.dtype == torch.float32 else dll.tetri_decode_attn_gqa_bf16
    rc = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), lengths.data_ptr(),
            out.data_ptr(), b, h, hkv, d, length, d ** -0.5, _threads(dll, num_threads))
    if rc != 0:
        raise MemoryError("decode_attn: out of memory for its scratch buffers")
    return out


PREFILL_ATTN_MAX_HEAD_DIM = 256


def prefill_attn_bf16(q: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor, rows: torch.Tensor,
                      ctx_start: int, num_threads: int | None = None) -> torch.Tensor:
    """Causal prefill attention in bf16 (AVX-512 BF16): q [Lq, H, D] (heads and dims contiguous, any token stride);
    k_base / v_base [S, Hkv, D] contiguous, row ``rows[j]`` holding key position j for j < ctx_start + Lq (rows: int64
    [ctx_start + Lq]); query i sits at position ctx_start + i and sees keys 0..ctx_start + i -> [Lq, H, D] bf16
    (fp32 scores and softmax, weights rounded to bf16 for the sum over V); (head, query block) pairs split over up
    to ``num_threads`` threads (default torch's count; bit-identical for any count). Call only when
    `avx512_bf16_available()`; rows must lie in [0, S) (the engine's own slots: not checked per row)."""
    dll = _load_avx512()
    assert dll is not None
    lq, h, d = q.shape
    s, hkv, dk = k_base.shape
    if (q.dtype != torch.bfloat16 or k_base.dtype != torch.bfloat16 or v_base.dtype != torch.bfloat16
            or dk != d or v_base.shape != k_base.shape or not k_base.is_contiguous() or not v_base.is_contiguous()
            or q.stride(2) != 1 or q.stride(1) != d or h % hkv or d % 16 or d > PREFILL_ATTN_MAX_HEAD_DIM
            or rows.dtype != torch.int64 or rows.shape != (ctx_start + lq,) or not rows.is_contiguous()
            or ctx_start < 0 or lq < 1):
        raise ValueError(f"prefill_attn_bf16: q {tuple(q.shape)} strides {q.stride()} {q.dtype}, k/v {tuple(k_base.shape)} "
                         f"{k_base.dtype}, rows {tuple(rows.shape)} {rows.dtype}, ctx_start {ctx_start}")
    out = torch.empty((lq, h, d), dtype=torch.bfloat16)
    rc = dll.tetri_prefill_attn_bf16(q.data_ptr(), q.stride(0), k_base.data_ptr(), v_base.data_ptr(), rows.data_ptr(),
                                     hkv * d, out.data_ptr(), lq, ctx_start, h, hkv, d, d ** -0.5,
                                     _threads(dll, num_threads))
    if rc != 0:
        raise MemoryError("prefill_attn_bf16: out of memory for its scratch buffers")
    return out


# ---- the fused decode step (`tetriinfer.engine.fused_decode`) ------------------------------------------------------

def _address(fn: ctypes._CFuncPtr) -> int:  # type: ignore[name-defined]
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


def matmul_address(name: str, dtype: torch.dtype) -> int:
    """The C entry point of the native matmul ``name`` ("gemv", "gemm_bf16_avx512", "gemm_f32_avx512", as
    `Linear.native_kernel` names them) for ``dtype``: all share tetri_gemv_*'s signature."""
    if name == "gemv":
        dll = _load()
        assert dll is not None
        return _address(dll.tetri_gemv_f32 if dtype == torch.float32 else dll.tetri_gemv_bf16)
    avx = _load_avx512()
    assert avx is not None
    if name == "gemm_bf16_avx512":
        return _address(avx.tetri_gemm_bf16_avx512)
    if name == "gemm_f32_avx512":
        return _address(avx.tetri_gemm_f32_avx512)
    raise KeyError(name)


def decode_attn_address(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> int:
    """The C entry point `decode_attn` calls for queries of ``dtype`` and this head shape."""
    dll = _load()
    assert dll is not None
    if grouped_decode_attn_ok(heads, kv_heads, head_dim, dtype):
        avx = _load_avx512()
        assert avx is not None
        return _address(avx.tetri_decode_attn_gqa_f32 if dtype == torch.float32 else avx.tetri_decode_attn_gqa_bf16)
    if dtype == torch.float32:
        return _address(dll.tetri_decode_attn_f32)
    return _address(dll.tetri_decode_attn_bf16)


def llama_decode_scratch(rows: int, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int) -> int:
    """Elements of scratch (in the model dtype) `llama_decode_layers` needs for ``rows`` tokens."""
    dll = _load()
    assert dll is not None
    return int(dll.tetri_llama_decode_scratch(rows, hidden, heads, kv_heads, head_dim, inter))


def llama_decode_layers(x: torch.Tensor, table: torch.Tensor, num_layers: int, fns: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, slot_mapping: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                        cfg: object, scratch: torch.Tensor, num_threads: int | None = None) -> None:
    """Every decoder layer of a decode-only step in one call (``tetri_llama_decode_layers``), x [B, hidden] updated
    in place. ``table``: num_layers x 12 int64 addresses (weights, biases or 0, K and V caches; see the C enum);
    ``fns``: [qkv, o, gate_up, down, attention] kernel addresses; cos, sin [B, head_dim] (any [B, 1, D] view);
    slot_mapping [B], slots [B, L], lengths [B] int64; ``cfg`` a `ModelConfig`. Call only with tensors the engine
    built for this step (`FusedDecode.applies`): nothing here is checked per element."""
    dll = _load()
    assert dll is not None
    b, hidden = x.shape
    c = cfg
    if (not x.is_contiguous() or table.dtype != torch.int64 or table.numel() != num_layers * LLAMA_LAYER_WORDS
            or fns.numel() != 5 or slots.shape[0] != b or lengths.shape != (b,) or slot_mapping.shape != (b,)
            or scratch.dtype != x.dtype or cos.dtype != x.dtype or cos.numel() != b * c.head_dim):  # type: ignore[attr-defined]
        raise ValueError(f"llama_decode_layers: x {tuple(x.shape)} {x.dtype}, table {tuple(table.shape)}, "
                         f"slots {tuple(slots.shape)}, lengths {tuple(lengths.shape)}")
    nthreads = (torch.get_num_threads() if num_threads is None else num_threads) if kernels_threaded() else 1
    rc = dll.tetri_llama_decode_layers(
        x.data_ptr(), table.data_ptr(), num_layers, fns.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        slot_mapping.data_ptr(), slots.data_ptr(), lengths.data_ptr(), slots.shape[1], b, hidden,
        c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.norm_eps,  # type: ignore[attr-defined]
        c.head_dim ** -0.5, int(x.dtype == torch.float32), scratch.data_ptr(), nthreads)  # type: ignore[attr-defined]
    if rc != 0:
        raise MemoryError("llama_decode_layers: a kernel ran out of memory for its scratch buffers")
