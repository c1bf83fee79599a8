/* Decode attention over the paged KV cache for x86-64 CPUs (AVX2 + FMA), loaded with ctypes (native.py).
 *
 * paged_decode_attention: one query token per sequence against its context, the blocks read in place (no gather
 * into a contiguous copy). Reading the keys and values bounds it, so the work is laid out for that:
 *   1. A work item is a sequence's context with every KV head (each block's keys, then its values, one contiguous
 *      read); with fewer sequences than ITEMS_PER_THREAD a thread, a part of that context (split-K, as in
 *      flash-decoding): each part keeps its own running softmax, merged into the output at the end. Contexts too
 *      short to split (under 2 x MIN_PART_KEYS) are shared out by KV head instead. Splitting few long contexts by
 *      KV head (each item reading a third of each token's lines, 768 bytes apart) ran 1.4-1.8x slower than
 *      splitting them into parts on an AVX2 EPYC (4 x 7,936 keys: 5.0 -> 3.2 ms a layer).
 *   2. An item walks its blocks a span (SPAN keys: whole blocks, one block when blocks are bigger) at a time, and
 *      prefetches the next span's lines into L2 a couple at a time while it works on this one: issued all at once
 *      they stall the core, and the hardware prefetcher cannot guess where the next scattered block lies. Spans
 *      of 128 keys, or prefetching two spans ahead, measured slower or no faster.
 *   3. Per KV head and span: the scores of its query heads (eight keys at a time per head, reduced together), one
 *      online-softmax step per query head, in base 2 (the queries copied once times scale * log2 e, so that a
 *      score is the exponent its weight needs), then the values, each value row loaded once for up to three query
 *      heads. With the keys and values in cache this runs ~1.6x the rate of the kernel before it (one value row
 *      load per query head, 2^x by way of e^x), which leaves the memory more of each step's time.
 *   4. Sink logits (gpt-oss's; sinks NULL: none): a head's learned logit joins its softmax as one more score with
 *      no value, added to the denominator once the running max is known (sink_scale), or in the merge of the parts.
 *   5. The caches hold float32 or bfloat16 (kv_bf16: half the bytes to read; each value widened exactly as it is
 *      loaded, or, kind 2, multiplied as it is by AVX512_BF16's dpbf16). One body serves every kind: the functions
 *      below take the kind as a constant (always inlined), so each kind gets its own loops. Kind 3 is a float32
 *      cache through AVX-512F's loops (sixteen keys a pass, sixteen dimensions a vector), where the caller's avx512
 *      allows. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_pairs.h"
#include "kernels.h"
#include "online_softmax.h"
#include "simd.h"
#include "thread_pool.h"

#define MAX_HD 16384          /* query heads x head_dim of one sequence (the running sums of a work item) */
#define MAX_G 64              /* query heads per KV head */
#define MAX_BS 256
#define SPAN 16               /* keys one softmax step covers (whole blocks; one block when blocks are bigger) */
#define SPAN_BLOCKS SPAN      /* the most blocks of a span (blocks of one token) */
#define MAX_SPAN (SPAN > MAX_BS ? SPAN : MAX_BS)  /* the most keys of a span */
#define ITEMS_PER_THREAD 4    /* work items wanted a thread */
#define MIN_PART_KEYS 256     /* the fewest keys of a part of a context */

#define INLINE static inline __attribute__((always_inline))
#define LOG2E 1.44269504088896341f

/* What a running softmax's unnormalized output (max m and sum l of its weights, base 2) is multiplied by to be the
 * attention's output when a sink logit s (base 2; -inf: none) joins the softmax: 2^(m - M) / (l 2^(m - M) + 2^(s -
 * M)), M the larger of m and s; 0 where nothing is visible and no sink either */
static inline float sink_scale(float m, float l, float s) {
    const float top = m > s ? m : s;
    if (top == -INFINITY) return 0.f;
    const float keys = exp2f(m - top), sum = l * keys + exp2f(s - top);
    return sum > 0.f ? keys / sum : 0.f;
}

/* where element i of a cache holding float32, or (bf16) bfloat16, values lies */
INLINE const char *kv_at(const void *base, int64_t i, const int bf16) {
    return (const char *)base + i * (bf16 ? 2 : 4);
}

/* eight values of a cache from p, as floats */
INLINE __m256 kv_load8(const char *p, const int bf16) {
    return bf16 ? bf16_load8((const uint16_t *)p) : _mm256_loadu_ps((const float *)p);
}

