/* bfloat16 weights times x rounded to bfloat16, two products an instruction (AVX512_BF16's dpbf16, each product
 * exact in float32, the sums float32), loaded with ctypes (petrel/model/native.py; gemm_kernels.bf16_pairs_rows
 * says where it runs). Built with the other kernels (-mavx2); its functions carry their own target.
 *
 * bf16_pairs_product: x rounded to bfloat16 (nearest even), then for few rows the kernels below, for many
 * gemm_avx512.c's GEMM over pairs (bf16_pairs_gemm).
 * Few rows: each thread walks its weight rows in tiles of 12 (in L1 or L2 while every pass of up to four x rows
 * goes over them, so W is read from memory once); a step loads 32 values of three weight rows and of each x row and
 * does twelve dpbf16s into 16-lane sums, added up at the end.
 *
 * The same products from W packed in panels at load: panels.c's bf16_panels_product. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16_pairs.h"
#include "kernels.h"
#include "thread_pool.h"

#define TARGET "avx512f,avx512bw,avx512bf16"
#define PAIRS_GEMM_ROWS 128  /* from here the GEMM: it packs W a call, which only many rows repay (Zen 4, weights
                              * from memory: the few-row kernels 265-364 GFLOP/s at 64 rows, the GEMM 238-270; at
                              * 128, 274-374 and 299-330; at 256, 269-379 and 351-378) */
#define TILE 12

/* y[m][n] for MR rows of x and the weight rows [n0, n1), NR at a time; K even (a last step of K % 32 masked);
 * each step also prefetches PF cache lines of *pf (up to pf_end) into L2: enough that the next tile is on its way
 * within one pass over this one (the hardware prefetcher alone leaves a tile's first pass waiting on memory) */
#define PAIRS_ROWS(MR, NR, PF) \
__attribute__((target(TARGET))) \
static void pairs_rows_##MR(const uint16_t *x, int64_t K, const uint16_t *W, float *y, int64_t N, int64_t n0, \
                            int64_t n1, const char **pf, const char *pf_end) { \
    const char *p = *pf; \
    for (int64_t n = n0; n < n1; n += NR) { \
        const int nr = n1 - n < NR ? (int)(n1 - n) : NR; \
        const uint16_t *w[NR]; \
        for (int j = 0; j < NR; j++) w[j] = W + (n + (j < nr ? j : 0)) * K; \
        __m512 acc[MR][NR]; \
        for (int m = 0; m < MR; m++) for (int j = 0; j < NR; j++) acc[m][j] = _mm512_setzero_ps(); \
        for (int64_t k = 0; k < K; k += 32) { \
            const __mmask32 mask = K - k >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << (K - k)) - 1); \
            for (int q = 0; q < PF; q++) if (p < pf_end) { _mm_prefetch(p, _MM_HINT_T1); p += 64; } \
            __m512i wv[NR]; \
            for (int j = 0; j < NR; j++) wv[j] = _mm512_maskz_loadu_epi16(mask, w[j] + k); \
            for (int m = 0; m < MR; m++) { \
                const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + m * K + k); \
                for (int j = 0; j < NR; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)xv, (__m512bh)wv[j]); \
            } \
        } \
        for (int m = 0; m < MR; m++)    /* every j (constant indices keep acc in registers), stored below nr */ \
            for (int j = 0; j < NR; j++) { \
                const float sum = _mm512_reduce_add_ps(acc[m][j]); \
                if (j < nr) y[m * N + n + j] = sum; \
            } \
    } \
    *pf = p; \
}
PAIRS_ROWS(1, 4, 4) PAIRS_ROWS(2, 3, 3) PAIRS_ROWS(3, 3, 3) PAIRS_ROWS(4, 3, 3)

typedef struct { const uint16_t *x; int64_t M, K; const uint16_t *W; float *y; int64_t N; } pairs_args;

static void pairs_part(void *args, int t, int T) {
    const pairs_args *a = args;
    const int64_t K = a->K, N = a->N;
    int64_t n0, n1;
    split_range(N, t, T, TILE, &n0, &n1);
    for (int64_t n = n0; n < n1; n += TILE) {
        const int64_t ne = n + TILE < n1 ? n + TILE : n1;
        const char *pf = (const char *)(a->W + ne * K);
        const char *const pf_end = (const char *)(a->W + (ne + TILE < n1 ? ne + TILE : n1) * K);
        for (int64_t m = 0; m < a->M; m += 4) {
            const uint16_t *x = a->x + m * K;
            float *y = a->y + m * N;
            const int64_t r = a->M - m < 4 ? a->M - m : 4;
            if (r == 4) pairs_rows_4(x, K, a->W, y, N, n, ne, &pf, pf_end);
            else if (r == 3) pairs_rows_3(x, K, a->W, y, N, n, ne, &pf, pf_end);
            else if (r == 2) pairs_rows_2(x, K, a->W, y, N, n, ne, &pf, pf_end);
            else pairs_rows_1(x, K, a->W, y, N, n, ne, &pf, pf_end);
        }
    }
}

/* y[M][N] = x[M][K] @ W[N][K]^T for bfloat16 W, K even, x rounded to bfloat16 first; callers check the CPU has
 * AVX512_BF16 and AVX-512 BW. 0, or KERNEL_OUT_OF_MEMORY */
int bf16_pairs_product(const float *x, int64_t M, int64_t K, const uint16_t *W, float *y, int64_t N, int nthreads) {
    const int gemm = M >= PAIRS_GEMM_ROWS;
    const int64_t rounded = (M * K + 1) / 2;   /* floats' room for M x K bfloat16 values */
    float *const scratch = malloc(sizeof(float) * (rounded + (gemm ? bf16_pairs_gemm_workspace(K, N, nthreads) : 0)));
    if (!scratch) return KERNEL_OUT_OF_MEMORY;
    const uint16_t *const xb = (const uint16_t *)scratch;
    round_to_bf16(x, M * K, (uint16_t *)scratch);
    if (gemm) {
        bf16_pairs_gemm(xb, M, K, W, y, N, scratch + rounded, nthreads);
    } else {
        pairs_args a = {xb, M, K, W, y, N};
        parallel_run(pairs_part, &a, nthreads);
    }
    free(scratch);
    return 0;
}
