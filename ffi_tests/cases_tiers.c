/*
 * Tiered caches (m40llm_kvcache_options.n_tiers > 0) against a host model written from the
 * header's rules: a row gets the first tier with a free row when it leaves the window (from its
 * FP16 copy) or when it is appended past it (from the appended values); tier_move re-quantizes
 * from the values held, all or nothing; truncate frees rows; fork copies them. After every step:
 * each tier's row count, each position's tier, read_f16 bit for bit, and attention against
 * float64 (1e-5 relative), each sequence alone and all in one batch, and the same calls'
 * exported weights and importance (against the float64 softmax: 1e-4 relative + 1e-7, the
 * entries past a length untouched). A one-tier cache without a window equals the uniform cache
 * of its formats bit for bit (on CUDA: within 1e-5). Causal attention against float64 (the
 * CUDA backend refuses it with a sliding window in this version).
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

enum { GROUP = 32 };
#define X_REL 1e-4
#define X_ABS 1e-7

/* One (layer, seq) of the model: rows are [pos][kv][kv_head][dim], kv 0 for K and 1 for V. */
typedef struct {
  int len, lo, count[M40LLM_MAX_TIERS];
  int *tier;   /* [pos]: -1 for a row in its FP16 slot */
  float *y;    /* the appended values, rotated as stored */
  double *val; /* what attention reads */
} m_seq;

typedef struct {
  m40llm_kvcache_options o;
  int sinks, window, row; /* row: floats of one position (2 x n_kv_heads x head_dim) */
  m_seq *seqs;            /* [layer][seq] */
  long long moved;        /* rows tier_move moved */
} model;

static m_seq *seq_of(model *m, int layer, int seq) {
  return &m->seqs[(size_t)layer * (size_t)m->o.max_seqs + (size_t)seq];
}

static int model_init(model *m, const m40llm_kvcache_options *o) {
  memset(m, 0, sizeof *m);
  m->o = *o;
  m->sinks = o->n_sinks < o->max_seq_len ? o->n_sinks : o->max_seq_len;
  m->window = o->window < o->max_seq_len - m->sinks ? o->window : o->max_seq_len - m->sinks;
  m->row = 2 * o->n_kv_heads * o->head_dim;
  const size_t n = (size_t)o->n_layers * (size_t)o->max_seqs;
  m->seqs = calloc(n, sizeof *m->seqs);
  if (!m->seqs) return 0;
  for (size_t i = 0; i < n; i++) {
    m->seqs[i].tier = malloc((size_t)o->max_seq_len * sizeof(int));
    m->seqs[i].y = malloc((size_t)o->max_seq_len * (size_t)m->row * sizeof(float));
    m->seqs[i].val = malloc((size_t)o->max_seq_len * (size_t)m->row * sizeof(double));
    if (!m->seqs[i].tier || !m->seqs[i].y || !m->seqs[i].val) return 0;
  }
  return 1;
}

static void model_free(model *m) {
  if (!m->seqs) return;
  for (size_t i = 0; i < (size_t)m->o.n_layers * (size_t)m->o.max_seqs; i++) {
    free(m->seqs[i].tier);
    free(m->seqs[i].y);
    free(m->seqs[i].val);
  }
  free(m->seqs);
}

static int quantized_rows(const model *m, int lo, int len) {
  int w = lo > m->sinks ? lo : m->sinks;
  w = w < len ? w : len;
  return w > m->sinks ? w - m->sinks : 0;
}

static int tier_format(const model *m, int t, int kv) {
  return kv ? m->o.tiers[t].v_format : m->o.tiers[t].k_format;
}

/* Position p's rows quantized into tier t from src (FP32, every kv and head). */
static void quantize_into(model *m, m_seq *s, int p, int t, const float *src) {
  const int d = m->o.head_dim, heads = m->o.n_kv_heads;
  for (int kv = 0; kv < 2; kv++)
    for (int h = 0; h < heads; h++) {
      const size_t at = ((size_t)kv * heads + h) * d;
      for (int i = 0; i < d; i += GROUP)
        t_quantize_group(tier_format(m, t, kv), src + at + i,
                         s->val + (size_t)p * m->row + at + i);
    }
  s->tier[p] = t;
  s->count[t]++;
}

static int first_free(const model *m, const m_seq *s) {
  int t = 0;
  while (t < m->o.n_tiers - 1 && s->count[t] >= m->o.tiers[t].rows) t++;
  return t;
}

/* The header's append: x is [n][kv][kv_head][dim] of appended values. */
static void model_append(model *m, int layer, int seq, const float *x, int n) {
  m_seq *s = seq_of(m, layer, seq);
  const int d = m->o.head_dim, len = s->len, end = len + n;
  const int lo = s->lo < end - m->window ? end - m->window : s->lo;
  const int q_end = m->sinks + quantized_rows(m, lo, end);
  float f16[2 * 16 * 256];
  for (int p = m->sinks + quantized_rows(m, s->lo, len); p < q_end && p < len; p++) {
    for (int i = 0; i < m->row; i++) f16[i] = t_f16_to_f32(t_f32_to_f16(s->y[(size_t)p * m->row + i]));
    quantize_into(m, s, p, first_free(m, s), f16);
  }
  for (int r = 0; r < n; r++) {
    const int p = len + r;
    float *y = s->y + (size_t)p * m->row;
    memcpy(y, x + (size_t)r * m->row, (size_t)m->row * sizeof(float));
    for (int i = 0; i < m->row; i += d) t_rotate_f32(y + i, d); /* AUTO: both are quantized */
    if (p >= m->sinks && p < q_end) {
      quantize_into(m, s, p, first_free(m, s), y);
    } else {
      s->tier[p] = -1;
      for (int i = 0; i < m->row; i++) s->val[(size_t)p * m->row + i] = t_f16_to_f32(t_f32_to_f16(y[i]));
    }
  }
  s->len = end;
  s->lo = lo;
}

/* The header's tier_move; returns the status the library must give. */
static int model_move(model *m, int layer, int seq, int begin, int end, int t) {
  m_seq *s = seq_of(m, layer, seq);
  const int q_end = m->sinks + quantized_rows(m, s->lo, s->len);
  if (begin < m->sinks) begin = m->sinks;
  if (end > q_end) end = q_end;
  int moving = 0;
  for (int p = begin; p < end; p++) moving += s->tier[p] != t;
  if (moving > m->o.tiers[t].rows - s->count[t]) return M40LLM_ERR_CAPACITY;
  m->moved += moving;
  float f[2 * 16 * 256];
  for (int p = begin; p < end; p++) {
    if (s->tier[p] == t) continue;
    for (int i = 0; i < m->row; i++) f[i] = (float)s->val[(size_t)p * m->row + i];
    s->count[s->tier[p]]--;
    quantize_into(m, s, p, t, f);
  }
  return M40LLM_OK;
}

static void model_truncate(model *m, int seq, int new_len) {
  for (int l = 0; l < m->o.n_layers; l++) {
    m_seq *s = seq_of(m, l, seq);
    for (int p = new_len; p < s->len; p++)
      if (s->tier[p] >= 0) s->count[s->tier[p]]--;
    if (s->len > new_len) s->len = new_len;
    if (s->lo > new_len) s->lo = new_len;
  }
}

