/*
 * FP16 and BF16 q, out and K/V rows (the _ex calls) on any context, every K/V format pair
 * (rotated, with protected tokens), GQA groups 1, 3, 4, 8, head_dim 40, 64, 96, 128, 256, ragged
 * lengths 1, 31, 33, 257. Two caches on the context under test get the same values: one from
 * 16-bit rows through m40llm_kvcache_append_batch_ex, one from those rows widened to FP32
 * through m40llm_kvcache_append_batch_f32; then
 * - their contents agree bit for bit (read_f16): a 16-bit row is stored as its FP32 value is;
 * - every output element of the decode, causal and append+attend calls in the 16-bit type is
 *   the FP32 call's element on the widened q, rounded to that type by this file's own
 *   converters (to nearest even): bit for bit, since the arithmetic is the same FP32 (NaN where
 *   it is NaN); outputs are poisoned first, so an unwritten element fails;
 * - the FP32 call agrees with the CPU backend's float64 reference on a cache of the same values
 *   (1e-5 relative L2 a row).
 * Errors: a dtype that is none fails with M40LLM_ERR_INVALID_ARGUMENT, writes nothing and
 * changes no length; q and out are checked for overlap over their bytes in the call's type.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#define TOL 1e-5
#define N_SEQS 4

typedef struct {
  int kf, vf, n_heads, n_kv, d;
} dtype_shape;

/* bfloat16 to nearest even, chosen between the two neighbours in float64 (not by the
 * library's bit trick); NaN stays NaN. */
static uint16_t to_bf16(float f) {
  if (f != f) return (uint16_t)((t_f32_bits(f) >> 16) | 0x40u);
  const uint32_t lo = t_f32_bits(f) & 0xffff0000u;
  const uint32_t hi = lo + 0x10000u; /* the next one away from zero (an inf past the largest) */
  const double dl = fabs((double)f - (double)t_f32_from_bits(lo));
  const double dh = fabs((double)t_f32_from_bits(hi) - (double)f);
  if (dl < dh || (dl == dh && !(lo & 0x10000u))) return (uint16_t)(lo >> 16);
  return (uint16_t)(hi >> 16);
}

static float from16(uint16_t h, int dtype) {
  return dtype == M40LLM_DTYPE_BF16 ? t_f32_from_bits((uint32_t)h << 16) : t_f16_to_f32(h);
}

static uint16_t to16(float f, int dtype) {
  return dtype == M40LLM_DTYPE_BF16 ? to_bf16(f) : t_f32_to_f16(f);
}

/* n random values in [-amp, amp] as 16-bit patterns, and their FP32 values. */
static void random16(uint16_t *bits, float *wide, size_t n, float amp, int dtype) {
  for (size_t i = 0; i < n; i++) {
    bits[i] = to16(t_rand_float(-amp, amp), dtype);
    wide[i] = from16(bits[i], dtype);
  }
}

/* Every element of got (16-bit, n of them) is want (FP32) rounded to the type. */
static void check_rounded(const uint16_t *got, const float *want, size_t n, int dtype,
                          const char *what) {
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < n; i++) {
    const uint16_t w = to16(want[i], dtype);
    const int same = want[i] != want[i] ? from16(got[i], dtype) != from16(got[i], dtype)
                                        : got[i] == w;
    if (!same && bad++ == 0) first = i;
  }
  T_CHECKF(bad == 0, "%s: %zu of %zu elements are not the FP32 output rounded (first: element %zu, "
           "got 0x%04x, FP32 %.9g)", what, bad, n, first, bad ? got[first] : 0,
           bad ? (double)want[first] : 0.0);
}

typedef struct {
  m40llm_context *ctx, *cpu;
  dtype_shape s;
  int dtype;
  size_t kv_row, q_row; /* elements of a position of K (or V), of a query row */
  m40llm_kvcache *c16, *c32, *ref; /* appended 16-bit / FP32 on ctx; FP32 on the CPU */
} dtype_case;

static m40llm_kvcache *make_cache(m40llm_context *ctx, const dtype_shape *s) {
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = 2, o.n_heads = s->n_heads, o.n_kv_heads = s->n_kv, o.head_dim = s->d;
  o.max_seqs = N_SEQS, o.max_seq_len = 300;
  o.format = s->kf, o.v_format = s->vf;
  o.n_sinks = 4, o.window = 32; /* so that some positions are quantized, some kept */
  m40llm_kvcache *c = NULL;
  return T_OK(m40llm_kvcache_create(&c, ctx, &o)) ? c : NULL;
}

/* A batched append of `rows` positions (counts per sequence) to layer 1 of every cache: 16-bit
 * rows to c16, their FP32 values to c32 and ref. */
