/* Kernels for CPUs with AVX-512 BF16 (AMD Zen 4, Intel Cooper Lake / Sapphire Rapids), built on vdpbf16ps:
 * tetri_gemm_bf16_avx512 (a few-row matmul for decode batches) and tetri_prefill_attn_bf16 (causal prefill
 * attention, below); and tetri_gemm_f32_avx512, the few-row matmul in fp32 on 16-lane FMAs.
 *
 * Few-row matmul:
 *
 * y[m, n] = bf16( sum_k x[m, k] * w[n, k] + bias[n] ),  0 <= m < M, 0 <= n < N
 * x: [M, K] bf16 row-major, w: [N, K] bf16 row-major (nn.Linear's weight), bias: [N] bf16 or NULL,
 * y: [M, N] bf16 row-major. Each bf16 x bf16 product is exact in fp32; sums in fp32 (vdpbf16ps adds pairs of products
 * into fp32 lanes, denormal inputs count as zero); the output is rounded to nearest even, as torch does.
 *
 * Why: a decode step's matmuls have few rows (the batch), so their cost is the weight read plus, per row, the
 * multiply-adds. The AVX2 kernel (decode_kernels.c) converts bf16 to fp32 and issues 8-lane FMAs (~45-50 GFLOP/s on
 * one core); vdpbf16ps takes 32 bf16 pairs per instruction, so the per-row part shrinks ~3-4x, while oneDNN's bf16
 * GEMM carries ~20 us of fixed cost per call on such CPUs (no AMX). Layout as in the AVX2 kernel: a group of NB <= 4
 * weight rows is read once and applied to every row of x, R <= 6 rows per pass (24 accumulators + 4 weight vectors +
 * one x vector = 29 of the 32 zmm registers), the group stays in L1 between passes. K tails use masked loads
 * (zeros contribute nothing). Only reads its inputs and writes y.
 *
 * Threads: built with -fopenmp (linking libgomp.so.1 by soname, so it shares the OpenMP runtime torch loaded: one
 * pool of threads, no oversubscription), the matmuls split the weight rows (output features) over the team in whole
 * groups of 4 and prefill attention deals out its (query head, query block) pairs; each output element is computed
 * by exactly the code a single thread runs, so every thread count gives bit-identical results. Without OpenMP the
 * pragmas are ignored and everything runs on the calling thread (tetri_avx512_openmp() says which).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernel_threads.h"

/* 1 when built with OpenMP (the kernels split their work over the threads they are given), else 0. */
int tetri_avx512_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

#define TR 6 /* rows of x per pass */
#define PF_GROUPS 4 /* prefetch the weight group this many groups ahead, into L2: prefetched into L1 (T0), the 4
                      * interleaved row streams evicted each other and a weight read from DRAM ran at ~11 GB/s on one
                      * Zen 4 core (the 49152 x 576 LM head at 1 row: 4.75 ms with T0, 1.84 ms with T1) */

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline __m512bh ld(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512((const void *)p); }
static inline __m512bh ldm(const uint16_t *p, __mmask32 m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }

/* The four lane sums of a[0..3] as one 4-lane vector: lane j = sum of a[j]'s 16 lanes (an unpack/add tree). */
static inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1)); /* per 128: a0 a1 a0 a1 */
    __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1)); /* per 128: a0 a1 a2 a3 */
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* y[r, j] = bf16(dot(x[r], w[j]) + bias[j]) for NB weight rows and R x rows (compile-time constants after inlining);
 * y points at y[m0, n0], row stride N. bias: NULL or bias + n0. The four sums of a row are added to the bias and rounded
 * as one vector (vcvtneps2bf16: round to nearest even, NaN stays NaN). */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                                                        uint16_t *y, int64_t N, int64_t K, int NB, int R,
                                                        const char *pf) {
    __m512 acc[TR][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv[4];
        for (int j = 0; j < NB; j++) wv[j] = ld(w + j * K + k);
        if (pf)
            for (int j = 0; j < 4; j++) _mm_prefetch(pf + (j * K + k) * 2, _MM_HINT_T1);
        for (int r = 0; r < R; r++) {
            __m512bh xv = ld(x + r * K + k);
            for (int j = 0; j < NB; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xv);
        }
    }
    if (k < K) {
        __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        __m512bh wv[4];
        for (int j = 0; j < NB; j++) wv[j] = ldm(w + j * K + k, m);
        for (int r = 0; r < R; r++) {
            __m512bh xv = ldm(x + r * K + k, m);
            for (int j = 0; j < NB; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xv);
        }
    }
    __m128 b = _mm_setzero_ps();
    if (bias) {
        float bf[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int j = 0; j < NB; j++) bf[j] = bf16_to_f32(bias[j]);
        b = _mm_loadu_ps(bf);
    }
    for (int r = 0; r < R; r++) {
        __m128i h = (__m128i)_mm_cvtneps_pbh(_mm_add_ps(sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), b));
        if (NB == 4) {
            _mm_storel_epi64((__m128i *)(y + r * N), h);
        } else {
            uint16_t t[8];
            _mm_storeu_si128((__m128i *)t, h);
            memcpy(y + r * N, t, (size_t)NB * 2);
        }
    }
}

/* tile() for a full group of 4 weight rows with the loops swapped: weight row j's chunks all before row j + 1's, so the
 * group is read as one linear stream (its 4 rows are adjacent in memory), without software prefetch. Each
 * accumulator sees the same products in the same order and the same reduction follows, so the result is
 * bit-identical to tile()'s. For 1-3 x rows the 4 interleaved row streams of tile() held a weight read from DRAM
 * to ~18-22 GB/s on one Zen 4 core (thirty 3072 x 576 matrices on huge pages, 1-3 rows), this order streams at
 * 27-33 GB/s (touching every cache line: 31-34); from 4 rows on, the interleaved order with its prefetch wins. */
