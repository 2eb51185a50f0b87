/* KV storage formats on the host: what a stored element costs, how one row (the head_dim
 * elements of one layer, sequence, K/V head and position) is laid out, and the CPU reference
 * routines that encode and decode a row. Every backend and the front end size, address and
 * check K/V through this file; the CUDA kernels' counterpart is cuda/kv_format.cuh. */
#ifndef M40LLM_KV_FORMAT_H
#define M40LLM_KV_FORMAT_H

#include <stddef.h>
#include <stdint.h>

#include "m40llm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A tensor (K or V) is stored as planes of rows in the same row order: the element codes, and
 * for formats with per-group parameters (scales, minimums) those parameters. */
enum { M40LLM_KV_CODES, M40LLM_KV_PARAMS, M40LLM_KV_PLANES };

typedef struct m40llm_kv_format_desc {
  int format;       /* m40llm_kv_format */
  const char *name;
  int bits;         /* per element in the codes plane */
  int group;        /* elements sharing one parameter set; 0: the format has none */
  int param_bytes;  /* parameter bytes per group */
  int v_only;       /* V only: a cache's K may not use it (m40llm.h says why) */
  /* CPU reference for one row of n elements (n = head_dim): */
  void (*encode_f32)(void *codes, void *params, const float *src, int n);
  void (*encode_f16)(void *codes, void *params, const uint16_t *src, int n);
  void (*decode)(float *dst, const void *codes, const void *params, int n);
  void (*read_f16)(uint16_t *dst, const void *codes, const void *params, int n);
} m40llm_kv_format_desc;

/* The description of format, or NULL if this library has none. */
const m40llm_kv_format_desc *m40llm_kv_format_find(int format);

typedef struct m40llm_kv_layout {
  const m40llm_kv_format_desc *fmt;
  size_t row_bytes[M40LLM_KV_PLANES]; /* 0: the format has no such plane */
  size_t rows;                        /* n_layers x max_seqs x n_kv_heads x max_seq_len */
} m40llm_kv_layout;

/* The layout of one tensor in format for a cache with options o (already range-checked), and
 * its bytes over all planes; M40LLM_ERR_OUT_OF_MEMORY if they overflow size_t. */
int m40llm_kv_layout_init(m40llm_kv_layout *out, size_t *out_bytes,
                          const m40llm_kvcache_options *o, int format);

/* Row index of (layer, seq, kv_head, pos): [layer][seq][kv_head][pos]. */
static inline size_t m40llm_kv_row(const m40llm_kvcache_options *o, int layer, int seq,
                                   int kv_head, int pos) {
  return (((size_t)layer * (size_t)o->max_seqs + (size_t)seq) * (size_t)o->n_kv_heads +
          (size_t)kv_head) * (size_t)o->max_seq_len + (size_t)pos;
}

/* One tensor of a cache: its layout and its planes in backend memory. */
typedef struct m40llm_kv_tensor {
  m40llm_kv_layout layout;
  unsigned char *plane[M40LLM_KV_PLANES];
  int rotated;       /* rows are stored rotated (m40llm_rotate_f32) */
  uint16_t *fp16;    /* protected positions' FP16 rows (m40llm_kv_protected_row), or NULL */
} m40llm_kv_tensor;

/* ---- Rotation: the normalized Walsh-Hadamard transform over blocks of the row ---- */

/* The block of a row of n dims: the largest power of two dividing n (n <= 256). */
static inline int m40llm_rotation_block(int n) { return n & -n; }
/* 1 / sqrt(block) in FP32, the last step of the FP32 transform. */
float m40llm_rotation_scale(int block);
/* x (n dims) rotated in place: in each block, stages h = 1, 2, 4, .. of butterflies
 * (x[i], x[i + h]) -> (x[i] + x[i + h], x[i] - x[i + h]) for every i with bit h clear, then
 * every element times m40llm_rotation_scale. The CUDA kernels do the same FP32 operations. Its
 * own inverse up to rounding. */
void m40llm_rotate_f32(float *x, int n);
/* The same in double with the exact scale (the reference attention's). */
void m40llm_rotate_f64(double *x, int n);

/* ---- Protected tokens: FP16 copies of a quantized tensor's sinks and recent window ---- */

/* Sinks and window as a cache uses them: capped at max_seq_len, 0 where no tensor is
 * quantized. */
void m40llm_kv_protection(const m40llm_kvcache_options *o, int k_format, int v_format,
                          int *out_sinks, int *out_window);

#ifdef __CUDACC__
#define M40LLM_KV_INLINE __host__ __device__ static inline
#else
#define M40LLM_KV_INLINE static inline
#endif

/* Where position pos lies among the FP16 slots: sinks at their position, then a ring of
 * `window` slots (pos must be protected: pos < sinks or window > 0). */
M40LLM_KV_INLINE int m40llm_kv_protected_slot(int sinks, int window, int pos) {
  return pos < sinks ? pos : sinks + (pos - sinks) % window;
}

/* Row index of (layer, seq, kv_head, slot) in a protected plane of slots rows a head. */
static inline size_t m40llm_kv_protected_row(const m40llm_kvcache_options *o, int slots,
                                             int layer, int seq, int kv_head, int slot) {
  return (((size_t)layer * (size_t)o->max_seqs + (size_t)seq) * (size_t)o->n_kv_heads +
          (size_t)kv_head) * (size_t)slots + (size_t)slot;
}

static inline unsigned char *m40llm_kv_at(const m40llm_kv_tensor *t, int plane, size_t row) {
  return t->plane[plane] ? t->plane[plane] + row * t->layout.row_bytes[plane] : NULL;
}

#ifdef __cplusplus
}
#endif

#endif
