/* The threads petrel's kernels share out their work over (compiled into the kernels' library).
 *
 * parallel_run(fn, ctx, T) runs fn(ctx, t, T) for t = 0..T-1 and returns when all are done, in one of two ways:
 *   - inside a one-call decoder layer or stack (between pool_enter() and pool_exit()): on this pool, t = 0 on the
 *     calling thread and the others on its workers. Such a call makes a few hundred kernel calls back to back;
 *     libgomp, once it manages more threads than there are cores (torch's team in the main thread plus a second
 *     one in petrel's engine thread), lets its workers sleep between parallel regions, and waking them for each
 *     doubled the time of a one-token decode step here. These workers spin for SPIN_NS after each call (yielding
 *     the core now and then to any other runnable thread), then sleep until the next.
 *   - anywhere else (a single kernel call between torch operations): an OpenMP parallel region, inside a torch
 *     process torch's own team, whose threads torch's operations around it use anyway. Using the pool there
 *     instead made a serving workload (W3) ~9% slower: two sets of worker threads contended for two cores; holding
 *     the pool through a whole model forward (torch's operations between the kernel calls) made W3 1.8x slower
 *     (177 -> 98 output tok/s; a lone 41-token prompt's forward 6-15% faster): each side's workers spin while the
 *     other's wait for the core.
 * One caller at a time uses the pool's workers; a second concurrent caller (two Python threads in kernels at once)
 * runs its parts itself, one after another. */
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <immintrin.h>
#include <stdint.h>
#include <time.h>

#include "thread_pool.h"

#define MAX_WORKERS 255
#define SPIN_NS 20000           /* 20 us */

static pthread_mutex_t run_lock = PTHREAD_MUTEX_INITIALIZER;     /* held by the caller using the workers */
static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static int num_workers;                                          /* started so far (under run_lock) */

static task_fn task;
static void *task_ctx;
static int task_threads;
static unsigned generation;      /* bumped (release) for each call; workers wait for it to change */
static int remaining;            /* workers that have not yet finished (or passed on) the current call */
static int sleepers;             /* workers waiting on `wake` */

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void *worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    unsigned seen = 0;
    for (;;) {
        unsigned g = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
        if (g == seen) {                         /* spin a while, then sleep until the next call */
            const int64_t until = now_ns() + SPIN_NS;
            for (int i = 0; (g = __atomic_load_n(&generation, __ATOMIC_ACQUIRE)) == seen; i++) {
                _mm_pause();
                if ((i & 63) == 63) sched_yield();
                if ((i & 255) == 255 && now_ns() > until) {
                    pthread_mutex_lock(&sleep_lock);
                    __atomic_add_fetch(&sleepers, 1, __ATOMIC_SEQ_CST);
                    while ((g = __atomic_load_n(&generation, __ATOMIC_SEQ_CST)) == seen)
                        pthread_cond_wait(&wake, &sleep_lock);
                    __atomic_sub_fetch(&sleepers, 1, __ATOMIC_SEQ_CST);
                    pthread_mutex_unlock(&sleep_lock);
                    break;
                }
            }
        }
        seen = g;
        if (id < task_threads) task(task_ctx, id, task_threads);
        __atomic_sub_fetch(&remaining, 1, __ATOMIC_ACQ_REL);    /* every worker acknowledges every call */
    }
    return 0;
}

static __thread int pool_depth;   /* > 0 between pool_enter() and pool_exit(): parallel_run uses these workers */

void pool_enter(void) { pool_depth++; }
void pool_exit(void) { pool_depth--; }

void parallel_run(task_fn fn, void *ctx, int nthreads) {
    if (pool_depth == 0 && nthreads > 1) {      /* a single kernel call between torch operations: torch's team */
        #pragma omp parallel num_threads(nthreads)
        fn(ctx, omp_get_thread_num(), omp_get_num_threads());
        return;
    }
    nthreads = nthreads < 1 ? 1 : nthreads > MAX_WORKERS + 1 ? MAX_WORKERS + 1 : nthreads;
    if (nthreads == 1 || pthread_mutex_trylock(&run_lock) != 0) {
        for (int t = 0; t < nthreads; t++) fn(ctx, t, nthreads);
        return;
    }
    while (num_workers < nthreads - 1) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&thread, &attr, worker, (void *)(intptr_t)(num_workers + 1)) != 0) {
            pthread_attr_destroy(&attr);
            break;
        }
        pthread_attr_destroy(&attr);
        num_workers++;
    }
    if (nthreads > num_workers + 1) nthreads = num_workers + 1;
    task = fn;
    task_ctx = ctx;
    task_threads = nthreads;
    __atomic_store_n(&remaining, num_workers, __ATOMIC_RELEASE);
    __atomic_add_fetch(&generation, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&sleepers, __ATOMIC_SEQ_CST) > 0) {
        pthread_mutex_lock(&sleep_lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&sleep_lock);
    }
    fn(ctx, 0, nthreads);
    for (int i = 0; __atomic_load_n(&remaining, __ATOMIC_ACQUIRE) > 0; i++) {
        _mm_pause();
        if ((i & 63) == 63) sched_yield();
    }
    pthread_mutex_unlock(&run_lock);
}

/* [lo, hi) of part t of T of n items, in multiples of `align` */
void split_range(int64_t n, int t, int T, int64_t align, int64_t *lo, int64_t *hi) {
    int64_t per = ((n + T - 1) / T + align - 1) / align * align;
    *lo = t * per < n ? t * per : n;
    *hi = *lo + per < n ? *lo + per : n;
}

typedef struct { rows_fn fn; const void *args; int64_t rows; } rows_task;

static void rows_part(void *task, int t, int T) {
    const rows_task *r = task;
    int64_t lo, hi;
    split_range(r->rows, t, T, 1, &lo, &hi);
    if (lo < hi) r->fn(r->args, lo, hi);
}

/* see thread_pool.h */
void for_rows(rows_fn fn, const void *args, int64_t n, int64_t elements, int nthreads) {
    if (elements < (pool_depth > 0 ? POOL_PARALLEL_ELEMENTS : PARALLEL_ELEMENTS) || nthreads <= 1 || n < 2) {
        fn(args, 0, n);
        return;
    }
    rows_task r = {fn, args, n};
    parallel_run(rows_part, &r, nthreads);
}
