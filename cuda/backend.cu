// The CUDA backend's table and host side: devices, the context's stream and workspace, memory,
// the checks only this backend needs, and the copies behind read and fork. Kernels live in
// append.cu and the attention_*.cu files (attention_dispatch.cu launches those).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda.h"
#include "common.cuh"
#include "io_rows.cuh"
#include "kv_format.cuh"
#include "tuning.cuh"

namespace {

// The errors that leave the CUDA context unusable ("sticky": every later call returns them).
bool is_sticky(cudaError_t err) {
  switch (err) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}

}  // namespace

int m40llm_cuda_error(cudaError_t err, const char *what) {
  (void)cudaGetLastError();  // clears the error unless it is sticky
  if (is_sticky(err))
    return m40llm_fail(M40LLM_ERR_CONTEXT_LOST,
                       "%s failed: %s (%s): a device fault; the CUDA context of this device is "
                       "lost for this process",
                       what, cudaGetErrorName(err), cudaGetErrorString(err));
  const int status =
      err == cudaErrorMemoryAllocation ? M40LLM_ERR_OUT_OF_MEMORY : M40LLM_ERR_CUDA;
  return m40llm_fail(status, "%s failed: %s (%s)", what, cudaGetErrorName(err),
                     cudaGetErrorString(err));
}

int m40llm_cuda_check_pointer(m40llm_cuda_state *st, const void *p, const char *name) {
  if (!st->check_pointers) return M40LLM_OK;
  for (const void *ok : st->ptr_ok)
    if (ok == p) return M40LLM_OK;
  cudaPointerAttributes attr;
  cudaError_t err = cudaPointerGetAttributes(&attr, p);
  if (err != cudaSuccess) {
    if (err != cudaErrorInvalidValue) return m40llm_cuda_error(err, "cudaPointerGetAttributes");
    (void)cudaGetLastError();  // older drivers: an address CUDA does not know
    attr.type = cudaMemoryTypeUnregistered;
  }
  const bool ok = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged ||
                  (attr.type == cudaMemoryTypeHost && attr.devicePointer == p);
  if (!ok)
    return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT,
                       "%s is %s, which the GPU cannot address: the CUDA backend needs device "
                       "memory (m40llm_malloc or cudaMalloc; copy host data in with "
                       "m40llm_memcpy_to_device)",
                       name,
                       attr.type == cudaMemoryTypeHost ? "pinned host memory not mapped to the device"
                                                       : "host memory");
  st->ptr_ok[st->ptr_ok_next++ % (sizeof st->ptr_ok / sizeof st->ptr_ok[0])] = p;
  return M40LLM_OK;
}

namespace {

thread_local char no_device_why[160];

int cuda_count(int *out_count) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no GPU: zero devices, not an error
    n = 0;
    snprintf(no_device_why, sizeof no_device_why, "cudaGetDeviceCount failed with %s (%s)",
             cudaGetErrorName(err), cudaGetErrorString(err));
  } else if (n == 0) {
    snprintf(no_device_why, sizeof no_device_why, "cudaGetDeviceCount reports 0 devices");
  }
  *out_count = n;
  return M40LLM_OK;
}

const char *cuda_no_device_reason() { return no_device_why; }

