/*
 * decode_loop: plays the attention part of a decoder on m40llm and times its decode step.
 *
 *   decode_loop [steps] [auto|cuda|cpu] [--layers N] [--seqs N] [--heads N] [--kv-heads N]
 *               [--head-dim N] [--context N] [--eager | --graph] [--no-prefill-attention]
 *               [--tiers [--importance] [--bits B]]
 *
 * By default a 4-layer model with 8 query heads sharing 2 KV heads (GQA), head_dim 64, serving
 * 4 sequences whose prompts have different lengths (37, 5, 120, 1, repeated for more
 * sequences); --context N gives every sequence a prompt of N tokens instead. The prompts go in
 * chunk by chunk (at most 256 tokens of each sequence a chunk): one batched append a layer
 * (ragged counts) and one causal attention call over the chunk's rows (each row attends to its
 * prompt up to itself; --no-prefill-attention leaves it out, for long prompts whose decode is
 * all that is timed). Then a decode step goes through the layers, each one call of
 * m40llm_kvcache_append_attn_f32q: every sequence's new token's K and V stored, then every
 * sequence's attention over its positions.
 *
 * The decode steps run twice (on the GPU; --eager or --graph runs one way only):
 *   eager  each step's calls as they are, 1 + (attention's) launches a layer from the host;
 *   graph  each step's calls captured into a CUDA graph on the context's stream
 *          (m40llm_graph_capture_begin / _end: the graph updated in place, or instantiated anew
 *          where the kernels launched change), and launched: one launch a step. A captured call
 *          bakes in the lengths it saw (m40llm.h, "Graphs"), so every step is captured anew;
 *          the host captures and updates the next step while the GPU runs the one before.
 * Each prints its time a step against the K/V bytes the step reads over the GPU's copy
 * bandwidth (cudaMemcpy device to device of a large buffer, bytes read + written, measured
 * here): 1.0x would be a step at the speed of its bytes. Needs a CUDA build for the graph and
 * the bandwidth; the CPU backend runs eager.
 *
 * The cache is F16. --tiers makes it a mixed-precision one (m40llm.h, tiers: the rows that leave
 * a 128-row FP16 window, after 4 FP16 sinks, in four tiers of (K, V) formats Q8/Q8, Q8/Q4,
 * Q4/Q3 and Q4/Q2 holding 10%, 20%, 30% and 40% of them), the oldest rows in the most bits;
 * with --importance the rows go by the attention they draw instead (M40LLM_PLACE_IMPORTANCE,
 * the cache's own observe call every 4th step: the default observe_interval), eager only (its
 * appends may wait for the GPU, which a capture cannot hold). --bits B gives the same four
 * tiers the rows m40llm_kvcache_plan_tiers plans for B stored bits a value (the FP16 sinks and
 * window counted) instead of those shares: the two tiers adjacent in cost around B. The step's
 * bytes are then the cache's bits per value (m40llm_kvcache_tier_stats) after the mode's steps.
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef DECODE_LOOP_CUDART
#include <cuda_runtime_api.h>
#endif

#include "m40llm.h"

enum { CHUNK = 256 }; /* prompt tokens of a sequence per prefill call */

typedef struct {
  int steps, backend, layers, seqs, heads, kv_heads, head_dim, context;
  int eager, graph; /* the ways to run the decode steps */
  int prefill_attention;
  int tiers, importance;
  double bits; /* --bits: the tiers' rows planned for it (0: the fixed shares) */
} options;

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

static int usage(const char *argv0) {
  fprintf(stderr,
          "usage: %s [steps (1..100000)] [auto|cuda|cpu] [--layers N] [--seqs N] [--heads N]\n"
          "       [--kv-heads N] [--head-dim N] [--context N] [--eager | --graph]\n"
          "       [--no-prefill-attention] [--tiers [--importance] [--bits B]]\n",
          argv0);
  return 2;
}

