/*
 * Quantized KV formats (Q8, Q4, the V formats Q3 and Q2, and K/V pairs of formats), rotated or
 * not, with protected tokens
 * (sinks and a window kept FP16) or without, against an independent quantizer and rotation
 * written from the header's definition: the stored values (read_f16, bit-exact), and attention
 * against a float64 reference over the stored values, on any context (CPU or CUDA), random and
 * peaked (one heavy position, the rest light and equal, V small). The CUDA
 * backend has kernels for some pairs (t_cuda_has_pair): there, creating a cache of another pair
 * must fail with M40LLM_ERR_UNSUPPORTED.
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

enum { GROUP = 32 };

void t_quantize_group(int fmt, const float *x, double *out) {
  if (fmt == M40LLM_KV_Q8) {
    float amax = 0.0f;
    for (int i = 0; i < GROUP; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float d = t_f16_to_f32(t_f32_to_f16(amax / 127.0f));
    for (int i = 0; i < GROUP; i++) {
      const float c = d == 0.0f ? 0.0f : fmaxf(fminf(rintf(x[i] / d), 127.0f), -127.0f);
      out[i] = (double)(int)c * (double)d; /* an integer code: no -0 */
    }
  } else { /* Q4, Q3, Q2: codes 0..qmax */
    const float qmax = fmt == M40LLM_KV_Q4 ? 15.0f : fmt == M40LLM_KV_Q3 ? 7.0f : 3.0f;
    float lo = x[0], hi = x[0];
    for (int i = 1; i < GROUP; i++) {
      lo = fminf(lo, x[i]);
      hi = fmaxf(hi, x[i]);
    }
    const float d = t_f16_to_f32(t_f32_to_f16((hi - lo) / qmax));
    const float m = t_f16_to_f32(t_f32_to_f16(lo));
    for (int i = 0; i < GROUP; i++) {
      const float c = d == 0.0f ? 0.0f : fmaxf(fminf(rintf((x[i] - m) / d), qmax), 0.0f);
      out[i] = (double)(int)c * (double)d + (double)m;
    }
  }
}

/* The header's rotation of one row of d dims: butterfly stages over blocks of the largest
 * power of two dividing d, then 1/sqrt(block); in FP32 (as rounded by the library) or double. */
#define ROTATE_ROW(T, x, d, scale)                                      \
  do {                                                                  \
    const int b_ = (d) & -(d);                                          \
    for (int o_ = 0; o_ < (d); o_ += b_) {                              \
      for (int h = 1; h < b_; h *= 2)                                   \
        for (int i = o_; i < o_ + b_; i++)                              \
          if (((i - o_) & h) == 0) {                                    \
            const T a_ = (x)[i], c_ = (x)[i + h];                       \
            (x)[i] = a_ + c_, (x)[i + h] = a_ - c_;                     \
          }                                                             \
      for (int i = o_; i < o_ + b_; i++) (x)[i] *= (scale);             \
    }                                                                   \
  } while (0)
void t_rotate_f32(float *x, int d) { ROTATE_ROW(float, x, d, 1.0f / sqrtf((float)(d & -d))); }
void t_rotate_f64(double *x, int d) { ROTATE_ROW(double, x, d, 1.0 / sqrt((double)(d & -d))); }

/* How one tensor of a cache stores a row: its format, rotated or not, and whether the row is a
 * protected position (kept as FP16 of the rotated values). */
typedef struct {
  int fmt, rotated;
} tensor_rule;

/* What attention reads for one row x (d dims), in the tensor's (rotated) frame, in double; and
 * what read_f16 returns for it. */
static void stored_row(tensor_rule r, int kept, const float *x, int d, double *val, uint16_t *read) {
  float y[256];
  for (int i = 0; i < d; i++) y[i] = x[i];
  if (r.fmt == M40LLM_KV_F16) { /* never rotated, never a copy */
    for (int i = 0; i < d; i++) read[i] = t_f32_to_f16(y[i]), val[i] = t_f16_to_f32(read[i]);
    return;
  }
  if (r.rotated) t_rotate_f32(y, d);
  if (kept) {
    for (int i = 0; i < d; i++) val[i] = t_f16_to_f32(t_f32_to_f16(y[i]));
  } else {
    for (int i = 0; i < d; i += GROUP) t_quantize_group(r.fmt, y + i, val + i);
  }
  for (int i = 0; i < d; i++) y[i] = (float)val[i]; /* exact: FP16 values, or code x scale + min
                                                       rounded once as the library's FMA */
  if (r.rotated) t_rotate_f32(y, d);
  for (int i = 0; i < d; i++) read[i] = t_f32_to_f16(y[i]);
}

/* Values with structure quantization must survive: outlier channels (x10-30), a group of equal
 * values (scale 0), a group of zeros, and, where big (V only: in K they would make the softmax
 * one-hot with logits of 1e4, where FP32 rounding of a score alone is 1e-3), large magnitudes. */
void t_fill_kv_values(float *x, size_t rows, int d, int big) {
  const int outlier = t_rand_int(0, d - 1);
  for (size_t r = 0; r < rows; r++) {
    float *row = x + r * (size_t)d;
    t_fill_uniform(row, (size_t)d, -1.0f, 1.0f);
    row[outlier] *= t_rand_float(10.0f, 30.0f);
    const int kind = t_rand_int(0, 15);
    if (kind == 0) for (int i = 0; i < GROUP; i++) row[i] = 0.5f;
    if (kind == 1) for (int i = 0; i < GROUP; i++) row[i] = 0.0f;
    if (kind == 2 && big) for (int i = 0; i < d; i++) row[i] *= 1000.0f;
  }
}

void t_ref_head(const float *q, const double *k, const double *v, int len, int d, int stride,
                double scale, double *out) {
  double mx = -INFINITY, sum = 0.0;
  double *w = malloc((size_t)(len > 0 ? len : 1) * sizeof(double));
  for (int t = 0; t < len; t++) {
    double s = 0.0;
    for (int i = 0; i < d; i++) s += (double)q[i] * k[(size_t)t * stride + i];
    w[t] = s * scale;
    if (w[t] > mx) mx = w[t];
  }
  for (int i = 0; i < d; i++) out[i] = 0.0;
  for (int t = 0; t < len; t++) {
    w[t] = exp(w[t] - mx);
    sum += w[t];
    for (int i = 0; i < d; i++) out[i] += w[t] * v[(size_t)t * stride + i];
  }
  for (int i = 0; i < d; i++) out[i] = len > 0 ? out[i] / sum : 0.0;
  free(w);
}

static int backend_is_cuda(m40llm_context *ctx) {
  m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
  return m40llm_context_device_info(&info, ctx) == M40LLM_OK && info.backend == M40LLM_BACKEND_CUDA;
}

int t_cuda_has_pair(int kf, int vf) {
  if (vf == M40LLM_KV_SAME) vf = kf;
  return (kf == vf && kf != M40LLM_KV_Q3 && kf != M40LLM_KV_Q2) ||
         (kf == M40LLM_KV_Q8 && vf == M40LLM_KV_Q4) ||
         (kf == M40LLM_KV_Q4 && (vf == M40LLM_KV_Q3 || vf == M40LLM_KV_Q2));
}

static const char *format_name(int fmt) {
  static const char *const names[] = {"F16", "Q8", "Q4", "Q3", "Q2"};
  return fmt >= 0 && fmt < 5 ? names[fmt] : "?";
}

