/* Prefill attention over the paged KV cache for x86-64 CPUs (AVX2 + FMA), loaded with ctypes (native.py).
 *
 * paged_prefill_attention: the n query tokens of one sequence's prompt chunk (positions p0 .. p0+n-1, their keys
 * and values already written to the cache) against every key they may see: causal, and within the last `window`
 * positions when window > 0. A chunk that continues a cached prefix reads it in place, like a fresh one.
 *   1. The visible keys are copied once per call out of their blocks into per-KV-head panels (as float32, from a
 *      float32 or a bfloat16 cache, kv_bf16; for dpbf16, kv_bf16 2, as bfloat16 pairs: prefill_attention.h): keys
 *      transposed in
 *      tiles of sixteen ([L/16][D][16]: one tile, 4 KB at D = 64, holds sixteen keys' every dimension, one cache
 *      line a dimension), values as rows ([L][D]). A key block is thus one contiguous read; the plain transpose
 *      [D][L] put a block's D lines L floats apart, 32 KB at 8k keys, all in one L1 set: at 8k-token prompts the
 *      kernel ran at half its short-prompt rate.
 *   2. Work items are GROUPS groups of ROWS query rows (a row: one position's query head) of one KV head, latest
 *      positions first (they see the most keys). An item walks its keys KEYS at a time, each block of keys read
 *      once for all its groups (from cache after the first: long prompts' panels do not fit L2, and reading them
 *      once per group of rows left the kernel waiting on L3), each group with an online softmax: scores as a
 *      ROWS x 16 register block per 16 keys (a broadcast of each row's query value against sixteen keys' values,
 *      per dimension), then the values as a ROWS x 16 block of the output per 16 dimensions (attend_keys_avx2;
 *      where AVX-512 runs, prefill_attention_avx512.c's step: 64 keys and 64 dimensions at a time, 1.1-1.4x the
 *      AVX2 step's rate on a Zen 4).
 *   3. The softmax works in base 2: a group's queries are copied once, times scale * log2(e), so a score is
 *      already the exponent of 2 its weight needs (no multiply a score), and 2^x for x <= 0 is a clamp, a round
 *      and a degree-6 polynomial, masked keys (-inf) giving exactly 0 with no separate mask pass. Before this,
 *      the softmax (scale, max, exp, mask) took ~25% of the kernel's time at 8k-token prompts.
 *   4. Sink logits (gpt-oss's; sinks NULL: none): each head's learned logit joins the softmax of its rows as one
 *      more score with no value, added to the denominator at the end (sink_scale), once each row's max is known.
 * torch's CPU flash attention runs these head_dim-64 shapes at ~70 GFLOP/s on two cores; this at 2-2.3 times that. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "online_softmax.h"
#include "prefill_attention.h"
#include "simd.h"
#include "thread_pool.h"

/* See decode_attention.c's: what a row's running output is multiplied by, the sink logit s (base 2) joining */
static inline float sink_scale(float m, float l, float s) {
    const float top = m > s ? m : s;
    if (top == -INFINITY) return 0.f;
    const float keys = exp2f(m - top), sum = l * keys + exp2f(s - top);
    return sum > 0.f ? keys / sum : 0.f;
}

/* keys and values lo .. p0+n-1 out of their blocks into the panels; the padding up to L as zeros */
static void pack_part(void *args, int t, int T) {
    const prefill_args *a = args;
    const int64_t D = a->D, KVH = a->KVH, L = a->L, ctx = a->p0 + a->n, row = KVH * D;
    int64_t j0, j1;
    split_range(L, t, T, 16, &j0, &j1);
    if (a->kv_bf16 == 2) {   /* bfloat16 pairs for dpbf16 (prefill_attention.h), the cache's bits unchanged */
        for (int64_t j = j0; j < j1; j += 2) {   /* j0 a multiple of 16, j1 too or L: whole key pairs */
            int64_t at[2];
            for (int i = 0; i < 2; i++) {
                const int64_t pos = a->lo + j + i;
                at[i] = pos < ctx ? (a->table[pos / a->bs] * a->bs + pos % a->bs) * row : -1;
            }
            for (int64_t kh = 0; kh < KVH; kh++) {
                const uint16_t *ks[2], *vs[2];
                for (int i = 0; i < 2; i++) {
                    ks[i] = at[i] < 0 ? NULL : (const uint16_t *)a->key_cache + at[i] + kh * D;
                    vs[i] = at[i] < 0 ? NULL : (const uint16_t *)a->value_cache + at[i] + kh * D;
                }
                pack_key_value_pairs(ks, vs, D, (uint32_t *)(a->kt + kh * D * L + j / 16 * D * 16) + j % 16,
                                     (uint32_t *)(a->v + kh * L * D + j / 2 * D));
            }
        }
        return;
    }
    for (int64_t j = j0; j < j1; j++) {
        const int64_t pos = a->lo + j;
        for (int64_t kh = 0; kh < KVH; kh++) {
            float *kt = a->kt + kh * D * L + j / 16 * D * 16 + j % 16, *v = a->v + (kh * L + j) * D;
            if (pos < ctx) {
                const int64_t at = (a->table[pos / a->bs] * a->bs + pos % a->bs) * row + kh * D;
                if (a->kv_bf16) {
                    const uint16_t *ks = (const uint16_t *)a->key_cache + at;
                    const uint16_t *vs = (const uint16_t *)a->value_cache + at;
                    for (int64_t d = 0; d < D; d++) {
                        kt[d * 16] = bf16_to_float(ks[d]);
                        v[d] = bf16_to_float(vs[d]);
                    }
                } else {
                    const float *ks = (const float *)a->key_cache + at, *vs = (const float *)a->value_cache + at;
                    for (int64_t d = 0; d < D; d++) kt[d * 16] = ks[d];
                    memcpy(v, vs, sizeof(float) * D);
                }
            } else {
                for (int64_t d = 0; d < D; d++) kt[d * 16] = 0.f;
                memset(v, 0, sizeof(float) * D);
            }
        }
    }
}

