/* gemm_avx512.c's GEMM of bfloat16 x and W (AVX512_BF16), for bf16_pairs.c, the rounding of x to bfloat16 that
 * bf16_pairs.c, panels.c and decode_attention.c share, and panels.c's product of an x already rounded (for
 * dense_kernels.c): C-only, not for ctypes */
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"

/* floats of workspace bf16_pairs_gemm needs */
int64_t bf16_pairs_gemm_workspace(int64_t K, int64_t N, int nthreads);

/* y[M][N] = x[M][K] @ W[N][K]^T, x and W bfloat16, K even */
void bf16_pairs_gemm(const uint16_t *x, int64_t M, int64_t K, const uint16_t *W, float *y, int64_t N,
                     float *workspace, int nthreads);

/* panels.c's bf16_panels_product (kernels.h) for x already rounded to bfloat16 (xb [M][K]) */
void bf16_panels_product_rounded(const uint16_t *xb, int64_t M, int64_t K, const uint16_t *W, float *y, int64_t N,
                                 int nthreads);

/* x rounded to bfloat16 (nearest even; the conversion takes subnormal floats as zero), n values */
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static inline void round_to_bf16(const float *x, int64_t n, uint16_t *out) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i)));
    if (i < n) {
        const __mmask16 lo = lanes16(n - i), hi = lanes16(n - i - 16);
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, x + i + 16), _mm512_maskz_loadu_ps(lo, x + i));
        _mm512_mask_storeu_epi16(out + i, ((__mmask32)hi << 16) | lo, (__m512i)v);
    }
}