int cuda_init(m40llm_context *ctx, int device, void *user_stream) {
  // calloc, not new: the C ABI's archive needs no C++ runtime. Zeroed is the state's start.
  m40llm_cuda_state *st = static_cast<m40llm_cuda_state *>(m40llm_host_calloc(1, sizeof *st));
  if (!st) return m40llm_fail(M40LLM_ERR_OUT_OF_MEMORY, "allocating the CUDA state");
  int rc = M40LLM_OK;
  cudaDeviceProp prop;
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess) err = cudaGetDeviceProperties(&prop, device);
  if (err == cudaSuccess && !user_stream) err = cudaStreamCreate(&st->stream);
  if (err != cudaSuccess) {
    rc = m40llm_cuda_error(err, "initialising the CUDA device");
    free(st);
    return rc;
  }
  if (user_stream) st->stream = static_cast<cudaStream_t>(user_stream);
  st->owns_stream = user_stream == nullptr;
  st->check_pointers = ctx->check_pointers != 0;
  st->sm_count = prop.multiProcessorCount;
  st->cc_major = prop.major;
  st->smem_per_sm = prop.sharedMemPerMultiprocessor;
  st->smem_per_block = prop.sharedMemPerBlockOptin;
  st->smem_reserved_per_block = prop.reservedSharedMemPerBlock;
  ctx->state = st;
  return M40LLM_OK;
}

void cuda_fini(m40llm_context *ctx) {
  m40llm_cuda_state *st = cuda_state(ctx);
  if (!st) return;
  // Teardown cannot report failures; a broken context still releases what it can.
  (void)cudaSetDevice(ctx->device);
  (void)cudaStreamSynchronize(st->stream);  // a tiered call's side streams are joined into it
  if (st->has_side) {
    for (int i = 0; i < M40LLM_MAX_TIERS; i++) {
      (void)cudaStreamDestroy(st->side[i]);
      (void)cudaEventDestroy(st->join[i]);
    }
    (void)cudaEventDestroy(st->fork);
  }
  (void)cudaFree(st->workspace);
  (void)cudaFree(st->io_stage);
  (void)cudaFree(st->scores);
  if (st->owns_stream) (void)cudaStreamDestroy(st->stream);
  (void)cudaGetLastError();
  free(st);
  ctx->state = nullptr;
}

int cuda_synchronize(m40llm_context *ctx) {
  M40LLM_CUDA_ENTER(ctx);
  M40LLM_CUDA_TRY(cudaStreamSynchronize(cuda_state(ctx)->stream));
  return M40LLM_OK;
}

void *cuda_stream(const m40llm_context *ctx) { return cuda_state(ctx)->stream; }

int cuda_device_info(m40llm_device_info *out, const m40llm_context *ctx) {
  M40LLM_CUDA_ENTER(ctx);
  cudaDeviceProp prop;
  M40LLM_CUDA_TRY(cudaGetDeviceProperties(&prop, ctx->device));
  size_t free_bytes = 0, total_bytes = 0;
  M40LLM_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes));
  // Version 2's facts load kernels for this GPU (a JIT compile where it runs PTX): only when asked.
  if (out->version >= 2) {
    int rc = m40llm_cuda_device_code(&out->kernel_arch, &out->native_code);
    if (rc == M40LLM_OK) rc = m40llm_cuda_tensor_cores(cuda_state(ctx), &out->tensor_cores);
    if (rc != M40LLM_OK) return rc;
  }
  out->backend = M40LLM_BACKEND_CUDA;
  out->device = ctx->device;
  snprintf(out->name, sizeof out->name, "%s", prop.name);
  out->compute_major = prop.major;
  out->compute_minor = prop.minor;
  out->multiprocessors = prop.multiProcessorCount;
  out->total_memory = total_bytes;
  out->free_memory = free_bytes;
  return M40LLM_OK;
}

int cuda_malloc(void **out, m40llm_context *ctx, size_t bytes) {
  M40LLM_CUDA_ENTER(ctx);
  void *p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes);
  if (err != cudaSuccess) {
    char what[64];
    snprintf(what, sizeof what, "cudaMalloc(%zu bytes)", bytes);
    return m40llm_cuda_error(err, what);
  }
  *out = p;
  return M40LLM_OK;
}

int cuda_free(m40llm_context *ctx, void *ptr) {
  M40LLM_CUDA_ENTER(ctx);
  m40llm_cuda_state *st = cuda_state(ctx);
  memset(st->ptr_ok, 0, sizeof st->ptr_ok);  // the address may come back as anything
  M40LLM_CUDA_TRY(cudaStreamSynchronize(cuda_state(ctx)->stream));
  M40LLM_CUDA_TRY(cudaFree(ptr));
  return M40LLM_OK;
}

