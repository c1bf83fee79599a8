/* The functions petrel's kernel library exports, declared once: every kernel file includes this header, so the
 * compiler checks each definition against it, and petrel/model/native.py reads it to give ctypes each function's
 * argument and result types (tests/test_native_kernels.py checks the Python call sites against it).
 *
 * native.py's reader takes plain prototypes only: one declaration per function, parameters of the types
 * int, int32_t, int64_t, float or pointers (any pointer is a void pointer to ctypes); results void, int, int64_t or
 * const char *. A function returning `int` returns a status: 0, or KERNEL_OUT_OF_MEMORY when its scratch memory
 * could not be allocated (its output then holds nothing meaningful and the caller raises MemoryError). */
#pragma once
#include <stdint.h>

#define KERNEL_OUT_OF_MEMORY 1

/* A projection's weight [N][K] (dense_kernels.Weight mirrors it, field for field): float32 rows (bits 32, data
 * only), bfloat16 rows (bits 16, data only: products of the weights widened to float32, or from integer_rows
 * rows, if not 0, of x rounded to bfloat16 too: bf16_pairs_product), or quant_kernels.c's codes (bits 4 or 8)
 * with their float32 scale and min per group of 2^gshift (mins may be NULL; 4-bit codes without mins are MXFP4,
 * their scale one E8M0 byte a group of 32: quant_kernels.c); integer_rows: from this many rows
 * of x its products run in integers with integer_isa's kernel (int8_gemm.c for 8-bit codes with one scale a row
 * and no mins, gshift >= 62; group_gemm.c for groups), 0 never. panels (bits 32 or 16), if not 0: the weights
 * packed in panels of 32 columns, not rows (panels.c): float32 ones multiplied by f32_panels_product with the blocks
 * of the ISA `panels` names (PANELS_AVX512 or PANELS_AVX2, callers check the CPU), bfloat16 ones (panels 1) by
 * bf16_panels_product, x always rounded to bfloat16. */
#define PANELS_AVX512 1
#define PANELS_AVX2 2
typedef struct {
    const void *data;
    const float *scale;
    const float *mins;
    int32_t bits;
    int32_t gshift;
    int32_t integer_rows;
    int32_t integer_isa;
    int32_t panels;
} weight;

/* dense_kernels.c */
void f32_gemv(const float *x, int64_t M, int64_t K, const float *W, float *y, int64_t N, int nthreads);
void bf16_gemv(const float *x, int64_t M, int64_t K, const uint16_t *W, float *y, int64_t N, int nthreads);
void f32_tile_product(const float *x, int64_t M, int64_t K, const float *tile, int64_t rows, float *y, int64_t N,
                      int64_t n0);
void paged_decode_attention(const float *q, int64_t q_stride, const void *key_cache, const void *value_cache,
                            int kv_bf16, const int64_t *tables, int64_t max_blocks, const int64_t *context_lens,
                            int64_t S, int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t window,
                            float scale, const float *sinks, float *out, int avx512, int nthreads);
int paged_latent_decode_attention(const float *q, int64_t q_stride, const void *cache, int kv_bf16,
                                  const int64_t *tables, int64_t max_blocks, const int64_t *context_lens, int64_t S,
                                  int64_t H, int64_t W, int64_t R, int64_t bs, float scale, float *out, int nthreads);
void rms_norm(const float *x, int64_t T, int64_t H, int64_t stride, const float *w, float eps, float *out,
              int nthreads);
void rotary(const float *x, int64_t T, int64_t heads, int64_t D, int64_t stride, const float *cos_t,
            const float *sin_t, float *out, int nthreads);
void silu_and_mul(const float *x, int64_t T, int64_t I, float *out, int nthreads);
/* A step's prompt chunk after its decode rows (decode_layer, decode_layers take an array of them, in row order;
 * dense_kernels.PromptChunk mirrors it): rows from first_row to the next chunk's first_row (the last chunk's to T)
 * are one prompt's positions p0, p0 + 1, ..., attending causally through its block table (the cache already holding
 * them) as paged_prefill_attention does, with the layer's kv_bf16 and avx512. */
