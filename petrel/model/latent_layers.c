/* DeepSeek-V2 / V3 decoder layers (multi-head latent attention, then a dense MLP or a mixture of experts) for a
 * step of decode rows, all layers in one call (petrel/model/latent_stack.py), loaded with ctypes (native.py).
 *
 * Per layer and row (petrel/model/mla.py says why each step computes what the torch path computes):
 *   h = norm1(x)
 *   q = q_b(norm(q_a(h)))  (or q_proj(h) without a q_lora_rank): per head nope values, then rope
 *   c = kv_a(h): the latent (rank values, then normed) and the rotary key (rope values)
 *   q_pe, k_pe rotated (rotate-half); the cache row [latent, k_pe] written at the row's slot
 *   query_h = [W_UK_h^T q_nope_h, q_pe_h]            (absorb: W_UK [heads][nope][rank], read once for all rows)
 *   latent_h = attention of query_h over the row's cache rows as they are (latent_attention.c)
 *   a_h = W_UV_h latent_h                             (expand: W_UV [heads][v][rank])
 *   x' = x + o(a); x_out = x' + mlp(norm2(x'))        (dense: down(silu(gate) * up); or moe.c's moe_mlp)
 * Products go through dense_kernels.c's weight_product (float32 rows or panels, bfloat16, quantized codes); the
 * absorb and expand steps split the heads over the threads. Prompt chunks are not taken here: those steps run the
 * layers' modules (they decompress the latent, which this file never does). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "scratch.h"
#include "simd.h"
#include "thread_pool.h"
#include "weight_product.h"

/* rows rotated in place, rotate-half: for T rows of `heads` vectors of D values (head h of row t at
 * x + t * row_stride + h * head_stride), lo' = lo cos - hi sin, hi' = hi cos + lo sin with cos, sin [T][D] (their
 * halves equal, as RotaryEmbedding lays them out); D even */
static void rotate_rows(float *x, int64_t T, int64_t heads, int64_t D, int64_t row_stride, int64_t head_stride,
                        const float *cos_t, const float *sin_t) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + t * D, *s = sin_t + t * D;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * row_stride + h * head_stride;
            int64_t d = 0;
            for (; d + 8 <= half; d += 8) {
                const __m256 lo = _mm256_loadu_ps(v + d), hi = _mm256_loadu_ps(v + half + d);
                _mm256_storeu_ps(v + d, _mm256_fnmadd_ps(hi, _mm256_loadu_ps(s + d),
                                                         _mm256_mul_ps(lo, _mm256_loadu_ps(c + d))));
                _mm256_storeu_ps(v + half + d, _mm256_fmadd_ps(lo, _mm256_loadu_ps(s + half + d),
                                                               _mm256_mul_ps(hi, _mm256_loadu_ps(c + half + d))));
            }
            for (; d < half; d++) {   /* the same arithmetic, a value at a time (fused as the vectors are) */
                const float lo = v[d], hi = v[half + d];
                v[d] = fmaf(-hi, s[d], lo * c[d]);
                v[half + d] = fmaf(lo, s[half + d], hi * c[half + d]);
            }
        }
    }
}

/* One layer's per-head products over T rows: absorb (out[t][h][0..rank) = sum over n of q[t][h][n] W_UK[h][n][.])
 * or expand (out[t][h][j] = latent[t][h] . W_UV[h][j]) */
typedef struct {
    const float *in; int64_t in_row, in_head;     /* in[t][h] at in + t * in_row + h * in_head */
    const float *w;                               /* [heads][n][m]: W_UK ([nope][rank]) or W_UV ([v][rank]) */
    float *out; int64_t out_row, out_head;
    int64_t T, heads, n, m;
} head_products_args;