/* Parses argv into *o; returns 0, or 2 after printing the usage. */
static int parse_args(options *o, int argc, char **argv) {
  int positional = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    int *num = NULL;
    if (strcmp(a, "--layers") == 0) num = &o->layers;
    else if (strcmp(a, "--seqs") == 0) num = &o->seqs;
    else if (strcmp(a, "--heads") == 0) num = &o->heads;
    else if (strcmp(a, "--kv-heads") == 0) num = &o->kv_heads;
    else if (strcmp(a, "--head-dim") == 0) num = &o->head_dim;
    else if (strcmp(a, "--context") == 0) num = &o->context;
    else if (strcmp(a, "--eager") == 0) o->graph = 0;
    else if (strcmp(a, "--graph") == 0) o->eager = 0;
    else if (strcmp(a, "--no-prefill-attention") == 0) o->prefill_attention = 0;
    else if (strcmp(a, "--tiers") == 0) o->tiers = 1;
    else if (strcmp(a, "--importance") == 0) o->importance = 1;
    else if (strcmp(a, "--bits") == 0) {
      char *end = NULL;
      o->bits = i + 1 < argc ? strtod(argv[i + 1], &end) : 0.0;
      if (!end || *end != '\0' || !(o->bits > 0.0 && o->bits <= 64.0)) return usage(argv[0]);
      o->tiers = 1;
      i++;
    }
    else if (positional == 0 && a[0] != '-') {
      char *end = NULL;
      const long v = strtol(a, &end, 10);
      if (!end || *end != '\0' || v < 1 || v > 100000) return usage(argv[0]);
      o->steps = (int)v;
      positional++;
    } else if (positional == 1 && a[0] != '-') {
      if (strcmp(a, "cuda") == 0) o->backend = M40LLM_BACKEND_CUDA;
      else if (strcmp(a, "cpu") == 0) o->backend = M40LLM_BACKEND_CPU;
      else if (strcmp(a, "auto") != 0) return usage(argv[0]);
      positional++;
    } else {
      return usage(argv[0]);
    }
    if (num) {
      char *end = NULL;
      const long v = i + 1 < argc ? strtol(argv[i + 1], &end, 10) : 0;
      if (!end || *end != '\0' || v < 1 || v > 1000000) return usage(argv[0]);
      *num = (int)v;
      i++;
    }
  }
  if (!o->eager && !o->graph) return usage(argv[0]); /* --eager and --graph together */
  if (o->importance && !o->tiers) return usage(argv[0]);
  if (o->importance && !o->eager) {
    fprintf(stderr, "--importance runs eager: its appends may wait for the GPU\n");
    return 2;
  }
  if (o->importance) o->graph = 0;
  return 0;
}

#ifdef DECODE_LOOP_CUDART
/* Device-to-device copy bandwidth, GB/s (bytes read + bytes written), of the largest buffer
 * pair up to 2 x 512 MiB the GPU has room for; 0 where none could be measured. */
static double copy_bandwidth(m40llm_context *ctx) {
  cudaStream_t st = (cudaStream_t)m40llm_context_cuda_stream(ctx);
  double gbps = 0.0;
  for (size_t bytes = (size_t)512 << 20; bytes >= ((size_t)64 << 20) && gbps == 0.0; bytes /= 2) {
    void *src = NULL, *dst = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    float ms = 0.0f;
    enum { REPS = 10 };
    if (m40llm_malloc(&src, ctx, bytes) == M40LLM_OK &&
        m40llm_malloc(&dst, ctx, bytes) == M40LLM_OK &&
        m40llm_memset(ctx, src, 1, bytes) == M40LLM_OK &&
        cudaEventCreate(&e0) == cudaSuccess && cudaEventCreate(&e1) == cudaSuccess &&
        m40llm_memcpy_device(ctx, dst, src, bytes) == M40LLM_OK && /* warm */
        cudaEventRecord(e0, st) == cudaSuccess) {
      int ok = 1;
      for (int r = 0; r < REPS && ok; r++)
        ok = m40llm_memcpy_device(ctx, dst, src, bytes) == M40LLM_OK;
      if (ok && cudaEventRecord(e1, st) == cudaSuccess && cudaEventSynchronize(e1) == cudaSuccess &&
          cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess && ms > 0.0f)
        gbps = 2.0 * (double)bytes * REPS / ((double)ms * 1e-3) / 1e9;
    }
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    m40llm_free(ctx, src);
    m40llm_free(ctx, dst);
  }
  (void)cudaGetLastError();
  return gbps;
}

