/* The experts of a mixture-of-experts layer as one call for a step's rows (petrel/model/moe.py's Experts, through
 * moe_kernels.py), loaded with ctypes (petrel/model/native.py).
 *
 * T tokens, each routed to k experts (ids [T][k] of the global expert numbers, routing weights [T][k]); this rank
 * holds experts first .. first + E - 1 (with expert parallelism the other picks are other ranks' work), each with
 * its gate_up [2I][H] (gate rows, then up rows) and down [H][I] described by a `weight` (kernels.h: float32 or
 * bfloat16 rows or panels, quantized codes), multiplied by dense_kernels.c's weight_product:
 *   1. group: each local expert's count of picks, offsets by prefix sum, and each pick's row in expert order (token
 *      order within an expert);
 *   2. one gather of x's rows into that order;
 *   3. gate/up: every used expert's rows times its gate_up, the work cut into units of (expert, 32 columns) and the
 *      threads given contiguous runs of units of equal cost (a unit costs its expert's rows or WEIGHT_COST, what
 *      streaming its weights costs beside them), so a decode step with few tokens has each thread stream whole
 *      runs of columns of a few experts: each used expert's weights are read once and no unused expert's at all;
 *   4. SiLU-and-multiply over all the rows (or gpt-oss's clamped SwiGLU; each expert's gate/up bias added first);
 *   5. down: the same split over the down weights (each expert's down bias added after);
 *   6. each token's output row: its picks' rows scaled by their routing weights and summed (pick order), written
 *      once (no scatter races, no zeroing pass).
 * A unit's products run on its thread alone (weight_product with one thread); a run of columns that is not a whole
 * expert goes through a per-thread scratch of at most MOE_COLUMNS columns and is copied into place. A prompt step's
 * tokens go through all of this in chunks (chunk_tokens), whose rows stay in the last-level cache between phases. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "scratch.h"
#include "thread_pool.h"
#include "weight_product.h"

#define UNIT 32           /* columns a unit of work: one panel of panels.c's layout */
#define MOE_COLUMNS 256   /* columns one product call takes when a thread holds part of an expert */
#define PARALLEL_WORK (1 << 20)   /* a phase of less work (units' cost x their columns x K: multiply-adds, or
                                   * weights streamed counted as WEIGHT_COST rows' worth) runs on one thread */
#define CHUNK_BYTES ((int64_t)32 << 20)   /* a pass's rows (chunk_tokens) */
#define CHUNK_ROWS 64     /* the fewest rows an expert a pass averages (chunk_tokens) */
#define WEIGHT_COST 32    /* what streaming a unit's weights from memory takes, in rows of products over it (unit_cost) */

/* w's rows (or, in panels, columns) from n0 on (n0 a multiple of UNIT), for a weight of K inputs: its codes and
 * its scales and mins (one group a row, or K >> gshift) moved on by n0 rows */
static weight rows_from(const weight *w, int64_t K, int64_t n0) {
    weight s = *w;
    s.data = (const char *)w->data + n0 * K * w->bits / 8;
    if (w->scale && w->bits == 4 && !w->mins) {   /* MXFP4: a byte a group (kernels.h) */
        s.scale = (const float *)((const uint8_t *)w->scale + n0 * (K / 32));
    } else if (w->scale) {
        const int64_t groups = w->gshift >= 62 ? 1 : K >> w->gshift;
        s.scale = w->scale + n0 * groups;
        if (w->mins) s.mins = w->mins + n0 * groups;
    }
    return s;
}

/* one phase of products: for every local expert e, rows offsets[e] .. offsets[e + 1] of out [N] = the same rows of
 * in [K] @ w[e]^T */
typedef struct {
    const float *in; int64_t K; float *out; int64_t N;
    const weight *w; const int64_t *offsets; int64_t E;
    int64_t total;                 /* the cost of every unit */
    float *scratch; int64_t scratch_floats;   /* per thread */
    int status;
} phase_args;

/* A unit's cost, the longer of streaming its weights and its rows' products (a roofline): a decode step's units (1-5
 * rows an expert) all cost the stream, a prompt step's (64 rows and more, the weights streamed while the products
 * run) their rows. With the two added instead (8 + rows), the thread holding more rows got the longer share of a
 * 16-row decode step: its experts read at 83-89% of the memory read rate measured beside them, 87-95% so (three
 * runs each, Zen 5), and a 2,048-token step's at the same 425-434 GFLOP/s. */
