/* Decode kernels, AVX2 + FMA: a few-row bf16 matmul for CPUs without native bf16 instructions (tetri_gemv_bf16),
 * the same few-row matmul in fp32 (tetri_gemv_f32: torch's small-M fp32 GEMM reaches ~40% of the read bandwidth)
 * and paged decode attention over bf16 or fp32 KV caches (tetri_decode_attn_bf16 / _f32, below).
 *
 * y[m, n] = bf16( sum_k float(x[m, k]) * float(w[n, k]) + float(bias[n]) ),  0 <= m < M, 0 <= n < N
 * x: [M, K] bf16 row-major, w: [N, K] bf16 row-major (nn.Linear's weight), bias: [N] bf16 or NULL,
 * y: [M, N] bf16 row-major. Products and sums in fp32; the output is rounded to nearest even (as torch does).
 *
 * Memory-bound by design: every weight row is read once per block of up to 4 rows of x (x stays in cache), so a
 * batch-1 decode step streams the weights once at close to the machine's read bandwidth. bf16 -> fp32 is exact
 * (a 16-bit shift).
 *
 * Threads: built with -fopenmp (sharing torch's OpenMP runtime, so the engine's threads form one pool), the matmuls
 * split the weight rows (output features) over the team in whole groups of 4 and decode attention splits its
 * (sequence, query head) pairs; every output element is computed by the same code as on one thread, so any thread
 * count gives bit-identical results. Without OpenMP the pragmas are ignored (tetri_openmp() returns 0).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include "kernel_threads.h"

/* 1 when built with OpenMP (the kernels split their work over the threads they are given), else 0. */
int tetri_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* The threads a call of `work` units uses: at most nthreads, at least `per_thread` units each, at least 1. */
static inline int team_for(int64_t nthreads, int64_t work, int64_t per_thread) {
    int64_t most = work / per_thread;
    int64_t nt = nthreads < most ? nthreads : most;
    return nt < 1 ? 1 : (int)nt;
}

/* Weight rows per thread below which a matmul is not split (a fork / join costs ~1 us). */
#define MIN_ROWS_PER_THREAD 64

static inline __m256 load8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 lanes of an fp32 or bf16 array at element index i (F32 is a compile-time constant after inlining) */
static inline __attribute__((always_inline)) __m256 kv8(const void *p, int64_t i, int F32) {
    return F32 ? _mm256_loadu_ps((const float *)p + i) : load8((const uint16_t *)p + i);
}

static inline __attribute__((always_inline)) float kv1(const void *p, int64_t i, int F32) {
    return F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

/* One tile: NB consecutive weight rows (fp32 or bf16, stride K) against R rows of x (fp32, stride K):
 * out[r * 4 + j] = dot(x[r], w[j]). NB <= 4, R <= TILE_R and F32 are compile-time constants after inlining, so the
 * NB x R accumulators stay in registers: each 8-lane weight load feeds R FMAs and each x load NB FMAs (with one
 * weight row against one x row the loop is bound by loads, not FMAs, once there are several rows).
 * Register budget (AVX2 has 16 ymm): 12 accumulators + the R = 3 x vectors, loaded first, + one weight vector at a
 * time (fp32 folds it into the FMA's memory operand). Loading the four weight vectors first instead needs 17 and
 * spills: that order ran at ~30 GFLOP/s, this one at 45-50 on 384-wide rows (batch 6-16, one core). The four sums
 * of one x row are reduced together by a hadd tree (K = 384 is only 48 iterations: the epilogue matters). */
#define TILE_R 3
#define PF_AHEAD 8
static inline __attribute__((always_inline)) void tile_dot(const float *xf, int64_t K, const void *w, int NB, int R,
                                                            float *out, const char *pf, int F32) {
    int64_t esz = F32 ? 4 : 2;
    __m256 acc[TILE_R][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NB; j++) acc[r][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 xv[TILE_R];
        for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_ps(xf + r * K + k);
        if (pf) /* the weight rows PF_AHEAD groups on, at this k (redundant for bf16's half lines: measured faster) */
            for (int j = 0; j < 4; j++) _mm_prefetch(pf + (j * K + k) * esz, _MM_HINT_T0);
        for (int j = 0; j < NB; j++) {
            __m256 wv = kv8((const char *)w + j * K * esz, k, F32);
            for (int r = 0; r < R; r++) acc[r][j] = _mm256_fmadd_ps(wv, xv[r], acc[r][j]);
        }
    }
    if (NB == 4 && k == K) { /* four sums of one x row at once: a hadd tree (5 instructions instead of ~28) */
        for (int r = 0; r < R; r++) {
            __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]), _mm256_hadd_ps(acc[r][2], acc[r][3]));
            _mm_storeu_ps(out + r * 4, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
        }
        return;
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NB; j++) {
            const void *wr = (const char *)w + j * K * esz;
            float s = hsum(acc[r][j]);
            for (int64_t t = k; t < K; t++) s += xf[r * K + t] * kv1(wr, t, F32);
            out[r * 4 + j] = s;
        }
}