#define ROW_ORDER_MAX_ROWS 3
static inline __attribute__((always_inline)) void tile_by_row(const uint16_t *x, const uint16_t *w,
                                                               const uint16_t *bias, uint16_t *y, int64_t N,
                                                               int64_t K, int R, const char *pf) {
    __m512 acc[ROW_ORDER_MAX_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    int64_t kfull = K - K % 32;
    __mmask32 m = (__mmask32)((1ull << (K - kfull)) - 1);
    for (int j = 0; j < 4; j++) {
        const uint16_t *wj = w + j * K;
        for (int64_t k = 0; k < kfull; k += 32) {
            __m512bh wv = ld(wj + k);
            if (pf) _mm_prefetch(pf + (j * K + k) * 2, _MM_HINT_T1);
            for (int r = 0; r < R; r++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv, ld(x + r * K + k));
        }
        if (kfull < K) {
            __m512bh wv = ldm(wj + kfull, m);
            for (int r = 0; r < R; r++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv, ldm(x + r * K + kfull, m));
        }
    }
    __m128 b = _mm_setzero_ps();
    if (bias) {
        float bf[4];
        for (int j = 0; j < 4; j++) bf[j] = bf16_to_f32(bias[j]);
        b = _mm_loadu_ps(bf);
    }
    for (int r = 0; r < R; r++)
        _mm_storel_epi64((__m128i *)(y + r * N),
                         (__m128i)_mm_cvtneps_pbh(_mm_add_ps(sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), b)));
}

#define TILE(nb, r) tile(xr, wr, br, yr, N, K, nb, r, pf)
static inline __attribute__((always_inline)) void tile_any(const uint16_t *xr, const uint16_t *wr, const uint16_t *br,
                                                            uint16_t *yr, int64_t N, int64_t K, int NB, int R,
                                                            const char *pf) {
    if (NB == 4) {
        switch (R) {
            case 1: TILE(4, 1); break;
            case 2: TILE(4, 2); break;
            case 3: TILE(4, 3); break;
            case 4: TILE(4, 4); break;
            case 5: TILE(4, 5); break;
            default: TILE(4, 6); break;
        }
    } else { /* the last, partial weight group (N % 4 rows): one x row at a time */
        for (int r = 0; r < R; r++) {
            if (NB == 1) tile(xr + r * K, wr, br, yr + r * N, N, K, 1, 1, NULL);
            else if (NB == 2) tile(xr + r * K, wr, br, yr + r * N, N, K, 2, 1, NULL);
            else tile(xr + r * K, wr, br, yr + r * N, N, K, 3, 1, NULL);
        }
    }
}

/* Loop order. While the rows of x and one weight group fit in L1 ((M + 4) * K elements within L1_ROWS_BYTES),
 * each group is read once and every pass over x runs on it (group outer, passes inner). Past that, each group's
 * passes would stream x from L2 again; instead the weight rows go in panels of PANEL_ROWS (L2-sized for K up to
 * ~1000 bf16) and each pass of up to 6 x rows runs over the whole panel (panel outer, passes, groups inner): x stays
 * in L1 and the panel is re-read from L2. Every output element still sums the same products in the same order.
 * Zen 4, one core, bf16, 48 rows: 3072 x 576 and 576 x 1536 matmuls 1.10-1.15x faster; at 16 rows over K = 1536
 * 1.2x; at 16-19 rows over K = 576 the group order stays (it was 5-10% faster there). */
#define L1_ROWS_BYTES (28 * 1024)
#define PANEL_ROWS 512

/* The body of gemm_cols / gemm_cols_f32 (element type T, their tile functions): see the loop order above. */
#define GEMM_COLS_BODY(T, TILE_ANY, TILE_BY_ROW)                                                                      \
    /* ceil(M / TR) passes of near-equal size (8 rows: 4 + 4, not 6 + 2: a thin pass is load-bound) */                \
    int64_t passes = (M + TR - 1) / TR;                                                                               \
    if (M > ROW_ORDER_MAX_ROWS && (M + 4) * K * (int64_t)sizeof(T) > L1_ROWS_BYTES) { /* x does not stay in L1: panel order */ \
        for (int64_t p0 = lo; p0 < hi; p0 += PANEL_ROWS) {                                                            \
            int64_t p1 = hi - p0 < PANEL_ROWS ? hi : p0 + PANEL_ROWS;                                                 \
            for (int64_t p = 0, m0 = 0; p < passes; p++) {                                                            \
                int R = (int)(M / passes + (p < M % passes));                                                         \
                for (int64_t n0 = p0; n0 < p1; n0 += 4) {                                                             \
                    int NB = p1 - n0 < 4 ? (int)(p1 - n0) : 4;                                                        \
                    const T *wr = w + n0 * K, *br = bias ? bias + n0 : NULL;                                          \
                    const char *pf = m0 == 0 && n0 + 4 * PF_GROUPS < hi ? (const char *)(wr + 4 * PF_GROUPS * K) : NULL; \
                    TILE_ANY(x + m0 * K, wr, br, y + m0 * N + n0, N, K, NB, R, pf);                                   \
                }                                                                                                     \
                m0 += R;                                                                                              \
            }                                                                                                         \
        }                                                                                                             \
        return;                                                                                                       \
    }                                                                                                                 \
    for (int64_t n0 = lo; n0 < hi; n0 += 4) {                                                                         \
        int NB = hi - n0 < 4 ? (int)(hi - n0) : 4;                                                                    \
        const T *wr = w + n0 * K, *br = bias ? bias + n0 : NULL;                                                      \
        if (NB == 4 && M <= ROW_ORDER_MAX_ROWS) {                                                                     \
            if (M == 1) TILE_BY_ROW(x, wr, br, y + n0, N, K, 1, NULL);                                                \
            else if (M == 2) TILE_BY_ROW(x, wr, br, y + n0, N, K, 2, NULL);                                           \
            else TILE_BY_ROW(x, wr, br, y + n0, N, K, 3, n0 + 4 * PF_GROUPS < hi ? (const char *)(wr + 4 * PF_GROUPS * K) : NULL); \
            continue;                                                                                                 \
        }                                                                                                             \
        for (int64_t p = 0, m0 = 0; p < passes; p++) {                                                                \
            int R = (int)(M / passes + (p < M % passes));                                                             \
            const char *pf = m0 == 0 && n0 + 4 * PF_GROUPS < hi ? (const char *)(wr + 4 * PF_GROUPS * K) : NULL;      \
            TILE_ANY(x + m0 * K, wr, br, y + m0 * N + n0, N, K, NB, R, pf);                                           \
            m0 += R;                                                                                                  \
        }                                                                                                             \
    }