int cuda_memcpy(m40llm_context *ctx, void *dst, const void *src, size_t bytes, int kind) {
  M40LLM_CUDA_ENTER(ctx);
  cudaStream_t s = cuda_state(ctx)->stream;
  const cudaMemcpyKind k = kind == M40LLM_COPY_H2D   ? cudaMemcpyHostToDevice
                           : kind == M40LLM_COPY_D2H ? cudaMemcpyDeviceToHost
                                                     : cudaMemcpyDeviceToDevice;
  M40LLM_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, k, s));
  // Host copies return when done: the caller may reuse or read its host buffer at once.
  if (kind != M40LLM_COPY_D2D) M40LLM_CUDA_TRY(cudaStreamSynchronize(s));
  return M40LLM_OK;
}

int cuda_memset(m40llm_context *ctx, void *dst, int value, size_t bytes) {
  M40LLM_CUDA_ENTER(ctx);
  M40LLM_CUDA_TRY(cudaMemsetAsync(dst, value, bytes, cuda_state(ctx)->stream));
  return M40LLM_OK;
}

// The kernels load K/V rows 8 elements at a time, and have kernels for some format pairs.
int cuda_check_cache(const m40llm_kvcache_options *o) {
  if (o->head_dim % 8 != 0)
    return m40llm_fail(M40LLM_ERR_UNSUPPORTED,
                       "opts->head_dim %d: the CUDA backend needs a multiple of 8", o->head_dim);
  if (o->placement == M40LLM_PLACE_IMPORTANCE && o->n_heads > kObserveMaxHeads)
    return m40llm_fail(M40LLM_ERR_UNSUPPORTED,
                       "opts->n_heads %d with M40LLM_PLACE_IMPORTANCE: the CUDA backend's observe "
                       "call takes at most %d query heads",
                       o->n_heads, kObserveMaxHeads);
  if (o->n_tiers > 0) return M40LLM_OK;  // every pair of tier formats (tiers.cu)
  const int v_format = o->v_format == M40LLM_KV_SAME ? o->format : o->v_format;
  return with_kv_pair(o->format, v_format, [](auto) -> int { return M40LLM_OK; });
}

// A tensor's rows (layer, seq, every K/V head, positions pos ..) out as FP16
// [n_tokens][n_kv_heads][head_dim]: each head's rows are contiguous in the cache and
// interleaved by head in the output.
int read_rows(const m40llm_kvcache *c, const m40llm_kv_tensor &t, uint16_t *out, int layer,
              int seq, int pos, int n_tokens) {
  if (!out) return M40LLM_OK;
  const m40llm_kvcache_options *o = &c->opts;
  if (t.layout.fmt->format != M40LLM_KV_F16)
    return m40llm_cuda_read_decoded(c, t, out, layer, seq, pos, n_tokens);
  const size_t row = t.layout.row_bytes[M40LLM_KV_CODES];
  for (int h = 0; h < o->n_kv_heads; h++)
    M40LLM_CUDA_TRY(cudaMemcpy2DAsync(out + (size_t)h * o->head_dim, row * o->n_kv_heads,
                                      m40llm_kv_at(&t, M40LLM_KV_CODES,
                                                   m40llm_kv_row(o, layer, seq, h, pos)),
                                      row, row, n_tokens, cudaMemcpyDeviceToDevice,
                                      cuda_state(c->ctx)->stream));
  return M40LLM_OK;
}