static int64_t unit_cost(int64_t rows) {
    return rows > WEIGHT_COST ? rows : WEIGHT_COST;
}

static int64_t units_of(int64_t N) {
    return (N + UNIT - 1) / UNIT;
}

static int64_t phase_cost(const int64_t *offsets, int64_t E, int64_t N) {
    int64_t total = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t rows = offsets[e + 1] - offsets[e];
        if (rows) total += units_of(N) * unit_cost(rows);
    }
    return total;
}

/* columns c0 .. c1 of expert e's rows */
static int expert_columns(const phase_args *a, int64_t e, int64_t c0, int64_t c1, float *scratch) {
    const int64_t rows = a->offsets[e + 1] - a->offsets[e], K = a->K, N = a->N, width = c1 - c0;
    const float *x = a->in + a->offsets[e] * K;
    float *y = a->out + a->offsets[e] * N;
    const weight sub = rows_from(&a->w[e], K, c0);
    if (width == N) return weight_product(x, rows, K, &sub, y, N, 1);
    const int status = weight_product(x, rows, K, &sub, scratch, width, 1);
    for (int64_t r = 0; r < rows; r++) memcpy(y + r * N + c0, scratch + r * width, sizeof(float) * width);
    return status;
}

/* thread t's share: the units whose cost starts in [total t / T, total (t + 1) / T), experts in order */
static void phase_part(void *args, int t, int T) {
    phase_args *a = args;
    const int64_t units = units_of(a->N), lo = a->total * t / T, hi = a->total * (t + 1) / T;
    float *const scratch = a->scratch + t * a->scratch_floats;
    int64_t before = 0;
    for (int64_t e = 0; e < a->E && before < hi; e++) {
        const int64_t rows = a->offsets[e + 1] - a->offsets[e];
        if (rows == 0) continue;
        const int64_t cost = unit_cost(rows);
        const int64_t u0 = lo > before ? (lo - before + cost - 1) / cost : 0;
        int64_t u1 = (hi - before + cost - 1) / cost;
        u1 = u1 < units ? u1 : units;
        before += units * cost;
        if (u0 >= u1) continue;
        const int64_t end = u1 * UNIT < a->N ? u1 * UNIT : a->N;
        const int64_t step = u0 == 0 && u1 == units ? a->N : MOE_COLUMNS;   /* a whole expert: one call, in place */
        for (int64_t c0 = u0 * UNIT; c0 < end; c0 += step) {
            const int status = expert_columns(a, e, c0, c0 + step < end ? c0 + step : end, scratch);
            if (status) __atomic_store_n(&a->status, status, __ATOMIC_RELAXED);
        }
    }
}

static int run_phase(const float *in, int64_t K, float *out, int64_t N, const weight *w, const int64_t *offsets,
                     int64_t E, float *scratch, int64_t scratch_floats, int nthreads) {
    phase_args a = {in, K, out, N, w, offsets, E, phase_cost(offsets, E, N), scratch, scratch_floats, 0};
    if (a.total * UNIT * K < PARALLEL_WORK) nthreads = 1;   /* less than waking the other threads costs */
    if (a.total) parallel_run(phase_part, &a, nthreads);
    return a.status;
}

typedef struct { float *y; int64_t N; const float *bias; const int64_t *offsets; int64_t E; } expert_bias_args;

/* rows r0 .. r1 (in expert order) += their expert's bias */
static void expert_bias_rows(const void *args, int64_t r0, int64_t r1) {
    const expert_bias_args *a = args;
    int64_t e = 0;
    for (int64_t r = r0; r < r1; r++) {
        while (a->offsets[e + 1] <= r) e++;
        const float *b = a->bias + e * a->N;
        float *y = a->y + r * a->N;
        for (int64_t i = 0; i < a->N; i++) y[i] += b[i];
    }
}

/* y [R][N] (rows grouped by expert: offsets) += bias[e] [N] of each row's expert e */
static void add_expert_bias(float *y, int64_t R, int64_t N, const float *bias, const int64_t *offsets, int64_t E,
                            int nthreads) {
    expert_bias_args a = {y, N, bias, offsets, E};
    for_rows(expert_bias_rows, &a, R, R * N, nthreads);
}

