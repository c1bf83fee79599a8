/* This machine's float32 FMA peak: independent fused multiply-adds on registers only, one chain set per thread.
 * The ceiling that no product can pass (torch's large square matmul, the peak `petrel bench compare` reports,
 * reaches about 80% of it here).
 *
 *     gcc -O3 -march=native -fopenmp benchmarks/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak [threads]
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#define CHAINS 12
#define ITERS 200000000L

int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 2;
    float sink = 0.f;
    const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        __m256 acc[CHAINS];
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm256_set1_ps(1e-3f * i);
        const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-6f);
        for (long it = 0; it < ITERS; it++)
            for (int i = 0; i < CHAINS; i++) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
        float lanes[8];
        for (int i = 1; i < CHAINS; i++) acc[0] = _mm256_add_ps(acc[0], acc[i]);
        _mm256_storeu_ps(lanes, acc[0]);
        sink += lanes[0];
    }
    const double seconds = omp_get_wtime() - t0;
    printf("%d threads: %.1f GFLOP/s float32 FMA peak (checksum %g)\n", threads,
           2.0 * 8 * CHAINS * ITERS * threads / seconds / 1e9, sink);
    return 0;
}
