/* Weight-only low-bit matrix products for petrel's QuantizedLinear (x86-64, AVX2 + FMA), loaded with ctypes.
 *
 * Every weight is an affine code: w[n][k] = scale[n][g] * code[n][k] + min[n][g], g the group of k.
 *   4-bit: codes[n][k/32][16] bytes; element i of a 32-group in the low nibble of byte i, element 16 + i in the
 *          high nibble (GGUF's Q4_0/Q4_1 order); groups of 32.
 *   8-bit: codes[n][k] signed bytes; group of k = k >> gshift (4: groups of 16, 5: of 32, >= 62: a whole row).
 *   mins may be NULL: 8-bit codes then are w = scale * code; 4-bit codes without mins are MXFP4 (OCP's microscaling
 *          format: gpt-oss's experts): each nibble an E2M1 value (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1,
 *          1.5, 2, 3, 4, 6 and their negatives), the group's scale an E8M0 byte e (2^(e - 127)), `scale` pointing at
 *          those bytes [n][k/32]. Twice each E2M1 value is a small integer (FP4_DOUBLED), so the codes widen to
 *          integers as the affine ones do, times 2^(e - 128) (fp4_scale).
 * Few rows of x (quant_gemv): the activations are first rounded to int16 per block of 32 (x ~ d q, d = max|x| /
 * 32767: a relative error near 2^-16 of the block's largest value, far below the weights' own rounding), then each
 * product is integer multiply-adds of codes by codes and one float multiply-add per block by the two scales; the
 * weights' mins multiply exact float sums of x. Each weight is read once per four rows of x. Many rows
 * (quant_dequant): a tile of weights is dequantized to floats for torch's GEMM, which then computes exactly.
 * Output rows are shared out over nthreads threads (thread_pool.c). K must be a multiple of 32. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"
#include "thread_pool.h"

/* Twice the E2M1 value of each nibble (integers: the products' codes), and an E8M0 byte's scale over 2 (the doubling
 * undone): 2^(e - 128), built from its bits (e < 2: the subnormals 2^-128, 2^-127) */
static const int8_t FP4_DOUBLED[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float fp4_scale(uint8_t e) {
    union { uint32_t u; float f; } v = {e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23};
    return v.f;
}

/* the doubled E2M1 values of 32 nibbles (lo, hi: codes 0..15 in bytes), as signed bytes */
static inline __m256i fp4_values(__m256i nibbles) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)FP4_DOUBLED));
    return _mm256_shuffle_epi8(table, nibbles);
}

/* groups per weight row: 4-bit codes have one per 32; 8-bit codes one per 2^gshift, or one a row (gshift >= 62) */
static inline int64_t num_groups(int bits, int64_t K, int gshift) {
    return bits == 4 ? K / 32 : (gshift >= 62 ? 1 : K >> gshift);
}

/* the scales s[0], s[0], s[1], s[1], s[0], s[0], s[1], s[1]: two groups' scales as _mm256_hadd_epi32 lays out
 * their two sums */
static inline __m256 pair_scales(const float *s) {
    return _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_castpd128_pd256(_mm_load_sd((const double *)s))),
                                    _mm256_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1));
}

/* pair_scales of two MXFP4 groups' E8M0 bytes */
static inline __m256 fp4_pair_scales(const uint8_t *e) {
    const float s0 = fp4_scale(e[0]), s1 = fp4_scale(e[1]);
    return _mm256_setr_ps(s0, s0, s1, s1, s0, s0, s1, s1);
}

/* the 32 weights of an MXFP4 group (its 16 bytes and its scale's byte), as four vectors of eight floats */
static inline void fp4_group(const uint8_t *codes, uint8_t e, __m256 w[4]) {
    const __m128i mask = _mm_set1_epi8(0x0F), b = _mm_loadu_si128((const __m128i *)codes);
    const __m128i table = _mm_loadu_si128((const __m128i *)FP4_DOUBLED);
    const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(b, mask));
    const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(b, 4), mask));
    const __m256 d = _mm256_set1_ps(fp4_scale(e));
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), d);
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), d);
    w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), d);
    w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), d);
}

