/* Products with weights packed once, at load (quantization.pack_panels), into panels of 32 columns: W [N][K] as
 * [ceil(N / 32)][K][32] elements of 32 bits (columns past N zero), the GEMM's packing done ahead over all of K.
 * Loaded with ctypes (petrel/model/native.py); built with the other kernels (-mavx2), its functions carry their own
 * target and callers check the CPU first (gemm_kernels.f32_panels, gemm_kernels.bf16_panels).
 *
 * f32_panels_product: float32 W, float32 x, FMA (AVX-512F).
 * bf16_panels_product: bfloat16 W whose elements are pairs of consecutive k ([N / 32][K / 2][32] pairs), x rounded
 *   to bfloat16 first, dpbf16 (AVX512_BF16: two products an instruction, each exact in float32, sums in float32).
 *
 * Every count of rows runs one kernel: blocks of up to 8 rows of x over a panel (sizes as even as the count
 * allows), two vectors of W and a broadcast element of x a step (16 multiply-adds for 10 loads), no sums across
 * lanes and no packing a call. Each thread walks its panels in slices of K (a slice of a panel in L1/L2 while every
 * block of x passes over it, x's slice in L2; past ROW_PASS rows, x goes in passes of that many rows, each over all
 * of the thread's panels), and while it multiplies one slice it prefetches the next (the rest of its panel, or the
 * next panel: slices are consecutive in memory), spread over every block's steps, so that memory streams W during
 * the arithmetic (from PREFETCH_ROWS rows).
 * Measured (2 threads, Zen 4, weights from memory) for bfloat16 against the row kernels of bf16_pairs.c: 1.0-1.2x at
 * 1-4 rows, 1.2-1.6x at 16-256, 1.0-1.25x at 2,048. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16_pairs.h"
#include "kernels.h"
#include "simd.h"
#include "thread_pool.h"

#define PANEL 32
#define MAX_BLOCK_ROWS 8  /* rows of x a block: 16 accumulators of the 32 registers */
#define K_SLICE 1024  /* elements of K a slice (128 KB of a panel) */
#define PREFETCH_ROWS 8  /* from this many rows of x the next slice is prefetched; below, a slice's few steps leave
                          * the stream to the hardware prefetcher (float32 at 1-4 rows: 1.0-1.2x with it alone) */
#define ROW_PASS 256  /* rows of x a pass over a thread's panels: a slice of x for that many rows stays in L2 while
                       * the panels stream by (2,048 rows at K 2,048-8,192: 1.07-1.28x one pass over all rows) */

/* y rows [0, MR) x columns [0, nr) (+ y where add: a later slice of K) = MR rows of x (ldx elements apart) @ K
 * steps of one panel wp; with PF each step also prefetches pf (and the line pf_step - 1 past it) into L2 and moves
 * pf on by pf_step (a branch a step instead cost the bfloat16 kernel 5-10%). MULADD(w, xb, c): c + w * xb lane by
 * lane (FMA), or c + the pair's two products (dpbf16). */