typedef struct { const float *x; int64_t I; float alpha, limit; float *out; } swiglu_args;

static void swiglu_rows(const void *args, int64_t t0, int64_t t1) {
    const swiglu_args *a = args;
    for (int64_t t = t0; t < t1; t++) {
        const float *gate = a->x + t * 2 * a->I, *up = gate + a->I;
        float *o = a->out + t * a->I;
        for (int64_t i = 0; i < a->I; i++) {
            const float g = gate[i] < a->limit ? gate[i] : a->limit;
            const float u = up[i] < -a->limit ? -a->limit : up[i] > a->limit ? a->limit : up[i];
            o[i] = (u + 1.f) * (g / (1.f + expf(-a->alpha * g)));
        }
    }
}

/* gpt-oss's clamped SwiGLU: out [T][I] = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit),
 * of x [T][2I] (gate, then up) */
static void swiglu_clamped(const float *x, int64_t T, int64_t I, float alpha, float limit, float *out, int nthreads) {
    swiglu_args a = {x, I, alpha, limit, out};
    for_rows(swiglu_rows, &a, T, T * I * 8, nthreads);
}

typedef struct { const float *x; int64_t H; const int64_t *token; float *xs; } gather_args;

static void gather_rows(const void *args, int64_t r0, int64_t r1) {
    const gather_args *a = args;
    for (int64_t r = r0; r < r1; r++) memcpy(a->xs + r * a->H, a->x + a->token[r] * a->H, sizeof(float) * a->H);
}

typedef struct {
    const float *ys; int64_t H, k; const int64_t *slot; const float *weights; float *out;
} combine_args;

/* out[t] = sum over t's picks j (in order) of weights[t][j] * ys[slot[t][j]]; zeros where t has no local pick */
static void combine_rows(const void *args, int64_t t0, int64_t t1) {
    const combine_args *a = args;
    const int64_t H = a->H, k = a->k;
    for (int64_t t = t0; t < t1; t++) {
        float *o = a->out + t * H;
        memset(o, 0, sizeof(float) * H);
        for (int64_t j = 0; j < k; j++) {
            const int64_t r = a->slot[t * k + j];
            if (r < 0) continue;
            const float *y = a->ys + r * H;
            const float w = a->weights[t * k + j];
            const __m256 wv = _mm256_set1_ps(w);
            int64_t h = 0;
            for (; h + 8 <= H; h += 8)
                _mm256_storeu_ps(o + h, _mm256_fmadd_ps(wv, _mm256_loadu_ps(y + h), _mm256_loadu_ps(o + h)));
            for (; h < H; h++) o[h] += w * y[h];
        }
    }
}

/* The most tokens one pass over the experts takes: a prompt step's gathered rows and their gate/up, activation and
 * down outputs ((H + 3 I) floats a pick) kept to about CHUNK_BYTES, so that they stay in the last-level cache
 * between the phases (2,048 tokens of the Qwen3-MoE-shaped model in one pass: 117 MB, 395 GFLOP/s; in passes of
 * 512: 29 MB, 433 GFLOP/s, Zen 5), but never fewer than CHUNK_ROWS rows an expert on average, below which each
 * pass's reading of the experts' weights would cost more than the chunking saves */
static int64_t chunk_tokens(int64_t T, int64_t H, int64_t I, int64_t k, int64_t E) {
    const int64_t by_bytes = CHUNK_BYTES / (k * (H + 3 * I) * (int64_t)sizeof(float));
    const int64_t by_rows = CHUNK_ROWS * E / k;
    const int64_t chunk = by_bytes > by_rows ? by_bytes : by_rows;
    return chunk < T ? chunk : T > 0 ? T : 1;
}

