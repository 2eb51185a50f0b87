/* Causal attention over the cache (m40llm_kvcache_attn_causal_f32q, issue 17): the prefill axis
 * and speculative verification. One sequence of one layer, 32 query heads over 8 K/V heads,
 * head_dim 128 (and 64, 256), F16 cache:
 *   prefill  T new rows (512 .. 8192) on a cached prefix of P (0 .. 32768) positions
 *   spec     T = 2, 4, 16 rows on P = 4096 and 32768, against one decode call
 *            (m40llm_kvcache_attn_batch_f32q) at the same length: the target is at most
 *            1.3x
 *   short    T = 32, 64, 128, 256 rows on P = 4096: where short prompts change kernels
 * Time: CUDA events around REPS calls on the context's stream, after a warm-up, the median of
 * SAMPLES such runs, per call. FLOPs: 4 x head_dim per (query head, visible position): the QK
 * dot and the PV sum, as FLOP/s against the device's FP32 peak (SMs x FP32 lanes x 2 x clock)
 * and, where the context runs the tensor-core kernels (m40llm_device_info.tensor_cores: sm_80+,
 * head_dims up to 128 here), its dense FP16 tensor-core peak with FP32 accumulation (SMs x
 * FLOP per clock x clock; sm_80 and sm_90 only). The tensor-core kernel takes q and the softmax
 * weights as two FP16 terms each, so its MMAs do twice the FLOPs counted here.
 * Usage: bench_causal [out.json [device [format]]] (default bench_causal.json, device 0, F16;
 * format: F16, Q8, Q4 or Q8Q4 (K Q8, V Q4), with the library's defaults for it: rotation, sinks
 * and window). M40LLM_BENCH_HEAD_DIMS="64,256" times those head_dims only (of 128, 64, 256),
 * M40LLM_BENCH_KINDS="spec,short" those kinds only (of prefill, spec, short). */
#define _POSIX_C_SOURCE 199309L
#include <ctype.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "m40llm.h"

enum { HEADS = 32, KV_HEADS = 8, MAX_T = 8192, MAX_P = 32768, CHUNK = 4096, SAMPLES = 5,
       WARM_MS = 500 };

#define CHECK(x) BENCH_CHECK(x, -1.0)
#define CUDA_CHECK(x) BENCH_CUDA_CHECK(x, -1.0)

typedef struct {
  m40llm_context *ctx;
  m40llm_kvcache *cache;
  int dim;
  float *kv;       /* CHUNK random rows of K (and V) */
  float *q, *out;  /* MAX_T query rows */
} bench;

/* Sequence 0 refilled to `len` positions. */
static double fill(bench *b, int len) {
  CHECK(m40llm_kvcache_seq_reset(b->cache, 0));
  for (int done = 0; done < len; done += CHUNK) {
    const int n = len - done < CHUNK ? len - done : CHUNK;
    CHECK(m40llm_kvcache_append_f32(b->cache, 0, 0, b->kv, b->kv, n));
  }
  return 0.0;
}

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Milliseconds `reps` calls take on the context's stream, between events e0 and e1: causal over
 * the last t rows (t > 0), or the decode call (t = 0); -1.0 on an error. */
static double run_calls(bench *b, int t, int reps, cudaEvent_t e0, cudaEvent_t e1) {
  const int32_t id = 0, count = t;
  cudaStream_t s = (cudaStream_t)m40llm_context_cuda_stream(b->ctx);
  CUDA_CHECK(cudaEventRecord(e0, s));
  for (int r = 0; r < reps; r++) {
    if (t > 0) CHECK(m40llm_kvcache_attn_causal_f32q(b->out, b->cache, 0, &id, &count, 1, b->q, NULL));
    else CHECK(m40llm_kvcache_attn_batch_f32q(b->out, b->cache, 0, &id, 1, b->q, 0.0f));
  }
  CUDA_CHECK(cudaEventRecord(e1, s));
  CUDA_CHECK(cudaEventSynchronize(e1));
  float ms = 0.0f;
  CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  return ms > 0.0f ? ms : 1e-6;
}

/* Microseconds a call (run_calls' t). The first shape of a run is timed after WARM_MS of its
 * calls: runs that began with a 10-us shape (M40LLM_BENCH_KINDS=spec) timed it at 1.2-1.9x what
 * runs whose prefill shapes came first took (H200, bench/RESULTS.md). */