/* the 32 weights of 4-bit group g of a row, as four vectors of eight floats */
static inline void q4_group(const uint8_t *codes, float scale, float min, __m256 w[4]) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i b = _mm_loadu_si128((const __m128i *)codes);
    __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    __m256 d = _mm256_set1_ps(scale), z = _mm256_set1_ps(min);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, z);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, z);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, z);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, z);
}

/* the 32 weights k..k+31 of an 8-bit row */
static inline void q8_chunk(const int8_t *row, const float *scale, const float *mins, int64_t k, int gshift, __m256 w[4]) {
    for (int j = 0; j < 4; j++) {
        int64_t g = gshift >= 62 ? 0 : (k + 8 * j) >> gshift;
        __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + k + 8 * j))));
        w[j] = mins ? _mm256_fmadd_ps(q, _mm256_set1_ps(scale[g]), _mm256_set1_ps(mins[g]))
                    : _mm256_mul_ps(q, _mm256_set1_ps(scale[g]));
    }
}

/* The activations of a few-row product: per 32 values an int16 code each and one scale (x ~ d q, d = max|x| /
 * 32767, q = round-to-even(x * (1 / d))), plus the exact float sum of every 16 values (the weights' mins multiply
 * those). */
static void quantize_activations(const float *x, int64_t n, int16_t *q, float *d, float *sum16) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < n / 32; b++) {
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(x + 32 * b + 8 * j);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float db = _mm_cvtss_f32(h) / 32767.f;
        const __m256 inv = _mm256_set1_ps(db > 0.f ? 1.f / db : 0.f);
        for (int j = 0; j < 4; j += 2) {   /* packs interleaves 128-bit lanes: the permute puts them back in order */
            const __m256i p = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv)),
                                                 _mm256_cvtps_epi32(_mm256_mul_ps(v[j + 1], inv)));
            _mm256_storeu_si256((__m256i *)(q + 32 * b + 8 * j), _mm256_permute4x64_epi64(p, 0xD8));
        }
        d[b] = db;
        sum16[2 * b] = hsum(_mm256_add_ps(v[0], v[1]));
        sum16[2 * b + 1] = hsum(_mm256_add_ps(v[2], v[3]));
    }
}

/* Rounded activation rows, as the kernels below read them */
typedef struct {
    const int16_t *q;   /* [M][K] codes */
    const float *d;     /* [M][K/32] scales */
    const float *dd;    /* [M][K/64][8]: the scales of 32-blocks 2i, 2i, 2i+1, 2i+1, 2i, 2i, 2i+1, 2i+1 (4-bit) */
    const float *sums;  /* [M][G] the float sum of x over each of the weight's groups (weights with mins) */
} activations;

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* 32 weight codes (16-bit, two vectors of 16) times 32 activation codes: eight int32 partial sums */
static inline __m256i dot32(__m256i w0, __m256i w1, const int16_t *x) {
    return _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(x + 16))));
}

/* 4-bit weights: y[m][n] for MR activation rows and output rows n0..n1, two code groups (64 weights) a step; FP 1:
 * MXFP4 codes (their doubled E2M1 values, sign-extended; scale: E8M0 bytes) */
