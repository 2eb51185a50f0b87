#include "kv_format.h"

#include <math.h>
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

/* ---- Q8, Q4, Q3, Q2: groups of 32; the CUDA append kernel (cuda/kv_format.cuh) rounds the
 * same way, with the same FP32 operations in the same order. ---- */
#define GROUP 32

/* Q8 codes are stored offset by 128 (0..255), which the kernels widen with integer bit tricks. */
static void q8_encode_f32(void *codes, void *params, const float *src, int n) {
  uint8_t *c = codes;
  uint16_t *d = params;
  for (int g = 0; g < n / GROUP; g++) {
    const float *x = src + g * GROUP;
    float amax = 0.0f;
    for (int i = 0; i < GROUP; i++) amax = fmaxf(amax, fabsf(x[i]));
    d[g] = m40llm_f32_to_f16(amax / 127.0f);
    const float df = m40llm_f16_to_f32(d[g]);
    for (int i = 0; i < GROUP; i++) {
      const float q = df == 0.0f ? 0.0f : fmaxf(fminf(rintf(x[i] / df), 127.0f), -127.0f);
      c[g * GROUP + i] = (uint8_t)((int)q + 128);
    }
  }
}

static void q8_decode(float *dst, const void *codes, const void *params, int n) {
  const uint8_t *c = codes;
  const uint16_t *d = params;
  for (int i = 0; i < n; i++) dst[i] = (float)((int)c[i] - 128) * m40llm_f16_to_f32(d[i / GROUP]);
}

/* The asymmetric formats (Q4, Q3, Q2): one group's FP16 (scale, min) pair p and its codes q in
 * 0..qmax, as the header says. */
static void asym_group(uint8_t *q, uint16_t *p, const float *x, float qmax) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < GROUP; i++) {
    lo = fminf(lo, x[i]);
    hi = fmaxf(hi, x[i]);
  }
  p[0] = m40llm_f32_to_f16((hi - lo) / qmax);
  p[1] = m40llm_f32_to_f16(lo);
  const float df = m40llm_f16_to_f32(p[0]), mf = m40llm_f16_to_f32(p[1]);
  for (int i = 0; i < GROUP; i++)
    q[i] = (uint8_t)(df == 0.0f ? 0.0f : fmaxf(fminf(rintf((x[i] - mf) / df), qmax), 0.0f));
}

/* Code e of a group's codes g as each format packs them (the header's storage words). */
static int q4_code(const uint8_t *g, int e) { return (g[e / 2] >> (4 * (e & 1))) & 15; }
static int q2_code(const uint8_t *g, int e) { return (g[e / 4] >> (2 * (e & 3))) & 3; }
static int q3_code(const uint8_t *g, int e) {
  return q2_code(g, e) | ((g[8 + e / 8] >> (e & 7)) & 1) << 2;
}

/* Packs a group's codes q into g (zeroed first by the caller's memset of the row). */
static void q4_pack(uint8_t *g, const uint8_t *q) {
  for (int e = 0; e < GROUP; e++) g[e / 2] |= (uint8_t)(q[e] << (4 * (e & 1)));
}
static void q2_pack(uint8_t *g, const uint8_t *q) {
  for (int e = 0; e < GROUP; e++) g[e / 4] |= (uint8_t)((q[e] & 3) << (2 * (e & 3)));
}
static void q3_pack(uint8_t *g, const uint8_t *q) {
  q2_pack(g, q);
  for (int e = 0; e < GROUP; e++) g[8 + e / 8] |= (uint8_t)((q[e] >> 2) << (e & 7));
}

/* A row of an asymmetric format of `bits` (group bytes 4 x bits): codes and (d, m) pairs. */
#define ASYM_FORMAT(name, bits)                                                               \
  static void name##_encode_f32(void *codes, void *params, const float *src, int n) {         \
    uint8_t *c = codes, q[GROUP];                                                             \
    uint16_t *p = params;                                                                     \
    memset(c, 0, (size_t)n * (bits) / 8);                                                     \
    for (int g = 0; g < n / GROUP; g++) {                                                     \
      asym_group(q, p + 2 * g, src + g * GROUP, (float)((1 << (bits)) - 1));                  \
      name##_pack(c + g * 4 * (bits), q);                                                     \
    }                                                                                         \
  }                                                                                           \
  static void name##_decode(float *dst, const void *codes, const void *params, int n) {      \
    const uint8_t *c = codes;                                                                 \
    const uint16_t *p = params;                                                               \
    for (int i = 0; i < n; i++) {                                                             \
      const int g = i / GROUP;                                                                \
      dst[i] = fmaf((float)name##_code(c + g * 4 * (bits), i % GROUP),                        \
                    m40llm_f16_to_f32(p[2 * g]), m40llm_f16_to_f32(p[2 * g + 1]));            \
    }                                                                                         \
  }
