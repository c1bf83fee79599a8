/* Products of many rows with group-quantized weights times activations rounded to 8-bit integers, one scale a group
 * of 32, as llama.cpp's Q8 blocks do: group_gemm.c's products with half the integer work. The weights: 4-bit codes
 * (GGUF's Q4_0, Q4_1, Q4_K as quant_kernels.c lays them out: groups of 32, a scale and a min each), or 8-bit ones
 * (int8 codes [N][K], a scale per group of 2^gshift or per row, optional mins: quantization="int8", GGUF's Q8_0) on
 * AVX512_VNNI only. group_gemm() and int8_gemm() call this where the caller's isa carries INT8_ACTIVATIONS
 * (quant_kernels.integer_isa; PETREL_Q4_ACTIVATIONS=16 / PETREL_INT8_ACTIVATIONS=16 keep 16-bit ones).
 *
 * Each group g of row m of x becomes codes q (|q| <= 127) and a scale dx[m][g] = max|x| / 127 over its 32 values,
 * with Sx[m][g] = dx[m][g] * sum of q, and
 *     y[m][n] = sum_g dx[m][g] s[n][g] P[m][n][g] + z[n][g] Sx[m][g],   P = sum over k in g of c[n][k] q[m][k]
 * exact in int32. The weights' codes are the unsigned operand of the byte products: 4-bit codes c in 0..15 as they
 * are, z their group's min; a signed 8-bit code c as c + 128 in 0..255, so that P counts 128 sum q too, which
 * z = min - 128 s takes back. AVX512_VNNI's dpbusd adds four products a lane into int32 (8-bit codes: at most
 * 32 * 255 * 127 = 1,036,320 a group); without it maddubs adds pairs into int16 (4-bit codes only: at most 2 * 15 *
 * 127 = 3,810 a pair, eight quads of a group 30,480: no saturation, where 8-bit codes' pairs, up to 64,770, would
 * saturate), madd with ones then sums the pairs into int32 once a group.
 * The rounding moves each activation by at most half its group's step, max|x| / 254 (16-bit rows: max / 65534 of
 * the whole row); tests/test_group_gemm.py and tests/test_int8_gemm.py bound the effect on a model's logprobs.
 *
 * Blocks: AVX-512 6 x 32 (twelve int32 or int16 accumulators, twelve float), AVX2 3 x 16 (six and six), as in
 * group_gemm.c; each thread widens one panel of W at a time into k-quad-major bytes wp[K/4][width][4] and passes
 * every row of x over it. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "group_gemm_q8.h"
#include "group_panels.h"
#include "kernels.h"
#include "simd.h"
#include "thread_pool.h"

#define GROUP 32

/* rows [m0, m1) of x (K floats, K a multiple of 32) as int8 codes q[m][K], scales dx[m][G] and sums Sx[m][G] */
static void round_groups(const float *x, int64_t K, int64_t m0, int64_t m1, int8_t *q, float *dx, float *Sx) {
    const int64_t G = K / GROUP;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t m = m0; m < m1; m++)
        for (int64_t g = 0; g < G; g++) {
            const float *xg = x + m * K + g * GROUP;
            __m256 v[4], mx = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xg + 8 * i);
                mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            const float top = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
            float inv = 127.f / top;
            if (!(inv < __builtin_inff())) inv = 0.f;   /* an all-zero group (or one below 2^-120: taken as zeros) */
            __m256i c[4], sum = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
                sum = _mm256_add_epi32(sum, c[i]);
            }
            /* int32 -> int8 (no saturation: |c| <= 127); packs interleave 128-bit lanes, the permute restores k order */
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
            _mm256_storeu_si256((__m256i *)(q + m * K + g * GROUP), _mm256_permutevar8x32_epi32(bytes, order));
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
            dx[m * G + g] = top / 127.f;
            Sx[m * G + g] = top / 127.f * (float)_mm_cvtsi128_si32(s);
        }
}

/* 4-bit rows [n, n + nr) (codes [N][K/32][16] bytes: element i of a group low in byte i, 16 + i high) as a panel
 * wp[K/4][width][4] of bytes, zeros past nr. Eight rows at a time: a row's group is eight quads of k (the low
 * nibbles quads 0..3, the high ones 4..7), an 8 x 8 transpose of those quads makes each quad's eight rows. */
