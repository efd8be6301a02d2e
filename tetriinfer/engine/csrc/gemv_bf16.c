/* bf16 x bf16 -> bf16 matmul for few rows (decode), AVX2 + FMA, for CPUs without native bf16 instructions.
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
