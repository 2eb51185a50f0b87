/* What the C benchmarks share: a monotonic clock, and checks that print a failed library or CUDA
 * runtime call's status and message, then return `fail` from the calling function (the CUDA one
 * is for files that include cuda_runtime.h). */
#ifndef M40LLM_BENCH_UTIL_H
#define M40LLM_BENCH_UTIL_H

#include <stdio.h>
#include <time.h>

#include "m40llm.h"

static inline double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

#define BENCH_CHECK(x, fail)                                                             \
  do {                                                                                   \
    int rc_ = (x);                                                                       \
    if (rc_ != M40LLM_OK) {                                                              \
      fprintf(stderr, "%s: %s (%s)\n", #x, m40llm_status_string(rc_),                    \
              m40llm_last_error_message());                                              \
      return fail;                                                                       \
    }                                                                                    \
  } while (0)

#define BENCH_CUDA_CHECK(x, fail)                                                        \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                           \
      return fail;                                                                       \
    }                                                                                    \
  } while (0)

#endif
