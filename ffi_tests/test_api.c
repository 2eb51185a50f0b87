/* The public C API on the CPU backend: every function, every error path, the sequence
 * semantics, FP16 rounding and attention against a float64 reference. Runs everywhere. */
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

static void test_version_and_status(void) {
  t_set_case("version");
  T_CHECK(m40llm_version_number() == M40LLM_VERSION_NUMBER);
  T_CHECK(M40LLM_VERSION_NUMBER ==
          M40LLM_VERSION_MAJOR * 10000 + M40LLM_VERSION_MINOR * 100 + M40LLM_VERSION_PATCH);
  char want[64];
  snprintf(want, sizeof want, "%d.%d.%d", M40LLM_VERSION_MAJOR, M40LLM_VERSION_MINOR,
           M40LLM_VERSION_PATCH);
  const char *vs = m40llm_version_string();
  T_CHECKF(vs != NULL && strcmp(vs, want) == 0, "version string \"%s\", expected \"%s\"",
           vs ? vs : "(null)", want);

  t_set_case("status strings");
  const int codes[] = {M40LLM_OK,          M40LLM_ERR_INVALID_ARGUMENT, M40LLM_ERR_OUT_OF_RANGE,
                       M40LLM_ERR_CAPACITY, M40LLM_ERR_OUT_OF_MEMORY,   M40LLM_ERR_NO_DEVICE,
                       M40LLM_ERR_CUDA,     M40LLM_ERR_UNSUPPORTED,      M40LLM_ERR_CONTEXT_LOST};
  const char *unknown = m40llm_status_string(-1000);
  T_CHECK(unknown != NULL && strstr(unknown, "unknown") != NULL);
  T_CHECK(M40LLM_ERR_CONTEXT_LOST == -8); /* appended: no code renumbered */
  const int unknown_codes[] = {1, -9, 42, INT_MIN, INT_MAX};
  for (size_t i = 0; i < sizeof unknown_codes / sizeof unknown_codes[0]; i++) {
    const char *s = m40llm_status_string(unknown_codes[i]);
    T_CHECKF(s != NULL && strcmp(s, unknown) == 0, "status %d: \"%s\"", unknown_codes[i],
             s ? s : "(null)");
  }
  for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++) {
    const char *s = m40llm_status_string(codes[i]);
    T_CHECKF(s != NULL && s[0] != '\0' && strcmp(s, unknown) != 0,
             "status %d has no string of its own", codes[i]);
    for (size_t j = 0; j < i; j++)
      T_CHECKF(s && strcmp(s, m40llm_status_string(codes[j])) != 0,
               "statuses %d and %d share a string", codes[i], codes[j]);
  }
}

/* ---- last_error_message is per thread ---------------------------------------------------- */

typedef struct thread_result {
  char before[512];
  char after[512];
  int status;
} thread_result;

static void *thread_main(void *arg) {
  thread_result *r = arg;
  snprintf(r->before, sizeof r->before, "%s", m40llm_last_error_message());
  r->status = m40llm_kvcache_options_init(NULL, M40LLM_KVCACHE_OPTIONS_VERSION);
  snprintf(r->after, sizeof r->after, "%s", m40llm_last_error_message());
  return NULL;
}

static void test_last_error_thread_local(void) {
  t_set_case("last_error_message per thread");
  int count = 0;
  T_FAIL_WITH(m40llm_cuda_device_count(NULL), M40LLM_ERR_INVALID_ARGUMENT, "out_count");
  char main_msg[512];
  snprintf(main_msg, sizeof main_msg, "%s", m40llm_last_error_message());
  /* a success does not clear it */
  T_OK(m40llm_cuda_device_count(&count));
  T_CHECK(strcmp(m40llm_last_error_message(), main_msg) == 0);
  thread_result r;
  memset(&r, 0, sizeof r);
  pthread_t th;
  if (!T_CHECK(pthread_create(&th, NULL, thread_main, &r) == 0)) return;
  pthread_join(th, NULL);
  T_CHECKF(r.before[0] == '\0', "a new thread starts with message \"%s\"", r.before);
  T_CHECK(r.status == M40LLM_ERR_INVALID_ARGUMENT);
  T_CHECK(strstr(r.after, "opts") != NULL);
  T_CHECKF(strcmp(m40llm_last_error_message(), main_msg) == 0,
           "another thread's failure changed this thread's message to \"%s\"",
           m40llm_last_error_message());
}