static void model_fork(model *m, int dst, int src) {
  for (int l = 0; l < m->o.n_layers; l++) {
    m_seq *a = seq_of(m, l, dst), *b = seq_of(m, l, src);
    a->len = b->len, a->lo = b->lo;
    memcpy(a->count, b->count, sizeof a->count);
    memcpy(a->tier, b->tier, (size_t)b->len * sizeof(int));
    memcpy(a->y, b->y, (size_t)b->len * (size_t)m->row * sizeof(float));
    memcpy(a->val, b->val, (size_t)b->len * (size_t)m->row * sizeof(double));
  }
}

/* Appends n random rows through the library and the model. */
static int append_both(m40llm_context *ctx, m40llm_kvcache *c, model *m, int layer, int seq, int n) {
  const int heads = m->o.n_kv_heads, d = m->o.head_dim;
  const size_t half = (size_t)n * heads * d;
  float *k = malloc(half * sizeof(float)), *v = malloc(half * sizeof(float));
  float *x = malloc(2 * half * sizeof(float));
  int rc = M40LLM_ERR_OUT_OF_MEMORY;
  if (k && v && x) {
    t_fill_kv_values(k, (size_t)n * heads, d, 0);
    t_fill_kv_values(v, (size_t)n * heads, d, 1);
    for (int r = 0; r < n; r++)
      for (int kv = 0; kv < 2; kv++)
        memcpy(x + ((size_t)r * 2 + kv) * heads * d, (kv ? v : k) + (size_t)r * heads * d,
               (size_t)heads * d * sizeof(float));
    float *dk = t_dev_upload(ctx, k, half * sizeof(float));
    float *dv = t_dev_upload(ctx, v, half * sizeof(float));
    rc = dk && dv ? m40llm_kvcache_append_f32(c, layer, seq, dk, dv, n) : M40LLM_ERR_OUT_OF_MEMORY;
    if (T_OK(rc)) model_append(m, layer, seq, x, n);
    m40llm_free(ctx, dk);
    m40llm_free(ctx, dv);
  }
  free(k);
  free(v);
  free(x);
  return rc;
}

static void check_attention(m40llm_context *ctx, m40llm_kvcache *c, model *m, int layer,
                            const int32_t *seq_ids, int n);

/* Everything observable of (layer, seq) against the model. */
static void check_seq(m40llm_context *ctx, m40llm_kvcache *c, model *m, int layer, int seq) {
  const m_seq *s = seq_of(m, layer, seq);
  const int heads = m->o.n_kv_heads, d = m->o.head_dim;
  int len = -1;
  T_OK(m40llm_kvcache_seq_len(&len, c, layer, seq));
  T_INT_EQ(len, s->len);
  int32_t rows[M40LLM_MAX_TIERS] = {-1, -1, -1, -1};
  if (T_OK(m40llm_kvcache_tier_rows(rows, c, layer, seq)))
    for (int t = 0; t < m->o.n_tiers; t++) T_INT_EQ(rows[t], s->count[t]);
  int tier_errors = 0;
  for (int p = 0; p < s->len; p++) {
    int t = -2;
    if (m40llm_kvcache_tier_of(&t, c, layer, seq, p) != M40LLM_OK || t != s->tier[p]) tier_errors++;
  }
  T_CHECKF(tier_errors == 0, "%d of %d positions in the wrong tier", tier_errors, s->len);
  if (s->len == 0) return;
  const size_t half = (size_t)s->len * heads * d;
  uint16_t *got = malloc(2 * half * sizeof(uint16_t));
  uint16_t *dk = t_dev_alloc(ctx, half * sizeof(uint16_t)), *dv = t_dev_alloc(ctx, half * sizeof(uint16_t));
  if (got && dk && dv && T_OK(m40llm_kvcache_read_f16(dk, dv, c, layer, seq, 0, s->len)) &&
      t_dev_download(ctx, got, dk, half * sizeof(uint16_t)) &&
      t_dev_download(ctx, got + half, dv, half * sizeof(uint16_t))) {
    int wrong = 0;
    float y[256];
    for (int p = 0; p < s->len; p++)
      for (int kv = 0; kv < 2; kv++)
        for (int h = 0; h < heads; h++) {
          const double *val = s->val + (size_t)p * m->row + ((size_t)kv * heads + h) * d;
          for (int i = 0; i < d; i++) y[i] = (float)val[i];
          t_rotate_f32(y, d);
          const uint16_t *g = got + (size_t)kv * half + ((size_t)p * heads + h) * d;
          for (int i = 0; i < d; i++) wrong += g[i] != t_f32_to_f16(y[i]);
        }
    T_CHECKF(wrong == 0, "read_f16: %d values differ from the model", wrong);
  }
  free(got);
  m40llm_free(ctx, dk);
  m40llm_free(ctx, dv);

  const int32_t id = seq;
  check_attention(ctx, c, m, layer, &id, 1);
}

/* The softmax weights of q row qr (rotated as K is) over len rows of k (a K/V head's, rows
 * `stride` apart), in float64. */
static void ref_weights(const float *qr, const double *k, int len, int d, int stride, double *w) {
  double most = -INFINITY, sum = 0.0;
  for (int p = 0; p < len; p++) {
    double s = 0.0;
    for (int e = 0; e < d; e++) s += (double)qr[e] * k[(size_t)p * stride + e];
    w[p] = s / sqrt((double)d);
    most = w[p] > most ? w[p] : most;
  }
  for (int p = 0; p < len; p++) sum += (w[p] = exp(w[p] - most));
  for (int p = 0; p < len; p++) w[p] /= sum;
}

/* Whether got is within X_REL + X_ABS of want; counts the misses. */
static int near(double got, double want, int *bad) {
  const int ok = fabs(got - want) <= X_REL * fabs(want) + X_ABS;
  *bad += !ok;
  return ok;
}

/* The batch's call exporting weights, then importance (decay 0.5 onto random values), against
 * w_ref ([row][head][stride] float64 weights) and ref (the float64 outputs, as the plain call's:
 * the calls may run different kernel families). */
