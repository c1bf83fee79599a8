/* Products of many rows (prefill, batched decode) with GGUF's group-quantized weights (quantization="gguf": Q4_0,
 * Q4_1, Q4_K as 4-bit codes, Q8_0, Q5_0, Q5_1, Q5_K, Q6_K as 8-bit codes, in quant_kernels.c's layouts) in integer
 * arithmetic, for x86-64 CPUs with AVX2, and AVX-512 (BW, VNNI) where the caller says the CPU has it; loaded with
 * ctypes. int8_gemm.c does the same for int8 codes with one scale a row.
 *
 * The weight: w[n][k] = s[n][g] c[n][k] + z[n][g] for k in group g (2^gshift values of k: 32, or 16 for Q6_K; the
 * mins z may be absent). Each row of x is rounded to 16-bit integers with one scale as in int8_gemm.c
 * (q = round(x / dx), dx[m] = max|x[m]| / 32767), and
 *     y[m][n] = dx[m] sum_g (s[n][g] P[m][n][g] + z[n][g] S[m][g]),
 * P[m][n][g] = sum over k in g of q[m][k] c[n][k], exact int32 sums (_mm256_madd_epi16 as in int8_gemm.c), and
 * S[m][g] = sum over g of q[m][k], exact. So y is the float product of the rounded x and the dequantized weight up
 * to float rounding: each group's sums become floats once and go into float accumulators times the group's scales
 * (one float32 rounding of P, at most 2^27, then one per group added). The mins multiply the rounded x's sums, not
 * x's own: the error of the rounding is then that of a product with the weight itself, at most dx[m] / 2
 * sum_k |w[n][k]| (as int8_gemm.c's), and 8 s less than with x's exact sums for Q4_0, whose mins are -8 s.
 *
 * Bound: |c| <= 128 (4-bit: 0..15) and |q| <= 32767, and the int32 sums start again at each group: a lane adds
 * 2^gshift / 2 pairs of two products below 2^22, under 2^31 for groups up to 512 whatever K, so x keeps all 16
 * bits where int8_gemm.c, one sum over all of K, has to use fewer as K grows.
 *
 * Blocks: per group the int32 accumulators start at zero, take the group's pairs of k (packed weights times
 * broadcast pairs of x, int8_gemm.c's step), then are converted and multiplied into float accumulators by the
 * panel's scales of that group (and S times its mins). AVX-512 (32 registers): 6 x 32, twelve int32 and twelve
 * float accumulators in registers (with AVX512_VNNI each madd and add one _mm512_dpwssd_epi32). AVX2 (16
 * registers): a 6 x 16 block's twelve int32 accumulators leave no room for twelve float ones, so 3 x 16, six and
 * six (15 registers with the weights and x's pair); measured on this Zen 4 (one thread, a shared machine) against
 * 6 x 16 with its float accumulators in an L1 array updated once per group: 120-140 GFLOP/s against 75-138,
 * medians about 130 against 120.
 * Each thread widens one panel of W at a time into k-pair-major int16 (4-bit codes unpacked), with the panel's
 * scales and mins as [G][NR], and passes every row of x over it, as int8_gemm.c does. K: a multiple of 32. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "group_gemm_q8.h"
#include "group_panels.h"
#include "int16_rows.h"
#include "kernels.h"
#include "thread_pool.h"

/* 4-bit rows [n, n + nr) (codes [N][K/32][16] bytes: element i of a group low in byte i, 16 + i high) as a panel
 * wp[K/2][width][2] of int16, zeros past nr. Eight rows at a time: the 16 low nibbles of a group are pairs 0..7,
 * the high ones pairs 8..15, each transposed into eight pairs of each row. */
static void pack_panel_q4(const uint8_t *codes, int64_t K, int64_t n, int nr, int width, int16_t *wp) {
    const int64_t B = K / 2;   /* bytes a row */
    const __m128i mask = _mm_set1_epi8(0x0F);
    if (nr < width) memset(wp, 0, sizeof(int16_t) * K * width);   /* a whole panel's every value is written below */
    int j0 = 0;
    for (; j0 + 8 <= nr; j0 += 8)
        for (int64_t k = 0; k < K; k += 32) {
            __m256i lo[8], hi[8];
            for (int i = 0; i < 8; i++) {
                const __m128i b = _mm_loadu_si128((const __m128i *)(codes + (n + j0 + i) * B + k / 2));
                lo[i] = _mm256_cvtepu8_epi16(_mm_and_si128(b, mask));
                hi[i] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), mask));
            }
            transpose8(lo);
            transpose8(hi);
            for (int p = 0; p < 8; p++) {
                _mm256_storeu_si256((__m256i *)(wp + ((k / 2 + p) * width + j0) * 2), lo[p]);
                _mm256_storeu_si256((__m256i *)(wp + ((k / 2 + 8 + p) * width + j0) * 2), hi[p]);
            }
        }
    for (int j = j0; j < nr; j++)
        for (int64_t k = 0; k < K; k++) {
            const uint8_t b = codes[(n + j) * B + k / 32 * 16 + k % 16];
            wp[((k >> 1) * width + j) * 2 + (k & 1)] = (int16_t)(k % 32 < 16 ? b & 0x0F : b >> 4);
        }
}

