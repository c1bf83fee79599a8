/* Decode attention over a latent paged KV cache (multi-head latent attention, DeepSeek-V2 / V3) for x86-64 CPUs
 * (AVX2 + FMA), loaded with ctypes (native.py).
 *
 * paged_latent_decode_attention: one absorbed query per sequence and head (petrel/model/mla.py: [W_UK^T q_nope,
 * q_pe], W = rank + rope values) against the sequence's cache rows [latent (rank), rotary key (rope)], read in
 * place. Every head attends over the same rows: keys are the whole row, values its first `rank` values. So:
 *   1. A work item is a part of one sequence's context with all its heads: each row is read from memory once for
 *      every head (a head-split would read it once per group of heads). With fewer sequences than
 *      ITEMS_PER_THREAD a thread, the contexts are split into parts (as flash-decoding splits them), each part
 *      keeping its own running softmax, merged at the end.
 *   2. A part walks its blocks a span (SPAN rows, whole blocks) at a time; the span's rows stay in L1/L2 while
 *      every group of HEADS heads takes its scores (two heads x four rows a pass: eight sums, six loads for eight
 *      multiply-adds), one online-softmax step each (base 2, the queries pre-scaled by scale * log2 e), then its
 *      values (three heads x 32 dimensions a pass, each row's vectors loaded once for the three).
 *   3. The running outputs of all heads live in the thread's scratch ([H][rank] + the queries [H][W]): heap memory,
 *      as V3's 128 heads x 512 are larger than a stack should hold; the call returns -1 when it cannot get it.
 *   4. float32 or bfloat16 rows (kv_bf16 1: each value widened as it is loaded; the dpbf16 kind is widened too).
 * The work a row costs is heads x (W + rank) multiply-adds against W values read: with many heads (V3: 128) the
 * kernel is bound by arithmetic, not memory, which is what latent attention trades for its small cache. */
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

#define SPAN 32               /* rows one softmax step covers (whole blocks; one block when blocks are bigger) */
#define MAX_BS 256
#define MAX_SPAN (SPAN > MAX_BS ? SPAN : MAX_BS)
#define ITEMS_PER_THREAD 2    /* work items wanted a thread */
#define MIN_PART_ROWS 128     /* the fewest rows of a part of a context */

#define INLINE static inline __attribute__((always_inline))

INLINE __m256 row_load8(const char *p, const int bf16) {
    return bf16 ? bf16_load8((const uint16_t *)p) : _mm256_loadu_ps((const float *)p);
}

typedef struct {
    const float *q; int64_t q_stride; const void *cache; int bf16;
    const int64_t *tables; int64_t max_blocks; const int64_t *context_lens;
    int64_t H, W, R, bs; float scale; float *out;
    int64_t parts, items;
    float *partial;           /* parts > 1: [S][parts][H][R + 2], each part's unnormalized output, max and sum */
    float *scratch;           /* per thread: queries [H][W], outputs [H][R], max and sum [H], scores [H][MAX_SPAN] */
    int64_t scratch_floats;
    int64_t next;
} latent_args;

/* the span's rows: where each lies */
typedef struct {
    const char *rows[MAX_SPAN];
    int64_t n;
} span_rows;

/* scores of heads h, h+1 (qs: W apart) against rows j .. j+3 of the span, into p[h][j..j+4) and p[h+1][j..j+4) */
INLINE void scores_2x4(const float *qs, int64_t W, const span_rows *sr, int64_t j, float *p0, float *p1,
                       const int bf16) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    const int64_t esize = bf16 ? 2 : 4;
    const char *r[4];
    for (int i = 0; i < 4; i++) r[i] = sr->rows[j + i < sr->n ? j + i : sr->n - 1];
    for (int64_t d = 0; d < W; d += 8) {
        const __m256 q0 = _mm256_loadu_ps(qs + d), q1 = _mm256_loadu_ps(qs + W + d);
        for (int i = 0; i < 4; i++) {
            const __m256 k = row_load8(r[i] + d * esize, bf16);
            a[i] = _mm256_fmadd_ps(q0, k, a[i]);
            a[4 + i] = _mm256_fmadd_ps(q1, k, a[4 + i]);
        }
    }
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    const __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                   _mm256_permute2f128_ps(s0123, s4567, 0x31));
    float t[8];
    _mm256_storeu_ps(t, s);
    memcpy(p0 + j, t, sizeof(float) * 4);
    memcpy(p1 + j, t + 4, sizeof(float) * 4);
}

