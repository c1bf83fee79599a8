/* Weight-only low-bit matrix products for petrel's QuantizedLinear (x86-64, AVX2 + FMA), loaded with ctypes.
 *
 * Every weight is an affine code: w[n][k] = scale[n][g] * code[n][k] + min[n][g], g the group of k.
 *   4-bit: codes[n][k/32][16] bytes; element i of a 32-group in the low nibble of byte i, element 16 + i in the
 *          high nibble (GGUF's Q4_0/Q4_1 order); groups of 32.
 *   8-bit: codes[n][k] signed bytes; group of k = k >> gshift (4: groups of 16, 5: of 32, >= 62: a whole row).
 *   mins may be NULL (8-bit only): w = scale * code.
 * The weights are turned into floats in registers and multiplied with float activations, so the result is the
 * dequantized weight's product up to the order of the float additions (no activation quantization).
 * few rows of x: *_gemv reads each weight once per four rows of x; many rows: *_dequant fills a float tile that
 * torch's GEMM then uses. Output rows are split over nthreads OpenMP threads (torch's own OpenMP runtime when
 * loaded into a torch process, so the two share one thread pool). K must be a multiple of 32. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
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

/* y[m][n] for MR rows of x and output rows n0..n1; NACC accumulators per row of x hide the FMA latency */
#define ROWS_KERNEL(MR, NACC) \
static void rows_##MR(int bits, const float *x, int64_t K, const void *codes, const float *scale, const float *mins, \
                      int gshift, float *y, int64_t N, int64_t n0, int64_t n1) { \
    const int64_t G = bits == 4 ? K / 32 : (gshift >= 62 ? 1 : K >> gshift); \
    for (int64_t n = n0; n < n1; n++) { \
        __m256 acc[MR][NACC], w[4]; \
        for (int m = 0; m < MR; m++) for (int a = 0; a < NACC; a++) acc[m][a] = _mm256_setzero_ps(); \
        const float *s = scale + n * G, *mn = mins ? mins + n * G : 0; \
        for (int64_t k = 0; k < K; k += 32) { \
            if (bits == 4) q4_group((const uint8_t *)codes + (n * G + k / 32) * 16, s[k / 32], mn[k / 32], w); \
            else q8_chunk((const int8_t *)codes + n * K, s, mn, k, gshift, w); \
            for (int m = 0; m < MR; m++) { \
                const float *xm = x + m * K + k; \
                for (int j = 0; j < 4; j++) \
                    acc[m][j % NACC] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xm + 8 * j), acc[m][j % NACC]); \
            } \
        } \
        for (int m = 0; m < MR; m++) { \
            __m256 t = acc[m][0]; \
            for (int a = 1; a < NACC; a++) t = _mm256_add_ps(t, acc[m][a]); \
            y[m * N + n] = hsum(t); \
        } \
    } \
}
ROWS_KERNEL(1, 4)
ROWS_KERNEL(2, 2)
ROWS_KERNEL(3, 2)
ROWS_KERNEL(4, 2)

/* y[M][N] = x[M][K] @ W^T */
void quant_gemv(int bits, const float *x, int64_t M, int64_t K, const void *codes, const float *scale,
                const float *mins, int gshift, float *y, int64_t N, int nthreads) {
    #pragma omp parallel num_threads(nthreads)
    {
        int t = omp_get_thread_num(), T = omp_get_num_threads();
        int64_t per = (N + T - 1) / T, n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
        for (int64_t m = 0; m < M && n0 < n1; m += 4) {
            int64_t r = M - m < 4 ? M - m : 4;
            const float *xm = x + m * K;
            float *ym = y + m * N;
            if (r == 4) rows_4(bits, xm, K, codes, scale, mins, gshift, ym, N, n0, n1);
            else if (r == 3) rows_3(bits, xm, K, codes, scale, mins, gshift, ym, N, n0, n1);
            else if (r == 2) rows_2(bits, xm, K, codes, scale, mins, gshift, ym, N, n0, n1);
            else rows_1(bits, xm, K, codes, scale, mins, gshift, ym, N, n0, n1);
        }
    }
}

/* out[n - n0][K] = W[n] for n0 <= n < n1 */
void quant_dequant(int bits, int64_t K, const void *codes, const float *scale, const float *mins, int gshift,
                   float *out, int64_t n0, int64_t n1, int nthreads) {
    const int64_t G = bits == 4 ? K / 32 : (gshift >= 62 ? 1 : K >> gshift);
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = n0; n < n1; n++) {
        __m256 w[4];
        const float *s = scale + n * G, *mn = mins ? mins + n * G : 0;
        for (int64_t k = 0; k < K; k += 32) {
            if (bits == 4) q4_group((const uint8_t *)codes + (n * G + k / 32) * 16, s[k / 32], mn[k / 32], w);
            else q8_chunk((const int8_t *)codes + n * K, s, mn, k, gshift, w);
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + (n - n0) * K + k + 8 * j, w[j]);
        }
    }
}