/* The blocks, one macro for both widths, all accumulators in registers. Each takes MR rows of x's
 * codes (Kp apart; their scales dx, their group sums S, G apart), one panel wp with its scales sp and mins zp
 * ([G][NR]; zp NULL without mins), pg pairs of k a group, and writes y rows [0, mr) x columns [0, nr) (ldy apart).
 * V* name the vector operations of the width being instantiated (defined before each instantiation); ROWS(F, a)
 * is F(i, a) for every row i. The integer accumulators are named variables with the empty asm of int8_gemm.c (without it gcc computes the
 * products first and keeps the sums in memory). */
#define ROWS3(F, a) F(0, a) F(1, a) F(2, a)
#define ROWS6(F, a) ROWS3(F, a) F(3, a) F(4, a) F(5, a)
#define ZERO_INT(i, _) VI c##i##0 = VZEROI(), c##i##1 = c##i##0;
#define STEP(i, _) \
    xb = VSET1I(pair_at(xg + i * Kp + 2 * p)); \
    c##i##0 = VMADD(c##i##0, w0, xb); \
    c##i##1 = VMADD(c##i##1, w1, xb); \
    __asm__("" : VKEEP(c##i##0), VKEEP(c##i##1));
#define FZERO(i, _) VF f##i##0 = VZEROF(), f##i##1 = f##i##0;
#define FSCALE(i, _) \
    f##i##0 = VFMA(VCVT(c##i##0), s0, f##i##0); \
    f##i##1 = VFMA(VCVT(c##i##1), s1, f##i##1);
#define FMINS(i, _) { \
    const VF sv = VSET1F(S[i * G + g]); \
    f##i##0 = VFMA(sv, z0, f##i##0); \
    f##i##1 = VFMA(sv, z1, f##i##1); }
#define FOUT(i, _) { \
    const VF d = VSET1F(dx[i]); \
    VSTOREF(tile[i], VMUL(f##i##0, d)); \
    VSTOREF(tile[i] + VW, VMUL(f##i##1, d)); }
#define GROUP_BLOCK(name, isa, ROWS, MR) \
    __attribute__((target(isa))) static void name(const int16_t *x, int64_t Kp, const float *dx, const float *S, \
                                                  int64_t G, int pg, const int16_t *wp, const float *sp, \
                                                  const float *zp, float *y, int64_t ldy, int mr, int nr) { \
        float tile[MR][2 * VW]; \
        ROWS(FZERO, _) \
        for (int64_t g = 0; g < G; g++) { \
            const int16_t *xg = x + 2 * pg * g; \
            ROWS(ZERO_INT, _) \
            for (int p = 0; p < pg; p++, wp += 4 * VW) { \
                const VI w0 = VLOADI(wp), w1 = VLOADI(wp + 2 * VW); \
                VI xb; \
                ROWS(STEP, _) \
            } \
            const VF s0 = VLOADF(sp + g * 2 * VW), s1 = VLOADF(sp + g * 2 * VW + VW); \
            ROWS(FSCALE, _) \
            if (zp) { \
                const VF z0 = VLOADF(zp + g * 2 * VW), z1 = VLOADF(zp + g * 2 * VW + VW); \
                ROWS(FMINS, _) \
            } \
        } \
        ROWS(FOUT, _) \
        for (int i = 0; i < mr; i++) memcpy(y + i * ldy, tile[i], sizeof(float) * nr); \
    }

#define VECTOR_BITS 256
#include "vector_ops.h"
#define VMADD(c, w, x) _mm256_add_epi32(c, _mm256_madd_epi16(w, x))
GROUP_BLOCK(block_3x16, "avx2,fma", ROWS3, 3)
#undef VMADD

#undef VECTOR_BITS
#define VECTOR_BITS 512
#include "vector_ops.h"
#define AVX512 "avx512f,avx512bw"
#define VMADD madd_add
GROUP_BLOCK(block_avx512, AVX512, ROWS6, 6)
#undef VMADD
#define VMADD dot_add
GROUP_BLOCK(block_vnni, AVX512 ",avx512vnni", ROWS6, 6)

typedef void (*group_block_fn)(const int16_t *x, int64_t Kp, const float *dx, const float *S, int64_t G, int pg,
                               const int16_t *wp, const float *sp, const float *zp, float *y, int64_t ldy, int mr,
                               int nr);

typedef struct {
    int mr, nr;   /* the block's rows and columns */
    group_block_fn block;
} group_kernel;

static const group_kernel KERNELS[] = {
    [INT8_AVX2] = {3, 16, block_3x16},
    [INT8_AVX512] = {6, 32, block_avx512},
    [INT8_AVX512_VNNI] = {6, 32, block_vnni},
};

typedef struct {
    rounding_args r; int64_t G; int group; float *S;
} rows_args;

/* rows of x rounded (round_rows), then each group's sum of their codes: S[m][g] (exact: at most 2^20) */
static void prepare_rows(void *args, int t, int T) {
    rows_args *a = args;
    round_rows(&a->r, t, T);
    int64_t m0, m1;
    split_range(a->r.M, t, T, 1, &m0, &m1);   /* round_rows's rows: this thread's own */
    for (int64_t m = m0; m < m1; m++)
        for (int64_t g = 0; g < a->G; g++) {
            const int16_t *q = a->r.q + m * a->r.Kp + g * a->group;
            int32_t sum = 0;
            for (int k = 0; k < a->group; k++) sum += q[k];
            a->S[m * a->G + g] = (float)sum;
        }
}

typedef struct {
    const group_kernel *g; int bits, gshift; const int16_t *q; const float *dx, *S; int64_t M, K, G;
    const void *codes; const float *scale, *mins; float *y; int64_t N; int16_t *panels; float *groups;
} product_args;

static void product_part(void *args, int t, int T) {
    const product_args *a = args;
    const int MR = a->g->mr, NR = a->g->nr;
    const int64_t K = a->K, G = a->G, N = a->N;
    int16_t *const panel = a->panels + t * K * NR;
    float *const sp = a->groups + t * 2 * G * NR, *const zp = a->mins ? sp + G * NR : NULL;
    int64_t n0, n1;
    split_range(N, t, T, NR, &n0, &n1);
    for (int64_t n = n0; n < n1; n += NR) {
        const int nr = n1 - n < NR ? (int)(n1 - n) : NR;
        if (a->bits == 4) pack_panel_q4(a->codes, K, n, nr, NR, panel);
        else pack_panel(a->codes, K, n, nr, NR, panel);
        pack_groups(a->scale, G, n, nr, NR, sp);
        if (zp) pack_groups(a->mins, G, n, nr, NR, zp);
        for (int64_t m = 0; m < a->M; m += MR)
            a->g->block(a->q + m * K, K, a->dx + m, a->S + m * G, G, 1 << (a->gshift - 1), panel, sp, zp,
                        a->y + m * N + n, N, a->M - m < MR ? (int)(a->M - m) : MR, nr);
    }
}

/* y[M][N] = x[M][K] @ W^T for W = scale * codes + mins in groups along K (quant_kernels.c's layouts: bits 4, groups
 * of 32, or bits 8, groups of 2^gshift, 1 <= gshift <= 9; mins may be NULL), x's rows rounded to 16-bit integers
 * first (see above), with the kernel of isa (an int8_isa the CPU has; with INT8_ACTIVATIONS, 4-bit codes, and 8-bit
 * ones in groups of 32 or more where the isa is INT8_AVX512_VNNI, go to group_gemm_q8.c); K a multiple of 32. 0, or
 * KERNEL_OUT_OF_MEMORY (y then not written) */
int group_gemm(int bits, const float *x, int64_t M, int64_t K, const void *codes, const float *scale,
               const float *mins, int gshift, float *y, int64_t N, int nthreads, int isa) {
    if (isa & INT8_ACTIVATIONS) {
        isa &= ~INT8_ACTIVATIONS;
        if (bits == 4 || (gshift >= 5 && isa == INT8_AVX512_VNNI))
            return group_gemm_q8(bits, x, M, K, codes, scale, mins, gshift, y, N, nthreads, isa);
    }
    const group_kernel *g = &KERNELS[isa];
    const int T = nthreads < 1 ? 1 : nthreads;
    if (bits == 4) gshift = 5;
    const int64_t G = K >> gshift, Mp = (M + g->mr - 1) / g->mr * g->mr;
    /* floats first: dx [Mp], S [Mp][G], each thread's scales and mins [2][G][NR]; then q [Mp][K] and the panels */
    const int64_t floats = Mp + Mp * G + T * 2 * G * g->nr;
    float *dx = malloc(sizeof(float) * floats + sizeof(int16_t) * (Mp * K + T * K * g->nr));
    if (!dx) return KERNEL_OUT_OF_MEMORY;
    float *S = dx + Mp, *groups = S + Mp * G;
    int16_t *q = (int16_t *)(dx + floats), *panels = q + Mp * K;
    memset(q + M * K, 0, sizeof(int16_t) * (Mp - M) * K);
    memset(dx + M, 0, sizeof(float) * (Mp - M));
    memset(S + M * G, 0, sizeof(float) * (Mp - M) * G);
    rows_args r = {{x, M, K, K, q, dx, 32767}, G, 1 << gshift, S};
    parallel_run(prepare_rows, &r, T);
    product_args a = {g, bits, gshift, q, dx, S, M, K, G, codes, scale, mins, y, N, panels, groups};
    parallel_run(product_part, &a, T);
    free(dx);
    return 0;
}