/* absorb: each head's nope rows of W_UK scaled by the row's query values and summed, the running sum in L1 */
static void absorb_heads(void *args, int t, int T) {
    const head_products_args *a = args;
    int64_t h0, h1;
    split_range(a->heads, t, T, 1, &h0, &h1);
    for (int64_t h = h0; h < h1; h++) {
        const float *w = a->w + h * a->n * a->m;
        for (int64_t r = 0; r < a->T; r++) memset(a->out + r * a->out_row + h * a->out_head, 0, sizeof(float) * a->m);
        for (int64_t i = 0; i < a->n; i++) {
            const float *wi = w + i * a->m;
            for (int64_t r = 0; r < a->T; r++) {
                const __m256 q = _mm256_set1_ps(a->in[r * a->in_row + h * a->in_head + i]);
                float *o = a->out + r * a->out_row + h * a->out_head;
                for (int64_t j = 0; j < a->m; j += 8)
                    _mm256_storeu_ps(o + j, _mm256_fmadd_ps(q, _mm256_loadu_ps(wi + j), _mm256_loadu_ps(o + j)));
            }
        }
    }
}

/* expand: each output value a dot product of the head's latent with a row of W_UV */
static void expand_heads(void *args, int t, int T) {
    const head_products_args *a = args;
    int64_t h0, h1;
    split_range(a->heads, t, T, 1, &h0, &h1);
    for (int64_t h = h0; h < h1; h++) {
        const float *w = a->w + h * a->n * a->m;
        for (int64_t i = 0; i < a->n; i++) {
            const float *wi = w + i * a->m;
            for (int64_t r = 0; r < a->T; r++) {
                const float *x = a->in + r * a->in_row + h * a->in_head;
                __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
                for (int64_t j = 0; j < a->m; j += 16) {
                    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(wi + j), acc0);
                    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 8), _mm256_loadu_ps(wi + j + 8), acc1);
                }
                a->out[r * a->out_row + h * a->out_head + i] = hsum(_mm256_add_ps(acc0, acc1));
            }
        }
    }
}

/* the cache rows [latent, k_pe] of T rows (c rows `stride` floats apart) at their slots, float32 or bfloat16 */
static void write_latent_rows(const float *c, int64_t stride, int64_t T, int64_t W, const int64_t *slots, void *cache,
                              int bf16) {
    for (int64_t t = 0; t < T; t++) {
        const float *row = c + t * stride;
        if (bf16) {
            uint16_t *dst = (uint16_t *)cache + slots[t] * W;
            for (int64_t i = 0; i < W; i++) dst[i] = float_to_bf16(row[i]);
        } else {
            memcpy((float *)cache + slots[t] * W, row, sizeof(float) * W);
        }
    }
}

/* The floats of a step's scratch for T rows (latent_decode_layers lays them out in this order) */
static int64_t scratch_floats(int64_t T, int64_t H, const latent_shape *s, int64_t inter) {
    const int64_t qk = s->nope + s->rope, W = s->rank + s->rope;
    const int64_t mlp = 3 * inter, attention = s->q_lora + s->heads * qk + W + s->heads * (W + s->rank + s->v_dim);
    return T * (2 * H + (mlp > attention ? mlp : attention));
}