int cuda_read_f16(const m40llm_kvcache *c, uint16_t *k_out, uint16_t *v_out, int layer, int seq,
                  int pos, int n_tokens) {
  M40LLM_CUDA_ENTER(c->ctx);
  m40llm_cuda_state *st = cuda_state(c->ctx);
  int rc0 = M40LLM_OK;
  if ((k_out && (rc0 = m40llm_cuda_check_pointer(st, k_out, "k_out")) != M40LLM_OK) ||
      (v_out && (rc0 = m40llm_cuda_check_pointer(st, v_out, "v_out")) != M40LLM_OK))
    return rc0;
  const int rc = read_rows(c, c->k, k_out, layer, seq, pos, n_tokens);
  return rc != M40LLM_OK ? rc : read_rows(c, c->v, v_out, layer, seq, pos, n_tokens);
}

// Every plane of src_seq's stored rows, one 2D copy per layer: heads are the pitch's rows; and
// the FP16 slots of every head, one run per layer.
int cuda_fork(const m40llm_kvcache *c, int dst_seq, int src_seq) {
  M40LLM_CUDA_ENTER(c->ctx);
  const m40llm_kvcache_options *o = &c->opts;
  for (const m40llm_kv_tensor *t : {&c->k, &c->v}) {
    for (int l = 0; t->fp16 && l < o->n_layers; l++)
      M40LLM_CUDA_TRY(cudaMemcpyAsync(
          t->fp16 + m40llm_kv_protected_row(o, c->slots, l, dst_seq, 0, 0) * o->head_dim,
          t->fp16 + m40llm_kv_protected_row(o, c->slots, l, src_seq, 0, 0) * o->head_dim,
          (size_t)o->n_kv_heads * c->slots * o->head_dim * sizeof(uint16_t),
          cudaMemcpyDeviceToDevice, cuda_state(c->ctx)->stream));
    for (int p = 0; p < M40LLM_KV_PLANES; p++) {
      if (!t->plane[p]) continue;
      const size_t pitch = (size_t)o->max_seq_len * t->layout.row_bytes[p];
      for (int l = 0; l < o->n_layers; l++) {
        const size_t width = (size_t)*m40llm_len_slot(c, l, src_seq) * t->layout.row_bytes[p];
        if (width == 0) continue;
        M40LLM_CUDA_TRY(cudaMemcpy2DAsync(m40llm_kv_at(t, p, m40llm_kv_row(o, l, dst_seq, 0, 0)),
                                          pitch,
                                          m40llm_kv_at(t, p, m40llm_kv_row(o, l, src_seq, 0, 0)),
                                          pitch, width, o->n_kv_heads, cudaMemcpyDeviceToDevice,
                                          cuda_state(c->ctx)->stream));
      }
    }
  }
  for (int t = 0; t < c->n_tiers; t++) {  // a tiered cache's rows, its held slots a head
    const size_t map_row = (size_t)o->tiers[t].rows * sizeof(int32_t);
    if (map_row > 0)  // and its slot map, every layer's rows of src_seq in one copy
      M40LLM_CUDA_TRY(cudaMemcpy2DAsync(m40llm_tier_map_at(c, t, 0, dst_seq), o->max_seqs * map_row,
                                        m40llm_tier_map_at(c, t, 0, src_seq), o->max_seqs * map_row,
                                        map_row, o->n_layers, cudaMemcpyDeviceToDevice,
                                        cuda_state(c->ctx)->stream));
    for (const m40llm_kv_tensor *x : {&c->tier_k[t], &c->tier_v[t]})
      for (int p = 0; p < M40LLM_KV_PLANES; p++) {
        if (!x->plane[p]) continue;
        const size_t pitch = (size_t)o->tiers[t].rows * x->layout.row_bytes[p];
        for (int l = 0; l < o->n_layers; l++) {
          const size_t width = (size_t)m40llm_tier_counts(c, l, src_seq)[t] * x->layout.row_bytes[p];
          if (width == 0) continue;
          M40LLM_CUDA_TRY(cudaMemcpy2DAsync(
              m40llm_kv_at(x, p, m40llm_tier_row(c, t, l, dst_seq, 0, 0)), pitch,
              m40llm_kv_at(x, p, m40llm_tier_row(c, t, l, src_seq, 0, 0)), pitch, width,
              o->n_kv_heads, cudaMemcpyDeviceToDevice, cuda_state(c->ctx)->stream));
        }
      }
  }
  return M40LLM_OK;
}

