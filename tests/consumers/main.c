/* A consumer program: exits 0 only when the check passes. EXPECT_CUDA (0 or 1) may be defined
 * by the build to require a library with (1) or without (0) the CUDA backend. */
#include "check.h"

#ifndef EXPECT_CUDA
#define EXPECT_CUDA -1
#endif

int main(void) { return consumer_check(EXPECT_CUDA) == 0 ? 0 : 1; }