/* ---- The test's own FP16 converter ----------------------------------------------------------- */

static void test_fp16_converter(void) {
  t_set_case("own fp16 converter");
  const struct {
    float f;
    uint16_t h;
  } known[] = {{0.0f, 0x0000},          {-0.0f, 0x8000},        {1.0f, 0x3C00},
               {-2.0f, 0xC000},         {0.5f, 0x3800},         {65504.0f, 0x7BFF},
               {65519.0f, 0x7BFF},      {65520.0f, 0x7C00},     {1e10f, 0x7C00},
               {INFINITY, 0x7C00},      {-INFINITY, 0xFC00},    {6.103515625e-5f, 0x0400},
               {5.9604644775390625e-8f, 0x0001}, {2.98023223876953125e-8f, 0x0000},
               {2.9802326e-8f, 0x0001}, {8.94069671630859375e-8f, 0x0002}, /* 1.5 ulp: tie to even */
               {1.0009765625f, 0x3C01}, {1.00048828125f, 0x3C00}, /* tie: stays even */
               {1.00146484375f, 0x3C02}, /* tie between 0x3C01 and 0x3C02: to even */
               {0.333333343f, 0x3555},  {1e-30f, 0x0000},      {-1e-30f, 0x8000}};
  for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) {
    uint16_t h = t_f32_to_f16(known[i].f);
    T_CHECKF(h == known[i].h, "f32_to_f16(%a) = 0x%04x, expected 0x%04x", (double)known[i].f, h,
             known[i].h);
  }
  T_CHECK(t_f16_is_nan(t_f32_to_f16(NAN)));
  T_CHECK(isnan(t_f16_to_f32(0x7E00)) && isnan(t_f16_to_f32(0xFC01)));
  T_CHECK(t_f16_to_f32(0x0001) == 5.9604644775390625e-8f);
  T_CHECK(t_f16_to_f32(0x83FF) == -6.097555160522461e-5f);
  /* every non-NaN half survives f16 -> f32 -> f16 */
  int roundtrip = 1;
  for (uint32_t h = 0; h < 65536; h++)
    if (!t_f16_is_nan((uint16_t)h)) roundtrip &= t_f32_to_f16(t_f16_to_f32((uint16_t)h)) == h;
  T_CHECK(roundtrip);
  /* nearest, ties to even: no neighbour is closer, and on a tie the result is even */
  int nearest = 1;
  for (int i = 0; i < 200000 && nearest; i++) {
    uint32_t exp = (uint32_t)t_rand_int(127 - 26, 127 + 15);
    float f = t_f32_from_bits((uint32_t)(t_rand_u64() & 0x807FFFFFu) | (exp << 23));
    uint16_t h = t_f32_to_f16(f);
    double x = fabs((double)f), y = fabs((double)t_f16_to_f32(h));
    double err = fabs(x - y);
    uint16_t mag = h & 0x7FFF;
    if (mag < 0x7C00) {
      double up = fabs(x - (double)t_f16_to_f32((uint16_t)(mag + 1)));
      if (mag == 0x7BFF) up = fabs(x - 65536.0); /* the overflow threshold acts as the next value */
      double down = mag > 0 ? fabs(x - (double)t_f16_to_f32((uint16_t)(mag - 1))) : INFINITY;
      nearest &= err < up || (err == up && (mag & 1) == 0);
      nearest &= err < down || (err == down && (mag & 1) == 0);
    } else {
      nearest &= x >= 65520.0;
    }
    nearest &= ((h & 0x8000) != 0) == (f < 0.0f || (f == 0.0f && signbit(f)));
    if (!nearest) T_CHECKF(0, "own converter: %a -> 0x%04x is not nearest-even", (double)f, h);
  }
  if (nearest) T_CHECK(1);
}

/* ---- Devices and contexts --------------------------------------------------------------------- */

