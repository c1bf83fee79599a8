/* The online-softmax step prefill_attention.c and decode_attention.c share, in base 2 (AVX2) */
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

/* One step of a running softmax over n more scores p[0..n) (32-byte aligned, n a multiple of 16; scores are
 * exponents of 2, masked ones -inf): the scores become their weights 2^(p - max), the running max *m and sum *l
 * move on, and the running output acc [D] (D a multiple of 8) is rescaled to the new max. While every score so far
 * is masked (max -inf) the weights are 0 and nothing else changes. */
static inline void online_softmax_step(float *p, int64_t n, float *m, float *l, float *acc, int64_t D) {
    __m256 vmax = _mm256_load_ps(p), vmax1 = _mm256_load_ps(p + 8);
    for (int64_t j = 16; j < n; j += 16) {
        vmax = _mm256_max_ps(vmax, _mm256_load_ps(p + j));
        vmax1 = _mm256_max_ps(vmax1, _mm256_load_ps(p + j + 8));
    }
    vmax = _mm256_max_ps(vmax, vmax1);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float mx = _mm_cvtss_f32(h) > *m ? _mm_cvtss_f32(h) : *m;
    if (mx == -INFINITY) {                           /* nothing visible yet: no weight */
        memset(p, 0, sizeof(float) * n);
        return;
    }
    const float corr = exp2f(*m - mx);               /* 0 on the first scores (m = -inf) */
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps(), vsum1 = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {            /* masked scores (-inf) weigh exactly 0 */
        const __m256 e = exp2_nonpositive(_mm256_sub_ps(_mm256_load_ps(p + j), vmx));
        const __m256 e1 = exp2_nonpositive(_mm256_sub_ps(_mm256_load_ps(p + j + 8), vmx));
        _mm256_store_ps(p + j, e);
        _mm256_store_ps(p + j + 8, e1);
        vsum = _mm256_add_ps(vsum, e);
        vsum1 = _mm256_add_ps(vsum1, e1);
    }
    *l = *l * corr + hsum(_mm256_add_ps(vsum, vsum1));
    *m = mx;
    const __m256 c = _mm256_set1_ps(corr);
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(acc + d, _mm256_mul_ps(c, _mm256_loadu_ps(acc + d)));
}
