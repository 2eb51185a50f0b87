#include "kv_format.h"

#include <string.h>

#include "internal.h"

/* ---- F16: IEEE binary16 codes, no parameters ---- */

static void f16_encode_f32(void *codes, void *params, const float *src, int n) {
  (void)params;
  uint16_t *dst = codes;
  for (int i = 0; i < n; i++) dst[i] = m40llm_f32_to_f16(src[i]);
}

static void f16_encode_f16(void *codes, void *params, const uint16_t *src, int n) {
  (void)params;
  memcpy(codes, src, (size_t)n * sizeof(uint16_t));
}

static void f16_decode(float *dst, const void *codes, const void *params, int n) {
  (void)params;
  const uint16_t *src = codes;
  for (int i = 0; i < n; i++) dst[i] = m40llm_f16_to_f32(src[i]);
}

static void f16_read(uint16_t *dst, const void *codes, const void *params, int n) {
  (void)params;
  memcpy(dst, codes, (size_t)n * sizeof(uint16_t));
}

static const m40llm_kv_format_desc formats[] = {
    {M40LLM_KV_F16, "F16", 16, 0, 0, f16_encode_f32, f16_encode_f16, f16_decode, f16_read},
};

const m40llm_kv_format_desc *m40llm_kv_format_find(int format) {
  for (size_t i = 0; i < sizeof formats / sizeof formats[0]; i++)
    if (formats[i].format == format) return &formats[i];
  return NULL;
}

static int mul_checked(size_t *acc, size_t x) {
  if (x != 0 && *acc > SIZE_MAX / x) return 0;
  *acc *= x;
  return 1;
}

int m40llm_kv_layout_init(m40llm_kv_layout *out, size_t *out_bytes,
                          const m40llm_kvcache_options *o, int format) {
  const m40llm_kv_format_desc *f = m40llm_kv_format_find(format);
  if (!f) return m40llm_fail(M40LLM_ERR_UNSUPPORTED, "KV format %d is not supported", format);
  m40llm_kv_layout l;
  memset(&l, 0, sizeof l);
  l.fmt = f;
  l.row_bytes[M40LLM_KV_CODES] = ((size_t)o->head_dim * (size_t)f->bits + 7) / 8;
  if (f->group > 0)
    l.row_bytes[M40LLM_KV_PARAMS] =
        ((size_t)o->head_dim + (size_t)f->group - 1) / (size_t)f->group * (size_t)f->param_bytes;
  size_t rows = 1;
  const size_t dims[] = {(size_t)o->n_layers, (size_t)o->max_seqs, (size_t)o->n_kv_heads,
                         (size_t)o->max_seq_len};
  for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
    if (!mul_checked(&rows, dims[i]))
      return m40llm_fail(M40LLM_ERR_OUT_OF_MEMORY, "cache size overflows size_t");
  l.rows = rows;
  size_t bytes = 0;
  for (int p = 0; p < M40LLM_KV_PLANES; p++) {
    size_t plane = rows;
    if (!mul_checked(&plane, l.row_bytes[p]) || bytes > SIZE_MAX - plane)
      return m40llm_fail(M40LLM_ERR_OUT_OF_MEMORY, "cache size overflows size_t");
    bytes += plane;
  }
  *out = l;
  *out_bytes = bytes;
  return M40LLM_OK;
}
