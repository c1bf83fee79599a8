/* petrel's kernel threads (thread_pool.c) */
#pragma once
#include <stdint.h>

typedef void (*task_fn)(void *ctx, int t, int T);

/* fn(ctx, t, T) for t = 0..T-1 (T = nthreads, at most), spread over the calling thread and the workers */
void parallel_run(task_fn fn, void *ctx, int nthreads);

/* [lo, hi): part t of T of n items, parts a multiple of `align` long */
void split_range(int64_t n, int t, int T, int64_t align, int64_t *lo, int64_t *hi);

/* Between pool_enter() and pool_exit() (on this thread) parallel_run uses these workers: for long runs of kernel
 * calls back to back (a decoder layer, a whole stack). Elsewhere it uses OpenMP, which inside a torch process is
 * torch's own team: for single kernel calls between torch operations, the threads torch's operations wake anyway. */
void pool_enter(void);
void pool_exit(void);

#define PARALLEL_ELEMENTS 262144   /* below this many elements one thread is faster than waking the others */
#define POOL_PARALLEL_ELEMENTS 16384  /* the same between pool_enter() and pool_exit(), the workers spinning */
typedef void (*rows_fn)(const void *args, int64_t r0, int64_t r1);

/* fn(args, r0, r1) over rows 0..n-1: shared out in ranges of rows over nthreads (parallel_run) when they hold
 * PARALLEL_ELEMENTS elements or more (POOL_PARALLEL_ELEMENTS between pool_enter() and pool_exit(), where the workers
 * spin: a 64-row decode step's norms, rotary, activation and cache writes, 3 of its ~45 ms a step on one thread)
 * and there are two rows or more, else all on this thread */
void for_rows(rows_fn fn, const void *args, int64_t n, int64_t elements, int nthreads);
