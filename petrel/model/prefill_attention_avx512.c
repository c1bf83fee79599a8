/* Prefill attention's inner step with AVX-512 vectors (prefill_attention.c has the packing, the work items and the
 * AVX2 step; prefill_attention.h what they share). Built with the other kernels (-mavx2): the functions here carry
 * their own target, and paged_prefill_attention_avx512 is called only where native.cpu_has_avx512 says so.
 *
 * A key tile ([D][16]: sixteen keys' values of one dimension in a cache line) is one vector, so a step of scores
 * keeps ROWS x 4 vectors (64 keys) in registers: per dimension four loads and ROWS broadcasts feed 4 * ROWS fused
 * multiply-adds (the AVX2 step: two loads and ROWS broadcasts for 2 * ROWS, of half the width). The values run the
 * same way, 64 output dimensions of ROWS rows per pass over the weights. The softmax is prefill_attention.c's, base
 * 2 and masked keys weighing exactly 0, sixteen wide. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "prefill_attention.h"

#define TARGET __attribute__((target("avx512f")))
#define INLINE TARGET __attribute__((always_inline)) static inline

/* 2^x for x <= 0 (simd.h's exp2_nonpositive, sixteen wide): x <= -127 (and -inf) gives exactly 0 */
INLINE __m512 exp2_nonpositive16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-127.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), r = _mm512_sub_ps(x, n);
    __m512 y = _mm512_set1_ps(1.5353361959569156e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3398875016719103e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(9.61843691766262e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.5503323674201965e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(2.4022647738456726e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(6.931471824645996e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

/* online_softmax.h's step, sixteen wide: n scores p (a multiple of 16) become their weights, *m and *l move on,
 * and the running output acc [D] is rescaled to the new max */
INLINE void online_softmax_step16(float *p, int64_t n, float *m, float *l, float *acc, int64_t D) {
    __m512 vmax = _mm512_loadu_ps(p);
    for (int64_t j = 16; j < n; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(p + j));
    const float block_max = _mm512_reduce_max_ps(vmax), mx = block_max > *m ? block_max : *m;
    if (mx == -INFINITY) {                           /* nothing visible yet: no weight */
        memset(p, 0, sizeof(float) * n);
        return;
    }
    const float corr = exp2f(*m - mx);               /* 0 on the first scores (m = -inf) */
    const __m512 vmx = _mm512_set1_ps(mx);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __m512 e = exp2_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(p + j), vmx));
        _mm512_storeu_ps(p + j, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    *l = *l * corr + _mm512_reduce_add_ps(vsum);
    *m = mx;
    if (corr != 1.f) {
        const __m512 c = _mm512_set1_ps(corr);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(c, _mm512_loadu_ps(acc + d)));
    }
}

/* the rows' scores s[r][0 .. nk) against keys kb .. masked, then their weights: one online-softmax step a row */
INLINE void weigh_scores(const prefill_args *a, row_group *rg, int64_t kb, int64_t nk, float s[ROWS][KEYS]) {
    const int masked = block_is_masked(a, rg, kb, nk);
    for (int r = 0; r < ROWS; r++) {
        if (masked) mask_scores(a, rg, r, kb, nk, s[r]);
        online_softmax_step16(s[r], nk, &rg->m[r], &rg->l[r], rg->o[r], a->D);
    }
}

/* s[r][c .. c+16*NV) = the ROWS queries' scores against NV tiles of keys (tiles: NV x [D][16], one after another) */
INLINE void score_tiles(const row_group *rg, const float *tiles, int64_t D, float s[ROWS][KEYS], int64_t c,
                        const int NV) {
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m512 k[4];
        for (int v = 0; v < NV; v++) k[v] = _mm512_loadu_ps(tiles + v * 16 * D + d * 16);
        for (int r = 0; r < ROWS; r++) {
            const __m512 q = _mm512_set1_ps(rg->qs[r][d]);
            for (int v = 0; v < NV; v++) acc[r][v] = _mm512_fmadd_ps(q, k[v], acc[r][v]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(s[r] + c + 16 * v, acc[r][v]);
}

/* o[r][d .. d+16*NV) += the weights s[r][0 .. nk) times the value rows' same dimensions, for the ROWS rows */
INLINE void add_weighted_values(row_group *rg, const float s[ROWS][KEYS], const float *vv, int64_t nk, int64_t D,
                                int64_t d, const int NV) {
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = _mm512_loadu_ps(rg->o[r] + d + 16 * v);
    for (int64_t j = 0; j < nk; j++) {
        __m512 x[4];
        for (int v = 0; v < NV; v++) x[v] = _mm512_loadu_ps(vv + j * D + d + 16 * v);
        for (int r = 0; r < ROWS; r++) {
            const __m512 w = _mm512_set1_ps(s[r][j]);
            for (int v = 0; v < NV; v++) acc[r][v] = _mm512_fmadd_ps(w, x[v], acc[r][v]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(rg->o[r] + d + 16 * v, acc[r][v]);
}

/* attend_fn (prefill_attention.h): 64 keys, then 64 dimensions, of ROWS rows at a time (16 for the tails) */
TARGET void attend_keys_avx512(const prefill_args *a, row_group *rg, int64_t kb, int64_t nk, const float *kt,
                               const float *vv) {
    const int64_t D = a->D;
    float s[ROWS][KEYS] __attribute__((aligned(64)));
    int64_t c = 0;
    for (; c + 64 <= nk; c += 64) score_tiles(rg, kt + c * D, D, s, c, 4);
    for (; c < nk; c += 16) score_tiles(rg, kt + c * D, D, s, c, 1);
    weigh_scores(a, rg, kb, nk, s);
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) add_weighted_values(rg, s, vv, nk, D, d, 4);
    for (; d < D; d += 16) add_weighted_values(rg, s, vv, nk, D, d, 1);
}

#define PAIRS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define PAIRS_INLINE PAIRS_TARGET __attribute__((always_inline)) static inline

/* score_tiles for the pairs' key tiles (NV x [D/2][16] pairs) and the rows' queries as pairs qp[r][D/2] */
PAIRS_INLINE void score_pair_tiles(const uint32_t qp[ROWS][MAX_D / 2], const uint32_t *tiles, int64_t D,
                                   float s[ROWS][KEYS], int64_t c, const int NV) {
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t e = 0; e < D / 2; e++) {
        __m512bh k[4];
        for (int v = 0; v < NV; v++) k[v] = (__m512bh)_mm512_loadu_si512(tiles + v * 16 * D + e * 16);
        for (int r = 0; r < ROWS; r++) {
            const __m512bh q = (__m512bh)_mm512_set1_epi32((int)qp[r][e]);
            for (int v = 0; v < NV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], k[v], q);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(s[r] + c + 16 * v, acc[r][v]);
}

/* add_weighted_values for value pairs vv [nk/2][D] and the rows' weights as pairs wp[r][nk/2] */
PAIRS_INLINE void add_weighted_pairs(row_group *rg, const uint32_t wp[ROWS][KEYS / 2], const uint32_t *vv,
                                     int64_t nk, int64_t D, int64_t d, const int NV) {
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = _mm512_loadu_ps(rg->o[r] + d + 16 * v);
    for (int64_t j = 0; j < nk / 2; j++) {
        __m512bh x[4];
        for (int v = 0; v < NV; v++) x[v] = (__m512bh)_mm512_loadu_si512(vv + j * D + d + 16 * v);
        for (int r = 0; r < ROWS; r++) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)wp[r][j]);
            for (int v = 0; v < NV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], x[v], w);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(rg->o[r] + d + 16 * v, acc[r][v]);
}

/* n floats (a multiple of 16) as bfloat16, rounded to nearest even: n / 2 pairs */
PAIRS_INLINE void round_pairs(const float *x, int64_t n, uint32_t *out) {
    for (int64_t i = 0; i < n; i += 16)
        _mm256_storeu_si256((__m256i *)(out + i / 2), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
}

/* see prefill_attention.h: key words copied to their lanes, value rows interleaved 32 dimensions at a time */
PAIRS_TARGET void pack_key_value_pairs(const uint16_t *const ks[2], const uint16_t *const vs[2], int64_t D,
                                       uint32_t *kt, uint32_t *v) {
    for (int i = 0; i < 2; i++) {
        const uint32_t *k = (const uint32_t *)ks[i];
        for (int64_t e = 0; e < D / 2; e++) kt[16 * e + i] = k ? k[e] : 0;
    }
    static const uint16_t low[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i lo = _mm512_loadu_si512(low), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t d = 0; d < D; d += 32) {   /* D a multiple of 16: the last 16 dimensions alone where it is odd */
        const int whole = D - d >= 32;
        const __mmask32 m = whole ? 0xFFFFFFFFu : 0xFFFFu;
        const __m512i r0 = vs[0] ? _mm512_maskz_loadu_epi16(m, vs[0] + d) : _mm512_setzero_si512();
        const __m512i r1 = vs[1] ? _mm512_maskz_loadu_epi16(m, vs[1] + d) : _mm512_setzero_si512();
        _mm512_storeu_si512(v + d, _mm512_permutex2var_epi16(r0, lo, r1));
        if (whole) _mm512_storeu_si512(v + d + 16, _mm512_permutex2var_epi16(r0, hi, r1));
    }
}

/* attend_fn for kv_bf16 2 (prefill_attention.h): attend_keys_avx512's steps, two products a dpbf16 */
PAIRS_TARGET void attend_keys_pairs(const prefill_args *a, row_group *rg, int64_t kb, int64_t nk, const float *kt,
                                    const float *vv) {
    const int64_t D = a->D;
    float s[ROWS][KEYS] __attribute__((aligned(64)));
    uint32_t qp[ROWS][MAX_D / 2] __attribute__((aligned(64))), wp[ROWS][KEYS / 2] __attribute__((aligned(64)));
    for (int r = 0; r < ROWS; r++) round_pairs(rg->qs[r], D, qp[r]);
    const uint32_t *tiles = (const uint32_t *)kt, *values = (const uint32_t *)vv;
    int64_t c = 0;
    for (; c + 64 <= nk; c += 64) score_pair_tiles(qp, tiles + c * D, D, s, c, 4);
    for (; c < nk; c += 16) score_pair_tiles(qp, tiles + c * D, D, s, c, 1);
    weigh_scores(a, rg, kb, nk, s);
    for (int r = 0; r < ROWS; r++) round_pairs(s[r], nk, wp[r]);
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) add_weighted_pairs(rg, wp, values, nk, D, d, 4);
    for (; d < D; d += 16) add_weighted_pairs(rg, wp, values, nk, D, d, 1);
}