static int append_all(dtype_case *t, const int32_t *counts, size_t rows) {
  const int32_t ids[N_SEQS] = {0, 1, 2, 3};
  const size_t n = rows * t->kv_row;
  uint16_t *k16 = malloc(n * 2), *v16 = malloc(n * 2);
  float *k32 = malloc(n * 4), *v32 = malloc(n * 4);
  int ok = T_CHECK(k16 && v16 && k32 && v32);
  if (ok) {
    random16(k16, k32, n, 2.0f, t->dtype);
    random16(v16, v32, n, 2.0f, t->dtype);
  }
  void *dk16 = ok ? t_dev_upload(t->ctx, k16, n * 2) : NULL;
  void *dv16 = ok ? t_dev_upload(t->ctx, v16, n * 2) : NULL;
  void *dk32 = ok ? t_dev_upload(t->ctx, k32, n * 4) : NULL;
  void *dv32 = ok ? t_dev_upload(t->ctx, v32, n * 4) : NULL;
  ok = ok && dk16 && dv16 && dk32 && dv32 &&
       T_OK(m40llm_kvcache_append_batch_ex(t->c16, 1, ids, counts, N_SEQS, dk16, dv16,
                                           t->dtype)) &&
       T_OK(m40llm_kvcache_append_batch_f32(t->c32, 1, ids, counts, N_SEQS, dk32, dv32)) &&
       T_OK(m40llm_kvcache_append_batch_f32(t->ref, 1, ids, counts, N_SEQS, k32, v32));
  m40llm_free(t->ctx, dk16), m40llm_free(t->ctx, dv16);
  m40llm_free(t->ctx, dk32), m40llm_free(t->ctx, dv32);
  free(k16), free(v16), free(k32), free(v32);
  return ok;
}

/* c16 and c32 hold the same FP16 contents (the values attention reads), bit for bit. */
static void check_contents(dtype_case *t) {
  for (int s = 0; s < N_SEQS; s++) {
    int len = 0;
    if (!T_OK(m40llm_kvcache_seq_len(&len, t->c16, 1, s))) return;
    const size_t n = (size_t)len * t->kv_row * 2;
    uint16_t *a = malloc(n), *b = malloc(n);
    void *dk = t_dev_alloc(t->ctx, n), *dv = t_dev_alloc(t->ctx, n);
    int ok = T_CHECK(a && b) && dk && dv &&
             T_OK(m40llm_kvcache_read_f16(dk, dv, t->c16, 1, s, 0, len)) &&
             t_dev_download(t->ctx, a, dk, n) &&
             T_OK(m40llm_kvcache_read_f16(dk, dv, t->c32, 1, s, 0, len)) &&
             t_dev_download(t->ctx, b, dk, n);
    if (ok) T_CHECKF(memcmp(a, b, n) == 0, "seq %d: K from 16-bit rows differs from FP32 rows", s);
    ok = ok && T_OK(m40llm_kvcache_read_f16(dk, dv, t->c16, 1, s, 0, len)) &&
         t_dev_download(t->ctx, a, dv, n) &&
         T_OK(m40llm_kvcache_read_f16(dk, dv, t->c32, 1, s, 0, len)) &&
         t_dev_download(t->ctx, b, dv, n);
    if (ok) T_CHECKF(memcmp(a, b, n) == 0, "seq %d: V from 16-bit rows differs from FP32 rows", s);
    m40llm_free(t->ctx, dk), m40llm_free(t->ctx, dv);
    free(a), free(b);
  }
}

enum { CALL_DECODE, CALL_CAUSAL, CALL_APPEND_ATTN };

/* One call of kind `call` over `rows` query rows in the 16-bit type on c16 and in FP32 on c32
 * (and ref, the reference), outputs poisoned first; checks the rounding and the reference. */