static void test_devices_and_contexts(void) {
  t_set_case("devices");
  int count = -1;
  T_OK(m40llm_cuda_device_count(&count));
  T_CHECK(count >= 0);
  const int built = m40llm_built_with_cuda();
  T_CHECK(built == 0 || built == 1);
  if (!built) T_CHECK(count == 0);
  printf("built with CUDA: %d, CUDA devices: %d\n", built, count);

  t_set_case("context options");
  m40llm_context_options co;
  memset(&co, 0x5A, sizeof co);
  m40llm_context_options co_before = co;
  T_FAIL_WITH(m40llm_context_options_init(NULL, M40LLM_CONTEXT_OPTIONS_VERSION),
              M40LLM_ERR_INVALID_ARGUMENT, "opts");
  T_FAIL_WITH(m40llm_context_options_init(&co, 0), M40LLM_ERR_INVALID_ARGUMENT, "version");
  T_FAIL_WITH(m40llm_context_options_init(&co, M40LLM_CONTEXT_OPTIONS_VERSION + 1),
              M40LLM_ERR_INVALID_ARGUMENT, "version");
  T_CHECK(memcmp(&co, &co_before, sizeof co) == 0);
  if (T_OK(m40llm_context_options_init(&co, M40LLM_CONTEXT_OPTIONS_VERSION))) {
    const m40llm_context_options want = M40LLM_CONTEXT_OPTIONS_INIT;
    T_CHECK(co.version == want.version && co.version == M40LLM_CONTEXT_OPTIONS_VERSION);
    T_CHECK(co.backend == M40LLM_BACKEND_AUTO && co.device == 0 && co.cuda_stream == NULL);
    T_CHECK(co.check_pointers == 1);
  }
  /* A version-1 caller's struct ends before check_pointers: nothing past it is read or written
   * (the ASan build catches either on this heap block). */
  {
    typedef struct {
      unsigned version;
      int backend, device;
      void *cuda_stream;
    } options_v1;
    _Static_assert(sizeof(options_v1) == offsetof(m40llm_context_options, check_pointers),
                   "v1 layout");
    options_v1 *v1 = malloc(sizeof *v1);
    m40llm_context_options *as_v1 = (m40llm_context_options *)(void *)v1;
    m40llm_context *c1 = NULL;
    if (T_CHECK(v1) && T_OK(m40llm_context_options_init(as_v1, 1))) {
      T_INT_EQ(v1->version, 1);
      v1->backend = M40LLM_BACKEND_CPU;
      if (T_OK(m40llm_context_create(&c1, as_v1))) m40llm_context_destroy(c1);
    }
    free(v1);
  }

  t_set_case("context_create error paths");
  m40llm_context *sentinel = (m40llm_context *)&count;
  m40llm_context *ctx = sentinel;
  m40llm_context_options o = M40LLM_CONTEXT_OPTIONS_INIT;
  T_FAIL_WITH(m40llm_context_create(NULL, NULL), M40LLM_ERR_INVALID_ARGUMENT, "out");
  T_FAIL_WITH(m40llm_context_create(NULL, &o), M40LLM_ERR_INVALID_ARGUMENT, "out");
  o.version = 0;
  T_FAIL_WITH(m40llm_context_create(&ctx, &o), M40LLM_ERR_INVALID_ARGUMENT, "version");
  o.version = M40LLM_CONTEXT_OPTIONS_VERSION + 1;
  T_FAIL_WITH(m40llm_context_create(&ctx, &o), M40LLM_ERR_INVALID_ARGUMENT, "version");
  o.version = M40LLM_CONTEXT_OPTIONS_VERSION;
  o.check_pointers = 2;
  T_FAIL_WITH(m40llm_context_create(&ctx, &o), M40LLM_ERR_INVALID_ARGUMENT, "check_pointers");
  o.check_pointers = 1;
  o.backend = 3;
  T_FAIL_WITH(m40llm_context_create(&ctx, &o), M40LLM_ERR_INVALID_ARGUMENT, "backend");
  o.backend = -1;
  T_FAIL_WITH(m40llm_context_create(&ctx, &o), M40LLM_ERR_INVALID_ARGUMENT, "backend");
  o.backend = M40LLM_BACKEND_CUDA;
  if (count == 0) {
    /* the message says why: the runtime's own words, or how to get a CUDA build */
    T_FAIL_WITH(m40llm_context_create(&ctx, &o), M40LLM_ERR_NO_DEVICE,
                built ? "cudaGetDeviceCount" : "rebuild");
  } else {
    o.device = count;
    T_FAIL_WITH(m40llm_context_create(&ctx, &o), M40LLM_ERR_OUT_OF_RANGE, "device");
    o.device = -1;
    T_FAIL_WITH(m40llm_context_create(&ctx, &o), M40LLM_ERR_OUT_OF_RANGE, "device");
  }
  T_CHECK(ctx == sentinel);

  /* the CPU backend ignores the device ordinal */
  t_set_case("CPU context ignores device");
  const int devices[2] = {7, -1};
  for (int i = 0; i < 2; i++) {
    o = (m40llm_context_options)M40LLM_CONTEXT_OPTIONS_INIT;
    o.backend = M40LLM_BACKEND_CPU;
    o.device = devices[i];
    ctx = NULL;
    if (T_OK(m40llm_context_create(&ctx, &o))) {
      m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
      T_OK(m40llm_context_device_info(&info, ctx));
      T_CHECK(info.backend == M40LLM_BACKEND_CPU && info.device == -1);
      m40llm_context_destroy(ctx);
    }
  }

  /* AUTO: the device is checked only where the context takes CUDA, whatever its value */
  t_set_case("AUTO context and device ordinals");
  const int auto_devices[3] = {-1, INT_MAX, INT_MIN};
  for (int i = 0; i < 3; i++) {
    o = (m40llm_context_options)M40LLM_CONTEXT_OPTIONS_INIT;
    o.device = auto_devices[i];
    ctx = sentinel;
    if (count > 0) {
      T_FAIL_WITH(m40llm_context_create(&ctx, &o), M40LLM_ERR_OUT_OF_RANGE, "device");
      T_CHECK(ctx == sentinel);
    } else if (T_OK(m40llm_context_create(&ctx, &o))) {
      m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
      T_OK(m40llm_context_device_info(&info, ctx));
      T_CHECK(info.backend == M40LLM_BACKEND_CPU && info.device == -1);
      m40llm_context_destroy(ctx);
    }
  }

  /* defaults: AUTO picks CUDA exactly when a device exists */
  t_set_case("context defaults");
  ctx = NULL;
  if (T_OK(m40llm_context_create(&ctx, NULL))) {
    m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
    if (T_OK(m40llm_context_device_info(&info, ctx)))
      T_CHECK(info.backend == (count > 0 ? M40LLM_BACKEND_CUDA : M40LLM_BACKEND_CPU));
    T_CHECK((m40llm_context_cuda_stream(ctx) != NULL) == (count > 0));
    T_OK(m40llm_context_synchronize(ctx));
    m40llm_context_destroy(ctx);
  }
}