/* The lines of the next span's blocks, brought into L2 a few at a time: block i's keys and values from k[i] and
 * v[i], `tokens` rows `stride` bytes apart, `lines` cache lines of each (the item's KV heads) */
typedef struct {
    const char *k[SPAN_BLOCKS], *v[SPAN_BLOCKS];
    int64_t blocks, tokens, stride, lines, i, t, c, issued;
} span_prefetch;

static inline void prefetch_lines(span_prefetch *p, int lines) {
    for (int n = 0; n < lines && p->i < p->blocks; n++, p->issued++) {
        const int64_t off = p->t * p->stride + 64 * p->c;
        _mm_prefetch(p->k[p->i] + off, _MM_HINT_T1);
        _mm_prefetch(p->v[p->i] + off, _MM_HINT_T1);
        if (++p->c == p->lines) {
            p->c = 0;
            if (++p->t == p->tokens) { p->t = 0; p->i++; }
        }
    }
}

typedef struct {
    const float *q; int64_t q_stride; const void *key_cache, *value_cache; int kv_bf16;
    const int64_t *tables; int64_t max_blocks;
    const int64_t *context_lens; int64_t H, KVH, D, bs, window; float scale; const float *sinks; float *out;
    int64_t heads, parts, items;  /* work items: a sequence's context in `parts` parts x its KV heads `heads` at a
                                   * time (all of them, or one) */
    float *partial;         /* parts > 1: [S][parts][H][D + 2], each part's unnormalized output, its max and its sum */
    int64_t next;           /* the first work item no thread has taken */
} decode_args;

/* one span's blocks: where each one's keys and values start (at KV head 0) and which of its tokens are seen */
typedef struct {
    const char *k[SPAN_BLOCKS], *v[SPAN_BLOCKS];
    int64_t t0[SPAN_BLOCKS], t1[SPAN_BLOCKS], n;
} span_blocks;

/* The scores of G query heads (qs, pre-scaled, D apart) against tokens t0..t1 of one block (kb: token 0's keys of
 * this KV head, rows `row` values apart), into p[g * MAX_SPAN + j ..] */
INLINE void block_scores(const float *qs, int64_t G, int64_t D, const char *kb, int64_t row, int64_t t0, int64_t t1,
                         float *p, int64_t j, span_prefetch *pf, const int bf16) {
    for (int64_t g = 0; g < G; g++) {
        const float *qg = qs + g * D;
        float *pg = p + g * MAX_SPAN + j - t0;
        int64_t t = t0;
        for (; t + 8 <= t1; t += 8) {     /* eight keys at once: eight sums reduced together */
            prefetch_lines(pf, 2);
            __m256 a[8];
            for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qg + d);
                for (int i = 0; i < 8; i++)
                    a[i] = _mm256_fmadd_ps(qv, kv_load8(kv_at(kb, (t + i) * row + d, bf16), bf16), a[i]);
            }
            const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
            const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
            _mm256_storeu_ps(pg + t, _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                                   _mm256_permute2f128_ps(s0123, s4567, 0x31)));
        }
        for (; t < t1; t++) {
            __m256 a0 = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), kv_load8(kv_at(kb, t * row + d, bf16), bf16), a0);
            pg[t] = hsum(a0);
        }
    }
}

/* acc[g][d0 .. d0+8*NV) += sum over the span's tokens of p[g][j] * value row, for GN (<= 3) query heads at once:
 * each value row's NV vectors loaded once for all of them */
INLINE void span_values_part(const span_blocks *sb, int64_t kh, int64_t D, int64_t row, const float *p, float *acc,
                             int64_t d0, const int GN, const int NV, span_prefetch *pf, const int bf16) {
    __m256 a[3][4];
    for (int g = 0; g < GN; g++)
        for (int i = 0; i < NV; i++) a[g][i] = _mm256_loadu_ps(acc + g * D + d0 + 8 * i);
    int64_t j = 0;
    for (int64_t b = 0; b < sb->n; b++) {
        const char *vb = kv_at(sb->v[b], kh * D + d0, bf16);
        for (int64_t u = sb->t0[b]; u < sb->t1[b]; u++, j++) {
            prefetch_lines(pf, 2);
            __m256 w[3];   /* the weights, then one value vector at a time: 12 sums + 3 + 1 fit AVX2's 16 registers */
            for (int g = 0; g < GN; g++) w[g] = _mm256_broadcast_ss(p + g * MAX_SPAN + j);
            for (int i = 0; i < NV; i++) {
                const __m256 v = kv_load8(kv_at(vb, u * row + 8 * i, bf16), bf16);
                for (int g = 0; g < GN; g++) a[g][i] = _mm256_fmadd_ps(w[g], v, a[g][i]);
            }
        }
    }
    for (int g = 0; g < GN; g++)
        for (int i = 0; i < NV; i++) _mm256_storeu_ps(acc + g * D + d0 + 8 * i, a[g][i]);
}