#define TILE_CASE(nb, r) tile_dot(xr, K, wr, nb, r, out, pf, F32)
static inline __attribute__((always_inline)) void tile_any(const float *xr, int64_t K, const void *wr, int NB, int R,
                                                            float *out, const char *pf, int F32) {
    switch (NB * 4 + R) { /* every (NB, R) pair gets its own fully unrolled body */
        case 4 + 1: TILE_CASE(1, 1); break;
        case 4 + 2: TILE_CASE(1, 2); break;
        case 4 + 3: TILE_CASE(1, 3); break;
        case 8 + 1: TILE_CASE(2, 1); break;
        case 8 + 2: TILE_CASE(2, 2); break;
        case 8 + 3: TILE_CASE(2, 3); break;
        case 12 + 1: TILE_CASE(3, 1); break;
        case 12 + 2: TILE_CASE(3, 2); break;
        case 12 + 3: TILE_CASE(3, 3); break;
        case 16 + 1: TILE_CASE(4, 1); break;
        case 16 + 2: TILE_CASE(4, 2); break;
        default: TILE_CASE(4, 3); break;
    }
}

/* One row of x against every weight row, one row after the other: the weights are read as a single linear stream
 * (prefetched ROW_PF_BYTES ahead, once per 64 bytes), four independent FMA chains per row. For one x row with short
 * weight rows (<= ROW_KERNEL_MAX_BYTES) this beats the 4-row tiles, whose four streams restart every few cache
 * lines: measured 90-105% of torch.sum's read bandwidth vs 67-87% on 768-wide bf16 rows (the tiles win on long rows,
 * 125% at 2560 wide, where four long streams keep more reads in flight). */
#define ROW_PF_BYTES 1024
#define ROW_KERNEL_MAX_BYTES 4096
static inline __attribute__((always_inline)) void gemv_one_row(const float *x, const void *w, const void *bias,
                                                                void *y, int64_t lo, int64_t hi, int64_t K, int F32) {
    int64_t esz = F32 ? 4 : 2, step = 64 / esz; /* elements per cache line */
    for (int64_t n = lo; n < hi; n++) {
        const char *wr = (const char *)w + n * K * esz;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int64_t k = 0;
        for (; k + 32 <= K; k += 32) {
            for (int64_t c = 0; c < 32; c += step) _mm_prefetch(wr + (k + c) * esz + ROW_PF_BYTES, _MM_HINT_T0);
            a0 = _mm256_fmadd_ps(kv8(wr, k, F32), _mm256_loadu_ps(x + k), a0);
            a1 = _mm256_fmadd_ps(kv8(wr, k + 8, F32), _mm256_loadu_ps(x + k + 8), a1);
            a2 = _mm256_fmadd_ps(kv8(wr, k + 16, F32), _mm256_loadu_ps(x + k + 16), a2);
            a3 = _mm256_fmadd_ps(kv8(wr, k + 24, F32), _mm256_loadu_ps(x + k + 24), a3);
        }
        for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(kv8(wr, k, F32), _mm256_loadu_ps(x + k), a0);
        float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        for (; k < K; k++) s += x[k] * kv1(wr, k, F32);
        s += bias ? kv1(bias, n, F32) : 0.0f;
        if (F32)
            ((float *)y)[n] = s;
        else
            ((uint16_t *)y)[n] = f32_to_bf16(s);
    }
}

/* y = x @ w.T + bias over fp32 activations xf [M, K], weight rows [lo, hi) (lo a multiple of 4); w, bias, y in
 * fp32 (F32) or bf16 (output rounded once). Weight rows go four at a time; each group is read from memory once and
 * applied to every row of x (TILE_R rows per pass, the group stays in L1 between passes). One x row over short
 * weight rows: gemv_one_row. */
static inline __attribute__((always_inline)) void gemv_rows(const float *xf, const void *w, const void *bias,
                                                             void *y, int64_t M, int64_t N, int64_t K, int64_t lo,
                                                             int64_t hi, int F32) {
    int64_t esz = F32 ? 4 : 2;
    if (M == 1 && K * esz <= ROW_KERNEL_MAX_BYTES) {
        gemv_one_row(xf, w, bias, y, lo, hi, K, F32);
        return;
    }
    float out[TILE_R * 4];
    for (int64_t n0 = lo; n0 < hi; n0 += 4) {
        int NB = hi - n0 < 4 ? (int)(hi - n0) : 4;
        const void *wr = (const char *)w + n0 * K * esz;
        for (int64_t m0 = 0; m0 < M; m0 += TILE_R) {
            int R = M - m0 < TILE_R ? (int)(M - m0) : TILE_R;
            const float *xr = xf + m0 * K;
            /* first pass over a group: prefetch the group PF_AHEAD groups on (memory latency overlaps compute) */
            const char *pf = m0 == 0 && n0 + 4 * PF_AHEAD < hi ? (const char *)wr + 4 * PF_AHEAD * K * esz : NULL;
            tile_any(xr, K, wr, NB, R, out, pf, F32);
            for (int r = 0; r < R; r++)
                for (int j = 0; j < NB; j++) {
                    float v = out[r * 4 + j] + (bias ? kv1(bias, n0 + j, F32) : 0.0f);
                    if (F32)
                        ((float *)y)[(m0 + r) * N + n0 + j] = v;
                    else
                        ((uint16_t *)y)[(m0 + r) * N + n0 + j] = f32_to_bf16(v);
                }
        }
    }
}