#define Q4_ROWS(MR, FP, NAME) \
static void NAME##_##MR(const activations *a, int64_t K, const uint8_t *codes, const float *scale, const float *mins, \
                         float *y, int64_t N, int64_t n0, int64_t n1) { \
    const int64_t B = K / 32; \
    const __m256i nibble = _mm256_set1_epi8(0x0F); \
    for (int64_t n = n0; n < n1; n++) { \
        __m256 acc[MR]; \
        for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps(); \
        const uint8_t *c = codes + n * B * 16; \
        const float *s = FP ? NULL : scale + n * B; \
        const uint8_t *fs = FP ? (const uint8_t *)scale + n * B : NULL; \
        int64_t b = 0; \
        for (; b + 2 <= B; b += 2) {    /* bytes: group b's 16 then group b+1's; low nibbles first halves */ \
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(c + 16 * b)); \
            __m256i lo = _mm256_and_si256(raw, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble); \
            if (FP) { lo = fp4_values(lo); hi = fp4_values(hi); } \
            const __m256i b0 = FP ? _mm256_cvtepi8_epi16(_mm256_castsi256_si128(lo)) \
                                  : _mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo)), \
                          b1 = FP ? _mm256_cvtepi8_epi16(_mm256_castsi256_si128(hi)) \
                                  : _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi)), \
                          c0 = FP ? _mm256_cvtepi8_epi16(_mm256_extracti128_si256(lo, 1)) \
                                  : _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1)), \
                          c1 = FP ? _mm256_cvtepi8_epi16(_mm256_extracti128_si256(hi, 1)) \
                                  : _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1)); \
            const __m256 sv = FP ? fp4_pair_scales(fs + b) : pair_scales(s + b); \
            for (int m = 0; m < MR; m++) { \
                const int16_t *xb = a->q + m * K + 32 * b; \
                const __m256i sums = _mm256_hadd_epi32(dot32(b0, b1, xb), dot32(c0, c1, xb + 32)); \
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), \
                                         _mm256_mul_ps(sv, _mm256_loadu_ps(a->dd + (m * (B / 2) + b / 2) * 8)), acc[m]); \
            } \
        } \
        if (b < B) {                       /* an odd last group */ \
            const __m128i raw = _mm_loadu_si128((const __m128i *)(c + 16 * b)), m4 = _mm_set1_epi8(0x0F); \
            __m128i l4 = _mm_and_si128(raw, m4), h4 = _mm_and_si128(_mm_srli_epi16(raw, 4), m4); \
            const __m128i table = _mm_loadu_si128((const __m128i *)FP4_DOUBLED); \
            if (FP) { l4 = _mm_shuffle_epi8(table, l4); h4 = _mm_shuffle_epi8(table, h4); } \
            const __m256i w0 = FP ? _mm256_cvtepi8_epi16(l4) : _mm256_cvtepu8_epi16(l4), \
                          w1 = FP ? _mm256_cvtepi8_epi16(h4) : _mm256_cvtepu8_epi16(h4); \
            const float sb = FP ? fp4_scale(fs[b]) : s[b]; \
            for (int m = 0; m < MR; m++) \
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(w0, w1, a->q + m * K + 32 * b)), \
                                         _mm256_set1_ps(sb * a->d[m * B + b]), acc[m]); \
        } \
        for (int m = 0; m < MR; m++) \
            y[m * N + n] = hsum(acc[m]) + (mins ? dot_f32(mins + n * B, a->sums + m * B, B) : 0.f); \
    } \
}

/* 8-bit weights (signed codes; groups of 16, 32 or a whole row): one 32-block a step, two accumulators */
#define Q8_ROWS(MR) \
static void q8_rows_##MR(const activations *a, int64_t K, const int8_t *codes, const float *scale, const float *mins, \
                         int gshift, float *y, int64_t N, int64_t n0, int64_t n1) { \
    const int64_t B = K / 32, G = num_groups(8, K, gshift); \
    for (int64_t n = n0; n < n1; n++) { \
        __m256 acc[MR][2]; \
        for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps(); \
        const int8_t *c = codes + n * K; \
        const float *s = scale + n * G; \
        for (int64_t b = 0; b < B; b += 2) { \
            for (int h = 0; h < 2 && b + h < B; h++) { \
                const int64_t bh = b + h; \
                const __m256i w = _mm256_loadu_si256((const __m256i *)(c + 32 * bh)); \
                const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w)), \
                              w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1)); \
                /* groups of 16: the sums of each half kept apart, as lanes 0, 1, 4, 5 and 2, 3, 6, 7 */ \
                const __m256 sv = gshift >= 62 ? _mm256_set1_ps(s[0]) \
                    : gshift == 4 ? pair_scales(s + 2 * bh) \
                    : _mm256_set1_ps(s[(32 * bh) >> gshift]); \
                for (int m = 0; m < MR; m++) { \
                    const int16_t *xb = a->q + m * K + 32 * bh; \
                    const __m256i sums = gshift != 4 ? dot32(w0, w1, xb) : _mm256_hadd_epi32( \
                        _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xb)), \
                        _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xb + 16)))); \
                    acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), \
                                                _mm256_mul_ps(sv, _mm256_set1_ps(a->d[m * B + bh])), acc[m][h]); \
                } \
            } \
        } \
        for (int m = 0; m < MR; m++) \
            y[m * N + n] = hsum(_mm256_add_ps(acc[m][0], acc[m][1])) \
                         + (mins ? dot_f32(mins + n * G, a->sums + m * G, G) : 0.f); \
    } \
}
Q4_ROWS(1, 0, q4_rows) Q4_ROWS(2, 0, q4_rows) Q4_ROWS(3, 0, q4_rows) Q4_ROWS(4, 0, q4_rows)
Q4_ROWS(1, 1, fp4_rows) Q4_ROWS(2, 1, fp4_rows) Q4_ROWS(3, 1, fp4_rows) Q4_ROWS(4, 1, fp4_rows)
Q8_ROWS(1) Q8_ROWS(2) Q8_ROWS(3) Q8_ROWS(4)