static void pack_panel_q4_quads(const uint8_t *codes, int64_t K, int64_t n, int nr, int width, uint8_t *wp) {
    const int64_t B = K / 2;   /* bytes a row */
    const __m128i mask = _mm_set1_epi8(0x0F);
    if (nr < width) memset(wp, 0, (size_t)K * width);
    int j0 = 0;
    for (; j0 + 8 <= nr; j0 += 8)
        for (int64_t k = 0; k < K; k += GROUP) {
            __m256i r[8];
            for (int i = 0; i < 8; i++) {
                const __m128i b = _mm_loadu_si128((const __m128i *)(codes + (n + j0 + i) * B + k / 2));
                r[i] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
            }
            transpose8(r);
            for (int p = 0; p < 8; p++) _mm256_storeu_si256((__m256i *)(wp + ((k / 4 + p) * width + j0) * 4), r[p]);
        }
    for (int j = j0; j < nr; j++)
        for (int64_t k = 0; k < K; k++) {
            const uint8_t b = codes[(n + j) * B + k / 32 * 16 + k % 16];
            wp[((k >> 2) * width + j) * 4 + (k & 3)] = (uint8_t)(k % 32 < 16 ? b & 0x0F : b >> 4);
        }
}

/* 8-bit rows [n, n + nr) (int8 codes [N][K]) as a panel wp[K/4][width][4] of bytes c + 128, zeros past nr: as
 * pack_panel_q4_quads, eight rows' 32 bytes of a group at a time transposed as 8 x 8 quads */
static void pack_panel_i8_quads(const int8_t *codes, int64_t K, int64_t n, int nr, int width, uint8_t *wp) {
    const __m256i offset = _mm256_set1_epi8((char)0x80);   /* c ^ 0x80 = c + 128 as an unsigned byte */
    if (nr < width) memset(wp, 0, (size_t)K * width);
    int j0 = 0;
    for (; j0 + 8 <= nr; j0 += 8)
        for (int64_t k = 0; k < K; k += GROUP) {
            __m256i r[8];
            for (int i = 0; i < 8; i++)
                r[i] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(codes + (n + j0 + i) * K + k)), offset);
            transpose8(r);
            for (int p = 0; p < 8; p++) _mm256_storeu_si256((__m256i *)(wp + ((k / 4 + p) * width + j0) * 4), r[p]);
        }
    for (int j = j0; j < nr; j++)
        for (int64_t k = 0; k < K; k++)
            wp[((k >> 2) * width + j) * 4 + (k & 3)] = (uint8_t)(codes[(n + j) * K + k] ^ 0x80);
}

/* rows [n, n + nr) of 8-bit codes' scales (and mins, or NULL), one per 2^gshift of k (gshift >= 62: one a row), as
 * [G][width] per group of 32, sp, and zp = min - 128 s (see above), zeros past nr */
static void pack_i8_groups(const float *scale, const float *mins, int64_t K, int gshift, int64_t G, int64_t n, int nr,
                           int width, float *sp, float *zp) {
    const int64_t per_row = gshift >= 62 ? 1 : K >> gshift;
    memset(sp, 0, sizeof(float) * G * width);
    memset(zp, 0, sizeof(float) * G * width);
    for (int j = 0; j < nr; j++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t i = (n + j) * per_row + (gshift >= 62 ? 0 : (g * GROUP) >> gshift);
            sp[g * width + j] = scale[i];
            zp[g * width + j] = (mins ? mins[i] : 0.f) - 128.f * scale[i];
        }
}

/* the four bytes at p as one int32 (to broadcast a quad of k) */
static inline int32_t quad_at(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The blocks, one macro for every width and step. Each takes MR rows of x's codes (K apart) with their scales dx
 * and sums Sx (G apart), one panel wp with its scales sp and mins zp ([G][NR]; zp NULL without mins), and writes
 * y rows [0, mr) x columns [0, nr) (ldy apart). VDOT(c, w, x) adds one quad's products into c; VSUM(c) turns c
 * into int32 sums at a group's end (maddubs's int16 pairs; nothing for VNNI). The integer accumulators are named
 * variables with an empty asm, as in int8_gemm.c (without it gcc keeps them in memory). */