/* ---- Build info ------------------------------------------------------------------------------ */

static void test_build_info(void) {
  t_set_case("build info error paths");
  m40llm_build_info b;
  memset(&b, 0x5A, sizeof b);
  T_FAIL_WITH(m40llm_build_info_get(NULL), M40LLM_ERR_INVALID_ARGUMENT, "out");
  const unsigned bad_versions[] = {0, M40LLM_BUILD_INFO_VERSION + 1};
  for (int i = 0; i < 2; i++) {
    b.version = bad_versions[i];
    const m40llm_build_info before = b;
    T_FAIL_WITH(m40llm_build_info_get(&b), M40LLM_ERR_INVALID_ARGUMENT, "version");
    T_CHECK(memcmp(&b, &before, sizeof b) == 0);
  }

  t_set_case("build info");
  b = (m40llm_build_info)M40LLM_BUILD_INFO_INIT;
  if (!T_OK(m40llm_build_info_get(&b))) return;
  T_INT_EQ(b.version, M40LLM_BUILD_INFO_VERSION);
  T_INT_EQ(b.cuda, m40llm_built_with_cuda());
  if (!T_CHECK(b.cuda_architectures != NULL)) return;
  printf("build: CUDA %d, toolkit %d, architectures \"%s\", tensor cores %d\n", b.cuda,
         b.cuda_toolkit_version, b.cuda_architectures, b.tensor_cores);
  m40llm_build_info again = M40LLM_BUILD_INFO_INIT;
  if (T_OK(m40llm_build_info_get(&again))) T_CHECK(memcmp(&again, &b, sizeof b) == 0);
  if (!b.cuda) {
    T_CHECK(b.cuda_architectures[0] == '\0');
    T_INT_EQ(b.cuda_toolkit_version, 0);
    T_INT_EQ(b.tensor_cores, 0);
    return;
  }
  int arch[64], real[64];
  const int n = t_parse_archs(b.cuda_architectures, arch, real, 64);
  T_CHECKF(n >= 1, "\"%s\" is not a list of NN-real and NN-virtual", b.cuda_architectures);
  int newest = 0;
  for (int i = 0; i < n; i++) {
    newest = arch[i] > newest ? arch[i] : newest;
    if (i > 0) /* sorted by architecture, SASS first */
      T_CHECKF(arch[i - 1] < arch[i] || (arch[i - 1] == arch[i] && real[i - 1] >= real[i]),
               "\"%s\" is not sorted", b.cuda_architectures);
  }
  T_CHECKF(b.cuda_toolkit_version >= 11080 && b.cuda_toolkit_version % 10 == 0,
           "cuda_toolkit_version %d", b.cuda_toolkit_version);
  T_CHECK(b.tensor_cores == 0 || newest >= 80);
#ifdef T_CUDA_ARCHITECTURES
  /* the list CMake configured arrives intact through the compile definition */
  T_CHECKF(strcmp(b.cuda_architectures, T_CUDA_ARCHITECTURES) == 0, "\"%s\", expected \"%s\"",
           b.cuda_architectures, T_CUDA_ARCHITECTURES);
  T_INT_EQ(b.tensor_cores, T_TENSOR_CORES_OPTION && newest >= 80);
#endif
}

