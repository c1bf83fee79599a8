/* Dense float32 kernels for petrel on x86-64 CPUs (AVX2 + FMA), loaded with ctypes (petrel/model/native.py).
 *
 * f32_gemv, bf16_gemv: y = x W^T for a few rows of x (decode at small batches), W float32 or bfloat16 rows
 *   (gemv_rows.h).
 * rms_norm, rotary, silu_and_mul: the small per-layer operations, each one pass over its rows instead of the
 *   five to eight torch operations (and their dispatch overhead, ~10 us each at one row) they replace.
 * decode_layer: all of the above and decode_attention.c's attention for a whole Llama decoder layer; its products
 *   take float32 weights or the quantized ones of quant_kernels.c (compiled into the same library), each described
 *   by a `weight`; with q/k norms (Qwen3) and a mixture of experts (moe.c) as the MLP where the layer has them.
 * Work is shared out over nthreads threads of thread_pool.c; the small operations stay on the calling thread unless
 * there are many rows. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_pairs.h"
#include "kernels.h"
#include "scratch.h"
#include "simd.h"
#include "thread_pool.h"
#include "weight_product.h"

/* f32_gemv, bf16_gemv (bfloat16 rows: each weight widened to float32 exactly, a shift) */
#define GEMV_WEIGHT float
#define GEMV_LOAD8(p) _mm256_loadu_ps(p)
#define GEMV_NAME(s) f32_##s
#include "gemv_rows.h"
#undef GEMV_WEIGHT
#undef GEMV_LOAD8
#undef GEMV_NAME
#define GEMV_WEIGHT uint16_t
#define GEMV_LOAD8(p) bf16_load8(p)
#define GEMV_NAME(s) bf16_##s
#include "gemv_rows.h"
#undef GEMV_WEIGHT
#undef GEMV_LOAD8
#undef GEMV_NAME

void f32_gemv(const float *x, int64_t M, int64_t K, const float *W, float *y, int64_t N, int nthreads) {
    f32_gemv_run(x, M, K, W, y, N, nthreads);
}

void bf16_gemv(const float *x, int64_t M, int64_t K, const uint16_t *W, float *y, int64_t N, int nthreads) {
    bf16_gemv_run(x, M, K, W, y, N, nthreads);
}

/* y[m][n0 + j] = x[m] . tile[j] for all M rows of x and the `rows` weight rows of a float32 tile [rows][K] (in
 * cache: quant_kernels.c's quant_gemm dequantizes a tile, then runs this over it on the same thread) */
void f32_tile_product(const float *x, int64_t M, int64_t K, const float *tile, int64_t rows, float *y, int64_t N,
                      int64_t n0) {
    const char *none = 0;
    f32_tile_passes(x, M, K, tile, y + n0, N, 0, rows, &none, none);
}

typedef struct { const float *x; int64_t H, stride; const float *w; float eps; float *out; } norm_args;

static void rms_norm_rows(const void *args, int64_t t0, int64_t t1) {
    const norm_args *a = args;
    const int64_t H = a->H;
    for (int64_t t = t0; t < t1; t++) {
        const float *xt = a->x + t * a->stride, *w = a->w;
        float *ot = a->out + t * H;
        __m256 acc = _mm256_setzero_ps();
        int64_t h = 0;
        for (; h + 8 <= H; h += 8) { __m256 v = _mm256_loadu_ps(xt + h); acc = _mm256_fmadd_ps(v, v, acc); }
        float ss = hsum(acc);
        for (; h < H; h++) ss += xt[h] * xt[h];
        const float r = 1.f / sqrtf(ss / (float)H + a->eps);
        const __m256 rv = _mm256_set1_ps(r);
        for (h = 0; h + 8 <= H; h += 8)
            _mm256_storeu_ps(ot + h, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xt + h), rv), _mm256_loadu_ps(w + h)));
        for (; h < H; h++) ot[h] = xt[h] * r * w[h];
    }
}

/* out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w for T rows of H floats (x rows `stride` floats apart) */
void rms_norm(const float *x, int64_t T, int64_t H, int64_t stride, const float *w, float eps, float *out,
              int nthreads) {
    norm_args a = {x, H, stride, w, eps, out};
    for_rows(rms_norm_rows, &a, T, T * H, nthreads);
}

typedef struct { const float *x; int64_t heads, D, stride; const float *cos_t, *sin_t; float *out; } rotary_args;