/* The graph mode's graph, and what the steps' captures cost the host. */
typedef struct {
  m40llm_graph *graph;
  int instantiated, updated;
  double capture_s, apply_s; /* host seconds in the steps' calls and in applying the capture */
} step_graph;
#endif

/* The decode step: one call a layer. The K/V, q and out buffers are the same every step, as a
 * model's projection outputs would be; a CUDA graph takes new ones too (they are parameters). */
typedef struct {
  m40llm_kvcache *cache;
  int layers, seqs;
  const int32_t *ids;
  const float *k, *v, *q;
  float *out;
} decode_step;

static int step_calls(const decode_step *d) {
  for (int l = 0; l < d->layers; l++) {
    const int rc = m40llm_kvcache_append_attn_f32q(d->out, d->cache, l, d->ids, d->seqs, d->k,
                                                   d->v, d->q, 0.0f);
    if (rc != M40LLM_OK) return rc;
  }
  return M40LLM_OK;
}

/* Positions the attention reads in `steps` steps from lengths len[] (each step's new token
 * included), summed over sequences and steps; len[] advances by the steps. */
static double positions_read(int *len, int seqs, int steps) {
  double sum = 0.0;
  for (int t = 0; t < steps; t++)
    for (int s = 0; s < seqs; s++) sum += (double)++len[s];
  return sum;
}

/* A tiered cache's bytes of one position of all layers now (its bits per value over the
 * positions it holds); a cache without tiers leaves *bytes as it is (F16). */
static int tiered_position_bytes(const m40llm_kvcache *cache, size_t kv_row, int layers,
                                 double *bytes) {
  m40llm_kvcache_options ko = M40LLM_KVCACHE_OPTIONS_INIT;
  int rc = m40llm_kvcache_get_options(&ko, cache);
  if (rc != M40LLM_OK || ko.n_tiers == 0) return rc;
  m40llm_tier_stats st = M40LLM_TIER_STATS_INIT;
  if ((rc = m40llm_kvcache_tier_stats(&st, cache)) == M40LLM_OK)
    *bytes = 2.0 * (double)kv_row * st.bits_per_value / 8.0 * layers;
  return rc;
}

static void report(const char *mode, double seconds, int steps, double bytes_per_step,
                   double copy_gbps, int seqs) {
  const double step_s = seconds / steps;
  printf("%-6s %9.3f ms a step  %9.0f tokens/s", mode, 1e3 * step_s, seqs / step_s);
  if (copy_gbps > 0.0)
    printf("  %6.2fx the step's K/V bytes over copy bandwidth (%.3f ms)",
           step_s / (bytes_per_step / (copy_gbps * 1e9)), 1e3 * bytes_per_step / (copy_gbps * 1e9));
  printf("\n");
}

