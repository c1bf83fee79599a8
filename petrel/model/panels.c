/* Products with weights packed once, at load (quantization.pack_panels), into panels of 32 columns: W [N][K] as
 * [ceil(N / 32)][K][32] elements of 32 bits (columns past N zero), the GEMM's packing done ahead over all of K.
 * Loaded with ctypes (petrel/model/native.py); built with the other kernels (-mavx2), its functions carry their own
 * target and callers check the CPU first (gemm_kernels.f32_panels_isa, gemm_kernels.bf16_panels).
 *
 * f32_panels_product: float32 W, float32 x, FMA: AVX-512F (PANELS_AVX512) or AVX2 (PANELS_AVX2).
 * bf16_panels_product: bfloat16 W whose elements are pairs of consecutive k ([N / 32][K / 2][32] pairs), x rounded
 *   to bfloat16 first, dpbf16 (AVX512_BF16: two products an instruction, each exact in float32, sums in float32).
 *
 * Every count of rows runs one kernel: blocks of rows of x over a panel (sizes as even as the count allows), a few
 * vectors of W and a broadcast element of x a step, no sums across lanes and no packing a call. AVX-512: blocks of
 * up to 8 rows over the panel's 32 columns (two vectors of W: 16 multiply-adds for 10 loads). AVX2, with 16
 * registers of 8 floats: blocks of up to 6 rows over the panel's two 16-column halves, one after the other (12
 * accumulators, two vectors of W: 12 multiply-adds for 8 loads), or, for up to 3 rows (decode, where W's stream is
 * what counts), over the panel's 32 columns a step. Each thread walks its panels in slices of K (a slice of a panel
 * in L1/L2 while every block of x passes over it, x's slice in L2; past ROW_PASS rows, x goes in passes of that many
 * rows, each over all of the thread's panels), and while it multiplies one slice it prefetches the next (the rest of
 * its panel, or the next panel: slices are consecutive in memory), spread over every block's steps, so that memory
 * streams W during the arithmetic (from PREFETCH_ROWS rows, and at any count over halves, which read a slice twice).
 * Measured (2 threads, Zen 4, weights from memory) for bfloat16 against the row kernels of bf16_pairs.c: 1.0-1.2x at
 * 1-4 rows, 1.2-1.6x at 16-256, 1.0-1.25x at 2,048; float32 with the AVX2 blocks against the AVX2 row kernels
 * (gemv_rows.h; SmolLM2's and a Llama-1B's layers): 1.1-1.3x at 1-2 rows, 1.1-1.8x at 3-16, 1.05-1.2x at 64-256, and
 * 0.90-0.95x the AVX-512 blocks' rate from 16 rows on (195-200 GFLOP/s at 2,048 rows, where the AVX2 GEMM that packs
 * W a call, gemm_avx2.c, makes 190-215). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16_pairs.h"
#include "kernels.h"
#include "simd.h"
#include "thread_pool.h"

#define PANEL 32
#define MAX_BLOCK_ROWS 8  /* rows of x an AVX-512 block: 16 accumulators of the 32 registers */
#define AVX2_HALF_ROWS 6  /* rows of x an AVX2 block over half a panel: 12 accumulators of the 16 registers */
#define AVX2_WIDE_ROWS 3  /* up to this many rows (a pass), AVX2 blocks take the whole panel: 4 accumulators a row
                           * (3 rows: one of the 12 kept in memory, still 1.2-1.3x halves at 3 rows) */
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

/* The AVX2 block: y rows [0, MR) x columns [0, nr) of NV vectors of 8 (nr may exceed them: a half's columns) as
 * PANEL_BLOCK's, the panel's columns from wp (a half: wp + 16), still PANEL elements a step of k. The accumulators
 * are named variables, c<row>_<vector>, not an array: with 16 registers gcc keeps an array of them in memory, a
 * store per multiply-add. */
