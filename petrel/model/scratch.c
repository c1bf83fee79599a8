/* Scratch memory a thread's kernel calls keep from one call to the next.
 *
 * A prompt step's buffers are large (a 2,048-token step of a Qwen3-MoE-shaped layer gathers 16,384 expert rows:
 * 117 MB), and glibc serves blocks that large with mmap and returns them with munmap: every call then faulted its
 * pages in and the kernel zeroed them, 15% of such a step's time. Each thread keeps one buffer a slot instead, grown
 * to the largest a call has asked for and freed when the thread exits, as an engine keeps its activations'
 * workspace; buffers of 2 MiB or more ask for transparent huge pages (where the system grants them on madvise). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "scratch.h"

#define ALIGN 64
#define HUGE_PAGE ((size_t)2 << 20)

typedef struct {
    void *data[SCRATCH_SLOTS];
    size_t bytes[SCRATCH_SLOTS];
} held_scratch;

static pthread_key_t key;
static int have_key;
static pthread_once_t key_once = PTHREAD_ONCE_INIT;

static void release(void *p) {
    held_scratch *held = p;
    for (int s = 0; s < SCRATCH_SLOTS; s++) free(held->data[s]);
    free(held);
}

static void make_key(void) {
    have_key = pthread_key_create(&key, release) == 0;
}

static held_scratch *this_thread(void) {
    pthread_once(&key_once, make_key);
    if (!have_key) return NULL;
    held_scratch *held = pthread_getspecific(key);
    if (!held && (held = calloc(1, sizeof(*held))) && pthread_setspecific(key, held) != 0) {
        free(held);
        held = NULL;
    }
    return held;
}

/* see scratch.h */
void *scratch_take(scratch_slot slot, size_t bytes) {
    held_scratch *held = this_thread();
    if (!held) return NULL;
    if (bytes == 0) bytes = 1;   /* an empty call still gets a pointer, as malloc(0) gave */
    if (bytes <= held->bytes[slot]) return held->data[slot];
    free(held->data[slot]);
    held->data[slot] = NULL;
    held->bytes[slot] = 0;
    const size_t align = bytes >= HUGE_PAGE ? HUGE_PAGE : ALIGN;
    const size_t size = (bytes + align - 1) / align * align;
    void *p;
    if (posix_memalign(&p, align, size) != 0) return NULL;
    if (align == HUGE_PAGE) madvise(p, size, MADV_HUGEPAGE);
    held->data[slot] = p;
    held->bytes[slot] = size;
    return p;
}
