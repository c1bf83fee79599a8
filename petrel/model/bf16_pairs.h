/* gemm_avx512.c's GEMM of bfloat16 x and W (AVX512_BF16), for bf16_pairs.c: C-only, not for ctypes */
#pragma once
#include <stdint.h>

/* floats of workspace bf16_pairs_gemm needs */
int64_t bf16_pairs_gemm_workspace(int64_t K, int64_t N, int nthreads);

/* y[M][N] = x[M][K] @ W[N][K]^T, x and W bfloat16, K even */
void bf16_pairs_gemm(const uint16_t *x, int64_t M, int64_t K, const uint16_t *W, float *y, int64_t N,
                     float *workspace, int nthreads);