#define REP_1(F) F(0)
#define REP_2(F) REP_1(F) F(1)
#define REP_3(F) REP_2(F) F(2)
#define REP_4(F) REP_3(F) F(3)
#define REP_5(F) REP_4(F) F(4)
#define REP_6(F) REP_5(F) F(5)
#define ACC_IN(i, v) \
    __m256 c##i##_##v = add ? _mm256_maskload_ps(y + i * ldy + 8 * v, lanes8(nr - 8 * v)) : _mm256_setzero_ps();
#define ACC_OUT(i, v) _mm256_maskstore_ps(y + i * ldy + 8 * v, lanes8(nr - 8 * v), c##i##_##v);
#define ACC_FMA(i, v) c##i##_##v = _mm256_fmadd_ps(w##v, xb##i, c##i##_##v);
#define IN_2(i) ACC_IN(i, 0) ACC_IN(i, 1)
#define IN_4(i) IN_2(i) ACC_IN(i, 2) ACC_IN(i, 3)
#define OUT_2(i) ACC_OUT(i, 0) ACC_OUT(i, 1)
#define OUT_4(i) OUT_2(i) ACC_OUT(i, 2) ACC_OUT(i, 3)
#define W_2 const __m256 w0 = _mm256_loadu_ps(wp), w1 = _mm256_loadu_ps(wp + 8);
#define W_4 W_2 const __m256 w2 = _mm256_loadu_ps(wp + 16), w3 = _mm256_loadu_ps(wp + 24);
#define STEP_2(i) { const __m256 xb##i = _mm256_broadcast_ss(x + i * ldx + k); ACC_FMA(i, 0) ACC_FMA(i, 1) }
#define STEP_4(i) \
    { const __m256 xb##i = _mm256_broadcast_ss(x + i * ldx + k); ACC_FMA(i, 0) ACC_FMA(i, 1) ACC_FMA(i, 2) \
      ACC_FMA(i, 3) }
#define PANEL_BLOCK_AVX2(MR, NV, PF) \
__attribute__((target("avx2,fma"))) \
static void avx2_block_##NV##_##MR##_##PF(const float *x, int64_t ldx, int64_t K, const float *wp, float *y, \
                                          int64_t ldy, int nr, int add, const char *pf, int64_t pf_step) { \
    REP_##MR(IN_##NV) \
    _Pragma("GCC unroll 4") \
    for (int64_t k = 0; k < K; k++, wp += PANEL, pf += pf_step) { \
        if (PF) { \
            _mm_prefetch(pf, _MM_HINT_T1); \
            _mm_prefetch(pf + pf_step - 1, _MM_HINT_T1); \
        } \
        W_##NV \
        REP_##MR(STEP_##NV) \
    } \
    REP_##MR(OUT_##NV) \
}
#define AVX2_BLOCKS(PF) \
    PANEL_BLOCK_AVX2(1, 4, PF) PANEL_BLOCK_AVX2(2, 4, PF) PANEL_BLOCK_AVX2(3, 4, PF) \
    PANEL_BLOCK_AVX2(1, 2, PF) PANEL_BLOCK_AVX2(2, 2, PF) PANEL_BLOCK_AVX2(3, 2, PF) \
    PANEL_BLOCK_AVX2(4, 2, PF) PANEL_BLOCK_AVX2(5, 2, PF) PANEL_BLOCK_AVX2(6, 2, PF)
AVX2_BLOCKS(0) AVX2_BLOCKS(1)

typedef void (*block_fn)(const float *x, int64_t ldx, int64_t K, const float *wp, float *y, int64_t ldy, int nr,
                         int add, const char *pf, int64_t pf_step);

/* A panel's blocks: blocks[pf][r - 1] the r-row block (r up to max_rows) without prefetching (pf 0), then with,
 * over each of the panel's `parts` column groups in turn (PANEL / parts columns each) */
typedef struct {
    block_fn blocks[2][MAX_BLOCK_ROWS];
    int max_rows, parts;
} panel_kernel;

/* K counts elements of 32 bits (float32 values, or pairs of bfloat16 ones); a pass of rows takes `few`'s blocks up
 * to its max_rows rows, else `many`'s */