typedef struct {
    int64_t first_row;
    const int64_t *table;
    int64_t p0;
} prompt_chunk;
/* What the experts of a mixture do beyond SiLU-and-multiply between unbiased products (dense_kernels.MoeAct mirrors
 * it): gate_up_bias [local experts][2 inter] added after the gate/up product, down_bias [local experts][H] after
 * the down product (NULL: none); swiglu 1: gpt-oss's clamped SwiGLU (clamp(up, -limit, limit) + 1) * g *
 * sigmoid(alpha g), g = min(gate, limit), instead of silu(gate) * up */
typedef struct {
    const float *gate_up_bias;
    const float *down_bias;
    int64_t swiglu;
    float alpha;
    float limit;
} moe_act;
/* A mixture of experts in place of a layer's dense MLP (dense_kernels.MoeLayer mirrors it, field for field): a
 * float32 router [experts][H] whose softmax's top_k experts each row takes (their probabilities renormalised to sum
 * 1 if renormalize), this rank's experts first .. first + num_local - 1 with weights gate_up[e] [2 inter][H] and
 * down[e] [H][inter] (moe.c's moe_experts), tokens routed added to routed[expert] (int64, or NULL); with
 * shared_inter > 0 a shared expert every row takes (shared_gate_up [2 shared_inter][H], shared_down [H][shared_inter])
 * scaled by sigmoid(shared_gate . x) (shared_gate [1][H]); router_bias [experts] (or NULL) added to the router's
 * logits, topk_softmax 1 for the top_k logits and then a softmax over those k (gpt-oss), act the experts' biases and
 * activation (moe_act). DeepSeek's routers: sigmoid 1 for sigmoid scores instead of the softmax; choice_bias
 * [experts] (or NULL) added to the scores for choosing only; with n_group > 1 the experts in n_group groups, each
 * scored by its best choice (or the sum of its best two with group_top2), only the topk_group best groups'
 * experts chosen; the weights (the unbiased scores of the chosen) times routed_scaling (1 for the others). A shared
 * expert with shared_gate.data NULL is added unscaled. */
typedef struct {
    const float *router;
    const weight *gate_up;
    const weight *down;
    int64_t *routed;
    int64_t experts;
    int64_t top_k;
    int64_t renormalize;
    int64_t first;
    int64_t num_local;
    int64_t inter;
    weight shared_gate_up;
    weight shared_down;
    weight shared_gate;
    int64_t shared_inter;
    const float *router_bias;
    int64_t topk_softmax;
    moe_act act;
    int64_t sigmoid;
    int64_t n_group;
    int64_t topk_group;
    int64_t group_top2;
    const float *choice_bias;
    float routed_scaling;
} moe_layer;
/* What a layer holds beyond a plain Llama layer (dense_kernels.LayerExtras mirrors it): RMS norms over each head of q
 * and of k before rotary, with the layer's eps (q_norm, k_norm [D], or NULL: Qwen3's), a mixture of experts
 * instead of the dense MLP (moe, or NULL), biases added after the qkv product ([(NH + 2 KVH) D]) and the o product
 * ([H]), and each query head's sink logit in its attention softmax (sink_logits [NH]: gpt-oss's), each NULL if
 * none */
typedef struct {
    const float *q_norm;
    const float *k_norm;
    const moe_layer *moe;
    const float *qkv_bias;
    const float *o_bias;
    const float *sink_logits;
} layer_extras;
int decode_layer(const float *x, float *x_out, int64_t T, int64_t H, const float *norm1, const float *norm2,
                 float eps, const weight *w_qkv, const weight *w_o, const weight *w_gate_up, const weight *w_down,
                 int64_t I, int64_t NH, int64_t KVH, int64_t D, const float *cos_t, const float *sin_t,
                 void *key_cache, void *value_cache, int kv_bf16, int avx512, const int64_t *slots,
                 const int64_t *tables, int64_t max_blocks, const int64_t *context_lens, int64_t bs, int64_t window,
                 float scale, const layer_extras *extras, const prompt_chunk *chunks, int64_t n_chunks,
                 int nthreads);
