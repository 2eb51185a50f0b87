/* What appending a decode step's K/V costs (issue 22): one m40llm_kvcache_append_batch_f32 of
 * 1, 8 and 64 sequences x 1 token against one m40llm_kvcache_append_f32 and against 64 of them
 * (one per sequence, the API before batching), 32/8 heads, head_dim 128, an F16 and a Q8 cache
 * (Q8 with the default rotation and protected tokens). Prints microseconds a step, two ways:
 *   eager  host time of STEPS steps enqueued back to back, then a synchronize, per step: what a
 *          decode loop that calls the library pays (launches included)
 *   graph  the same STEPS steps captured in one CUDA graph, device time of a replay (CUDA
 *          events) per step: the kernels' own cost
 * and each against one sequence's append (target: 64 sequences at most 2x one). Then a decode
 * step's append and attention (over 128 prefilled positions) as two calls (append_batch +
 * attn_batch) against m40llm_kvcache_append_attn_f32q, at 1, 8 and 64 sequences (ratio: the
 * one call against the two). Writes the table as JSON.
 * Usage: bench_append [out.json [device]] (default bench_append.json, device 0). */
#define _POSIX_C_SOURCE 199309L
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "bench_util.h"
#include "m40llm.h"

enum { SEQS = 64, HEADS = 32, KV_HEADS = 8, DIM = 128, STEPS = 100, SAMPLES = 15, REPLAYS = 20 };

#define CHECK(x) BENCH_CHECK(x, -1.0)
#define CUDA_CHECK(x) BENCH_CUDA_CHECK(x, -1.0)

/* A step: n_seqs sequences, one token each, in one batched call or n_seqs single calls; and
 * for the decode-step rows (attend), the attention after it: as its own call (1) or in
 * m40llm_kvcache_append_attn_f32q (2), over PREFILL + the step's positions. */
typedef struct {
  const char *name;
  int n_seqs, batched, attend;
} step_kind;

enum { PREFILL = 128 };
static const step_kind kinds[] = {
    {"append x1", 1, 0, 0},        {"batch 1", 1, 1, 0},         {"batch 8", 8, 1, 0},
    {"batch 64", 64, 1, 0},        {"64 x append", 64, 0, 0},    {"batch+attn 1", 1, 1, 1},
    {"append_attn 1", 1, 1, 2},    {"batch+attn 8", 8, 1, 1},    {"append_attn 8", 8, 1, 2},
    {"batch+attn 64", 64, 1, 1},   {"append_attn 64", 64, 1, 2}};
enum { KINDS = sizeof kinds / sizeof kinds[0], APPEND_KINDS = 5 };

typedef struct {
  m40llm_context *ctx;
  m40llm_kvcache *cache;
  float *k, *v;    /* SEQS tokens of K/V rows, device memory */
  float *q, *out;  /* SEQS query rows each */
  float *prompt;   /* PREFILL tokens of K/V rows */
  int32_t ids[SEQS];
} bench;

static int step(bench *b, const step_kind *s) {
  if (s->attend == 2)
    return m40llm_kvcache_append_attn_f32q(b->out, b->cache, 0, b->ids, s->n_seqs, b->k, b->v,
                                           b->q, 0.0f);
  if (s->batched) {
    const int rc =
        m40llm_kvcache_append_batch_f32(b->cache, 0, b->ids, NULL, s->n_seqs, b->k, b->v);
    if (rc != M40LLM_OK || !s->attend) return rc;
    return m40llm_kvcache_attn_batch_f32q(b->out, b->cache, 0, b->ids, s->n_seqs, b->q, 0.0f);
  }
  const size_t row = (size_t)KV_HEADS * DIM;
  for (int i = 0; i < s->n_seqs; i++) {
    const int rc = m40llm_kvcache_append_f32(b->cache, 0, i, b->k + i * row, b->v + i * row, 1);
    if (rc != M40LLM_OK) return rc;
  }
  return M40LLM_OK;
}

