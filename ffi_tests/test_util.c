#include "test_util.h"

#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Tests ask for absurd allocations on purpose: under AddressSanitizer let malloc return NULL
 * instead of aborting; CUDA under ASan needs the shadow gap unprotected. */
#if defined(__SANITIZE_ADDRESS__)
#define T_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define T_ASAN 1
#endif
#endif
#ifdef T_ASAN
const char *__asan_default_options(void);
const char *__asan_default_options(void) {
  return "allocator_may_return_null=1:protect_shadow_gap=0:detect_leaks=1";
}
#endif

/* ---- Assertions ------------------------------------------------------------------------------ */

long t_passed = 0;
long t_failed = 0;
long t_skipped = 0;

enum { T_MAX_PRINTED_FAILURES = 100 };
static char t_case_name[512] = "";

void t_set_case(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(t_case_name, sizeof t_case_name, fmt, ap);
  va_end(ap);
}

/* A failed status check prints the library's detail message; a failed value check does not
 * (the message is the last failure's, often a bad argument passed on purpose long before). */
static void t_report_failure(const char *file, int line, const char *msg, int with_detail) {
  t_failed++;
  if (t_failed > T_MAX_PRINTED_FAILURES) {
    if (t_failed == T_MAX_PRINTED_FAILURES + 1) fprintf(stderr, "(further failures not printed)\n");
    return;
  }
  const char *last = with_detail ? m40llm_last_error_message() : NULL;
  fprintf(stderr, "%s:%d: FAIL%s%s%s: %s%s%s%s\n", file, line, t_case_name[0] ? " [" : "",
          t_case_name, t_case_name[0] ? "]" : "", msg, with_detail ? " (detail: \"" : "",
          with_detail ? (last ? last : "(null)") : "", with_detail ? "\")" : "");
  fflush(stderr);
}

static int t_vcheck(int ok, const char *file, int line, int with_detail, const char *fmt,
                    va_list ap) {
  if (ok) {
    t_passed++;
    return 1;
  }
  char msg[1024];
  vsnprintf(msg, sizeof msg, fmt, ap);
  t_report_failure(file, line, msg, with_detail);
  return 0;
}

int t_check(int ok, const char *file, int line, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  const int r = t_vcheck(ok, file, line, 0, fmt, ap);
  va_end(ap);
  return r;
}

static int t_check_detail(int ok, const char *file, int line, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  const int r = t_vcheck(ok, file, line, 1, fmt, ap);
  va_end(ap);
  return r;
}

int t_check_status(int got, int want, const char *file, int line, const char *expr) {
  return t_check_detail(got == want, file, line, "%s returned %d (%s), expected %d (%s)", expr,
                        got, m40llm_status_string(got), want, m40llm_status_string(want));
}

static int t_contains_nocase(const char *hay, const char *needle) {
  size_t n = strlen(needle);
  for (; *hay; hay++) {
    size_t i = 0;
    while (i < n && hay[i] &&
           tolower((unsigned char)hay[i]) == tolower((unsigned char)needle[i]))
      i++;
    if (i == n) return 1;
  }
  return n == 0;
}

int t_check_errmsg(const char *want, const char *file, int line) {
  const char *msg = m40llm_last_error_message();
  if (!t_check(msg != NULL && msg[0] != '\0', file, line, "last_error_message is empty after a failure"))
    return 0;
  return t_check(want == NULL || t_contains_nocase(msg, want), file, line,
                 "last_error_message does not mention \"%s\"", want);
}

int t_check_failure(int got, int want, const char *substr, const char *file, int line,
                    const char *expr) {
  return t_check_status(got, want, file, line, expr) && t_check_errmsg(substr, file, line);
}

void t_skip(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("skipped: ");
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
  t_skipped++;
}

int t_finish(void) {
  if (t_skipped)
    printf("%ld passed, %ld failed, %ld skipped\n", t_passed, t_failed, t_skipped);
  else
    printf("%ld passed, %ld failed\n", t_passed, t_failed);
  fflush(stdout);
  return t_failed == 0 ? 0 : 1;
}

/* ---- RNG: xoshiro256** seeded by splitmix64 ------------------------------------------------- */

static uint64_t t_seed_value;
static uint64_t t_state[4];

