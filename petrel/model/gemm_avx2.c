/* Float32 products of many rows (prefill) for x86-64 CPUs with AVX2 + FMA, loaded with ctypes (petrel/model/native.py).
 *
 * f32_gemm_avx2: y[M][N] = x[M][K] @ W[N][K]^T, gemm_avx512.c's scheme sized for 16 vector registers: the innermost
 * loop keeps a 6 x 16 block of y in 12 registers and, per k, loads two vectors of W and broadcasts one value from
 * each of 6 rows of x: 12 fused multiply-adds for 8 loads. W is first copied a panel of 16 columns at a time into
 * k-major order ([K][16], 8 x 8 transposes in registers), and 6 rows of x into [K][6] where needed; slicing K, the
 * blocks' order and the threads: gemm_driver.h.
 * Built with the other kernels (-mavx2 -mfma): callers check native.cpu_has_avx2_fma, as for every kernel. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "gemm_driver.h"
#include "kernels.h"
#include "simd.h"

#define MR 6
#define NR 16

/* y rows [0, mr) x columns [0, nr) = 6 rows of x (x[i * rs + k * ks]) @ the W panel [K][16] (+ y where add). The twelve
 * accumulators are named variables, not an array: gcc keeps an array of vectors in memory, a store per multiply-add.
 * The block comes in (add) and goes out through a stack tile, so that a partial block (mr < MR or nr < NR) touches
 * no row or column past it. */
static inline __attribute__((always_inline)) void block_6x16_at(const float *x, int64_t rs, int64_t ks,
                                                                 const float *wp, int64_t K, float *y, int64_t ldy,
                                                                 int mr, int nr, int add) {
    float tile[MR][NR];
    memset(tile, 0, sizeof(tile));
    if (add)
        for (int i = 0; i < mr; i++) memcpy(tile[i], y + i * ldy, sizeof(float) * nr);
    __m256 c00 = _mm256_loadu_ps(tile[0]), c01 = _mm256_loadu_ps(tile[0] + 8);
    __m256 c10 = _mm256_loadu_ps(tile[1]), c11 = _mm256_loadu_ps(tile[1] + 8);
    __m256 c20 = _mm256_loadu_ps(tile[2]), c21 = _mm256_loadu_ps(tile[2] + 8);
    __m256 c30 = _mm256_loadu_ps(tile[3]), c31 = _mm256_loadu_ps(tile[3] + 8);
    __m256 c40 = _mm256_loadu_ps(tile[4]), c41 = _mm256_loadu_ps(tile[4] + 8);
    __m256 c50 = _mm256_loadu_ps(tile[5]), c51 = _mm256_loadu_ps(tile[5] + 8);
#pragma GCC unroll 4
    for (int64_t k = 0; k < K; k++, wp += NR) {
        const float *xk = x + k * ks;
        const __m256 w0 = _mm256_loadu_ps(wp), w1 = _mm256_loadu_ps(wp + 8);
        __m256 xb = _mm256_broadcast_ss(xk);
        c00 = _mm256_fmadd_ps(w0, xb, c00), c01 = _mm256_fmadd_ps(w1, xb, c01);
        xb = _mm256_broadcast_ss(xk + rs);
        c10 = _mm256_fmadd_ps(w0, xb, c10), c11 = _mm256_fmadd_ps(w1, xb, c11);
        xb = _mm256_broadcast_ss(xk + 2 * rs);
        c20 = _mm256_fmadd_ps(w0, xb, c20), c21 = _mm256_fmadd_ps(w1, xb, c21);
        xb = _mm256_broadcast_ss(xk + 3 * rs);
        c30 = _mm256_fmadd_ps(w0, xb, c30), c31 = _mm256_fmadd_ps(w1, xb, c31);
        xb = _mm256_broadcast_ss(xk + 4 * rs);
        c40 = _mm256_fmadd_ps(w0, xb, c40), c41 = _mm256_fmadd_ps(w1, xb, c41);
        xb = _mm256_broadcast_ss(xk + 5 * rs);
        c50 = _mm256_fmadd_ps(w0, xb, c50), c51 = _mm256_fmadd_ps(w1, xb, c51);
    }
    _mm256_storeu_ps(tile[0], c00), _mm256_storeu_ps(tile[0] + 8, c01);
    _mm256_storeu_ps(tile[1], c10), _mm256_storeu_ps(tile[1] + 8, c11);
    _mm256_storeu_ps(tile[2], c20), _mm256_storeu_ps(tile[2] + 8, c21);
    _mm256_storeu_ps(tile[3], c30), _mm256_storeu_ps(tile[3] + 8, c31);
    _mm256_storeu_ps(tile[4], c40), _mm256_storeu_ps(tile[4] + 8, c41);
    _mm256_storeu_ps(tile[5], c50), _mm256_storeu_ps(tile[5] + 8, c51);
    for (int i = 0; i < mr; i++) memcpy(y + i * ldy, tile[i], sizeof(float) * nr);
}

