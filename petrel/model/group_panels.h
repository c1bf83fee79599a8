/* What group_gemm.c and group_gemm_q8.c both lay out the same way: a panel's scales and mins */
#pragma once
#include <stdint.h>
#include <string.h>

/* rows [n, n + nr) of a [N][G] float array (the weights' scales or mins per group) as [G][width], zeros past nr */
static inline void pack_groups(const float *src, int64_t G, int64_t n, int nr, int width, float *dst) {
    memset(dst, 0, sizeof(float) * G * width);
    for (int j = 0; j < nr; j++)
        for (int64_t g = 0; g < G; g++) dst[g * width + j] = src[(n + j) * G + g];
}