/* Weight rows [lo, hi) of the matmul (lo a multiple of 4): the groups of 4 a single thread would form. */
static void gemm_cols(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                      int64_t K, int64_t lo, int64_t hi) {
    GEMM_COLS_BODY(uint16_t, tile_any, tile_by_row)
}

/* Weight rows per thread below which a matmul is not split (the fork / join costs ~1 us, 64 rows of 576 take ~3). */
#define MIN_ROWS_PER_THREAD 64

/* x [M, K], w [N, K], bias [N] or NULL, y [M, N]; all bf16 (raw uint16 bits); up to nthreads threads. Returns 0. */
int tetri_gemm_bf16_avx512(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M,
                           int64_t N, int64_t K, int64_t nthreads) {
    int64_t most = N / MIN_ROWS_PER_THREAD;
    int nt = (int)(nthreads < most ? nthreads : most);
    if (nt <= 1) {
        gemm_cols(x, w, bias, y, M, N, K, 0, N);
        return 0;
    }
#pragma omp parallel num_threads(nt)
    {
        int64_t lo, hi;
        split_range(N, 4, team_size(), team_id(), &lo, &hi);
        gemm_cols(x, w, bias, y, M, N, K, lo, hi);
    }
    return 0;
}

/* ---- few-row fp32 matmul --------------------------------------------------------------------------------------
 *
 * y[m, n] = sum_k x[m, k] * w[n, k] + bias[n], all fp32 (x [M, K], w [N, K], bias [N] or NULL, y [M, N]). The same
 * layout as the bf16 matmul above with 16-lane fp32 FMAs: a group of 4 weight rows is read once and applied to every
 * row of x, TR rows per pass (24 accumulators + 4 weight vectors + one x vector), masked K tails. Why: torch's fp32
 * GEMM with few rows reaches a fraction of the read bandwidth, and the AVX2 kernel's 8-lane FMAs lose to it from 16
 * rows on AVX-512 CPUs. Weight rows split over the threads in groups of 4, as above: bit-identical at any count. */
static inline __attribute__((always_inline)) void tile_f32(const float *x, const float *w, const float *bias,
                                                            float *y, int64_t N, int64_t K, int NB, int R,
                                                            const char *pf) {
    __m512 acc[TR][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv[4];
        for (int j = 0; j < NB; j++) wv[j] = _mm512_loadu_ps(w + j * K + k);
        if (pf)
            for (int j = 0; j < 4; j++) _mm_prefetch(pf + (j * K + k) * 4, _MM_HINT_T1);
        for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_loadu_ps(x + r * K + k);
            for (int j = 0; j < NB; j++) acc[r][j] = _mm512_fmadd_ps(wv[j], xv, acc[r][j]);
        }
    }
    if (k < K) {
        __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
        __m512 wv[4];
        for (int j = 0; j < NB; j++) wv[j] = _mm512_maskz_loadu_ps(m, w + j * K + k);
        for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_maskz_loadu_ps(m, x + r * K + k);
            for (int j = 0; j < NB; j++) acc[r][j] = _mm512_fmadd_ps(wv[j], xv, acc[r][j]);
        }
    }
    float bf[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (bias)
        for (int j = 0; j < NB; j++) bf[j] = bias[j];
    __m128 b = _mm_loadu_ps(bf);
    for (int r = 0; r < R; r++) {
        __m128 v = _mm_add_ps(sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), b);
        if (NB == 4) {
            _mm_storeu_ps(y + r * N, v);
        } else {
            float t[4];
            _mm_storeu_ps(t, v);
            memcpy(y + r * N, t, (size_t)NB * 4);
        }
    }
}

/* tile_f32() for a full group of 4 weight rows, read row after row (see tile_by_row): bit-identical to it. */
static inline __attribute__((always_inline)) void tile_by_row_f32(const float *x, const float *w, const float *bias,
                                                                   float *y, int64_t N, int64_t K, int R,
                                                                   const char *pf) {
    __m512 acc[ROW_ORDER_MAX_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    int64_t kfull = K - K % 16;
    __mmask16 m = (__mmask16)((1u << (K - kfull)) - 1);
    for (int j = 0; j < 4; j++) {
        const float *wj = w + j * K;
        for (int64_t k = 0; k < kfull; k += 16) {
            __m512 wv = _mm512_loadu_ps(wj + k);
            if (pf) _mm_prefetch(pf + (j * K + k) * 4, _MM_HINT_T1);
            for (int r = 0; r < R; r++) acc[r][j] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * K + k), acc[r][j]);
        }
        if (kfull < K) {
            __m512 wv = _mm512_maskz_loadu_ps(m, wj + kfull);
            for (int r = 0; r < R; r++)
                acc[r][j] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x + r * K + kfull), acc[r][j]);
        }
    }
    float bf[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (bias)
        for (int j = 0; j < 4; j++) bf[j] = bias[j];
    __m128 b = _mm_loadu_ps(bf);
    for (int r = 0; r < R; r++) _mm_storeu_ps(y + r * N, _mm_add_ps(sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), b));
}