int t_pair_refused(m40llm_context *ctx, const m40llm_kvcache_options *o) {
  const int vf = o->v_format == M40LLM_KV_SAME ? o->format : o->v_format;
  if (!backend_is_cuda(ctx) || t_cuda_has_pair(o->format, vf)) return 0;
  m40llm_kvcache *c = (m40llm_kvcache *)&c;
  char want[64];
  snprintf(want, sizeof want, "no kernels for K format %s with V format %s",
           format_name(o->format), format_name(vf));
  T_FAIL_WITH(m40llm_kvcache_create(&c, ctx, o), M40LLM_ERR_UNSUPPORTED, want);
  T_CHECK(c == (m40llm_kvcache *)&c);
  return 1;
}

typedef struct {
  int kf, vf, n_heads, n_kv, d;
  int rotation, sinks, window; /* the options' (rotation: m40llm_kv_rotation) */
} quant_case;

/* One cache: sequences of the given lengths appended (FP32, or FP16 where use_f16) in chunks,
 * then read back and attended, batched and one by one. */
static void run_case(m40llm_context *ctx, quant_case c, const int *lens, int n_seqs, int use_f16) {
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.rotation = c.rotation;
  o.n_sinks = c.sinks;
  o.window = c.window;
  o.n_layers = 2;
  o.n_heads = c.n_heads;
  o.n_kv_heads = c.n_kv;
  o.head_dim = c.d;
  o.max_seqs = n_seqs;
  o.max_seq_len = 1;
  for (int i = 0; i < n_seqs; i++)
    if (lens[i] > o.max_seq_len) o.max_seq_len = lens[i];
  o.format = c.kf;
  o.v_format = c.vf;
  const int vf = c.vf == M40LLM_KV_SAME ? c.kf : c.vf;
  const int quantized = c.kf != M40LLM_KV_F16 || vf != M40LLM_KV_F16;
  const tensor_rule rule_k = {c.kf, c.kf != M40LLM_KV_F16 && c.rotation != M40LLM_ROTATE_NONE};
  const tensor_rule rule_v = {vf, vf != M40LLM_KV_F16 && (c.rotation == M40LLM_ROTATE_AUTO ||
                                                      c.rotation == M40LLM_ROTATE_KV)};
  t_set_case("quantized K %d / V %d, %d/%d heads, head_dim %d, rotation %d, sinks %d, window "
             "%d%s: create", c.kf, c.vf, c.n_heads, c.n_kv, c.d, c.rotation, c.sinks, c.window,
             use_f16 ? ", FP16 input" : "");
  if (t_pair_refused(ctx, &o)) return;
  m40llm_kvcache *cache = NULL;
  int rc = m40llm_kvcache_create(&cache, ctx, &o);
  if (rc == M40LLM_ERR_UNSUPPORTED && backend_is_cuda(ctx)) {
    /* The CUDA backend has kernels for some pairs only; it must say so at create. */
    T_CHECK(strstr(m40llm_last_error_message(), "format") != NULL);
    return;
  }
  if (!T_OK(rc)) return;
  const size_t row = (size_t)c.n_kv * (size_t)c.d, qrow = (size_t)c.n_heads * (size_t)c.d;
  const int layer = 1;
  double **sk = calloc((size_t)n_seqs, sizeof *sk), **sv = calloc((size_t)n_seqs, sizeof *sv);
  float *q = malloc((size_t)n_seqs * qrow * sizeof(float));
  float *got = malloc((size_t)n_seqs * qrow * sizeof(float));
  double *ref = malloc(qrow * sizeof(double));
  float *dq = t_dev_alloc(ctx, (size_t)n_seqs * qrow * sizeof(float));
  float *dout = t_dev_alloc(ctx, (size_t)n_seqs * qrow * sizeof(float));
  if (!T_CHECK(sk && sv && q && got && ref && dq && dout)) goto done;

  for (int s = 0; s < n_seqs; s++) {
    const size_t n = (size_t)lens[s] * row;
    float *k = malloc((n ? n : 1) * sizeof(float)), *v = malloc((n ? n : 1) * sizeof(float));
    sk[s] = malloc((n ? n : 1) * sizeof(double));
    sv[s] = malloc((n ? n : 1) * sizeof(double));
    uint16_t *hk = malloc((n ? n : 1) * sizeof(uint16_t)), *hv = malloc((n ? n : 1) * sizeof(uint16_t));
    if (!T_CHECK(k && v && sk[s] && sv[s] && hk && hv)) {
      free(k), free(v), free(hk), free(hv);
      goto done;
    }
    t_fill_kv_values(k, (size_t)lens[s] * (size_t)c.n_kv, c.d, 0);
    t_fill_kv_values(v, (size_t)lens[s] * (size_t)c.n_kv, c.d, 1);
    if (use_f16) { /* the library quantizes the FP16 values: so does the reference */
      for (size_t i = 0; i < n; i++) {
        hk[i] = t_f32_to_f16(k[i]);
        hv[i] = t_f32_to_f16(v[i]);
        k[i] = t_f16_to_f32(hk[i]);
        v[i] = t_f16_to_f32(hv[i]);
      }
    }
    /* Appends only: the window ends as the last c.window positions. */
    uint16_t *want_k = malloc((n ? n : 1) * sizeof(uint16_t)), *want_v = malloc((n ? n : 1) * sizeof(uint16_t));
    if (!T_CHECK(want_k && want_v)) {
      free(k), free(v), free(hk), free(hv), free(want_k), free(want_v);
      goto done;
    }
    for (size_t r = 0; r < (size_t)lens[s] * (size_t)c.n_kv; r++) {
      const int p = (int)(r / (size_t)c.n_kv);
      const int kept = quantized && (p < c.sinks || p >= lens[s] - c.window);
      const size_t e = r * (size_t)c.d;
      stored_row(rule_k, kept, k + e, c.d, sk[s] + e, want_k + e);
      stored_row(rule_v, kept, v + e, c.d, sv[s] + e, want_v + e);
    }
    t_set_case("quantized K %d / V %d, %d/%d heads, head_dim %d: append seq %d (%d positions)",
               c.kf, c.vf, c.n_heads, c.n_kv, c.d, s, lens[s]);
    for (int p = 0; p < lens[s];) {
      const int chunk = t_rand_int(1, lens[s] - p < 97 ? lens[s] - p : 97);
      const size_t off = (size_t)p * row, bytes = (size_t)chunk * row;
      void *dk = use_f16 ? t_dev_upload(ctx, hk + off, bytes * 2) : t_dev_upload(ctx, k + off, bytes * 4);
      void *dv = use_f16 ? t_dev_upload(ctx, hv + off, bytes * 2) : t_dev_upload(ctx, v + off, bytes * 4);
      rc = !dk || !dv ? M40LLM_ERR_OUT_OF_MEMORY
           : use_f16  ? m40llm_kvcache_append_f16(cache, layer, s, dk, dv, chunk)
                      : m40llm_kvcache_append_f32(cache, layer, s, dk, dv, chunk);
      m40llm_free(ctx, dk);
      m40llm_free(ctx, dv);
      if (!T_OK(rc)) break;
      p += chunk;
    }
    free(k), free(v), free(hk), free(hv);
    if (rc != M40LLM_OK) {
      free(want_k), free(want_v);
      goto done;
    }

    /* what is stored, bit-exact: FP16 of the dequantized value */
    if (lens[s] > 0) {
      t_set_case("quantized K %d / V %d, head_dim %d: read_f16 of seq %d", c.kf, c.vf, c.d, s);
      const size_t bytes = (size_t)lens[s] * row * sizeof(uint16_t);
      uint16_t *rk = t_dev_alloc(ctx, bytes), *rv = t_dev_alloc(ctx, bytes);
      uint16_t *bk = malloc(bytes), *bv = malloc(bytes);
      if (rk && rv && bk && bv && T_OK(m40llm_memset(ctx, rk, 0xFF, bytes)) &&
          T_OK(m40llm_memset(ctx, rv, 0xFF, bytes)) &&
          T_OK(m40llm_kvcache_read_f16(rk, rv, cache, layer, s, 0, lens[s])) &&
          t_dev_download(ctx, bk, rk, bytes) && t_dev_download(ctx, bv, rv, bytes)) {
        size_t bad = 0, first = 0;
        for (size_t i = 0; i < n; i++) {
          const int ok = bk[i] == want_k[i] && bv[i] == want_v[i];
          if (!ok && bad++ == 0) first = i;
        }
        T_CHECKF(bad == 0, "%zu stored values differ from the header's rule (first at %zu, "
                 "position %zu: K %04x want %04x, V %04x want %04x)", bad, first,
                 first / (size_t)row, bk[first], want_k[first], bv[first], want_v[first]);
      }
      m40llm_free(ctx, rk);
      m40llm_free(ctx, rv);
      free(bk);
      free(bv);
    }
    free(want_k), free(want_v);
  }

  t_fill_uniform(q, (size_t)n_seqs * qrow, -1.0f, 1.0f);
  if (!T_OK(m40llm_memcpy_to_device(ctx, dq, q, (size_t)n_seqs * qrow * sizeof(float)))) goto done;
  for (int batch = 0; batch < 2; batch++) {
    t_set_case("quantized K %d / V %d, %d/%d heads, head_dim %d: attention (%s)", c.kf, c.vf,
               c.n_heads, c.n_kv, c.d, batch ? "batch" : "one by one");
    if (!T_OK(m40llm_memset(ctx, dout, 0xFF, (size_t)n_seqs * qrow * sizeof(float)))) goto done;
    int32_t *ids = malloc((size_t)n_seqs * sizeof(int32_t));
    if (!T_CHECK(ids)) goto done;
    for (int i = 0; i < n_seqs; i++) ids[i] = i;
    if (batch) {
      rc = m40llm_kvcache_attn_batch_f32q(dout, cache, layer, ids, n_seqs, dq, 0.0f);
    } else {
      rc = M40LLM_OK;
      for (int i = 0; i < n_seqs && rc == M40LLM_OK; i++)
        rc = m40llm_kvcache_attn_last_token_f32q(dout + (size_t)i * qrow, cache, layer, i,
                                                 dq + (size_t)i * qrow, 0.0f);
    }
    free(ids);
    if (!T_OK(rc) || !t_dev_download(ctx, got, dout, (size_t)n_seqs * qrow * sizeof(float))) goto done;
    double worst = 0.0;
    for (int s = 0; s < n_seqs; s++) {
      const int group = c.n_heads / c.n_kv;
      for (int h = 0; h < c.n_heads; h++) {
        /* in the tensors' frames: q rotated as K is, the output rotated back as V is */
        const float *qh = q + (size_t)s * qrow + (size_t)h * c.d;
        float qr[256];
        double qd[256];
        for (int i = 0; i < c.d; i++) qd[i] = qh[i];
        if (rule_k.rotated) t_rotate_f64(qd, c.d);
        for (int i = 0; i < c.d; i++) qr[i] = (float)qd[i];
        t_ref_head(rule_k.rotated ? qr : qh, sk[s] + (size_t)(h / group) * c.d,
                 sv[s] + (size_t)(h / group) * c.d, lens[s], c.d, (int)row,
                 1.0 / sqrt((double)c.d), ref + (size_t)h * c.d);
        if (rule_v.rotated) t_rotate_f64(ref + (size_t)h * c.d, c.d);
      }
      const double err = t_rel_l2(got + (size_t)s * qrow, ref, qrow);
      if (!(err <= worst)) worst = err;
    }
    T_CHECKF(worst <= 1e-5, "relative L2 error %.3g over %d sequences (bound 1e-5)", worst, n_seqs);
  }

done:
  for (int s = 0; s < n_seqs; s++) {
    if (sk) free(sk[s]);
    if (sv) free(sv[s]);
  }
  free(sk), free(sv), free(q), free(got), free(ref);
  m40llm_free(ctx, dq);
  m40llm_free(ctx, dout);
  m40llm_kvcache_destroy(cache);
}