/* the span's values into the running outputs acc [G][D] of KV head kh's query heads, weights p [G][MAX_SPAN] */
INLINE void span_values(const span_blocks *sb, int64_t kh, int64_t G, int64_t D, int64_t row, const float *p,
                        float *acc, span_prefetch *pf, const int bf16) {
    for (int64_t g0 = 0; g0 < G; g0 += 3) {
        const float *pg = p + g0 * MAX_SPAN;
        float *ag = acc + g0 * D;
        const int gn = G - g0 >= 3 ? 3 : (int)(G - g0);
        int64_t d0 = 0;
        for (; d0 + 32 <= D; d0 += 32) {
            if (gn == 3) span_values_part(sb, kh, D, row, pg, ag, d0, 3, 4, pf, bf16);
            else if (gn == 2) span_values_part(sb, kh, D, row, pg, ag, d0, 2, 4, pf, bf16);
            else span_values_part(sb, kh, D, row, pg, ag, d0, 1, 4, pf, bf16);
        }
        if (d0 < D)                        /* the last 8, 16 or 24 dimensions, a query head at a time */
            for (int g = 0; g < gn; g++) {
                const float *pq = pg + g * MAX_SPAN;
                float *aq = ag + g * D;
                if (D - d0 == 8) span_values_part(sb, kh, D, row, pq, aq, d0, 1, 1, pf, bf16);
                else if (D - d0 == 16) span_values_part(sb, kh, D, row, pq, aq, d0, 1, 2, pf, bf16);
                else span_values_part(sb, kh, D, row, pq, aq, d0, 1, 3, pf, bf16);
            }
    }
}

/* A bfloat16 cache through AVX512_BF16's dpbf16 (kv_bf16 2): the scaled queries and the softmax weights are rounded
 * to bfloat16 (nearest even) and multiplied by the cached values as they are, two products an instruction with
 * float32 sums, as the products round x where this kind is chosen (dense_kernels._bf16_cache_kind) and as
 * paged_prefill_attention's kind 2 does. A dpbf16 does 32 of the widening loops' products with no widening. */
#define PAIRS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

/* the span's rows of KV head kh (keys or values: base[b] of each block), the last ones repeated up to a multiple
 * of 16 (read, never stored: the padding lanes are dropped or weigh 0); returns how many are real */
static inline int64_t span_rows(const span_blocks *sb, const char *const *base, int64_t kh, int64_t D, int64_t row,
                                const uint16_t **rows) {
    int64_t n = 0;
    for (int64_t b = 0; b < sb->n; b++)
        for (int64_t u = sb->t0[b]; u < sb->t1[b]; u++) rows[n++] = (const uint16_t *)base[b] + u * row + kh * D;
    for (int64_t j = n; j < (n + 15) / 16 * 16; j++) rows[j] = rows[0];
    return n;
}

/* s[e] = the sum of a[e]'s sixteen lanes for a[] given in the order SCORE_SLOT (a transposing tree: 15 adds, 30
 * shuffles for sixteen sums) */
static const int SCORE_SLOT[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
__attribute__((target("avx512f"))) static inline __m512 sum16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88), _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[i], c[i + 2], 0x44), _mm512_shuffle_ps(c[i], c[i + 2], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}

/* The scores of G query heads (rounded to bfloat16: qb, D apart; D a multiple of 32) against the span's keys of KV
 * head kh, into p[g * MAX_SPAN + j]; returns the span's keys. Sixteen keys a pass, one 16-lane sum each. */
PAIRS_TARGET static int64_t span_scores_pairs(const span_blocks *sb, int64_t kh, int64_t G, int64_t D, int64_t row,
                                              const uint16_t *qb, float *p, span_prefetch *pf) {
    const uint16_t *rows[MAX_SPAN + 16];
    const int64_t n = span_rows(sb, (const char *const *)sb->k, kh, D, row, rows);
    for (int64_t g = 0; g < G; g++)
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
            prefetch_lines(pf, 4);
            __m512 a[16];
            for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 32) {
                const __m512bh h = (__m512bh)_mm512_loadu_si512(qb + g * D + d);
#pragma GCC unroll 16
                for (int i = 0; i < 16; i++) {
                    const __m512bh k = (__m512bh)_mm512_loadu_si512(rows[j0 + i] + d);
                    a[SCORE_SLOT[i]] = _mm512_dpbf16_ps(a[SCORE_SLOT[i]], k, h);
                }
            }
            const __mmask16 keep = lanes16(n - j0);
            _mm512_mask_storeu_ps(p + g * MAX_SPAN + j0, keep, sum16(a));
        }
    return n;
}

