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

/* ---- Q8 and Q4: groups of 32; the CUDA append kernel (cuda/kv_format.cuh) rounds the same way,
 * with the same FP32 operations in the same order. ---- */
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

/* Q4: element 2j in the low nibble of byte j, 2j + 1 in the high one; (d, m) pairs. */
static void q4_encode_f32(void *codes, void *params, const float *src, int n) {
  uint8_t *c = codes;
  uint16_t *p = params;
  for (int g = 0; g < n / GROUP; g++) {
    const float *x = src + g * GROUP;
    float lo = x[0], hi = x[0];
    for (int i = 1; i < GROUP; i++) {
      lo = fminf(lo, x[i]);
      hi = fmaxf(hi, x[i]);
    }
    p[2 * g] = m40llm_f32_to_f16((hi - lo) / 15.0f);
    p[2 * g + 1] = m40llm_f32_to_f16(lo);
    const float df = m40llm_f16_to_f32(p[2 * g]), mf = m40llm_f16_to_f32(p[2 * g + 1]);
    for (int i = 0; i < GROUP; i += 2) {
      uint8_t b = 0;
      for (int j = 0; j < 2; j++) {
        const float q = df == 0.0f ? 0.0f : fmaxf(fminf(rintf((x[i + j] - mf) / df), 15.0f), 0.0f);
        b |= (uint8_t)((int)q << (4 * j));
      }
      c[(g * GROUP + i) / 2] = b;
    }
  }
}

static void q4_decode(float *dst, const void *codes, const void *params, int n) {
  const uint8_t *c = codes;
  const uint16_t *p = params;
  for (int i = 0; i < n; i++) {
    const int q = (c[i / 2] >> (4 * (i & 1))) & 15;
    dst[i] = fmaf((float)q, m40llm_f16_to_f32(p[2 * (i / GROUP)]),
                  m40llm_f16_to_f32(p[2 * (i / GROUP) + 1]));
  }
}

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
READ_VIA_F32(q8_read, q8_decode)
READ_VIA_F32(q4_read, q4_decode)

static const m40llm_kv_format_desc formats[] = {
    {M40LLM_KV_F16, "F16", 16, 0, 0, f16_encode_f32, f16_encode_f16, f16_decode, f16_read},
    {M40LLM_KV_Q8, "Q8", 8, GROUP, 2, q8_encode_f32, q8_encode_f16, q8_decode, q8_read},
    {M40LLM_KV_Q4, "Q4", 4, GROUP, 4, q4_encode_f32, q4_encode_f16, q4_decode, q4_read},
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