static void run_call(dtype_case *t, int call, const int32_t *q_counts, size_t rows) {
  static const char *names[] = {"attn_batch_ex", "attn_causal_ex", "append_attn_ex"};
  const int32_t ids[N_SEQS] = {0, 1, 2, 3};
  const size_t n = rows * t->q_row, nkv = N_SEQS * t->kv_row;
  uint16_t *q16 = malloc(n * 2), *o16 = malloc(n * 2), *k16 = malloc(nkv * 2),
           *v16 = malloc(nkv * 2);
  float *q32 = malloc(n * 4), *o32 = malloc(n * 4), *oref = malloc(n * 4), *k32 = malloc(nkv * 4),
        *v32 = malloc(nkv * 4);
  int ok = T_CHECK(q16 && o16 && k16 && v16 && q32 && o32 && oref && k32 && v32);
  if (!ok) goto done;
  random16(q16, q32, n, 1.5f, t->dtype);
  random16(k16, k32, nkv, 2.0f, t->dtype);
  random16(v16, v32, nkv, 2.0f, t->dtype);
  void *dq16 = t_dev_upload(t->ctx, q16, n * 2), *dq32 = t_dev_upload(t->ctx, q32, n * 4);
  void *dk16 = t_dev_upload(t->ctx, k16, nkv * 2), *dv16 = t_dev_upload(t->ctx, v16, nkv * 2);
  void *dk32 = t_dev_upload(t->ctx, k32, nkv * 4), *dv32 = t_dev_upload(t->ctx, v32, nkv * 4);
  void *do16 = t_dev_alloc(t->ctx, n * 2), *do32 = t_dev_alloc(t->ctx, n * 4);
  ok = dq16 && dq32 && dk16 && dv16 && dk32 && dv32 && do16 && do32 &&
       T_OK(m40llm_memset(t->ctx, do16, 0xFF, n * 2)) &&
       T_OK(m40llm_memset(t->ctx, do32, 0xFF, n * 4));
  for (size_t i = 0; i < n; i++) oref[i] = NAN;
  if (ok && call == CALL_DECODE) {
    ok = T_OK(m40llm_kvcache_attn_batch_ex(do16, t->c16, 1, ids, N_SEQS, dq16, t->dtype, 0.0f)) &&
         T_OK(m40llm_kvcache_attn_batch_f32q(do32, t->c32, 1, ids, N_SEQS, dq32, 0.0f)) &&
         T_OK(m40llm_kvcache_attn_batch_f32q(oref, t->ref, 1, ids, N_SEQS, q32, 0.0f));
  } else if (ok && call == CALL_CAUSAL) {
    ok = T_OK(m40llm_kvcache_attn_causal_ex(do16, t->c16, 1, ids, q_counts, N_SEQS, dq16,
                                            t->dtype, NULL)) &&
         T_OK(m40llm_kvcache_attn_causal_f32q(do32, t->c32, 1, ids, q_counts, N_SEQS, dq32,
                                              NULL)) &&
         T_OK(m40llm_kvcache_attn_causal_f32q(oref, t->ref, 1, ids, q_counts, N_SEQS, q32, NULL));
  } else if (ok) {
    ok = T_OK(m40llm_kvcache_append_attn_ex(do16, t->c16, 1, ids, N_SEQS, dk16, dv16, dq16,
                                            t->dtype, 0.0f)) &&
         T_OK(m40llm_kvcache_append_attn_f32q(do32, t->c32, 1, ids, N_SEQS, dk32, dv32, dq32,
                                              0.0f)) &&
         T_OK(m40llm_kvcache_append_attn_f32q(oref, t->ref, 1, ids, N_SEQS, k32, v32, q32, 0.0f));
  }
  ok = ok && t_dev_download(t->ctx, o16, do16, n * 2) && t_dev_download(t->ctx, o32, do32, n * 4);
  if (ok) {
    check_rounded(o16, o32, n, t->dtype, names[call]);
    double ref_row[256 * 64];
    for (size_t r = 0; r < rows; r++) {
      for (size_t i = 0; i < t->q_row; i++) ref_row[i] = oref[r * t->q_row + i];
      const double err = t_rel_l2(o32 + r * t->q_row, ref_row, t->q_row);
      T_CHECKF(err <= TOL, "%s: FP32 row %zu against the CPU reference: relative L2 %.3g > %g",
               names[call], r, err, TOL);
    }
  }
  m40llm_free(t->ctx, dq16), m40llm_free(t->ctx, dq32), m40llm_free(t->ctx, dk16);
  m40llm_free(t->ctx, dv16), m40llm_free(t->ctx, dk32), m40llm_free(t->ctx, dv32);
  m40llm_free(t->ctx, do16), m40llm_free(t->ctx, do32);
done:
  free(q16), free(o16), free(k16), free(v16), free(q32), free(o32), free(oref), free(k32), free(v32);
}

static void run_case(m40llm_context *ctx, m40llm_context *cpu, dtype_shape s, int dtype) {
  static const char *fmts[] = {"F16", "Q8", "Q4"};
  t_set_case("dtype %s, K %s / V %s, %d/%d heads, head_dim %d",
             dtype == M40LLM_DTYPE_BF16 ? "BF16" : "F16", fmts[s.kf], fmts[s.vf], s.n_heads,
             s.n_kv, s.d);
  dtype_case t = {ctx, cpu, s, dtype, (size_t)s.n_kv * s.d, (size_t)s.n_heads * s.d,
                  make_cache(ctx, &s), make_cache(ctx, &s), make_cache(cpu, &s)};
  if (t.c16 && t.c32 && t.ref) {
    const int32_t lens[N_SEQS] = {1, 31, 33, 257};
    const int32_t q_counts[N_SEQS] = {1, 7, 33, 40};
    if (append_all(&t, lens, 1 + 31 + 33 + 257)) {
      check_contents(&t);
      run_call(&t, CALL_DECODE, NULL, N_SEQS);
      run_call(&t, CALL_CAUSAL, q_counts, 1 + 7 + 33 + 40);
      run_call(&t, CALL_APPEND_ATTN, NULL, N_SEQS);
      check_contents(&t);
    }
  }
  m40llm_kvcache_destroy(t.c16), m40llm_kvcache_destroy(t.c32), m40llm_kvcache_destroy(t.ref);
}