/* The span's weights p[g][0 .. n) (n a multiple of 16) rounded to bfloat16 as pairs of consecutive keys', one 32-bit
 * pair each, MAX_SPAN / 2 apart a head, into w */
PAIRS_TARGET static void weight_pairs(const float *p, int64_t G, int64_t n, uint32_t *w) {
    for (int64_t g = 0; g < G; g++)
        for (int64_t j = 0; j < n; j += 16)
            _mm256_storeu_si256((__m256i *)(w + (g * MAX_SPAN + j) / 2),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + g * MAX_SPAN + j)));
}

/* acc [GN][D] (the pairs' order, below) += the span's value rows (rows[0 .. n), n even) weighted by the pairs w,
 * for dimensions d0 .. d0 + 32 NC: two rows' values interleaved into pairs (one unpack each for 32 of them), each
 * pair times GN heads' two weight pairs */
#define VALUE_PAIRS(GN, NC) \
PAIRS_TARGET static void value_pairs_##GN##_##NC(const uint16_t *const *rows, int64_t n, const uint32_t *w, \
                                                 float *acc, int64_t D, int64_t d0, span_prefetch *pf) { \
    __m512 a[GN][2 * NC]; \
    for (int g = 0; g < GN; g++) \
        for (int c = 0; c < 2 * NC; c++) a[g][c] = _mm512_loadu_ps(acc + g * D + d0 + 16 * c); \
    for (int64_t j = 0; j < n; j += 2) { \
        prefetch_lines(pf, 4); \
        __m512i v[2 * NC]; \
        for (int c = 0; c < NC; c++) { \
            const __m512i r0 = _mm512_loadu_si512(rows[j] + d0 + 32 * c); \
            const __m512i r1 = _mm512_loadu_si512(rows[j + 1] + d0 + 32 * c); \
            v[2 * c] = _mm512_unpacklo_epi16(r0, r1); \
            v[2 * c + 1] = _mm512_unpackhi_epi16(r0, r1); \
        } \
        for (int g = 0; g < GN; g++) { \
            const __m512bh h = (__m512bh)_mm512_set1_epi32((int)w[g * (MAX_SPAN / 2) + j / 2]); \
            for (int c = 0; c < 2 * NC; c++) a[g][c] = _mm512_dpbf16_ps(a[g][c], (__m512bh)v[c], h); \
        } \
    } \
    for (int g = 0; g < GN; g++) \
        for (int c = 0; c < 2 * NC; c++) _mm512_storeu_ps(acc + g * D + d0 + 16 * c, a[g][c]); \
}
VALUE_PAIRS(1, 1) VALUE_PAIRS(2, 1) VALUE_PAIRS(3, 1) VALUE_PAIRS(1, 2) VALUE_PAIRS(2, 2) VALUE_PAIRS(3, 2)

/* The span's values of KV head kh into the running outputs acc [G][D] of its query heads (the pairs' order: of each
 * 32 dimensions from d, element 4 L + i holds dimension d + 8 L + i, element 16 + 4 L + i dimension d + 8 L + 4 + i,
 * for lanes L < 4, i < 4; pairs_to_dims puts them back), weights p [G][MAX_SPAN] */
PAIRS_TARGET static void span_values_pairs(const span_blocks *sb, int64_t kh, int64_t G, int64_t D, int64_t row,
                                           const float *p, float *acc, span_prefetch *pf) {
    const uint16_t *rows[MAX_SPAN + 16];
    uint32_t w[MAX_G * MAX_SPAN / 2] __attribute__((aligned(64)));
    const int64_t n = span_rows(sb, (const char *const *)sb->v, kh, D, row, rows), padded = (n + 15) / 16 * 16;
    weight_pairs(p, G, padded, w);
    for (int64_t g0 = 0; g0 < G; g0 += 3) {
        const int gn = G - g0 >= 3 ? 3 : (int)(G - g0);
        const uint32_t *h = w + g0 * (MAX_SPAN / 2);
        float *ag = acc + g0 * D;
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            const int nc = D - d0 >= 64 ? 2 : 1;
            if (gn == 3 && nc == 2) value_pairs_3_2(rows, padded, h, ag, D, d0, pf);
            else if (gn == 2 && nc == 2) value_pairs_2_2(rows, padded, h, ag, D, d0, pf);
            else if (nc == 2) value_pairs_1_2(rows, padded, h, ag, D, d0, pf);
            else if (gn == 3) value_pairs_3_1(rows, padded, h, ag, D, d0, pf);
            else if (gn == 2) value_pairs_2_1(rows, padded, h, ag, D, d0, pf);
            else value_pairs_1_1(rows, padded, h, ag, D, d0, pf);
        }
    }
}

