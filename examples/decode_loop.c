/*
 * decode_loop: plays the attention part of a small decoder on m40llm.
 *
 *   decode_loop [steps] [auto|cuda|cpu]
 *
 * A 4-layer model with 8 query heads sharing 2 KV heads (GQA), head_dim 64, serving 4 sequences
 * whose prompts have different lengths. The prompts go in with one batched append per layer
 * (ragged counts) and one causal attention call over all of them (each prompt row attends to
 * the prompt up to itself); then each decode step goes through the layers: one batched append stores
 * every sequence's new token's K and V (FP32, rounded to FP16 by the library), then one batched
 * attention call computes all sequences' outputs for that layer.
 * Uses the GPU when one is present (backend auto), else the CPU backend.
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "m40llm.h"

enum {
  N_LAYERS = 4,
  N_SEQS = 4,
  N_HEADS = 8,
  N_KV_HEADS = 2,
  HEAD_DIM = 64,
  POOL = 64 /* random token rows the steps cycle through, so the loop times only m40llm */
};

#define CHECK(call)                                                                       \
  do {                                                                                    \
    int st_ = (call);                                                                     \
    if (st_ != M40LLM_OK) {                                                               \
      fprintf(stderr, "%s:%d: %s failed: %s: %s\n", __FILE__, __LINE__, #call,            \
              m40llm_status_string(st_), m40llm_last_error_message());                    \
      goto cleanup;                                                                       \
    }                                                                                     \
  } while (0)

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static float rand_uniform(void) { /* xorshift64*, uniform in [-1, 1) */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (float)((rng_state * 0x2545F4914F6CDD1Dull) >> 40) / 8388608.0f - 1.0f;
}

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Uploads n random floats into a new backend buffer. */
static int upload_random(m40llm_context *ctx, float **out, size_t n) {
  float *host = malloc(n * sizeof(float));
  if (!host) return M40LLM_ERR_OUT_OF_MEMORY;
  for (size_t i = 0; i < n; i++) host[i] = rand_uniform();
  void *dev = NULL;
  int st = m40llm_malloc(&dev, ctx, n * sizeof(float));
  if (st == M40LLM_OK) st = m40llm_memcpy_to_device(ctx, dev, host, n * sizeof(float));
  free(host);
  if (st != M40LLM_OK) {
    m40llm_free(ctx, dev);
    return st;
  }
  *out = dev;
  return M40LLM_OK;
}