static void check_exports(m40llm_context *ctx, m40llm_kvcache *c, const model *m,
                          const int32_t *seq_ids, int n, int layer, const float *dq,
                          const double *ref, const double *w_ref, size_t stride) {
  const int nh = m->o.n_heads, heads = m->o.n_kv_heads, group = nh / heads;
  const size_t qrow = (size_t)nh * m->o.head_dim, all = (size_t)n * qrow;
  const size_t w_all = (size_t)n * nh * stride, i_all = (size_t)n * heads * stride;
  float *out = malloc(all * sizeof(float)), *w = malloc(w_all * sizeof(float));
  float *imp = malloc(i_all * sizeof(float)), *old = malloc(i_all * sizeof(float));
  float *dout = t_dev_alloc(ctx, all * sizeof(float)), *dw = NULL, *di = NULL;
  if (!T_CHECK(out && w && imp && old && dout)) goto done;
  memset(w, 0xFF, w_all * sizeof(float));
  int bad = 0, untouched = 0, out_diff = 0;
  if ((dw = t_dev_upload(ctx, w, w_all * sizeof(float))) &&
      T_OK(m40llm_kvcache_attn_weights_ex(dout, dw, stride, c, layer, seq_ids, n, dq,
                                          M40LLM_DTYPE_F32, 0.0f)) &&
      t_dev_download(ctx, w, dw, w_all * sizeof(float)) &&
      t_dev_download(ctx, out, dout, all * sizeof(float))) {
    for (int i = 0; i < n; i++) {
      const int len = seq_of((model *)m, layer, seq_ids[i])->len;
      for (int h = 0; h < nh; h++)
        for (size_t p = 0; p < stride; p++) {
          const size_t at = ((size_t)i * nh + h) * stride + p;
          if ((int)p < len) near(w[at], w_ref[at], &bad);
          else untouched += t_all_bytes(&w[at], sizeof(float), 0xFF);
        }
    }
    for (int i = 0; i < n; i++) {
      const float *row = out + (size_t)i * qrow;
      if (seq_of((model *)m, layer, seq_ids[i])->len > 0)
        out_diff += !(t_rel_l2(row, ref + (size_t)i * qrow, qrow) <= 1e-5);
      else
        for (size_t e = 0; e < qrow; e++) out_diff += row[e] != 0.0f;
    }
    T_CHECKF(bad == 0, "layer %d, %d rows: %d exported weights off the float64 softmax", layer, n,
             bad);
    size_t past = 0;
    for (int i = 0; i < n; i++) past += (size_t)nh * (stride - (size_t)seq_of((model *)m, layer, seq_ids[i])->len);
    T_CHECKF((size_t)untouched == past, "%zu of %zu weights past the lengths were written",
             past - (size_t)untouched, past);
    T_CHECKF(out_diff == 0, "%d rows (or nonzero outputs of empty ones) of the call with weights "
             "off float64 (relative L2 bound 1e-5, the plain call's)", out_diff);
  }
  t_fill_uniform(old, i_all, 0.0f, 1.0f);
  bad = 0;
  if ((di = t_dev_upload(ctx, old, i_all * sizeof(float))) &&
      T_OK(m40llm_kvcache_attn_importance_ex(dout, di, stride, 0.5f, c, layer, seq_ids, n, dq,
                                             M40LLM_DTYPE_F32, 0.0f)) &&
      t_dev_download(ctx, imp, di, i_all * sizeof(float))) {
    for (int i = 0; i < n; i++) {
      const int len = seq_of((model *)m, layer, seq_ids[i])->len;
      for (int g = 0; g < heads; g++)
        for (size_t p = 0; p < stride; p++) {
          const size_t at = ((size_t)i * heads + g) * stride + p;
          double want = old[at];
          if ((int)p < len) {
            double most = 0.0;
            for (int j = 0; j < group; j++) {
              const double x = w_ref[((size_t)i * nh + (size_t)g * group + j) * stride + p];
              most = x > most ? x : most;
            }
            want = 0.5 * old[at] + most;
          }
          near(imp[at], want, &bad);
        }
    }
    T_CHECKF(bad == 0, "layer %d, %d rows: %d importance values off float64", layer, n, bad);
  }
done:
  m40llm_free(ctx, dout);
  m40llm_free(ctx, dw);
  m40llm_free(ctx, di);
  free(out);
  free(w);
  free(imp);
  free(old);
}

/* Attention of a batch of (layer, seq_ids) at once against float64: q rotated as K is, the
 * output rotated back as V is; then its exports (check_exports). Repeats and empty sequences
 * allowed. */
static void check_attention(m40llm_context *ctx, m40llm_kvcache *c, model *m, int layer,
                            const int32_t *seq_ids, int n) {
  const int heads = m->o.n_kv_heads, d = m->o.head_dim, nh = m->o.n_heads;
  const size_t qrow = (size_t)nh * d, all = (size_t)n * qrow;
  size_t longest = 1;
  for (int i = 0; i < n; i++)
    if ((size_t)seq_of(m, layer, seq_ids[i])->len > longest) longest = seq_of(m, layer, seq_ids[i])->len;
  float *q = malloc(all * sizeof(float)), *out = malloc(all * sizeof(float));
  double *kvals = malloc(longest * heads * d * sizeof(double));
  double *vvals = malloc(longest * heads * d * sizeof(double));
  double *ref = malloc(all * sizeof(double));
  double *w_ref = malloc((size_t)n * nh * longest * sizeof(double));
  float *dq = NULL, *dout = NULL;
  if (!T_CHECK(q && out && kvals && vvals && ref && w_ref)) goto done;
  t_fill_uniform(q, all, -1.0f, 1.0f);
  for (int i = 0; i < n; i++) {
    const m_seq *s = seq_of(m, layer, seq_ids[i]);
    for (int p = 0; p < s->len; p++)
      for (int kv = 0; kv < 2; kv++)
        memcpy((kv ? vvals : kvals) + (size_t)p * heads * d,
               s->val + (size_t)p * m->row + (size_t)kv * heads * d, (size_t)heads * d * sizeof(double));
    for (int h = 0; h < nh; h++) {
      double qd[256];
      float qr[256];
      double *r = ref + (size_t)i * qrow + (size_t)h * d;
      for (int e = 0; e < d; e++) qd[e] = q[(size_t)i * qrow + (size_t)h * d + e];
      t_rotate_f64(qd, d);
      for (int e = 0; e < d; e++) qr[e] = (float)qd[e];
      const int g = h / (nh / heads);
      if (s->len == 0) { /* documented: zeros */
        for (int e = 0; e < d; e++) r[e] = 0.0;
        continue;
      }
      t_ref_head(qr, kvals + (size_t)g * d, vvals + (size_t)g * d, s->len, d, heads * d,
                 1.0 / sqrt((double)d), r);
      t_rotate_f64(r, d);
      ref_weights(qr, kvals + (size_t)g * d, s->len, d, heads * d,
                  w_ref + ((size_t)i * nh + h) * longest);
    }
  }
  memset(out, 0xFF, all * sizeof(float));
  dq = t_dev_upload(ctx, q, all * sizeof(float));
  dout = t_dev_upload(ctx, out, all * sizeof(float));
  if (dq && dout && T_OK(m40llm_kvcache_attn_batch_f32q(dout, c, layer, seq_ids, n, dq, 0.0f)) &&
      t_dev_download(ctx, out, dout, all * sizeof(float)))
    for (int i = 0; i < n; i++) {
      const double err = t_rel_l2(out + (size_t)i * qrow, ref + (size_t)i * qrow, qrow);
      const int zeros = seq_of(m, layer, seq_ids[i])->len == 0;
      int nonzero = 0;
      for (size_t e = 0; zeros && e < qrow; e++) nonzero += out[(size_t)i * qrow + e] != 0.0f;
      T_CHECKF(zeros ? nonzero == 0 : err <= 1e-5,
               "layer %d seq %d (length %d, row %d of %d): relative L2 error %.3g (bound 1e-5), "
               "%d nonzero",
               layer, seq_ids[i], seq_of(m, layer, seq_ids[i])->len, i, n, err, nonzero);
    }
  if (dq && dout) check_exports(ctx, c, m, seq_ids, n, layer, dq, ref, w_ref, longest);
done:
  m40llm_free(ctx, dq);
  m40llm_free(ctx, dout);
  free(q);
  free(out);
  free(kvals);
  free(vvals);
  free(ref);
  free(w_ref);
}