#define ROWS3(F) F(0) F(1) F(2)
#define ROWS6(F) ROWS3(F) F(3) F(4) F(5)
#define ZERO_INT(i) VI c##i##0 = VZEROI(), c##i##1 = c##i##0;
#define STEP(i) \
    xb = VSET1I(quad_at(xg + i * K + 4 * p)); \
    c##i##0 = VDOT(c##i##0, w0, xb); \
    c##i##1 = VDOT(c##i##1, w1, xb); \
    __asm__("" : VKEEP(c##i##0), VKEEP(c##i##1));
#define FZERO(i) VF f##i##0 = VZEROF(), f##i##1 = f##i##0;
#define FSCALE(i) { \
    const VF d = VSET1F(dx[i * G + g]); \
    f##i##0 = VFMA(VCVT(VSUM(c##i##0)), VMUL(s0, d), f##i##0); \
    f##i##1 = VFMA(VCVT(VSUM(c##i##1)), VMUL(s1, d), f##i##1); }
#define FMINS(i) { \
    const VF sv = VSET1F(Sx[i * G + g]); \
    f##i##0 = VFMA(sv, z0, f##i##0); \
    f##i##1 = VFMA(sv, z1, f##i##1); }
#define FOUT(i) VSTOREF(tile[i], f##i##0); VSTOREF(tile[i] + VW, f##i##1);
#define Q8_BLOCK(name, isa, ROWS, MR) \
    __attribute__((target(isa))) static void name(const int8_t *x, int64_t K, const float *dx, const float *Sx, \
                                                  int64_t G, const uint8_t *wp, const float *sp, const float *zp, \
                                                  float *y, int64_t ldy, int mr, int nr) { \
        float tile[MR][2 * VW]; \
        ROWS(FZERO) \
        for (int64_t g = 0; g < G; g++) { \
            const int8_t *xg = x + GROUP * g; \
            ROWS(ZERO_INT) \
            for (int p = 0; p < GROUP / 4; p++, wp += 8 * VW) { \
                const VI w0 = VLOADI(wp), w1 = VLOADI(wp + 4 * VW); \
                VI xb; \
                ROWS(STEP) \
            } \
            const VF s0 = VLOADF(sp + g * 2 * VW), s1 = VLOADF(sp + g * 2 * VW + VW); \
            ROWS(FSCALE) \
            if (zp) { \
                const VF z0 = VLOADF(zp + g * 2 * VW), z1 = VLOADF(zp + g * 2 * VW + VW); \
                ROWS(FMINS) \
            } \
        } \
        ROWS(FOUT) \
        for (int i = 0; i < mr; i++) memcpy(y + i * ldy, tile[i], sizeof(float) * nr); \
    }

#define VECTOR_BITS 256
#include "vector_ops.h"
#define VDOT(c, w, x) _mm256_add_epi16(c, _mm256_maddubs_epi16(w, x))
#define VSUM(c) _mm256_madd_epi16(c, _mm256_set1_epi16(1))
Q8_BLOCK(block_3x16, "avx2,fma", ROWS3, 3)
#undef VDOT
#undef VSUM

#undef VECTOR_BITS
#define VECTOR_BITS 512
#include "vector_ops.h"
#define AVX512 "avx512f,avx512bw"
#define VDOT(c, w, x) _mm512_add_epi16(c, _mm512_maddubs_epi16(w, x))
#define VSUM(c) _mm512_madd_epi16(c, _mm512_set1_epi16(1))
Q8_BLOCK(block_avx512, AVX512, ROWS6, 6)
#undef VDOT
#undef VSUM
#define VDOT(c, w, x) _mm512_dpbusd_epi32(c, w, x)
#define VSUM(c) (c)
Q8_BLOCK(block_vnni, AVX512 ",avx512vnni", ROWS6, 6)

typedef void (*q8_block_fn)(const int8_t *x, int64_t K, const float *dx, const float *Sx, int64_t G,
                            const uint8_t *wp, const float *sp, const float *zp, float *y, int64_t ldy, int mr,
                            int nr);

typedef struct {
    int mr, nr;   /* the block's rows and columns */
    q8_block_fn block;
} q8_kernel;

static const q8_kernel KERNELS[] = {
    [INT8_AVX2] = {3, 16, block_3x16},
    [INT8_AVX512] = {6, 32, block_avx512},
    [INT8_AVX512_VNNI] = {6, 32, block_vnni},
};

typedef struct {
    const q8_kernel *k; int bits, gshift; const float *x; int64_t M, K, G; int8_t *q; float *dx, *Sx;
    const void *codes; const float *scale, *mins; float *y; int64_t N; uint8_t *panels; float *groups;
} q8_args;

static void round_part(void *args, int t, int T) {
    const q8_args *a = args;
    int64_t m0, m1;
    split_range(a->M, t, T, 1, &m0, &m1);
    round_groups(a->x, a->K, m0, m1, a->q, a->dx, a->Sx);
}

static void product_part(void *args, int t, int T) {
    const q8_args *a = args;
    const int MR = a->k->mr, NR = a->k->nr;
    const int64_t K = a->K, G = a->G, N = a->N;
    uint8_t *const panel = a->panels + t * K * NR;
    float *const sp = a->groups + t * 2 * G * NR, *const zp = a->mins || a->bits == 8 ? sp + G * NR : NULL;
    int64_t n0, n1;
    split_range(N, t, T, NR, &n0, &n1);
    for (int64_t n = n0; n < n1; n += NR) {
        const int nr = n1 - n < NR ? (int)(n1 - n) : NR;
        if (a->bits == 8) {
            pack_panel_i8_quads(a->codes, K, n, nr, NR, panel);
            pack_i8_groups(a->scale, a->mins, K, a->gshift, G, n, nr, NR, sp, zp);
        } else {
            pack_panel_q4_quads(a->codes, K, n, nr, NR, panel);
            pack_groups(a->scale, G, n, nr, NR, sp);
            if (zp) pack_groups(a->mins, G, n, nr, NR, zp);
        }
        for (int64_t m = 0; m < a->M; m += MR)
            a->k->block(a->q + m * K, K, a->dx + m * G, a->Sx + m * G, G, panel, sp, zp, a->y + m * N + n, N,
                        a->M - m < MR ? (int)(a->M - m) : MR, nr);
    }
}

/* see group_gemm_q8.h */
int group_gemm_q8(int bits, const float *x, int64_t M, int64_t K, const void *codes, const float *scale,
                  const float *mins, int gshift, float *y, int64_t N, int nthreads, int isa) {
    const q8_kernel *k = &KERNELS[isa];
    const int T = nthreads < 1 ? 1 : nthreads;
    const int64_t G = K / GROUP, Mp = (M + k->mr - 1) / k->mr * k->mr;
    /* floats first: dx and Sx [Mp][G], each thread's scales and mins [2][G][NR]; then q [Mp][K] and the panels */
    const int64_t floats = 2 * Mp * G + T * 2 * G * k->nr;
    float *dx = malloc(sizeof(float) * floats + (size_t)Mp * K + (size_t)T * K * k->nr);
    if (!dx) return KERNEL_OUT_OF_MEMORY;
    float *Sx = dx + Mp * G, *groups = Sx + Mp * G;
    int8_t *q = (int8_t *)(dx + floats);
    uint8_t *panels = (uint8_t *)q + Mp * K;
    memset(q + M * K, 0, (size_t)(Mp - M) * K);   /* the padding rows: zero codes, scales and sums */
    memset(dx + M * G, 0, sizeof(float) * (Mp - M) * G);
    memset(Sx + M * G, 0, sizeof(float) * (Mp - M) * G);
    q8_args a = {k, bits, gshift, x, M, K, G, q, dx, Sx, codes, scale, mins, y, N, panels, groups};
    parallel_run(round_part, &a, T);
    parallel_run(product_part, &a, T);
    free(dx);
    return 0;
}