/* fp32: x [M, K], w [N, K], bias [N] or NULL, y [M, N]; no scratch memory; up to nthreads threads. Returns 0. */
int tetri_gemv_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                   int64_t nthreads) {
    int nt = team_for(nthreads, N, MIN_ROWS_PER_THREAD);
    if (nt == 1) {
        gemv_rows(x, w, bias, y, M, N, K, 0, N, 1);
        return 0;
    }
#pragma omp parallel num_threads(nt)
    {
        int64_t lo, hi;
        split_range(N, 4, team_size(), team_id(), &lo, &hi);
        gemv_rows(x, w, bias, y, M, N, K, lo, hi, 1);
    }
    return 0;
}

/* bf16, up to nthreads threads. Returns 0, or -1 when scratch memory could not be allocated (nothing written then). */
int tetri_gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M,
                    int64_t N, int64_t K, int64_t nthreads) {
    float *xf = (float *)malloc((size_t)(M * K + 1) * sizeof(float));
    if (!xf) return -1;
    for (int64_t i = 0; i < M * K; i++) xf[i] = bf16_to_f32(x[i]);
    int nt = team_for(nthreads, N, MIN_ROWS_PER_THREAD);
    if (nt == 1) {
        gemv_rows(xf, w, bias, y, M, N, K, 0, N, 0);
    } else {
#pragma omp parallel num_threads(nt)
        {
            int64_t lo, hi;
            split_range(N, 4, team_size(), team_id(), &lo, &hi);
            gemv_rows(xf, w, bias, y, M, N, K, lo, hi, 0);
        }
    }
    free(xf);
    return 0;
}

/* Decode attention over a paged KV cache (bf16 or fp32), reading K/V in place (no gather, no conversion copies).
 *
 * q: [B, H, D]; k_cache, v_cache: [S, Hkv, D] (S slots), same dtype as q; slots: [B, L] int64, row b's first
 * lengths[b] entries are the slots of its context (the rest is ignored); out: [B, H, D], same dtype.
 * Query head h reads kv head h / (H / Hkv) (grouped-query attention). Scores, softmax and the weighted sum are
 * fp32 (max-subtracted exp, as SDPA's math); a bf16 output is rounded once. Exported as tetri_decode_attn_bf16 and
 * tetri_decode_attn_f32 (F32 below is a compile-time constant in each).
 * Returns 0, or -1 when scratch memory could not be allocated (nothing written then). */

/* The 8 horizontal sums of a[0..7] as one vector (lane i = sum of a[i]): a tree of hadds, ~10 instructions for 8
 * sums instead of ~7 each. */
static inline __m256 hsum8(const __m256 *a) {
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    /* s0123 lanes: [a0 a1 a2 a3 | a0 a1 a2 a3] halves (low 128: low halves of the sums, high 128: high halves) */
    __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    return _mm256_add_ps(lo, hi);
}

/* Scores of one query head q (fp32, D) against the keys in rows[0..7] (8 slots' K of one kv head, fp32 or bf16):
 * 8 independent FMA chains, reduced together by hsum8. Requires D % 8 == 0 (callers handle other D). */
static inline __attribute__((always_inline)) __m256 dots8(const float *q, int64_t D, const char *const *rows,
                                                           int F32) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 qq = _mm256_loadu_ps(q + d);
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qq, kv8(rows[i], d, F32), a[i]);
    }
    return hsum8(a);
}

static inline __attribute__((always_inline)) float dot1(const float *q, int64_t D, const void *k, int F32) {
    __m256 a = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), kv8(k, d, F32), a);
    float s = hsum(a);
    for (; d < D; d++) s += q[d] * kv1(k, d, F32);
    return s;
}

/* out[0 .. 8*NV) = sum_l p[l] * v_l[d0 .. d0 + 8*NV) over n slots (V rows of one kv head at rows[l]); NV <= 8
 * accumulators stay in registers (one load + one FMA per 8 lanes per slot, no stores in the loop). */
static inline __attribute__((always_inline)) void wsum_chunk(const float *p, int64_t n, const char *vbase,
                                                              const int64_t *sl, int64_t row_bytes, int64_t d0,
                                                              int NV, float *out, int F32) {
    __m256 a[8];
    for (int v = 0; v < NV; v++) a[v] = _mm256_setzero_ps();
    for (int64_t l = 0; l < n; l++) {
        const char *vr = vbase + sl[l] * row_bytes;
        __m256 pp = _mm256_set1_ps(p[l]);
        for (int v = 0; v < NV; v++) a[v] = _mm256_fmadd_ps(pp, kv8(vr, d0 + 8 * v, F32), a[v]);
    }
    for (int v = 0; v < NV; v++) _mm256_storeu_ps(out + d0 + 8 * v, a[v]);
}

/* exp of 8 lanes (Cephes' single-precision polynomial, ~1 ulp on [-87, 88]; -> 0 below). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447505531f));
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    __m256i n = _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127));
    return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(n, 23)));
}

/* Keys ahead of the ones being scored whose K and V rows (of this kv head) are prefetched into L2: a context's
 * slots are blocks scattered over the pool, too short for the hardware prefetchers to follow. */
#define ATTN_PREFETCH_KEYS 32

/* One (sequence b, query head h) pair: scores over its n keys (8 per pass, a tail of < 8 keys or D not a multiple
 * of 8 one key at a time), softmax (8 scores at a time), then the weighted sum of V with the accumulators in
 * registers per 64-lane chunk of D. Scratch: qf [D], acc [D], sh [n + 8] fp32. */
