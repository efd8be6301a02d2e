/* Threading helpers shared by the native kernels (decode_kernels.c, avx512_bf16.c): the calling thread's place in
 * its OpenMP team and deterministic splits of work over the team. Without OpenMP every call runs as a team of one.
 * Every split depends only on its inputs, and each work item is computed by the same code whichever thread takes
 * it, so results are bit-identical at any thread count. */
#ifndef TETRI_KERNEL_THREADS_H
#define TETRI_KERNEL_THREADS_H

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static inline int team_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline int team_size(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* [*lo, *hi): part t of nt of [0, n) in whole units of `align` (the last part also takes a ragged end). */
static inline void split_range(int64_t n, int64_t align, int nt, int t, int64_t *lo, int64_t *hi) {
    int64_t units = (n + align - 1) / align, a = units * t / nt, b = units * (t + 1) / nt;
    *lo = a * align;
    *hi = b * align < n ? b * align : n;
}

/* [*lo, *hi): part t of nt of the items [0, B * per_seq), item i belonging to sequence i / per_seq, split so that
 * each part holds about the same number of keys (min(lengths[b], L), plus 16 for an item's fixed cost): contexts
 * of very different lengths leave no thread idle. */
static inline void split_by_keys(const int64_t *lengths, int64_t L, int64_t B, int64_t per_seq, int nt, int t,
                                 int64_t *lo, int64_t *hi) {
    int64_t total = 0;
    for (int64_t b = 0; b < B; b++) total += ((lengths[b] < L ? lengths[b] : L) + 16) * per_seq;
    const int64_t start = total * t / nt, stop = total * (t + 1) / nt;
    int64_t cum = 0, first = -1, end = B * per_seq;
    for (int64_t i = 0; i < B * per_seq; i++) {
        if (first < 0 && cum >= start) first = i;
        if (cum >= stop) {
            end = i;
            break;
        }
        const int64_t b = i / per_seq;
        cum += (lengths[b] < L ? lengths[b] : L) + 16;
    }
    *lo = first < 0 ? end : first;
    *hi = t == nt - 1 ? B * per_seq : end;
}

#endif