/* Stored bits a value of a format (codes, and a 32-dim group's FP16 parameters). */
static double format_bits(int f) {
  switch (f) {
    case M40LLM_KV_Q8: return 8.5; /* a scale */
    case M40LLM_KV_Q4: return 5.0; /* a scale and a min */
    case M40LLM_KV_Q3: return 4.0;
    default: return 3.0;
  }
}

/* m40llm_kvcache_tier_stats against the model. */
static void check_stats(m40llm_kvcache *c, const model *m) {
  long long rows[M40LLM_MAX_TIERS] = {0}, kept = 0, positions = 0;
  for (int l = 0; l < m->o.n_layers; l++)
    for (int q = 0; q < m->o.max_seqs; q++) {
      const m_seq *s = &m->seqs[(size_t)l * (size_t)m->o.max_seqs + (size_t)q];
      int held = 0;
      for (int t = 0; t < m->o.n_tiers; t++) rows[t] += s->count[t], held += s->count[t];
      kept += s->len - held;
      positions += s->len;
    }
  double bits = 16.0 * (double)kept;
  const double map_bits = 32.0 / (2.0 * m->o.n_kv_heads * m->o.head_dim); /* a tier row's map entry */
  for (int t = 0; t < m->o.n_tiers; t++)
    bits += (double)rows[t] *
            ((format_bits(m->o.tiers[t].k_format) + format_bits(m->o.tiers[t].v_format)) / 2.0 +
             map_bits);
  m40llm_tier_stats st = M40LLM_TIER_STATS_INIT;
  if (!T_OK(m40llm_kvcache_tier_stats(&st, c))) return;
  int ok = st.n_tiers == m->o.n_tiers && st.kept_rows == kept && st.moved_rows == m->moved &&
           fabs(st.bits_per_value - (positions ? bits / (double)positions : 0.0)) < 1e-9;
  for (int t = 0; t < m->o.n_tiers; t++)
    ok &= st.rows[t] == rows[t] &&
          st.free_rows[t] == (long long)m->o.tiers[t].rows * m->o.n_layers * m->o.max_seqs - rows[t];
  T_CHECKF(ok, "tier_stats: %d tiers, rows %lld %lld %lld %lld, kept %lld, %.6f bits, moved %lld "
           "(model: kept %lld, %.6f bits, moved %lld)", st.n_tiers, (long long)st.rows[0],
           (long long)st.rows[1], (long long)st.rows[2], (long long)st.rows[3],
           (long long)st.kept_rows, st.bits_per_value, (long long)st.moved_rows, kept,
           positions ? bits / (double)positions : 0.0, m->moved);
}

static void check_all(m40llm_context *ctx, m40llm_kvcache *c, model *m) {
  check_stats(c, m);
  for (int l = 0; l < m->o.n_layers; l++) {
    for (int s = 0; s < m->o.max_seqs; s++) check_seq(ctx, c, m, l, s);
    /* the sequences together, twice over, in a launch */
    int32_t ids[16];
    int n = 0;
    for (int r = 0; r < 2; r++)
      for (int s = m->o.max_seqs - 1; s >= 0 && n < 16; s--) ids[n++] = s;
    check_attention(ctx, c, m, l, ids, n);
  }
}

/* Four tiers of these (K, V) pairs, every tier too small alone (1/8, 1/5, 1/4 and 1/2 of the
 * rows); the cache's formats are the first tier's. */
static void set_tiers(m40llm_kvcache_options *o, const int pairs[4][2]) {
  static const int share[4] = {8, 5, 4, 2};
  o->n_tiers = 4;
  for (int t = 0; t < 4; t++)
    o->tiers[t] = (m40llm_kv_tier){pairs[t][0], pairs[t][1], o->max_seq_len / share[t]};
  o->format = pairs[0][0];
  o->v_format = pairs[0][1];
}

static m40llm_kvcache_options tiered_options(int max_seq_len, int sinks, int window) {
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = 2;
  o.n_heads = 6;
  o.n_kv_heads = 2;
  o.head_dim = 64;
  o.max_seqs = 3;
  o.max_seq_len = max_seq_len;
  o.n_sinks = sinks;
  o.window = window;
  /* the study's pairs (bench/fidelity/results/buckets.md) */
  static const int pairs[4][2] = {{M40LLM_KV_Q8, M40LLM_KV_Q8}, {M40LLM_KV_Q8, M40LLM_KV_Q4},
                                  {M40LLM_KV_Q4, M40LLM_KV_Q3}, {M40LLM_KV_Q4, M40LLM_KV_Q2}};
  set_tiers(&o, pairs);
  return o;
}

/* Other shapes than tiered_options' (shape 0), each the kernels of another head_dim:
 * 1: groups of 8 query heads at head_dim 96 (the FP32 kernel's runtime-head_dim instances,
 *    which run the FP16 slots in a launch of their own), and tier pairs that no uniform cache has;
 * 2: groups of 4 at head_dim 128 (the tensor-core kernels' 4-warp blocks);
 * 3: MHA at head_dim 32;
 * 4: groups of 8 at head_dim 256 (the tensor-core kernels' pairs of warps, each half the dims);
 * 5: groups of 6 at head_dim 192 (the same, three chunks a warp). */
static m40llm_kvcache_options other_shape(m40llm_kvcache_options o, int shape) {
  static const int pairs[6][4][2] = {
      {{0}},
      {{M40LLM_KV_Q4, M40LLM_KV_Q8}, {M40LLM_KV_Q8, M40LLM_KV_Q3},
       {M40LLM_KV_Q8, M40LLM_KV_Q2}, {M40LLM_KV_Q4, M40LLM_KV_Q4}},
      {{M40LLM_KV_Q8, M40LLM_KV_Q4}, {M40LLM_KV_Q4, M40LLM_KV_Q8},
       {M40LLM_KV_Q4, M40LLM_KV_Q2}, {M40LLM_KV_Q8, M40LLM_KV_Q3}},
      {{M40LLM_KV_Q4, M40LLM_KV_Q4}, {M40LLM_KV_Q8, M40LLM_KV_Q8},
       {M40LLM_KV_Q4, M40LLM_KV_Q3}, {M40LLM_KV_Q8, M40LLM_KV_Q2}},
      {{M40LLM_KV_Q8, M40LLM_KV_Q4}, {M40LLM_KV_Q4, M40LLM_KV_Q4},
       {M40LLM_KV_Q8, M40LLM_KV_Q8}, {M40LLM_KV_Q4, M40LLM_KV_Q2}},
      {{M40LLM_KV_Q4, M40LLM_KV_Q3}, {M40LLM_KV_Q8, M40LLM_KV_Q2},
       {M40LLM_KV_Q4, M40LLM_KV_Q8}, {M40LLM_KV_Q8, M40LLM_KV_Q4}}};
  static const int heads[6][3] = {{0},         {16, 2, 96},  {8, 2, 128},
                                  {3, 3, 32},  {16, 2, 256}, {12, 2, 192}};
  if (shape == 0) return o;
  o.n_heads = heads[shape][0];
  o.n_kv_heads = heads[shape][1];
  o.head_dim = heads[shape][2];
  set_tiers(&o, pairs[shape]);
  return o;
}

