/* The part of petrel's register-blocked float32 GEMMs that does not depend on the vector width, shared by
 * gemm_avx2.c and gemm_avx512.c; each supplies its block (an MR x NR tile of y kept in registers) and its sizes.
 *
 * y[M][N] = x[M][K] @ W[N][K]^T: each thread takes whole panels of NR columns. K is cut into slices of ~512
 * (gemm_k_slice) and a thread's columns into chunks of up to ~4 MB of packed W a slice (gemm_chunk_columns, so
 * that a chunk stays in L3); each chunk is copied into k-major panels ([slice][NR], columns past N as zeros), then
 * the rows of x pass over it a few MR-row blocks at a time (as many as fit ~256 KB of L2): a panel brought from
 * L3 serves every block of the pass, and W is read from memory once a call. A block of x is read in place, unless
 * its rows would crowd one L1 set (K floats apart: at K = 1,024 x 2^j all MR rows fall in one set, and evict each
 * other at every k) or it is the last, partial block: those are copied k-major ([slice][MR], rows past M as zeros)
 * once per chunk (copying every block measured 10-30% slower where N is small). (Packing all of W up front, as
 * before, put 64 MB a thread of a 1B model's gate/up in memory, brought back for every 28 rows.) A block after the
 * first slice starts from the y its earlier slices wrote, so the sums run in the same order as without slices; a
 * block writes only its valid rows and columns. W may be bfloat16 rows instead: the packing widens them to float32
 * (exactly), so the products are those of the widened weights, at the float32 rate, from half the bytes. */
#pragma once
#include <stdint.h>
#include <string.h>

#include "thread_pool.h"

/* y rows [0, mr) x columns [0, nr) = a block of MR rows of x (x[i * rs + k * ks]: in place rs = ldx, ks = 1;
 * packed k-major rs = 1, ks = MR) @ a packed panel of W, wp [K][NR], plus y's own values where add is nonzero (a
 * later slice of K) */
typedef void (*gemm_block_fn)(const float *x, int64_t rs, int64_t ks, const float *wp, int64_t K, float *y,
                              int64_t ldy, int mr, int nr, int add);

/* W rows [n, n + nr), columns [0, K) (rows ldw floats apart), as a k-major panel wp [K][NR], columns nr..NR zero */
typedef void (*gemm_pack_fn)(const float *W, int64_t ldw, int64_t K, int64_t n, int nr, int NR, float *wp);
/* the same from bfloat16 rows of W (each value widened to float32 exactly) */
typedef void (*gemm_pack_bf16_fn)(const uint16_t *W, int64_t ldw, int64_t K, int64_t n, int nr, int NR, float *wp);

typedef struct {
    int mr, nr;          /* the block's rows and columns */
    gemm_block_fn block;
    gemm_pack_fn pack;   /* gemm_pack_panel, or a vectorized one */
    gemm_pack_bf16_fn pack_bf16;
} gemm_kernel;

/* the length of K's slices: K itself up to 768, else K cut into about equal slices of about 512, a multiple of 16 */
static inline int64_t gemm_k_slice(int64_t K) {
    if (K <= 768) return K;
    const int64_t slices = (K + 256) / 512;
    return ((K + slices - 1) / slices + 15) / 16 * 16;
}

/* a thread's share of the columns, whole panels: at most this many */
static inline int64_t gemm_columns_per_thread(const gemm_kernel *g, int64_t N, int nthreads) {
    return ((N + nthreads - 1) / nthreads + g->nr - 1) / g->nr * g->nr;
}

#define GEMM_CHUNK_BYTES (4 << 20) /* a thread's packed chunk of W: in L3 */
#define GEMM_PASS_BYTES (256 << 10) /* a pass's packed blocks of x: in L2 */

/* the columns of a packed chunk: whole panels of a K slice, ~GEMM_CHUNK_BYTES, at most a thread's share */
static inline int64_t gemm_chunk_columns(const gemm_kernel *g, int64_t K, int64_t N, int nthreads) {
    const int64_t panels = GEMM_CHUNK_BYTES / 4 / (gemm_k_slice(K) * g->nr);
    const int64_t columns = (panels < 1 ? 1 : panels) * g->nr, share = gemm_columns_per_thread(g, N, nthreads);
    return columns < share ? columns : share;
}

/* the MR-row blocks of a pass: ~GEMM_PASS_BYTES of packed x */
static inline int64_t gemm_pass_blocks(const gemm_kernel *g, int64_t K) {
    const int64_t blocks = GEMM_PASS_BYTES / 4 / (gemm_k_slice(K) * g->mr);
    return blocks < 1 ? 1 : blocks;
}

/* floats of workspace gemm_run needs: every thread's packed chunk of W and pass of x */
static inline int64_t gemm_workspace(const gemm_kernel *g, int64_t K, int64_t N, int nthreads) {
    const int64_t columns = gemm_chunk_columns(g, K, N, nthreads), rows = gemm_pass_blocks(g, K) * g->mr;
    return (int64_t)nthreads * gemm_k_slice(K) * (columns + rows);
}

/* W float32 rows, or W16 bfloat16 ones (the other NULL); wp: the threads' workspaces */
typedef struct {
    const gemm_kernel *g; const float *x; int64_t M, K; const float *W; const uint16_t *W16; float *y; int64_t N;
    float *wp;
} gemm_args;

/* whether MR rows ldx floats apart put more of their cache lines in one set of an 8-way, 64-set L1 than it holds */
static inline int gemm_rows_crowd_l1(int MR, int64_t ldx) {
    int count[64] = {0};
    for (int i = 0; i < MR; i++)
        if (++count[(i * ldx * 4 / 64) % 64] > 8) return 1;
    return 0;
}