int main(int argc, char **argv) {
  int steps = 256;
  int backend = M40LLM_BACKEND_AUTO;
  if (argc > 1) {
    char *end = NULL;
    long v = strtol(argv[1], &end, 10);
    if (!end || *end != '\0' || v < 1 || v > 100000) {
      fprintf(stderr, "usage: %s [steps (1..100000)] [auto|cuda|cpu]\n", argv[0]);
      return 2;
    }
    steps = (int)v;
  }
  if (argc > 2) {
    if (strcmp(argv[2], "cuda") == 0) backend = M40LLM_BACKEND_CUDA;
    else if (strcmp(argv[2], "cpu") == 0) backend = M40LLM_BACKEND_CPU;
    else if (strcmp(argv[2], "auto") != 0) {
      fprintf(stderr, "usage: %s [steps] [auto|cuda|cpu]\n", argv[0]);
      return 2;
    }
  }

  const int32_t prompt[N_SEQS] = {37, 5, 120, 1};
  int max_prompt = 0, prompt_rows = 0;
  for (int s = 0; s < N_SEQS; s++) {
    max_prompt = prompt[s] > max_prompt ? prompt[s] : max_prompt;
    prompt_rows += prompt[s];
  }

  int rc = 1;
  m40llm_context *ctx = NULL;
  m40llm_kvcache *cache = NULL;
  float *k_pool = NULL, *v_pool = NULL, *q_pool = NULL, *out = NULL;
  float *prompt_q = NULL, *prompt_out = NULL, *host_prompt = NULL;
  float *host_out = NULL;
  const size_t kv_row = (size_t)N_KV_HEADS * HEAD_DIM; /* floats per token's K (or V) */
  const size_t q_row = (size_t)N_HEADS * HEAD_DIM;     /* floats per sequence's q (or out) */

  int n_devices = 0;
  CHECK(m40llm_cuda_device_count(&n_devices));
  m40llm_context_options copts = M40LLM_CONTEXT_OPTIONS_INIT;
  copts.backend = backend;
  CHECK(m40llm_context_create(&ctx, &copts));

  m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
  CHECK(m40llm_context_device_info(&info, ctx));
  printf("m40llm %s, built %s CUDA, %d CUDA device(s)\n", m40llm_version_string(),
         m40llm_built_with_cuda() ? "with" : "without", n_devices);
  if (info.backend == M40LLM_BACKEND_CUDA)
    printf("backend: CUDA device %d: %s, compute %d.%d, %d SMs, %.1f GiB\n", info.device,
           info.name, info.compute_major, info.compute_minor, info.multiprocessors,
           (double)info.total_memory / 1073741824.0);
  else
    printf("backend: CPU\n");

  m40llm_kvcache_options kopts = M40LLM_KVCACHE_OPTIONS_INIT;
  kopts.n_layers = N_LAYERS;
  kopts.n_heads = N_HEADS;
  kopts.n_kv_heads = N_KV_HEADS;
  kopts.head_dim = HEAD_DIM;
  kopts.max_seqs = N_SEQS;
  kopts.max_seq_len = max_prompt + steps;
  size_t cache_bytes = 0;
  CHECK(m40llm_kvcache_bytes_needed(&cache_bytes, &kopts));
  CHECK(m40llm_kvcache_create(&cache, ctx, &kopts));

  CHECK(upload_random(ctx, &k_pool, (size_t)(max_prompt + POOL) * kv_row));
  CHECK(upload_random(ctx, &v_pool, (size_t)(max_prompt + POOL) * kv_row));
  CHECK(upload_random(ctx, &q_pool, (size_t)(POOL + N_SEQS) * q_row));
  CHECK(m40llm_malloc((void **)&out, ctx, (size_t)N_SEQS * q_row * sizeof(float)));
  CHECK(upload_random(ctx, &prompt_q, (size_t)prompt_rows * q_row));
  CHECK(m40llm_malloc((void **)&prompt_out, ctx, (size_t)prompt_rows * q_row * sizeof(float)));
  host_out = malloc((size_t)N_SEQS * q_row * sizeof(float));
  host_prompt = malloc((size_t)prompt_rows * q_row * sizeof(float));
  if (!host_out || !host_prompt) goto cleanup;

  int32_t seq_ids[N_SEQS];
  for (int s = 0; s < N_SEQS; s++) seq_ids[s] = s;

  /* Prefill: every sequence's prompt in one call per layer, the prompts' rows packed in order
   * (the pool's first rows; their sum fits its max_prompt + POOL rows), then the prompts'
   * attention in one causal call: prompt_q's rows packed the same way, each attending to its
   * prompt up to its own position. */
  for (int l = 0; l < N_LAYERS; l++) {
    CHECK(m40llm_kvcache_append_batch_f32(cache, l, seq_ids, prompt, N_SEQS, k_pool, v_pool));
    CHECK(m40llm_kvcache_attn_causal_f32q(prompt_out, cache, l, seq_ids, prompt, N_SEQS,
                                          prompt_q, NULL));
  }

  CHECK(m40llm_context_synchronize(ctx));
  const double t0 = now_seconds();
  for (int t = 0; t < steps; t++) {
    for (int l = 0; l < N_LAYERS; l++) {
      /* one token for each sequence (counts NULL), rows row .. row + N_SEQS - 1 */
      const size_t row = (size_t)((t * N_SEQS + l) % POOL);
      CHECK(m40llm_kvcache_append_batch_f32(cache, l, seq_ids, NULL, N_SEQS,
                                            k_pool + row * kv_row, v_pool + row * kv_row));
      const size_t qr = (size_t)((t + l) % POOL);
      CHECK(m40llm_kvcache_attn_batch_f32q(out, cache, l, seq_ids, N_SEQS, q_pool + qr * q_row,
                                           0.0f));
    }
  }
  CHECK(m40llm_context_synchronize(ctx));
  const double seconds = now_seconds() - t0;

  /* Sanity: every length advanced by steps, and the last outputs are finite. */
  for (int l = 0; l < N_LAYERS; l++) {
    for (int s = 0; s < N_SEQS; s++) {
      int len = -1;
      CHECK(m40llm_kvcache_seq_len(&len, cache, l, s));
      if (len != (int)prompt[s] + steps) {
        fprintf(stderr, "layer %d seq %d: length %d, expected %d\n", l, s, len,
                (int)prompt[s] + steps);
        goto cleanup;
      }
    }
  }
  /* The last layer's prompt outputs are finite too. */
  CHECK(m40llm_memcpy_to_host(ctx, host_prompt, prompt_out,
                              (size_t)prompt_rows * q_row * sizeof(float)));
  for (size_t i = 0; i < (size_t)prompt_rows * q_row; i++) {
    if (!isfinite(host_prompt[i])) {
      fprintf(stderr, "prompt output %zu is not finite\n", i);
      goto cleanup;
    }
  }
  CHECK(m40llm_memcpy_to_host(ctx, host_out, out, (size_t)N_SEQS * q_row * sizeof(float)));
  double checksum = 0.0;
  for (size_t i = 0; i < (size_t)N_SEQS * q_row; i++) {
    if (!isfinite(host_out[i])) {
      fprintf(stderr, "output %zu is not finite\n", i);
      goto cleanup;
    }
    checksum += fabs((double)host_out[i]);
  }

  printf("ran: %d layers, %d sequences (prompts %d, %d, %d, %d), %d query heads / %d KV heads, "
         "head_dim %d, KV cache %.1f MiB\n",
         N_LAYERS, N_SEQS, (int)prompt[0], (int)prompt[1], (int)prompt[2], (int)prompt[3],
         N_HEADS, N_KV_HEADS, HEAD_DIM, (double)cache_bytes / 1048576.0);
  printf("prefill: %d prompt rows, one batched append and one causal attention call a layer\n",
         prompt_rows);
  printf("%d decode steps x %d layers: %d batched appends + %d batched attention calls\n",
         steps, N_LAYERS, steps * N_LAYERS, steps * N_LAYERS);
  printf("%d tokens in %.4f s: %.1f tokens/s (%.3f ms per step, all sequences), checksum %.6g\n",
         steps * N_SEQS, seconds, (double)(steps * N_SEQS) / seconds, 1e3 * seconds / steps,
         checksum);
  rc = 0;

cleanup:
  free(host_out);
  free(host_prompt);
  if (ctx) {
    m40llm_free(ctx, k_pool);
    m40llm_free(ctx, v_pool);
    m40llm_free(ctx, q_pool);
    m40llm_free(ctx, out);
    m40llm_free(ctx, prompt_q);
    m40llm_free(ctx, prompt_out);
  }
  m40llm_kvcache_destroy(cache);
  m40llm_context_destroy(ctx);
  return rc;
}