#define PANEL_BLOCK(NAME, MR, PF, TARGET, MULADD) \
__attribute__((target(TARGET))) \
static void NAME##_##MR##_##PF(const float *x, int64_t ldx, int64_t K, const float *wp, float *y, int64_t ldy, \
                               int nr, int add, const char *pf, int64_t pf_step) { \
    const __mmask16 m0 = lanes16(nr), m1 = lanes16(nr - 16); \
    __m512 c[MR][2]; \
    for (int i = 0; i < MR; i++) { \
        c[i][0] = add ? _mm512_maskz_loadu_ps(m0, y + i * ldy) : _mm512_setzero_ps(); \
        c[i][1] = add ? _mm512_maskz_loadu_ps(m1, y + i * ldy + 16) : _mm512_setzero_ps(); \
    } \
    for (int64_t k = 0; k < K; k++, wp += PANEL, pf += pf_step) { \
        if (PF) { \
            _mm_prefetch(pf, _MM_HINT_T1); \
            _mm_prefetch(pf + pf_step - 1, _MM_HINT_T1); \
        } \
        const __m512 w0 = _mm512_loadu_ps(wp), w1 = _mm512_loadu_ps(wp + 16); \
        for (int i = 0; i < MR; i++) { \
            const __m512 xb = _mm512_set1_ps(x[i * ldx + k]); \
            c[i][0] = MULADD(w0, xb, c[i][0]); \
            c[i][1] = MULADD(w1, xb, c[i][1]); \
        } \
    } \
    for (int i = 0; i < MR; i++) { \
        _mm512_mask_storeu_ps(y + i * ldy, m0, c[i][0]); \
        _mm512_mask_storeu_ps(y + i * ldy + 16, m1, c[i][1]); \
    } \
}
#define FMA(w, xb, c) _mm512_fmadd_ps(w, xb, c)
#define DPBF16(w, xb, c) _mm512_dpbf16_ps(c, (__m512bh)(w), (__m512bh)(xb))
#define BLOCKS(NAME, PF, TARGET, MULADD) \
    PANEL_BLOCK(NAME, 1, PF, TARGET, MULADD) PANEL_BLOCK(NAME, 2, PF, TARGET, MULADD) \
    PANEL_BLOCK(NAME, 3, PF, TARGET, MULADD) PANEL_BLOCK(NAME, 4, PF, TARGET, MULADD) \
    PANEL_BLOCK(NAME, 5, PF, TARGET, MULADD) PANEL_BLOCK(NAME, 6, PF, TARGET, MULADD) \
    PANEL_BLOCK(NAME, 7, PF, TARGET, MULADD) PANEL_BLOCK(NAME, 8, PF, TARGET, MULADD)
BLOCKS(f32_block, 0, "avx512f", FMA) BLOCKS(f32_block, 1, "avx512f", FMA)
BLOCKS(pairs_block, 0, "avx512f,avx512bw,avx512bf16", DPBF16) BLOCKS(pairs_block, 1, "avx512f,avx512bw,avx512bf16", DPBF16)

typedef void (*block_fn)(const float *x, int64_t ldx, int64_t K, const float *wp, float *y, int64_t ldy, int nr,
                         int add, const char *pf, int64_t pf_step);

/* K counts elements of 32 bits (float32 values, or pairs of bfloat16 ones); blocks[pf][r - 1]: the r-row block
 * without prefetching (pf 0), then with */
typedef struct {
    const float *x; int64_t M, K; const float *W; float *y; int64_t N; const block_fn (*blocks)[MAX_BLOCK_ROWS];
} panels_args;

/* M rows go through a slice of a panel in ceil(M / 8) blocks of sizes as even as can be (their first M % blocks one
 * row more): 41 rows as 7, 7, 7, 7, 7, 6, not five of 8 and one of 1, whose two accumulators wait on the FMA's
 * latency (a few rows cost the 1-row block's K steps at half the rate). Each row's sums run over k in the same
 * order in every block, so a row's result does not depend on the rows beside it. */
static int64_t panel_blocks(int64_t M) {
    return (M + MAX_BLOCK_ROWS - 1) / MAX_BLOCK_ROWS;
}