/* acc [D] from the pairs' order into dimensions' order */
static void pairs_to_dims(float *acc, int64_t D) {
    float t[32];
    for (int64_t d = 0; d < D; d += 32) {
        for (int L = 0; L < 4; L++)
            for (int i = 0; i < 4; i++) {
                t[8 * L + i] = acc[d + 4 * L + i];
                t[8 * L + 4 + i] = acc[d + 16 + 4 * L + i];
            }
        memcpy(acc + d, t, sizeof t);
    }
}

/* A float32 cache through AVX-512F (kind 3, where D is a multiple of 16): sixteen keys a pass against one query
 * head, a 16-lane sum each (sum16), and the values sixteen dimensions a vector for up to four query heads at once:
 * half the instructions of the AVX2 loops a key, which on a Zen 5 core left those loops, not the memory, setting
 * the pace at four query heads a KV head (benchmarks/where_time_goes.py decode-attention --heads 16,4: 1.24-1.28x
 * the AVX2 loops; 1.09-1.13x at SmolLM2's 9 over 3). */
#define F32_512_TARGET __attribute__((target("avx512f")))

/* the span's float32 rows of KV head kh (keys or values: base[b] of each block), the last ones repeated up to a
 * multiple of 16 (read, never stored); returns how many are real */
static inline int64_t span_rows_f32(const span_blocks *sb, const char *const *base, int64_t kh, int64_t D,
                                    int64_t row, const float **rows) {
    int64_t n = 0;
    for (int64_t b = 0; b < sb->n; b++)
        for (int64_t u = sb->t0[b]; u < sb->t1[b]; u++) rows[n++] = (const float *)base[b] + u * row + kh * D;
    for (int64_t j = n; j < (n + 15) / 16 * 16; j++) rows[j] = rows[0];
    return n;
}

/* The scores of G query heads (qs, pre-scaled, D apart) against the span's keys of KV head kh, into
 * p[g * MAX_SPAN + j]; returns the span's keys */
F32_512_TARGET static int64_t span_scores_f32(const span_blocks *sb, int64_t kh, int64_t G, int64_t D, int64_t row,
                                              const float *qs, float *p, span_prefetch *pf) {
    const float *rows[MAX_SPAN + 16];
    const int64_t n = span_rows_f32(sb, (const char *const *)sb->k, kh, D, row, rows);
    for (int64_t g = 0; g < G; g++)
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
            prefetch_lines(pf, 8);
            __m512 a[16];
            for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 16) {
                const __m512 q = _mm512_loadu_ps(qs + g * D + d);
#pragma GCC unroll 16
                for (int i = 0; i < 16; i++)
                    a[SCORE_SLOT[i]] = _mm512_fmadd_ps(_mm512_loadu_ps(rows[j0 + i] + d), q, a[SCORE_SLOT[i]]);
            }
            _mm512_mask_storeu_ps(p + g * MAX_SPAN + j0, lanes16(n - j0), sum16(a));
        }
    return n;
}

/* acc[g][d0 .. d0 + 16 NV) += sum over rows j < n of p[g][j] * rows[j][d0 ..], for GN query heads (MAX_SPAN apart
 * in p, D apart in acc): each row's NV vectors loaded once for all of them */