static uint64_t t_splitmix64(uint64_t *x) {
  uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

void t_rng_init(void) {
  const char *env = getenv("M40LLM_TEST_SEED");
  if (env && *env) {
    t_seed_value = strtoull(env, NULL, 0);
  } else {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    uint64_t x = (uint64_t)ts.tv_sec * 1000000007ull ^ (uint64_t)ts.tv_nsec ^
                 (uint64_t)(uintptr_t)&ts;
    t_seed_value = t_splitmix64(&x) % 1000000000000ull;
  }
  uint64_t s = t_seed_value;
  for (int i = 0; i < 4; i++) t_state[i] = t_splitmix64(&s);
  printf("seed %llu (rerun with M40LLM_TEST_SEED=%llu to reproduce)\n",
         (unsigned long long)t_seed_value, (unsigned long long)t_seed_value);
  fflush(stdout);
}

static uint64_t t_rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t t_rand_u64(void) {
  uint64_t *s = t_state;
  uint64_t result = t_rotl(s[1] * 5, 7) * 9;
  uint64_t t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = t_rotl(s[3], 45);
  return result;
}

double t_rand_unit(void) { return (double)(t_rand_u64() >> 11) * (1.0 / 9007199254740992.0); }

float t_rand_float(float lo, float hi) { return lo + (float)(t_rand_unit() * (double)(hi - lo)); }

int t_rand_int(int lo, int hi) {
  uint64_t span = (uint64_t)((int64_t)hi - (int64_t)lo + 1);
  return (int)((int64_t)lo + (int64_t)(t_rand_u64() % span));
}

void t_fill_uniform(float *x, size_t n, float lo, float hi) {
  for (size_t i = 0; i < n; i++) x[i] = t_rand_float(lo, hi);
}

void t_peaked_qk(float *q, int n_heads, int d, float *k0) {
  double qq = 0.0;
  t_fill_uniform(k0, (size_t)d, -1.0f, 1.0f);
  for (int i = 0; i < d; i++) qq += (double)k0[i] * k0[i];
  for (int h = 0; h < n_heads; h++)
    for (int i = 0; i < d; i++) q[h * d + i] = (1.0f + 0.1f * (float)(h % 4)) * k0[i];
  const float gamma = (float)(10.09 * sqrt((double)d) / qq); /* head 0's logit: 10.09 */
  for (int i = 0; i < d; i++) k0[i] *= gamma;
}

void t_huge_qk(float *q, int n_heads, int d, float *k0) {
  t_peaked_qk(q, n_heads, d, k0);
  float kmax = 0.0f, qmax = 0.0f;
  for (int i = 0; i < d; i++) kmax = fmaxf(kmax, fabsf(k0[i]));
  for (int i = 0; i < n_heads * d; i++) qmax = fmaxf(qmax, fabsf(q[i]));
  for (int i = 0; i < d; i++) k0[i] *= 6e4f / kmax;
  for (int i = 0; i < n_heads * d; i++) q[i] *= 1e3f / qmax;
}

/* ---- FP16 ------------------------------------------------------------------------------------ */

uint32_t t_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

float t_f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

uint16_t t_f32_to_f16(float f) {
  uint32_t x = t_f32_bits(f);
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  uint32_t a = x & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x3FFu)); /* quiet NaN */
  if (a == 0x7F800000u) return (uint16_t)(sign | 0x7C00u);
  int e = (int)(a >> 23) - 127;
  uint32_t mant = a & 0x7FFFFFu;
  if (e > 15) return (uint16_t)(sign | 0x7C00u);
  if (e >= -14) {
    /* normal: keep 10 mantissa bits, round the 13 dropped ones to nearest even; a carry moves
     * into the exponent and may reach infinity (0x7C00), which is right */
    uint32_t h = ((uint32_t)(e + 15) << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
  }
  /* subnormal result (or zero): value = m * 2^(e-23) with m = 1.mant in 24 bits; in units of the
   * smallest subnormal 2^-24 that is m >> shift with shift = -(e + 1) >= 14 */
  int shift = -(e + 1);
  if (shift >= 32 || a == 0) return sign; /* far below 2^-25 (FP32 zeros and subnormals too) */
  uint64_t m = (uint64_t)(mant | 0x800000u);
  uint64_t q = m >> shift;
  uint64_t rem = m & ((1ull << shift) - 1);
  uint64_t half = 1ull << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) q++;
  return (uint16_t)(sign | (uint16_t)q);
}