/* Fork and truncate copy and keep every plane, of K and of V. */
static void fork_truncate(m40llm_context *ctx, int kf, int vf) {
  t_set_case("quantized K %d / V %d: fork and truncate", kf, vf);
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = 2, o.n_heads = 4, o.n_kv_heads = 2, o.head_dim = 64, o.max_seqs = 3;
  o.max_seq_len = 40, o.format = kf, o.v_format = vf;
  if (t_pair_refused(ctx, &o)) return;
  m40llm_kvcache *cache = NULL;
  if (!T_OK(m40llm_kvcache_create(&cache, ctx, &o))) return;
  const size_t row = 2 * 64, n = 40 * row, part = 25 * row * 2;
  float *k = malloc(n * sizeof(float));
  uint16_t *a = malloc(2 * n * 2), *b = malloc(2 * n * 2);
  void *dk = NULL;
  uint16_t *ra = t_dev_alloc(ctx, 2 * n * 2), *rb = t_dev_alloc(ctx, 2 * n * 2);
  if (!T_CHECK(k && a && b && ra && rb)) goto done;
  t_fill_kv_values(k, 40 * 2, 64, 1);
  dk = t_dev_upload(ctx, k, n * sizeof(float));
  for (int l = 0; l < 2; l++) T_OK(m40llm_kvcache_append_f32(cache, l, 0, dk, dk, 40));
  T_OK(m40llm_kvcache_seq_fork(cache, 2, 0));
  T_OK(m40llm_kvcache_seq_truncate(cache, 2, 25));
  int len = -1;
  T_OK(m40llm_kvcache_seq_len(&len, cache, 1, 2));
  T_INT_EQ(len, 25);
  if (T_OK(m40llm_kvcache_read_f16(ra, ra + n, cache, 1, 0, 0, 25)) &&
      T_OK(m40llm_kvcache_read_f16(rb, rb + n, cache, 1, 2, 0, 25)) &&
      t_dev_download(ctx, a, ra, 2 * n * 2) && t_dev_download(ctx, b, rb, 2 * n * 2)) {
    T_CHECKF(memcmp(a, b, part) == 0, "the fork's K differs from its source");
    T_CHECKF(memcmp(a + n, b + n, part) == 0, "the fork's V differs from its source");
  }
done:
  m40llm_free(ctx, dk);
  m40llm_free(ctx, ra);
  m40llm_free(ctx, rb);
  free(k), free(a), free(b);
  m40llm_kvcache_destroy(cache);
}

/* Options: head_dim must be a multiple of 32; unknown formats are refused; sizes are the
 * header's bits a value; version-1 structs still work. */