/* A dtype that is none: each _ex call fails, writes nothing, changes no length. Adjacent
 * 16-bit q and out do not overlap; the same bytes read as FP32 rows do. */
static void errors(m40llm_context *ctx) {
  t_set_case("dtype errors");
  const dtype_shape s = {M40LLM_KV_F16, M40LLM_KV_F16, 4, 2, 64};
  m40llm_kvcache *c = make_cache(ctx, &s);
  const size_t q_row = 4 * 64, kv_row = 2 * 64;
  void *buf = t_dev_alloc(ctx, 2 * q_row * 4), *kv = t_dev_alloc(ctx, kv_row * 4);
  if (!c || !buf || !kv || !T_OK(m40llm_memset(ctx, kv, 0, kv_row * 4)) ||
      !T_OK(m40llm_memset(ctx, buf, 0x7F, 2 * q_row * 4))) {
    m40llm_kvcache_destroy(c), m40llm_free(ctx, buf), m40llm_free(ctx, kv);
    return;
  }
  const int32_t id = 0;
  unsigned char *q = buf, *out = (unsigned char *)buf + q_row * 2;
  T_OK(m40llm_kvcache_append_batch_ex(c, 0, &id, NULL, 1, kv, kv, M40LLM_DTYPE_BF16));
  for (int bad = -1; bad <= 3; bad += 4) {
    T_FAIL_WITH(m40llm_kvcache_append_batch_ex(c, 0, &id, NULL, 1, kv, kv, bad),
                M40LLM_ERR_INVALID_ARGUMENT, "dtype");
    T_FAIL_WITH(m40llm_kvcache_attn_batch_ex(out, c, 0, &id, 1, q, bad, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "dtype");
    T_FAIL_WITH(m40llm_kvcache_attn_causal_ex(out, c, 0, &id, NULL, 1, q, bad, NULL),
                M40LLM_ERR_INVALID_ARGUMENT, "dtype");
    T_FAIL_WITH(m40llm_kvcache_append_attn_ex(out, c, 0, &id, 1, kv, kv, q, bad, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "dtype");
  }
  int len = -1;
  T_OK(m40llm_kvcache_seq_len(&len, c, 0, 0));
  T_INT_EQ(len, 1);
  unsigned char host[256 * 4 * 2];
  if (t_dev_download(ctx, host, buf, sizeof host))
    T_CHECKF(t_all_bytes(host, sizeof host, 0x7F), "a failed call wrote q or out");
  /* out starts where 16-bit q ends: fine in F16, an overlap as FP32. */
  T_FAIL_WITH(m40llm_kvcache_attn_batch_ex(out, c, 0, &id, 1, q, M40LLM_DTYPE_F32, 0.0f),
              M40LLM_ERR_INVALID_ARGUMENT, "overlap");
  T_OK(m40llm_kvcache_attn_batch_ex(out, c, 0, &id, 1, q, M40LLM_DTYPE_F16, 0.0f));
  m40llm_kvcache_destroy(c);
  m40llm_free(ctx, buf), m40llm_free(ctx, kv);
}

void t_cases_dtype(m40llm_context *ctx, m40llm_context *cpu, int small) {
  const int F = M40LLM_KV_F16, Q8 = M40LLM_KV_Q8, Q4 = M40LLM_KV_Q4;
  const dtype_shape shapes[] = {
      {F, F, 8, 8, 64},  {F, F, 9, 3, 64},    {F, F, 16, 2, 256}, {F, F, 12, 3, 128},
      {F, F, 5, 5, 40},  {Q8, Q4, 8, 2, 128}, {Q4, Q4, 6, 2, 64}, {Q8, Q8, 4, 4, 96},
      {Q8, Q4, 8, 1, 64},
  };
  const int n = (int)(sizeof shapes / sizeof shapes[0]);
  for (int i = 0; i < n; i++) {
    run_case(ctx, cpu, shapes[i], M40LLM_DTYPE_F16);
    if (!small || i % 2 == 0) run_case(ctx, cpu, shapes[i], M40LLM_DTYPE_BF16);
  }
  errors(ctx);
}
