/* The few-row products y[M][N] = x[M][K] @ W[N][K]^T (decode at small batches), written once for every kind of
 * weight row: dense_kernels.c includes this file once a kind, with
 *   GEMV_WEIGHT    the type of W's elements (float; uint16_t for bfloat16 rows)
 *   GEMV_LOAD8(p)  eight of them from p as a __m256 of floats
 *   GEMV_NAME(s)   the kind's name for s (f32_##s, bf16_##s)
 * torch's BLAS reaches about half of the machine's memory bandwidth on these skinny products; here each thread
 * streams its share of W's rows once, several weight rows at a time so that enough FMAs are in flight. Each thread
 * walks its weight rows in tiles of 12; a tile stays in L1 or L2 while every group of four x rows passes over it,
 * so W is read from memory once for any M. K a multiple of 16. */

/* y[m][n] for MR rows of x and NR weight rows at a time, KS floats of k per iteration (8 or 16); each iteration
 * also prefetches PF cache lines of *pf (up to pf_end) into L2 */
#define GEMV_KERNEL(NAME, MR, NR, KS, PF) \
static void NAME(const float *x, int64_t K, const GEMV_WEIGHT *W, float *y, int64_t N, int64_t n0, int64_t n1, \
                 const char **pf, const char *pf_end) { \
    const char *p = *pf; \
    for (int64_t n = n0; n < n1; n += NR) { \
        const int nr = n1 - n < NR ? (int)(n1 - n) : NR; \
        __m256 acc[MR][NR][KS / 8]; \
        for (int m = 0; m < MR; m++) for (int j = 0; j < NR; j++) for (int h = 0; h < KS / 8; h++) acc[m][j][h] = _mm256_setzero_ps(); \
        if (nr == NR) { \
            for (int64_t k = 0; k < K; k += KS) { \
                for (int q = 0; q < PF; q++) if (p < pf_end) { _mm_prefetch(p, _MM_HINT_T1); p += 64; } \
                for (int h = 0; h < KS / 8; h++) { \
                    __m256 w[NR]; \
                    for (int j = 0; j < NR; j++) w[j] = GEMV_LOAD8(W + (n + j) * K + k + 8 * h); \
                    for (int m = 0; m < MR; m++) { \
                        __m256 xv = _mm256_loadu_ps(x + m * K + k + 8 * h); \
                        for (int j = 0; j < NR; j++) acc[m][j][h] = _mm256_fmadd_ps(w[j], xv, acc[m][j][h]); \
                    } \
                } \
            } \
        } else { \
            for (int j = 0; j < nr; j++) for (int64_t k = 0; k < K; k += 8) { \
                __m256 w = GEMV_LOAD8(W + (n + j) * K + k); \
                for (int m = 0; m < MR; m++) acc[m][j][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + m * K + k), acc[m][j][0]); \
            } \
        } \
        for (int m = 0; m < MR; m++) for (int j = 0; j < nr; j++) { \
            __m256 t = acc[m][j][0]; \
            for (int h = 1; h < KS / 8; h++) t = _mm256_add_ps(t, acc[m][j][h]); \
            y[m * N + n + j] = hsum(t); \
        } \
    } \
    *pf = p; \
}
/* PF: enough that the next tile is all on its way within one pass over this one (the passes of up to 4 rows are
 * the only ones; a 4-row pass among others shares the work) */
GEMV_KERNEL(GEMV_NAME(rows_1), 1, 4, 16, 4) GEMV_KERNEL(GEMV_NAME(rows_2), 2, 2, 16, 2)
GEMV_KERNEL(GEMV_NAME(rows_3), 3, 3, 8, 2) GEMV_KERNEL(GEMV_NAME(rows_4), 4, 3, 8, 1)
GEMV_KERNEL(GEMV_NAME(rows_4_alone), 4, 3, 8, 2)
#undef GEMV_KERNEL

/* y[m][n..ne) for every row m of x over the weight rows n..ne (a tile), four x rows a pass, prefetching *pf */
static void GEMV_NAME(tile_passes)(const float *x, int64_t M, int64_t K, const GEMV_WEIGHT *W, float *y, int64_t N,
                                   int64_t n, int64_t ne, const char **pf, const char *pf_end) {
    for (int64_t m = 0; m < M; m += 4) {
        const int64_t r = M - m < 4 ? M - m : 4;
        if (M == 4) GEMV_NAME(rows_4_alone)(x, K, W, y, N, n, ne, pf, pf_end);
        else if (r == 4) GEMV_NAME(rows_4)(x + m * K, K, W, y + m * N, N, n, ne, pf, pf_end);
        else if (r == 3) GEMV_NAME(rows_3)(x + m * K, K, W, y + m * N, N, n, ne, pf, pf_end);
        else if (r == 2) GEMV_NAME(rows_2)(x + m * K, K, W, y + m * N, N, n, ne, pf, pf_end);
        else GEMV_NAME(rows_1)(x + m * K, K, W, y + m * N, N, n, ne, pf, pf_end);
    }
}

typedef struct { const float *x; int64_t M, K; const GEMV_WEIGHT *W; float *y; int64_t N; } GEMV_NAME(gemv_args);

static void GEMV_NAME(gemv_part)(void *args, int t, int T) {
    const GEMV_NAME(gemv_args) *a = args;
    const GEMV_WEIGHT *W = a->W;
    const int64_t K = a->K, N = a->N;
    int64_t n0, n1;
    split_range(N, t, T, 8, &n0, &n1);
    /* the next tile comes into L2 while this one is worked on, a few lines per inner iteration so that all of it
     * is on its way within the first pass over this one: the hardware prefetcher alone leaves the first pass over
     * each tile waiting on memory (and one row streams a third slower) */
    for (int64_t n = n0; n < n1; n += 12) {
        const int64_t ne = n + 12 < n1 ? n + 12 : n1;
        const char *pf = (const char *)(W + ne * K), *pf_end = (const char *)(W + (ne + 12 < n1 ? ne + 12 : n1) * K);
        GEMV_NAME(tile_passes)(a->x, a->M, K, W, a->y, N, n, ne, &pf, pf_end);
    }
}

static void GEMV_NAME(gemv_run)(const float *x, int64_t M, int64_t K, const GEMV_WEIGHT *W, float *y, int64_t N,
                                int nthreads) {
    GEMV_NAME(gemv_args) a = {x, M, K, W, y, N};
    parallel_run(GEMV_NAME(gemv_part), &a, nthreads);
}