/* Lengths 1, 31, 33, 257 and more through ragged appends, moves (down, up, to a full tier),
 * truncate into and below the quantized rows, reset, fork, and appends that refill freed rows.
 * ends_empty: the first and last tiers hold no rows (as m40llm_kvcache_plan_tiers leaves the
 * tiers outside its pair), so every call's FP16 slots go with the second tier's rows. */
static void history(m40llm_context *ctx, int sinks, int window, int small, int shape,
                    int ends_empty) {
  const int max_len = small ? 300 : 700;
  m40llm_kvcache_options o = other_shape(tiered_options(max_len, sinks, window), shape);
  if (ends_empty) {
    o.tiers[0].rows = o.tiers[3].rows = 0;
    o.tiers[1].rows = max_len / 3;
    o.tiers[2].rows = max_len - max_len / 3;
  }
  t_set_case("tiers: history, %d/%d heads, head_dim %d, sinks %d, window %d, max_seq_len %d%s",
             o.n_heads, o.n_kv_heads, o.head_dim, sinks, window, max_len,
             ends_empty ? ", first and last tiers empty" : "");
  m40llm_kvcache *c = NULL;
  model m;
  if (!T_CHECK(model_init(&m, &o)) || !T_OK(m40llm_kvcache_create(&c, ctx, &o))) {
    model_free(&m);
    return;
  }
  const int targets[3][2] = {{1, 257}, {31, max_len}, {33, 200}}; /* per seq, layer 0 and 1 */
  for (int s = 0; s < 3; s++)
    for (int l = 0; l < 2; l++)
      while (seq_of(&m, l, s)->len < targets[s][l]) {
        const int left = targets[s][l] - seq_of(&m, l, s)->len;
        int n = t_rand_int(1, 40);
        if (n > left) n = left;
        if (append_both(ctx, c, &m, l, s, n) != M40LLM_OK) goto out;
      }
  check_all(ctx, c, &m);

  /* moves: a range down, a part of it back up, into a tier too small (nothing moves) */
  const int moves[][4] = {{1, 1, 10, 3}, {1, 1, 40, 2}, {1, 20, 30, 0}, {1, 0, max_len, 0},
                          {0, 0, 257, 1}, {0, 100, 101, 3}, {0, 5, 5, 2}, {2, 0, 200, 3}};
  for (size_t i = 0; i < sizeof moves / sizeof moves[0]; i++) {
    const int s = moves[i][0], l = s == 2 ? 0 : 1;
    const int begin = moves[i][1], end = moves[i][2] < seq_of(&m, l, s)->len ? moves[i][2]
                                                                              : seq_of(&m, l, s)->len;
    const int want = model_move(&m, l, s, begin, end, moves[i][3]);
    const int rc = m40llm_kvcache_tier_move(c, l, s, begin, end, moves[i][3]);
    T_CHECKF(rc == want, "move [%d, %d) of layer %d seq %d to tier %d: status %d, want %d", begin,
             end, l, s, moves[i][3], rc, want);
    check_seq(ctx, c, &m, l, s);
  }
  /* truncate below the window and into the sinks, fork, append again into freed rows */
  if (!T_OK(m40llm_kvcache_seq_fork(c, 2, 1))) goto out;
  model_fork(&m, 2, 1);
  const int cuts[3] = {max_len - 150, sinks + 20, 2};
  for (int i = 0; i < 3; i++) {
    if (!T_OK(m40llm_kvcache_seq_truncate(c, 1, cuts[i]))) goto out;
    model_truncate(&m, 1, cuts[i]);
    check_all(ctx, c, &m);
    while (seq_of(&m, 1, 1)->len < max_len - 30)
      if (append_both(ctx, c, &m, 1, 1, t_rand_int(1, 60 < max_len - 30 - seq_of(&m, 1, 1)->len
                                                          ? 60
                                                          : max_len - 30 - seq_of(&m, 1, 1)->len)) !=
          M40LLM_OK)
        goto out;
    check_all(ctx, c, &m);
  }
  if (!T_OK(m40llm_kvcache_seq_reset(c, 0))) goto out;
  model_truncate(&m, 0, 0);
  if (append_both(ctx, c, &m, 0, 0, 33) != M40LLM_OK) goto out;
  check_all(ctx, c, &m);
  if (!small) { /* a batch over M40LLM_PLAN_MAX_ITEMS rows: a call of two launches' worth */
    int32_t ids[131];
    for (int i = 0; i < 131; i++) ids[i] = (i * 7) % 3;
    check_attention(ctx, c, &m, 1, ids, 131);
  }
out:
  m40llm_kvcache_destroy(c);
  model_free(&m);
}

static int on_cuda(m40llm_context *ctx) {
  m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
  return m40llm_context_device_info(&info, ctx) == M40LLM_OK && info.backend == M40LLM_BACKEND_CUDA;
}

/* Without a window every row is quantized when appended, from the appended values: a one-tier
 * cache then stores what the uniform cache of the same formats stores, and attends to it as
 * that cache does (bit for bit on the CPU; on CUDA the kernels differ, within 1e-5). */
static void one_tier_is_uniform(m40llm_context *ctx, int kf, int vf) {
  t_set_case("tiers: one tier of %d/%d against the uniform cache", kf, vf);
  m40llm_kvcache_options u = tiered_options(100, 4, 0);
  u.n_tiers = 0;
  u.format = kf;
  u.v_format = vf;
  u.rotation = M40LLM_ROTATE_K;
  m40llm_kvcache_options t = u;
  t.n_tiers = 1;
  t.tiers[0] = (m40llm_kv_tier){kf, vf, 96};
  m40llm_kvcache *cu = NULL, *ct = NULL;
  const size_t qrow = (size_t)u.n_heads * u.head_dim, row = (size_t)u.n_kv_heads * u.head_dim;
  const int n = 97;
  float *k = malloc((size_t)n * row * sizeof(float)), *v = malloc((size_t)n * row * sizeof(float));
  float *q = malloc(qrow * sizeof(float)), *out = malloc(2 * qrow * sizeof(float));
  float *dk = NULL, *dv = NULL, *dq = NULL, *dout = NULL;
  if (!k || !v || !q || !out || !T_OK(m40llm_kvcache_create(&cu, ctx, &u)) ||
      !T_OK(m40llm_kvcache_create(&ct, ctx, &t)))
    goto out;
  t_fill_kv_values(k, (size_t)n * u.n_kv_heads, u.head_dim, 0);
  t_fill_kv_values(v, (size_t)n * u.n_kv_heads, u.head_dim, 1);
  t_fill_uniform(q, qrow, -1.0f, 1.0f);
  dk = t_dev_upload(ctx, k, (size_t)n * row * sizeof(float));
  dv = t_dev_upload(ctx, v, (size_t)n * row * sizeof(float));
  dq = t_dev_upload(ctx, q, qrow * sizeof(float));
  dout = t_dev_alloc(ctx, 2 * qrow * sizeof(float));
  if (!dk || !dv || !dq || !dout) goto out;
  for (int done = 0, step = 1; done < n; done += step, step = step * 2 + 1) {
    if (step > n - done) step = n - done;
    const size_t at = (size_t)done * row;
    if (!T_OK(m40llm_kvcache_append_f32(cu, 1, 2, dk + at, dv + at, step)) ||
        !T_OK(m40llm_kvcache_append_f32(ct, 1, 2, dk + at, dv + at, step)) ||
        !T_OK(m40llm_kvcache_attn_last_token_f32q(dout, cu, 1, 2, dq, 0.0f)) ||
        !T_OK(m40llm_kvcache_attn_last_token_f32q(dout + qrow, ct, 1, 2, dq, 0.0f)) ||
        !t_dev_download(ctx, out, dout, 2 * qrow * sizeof(float)))
      goto out;
    if (on_cuda(ctx)) {
      double *ref = malloc(qrow * sizeof(double));
      if (!T_CHECK(ref != NULL)) goto out;
      for (size_t i = 0; i < qrow; i++) ref[i] = out[i];
      const double err = t_rel_l2(out + qrow, ref, qrow);
      free(ref);
      T_CHECKF(err <= 1e-5, "length %d: the one-tier cache's output is %.3g from the uniform "
               "cache's (bound 1e-5)", done + step, err);
    } else {
      T_CHECKF(memcmp(out, out + qrow, qrow * sizeof(float)) == 0,
               "length %d: the one-tier cache's output differs from the uniform cache's",
               done + step);
    }
  }
  int32_t rows = -1;
  if (T_OK(m40llm_kvcache_tier_rows(&rows, ct, 1, 2))) T_INT_EQ(rows, n - 4);
out:
  m40llm_free(ctx, dk);
  m40llm_free(ctx, dv);
  m40llm_free(ctx, dq);
  m40llm_free(ctx, dout);
  m40llm_kvcache_destroy(cu);
  m40llm_kvcache_destroy(ct);
  free(k);
  free(v);
  free(q);
  free(out);
}

