/* What prefill_attention.c (the packing and the work items) shares with each ISA's inner step (attend_keys in
 * prefill_attention.c for AVX2, prefill_attention_avx512.c for AVX-512) */
#pragma once
#include <stdint.h>

#define ROWS 6
#define GROUPS 8  /* row groups per work item: each block of keys is read once for all of their rows */
#define KEYS 256
#define MAX_D 256

typedef struct prefill_args prefill_args;

/* ROWS query rows of one KV head and their running softmax (max m, denominator l, unnormalized output o) */
typedef struct {
    float o[ROWS][MAX_D] __attribute__((aligned(64)));
    float qs[ROWS][MAX_D] __attribute__((aligned(64)));  /* the rows' queries times scale * log2(e) */
    const float *q[ROWS];
    float *out[ROWS];
    int64_t pos[ROWS];
    float m[ROWS], l[ROWS];
    float sink[ROWS];                         /* the rows' heads' sink logits times log2(e) (-inf: none) */
    int nr;                                   /* rows of the chunk in the group (the rest repeat its last row) */
} row_group;

/* The group's scores against keys kb .. kb+nk-1 (nk a multiple of 16, at most KEYS; kt: their tiles [nk/16][D][16],
 * vv: their value rows [nk][D]), masked, one online-softmax step per row, then the values into o */
typedef void (*attend_fn)(const prefill_args *a, row_group *rg, int64_t kb, int64_t nk, const float *kt,
                          const float *vv);

struct prefill_args {
    const float *q; int64_t q_stride; const void *key_cache, *value_cache; int kv_bf16; const int64_t *table;
    int64_t n, p0, H, KVH, D, bs, window, lo, L;     /* keys lo .. lo+L-1 packed (L a multiple of 16) */
    float scale; const float *sinks;                 /* sinks [H] or NULL: each head's sink logit */
    float *out, *kt, *v;                             /* kt [KVH][L/16][D][16], v [KVH][L][D] */
    int64_t tiles_per_head, next;
    attend_fn attend;
};

/* the mask of row r against keys kb .. kb+nk-1: -inf where the key is after the row's position or behind its
 * window (called only where some key of the block is masked for some row); only the masked keys are touched (a
 * test of every key cost more than the scores of the diagonal's blocks, which are all of a short prompt's) */
static inline void mask_scores(const prefill_args *a, const row_group *rg, int r, int64_t kb, int64_t nk, float *s) {
    const float masked = -(float)__builtin_inff();
    for (int64_t j = rg->pos[r] + 1 - kb > 0 ? rg->pos[r] + 1 - kb : 0; j < nk; j++) s[j] = masked;   /* after it */
    if (a->window > 0)
        for (int64_t j = 0; j < nk && kb + j <= rg->pos[r] - a->window; j++) s[j] = masked;          /* behind */
}

/* whether some key of kb .. kb+nk-1 is masked for some row of the group */
static inline int block_is_masked(const prefill_args *a, const row_group *rg, int64_t kb, int64_t nk) {
    return kb + nk - 1 > rg->pos[0] || (a->window > 0 && kb <= rg->pos[rg->nr - 1] - a->window);
}

void attend_keys_avx512(const prefill_args *a, row_group *rg, int64_t kb, int64_t nk, const float *kt,
                        const float *vv);
/* The same through AVX512_BF16's dpbf16 (kv_bf16 2): a bfloat16 cache, the queries and the softmax weights rounded
 * to bfloat16 (nearest even), two products an instruction. Its panels hold bfloat16 pairs, 32 bits an element: a
 * key tile [D/2][16] (keys j .. j+15, a dimension pair (d, d+1) of each) where the float tile [D][16] starts (its
 * first half), and values by key pairs, [L/2][D] (keys j, j+1 of each dimension) */
void attend_keys_pairs(const prefill_args *a, row_group *rg, int64_t kb, int64_t nk, const float *kt,
                       const float *vv);
/* The packing of two consecutive keys j, j + 1 (j even) of a KV head for attend_keys_pairs: their key rows ks[0],
 * ks[1] (D bfloat16 values each) into the tile at kt (word e of key j + i at kt[16 e + i]: kt points at key j's
 * lane), their value rows vs[0], vs[1] into the key pair's D pairs at v; a NULL row (past the context) packs as
 * zeros */
void pack_key_value_pairs(const uint16_t *const ks[2], const uint16_t *const vs[2], int64_t D, uint32_t *kt,
                          uint32_t *v);