#define TILE_F32(nb, r) tile_f32(xr, wr, br, yr, N, K, nb, r, pf)
static inline __attribute__((always_inline)) void tile_any_f32(const float *xr, const float *wr, const float *br,
                                                                float *yr, int64_t N, int64_t K, int NB, int R,
                                                                const char *pf) {
    if (NB == 4) {
        switch (R) {
            case 1: TILE_F32(4, 1); break;
            case 2: TILE_F32(4, 2); break;
            case 3: TILE_F32(4, 3); break;
            case 4: TILE_F32(4, 4); break;
            case 5: TILE_F32(4, 5); break;
            default: TILE_F32(4, 6); break;
        }
    } else { /* the last, partial weight group (N % 4 rows): one x row at a time */
        for (int r = 0; r < R; r++) {
            if (NB == 1) tile_f32(xr + r * K, wr, br, yr + r * N, N, K, 1, 1, NULL);
            else if (NB == 2) tile_f32(xr + r * K, wr, br, yr + r * N, N, K, 2, 1, NULL);
            else tile_f32(xr + r * K, wr, br, yr + r * N, N, K, 3, 1, NULL);
        }
    }
}

static void gemm_cols_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                          int64_t K, int64_t lo, int64_t hi) {
    GEMM_COLS_BODY(float, tile_any_f32, tile_by_row_f32)
}

/* x [M, K], w [N, K], bias [N] or NULL, y [M, N]; all fp32; up to nthreads threads. Returns 0. */
int tetri_gemm_f32_avx512(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                          int64_t K, int64_t nthreads) {
    int64_t most = N / MIN_ROWS_PER_THREAD;
    int nt = (int)(nthreads < most ? nthreads : most);
    if (nt <= 1) {
        gemm_cols_f32(x, w, bias, y, M, N, K, 0, N);
        return 0;
    }
#pragma omp parallel num_threads(nt)
    {
        int64_t lo, hi;
        split_range(N, 4, team_size(), team_id(), &lo, &hi);
        gemm_cols_f32(x, w, bias, y, M, N, K, lo, hi);
    }
    return 0;
}

/* ---- causal prefill attention ------------------------------------------------------------------------------------
 *
 * out[i, h, :] = sum_j softmax_j(q[i, h] . k[j, g] * scale) v[j, g],  j <= ctx_start + i,  g = h / (H / Hkv)
 * q: [Lq, H, D] bf16 (token stride q_stride elements, heads contiguous); K/V rows: key j lives at
 * k_base + rows[j] * kv_stride (its Hkv heads contiguous, D each), the same for V; keys are positions 0..Lk-1
 * (Lk = ctx_start + Lq). out: [Lq, H, D] bf16 contiguous. D must be a multiple of 16 and at most 256.
 * Scores, softmax and the output sums in fp32 (online softmax, one pass over the keys); the softmax weights are
 * rounded to bf16 for the weighted sum of V (as flash attention does on GPUs); the output is rounded once.
 *
 * Why: torch's CPU flash attention in bf16 ran at ~18 GFLOP/s on Zen 4 (no AMX): 43% of a 512-token prefill step of
 * the tiny llama. Here both products run on vdpbf16ps over repacked K and V for one kv head at a time:
 * K as [key block of 16][D / 2][16 keys][2] (one zmm = 16 keys x one pair of dims: a query's scores for 16 keys
 * are D / 2 dot-product steps, no horizontal sums), V as [key pair][D / 16][16 dims][2] (one zmm = 16 dims x two
 * keys). Queries go QB at a time so every K and V load serves QB queries.
 * Returns 0, or -1 when scratch memory could not be allocated (nothing written then).
 */
#define QB 4  /* queries per pass */
#define KB 32 /* keys per online-softmax step (two blocks of 16) */

static inline __m512 exp16(__m512 x) { /* Cephes' single-precision exp, ~1 ulp on [-87, 88]; -> 0 far below */
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.3365447505531f));
    __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    __m512i n = _mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127));
    return _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(n, 23)));
}

static inline uint32_t pair_at(const uint16_t *p) { /* two consecutive bf16 as one 32-bit lane */
    uint32_t u;
    memcpy(&u, p, 4);
    return u;
}