static inline __attribute__((always_inline)) void attn_head(const void *q, const char *kc, const char *vc,
                                                             const int64_t *sl, int64_t n, void *out, int64_t b,
                                                             int64_t h, int64_t H, int64_t G, int64_t row, int64_t D,
                                                             float scale, float *qf, float *acc, float *sh, int F32) {
    int64_t esz = F32 ? 4 : 2, hk = h / G;
    for (int64_t i = 0; i < D; i++) qf[i] = kv1(q, (b * H + h) * D + i, F32) * scale;
    int64_t l = 0;
    if (D % 8 == 0)
        for (; l + 8 <= n; l += 8) {
            for (int64_t p = l + ATTN_PREFETCH_KEYS; p < n && p < l + ATTN_PREFETCH_KEYS + 8; p++)
                for (int64_t off = 0; off < D * esz; off += 64) {
                    _mm_prefetch(kc + (sl[p] * row + hk * D) * esz + off, _MM_HINT_T1);
                    _mm_prefetch(vc + (sl[p] * row + hk * D) * esz + off, _MM_HINT_T1);
                }
            const char *rows[8];
            for (int i = 0; i < 8; i++) rows[i] = kc + (sl[l + i] * row + hk * D) * esz;
            _mm256_storeu_ps(sh + l, dots8(qf, D, rows, F32));
        }
    for (; l < n; l++) sh[l] = dot1(qf, D, kc + (sl[l] * row + hk * D) * esz, F32);
    float mx = -INFINITY;
    for (l = 0; l < n; l++) mx = sh[l] > mx ? sh[l] : mx;
    __m256 vmx = _mm256_set1_ps(mx), vsum = _mm256_setzero_ps();
    for (l = 0; l + 8 <= n; l += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + l), vmx));
        _mm256_storeu_ps(sh + l, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum(vsum);
    for (; l < n; l++) {
        sh[l] = expf(sh[l] - mx);
        sum += sh[l];
    }
    float inv = n > 0 ? 1.0f / sum : 0.0f;
    for (l = 0; l < n; l++) sh[l] *= inv;
    const char *vbase = vc + hk * D * esz;
    int64_t nvec = D / 8;
    for (int64_t v0 = 0; v0 < nvec; v0 += 8) {
        int64_t d0 = 8 * v0;
        switch (nvec - v0 >= 8 ? 8 : nvec - v0) {
            case 1: wsum_chunk(sh, n, vbase, sl, row * esz, d0, 1, acc, F32); break;
            case 2: wsum_chunk(sh, n, vbase, sl, row * esz, d0, 2, acc, F32); break;
            case 3: wsum_chunk(sh, n, vbase, sl, row * esz, d0, 3, acc, F32); break;
            case 4: wsum_chunk(sh, n, vbase, sl, row * esz, d0, 4, acc, F32); break;
            case 5: wsum_chunk(sh, n, vbase, sl, row * esz, d0, 5, acc, F32); break;
            case 6: wsum_chunk(sh, n, vbase, sl, row * esz, d0, 6, acc, F32); break;
            case 7: wsum_chunk(sh, n, vbase, sl, row * esz, d0, 7, acc, F32); break;
            default: wsum_chunk(sh, n, vbase, sl, row * esz, d0, 8, acc, F32); break;
        }
    }
    for (int64_t d = 8 * nvec; d < D; d++) { /* D % 8 tail lanes */
        float t = 0.0f;
        for (l = 0; l < n; l++) t += sh[l] * kv1(vbase + sl[l] * row * esz, d, F32);
        acc[d] = t;
    }
    if (F32)
        memcpy((float *)out + (b * H + h) * D, acc, (size_t)D * sizeof(float));
    else
        for (int64_t i = 0; i < D; i++) ((uint16_t *)out)[(b * H + h) * D + i] = f32_to_bf16(acc[i]);
}

/* Pairs of (sequence, query head) per thread below which decode attention is not split. */
#define MIN_HEADS_PER_THREAD 2

static inline __attribute__((always_inline)) int decode_attn(const void *q, const void *k_cache,
                                                              const void *v_cache, const int64_t *slots,
                                                              const int64_t *lengths, void *out, int64_t B,
                                                              int64_t H, int64_t Hkv, int64_t D, int64_t L,
                                                              float scale, int64_t nthreads, int F32) {
    int64_t G = H / Hkv, row = Hkv * D;  /* row: elements of one slot (every kv head), read contiguously */
    const char *kc = (const char *)k_cache, *vc = (const char *)v_cache;
    int64_t Lp = (L > 0 ? L : 1) + 8, per = 2 * D + Lp + 16; /* one thread's scratch: qf, acc, scores */
    int nt = team_for(nthreads, B * H, MIN_HEADS_PER_THREAD);
    float *scratch = (float *)malloc((size_t)(per * nt) * sizeof(float));
    if (!scratch) return -1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040); /* flush denormals (FTZ | DAZ) while we run: negligible weights, no slow path */
        int64_t lo, hi;
        split_by_keys(lengths, L, B, H, team_size(), team_id(), &lo, &hi);
        float *qf = scratch + per * team_id(), *acc = qf + D, *sh = acc + D;
        for (int64_t it = lo; it < hi; it++) {
            int64_t b = it / H, h = it % H;
            int64_t n = lengths[b] < L ? lengths[b] : L;
            attn_head(q, kc, vc, slots + b * L, n, out, b, h, H, G, row, D, scale, qf, acc, sh, F32);
        }
        _mm_setcsr(csr);
    }
    free(scratch);
    return 0;
}