static void rotary_rows(const void *args, int64_t t0, int64_t t1) {
    const rotary_args *a = args;
    const int64_t D = a->D, half = D / 2, heads = a->heads;
    for (int64_t t = t0; t < t1; t++) {
        const float *c = a->cos_t + t * D, *sn = a->sin_t + t * D;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = a->x + t * a->stride + h * D;
            float *oh = a->out + (t * heads + h) * D;
            for (int64_t d = 0; d < half; d += 8) {
                const __m256 lo = _mm256_loadu_ps(xh + d), hi = _mm256_loadu_ps(xh + half + d);
                _mm256_storeu_ps(oh + d, _mm256_fnmadd_ps(hi, _mm256_loadu_ps(sn + d), _mm256_mul_ps(lo, _mm256_loadu_ps(c + d))));
                _mm256_storeu_ps(oh + half + d, _mm256_fmadd_ps(lo, _mm256_loadu_ps(sn + half + d),
                                                                _mm256_mul_ps(hi, _mm256_loadu_ps(c + half + d))));
            }
        }
    }
}

typedef struct { float *x; int64_t heads, D, stride; const float *w; float eps; } head_norm_args;

static void head_norm_rows(const void *args, int64_t t0, int64_t t1) {
    const head_norm_args *a = args;
    for (int64_t t = t0; t < t1; t++) {
        float *row = a->x + t * a->stride;
        norm_args n = {row, a->D, a->D, a->w, a->eps, row};   /* each head a row of D, normed in place */
        rms_norm_rows(&n, 0, a->heads);
    }
}

/* x[t][h] = rms_norm(x[t][h]) * w for T rows of `heads` heads of D floats (rows `stride` floats apart), in place:
 * the per-head q / k norms of Qwen3 */
static void head_norm(float *x, int64_t T, int64_t heads, int64_t D, int64_t stride, const float *w, float eps,
                      int nthreads) {
    head_norm_args a = {x, heads, D, stride, w, eps};
    for_rows(head_norm_rows, &a, T, T * heads * D, nthreads);
}

/* Rotate-half rotary embedding: out[t][h] = x[t][h] * cos[t] + rotate_half(x[t][h]) * sin[t], for T rows of
 * `heads` heads of D floats (x rows `stride` floats apart, heads contiguous); cos, sin [T][D]; D a multiple of 16 */
void rotary(const float *x, int64_t T, int64_t heads, int64_t D, int64_t stride, const float *cos_t,
            const float *sin_t, float *out, int nthreads) {
    rotary_args a = {x, heads, D, stride, cos_t, sin_t, out};
    for_rows(rotary_rows, &a, T, T * heads * D, nthreads);
}

/* silu(g) * u = g / (1 + e^-g) * u for vectors g, u: the arithmetic of silu_and_mul_rows (P _mm256, EXP exp256)
 * and silu_and_mul_bf16_rows (_mm512, exp512), one text so that both give the same results lane by lane */
#define SILU_TIMES(P, EXP, g, u) \
    P##_mul_ps(P##_div_ps(g, P##_add_ps(P##_set1_ps(1.f), EXP(P##_sub_ps(P##_setzero_ps(), g)))), u)

typedef struct { const float *x; int64_t I; float *out; } silu_args;

static void silu_and_mul_rows(const void *args, int64_t t0, int64_t t1) {
    const silu_args *a = args;
    const int64_t I = a->I;
    for (int64_t t = t0; t < t1; t++) {
        const float *g = a->x + t * 2 * I, *u = g + I;
        float *o = a->out + t * I;
        for (int64_t i = 0; i < I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            _mm256_storeu_ps(o + i, SILU_TIMES(_mm256, exp256, gv, _mm256_loadu_ps(u + i)));
        }
    }
}

/* out[t][i] = silu(x[t][i]) * x[t][I + i] for T rows of 2I floats; I a multiple of 8 */
void silu_and_mul(const float *x, int64_t T, int64_t I, float *out, int nthreads) {
    silu_args a = {x, I, out};
    for_rows(silu_and_mul_rows, &a, T, T * I, nthreads);
}

