/* What petrel's kernel library was built from: the digest of its sources and flags (kernel_build.source_digest,
 * passed by the build as PETREL_KERNELS_DIGEST), so that native.py can tell a library installed from other sources
 * (an editable install whose C files have changed since) from a current one. */
#include "kernels.h"

#ifndef PETREL_KERNELS_DIGEST
#define PETREL_KERNELS_DIGEST ""
#endif

const char *kernels_source_digest(void) { return PETREL_KERNELS_DIGEST; }
