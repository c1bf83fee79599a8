/* Float32 products of many rows (prefill) for x86-64 CPUs with AVX-512, loaded with ctypes (petrel/model/native.py).
 *
 * f32_gemm: y[M][N] = x[M][K] @ W[N][K]^T. The innermost loop keeps a 14 x 32 block of y in 28 of the 32 vector
 * registers and, per k, loads two vectors of W and broadcasts one value from each of 14 rows of x: 28 fused
 * multiply-adds for 16 loads. Packing W and x, slicing K and the threads: gemm_driver.h.
 * This file is built with the other kernels (-mavx2); its functions carry their own target, and callers check that
 * the CPU has AVX-512 first (native.cpu_has_avx512). */
#include <immintrin.h>
#include <stdint.h>

#include "bf16_pairs.h"
#include "gemm_driver.h"
#include "kernels.h"
#include "simd.h"

#define MR 14
#define NR 32

/* y rows [0, mr) x columns [0, nr) = 14 rows of x (x[i * rs + k * ks]) @ the W panel [K][32] (+ y where add);
 * masked loads and stores touch no column past nr and no row past mr. MULADD(w, xb, c): c + w * xb lane by lane
 * (FMA), or for the bfloat16 GEMM, where every 32-bit element of x and W is a pair of bfloat16 values (consecutive
 * k), c + the pair's two products (dpbf16). */
#define BLOCK_14X32(NAME, TARGET, MULADD) \
__attribute__((target(TARGET), always_inline)) \
static inline void NAME(const float *x, int64_t rs, int64_t ks, const float *wp, int64_t K, float *y, int64_t ldy, \
                        int mr, int nr, int add) { \
    const __mmask16 mask0 = lanes16(nr), mask1 = lanes16(nr - 16); \
    __m512 c[MR][2]; \
    for (int i = 0; i < MR; i++) { \
        c[i][0] = add && i < mr ? _mm512_maskz_loadu_ps(mask0, y + i * ldy) : _mm512_setzero_ps(); \
        c[i][1] = add && i < mr ? _mm512_maskz_loadu_ps(mask1, y + i * ldy + 16) : _mm512_setzero_ps(); \
    } \
    for (int64_t k = 0; k < K; k++, x += ks, wp += NR) { \
        const __m512 w0 = _mm512_loadu_ps(wp), w1 = _mm512_loadu_ps(wp + 16); \
        for (int i = 0; i < MR; i++) { \
            const __m512 xb = _mm512_set1_ps(x[i * rs]); \
            c[i][0] = MULADD(w0, xb, c[i][0]); \
            c[i][1] = MULADD(w1, xb, c[i][1]); \
        } \
    } \
    for (int i = 0; i < mr; i++) { \
        _mm512_mask_storeu_ps(y + i * ldy, mask0, c[i][0]); \
        _mm512_mask_storeu_ps(y + i * ldy + 16, mask1, c[i][1]); \
    } \
}
#define FMA(w, xb, c) _mm512_fmadd_ps(w, xb, c)
#define DPBF16(w, xb, c) _mm512_dpbf16_ps(c, (__m512bh)(w), (__m512bh)(xb))
BLOCK_14X32(block_14x32_at, "avx512f", FMA)
BLOCK_14X32(block_14x32_pairs_at, "avx512f,avx512bf16", DPBF16)

/* sixteen elements i.. of W, float32 or bfloat16 (widened exactly) */
__attribute__((target("avx512f"), always_inline))
static inline __m512 load16(const void *W, int bf16, int64_t i) {
    if (!bf16) return _mm512_loadu_ps((const float *)W + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)W + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* W rows [n, n + nr), columns [0, K) (rows ldw apart; float32, or bfloat16 where bf16), as the k-major panel wp
 * [K][32]: 16 x 16 tiles of W transposed in registers, four rounds of two-source permutes (round s swaps the
 * off-diagonal s x s blocks of each 2s x 2s block); a partial panel, and the last K % 16 columns, one value at a
 * time */
__attribute__((target("avx512f"), always_inline))
static inline void pack_32_from(const void *W, int bf16, int64_t ldw, int64_t K, int64_t n, int nr, int nr_full,
                                float *wp) {
    if (nr < NR) {
        if (bf16) gemm_pack_panel_bf16(W, ldw, K, n, nr, nr_full, wp);
        else gemm_pack_panel(W, ldw, K, n, nr, nr_full, wp);
        return;
    }
    __m512i lo[4], hi[4];
    for (int r = 0, s = 8; r < 4; r++, s /= 2) {
        int32_t l[16], h[16];
        for (int c = 0; c < 16; c++) {
            l[c] = c & s ? 16 + c - s : c;
            h[c] = c & s ? 16 + c : c + s;
        }
        lo[r] = _mm512_loadu_si512(l), hi[r] = _mm512_loadu_si512(h);
    }
    const int64_t K16 = K / 16 * 16;
    for (int64_t k = 0; k < K16; k += 16)
        for (int half = 0; half < 2; half++) {
            __m512 t[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) t[i] = load16(W, bf16, (n + 16 * half + i) * ldw + k);
#pragma GCC unroll 4
            for (int r = 0, s = 8; r < 4; r++, s /= 2)
#pragma GCC unroll 16
                for (int i = 0; i < 16; i++)
                    if (!(i & s)) {
                        const __m512 a = t[i], b = t[i + s];
                        t[i] = _mm512_permutex2var_ps(a, lo[r], b);
                        t[i + s] = _mm512_permutex2var_ps(a, hi[r], b);
                    }
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) _mm512_storeu_ps(wp + (k + i) * NR + 16 * half, t[i]);
        }
    if (K16 < K && bf16) gemm_pack_panel_bf16((const uint16_t *)W + K16, ldw, K - K16, n, nr, nr_full, wp + K16 * NR);
    else if (K16 < K) gemm_pack_panel((const float *)W + K16, ldw, K - K16, n, nr, nr_full, wp + K16 * NR);
}

