/* The check every consumer project runs: a CPU-backend context and cache (CI has no GPU), two
 * appended tokens, one attention call, the result compared with the value computed by hand.
 * Returns 0 when it holds; otherwise prints why and returns 1. */
#include "check.h"

#include <math.h>
#include <stdio.h>

#include <m40llm.h>

#define HEAD_DIM 8

static int fail(const char *what, int rc) {
  fprintf(stderr, "consumer: %s failed: %s (%s)\n", what, m40llm_status_string(rc),
          m40llm_last_error_message());
  return 1;
}

int consumer_check(int expect_cuda) {
  if (m40llm_version_number() != M40LLM_VERSION_NUMBER) {
    fprintf(stderr, "consumer: header version %d, library %u\n", M40LLM_VERSION_NUMBER,
            m40llm_version_number());
    return 1;
  }
  if (expect_cuda >= 0 && m40llm_built_with_cuda() != expect_cuda) {
    fprintf(stderr, "consumer: built_with_cuda() = %d, expected %d\n", m40llm_built_with_cuda(),
            expect_cuda);
    return 1;
  }

  m40llm_context *ctx = NULL;
  m40llm_context_options co = M40LLM_CONTEXT_OPTIONS_INIT;
  co.backend = M40LLM_BACKEND_CPU;
  int rc = m40llm_context_create(&ctx, &co);
  if (rc != M40LLM_OK) return fail("m40llm_context_create", rc);

  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = 1;
  o.n_heads = 2;
  o.n_kv_heads = 1;
  o.head_dim = HEAD_DIM;
  o.max_seqs = 1;
  o.max_seq_len = 4;
  m40llm_kvcache *kv = NULL;
  rc = m40llm_kvcache_create(&kv, ctx, &o);
  if (rc != M40LLM_OK) {
    m40llm_context_destroy(ctx);
    return fail("m40llm_kvcache_create", rc);
  }

  /* Token 0: k = 0, v = 1; token 1: k = 0.25, v = 3 (all exact in FP16). With q = 1 and scale 1
   * the scores are 0 and 2, so every output element is 1 + 2 * e^2 / (1 + e^2). */
  float k[2 * HEAD_DIM], v[2 * HEAD_DIM], q[2 * HEAD_DIM], out[2 * HEAD_DIM];
  for (int i = 0; i < HEAD_DIM; i++) {
    k[i] = 0.0f;
    v[i] = 1.0f;
    k[HEAD_DIM + i] = 0.25f;
    v[HEAD_DIM + i] = 3.0f;
  }
  for (int i = 0; i < 2 * HEAD_DIM; i++) {
    q[i] = 1.0f;
    out[i] = -1.0f;
  }
  int bad = 0;
  rc = m40llm_kvcache_append_f32(kv, 0, 0, k, v, 2);
  if (rc != M40LLM_OK) bad = fail("m40llm_kvcache_append_f32", rc);
  if (!bad) {
    rc = m40llm_kvcache_attn_last_token_f32q(out, kv, 0, 0, q, 1.0f);
    if (rc != M40LLM_OK) bad = fail("m40llm_kvcache_attn_last_token_f32q", rc);
  }
  const double e2 = exp(2.0);
  const double want = 1.0 + 2.0 * e2 / (1.0 + e2);
  for (int i = 0; !bad && i < 2 * HEAD_DIM; i++) {
    if (fabs(out[i] - want) > 1e-5) {
      fprintf(stderr, "consumer: out[%d] = %.7f, expected %.7f\n", i, out[i], want);
      bad = 1;
    }
  }
  m40llm_kvcache_destroy(kv);
  m40llm_context_destroy(ctx);
  if (!bad) {
    printf("consumer: m40llm %s (built_with_cuda=%d): attention %.6f as expected\n",
           m40llm_version_string(), m40llm_built_with_cuda(), out[0]);
  }
  return bad;
}