/* One pass: queries i0 .. i0 + nq - 1 (nq <= QB) of query head h against kp / vp, its kv head's repacked K and V. */
static void prefill_block(const uint16_t *q, int64_t q_stride, const uint16_t *kp, const uint16_t *vp, uint16_t *out,
                          int64_t i0, int nq, int64_t h, int64_t ctx_start, int64_t H, int64_t D, float scale) {
    const int64_t dp = D / 2, dv = D / 16;
    __m512 o[QB][8]; /* D <= 256: up to 16 zmm of output per query (8 here: D <= 128 fast path) */
    float acc_o[QB][256];
    float m[QB], l[QB];
    for (int r = 0; r < QB; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        for (int64_t t = 0; t < dv && t < 8; t++) o[r][t] = _mm512_setzero_ps();
        memset(acc_o[r], 0, sizeof(acc_o[r]));
    }
    const int64_t last = ctx_start + i0 + nq - 1; /* the furthest key any query of the pass sees */
    for (int64_t j0 = 0; j0 <= last; j0 += KB) {
        __m512 s[QB][2];
        for (int r = 0; r < QB; r++) s[r][0] = s[r][1] = _mm512_setzero_ps();
        const uint16_t *k0 = kp + (j0 / 16) * (16 * D), *k1 = k0 + 16 * D;
        for (int64_t t = 0; t < dp; t++) {
            __m512bh a = ld(k0 + t * 32), b = ld(k1 + t * 32);
            for (int r = 0; r < nq; r++) {
                __m512bh qq = (__m512bh)_mm512_set1_epi32(
                    (int)pair_at(q + (i0 + r) * q_stride + h * D + 2 * t));
                s[r][0] = _mm512_dpbf16_ps(s[r][0], a, qq);
                s[r][1] = _mm512_dpbf16_ps(s[r][1], b, qq);
            }
        }
        for (int r = 0; r < nq; r++) {
            const int64_t lim = ctx_start + i0 + r; /* keys j <= lim are visible */
            __m512 x0 = _mm512_mul_ps(s[r][0], _mm512_set1_ps(scale));
            __m512 x1 = _mm512_mul_ps(s[r][1], _mm512_set1_ps(scale));
            if (j0 + KB - 1 > lim) {
                int64_t n0 = lim - j0 + 1, n1 = lim - j0 - 15;
                __mmask16 m0 = n0 >= 16 ? 0xFFFF : (n0 <= 0 ? 0 : (__mmask16)((1u << n0) - 1));
                __mmask16 m1 = n1 >= 16 ? 0xFFFF : (n1 <= 0 ? 0 : (__mmask16)((1u << n1) - 1));
                x0 = _mm512_mask_blend_ps(m0, _mm512_set1_ps(-INFINITY), x0);
                x1 = _mm512_mask_blend_ps(m1, _mm512_set1_ps(-INFINITY), x1);
            }
            float mx = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
            if (mx == -INFINITY) { /* nothing visible in this step for this query */
                s[r][0] = s[r][1] = _mm512_setzero_ps();
                continue;
            }
            float mnew = mx > m[r] ? mx : m[r];
            float corr = m[r] == -INFINITY ? 0.0f : expf(m[r] - mnew);
            __m512 p0 = exp16(_mm512_sub_ps(x0, _mm512_set1_ps(mnew)));
            __m512 p1 = exp16(_mm512_sub_ps(x1, _mm512_set1_ps(mnew)));
            p0 = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x0, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), p0,
                                      _mm512_setzero_ps());
            p1 = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x1, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), p1,
                                      _mm512_setzero_ps());
            l[r] = l[r] * corr + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
            m[r] = mnew;
            if (corr != 1.0f) {
                __m512 c = _mm512_set1_ps(corr);
                for (int64_t t = 0; t < dv && t < 8; t++) o[r][t] = _mm512_mul_ps(o[r][t], c);
                for (int64_t t = 8; t < dv; t++)
                    _mm512_storeu_ps(acc_o[r] + 16 * t, _mm512_mul_ps(_mm512_loadu_ps(acc_o[r] + 16 * t), c));
            }
            s[r][0] = p0; /* the weights of this step, reused below */
            s[r][1] = p1;
        }
        /* o[r] += sum over the KB keys of p[r, j] * v[j]: one zmm of V = 16 dims x a key pair */
        uint32_t pw[QB][KB / 2];
        for (int r = 0; r < nq; r++)
            _mm512_storeu_si512((void *)pw[r], (__m512i)_mm512_cvtne2ps_pbh(s[r][1], s[r][0]));
        const int64_t npair = (last - j0 + 1 < KB ? last - j0 + 2 : KB) / 2;
        for (int64_t kq = 0; kq < npair; kq++) {
            const uint16_t *vr = vp + (j0 / 2 + kq) * (2 * D);
            for (int64_t t = 0; t < dv && t < 8; t++) {
                __m512bh vv = ld(vr + t * 32);
                for (int r = 0; r < nq; r++)
                    o[r][t] = _mm512_dpbf16_ps(o[r][t], vv, (__m512bh)_mm512_set1_epi32((int)pw[r][kq]));
            }
            for (int64_t t = 8; t < dv; t++) {
                __m512bh vv = ld(vr + t * 32);
                for (int r = 0; r < nq; r++)
                    _mm512_storeu_ps(acc_o[r] + 16 * t,
                                     _mm512_dpbf16_ps(_mm512_loadu_ps(acc_o[r] + 16 * t), vv,
                                                      (__m512bh)_mm512_set1_epi32((int)pw[r][kq])));
            }
        }
    }
    for (int r = 0; r < nq; r++) {
        __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        uint16_t *dst = out + ((i0 + r) * H + h) * D;
        for (int64_t t = 0; t < dv; t++) {
            __m512 v = t < 8 ? o[r][t] : _mm512_loadu_ps(acc_o[r] + 16 * t);
            _mm256_storeu_si256((__m256i *)(dst + 16 * t), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(v, inv)));
        }
    }
}

/* Queries per thread-split unit: (query head, block of QB queries) pairs go to the threads round-robin, so the
 * causal mask's growing cost per block is shared evenly. nthreads: the most threads to use. */