static void panels_part(void *args, int t, int T) {
    const panels_args *a = args;
    const int64_t K = a->K, N = a->N, M = a->M;
    const int64_t slices = (K + K_SLICE - 1) / K_SLICE, kc = (K + slices - 1) / slices;
    int64_t p0, p1;
    split_range((N + PANEL - 1) / PANEL, t, T, 1, &p0, &p1);
    const char *const start = (const char *)(a->W + p0 * K * PANEL), *const end = (const char *)(a->W + p1 * K * PANEL);
    for (int64_t m0 = 0; m0 < M; m0 += ROW_PASS) {
        const int64_t m1 = M - m0 < ROW_PASS ? M : m0 + ROW_PASS;
        /* a step of every block prefetches its share of a step of the next slice (PANEL elements of 4 bytes) */
        const int prefetch = m1 - m0 >= PREFETCH_ROWS;
        const int64_t share = prefetch ? PANEL * 4 / panel_blocks(m1 - m0) : 0;
        const int64_t pf_step = prefetch && share < 1 ? 1 : share;
        for (int64_t p = p0; p < p1; p++) {
            const int nr = N - p * PANEL < PANEL ? (int)(N - p * PANEL) : PANEL;
            for (int64_t k0 = 0; k0 < K; k0 += kc) {
                const int64_t kn = K - k0 < kc ? K - k0 : kc;
                const float *const wp = a->W + (p * K + k0) * PANEL;
                /* the next slice: the rest of this panel, or the next panel (after the last, the first again, for
                 * the next pass of rows) */
                const char *pf = (const char *)(wp + kn * PANEL);
                if (pf >= end) pf = start;
                const int64_t blocks = panel_blocks(m1 - m0), even = (m1 - m0) / blocks, more = (m1 - m0) % blocks;
                for (int64_t b = 0, m = m0; b < blocks; b++, pf += kn * pf_step) {
                    const int64_t rows = even + (b < more);
                    a->blocks[prefetch][rows - 1](a->x + m * K + k0, K, kn, wp, a->y + m * N + p * PANEL, N, nr,
                                                  k0 > 0, pf, pf_step);
                    m += rows;
                }
            }
        }
    }
}

#define ROW_BLOCKS(NAME, PF) \
    {NAME##_1_##PF, NAME##_2_##PF, NAME##_3_##PF, NAME##_4_##PF, NAME##_5_##PF, NAME##_6_##PF, NAME##_7_##PF, \
     NAME##_8_##PF}
static const block_fn f32_blocks[2][MAX_BLOCK_ROWS] = {ROW_BLOCKS(f32_block, 0), ROW_BLOCKS(f32_block, 1)};
static const block_fn pairs_blocks[2][MAX_BLOCK_ROWS] = {ROW_BLOCKS(pairs_block, 0), ROW_BLOCKS(pairs_block, 1)};

/* y[M][N] = x[M][K] @ W^T for float32 W packed in panels ([ceil(N / 32)][K][32]); callers check the CPU has
 * AVX-512F */
void f32_panels_product(const float *x, int64_t M, int64_t K, const float *W, float *y, int64_t N, int nthreads) {
    panels_args a = {x, M, K, W, y, N, f32_blocks};
    parallel_run(panels_part, &a, nthreads);
}

typedef struct { const float *x; int64_t rows, K; uint16_t *out; } round_args;

static void round_rows(const void *args, int64_t r0, int64_t r1) {
    const round_args *a = args;
    round_to_bf16(a->x + r0 * a->K, (r1 - r0) * a->K, a->out + r0 * a->K);
}

/* y[M][N] = x[M][K] @ W^T for bfloat16 W packed in panels ([ceil(N / 32)][K / 2][32] pairs), K even, x rounded to
 * bfloat16 first; callers check the CPU has AVX512_BF16 and AVX-512 BW. 0, or KERNEL_OUT_OF_MEMORY */
int bf16_panels_product(const float *x, int64_t M, int64_t K, const uint16_t *W, float *y, int64_t N, int nthreads) {
    uint16_t *const xb = malloc(sizeof(uint16_t) * (M * K + 2));
    if (!xb) return KERNEL_OUT_OF_MEMORY;
    round_args r = {x, M, K, xb};
    for_rows(round_rows, &r, M, M * K, nthreads);
    bf16_panels_product_rounded(xb, M, K, W, y, N, nthreads);
    free(xb);
    return 0;
}

/* see kernels.h */
void bf16_panels_product_rounded(const uint16_t *xb, int64_t M, int64_t K, const uint16_t *W, float *y, int64_t N,
                                 int nthreads) {
    panels_args a = {(const float *)xb, M, K / 2, (const float *)W, y, N, pairs_blocks};
    parallel_run(panels_part, &a, nthreads);
}
