/* What the CUDA backend's pointer-kind check costs a decode call (issue 21: on by default only if
 * it costs under 0.2 us a call at batch 1). Prints, in microseconds of host time per call:
 *   raw        one cudaPointerGetAttributes on a device pointer (a check that misses the memo)
 *   hit        m40llm_kvcache_attn_batch_f32q at batch 1, the same q/out every call (the memo
 *              answers both checks: the decode loop's case)
 *   miss       the same call rotating over 16 q/out pairs (both checks ask the driver)
 *   miss - hit what two checks cost a call when the memo does not help
 * Calls are timed as they are enqueued, 256 per sample between synchronizations, so the launch
 * queue never fills and GPU time does not count. Usage: bench_ptrcheck [device] */
#define _POSIX_C_SOURCE 199309L
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "bench_util.h"
#include "m40llm.h"

#define CHECK(x) BENCH_CHECK(x, 1)

enum { PAIRS = 16, CALLS = 256, SAMPLES = 200 };

/* Median host time per call of SAMPLES samples of CALLS calls, rotating over `pairs` buffers. */
static double time_calls(m40llm_context *ctx, m40llm_kvcache *c, float **q, float **out,
                         int pairs) {
  static double t[SAMPLES];
  const int32_t id = 0;
  for (int s = 0; s < SAMPLES; s++) {
    const double t0 = now_us();
    for (int i = 0; i < CALLS; i++)
      if (m40llm_kvcache_attn_batch_f32q(out[i % pairs], c, 0, &id, 1, q[i % pairs], 0.0f))
        return -1.0;
    t[s] = (now_us() - t0) / CALLS;
    if (m40llm_context_synchronize(ctx)) return -1.0;
  }
  for (int i = 1; i < SAMPLES; i++)
    for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
      const double x = t[j];
      t[j] = t[j - 1];
      t[j - 1] = x;
    }
  return t[SAMPLES / 2];
}

/* Hit and miss times per call on a context with the check on or off (check_pointers). */
static int measure(int device, int check, double *hit, double *miss, double *raw) {
  m40llm_context_options o = M40LLM_CONTEXT_OPTIONS_INIT;
  o.backend = M40LLM_BACKEND_CUDA;
  o.device = device;
  o.check_pointers = check;
  m40llm_context *ctx = NULL;
  m40llm_kvcache *c = NULL;
  CHECK(m40llm_context_create(&ctx, &o));
  m40llm_kvcache_options ko = M40LLM_KVCACHE_OPTIONS_INIT;
  ko.n_layers = 1, ko.n_heads = 32, ko.n_kv_heads = 8, ko.head_dim = 128;
  ko.max_seqs = 1, ko.max_seq_len = 16;
  CHECK(m40llm_kvcache_create(&c, ctx, &ko));
  const size_t row = (size_t)ko.n_heads * ko.head_dim * sizeof(float);
  float *q[PAIRS], *out[PAIRS], *kv = NULL;
  for (int i = 0; i < PAIRS; i++) {
    CHECK(m40llm_malloc((void **)&q[i], ctx, row));
    CHECK(m40llm_malloc((void **)&out[i], ctx, row));
    CHECK(m40llm_memset(ctx, q[i], 0, row));
  }
  CHECK(m40llm_malloc((void **)&kv, ctx, (size_t)ko.n_kv_heads * ko.head_dim * sizeof(float)));
  CHECK(m40llm_memset(ctx, kv, 0, (size_t)ko.n_kv_heads * ko.head_dim * sizeof(float)));
  CHECK(m40llm_kvcache_append_f32(c, 0, 0, kv, kv, 1));

  struct cudaPointerAttributes attr;
  double best = 1e30;
  for (int s = 0; s < 20; s++) {
    const double t0 = now_us();
    for (int i = 0; i < 10000; i++) (void)cudaPointerGetAttributes(&attr, q[i % PAIRS]);
    const double t = (now_us() - t0) / 10000;
    if (t < best) best = t;
  }
  *raw = best;
  (void)time_calls(ctx, c, q, out, PAIRS); /* warm-up */
  *hit = time_calls(ctx, c, q, out, 1);
  *miss = time_calls(ctx, c, q, out, PAIRS);
  for (int i = 0; i < PAIRS; i++) {
    m40llm_free(ctx, q[i]);
    m40llm_free(ctx, out[i]);
  }
  m40llm_free(ctx, kv);
  m40llm_kvcache_destroy(c);
  m40llm_context_destroy(ctx);
  if (*hit < 0 || *miss < 0) {
    fprintf(stderr, "attention failed: %s\n", m40llm_last_error_message());
    return 1;
  }
  return 0;
}

int main(int argc, char **argv) {
  const int device = argc > 1 ? atoi(argv[1]) : 0;
  double hit, miss, raw, off_hit, off_miss;
  if (measure(device, 1, &hit, &miss, &raw) || measure(device, 0, &off_hit, &off_miss, &raw))
    return 1;
  printf("raw cudaPointerGetAttributes: %.3f us\n", raw);
  printf("attention batch 1, same q/out (memo hit): %.3f us/call\n", hit);
  printf("attention batch 1, 16 q/out pairs (memo miss, 2 checks): %.3f us/call\n", miss);
  printf("miss - hit: %.3f us/call\n", miss - hit);
  printf("check_pointers = 0: same q/out %.3f us/call, 16 pairs %.3f us/call\n", off_hit, off_miss);
  printf("check cost against check_pointers = 0: hit %+.3f us/call, miss %+.3f us/call\n",
         hit - off_hit, miss - off_miss);
  return 0;
}