/* acc[g][d0 .. d0 + 32) += sum over the span's rows of p[g][j] * row[j][d0 ..], for GN (<= 3) heads at once */
INLINE void values_part(const span_rows *sr, const float *p, float *acc, int64_t R, int64_t d0, const int GN,
                        const int bf16) {
    __m256 a[3][4];
    const int64_t esize = bf16 ? 2 : 4;
    for (int g = 0; g < GN; g++)
        for (int i = 0; i < 4; i++) a[g][i] = _mm256_loadu_ps(acc + g * R + d0 + 8 * i);
    for (int64_t j = 0; j < sr->n; j++) {
        __m256 w[3];
        for (int g = 0; g < GN; g++) w[g] = _mm256_broadcast_ss(p + g * MAX_SPAN + j);
        const char *row = sr->rows[j] + d0 * esize;
        for (int i = 0; i < 4; i++) {
            const __m256 v = row_load8(row + 8 * i * esize, bf16);
            for (int g = 0; g < GN; g++) a[g][i] = _mm256_fmadd_ps(w[g], v, a[g][i]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(acc + g * R + d0 + 8 * i, a[g][i]);
}

/* work item (sequence, part): that part of the sequence's rows against all its heads */
INLINE void latent_item(latent_args *a, int64_t item, float *scratch, const int bf16) {
    const int64_t H = a->H, W = a->W, R = a->R, bs = a->bs, esize = bf16 ? 2 : 4;
    const int64_t s = item / a->parts, part = item % a->parts, len = a->context_lens[s];
    const int64_t blocks = (len + bs - 1) / bs, per = (blocks + a->parts - 1) / a->parts;
    const int64_t b0 = part * per, b1 = b0 + per < blocks ? b0 + per : blocks;
    const int64_t span = SPAN / bs > 1 ? SPAN / bs : 1;
    float *qs = scratch, *acc = qs + H * W, *m = acc + H * R, *l = m + H, *p = l + H;
    p = (float *)(((uintptr_t)p + 31) & ~(uintptr_t)31);
    const float scale_log2e = a->scale * 1.44269504088896341f;
    const float *q = a->q + s * a->q_stride;
    for (int64_t i = 0; i < H * W; i++) qs[i] = q[i] * scale_log2e;
    memset(acc, 0, sizeof(float) * H * R);
    for (int64_t h = 0; h < H; h++) { m[h] = -INFINITY; l[h] = 0.f; }
    span_rows sr;
    for (int64_t b = b0; b < b1; b += span) {
        const int64_t nb = b + span <= b1 ? span : b1 - b;
        sr.n = 0;
        for (int64_t i = 0; i < nb; i++) {
            const int64_t block = a->tables[s * a->max_blocks + b + i], first = (b + i) * bs;
            const int64_t t1 = first + bs <= len ? bs : len - first;
            const char *base = (const char *)a->cache + block * bs * W * esize;
            for (int64_t t = 0; t < t1; t++) sr.rows[sr.n++] = base + t * W * esize;
        }
        const int64_t padded = (sr.n + 15) / 16 * 16;
        for (int64_t h = 0; h < H; h += 2) {      /* H is even (the wrapper checks) */
            float *p0 = p + h * MAX_SPAN, *p1 = p0 + MAX_SPAN;
            for (int64_t j = 0; j < sr.n; j += 4) scores_2x4(qs + h * W, W, &sr, j, p0, p1, bf16);
            for (int64_t j = sr.n; j < padded; j++) p0[j] = p1[j] = -INFINITY;
            online_softmax_step(p0, padded, &m[h], &l[h], acc + h * R, R);
            online_softmax_step(p1, padded, &m[h + 1], &l[h + 1], acc + (h + 1) * R, R);
        }
        for (int64_t h = 0; h < H; h += 3) {
            const int gn = H - h >= 3 ? 3 : (int)(H - h);
            for (int64_t d0 = 0; d0 < R; d0 += 32) {
                if (gn == 3) values_part(&sr, p + h * MAX_SPAN, acc + h * R, R, d0, 3, bf16);
                else if (gn == 2) values_part(&sr, p + h * MAX_SPAN, acc + h * R, R, d0, 2, bf16);
                else values_part(&sr, p + h * MAX_SPAN, acc + h * R, R, d0, 1, bf16);
            }
        }
    }
    if (a->parts == 1) {
        float *out = a->out + s * H * R;
        for (int64_t h = 0; h < H; h++) {
            const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
            for (int64_t d = 0; d < R; d++) out[h * R + d] = acc[h * R + d] * inv;
        }
        return;
    }
    float *mine = a->partial + (s * a->parts + part) * H * (R + 2);
    for (int64_t h = 0; h < H; h++) {
        memcpy(mine + h * (R + 2), acc + h * R, sizeof(float) * R);
        mine[h * (R + 2) + R] = m[h];
        mine[h * (R + 2) + R + 1] = l[h];
    }
}

static void latent_part(void *args, int t, int T) {
    latent_args *a = args;
    (void)T;
    float *scratch = a->scratch + (int64_t)t * a->scratch_floats;
    for (;;) {
        const int64_t item = __atomic_fetch_add(&a->next, 1, __ATOMIC_RELAXED);
        if (item >= a->items) break;
        if (a->bf16) latent_item(a, item, scratch, 1);
        else latent_item(a, item, scratch, 0);
    }
}

static void merge_latent_parts(const latent_args *a, int64_t S) {
    const int64_t H = a->H, R = a->R, P = a->parts, stride = H * (R + 2);
    for (int64_t s = 0; s < S; s++)
        for (int64_t h = 0; h < H; h++) {
            const float *first = a->partial + s * P * stride + h * (R + 2);
            float mx = -INFINITY, sum = 0.f, *out = a->out + (s * H + h) * R;
            for (int64_t p = 0; p < P; p++) mx = first[p * stride + R] > mx ? first[p * stride + R] : mx;
            memset(out, 0, sizeof(float) * R);
            if (mx == -INFINITY) continue;
            for (int64_t p = 0; p < P; p++) {
                const float *part = first + p * stride, w = exp2f(part[R] - mx);
                sum += part[R + 1] * w;
                for (int64_t d = 0; d < R; d++) out[d] += part[d] * w;
            }
            const float inv = sum > 0.f ? 1.f / sum : 0.f;
            for (int64_t d = 0; d < R; d++) out[d] *= inv;
        }
}

/* One absorbed query row per sequence against its latent cache rows, read in place.
 * q [S][H][W] (rows q_stride floats apart); cache [num_blocks][bs][W] float32 (kv_bf16 0) or bfloat16 (else);
 * tables [S][max_blocks], context_lens [S]; out [S][H][R]: each head's softmax-weighted sum of the rows' first R
 * values. H even, W a multiple of 8, R of 32, bs <= MAX_BS. Returns 0, or -1 when scratch memory was not to be had. */
int paged_latent_decode_attention(const float *q, int64_t q_stride, const void *cache, int kv_bf16,
                                  const int64_t *tables, int64_t max_blocks, const int64_t *context_lens, int64_t S,
                                  int64_t H, int64_t W, int64_t R, int64_t bs, float scale, float *out, int nthreads) {
    const int64_t wanted = ITEMS_PER_THREAD * nthreads;
    int64_t parts = 1;
    if (S < wanted) {
        int64_t longest = 0;
        for (int64_t s = 0; s < S; s++) longest = context_lens[s] > longest ? context_lens[s] : longest;
        parts = (wanted + S - 1) / S;
        if (parts > longest / MIN_PART_ROWS) parts = longest / MIN_PART_ROWS > 1 ? longest / MIN_PART_ROWS : 1;
    }
    const int64_t threads = nthreads < S * parts ? nthreads : S * parts;
    const int64_t scratch_floats = H * W + H * R + 2 * H + H * MAX_SPAN + 64;
    float *scratch = malloc(sizeof(float) * scratch_floats * (threads > 0 ? threads : 1));
    float *partial = parts > 1 ? malloc(sizeof(float) * S * parts * H * (R + 2)) : NULL;
    if (!scratch || (parts > 1 && !partial)) {
        free(scratch);
        free(partial);
        return -1;
    }
    latent_args a = {q, q_stride, cache, kv_bf16 != 0, tables, max_blocks, context_lens, H, W, R, bs, scale, out,
                     parts, S * parts, partial, scratch, scratch_floats, 0};
    parallel_run(latent_part, &a, (int)(threads > 0 ? threads : 1));
    if (parts > 1) merge_latent_parts(&a, S);
    free(scratch);
    free(partial);
    return 0;
}