/* MXFP4 with AVX-512 (F + BW): four groups (128 weights, 64 bytes of codes) a step. The activations' codes are laid
 * out for it first (fp4_wide_activations): per four groups, the first halves of groups 0 and 1, their second halves,
 * then the same of groups 2 and 3, so that each 32-value vector of codes widened from the nibbles meets its values in
 * one load; 16-bit products summed in pairs (vpmaddwd) as the AVX2 kernel does, each group's eight int32 sums then
 * scaled by its activation scale times 2^(e - 128) (vscalefps: exact, the E8M0 byte's power of two). The last
 * groups of a row past a multiple of four: codes read under a mask, their activations zero. Measured (one thread,
 * 64 experts' 2,048 x 1,024 weights from memory, Zen 5): 1.5x the AVX2 kernel's rate at one row, 1.04x at four. */
typedef struct {
    const int16_t *q;   /* [M][K4] codes in the order above (K4: K rounded up to 128, zeros past K) */
    const float *dd;    /* [M][K4 / 32][8]: each group's activation scale, eight times */
} wide_activations;

#define FP4_WIDE_ROWS(MR) \
__attribute__((target("avx512f,avx512bw"))) \
static void fp4_wide_rows_##MR(const wide_activations *a, int64_t K, const uint8_t *codes, const uint8_t *e8, \
                               float *y, int64_t N, int64_t n0, int64_t n1) { \
    const int64_t B = K / 32, K4 = (K + 127) / 128 * 128; \
    const __m512i nibble = _mm512_set1_epi8(0x0F); \
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)FP4_DOUBLED)); \
    const __m512i pair01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1); \
    const __m512i pair23 = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3); \
    const __m512 bias = _mm512_set1_ps(128.f); \
    for (int64_t n = n0; n < n1; n++) { \
        __m512 acc[MR]; \
        for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_ps(); \
        const uint8_t *c = codes + n * B * 16, *e = e8 + n * B; \
        for (int64_t b = 0; b < B; b += 4) { \
            const int64_t left = B - b < 4 ? B - b : 4; \
            const __mmask64 valid = left == 4 ? ~(__mmask64)0 : (((__mmask64)1 << (16 * left)) - 1); \
            /* a masked load only for the last groups: from memory it stalls Zen 5's stream (2.5x slower) */ \
            const __m512i raw = left == 4 ? _mm512_loadu_si512(c + 16 * b) \
                                          : _mm512_maskz_loadu_epi8(valid, c + 16 * b); \
            const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(raw, nibble)); \
            const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble)); \
            const __m512i wl01 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(lo)), \
                          wh01 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(hi)), \
                          wl23 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(lo, 1)), \
                          wh23 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(hi, 1)); \
            uint32_t bytes = 0; \
            if (left == 4) memcpy(&bytes, e + b, 4); \
            else for (int64_t i = 0; i < left; i++) bytes |= (uint32_t)e[b + i] << (8 * i); \
            const __m512 exps = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_cvtsi32_si128((int)bytes))), \
                                              bias); \
            const __m512 e01 = _mm512_permutexvar_ps(pair01, exps), e23 = _mm512_permutexvar_ps(pair23, exps); \
            for (int m = 0; m < MR; m++) { \
                const int16_t *xq = a->q + m * K4 + 32 * b; \
                const float *dd = a->dd + (m * (K4 / 32) + b) * 8; \
                const __m512i s01 = _mm512_add_epi32(_mm512_madd_epi16(wl01, _mm512_loadu_si512(xq)), \
                                                     _mm512_madd_epi16(wh01, _mm512_loadu_si512(xq + 32))); \
                const __m512i s23 = _mm512_add_epi32(_mm512_madd_epi16(wl23, _mm512_loadu_si512(xq + 64)), \
                                                     _mm512_madd_epi16(wh23, _mm512_loadu_si512(xq + 96))); \
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s01), _mm512_scalef_ps(_mm512_loadu_ps(dd), e01), acc[m]); \
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s23), _mm512_scalef_ps(_mm512_loadu_ps(dd + 16), e23), \
                                         acc[m]); \
            } \
        } \
        for (int m = 0; m < MR; m++) y[m * N + n] = _mm512_reduce_add_ps(acc[m]); \
    } \
}
FP4_WIDE_ROWS(1) FP4_WIDE_ROWS(2) FP4_WIDE_ROWS(3) FP4_WIDE_ROWS(4)

