/* Decode kernels, AVX2 + FMA: a few-row bf16 matmul for CPUs without native bf16 instructions (tetri_gemv_bf16)
 * and paged decode attention over bf16 or fp32 KV caches (tetri_decode_attn_bf16 / _f32, below).
 *
 * y[m, n] = bf16( sum_k float(x[m, k]) * float(w[n, k]) + float(bias[n]) ),  0 <= m < M, 0 <= n < N
 * x: [M, K] bf16 row-major, w: [N, K] bf16 row-major (nn.Linear's weight), bias: [N] bf16 or NULL,
 * y: [M, N] bf16 row-major. Products and sums in fp32; the output is rounded to nearest even (as torch does).
 *
 * Memory-bound by design: every weight row is read once per block of up to 4 rows of x (x stays in cache), so a
 * batch-1 decode step streams the weights once at close to the machine's read bandwidth. bf16 -> fp32 is exact
 * (a 16-bit shift). Single-threaded: one engine per core is the CPU serving configuration.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

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

/* R rows of x (fp32, stride K) against one weight row; R is a compile-time constant after inlining. Two
 * accumulators per row hide the FMA latency. (Streaming 4 weight rows at once, unrolling to 32 elements or
 * software prefetching measured no faster here: one row at a time already runs at the read bandwidth.) */
static inline __attribute__((always_inline)) void rows_dot(const float *xf, int64_t K, const uint16_t *wr,
                                                            int R, float *out) {
    __m256 a0[4], a1[4];
    for (int r = 0; r < R; r++) {
        a0[r] = _mm256_setzero_ps();
        a1[r] = _mm256_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256 w0 = load8(wr + k), w1 = load8(wr + k + 8);
        for (int r = 0; r < R; r++) {
            a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xf + r * K + k), a0[r]);
            a1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xf + r * K + k + 8), a1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float s = hsum(_mm256_add_ps(a0[r], a1[r]));
        for (int64_t j = k; j < K; j++) s += xf[r * K + j] * bf16_to_f32(wr[j]);
        out[r] = s;
    }
}

/* Returns 0, or -1 when scratch memory could not be allocated (nothing written then). */
int tetri_gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M,
                    int64_t N, int64_t K) {
    float *xf = (float *)malloc((size_t)(M * K + 1) * sizeof(float));
    if (!xf) return -1;
    for (int64_t i = 0; i < M * K; i++) xf[i] = bf16_to_f32(x[i]);
    float out[4];
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *wr = w + n * K;
        float b = bias ? bf16_to_f32(bias[n]) : 0.0f;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int64_t R = M - m0 < 4 ? M - m0 : 4;
            const float *xr = xf + m0 * K;
            switch (R) {
                case 1: rows_dot(xr, K, wr, 1, out); break;
                case 2: rows_dot(xr, K, wr, 2, out); break;
                case 3: rows_dot(xr, K, wr, 3, out); break;
                default: rows_dot(xr, K, wr, 4, out); break;
            }
            for (int64_t r = 0; r < R; r++) y[(m0 + r) * N + n] = f32_to_bf16(out[r] + b);
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

/* 8 lanes of K/V at element index i of an fp32 or bf16 array */
static inline __attribute__((always_inline)) __m256 kv8(const void *p, int64_t i, int F32) {
    return F32 ? _mm256_loadu_ps((const float *)p + i) : load8((const uint16_t *)p + i);
}

static inline __attribute__((always_inline)) float kv1(const void *p, int64_t i, int F32) {
    return F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

/* Scores of GN query heads (rows of q, stride D) against two keys: 2 x GN independent FMA chains (one chain per
 * dot would be latency-bound); GN and F32 are compile-time constants after inlining. */
static inline __attribute__((always_inline)) void dots2(const float *q, int64_t D, int GN, const void *k0,
                                                         const void *k1, float *o0, float *o1, int F32) {
    __m256 a0[4], a1[4];
    for (int g = 0; g < GN; g++) {
        a0[g] = _mm256_setzero_ps();
        a1[g] = _mm256_setzero_ps();
    }
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 x0 = kv8(k0, d, F32), x1 = kv8(k1, d, F32);
        for (int g = 0; g < GN; g++) {
            __m256 qq = _mm256_loadu_ps(q + g * D + d);
            a0[g] = _mm256_fmadd_ps(qq, x0, a0[g]);
            a1[g] = _mm256_fmadd_ps(qq, x1, a1[g]);
        }
    }
    for (int g = 0; g < GN; g++) {
        float s0 = hsum(a0[g]), s1 = hsum(a1[g]);
        for (int64_t t = d; t < D; t++) {
            s0 += q[g * D + t] * kv1(k0, t, F32);
            s1 += q[g * D + t] * kv1(k1, t, F32);
        }
        o0[g] = s0;
        o1[g] = s1;
    }
}

static inline __attribute__((always_inline)) void axpy(float *acc, float p, const void *v, int64_t D, int F32) {
    __m256 pp = _mm256_set1_ps(p);
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
        _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pp, kv8(v, d, F32), _mm256_loadu_ps(acc + d)));
    for (; d < D; d++) acc[d] += p * kv1(v, d, F32);
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