float t_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1Fu;
  uint32_t m = h & 0x3FFu;
  if (e == 0x1F) return t_f32_from_bits(sign | 0x7F800000u | (m << 13));
  if (e == 0) {
    /* zero or subnormal: m * 2^-24, exact in float */
    float v = (float)m * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return t_f32_from_bits(sign | ((e + 112u) << 23) | (m << 13));
}

int t_f16_is_nan(uint16_t h) { return (h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) != 0; }

/* ---- Reference attention --------------------------------------------------------------------- */

static double *t_f16_table;

static const double *t_f16_lut(void) {
  if (!t_f16_table) {
    t_f16_table = malloc(65536 * sizeof(double));
    if (!t_f16_table) {
      fprintf(stderr, "out of host memory\n");
      exit(2);
    }
    for (uint32_t i = 0; i < 65536; i++) t_f16_table[i] = (double)t_f16_to_f32((uint16_t)i);
  }
  return t_f16_table;
}

/* Softmax weights of each query head over positions [0, len) of an F16 model's K
 * ([pos][kv_head][dim]), in double: w[h * len + p]. */
void t_ref_weights(double *w, const float *q, const uint16_t *k, int len, int n_heads,
                   int n_kv_heads, int d, float scale) {
  const double sc = scale == 0.0f ? 1.0 / sqrt((double)d) : (double)scale;
  const int group = n_heads / n_kv_heads;
  for (int h = 0; h < n_heads; h++) {
    double *row = w + (size_t)h * (size_t)len, mx = -INFINITY, sum = 0.0;
    for (int p = 0; p < len; p++) {
      const uint16_t *kr = k + ((size_t)p * (size_t)n_kv_heads + (size_t)(h / group)) * (size_t)d;
      double s = 0.0;
      for (int i = 0; i < d; i++) s += (double)q[(size_t)h * (size_t)d + i] * t_f16_to_f32(kr[i]);
      row[p] = s * sc;
      if (row[p] > mx) mx = row[p];
    }
    for (int p = 0; p < len; p++) sum += row[p] = exp(row[p] - mx);
    for (int p = 0; p < len; p++) row[p] /= sum;
  }
}

void t_ref_attention(double *out, const float *q, const uint16_t *k, const uint16_t *v, int len,
                     int n_heads, int n_kv_heads, int head_dim, float scale) {
  const double *lut = t_f16_lut();
  const int group = n_heads / n_kv_heads;
  const double s = scale == 0.0f ? 1.0 / sqrt((double)head_dim) : (double)scale;
  const size_t row = (size_t)n_kv_heads * (size_t)head_dim;
  double *w = malloc(((size_t)len + 1) * sizeof(double));
  double *acc = malloc((size_t)head_dim * sizeof(double));
  if (!w || !acc) {
    fprintf(stderr, "out of host memory\n");
    exit(2);
  }
  for (int h = 0; h < n_heads; h++) {
    const int g = h / group;
    const float *qh = q + (size_t)h * (size_t)head_dim;
    double *oh = out + (size_t)h * (size_t)head_dim;
    double mx = -INFINITY;
    for (int t = 0; t < len; t++) {
      const uint16_t *kt = k + (size_t)t * row + (size_t)g * (size_t)head_dim;
      double dot = 0.0;
      for (int d = 0; d < head_dim; d++) dot += (double)qh[d] * lut[kt[d]];
      w[t] = s * dot;
      if (w[t] > mx) mx = w[t];
    }
    double z = 0.0;
    for (int t = 0; t < len; t++) {
      w[t] = w[t] == -INFINITY ? 0.0 : exp(w[t] - mx); /* masked: weight 0 */
      z += w[t];
    }
    for (int d = 0; d < head_dim; d++) acc[d] = 0.0;
    for (int t = 0; t < len; t++) {
      const uint16_t *vt = v + (size_t)t * row + (size_t)g * (size_t)head_dim;
      for (int d = 0; d < head_dim; d++) acc[d] += w[t] * lut[vt[d]];
    }
    for (int d = 0; d < head_dim; d++) oh[d] = z > 0.0 ? acc[d] / z : 0.0;
  }
  free(w);
  free(acc);
}