/* x's int16 codes and scales (quantize_activations') laid out for fp4_wide_rows: K4 codes a row, K4 / 32 groups of
 * eight scales */
static void fp4_wide_activations(const int16_t *q, const float *d, int64_t M, int64_t K, int16_t *wq, float *wdd) {
    const int64_t B = K / 32, K4 = (K + 127) / 128 * 128, B4 = K4 / 32;
    memset(wq, 0, sizeof(int16_t) * M * K4);
    memset(wdd, 0, sizeof(float) * M * B4 * 8);
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < B; g++) {
            const int64_t quad = g / 4 * 128, pair = (g % 4) / 2 * 64, which = g % 2 * 16;
            memcpy(wq + m * K4 + quad + pair + which, q + m * K + 32 * g, sizeof(int16_t) * 16);
            memcpy(wq + m * K4 + quad + pair + 32 + which, q + m * K + 32 * g + 16, sizeof(int16_t) * 16);
            for (int j = 0; j < 8; j++) wdd[(m * B4 + g) * 8 + j] = d[m * B + g];
        }
}

typedef struct { const wide_activations *a; int64_t M, K; const uint8_t *codes, *e8; float *y; int64_t N; } wide_args;

static void fp4_wide_part(void *args, int t, int T) {
    const wide_args *g = args;
    const int64_t K4 = (g->K + 127) / 128 * 128;
    int64_t n0, n1;
    split_range(g->N, t, T, 1, &n0, &n1);
    for (int64_t m = 0; m < g->M && n0 < n1; m += 4) {
        const wide_activations am = {g->a->q + m * K4, g->a->dd + m * (K4 / 32) * 8};
        const int64_t r = g->M - m < 4 ? g->M - m : 4;
        float *y = g->y + m * g->N;
        if (r == 4) fp4_wide_rows_4(&am, g->K, g->codes, g->e8, y, g->N, n0, n1);
        else if (r == 3) fp4_wide_rows_3(&am, g->K, g->codes, g->e8, y, g->N, n0, n1);
        else if (r == 2) fp4_wide_rows_2(&am, g->K, g->codes, g->e8, y, g->N, n0, n1);
        else fp4_wide_rows_1(&am, g->K, g->codes, g->e8, y, g->N, n0, n1);
    }
}