int main(int argc, char **argv) {
  options o = {256, M40LLM_BACKEND_AUTO, 4, 4, 8, 2, 64, 0, 1, 1, 1, 0, 0, 0.0};
  if (parse_args(&o, argc, argv) != 0) return 2;
  const int32_t default_prompt[4] = {37, 5, 120, 1};

  int rc = 1;
  m40llm_context *ctx = NULL;
  m40llm_kvcache *cache = NULL;
  int32_t *ids = NULL, *prompt = NULL, *done_rows = NULL, *chunk_ids = NULL, *chunk_rows = NULL;
  int *len = NULL;
  float *k_pool = NULL, *v_pool = NULL, *prompt_q = NULL, *prompt_out = NULL;
  float *k_step = NULL, *v_step = NULL, *q_step = NULL, *out = NULL, *host_out = NULL;
#ifdef DECODE_LOOP_CUDART
  step_graph sg = {NULL, 0, 0, 0.0, 0.0};
  cudaEvent_t e0 = NULL, e1 = NULL;
#endif
  const size_t kv_row = (size_t)o.kv_heads * o.head_dim; /* floats per token's K (or V) */
  const size_t q_row = (size_t)o.heads * o.head_dim;     /* floats per sequence's q (or out) */

  ids = malloc((size_t)o.seqs * sizeof *ids);
  prompt = malloc((size_t)o.seqs * sizeof *prompt);
  done_rows = calloc((size_t)o.seqs, sizeof *done_rows);
  chunk_ids = malloc((size_t)o.seqs * sizeof *chunk_ids);
  chunk_rows = malloc((size_t)o.seqs * sizeof *chunk_rows);
  len = malloc((size_t)o.seqs * sizeof *len);
  host_out = malloc((size_t)o.seqs * q_row * sizeof(float));
  if (!ids || !prompt || !done_rows || !chunk_ids || !chunk_rows || !len || !host_out) {
    fprintf(stderr, "out of host memory\n");
    goto cleanup;
  }
  int max_prompt = 0;
  for (int s = 0; s < o.seqs; s++) {
    ids[s] = s;
    prompt[s] = o.context > 0 ? o.context : default_prompt[s % 4];
    max_prompt = prompt[s] > max_prompt ? prompt[s] : max_prompt;
  }

  int n_devices = 0;
  CHECK(m40llm_cuda_device_count(&n_devices));
  m40llm_context_options copts = M40LLM_CONTEXT_OPTIONS_INIT;
  copts.backend = o.backend;
  CHECK(m40llm_context_create(&ctx, &copts));
  m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
  CHECK(m40llm_context_device_info(&info, ctx));
  const int on_gpu = info.backend == M40LLM_BACKEND_CUDA;
  printf("m40llm %s, built %s CUDA, %d CUDA device(s)\n", m40llm_version_string(),
         m40llm_built_with_cuda() ? "with" : "without", n_devices);
  if (on_gpu)
    printf("backend: CUDA device %d: %s, compute %d.%d, %d SMs, %.1f GiB, runs %s\n", info.device,
           info.name, info.compute_major, info.compute_minor, info.multiprocessors,
           (double)info.total_memory / 1073741824.0,
           info.native_code ? "native code" : "PTX through the JIT");
  else
    printf("backend: CPU\n");

  double copy_gbps = 0.0;
#ifdef DECODE_LOOP_CUDART
  if (on_gpu) {
    copy_gbps = copy_bandwidth(ctx);
    printf("copy bandwidth: %.0f GB/s (cudaMemcpy device to device, bytes read + written)\n",
           copy_gbps);
  }
#endif
  if (o.graph && !on_gpu) {
    if (!o.eager) {
      fprintf(stderr, "--graph needs the CUDA backend on a GPU%s\n",
              m40llm_built_with_cuda() ? "" : " (this build has no CUDA)");
      goto cleanup;
    }
    o.graph = 0;
  }
#ifndef DECODE_LOOP_CUDART
  o.graph = 0; /* a CUDA build of the library, this example built without the CUDA runtime */
#endif

  /* Room for every step: the warm-up steps, then the steps of each mode. The warm-up takes a
   * step, or with --importance as many as the cache's first observe call needs (the default
   * observe_interval), so that it loads its kernels too. */
  const int warm_up = o.importance ? 4 : 1;
  const int decode_steps = warm_up + (o.eager ? o.steps : 0) + (o.graph ? o.steps : 0);
  m40llm_kvcache_options kopts = M40LLM_KVCACHE_OPTIONS_INIT;
  kopts.n_layers = o.layers;
  kopts.n_heads = o.heads;
  kopts.n_kv_heads = o.kv_heads;
  kopts.head_dim = o.head_dim;
  kopts.max_seqs = o.seqs;
  kopts.max_seq_len = max_prompt + decode_steps;
  if (o.tiers) {
    const int pairs[4][2] = {{M40LLM_KV_Q8, M40LLM_KV_Q8}, {M40LLM_KV_Q8, M40LLM_KV_Q4},
                             {M40LLM_KV_Q4, M40LLM_KV_Q3}, {M40LLM_KV_Q4, M40LLM_KV_Q2}};
    const int percent[4] = {10, 20, 30, 40};
    const int leaving = kopts.max_seq_len - kopts.n_sinks - kopts.window; /* may be <= 0 */
    kopts.n_tiers = 4;
    for (int t = 0, left = leaving > 0 ? leaving : 0; t < 4; t++) {
      const int rows = t == 3 ? left : (int)((long long)leaving * percent[t] / 100);
      kopts.tiers[t] = (m40llm_kv_tier){pairs[t][0], pairs[t][1], rows > 0 ? rows : 0};
      left -= kopts.tiers[t].rows;
    }
    kopts.format = pairs[0][0], kopts.v_format = pairs[0][1];
    kopts.placement = o.importance ? M40LLM_PLACE_IMPORTANCE : M40LLM_PLACE_FIRST_FREE;
    if (o.bits > 0.0) CHECK(m40llm_kvcache_plan_tiers(&kopts, o.bits));
  }
  size_t cache_bytes = 0;
  CHECK(m40llm_kvcache_bytes_needed(&cache_bytes, &kopts));
  CHECK(m40llm_kvcache_create(&cache, ctx, &kopts));
  printf("%d layers, %d sequences, %d query heads / %d KV heads, head_dim %d, KV cache %.1f MiB",
         o.layers, o.seqs, o.heads, o.kv_heads, o.head_dim, (double)cache_bytes / 1048576.0);
  if (!o.tiers)
    printf(" (F16)\n");
  else if (o.bits > 0.0)
    printf(" (tiers K8V8/K8V4/K4V3/K4V2 planned for %g bits: rows %d/%d/%d/%d, placed by %s)\n",
           o.bits, kopts.tiers[0].rows, kopts.tiers[1].rows, kopts.tiers[2].rows,
           kopts.tiers[3].rows, o.importance ? "importance" : "age");
  else
    printf(" (tiers K8V8/K8V4/K4V3/K4V2 10/20/30/40%%, placed by %s)\n",
           o.importance ? "importance" : "age");

  /* Prefill, chunk by chunk: each sequence's next (at most CHUNK) prompt tokens in one batched
   * append a layer, rows packed in sequence order (random rows from the pool, which holds a
   * chunk of every sequence), then their causal attention in one call. */
  const size_t chunk_cap = (size_t)o.seqs * (max_prompt < CHUNK ? max_prompt : CHUNK);
  CHECK(upload_random(ctx, &k_pool, chunk_cap * kv_row));
  CHECK(upload_random(ctx, &v_pool, chunk_cap * kv_row));
  if (o.prefill_attention) {
    CHECK(upload_random(ctx, &prompt_q, chunk_cap * q_row));
    CHECK(m40llm_malloc((void **)&prompt_out, ctx, chunk_cap * q_row * sizeof(float)));
  }
  const double t_prefill = now_seconds();
  int prompt_rows = 0;
  for (;;) {
    int n = 0;
    for (int s = 0; s < o.seqs; s++) {
      const int left = prompt[s] - done_rows[s];
      if (left == 0) continue;
      chunk_ids[n] = s;
      chunk_rows[n] = left < CHUNK ? left : CHUNK;
      done_rows[s] += chunk_rows[n];
      prompt_rows += chunk_rows[n++];
    }
    if (n == 0) break;
    for (int l = 0; l < o.layers; l++) {
      CHECK(m40llm_kvcache_append_batch_f32(cache, l, chunk_ids, chunk_rows, n, k_pool, v_pool));
      if (o.prefill_attention)
        CHECK(m40llm_kvcache_attn_causal_f32q(prompt_out, cache, l, chunk_ids, chunk_rows, n,
                                              prompt_q, NULL));
    }
  }
  CHECK(m40llm_context_synchronize(ctx));
  printf("prefill: %d prompt tokens in %.1f ms (batched appends%s, chunks of %d tokens a "
         "sequence)\n",
         prompt_rows, 1e3 * (now_seconds() - t_prefill),
         o.prefill_attention ? " and causal attention" : "", CHUNK);

  CHECK(upload_random(ctx, &k_step, (size_t)o.seqs * kv_row));
  CHECK(upload_random(ctx, &v_step, (size_t)o.seqs * kv_row));
  CHECK(upload_random(ctx, &q_step, (size_t)o.seqs * q_row));
  CHECK(m40llm_malloc((void **)&out, ctx, (size_t)o.seqs * q_row * sizeof(float)));
  const decode_step d = {cache, o.layers, o.seqs, ids, k_step, v_step, q_step, out};
  for (int s = 0; s < o.seqs; s++) len[s] = prompt[s];
  /* K and V of every position the attention reads: bytes of one position of all layers, F16 or
   * (tiers) at the cache's bits per value, read again after each mode */
  double position_bytes = 2.0 * (double)kv_row * sizeof(uint16_t) * o.layers;
  printf("decode: %d steps a mode, one m40llm_kvcache_append_attn_f32q a layer (contexts from "
         "%d to %d tokens)\n",
         o.steps, max_prompt, max_prompt + decode_steps);

  /* Warm-up steps, untimed: the first calls load the kernels (on a GPU that runs PTX, the
   * driver compiles them) and set up what a capture cannot hold (m40llm.h, "Graphs"). */
  for (int t = 0; t < warm_up; t++) CHECK(step_calls(&d));
  positions_read(len, o.seqs, warm_up);
  CHECK(m40llm_context_synchronize(ctx));

  if (o.eager) {
    const double positions = positions_read(len, o.seqs, o.steps) / o.steps;
    const double t0 = now_seconds();
    for (int t = 0; t < o.steps; t++) CHECK(step_calls(&d));
    CHECK(m40llm_context_synchronize(ctx));
    const double seconds = now_seconds() - t0;
    CHECK(tiered_position_bytes(cache, kv_row, o.layers, &position_bytes));
    report("eager", seconds, o.steps, position_bytes * positions, copy_gbps, o.seqs);
  }

#ifdef DECODE_LOOP_CUDART
  if (o.graph) {
    cudaStream_t st = (cudaStream_t)m40llm_context_cuda_stream(ctx);
    const double positions = positions_read(len, o.seqs, o.steps) / o.steps;
    const double t0 = now_seconds();
    for (int t = 0; t < o.steps; t++) {
      const double c0 = now_seconds();
      CHECK(m40llm_graph_capture_begin(ctx));
      const int call_rc = step_calls(&d);
      if (call_rc != M40LLM_OK) (void)m40llm_graph_capture_end(NULL, ctx, NULL); /* discard */
      CHECK(call_rc);
      const double c1 = now_seconds();
      int updated = 0;
      CHECK(m40llm_graph_capture_end(&sg.graph, ctx, &updated));
      if (updated) sg.updated++;
      else sg.instantiated++;
      sg.capture_s += c1 - c0;
      sg.apply_s += now_seconds() - c1;
      CHECK(m40llm_graph_launch(sg.graph));
    }
    CHECK(m40llm_context_synchronize(ctx));
    const double seconds = now_seconds() - t0;
    CHECK(tiered_position_bytes(cache, kv_row, o.layers, &position_bytes));
    report("graph", seconds, o.steps, position_bytes * positions, copy_gbps, o.seqs);
    printf("       host a step: %.1f us capturing the calls, %.1f us applying the graph (%d "
           "updated, %d instantiated)\n",
           1e6 * sg.capture_s / o.steps, 1e6 * sg.apply_s / o.steps, sg.updated, sg.instantiated);
    /* The last step's graph again: it writes the same rows at the same positions and reads the
     * same lengths, so it can be replayed to time the device alone. */
    enum { REPLAYS = 10 };
    float ms = 0.0f;
    if (cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess ||
        cudaEventRecord(e0, st) != cudaSuccess) {
      fprintf(stderr, "CUDA events failed\n");
      goto cleanup;
    }
    for (int r = 0; r < REPLAYS; r++)
      CHECK(m40llm_graph_launch(sg.graph));
    if (cudaEventRecord(e1, st) != cudaSuccess || cudaEventSynchronize(e1) != cudaSuccess ||
        cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess) {
      fprintf(stderr, "CUDA events failed\n");
      goto cleanup;
    }
    double last_positions = 0.0; /* the last step's: len[] includes its tokens */
    for (int s = 0; s < o.seqs; s++) last_positions += len[s];
    report("replay", 1e-3 * ms, REPLAYS, position_bytes * last_positions, copy_gbps, o.seqs);
    printf("       (the last step's graph launched %d times more: the device's time alone)\n",
           REPLAYS);
  }
#endif

  /* Sanity: every length advanced by the decode steps, and the last outputs are finite. */
  for (int l = 0; l < o.layers; l++) {
    for (int s = 0; s < o.seqs; s++) {
      int got = -1;
      CHECK(m40llm_kvcache_seq_len(&got, cache, l, s));
      if (got != (int)prompt[s] + decode_steps) {
        fprintf(stderr, "layer %d seq %d: length %d, expected %d\n", l, s, got,
                (int)prompt[s] + decode_steps);
        goto cleanup;
      }
    }
  }
  CHECK(m40llm_memcpy_to_host(ctx, host_out, out, (size_t)o.seqs * q_row * sizeof(float)));
  double checksum = 0.0;
  for (size_t i = 0; i < (size_t)o.seqs * q_row; i++) {
    if (!isfinite(host_out[i])) {
      fprintf(stderr, "output %zu is not finite\n", i);
      goto cleanup;
    }
    checksum += fabs((double)host_out[i]);
  }
  printf("lengths checked, outputs finite (checksum %.6g)\n", checksum);
  if (o.tiers) {
    m40llm_tier_stats st = M40LLM_TIER_STATS_INIT;
    CHECK(m40llm_kvcache_tier_stats(&st, cache));
    printf("tiers: %.3f bits a value; rows %lld / %lld / %lld / %lld, %lld FP16 (sinks and "
           "windows); %lld moved down by importance, %lld observe calls\n",
           st.bits_per_value, (long long)st.rows[0], (long long)st.rows[1], (long long)st.rows[2],
           (long long)st.rows[3], (long long)st.kept_rows, (long long)st.demoted_rows,
           (long long)st.observe_calls);
  }
  rc = 0;

cleanup:
#ifdef DECODE_LOOP_CUDART
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  m40llm_graph_destroy(sg.graph);
#endif
  free(ids), free(prompt), free(done_rows), free(chunk_ids), free(chunk_rows), free(len);
  free(host_out);
  if (ctx) {
    m40llm_free(ctx, k_pool), m40llm_free(ctx, v_pool);
    m40llm_free(ctx, prompt_q), m40llm_free(ctx, prompt_out);
    m40llm_free(ctx, k_step), m40llm_free(ctx, v_step), m40llm_free(ctx, q_step);
    m40llm_free(ctx, out);
  }
  m40llm_kvcache_destroy(cache);
  m40llm_context_destroy(ctx);
  return rc;
}