/* Empties every sequence; for a decode-step kind, then gives each PREFILL positions. */
static double reset_all(bench *b, const step_kind *s) {
  for (int i = 0; i < SEQS; i++) {
    CHECK(m40llm_kvcache_seq_reset(b->cache, i));
    if (s->attend) CHECK(m40llm_kvcache_append_f32(b->cache, 0, i, b->prompt, b->prompt, PREFILL));
  }
  return 0.0;
}

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Median host microseconds a step over SAMPLES runs of STEPS steps. */
static double time_eager(bench *b, const step_kind *s) {
  double t[SAMPLES];
  for (int r = 0; r < SAMPLES; r++) {
    if (reset_all(b, s) < 0) return -1.0;
    CHECK(m40llm_context_synchronize(b->ctx));
    const double t0 = now_us();
    for (int i = 0; i < STEPS; i++) CHECK(step(b, s));
    CHECK(m40llm_context_synchronize(b->ctx));
    t[r] = (now_us() - t0) / STEPS;
  }
  qsort(t, SAMPLES, sizeof t[0], cmp_double);
  return t[SAMPLES / 2];
}

/* Median device microseconds a step over REPLAYS replays of a graph of STEPS steps. */
static double time_graph(bench *b, const step_kind *s) {
  cudaStream_t st = (cudaStream_t)m40llm_context_cuda_stream(b->ctx);
  cudaGraph_t g;
  cudaGraphExec_t ge;
  cudaEvent_t e0, e1;
  if (reset_all(b, s) < 0) return -1.0;
  CHECK(m40llm_context_synchronize(b->ctx));
  CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed));
  for (int i = 0; i < STEPS; i++)
    if (step(b, s) != M40LLM_OK) {
      fprintf(stderr, "append during capture: %s\n", m40llm_last_error_message());
      (void)cudaStreamEndCapture(st, &g);
      return -1.0;
    }
  CUDA_CHECK(cudaStreamEndCapture(st, &g));
  CUDA_CHECK(cudaGraphInstantiateWithFlags(&ge, g, 0));
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  CUDA_CHECK(cudaGraphLaunch(ge, st)); /* warm */
  double t[REPLAYS];
  for (int r = 0; r < REPLAYS; r++) {
    float ms = 0.0f;
    CUDA_CHECK(cudaEventRecord(e0, st));
    CUDA_CHECK(cudaGraphLaunch(ge, st));
    CUDA_CHECK(cudaEventRecord(e1, st));
    CUDA_CHECK(cudaEventSynchronize(e1));
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    t[r] = (double)ms * 1000.0 / STEPS;
  }
  qsort(t, REPLAYS, sizeof t[0], cmp_double);
  (void)cudaEventDestroy(e0);
  (void)cudaEventDestroy(e1);
  (void)cudaGraphExecDestroy(ge);
  (void)cudaGraphDestroy(g);
  return t[REPLAYS / 2];
}

/* Times every step kind on a cache of format fmt into eager[] and graph[]; 0 on success. */
static int run_format(int device, int fmt, double *eager, double *graph) {
  m40llm_context_options co = M40LLM_CONTEXT_OPTIONS_INIT;
  co.backend = M40LLM_BACKEND_CUDA;
  co.device = device;
  bench b = {0};
  if (m40llm_context_create(&b.ctx, &co) != M40LLM_OK) {
    fprintf(stderr, "context: %s\n", m40llm_last_error_message());
    return 1;
  }
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = 1, o.n_heads = HEADS, o.n_kv_heads = KV_HEADS, o.head_dim = DIM;
  o.max_seqs = SEQS, o.max_seq_len = PREFILL + STEPS, o.format = fmt;
  const size_t bytes = (size_t)SEQS * KV_HEADS * DIM * sizeof(float);
  const size_t q_bytes = (size_t)SEQS * HEADS * DIM * sizeof(float);
  const size_t p_bytes = (size_t)PREFILL * KV_HEADS * DIM * sizeof(float);
  int rc = m40llm_kvcache_create(&b.cache, b.ctx, &o);
  /* small values (0x3c3c3c3c is 0.0115 as FP32, 0x3b.. 0.0029): finite scores, any format */
  float **bufs[5] = {&b.k, &b.v, &b.q, &b.out, &b.prompt};
  const size_t sizes[5] = {bytes, bytes, q_bytes, q_bytes, p_bytes};
  for (int i = 0; i < 5 && rc == M40LLM_OK; i++) {
    rc = m40llm_malloc((void **)bufs[i], b.ctx, sizes[i]);
    if (rc == M40LLM_OK) rc = m40llm_memset(b.ctx, *bufs[i], i % 2 ? 0x3b : 0x3c, sizes[i]);
  }
  for (int i = 0; i < SEQS; i++) b.ids[i] = i;
  int failed = rc != M40LLM_OK;
  if (failed) fprintf(stderr, "setup: %s\n", m40llm_last_error_message());
  for (int i = 0; !failed && i < KINDS; i++) {
    eager[i] = time_eager(&b, &kinds[i]);
    graph[i] = time_graph(&b, &kinds[i]);
    failed = eager[i] < 0 || graph[i] < 0;
  }
  for (int i = 0; i < 5; i++) m40llm_free(b.ctx, *bufs[i]);
  m40llm_kvcache_destroy(b.cache);
  m40llm_context_destroy(b.ctx);
  return failed;
}