static void rows(int bits, int64_t r, const activations *a, int64_t K, const void *codes, const float *scale,
                 const float *mins, int gshift, float *y, int64_t N, int64_t n0, int64_t n1) {
    if (bits == 4 && !mins) {   /* MXFP4 */
        if (r == 4) fp4_rows_4(a, K, codes, scale, mins, y, N, n0, n1);
        else if (r == 3) fp4_rows_3(a, K, codes, scale, mins, y, N, n0, n1);
        else if (r == 2) fp4_rows_2(a, K, codes, scale, mins, y, N, n0, n1);
        else fp4_rows_1(a, K, codes, scale, mins, y, N, n0, n1);
    } else if (bits == 4) {
        if (r == 4) q4_rows_4(a, K, codes, scale, mins, y, N, n0, n1);
        else if (r == 3) q4_rows_3(a, K, codes, scale, mins, y, N, n0, n1);
        else if (r == 2) q4_rows_2(a, K, codes, scale, mins, y, N, n0, n1);
        else q4_rows_1(a, K, codes, scale, mins, y, N, n0, n1);
    } else {
        if (r == 4) q8_rows_4(a, K, codes, scale, mins, gshift, y, N, n0, n1);
        else if (r == 3) q8_rows_3(a, K, codes, scale, mins, gshift, y, N, n0, n1);
        else if (r == 2) q8_rows_2(a, K, codes, scale, mins, gshift, y, N, n0, n1);
        else q8_rows_1(a, K, codes, scale, mins, gshift, y, N, n0, n1);
    }
}

typedef struct {
    const activations *a; int bits; int64_t M, K; const void *codes; const float *scale, *mins; int gshift;
    float *y; int64_t N;
} gemv_args;

static void gemv_part(void *args, int t, int T) {
    const gemv_args *g = args;
    const int64_t K = g->K, B = K / 32, G = num_groups(g->bits, K, g->gshift);
    int64_t n0, n1;
    split_range(g->N, t, T, 1, &n0, &n1);
    for (int64_t m = 0; m < g->M && n0 < n1; m += 4) {
        const activations *a = g->a;
        const activations am = {a->q + m * K, a->d + m * B, a->dd + m * (B / 2) * 8, a->sums + m * G};
        rows(g->bits, g->M - m < 4 ? g->M - m : 4, &am, K, g->codes, g->scale, g->mins, g->gshift, g->y + m * g->N,
             g->N, n0, n1);
    }
}

/* y[M][N] = x[M][K] @ W^T, the activations rounded to int16 per 32 first (see quantize_activations); MXFP4 codes
 * with AVX-512's four groups a step where isa (int8_gemm's: kernels.h) names an AVX-512 kernel (the CPU has
 * AVX-512 F + BW), else AVX2's two. 0, or KERNEL_OUT_OF_MEMORY when there is no memory for the rounded activations
 * (y is then not written) */
int quant_gemv(int bits, const float *x, int64_t M, int64_t K, const void *codes, const float *scale,
               const float *mins, int gshift, float *y, int64_t N, int nthreads, int isa) {
    const int64_t B = K / 32, G = num_groups(bits, K, gshift);
    const int wide = bits == 4 && !mins && (isa & 3) != INT8_AVX2;
    const int64_t K4 = wide ? (K + 127) / 128 * 128 : 0;
    int16_t *q = malloc(sizeof(int16_t) * M * K + sizeof(float) * M * (2 * B + B + 4 * B + G)
                        + sizeof(int16_t) * M * K4 + sizeof(float) * M * (K4 / 4) + 64);
    if (!q) return KERNEL_OUT_OF_MEMORY;
    float *sum16 = (float *)(q + M * K), *d = sum16 + M * 2 * B, *dd = d + M * B, *sums = dd + M * 4 * B;
    quantize_activations(x, M * K, q, d, sum16);
    if (wide) {
        int16_t *const wq = (int16_t *)(sums + M * G);
        float *const wdd = (float *)(wq + M * K4);
        fp4_wide_activations(q, d, M, K, wq, wdd);
        const wide_activations a = {wq, wdd};
        wide_args args = {&a, M, K, codes, (const uint8_t *)scale, y, N};
        parallel_run(fp4_wide_part, &args, nthreads);
        free(q);
        return 0;
    }
    for (int64_t m = 0; m < M && mins; m++)              /* x's sum over each weight group, from the 16-sums */
        for (int64_t g = 0; g < G; g++) {
            const int64_t per = 2 * B / G;
            float t = 0.f;
            for (int64_t i = 0; i < per; i++) t += sum16[m * 2 * B + g * per + i];
            sums[m * G + g] = t;
        }
    for (int64_t m = 0; m < M && bits == 4; m++)
        for (int64_t b = 0; b + 2 <= B; b += 2)
            for (int j = 0; j < 8; j++) dd[(m * (B / 2) + b / 2) * 8 + j] = d[m * B + b + (j / 2) % 2];
    activations a = {q, d, dd, sums};
    gemv_args args = {&a, bits, M, K, codes, scale, mins, gshift, y, N};
    parallel_run(gemv_part, &args, nthreads);
    free(q);
    return 0;
}

