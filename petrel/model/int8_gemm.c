/* Products of many rows (prefill, batched decode) with int8 weights of one scale per output row
 * (quantization="int8") in integer arithmetic, for x86-64 CPUs with AVX2, and AVX-512 (BW, VNNI) where the caller
 * says the CPU has it; loaded with ctypes.
 *
 * y[m][n] = dx[m] s[n] sum_k q[m][k] c[n][k]: c are the weight's int8 codes and s their row scales; each row of x
 * is first rounded to 16-bit integers with one scale (q = round(x / dx), dx = max|x| / Q), and the sum is exact
 * int32 arithmetic: _mm256_madd_epi16 multiplies sixteen pairs of 16-bit values and adds neighbours into eight int32
 * lanes. Q = min(32767, (2^31 - 1) / (256 ceil(K / 2))), so that no lane can overflow: each adds ceil(K / 2) sums
 * of two products of at most 128 Q. Only the rounding of x differs from the float product of the dequantized
 * weight: each value moves by at most max|x| / 2Q, 2^-16 of its row's largest up to K = 512, 2^-14.4 at K = 1536.
 *
 * Where the CPU has AVX512_VNNI, the caller's INT8_ACTIVATIONS sends the product to group_gemm_q8.c instead: 8-bit
 * activations a group of 32 times the codes offset to unsigned bytes, dpbusd's four products a lane (see there).
 * Why 16-bit activations and not 8-bit ones with _mm256_maddubs_epi16: maddubs multiplies unsigned by signed bytes,
 * so signed codes by signed activations need a _mm256_sign_epi8 per product, and its int16 sums a madd by ones to
 * widen them: per multiply-add as many instructions on the multiplier ports as madd_epi16 on 16-bit values, plus
 * the sign, and activations 256 times coarser.
 *
 * The AVX2 blocking is gemm_avx2.c's: a 6 x 16 block of y in twelve int32 accumulators; per pair of k, two loads of
 * packed weights (16 columns x 2 k as int16) and six broadcasts of a pair of activations, twelve madds. The AVX-512
 * block is MR512 x 32 in 2 MR512 of the 32 registers, the same steps at twice the width; with AVX512_VNNI each
 * madd and add is one _mm512_dpwssd_epi32 (the same exact sums: it does not saturate). Each thread takes whole
 * panels of W (NR = the block's columns), widens one at a time into k-pair-major order ([ceil(K/2)][NR][2] int16,
 * zeros past N and K) and passes every row of x over it: the panel stays in cache, the rounded x streams (scratch:
 * the rounded x and one panel a thread, however large W). The AVX-512 functions carry their own target; the caller
 * picks the ISA (quant_kernels.int8_isa). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "group_gemm_q8.h"
#include "int16_rows.h"
#include "kernels.h"
#include "thread_pool.h"

#define MR256 6
#define NR256 16
#define MR512 8   /* measured on Zen 4: as fast as 12 rows (both about 200 GFLOP/s a core), less padding */
#define NR512 32

/* row i of the block, one pair of k. The empty asm takes each row's sums as made: without it gcc computes all twelve
 * products first and keeps the accumulators on the stack (half the speed, measured) */
