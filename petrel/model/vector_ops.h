/* The vector operations group_gemm.c's and group_gemm_q8.c's block macros are written in: VECTOR_BITS 256 (AVX2)
 * or 512 (AVX-512). No include guard: each inclusion replaces the last one's definitions, so a file defines
 * VECTOR_BITS, includes this, instantiates its blocks of that width, and so on for the next width. The integer
 * step of a block (madd, dpwssd, maddubs, dpbusd) stays in each file. */
#undef VW
#undef VI
#undef VF
#undef VLOADI
#undef VSET1I
#undef VZEROI
#undef VKEEP
#undef VZEROF
#undef VCVT
#undef VFMA
#undef VLOADF
#undef VSTOREF
#undef VSET1F
#undef VMUL
#if VECTOR_BITS == 512
#define VW 16   /* floats a vector */
#define VI __m512i
#define VF __m512
#define VLOADI(p) _mm512_loadu_si512(p)
#define VSET1I(v) _mm512_set1_epi32(v)
#define VZEROI() _mm512_setzero_si512()
#define VKEEP(v) "+v"(v)   /* an empty asm's operand: keeps an accumulator in a register */
#define VZEROF() _mm512_setzero_ps()
#define VCVT(v) _mm512_cvtepi32_ps(v)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VLOADF(p) _mm512_loadu_ps(p)
#define VSTOREF(p, v) _mm512_storeu_ps(p, v)
#define VSET1F(v) _mm512_set1_ps(v)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#else
#define VW 8
#define VI __m256i
#define VF __m256
#define VLOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define VSET1I(v) _mm256_set1_epi32(v)
#define VZEROI() _mm256_setzero_si256()
#define VKEEP(v) "+x"(v)
#define VZEROF() _mm256_setzero_ps()
#define VCVT(v) _mm256_cvtepi32_ps(v)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VLOADF(p) _mm256_loadu_ps(p)
#define VSTOREF(p, v) _mm256_storeu_ps(p, v)
#define VSET1F(v) _mm256_set1_ps(v)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#endif