typedef struct { const float *x; int64_t I; uint16_t *out; } silu_bf16_args;

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static void silu_and_mul_bf16_rows(const void *args, int64_t t0, int64_t t1) {
    const silu_bf16_args *a = args;
    const int64_t I = a->I;
    for (int64_t t = t0; t < t1; t++) {
        const float *g = a->x + t * 2 * I, *u = g + I;
        uint16_t *o = a->out + t * I;
        for (int64_t i = 0; i < I; i += 16) {   /* silu_and_mul_rows' arithmetic, then rounded as round_to_bf16 */
            const __mmask16 m = lanes16(I - i);
            const __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
            const __m512 y = SILU_TIMES(_mm512, exp512, gv, _mm512_maskz_loadu_ps(m, u + i));
            _mm256_mask_storeu_epi16(o + i, m, (__m256i)_mm512_cvtneps_pbh(y));
        }
    }
}

/* silu_and_mul's out rounded to bfloat16 (nearest even) as it is written: the input of a product through
 * bf16_panels_product_rounded, one pass fewer than silu_and_mul and then the product's own rounding; callers check
 * the CPU has AVX512_BF16 (bfloat16 panels) */
static void silu_and_mul_bf16(const float *x, int64_t T, int64_t I, uint16_t *out, int nthreads) {
    silu_bf16_args a = {x, I, out};
    for_rows(silu_and_mul_bf16_rows, &a, T, T * I, nthreads);
}

typedef struct { const float *x, *y; float *sum; int64_t H; } add_args;

static void add_rows(const void *args, int64_t t0, int64_t t1) {
    const add_args *a = args;
    for (int64_t i = t0 * a->H; i < t1 * a->H; i++) a->sum[i] = a->x[i] + a->y[i];
}

/* sum = x + y over T rows of H floats (sum may be x: a residual added in place) */
static void add(const float *x, const float *y, float *sum, int64_t T, int64_t H, int nthreads) {
    add_args a = {x, y, sum, H};
    for_rows(add_rows, &a, T, T * H, nthreads);
}

typedef struct {
    const float *k; int64_t k_stride; const float *v; int64_t v_stride, row; const int64_t *slots;
    void *key_cache, *value_cache; int bf16;
} cache_args;

static void cache_rows(const void *args, int64_t t0, int64_t t1) {
    const cache_args *a = args;
    const int64_t row = a->row;
    for (int64_t t = t0; t < t1; t++) {
        const float *k = a->k + t * a->k_stride, *v = a->v + t * a->v_stride;
        if (a->bf16) {
            uint16_t *kc = (uint16_t *)a->key_cache + a->slots[t] * row;
            uint16_t *vc = (uint16_t *)a->value_cache + a->slots[t] * row;
            for (int64_t i = 0; i < row; i++) {
                kc[i] = float_to_bf16(k[i]);
                vc[i] = float_to_bf16(v[i]);
            }
        } else {
            memcpy((float *)a->key_cache + a->slots[t] * row, k, sizeof(float) * row);
            memcpy((float *)a->value_cache + a->slots[t] * row, v, sizeof(float) * row);
        }
    }
}

typedef struct { float *y; int64_t N; const float *bias; } bias_args;

static void bias_rows(const void *args, int64_t t0, int64_t t1) {
    const bias_args *a = args;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t i = 0; i < a->N; i++) a->y[t * a->N + i] += a->bias[i];
}

/* y[t] += bias for T rows of N floats */
static void add_bias(float *y, int64_t T, int64_t N, const float *bias, int nthreads) {
    bias_args a = {y, N, bias};
    for_rows(bias_rows, &a, T, T * N, nthreads);
}

/* the new keys and values of T rows (k, v: `row` floats each, k_stride / v_stride floats apart) into the cache
 * slots slots[t], as float32 or (bf16) bfloat16 rounded to nearest even */
static void write_cache(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t T, int64_t row,
                        const int64_t *slots, void *key_cache, void *value_cache, int bf16, int nthreads) {
    cache_args a = {k, k_stride, v, v_stride, row, slots, key_cache, value_cache, bf16};
    for_rows(cache_rows, &a, T, T * 2 * row, nthreads);
}

/* the weight type and quant_kernels.c's products: kernels.h */
#define QUANT_GEMV_MAX_ROWS 12      /* quantization.GEMV_MAX_ROWS: beyond, dequantized tiles (quant_gemm) win */

/* whether w is bfloat16 packed in panels: its products round x to bfloat16 first (bf16_panels_product) */
static int bf16_panels(const weight *w) {
    return w->bits == 16 && w->panels;
}