/* moe_experts over rows of one chunk */
static int experts_rows(const float *x, int64_t T, int64_t H, int64_t I, int64_t k, const int64_t *ids,
                        const float *route_weights, int64_t first, int64_t E, const weight *gate_up,
                        const weight *down, const moe_act *act, float *out, int nthreads) {
    const int64_t picks = T * k;
    /* this thread's scratch (scratch.c): the picks' index arrays, then the rows */
    int64_t *const offsets = scratch_take(SCRATCH_EXPERT_PICKS, sizeof(int64_t) * (2 * E + 1 + 2 * picks + 1));
    if (!offsets) return KERNEL_OUT_OF_MEMORY;
    int64_t *const next = offsets + E + 1, *const slot = next + E, *const token = slot + picks;
    memset(offsets, 0, sizeof(int64_t) * (2 * E + 1));
    for (int64_t i = 0; i < picks; i++) {   /* 1. counts, offsets, each pick's row */
        const int64_t e = ids[i] - first;
        if (e >= 0 && e < E) offsets[e + 1]++;
    }
    int64_t max_rows = 0;
    for (int64_t e = 0; e < E; e++) {
        max_rows = offsets[e + 1] > max_rows ? offsets[e + 1] : max_rows;
        offsets[e + 1] += offsets[e];
    }
    for (int64_t i = 0; i < picks; i++) {
        const int64_t e = ids[i] - first;
        slot[i] = e >= 0 && e < E ? offsets[e] + next[e]++ : -1;
        if (slot[i] >= 0) token[slot[i]] = i / k;
    }
    const int64_t R = offsets[E], per_thread = max_rows * MOE_COLUMNS;
    float *const buffer = scratch_take(SCRATCH_EXPERT_ROWS,
                                       sizeof(float) * (R * H + R * 2 * I + R * I + nthreads * per_thread + 1));
    if (!buffer) return KERNEL_OUT_OF_MEMORY;
    int status = 0;
    float *const xs = buffer, *const hs = xs + R * H, *const acts = hs + R * 2 * I, *const scratch = acts + R * I;
    float *const ys = xs;   /* the down products' rows reuse the gathered rows' room */
    pool_enter();
    if (R) {
        gather_args g = {x, H, token, xs};
        for_rows(gather_rows, &g, R, R * H, nthreads);   /* 2 */
        status = run_phase(xs, H, hs, 2 * I, gate_up, offsets, E, scratch, per_thread, nthreads);   /* 3 */
        if (status == 0) {
            if (act && act->gate_up_bias) add_expert_bias(hs, R, 2 * I, act->gate_up_bias, offsets, E, nthreads);
            if (act && act->swiglu) swiglu_clamped(hs, R, I, act->alpha, act->limit, acts, nthreads);   /* 4 */
            else silu_and_mul(hs, R, I, acts, nthreads);
            status = run_phase(acts, I, ys, H, down, offsets, E, scratch, per_thread, nthreads);   /* 5 */
            if (status == 0 && act && act->down_bias)
                add_expert_bias(ys, R, H, act->down_bias, offsets, E, nthreads);
        }
    }
    if (status == 0) {
        combine_args c = {ys, H, k, slot, route_weights, out};
        for_rows(combine_rows, &c, T, T * H * k, nthreads);   /* 6 */
    }
    pool_exit();
    return status;
}

/* The layer's experts over T rows of x [T][H] (see the top of this file): out [T][H] = for each token the sum over
 * its picks on this rank's experts (first .. first + E - 1) of route_weights * down(silu(gate) * up)(x); ids [T][k]
 * int64, route_weights [T][k]; gate_up[e], down[e] the local experts' weights [2I][H] and [H][I]; I a multiple of
 * 8. With act (kernels.h's moe_act) the activation and the biases: gate_up_bias[e] [2I] and down_bias[e] [H] after
 * the products (NULL: none), the clamped SwiGLU with act->swiglu. Returns 0, or KERNEL_OUT_OF_MEMORY (out then
 * holds nothing meaningful). Prompt steps go in chunks of tokens (chunk_tokens). */
int moe_experts(const float *x, int64_t T, int64_t H, int64_t I, int64_t k, const int64_t *ids,
                const float *route_weights, int64_t first, int64_t E, const weight *gate_up, const weight *down,
                const moe_act *act, float *out, int nthreads) {
    const int64_t chunk = chunk_tokens(T, H, I, k, E), chunks = (T + chunk - 1) / chunk;
    int status = 0;
    for (int64_t c = 0, t0 = 0; c < chunks && status == 0; c++) {
        const int64_t n = (T - t0) / (chunks - c);   /* chunks as even as can be */
        status = experts_rows(x + t0 * H, n, H, I, k, ids + t0 * k, route_weights + t0 * k, first, E, gate_up, down,
                              act, out + t0 * H, nthreads);
        t0 += n;
    }
    return status;
}