#define STEP(i) \
    xb = _mm256_set1_epi32(pair_at(x##i + 2 * p)); \
    c##i##0 = _mm256_add_epi32(c##i##0, _mm256_madd_epi16(w0, xb)); \
    c##i##1 = _mm256_add_epi32(c##i##1, _mm256_madd_epi16(w1, xb)); \
    __asm__("" : "+x"(c##i##0), "+x"(c##i##1));
#define OUT(i) \
    _mm256_storeu_ps(tile[i], _mm256_mul_ps(_mm256_cvtepi32_ps(c##i##0), _mm256_mul_ps(s0, _mm256_set1_ps(dx[i])))); \
    _mm256_storeu_ps(tile[i] + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(c##i##1), _mm256_mul_ps(s1, _mm256_set1_ps(dx[i]))));

/* y rows [0, mr) x columns [0, nr) from the codes of MR256 rows of x (Kp apart, scales dx) and one panel wp (row
 * scales s, NR256 of them). The accumulators are named variables, not an array: gcc keeps an array of vectors in
 * memory. */
static void block_6x16(const int16_t *x, int64_t Kp, const float *dx, const int16_t *wp, const float *s, float *y,
                       int64_t ldy, int mr, int nr) {
    __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256i c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, xb;
    const int16_t *x0 = x, *x1 = x + Kp, *x2 = x + 2 * Kp, *x3 = x + 3 * Kp, *x4 = x + 4 * Kp, *x5 = x + 5 * Kp;
    for (int64_t p = 0; p < Kp / 2; p++, wp += 2 * NR256) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)wp), w1 = _mm256_loadu_si256((const __m256i *)(wp + 16));
        STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5)
    }
    const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
    float tile[MR256][NR256];
    OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5)
    for (int i = 0; i < mr; i++) memcpy(y + i * ldy, tile[i], sizeof(float) * nr);
}

/* block_6x16 at 512 bits: MR512 rows x NR512 columns, MADD the step; ROWS512(F, a) is F(i, a) for every row i. Named
 * accumulators and the empty asm ("+v": any of the 32 registers) as there: with an array, or without the asm, gcc 12
 * copies every accumulator between two registers on each pair of k (seen in the assembly). */
#define ROWS512(F, a) F(0, a) F(1, a) F(2, a) F(3, a) F(4, a) F(5, a) F(6, a) F(7, a)
#define ZERO512(i, _) __m512i c##i##0 = _mm512_setzero_si512(), c##i##1 = c##i##0;
#define STEP512(i, MADD) \
    xb = _mm512_set1_epi32(pair_at(x + i * Kp + 2 * p)); \
    c##i##0 = MADD(c##i##0, w0, xb); \
    c##i##1 = MADD(c##i##1, w1, xb); \
    __asm__("" : "+v"(c##i##0), "+v"(c##i##1));
#define OUT512(i, _) \
    _mm512_storeu_ps(tile[i], _mm512_mul_ps(_mm512_cvtepi32_ps(c##i##0), _mm512_mul_ps(s0, _mm512_set1_ps(dx[i])))); \
    _mm512_storeu_ps(tile[i] + 16, \
                     _mm512_mul_ps(_mm512_cvtepi32_ps(c##i##1), _mm512_mul_ps(s1, _mm512_set1_ps(dx[i]))));
#define BLOCK_512(name, isa, MADD) \
    __attribute__((target(isa))) static void name(const int16_t *x, int64_t Kp, const float *dx, const int16_t *wp, \
                                                  const float *s, float *y, int64_t ldy, int mr, int nr) { \
        ROWS512(ZERO512, _) \
        __m512i xb; \
        for (int64_t p = 0; p < Kp / 2; p++, wp += 2 * NR512) { \
            const __m512i w0 = _mm512_loadu_si512(wp), w1 = _mm512_loadu_si512(wp + 32); \
            ROWS512(STEP512, MADD) \
        } \
        const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16); \
        float tile[MR512][NR512]; \
        ROWS512(OUT512, _) \
        for (int i = 0; i < mr; i++) memcpy(y + i * ldy, tile[i], sizeof(float) * nr); \
    }

BLOCK_512(block_avx512, "avx512f,avx512bw", madd_add)
BLOCK_512(block_vnni, "avx512f,avx512bw,avx512vnni", dot_add)

/* y rows [0, mr) x columns [0, nr) from the codes of mr rows of x (Kp apart, scales dx) and one panel wp */
typedef void (*int8_block_fn)(const int16_t *x, int64_t Kp, const float *dx, const int16_t *wp, const float *s,
                              float *y, int64_t ldy, int mr, int nr);

typedef struct {
    int mr, nr;   /* the block's rows and columns */
    int8_block_fn block;
} int8_kernel;

static const int8_kernel KERNELS[] = {
    [INT8_AVX2] = {MR256, NR256, block_6x16},
    [INT8_AVX512] = {MR512, NR512, block_avx512},
    [INT8_AVX512_VNNI] = {MR512, NR512, block_vnni},
};

typedef struct {
    const int8_kernel *g; const int16_t *q; const float *dx; int64_t M, Kp; const int8_t *codes; const float *scale;
    float *y; int64_t N, K; int16_t *panels;
} product_args;

static void product_part(void *args, int t, int T) {
    const product_args *a = args;
    const int MR = a->g->mr, NR = a->g->nr;
    const int64_t Kp = a->Kp, N = a->N;
    int16_t *const panel = a->panels + t * Kp * NR;
    int64_t n0, n1;
    split_range(N, t, T, NR, &n0, &n1);
    for (int64_t n = n0; n < n1; n += NR) {
        const int nr = n1 - n < NR ? (int)(n1 - n) : NR;
        float s[NR512] = {0};   /* the widest block's */
        memcpy(s, a->scale + n, sizeof(float) * nr);
        pack_panel(a->codes, a->K, n, nr, NR, panel);
        for (int64_t m = 0; m < a->M; m += MR)
            a->g->block(a->q + m * Kp, Kp, a->dx + m, panel, s, a->y + m * N + n, N,
                        a->M - m < MR ? (int)(a->M - m) : MR, nr);
    }
}

/* y[M][N] = x[M][K] @ W^T for W = scale[n] * codes[n][k] (int8 codes, one float scale a row), x's rows rounded to
 * 16-bit integers first (see above), with the kernel of isa (an int8_isa the CPU has); with INT8_ACTIVATIONS on
 * AVX512_VNNI (K a multiple of 32), x rounded to 8 bits a group of 32 instead (group_gemm_q8.c); 0, or
 * KERNEL_OUT_OF_MEMORY (y then not written) */
int int8_gemm(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scale, float *y, int64_t N,
              int nthreads, int isa) {
    if (isa == (INT8_AVX512_VNNI | INT8_ACTIVATIONS) && K % 32 == 0)   /* x rounded to 8 bits a group of 32 */
        return group_gemm_q8(8, x, M, K, codes, scale, NULL, 62, y, N, nthreads, INT8_AVX512_VNNI);
    isa &= ~INT8_ACTIVATIONS;
    const int8_kernel *g = &KERNELS[isa];
    const int T = nthreads < 1 ? 1 : nthreads;
    const int64_t Kp = (K + 1) / 2 * 2, Mp = (M + g->mr - 1) / g->mr * g->mr, bound = 2147483647 / (128 * Kp);
    int16_t *q = malloc(sizeof(int16_t) * (Mp * Kp + T * Kp * g->nr) + sizeof(float) * Mp);
    if (!q) return KERNEL_OUT_OF_MEMORY;
    int16_t *panels = q + Mp * Kp;
    float *dx = (float *)(panels + T * Kp * g->nr);
    memset(q + M * Kp, 0, sizeof(int16_t) * (Mp - M) * Kp);
    memset(dx + M, 0, sizeof(float) * (Mp - M));
    rounding_args r = {x, M, K, Kp, q, dx, (int16_t)(bound < 32767 ? bound : 32767)};
    parallel_run(round_rows, &r, T);
    product_args a = {g, q, dx, M, Kp, codes, scale, y, N, K, panels};
    parallel_run(product_part, &a, T);
    free(q);
    return 0;
}