/* x rows [0, mr) (ldx floats apart), K columns, as a k-major block xp [K][MR], rows mr..MR zero */
static inline void gemm_pack_rows(const float *x, int64_t ldx, int64_t K, int mr, int MR, float *xp) {
    if (mr < MR) memset(xp, 0, sizeof(float) * K * MR);
    for (int i = 0; i < mr; i++)
        for (int64_t k = 0; k < K; k++) xp[k * MR + i] = x[i * ldx + k];
}

/* W rows [n, n + nr), columns [0, K) (rows ldw apart), as a k-major panel [K][NR], columns nr..NR zero: one float
 * at a time */
static inline void gemm_pack_panel(const float *W, int64_t ldw, int64_t K, int64_t n, int nr, int NR, float *wp) {
    for (int64_t k = 0; k < K; k++) {
        float *dst = wp + k * NR;
        for (int j = 0; j < nr; j++) dst[j] = W[(n + j) * ldw + k];
        for (int j = nr; j < NR; j++) dst[j] = 0.f;
    }
}

/* gemm_pack_panel from bfloat16 rows */
static inline void gemm_pack_panel_bf16(const uint16_t *W, int64_t ldw, int64_t K, int64_t n, int nr, int NR,
                                        float *wp) {
    for (int64_t k = 0; k < K; k++) {
        float *dst = wp + k * NR;
        for (int j = 0; j < nr; j++) {
            const uint32_t bits = (uint32_t)W[(n + j) * ldw + k] << 16;
            memcpy(dst + j, &bits, sizeof(float));
        }
        for (int j = nr; j < NR; j++) dst[j] = 0.f;
    }
}

/* MR-row block b of x in the K slice from k0: its rows (returned), and where the kernel reads them (*x, strides *rs,
 * *ks): in place, or from `copy` (k-major, gemm_pack_rows) when its rows crowd one L1 set or it is the last, partial
 * block */
static inline int gemm_block_source(const gemm_args *a, int64_t b, int64_t k0, int crowded, float *copy,
                                    const float **x, int64_t *rs, int64_t *ks) {
    const int MR = a->g->mr, mr = a->M - b * MR < MR ? (int)(a->M - b * MR) : MR, copied = crowded || mr < MR;
    *x = copied ? copy : a->x + b * MR * a->K + k0;
    *rs = copied ? 1 : a->K;
    *ks = copied ? MR : 1;
    return mr;
}

static void gemm_part(void *args, int t, int T) {
    const gemm_args *a = args;
    const gemm_kernel *g = a->g;
    const int MR = g->mr, NR = g->nr;
    const int64_t M = a->M, K = a->K, N = a->N, kc = gemm_k_slice(K), pass = gemm_pass_blocks(g, K);
    const int64_t nc = gemm_chunk_columns(g, K, N, T), blocks = (M + MR - 1) / MR;
    const int crowded = gemm_rows_crowd_l1(MR, K);
    int64_t n0, n1;
    split_range(N, t, T, NR, &n0, &n1);
    float *const chunk = a->wp + t * kc * (nc + pass * MR), *const xp = chunk + kc * nc;
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const int64_t kn = K - k0 < kc ? K - k0 : kc;
        for (int64_t c0 = n0; c0 < n1; c0 += nc) {
            const int64_t c1 = c0 + nc < n1 ? c0 + nc : n1;
            for (int64_t n = c0; n < c1; n += NR) {
                const int nr = c1 - n < NR ? (int)(c1 - n) : NR;
                if (a->W16) g->pack_bf16(a->W16 + k0, K, kn, n, nr, NR, chunk + (n - c0) * kn);
                else g->pack(a->W + k0, K, kn, n, nr, NR, chunk + (n - c0) * kn);
            }
            for (int64_t b0 = 0; b0 < blocks; b0 += pass) {
                const int64_t b1 = b0 + pass < blocks ? b0 + pass : blocks;
                for (int64_t b = b0; b < b1; b++) {  /* the blocks to copy: copied once for the chunk's panels */
                    float *const copy = xp + (b - b0) * kn * MR;
                    const float *x;
                    int64_t rs, ks;
                    const int mr = gemm_block_source(a, b, k0, crowded, copy, &x, &rs, &ks);
                    if (x == copy) gemm_pack_rows(a->x + b * MR * K + k0, K, kn, mr, MR, copy);
                }
                for (int64_t n = c0; n < c1; n += NR) {
                    const int nr = c1 - n < NR ? (int)(c1 - n) : NR;
                    for (int64_t b = b0; b < b1; b++) {
                        const float *x;
                        int64_t rs, ks;
                        const int mr = gemm_block_source(a, b, k0, crowded, xp + (b - b0) * kn * MR, &x, &rs, &ks);
                        g->block(x, rs, ks, chunk + (n - c0) * kn, kn, a->y + b * MR * N + n, N, mr, nr, k0 > 0);
                    }
                }
            }
        }
    }
}

/* y[M][N] = x[M][K] @ W[N][K]^T (x, W, y contiguous rows), W float32 rows or W16 bfloat16 ones (the other NULL);
 * workspace: gemm_workspace(g, K, N, nthreads) floats */
static inline void gemm_run(const gemm_kernel *g, const float *x, int64_t M, int64_t K, const float *W,
                            const uint16_t *W16, float *y, int64_t N, float *workspace, int nthreads) {
    gemm_args a = {g, x, M, K, W, W16, y, N, workspace};
    parallel_run(gemm_part, &a, nthreads);
}