static void options(m40llm_context *ctx) {
  t_set_case("quantized options");
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = 3, o.n_heads = 8, o.n_kv_heads = 2, o.head_dim = 128, o.max_seqs = 5;
  o.max_seq_len = 100;
  o.n_sinks = 4, o.window = 20;
  const size_t values = 3ull * 5 * 2 * 100 * 128; /* per tensor */
  const size_t kept = 3ull * 5 * 2 * 24 * 128 * 2;  /* FP16 slots per quantized tensor */
  size_t bytes = 0;
  o.format = M40LLM_KV_Q8;
  if (T_OK(m40llm_kvcache_bytes_needed(&bytes, &o)))
    T_CHECK(bytes == 2 * (values + values / 16) + 2 * kept);
  o.v_format = M40LLM_KV_Q4;
  if (T_OK(m40llm_kvcache_bytes_needed(&bytes, &o)))
    T_CHECK(bytes == (values + values / 16) + (values / 2 + values / 8) + 2 * kept);
  o.format = M40LLM_KV_F16;
  if (T_OK(m40llm_kvcache_bytes_needed(&bytes, &o)))
    T_CHECK(bytes == 2 * values + values / 2 + values / 8 + kept);
  o.v_format = M40LLM_KV_SAME; /* all F16: nothing to protect */
  if (T_OK(m40llm_kvcache_bytes_needed(&bytes, &o))) T_CHECK(bytes == 4 * values);
  o.format = M40LLM_KV_Q8, o.window = 1000, o.n_sinks = 0; /* capped at max_seq_len */
  if (T_OK(m40llm_kvcache_bytes_needed(&bytes, &o)))
    T_CHECK(bytes == 2 * (values + values / 16) + 2 * (kept / 24 * 100));
  o.window = 0;
  if (T_OK(m40llm_kvcache_bytes_needed(&bytes, &o))) T_CHECK(bytes == 2 * (values + values / 16));
  /* V in Q3 (4 bits a value) and Q2 (3 bits), K in Q4 (5 bits) */
  o.format = M40LLM_KV_Q4, o.v_format = M40LLM_KV_Q3, o.n_sinks = 4, o.window = 20;
  if (T_OK(m40llm_kvcache_bytes_needed(&bytes, &o)))
    T_CHECK(bytes == values * 5 / 8 + values * 4 / 8 + 2 * kept);
  o.v_format = M40LLM_KV_Q2;
  if (T_OK(m40llm_kvcache_bytes_needed(&bytes, &o)))
    T_CHECK(bytes == values * 5 / 8 + values * 3 / 8 + 2 * kept);
  o.format = M40LLM_KV_F16;
  if (T_OK(m40llm_kvcache_bytes_needed(&bytes, &o)))
    T_CHECK(bytes == 2 * values + values * 3 / 8 + kept);
  /* K may not be Q3 or Q2, whatever V is, on every backend: nothing created */
  for (int f = M40LLM_KV_Q3; f <= M40LLM_KV_Q2; f++) {
    const int vfs[3] = {M40LLM_KV_SAME, M40LLM_KV_Q4, f};
    for (int i = 0; i < 3; i++) {
      o.format = f, o.v_format = vfs[i];
      T_FAIL_WITH(m40llm_kvcache_bytes_needed(&bytes, &o), M40LLM_ERR_INVALID_ARGUMENT,
                  "V format only");
      m40llm_kvcache *none = (m40llm_kvcache *)&bytes;
      T_FAIL_WITH(m40llm_kvcache_create(&none, ctx, &o), M40LLM_ERR_INVALID_ARGUMENT,
                  "V format only");
      T_CHECK(none == (m40llm_kvcache *)&bytes);
    }
  }
  o.v_format = M40LLM_KV_Q3, o.format = M40LLM_KV_Q4, o.head_dim = 48;
  T_FAIL_WITH(m40llm_kvcache_bytes_needed(&bytes, &o), M40LLM_ERR_UNSUPPORTED, "multiple of 32");
  o.head_dim = 128;
  /* On the CUDA backend: pairs it has no kernels for, said at create */
  o.format = M40LLM_KV_Q8;
  T_CHECK(!backend_is_cuda(ctx) || t_pair_refused(ctx, &o));
  o.format = M40LLM_KV_F16, o.v_format = M40LLM_KV_Q2;
  T_CHECK(!backend_is_cuda(ctx) || t_pair_refused(ctx, &o));
  o.format = M40LLM_KV_Q4, o.v_format = M40LLM_KV_SAME, o.head_dim = 48;
  m40llm_kvcache *c = (m40llm_kvcache *)&bytes;
  T_FAIL_WITH(m40llm_kvcache_create(&c, ctx, &o), M40LLM_ERR_UNSUPPORTED, "multiple of 32");
  T_CHECK(c == (m40llm_kvcache *)&bytes);
  o.head_dim = 64, o.v_format = 5;
  T_FAIL_WITH(m40llm_kvcache_bytes_needed(&bytes, &o), M40LLM_ERR_UNSUPPORTED, "v_format");
  o.v_format = -2;
  T_FAIL_WITH(m40llm_kvcache_bytes_needed(&bytes, &o), M40LLM_ERR_UNSUPPORTED, "v_format");

  /* A version-1 caller's struct (as that header declared it) ends before v_format: the library
   * must not read past it (the ASan build catches a read of the heap block) and fills only its
   * fields back. */
  typedef struct {
    unsigned version;
    int n_layers, n_heads, n_kv_heads, head_dim, max_seqs, max_seq_len, format;
  } options_v1;
  _Static_assert(sizeof(options_v1) == offsetof(m40llm_kvcache_options, v_format), "v1 layout");
  options_v1 *old = malloc(sizeof *old);
  if (!T_CHECK(old)) return;
  m40llm_kvcache_options *as_v1 = (m40llm_kvcache_options *)(void *)old;
  if (T_OK(m40llm_kvcache_options_init(as_v1, 1))) {
    T_INT_EQ(old->version, 1);
    T_INT_EQ(old->format, M40LLM_KV_F16);
    old->n_layers = 1, old->n_heads = 2, old->n_kv_heads = 1, old->head_dim = 32;
    old->max_seqs = 1, old->max_seq_len = 4, old->format = M40LLM_KV_Q8;
    if (T_OK(m40llm_kvcache_bytes_needed(&bytes, as_v1))) T_CHECK(bytes == 2 * (4 * 32 + 4 * 2));
    c = NULL;
    if (T_OK(m40llm_kvcache_create(&c, ctx, as_v1))) {
      memset(old, 0, sizeof *old);
      old->version = 1;
      if (T_OK(m40llm_kvcache_get_options(as_v1, c))) {
        T_INT_EQ(old->version, 1);
        T_INT_EQ(old->format, M40LLM_KV_Q8);
        T_INT_EQ(old->max_seq_len, 4);
      }
      m40llm_kvcache_options now = M40LLM_KVCACHE_OPTIONS_INIT;
      if (T_OK(m40llm_kvcache_get_options(&now, c))) T_INT_EQ(now.v_format, M40LLM_KV_SAME);
      m40llm_kvcache_destroy(c);
    }
  }
  free(old);

  /* A version-2 struct (ends before rotation) keeps version 2's behaviour: no rotation, no
   * protected tokens. */
  typedef struct {
    unsigned version;
    int n_layers, n_heads, n_kv_heads, head_dim, max_seqs, max_seq_len, format, v_format;
  } options_v2;
  _Static_assert(sizeof(options_v2) == offsetof(m40llm_kvcache_options, rotation), "v2 layout");
  options_v2 *old2 = malloc(sizeof *old2);
  if (!T_CHECK(old2)) return;
  m40llm_kvcache_options *v2 = (m40llm_kvcache_options *)(void *)old2;
  if (T_OK(m40llm_kvcache_options_init(v2, 2))) {
    old2->n_layers = 1, old2->n_heads = 2, old2->n_kv_heads = 1, old2->head_dim = 32;
    old2->max_seqs = 1, old2->max_seq_len = 4, old2->format = M40LLM_KV_Q8;
    if (T_OK(m40llm_kvcache_bytes_needed(&bytes, v2))) T_CHECK(bytes == 2 * (4 * 32 + 4 * 2));
    c = NULL;
    if (T_OK(m40llm_kvcache_create(&c, ctx, v2))) {
      m40llm_kvcache_options now = M40LLM_KVCACHE_OPTIONS_INIT;
      if (T_OK(m40llm_kvcache_get_options(&now, c))) {
        T_INT_EQ(now.rotation, M40LLM_ROTATE_NONE);
        T_INT_EQ(now.n_sinks, 0);
        T_INT_EQ(now.window, 0);
      }
      m40llm_kvcache_destroy(c);
    }
  }
  free(old2);
}