// The kernels' entry points behind the pointer-kind checks: each makes the cache's device current
// and checks a call's two caller buffers first.
int enter_with(const m40llm_kvcache *c, const void *a, const char *a_name, const void *b,
               const char *b_name) {
  M40LLM_CUDA_ENTER(c->ctx);
  m40llm_cuda_state *st = cuda_state(c->ctx);
  int rc = m40llm_cuda_check_pointer(st, a, a_name);
  return rc != M40LLM_OK ? rc : m40llm_cuda_check_pointer(st, b, b_name);
}

int cuda_append(const m40llm_kvcache *c, int layer, const m40llm_append_item *items,
                int n_items, const void *k, const void *v, int dtype) {
  const int rc = enter_with(c, k, "k", v, "v");
  return rc != M40LLM_OK ? rc : m40llm_cuda_append(c, layer, items, n_items, k, v, dtype);
}

int cuda_tier_rows(const m40llm_kvcache *c, int layer, const m40llm_row_op *ops, int n_ops,
                   const uint8_t *links, int n_chains, const void *k_in, const void *v_in,
                   int dtype, uint16_t *k_out, uint16_t *v_out) {
  M40LLM_CUDA_ENTER(c->ctx);
  const void *buffers[4] = {k_in, v_in, k_out, v_out};
  const char *names[4] = {"k", "v", "k_out", "v_out"};
  for (int i = 0; i < 4; i++) {
    const int rc = buffers[i] ? m40llm_cuda_check_pointer(cuda_state(c->ctx), buffers[i], names[i])
                              : M40LLM_OK;
    if (rc != M40LLM_OK) return rc;
  }
  return n_ops == 0 ? M40LLM_OK
                    : m40llm_cuda_tier_rows(c, layer, ops, n_ops, links, n_chains, k_in, v_in,
                                            dtype, k_out, v_out);
}

int cuda_prepare_attention(const m40llm_kvcache *c, int n_rows, const void *q, const void *out,
                           int dtype, int observe_len) {
  int rc = enter_with(c, q, "q", out, "out");
  if (rc == M40LLM_OK && observe_len > 0) rc = m40llm_cuda_prepare_observe(c, n_rows, observe_len);
  if (rc != M40LLM_OK || dtype == M40LLM_DTYPE_F32) return rc;
  float *stage = nullptr;  // with_f32_rows's size for these rows
  return m40llm_cuda_io_stage(cuda_state(c->ctx),
                              2 * (size_t)n_rows * c->opts.n_heads * c->opts.head_dim, &stage);
}

// An F16 cache's split kernels write a decode step's new rows themselves (attention.cuh,
// write_appended_row), where each row is whole 32-byte sectors that no other block reads.
int cuda_attention_appends(const m40llm_kvcache *c) {
  return c->k.layout.fmt->format == M40LLM_KV_F16 && c->v.layout.fmt->format == M40LLM_KV_F16 &&
         c->opts.head_dim % 16 == 0;
}

