/* group_gemm_q8.c's product, called by group_gemm (group_gemm.c) and int8_gemm (int8_gemm.c) when their isa carries
 * INT8_ACTIVATIONS (C only: Python reaches it through those two) */
#pragma once
#include <stdint.h>

/* y[M][N] = x[M][K] @ W^T, x rounded to 8-bit integers a group of 32 at a time, for W = scale * codes + mins: bits 4,
 * codes in groups of 32 (quant_kernels.c's layout), mins may be NULL, gshift unused; or bits 8, int8 codes [N][K]
 * with a scale (and min, or NULL) per 2^gshift of k (gshift >= 5; >= 62: per row), isa INT8_AVX512_VNNI only.
 * isa: INT8_AVX2, INT8_AVX512 or INT8_AVX512_VNNI (one the CPU has); K a multiple of 32. 0, or
 * KERNEL_OUT_OF_MEMORY (y then not written) */
int group_gemm_q8(int bits, const float *x, int64_t M, int64_t K, const void *codes, const float *scale,
                  const float *mins, int gshift, float *y, int64_t N, int nthreads, int isa);