typedef struct {
    const float *x; int64_t M, K; const float *W; float *y; int64_t N; const panel_kernel *few, *many;
} panels_args;

/* M rows go through a slice of a panel in ceil(M / max_rows) blocks of sizes as even as can be (their first
 * M % blocks one row more): 41 rows in blocks of 8 as 7, 7, 7, 7, 7, 6, not five of 8 and one of 1, whose two
 * accumulators wait on the FMA's latency (a few rows cost the 1-row block's K steps at half the rate). Each row's
 * sums run over k in the same order in every block, so a row's result does not depend on the rows beside it. */
static int64_t panel_blocks(int64_t M, int max_rows) {
    return (M + max_rows - 1) / max_rows;
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
        const panel_kernel *const kernel = m1 - m0 <= a->few->max_rows ? a->few : a->many;
        const int parts = kernel->parts, width = PANEL / parts;
        const int64_t blocks = panel_blocks(m1 - m0, kernel->max_rows), even = (m1 - m0) / blocks;
        const int64_t more = (m1 - m0) % blocks;
        /* a step of every block prefetches its share of a step of the next slice (PANEL elements of 4 bytes) */
        const int prefetch = (m1 - m0 >= PREFETCH_ROWS || parts > 1);
        const int64_t share = prefetch ? PANEL * 4 / (blocks * parts) : 0;
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
                for (int64_t b = 0, m = m0; b < blocks; b++) {
                    const int64_t rows = even + (b < more);
                    for (int part = 0; part < parts && part * width < nr; part++, pf += kn * pf_step)
                        kernel->blocks[prefetch][rows - 1](a->x + m * K + k0, K, kn, wp + part * width,
                                                           a->y + m * N + p * PANEL + part * width, N,
                                                           nr - part * width, k0 > 0, pf, pf_step);
                    m += rows;
                }
            }
        }
    }
}

#define ROW_BLOCKS(NAME, PF) \
    {NAME##_1_##PF, NAME##_2_##PF, NAME##_3_##PF, NAME##_4_##PF, NAME##_5_##PF, NAME##_6_##PF, NAME##_7_##PF, \
     NAME##_8_##PF}
static const panel_kernel f32_avx512 = {{ROW_BLOCKS(f32_block, 0), ROW_BLOCKS(f32_block, 1)}, MAX_BLOCK_ROWS, 1};
static const panel_kernel pairs = {{ROW_BLOCKS(pairs_block, 0), ROW_BLOCKS(pairs_block, 1)}, MAX_BLOCK_ROWS, 1};
#define HALF_BLOCKS(PF) \
    {avx2_block_2_1_##PF, avx2_block_2_2_##PF, avx2_block_2_3_##PF, avx2_block_2_4_##PF, avx2_block_2_5_##PF, \
     avx2_block_2_6_##PF}
static const panel_kernel f32_avx2_halves = {{HALF_BLOCKS(0), HALF_BLOCKS(1)}, AVX2_HALF_ROWS, 2};
static const panel_kernel f32_avx2_wide = {{{avx2_block_4_1_0, avx2_block_4_2_0, avx2_block_4_3_0},
                                            {avx2_block_4_1_1, avx2_block_4_2_1, avx2_block_4_3_1}},
                                           AVX2_WIDE_ROWS, 1};

/* y[M][N] = x[M][K] @ W^T for float32 W packed in panels ([ceil(N / 32)][K][32]) with the blocks of isa
 * (PANELS_AVX512 or PANELS_AVX2); callers check the CPU has it */
void f32_panels_product(const float *x, int64_t M, int64_t K, const float *W, float *y, int64_t N, int nthreads,
                        int isa) {
    panels_args a = {x, M, K, W, y, N, &f32_avx512, &f32_avx512};
    if (isa == PANELS_AVX2) a.few = &f32_avx2_wide, a.many = &f32_avx2_halves;
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
    panels_args a = {(const float *)xb, M, K / 2, (const float *)W, y, N, &pairs, &pairs};
    parallel_run(panels_part, &a, nthreads);
}