int tetri_decode_attn_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int64_t *slots, const int64_t *lengths, uint16_t *out, int64_t B, int64_t H,
                           int64_t Hkv, int64_t D, int64_t L, float scale, int64_t nthreads) {
    return decode_attn(q, k_cache, v_cache, slots, lengths, out, B, H, Hkv, D, L, scale, nthreads, 0);
}

int tetri_decode_attn_f32(const float *q, const float *k_cache, const float *v_cache, const int64_t *slots,
                          const int64_t *lengths, float *out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                          int64_t L, float scale, int64_t nthreads) {
    return decode_attn(q, k_cache, v_cache, slots, lengths, out, B, H, Hkv, D, L, scale, nthreads, 1);
}

/* ---- small per-token ops of a decode step, fused (each replaces 3-6 torch ops of a few microseconds) ---------- */

/* Rounding of fp32 lanes to the dtype (bf16: to nearest even, as torch; fp32: as is) and stores of rounded lanes. */
static inline __attribute__((always_inline)) float rnd(float v, int F32) {
    return F32 ? v : bf16_to_f32(f32_to_bf16(v));
}

/* 8 lanes rounded to bf16 and back (round to nearest even, as f32_to_bf16; NaN stays a quiet NaN). */
static inline __m256 rnd8_bf16(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
    __m256i nan = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x00400000)),
                                   _mm256_set1_epi32((int)0xffff0000u));
    return _mm256_castsi256_ps(_mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))));
}

static inline __attribute__((always_inline)) __m256 rnd8(__m256 v, int F32) { return F32 ? v : rnd8_bf16(v); }

static inline __attribute__((always_inline)) void store8(void *p, int64_t i, __m256 v, int F32) {
    if (F32) {
        _mm256_storeu_ps((float *)p + i, v);
    } else { /* v holds bf16 values already (rounded): the high halves of its lanes */
        __m256i h = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
        __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i), packed);
    }
}

/* RMSNorm of M rows of N (fp32 or bf16, as torch computes `w * rms_norm(x.float()).to(dtype)`):
 * t = x * 1/sqrt(mean(x^2) + eps) in fp32, rounded to the dtype, then y = w * t rounded to the dtype.
 * Only the order of the sum of squares differs from torch. Returns 0. */
static inline __attribute__((always_inline)) void rmsnorm_rows(const void *x, const void *w, void *y, int64_t lo,
                                                                int64_t hi, int64_t N, float eps, int F32) {
    int64_t esz = F32 ? 4 : 2;
    for (int64_t m = lo; m < hi; m++) {
        const char *xr = (const char *)x + m * N * esz;
        __m256 acc = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= N; k += 8) {
            __m256 v = kv8(xr, k, F32);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum(acc);
        for (; k < N; k++) ss += kv1(xr, k, F32) * kv1(xr, k, F32);
        float inv = 1.0f / sqrtf(ss / (float)N + eps);
        const __m256 inv8 = _mm256_set1_ps(inv);
        char *yr = (char *)y + m * N * esz;
        for (k = 0; k + 8 <= N; k += 8) /* 8 lanes: the same two products and roundings as below */
            store8(yr, k, rnd8(_mm256_mul_ps(kv8(w, k, F32), rnd8(_mm256_mul_ps(kv8(xr, k, F32), inv8), F32)), F32), F32);
        for (; k < N; k++) {
            float t = kv1(xr, k, F32) * inv;
            if (F32) {
                ((float *)y)[m * N + k] = ((const float *)w)[k] * t;
            } else {
                float tb = bf16_to_f32(f32_to_bf16(t));
                ((uint16_t *)y)[m * N + k] = f32_to_bf16(bf16_to_f32(((const uint16_t *)w)[k]) * tb);
            }
        }
    }
}

/* Elements per thread below which the small per-token ops (RMSNorm, RoPE) are not split. */
#define MIN_ELEMS_PER_THREAD 4096

/* Elements per thread below which RMSNorm is not split: vectorized, 64 rows of 576 take ~10 us on one core, and a
 * second thread made a batch-48 step's norms slower (its fork / join and the rows' cache lines moving over). */
#define NORM_MIN_ELEMS_PER_THREAD 65536

int tetri_rmsnorm_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, float eps, int64_t nthreads) {
    int nt = team_for(nthreads, M * N, NORM_MIN_ELEMS_PER_THREAD);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int64_t lo, hi;
        split_range(M, 1, team_size(), team_id(), &lo, &hi);
        rmsnorm_rows(x, w, y, lo, hi, N, eps, 1);
    }
    return 0;
}

int tetri_rmsnorm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N, float eps,
                       int64_t nthreads) {
    int nt = team_for(nthreads, M * N, NORM_MIN_ELEMS_PER_THREAD);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int64_t lo, hi;
        split_range(M, 1, team_size(), team_id(), &lo, &hi);
        rmsnorm_rows(x, w, y, lo, hi, N, eps, 0);
    }
    return 0;
}

/* Rotate-half RoPE (HF Llama), as torch computes `x * cos + cat(-x2, x1) * sin` in the dtype: each product and the
 * sum rounded to the dtype (fp32: no fused multiply-add, bit-identical to torch; bf16: the products of two bf16
 * values are exact in fp32, then rounded as torch rounds).
 * x: T tokens x H heads x D, token stride xs elements (a column slice of the fused qkv output), head stride D;
 * cos, sin: [T, D] contiguous; out: [T, H, D] contiguous. Returns 0. */