typedef struct {
    int bits; int64_t K; const void *codes; const float *scale, *mins; int gshift; float *out; int64_t n0, n1;
} dequant_args;

/* out[n - n0][K] = W[n] for n0 <= n < n1, on this thread */
static void dequant_rows(int bits, int64_t K, const void *codes, const float *scale, const float *mins, int gshift,
                         float *out, int64_t n0, int64_t n1) {
    const int64_t G = num_groups(bits, K, gshift);
    for (int64_t n = n0; n < n1; n++) {
        __m256 w[4];
        const float *s = scale + n * G, *mn = mins ? mins + n * G : 0;
        for (int64_t k = 0; k < K; k += 32) {
            const int64_t g = n * G + k / 32;   /* the group, of 4-bit codes */
            if (bits == 4 && !mins) fp4_group((const uint8_t *)codes + g * 16, ((const uint8_t *)scale)[g], w);
            else if (bits == 4) q4_group((const uint8_t *)codes + (n * G + k / 32) * 16, s[k / 32], mn[k / 32], w);
            else q8_chunk((const int8_t *)codes + n * K, s, mn, k, gshift, w);
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + (n - n0) * K + k + 8 * j, w[j]);
        }
    }
}

static void dequant_part(void *args, int t, int T) {
    const dequant_args *a = args;
    int64_t lo, hi;
    split_range(a->n1 - a->n0, t, T, 1, &lo, &hi);
    dequant_rows(a->bits, a->K, a->codes, a->scale, a->mins, a->gshift, a->out + lo * a->K, a->n0 + lo, a->n0 + hi);
}

/* out[n - n0][K] = W[n] for n0 <= n < n1 */
void quant_dequant(int bits, int64_t K, const void *codes, const float *scale, const float *mins, int gshift,
                   float *out, int64_t n0, int64_t n1, int nthreads) {
    dequant_args a = {bits, K, codes, scale, mins, gshift, out, n0, n1};
    parallel_run(dequant_part, &a, nthreads);
}

#define TILE 12
typedef struct {
    int bits; const float *x; int64_t M, K; const void *codes; const float *scale, *mins; int gshift; float *y;
    int64_t N; float *tiles;
} gemm_args;

static void gemm_part(void *args, int t, int T) {
    const gemm_args *a = args;
    float *tile = a->tiles + (int64_t)t * TILE * a->K;
    int64_t n0, n1;
    split_range(a->N, t, T, TILE, &n0, &n1);
    for (int64_t n = n0; n < n1; n += TILE) {
        const int64_t ne = n + TILE < n1 ? n + TILE : n1;
        dequant_rows(a->bits, a->K, a->codes, a->scale, a->mins, a->gshift, tile, n, ne);
        f32_tile_product(a->x, a->M, a->K, tile, ne - n, a->y, a->N, n);
    }
}

/* y[M][N] = x[M][K] @ W^T for more rows than quant_gemv's: each thread dequantizes TILE weight rows into a float32
 * tile that stays in cache while every row of x passes over it (float32 products, the weight read once); 0, or
 * KERNEL_OUT_OF_MEMORY (y then not written) */
int quant_gemm(int bits, const float *x, int64_t M, int64_t K, const void *codes, const float *scale,
               const float *mins, int gshift, float *y, int64_t N, int nthreads) {
    const int T = nthreads < 1 ? 1 : nthreads;
    float *tiles = malloc(sizeof(float) * TILE * K * T);
    if (!tiles)            /* no memory for the tiles: the few-row kernel, slower (and its own status) */
        return quant_gemv(bits, x, M, K, codes, scale, mins, gshift, y, N, nthreads, INT8_AVX2);
    gemm_args a = {bits, x, M, K, codes, scale, mins, gshift, y, N, tiles};
    parallel_run(gemm_part, &a, T);
    free(tiles);
    return 0;
}
