/* group_gemm_q8.c's product, called by group_gemm (group_gemm.c) for 4-bit codes when its isa carries
 * INT8_ACTIVATIONS (C only: Python reaches it through group_gemm) */
#pragma once
#include <stdint.h>

/* y[M][N] = x[M][K] @ W^T for 4-bit W = scale * codes + mins in groups of 32 (mins may be NULL), x rounded to 8-bit
 * integers a group of 32 at a time; isa: INT8_AVX2, INT8_AVX512 or INT8_AVX512_VNNI (one the CPU has); K a
 * multiple of 32. 0, or KERNEL_OUT_OF_MEMORY (y then not written) */
int group_gemm_q8(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *scale, const float *mins,
                  float *y, int64_t N, int nthreads, int isa);