static void test_cpu_context_info(m40llm_context *ctx) {
  t_set_case("CPU device info");
  m40llm_device_info info;
  memset(&info, 0x5A, sizeof info);
  info.version = M40LLM_DEVICE_INFO_VERSION;
  if (T_OK(m40llm_context_device_info(&info, ctx))) {
    T_CHECK(info.version == M40LLM_DEVICE_INFO_VERSION);
    T_CHECK(info.backend == M40LLM_BACKEND_CPU);
    T_CHECK(info.device == -1);
    T_CHECK(memchr(info.name, '\0', sizeof info.name) != NULL && strcmp(info.name, "CPU") == 0);
    T_CHECK(info.compute_major == 0 && info.compute_minor == 0 && info.multiprocessors == 0);
    T_CHECK(info.total_memory == 0 && info.free_memory == 0);
    T_CHECK(info.kernel_arch == 0 && info.native_code == 0 && info.tensor_cores == 0);
  }
  /* A version-1 caller's struct ends before kernel_arch: nothing past it is written (the ASan
   * build catches a write past the heap block; the poison, one in a larger struct). */
  t_set_case("CPU device info, version 1");
  typedef struct {
    unsigned version;
    int backend, device;
    char name[256];
    int compute_major, compute_minor, multiprocessors;
    size_t total_memory, free_memory;
  } device_info_v1;
  const size_t v1_size = offsetof(m40llm_device_info, kernel_arch);
  _Static_assert(sizeof(device_info_v1) == offsetof(m40llm_device_info, kernel_arch), "v1 layout");
  device_info_v1 *v1 = malloc(sizeof *v1);
  if (T_CHECK(v1 != NULL)) {
    v1->version = 1;
    if (T_OK(m40llm_context_device_info((m40llm_device_info *)(void *)v1, ctx))) {
      T_INT_EQ(v1->version, 1);
      T_CHECK(v1->backend == M40LLM_BACKEND_CPU && strcmp(v1->name, "CPU") == 0);
    }
    free(v1);
  }
  memset(&info, 0x5A, sizeof info);
  info.version = 1;
  if (T_OK(m40llm_context_device_info(&info, ctx))) {
    T_INT_EQ(info.version, 1);
    T_CHECK(info.backend == M40LLM_BACKEND_CPU && info.device == -1);
    T_CHECK(t_all_bytes((const char *)&info + v1_size, sizeof info - v1_size, 0x5A));
  }
  T_CHECK(m40llm_context_cuda_stream(ctx) == NULL);
  T_OK(m40llm_context_synchronize(ctx));

  /* Graphs are the CUDA backend's: a CPU context says so; bad arguments come first. */
  t_set_case("graphs on the CPU backend");
  m40llm_graph *g = NULL;
  T_FAIL_WITH(m40llm_graph_capture_begin(ctx), M40LLM_ERR_UNSUPPORTED, "CUDA backend");
  T_FAIL_WITH(m40llm_graph_capture_end(&g, ctx, NULL), M40LLM_ERR_UNSUPPORTED, "CUDA backend");
  T_CHECK(g == NULL);
  T_FAIL_WITH(m40llm_graph_capture_begin(NULL), M40LLM_ERR_INVALID_ARGUMENT, "ctx");
  T_FAIL_WITH(m40llm_graph_capture_end(&g, NULL, NULL), M40LLM_ERR_INVALID_ARGUMENT, "ctx");
  T_FAIL_WITH(m40llm_graph_launch(NULL), M40LLM_ERR_INVALID_ARGUMENT, "graph");
  m40llm_graph_destroy(NULL);
}