static void option_errors(m40llm_context *ctx) {
  const m40llm_kvcache_options good = tiered_options(300, 4, 32);
  struct {
    const char *what;
    m40llm_kvcache_options o;
    int status;
    const char *substr;
  } bad[12];
  int n = 0;
#define BAD(what_, stmt, code, sub)            \
  do {                                         \
    bad[n].what = what_;                       \
    bad[n].o = good;                           \
    m40llm_kvcache_options *o = &bad[n].o;     \
    stmt;                                      \
    bad[n].status = M40LLM_ERR_##code;         \
    bad[n].substr = sub;                       \
    n++;                                       \
  } while (0)
  BAD("n_tiers -1", o->n_tiers = -1, INVALID_ARGUMENT, "n_tiers");
  BAD("n_tiers 5", o->n_tiers = 5, INVALID_ARGUMENT, "n_tiers");
  BAD("a 3-bit K", o->tiers[2].k_format = M40LLM_KV_Q3, INVALID_ARGUMENT, "tiers[2]");
  BAD("an F16 V", o->tiers[1].v_format = M40LLM_KV_F16, INVALID_ARGUMENT, "tiers[1]");
  BAD("an unknown format", o->tiers[3].v_format = 9, INVALID_ARGUMENT, "tiers[3]");
  BAD("rows -1", o->tiers[3].rows = -1, INVALID_ARGUMENT, "rows");
  BAD("rows past max_seq_len", o->tiers[0].rows = 301, INVALID_ARGUMENT, "rows");
  BAD("too few rows", o->tiers[3].rows = 0, INVALID_ARGUMENT, "leave the window");
  BAD("format not the first tier's", o->format = M40LLM_KV_Q4, INVALID_ARGUMENT, "first tier");
  BAD("v_format not the first tier's", o->v_format = M40LLM_KV_Q4, INVALID_ARGUMENT, "first tier");
#undef BAD
  for (int i = 0; i < n; i++) {
    t_set_case("tiers: options: %s", bad[i].what);
    size_t bytes = 12345;
    T_FAIL_WITH(m40llm_kvcache_bytes_needed(&bytes, &bad[i].o), bad[i].status, bad[i].substr);
    T_CHECK(bytes == 12345);
    m40llm_kvcache *c = (m40llm_kvcache *)&bytes;
    T_FAIL_WITH(m40llm_kvcache_create(&c, ctx, &bad[i].o), bad[i].status, bad[i].substr);
    T_CHECK(c == (m40llm_kvcache *)&bytes);
  }
  t_set_case("tiers: bytes_needed and the planner");
  /* the FP16 slots, each tier's codes and FP16 parameters, and its slot map in backend memory
   * (4 bytes a row; the other maps are host memory) */
  size_t want = 2 * 2 * (size_t)(4 + 32) * 64 * 2; /* K and V, 2 K/V heads */
  const size_t k_row[5] = {0, 64 + 4, 32 + 8, 24 + 8, 16 + 8}; /* by format: codes + params */
  for (int t = 0; t < 4; t++)
    want += (size_t)good.tiers[t].rows *
            (2 * (k_row[good.tiers[t].k_format] + k_row[good.tiers[t].v_format]) + 4);
  want *= 2 * 3; /* layers x seqs */
  size_t bytes = 0;
  if (T_OK(m40llm_kvcache_bytes_needed(&bytes, &good)))
    T_CHECKF(bytes == want, "bytes_needed %zu, want %zu", bytes, want);
  int len = 77;
  T_FAIL_WITH(m40llm_kvcache_max_seq_len(&len, &good, (size_t)1 << 30),
              M40LLM_ERR_INVALID_ARGUMENT, "per tier");
  T_INT_EQ(len, 77);
}