static inline __attribute__((always_inline)) void rope_rows(const void *x, const void *cs, const void *sn, void *out,
                                                             int64_t lo, int64_t hi, int64_t H, int64_t D,
                                                             int64_t xs, int F32) {
    int64_t half = D / 2;
    for (int64_t it = lo; it < hi; it++) { /* (token, head) pairs */
        int64_t t = it / H, h = it % H;
        int64_t xi = t * xs + h * D, oi = (t * H + h) * D, ci = t * D;
        int64_t d0 = 0;
        if (half % 8 == 0) /* 8 lanes of each half at a time: the same products, roundings and sums as below */
            for (; d0 < half; d0 += 8) {
                __m256 x1 = kv8(x, xi + d0, F32), x2 = kv8(x, xi + d0 + half, F32);
                __m256 c1 = kv8(cs, ci + d0, F32), c2 = kv8(cs, ci + d0 + half, F32);
                __m256 s1 = kv8(sn, ci + d0, F32), s2 = kv8(sn, ci + d0 + half, F32);
                __m256 neg = _mm256_xor_ps(x2, _mm256_set1_ps(-0.0f));
                __m256 lo8 = rnd8(_mm256_add_ps(rnd8(_mm256_mul_ps(x1, c1), F32), rnd8(_mm256_mul_ps(neg, s1), F32)), F32);
                __m256 hi8 = rnd8(_mm256_add_ps(rnd8(_mm256_mul_ps(x2, c2), F32), rnd8(_mm256_mul_ps(x1, s2), F32)), F32);
                store8(out, oi + d0, lo8, F32);
                store8(out, oi + d0 + half, hi8, F32);
            }
        if (d0 == half && half > 0) continue;
        for (int64_t d = 0; d < D; d++) {
            float xv = kv1(x, xi + d, F32);
            float rot = d < half ? -kv1(x, xi + d + half, F32) : kv1(x, xi + d - half, F32);
            volatile float a = rnd(xv * kv1(cs, ci + d, F32), F32);  /* volatile: never contracted to an FMA */
            volatile float b = rnd(rot * kv1(sn, ci + d, F32), F32);
            float o = rnd(a + b, F32);
            if (F32)
                ((float *)out)[oi + d] = o;
            else
                ((uint16_t *)out)[oi + d] = f32_to_bf16(o);
        }
    }
}

int tetri_rope_f32(const float *x, const float *cs, const float *sn, float *out, int64_t T, int64_t H, int64_t D,
                   int64_t xs, int64_t nthreads) {
    int nt = team_for(nthreads, T * H * D, MIN_ELEMS_PER_THREAD);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int64_t lo, hi;
        split_range(T * H, 1, team_size(), team_id(), &lo, &hi);
        rope_rows(x, cs, sn, out, lo, hi, H, D, xs, 1);
    }
    return 0;
}

int tetri_rope_bf16(const uint16_t *x, const uint16_t *cs, const uint16_t *sn, uint16_t *out, int64_t T, int64_t H,
                    int64_t D, int64_t xs, int64_t nthreads) {
    int nt = team_for(nthreads, T * H * D, MIN_ELEMS_PER_THREAD);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int64_t lo, hi;
        split_range(T * H, 1, team_size(), team_id(), &lo, &hi);
        rope_rows(x, cs, sn, out, lo, hi, H, D, xs, 0);
    }
    return 0;
}

/* ---- a whole decode step of a Llama-family decoder in one call --------------------------------------------------
 *
 * tetri_llama_decode_layers runs every decoder layer of a decode-only step (B tokens, each one new token of its
 * own sequence) on the kernels above and those it is handed, with no Python between them: per layer
 *   h = rmsnorm(x);  qkv = h W_qkv^T (+ b);  q, k = rope(qkv.q), rope(qkv.k);  K/V of the new tokens -> their slots;
 *   a = attention(q, caches);  x = x + a W_o^T (+ b);  h = rmsnorm(x);  gu = h W_gu^T (+ b);
 *   x = x + (silu(gu.gate) * gu.up) W_down^T (+ b)
 * with torch's per-op rounding in the model dtype (each op's output rounded to bf16 in bf16 models). The matmuls
 * and the attention are the same kernels, with the same arguments, that the per-op path picks for this step, so
 * their outputs are bit-identical to it; RMSNorm and RoPE are the fused kernels above; the residual adds and
 * silu(gate) * up are computed here as torch computes them (fp32 math, each op rounded to the dtype), silu with
 * libm's expf where torch uses its vectorized exp (at most one fp32 ulp apart).
 *
 * x [B, hidden] (in: the embeddings; out: the last layer's output); lw: num_layers x LW_COUNT addresses (below;
 * 0 for an absent bias); fns: the matmul kernels for qkv, o, gate_up and down and the attention kernel (addresses
 * of functions with the signatures of tetri_gemv_* and tetri_decode_attn_*); cos, sin [B, D]; slot_mapping [B]:
 * where each new token's K/V goes; slots [B, L], lengths [B]: each row's context (the new token included); scale:
 * the attention's 1/sqrt(D) as the per-op path passes it; scratch: at least tetri_llama_decode_scratch(...) elements of the dtype. Returns 0, or the first kernel's
 * nonzero code. */