/* ---- Sizes ----------------------------------------------------------------------------------- */

static void test_bytes_needed(m40llm_context *ctx) {
  t_set_case("bytes_needed formula");
  for (int i = 0; i < 50; i++) {
    m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
    o.n_layers = t_rand_int(1, 80);
    o.n_kv_heads = t_rand_int(1, 16);
    o.n_heads = o.n_kv_heads * t_rand_int(1, 8);
    o.head_dim = t_rand_int(1, 256);
    o.max_seqs = t_rand_int(1, 64);
    o.max_seq_len = t_rand_int(1, 1 << 17);
    size_t want = (size_t)2 * 2 * (size_t)o.n_layers * (size_t)o.max_seqs * (size_t)o.n_kv_heads *
                  (size_t)o.max_seq_len * (size_t)o.head_dim;
    size_t got = 0;
    if (T_OK(m40llm_kvcache_bytes_needed(&got, &o)))
      T_CHECKF(got == want, "bytes_needed %zu, expected %zu", got, want);
  }
  /* n_heads does not change the size; the extremes of head_dim */
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = 3;
  o.n_heads = 32;
  o.n_kv_heads = 8;
  o.head_dim = 256;
  o.max_seqs = 5;
  o.max_seq_len = 1000;
  size_t a = 0, b = 0;
  T_OK(m40llm_kvcache_bytes_needed(&a, &o));
  o.n_heads = 8;
  T_OK(m40llm_kvcache_bytes_needed(&b, &o));
  T_CHECK(a == b && a == (size_t)4 * 3 * 5 * 8 * 1000 * 256);
  o.head_dim = 1;
  T_OK(m40llm_kvcache_bytes_needed(&b, &o));
  T_CHECK(b == (size_t)4 * 3 * 5 * 8 * 1000);

  /* a created cache reports the options it was given */
  o.n_heads = 12;
  o.n_kv_heads = 4;
  o.head_dim = 24;
  o.max_seq_len = 33;
  m40llm_kvcache *c = NULL;
  if (T_OK(m40llm_kvcache_create(&c, ctx, &o))) {
    m40llm_kvcache_options got = M40LLM_KVCACHE_OPTIONS_INIT;
    if (T_OK(m40llm_kvcache_get_options(&got, c))) T_CHECK(memcmp(&got, &o, sizeof o) == 0);
    for (int l = 0; l < o.n_layers; l++)
      for (int s = 0; s < o.max_seqs; s++) {
        int len = -1;
        T_OK(m40llm_kvcache_seq_len(&len, c, l, s));
        T_CHECK(len == 0);
      }
    m40llm_kvcache_destroy(c);
  }
}

/* ---- CPU-only shapes (head_dim not a multiple of 8 and the extremes) -------------------------- */

static void test_cpu_shapes(m40llm_context *ctx) {
  const int shapes[][3] = {{1, 1, 1},   {3, 1, 3},   {4, 2, 12},  {10, 5, 100},
                           {2, 2, 256}, {7, 7, 40},  {12, 4, 64}, {28, 4, 80}};
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
    const int n_heads = shapes[i][0], n_kv = shapes[i][1], hd = shapes[i][2];
    t_kv kv;
    t_set_case("CPU shape %d/%d heads, head_dim %d", n_heads, n_kv, hd);
    if (t_kv_create(&kv, ctx, 1, n_heads, n_kv, hd, 4, 130) != M40LLM_OK) continue;
    const int lens[4] = {t_rand_int(1, 130), 0, 1, 130};
    for (int s = 0; s < 4; s++)
      if (lens[s]) T_OK(t_kv_append_random(&kv, 0, s, lens[s], 1.0f));
    t_kv_check_contents(&kv);
    const int32_t ids[6] = {3, 1, 0, 2, 0, 3};
    const size_t n = 6 * (size_t)n_heads * (size_t)hd;
    float *q = malloc(n * sizeof(float));
    if (T_CHECK(q != NULL)) {
      t_fill_uniform(q, n, -3.0f, 3.0f);
      t_kv_check_attention(&kv, 0, ids, 6, q, 0.0f, 1e-5, 1, NULL);
      t_kv_check_attention(&kv, 0, ids, 6, q, 0.0f, 1e-5, 0, NULL);
      t_kv_check_attention(&kv, 0, ids, 6, q, 0.09f, 1e-5, 1, NULL);
    }
    free(q);
    t_kv_destroy(&kv);
  }
}

