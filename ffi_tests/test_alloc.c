/* Host allocation failures (issue 21): every host allocation the library makes is made to fail
 * in turn, through the test hook of c/src/internal.h, over a run of calls that reaches each of
 * them (context, cache handle, lengths, CPU-backend buffers, a batch's id copy). Each failing
 * call must return M40LLM_ERR_OUT_OF_MEMORY having written nothing, the handles must stay
 * usable (the same call then succeeds), and nothing may leak (the asan build's leak check). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "test_util.h"

static long allocs, fail_at;
static int injected, hit; /* in the current call; anywhere in the run */

static int fail_one(size_t bytes) {
  (void)bytes;
  if (allocs++ != fail_at) return 0;
  injected = hit = 1;
  return 1;
}

/* Runs a call; where the injected failure hit it, checks the status and retries it with the
 * hook off, so the run goes on. Returns the final status. */
#define STEP(expr)                                                                          \
  (step_check((injected = 0, m40llm_host_alloc_hook = fail_one, (expr)), #expr) == M40LLM_OK \
       ? M40LLM_OK                                                                           \
       : (m40llm_host_alloc_hook = NULL, T_OK(expr) ? M40LLM_OK : M40LLM_ERR_CUDA))

static int step_check(int rc, const char *what) {
  m40llm_host_alloc_hook = NULL;
  if (rc == M40LLM_OK) return rc;
  T_CHECKF(injected && rc == M40LLM_ERR_OUT_OF_MEMORY,
           "%s failed with %s (%s) %s an injected allocation failure", what,
           m40llm_status_string(rc), m40llm_last_error_message(), injected ? "after" : "without");
  return rc;
}

/* One run of calls with allocation number fail_at failing; returns whether it was reached. */
static int run(void) {
  allocs = 0;
  hit = 0;
  m40llm_context *ctx = NULL;
  m40llm_kvcache *c = NULL;
  float *k = NULL, *v = NULL, *q = NULL, *out = NULL;
  enum { N = 100, H = 4, KVH = 2, D = 16, LEN = 5 };
  int32_t ids[N];
  for (int i = 0; i < N; i++) ids[i] = i % 3;
  m40llm_context_options co = M40LLM_CONTEXT_OPTIONS_INIT;
  co.backend = M40LLM_BACKEND_CPU;
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = 2, o.n_heads = H, o.n_kv_heads = KVH, o.head_dim = D, o.max_seqs = 3;
  o.max_seq_len = 8;
  const size_t kv_bytes = (size_t)LEN * KVH * D * sizeof(float);
  const size_t q_bytes = (size_t)N * H * D * sizeof(float);

  if (STEP(m40llm_context_create(&ctx, &co)) != M40LLM_OK) goto done;
  if (STEP(m40llm_kvcache_create(&c, ctx, &o)) != M40LLM_OK) goto done;
  if (STEP(m40llm_malloc((void **)&k, ctx, kv_bytes)) || STEP(m40llm_malloc((void **)&v, ctx, kv_bytes)) ||
      STEP(m40llm_malloc((void **)&q, ctx, q_bytes)) || STEP(m40llm_malloc((void **)&out, ctx, q_bytes)))
    goto done;
  for (size_t i = 0; i < kv_bytes / sizeof(float); i++) k[i] = v[i] = (float)i / 100.0f;
  for (size_t i = 0; i < q_bytes / sizeof(float); i++) q[i] = (float)(i % 7) / 7.0f;
  for (int s = 0; s < 3; s++)
    if (STEP(m40llm_kvcache_append_f32(c, 1, s, k, v, LEN - s))) goto done;
  T_OK(m40llm_kvcache_seq_fork(c, 2, 0));
  memset(out, 0xFF, q_bytes);
  const int rc = step_check(
      (injected = 0, m40llm_host_alloc_hook = fail_one,
       m40llm_kvcache_attn_batch_f32q(out, c, 1, ids, N, q, 0.0f)),
      "attention");
  if (rc != M40LLM_OK) {
    T_CHECKF(t_all_bytes(out, q_bytes, 0xFF), "a failed attention wrote its output");
    T_OK(m40llm_kvcache_attn_batch_f32q(out, c, 1, ids, N, q, 0.0f));
  }
  T_CHECK(out[0] == out[0] && !t_all_bytes(out, q_bytes, 0xFF));
  int len = -1;
  if (T_OK(m40llm_kvcache_seq_len(&len, c, 1, 2))) T_INT_EQ(len, LEN);
done:
  m40llm_host_alloc_hook = NULL;
  if (ctx) {
    m40llm_free(ctx, k);
    m40llm_free(ctx, v);
    m40llm_free(ctx, q);
    m40llm_free(ctx, out);
  }
  m40llm_kvcache_destroy(c);
  m40llm_context_destroy(ctx);
  return hit;
}

int main(void) {
  long n = 0;
  for (fail_at = 0; fail_at < 1000; fail_at++, n++) {
    t_set_case("host allocation %ld fails", fail_at);
    if (!run()) break;
  }
  t_set_case("");
  printf("%ld host allocations made to fail in turn\n", n);
  T_CHECKF(n >= 8, "only %ld host allocations were reached: the hook is not in use", n);
  return t_finish();
}