int tetri_prefill_attn_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_base, const uint16_t *v_base,
                            const int64_t *rows, int64_t kv_stride, uint16_t *out, int64_t Lq, int64_t ctx_start,
                            int64_t H, int64_t Hkv, int64_t D, float scale, int64_t nthreads) {
    const int64_t Lk = ctx_start + Lq, group = H / Hkv, nkb = (Lk + 15) / 16, dp = D / 2;
    const int64_t kpad = nkb * 16 + KB; /* room for a whole KB step past the last key block */
    const size_t head_elems = (size_t)(kpad * D); /* one kv head's repacked K (or V); a multiple of 32 elements */
    uint16_t *kp = (uint16_t *)aligned_alloc(64, head_elems * (size_t)Hkv * 2);
    uint16_t *vp = (uint16_t *)aligned_alloc(64, head_elems * (size_t)Hkv * 2);
    if (!kp || !vp) {
        free(kp);
        free(vp);
        return -1;
    }
    memset(kp, 0, head_elems * (size_t)Hkv * 2); /* keys past Lk stay zero */
    memset(vp, 0, head_elems * (size_t)Hkv * 2);
    const int64_t nqb = (Lq + QB - 1) / QB, items = H * nqb;
    const int nt = (int)(nthreads < items ? nthreads : items);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int T = team_size(), t = team_id();
        int64_t jlo, jhi;
        split_range(Lk, 16, T, t, &jlo, &jhi);
        /* repack keys [jlo, jhi) of every kv head g: K [kb][dp][16][2], V [key pair][dv][16][2] */
        for (int64_t g = 0; g < Hkv; g++) {
            uint16_t *kg = kp + (size_t)g * head_elems, *vg = vp + (size_t)g * head_elems;
            for (int64_t j = jlo; j < jhi; j++) {
                const uint16_t *kr = k_base + rows[j] * kv_stride + g * D, *vr = v_base + rows[j] * kv_stride + g * D;
                uint16_t *kd = kg + (j / 16) * (16 * D) + (j % 16) * 2;
                for (int64_t u = 0; u < dp; u++) memcpy(kd + u * 32, kr + 2 * u, 4);
                uint16_t *vd = vg + (j / 2) * (2 * D) + (j % 2);
                for (int64_t d = 0; d < D; d++) vd[(d / 16) * 32 + (d % 16) * 2] = vr[d];
            }
        }
#pragma omp barrier
        for (int64_t it = t; it < items; it += T) {
            const int64_t i0 = (it / H) * QB, h = it % H, g = h / group;
            const int nq = Lq - i0 < QB ? (int)(Lq - i0) : QB;
            prefill_block(q, q_stride, kp + (size_t)g * head_elems, vp + (size_t)g * head_elems, out, i0, nq, h,
                          ctx_start, H, D, scale);
        }
    }
    free(kp);
    free(vp);
    return 0;
}

/* ---- decode attention over a paged bf16 KV cache, grouped: tetri_decode_attn_gqa_bf16 --------------------------
 *
 * Same contract as decode_kernels.c's tetri_decode_attn_bf16: q [B, H, D]; k_cache, v_cache [S, Hkv, D]; slots
 * [B, L] int64 (row b's first lengths[b] entries are its context's slots); out [B, H, D]; all bf16. Query head h reads
 * kv head h / G (G = H / Hkv). Requires D % 32 == 0, D <= 256 and G <= 8 (the caller routes other shapes elsewhere).
 *
 * Why: the per-(sequence, query head) AVX2 kernel converts every K and V element to fp32 once per query head, so a
 * kv head's rows are read and converted G times. Here one work item is a (sequence, kv head) pair and its G query
 * heads share each row read: a 16-key tile of K goes through vdpbf16ps (products exact in fp32, sums in fp32; the
 * 16 partial sums of each key reduced by one shuffle tree per tile and query head), and each V row is widened to
 * fp32 once and applied to the G heads with 16-lane FMAs (the softmax weights stay fp32). Two passes per head:
 * scores into scratch, softmax (max-subtracted exp16, fp32 sum), then the weighted sum of V; the output is rounded
 * once (round to nearest even). Items are split over the threads in contiguous ranges and computed by the same code
 * at any count (bit-identical results). Returns 0, or -1 when scratch memory could not be allocated. */

/* lane j = the sum of a[j]'s 16 lanes, j < 16 (a is clobbered): halves, quarters, pairs, then one fixed permutation. */
static inline __m512 sum16x16(__m512 *a) {
    for (int j = 0; j < 8; j++)
        a[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[j], a[j + 8], 0x44), _mm512_shuffle_f32x4(a[j], a[j + 8], 0xEE));
    for (int j = 0; j < 4; j++)
        a[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[j], a[j + 4], 0x88), _mm512_shuffle_f32x4(a[j], a[j + 4], 0xDD));
    for (int j = 0; j < 2; j++)
        a[j] = _mm512_add_ps(_mm512_shuffle_ps(a[j], a[j + 2], 0x44), _mm512_shuffle_ps(a[j], a[j + 2], 0xEE));
    __m512 f = _mm512_add_ps(_mm512_shuffle_ps(a[0], a[1], 0x88), _mm512_shuffle_ps(a[0], a[1], 0xDD));
    /* f's lane of key j (the tree leaves them in this order; the map is its own inverse) */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), f);
}

static inline __m512 widen16(const uint16_t *p) { /* 16 bf16 -> 16 fp32 (exact) */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Keys ahead of the one being scored whose K and V rows are prefetched (into L2: into L1 they evicted each other and
 * ran no faster). A context's slots come in blocks scattered over the whole pool, a few KB contiguous each, too short
 * for the hardware prefetchers: without this the kernel waited on DRAM (~5 GB/s on one Zen 4 core with 30 layers of
 * KV out of cache, 1.6x slower than with it). An item's first keys are prefetched by the item before it, once that
 * one's scores are in (its softmax and values then run from cache): else every item began with a wait on DRAM (48
 * sequences x 3 kv heads of 60-180 keys, 30 layers out of cache, one Zen 4 core: bf16 1.14x, fp32 1.05x faster).
 * Distances of 8, 16 and 64 keys were no faster than 32. */
#define GQA_PREFETCH_KEYS 32