/* the block with its strides known to the compiler (in place: ks 1; packed: rs 1, ks MR), so that the loop
 * addresses each row of x off one pointer instead of stepping six */
static void block_6x16(const float *x, int64_t rs, int64_t ks, const float *wp, int64_t K, float *y, int64_t ldy,
                       int mr, int nr, int add) {
    if (ks == 1) block_6x16_at(x, rs, 1, wp, K, y, ldy, mr, nr, add);
    else block_6x16_at(x, 1, MR, wp, K, y, ldy, mr, nr, add);
}

/* W rows [n, n + nr), columns [0, K) (rows ldw apart; float32, or bfloat16 where bf16, widened exactly), as the
 * k-major panel wp [K][16]: 8 x 8 tiles of W transposed in registers (the float-at-a-time copy took ~10% of a
 * 512-row product over 576 x 576); a partial panel, and the last K % 8 columns, one value at a time */
static inline __attribute__((always_inline)) void pack_16_from(const void *W, int bf16, int64_t ldw, int64_t K,
                                                                int64_t n, int nr, int nr_full, float *wp) {
    if (nr < NR) {
        if (bf16) gemm_pack_panel_bf16(W, ldw, K, n, nr, nr_full, wp);
        else gemm_pack_panel(W, ldw, K, n, nr, nr_full, wp);
        return;
    }
    const int64_t K8 = K / 8 * 8;
    for (int64_t k = 0; k < K8; k += 8)
        for (int half = 0; half < 2; half++) {
            __m256i t[8];
            for (int i = 0; i < 8; i++) {
                const int64_t at = (n + 8 * half + i) * ldw + k;
                t[i] = _mm256_castps_si256(bf16 ? bf16_load8((const uint16_t *)W + at) : _mm256_loadu_ps((const float *)W + at));
            }
            transpose8(t);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(wp + (k + i) * NR + 8 * half, _mm256_castsi256_ps(t[i]));
        }
    if (K8 < K && bf16) gemm_pack_panel_bf16((const uint16_t *)W + K8, ldw, K - K8, n, nr, nr_full, wp + K8 * NR);
    else if (K8 < K) gemm_pack_panel((const float *)W + K8, ldw, K - K8, n, nr, nr_full, wp + K8 * NR);
}

static void pack_16(const float *W, int64_t ldw, int64_t K, int64_t n, int nr, int nr_full, float *wp) {
    pack_16_from(W, 0, ldw, K, n, nr, nr_full, wp);
}

static void pack_16_bf16(const uint16_t *W, int64_t ldw, int64_t K, int64_t n, int nr, int nr_full, float *wp) {
    pack_16_from(W, 1, ldw, K, n, nr, nr_full, wp);
}

static const gemm_kernel kernel = {MR, NR, block_6x16, pack_16, pack_16_bf16};

/* floats of workspace f32_gemm_avx2 needs */
int64_t f32_gemm_avx2_workspace(int64_t K, int64_t N, int nthreads) {
    return gemm_workspace(&kernel, K, N, nthreads);
}

/* y[M][N] = x[M][K] @ W[N][K]^T (x, W, y contiguous rows); workspace: f32_gemm_avx2_workspace(K, N, nthreads)
 * floats */
void f32_gemm_avx2(const float *x, int64_t M, int64_t K, const float *W, float *y, int64_t N, float *workspace,
                   int nthreads) {
    gemm_run(&kernel, x, M, K, W, NULL, y, N, workspace, nthreads);
}

/* f32_gemm_avx2 for bfloat16 rows of W (widened to float32 exactly as they are packed); the same workspace */
void bf16_gemm_avx2(const float *x, int64_t M, int64_t K, const uint16_t *W, float *y, int64_t N, float *workspace,
                    int nthreads) {
    gemm_run(&kernel, x, M, K, NULL, W, y, N, workspace, nthreads);
}