enum { LW_IN_NORM, LW_QKV, LW_QKV_B, LW_O, LW_O_B, LW_POST_NORM, LW_GU, LW_GU_B, LW_DOWN, LW_DOWN_B, LW_K_CACHE,
       LW_V_CACHE, LW_COUNT };

typedef int (*tetri_matmul_fn)(const void *x, const void *w, const void *bias, void *y, int64_t M, int64_t N,
                               int64_t K, int64_t nthreads);
typedef int (*tetri_attn_fn)(const void *q, const void *k_cache, const void *v_cache, const int64_t *slots,
                             const int64_t *lengths, void *out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                             int64_t L, float scale, int64_t nthreads);

int64_t tetri_llama_decode_layer_words(void) { return LW_COUNT; }

int64_t tetri_llama_decode_scratch(int64_t B, int64_t hidden, int64_t H, int64_t Hkv, int64_t D, int64_t inter) {
    int64_t qkv = (H + 2 * Hkv) * D;
    return B * (hidden + qkv + H * D + Hkv * D + H * D + hidden + 2 * inter + inter);
}

/* x[i] = x[i] + d[i], rounded to the dtype (torch: both operands widened to fp32, one rounding). */
static void add_into(void *x, const void *d, int64_t n, int F32) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8(x, i, rnd8(_mm256_add_ps(kv8(x, i, F32), kv8(d, i, F32)), F32), F32);
    for (; i < n; i++) {
        float v = rnd(kv1(x, i, F32) + kv1(d, i, F32), F32);
        if (F32)
            ((float *)x)[i] = v;
        else
            ((uint16_t *)x)[i] = f32_to_bf16(v);
    }
}

/* act[b, i] = silu(gu[b, i]) * gu[b, inter + i], each op rounded to the dtype as torch's F.silu then mul (silu
 * = g / (1 + exp(-g)) in fp32, exp from exp8 / expf: torch's own exp differs by at most about one fp32 ulp). */
static void silu_mul(const void *gu, void *act, int64_t B, int64_t inter, int F32) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < B; b++) {
        const int64_t gi = b * 2 * inter, ui = gi + inter, ai = b * inter;
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8) {
            __m256 g = kv8(gu, gi + i, F32), u = kv8(gu, ui + i, F32);
            __m256 s = rnd8(_mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_xor_ps(g, sign)))), F32);
            store8(act, ai + i, rnd8(_mm256_mul_ps(s, u), F32), F32);
        }
        for (; i < inter; i++) {
            float g = kv1(gu, gi + i, F32), u = kv1(gu, ui + i, F32);
            float v = rnd(rnd(g / (1.0f + expf(-g)), F32) * u, F32);
            if (F32)
                ((float *)act)[ai + i] = v;
            else
                ((uint16_t *)act)[ai + i] = f32_to_bf16(v);
        }
    }
}

/* silu(gate) * up of M rows of [gate | up] (2 * inter each) -> [M, inter], split over rows (see silu_mul). */
static void silu_mul_rows(const void *gu, void *act, int64_t M, int64_t inter, int F32, int64_t nthreads) {
    int nt = team_for(nthreads, M * inter, MIN_ELEMS_PER_THREAD);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int64_t lo, hi;
        split_range(M, 1, team_size(), team_id(), &lo, &hi);
        const int64_t esz = F32 ? 4 : 2;
        if (hi > lo) silu_mul((const char *)gu + lo * 2 * inter * esz, (char *)act + lo * inter * esz, hi - lo, inter, F32);
    }
}

int tetri_silu_mul_f32(const float *gu, float *act, int64_t M, int64_t inter, int64_t nthreads) {
    silu_mul_rows(gu, act, M, inter, 1, nthreads);
    return 0;
}

int tetri_silu_mul_bf16(const uint16_t *gu, uint16_t *act, int64_t M, int64_t inter, int64_t nthreads) {
    silu_mul_rows(gu, act, M, inter, 0, nthreads);
    return 0;
}

/* out[m] = the index of the first maximum of row m of x [M, N] (fp32 or bf16, contiguous), as torch's argmax: a NaN
 * counts as greater than every number (the first NaN wins), -0.0 equals 0.0. Eight lanes each keep their first
 * strictly greater value and its index; the lanes' results are then merged (largest value, lowest index among
 * equals). bf16 widens to fp32 exactly, so a bf16 row's argmax equals that of its fp32 copy. Rows split over the
 * threads (the result does not depend on the count). */
static int64_t argmax_row(const void *row, int64_t N, int F32) {
    int64_t i = 0;
    __m256 best = _mm256_set1_ps(-INFINITY), nan_seen = _mm256_setzero_ps();
    __m256i best_i = _mm256_set1_epi32(-1), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    if (N < (1ll << 31) - 8)
        for (; i + 8 <= N; i += 8) {
            __m256 v = kv8(row, i, F32);
            __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
            nan_seen = _mm256_or_ps(nan_seen, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            best = _mm256_blendv_ps(best, v, gt);
            best_i = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_i), _mm256_castsi256_ps(idx), gt));
            idx = _mm256_add_epi32(idx, step);
        }
    if (_mm256_movemask_ps(nan_seen)) /* the first NaN, by a plain scan */
        for (int64_t j = 0; j < N; j++)
            if (isnan(kv1(row, j, F32))) return j;
    float bv[8];
    int32_t bi[8];
    _mm256_storeu_ps(bv, best);
    _mm256_storeu_si256((__m256i *)bi, best_i);
    float top = -INFINITY;
    int64_t at = -1;
    for (int l = 0; l < 8; l++)
        if (bi[l] >= 0 && (bv[l] > top || (bv[l] == top && bi[l] < at))) top = bv[l], at = bi[l];
    if (at < 0 && i > 0) at = 0; /* every element so far is -inf: the first one leads */
    for (; i < N; i++) {
        float v = kv1(row, i, F32);
        if (isnan(v)) return i;
        if (v > top || at < 0) top = v, at = i;
    }
    return at < 0 ? 0 : at; /* a row of -inf only: its first element */
}