__attribute__((target("avx512f")))
static void pack_32(const float *W, int64_t ldw, int64_t K, int64_t n, int nr, int nr_full, float *wp) {
    pack_32_from(W, 0, ldw, K, n, nr, nr_full, wp);
}

__attribute__((target("avx512f")))
static void pack_32_bf16(const uint16_t *W, int64_t ldw, int64_t K, int64_t n, int nr, int nr_full, float *wp) {
    pack_32_from(W, 1, ldw, K, n, nr, nr_full, wp);
}

/* the block with its strides known to the compiler (in place: ks 1; packed: rs 1, ks MR) */
__attribute__((target("avx512f")))
static void block_14x32(const float *x, int64_t rs, int64_t ks, const float *wp, int64_t K, float *y, int64_t ldy,
                        int mr, int nr, int add) {
    if (ks == 1) block_14x32_at(x, rs, 1, wp, K, y, ldy, mr, nr, add);
    else block_14x32_at(x, 1, MR, wp, K, y, ldy, mr, nr, add);
}

/* the bfloat16 pairs' block, its strides known to the compiler as block_14x32's */
__attribute__((target("avx512f,avx512bf16")))
static void block_14x32_pairs(const float *x, int64_t rs, int64_t ks, const float *wp, int64_t K, float *y,
                              int64_t ldy, int mr, int nr, int add) {
    if (ks == 1) block_14x32_pairs_at(x, rs, 1, wp, K, y, ldy, mr, nr, add);
    else block_14x32_pairs_at(x, 1, MR, wp, K, y, ldy, mr, nr, add);
}

static const gemm_kernel kernel = {MR, NR, block_14x32, pack_32, pack_32_bf16};
/* bfloat16 x bfloat16: each 32-bit element a pair of bfloat16 values, moved as a float (bits unchanged) */
static const gemm_kernel pairs_kernel = {MR, NR, block_14x32_pairs, pack_32, NULL};

/* floats of workspace f32_gemm needs */
int64_t f32_gemm_workspace(int64_t K, int64_t N, int nthreads) {
    return gemm_workspace(&kernel, K, N, nthreads);
}

/* y[M][N] = x[M][K] @ W[N][K]^T (x, W, y contiguous rows); workspace: f32_gemm_workspace(K, N, nthreads) floats */
void f32_gemm(const float *x, int64_t M, int64_t K, const float *W, float *y, int64_t N, float *workspace,
              int nthreads) {
    gemm_run(&kernel, x, M, K, W, NULL, y, N, workspace, nthreads);
}

/* f32_gemm for bfloat16 rows of W (widened to float32 exactly as they are packed); the same workspace */
void bf16_gemm(const float *x, int64_t M, int64_t K, const uint16_t *W, float *y, int64_t N, float *workspace,
               int nthreads) {
    gemm_run(&kernel, x, M, K, NULL, W, y, N, workspace, nthreads);
}

/* floats of workspace bf16_pairs_gemm needs */
int64_t bf16_pairs_gemm_workspace(int64_t K, int64_t N, int nthreads) {
    return gemm_workspace(&pairs_kernel, K / 2, N, nthreads);
}

/* y[M][N] = x[M][K] @ W[N][K]^T for bfloat16 x (activations rounded by the caller) and W, K even, with AVX512_BF16's
 * dpbf16 (twice the multiply-adds of an FMA an instruction; each product exact in float32, sums in float32): the
 * float32 GEMM's driver over K / 2 elements of 32 bits, each a pair of consecutive k, which its packing moves
 * unchanged; callers check the CPU has AVX512_BF16. Workspace: bf16_pairs_gemm_workspace(K, N, nthreads) floats */
void bf16_pairs_gemm(const uint16_t *x, int64_t M, int64_t K, const uint16_t *W, float *y, int64_t N,
                     float *workspace, int nthreads) {
    gemm_run(&pairs_kernel, (const float *)x, M, K / 2, (const float *)W, NULL, y, N, workspace, nthreads);
}
