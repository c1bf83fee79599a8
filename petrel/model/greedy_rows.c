/* greedy_rows: a greedy sampler's whole work on a step's logits in two passes over each row, the chosen token (the
 * first maximum, as torch's argmax) and its log-softmax, where torch takes five to eight operations (its argmax over
 * a long row is a scalar loop) and, on a decode step of one or a few rows, wakes its threads for each. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "simd.h"
#include "thread_pool.h"

typedef struct { const float *x; int64_t vocab, stride; int64_t *tokens; float *logprobs; } greedy_args;

/* The index of x's first NaN (the caller knows there is one) */
static int64_t first_nan(const float *x) {
    int64_t i = 0;
    while (!isnan(x[i])) i++;
    return i;
}

/* The index of the first maximum of x[0..n), or of the first NaN if there is one (as torch's argmax) */
static int64_t first_max(const float *x, int64_t n, int *nan) {
    int64_t j = 0, best = 0;
    float m = x[0];
    if (n >= 16) {
        const __m256i step = _mm256_set1_epi32(8);
        __m256 vmax = _mm256_loadu_ps(x), unordered = _mm256_cmp_ps(vmax, vmax, _CMP_UNORD_Q);
        __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), vbest = idx;
        for (j = 8; j + 8 <= n; j += 8) {  /* per lane: its first maximum (strictly greater moves it) */
            const __m256 v = _mm256_loadu_ps(x + j);
            idx = _mm256_add_epi32(idx, step);
            const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);
            vmax = _mm256_blendv_ps(vmax, v, gt);
            vbest = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vbest), _mm256_castsi256_ps(idx), gt));
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        if (_mm256_movemask_ps(unordered)) {
            *nan = 1;
            return first_nan(x);
        }
        float lanes[8];
        int32_t lane_best[8];
        _mm256_storeu_ps(lanes, vmax);
        _mm256_storeu_si256((__m256i *)lane_best, vbest);
        m = lanes[0], best = lane_best[0];
        for (int l = 1; l < 8; l++)  /* the greatest lane; of equal ones, the earliest index */
            if (lanes[l] > m || (lanes[l] == m && lane_best[l] < best)) m = lanes[l], best = lane_best[l];
    }
    for (; j < n; j++) {  /* the rest, after every lane's index */
        if (isnan(x[j])) {
            *nan = 1;
            return first_nan(x);
        }
        if (x[j] > m) m = x[j], best = j;
    }
    return best;
}

/* log(sum of e^(x - m)) over x[0..n), every x <= m finite */
static float log_sum_exp_below(const float *x, int64_t n, float m) {
    const __m256 vm = _mm256_set1_ps(m), log2e = _mm256_set1_ps(1.44269504088896341f);
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        s0 = _mm256_add_ps(s0, exp2_nonpositive(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm), log2e)));
        s1 = _mm256_add_ps(s1, exp2_nonpositive(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8), vm), log2e)));
    }
    float sum = hsum(_mm256_add_ps(s0, s1));
    for (; j < n; j++) sum += expf(x[j] - m);
    return logf(sum);
}

static void greedy_part(const void *args, int64_t r0, int64_t r1) {
    const greedy_args *a = args;
    for (int64_t r = r0; r < r1; r++) {
        const float *x = a->x + r * a->stride;
        int nan = 0;
        const int64_t t = first_max(x, a->vocab, &nan);
        a->tokens[r] = t;
        /* a NaN, or an infinite maximum (every logit -inf, or one +inf), has no log-softmax: NaN, as torch's */
        a->logprobs[r] = nan || isinf(x[t]) ? NAN : -log_sum_exp_below(x, a->vocab, x[t]);
    }
}

/* Per row r of x [rows][vocab] (rows `stride` floats apart, vocab >= 1): tokens[r] = argmax (the first maximum; the
 * first NaN where there is one) and logprobs[r] = its log-softmax (0 - log sum e^(x - max); relative error ~1e-7) */
void greedy_rows(const float *x, int64_t rows, int64_t vocab, int64_t stride, int64_t *tokens, float *logprobs,
                 int nthreads) {
    greedy_args a = {x, vocab, stride, tokens, logprobs};
    for_rows(greedy_part, &a, rows, rows * vocab, nthreads);
}