/* A step as one KV group's layers see it (a model whose layers keep different blocks, gpt-oss's windowed and full
 * ones, has a group for each kind; dense_kernels.KvGroup mirrors it): the rows' cache slots [T], the decode rows'
 * block tables [decodes][max_blocks] and context lengths [decodes], and the prompt chunks (n_chunks, the same rows
 * in every group, their tables the group's) */
typedef struct {
    const int64_t *slots;
    const int64_t *tables;
    int64_t max_blocks;
    const int64_t *context_lens;
    const prompt_chunk *chunks;
} kv_group;
int decode_layers(int64_t L, const float *x, float *x_out, int64_t T, int64_t H, const float *const *norm1,
                  const float *const *norm2, float eps, const weight *weights, int64_t I, int64_t NH, int64_t KVH,
                  int64_t D, const float *cos_t, const float *sin_t, void *const *key_caches,
                  void *const *value_caches, int kv_bf16, int avx512, const kv_group *groups,
                  const int64_t *layer_groups, int64_t bs, const int64_t *windows, float scale,
                  const layer_extras *extras, int64_t n_chunks, int nthreads);

/* latent_layers.c: DeepSeek's decoder layers (multi-head latent attention, then a dense MLP or a mixture of experts)
 * for a step of T decode rows (dense_kernels.LatentLayer and LatentShape mirror these, field for field). A layer: its
 * norms [H]; q_a [q_lora][H] with q_a_norm [q_lora] then q_b [heads (nope + rope)][q_lora], or (q_a.data NULL) q_b
 * the whole query projection [heads (nope + rope)][H]; kv_a [rank + rope][H] with kv_a_norm [rank]; w_uk [heads][nope]
 * [rank] and w_uv [heads][v][rank] float32; o [H][heads v]; a dense MLP (gate_up [2 inter][H], down [H][inter]) or
 * moe (not NULL); its latent cache [blocks][bs][rank + rope], float32 or (kv_bf16) bfloat16. */
typedef struct {
    const float *norm1;
    const float *norm2;
    weight q_a;
    const float *q_a_norm;
    weight q_b;
    weight kv_a;
    const float *kv_a_norm;
    const float *w_uk;
    const float *w_uv;
    weight o;
    weight gate_up;
    weight down;
    int64_t inter;
    const moe_layer *moe;
    void *cache;
} latent_layer;
/* the shapes every layer shares: eps the layer norms', latent_eps q_a_norm's and kv_a_norm's, scale the softmax's */
typedef struct {
    int64_t heads;
    int64_t nope;
    int64_t rope;
    int64_t v_dim;
    int64_t rank;
    int64_t q_lora;
    float eps;
    float latent_eps;
    float scale;
} latent_shape;
/* x [T][H] -> x_out through L layers; cos, sin [T][rope]; slots [T]; tables [T][max_blocks], context_lens [T] the
 * rows' (paged_latent_decode_attention's). 0, or KERNEL_OUT_OF_MEMORY */
int latent_decode_layers(int64_t L, const latent_layer *layers, const latent_shape *shape, const float *x,
                         float *x_out, int64_t T, int64_t H, const float *cos_t, const float *sin_t, int kv_bf16,
                         const int64_t *slots, const int64_t *tables, int64_t max_blocks,
                         const int64_t *context_lens, int64_t bs, int nthreads);

/* prefill_attention.c */
int64_t prefill_attention_workspace(int64_t n, int64_t p0, int64_t window, int64_t KVH, int64_t D);
void paged_prefill_attention(const float *q, int64_t q_stride, const void *key_cache, const void *value_cache,
                             int kv_bf16, const int64_t *table, int64_t n, int64_t p0, int64_t H, int64_t KVH,
                             int64_t D, int64_t bs, int64_t window, float scale, const float *sinks, float *out,
                             float *workspace, int avx512, int nthreads);

