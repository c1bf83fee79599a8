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
 * bf16_panels_product: the same product from W packed once, at load (quantization.pack_panels), into panels of 32
 * columns, [N / 32][K / 2][32] pairs (the GEMM's packing done ahead, over all of K): every count of rows runs one
 * kernel, blocks of up to 8 rows of x over a panel, two vectors of W and a broadcast pair of x a step, no sums
 * across lanes and no packing a call (2 threads, Zen 4, against the kernels above: 1.0-1.2x at 1-4 rows,
 * 1.2-1.6x at 16-256, 1.0-1.25x at 2,048). */
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

/* x rounded to bfloat16 (nearest even; the conversion takes subnormal floats as zero), n values */
__attribute__((target(TARGET)))
static void round_to_bf16(const float *x, int64_t n, uint16_t *out) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i)));
    if (i < n) {
        const __mmask16 lo = (__mmask16)((1u << (n - i < 16 ? n - i : 16)) - 1);
        const __mmask16 hi = (__mmask16)(n - i > 16 ? (1u << (n - i - 16)) - 1 : 0);
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, x + i + 16), _mm512_maskz_loadu_ps(lo, x + i));
        _mm512_mask_storeu_epi16(out + i, ((__mmask32)hi << 16) | lo, (__m512i)v);
    }
}

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

/* bf16_panels_product: a panel is 32 columns of W, [K2][32] pairs (32-bit elements, each two consecutive k) */
#define PANEL 32

/* y rows [0, MR) x columns [0, nr) = MR rows of x (bfloat16 pairs, rows K2 apart) @ one panel wp; each step also
 * prefetches pf (and the line pf_step - 1 past it) into L2 and moves pf on by pf_step: the caller spreads the next
 * panel over every block's steps, so that memory streams it while this panel is multiplied */
#define PANEL_BLOCK(MR) \
__attribute__((target(TARGET))) \
static void panel_block_##MR(const uint32_t *x, int64_t K2, const uint32_t *wp, float *y, int64_t ldy, int nr, \
                             const char *pf, int64_t pf_step) { \
    __m512 c[MR][2]; \
    for (int i = 0; i < MR; i++) c[i][0] = c[i][1] = _mm512_setzero_ps(); \
    for (int64_t k = 0; k < K2; k++, wp += PANEL, pf += pf_step) { \
        _mm_prefetch(pf, _MM_HINT_T1); \
        _mm_prefetch(pf + pf_step - 1, _MM_HINT_T1); \
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 16); \
        for (int i = 0; i < MR; i++) { \
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int32_t)x[i * K2 + k]); \
            c[i][0] = _mm512_dpbf16_ps(c[i][0], w0, xb); \
            c[i][1] = _mm512_dpbf16_ps(c[i][1], w1, xb); \
        } \
    } \
    const __mmask16 m0 = nr >= 16 ? 0xFFFF : (__mmask16)((1u << nr) - 1); \
    const __mmask16 m1 = nr >= 32 ? 0xFFFF : nr <= 16 ? 0 : (__mmask16)((1u << (nr - 16)) - 1); \
    for (int i = 0; i < MR; i++) { \
        _mm512_mask_storeu_ps(y + i * ldy, m0, c[i][0]); \
        _mm512_mask_storeu_ps(y + i * ldy + 16, m1, c[i][1]); \
    } \
}
PANEL_BLOCK(8) PANEL_BLOCK(4) PANEL_BLOCK(2) PANEL_BLOCK(1)

typedef struct { const uint32_t *x; int64_t M, K2; const uint32_t *W; float *y; int64_t N; } panels_args;

/* blocks of 8 rows, then 4, 2, 1 for the rest: how many a panel goes through */
static int64_t panel_blocks(int64_t M) {
    return M / 8 + __builtin_popcountll((unsigned long long)(M % 8));
}

static void panels_part(void *args, int t, int T) {
    const panels_args *a = args;
    const int64_t K2 = a->K2, N = a->N, panel_bytes = K2 * PANEL * 4;
    int64_t p0, p1;
    split_range((N + PANEL - 1) / PANEL, t, T, 1, &p0, &p1);
    int64_t pf_step = panel_bytes / (panel_blocks(a->M) * K2);
    if (pf_step < 1) pf_step = 1;
    for (int64_t p = p0; p < p1; p++) {
        const uint32_t *const wp = a->W + p * K2 * PANEL;
        const int nr = N - p * PANEL < PANEL ? (int)(N - p * PANEL) : PANEL;
        /* the next panel, or this one again for the last (prefetching what is in cache costs little) */
        const char *pf = (const char *)(p + 1 < p1 ? wp + K2 * PANEL : wp);
        for (int64_t m = 0; m < a->M; pf += K2 * pf_step) {
            const int64_t r = a->M - m;
            const uint32_t *x = a->x + m * K2;
            float *y = a->y + m * N + p * PANEL;
            if (r >= 8) panel_block_8(x, K2, wp, y, N, nr, pf, pf_step), m += 8;
            else if (r >= 4) panel_block_4(x, K2, wp, y, N, nr, pf, pf_step), m += 4;
            else if (r >= 2) panel_block_2(x, K2, wp, y, N, nr, pf, pf_step), m += 2;
            else panel_block_1(x, K2, wp, y, N, nr, pf, pf_step), m += 1;
        }
    }
}

typedef struct { const float *x; int64_t rows, K; uint16_t *out; } round_args;

static void round_part(void *args, int t, int T) {
    const round_args *a = args;
    int64_t r0, r1;
    split_range(a->rows, t, T, 1, &r0, &r1);
    if (r1 > r0) round_to_bf16(a->x + r0 * a->K, (r1 - r0) * a->K, a->out + r0 * a->K);
}

/* y[M][N] = x[M][K] @ W^T for bfloat16 W packed in panels (quantization.pack_panels: [ceil(N / 32)][K / 2][32]
 * pairs, columns past N zero), K even, x rounded to bfloat16 first; callers check the CPU has AVX512_BF16 and
 * AVX-512 BW. 0, or KERNEL_OUT_OF_MEMORY */
int bf16_panels_product(const float *x, int64_t M, int64_t K, const uint16_t *W, float *y, int64_t N, int nthreads) {
    uint16_t *const xb = malloc(sizeof(uint16_t) * (M * K + 2));
    if (!xb) return KERNEL_OUT_OF_MEMORY;
    round_args r = {x, M, K, xb};
    if (M * K >= (1 << 16)) parallel_run(round_part, &r, nthreads);
    else round_part(&r, 0, 1);
    panels_args a = {(const uint32_t *)xb, M, K / 2, (const uint32_t *)W, y, N};
    parallel_run(panels_part, &a, nthreads);
    free(xb);
    return 0;
}
