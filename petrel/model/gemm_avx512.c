/* Float32 products of many rows (prefill) for x86-64 CPUs with AVX-512, loaded with ctypes (petrel/model/native.py).
 *
 * f32_gemm: y[M][N] = x[M][K] @ W[N][K]^T. The innermost loop keeps an MR x NR block of y in 28 of the 32 vector
 * registers and, per k, loads two vectors of W and broadcasts one value from each of MR rows of x: 28 fused
 * multiply-adds for 16 loads, at the FMA units' rate (221 GFLOP/s on two cores in L1 here, about 96% of their
 * peak). W is first copied a panel of NR columns at a time into k-major order ([K][NR]), which stays in L2 while
 * every MR-row block of x passes over it. Threads take panels of W.
 * This file is built with the other kernels (-mavx2); its functions carry their own target, and callers check that
 * the CPU has AVX-512 first (native.cpu_has_avx512). */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "thread_pool.h"

#define MR 14
#define NR 32

/* y rows [0, mr) x columns [0, NR) (masked to the valid ones) = x rows [0, MR) (ldx floats apart) @ W panel */
__attribute__((target("avx512f")))
static void block_14x32(const float *x, int64_t ldx, const float *wp, int64_t K, float *y, int64_t ldy, int mr,
                        __mmask16 mask0, __mmask16 mask1) {
    __m512 c[MR][2];
    for (int i = 0; i < MR; i++) c[i][0] = c[i][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++, x++, wp += NR) {
        const __m512 w0 = _mm512_loadu_ps(wp), w1 = _mm512_loadu_ps(wp + 16);
        for (int i = 0; i < MR; i++) {
            const __m512 xb = _mm512_set1_ps(x[i * ldx]);
            c[i][0] = _mm512_fmadd_ps(w0, xb, c[i][0]);
            c[i][1] = _mm512_fmadd_ps(w1, xb, c[i][1]);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm512_mask_storeu_ps(y + i * ldy, mask0, c[i][0]);
        _mm512_mask_storeu_ps(y + i * ldy + 16, mask1, c[i][1]);
    }
}

/* tail: the last M % MR rows of x followed by zero rows, [MR][K] (NULL when M is a multiple of MR); wp: each
 * thread's W panel [K][NR] */
typedef struct {
    const float *x; int64_t M, K; const float *W; float *y; int64_t N; const float *tail; float *wp;
} gemm_args;

__attribute__((target("avx512f")))
static void gemm_part(void *args, int t, int T) {
    const gemm_args *a = args;
    const int64_t M = a->M, K = a->K, N = a->N, full = M / MR;
    int64_t n0, n1;
    split_range(N, t, T, NR, &n0, &n1);
    float *wp = a->wp + t * K * NR;
    for (int64_t n = n0; n < n1; n += NR) {
        const int nr = n1 - n < NR ? (int)(n1 - n) : NR;
        for (int j = 0; j < NR; j++) {          /* this W panel, k-major; columns past N as zeros */
            if (j < nr) {
                const float *src = a->W + (n + j) * K;
                for (int64_t k = 0; k < K; k++) wp[k * NR + j] = src[k];
            } else {
                for (int64_t k = 0; k < K; k++) wp[k * NR + j] = 0.f;
            }
        }
        const __mmask16 mask0 = nr >= 16 ? 0xFFFF : (__mmask16)((1u << nr) - 1);
        const __mmask16 mask1 = nr >= 32 ? 0xFFFF : nr <= 16 ? 0 : (__mmask16)((1u << (nr - 16)) - 1);
        for (int64_t p = 0; p < full; p++)
            block_14x32(a->x + p * MR * K, K, wp, K, a->y + p * MR * N + n, N, MR, mask0, mask1);
        if (a->tail) block_14x32(a->tail, K, wp, K, a->y + full * MR * N + n, N, (int)(M - full * MR), mask0, mask1);
    }
}

/* floats of workspace f32_gemm needs */
int64_t f32_gemm_workspace(int64_t K, int nthreads) {
    return MR * K + (int64_t)nthreads * K * NR;
}

/* y[M][N] = x[M][K] @ W[N][K]^T (x, W, y contiguous rows); workspace: f32_gemm_workspace(K, nthreads) floats */
void f32_gemm(const float *x, int64_t M, int64_t K, const float *W, float *y, int64_t N, float *workspace,
              int nthreads) {
    const int64_t rest = M % MR;
    float *tail = rest ? workspace : NULL;
    if (tail) {
        memcpy(tail, x + (M - rest) * K, sizeof(float) * rest * K);
        memset(tail + rest * K, 0, sizeof(float) * (MR - rest) * K);
    }
    gemm_args a = {x, M, K, W, y, N, tail, workspace + MR * K};
    parallel_run(gemm_part, &a, nthreads);
}