/* p = softmax(l) over E logits */
static void softmax_row(const float *l, int64_t E, float *p) {
    float top = l[0], sum = 0.f;
    for (int64_t e = 1; e < E; e++) top = l[e] > top ? l[e] : top;
    for (int64_t e = 0; e < E; e++) sum += p[e] = expf(l[e] - top);
    for (int64_t e = 0; e < E; e++) p[e] /= sum;
}

/* Each row's top_k experts by softmax probability (ties: the lower number first) and their routing weights,
 * renormalised to sum 1 if asked; with topk_softmax (gpt-oss) the top_k logits, then a softmax over those k: logits
 * [T][E] in, ids and weights [T][k] out */
static void route_rows(const float *logits, int64_t T, int64_t E, int64_t k, int renormalize, int topk_softmax,
                       int64_t *ids, float *weights, float *probs) {
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        if (topk_softmax) {
            for (int64_t e = 0; e < E; e++) probs[e] = l[e];
            for (int64_t j = 0; j < k; j++) {
                int64_t best = -1;
                for (int64_t e = 0; e < E; e++)
                    if (probs[e] == probs[e] && probs[e] != -INFINITY && (best < 0 || probs[e] > probs[best])) best = e;
                if (best < 0) best = j % E;   /* NaN logits (the output is NaN anyway) */
                ids[t * k + j] = best;
                weights[t * k + j] = probs[best];
                probs[best] = -INFINITY;   /* taken */
            }
            float top = weights[t * k], sum = 0.f;   /* the first pick has the largest logit */
            for (int64_t j = 0; j < k; j++) sum += weights[t * k + j] = expf(weights[t * k + j] - top);
            for (int64_t j = 0; j < k; j++) weights[t * k + j] /= sum;
            continue;
        }
        softmax_row(l, E, probs);
        float picked = 0.f;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (probs[e] >= 0.f && (best < 0 || probs[e] > probs[best])) best = e;
            if (best < 0) best = j % E;   /* NaN logits: no expert wins; any valid one (the output is NaN anyway) */
            ids[t * k + j] = best;
            weights[t * k + j] = probs[best];
            picked += probs[best];
            probs[best] = -1.f;   /* taken */
        }
        if (renormalize)
            for (int64_t j = 0; j < k; j++) weights[t * k + j] /= picked;
    }
}

/* the index of the largest of v[0..n) not yet taken (taken[i] set), the lower index on ties; -1 if none is a number */
static int64_t best_untaken(const float *v, const uint8_t *taken, int64_t n) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; i++)
        if (!taken[i] && v[i] == v[i] && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

/* DeepSeek's router (m->routed_scaling > 0; petrel/model/deepseek.py's DeepseekRouter): scores softmax or sigmoid of
 * the logits; the choice scores (+ choice_bias); with n_group > 1 only the topk_group best groups' experts (a group
 * scored by its best choice, or its best two summed with group_top2); the top_k choices, weighted by their unbiased
 * scores, renormalised to sum 1 if asked, times routed_scaling. scratch: 2 E + n_group floats, E + n_group bytes. */
static void route_grouped_rows(const float *logits, int64_t T, const moe_layer *m, int64_t *ids, float *weights,
                               float *scratch, uint8_t *taken) {
    const int64_t E = m->experts, k = m->top_k, G = m->n_group > 1 ? m->n_group : 1, per = E / G;
    float *const scores = scratch, *const choice = scores + E, *const group_score = choice + E;
    uint8_t *const group_taken = taken + E;
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        if (m->sigmoid) {
            for (int64_t e = 0; e < E; e++) scores[e] = 1.f / (1.f + expf(-l[e]));
        } else {
            softmax_row(l, E, scores);
        }
        for (int64_t e = 0; e < E; e++) choice[e] = scores[e] + (m->choice_bias ? m->choice_bias[e] : 0.f);
        memset(taken, 0, (size_t)E);
        if (G > 1) {
            for (int64_t g = 0; g < G; g++) {
                const int64_t first = best_untaken(choice + g * per, taken + g * per, per);
                float score = first < 0 ? NAN : choice[g * per + first];
                if (m->group_top2 && first >= 0) {
                    taken[g * per + first] = 1;
                    const int64_t second = best_untaken(choice + g * per, taken + g * per, per);
                    taken[g * per + first] = 0;
                    score = second < 0 ? score : score + choice[g * per + second];
                }
                group_score[g] = score;
            }
            memset(group_taken, 0, (size_t)G);
            for (int64_t j = 0; j < m->topk_group && j < G; j++) {
                const int64_t g = best_untaken(group_score, group_taken, G);
                if (g >= 0) group_taken[g] = 1;
            }
            for (int64_t e = 0; e < E; e++) taken[e] = !group_taken[e / per];   /* other groups' experts: out */
        }
        float picked = 0.f;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = best_untaken(choice, taken, E);
            if (best < 0) best = j % E;   /* NaN scores (the output is NaN anyway) */
            taken[best] = 1;
            ids[t * k + j] = best;
            picked += weights[t * k + j] = scores[best];
        }
        for (int64_t j = 0; j < k; j++)
            weights[t * k + j] = (m->renormalize ? weights[t * k + j] / (picked + 1e-20f) : weights[t * k + j])
                                 * m->routed_scaling;
    }
}