/* gemm_avx512.c */
int64_t f32_gemm_workspace(int64_t K, int64_t N, int nthreads);
void f32_gemm(const float *x, int64_t M, int64_t K, const float *W, float *y, int64_t N, float *workspace,
              int nthreads);
void bf16_gemm(const float *x, int64_t M, int64_t K, const uint16_t *W, float *y, int64_t N, float *workspace,
               int nthreads);

/* bf16_pairs.c */
int bf16_pairs_product(const float *x, int64_t M, int64_t K, const uint16_t *W, float *y, int64_t N, int nthreads);

/* panels.c */
void f32_panels_product(const float *x, int64_t M, int64_t K, const float *W, float *y, int64_t N, int nthreads,
                        int isa);
int bf16_panels_product(const float *x, int64_t M, int64_t K, const uint16_t *W, float *y, int64_t N, int nthreads);

/* gemm_avx2.c */
int64_t f32_gemm_avx2_workspace(int64_t K, int64_t N, int nthreads);
void f32_gemm_avx2(const float *x, int64_t M, int64_t K, const float *W, float *y, int64_t N, float *workspace,
                   int nthreads);
void bf16_gemm_avx2(const float *x, int64_t M, int64_t K, const uint16_t *W, float *y, int64_t N, float *workspace,
                    int nthreads);

/* quant_kernels.c */
int quant_gemv(int bits, const float *x, int64_t M, int64_t K, const void *codes, const float *scale,
               const float *mins, int gshift, float *y, int64_t N, int nthreads, int isa);
int quant_gemm(int bits, const float *x, int64_t M, int64_t K, const void *codes, const float *scale,
               const float *mins, int gshift, float *y, int64_t N, int nthreads);
void quant_dequant(int bits, int64_t K, const void *codes, const float *scale, const float *mins, int gshift,
                   float *out, int64_t n0, int64_t n1, int nthreads);

/* int8_gemm.c; isa: which kernel (quant_kernels.int8_isa: one the CPU has), INT8_AVX512_VNNI or'ed with
 * INT8_ACTIVATIONS for activations rounded to 8 bits a group of 32 (group_gemm_q8.c) */
#define INT8_AVX2 0
#define INT8_AVX512 1          /* AVX-512 F + BW */
#define INT8_AVX512_VNNI 2     /* and AVX512_VNNI */
int int8_gemm(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scale, float *y, int64_t N,
              int nthreads, int isa);

/* group_gemm.c; isa as int8_gemm's, or'ed with INT8_ACTIVATIONS for activations rounded to 8 bits a group of 32
 * (group_gemm_q8.c: 4-bit codes; 8-bit ones in groups of 32 or more on AVX512_VNNI) instead of 16 a row */
#define INT8_ACTIVATIONS 4
int group_gemm(int bits, const float *x, int64_t M, int64_t K, const void *codes, const float *scale,
               const float *mins, int gshift, float *y, int64_t N, int nthreads, int isa);

/* moe.c: a mixture-of-experts layer's experts over a step's rows (ids, route_weights [T][k]; this rank's experts
 * first .. first + E - 1, their weights gate_up[E] [2I][H] and down[E] [H][I]; act their biases and activation, or
 * NULL for none and SiLU) */
int moe_experts(const float *x, int64_t T, int64_t H, int64_t I, int64_t k, const int64_t *ids,
                const float *route_weights, int64_t first, int64_t E, const weight *gate_up, const weight *down,
                const moe_act *act, float *out, int nthreads);

/* greedy_rows.c */
void greedy_rows(const float *x, int64_t rows, int64_t vocab, int64_t stride, int64_t *tokens, float *logprobs,
                 int nthreads);

/* build_info.c */
const char *kernels_source_digest(void);
