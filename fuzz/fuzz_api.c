/* libFuzzer target over the CPU backend's API (issue 21): the input is a sequence of calls on
 * one context and one cache, each checked against a small model of the cache: the status each
 * call must return (the library's order of checks), the lengths, the contents read back bit for
 * bit, and attention against a float64 reference over the model. Any mismatch aborts (a
 * finding). Built with ASan + UBSan by scripts/fuzz.sh, which also runs it. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "m40llm.h"

enum { LAYERS = 2, HEADS = 4, KVH = 2, D = 8, SEQS = 3, LEN = 16, ROW = KVH * D };

typedef struct {
  const uint8_t *p;
  size_t n;
} input;

static int take(input *in) {
  if (in->n == 0) return 0;
  in->n--;
  return *in->p++;
}

static void fail(const char *what, int got, int want) {
  fprintf(stderr, "fuzz_api: %s: status %d (%s), expected %d; message \"%s\"\n", what, got,
          m40llm_status_string(got), want, m40llm_last_error_message());
  abort();
}

#define EXPECT(what, got, want)                    \
  do {                                             \
    const int g_ = (got), w_ = (want);             \
    if (g_ != w_) fail(what, g_, w_);              \
  } while (0)

static uint16_t model_k[LAYERS][SEQS][LEN][ROW], model_v[LAYERS][SEQS][LEN][ROW];
static int model_len[LAYERS][SEQS];

/* A half whose value is exact in FP32 and small: (b - 128) / 16. */
static float value_of(int b) { return (float)(b - 128) / 16.0f; }
static uint16_t half_of(float x) { /* x = k / 16, |k| <= 128: exact in binary16 */
  if (x == 0.0f) return 0;
  uint16_t sign = x < 0 ? 0x8000 : 0;
  float a = fabsf(x);
  int e = 0;
  float m = frexpf(a, &e); /* a = m 2^e, m in [0.5, 1) */
  const int exp = e - 1 + 15;
  const int mant = (int)((m * 2.0f - 1.0f) * 1024.0f);
  return (uint16_t)(sign | (exp << 10) | mant);
}
static double f16(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const double v = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -v : v;
}

static int layer_ok(int l) { return l >= 0 && l < LAYERS; }
static int seq_ok(int s) { return s >= 0 && s < SEQS; }

