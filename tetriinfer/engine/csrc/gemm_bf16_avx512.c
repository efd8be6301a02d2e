/* Few-row bf16 matmul for CPUs with AVX-512 BF16 (AMD Zen 4, Intel Cooper Lake / Sapphire Rapids): vdpbf16ps.
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
 * (zeros contribute nothing). Single-threaded; only reads its inputs and writes y.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define TR 6 /* rows of x per pass */
#define PF_GROUPS 4 /* prefetch the weight group this many groups ahead */

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
            for (int j = 0; j < 4; j++) _mm_prefetch(pf + (j * K + k) * 2, _MM_HINT_T0);
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

/* x [M, K], w [N, K], bias [N] or NULL, y [M, N]; all bf16 (raw uint16 bits). Returns 0. */
int tetri_gemm_bf16_avx512(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M,
                           int64_t N, int64_t K) {
    /* ceil(M / TR) passes of near-equal size (8 rows: 4 + 4, not 6 + 2: a thin pass is load-bound) */
    int64_t passes = (M + TR - 1) / TR;
    for (int64_t n0 = 0; n0 < N; n0 += 4) {
        int NB = N - n0 < 4 ? (int)(N - n0) : 4;
        const uint16_t *wr = w + n0 * K, *br = bias ? bias + n0 : NULL;
        for (int64_t p = 0, m0 = 0; p < passes; p++) {
            int R = (int)(M / passes + (p < M % passes));
            const char *pf = m0 == 0 && n0 + 4 * PF_GROUPS < N ? (const char *)(wr + 4 * PF_GROUPS * K) : NULL;
            tile_any(x + m0 * K, wr, br, y + m0 * N + n0, N, K, NB, R, pf);
            m0 += R;
        }
    }
    return 0;
}