/* see weight_product.h */
int weight_product(const float *x, int64_t M, int64_t K, const weight *w, float *y, int64_t N, int nthreads) {
    if (w->bits == 32 && w->panels) {
        f32_panels_product(x, M, K, (const float *)w->data, y, N, nthreads, w->panels);
        return 0;
    }
    if (w->bits == 32) {
        f32_gemv(x, M, K, (const float *)w->data, y, N, nthreads);
        return 0;
    }
    if (bf16_panels(w)) return bf16_panels_product(x, M, K, (const uint16_t *)w->data, y, N, nthreads);
    if (w->bits == 16 && w->integer_rows && M >= w->integer_rows)
        return bf16_pairs_product(x, M, K, (const uint16_t *)w->data, y, N, nthreads);
    if (w->bits == 16) {
        bf16_gemv(x, M, K, (const uint16_t *)w->data, y, N, nthreads);
        return 0;
    }
    if (M <= QUANT_GEMV_MAX_ROWS)
        return quant_gemv(w->bits, x, M, K, w->data, w->scale, w->mins, w->gshift, y, N, nthreads, w->integer_isa);
    if (w->integer_rows && M >= w->integer_rows && w->gshift >= 62)
        return int8_gemm(x, M, K, (const int8_t *)w->data, w->scale, y, N, nthreads, w->integer_isa);
    if (w->integer_rows && M >= w->integer_rows)
        return group_gemm(w->bits, x, M, K, w->data, w->scale, w->mins, w->gshift, y, N, nthreads, w->integer_isa);
    return quant_gemm(w->bits, x, M, K, w->data, w->scale, w->mins, w->gshift, y, N, nthreads);
}

/* rows of prompt chunk i of n: from its first_row to the next chunk's (the last one's to T) */
static int64_t chunk_rows(const prompt_chunk *chunks, int64_t n, int64_t i, int64_t T) {
    return (i + 1 < n ? chunks[i + 1].first_row : T) - chunks[i].first_row;
}

/* The floats a row of a layer's scratch shares between the attention's q/k/v, rotated q/k and output and then, once
 * the o projection has read those, the MLP's gate/up and activation */
static int64_t shared_floats(int64_t I, int64_t NH, int64_t KVH, int64_t D) {
    const int64_t attention = (3 * NH + 3 * KVH) * D, mlp = 3 * I;
    return attention > mlp ? attention : mlp;
}

/* Scratch for a layer of T rows (this thread's SCRATCH_LAYERS buffer): `extra` floats (a stack's spare rows), a
 * norm's output, shared_floats, a product's output; and in *workspace, after them at a 64-byte boundary, the most any
 * of the prompt chunks' attention takes (its workspace at no window, the most a window leaves it); NULL if the memory
 * could not be had */
static float *layer_scratch(int64_t T, int64_t H, int64_t I, int64_t NH, int64_t KVH, int64_t D,
                            const prompt_chunk *chunks, int64_t n_chunks, int64_t extra, float **workspace) {
    const int64_t rows = extra + T * (2 * H + shared_floats(I, NH, KVH, D));
    int64_t spare = 0;
    for (int64_t i = 0; i < n_chunks; i++) {
        const int64_t need = prefill_attention_workspace(chunk_rows(chunks, n_chunks, i, T), chunks[i].p0, 0, KVH, D);
        spare = need > spare ? need : spare;
    }
    float *h = scratch_take(SCRATCH_LAYERS, sizeof(float) * (rows + (spare ? spare + 16 : 0)));
    if (h) *workspace = (float *)(((uintptr_t)(h + rows) + 63) & ~(uintptr_t)63);
    return h;
}

