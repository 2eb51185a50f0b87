#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* The CUDA backend's table, or NULL in a build without it. */
static const m40llm_backend_ops *cuda_backend(void) {
#ifdef M40LLM_HAVE_CUDA
  return &m40llm_cuda_backend;
#else
  return NULL;
#endif
}

int m40llm_context_check(const m40llm_context *ctx) {
  if (!ctx->lost) return M40LLM_OK;
  return m40llm_fail(M40LLM_ERR_CONTEXT_LOST,
                     "the context is lost: an earlier call met a device fault (%s); destroy its "
                     "caches and the context, and use the GPU from a new process",
                     ctx->lost_why);
}

int m40llm_context_result(m40llm_context *ctx, int status) {
  if (status == M40LLM_ERR_CONTEXT_LOST && !ctx->lost) {
    snprintf(ctx->lost_why, sizeof ctx->lost_why, "%s", m40llm_last_error_message());
    ctx->lost = 1;
  }
  return status;
}

/* A backend call on ctx: refused fast on a lost context, and a loss it meets is recorded. */
#define BACKEND_CALL(ctx, call) \
  (m40llm_context_check(ctx) != M40LLM_OK ? M40LLM_ERR_CONTEXT_LOST \
                                          : m40llm_context_result((ctx), (call)))

int m40llm_built_with_cuda(void) { return cuda_backend() != NULL; }

int m40llm_cuda_device_count(int *out_count) {
  if (!out_count) return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT, "out_count is NULL");
  *out_count = 0;
  return cuda_backend() ? cuda_backend()->device_count(out_count) : M40LLM_OK;
}

/* Bytes of the options struct of each version: a version-1 caller's ends before check_pointers. */
static size_t options_size(unsigned version) {
  return version == 1 ? offsetof(m40llm_context_options, check_pointers)
                      : version == 2 ? sizeof(m40llm_context_options) : 0;
}

int m40llm_context_options_init(m40llm_context_options *opts, unsigned version) {
  if (!opts) return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT, "opts is NULL");
  if (!options_size(version))
    return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT,
                       "context options version %u is not supported (this library knows 1 to %u)",
                       version, M40LLM_CONTEXT_OPTIONS_VERSION);
  const m40llm_context_options defaults = M40LLM_CONTEXT_OPTIONS_INIT;
  memcpy(opts, &defaults, options_size(version));
  opts->version = version;
  return M40LLM_OK;
}

int m40llm_context_create(m40llm_context **out, const m40llm_context_options *opts) {
  if (!out) return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT, "out is NULL");
  m40llm_context_options o = M40LLM_CONTEXT_OPTIONS_INIT;
  if (opts) {
    if (!options_size(opts->version))
      return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT,
                         "opts->version %u is not supported (this library knows 1 to %u; use "
                         "M40LLM_CONTEXT_OPTIONS_INIT)",
                         opts->version, M40LLM_CONTEXT_OPTIONS_VERSION);
    memcpy(&o, opts, options_size(opts->version));
    o.version = M40LLM_CONTEXT_OPTIONS_VERSION;
  }
  if (o.check_pointers != 0 && o.check_pointers != 1)
    return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT, "opts->check_pointers is %d, must be 0 or 1",
                       o.check_pointers);
  if (o.backend != M40LLM_BACKEND_AUTO && o.backend != M40LLM_BACKEND_CUDA &&
      o.backend != M40LLM_BACKEND_CPU)
    return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT, "opts->backend %d is not an m40llm_backend",
                       o.backend);
  int backend = o.backend;
  if (backend != M40LLM_BACKEND_CPU) {
    int count = 0;
    int rc = m40llm_cuda_device_count(&count);
    if (rc != M40LLM_OK) return rc;
    if (backend == M40LLM_BACKEND_AUTO) {
      backend = count > 0 ? M40LLM_BACKEND_CUDA : M40LLM_BACKEND_CPU;
    } else if (count == 0) {
      if (!cuda_backend())
        return m40llm_fail(M40LLM_ERR_NO_DEVICE,
                           "CUDA backend requested but m40llm was built without CUDA (no CUDA "
                           "toolkit was found when it was built): install one (scripts/setup.sh "
                           "does on Debian/Ubuntu) or point NVCC or CUDA_PATH at one, then "
                           "rebuild (cargo clean -p m40llm-sys; with CMake, a new build "
                           "directory)");
      return m40llm_fail(M40LLM_ERR_NO_DEVICE,
                         "CUDA backend requested but no usable CUDA device was found: %s",
                         cuda_backend()->no_device_reason());
    }
    /* The device matters only to the CUDA backend: AUTO on a machine without a usable GPU
     * takes the CPU and ignores it, as M40LLM_BACKEND_CPU does. */
    if (backend == M40LLM_BACKEND_CUDA && (o.device < 0 || o.device >= count))
      return m40llm_fail(M40LLM_ERR_OUT_OF_RANGE,
                         "opts->device %d is outside 0..%d (%d CUDA device(s))", o.device,
                         count - 1, count);
  }
  if (backend == M40LLM_BACKEND_CPU && o.cuda_stream)
    return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT,
                       "opts->cuda_stream is set but the context uses the CPU backend");

  m40llm_context *ctx = m40llm_host_calloc(1, sizeof *ctx);
  if (!ctx) return m40llm_fail(M40LLM_ERR_OUT_OF_MEMORY, "allocating the context");
  ctx->backend = backend;
  ctx->device = backend == M40LLM_BACKEND_CUDA ? o.device : -1;
  ctx->ops = backend == M40LLM_BACKEND_CUDA ? cuda_backend() : &m40llm_cpu_backend;
  ctx->check_pointers = o.check_pointers;
  int rc = ctx->ops->init(ctx, ctx->device, o.cuda_stream);
  if (rc == M40LLM_ERR_CONTEXT_LOST)
    rc = m40llm_fail(M40LLM_ERR_CONTEXT_LOST,
                     "CUDA device %d is lost to an earlier device fault in this process (%s)",
                     ctx->device, m40llm_last_error_message());
  if (rc != M40LLM_OK) {
    free(ctx);
    return rc;
  }
  *out = ctx;
  return M40LLM_OK;
}