int main(int argc, char **argv) {
  const char *path = argc > 1 ? argv[1] : "bench_append.json";
  const int device = argc > 2 ? atoi(argv[2]) : 0;
  int count = 0;
  if (m40llm_cuda_device_count(&count) != M40LLM_OK || count <= device) {
    fprintf(stderr, "no CUDA device %d\n", device);
    return 1;
  }
  struct cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) return 1;
  m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
  {
    m40llm_context_options co = M40LLM_CONTEXT_OPTIONS_INIT;
    co.backend = M40LLM_BACKEND_CUDA, co.device = device;
    m40llm_context *ctx = NULL;
    if (m40llm_context_create(&ctx, &co) != M40LLM_OK ||
        m40llm_context_device_info(&info, ctx) != M40LLM_OK)
      return 1;
    m40llm_context_destroy(ctx);
  }
  const int fmts[2] = {M40LLM_KV_F16, M40LLM_KV_Q8};
  const char *fmt_names[2] = {"F16", "Q8"};
  double eager[2][KINDS], graph[2][KINDS];
  for (int f = 0; f < 2; f++)
    if (run_format(device, fmts[f], eager[f], graph[f])) return 1;

  printf("append of a decode step: %s (sm_%d%d, kernels sm_%d %s), %d/%d heads, head_dim %d, "
         "1 token a sequence\nus a step (median); ratio: against one append of one sequence\n",
         prop.name, prop.major, prop.minor, info.kernel_arch, info.native_code ? "SASS" : "PTX JIT",
         HEADS, KV_HEADS, DIM);
  FILE *js = fopen(path, "w");
  if (!js) {
    fprintf(stderr, "cannot write %s\n", path);
    return 1;
  }
  fprintf(js, "{\n  \"device\": \"%s\",\n  \"kernel_arch\": %d,\n  \"native_code\": %d,\n"
          "  \"shape\": {\"n_heads\": %d, \"n_kv_heads\": %d, \"head_dim\": %d, \"prefill\": %d},\n"
          "  \"rows\": [", prop.name, info.kernel_arch, info.native_code, HEADS, KV_HEADS, DIM,
          PREFILL);
  printf("%-6s %-15s %5s %5s %10s %8s %10s %8s\n", "format", "step", "seqs", "calls", "eager us",
         "ratio", "graph us", "ratio");
  int first = 1;
  for (int f = 0; f < 2; f++) {
    for (int i = 0; i < KINDS; i++) {
      const step_kind *s = &kinds[i];
      const int base = s->attend == 2 ? i - 1 : s->attend == 1 ? i : 0;
      const double re = eager[f][i] / eager[f][base], rg = graph[f][i] / graph[f][base];
      const int calls = s->attend == 1 ? 2 : s->batched ? 1 : s->n_seqs;
      if (i == APPEND_KINDS)
        printf("%-6s decode step: append + attention over %d+ positions (ratio: against the two "
               "calls)\n", fmt_names[f], PREFILL);
      printf("%-6s %-15s %5d %5d %10.2f %8.2f %10.2f %8.2f\n", fmt_names[f], s->name, s->n_seqs,
             calls, eager[f][i], re, graph[f][i], rg);
      fprintf(js, "%s\n    {\"format\": \"%s\", \"step\": \"%s\", \"seqs\": %d, \"calls\": %d, "
              "\"eager_us\": %.3f, \"graph_us\": %.3f, \"eager_ratio\": %.3f, "
              "\"graph_ratio\": %.3f}", first ? "" : ",", fmt_names[f], s->name, s->n_seqs, calls,
              eager[f][i], graph[f][i], re, rg);
      first = 0;
    }
    const int b64 = 3;
    printf("%-6s target: batch 64 <= 2x one append: eager %.2fx, graph %.2fx (%s)\n",
           fmt_names[f], eager[f][b64] / eager[f][0], graph[f][b64] / graph[f][0],
           eager[f][b64] <= 2 * eager[f][0] && graph[f][b64] <= 2 * graph[f][0] ? "met" : "missed");
  }
  fprintf(js, "\n  ]\n}\n");
  fclose(js);
  printf("wrote %s\n", path);
  return 0;
}