#define VALUES_F32(GN, NV) \
F32_512_TARGET static void values_f32_##GN##_##NV(const float *const *rows, int64_t n, const float *p, float *acc, \
                                                  int64_t D, int64_t d0, span_prefetch *pf) { \
    __m512 a[GN][NV]; \
    for (int g = 0; g < GN; g++) \
        for (int i = 0; i < NV; i++) a[g][i] = _mm512_loadu_ps(acc + g * D + d0 + 16 * i); \
    for (int64_t j = 0; j < n; j++) { \
        prefetch_lines(pf, 2); \
        __m512 v[NV]; \
        for (int i = 0; i < NV; i++) v[i] = _mm512_loadu_ps(rows[j] + d0 + 16 * i); \
        for (int g = 0; g < GN; g++) { \
            const __m512 w = _mm512_set1_ps(p[g * MAX_SPAN + j]); \
            for (int i = 0; i < NV; i++) a[g][i] = _mm512_fmadd_ps(w, v[i], a[g][i]); \
        } \
    } \
    for (int g = 0; g < GN; g++) \
        for (int i = 0; i < NV; i++) _mm512_storeu_ps(acc + g * D + d0 + 16 * i, a[g][i]); \
}
#define VALUES_F32_HEADS(GN) VALUES_F32(GN, 1) VALUES_F32(GN, 2) VALUES_F32(GN, 3) VALUES_F32(GN, 4)
VALUES_F32_HEADS(1) VALUES_F32_HEADS(2) VALUES_F32_HEADS(3) VALUES_F32_HEADS(4)

typedef void (*values_f32_fn)(const float *const *rows, int64_t n, const float *p, float *acc, int64_t D, int64_t d0,
                              span_prefetch *pf);
#define VALUES_F32_ROW(GN) {values_f32_##GN##_1, values_f32_##GN##_2, values_f32_##GN##_3, values_f32_##GN##_4}
static const values_f32_fn VALUES_F32_FNS[4][4] = {VALUES_F32_ROW(1), VALUES_F32_ROW(2), VALUES_F32_ROW(3),
                                                   VALUES_F32_ROW(4)};

/* The span's values of KV head kh into the running outputs acc [G][D] of its query heads, weights p [G][MAX_SPAN]:
 * four query heads and 64 dimensions at a time (16 sums, 4 values and 4 weights of the 32 registers) */
F32_512_TARGET static void span_values_f32(const span_blocks *sb, int64_t kh, int64_t G, int64_t D, int64_t row,
                                           const float *p, float *acc, span_prefetch *pf) {
    const float *rows[MAX_SPAN + 16];
    const int64_t n = span_rows_f32(sb, (const char *const *)sb->v, kh, D, row, rows);
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t gn = G - g0 >= 4 ? 4 : G - g0;
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            const int64_t nv = D - d0 >= 64 ? 4 : (D - d0) / 16;
            VALUES_F32_FNS[gn - 1][nv - 1](rows, n, p + g0 * MAX_SPAN, acc + g0 * D, D, d0, pf);
        }
    }
}

/* blocks b .. b+n-1 of sequence s (of its `len` keys, those from lo on) into sb */
INLINE void gather_span(const decode_args *a, int64_t s, int64_t b, int64_t n, int64_t lo, int64_t len,
                        span_blocks *sb, const int bf16) {
    const int64_t bs = a->bs, row = a->KVH * a->D;
    sb->n = n;
    for (int64_t i = 0; i < n; i++) {
        const int64_t block = a->tables[s * a->max_blocks + b + i], first = (b + i) * bs;
        sb->k[i] = kv_at(a->key_cache, block * bs * row, bf16);
        sb->v[i] = kv_at(a->value_cache, block * bs * row, bf16);
        sb->t0[i] = first < lo ? lo - first : 0;
        sb->t1[i] = first + bs <= len ? bs : len - first;
    }
}

/* work item (s, part, KV heads kh0 ..): that part of its blocks' keys and values against those heads' queries;
 * kind: a->kv_bf16 (0 float32, 1 bfloat16 widened, 2 bfloat16 through dpbf16, 3 float32 through AVX-512F), as a
 * constant */