typedef struct { const float *h; int64_t H; const float *gate, *shared; float *y; } shared_args;

/* y[t] += sigmoid(gate[t]) * shared[t] (no gate: y[t] += shared[t]) */
static void add_shared_rows(const void *args, int64_t t0, int64_t t1) {
    const shared_args *a = args;
    for (int64_t t = t0; t < t1; t++) {
        const float g = a->gate ? 1.f / (1.f + expf(-a->gate[t])) : 1.f;
        for (int64_t i = 0; i < a->H; i++) a->y[t * a->H + i] += g * a->shared[t * a->H + i];
    }
}

/* see weight_product.h */
int moe_mlp(const float *h, int64_t T, int64_t H, const moe_layer *m, float *y, int nthreads) {
    const int64_t E = m->experts, k = m->top_k, SI = m->shared_inter, G = m->n_group > 1 ? m->n_group : 0;
    const int64_t routing = 2 * E + G, floats = T * E + routing + T * k + (SI ? T * (3 * SI + H + 1) : 0);
    float *const scratch =
        scratch_take(SCRATCH_ROUTING, sizeof(float) * floats + sizeof(int64_t) * T * k + (size_t)(E + G));
    if (!scratch) return KERNEL_OUT_OF_MEMORY;
    float *const logits = scratch, *const probs = logits + T * E, *const weights = probs + routing;
    int64_t *const ids = (int64_t *)(weights + T * k + (SI ? T * (3 * SI + H + 1) : 0));
    uint8_t *const taken = (uint8_t *)(ids + T * k);
    const weight router = {m->router, NULL, NULL, 32, 0, 0, 0, 0};   /* float32 rows */
    int status = weight_product(h, T, H, &router, logits, E, nthreads);
    if (status == 0) {
        if (m->router_bias)
            for (int64_t t = 0; t < T; t++)
                for (int64_t e = 0; e < E; e++) logits[t * E + e] += m->router_bias[e];
        if (m->routed_scaling > 0.f) route_grouped_rows(logits, T, m, ids, weights, probs, taken);
        else route_rows(logits, T, E, k, (int)m->renormalize, (int)m->topk_softmax, ids, weights, probs);
        if (m->routed)
            for (int64_t i = 0; i < T * k; i++) m->routed[ids[i]]++;
        status = moe_experts(h, T, H, m->inter, k, ids, weights, m->first, m->num_local, m->gate_up, m->down, &m->act,
                             y, nthreads);
    }
    if (status == 0 && SI) {   /* the shared expert, scaled by its gate */
        float *const gate_up = weights + T * k, *const act = gate_up + T * 2 * SI, *const shared = act + T * SI;
        float *const gate = shared + T * H;
        if (!(status = weight_product(h, T, H, &m->shared_gate_up, gate_up, 2 * SI, nthreads))) {
            silu_and_mul(gate_up, T, SI, act, nthreads);
            status = weight_product(act, T, SI, &m->shared_down, shared, H, nthreads);
        }
        if (status == 0 && m->shared_gate.data) status = weight_product(h, T, H, &m->shared_gate, gate, 1, nthreads);
        if (status == 0) {
            shared_args a = {h, H, m->shared_gate.data ? gate : NULL, shared, y};
            for_rows(add_shared_rows, &a, T, T * H, nthreads);
        }
    }
    return status;
}