static inline __attribute__((always_inline)) int decode_attn(const void *q, const void *k_cache,
                                                              const void *v_cache, const int64_t *slots,
                                                              const int64_t *lengths, void *out, int64_t B,
                                                              int64_t H, int64_t Hkv, int64_t D, int64_t L,
                                                              float scale, int F32) {
    int64_t G = H / Hkv, row = Hkv * D;  /* row: elements of one slot (every kv head), read contiguously */
    int64_t esz = F32 ? 4 : 2;
    const char *kc = (const char *)k_cache, *vc = (const char *)v_cache;
    int64_t Lp = (L > 0 ? L : 1) + 8;
    float *qf = (float *)malloc((size_t)(H * D) * sizeof(float));
    float *acc = (float *)malloc((size_t)(H * D) * sizeof(float));
    float *s = (float *)malloc((size_t)(H * Lp) * sizeof(float));
    if (!qf || !acc || !s) {
        free(qf);
        free(acc);
        free(s);
        return -1;
    }
    unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040); /* flush denormals (FTZ | DAZ) while we run: negligible weights, no slow path */
    for (int64_t b = 0; b < B; b++) {
        int64_t n = lengths[b] < L ? lengths[b] : L;
        const int64_t *sl = slots + b * L;
        for (int64_t i = 0; i < H * D; i++) qf[i] = kv1(q, b * H * D + i, F32) * scale;
        /* scores, key-major: each slot's K row (all kv heads) is read once, two slots per pass */
        for (int64_t l = 0; l < n; l += 2) {
            const char *r0 = kc + sl[l] * row * esz;
            const char *r1 = l + 1 < n ? kc + sl[l + 1] * row * esz : r0;
            for (int64_t h0 = 0; h0 < H;) {  /* blocks of <= 4 query heads within one kv head */
                int64_t hk = h0 / G, gn = G - h0 % G;
                gn = gn < 4 ? gn : 4;
                float o0[4], o1[4];
                const float *qh = qf + h0 * D;
                const void *k0 = r0 + hk * D * esz, *k1 = r1 + hk * D * esz;
                switch (gn) {
                    case 1: dots2(qh, D, 1, k0, k1, o0, o1, F32); break;
                    case 2: dots2(qh, D, 2, k0, k1, o0, o1, F32); break;
                    case 3: dots2(qh, D, 3, k0, k1, o0, o1, F32); break;
                    default: dots2(qh, D, 4, k0, k1, o0, o1, F32); break;
                }
                for (int64_t g = 0; g < gn; g++) {
                    s[(h0 + g) * Lp + l] = o0[g];
                    if (l + 1 < n) s[(h0 + g) * Lp + l + 1] = o1[g];
                }
                h0 += gn;
            }
        }
        for (int64_t h = 0; h < H; h++) {  /* softmax per query head, 8 scores at a time */
            float *sh = s + h * Lp;
            float mx = -INFINITY;
            for (int64_t l = 0; l < n; l++) mx = sh[l] > mx ? sh[l] : mx;
            __m256 vmx = _mm256_set1_ps(mx), vsum = _mm256_setzero_ps();
            int64_t l = 0;
            for (; l + 8 <= n; l += 8) {
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
        }
        /* weighted values, key-major: each slot's V row read once for every query head */
        memset(acc, 0, (size_t)(H * D) * sizeof(float));
        for (int64_t l = 0; l < n; l++) {
            const char *vr = vc + sl[l] * row * esz;
            for (int64_t h = 0; h < H; h++) axpy(acc + h * D, s[h * Lp + l], vr + (h / G) * D * esz, D, F32);
        }
        if (F32)
            memcpy((float *)out + b * H * D, acc, (size_t)(H * D) * sizeof(float));
        else
            for (int64_t i = 0; i < H * D; i++) ((uint16_t *)out)[b * H * D + i] = f32_to_bf16(acc[i]);
    }
    _mm_setcsr(csr);
    free(qf);
    free(acc);
    free(s);
    return 0;
}

int tetri_decode_attn_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int64_t *slots, const int64_t *lengths, uint16_t *out, int64_t B, int64_t H,
                           int64_t Hkv, int64_t D, int64_t L, float scale) {
    return decode_attn(q, k_cache, v_cache, slots, lengths, out, B, H, Hkv, D, L, scale, 0);
}

int tetri_decode_attn_f32(const float *q, const float *k_cache, const float *v_cache, const int64_t *slots,
                          const int64_t *lengths, float *out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                          int64_t L, float scale) {
    return decode_attn(q, k_cache, v_cache, slots, lengths, out, B, H, Hkv, D, L, scale, 1);
}
