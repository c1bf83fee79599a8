/* A product with any kind of `weight` (kernels.h), shared by the kernel files that take weights by description
 * (dense_kernels.c's decoder layers, moe.c's experts); defined in dense_kernels.c */
#pragma once
#include <stdint.h>

#include "kernels.h"

/* y[M][N] = x[M][K] @ W^T for either kind of weight (float32 or bfloat16 rows or panels; quantized: few rows in
 * registers, from w->integer_rows rows in integers: int8_gemm for one scale a row, group_gemm for groups; else
 * dequantized tiles), over nthreads threads (1: all on the calling thread); 0, or KERNEL_OUT_OF_MEMORY (scratch) */
int weight_product(const float *x, int64_t M, int64_t K, const weight *w, float *y, int64_t N, int nthreads);

/* y [T][H] = a mixture of experts' MLP of h [T][H] (kernels.h's moe_layer: router, top-k, experts, shared expert);
 * defined in moe.c. 0, or KERNEL_OUT_OF_MEMORY */
int moe_mlp(const float *h, int64_t T, int64_t H, const moe_layer *m, float *y, int nthreads);