/* decode_layer's work in scratch h and workspace (layer_scratch's) */
static int layer_step(const float *x, float *x_out, int64_t T, int64_t H, const float *norm1, const float *norm2,
                      float eps, const weight *w_qkv, const weight *w_o, const weight *w_gate_up,
                      const weight *w_down, int64_t I, int64_t NH, int64_t KVH, int64_t D, const float *cos_t,
                      const float *sin_t, void *key_cache, void *value_cache, int kv_bf16, int avx512,
                      const int64_t *slots, const int64_t *tables, int64_t max_blocks, const int64_t *context_lens,
                      int64_t bs, int64_t window, float scale, const layer_extras *extras,
                      const prompt_chunk *chunks, int64_t n_chunks, float *h, float *workspace, int nthreads) {
    const int64_t QKV = (NH + 2 * KVH) * D, QK = (NH + KVH) * D, ROW = KVH * D;
    const int64_t decodes = n_chunks ? chunks[0].first_row : T;
    int status;
    pool_enter();
    float *qkv = h + T * H, *qk = qkv + T * QKV, *attn = qk + T * QK;
    float *gate_up = qkv, *act = gate_up + T * 2 * I, *y = qkv + T * shared_floats(I, NH, KVH, D);
    const float *sinks = extras ? extras->sink_logits : NULL;
    rms_norm(x, T, H, H, norm1, eps, h, nthreads);
    if ((status = weight_product(h, T, H, w_qkv, qkv, QKV, nthreads))) goto done;
    if (extras && extras->qkv_bias) add_bias(qkv, T, QKV, extras->qkv_bias, nthreads);
    if (extras && extras->q_norm) head_norm(qkv, T, NH, D, QKV, extras->q_norm, eps, nthreads);
    if (extras && extras->k_norm) head_norm(qkv + NH * D, T, KVH, D, QKV, extras->k_norm, eps, nthreads);
    rotary(qkv, T, NH + KVH, D, QKV, cos_t, sin_t, qk, nthreads);
    write_cache(qk + NH * D, QK, qkv + QK, QKV, T, ROW, slots, key_cache, value_cache, kv_bf16, nthreads);
    if (decodes)
        paged_decode_attention(qk, QK, key_cache, value_cache, kv_bf16, tables, max_blocks, context_lens, decodes, NH,
                               KVH, D, bs, window, scale, sinks, attn, avx512, nthreads);
    for (int64_t i = 0; i < n_chunks; i++) {
        const prompt_chunk *c = &chunks[i];
        paged_prefill_attention(qk + c->first_row * QK, QK, key_cache, value_cache, kv_bf16, c->table,
                                chunk_rows(chunks, n_chunks, i, T), c->p0, NH, KVH, D, bs, window, scale, sinks,
                                attn + c->first_row * NH * D, workspace, avx512, nthreads);
    }
    if ((status = weight_product(attn, T, NH * D, w_o, y, H, nthreads))) goto done;
    if (extras && extras->o_bias) add_bias(y, T, H, extras->o_bias, nthreads);
    add(x, y, x_out, T, H, nthreads);
    rms_norm(x_out, T, H, H, norm2, eps, h, nthreads);
    if (extras && extras->moe) {   /* a mixture of experts instead of the dense MLP */
        if ((status = moe_mlp(h, T, H, extras->moe, y, nthreads))) goto done;
    } else if ((status = weight_product(h, T, H, w_gate_up, gate_up, 2 * I, nthreads))) {
        goto done;
    } else if (bf16_panels(w_down)) {   /* the activation straight to bfloat16, the product's input */
        silu_and_mul_bf16(gate_up, T, I, (uint16_t *)act, nthreads);
        bf16_panels_product_rounded((const uint16_t *)act, T, I, (const uint16_t *)w_down->data, y, H, nthreads);
    } else {
        silu_and_mul(gate_up, T, I, act, nthreads);
        if ((status = weight_product(act, T, I, w_down, y, H, nthreads))) goto done;
    }
    add(x_out, y, x_out, T, H, nthreads);
done:
    pool_exit();
    return status;
}

/* One Llama decoder layer for a step's T rows, all in this call: decode rows (one new token per sequence), then
 * n_chunks prompt chunks (chunks[i]'s rows from its first_row to the next one's, the last one's to T):
 *   h = norm1(x); q, k, v = qkv(h); q, k = rotary(q, k); cache[slots] = k, v; a = attention(q, paged cache)
 *   x' = x + o(a); x_out = x' + down(silu(gate) * up)(norm2(x'))
 * the same kernels as the separate calls (so the same results), without the ~15 torch and ctypes dispatches a
 * layer that otherwise cost more than the arithmetic at one row, and (a prompt's forward layer by layer, in
 * Python) a third of a short prompt's time. Weights [out][in], no biases; qkv rows are q (NH heads), k, v (KVH
 * heads each); cos, sin [T][D]; slots [T] the cache slot of each row's new K/V; the caches hold float32, or
 * bfloat16 when kv_bf16 (the new K/V rounded to nearest even, as torch rounds); tables, context_lens: the decode
 * rows' (paged_decode_attention's); kv_bf16 the cache's kind and avx512 whether they may use AVX-512, for both
 * attention kernels. extras (or NULL): q/k norms
 * after the qkv product (Qwen3), biases after the qkv and o products and the attention's sink logits (gpt-oss), and
 * a mixture of experts (moe.c's moe_mlp) in place of the dense MLP (whose weights and I it then leaves unread).
 * Returns 0, or KERNEL_OUT_OF_MEMORY when scratch memory (its own or a quantized product's) could not be had. */