static double time_call(bench *b, int t) {
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  const cudaError_t made = cudaEventCreate(&e1);
  if (made != cudaSuccess) cudaEventDestroy(e0);
  CUDA_CHECK(made);
  double samples[SAMPLES], ms = 0.0;
  static int warm = 0;
  for (double busy = 0.0; !warm && busy < WARM_MS && ms >= 0.0; busy += ms)
    ms = run_calls(b, t, 20, e0, e1);
  warm = 1;
  int reps = 1;
  for (int i = -1; i < SAMPLES && ms >= 0.0; i++) {
    ms = run_calls(b, t, reps, e0, e1);
    if (i < 0) {  /* the first run sizes the others: about 20 ms each, 1 to 200 calls */
      reps = (int)(20.0 * reps / ms);
      reps = reps < 1 ? 1 : reps > 200 ? 200 : reps;
    } else {
      samples[i] = 1e3 * ms / reps;
    }
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  if (ms < 0.0) return -1.0;
  qsort(samples, SAMPLES, sizeof samples[0], cmp_double);
  return samples[SAMPLES / 2];
}

/* FP32 lanes per SM by compute capability (the CUDA programming guide's table). */
static int fp32_lanes(int major, int minor) {
  if (major == 5 || (major == 6 && minor != 0) || (major == 8 && minor != 0) || major >= 9) return 128;
  return 64;
}

/* Dense FP16 tensor-core FLOP per clock per SM with FP32 accumulation (A100, H100), else 0. */
static int tc_flop_per_clock(int major, int minor) {
  return major == 9 && minor == 0 ? 4096 : major == 8 && minor == 0 ? 2048 : 0;
}

/* Whether the list (numbers separated by anything else: "64,256", "64 256") names head_dim d. */
static int has_dim(const char *list, int d) {
  for (const char *c = list; *c;) {
    char *end;
    const long v = strtol(c, &end, 10);
    if (end == c) {
      c++;
      continue;
    }
    if (v == d) return 1;
    c = end;
  }
  return 0;
}

/* Whether the list (names separated by anything but letters: "spec,short", "spec short") names
 * kind k. */
static int has_kind(const char *list, const char *k) {
  const size_t n = strlen(k);
  for (const char *c = list; *c;) {
    size_t len = 0;
    while (isalpha((unsigned char)c[len])) len++;
    if (len == n && !strncmp(c, k, n)) return 1;
    c += len ? len : 1;
  }
  return 0;
}

int main(int argc, char **argv) {
  const char *json_path = argc > 1 ? argv[1] : "bench_causal.json";
  const int device = argc > 2 ? atoi(argv[2]) : 0;
  const char *format = argc > 3 ? argv[3] : "F16";
  int k_format, v_format;
  if (!strcmp(format, "F16")) k_format = v_format = M40LLM_KV_F16;
  else if (!strcmp(format, "Q8")) k_format = v_format = M40LLM_KV_Q8;
  else if (!strcmp(format, "Q4")) k_format = v_format = M40LLM_KV_Q4;
  else if (!strcmp(format, "Q8Q4")) k_format = M40LLM_KV_Q8, v_format = M40LLM_KV_Q4;
  else {
    fprintf(stderr, "bench_causal: format %s: F16, Q8, Q4 or Q8Q4\n", format);
    return 1;
  }
  int sms = 0, clock_khz = 0, major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    fprintf(stderr, "bench_causal: no CUDA device %d\n", device);
    return 1;
  }
  const double peak = (double)sms * fp32_lanes(major, minor) * 2.0 * clock_khz * 1e3;
  m40llm_context_options co = M40LLM_CONTEXT_OPTIONS_INIT;
  co.backend = M40LLM_BACKEND_CUDA;
  co.device = device;
  m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
  bench b = {0};
  BENCH_CHECK(m40llm_context_create(&b.ctx, &co), 1);
  BENCH_CHECK(m40llm_context_device_info(&info, b.ctx), 1);
  const double tc_peak =
      info.tensor_cores ? (double)sms * tc_flop_per_clock(major, minor) * clock_khz * 1e3 : 0.0;
  printf("%s, sm_%d%d, kernels for sm_%d (%s); FP32 peak %.1f TFLOP/s, tensor-core peak %.1f "
         "(0: FP32 kernels, or not known); K/V %s\n", info.name, major, minor, info.kernel_arch,
         info.native_code ? "native" : "PTX JIT", peak / 1e12, tc_peak / 1e12, format);
  FILE *json = fopen(json_path, "w");
  if (!json) {
    fprintf(stderr, "bench_causal: cannot write %s\n", json_path);
    return 1;
  }
  fprintf(json,
          "{\"device\": \"%s\", \"kernel_arch\": %d, \"tensor_cores\": %d, \"format\": \"%s\", "
          "\"fp32_peak_flops\": %.6g, \"tc_peak_flops\": %.6g, \"rows\": [",
          info.name, info.kernel_arch, info.tensor_cores, format, peak, tc_peak);
  printf("%-8s %4s %6s %6s %12s %10s %8s %8s %10s\n", "kind", "dim", "T", "P", "us/call", "TFLOP/s",
         "of FP32", "of TC", "x decode");
  int first = 1;
  const int dims[3] = {128, 64, 256};
  const char *only = getenv("M40LLM_BENCH_HEAD_DIMS");
  if (only && !has_dim(only, 64) && !has_dim(only, 128) && !has_dim(only, 256))
    fprintf(stderr, "M40LLM_BENCH_HEAD_DIMS=\"%s\" names none of 64, 128, 256: nothing to time\n", only);
  static const char *const kinds[] = {"prefill", "spec", "short"};
  const char *only_kinds = getenv("M40LLM_BENCH_KINDS");
  if (only_kinds && !has_kind(only_kinds, kinds[0]) && !has_kind(only_kinds, kinds[1]) &&
      !has_kind(only_kinds, kinds[2]))
    fprintf(stderr,
            "M40LLM_BENCH_KINDS=\"%s\" names none of prefill, spec, short: nothing to time\n",
            only_kinds);
  for (int di = 0; di < 3; di++) {
    b.dim = dims[di];
    if (only && !has_dim(only, b.dim)) continue;
    m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
    o.n_layers = 1, o.n_heads = HEADS, o.n_kv_heads = KV_HEADS, o.head_dim = b.dim;
    o.max_seqs = 1, o.max_seq_len = MAX_T + MAX_P;
    o.format = k_format, o.v_format = v_format;
    BENCH_CHECK(m40llm_kvcache_create(&b.cache, b.ctx, &o), 1);
    const size_t kv_floats = (size_t)CHUNK * KV_HEADS * b.dim, q_floats = (size_t)MAX_T * HEADS * b.dim;
    float *h = malloc((kv_floats > q_floats ? kv_floats : q_floats) * sizeof(float));
    if (!h) return 1;
    srand(17);
    for (size_t i = 0; i < (kv_floats > q_floats ? kv_floats : q_floats); i++)
      h[i] = (float)rand() / RAND_MAX * 2.0f - 1.0f;
    BENCH_CHECK(m40llm_malloc((void **)&b.kv, b.ctx, kv_floats * sizeof(float)), 1);
    BENCH_CHECK(m40llm_malloc((void **)&b.q, b.ctx, q_floats * sizeof(float)), 1);
    BENCH_CHECK(m40llm_malloc((void **)&b.out, b.ctx, q_floats * sizeof(float)), 1);
    BENCH_CHECK(m40llm_memcpy_to_device(b.ctx, b.kv, h, kv_floats * sizeof(float)), 1);
    BENCH_CHECK(m40llm_memcpy_to_device(b.ctx, b.q, h, q_floats * sizeof(float)), 1);
    free(h);
    static const int prefill_t[] = {512, 1024, 2048, 4096, 8192}, prefill_p[] = {0, 4096, 32768};
    static const int spec_t[] = {2, 4, 16}, spec_p[] = {4096, 32768};
    static const int short_t[] = {32, 64, 128, 256}, short_p[] = {4096};
    for (int kind = 0; kind < 3; kind++) {
      if (only_kinds && !has_kind(only_kinds, kinds[kind])) continue;
      const int nt = kind == 0 ? 5 : kind == 1 ? 3 : 4, np = kind == 0 ? 3 : kind == 1 ? 2 : 1;
      for (int pi = 0; pi < np; pi++)
        for (int ti = 0; ti < nt; ti++) {
          const int t = kind == 0 ? prefill_t[ti] : kind == 1 ? spec_t[ti] : short_t[ti];
          const int p = kind == 0 ? prefill_p[pi] : kind == 1 ? spec_p[pi] : short_p[pi];
          if (!kind && p == 32768 && t > 2048 && b.dim != 128) continue;  /* dim 128 covers it */
          if (fill(&b, p + t) < 0.0) return 1;
          const double us = time_call(&b, t);
          double dec = 0.0;
          if (kind == 1) {  /* one decode call at the same length */
            if (fill(&b, p + 1) < 0.0) return 1;
            dec = time_call(&b, 0);
          }
          if (us < 0.0 || dec < 0.0) return 1;
          const double flops = (double)HEADS * 4.0 * b.dim *
                               ((double)t * p + (double)t * (t + 1) / 2.0);
          const double rate = flops / (us * 1e-6);
          const double of_tc = tc_peak > 0.0 ? rate / tc_peak : 0.0;
          printf("%-8s %4d %6d %6d %12.1f %10.2f %7.1f%% %7.1f%%", kinds[kind], b.dim,
                 t, p, us, rate / 1e12, 100.0 * rate / peak, 100.0 * of_tc);
          if (kind == 1) printf(" %10.2f", us / dec);
          printf("\n");
          fprintf(json,
                  "%s\n  {\"kind\": \"%s\", \"head_dim\": %d, \"heads\": %d, \"kv_heads\": %d, "
                  "\"T\": %d, \"P\": %d, \"us\": %.3f, \"flops_per_s\": %.6g, \"of_fp32_peak\": "
                  "%.4f, \"of_tc_peak\": %.4f, \"decode_us\": %.3f}",
                  first ? "" : ",", kinds[kind], b.dim, HEADS, KV_HEADS, t, p, us,
                  rate, rate / peak, of_tc, dec);
          first = 0;
        }
    }
    m40llm_free(b.ctx, b.kv), m40llm_free(b.ctx, b.q), m40llm_free(b.ctx, b.out);
    m40llm_kvcache_destroy(b.cache);
  }
  fprintf(json, "\n]}\n");
  fclose(json);
  m40llm_context_destroy(b.ctx);
  printf("wrote %s\n", json_path);
  return 0;
}