/* The window after truncation and appends, and across a fork: position by position, read_f16
 * returns the FP16 copy (exactly the FP16 input: no rotation) where the position is protected,
 * else the dequantized value; attention reads the same values (the ring's live slots wrap). */
static void window_history(m40llm_context *ctx, int kf, int vf) {
  t_set_case("quantized K %d / V %d: the window through truncate, append and fork", kf, vf);
  enum { D = 32, SINKS = 2, WINDOW = 8, N = 40 };
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = 1, o.n_heads = 2, o.n_kv_heads = 1, o.head_dim = D, o.max_seqs = 2;
  o.max_seq_len = N, o.format = kf, o.v_format = vf, o.rotation = M40LLM_ROTATE_NONE;
  o.n_sinks = SINKS, o.window = WINDOW;
  if (t_pair_refused(ctx, &o)) return;
  m40llm_kvcache *cache = NULL;
  if (!T_OK(m40llm_kvcache_create(&cache, ctx, &o))) return;
  uint16_t x[N * D], got[N * D];
  for (int i = 0; i < N * D; i++) x[i] = t_f32_to_f16(t_rand_float(-1.0f, 1.0f));
  uint16_t *dx = t_dev_upload(ctx, x, sizeof x);
  uint16_t *dr = t_dev_alloc(ctx, sizeof got);
  float q[2 * D], out[2 * D];
  double kvals[N * D], vvals[N * D], ref[2 * D];
  t_fill_uniform(q, 2 * D, -2.0f, 2.0f);
  float *dq = t_dev_upload(ctx, q, sizeof q), *dout = t_dev_alloc(ctx, sizeof out);
  const tensor_rule rules[2] = {{kf, 0}, {vf, 0}};
  double *vals[2] = {kvals, vvals};
  /* 30 positions; back to 27 (the window keeps 22..26); 5 more, 27..31 (window 24..31, and
   * 22, 23 left it); fork; back to 20 (the window is empty: 20..22 were never refilled); 3
   * more, 20..22 (window 20..22). */
  struct { int op, n; int lo; } steps[] = {{0, 30, 22}, {1, 27, 22}, {0, 5, 24}, {2, 0, 24},
                                          {1, 20, 20}, {0, 3, 20}};
  int len = 0;
  for (size_t i = 0; dx && dr && dq && dout && i < sizeof steps / sizeof steps[0]; i++) {
    if (steps[i].op == 0) {
      if (!T_OK(m40llm_kvcache_append_f16(cache, 0, 0, dx + len * D, dx + len * D, steps[i].n))) break;
      len += steps[i].n;
    } else if (steps[i].op == 1) {
      if (!T_OK(m40llm_kvcache_seq_truncate(cache, 0, steps[i].n))) break;
      len = steps[i].n;
    } else if (!T_OK(m40llm_kvcache_seq_fork(cache, 1, 0))) {
      break;
    }
    for (int seq = 0; seq < (steps[i].op == 2 ? 2 : 1); seq++) {
      for (int kv = 0; kv < 2; kv++) { /* K, then V */
        if (!T_OK(m40llm_kvcache_read_f16(kv ? NULL : dr, kv ? dr : NULL, cache, 0, seq, 0, len)) ||
            !t_dev_download(ctx, got, dr, (size_t)len * D * 2))
          break;
        int bad = -1;
        for (int p = 0; p < len; p++) {
          float f[D];
          uint16_t want[D];
          for (int j = 0; j < D; j++) f[j] = t_f16_to_f32(x[p * D + j]);
          stored_row(rules[kv], p < SINKS || p >= steps[i].lo, f, D, vals[kv] + p * D, want);
          if (bad < 0 && memcmp(want, got + p * D, sizeof want) != 0) bad = p;
        }
        T_CHECKF(bad < 0, "step %zu, seq %d, %s: position %d is not what the window says", i,
                 seq, kv ? "V" : "K", bad);
      }
      if (!T_OK(m40llm_memset(ctx, dout, 0xFF, sizeof out)) ||
          !T_OK(m40llm_kvcache_attn_last_token_f32q(dout, cache, 0, seq, dq, 0.0f)) ||
          !t_dev_download(ctx, out, dout, sizeof out))
        break;
      for (int h = 0; h < 2; h++)
        t_ref_head(q + h * D, kvals, vvals, len, D, D, 1.0 / sqrt((double)D), ref + h * D);
      const double err = t_rel_l2(out, ref, 2 * D);
      T_CHECKF(err <= 1e-5, "step %zu, seq %d: attention relative L2 error %.3g (bound 1e-5)", i,
               seq, err);
    }
  }
  m40llm_free(ctx, dx);
  m40llm_free(ctx, dr);
  m40llm_free(ctx, dq);
  m40llm_free(ctx, dout);
  m40llm_kvcache_destroy(cache);
}

/* A long row's element i of position pos as appended the gen-th time (a truncation's positions
 * are appended again with other values): uniform in [-1, 1) from a hash, every 17th channel x8. */
static float long_value(uint32_t tensor, int gen, int pos, int i) {
  uint32_t h = tensor * 0x9E3779B9u ^ (uint32_t)gen * 0x85EBCA6Bu ^ (uint32_t)pos * 0xC2B2AE35u;
  h ^= (uint32_t)i * 0x27D4EB2Fu;
  h ^= h >> 15, h *= 0x2C1B3C6Du, h ^= h >> 12, h *= 0x297A2D39u, h ^= h >> 15;
  const float x = (float)(h >> 8) * (2.0f / 16777216.0f) - 1.0f;
  return i % 17 == 3 ? 8.0f * x : x;
}

/* Options for a one-layer cache of one sequence of up to len positions, case c's shape. */
static m40llm_kvcache_options one_seq_options(quant_case c, int rotation, int len) {
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.rotation = rotation;
  o.n_sinks = c.sinks, o.window = c.window;
  o.n_layers = 1, o.n_heads = c.n_heads, o.n_kv_heads = c.n_kv, o.head_dim = c.d;
  o.max_seqs = 1, o.max_seq_len = len;
  o.format = c.kf, o.v_format = c.vf;
  return o;
}

/* A one-sequence check's buffers: K and V rows of `rows` positions (host, zeroed, and device),
 * q and the output (host and device), and the float64 reference's output, maxima and sums. */
typedef struct {
  float *hk, *hv, *q, *got, *dk, *dv, *dq, *dout;
  double *ref, *m, *l;
} seq_buffers;

