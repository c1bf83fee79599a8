/* The part of petrel's register-blocked float32 GEMMs that does not depend on the vector width, shared by
 * gemm_avx2.c and gemm_avx512.c; each supplies its block (an MR x NR tile of y kept in registers) and its sizes.
 *
 * y[M][N] = x[M][K] @ W[N][K]^T: each thread takes whole panels of NR columns, copies its panels of W once per call
 * into k-major order ([K][NR], columns past N as zeros), then passes rows of x over them a few MR-row blocks at a time
 * (as many as fit ~256 KB of L2, so each packed panel serves many blocks while those rows stay in cache). The last
 * M % MR rows go through a zero-padded copy, so a block always reads MR whole rows; a block writes only its valid
 * rows and columns. */
#pragma once
#include <stdint.h>
#include <string.h>

#include "thread_pool.h"

/* y rows [0, mr) x columns [0, nr) = x rows [0, MR) (ldx floats apart) @ one packed panel wp [K][NR] */
typedef void (*gemm_block_fn)(const float *x, int64_t ldx, const float *wp, int64_t K, float *y, int64_t ldy, int mr,
                              int nr);

/* W rows [n, n + nr) as a k-major panel wp [K][NR], columns nr..NR zero */
typedef void (*gemm_pack_fn)(const float *W, int64_t K, int64_t n, int nr, int NR, float *wp);

typedef struct {
    int mr, nr;          /* the block's rows and columns */
    gemm_block_fn block;
    gemm_pack_fn pack;   /* gemm_pack_panel, or a vectorized one */
} gemm_kernel;

/* a thread's share of the columns, whole panels: at most this many */
static inline int64_t gemm_columns_per_thread(const gemm_kernel *g, int64_t N, int nthreads) {
    return ((N + nthreads - 1) / nthreads + g->nr - 1) / g->nr * g->nr;
}

/* floats of workspace gemm_run needs: the tail rows [MR][K] and every thread's packed panels */
static inline int64_t gemm_workspace(const gemm_kernel *g, int64_t K, int64_t N, int nthreads) {
    return g->mr * K + (int64_t)nthreads * K * gemm_columns_per_thread(g, N, nthreads);
}

/* tail: the last M % MR rows of x followed by zero rows (NULL when M is a multiple of MR); wp: the panels */
typedef struct {
    const gemm_kernel *g; const float *x; int64_t M, K; const float *W; float *y; int64_t N; const float *tail;
    float *wp;
} gemm_args;

/* W rows [n, n + nr) as a k-major panel [K][NR], columns nr..NR zero: one float at a time */
static inline void gemm_pack_panel(const float *W, int64_t K, int64_t n, int nr, int NR, float *wp) {
    for (int64_t k = 0; k < K; k++) {
        float *dst = wp + k * NR;
        for (int j = 0; j < nr; j++) dst[j] = W[(n + j) * K + k];
        for (int j = nr; j < NR; j++) dst[j] = 0.f;
    }
}

static void gemm_part(void *args, int t, int T) {
    const gemm_args *a = args;
    const int MR = a->g->mr, NR = a->g->nr;
    const int64_t M = a->M, K = a->K, N = a->N, full = M / MR;
    int64_t pass = (256 * 1024 / 4) / (MR * K);
    if (pass < 1) pass = 1;
    int64_t n0, n1;
    split_range(N, t, T, NR, &n0, &n1);
    float *const panels = a->wp + t * K * gemm_columns_per_thread(a->g, N, T);
    for (int64_t n = n0; n < n1; n += NR)
        a->g->pack(a->W, K, n, n1 - n < NR ? (int)(n1 - n) : NR, NR, panels + (n - n0) * K);
    for (int64_t p0 = 0; p0 < full + (a->tail != NULL); p0 += pass) {
        const int64_t p1 = p0 + pass < full ? p0 + pass : full;
        for (int64_t n = n0; n < n1; n += NR) {
            const float *wp = panels + (n - n0) * K;
            const int nr = n1 - n < NR ? (int)(n1 - n) : NR;
            for (int64_t p = p0; p < p1; p++) a->g->block(a->x + p * MR * K, K, wp, K, a->y + p * MR * N + n, N, MR, nr);
            if (a->tail && p1 == full && p0 + pass > full)
                a->g->block(a->tail, K, wp, K, a->y + full * MR * N + n, N, (int)(M - full * MR), nr);
        }
    }
}

/* y[M][N] = x[M][K] @ W[N][K]^T (x, W, y contiguous rows); workspace: gemm_workspace(g, K, N, nthreads) floats */
static inline void gemm_run(const gemm_kernel *g, const float *x, int64_t M, int64_t K, const float *W, float *y,
                            int64_t N, float *workspace, int nthreads) {
    const int64_t rest = M % g->mr;
    float *tail = rest ? workspace : NULL;
    if (tail) {
        memcpy(tail, x + (M - rest) * K, sizeof(float) * rest * K);
        memset(tail + rest * K, 0, sizeof(float) * (g->mr - rest) * K);
    }
    gemm_args a = {g, x, M, K, W, y, N, tail, workspace + g->mr * K};
    parallel_run(gemm_part, &a, nthreads);
}