double t_rel_l2(const float *got, const double *ref, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; i++) {
    if (!isfinite(got[i])) return NAN;
    double d = (double)got[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

int t_all_bytes(const void *p, size_t n, unsigned char byte) {
  const unsigned char *c = p;
  for (size_t i = 0; i < n; i++)
    if (c[i] != byte) return 0;
  return 1;
}

int t_parse_archs(const char *list, int *arch, int *real, int max) {
  int n = 0;
  for (const char *s = list; *s;) {
    if (n == max || !isdigit((unsigned char)*s)) return -1;
    arch[n] = 0;
    while (isdigit((unsigned char)*s)) arch[n] = 10 * arch[n] + (*s++ - '0');
    while (islower((unsigned char)*s)) s++;
    if (strncmp(s, "-real", 5) == 0) {
      real[n] = 1;
      s += 5;
    } else if (strncmp(s, "-virtual", 8) == 0) {
      real[n] = 0;
      s += 8;
    } else {
      return -1;
    }
    n++;
    if (*s == ';' && s[1]) s++;
    else if (*s) return -1;
  }
  return n;
}

/* ---- Host model ------------------------------------------------------------------------------ */

static size_t t_model_index(const t_model *m, int layer, int seq) {
  return ((size_t)layer * (size_t)m->max_seqs + (size_t)seq) * (size_t)m->max_seq_len * m->row;
}

int t_model_init(t_model *m, const m40llm_kvcache_options *o) {
  memset(m, 0, sizeof *m);
  m->n_layers = o->n_layers;
  m->max_seqs = o->max_seqs;
  m->n_kv_heads = o->n_kv_heads;
  m->head_dim = o->head_dim;
  m->max_seq_len = o->max_seq_len;
  m->row = (size_t)o->n_kv_heads * (size_t)o->head_dim;
  size_t elems = (size_t)o->n_layers * (size_t)o->max_seqs * (size_t)o->max_seq_len * m->row;
  m->k = malloc(elems * sizeof(uint16_t));
  m->v = malloc(elems * sizeof(uint16_t));
  m->len = calloc((size_t)o->n_layers * (size_t)o->max_seqs, sizeof(int));
  if (!m->k || !m->v || !m->len) {
    t_model_free(m);
    return 0;
  }
  return 1;
}

void t_model_free(t_model *m) {
  free(m->k);
  free(m->v);
  free(m->len);
  m->k = m->v = NULL;
  m->len = NULL;
}

uint16_t *t_model_k(const t_model *m, int layer, int seq) { return m->k + t_model_index(m, layer, seq); }
uint16_t *t_model_v(const t_model *m, int layer, int seq) { return m->v + t_model_index(m, layer, seq); }
int t_model_len(const t_model *m, int layer, int seq) { return m->len[layer * m->max_seqs + seq]; }

void t_model_append(t_model *m, int layer, int seq, const uint16_t *k, const uint16_t *v, int n) {
  int *len = &m->len[layer * m->max_seqs + seq];
  size_t off = (size_t)*len * m->row;
  memcpy(t_model_k(m, layer, seq) + off, k, (size_t)n * m->row * sizeof(uint16_t));
  memcpy(t_model_v(m, layer, seq) + off, v, (size_t)n * m->row * sizeof(uint16_t));
  *len += n;
}

void t_model_truncate(t_model *m, int seq, int new_len) {
  for (int l = 0; l < m->n_layers; l++) {
    int *len = &m->len[l * m->max_seqs + seq];
    if (*len > new_len) *len = new_len;
  }
}

void t_model_reset(t_model *m, int seq) { t_model_truncate(m, seq, 0); }

void t_model_fork(t_model *m, int dst, int src) {
  for (int l = 0; l < m->n_layers; l++) {
    int n = t_model_len(m, l, src);
    memcpy(t_model_k(m, l, dst), t_model_k(m, l, src), (size_t)n * m->row * sizeof(uint16_t));
    memcpy(t_model_v(m, l, dst), t_model_v(m, l, src), (size_t)n * m->row * sizeof(uint16_t));
    m->len[l * m->max_seqs + dst] = n;
  }
}

/* ---- Backend buffers ------------------------------------------------------------------------- */

void *t_dev_alloc(m40llm_context *ctx, size_t bytes) {
  void *p = NULL;
  if (!T_OK(m40llm_malloc(&p, ctx, bytes))) return NULL;
  T_CHECK(p != NULL);
  return p;
}

void *t_dev_upload(m40llm_context *ctx, const void *host, size_t bytes) {
  void *p = t_dev_alloc(ctx, bytes);
  if (p && !T_OK(m40llm_memcpy_to_device(ctx, p, host, bytes))) {
    m40llm_free(ctx, p);
    return NULL;
  }
  return p;
}

int t_dev_download(m40llm_context *ctx, void *host, const void *dev, size_t bytes) {
  return T_OK(m40llm_memcpy_to_host(ctx, host, dev, bytes));
}

/* ---- Cache + model ----------------------------------------------------------------------------- */

int t_kv_create_opts(t_kv *kv, m40llm_context *ctx, const m40llm_kvcache_options *o) {
  memset(kv, 0, sizeof *kv);
  kv->ctx = ctx;
  kv->opts = *o;
  int st = m40llm_kvcache_create(&kv->cache, ctx, o);
  if (!T_OK(st)) {
    kv->cache = NULL;
    return st == M40LLM_OK ? M40LLM_ERR_INVALID_ARGUMENT : st;
  }
  if (!T_CHECK(t_model_init(&kv->model, o))) {
    m40llm_kvcache_destroy(kv->cache);
    kv->cache = NULL;
    return M40LLM_ERR_OUT_OF_MEMORY;
  }
  return M40LLM_OK;
}

int t_kv_create(t_kv *kv, m40llm_context *ctx, int n_layers, int n_heads, int n_kv_heads,
                int head_dim, int max_seqs, int max_seq_len) {
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = n_layers;
  o.n_heads = n_heads;
  o.n_kv_heads = n_kv_heads;
  o.head_dim = head_dim;
  o.max_seqs = max_seqs;
  o.max_seq_len = max_seq_len;
  return t_kv_create_opts(kv, ctx, &o);
}

void t_kv_destroy(t_kv *kv) {
  m40llm_kvcache_destroy(kv->cache);
  kv->cache = NULL;
  t_model_free(&kv->model);
}

int t_kv_append_f16(t_kv *kv, int layer, int seq, const uint16_t *k, const uint16_t *v, int n) {
  size_t bytes = (size_t)n * kv->model.row * sizeof(uint16_t);
  void *dk = t_dev_upload(kv->ctx, k, bytes);
  void *dv = t_dev_upload(kv->ctx, v, bytes);
  int st = M40LLM_ERR_OUT_OF_MEMORY;
  if (dk && dv) st = m40llm_kvcache_append_f16(kv->cache, layer, seq, dk, dv, n);
  if (st == M40LLM_OK) t_model_append(&kv->model, layer, seq, k, v, n);
  m40llm_free(kv->ctx, dk);
  m40llm_free(kv->ctx, dv);
  return st;
}

int t_kv_append_f32(t_kv *kv, int layer, int seq, const float *k, const float *v, int n) {
  size_t elems = (size_t)n * kv->model.row;
  void *dk = t_dev_upload(kv->ctx, k, elems * sizeof(float));
  void *dv = t_dev_upload(kv->ctx, v, elems * sizeof(float));
  int st = M40LLM_ERR_OUT_OF_MEMORY;
  if (dk && dv) st = m40llm_kvcache_append_f32(kv->cache, layer, seq, dk, dv, n);
  if (st == M40LLM_OK) {
    uint16_t *hk = malloc(elems * sizeof(uint16_t));
    uint16_t *hv = malloc(elems * sizeof(uint16_t));
    if (hk && hv) {
      for (size_t i = 0; i < elems; i++) {
        hk[i] = t_f32_to_f16(k[i]);
        hv[i] = t_f32_to_f16(v[i]);
      }
      t_model_append(&kv->model, layer, seq, hk, hv, n);
    } else {
      st = M40LLM_ERR_OUT_OF_MEMORY;
    }
    free(hk);
    free(hv);
  }
  m40llm_free(kv->ctx, dk);
  m40llm_free(kv->ctx, dv);
  return st;
}

void t_kv_append_same_random(t_kv *const *kvs, int *status, int n_kvs, int layer, int seq, int n,
                             float amp, int use_f32) {
  const size_t elems = (size_t)n * kvs[0]->model.row;
  float *k = malloc(elems * sizeof(float));
  float *v = malloc(elems * sizeof(float));
  uint16_t *hk = malloc(elems * sizeof(uint16_t));
  uint16_t *hv = malloc(elems * sizeof(uint16_t));
  for (int i = 0; i < n_kvs; i++) status[i] = M40LLM_ERR_OUT_OF_MEMORY;
  if (k && v && hk && hv) {
    t_fill_uniform(k, elems, -amp, amp);
    t_fill_uniform(v, elems, -amp, amp);
    if (!use_f32) {
      for (size_t i = 0; i < elems; i++) {
        hk[i] = t_f32_to_f16(k[i]);
        hv[i] = t_f32_to_f16(v[i]);
      }
    }
    for (int i = 0; i < n_kvs; i++)
      status[i] = use_f32 ? t_kv_append_f32(kvs[i], layer, seq, k, v, n)
                          : t_kv_append_f16(kvs[i], layer, seq, hk, hv, n);
  }
  free(k);
  free(v);
  free(hk);
  free(hv);
}

int t_kv_append_random(t_kv *kv, int layer, int seq, int n, float amp) {
  int done = 0, use_f32 = (int)(t_rand_u64() & 1);
  while (done < n) {
    int left = n - done;
    int chunk = left <= 3 ? left : t_rand_int(1, left / 2 + 1);
    int st;
    t_kv_append_same_random(&kv, &st, 1, layer, seq, chunk, amp, use_f32);
    if (!T_OK(st)) return st;
    done += chunk;
    use_f32 = !use_f32;
  }
  return M40LLM_OK;
}

int t_kv_truncate(t_kv *kv, int seq, int new_len) {
  int st = m40llm_kvcache_seq_truncate(kv->cache, seq, new_len);
  if (st == M40LLM_OK) t_model_truncate(&kv->model, seq, new_len);
  return st;
}

int t_kv_reset(t_kv *kv, int seq) {
  int st = m40llm_kvcache_seq_reset(kv->cache, seq);
  if (st == M40LLM_OK) t_model_reset(&kv->model, seq);
  return st;
}

int t_kv_fork(t_kv *kv, int dst, int src) {
  int st = m40llm_kvcache_seq_fork(kv->cache, dst, src);
  if (st == M40LLM_OK) t_model_fork(&kv->model, dst, src);
  return st;
}

static void t_compare_f16(const uint16_t *got, const uint16_t *want, size_t n, const char *what,
                          int layer, int seq, int pos0, size_t row) {
  for (size_t i = 0; i < n; i++) {
    if (got[i] != want[i]) {
      T_CHECKF(0, "%s of layer %d seq %d differs at position %zu element %zu: got 0x%04x want 0x%04x",
               what, layer, seq, (size_t)pos0 + i / row, i % row, got[i], want[i]);
      return;
    }
  }
  T_CHECK(1);
}

void t_kv_check_contents(t_kv *kv) {
  const t_model *m = &kv->model;
  for (int l = 0; l < m->n_layers; l++) {
    for (int s = 0; s < m->max_seqs; s++) {
      int len = -1;
      T_OK(m40llm_kvcache_seq_len(&len, kv->cache, l, s));
      if (!T_CHECKF(len == t_model_len(m, l, s), "layer %d seq %d: length %d, expected %d", l, s,
                    len, t_model_len(m, l, s)) ||
          len <= 0)
        continue;
      size_t elems = (size_t)len * m->row;
      size_t bytes = elems * sizeof(uint16_t);
      uint16_t *dk = t_dev_alloc(kv->ctx, bytes);
      uint16_t *dv = t_dev_alloc(kv->ctx, bytes);
      uint16_t *hk = malloc(bytes);
      uint16_t *hv = malloc(bytes);
      if (dk && dv && hk && hv && T_OK(m40llm_memset(kv->ctx, dk, 0xFF, bytes)) &&
          T_OK(m40llm_memset(kv->ctx, dv, 0xFF, bytes)) &&
          T_OK(m40llm_kvcache_read_f16(dk, dv, kv->cache, l, s, 0, len)) &&
          t_dev_download(kv->ctx, hk, dk, bytes) && t_dev_download(kv->ctx, hv, dv, bytes)) {
        t_compare_f16(hk, t_model_k(m, l, s), elems, "K", l, s, 0, m->row);
        t_compare_f16(hv, t_model_v(m, l, s), elems, "V", l, s, 0, m->row);
        /* a sub-range with only V requested (K NULL), into the start of the buffer */
        int pos = len / 2, n = len - len / 2;
        size_t sub = (size_t)n * m->row;
        if (T_OK(m40llm_memset(kv->ctx, dv, 0xFF, bytes)) &&
            T_OK(m40llm_kvcache_read_f16(NULL, dv, kv->cache, l, s, pos, n)) &&
            t_dev_download(kv->ctx, hv, dv, bytes)) {
          t_compare_f16(hv, t_model_v(m, l, s) + (size_t)pos * m->row, sub, "V sub-range", l, s,
                        pos, m->row);
          T_CHECKF(t_all_bytes(hv + sub, bytes - sub * sizeof(uint16_t), 0xFF),
                   "read_f16 wrote past n_tokens");
        }
      }
      m40llm_free(kv->ctx, dk);
      m40llm_free(kv->ctx, dv);
      free(hk);
      free(hv);
    }
  }
}

double t_kv_check_attention(t_kv *kv, int layer, const int32_t *ids, int n_ids, const float *q,
                            float scale, double tol, int use_batch, float *got_out) {
  const m40llm_kvcache_options *o = &kv->opts;
  const size_t stride = (size_t)o->n_heads * (size_t)o->head_dim;
  const size_t bytes = (size_t)n_ids * stride * sizeof(float);
  float *dq = t_dev_upload(kv->ctx, q, bytes);
  float *dout = t_dev_alloc(kv->ctx, bytes);
  float *got = malloc(bytes);
  double *ref = malloc(stride * sizeof(double));
  double worst = 0.0;
  if (!dq || !dout || !got || !ref) {
    T_CHECKF(0, "allocation failed");
    worst = NAN;
    goto done;
  }
  if (!T_OK(m40llm_memset(kv->ctx, dout, 0xFF, bytes))) {
    worst = NAN;
    goto done;
  }
  if (use_batch) {
    if (!T_OK(m40llm_kvcache_attn_batch_f32q(dout, kv->cache, layer, ids, n_ids, dq, scale))) {
      worst = NAN;
      goto done;
    }
  } else {
    for (int i = 0; i < n_ids; i++) {
      if (!T_OK(m40llm_kvcache_attn_last_token_f32q(dout + (size_t)i * stride, kv->cache, layer,
                                                    ids[i], dq + (size_t)i * stride, scale))) {
        worst = NAN;
        goto done;
      }
    }
  }
  if (!T_OK(m40llm_context_synchronize(kv->ctx)) || !t_dev_download(kv->ctx, got, dout, bytes)) {
    worst = NAN;
    goto done;
  }
  for (int i = 0; i < n_ids; i++) {
    int s = ids[i];
    int len = t_model_len(&kv->model, layer, s);
    t_ref_attention(ref, q + (size_t)i * stride, t_model_k(&kv->model, layer, s),
                    t_model_v(&kv->model, layer, s), len, o->n_heads, o->n_kv_heads, o->head_dim,
                    scale);
    const float *row = got + (size_t)i * stride;
    double err = t_rel_l2(row, ref, stride);
    if (!(err <= worst)) worst = err;
    if (len == 0) {
      int zeros = 1;
      for (size_t j = 0; j < stride; j++) zeros &= row[j] == 0.0f;
      T_CHECKF(zeros, "%s row %d (seq %d, layer %d, empty) is not all zeros",
               use_batch ? "batch" : "single", i, s, layer);
    } else {
      T_CHECKF(err <= tol, "%s row %d (seq %d, layer %d, len %d, scale %g): rel L2 %.3g > %.1g",
               use_batch ? "batch" : "single", i, s, layer, len, (double)scale, err, tol);
    }
  }
  if (got_out) memcpy(got_out, got, bytes);
done:
  m40llm_free(kv->ctx, dq);
  m40llm_free(kv->ctx, dout);
  free(got);
  free(ref);
  return worst;
}