INLINE void decode_item(decode_args *a, int64_t item, const int kind) {
    const int bf16 = kind == 1 || kind == 2;
    const int64_t H = a->H, KVH = a->KVH, D = a->D, bs = a->bs, G = H / KVH, row = KVH * D;
    const int64_t groups = KVH / a->heads, kh0 = item % groups * a->heads, nkh = a->heads, h0 = kh0 * G;
    const int64_t s = item / groups / a->parts, part = item / groups % a->parts, len = a->context_lens[s];
    const int64_t lo = a->window > 0 && len > a->window ? len - a->window : 0;
    const int64_t first = lo / bs, blocks = (len + bs - 1) / bs - first, per = (blocks + a->parts - 1) / a->parts;
    const int64_t b0 = first + part * per, b1 = b0 + per < first + blocks ? b0 + per : first + blocks;
    const int64_t span = SPAN / bs > 1 ? SPAN / bs : 1;
    const float scale_log2e = a->scale * 1.44269504088896341f;
    float qs[MAX_HD] __attribute__((aligned(32))), acc[MAX_HD], m[MAX_HD / 8], l[MAX_HD / 8];
    float p[MAX_G * MAX_SPAN] __attribute__((aligned(32)));
    span_blocks sb;
    const int64_t esize = bf16 ? 2 : 4;
    span_prefetch pf = {.tokens = bs, .stride = row * esize, .lines = (nkh * D * esize + 63) / 64};
    const float *q = a->q + s * a->q_stride + h0 * D;
    for (int64_t i = 0; i < nkh * G * D; i++) { qs[i] = q[i] * scale_log2e; acc[i] = 0.f; }
    for (int64_t h = 0; h < nkh * G; h++) { m[h] = -INFINITY; l[h] = 0.f; }
    uint16_t qb[kind == 2 ? MAX_HD : 1] __attribute__((aligned(64)));
    if (kind == 2) round_to_bf16(qs, nkh * G * D, qb);   /* as products round x, and the weights below */
    for (int64_t b = b0; b < b1; b += span) {
        const int64_t n = b + span <= b1 ? span : b1 - b, next = b + n + span <= b1 ? span : b1 - b - n;
        gather_span(a, s, b, n, lo, len, &sb, bf16);
        pf.blocks = next; pf.i = pf.t = pf.c = pf.issued = 0;
        for (int64_t i = 0; i < next; i++) {
            const int64_t block = a->tables[s * a->max_blocks + b + n + i];
            pf.k[i] = kv_at(a->key_cache, block * bs * row + kh0 * D, bf16);
            pf.v[i] = kv_at(a->value_cache, block * bs * row + kh0 * D, bf16);
        }
        for (int64_t kh = kh0; kh < kh0 + nkh; kh++) {
            const int64_t i0 = (kh - kh0) * G;           /* the item's first query head of this KV head */
            int64_t keys = 0;
            if (kind == 2) keys = span_scores_pairs(&sb, kh, G, D, row, qb + i0 * D, p, &pf);
            else if (kind == 3) keys = span_scores_f32(&sb, kh, G, D, row, qs + i0 * D, p, &pf);
            else
                for (int64_t i = 0; i < sb.n; i++) {
                    block_scores(qs + i0 * D, G, D, kv_at(sb.k[i], kh * D, bf16), row, sb.t0[i], sb.t1[i], p, keys,
                                 &pf, bf16);
                    keys += sb.t1[i] - sb.t0[i];
                }
            const int64_t padded = (keys + 15) / 16 * 16;
            for (int64_t g = 0; g < G; g++) {
                for (int64_t j = keys; j < padded; j++) p[g * MAX_SPAN + j] = -INFINITY;
                online_softmax_step(p + g * MAX_SPAN, padded, &m[i0 + g], &l[i0 + g], acc + (i0 + g) * D, D);
            }
            if (kind == 2) span_values_pairs(&sb, kh, G, D, row, p, acc + i0 * D, &pf);
            else if (kind == 3) span_values_f32(&sb, kh, G, D, row, p, acc + i0 * D, &pf);
            else span_values(&sb, kh, G, D, row, p, acc + i0 * D, &pf, bf16);
            /* by the end of each KV head's share of the span, that share of the next span's lines (the loops'
             * own prefetches fall short where the item has many lines a token for its query heads) */
            const int64_t due = pf.blocks * pf.tokens * pf.lines * (kh - kh0 + 1) / nkh;
            if (pf.issued < due) prefetch_lines(&pf, (int)(due - pf.issued));
        }
    }
    if (kind == 2)
        for (int64_t h = 0; h < nkh * G; h++) pairs_to_dims(acc + h * D, D);
    if (a->parts == 1) {
        float *out = a->out + (s * H + h0) * D;
        for (int64_t h = 0; h < nkh * G; h++) {
            const float inv = sink_scale(m[h], l[h], a->sinks ? a->sinks[h0 + h] * LOG2E : -INFINITY);
            for (int64_t d = 0; d < D; d++) out[h * D + d] = acc[h * D + d] * inv;
        }
        return;
    }
    float *mine = a->partial + ((s * a->parts + part) * H + h0) * (D + 2);
    for (int64_t h = 0; h < nkh * G; h++) {
        memcpy(mine + h * (D + 2), acc + h * D, sizeof(float) * D);
        mine[h * (D + 2) + D] = m[h];
        mine[h * (D + 2) + D + 1] = l[h];
    }
}

