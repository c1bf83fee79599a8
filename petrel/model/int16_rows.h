/* What int8_gemm.c and group_gemm.c share: rows of x rounded to 16-bit integers with one scale a row, 8-bit weight
 * rows widened into k-pair-major int16 panels, and the AVX-512 steps. All static: each file that includes this
 * gets its own copy, and the library exports none of them. */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"
#include "thread_pool.h"

/* the two int16 at p as one int32 (to broadcast a pair of k) */
static inline int32_t pair_at(const int16_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

typedef struct {
    const float *x; int64_t M, K, Kp; int16_t *q; float *dx; int16_t Q;
} rounding_args;

/* rows [m0, m1) of x as codes q[m][Kp] (zeros from K on) and scales dx[m] */
static void round_rows(void *args, int t, int T) {
    const rounding_args *a = args;
    const int64_t K = a->K;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    int64_t m0, m1;
    split_range(a->M, t, T, 1, &m0, &m1);
    for (int64_t m = m0; m < m1; m++) {
        const float *x = a->x + m * K;
        int16_t *q = a->q + m * a->Kp;
        __m256 mx8 = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) mx8 = _mm256_max_ps(mx8, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
        float lanes[8], mx = 0.f;
        _mm256_storeu_ps(lanes, mx8);
        for (int j = 0; j < 8; j++) mx = lanes[j] > mx ? lanes[j] : mx;
        for (; k < K; k++) mx = __builtin_fabsf(x[k]) > mx ? __builtin_fabsf(x[k]) : mx;
        float inv = (float)a->Q / mx;
        if (!(inv < __builtin_inff())) inv = 0.f;   /* an all-zero row (or one below 2^-113: taken as zeros) */
        const __m256 inv8 = _mm256_set1_ps(inv);
        for (k = 0; k + 16 <= K; k += 16) {   /* packs interleaves 128-bit lanes: the permute puts them in order */
            const __m256i p = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), inv8)),
                                                 _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8), inv8)));
            _mm256_storeu_si256((__m256i *)(q + k), _mm256_permute4x64_epi64(p, 0xD8));
        }
        for (; k < K; k++) q[k] = (int16_t)_mm_cvtss_si32(_mm_set_ss(x[k] * inv));
        for (; k < a->Kp; k++) q[k] = 0;
        a->dx[m] = mx / (float)a->Q;
    }
}

/* 8-bit W rows [n, n + nr) (codes [N][K]) as a panel wp[ceil(K/2)][width][2] of int16, zeros past nr and K. Eight whole rows and 16 k at a
 * time: each row's 16 codes widened are eight int32 pairs, and a transpose makes them eight pairs of each row. */
static void pack_panel(const int8_t *codes, int64_t K, int64_t n, int nr, int width, int16_t *wp) {
    const int64_t P = (K + 1) / 2;
    if (nr < width || K % 2) memset(wp, 0, sizeof(int16_t) * P * width * 2);   /* else every value is written */
    int j0 = 0;
    for (; j0 + 8 <= nr; j0 += 8) {
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
            __m256i r[8];
            for (int i = 0; i < 8; i++)
                r[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + (n + j0 + i) * K + k)));
            transpose8(r);
            for (int p = 0; p < 8; p++) _mm256_storeu_si256((__m256i *)(wp + ((k / 2 + p) * width + j0) * 2), r[p]);
        }
        for (int j = j0; j < j0 + 8; j++)
            for (int64_t kk = k; kk < K; kk++) wp[((kk >> 1) * width + j) * 2 + (kk & 1)] = codes[(n + j) * K + kk];
    }
    for (int j = j0; j < nr; j++)
        for (int64_t k = 0; k < K; k++) wp[((k >> 1) * width + j) * 2 + (k & 1)] = codes[(n + j) * K + k];
}

/* the AVX-512 block's step: c + the products of w and x's pairs, summed in pairs (exact int32, wrapping) */
__attribute__((target("avx512f,avx512bw"))) static inline __m512i madd_add(__m512i c, __m512i w, __m512i x) {
    return _mm512_add_epi32(c, _mm512_madd_epi16(w, x));
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static inline __m512i dot_add(__m512i c, __m512i w, __m512i x) {
    return _mm512_dpwssd_epi32(c, w, x);
}