/* The grouped decode kernels below take bf16 (F32 = 0) or fp32 (F32 = 1) queries and caches; F32 is a compile-time
 * constant after inlining, so each entry point gets its own code. ESZ: bytes per element. */
#define ESZ(F32) ((F32) ? 4 : 2)

static inline __attribute__((always_inline)) void gqa_prefetch(const char *kc, const char *vc, int64_t s,
                                                                int64_t row, int64_t hk, int64_t D, int F32) {
    /* slot s's K and V rows of kv head hk */
    const char *k = kc + (s * row + hk * D) * ESZ(F32), *v = vc + (s * row + hk * D) * ESZ(F32);
    for (int64_t off = 0; off < D * ESZ(F32); off += 64) {
        _mm_prefetch(k + off, _MM_HINT_T1);
        _mm_prefetch(v + off, _MM_HINT_T1);
    }
}

/* sc[g][l] = scale * q_g . k_l for the n keys (slots sl) of kv head hk, g < G; q0: query head hk * G's row. bf16: 32
 * dims per vdpbf16ps (exact products, fp32 sums); fp32: 16 per FMA. */
static inline __attribute__((always_inline)) void gqa_scores(const char *q0, const char *kc, const char *vc,
                                                              const int64_t *sl, int64_t n, int64_t row, int64_t hk,
                                                              int64_t G, int64_t D, float scale, float *sc,
                                                              int64_t npad, int F32) {
    const int64_t step = F32 ? 16 : 32, nd = D / step;
    for (int64_t l = 0; l < n && l < GQA_PREFETCH_KEYS; l++) gqa_prefetch(kc, vc, sl[l], row, hk, D, F32);
    for (int64_t l0 = 0; l0 < n; l0 += 16) {
        const int64_t nk = n - l0 < 16 ? n - l0 : 16;
        for (int64_t l = l0 + GQA_PREFETCH_KEYS; l < n && l < l0 + GQA_PREFETCH_KEYS + 16; l++)
            gqa_prefetch(kc, vc, sl[l], row, hk, D, F32);
        const char *kr[16];
        for (int i = 0; i < 16; i++) /* tail: key l0 again */
            kr[i] = kc + (sl[l0 + (i < nk ? i : 0)] * row + hk * D) * ESZ(F32);
        const __mmask16 keep = nk == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nk) - 1);
        for (int64_t g = 0; g < G; g++) {
            const char *qg = q0 + g * D * ESZ(F32);
            __m512 a[16];
            for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
            for (int64_t t = 0; t < nd; t++) {
                const int64_t off = step * t * ESZ(F32);
                if (F32) {
                    __m512 qq = _mm512_loadu_ps((const float *)(qg + off));
                    for (int i = 0; i < 16; i++)
                        a[i] = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)(kr[i] + off)), qq, a[i]);
                } else {
                    __m512bh qq = ld((const uint16_t *)(qg + off));
                    for (int i = 0; i < 16; i++)
                        a[i] = _mm512_dpbf16_ps(a[i], ld((const uint16_t *)(kr[i] + off)), qq);
                }
            }
            _mm512_mask_storeu_ps(sc + g * npad + l0, keep, _mm512_mul_ps(sum16x16(a), _mm512_set1_ps(scale)));
        }
    }
}

/* sc[g][0..n) <- softmax of itself (fp32, max-subtracted; n > 0). */
static inline void gqa_softmax(float *s, int64_t n) {
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    int64_t l = 0;
    for (; l + 16 <= n; l += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(s + l));
    float mx = _mm512_reduce_max_ps(vmx);
    for (int64_t i = l; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    __m512 m = _mm512_set1_ps(mx), sum = _mm512_setzero_ps();
    for (l = 0; l < n; l += 16) {
        const __mmask16 keep = n - l >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - l)) - 1);
        __m512 e = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, s + l), m)));
        _mm512_mask_storeu_ps(s + l, keep, e);
        sum = _mm512_add_ps(sum, e);
    }
    __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (l = 0; l < n; l += 16) {
        const __mmask16 keep = n - l >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - l)) - 1);
        _mm512_mask_storeu_ps(s + l, keep, _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, s + l), inv));
    }
}

/* out rows of the G query heads (o0: head hk * G's row) = sum_l p[g][l] v_l, dims [16 v0, 16 (v0 + nb)), nb <= NB;
 * G and NB are compile-time constants after inlining (G * NB <= 24 accumulators). bf16 V rows widen to fp32 once
 * (exact) and the output is rounded once; fp32 as is. */