static void check_attention(const float *out, const float *q, int layer, int seq) {
  const int len = model_len[layer][seq];
  for (int h = 0; h < HEADS; h++) {
    const int g = h / (HEADS / KVH);
    double w[LEN], mx = -INFINITY, z = 0.0;
    for (int t = 0; t < len; t++) {
      double dot = 0.0;
      for (int d = 0; d < D; d++) dot += (double)q[h * D + d] * f16(model_k[layer][seq][t][g * D + d]);
      w[t] = dot / sqrt((double)D);
      if (w[t] > mx) mx = w[t];
    }
    for (int t = 0; t < len; t++) z += (w[t] = exp(w[t] - mx));
    for (int d = 0; d < D; d++) {
      double acc = 0.0;
      for (int t = 0; t < len; t++) acc += w[t] * f16(model_v[layer][seq][t][g * D + d]);
      const double ref = len ? acc / z : 0.0, got = out[h * D + d];
      if (!(fabs(got - ref) <= 1e-5 * (1.0 + fabs(ref)))) {
        fprintf(stderr, "fuzz_api: attention layer %d seq %d head %d dim %d: %g vs %g\n", layer,
                seq, h, d, got, ref);
        abort();
      }
    }
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  input in = {data, size};
  m40llm_context_options co = M40LLM_CONTEXT_OPTIONS_INIT;
  co.backend = M40LLM_BACKEND_CPU;
  m40llm_context *ctx = NULL;
  m40llm_kvcache *c = NULL;
  EXPECT("context_create", m40llm_context_create(&ctx, &co), M40LLM_OK);
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = LAYERS, o.n_heads = HEADS, o.n_kv_heads = KVH, o.head_dim = D;
  o.max_seqs = SEQS, o.max_seq_len = LEN;
  EXPECT("kvcache_create", m40llm_kvcache_create(&c, ctx, &o), M40LLM_OK);
  memset(model_len, 0, sizeof model_len);

  static float kf[LEN + 2][ROW], vf[LEN + 2][ROW], q[SEQS + 2][HEADS * D], out[SEQS + 2][HEADS * D];
  static uint16_t kh[LEN + 2][ROW], vh[LEN + 2][ROW], rk[LEN + 2][ROW], rv[LEN + 2][ROW];
  while (in.n > 0) {
    const int op = take(&in) % 9;
    const int layer = take(&in) % (LAYERS + 2) - 1, seq = take(&in) % (SEQS + 2) - 1;
    const int a = take(&in) % (LEN + 3) - 1; /* -1 .. LEN + 1 */
    switch (op) {
      case 0:
      case 1: { /* append a tokens, FP16 or FP32 */
        const int n = a;
        for (int t = 0; t < (n > 0 ? n : 0); t++)
          for (int i = 0; i < ROW; i++) {
            kf[t][i] = value_of(take(&in));
            vf[t][i] = value_of(take(&in));
            kh[t][i] = half_of(kf[t][i]);
            vh[t][i] = half_of(vf[t][i]);
          }
        int want = M40LLM_OK;
        if (!layer_ok(layer) || !seq_ok(seq)) want = M40LLM_ERR_OUT_OF_RANGE;
        else if (n < 1) want = M40LLM_ERR_INVALID_ARGUMENT;
        else if (model_len[layer][seq] + n > LEN) want = M40LLM_ERR_CAPACITY;
        const int rc = op == 0 ? m40llm_kvcache_append_f16(c, layer, seq, &kh[0][0], &vh[0][0], n)
                               : m40llm_kvcache_append_f32(c, layer, seq, &kf[0][0], &vf[0][0], n);
        EXPECT("append", rc, want);
        if (rc == M40LLM_OK) {
          memcpy(model_k[layer][seq][model_len[layer][seq]], kh, (size_t)n * sizeof kh[0]);
          memcpy(model_v[layer][seq][model_len[layer][seq]], vh, (size_t)n * sizeof vh[0]);
          model_len[layer][seq] += n;
        }
        break;
      }
      case 2: { /* truncate seq to a (a -1: invalid) */
        const int want = !seq_ok(seq) ? M40LLM_ERR_OUT_OF_RANGE
                         : a < 0      ? M40LLM_ERR_INVALID_ARGUMENT
                                      : M40LLM_OK;
        EXPECT("truncate", m40llm_kvcache_seq_truncate(c, seq, a), want);
        if (want == M40LLM_OK)
          for (int l = 0; l < LAYERS; l++)
            if (model_len[l][seq] > a) model_len[l][seq] = a;
        break;
      }
      case 3: { /* fork seq from layer-as-src */
        const int src = layer;
        int want = M40LLM_OK;
        if (!seq_ok(seq) || !seq_ok(src)) want = M40LLM_ERR_OUT_OF_RANGE;
        else if (seq == src) want = M40LLM_ERR_INVALID_ARGUMENT;
        EXPECT("fork", m40llm_kvcache_seq_fork(c, seq, src), want);
        if (want == M40LLM_OK)
          for (int l = 0; l < LAYERS; l++) {
            memcpy(model_k[l][seq], model_k[l][src], sizeof model_k[l][seq]);
            memcpy(model_v[l][seq], model_v[l][src], sizeof model_v[l][seq]);
            model_len[l][seq] = model_len[l][src];
          }
        break;
      }
      case 4: { /* read n from pos */
        const int pos = take(&in) % (LEN + 2) - 1, n = a;
        int want = M40LLM_OK;
        if (!layer_ok(layer) || !seq_ok(seq)) want = M40LLM_ERR_OUT_OF_RANGE;
        else if (n < 1) want = M40LLM_ERR_INVALID_ARGUMENT;
        else if (pos < 0 || pos + n > model_len[layer][seq]) want = M40LLM_ERR_OUT_OF_RANGE;
        memset(rk, 0xEE, sizeof rk);
        memset(rv, 0xEE, sizeof rv);
        EXPECT("read_f16", m40llm_kvcache_read_f16(&rk[0][0], &rv[0][0], c, layer, seq, pos, n), want);
        if (want == M40LLM_OK) {
          if (memcmp(rk, model_k[layer][seq][pos], (size_t)n * sizeof rk[0]) != 0 ||
              memcmp(rv, model_v[layer][seq][pos], (size_t)n * sizeof rv[0]) != 0) {
            fprintf(stderr, "fuzz_api: read_f16 contents differ from the model\n");
            abort();
          }
        }
        for (size_t i = want == M40LLM_OK ? (size_t)n * ROW : 0; i < (LEN + 2) * ROW; i++)
          if ((&rk[0][0])[i] != 0xEEEE || (&rv[0][0])[i] != 0xEEEE) {
            fprintf(stderr, "fuzz_api: read_f16 wrote past what it was asked\n");
            abort();
          }
        break;
      }
      case 5: { /* seq_len */
        int len = -7;
        const int want = layer_ok(layer) && seq_ok(seq) ? M40LLM_OK : M40LLM_ERR_OUT_OF_RANGE;
        EXPECT("seq_len", m40llm_kvcache_seq_len(&len, c, layer, seq), want);
        if (want == M40LLM_OK ? len != model_len[layer][seq] : len != -7) {
          fprintf(stderr, "fuzz_api: seq_len %d, model %d\n", len, model_len[layer][seq]);
          abort();
        }
        break;
      }
      case 8: { /* batched append: n ids (some out of range or repeated), counts -1..3 */
        const int n = a < 0 ? -1 : a > SEQS + 2 ? SEQS + 2 : a;
        int32_t ids[SEQS + 2], counts[SEQS + 2];
        int want = !layer_ok(layer) ? M40LLM_ERR_OUT_OF_RANGE
                   : n < 1 || n > SEQS ? M40LLM_ERR_INVALID_ARGUMENT
                                       : M40LLM_OK;
        int total = 0, named[SEQS] = {0};
        for (int i = 0; i < (n > 0 ? n : 0); i++) {
          ids[i] = take(&in) % (SEQS + 1);
          counts[i] = take(&in) % 5 - 1;
          if (want != M40LLM_OK) continue;
          if (!seq_ok(ids[i])) want = M40LLM_ERR_OUT_OF_RANGE;
          else if (named[ids[i]]++) want = M40LLM_ERR_INVALID_ARGUMENT;
          else if (counts[i] < 0) want = M40LLM_ERR_INVALID_ARGUMENT;
          else if (model_len[layer][ids[i]] + counts[i] > LEN) want = M40LLM_ERR_CAPACITY;
          else total += counts[i];
        }
        for (int t = 0; t < total; t++)
          for (int i = 0; i < ROW; i++) {
            kh[t][i] = half_of(value_of(take(&in)));
            vh[t][i] = half_of(value_of(take(&in)));
          }
        EXPECT("append_batch",
               m40llm_kvcache_append_batch_f16(c, layer, ids, counts, n, &kh[0][0], &vh[0][0]),
               want);
        for (int i = 0, t = 0; want == M40LLM_OK && i < n; t += counts[i++]) {
          int *len = &model_len[layer][ids[i]];
          memcpy(model_k[layer][ids[i]][*len], kh[t], (size_t)counts[i] * sizeof kh[0]);
          memcpy(model_v[layer][ids[i]][*len], vh[t], (size_t)counts[i] * sizeof vh[0]);
          *len += counts[i];
        }
        break;
      }
      default: { /* attention over n ids (from the input, some out of range), batch or single */
        const int n = a < 1 ? 1 : a > SEQS + 2 ? SEQS + 2 : a;
        int32_t ids[SEQS + 2];
        int want = layer_ok(layer) ? M40LLM_OK : M40LLM_ERR_OUT_OF_RANGE;
        for (int i = 0; i < n; i++) {
          ids[i] = take(&in) % (SEQS + 1);
          if (want == M40LLM_OK && !seq_ok(ids[i])) want = M40LLM_ERR_OUT_OF_RANGE;
          for (int j = 0; j < HEADS * D; j++) q[i][j] = value_of(take(&in));
        }
        memset(out, 0xEE, sizeof out);
        const int rc = op == 6 ? m40llm_kvcache_attn_batch_f32q(&out[0][0], c, layer, ids, n, &q[0][0], 0.0f)
                               : m40llm_kvcache_attn_last_token_f32q(&out[0][0], c, layer, ids[0], &q[0][0], 0.0f);
        if (op == 7) want = !seq_ok(ids[0]) ? M40LLM_ERR_OUT_OF_RANGE
                            : layer_ok(layer) ? M40LLM_OK : M40LLM_ERR_OUT_OF_RANGE;
        EXPECT("attention", rc, want);
        if (rc == M40LLM_OK)
          for (int i = 0; i < (op == 6 ? n : 1); i++) check_attention(out[i], q[i], layer, ids[i]);
        break;
      }
    }
  }
  /* the lengths, once more, all of them */
  for (int l = 0; l < LAYERS; l++)
    for (int s = 0; s < SEQS; s++) {
      int len = -1;
      EXPECT("final seq_len", m40llm_kvcache_seq_len(&len, c, l, s), M40LLM_OK);
      if (len != model_len[l][s]) abort();
    }
  m40llm_kvcache_destroy(c);
  m40llm_context_destroy(ctx);
  return 0;
}
