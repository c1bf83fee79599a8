/* Scratch memory a thread's kernel calls keep from one call to the next (scratch.c) */
#pragma once
#include <stddef.h>

/* One buffer a slot: the callers that may hold scratch at the same time (a decoder stack's layers; inside them a
 * mixture of experts' routing; inside that its picks' indices and its experts' rows) each take their own */
typedef enum {
    SCRATCH_LAYERS, SCRATCH_ROUTING, SCRATCH_EXPERT_PICKS, SCRATCH_EXPERT_ROWS, SCRATCH_SLOTS
} scratch_slot;

/* The calling thread's buffer for `slot`, at least `bytes` long (64-byte aligned), valid until this thread's next
 * scratch_take of the same slot or its exit; NULL if the memory could not be had */
void *scratch_take(scratch_slot slot, size_t bytes);