static int seq_buffers_alloc(m40llm_context *ctx, seq_buffers *b, size_t rows, quant_case c) {
  const size_t row = (size_t)c.n_kv * (size_t)c.d, qrow = (size_t)c.n_heads * (size_t)c.d;
  b->hk = calloc(rows * row, sizeof(float)), b->hv = calloc(rows * row, sizeof(float));
  b->q = malloc(qrow * sizeof(float)), b->got = malloc(qrow * sizeof(float));
  b->ref = malloc(qrow * sizeof(double));
  b->m = malloc((size_t)c.n_heads * sizeof(double)), b->l = malloc((size_t)c.n_heads * sizeof(double));
  b->dk = t_dev_alloc(ctx, rows * row * sizeof(float)), b->dv = t_dev_alloc(ctx, rows * row * sizeof(float));
  b->dq = t_dev_alloc(ctx, qrow * sizeof(float)), b->dout = t_dev_alloc(ctx, qrow * sizeof(float));
  return T_CHECK(b->hk && b->hv && b->q && b->got && b->ref && b->m && b->l && b->dk && b->dv &&
                 b->dq && b->dout);
}

static void seq_buffers_free(m40llm_context *ctx, seq_buffers *b) {
  free(b->hk), free(b->hv), free(b->q), free(b->got), free(b->ref), free(b->m), free(b->l);
  m40llm_free(ctx, b->dk), m40llm_free(ctx, b->dv), m40llm_free(ctx, b->dq);
  m40llm_free(ctx, b->dout);
}

/* A streamed float64 reference: one position's stored K and V (val[0], val[1]) seen by query
 * heads h0 .. h1 - 1 (q row h at h x d), their running max m, sum l and unnormalised output ref
 * (row h at h x d) updated. */
static void reference_step(const float *q, double (*val)[256], int h0, int h1, int d,
                           double scale, double *m, double *l, double *ref) {
  for (int h = h0; h < h1; h++) {
    double sc = 0.0;
    for (int i = 0; i < d; i++) sc += (double)q[h * d + i] * val[0][i];
    sc *= scale;
    const double m_new = sc > m[h] ? sc : m[h];
    const double alpha = exp(m[h] - m_new), w = exp(sc - m_new);
    l[h] = l[h] * alpha + w;
    for (int i = 0; i < d; i++) ref[h * d + i] = ref[h * d + i] * alpha + w * val[1][i];
    m[h] = m_new;
  }
}

/* One sequence of about 6400 x SMs / K/V heads positions (the plan then aims at splits of 400
 * positions at 8 blocks an SM, and cuts none shorter than 2/3 of that: more than the 256 of
 * kFp32MixedMinRows), so that the FP32 kernel's splits
 * read the kept rows with the codes (M40LLM_PLAN_MIXED) and one split holds both. Attention is
 * checked with the window a full ring (the kept slots one run), then after a truncation and
 * appends leave it part-filled from mid-ring (three runs). The float64 reference streams over
 * the positions, a row at a time. CUDA only (it plans no blocks on the CPU); on sm_80+ the
 * tensor-core kernels run the same calls (their own MIXED plans). */
static void long_kept_splits(m40llm_context *ctx, quant_case c) {
  m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
  if (!backend_is_cuda(ctx) || !T_OK(m40llm_context_device_info(&info, ctx))) return;
  const int sms = info.multiprocessors > 0 ? info.multiprocessors : 24;
  /* ring slot window - 20 first after the truncation: a window of 68 then wraps the ring */
  int len0 = 6400 * sms / c.n_kv;
  if (c.window >= 32) len0 += c.window - 20 - (len0 - c.sinks - c.window) % c.window;
  const int cut = len0 - 100, more = 40;
  const m40llm_kvcache_options o = one_seq_options(c, M40LLM_ROTATE_NONE, len0);
  const int vf = c.vf == M40LLM_KV_SAME ? c.kf : c.vf;
  t_set_case("long splits, K %d / V %d, %d/%d heads, head_dim %d, sinks %d, window %d: %d "
             "positions", c.kf, vf, c.n_heads, c.n_kv, c.d, c.sinks, c.window, len0);
  m40llm_kvcache *cache = NULL;
  if (t_pair_refused(ctx, &o) || !T_OK(m40llm_kvcache_create(&cache, ctx, &o))) return;
  enum { CHUNK = 4096 };
  const size_t row = (size_t)c.n_kv * (size_t)c.d, qrow = (size_t)c.n_heads * (size_t)c.d;
  const tensor_rule rules[2] = {{c.kf, 0}, {vf, 0}};
  const int group = c.n_heads / c.n_kv;
  seq_buffers b;
  if (!seq_buffers_alloc(ctx, &b, CHUNK, c)) goto done;
  t_fill_uniform(b.q, qrow, -1.0f, 1.0f);
  if (!T_OK(m40llm_memcpy_to_device(ctx, b.dq, b.q, qrow * sizeof(float)))) goto done;
  /* positions [from, to), their gen-th values */
  const struct { int from, to, gen; } appends[2] = {{0, len0, 0}, {cut, cut + more, 1}};
  for (int step = 0; step < 2; step++) {
    if (step == 1 && !T_OK(m40llm_kvcache_seq_truncate(cache, 0, cut))) break;
    for (int p = appends[step].from; p < appends[step].to; p += CHUNK) {
      const int n = appends[step].to - p < CHUNK ? appends[step].to - p : CHUNK;
      for (int t = 0; t < n; t++)
        for (size_t i = 0; i < row; i++) {
          b.hk[t * row + i] = long_value(1, appends[step].gen, p + t, (int)i);
          b.hv[t * row + i] = long_value(2, appends[step].gen, p + t, (int)i);
        }
      if (!T_OK(m40llm_memcpy_to_device(ctx, b.dk, b.hk, (size_t)n * row * sizeof(float))) ||
          !T_OK(m40llm_memcpy_to_device(ctx, b.dv, b.hv, (size_t)n * row * sizeof(float))) ||
          !T_OK(m40llm_kvcache_append_f32(cache, 0, 0, b.dk, b.dv, n)))
        goto done;
    }
    /* the window's first position: a truncation lowers it to the cut at most (no position
     * below it is refilled), an append raises it to the last c.window */
    const int len = appends[step].to, lo0 = len0 - c.window;
    int lo = lo0;
    if (step == 1) {
      lo = lo0 < cut ? lo0 : cut;
      if (len - c.window > lo) lo = len - c.window;
    }
    if (!T_OK(m40llm_memset(ctx, b.dout, 0xFF, qrow * sizeof(float))) ||
        !T_OK(m40llm_kvcache_attn_last_token_f32q(b.dout, cache, 0, 0, b.dq, 0.0f)) ||
        !t_dev_download(ctx, b.got, b.dout, qrow * sizeof(float)))
      goto done;
    const double scale = 1.0 / sqrt((double)c.d);
    for (int h = 0; h < c.n_heads; h++) b.m[h] = -INFINITY, b.l[h] = 0.0;
    for (size_t i = 0; i < qrow; i++) b.ref[i] = 0.0;
    for (int p = 0; p < len; p++) {
      const int gen = step == 1 && p >= cut;
      for (int g = 0; g < c.n_kv; g++) {
        float x[2][256];
        double val[2][256];
        uint16_t bits[256];
        for (int t = 0; t < 2; t++) {
          for (int i = 0; i < c.d; i++) x[t][i] = long_value(1 + t, gen, p, g * c.d + i);
          stored_row(rules[t], p < c.sinks || p >= lo, x[t], c.d, val[t], bits);
        }
        reference_step(b.q, val, g * group, (g + 1) * group, c.d, scale, b.m, b.l, b.ref);
      }
    }
    for (size_t i = 0; i < qrow; i++) b.ref[i] /= b.l[i / (size_t)c.d];
    /* Every kernel's bound, the tensor-core kernels' included: before their codes were centred
     * (MmaCodes) they missed it at this length (H200: Q4 2.2e-4, Q8 K / Q4 V 9.0e-4). */
    const double bound = 1e-5;
    const double err = t_rel_l2(b.got, b.ref, qrow);
    T_CHECKF(err <= bound, "%s: relative L2 error %.3g (bound %g)",
             step ? "window part-filled from mid-ring" : "window a full ring", err, bound);
  }
done:
  seq_buffers_free(ctx, &b);
  m40llm_kvcache_destroy(cache);
}

