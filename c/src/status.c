#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

static _Thread_local char last_error[512];

#define M40LLM_STR2(x) #x
#define M40LLM_STR(x) M40LLM_STR2(x)

unsigned m40llm_version_number(void) { return M40LLM_VERSION_NUMBER; }

const char *m40llm_version_string(void) {
  return M40LLM_STR(M40LLM_VERSION_MAJOR) "." M40LLM_STR(M40LLM_VERSION_MINOR) "." M40LLM_STR(
      M40LLM_VERSION_PATCH);
}

const char *m40llm_status_string(int status) {
  switch (status) {
    case M40LLM_OK: return "M40LLM_OK: success";
    case M40LLM_ERR_INVALID_ARGUMENT: return "M40LLM_ERR_INVALID_ARGUMENT: invalid argument";
    case M40LLM_ERR_OUT_OF_RANGE: return "M40LLM_ERR_OUT_OF_RANGE: index out of range";
    case M40LLM_ERR_CAPACITY: return "M40LLM_ERR_CAPACITY: sequence capacity exceeded";
    case M40LLM_ERR_OUT_OF_MEMORY: return "M40LLM_ERR_OUT_OF_MEMORY: out of memory";
    case M40LLM_ERR_NO_DEVICE: return "M40LLM_ERR_NO_DEVICE: no usable CUDA device";
    case M40LLM_ERR_CUDA: return "M40LLM_ERR_CUDA: CUDA runtime error";
    case M40LLM_ERR_UNSUPPORTED: return "M40LLM_ERR_UNSUPPORTED: not supported by this build or backend";
    case M40LLM_ERR_CONTEXT_LOST:
      return "M40LLM_ERR_CONTEXT_LOST: the context's GPU had a device fault; the context is lost";
    default: return "unknown status";
  }
}

const char *m40llm_last_error_message(void) { return last_error; }

int m40llm_fail(int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return status;
}

int (*m40llm_host_alloc_hook)(size_t bytes);

void *m40llm_host_malloc(size_t bytes) {
  if (m40llm_host_alloc_hook && m40llm_host_alloc_hook(bytes)) return NULL;
  return malloc(bytes);
}

void *m40llm_host_calloc(size_t n, size_t size) {
  if (m40llm_host_alloc_hook && m40llm_host_alloc_hook(n * size)) return NULL;
  return calloc(n, size);
}

void *m40llm_host_aligned_alloc(size_t alignment, size_t bytes) {
  if (m40llm_host_alloc_hook && m40llm_host_alloc_hook(bytes)) return NULL;
  return aligned_alloc(alignment, bytes);
}