/* acc[r] += a[r][i] * (b0, b1) for every row r: one column of a times one row of b, sixteen wide */
static inline void add_outer_product(__m256 acc[ROWS][2], const float *const a[ROWS], int64_t i, __m256 b0,
                                     __m256 b1) {
    for (int r = 0; r < ROWS; r++) {
        const __m256 ar = _mm256_broadcast_ss(a[r] + i);
        acc[r][0] = _mm256_fmadd_ps(ar, b0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(ar, b1, acc[r][1]);
    }
}

/* attend_fn (prefill_attention.h) with AVX2 vectors: 16 keys, then 16 dimensions, of ROWS rows at a time */
static void attend_keys_avx2(const prefill_args *a, row_group *rg, int64_t kb, int64_t nk, const float *kt,
                             const float *vv) {
    const int64_t D = a->D;
    float s[ROWS][KEYS] __attribute__((aligned(32)));
    const float *weights[ROWS];                         /* the rows of s, once the softmax has run */
    for (int r = 0; r < ROWS; r++) weights[r] = s[r];
    for (int64_t c = 0; c < nk; c += 16) {           /* scores of 16 keys for all rows */
        __m256 acc[ROWS][2];
        for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        const float *tile = kt + c * D;              /* keys kb+c .. kb+c+15: [D][16], contiguous */
        for (int64_t d = 0; d < D; d++)
            add_outer_product(acc, rg->q, d, _mm256_loadu_ps(tile + d * 16), _mm256_loadu_ps(tile + d * 16 + 8));
        for (int r = 0; r < ROWS; r++) {
            _mm256_store_ps(s[r] + c, acc[r][0]);
            _mm256_store_ps(s[r] + c + 8, acc[r][1]);
        }
    }
    const int masked = block_is_masked(a, rg, kb, nk);
    for (int r = 0; r < ROWS; r++) {                 /* mask, then the online softmax of each row */
        if (masked) mask_scores(a, rg, r, kb, nk, s[r]);
        online_softmax_step(s[r], nk, &rg->m[r], &rg->l[r], rg->o[r], D);
    }
    for (int64_t d = 0; d < D; d += 16) {            /* the values, 16 dimensions of all rows at a time */
        __m256 acc[ROWS][2];
        for (int r = 0; r < ROWS; r++) {
            acc[r][0] = _mm256_load_ps(rg->o[r] + d);
            acc[r][1] = _mm256_load_ps(rg->o[r] + d + 8);
        }
        for (int64_t j = 0; j < nk; j++)
            add_outer_product(acc, weights, j, _mm256_loadu_ps(vv + j * D + d), _mm256_loadu_ps(vv + j * D + d + 8));
        for (int r = 0; r < ROWS; r++) {
            _mm256_store_ps(rg->o[r] + d, acc[r][0]);
            _mm256_store_ps(rg->o[r] + d + 8, acc[r][1]);
        }
    }
}

static void prefill_part(void *args, int part, int parts) {
    prefill_args *a = args;
    const int64_t D = a->D, L = a->L, G = a->H / a->KVH, lo = a->lo, window = a->window, rows = a->n * G;
    const int64_t items = a->tiles_per_head * a->KVH;
    const float scale_log2e = a->scale * 1.44269504088896341f;
    row_group groups[GROUPS];
    (void)part; (void)parts;
    for (;;) {
        const int64_t item = __atomic_fetch_add(&a->next, 1, __ATOMIC_RELAXED);
        if (item >= items) break;
        const int64_t kh = item % a->KVH, tile = a->tiles_per_head - 1 - item / a->KVH;
        int ng = 0;
        for (int gi = 0; gi < GROUPS && (tile * GROUPS + gi) * ROWS < rows; gi++, ng++) {
            row_group *rg = &groups[gi];
            rg->nr = 0;
            for (int r = 0; r < ROWS; r++) {    /* rows past the chunk repeat its last row, unwritten */
                int64_t g = (tile * GROUPS + gi) * ROWS + r;
                if (g < rows) rg->nr = r + 1;
                else g = rows - 1;
                const int64_t i = g / G, h = kh * G + g % G;
                const float *q = a->q + i * a->q_stride + h * D;
                for (int64_t d = 0; d < D; d++) rg->qs[r][d] = q[d] * scale_log2e;
                rg->q[r] = rg->qs[r];
                rg->out[r] = a->out + (i * a->H + h) * D;
                rg->pos[r] = a->p0 + i;
                rg->sink[r] = a->sinks ? a->sinks[h] * 1.44269504088896341f : -INFINITY;
                rg->m[r] = -INFINITY;
                rg->l[r] = 0.f;
                memset(rg->o[r], 0, sizeof(float) * D);
            }
        }
        const int64_t first_pos = groups[0].pos[0], last_pos = groups[ng - 1].pos[groups[ng - 1].nr - 1];
        int64_t kfirst = window > 0 && first_pos - window + 1 > lo ? first_pos - window + 1 : lo;
        kfirst = lo + (kfirst - lo) / 16 * 16;
        for (int64_t kb = kfirst; kb <= last_pos; kb += KEYS) {  /* each key block once for every group */
            const int64_t nk = (kb + KEYS <= last_pos + 1 ? KEYS : (last_pos + 1 - kb + 15) / 16 * 16);
            const float *kt = a->kt + kh * D * L + (kb - lo) * D;
            const float *vv = a->v + kh * L * D + (a->kv_bf16 == 2 ? (kb - lo) / 2 : kb - lo) * D;
            for (int gi = 0; gi < ng; gi++) {
                row_group *rg = &groups[gi];
                const int64_t glast = rg->pos[rg->nr - 1];
                if (kb > glast || (window > 0 && kb + nk - 1 <= rg->pos[0] - window)) continue;  /* all masked */
                a->attend(a, rg, kb, nk, kt, vv);
            }
        }
        for (int gi = 0; gi < ng; gi++)
            for (int r = 0; r < groups[gi].nr; r++) {
                const float inv = sink_scale(groups[gi].m[r], groups[gi].l[r], groups[gi].sink[r]);
                for (int64_t d = 0; d < D; d++) groups[gi].out[r][d] = groups[gi].o[r][d] * inv;
            }
    }
}

/* the first position a chunk starting at p0 sees (its first query's window), and how many keys it packs from there */
static int64_t first_key(int64_t p0, int64_t window) {
    return window > 0 && p0 - window + 1 > 0 ? p0 - window + 1 : 0;
}

static int64_t packed_keys(int64_t n, int64_t p0, int64_t window) {
    return (p0 + n - first_key(p0, window) + 15) / 16 * 16;
}

/* floats of workspace paged_prefill_attention needs (its arguments of the same names) */
int64_t prefill_attention_workspace(int64_t n, int64_t p0, int64_t window, int64_t KVH, int64_t D) {
    return 2 * KVH * D * packed_keys(n, p0, window);
}

/* q: the chunk's n queries, [n][H][D] (rows q_stride floats apart); out [n][H][D]; key_cache, value_cache
 * [num_blocks][bs][KVH][D] (float32 for kv_bf16 0, else bfloat16: 1 widened to float32, 2 through dpbf16 with the
 * queries and weights rounded to bfloat16, where the caller has checked the CPU has AVX512_BF16) holding positions
 * 0 .. p0+n-1 (this chunk's too)
 * through `table`; D a multiple of 16
 * up to MAX_D; window 0 for none; sinks [H] (or NULL): each head's sink logit (4. above); workspace of
 * prefill_attention_workspace(n, p0, window, KVH, D) floats;
 * avx512: the inner step of prefill_attention_avx512.c (only where native.cpu_has_avx512 says so), else AVX2's */
void paged_prefill_attention(const float *q, int64_t q_stride, const void *key_cache, const void *value_cache,
                             int kv_bf16, const int64_t *table, int64_t n, int64_t p0, int64_t H, int64_t KVH,
                             int64_t D, int64_t bs, int64_t window, float scale, const float *sinks, float *out,
                             float *workspace, int avx512, int nthreads) {
    const int64_t lo = first_key(p0, window), L = packed_keys(n, p0, window);
    prefill_args a = {q, q_stride, key_cache, value_cache, kv_bf16, table, n, p0, H, KVH, D, bs, window, lo, L, scale,
                      sinks, out, workspace, workspace + KVH * D * L, (n * (H / KVH) + ROWS * GROUPS - 1) / (ROWS * GROUPS), 0,
                      kv_bf16 == 2 ? attend_keys_pairs : avx512 ? attend_keys_avx512 : attend_keys_avx2};
    parallel_run(pack_part, &a, nthreads);
    parallel_run(prefill_part, &a, nthreads);
}
