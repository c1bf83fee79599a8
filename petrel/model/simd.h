/* Small AVX2 helpers (and an AVX-512 lane mask) shared by petrel's kernel files */
#pragma once
#include <immintrin.h>
#include <stdint.h>

/* the first n of 16 lanes as an AVX-512 mask: none for n <= 0, all from 16 (plain integer work: any ISA) */
static inline uint16_t lanes16(int64_t n) {
    return n <= 0 ? 0 : n >= 16 ? 0xFFFF : (uint16_t)((1u << n) - 1);
}

/* a mask of the first n of eight 32-bit lanes (all lanes from 8 on, none at 0 or below), for maskload / maskstore */
static inline __m256i lanes8(int64_t n) {
    const int c = n <= 0 ? 0 : n >= 8 ? 8 : (int)n;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* the sum of a vector's eight floats */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* eight bfloat16 values (the top halves of float32s) from p as floats: exact */
static inline __m256 bf16_load8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* float x as bfloat16, rounded to nearest even (torch's rounding; a NaN stays a NaN) */
static inline uint16_t float_to_bf16(float x) {
    uint32_t u;
    __builtin_memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* a bfloat16 value as a float: exact */
static inline float bf16_to_float(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float x;
    __builtin_memcpy(&x, &u, sizeof x);
    return x;
}

/* e^x, relative error ~1e-7 (clamped to [-87, 88]): 2^n * e^r with |r| <= ln2/2, degree-6 polynomial; the steps
 * of exp256 and its sixteen-wide exp512 (for AVX-512 callers), one text so that both give the same results lane by
 * lane. P: the intrinsics' prefix, V / VI: the float and integer vector types, ROUND: to the nearest integer,
 * BITS_AS_FLOAT: an integer vector's bits as floats. */
#define EXP_STEPS(P, V, VI, ROUND, BITS_AS_FLOAT)                                                                  \
    x = P##_min_ps(P##_max_ps(x, P##_set1_ps(-87.f)), P##_set1_ps(88.f));                                          \
    V n = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)));                                                 \
    V r = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                                                          \
    r = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), r);                                                         \
    V y = P##_set1_ps(1.9875691500e-4f);                                                                           \
    y = P##_fmadd_ps(y, r, P##_set1_ps(1.3981999507e-3f));                                                         \
    y = P##_fmadd_ps(y, r, P##_set1_ps(8.3334519073e-3f));                                                         \
    y = P##_fmadd_ps(y, r, P##_set1_ps(4.1665795894e-2f));                                                         \
    y = P##_fmadd_ps(y, r, P##_set1_ps(1.6666665459e-1f));                                                         \
    y = P##_fmadd_ps(y, r, P##_set1_ps(5.0000001201e-1f));                                                         \
    y = P##_fmadd_ps(y, P##_mul_ps(r, r), P##_add_ps(r, P##_set1_ps(1.f)));                                        \
    VI e = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23);                             \
    return P##_mul_ps(y, BITS_AS_FLOAT(e))
#define ROUND256(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define ROUND512(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

static inline __m256 exp256(__m256 x) { EXP_STEPS(_mm256, __m256, __m256i, ROUND256, _mm256_castsi256_ps); }
__attribute__((target("avx512f"))) static inline __m512 exp512(__m512 x) {
    EXP_STEPS(_mm512, __m512, __m512i, ROUND512, _mm512_castsi512_ps);
}

/* 2^x for x <= 0, relative error < 1e-7; x <= -127 (and -inf) gives exactly 0, never a subnormal: 2^n * 2^r
 * with n = round(x), |r| <= 1/2, 2^r by a degree-6 polynomial fitted for relative error */
static inline __m256 exp2_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-127.f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), r = _mm256_sub_ps(x, n);
    __m256 y = _mm256_set1_ps(1.5353361959569156e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3398875016719103e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(9.61843691766262e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.5503323674201965e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(2.4022647738456726e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(6.931471824645996e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* r[i][j] = r[j][i] for an 8 x 8 matrix of 32-bit values (int32, or floats cast) */
static inline void transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}