static void call_errors(m40llm_context *ctx) {
  t_set_case("tiers: call errors");
  const m40llm_kvcache_options o = tiered_options(300, 4, 32);
  m40llm_kvcache *c = NULL, *plain = NULL;
  model m;
  m40llm_kvcache_options p = o;
  p.n_tiers = 0;
  if (!T_CHECK(model_init(&m, &o)) || !T_OK(m40llm_kvcache_create(&c, ctx, &o)) ||
      !T_OK(m40llm_kvcache_create(&plain, ctx, &p)) || append_both(ctx, c, &m, 0, 1, 100) != M40LLM_OK)
    goto out;
  int32_t rows[4] = {7, 7, 7, 7};
  int t = 7;
  T_FAIL_WITH(m40llm_kvcache_tier_move(plain, 0, 0, 0, 0, 0), M40LLM_ERR_INVALID_ARGUMENT, "no tiers");
  T_FAIL_WITH(m40llm_kvcache_tier_rows(rows, plain, 0, 0), M40LLM_ERR_INVALID_ARGUMENT, "no tiers");
  T_FAIL_WITH(m40llm_kvcache_tier_of(&t, plain, 0, 0, 0), M40LLM_ERR_INVALID_ARGUMENT, "no tiers");
  T_FAIL_WITH(m40llm_kvcache_tier_move(NULL, 0, 0, 0, 0, 0), M40LLM_ERR_INVALID_ARGUMENT, "cache");
  T_FAIL_WITH(m40llm_kvcache_tier_rows(NULL, c, 0, 1), M40LLM_ERR_INVALID_ARGUMENT, "out_rows");
  T_FAIL_WITH(m40llm_kvcache_tier_of(NULL, c, 0, 1, 0), M40LLM_ERR_INVALID_ARGUMENT, "out_tier");
  T_FAIL_WITH(m40llm_kvcache_tier_rows(rows, c, 2, 1), M40LLM_ERR_OUT_OF_RANGE, "layer");
  T_FAIL_WITH(m40llm_kvcache_tier_of(&t, c, 0, 1, 100), M40LLM_ERR_OUT_OF_RANGE, "pos");
  T_FAIL_WITH(m40llm_kvcache_tier_of(&t, c, 0, 1, -1), M40LLM_ERR_OUT_OF_RANGE, "pos");
  T_FAIL_WITH(m40llm_kvcache_tier_move(c, 0, 1, 10, 9, 0), M40LLM_ERR_OUT_OF_RANGE, "begin");
  T_FAIL_WITH(m40llm_kvcache_tier_move(c, 0, 1, -1, 9, 0), M40LLM_ERR_OUT_OF_RANGE, "begin");
  T_FAIL_WITH(m40llm_kvcache_tier_move(c, 0, 1, 0, 101, 0), M40LLM_ERR_OUT_OF_RANGE, "length");
  T_FAIL_WITH(m40llm_kvcache_tier_move(c, 0, 1, 0, 10, 4), M40LLM_ERR_OUT_OF_RANGE, "tier");
  T_FAIL_WITH(m40llm_kvcache_tier_move(c, 0, 1, 0, 10, -1), M40LLM_ERR_OUT_OF_RANGE, "tier");
  T_FAIL_WITH(m40llm_kvcache_tier_move(c, 0, 3, 0, 0, 0), M40LLM_ERR_OUT_OF_RANGE, "seq");
  /* tier 0 holds 37 rows: 64 quantized rows cannot all go there; nothing moves */
  T_INT_EQ(model_move(&m, 0, 1, 0, 100, 0), M40LLM_ERR_CAPACITY);
  T_FAIL_WITH(m40llm_kvcache_tier_move(c, 0, 1, 0, 100, 0), M40LLM_ERR_CAPACITY, "none was moved");
  T_CHECK(rows[0] == 7 && t == 7);
  check_seq(ctx, c, &m, 0, 1);
  m40llm_tier_stats st = M40LLM_TIER_STATS_INIT, untouched = M40LLM_TIER_STATS_INIT;
  T_FAIL_WITH(m40llm_kvcache_tier_stats(NULL, c), M40LLM_ERR_INVALID_ARGUMENT, "out");
  T_FAIL_WITH(m40llm_kvcache_tier_stats(&st, NULL), M40LLM_ERR_INVALID_ARGUMENT, "cache");
  T_FAIL_WITH(m40llm_kvcache_tier_stats(&st, plain), M40LLM_ERR_INVALID_ARGUMENT, "no tiers");
  st.version = M40LLM_TIER_STATS_VERSION + 1;
  T_FAIL_WITH(m40llm_kvcache_tier_stats(&st, c), M40LLM_ERR_INVALID_ARGUMENT, "version");
  st.version = 0;
  T_FAIL_WITH(m40llm_kvcache_tier_stats(&st, c), M40LLM_ERR_INVALID_ARGUMENT, "version");
  st.version = M40LLM_TIER_STATS_VERSION;
  T_CHECK(memcmp(&st, &untouched, sizeof st) == 0); /* nothing written */
  /* A version-1 caller's struct ends before demoted_rows, which is not written. */
  m40llm_tier_stats v1 = M40LLM_TIER_STATS_INIT;
  v1.version = 1;
  v1.demoted_rows = -7;
  if (T_OK(m40llm_kvcache_tier_stats(&v1, c))) {
    T_CHECK(v1.version == 1 && v1.demoted_rows == -7);
    T_CHECK(v1.n_tiers == o.n_tiers);
  }
  check_stats(c, &m);
out:
  m40llm_kvcache_destroy(c);
  m40llm_kvcache_destroy(plain);
  model_free(&m);
}

/* A caller of version 3 (no tiers) is served as before; reading back writes only its fields. */
static void version_3(m40llm_context *ctx) {
  t_set_case("tiers: a version-3 options struct");
  const size_t v3 = offsetof(m40llm_kvcache_options, n_tiers);
  m40llm_kvcache_options full;
  unsigned char *o = malloc(v3), *back = malloc(v3 + 16);
  m40llm_kvcache *c = NULL;
  if (!T_CHECK(o && back) || !T_OK(m40llm_kvcache_options_init(&full, 3))) goto out;
  full.n_layers = full.n_heads = full.n_kv_heads = full.max_seqs = 1;
  full.head_dim = 64;
  full.max_seq_len = 40;
  full.format = M40LLM_KV_Q4;
  memcpy(o, &full, v3);
  if (!T_OK(m40llm_kvcache_create(&c, ctx, (const m40llm_kvcache_options *)(void *)o))) goto out;
  memset(back, 0xA5, v3 + 16);
  const unsigned version = 3;
  memcpy(back, &version, sizeof version);
  if (T_OK(m40llm_kvcache_get_options((m40llm_kvcache_options *)(void *)back, c)))
    T_CHECK(t_all_bytes(back + v3, 16, 0xA5) && memcmp(back, o, v3) == 0);
  int32_t rows = 0;
  T_FAIL_WITH(m40llm_kvcache_tier_rows(&rows, c, 0, 0), M40LLM_ERR_INVALID_ARGUMENT, "no tiers");
out:
  m40llm_kvcache_destroy(c);
  free(o);
  free(back);
}

/* Causal attention over a tiered cache against float64: query row i of a sequence of length L
 * with T rows sees positions L - T + i - W + 1 .. L - T + i (W: the window, 0 for none), the
 * rows that left the FP16 window during the appends included (T past the window + 1: a tier's
 * rows masked by position); 158 rows, more than one launch's 128 on CUDA. The CUDA backend
 * refuses a window (nothing written). shape: other_shape's. */