/* one layer: x -> x_out (see the top of this file); h, work: scratch */
static int latent_layer_step(const latent_layer *l, const latent_shape *s, const float *x, float *x_out, int64_t T,
                             int64_t H, const float *cos_t, const float *sin_t, int kv_bf16, const int64_t *slots,
                             const int64_t *tables, int64_t max_blocks, const int64_t *context_lens, int64_t bs,
                             float *h, float *y, float *work, int nthreads) {
    const int64_t NH = s->heads, qk = s->nope + s->rope, W = s->rank + s->rope, R = s->rank;
    float *const qa = work, *const q = qa + T * s->q_lora, *const c = q + T * NH * qk, *const query = c + T * W;
    float *const latent = query + T * NH * W, *const attn = latent + T * NH * R;
    int status;
    rms_norm(x, T, H, H, l->norm1, s->eps, h, nthreads);
    if (l->q_a.data) {
        if ((status = weight_product(h, T, H, &l->q_a, qa, s->q_lora, nthreads))) return status;
        rms_norm(qa, T, s->q_lora, s->q_lora, l->q_a_norm, s->latent_eps, qa, nthreads);
        if ((status = weight_product(qa, T, s->q_lora, &l->q_b, q, NH * qk, nthreads))) return status;
    } else if ((status = weight_product(h, T, H, &l->q_b, q, NH * qk, nthreads))) {
        return status;
    }
    if ((status = weight_product(h, T, H, &l->kv_a, c, W, nthreads))) return status;
    for (int64_t t = 0; t < T; t++)   /* the latent part of each row, in place */
        rms_norm(c + t * W, 1, R, R, l->kv_a_norm, s->latent_eps, c + t * W, 1);
    rotate_rows(q + s->nope, T, NH, s->rope, NH * qk, qk, cos_t, sin_t);
    rotate_rows(c + R, T, 1, s->rope, W, 0, cos_t, sin_t);
    write_latent_rows(c, W, T, W, slots, l->cache, kv_bf16);
    for (int64_t t = 0; t < T; t++)   /* each head's rotary query part beside its absorbed part */
        for (int64_t hd = 0; hd < NH; hd++)
            memcpy(query + (t * NH + hd) * W + R, q + t * NH * qk + hd * qk + s->nope, sizeof(float) * s->rope);
    head_products_args absorb = {q, NH * qk, qk, l->w_uk, query, NH * W, W, T, NH, s->nope, R};
    parallel_run(absorb_heads, &absorb, nthreads);
    if (paged_latent_decode_attention(query, NH * W, l->cache, kv_bf16, tables, max_blocks, context_lens, T, NH, W, R,
                                      bs, s->scale, latent, nthreads))
        return KERNEL_OUT_OF_MEMORY;
    head_products_args expand = {latent, NH * R, R, l->w_uv, attn, NH * s->v_dim, s->v_dim, T, NH, s->v_dim, R};
    parallel_run(expand_heads, &expand, nthreads);
    if ((status = weight_product(attn, T, NH * s->v_dim, &l->o, y, H, nthreads))) return status;
    for (int64_t i = 0; i < T * H; i++) x_out[i] = x[i] + y[i];
    rms_norm(x_out, T, H, H, l->norm2, s->eps, h, nthreads);
    if (l->moe) {
        if ((status = moe_mlp(h, T, H, l->moe, y, nthreads))) return status;
    } else {
        float *const gate_up = work, *const act = gate_up + T * 2 * l->inter;
        if ((status = weight_product(h, T, H, &l->gate_up, gate_up, 2 * l->inter, nthreads))) return status;
        silu_and_mul(gate_up, T, l->inter, act, nthreads);
        if ((status = weight_product(act, T, l->inter, &l->down, y, H, nthreads))) return status;
    }
    for (int64_t i = 0; i < T * H; i++) x_out[i] += y[i];
    return 0;
}

/* see kernels.h */
int latent_decode_layers(int64_t L, const latent_layer *layers, const latent_shape *shape, const float *x,
                         float *x_out, int64_t T, int64_t H, const float *cos_t, const float *sin_t, int kv_bf16,
                         const int64_t *slots, const int64_t *tables, int64_t max_blocks,
                         const int64_t *context_lens, int64_t bs, int nthreads) {
    int64_t inter = 0;
    for (int64_t l = 0; l < L; l++) inter = layers[l].inter > inter ? layers[l].inter : inter;
    float *const h = scratch_take(SCRATCH_LAYERS, sizeof(float) * (scratch_floats(T, H, shape, inter) + T * H));
    if (!h) return KERNEL_OUT_OF_MEMORY;
    float *const y = h + T * H, *const spare = y + T * H, *const work = spare + T * H;
    int status = 0;
    const float *in = x;
    pool_enter();
    for (int64_t l = 0; l < L && status == 0; l++) {
        float *out = (L - 1 - l) % 2 == 0 ? x_out : spare;   /* alternate, ending in x_out */
        status = latent_layer_step(&layers[l], shape, in, out, T, H, cos_t, sin_t, kv_bf16, slots, tables,
                                   max_blocks, context_lens, bs, h, y, work, nthreads);
        in = out;
    }
    pool_exit();
    return status;
}