static inline __attribute__((always_inline)) void gqa_values(const float *p, int64_t npad, const char *vc,
                                                              const int64_t *sl, int64_t n, int64_t row, int64_t hk,
                                                              int64_t D, int64_t v0, int nb, char *o0, const int G,
                                                              const int NB, int F32) {
    __m512 acc[24];
    for (int i = 0; i < G * NB; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t l = 0; l < n; l++) {
        const char *vr = vc + (sl[l] * row + hk * D + 16 * v0) * ESZ(F32);
        __m512 vv[8];
        for (int u = 0; u < NB; u++)
            vv[u] = u >= nb ? _mm512_setzero_ps()
                    : F32   ? _mm512_loadu_ps((const float *)vr + 16 * u)
                            : widen16((const uint16_t *)vr + 16 * u);
        for (int g = 0; g < G; g++) {
            __m512 pp = _mm512_set1_ps(p[g * npad + l]);
            for (int u = 0; u < NB; u++)
                if (u < nb) acc[g * NB + u] = _mm512_fmadd_ps(pp, vv[u], acc[g * NB + u]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int u = 0; u < NB; u++) {
            if (u >= nb) continue;
            char *o = o0 + (g * D + 16 * (v0 + u)) * ESZ(F32);
            if (F32)
                _mm512_storeu_ps((float *)o, acc[g * NB + u]);
            else
                _mm256_storeu_si256((__m256i *)o, (__m256i)_mm512_cvtneps_pbh(acc[g * NB + u]));
        }
}

#define GQA_VALUES(GC, NBC)                                                                                        \
    for (int64_t v0 = 0; v0 < nv; v0 += NBC)                                                                       \
        gqa_values(sc, npad, vc, sl, n, row, hk, D, v0, nv - v0 < NBC ? (int)(nv - v0) : NBC, o0, GC, NBC, F32);

static inline __attribute__((always_inline)) void gqa_item(const char *q, const char *kc, const char *vc,
                                                            const int64_t *sl, int64_t n, char *out, int64_t b,
                                                            int64_t hk, int64_t H, int64_t G, int64_t Hkv, int64_t D,
                                                            float scale, float *sc, int64_t npad,
                                                            const int64_t *next_sl, int64_t next_n, int64_t next_hk,
                                                            int F32) {
    const int64_t row = Hkv * D, nv = D / 16;
    char *o0 = out + (b * H + hk * G) * D * ESZ(F32);
    if (n <= 0) {
        memset(o0, 0, (size_t)(G * D * ESZ(F32)));
        return;
    }
    gqa_scores(q + (b * H + hk * G) * D * ESZ(F32), kc, vc, sl, n, row, hk, G, D, scale, sc, npad, F32);
    /* the next item's first keys start on their way while this one's softmax and values run from cache */
    for (int64_t l = 0; l < next_n && l < GQA_PREFETCH_KEYS; l++) gqa_prefetch(kc, vc, next_sl[l], row, next_hk, D, F32);
    for (int64_t g = 0; g < G; g++) gqa_softmax(sc + g * npad, n);
    switch (G) {
        case 1: GQA_VALUES(1, 8) break;
        case 2: GQA_VALUES(2, 8) break;
        case 3: GQA_VALUES(3, 8) break;
        case 4: GQA_VALUES(4, 6) break;
        case 5: GQA_VALUES(5, 4) break;
        case 6: GQA_VALUES(6, 4) break;
        case 7: GQA_VALUES(7, 3) break;
        default: GQA_VALUES(8, 3) break;
    }
}

static inline __attribute__((always_inline)) int gqa_attn(const char *q, const char *k_cache, const char *v_cache,
                                                           const int64_t *slots, const int64_t *lengths, char *out,
                                                           int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t L,
                                                           float scale, int64_t nthreads, int F32) {
    const int64_t G = H / Hkv, items = B * Hkv, npad = ((L > 0 ? L : 1) + 15) / 16 * 16;
    const int nt = (int)(nthreads < items ? (nthreads > 0 ? nthreads : 1) : (items > 0 ? items : 1));
    float *scratch = (float *)malloc((size_t)(nt * G * npad) * sizeof(float));
    if (!scratch) return -1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040); /* flush denormals (FTZ | DAZ) while we run, as the AVX2 kernel does */
        int64_t lo, hi;
        split_by_keys(lengths, L, B, Hkv, team_size(), team_id(), &lo, &hi);
        float *sc = scratch + (size_t)team_id() * (size_t)(G * npad);
        for (int64_t it = lo; it < hi; it++) {
            const int64_t b = it / Hkv, hk = it % Hkv, n = lengths[b] < L ? lengths[b] : L;
            const int64_t nb = (it + 1) / Hkv, nn = it + 1 < hi ? (lengths[nb] < L ? lengths[nb] : L) : 0;
            gqa_item(q, k_cache, v_cache, slots + b * L, n, out, b, hk, H, G, Hkv, D, scale, sc, npad,
                     slots + nb * L, nn, (it + 1) % Hkv, F32);
        }
        _mm_setcsr(csr);
    }
    free(scratch);
    return 0;
}

int tetri_decode_attn_gqa_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                               const int64_t *slots, const int64_t *lengths, uint16_t *out, int64_t B, int64_t H,
                               int64_t Hkv, int64_t D, int64_t L, float scale, int64_t nthreads) {
    return gqa_attn((const char *)q, (const char *)k_cache, (const char *)v_cache, slots, lengths, (char *)out, B, H,
                    Hkv, D, L, scale, nthreads, 0);
}

/* ---- grouped fp32 decode attention -------------------------------------------------------------------------------
 *
 * tetri_decode_attn_gqa_bf16's layout for fp32 queries and caches: one (sequence, kv head) work item scores its G
 * query heads against each K row while the row is in L1 (16 keys at a time: 16 accumulators of 16-lane FMAs over the
 * head dim, reduced by sum16x16), takes an fp32 softmax per head, and applies each V row to all G heads (16-lane FMAs,
 * no widening). Why: the AVX2 fp32 kernel runs one (sequence, query head) pair at a time with 8-lane FMAs and
 * reads every K and V row once per query head; at SmolLM2's 3 query heads per kv head it took 50 ms for 30 layers of
 * 48 x 201-token contexts on one Zen 4 core. D must be a multiple of 16 and at most 256; up to GQA_MAX_G query heads
 * per kv head. Each item is computed by the same code on any thread: bit-identical at every thread count. */
int tetri_decode_attn_gqa_f32(const float *q, const float *k_cache, const float *v_cache, const int64_t *slots,
                              const int64_t *lengths, float *out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                              int64_t L, float scale, int64_t nthreads) {
    return gqa_attn((const char *)q, (const char *)k_cache, (const char *)v_cache, slots, lengths, (char *)out, B, H,
                    Hkv, D, L, scale, nthreads, 1);
}