int tetri_argmax_rows(const void *x, int64_t M, int64_t N, int64_t f32, int64_t *out, int64_t nthreads) {
    const int F32 = f32 != 0;
    const int64_t esz = F32 ? 4 : 2;
    int nt = team_for(nthreads, M * N, MIN_ELEMS_PER_THREAD);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int64_t lo, hi;
        split_range(M, 1, team_size(), team_id(), &lo, &hi);
        for (int64_t m = lo; m < hi; m++)
            out[m] = F32 ? argmax_row((const char *)x + m * N * esz, N, 1) : argmax_row((const char *)x + m * N * esz, N, 0);
    }
    return 0;
}

int tetri_llama_decode_layers(void *x, const int64_t *lw, int64_t num_layers, const int64_t *fns, const void *cs,
                              const void *sn, const int64_t *slot_mapping, const int64_t *slots,
                              const int64_t *lengths, int64_t L, int64_t B, int64_t hidden, int64_t H, int64_t Hkv,
                              int64_t D, int64_t inter, float eps, float scale, int64_t f32, void *scratch,
                              int64_t nthreads) {
    const int F32 = f32 != 0;
    const int64_t esz = F32 ? 4 : 2, qs = H * D, kvs = Hkv * D, qkv_n = qs + 2 * kvs;
    char *h = (char *)scratch, *qkv = h + B * hidden * esz, *qr = qkv + B * qkv_n * esz, *kr = qr + B * qs * esz,
         *ao = kr + B * kvs * esz, *o = ao + B * qs * esz, *gu = o + B * hidden * esz, *act = gu + B * 2 * inter * esz;
    tetri_matmul_fn mm_qkv = (tetri_matmul_fn)(intptr_t)fns[0], mm_o = (tetri_matmul_fn)(intptr_t)fns[1],
                    mm_gu = (tetri_matmul_fn)(intptr_t)fns[2], mm_down = (tetri_matmul_fn)(intptr_t)fns[3];
    tetri_attn_fn attn = (tetri_attn_fn)(intptr_t)fns[4];
    int rc;
    for (int64_t l = 0; l < num_layers; l++) {
        const int64_t *w = lw + l * LW_COUNT;
#define P(i) ((const void *)(intptr_t)w[i])
        if (F32)
            tetri_rmsnorm_f32(x, P(LW_IN_NORM), (float *)h, B, hidden, eps, nthreads);
        else
            tetri_rmsnorm_bf16(x, P(LW_IN_NORM), (uint16_t *)h, B, hidden, eps, nthreads);
        if ((rc = mm_qkv(h, P(LW_QKV), P(LW_QKV_B), qkv, B, qkv_n, hidden, nthreads))) return rc;
        if (F32) {
            tetri_rope_f32((const float *)qkv, cs, sn, (float *)qr, B, H, D, qkv_n, nthreads);
            tetri_rope_f32((const float *)qkv + qs, cs, sn, (float *)kr, B, Hkv, D, qkv_n, nthreads);
        } else {
            tetri_rope_bf16((const uint16_t *)qkv, cs, sn, (uint16_t *)qr, B, H, D, qkv_n, nthreads);
            tetri_rope_bf16((const uint16_t *)qkv + qs, cs, sn, (uint16_t *)kr, B, Hkv, D, qkv_n, nthreads);
        }
        char *kc = (char *)(intptr_t)w[LW_K_CACHE], *vc = (char *)(intptr_t)w[LW_V_CACHE];
        for (int64_t b = 0; b < B; b++) { /* the new tokens' K (rotated) and V into their slots */
            memcpy(kc + slot_mapping[b] * kvs * esz, kr + b * kvs * esz, kvs * esz);
            memcpy(vc + slot_mapping[b] * kvs * esz, qkv + (b * qkv_n + qs + kvs) * esz, kvs * esz);
        }
        if ((rc = attn(qr, kc, vc, slots, lengths, ao, B, H, Hkv, D, L, scale, nthreads))) return rc;
        if ((rc = mm_o(ao, P(LW_O), P(LW_O_B), o, B, hidden, qs, nthreads))) return rc;
        add_into(x, o, B * hidden, F32);
        if (F32)
            tetri_rmsnorm_f32(x, P(LW_POST_NORM), (float *)h, B, hidden, eps, nthreads);
        else
            tetri_rmsnorm_bf16(x, P(LW_POST_NORM), (uint16_t *)h, B, hidden, eps, nthreads);
        if ((rc = mm_gu(h, P(LW_GU), P(LW_GU_B), gu, B, 2 * inter, hidden, nthreads))) return rc;
        silu_mul_rows(gu, act, B, inter, F32, nthreads);
        if ((rc = mm_down(act, P(LW_DOWN), P(LW_DOWN_B), o, B, hidden, inter, nthreads))) return rc;
        add_into(x, o, B * hidden, F32);
#undef P
    }
    return 0;
}