/* ---- The CPU backend takes plain host pointers ---------------------------------------------- */

static void test_host_pointers(m40llm_context *ctx) {
  t_set_case("CPU backend with plain host pointers");
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = 1;
  o.n_heads = 4;
  o.n_kv_heads = 2;
  o.head_dim = 8;
  o.max_seqs = 1;
  o.max_seq_len = 4;
  m40llm_kvcache *c = NULL;
  if (!T_OK(m40llm_kvcache_create(&c, ctx, &o))) return;
  float k[3][2][8], v[3][2][8], q[4][8], out[4][8];
  uint16_t k16[3][2][8], v16[3][2][8], back_k[3][2][8], back_v[3][2][8];
  t_fill_uniform(&k[0][0][0], 48, -1.0f, 1.0f);
  t_fill_uniform(&v[0][0][0], 48, -1.0f, 1.0f);
  t_fill_uniform(&q[0][0], 32, -1.0f, 1.0f);
  for (int i = 0; i < 48; i++) {
    (&k16[0][0][0])[i] = t_f32_to_f16((&k[0][0][0])[i]);
    (&v16[0][0][0])[i] = t_f32_to_f16((&v[0][0][0])[i]);
  }
  T_OK(m40llm_kvcache_append_f32(c, 0, 0, &k[0][0][0], &v[0][0][0], 2));
  T_OK(m40llm_kvcache_append_f16(c, 0, 0, &k16[2][0][0], &v16[2][0][0], 1));
  memset(back_k, 0xFF, sizeof back_k);
  memset(back_v, 0xFF, sizeof back_v);
  if (T_OK(m40llm_kvcache_read_f16(&back_k[0][0][0], &back_v[0][0][0], c, 0, 0, 0, 3))) {
    T_CHECK(memcmp(back_k, k16, sizeof k16) == 0);
    T_CHECK(memcmp(back_v, v16, sizeof v16) == 0);
  }
  memset(out, 0xFF, sizeof out);
  if (T_OK(m40llm_kvcache_attn_last_token_f32q(&out[0][0], c, 0, 0, &q[0][0], 0.0f))) {
    double ref[32];
    t_ref_attention(ref, &q[0][0], &k16[0][0][0], &v16[0][0][0], 3, 4, 2, 8, 0.0f);
    double err = t_rel_l2(&out[0][0], ref, 32);
    T_CHECKF(err <= 1e-5, "rel L2 %g", err);
  }
  m40llm_kvcache_destroy(c);
}

int main(void) {
  t_rng_init();
  test_version_and_status();
  test_last_error_thread_local();
  test_fp16_converter();
  test_devices_and_contexts();
  test_build_info();

  m40llm_context_options o = M40LLM_CONTEXT_OPTIONS_INIT;
  o.backend = M40LLM_BACKEND_CPU;
  m40llm_context *ctx = NULL;
  t_set_case("CPU context");
  if (T_OK(m40llm_context_create(&ctx, &o)) && T_CHECK(ctx != NULL)) {
    test_cpu_context_info(ctx);
    t_cases_error_paths(ctx);
    test_bytes_needed(ctx);
    t_cases_sequence_ops(ctx);
    t_cases_fp16_rounding(ctx);
    t_cases_attention_basic(ctx);
    t_cases_attention_masked(ctx);
    t_cases_append_batch(ctx, 0);
    t_cases_importance(ctx, NULL, 1);
    t_cases_tiers(ctx, 1);
    t_cases_policy(ctx, 1);
    test_cpu_shapes(ctx);
    test_host_pointers(ctx);
    m40llm_context_destroy(ctx);
  }
  t_set_case("");
  return t_finish();
}