/* A peaked row: position 0's key meets q with a logit of 10-13 (natural units) and every later
 * key is 0, so each later position has the same weight, 2^-14.6 to 2^-18.9 of position 0's; V
 * is near 2^-12 (a quantized V's scales near 2^-18.4). The tensor-core kernel's weights, times
 * V's scale, go to the MMAs as FP16 hi + lo terms, which were subnormal under 2^-14 before they
 * were scaled (kMmaPShiftF16): this row then missed the bound (H200: Q8 1.5e-5 with V near 1).
 * With huge (t_huge_qk) the logit is near 2^27 and the row is position 0's V. Attention within
 * 1e-5 of float64 over the stored values, one call. */
static void peaked_row(m40llm_context *ctx, quant_case c, int len, int huge) {
  const m40llm_kvcache_options o = one_seq_options(c, c.rotation, len);
  const int vf = c.vf == M40LLM_KV_SAME ? c.kf : c.vf;
  t_set_case("%s row, K %d / V %d, %d/%d heads, head_dim %d, rotation %d, sinks %d, window "
             "%d: %d positions", huge ? "huge-logit" : "peaked", c.kf, vf, c.n_heads, c.n_kv, c.d,
             c.rotation, c.sinks, c.window, len);
  m40llm_kvcache *cache = NULL;
  if (t_pair_refused(ctx, &o) || !T_OK(m40llm_kvcache_create(&cache, ctx, &o))) return;
  const tensor_rule rules[2] = {
      {c.kf, c.kf != M40LLM_KV_F16 && c.rotation != M40LLM_ROTATE_NONE},
      {vf, vf != M40LLM_KV_F16 &&
               (c.rotation == M40LLM_ROTATE_AUTO || c.rotation == M40LLM_ROTATE_KV)}};
  const size_t row = (size_t)c.n_kv * (size_t)c.d, qrow = (size_t)c.n_heads * (size_t)c.d;
  const int group = c.n_heads / c.n_kv;
  float k0[256];
  seq_buffers b;
  if (!seq_buffers_alloc(ctx, &b, (size_t)len, c)) goto done;
  const double scale = 1.0 / sqrt((double)c.d);
  (huge ? t_huge_qk : t_peaked_qk)(b.q, c.n_heads, c.d, k0);
  for (int g = 0; g < c.n_kv; g++) memcpy(b.hk + g * c.d, k0, (size_t)c.d * sizeof(float));
  for (size_t i = 0; i < (size_t)len * row; i++) b.hv[i] = t_rand_float(0.5f, 1.5f) * 0x1p-12f;
  if (!T_OK(m40llm_memcpy_to_device(ctx, b.dk, b.hk, (size_t)len * row * sizeof(float))) ||
      !T_OK(m40llm_memcpy_to_device(ctx, b.dv, b.hv, (size_t)len * row * sizeof(float))) ||
      !T_OK(m40llm_memcpy_to_device(ctx, b.dq, b.q, qrow * sizeof(float))) ||
      !T_OK(m40llm_kvcache_append_f32(cache, 0, 0, b.dk, b.dv, len)) ||
      !T_OK(m40llm_memset(ctx, b.dout, 0xFF, qrow * sizeof(float))) ||
      !T_OK(m40llm_kvcache_attn_last_token_f32q(b.dout, cache, 0, 0, b.dq, 0.0f)) ||
      !t_dev_download(ctx, b.got, b.dout, qrow * sizeof(float)))
    goto done;
  for (int h = 0; h < c.n_heads; h++) b.m[h] = -INFINITY, b.l[h] = 0.0;
  for (size_t i = 0; i < qrow; i++) b.ref[i] = 0.0;
  /* in the tensors' frames: q rotated as K is, the output rotated back as V is */
  if (rules[0].rotated)
    for (int h = 0; h < c.n_heads; h++) {
      double qd[256];
      for (int i = 0; i < c.d; i++) qd[i] = b.q[h * c.d + i];
      t_rotate_f64(qd, c.d);
      for (int i = 0; i < c.d; i++) b.q[h * c.d + i] = (float)qd[i];
    }
  for (int p = 0; p < len; p++) {
    const int kept = p < c.sinks || p >= len - c.window;
    for (int g = 0; g < c.n_kv; g++) {
      double val[2][256];
      uint16_t bits[256];
      for (int t = 0; t < 2; t++)
        stored_row(rules[t], kept, (t ? b.hv : b.hk) + p * row + g * c.d, c.d, val[t], bits);
      reference_step(b.q, val, g * group, (g + 1) * group, c.d, scale, b.m, b.l, b.ref);
    }
  }
  for (size_t i = 0; i < qrow; i++) b.ref[i] /= b.l[i / (size_t)c.d];
  if (rules[1].rotated)
    for (int h = 0; h < c.n_heads; h++) t_rotate_f64(b.ref + (size_t)h * c.d, c.d);
  const double err = t_rel_l2(b.got, b.ref, qrow);
  T_CHECKF(err <= 1e-5, "relative L2 error %.3g (bound 1e-5)", err);
done:
  seq_buffers_free(ctx, &b);
  m40llm_kvcache_destroy(cache);
}