void m40llm_context_destroy(m40llm_context *ctx) {
  if (!ctx) return;
  ctx->ops->fini(ctx);
  free(ctx);
}

int m40llm_context_synchronize(m40llm_context *ctx) {
  if (!ctx) return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT, "ctx is NULL");
  return BACKEND_CALL(ctx, ctx->ops->synchronize(ctx));
}

void *m40llm_context_cuda_stream(const m40llm_context *ctx) {
  return ctx ? ctx->ops->stream(ctx) : NULL;
}

/* Bytes of the device info of each version: a version-1 caller's ends before kernel_arch. */
static size_t device_info_size(unsigned version) {
  return version == 1 ? offsetof(m40llm_device_info, kernel_arch)
                      : version == 2 ? sizeof(m40llm_device_info) : 0;
}

int m40llm_context_device_info(m40llm_device_info *out, const m40llm_context *ctx) {
  if (!out) return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT, "out is NULL");
  if (!ctx) return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT, "ctx is NULL");
  const unsigned version = out->version;
  if (!device_info_size(version))
    return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT,
                       "out->version %u is not supported (this library knows 1 to %u; use "
                       "M40LLM_DEVICE_INFO_INIT)",
                       version, M40LLM_DEVICE_INFO_VERSION);
  /* The backend fills a whole struct, asked for the caller's version; the caller gets its part. */
  m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
  info.version = version;
  m40llm_context *c = (m40llm_context *)ctx; /* the loss is recorded in the handle */
  const int rc = BACKEND_CALL(c, ctx->ops->device_info(&info, ctx));
  if (rc == M40LLM_OK) memcpy(out, &info, device_info_size(version));
  return rc;
}

int m40llm_malloc(void **out_ptr, m40llm_context *ctx, size_t bytes) {
  if (!out_ptr) return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT, "out_ptr is NULL");
  if (!ctx) return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT, "ctx is NULL");
  if (bytes == 0) return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT, "bytes is 0");
  return BACKEND_CALL(ctx, ctx->ops->malloc(out_ptr, ctx, bytes));
}

int m40llm_free(m40llm_context *ctx, void *ptr) {
  if (!ptr) return M40LLM_OK;
  if (!ctx) return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT, "ctx is NULL");
  return BACKEND_CALL(ctx, ctx->ops->free(ctx, ptr));
}

static int copy_args(m40llm_context *ctx, void *dst, const void *src, size_t bytes) {
  if (!ctx) return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT, "ctx is NULL");
  if (bytes && !dst) return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT, "dst is NULL");
  if (bytes && !src) return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT, "src is NULL");
  return M40LLM_OK;
}

static int copy(m40llm_context *ctx, void *dst, const void *src, size_t bytes, int kind) {
  int rc = copy_args(ctx, dst, src, bytes);
  if (rc != M40LLM_OK || bytes == 0) return rc;
  return BACKEND_CALL(ctx, ctx->ops->memcpy(ctx, dst, src, bytes, kind));
}

int m40llm_memcpy_to_device(m40llm_context *ctx, void *dst, const void *src_host, size_t bytes) {
  return copy(ctx, dst, src_host, bytes, M40LLM_COPY_H2D);
}

int m40llm_memcpy_to_host(m40llm_context *ctx, void *dst_host, const void *src, size_t bytes) {
  return copy(ctx, dst_host, src, bytes, M40LLM_COPY_D2H);
}

int m40llm_memcpy_device(m40llm_context *ctx, void *dst, const void *src, size_t bytes) {
  return copy(ctx, dst, src, bytes, M40LLM_COPY_D2D);
}

int m40llm_memset(m40llm_context *ctx, void *dst, int value, size_t bytes) {
  if (!ctx) return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT, "ctx is NULL");
  if (bytes && !dst) return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT, "dst is NULL");
  if (bytes == 0) return M40LLM_OK;
  return BACKEND_CALL(ctx, ctx->ops->memset(ctx, dst, value, bytes));
}