int cuda_attention(const m40llm_kvcache *c, int layer, const int32_t *seq_ids, int n_seqs,
                   const void *q, void *out, int dtype, float scale,
                   const m40llm_attn_export *x) {
  int rc = enter_with(c, q, "q", out, "out");
  if (rc == M40LLM_OK && x && x->observe) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    M40LLM_CUDA_TRY(cudaStreamIsCapturing(cuda_state(c->ctx)->stream, &capture));
    if (capture != cudaStreamCaptureStatusNone)
      return m40llm_fail(M40LLM_ERR_UNSUPPORTED,
                         "m40llm_kvcache_attn_observe_ex cannot be captured into a CUDA graph: "
                         "its ranking reaches the host through a copy the host waits for (make "
                         "the plain call in the graph, the observe call outside it)");
  }
  if (rc == M40LLM_OK && x && x->weights)
    rc = m40llm_cuda_check_pointer(cuda_state(c->ctx), x->weights, "weights");
  if (rc == M40LLM_OK && x && x->importance)
    rc = m40llm_cuda_check_pointer(cuda_state(c->ctx), x->importance, "importance");
  if (rc == M40LLM_OK && x && x->append_k)
    rc = enter_with(c, x->append_k, "k", x->append_v, "v");
  return rc != M40LLM_OK
             ? rc
             : m40llm_cuda_attention(c, layer, seq_ids, n_seqs, q, out, dtype, scale, x);
}

int cuda_attention_causal(const m40llm_kvcache *c, int layer, const m40llm_append_item *items,
                          int n_items, const void *q, void *out, int dtype, float scale,
                          int window) {
  const int rc = enter_with(c, q, "q", out, "out");
  return rc != M40LLM_OK ? rc
                         : m40llm_cuda_attention_causal(c, layer, items, n_items, q, out, dtype,
                                                        scale, window);
}

}  // namespace

int m40llm_cuda_may_grow(m40llm_cuda_state *st, const char *what) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  M40LLM_CUDA_TRY(cudaStreamIsCapturing(st->stream, &capture));
  if (capture == cudaStreamCaptureStatusNone) return M40LLM_OK;
  return m40llm_fail(M40LLM_ERR_UNSUPPORTED,
                     "the context's %s would have to grow while its stream is being captured "
                     "into a CUDA graph, and an allocation cannot be captured: make the same "
                     "call once before the capture (see Graphs in m40llm.h)",
                     what);
}

int m40llm_cuda_grow(m40llm_cuda_state *st, void **buf, size_t *buf_bytes, size_t bytes,
                     const char *what) {
  if (bytes <= *buf_bytes) return M40LLM_OK;
  const int rc = m40llm_cuda_may_grow(st, what);
  if (rc != M40LLM_OK) return rc;
  M40LLM_CUDA_TRY(cudaStreamSynchronize(st->stream));  // the old buffer may still be in use
  M40LLM_CUDA_TRY(cudaFree(*buf));
  *buf = nullptr;
  *buf_bytes = 0;
  M40LLM_CUDA_TRY(cudaMalloc(buf, bytes));
  *buf_bytes = bytes;
  return M40LLM_OK;
}

int m40llm_cuda_workspace(m40llm_cuda_state *st, size_t bytes, void **out) {
  const int rc =
      m40llm_cuda_grow(st, &st->workspace, &st->workspace_bytes, bytes, "attention workspace");
  *out = st->workspace;
  return rc;
}

// Positional: designated initialisers are C++20.
const m40llm_backend_ops m40llm_cuda_backend = {
    M40LLM_BACKEND_CUDA, cuda_count,   cuda_no_device_reason,   cuda_init,   cuda_fini,
    cuda_synchronize,    cuda_stream,  cuda_device_info,        cuda_malloc, cuda_free,
    cuda_memcpy,         cuda_memset,  cuda_check_cache,        m40llm_cuda_reserve_for,
    cuda_append,         cuda_read_f16, cuda_fork,              cuda_prepare_attention,
    cuda_attention_appends,
    cuda_attention,      cuda_attention_causal, cuda_tier_rows, m40llm_cuda_policy_alloc,
    m40llm_cuda_policy_free, m40llm_cuda_tier_rank, m40llm_cuda_tier_rank_wait,
    m40llm_cuda_graph_begin, m40llm_cuda_graph_end,
    m40llm_cuda_graph_launch, m40llm_cuda_graph_destroy, m40llm_cuda_capturing,
};