void t_cases_quantized(m40llm_context *ctx, int small) {
  options(ctx);
  enum { F16 = M40LLM_KV_F16, Q8 = M40LLM_KV_Q8, Q4 = M40LLM_KV_Q4, Q3 = M40LLM_KV_Q3,
         Q2 = M40LLM_KV_Q2 };
  const int pairs[][2] = {{Q8, Q8}, {Q4, Q4}, {Q4, Q3}, {Q4, Q2}, {Q8, Q3}, {F16, Q2}};
  for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
    fork_truncate(ctx, pairs[i][0], pairs[i][1]);
    window_history(ctx, pairs[i][0], pairs[i][1]);
  }
  enum { AUTO = M40LLM_ROTATE_AUTO, NONE = M40LLM_ROTATE_NONE, K = M40LLM_ROTATE_K,
         KV = M40LLM_ROTATE_KV };
  static const quant_case cases[] = {
      /* rotation alone */
      {M40LLM_KV_Q8, M40LLM_KV_SAME, 4, 4, 64, AUTO, 0, 0},
      {M40LLM_KV_Q4, M40LLM_KV_SAME, 4, 4, 64, NONE, 0, 0},
      {M40LLM_KV_Q8, M40LLM_KV_Q4, 8, 2, 128, AUTO, 0, 0},
      {M40LLM_KV_Q4, M40LLM_KV_SAME, 12, 4, 128, K, 0, 0},
      {M40LLM_KV_Q8, M40LLM_KV_SAME, 6, 3, 32, KV, 0, 0},
      {M40LLM_KV_Q4, M40LLM_KV_SAME, 16, 2, 256, AUTO, 0, 0},
      {M40LLM_KV_Q8, M40LLM_KV_SAME, 32, 8, 128, NONE, 0, 0},
      {M40LLM_KV_Q8, M40LLM_KV_SAME, 8, 1, 96, AUTO, 0, 0},
      {M40LLM_KV_Q4, M40LLM_KV_SAME, 8, 1, 192, KV, 0, 0},
      {M40LLM_KV_F16, M40LLM_KV_Q4, 4, 2, 64, AUTO, 0, 0},
      {M40LLM_KV_Q4, M40LLM_KV_Q8, 4, 2, 64, KV, 0, 0},
      /* protected tokens */
      {M40LLM_KV_Q8, M40LLM_KV_SAME, 4, 4, 64, AUTO, 4, 128},
      {M40LLM_KV_Q8, M40LLM_KV_Q4, 8, 2, 128, AUTO, 4, 128},
      {M40LLM_KV_Q4, M40LLM_KV_SAME, 12, 4, 128, K, 3, 17},
      {M40LLM_KV_Q8, M40LLM_KV_SAME, 6, 3, 32, KV, 0, 40},
      {M40LLM_KV_Q8, M40LLM_KV_SAME, 32, 8, 128, NONE, 2, 0},
      {M40LLM_KV_Q8, M40LLM_KV_SAME, 8, 1, 96, AUTO, 1, 5},
      {M40LLM_KV_F16, M40LLM_KV_Q4, 4, 2, 64, AUTO, 4, 128},
      {M40LLM_KV_Q4, M40LLM_KV_Q8, 4, 2, 64, KV, 4, 64},
      /* the V formats Q3 and Q2 (CUDA: with Q4 K; the other pairs are refused there) */
      {M40LLM_KV_Q4, M40LLM_KV_Q3, 8, 2, 64, AUTO, 0, 0},
      {M40LLM_KV_Q4, M40LLM_KV_Q2, 4, 4, 32, NONE, 0, 0},
      {M40LLM_KV_Q8, M40LLM_KV_Q3, 12, 4, 128, K, 0, 0},
      {M40LLM_KV_F16, M40LLM_KV_Q2, 16, 2, 256, KV, 0, 0},
      {M40LLM_KV_Q4, M40LLM_KV_Q3, 8, 1, 96, KV, 0, 0},
      {M40LLM_KV_Q4, M40LLM_KV_Q3, 8, 2, 128, AUTO, 4, 128},
      {M40LLM_KV_Q4, M40LLM_KV_Q2, 6, 3, 64, AUTO, 4, 128},
      {M40LLM_KV_Q8, M40LLM_KV_Q2, 4, 1, 32, K, 3, 17},
      {M40LLM_KV_F16, M40LLM_KV_Q3, 4, 2, 256, NONE, 0, 40},
      /* Q4 K with Q3 / Q2 V over the FP32 kernel's tiles (1, 2, 4, 8 heads; head_dim its
       * class's or not) and the tensor-core kernel's head_dims */
      {M40LLM_KV_Q4, M40LLM_KV_Q2, 16, 2, 256, KV, 0, 0},
      {M40LLM_KV_Q4, M40LLM_KV_Q3, 16, 2, 256, KV, 4, 128},
      {M40LLM_KV_Q4, M40LLM_KV_Q2, 8, 1, 96, K, 3, 17},
      {M40LLM_KV_Q4, M40LLM_KV_Q3, 4, 2, 256, NONE, 0, 40},
      {M40LLM_KV_Q4, M40LLM_KV_Q2, 4, 2, 256, AUTO, 4, 128},
      {M40LLM_KV_Q4, M40LLM_KV_Q2, 12, 4, 128, KV, 0, 0},
      {M40LLM_KV_Q4, M40LLM_KV_Q3, 12, 4, 96, AUTO, 2, 9},
      {M40LLM_KV_Q4, M40LLM_KV_Q2, 12, 4, 96, NONE, 0, 0},
      {M40LLM_KV_Q4, M40LLM_KV_Q3, 4, 4, 64, KV, 0, 0},
      {M40LLM_KV_Q4, M40LLM_KV_Q2, 4, 4, 128, KV, 4, 128},
      {M40LLM_KV_Q4, M40LLM_KV_Q3, 10, 2, 160, KV, 2, 9},
      {M40LLM_KV_Q4, M40LLM_KV_Q2, 6, 2, 32, AUTO, 1, 5},
      /* groups over 8 heads: several tiles of query heads a K/V head (20/2: 8 and 2) */
      {M40LLM_KV_Q8, M40LLM_KV_SAME, 20, 2, 128, AUTO, 4, 128},
      {M40LLM_KV_Q4, M40LLM_KV_SAME, 16, 1, 64, K, 0, 0},
      {M40LLM_KV_Q4, M40LLM_KV_Q2, 24, 1, 256, KV, 3, 17},
  };
  const int lens[6] = {1, 31, 33, 257, small ? 300 : 2100, 0};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(ctx, cases[i], lens, 6, 0);
  /* one long sequence alone: many splits, the combine kernel */
  const int one[1] = {small ? 900 : 6000};
  run_case(ctx, cases[2], one, 1, 0);
  run_case(ctx, cases[3], one, 1, 1);
  run_case(ctx, cases[1], one, 1, 1);
  run_case(ctx, cases[12], one, 1, 0);
  run_case(ctx, cases[13], one, 1, 1);
  run_case(ctx, cases[24], one, 1, 1);
  run_case(ctx, cases[25], one, 1, 0);
  run_case(ctx, cases[40], one, 1, 1);
  run_case(ctx, cases[28], one, 1, 0);
  run_case(ctx, cases[33], one, 1, 1);
  run_case(ctx, cases[37], one, 1, 0);
  /* the FP32 kernel's long splits: 2-head tiles (a V with a min summed apart: o_min), 4, 8
   * (wide), and one head */
  static const quant_case long_cases[] = {{M40LLM_KV_Q4, M40LLM_KV_SAME, 4, 2, 64, 0, 4, 128},
                                          {M40LLM_KV_Q8, M40LLM_KV_Q4, 8, 2, 128, 0, 4, 128},
                                          {M40LLM_KV_Q4, M40LLM_KV_Q2, 16, 2, 128, 0, 3, 17},
                                          {M40LLM_KV_Q8, M40LLM_KV_SAME, 4, 4, 128, 0, 4, 128}};
  for (size_t i = 0; i < sizeof long_cases / sizeof long_cases[0]; i++)
    long_kept_splits(ctx, long_cases[i]);
  static const quant_case peaked[] = {{M40LLM_KV_F16, M40LLM_KV_SAME, 8, 2, 128, NONE, 0, 0},
                                      {M40LLM_KV_F16, M40LLM_KV_SAME, 12, 4, 64, NONE, 0, 0},
                                      {M40LLM_KV_Q8, M40LLM_KV_SAME, 8, 2, 128, NONE, 0, 0},
                                      {M40LLM_KV_Q8, M40LLM_KV_Q4, 8, 2, 128, AUTO, 4, 128},
                                      {M40LLM_KV_Q4, M40LLM_KV_SAME, 4, 1, 64, KV, 0, 0},
                                      {M40LLM_KV_Q4, M40LLM_KV_Q2, 16, 2, 256, NONE, 4, 32},
                                      {M40LLM_KV_Q4, M40LLM_KV_Q3, 6, 3, 96, AUTO, 0, 0}};
  for (size_t i = 0; i < sizeof peaked / sizeof peaked[0]; i++)
    peaked_row(ctx, peaked[i], small ? 4099 : 12289, 0);
  /* Logits near 2^27: position 0's weight alone (a rotated K would leave FP16's range) */
  for (size_t i = 0; i < sizeof peaked / sizeof peaked[0]; i++)
    if (peaked[i].kf == F16 || peaked[i].rotation == NONE) peaked_row(ctx, peaked[i], 1000, 1);
  t_set_case("");
}