int decode_layer(const float *x, float *x_out, int64_t T, int64_t H, const float *norm1, const float *norm2,
                 float eps, const weight *w_qkv, const weight *w_o, const weight *w_gate_up, const weight *w_down,
                 int64_t I, int64_t NH, int64_t KVH, int64_t D, const float *cos_t, const float *sin_t,
                 void *key_cache, void *value_cache, int kv_bf16, int avx512, const int64_t *slots,
                 const int64_t *tables, int64_t max_blocks, const int64_t *context_lens, int64_t bs, int64_t window,
                 float scale, const layer_extras *extras, const prompt_chunk *chunks, int64_t n_chunks,
                 int nthreads) {
    float *workspace, *h = layer_scratch(T, H, I, NH, KVH, D, chunks, n_chunks, 0, &workspace);
    if (!h) return KERNEL_OUT_OF_MEMORY;
    return layer_step(x, x_out, T, H, norm1, norm2, eps, w_qkv, w_o, w_gate_up, w_down, I, NH, KVH, D, cos_t, sin_t,
                      key_cache, value_cache, kv_bf16, avx512, slots, tables, max_blocks, context_lens, bs, window,
                      scale, extras, chunks, n_chunks, h, workspace, nthreads);
}

/* The decoder stack of a step of decodes and prompt chunks after them: decode_layer for each of L layers in turn
 * (x -> x_out), one call for the whole model instead of one per layer from Python, with one scratch for all of
 * them (a prompt step's is tens of MB: scratch.c keeps it from step to step, its pages faulted in once). Per
 * layer l: norms norm1[l], norm2[l]; weights weights[4 l .. 4 l + 3] (qkv, o, gate_up, down); its cache
 * key_caches[l], value_caches[l]; windows[l]; extras[l] (extras NULL: none for any); its KV group's slots, block
 * tables, context lengths and chunks, groups[layer_groups[l]] (layer_groups NULL: groups[0] for every layer). I is
 * the dense layers' MLP width. Returns 0, or KERNEL_OUT_OF_MEMORY (then stops at that layer). */
int decode_layers(int64_t L, const float *x, float *x_out, int64_t T, int64_t H, const float *const *norm1,
                  const float *const *norm2, float eps, const weight *weights, int64_t I, int64_t NH, int64_t KVH,
                  int64_t D, const float *cos_t, const float *sin_t, void *const *key_caches,
                  void *const *value_caches, int kv_bf16, int avx512, const kv_group *groups,
                  const int64_t *layer_groups, int64_t bs, const int64_t *windows, float scale,
                  const layer_extras *extras, int64_t n_chunks, int nthreads) {
    const prompt_chunk *chunks = n_chunks ? groups[0].chunks : NULL;   /* their rows: the same in every group */
    float *workspace, *spare = layer_scratch(T, H, I, NH, KVH, D, chunks, n_chunks, T * H, &workspace);
    float *h = spare ? spare + T * H : NULL;
    int status = spare ? 0 : KERNEL_OUT_OF_MEMORY;
    const float *in = x;
    for (int64_t l = 0; l < L && status == 0; l++) {
        float *out = (L - 1 - l) % 2 == 0 ? x_out : spare;     /* alternate, ending in x_out */
        const kv_group *g = &groups[layer_groups ? layer_groups[l] : 0];
        status = layer_step(in, out, T, H, norm1[l], norm2[l], eps, &weights[4 * l], &weights[4 * l + 1],
                            &weights[4 * l + 2], &weights[4 * l + 3], I, NH, KVH, D, cos_t, sin_t, key_caches[l],
                            value_caches[l], kv_bf16, avx512, g->slots, g->tables, g->max_blocks, g->context_lens, bs,
                            windows[l], scale, extras ? &extras[l] : NULL, g->chunks, n_chunks, h, workspace,
                            nthreads);
        in = out;
    }
    return status;
}