ASYM_FORMAT(q4, 4)
ASYM_FORMAT(q3, 3)
ASYM_FORMAT(q2, 2)

/* From FP16 input and out to FP16, through FP32, for the quantized formats. */
#define FROM_F16_VIA_F32(name, encode)                                            \
  static void name(void *codes, void *params, const uint16_t *src, int n) {      \
    float x[256];                                                                 \
    for (int i = 0; i < n; i++) x[i] = m40llm_f16_to_f32(src[i]);                \
    encode(codes, params, x, n);                                                  \
  }
#define READ_VIA_F32(name, decode)                                                \
  static void name(uint16_t *dst, const void *codes, const void *params, int n) { \
    float x[256];                                                                 \
    decode(x, codes, params, n);                                                  \
    for (int i = 0; i < n; i++) dst[i] = m40llm_f32_to_f16(x[i]);                \
  }
FROM_F16_VIA_F32(q8_encode_f16, q8_encode_f32)
FROM_F16_VIA_F32(q4_encode_f16, q4_encode_f32)
FROM_F16_VIA_F32(q3_encode_f16, q3_encode_f32)
FROM_F16_VIA_F32(q2_encode_f16, q2_encode_f32)
READ_VIA_F32(q8_read, q8_decode)
READ_VIA_F32(q4_read, q4_decode)
READ_VIA_F32(q3_read, q3_decode)
READ_VIA_F32(q2_read, q2_decode)

static const m40llm_kv_format_desc formats[] = {
    {M40LLM_KV_F16, "F16", 16, 0, 0, 0, f16_encode_f32, f16_encode_f16, f16_decode, f16_read},
    {M40LLM_KV_Q8, "Q8", 8, GROUP, 2, 0, q8_encode_f32, q8_encode_f16, q8_decode, q8_read},
    {M40LLM_KV_Q4, "Q4", 4, GROUP, 4, 0, q4_encode_f32, q4_encode_f16, q4_decode, q4_read},
    {M40LLM_KV_Q3, "Q3", 3, GROUP, 4, 1, q3_encode_f32, q3_encode_f16, q3_decode, q3_read},
    {M40LLM_KV_Q2, "Q2", 2, GROUP, 4, 1, q2_encode_f32, q2_encode_f16, q2_decode, q2_read},
};

const m40llm_kv_format_desc *m40llm_kv_format_find(int format) {
  for (size_t i = 0; i < sizeof formats / sizeof formats[0]; i++)
    if (formats[i].format == format) return &formats[i];
  return NULL;
}

float m40llm_rotation_scale(int block) { return 1.0f / sqrtf((float)block); }

#define ROTATE(T, x, n, scale)                                            \
  do {                                                                    \
    const int b_ = m40llm_rotation_block(n);                              \
    for (int base = 0; base < (n); base += b_) {                          \
      T *y = (x) + base;                                                  \
      for (int h = 1; h < b_; h <<= 1)                                    \
        for (int i = 0; i < b_; i++)                                      \
          if (!(i & h)) {                                                 \
            const T a = y[i], c = y[i + h];                               \
            y[i] = a + c;                                                 \
            y[i + h] = a - c;                                             \
          }                                                               \
      for (int i = 0; i < b_; i++) y[i] *= (scale);                       \
    }                                                                     \
  } while (0)

void m40llm_rotate_f32(float *x, int n) {
  ROTATE(float, x, n, m40llm_rotation_scale(m40llm_rotation_block(n)));
}

void m40llm_rotate_f64(double *x, int n) {
  ROTATE(double, x, n, 1.0 / sqrt((double)m40llm_rotation_block(n)));
}

void m40llm_kv_protection(const m40llm_kvcache_options *o, int k_format, int v_format,
                          int *out_sinks, int *out_window) {
  const int quantized = k_format != M40LLM_KV_F16 || v_format != M40LLM_KV_F16;
  const int sinks = !quantized ? 0 : o->n_sinks < o->max_seq_len ? o->n_sinks : o->max_seq_len;
  const int room = o->max_seq_len - sinks;
  *out_sinks = sinks;
  *out_window = !quantized ? 0 : o->window < room ? o->window : room;
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
  if (f->group > 0 && o->head_dim % f->group != 0)
    return m40llm_fail(M40LLM_ERR_UNSUPPORTED,
                       "KV format %s needs head_dim a multiple of %d (opts->head_dim is %d)",
                       f->name, f->group, o->head_dim);
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