static void decode_part(void *args, int t, int T) {
    decode_args *a = args;
    (void)t; (void)T;
    for (;;) {                     /* items handed out one at a time: sequences differ in length */
        const int64_t item = __atomic_fetch_add(&a->next, 1, __ATOMIC_RELAXED);
        if (item >= a->items) break;
        if (a->kv_bf16 == 3) decode_item(a, item, 3);
        else if (a->kv_bf16 == 2) decode_item(a, item, 2);
        else if (a->kv_bf16) decode_item(a, item, 1);
        else decode_item(a, item, 0);
    }
}

/* the parts' running sums of each sequence and query head into its output */
static void merge_parts(const decode_args *a, int64_t S) {
    const int64_t H = a->H, D = a->D, P = a->parts, stride = H * (D + 2);
    for (int64_t s = 0; s < S; s++)
        for (int64_t h = 0; h < H; h++) {
            const float *first = a->partial + s * P * stride + h * (D + 2);
            const float sink = a->sinks ? a->sinks[h] * LOG2E : -INFINITY;
            float mx = sink, sum = 0.f, *out = a->out + (s * H + h) * D;
            for (int64_t p = 0; p < P; p++) mx = first[p * stride + D] > mx ? first[p * stride + D] : mx;
            for (int64_t d = 0; d < D; d++) out[d] = 0.f;
            if (mx == -INFINITY) continue;
            sum = exp2f(sink - mx);   /* the sink logit's weight (0 without one) */
            for (int64_t p = 0; p < P; p++) {
                const float *part = first + p * stride, w = exp2f(part[D] - mx);
                sum += part[D + 1] * w;
                for (int64_t d = 0; d < D; d++) out[d] += part[d] * w;
            }
            const float inv = sum > 0.f ? 1.f / sum : 0.f;
            for (int64_t d = 0; d < D; d++) out[d] *= inv;
        }
}

/* One query token per sequence against its paged context, read in place.
 * q [S][H][D] (rows q_stride floats apart), out [S][H][D]; key_cache, value_cache [num_blocks][bs][KVH][D] of
 * float32 (kv_bf16 0; through AVX-512F's loops, kind 3 below, where avx512 and D is a multiple of 16: callers
 * check the CPU has it, as paged_prefill_attention's avx512), or of bfloat16 (1: each value widened; 2: through
 * AVX512_BF16's dpbf16, the queries and the softmax weights rounded to bfloat16, where D is a multiple of 32,
 * callers check the CPU has AVX512_BF16, BW and VL);
 * tables [S][max_blocks]; context_lens [S]. Query head h uses KV head h / (H / KVH). With window > 0 a row sees
 * its last `window` positions only. sinks [H] (or NULL): each head's sink logit (see 4. above). D a multiple of 8,
 * H * D <= MAX_HD, H / KVH <= MAX_G, bs <= MAX_BS. */
void paged_decode_attention(const float *q, int64_t q_stride, const void *key_cache, const void *value_cache,
                            int kv_bf16, const int64_t *tables, int64_t max_blocks, const int64_t *context_lens,
                            int64_t S, int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t window,
                            float scale, const float *sinks, float *out, int avx512, int nthreads) {
    const int64_t wanted = ITEMS_PER_THREAD * nthreads;
    int64_t heads = KVH, parts = 1;
    if (kv_bf16 == 2 && D % 32) kv_bf16 = 1;   /* dpbf16's loops take 32 dimensions at a time */
    if (kv_bf16 == 0 && avx512 && D % 16 == 0) kv_bf16 = 3;   /* AVX-512F's float32 loops, 16 */
    if (S < wanted) {                /* too few sequences to share out: split their contexts */
        int64_t longest = 0;
        for (int64_t s = 0; s < S; s++) {
            const int64_t keys = window > 0 && context_lens[s] > window ? window : context_lens[s];
            longest = keys > longest ? keys : longest;
        }
        parts = (wanted + S - 1) / S;
        if (parts > longest / MIN_PART_KEYS) parts = longest / MIN_PART_KEYS > 1 ? longest / MIN_PART_KEYS : 1;
        if (parts == 1) heads = 1;   /* contexts too short to split: their KV heads shared out instead */
    }
    float *partial = NULL;
    if (parts > 1 && !(partial = malloc(sizeof(float) * S * parts * H * (D + 2)))) parts = 1;
    decode_args a = {q, q_stride, key_cache, value_cache, kv_bf16, tables, max_blocks, context_lens, H, KVH, D, bs,
                     window, scale, sinks, out, heads, parts, S * parts * (KVH / heads), partial, 0};
    parallel_run(decode_part, &a, nthreads);
    if (parts > 1) merge_parts(&a, S);
    free(partial);
}