static void causal_rows(m40llm_context *ctx, int window, int shape, int ends_empty) {
  m40llm_kvcache_options o = other_shape(tiered_options(300, 4, 32), shape);
  if (ends_empty) { /* as history()'s */
    o.tiers[0].rows = o.tiers[3].rows = 0;
    o.tiers[1].rows = 100;
    o.tiers[2].rows = 200;
  }
  t_set_case("tiers: causal attention, window %d, %d/%d heads, head_dim %d%s", window, o.n_heads,
             o.n_kv_heads, o.head_dim, ends_empty ? ", first and last tiers empty" : "");
  const int heads = o.n_kv_heads, d = o.head_dim, nh = o.n_heads;
  const size_t qrow = (size_t)nh * d;
  const int32_t ids[3] = {0, 2, 1}, counts[3] = {100, 57, 1}, lens[3] = {260, 57, 140};
  int rows = 0;
  for (int s = 0; s < 3; s++) rows += counts[s];
  m40llm_kvcache *c = NULL;
  model m;
  memset(&m, 0, sizeof m); /* model_free of an unmade model frees nothing */
  float *q = malloc((size_t)rows * qrow * sizeof(float));
  float *out = malloc((size_t)rows * qrow * sizeof(float));
  double *kvals = malloc((size_t)300 * heads * d * sizeof(double));
  double *vvals = malloc((size_t)300 * heads * d * sizeof(double));
  float *dq = NULL, *dout = NULL;
  if (!T_CHECK(q && out && kvals && vvals) || !T_CHECK(model_init(&m, &o)) ||
      !T_OK(m40llm_kvcache_create(&c, ctx, &o)))
    goto out;
  for (int s = 0; s < 3; s++)
    while (seq_of(&m, 0, ids[s])->len < lens[s]) {
      const int left = lens[s] - seq_of(&m, 0, ids[s])->len, n = t_rand_int(1, 50);
      if (append_both(ctx, c, &m, 0, ids[s], n < left ? n : left) != M40LLM_OK) goto out;
    }
  t_fill_uniform(q, (size_t)rows * qrow, -1.0f, 1.0f);
  memset(out, 0xFF, (size_t)rows * qrow * sizeof(float));
  dq = t_dev_upload(ctx, q, (size_t)rows * qrow * sizeof(float));
  dout = t_dev_upload(ctx, out, (size_t)rows * qrow * sizeof(float));
  if (!dq || !dout) goto out;
  m40llm_causal_options co = M40LLM_CAUSAL_OPTIONS_INIT;
  co.window = window;
  if (window > 0 && on_cuda(ctx)) {
    T_FAIL_WITH(m40llm_kvcache_attn_causal_f32q(dout, c, 0, ids, counts, 3, dq, &co),
                M40LLM_ERR_UNSUPPORTED, "tiered cache with a sliding window");
    if (t_dev_download(ctx, out, dout, (size_t)rows * qrow * sizeof(float)))
      T_CHECKF(t_all_bytes(out, (size_t)rows * qrow * sizeof(float), 0xFF),
               "the refused call wrote its output");
    goto out;
  }
  if (!T_OK(m40llm_kvcache_attn_causal_f32q(dout, c, 0, ids, counts, 3, dq, &co)) ||
      !t_dev_download(ctx, out, dout, (size_t)rows * qrow * sizeof(float)))
    goto out;
  for (int s = 0, row = 0; s < 3; s++) {
    const m_seq *sq = seq_of(&m, 0, ids[s]);
    for (int p = 0; p < sq->len; p++)
      for (int kv = 0; kv < 2; kv++)
        memcpy((kv ? vvals : kvals) + (size_t)p * heads * d,
               sq->val + (size_t)p * m.row + (size_t)kv * heads * d,
               (size_t)heads * d * sizeof(double));
    for (int i = 0; i < counts[s]; i++, row++) {
      const int end = sq->len - counts[s] + i + 1;
      const int begin = window > 0 && end > window ? end - window : 0;
      int bad = 0;
      double worst = 0.0;
      for (int h = 0; h < nh; h++) {
        double qd[256], r[256];
        float qr[256];
        for (int e = 0; e < d; e++) qd[e] = q[(size_t)row * qrow + (size_t)h * d + e];
        t_rotate_f64(qd, d);
        for (int e = 0; e < d; e++) qr[e] = (float)qd[e];
        const size_t g = (size_t)(h / (nh / heads)) * d, first = (size_t)begin * heads * d;
        t_ref_head(qr, kvals + first + g, vvals + first + g, end - begin, d, heads * d,
                   1.0 / sqrt((double)d), r);
        t_rotate_f64(r, d);
        const double err = t_rel_l2(out + (size_t)row * qrow + (size_t)h * d, r, (size_t)d);
        bad += !(err <= 1e-5);
        worst = err > worst ? err : worst;
      }
      T_CHECKF(bad == 0, "seq %d (length %d, %d rows) row %d (sees %d..%d): %d heads off "
               "float64, relative L2 up to %.3g (bound 1e-5)",
               ids[s], sq->len, counts[s], i, begin, end - 1, bad, worst);
    }
  }
out:
  m40llm_free(ctx, dq);
  m40llm_free(ctx, dout);
  m40llm_kvcache_destroy(c);
  model_free(&m);
  free(q);
  free(out);
  free(kvals);
  free(vvals);
}

/* A call of more rows x K/V head units than kTierOneLaunchRowsPerSm (1024, cuda/tuning.cuh) an
 * SM: on sm_80+ in builds of CUDA 12.1 and later such a call takes a launch per tier, chained,
 * where the other cases' calls take one launch for every tier. Three sequences of 256 x SMs
 * positions, one unit each of 2 K/V heads: 1536 an SM, past the bound (keep it so). */
static void long_call(m40llm_context *ctx) {
  m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
  if (!on_cuda(ctx) || !T_OK(m40llm_context_device_info(&info, ctx))) return;
  const int sms = info.multiprocessors > 0 ? info.multiprocessors : 24;
  const int len = 256 * sms + t_rand_int(0, 99);
  m40llm_kvcache_options o = tiered_options(len, 4, 32);
  o.n_layers = 1;
  t_set_case("tiers: a long call, 3 x %d positions, %d/%d heads", len, o.n_heads, o.n_kv_heads);
  m40llm_kvcache *c = NULL;
  model m;
  if (!T_CHECK(model_init(&m, &o)) || !T_OK(m40llm_kvcache_create(&c, ctx, &o))) {
    model_free(&m);
    return;
  }
  for (int s = 0; s < 3; s++)
    while (seq_of(&m, 0, s)->len < len) {
      const int left = len - seq_of(&m, 0, s)->len;
      if (append_both(ctx, c, &m, 0, s, left < 4096 ? left : 4096) != M40LLM_OK) goto out;
    }
  int32_t rows[M40LLM_MAX_TIERS] = {0};
  if (T_OK(m40llm_kvcache_tier_rows(rows, c, 0, 1)))
    for (int t = 0; t < o.n_tiers; t++)
      T_CHECKF(rows[t] > 0, "tier %d holds no rows of the long sequence", t);
  const int32_t ids[3] = {2, 0, 1};
  check_attention(ctx, c, &m, 0, ids, 3);
out:
  m40llm_kvcache_destroy(c);
  model_free(&m);
}

void t_cases_tiers(m40llm_context *ctx, int small) {
  option_errors(ctx);
  call_errors(ctx);
  version_3(ctx);
  one_tier_is_uniform(ctx, M40LLM_KV_Q8, M40LLM_KV_Q4);
  one_tier_is_uniform(ctx, M40LLM_KV_Q4, M40LLM_KV_Q2);
  history(ctx, 4, 32, small, 0, 0);
  history(ctx, 0, 16, small, 0, 0);
  history(ctx, 3, 0, small, 0, 0);
  history(ctx, 0, 0, small, 0, 0); /* no FP16 slots: every row in a tier */
  history(ctx, 4, 32, small, 1, 0);
  history(ctx, 2, 0, small, 1, 0);
  history(ctx, 4, 128, small, 2, 0);
  history(ctx, 1, 8, small, 3, 0);
  history(ctx, 4, 32, small, 0, 1);
  history(ctx, 4, 32, small, 1, 1); /* the FP16 slots in an F16 launch of their own on CUDA */
  history(ctx, 4, 128, small, 2, 1);
  /* the tensor-core kernels' pairs of warps; on the CPU backend (no code by head_dim) it only
   * added 40 s to test_api under ASan */
  if (on_cuda(ctx)) {
    history(ctx, 2, 16, small, 4, 0);
    history(ctx, 4, 8, small, 5, 0);
  }
  causal_rows(ctx, 0, 0, 0);
  causal_rows(ctx, 0, 1, 0); /* the FP16 slots in a launch of their own on CUDA */
  causal_rows(ctx, 45, 0, 0);
  causal_rows(ctx, 0, 0, 1);
  long_call(ctx);
}
