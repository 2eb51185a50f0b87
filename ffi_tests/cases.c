/* Cases that run on any context, CPU or CUDA: every error path of the cache and memory calls,
 * the sequence operations, small attention shapes, and FP32->FP16 rounding. */
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

static int backend_of(m40llm_context *ctx) {
  m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
  if (!T_OK(m40llm_context_device_info(&info, ctx))) return -1;
  return info.backend;
}

/* Synchronizes and checks that a backend buffer still holds the 0xFF poison. */
static void check_poisoned(m40llm_context *ctx, const void *dev, size_t bytes, const char *what) {
  unsigned char *h = malloc(bytes);
  if (!T_CHECK(h != NULL)) return;
  if (T_OK(m40llm_context_synchronize(ctx)) && t_dev_download(ctx, h, dev, bytes))
    T_CHECKF(t_all_bytes(h, bytes, 0xFF), "%s wrote its output although it failed", what);
  free(h);
}

static m40llm_kvcache_options valid_opts(void) {
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = 2;
  o.n_heads = 4;
  o.n_kv_heads = 2;
  o.head_dim = 16;
  o.max_seqs = 3;
  o.max_seq_len = 8;
  return o;
}

/* ---- Error paths ------------------------------------------------------------------------------ */

typedef struct bad_opts {
  const char *what;
  m40llm_kvcache_options o;
  int status;
  const char *substr;
} bad_opts;

static void error_paths_options(m40llm_context *ctx) {
  t_set_case("kvcache options validation");
  const m40llm_kvcache_options good = valid_opts();
  bad_opts bad[32];
  int n = 0;
#define BAD(field, value, code, sub)                   \
  do {                                                 \
    bad[n].what = #field " = " #value;                 \
    bad[n].o = good;                                   \
    bad[n].o.field = (value);                          \
    bad[n].status = M40LLM_ERR_##code;                 \
    bad[n].substr = (sub);                             \
    n++;                                               \
  } while (0)
  BAD(version, 0u, INVALID_ARGUMENT, "version");
  BAD(version, M40LLM_KVCACHE_OPTIONS_VERSION + 1u, INVALID_ARGUMENT, "version");
  BAD(n_layers, 0, INVALID_ARGUMENT, "n_layers");
  BAD(n_layers, -1, INVALID_ARGUMENT, "n_layers");
  BAD(n_heads, 0, INVALID_ARGUMENT, "n_heads");
  BAD(n_heads, -4, INVALID_ARGUMENT, "n_heads");
  BAD(n_kv_heads, 0, INVALID_ARGUMENT, "n_kv_heads");
  BAD(n_kv_heads, -2, INVALID_ARGUMENT, "n_kv_heads");
  BAD(n_kv_heads, 3, INVALID_ARGUMENT, "n_kv_heads");  /* 4 heads not a multiple of 3 */
  BAD(n_kv_heads, 8, INVALID_ARGUMENT, "n_kv_heads");  /* more KV heads than heads */
  BAD(head_dim, 0, INVALID_ARGUMENT, "head_dim");
  BAD(head_dim, -16, INVALID_ARGUMENT, "head_dim");
  BAD(head_dim, 257, INVALID_ARGUMENT, "head_dim");
  BAD(head_dim, 264, INVALID_ARGUMENT, "head_dim");
  BAD(max_seqs, 0, INVALID_ARGUMENT, "max_seqs");
  BAD(max_seqs, -1, INVALID_ARGUMENT, "max_seqs");
  BAD(max_seq_len, 0, INVALID_ARGUMENT, "max_seq_len");
  BAD(max_seq_len, INT_MIN, INVALID_ARGUMENT, "max_seq_len");
  BAD(format, 5, UNSUPPORTED, "format");
  BAD(format, M40LLM_KV_Q3, INVALID_ARGUMENT, "V format only");
  BAD(format, -1, UNSUPPORTED, "format");
  BAD(rotation, -1, INVALID_ARGUMENT, "rotation");
  BAD(rotation, 4, INVALID_ARGUMENT, "rotation");
  BAD(n_sinks, -1, INVALID_ARGUMENT, "n_sinks");
  BAD(window, -1, INVALID_ARGUMENT, "window");
#undef BAD
  bad[n].what = "n_heads 6 / n_kv_heads 4";
  bad[n].o = good;
  bad[n].o.n_heads = 6;
  bad[n].o.n_kv_heads = 4;
  bad[n].status = M40LLM_ERR_INVALID_ARGUMENT;
  bad[n].substr = "n_kv_heads";
  n++;
  /* a size that overflows size_t must be refused, not wrapped */
  bad[n].what = "size overflow";
  bad[n].o = good;
  bad[n].o.n_layers = INT_MAX;
  bad[n].o.max_seqs = INT_MAX;
  bad[n].o.n_heads = bad[n].o.n_kv_heads = INT_MAX;
  bad[n].o.max_seq_len = INT_MAX;
  bad[n].o.head_dim = 256;
  bad[n].status = M40LLM_ERR_OUT_OF_MEMORY;
  bad[n].substr = NULL;
  n++;

  for (int i = 0; i < n; i++) {
    t_set_case("kvcache options: %s", bad[i].what);
    size_t bytes = 12345;
    T_FAIL_WITH(m40llm_kvcache_bytes_needed(&bytes, &bad[i].o), bad[i].status, bad[i].substr);
    T_CHECK(bytes == 12345);
    m40llm_kvcache *c = (m40llm_kvcache *)&bytes; /* sentinel: must stay untouched */
    T_FAIL_WITH(m40llm_kvcache_create(&c, ctx, &bad[i].o), bad[i].status, bad[i].substr);
    T_CHECK(c == (m40llm_kvcache *)&bytes);
  }

  t_set_case("kvcache create/bytes_needed NULL arguments");
  m40llm_kvcache_options o = good;
  size_t bytes = 7;
  T_FAIL_WITH(m40llm_kvcache_bytes_needed(NULL, &o), M40LLM_ERR_INVALID_ARGUMENT, "out");
  T_FAIL_WITH(m40llm_kvcache_bytes_needed(&bytes, NULL), M40LLM_ERR_INVALID_ARGUMENT, "opts");
  T_CHECK(bytes == 7);
  m40llm_kvcache *c = NULL;
  T_FAIL_WITH(m40llm_kvcache_create(NULL, ctx, &o), M40LLM_ERR_INVALID_ARGUMENT, "out");
  T_FAIL_WITH(m40llm_kvcache_create(&c, NULL, &o), M40LLM_ERR_INVALID_ARGUMENT, "ctx");
  T_FAIL_WITH(m40llm_kvcache_create(&c, ctx, NULL), M40LLM_ERR_INVALID_ARGUMENT, "opts");
  T_CHECK(c == NULL);

  /* Huge but representable: the allocation itself must fail cleanly (2^54 bytes). */
  t_set_case("kvcache create out of memory");
  o.n_layers = 1024;
  o.max_seqs = 1024;
  o.n_heads = o.n_kv_heads = 256;
  o.max_seq_len = 65536;
  o.head_dim = 256;
  T_OK(m40llm_kvcache_bytes_needed(&bytes, &o));
  T_CHECK(bytes == (size_t)1 << 54);
  c = NULL;
  T_STATUS(m40llm_kvcache_create(&c, ctx, &o), M40LLM_ERR_OUT_OF_MEMORY);
  T_CHECK(c == NULL);

  t_set_case("kvcache options_init");
  m40llm_kvcache_options init;
  memset(&init, 0x5A, sizeof init);
  m40llm_kvcache_options before = init;
  T_FAIL_WITH(m40llm_kvcache_options_init(NULL, M40LLM_KVCACHE_OPTIONS_VERSION),
              M40LLM_ERR_INVALID_ARGUMENT, "opts");
  T_FAIL_WITH(m40llm_kvcache_options_init(&init, 0), M40LLM_ERR_INVALID_ARGUMENT, "version");
  T_FAIL_WITH(m40llm_kvcache_options_init(&init, M40LLM_KVCACHE_OPTIONS_VERSION + 1),
              M40LLM_ERR_INVALID_ARGUMENT, "version");
  T_CHECK(memcmp(&init, &before, sizeof init) == 0);
  if (T_OK(m40llm_kvcache_options_init(&init, M40LLM_KVCACHE_OPTIONS_VERSION))) {
    const m40llm_kvcache_options want = M40LLM_KVCACHE_OPTIONS_INIT;
    T_CHECK(init.version == M40LLM_KVCACHE_OPTIONS_VERSION);
    T_CHECK(init.n_layers == 0 && init.n_heads == 0 && init.n_kv_heads == 0 &&
            init.head_dim == 0 && init.max_seqs == 0 && init.max_seq_len == 0);
    T_CHECK(init.format == M40LLM_KV_F16);
    T_CHECK(init.rotation == M40LLM_ROTATE_AUTO && init.n_sinks == 4 && init.window == 128);
    T_CHECK(init.n_tiers == 0 && init.n_tiers == want.n_tiers);
    T_CHECK(init.version == want.version && init.format == want.format &&
            init.rotation == want.rotation && init.n_sinks == want.n_sinks &&
            init.window == want.window);
  }

  /* head_dim must be a multiple of 8 on CUDA, anything in 1..256 on the CPU */
  t_set_case("kvcache head_dim 12");
  o = good;
  o.head_dim = 12;
  T_OK(m40llm_kvcache_bytes_needed(&bytes, &o));
  c = NULL;
  if (backend_of(ctx) == M40LLM_BACKEND_CUDA) {
    T_FAIL_WITH(m40llm_kvcache_create(&c, ctx, &o), M40LLM_ERR_UNSUPPORTED, "head_dim");
    T_CHECK(c == NULL);
  } else {
    T_OK(m40llm_kvcache_create(&c, ctx, &o));
    m40llm_kvcache_destroy(c);
  }
}

static void error_paths_memory(m40llm_context *ctx) {
  t_set_case("backend memory error paths");
  void *p = (void *)&p;
  T_FAIL_WITH(m40llm_malloc(NULL, ctx, 64), M40LLM_ERR_INVALID_ARGUMENT, "out_ptr");
  T_FAIL_WITH(m40llm_malloc(&p, NULL, 64), M40LLM_ERR_INVALID_ARGUMENT, "ctx");
  T_FAIL_WITH(m40llm_malloc(&p, ctx, 0), M40LLM_ERR_INVALID_ARGUMENT, "bytes");
  T_STATUS(m40llm_malloc(&p, ctx, SIZE_MAX), M40LLM_ERR_OUT_OF_MEMORY);
  T_CHECK(m40llm_last_error_message()[0] != '\0');
  T_STATUS(m40llm_malloc(&p, ctx, SIZE_MAX - 100), M40LLM_ERR_OUT_OF_MEMORY);
  T_STATUS(m40llm_malloc(&p, ctx, (size_t)1 << 56), M40LLM_ERR_OUT_OF_MEMORY);
  T_CHECK(p == (void *)&p);

  void *d = t_dev_alloc(ctx, 256);
  if (!d) return;
  T_CHECKF(((uintptr_t)d % 256) == 0, "m40llm_malloc returned %p, not 256-byte aligned", d);
  unsigned char host[256];
  memset(host, 0x11, sizeof host);
  T_FAIL_WITH(m40llm_free(NULL, d), M40LLM_ERR_INVALID_ARGUMENT, "ctx");
  T_OK(m40llm_free(ctx, NULL));
  T_FAIL_WITH(m40llm_memcpy_to_device(NULL, d, host, 16), M40LLM_ERR_INVALID_ARGUMENT, "ctx");
  T_FAIL_WITH(m40llm_memcpy_to_device(ctx, NULL, host, 16), M40LLM_ERR_INVALID_ARGUMENT, "dst");
  T_FAIL_WITH(m40llm_memcpy_to_device(ctx, d, NULL, 16), M40LLM_ERR_INVALID_ARGUMENT, "src");
  T_FAIL_WITH(m40llm_memcpy_to_host(NULL, host, d, 16), M40LLM_ERR_INVALID_ARGUMENT, "ctx");
  T_FAIL_WITH(m40llm_memcpy_to_host(ctx, NULL, d, 16), M40LLM_ERR_INVALID_ARGUMENT, "dst");
  T_FAIL_WITH(m40llm_memcpy_to_host(ctx, host, NULL, 16), M40LLM_ERR_INVALID_ARGUMENT, "src");
  T_FAIL_WITH(m40llm_memcpy_device(NULL, d, d, 16), M40LLM_ERR_INVALID_ARGUMENT, "ctx");
  T_FAIL_WITH(m40llm_memcpy_device(ctx, NULL, d, 16), M40LLM_ERR_INVALID_ARGUMENT, "dst");
  T_FAIL_WITH(m40llm_memcpy_device(ctx, d, NULL, 16), M40LLM_ERR_INVALID_ARGUMENT, "src");
  T_FAIL_WITH(m40llm_memset(NULL, d, 0, 16), M40LLM_ERR_INVALID_ARGUMENT, "ctx");
  T_FAIL_WITH(m40llm_memset(ctx, NULL, 0, 16), M40LLM_ERR_INVALID_ARGUMENT, "dst");
  T_CHECK(t_all_bytes(host, sizeof host, 0x11));

  /* the memory calls do what they say */
  t_set_case("backend memory round trip");
  void *d2 = t_dev_alloc(ctx, 256);
  if (d2) {
    unsigned char src[256], back[256];
    for (int i = 0; i < 256; i++) src[i] = (unsigned char)t_rand_u64();
    T_OK(m40llm_memcpy_to_device(ctx, d, src, 256));
    T_OK(m40llm_memset(ctx, d2, 0xA5, 256));
    T_OK(m40llm_memcpy_device(ctx, d2, (unsigned char *)d + 64, 100));
    if (T_OK(m40llm_memcpy_to_host(ctx, back, d2, 256))) {
      T_CHECK(memcmp(back, src + 64, 100) == 0);
      T_CHECK(t_all_bytes(back + 100, 156, 0xA5));
    }
    T_OK(m40llm_memset(ctx, d2, 0x100 + 0x3C, 10)); /* value is taken as unsigned char */
    if (T_OK(m40llm_memcpy_to_host(ctx, back, d2, 256))) {
      T_CHECK(t_all_bytes(back, 10, 0x3C));
      T_CHECK(memcmp(back + 10, src + 74, 90) == 0);
    }
    T_OK(m40llm_free(ctx, d2));
  }
  T_OK(m40llm_free(ctx, d));
}

static void error_paths_context(m40llm_context *ctx) {
  t_set_case("context error paths");
  m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
  T_FAIL_WITH(m40llm_context_device_info(NULL, ctx), M40LLM_ERR_INVALID_ARGUMENT, "out");
  T_FAIL_WITH(m40llm_context_device_info(&info, NULL), M40LLM_ERR_INVALID_ARGUMENT, "ctx");
  memset(&info, 0x5A, sizeof info);
  info.version = 0;
  m40llm_device_info before = info;
  T_FAIL_WITH(m40llm_context_device_info(&info, ctx), M40LLM_ERR_INVALID_ARGUMENT, "version");
  info.version = M40LLM_DEVICE_INFO_VERSION + 1;
  before.version = info.version;
  T_FAIL_WITH(m40llm_context_device_info(&info, ctx), M40LLM_ERR_INVALID_ARGUMENT, "version");
  T_CHECK(memcmp(&info, &before, sizeof info) == 0);
  T_FAIL_WITH(m40llm_context_synchronize(NULL), M40LLM_ERR_INVALID_ARGUMENT, "ctx");
  T_CHECK(m40llm_context_cuda_stream(NULL) == NULL);
  m40llm_context_destroy(NULL);
  m40llm_kvcache_destroy(NULL);
  T_CHECK(1);
}

static void error_paths_cache(m40llm_context *ctx) {
  t_kv kv;
  t_set_case("cache error paths: setup");
  if (t_kv_create(&kv, ctx, 2, 4, 2, 16, 3, 8) != M40LLM_OK) return;
  m40llm_kvcache *c = kv.cache;
  T_OK(t_kv_append_random(&kv, 0, 1, 5, 1.0f));
  T_OK(t_kv_append_random(&kv, 1, 1, 2, 1.0f));
  T_OK(t_kv_append_random(&kv, 0, 2, 8, 1.0f)); /* full */

  const size_t row = kv.model.row;
  const size_t qrow = 4 * 16;
  float *k32 = t_dev_alloc(ctx, 16 * row * sizeof(float));
  float *v32 = t_dev_alloc(ctx, 16 * row * sizeof(float));
  uint16_t *k16 = t_dev_alloc(ctx, 16 * row * sizeof(uint16_t));
  uint16_t *v16 = t_dev_alloc(ctx, 16 * row * sizeof(uint16_t));
  float *q = t_dev_alloc(ctx, 4 * qrow * sizeof(float));
  float *out = t_dev_alloc(ctx, 4 * qrow * sizeof(float));
  if (!k32 || !v32 || !k16 || !v16 || !q || !out) goto done;
  T_OK(m40llm_memset(ctx, k32, 0, 16 * row * sizeof(float)));
  T_OK(m40llm_memset(ctx, v32, 0, 16 * row * sizeof(float)));
  T_OK(m40llm_memset(ctx, k16, 0, 16 * row * sizeof(uint16_t)));
  T_OK(m40llm_memset(ctx, v16, 0, 16 * row * sizeof(uint16_t)));
  T_OK(m40llm_memset(ctx, q, 0, 4 * qrow * sizeof(float)));

  t_set_case("get_options");
  m40llm_kvcache_options got = M40LLM_KVCACHE_OPTIONS_INIT;
  if (T_OK(m40llm_kvcache_get_options(&got, c))) T_CHECK(memcmp(&got, &kv.opts, sizeof got) == 0);
  T_FAIL_WITH(m40llm_kvcache_get_options(NULL, c), M40LLM_ERR_INVALID_ARGUMENT, "out");
  T_FAIL_WITH(m40llm_kvcache_get_options(&got, NULL), M40LLM_ERR_INVALID_ARGUMENT, "cache");
  memset(&got, 0x5A, sizeof got);
  got.version = 0;
  m40llm_kvcache_options got_before = got;
  T_FAIL_WITH(m40llm_kvcache_get_options(&got, c), M40LLM_ERR_INVALID_ARGUMENT, "version");
  T_CHECK(memcmp(&got, &got_before, sizeof got) == 0);

  t_set_case("seq_len");
  int len = -7;
  T_FAIL_WITH(m40llm_kvcache_seq_len(NULL, c, 0, 0), M40LLM_ERR_INVALID_ARGUMENT, "out_len");
  T_FAIL_WITH(m40llm_kvcache_seq_len(&len, NULL, 0, 0), M40LLM_ERR_INVALID_ARGUMENT, "cache");
  T_FAIL_WITH(m40llm_kvcache_seq_len(&len, c, -1, 0), M40LLM_ERR_OUT_OF_RANGE, "layer");
  T_FAIL_WITH(m40llm_kvcache_seq_len(&len, c, 2, 0), M40LLM_ERR_OUT_OF_RANGE, "layer");
  T_FAIL_WITH(m40llm_kvcache_seq_len(&len, c, INT_MIN, 0), M40LLM_ERR_OUT_OF_RANGE, "layer");
  T_FAIL_WITH(m40llm_kvcache_seq_len(&len, c, 0, -1), M40LLM_ERR_OUT_OF_RANGE, "seq");
  T_FAIL_WITH(m40llm_kvcache_seq_len(&len, c, 0, 3), M40LLM_ERR_OUT_OF_RANGE, "seq");
  T_FAIL_WITH(m40llm_kvcache_seq_len(&len, c, 0, INT_MAX), M40LLM_ERR_OUT_OF_RANGE, "seq");
  T_CHECK(len == -7);

  t_set_case("seq_reset / seq_truncate / seq_fork");
  T_FAIL_WITH(m40llm_kvcache_seq_reset(NULL, 0), M40LLM_ERR_INVALID_ARGUMENT, "cache");
  T_FAIL_WITH(m40llm_kvcache_seq_reset(c, -1), M40LLM_ERR_OUT_OF_RANGE, "seq");
  T_FAIL_WITH(m40llm_kvcache_seq_reset(c, 3), M40LLM_ERR_OUT_OF_RANGE, "seq");
  T_FAIL_WITH(m40llm_kvcache_seq_truncate(NULL, 1, 0), M40LLM_ERR_INVALID_ARGUMENT, "cache");
  T_FAIL_WITH(m40llm_kvcache_seq_truncate(c, -1, 0), M40LLM_ERR_OUT_OF_RANGE, "seq");
  T_FAIL_WITH(m40llm_kvcache_seq_truncate(c, 3, 0), M40LLM_ERR_OUT_OF_RANGE, "seq");
  T_FAIL_WITH(m40llm_kvcache_seq_truncate(c, 1, -1), M40LLM_ERR_INVALID_ARGUMENT, "new_len");
  T_FAIL_WITH(m40llm_kvcache_seq_truncate(c, 1, INT_MIN), M40LLM_ERR_INVALID_ARGUMENT, "new_len");
  T_FAIL_WITH(m40llm_kvcache_seq_fork(NULL, 0, 1), M40LLM_ERR_INVALID_ARGUMENT, "cache");
  T_FAIL_WITH(m40llm_kvcache_seq_fork(c, 1, 1), M40LLM_ERR_INVALID_ARGUMENT, "seq");
  T_FAIL_WITH(m40llm_kvcache_seq_fork(c, 0, 0), M40LLM_ERR_INVALID_ARGUMENT, "seq");
  T_FAIL_WITH(m40llm_kvcache_seq_fork(c, 3, 1), M40LLM_ERR_OUT_OF_RANGE, "dst_seq");
  T_FAIL_WITH(m40llm_kvcache_seq_fork(c, -1, 1), M40LLM_ERR_OUT_OF_RANGE, "dst_seq");
  T_FAIL_WITH(m40llm_kvcache_seq_fork(c, 0, 3), M40LLM_ERR_OUT_OF_RANGE, "src_seq");
  T_FAIL_WITH(m40llm_kvcache_seq_fork(c, 0, -1), M40LLM_ERR_OUT_OF_RANGE, "src_seq");

  t_set_case("append");
  for (int f32 = 0; f32 < 2; f32++) {
#define APPEND(cache_, layer_, seq_, kk, vv, n_)                                                 \
  (f32 ? m40llm_kvcache_append_f32((cache_), (layer_), (seq_), (kk) ? k32 : NULL,               \
                                   (vv) ? v32 : NULL, (n_))                                      \
       : m40llm_kvcache_append_f16((cache_), (layer_), (seq_), (kk) ? k16 : NULL,               \
                                   (vv) ? v16 : NULL, (n_)))
    t_set_case("append_%s error paths", f32 ? "f32" : "f16");
    T_FAIL_WITH(APPEND(NULL, 0, 0, 1, 1, 1), M40LLM_ERR_INVALID_ARGUMENT, "cache");
    T_FAIL_WITH(APPEND(c, 0, 0, 0, 1, 1), M40LLM_ERR_INVALID_ARGUMENT, "k");
    T_FAIL_WITH(APPEND(c, 0, 0, 1, 0, 1), M40LLM_ERR_INVALID_ARGUMENT, "v");
    T_FAIL_WITH(APPEND(c, -1, 0, 1, 1, 1), M40LLM_ERR_OUT_OF_RANGE, "layer");
    T_FAIL_WITH(APPEND(c, 2, 0, 1, 1, 1), M40LLM_ERR_OUT_OF_RANGE, "layer");
    T_FAIL_WITH(APPEND(c, 0, -1, 1, 1, 1), M40LLM_ERR_OUT_OF_RANGE, "seq");
    T_FAIL_WITH(APPEND(c, 0, 3, 1, 1, 1), M40LLM_ERR_OUT_OF_RANGE, "seq");
    T_FAIL_WITH(APPEND(c, 0, 0, 1, 1, 0), M40LLM_ERR_INVALID_ARGUMENT, "n_tokens");
    T_FAIL_WITH(APPEND(c, 0, 0, 1, 1, -1), M40LLM_ERR_INVALID_ARGUMENT, "n_tokens");
    T_FAIL_WITH(APPEND(c, 0, 0, 1, 1, INT_MIN), M40LLM_ERR_INVALID_ARGUMENT, "n_tokens");
    /* capacity: (0,1) holds 5 of 8 */
    T_FAIL_WITH(APPEND(c, 0, 1, 1, 1, 4), M40LLM_ERR_CAPACITY, "max_seq_len");
    T_FAIL_WITH(APPEND(c, 0, 1, 1, 1, INT_MAX), M40LLM_ERR_CAPACITY, "max_seq_len");
    T_FAIL_WITH(APPEND(c, 0, 2, 1, 1, 1), M40LLM_ERR_CAPACITY, "max_seq_len"); /* full */
    T_FAIL_WITH(APPEND(c, 0, 0, 1, 1, 9), M40LLM_ERR_CAPACITY, "max_seq_len");  /* empty */
    T_FAIL_WITH(APPEND(c, 1, 0, 1, 1, 16), M40LLM_ERR_CAPACITY, "max_seq_len");
#undef APPEND
  }

  t_set_case("read_f16 error paths");
  {
    const size_t bytes = 16 * row * sizeof(uint16_t);
    T_OK(m40llm_memset(ctx, k16, 0xFF, bytes));
    T_OK(m40llm_memset(ctx, v16, 0xFF, bytes));
    T_FAIL_WITH(m40llm_kvcache_read_f16(k16, v16, NULL, 0, 1, 0, 1), M40LLM_ERR_INVALID_ARGUMENT,
                "cache");
    T_FAIL_WITH(m40llm_kvcache_read_f16(NULL, NULL, c, 0, 1, 0, 1), M40LLM_ERR_INVALID_ARGUMENT,
                "k_out");
    T_FAIL_WITH(m40llm_kvcache_read_f16(k16, v16, c, -1, 1, 0, 1), M40LLM_ERR_OUT_OF_RANGE, "layer");
    T_FAIL_WITH(m40llm_kvcache_read_f16(k16, v16, c, 2, 1, 0, 1), M40LLM_ERR_OUT_OF_RANGE, "layer");
    T_FAIL_WITH(m40llm_kvcache_read_f16(k16, v16, c, 0, -1, 0, 1), M40LLM_ERR_OUT_OF_RANGE, "seq");
    T_FAIL_WITH(m40llm_kvcache_read_f16(k16, v16, c, 0, 3, 0, 1), M40LLM_ERR_OUT_OF_RANGE, "seq");
    T_FAIL_WITH(m40llm_kvcache_read_f16(k16, v16, c, 0, 1, -1, 1), M40LLM_ERR_OUT_OF_RANGE, NULL);
    T_FAIL_WITH(m40llm_kvcache_read_f16(k16, v16, c, 0, 1, 3, 3), M40LLM_ERR_OUT_OF_RANGE, NULL);
    T_FAIL_WITH(m40llm_kvcache_read_f16(k16, v16, c, 0, 1, 5, 1), M40LLM_ERR_OUT_OF_RANGE, NULL);
    T_FAIL_WITH(m40llm_kvcache_read_f16(k16, NULL, c, 0, 1, 0, 6), M40LLM_ERR_OUT_OF_RANGE, NULL);
    T_FAIL_WITH(m40llm_kvcache_read_f16(k16, v16, c, 0, 1, INT_MAX, 1), M40LLM_ERR_OUT_OF_RANGE,
                NULL);
    T_FAIL_WITH(m40llm_kvcache_read_f16(k16, v16, c, 0, 1, 1, INT_MAX), M40LLM_ERR_OUT_OF_RANGE,
                NULL);
    T_FAIL_WITH(m40llm_kvcache_read_f16(k16, v16, c, 0, 0, 0, 1), M40LLM_ERR_OUT_OF_RANGE, NULL);
    T_FAIL_WITH(m40llm_kvcache_read_f16(k16, v16, c, 0, 1, 0, 0), M40LLM_ERR_INVALID_ARGUMENT,
                "n_tokens");
    T_FAIL_WITH(m40llm_kvcache_read_f16(k16, v16, c, 0, 1, 0, -1), M40LLM_ERR_INVALID_ARGUMENT,
                "n_tokens");
    check_poisoned(ctx, k16, bytes, "read_f16 (K)");
    check_poisoned(ctx, v16, bytes, "read_f16 (V)");
  }

  t_set_case("attention error paths");
  {
    const size_t bytes = 4 * qrow * sizeof(float);
    const int32_t ids_ok[3] = {1, 0, 2};
    const int32_t ids_bad_last[3] = {1, 0, 3};
    const int32_t ids_bad_neg[2] = {-1, 0};
    T_OK(m40llm_memset(ctx, out, 0xFF, bytes));
    T_FAIL_WITH(m40llm_kvcache_attn_last_token_f32q(NULL, c, 0, 1, q, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "out");
    T_FAIL_WITH(m40llm_kvcache_attn_last_token_f32q(out, NULL, 0, 1, q, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "cache");
    T_FAIL_WITH(m40llm_kvcache_attn_last_token_f32q(out, c, 0, 1, NULL, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "q");
    T_FAIL_WITH(m40llm_kvcache_attn_last_token_f32q(out, c, -1, 1, q, 0.0f),
                M40LLM_ERR_OUT_OF_RANGE, "layer");
    T_FAIL_WITH(m40llm_kvcache_attn_last_token_f32q(out, c, 2, 1, q, 0.0f),
                M40LLM_ERR_OUT_OF_RANGE, "layer");
    T_FAIL_WITH(m40llm_kvcache_attn_last_token_f32q(out, c, 0, -1, q, 0.0f),
                M40LLM_ERR_OUT_OF_RANGE, "seq");
    T_FAIL_WITH(m40llm_kvcache_attn_last_token_f32q(out, c, 0, 3, q, 0.0f),
                M40LLM_ERR_OUT_OF_RANGE, "seq");
    T_FAIL_WITH(m40llm_kvcache_attn_last_token_f32q(out, c, 0, 1, out, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "overlap");
    T_FAIL_WITH(m40llm_kvcache_attn_last_token_f32q(out + 8, c, 0, 1, out, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "overlap");
    T_FAIL_WITH(m40llm_kvcache_attn_last_token_f32q(out, c, 0, 1, out + qrow - 1, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "overlap");
    T_FAIL_WITH(m40llm_kvcache_attn_last_token_f32q(out, c, 0, 1, q, NAN),
                M40LLM_ERR_INVALID_ARGUMENT, "scale");
    T_FAIL_WITH(m40llm_kvcache_attn_last_token_f32q(out, c, 0, 1, q, INFINITY),
                M40LLM_ERR_INVALID_ARGUMENT, "scale");

    T_FAIL_WITH(m40llm_kvcache_attn_batch_f32q(NULL, c, 0, ids_ok, 3, q, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "out");
    T_FAIL_WITH(m40llm_kvcache_attn_batch_f32q(out, NULL, 0, ids_ok, 3, q, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "cache");
    T_FAIL_WITH(m40llm_kvcache_attn_batch_f32q(out, c, 0, NULL, 3, q, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "seq_ids");
    T_FAIL_WITH(m40llm_kvcache_attn_batch_f32q(out, c, 0, ids_ok, 3, NULL, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "q");
    T_FAIL_WITH(m40llm_kvcache_attn_batch_f32q(out, c, 0, ids_ok, 0, q, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "n_seqs");
    T_FAIL_WITH(m40llm_kvcache_attn_batch_f32q(out, c, 0, ids_ok, -1, q, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "n_seqs");
    T_FAIL_WITH(m40llm_kvcache_attn_batch_f32q(out, c, -1, ids_ok, 3, q, 0.0f),
                M40LLM_ERR_OUT_OF_RANGE, "layer");
    T_FAIL_WITH(m40llm_kvcache_attn_batch_f32q(out, c, 2, ids_ok, 3, q, 0.0f),
                M40LLM_ERR_OUT_OF_RANGE, "layer");
    T_FAIL_WITH(m40llm_kvcache_attn_batch_f32q(out, c, 0, ids_bad_last, 3, q, 0.0f),
                M40LLM_ERR_OUT_OF_RANGE, "seq_ids");
    T_FAIL_WITH(m40llm_kvcache_attn_batch_f32q(out, c, 0, ids_bad_neg, 2, q, 0.0f),
                M40LLM_ERR_OUT_OF_RANGE, "seq_ids");
    /* rows 1.. of out overlap q's rows */
    T_FAIL_WITH(m40llm_kvcache_attn_batch_f32q(out + qrow, c, 0, ids_ok, 3, out, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "overlap");
    T_FAIL_WITH(m40llm_kvcache_attn_batch_f32q(out, c, 0, ids_ok, 3, q, -INFINITY),
                M40LLM_ERR_INVALID_ARGUMENT, "scale");
    /* n_seqs far past the buffers: named as the mistake, before the overlap it causes */
    T_FAIL_WITH(m40llm_kvcache_attn_batch_f32q(out, c, 0, ids_ok, INT_MAX, q, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "n_seqs");
    T_FAIL_WITH(m40llm_kvcache_attn_batch_f32q(out, c, 0, ids_ok, 3,
                                               (const float *)(UINTPTR_MAX - 64), 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "address space");
    T_FAIL_WITH(m40llm_kvcache_attn_batch_f32q((float *)(UINTPTR_MAX - 64), c, 0, ids_ok, 1, q,
                                               0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "address space");
    check_poisoned(ctx, out, bytes, "attention");
  }

  /* nothing above may have changed a length or a stored value */
  t_set_case("cache unchanged after failed calls");
  t_kv_check_contents(&kv);

done:
  m40llm_free(ctx, k32);
  m40llm_free(ctx, v32);
  m40llm_free(ctx, k16);
  m40llm_free(ctx, v16);
  m40llm_free(ctx, q);
  m40llm_free(ctx, out);
  t_kv_destroy(&kv);
}

void t_cases_error_paths(m40llm_context *ctx) {
  error_paths_context(ctx);
  error_paths_memory(ctx);
  error_paths_options(ctx);
  error_paths_cache(ctx);
  t_set_case("");
}

/* ---- Sequence operations --------------------------------------------------------------------- */

static void check_lens(t_kv *kv, int seq, int l0, int l1, int l2) {
  const int want[3] = {l0, l1, l2};
  for (int l = 0; l < 3; l++) {
    int len = -1;
    T_OK(m40llm_kvcache_seq_len(&len, kv->cache, l, seq));
    T_CHECKF(len == want[l], "seq %d layer %d: length %d, expected %d", seq, l, len, want[l]);
  }
}

static void attention_all(t_kv *kv, const char *when) {
  const int n_heads = kv->opts.n_heads, hd = kv->opts.head_dim, max_seqs = kv->opts.max_seqs;
  int32_t ids[16];
  int n = 0;
  for (int s = 0; s < max_seqs; s++) ids[n++] = s;
  ids[n++] = 1;
  ids[n++] = 0;
  float *q = malloc((size_t)n * (size_t)n_heads * (size_t)hd * sizeof(float));
  if (!T_CHECK(q != NULL)) return;
  t_fill_uniform(q, (size_t)n * (size_t)n_heads * (size_t)hd, -2.0f, 2.0f);
  for (int l = 0; l < kv->opts.n_layers; l++) {
    t_set_case("sequence ops: attention %s, layer %d", when, l);
    t_kv_check_attention(kv, l, ids, n, q, 0.0f, 1e-5, 1, NULL);
    t_kv_check_attention(kv, l, ids, 2, q, 0.0f, 1e-5, 0, NULL);
  }
  free(q);
}

void t_cases_sequence_ops(m40llm_context *ctx) {
  t_kv kv;
  t_set_case("sequence ops: setup");
  if (t_kv_create(&kv, ctx, 3, 4, 2, 8, 4, 16) != M40LLM_OK) return;

  /* each layer's append advances only that layer */
  t_set_case("sequence ops: per-layer lengths");
  T_OK(t_kv_append_random(&kv, 0, 0, 1, 1.0f));
  T_OK(t_kv_append_random(&kv, 0, 0, 1, 1.0f));
  T_OK(t_kv_append_random(&kv, 1, 0, 1, 1.0f));
  check_lens(&kv, 0, 2, 1, 0);
  check_lens(&kv, 1, 0, 0, 0);
  T_OK(t_kv_append_random(&kv, 0, 0, 3, 1.0f));
  T_OK(t_kv_append_random(&kv, 1, 0, 2, 1.0f));
  T_OK(t_kv_append_random(&kv, 1, 1, 7, 1.0f));
  T_OK(t_kv_append_random(&kv, 2, 1, 2, 1.0f));
  T_OK(t_kv_append_random(&kv, 0, 1, 5, 1.0f));
  T_OK(t_kv_append_random(&kv, 2, 3, 9, 1.0f));
  check_lens(&kv, 0, 5, 3, 0);
  check_lens(&kv, 1, 5, 7, 2);
  t_kv_check_contents(&kv);
  attention_all(&kv, "after appends");

  /* truncate: to a length between the layers' lengths, then past every length, then 0 */
  t_set_case("sequence ops: truncate");
  T_OK(t_kv_truncate(&kv, 0, 4));
  check_lens(&kv, 0, 4, 3, 0);
  T_OK(t_kv_truncate(&kv, 0, 10));
  check_lens(&kv, 0, 4, 3, 0);
  T_OK(t_kv_truncate(&kv, 0, INT_MAX));
  check_lens(&kv, 0, 4, 3, 0);
  T_OK(t_kv_truncate(&kv, 0, 3));
  check_lens(&kv, 0, 3, 3, 0);
  check_lens(&kv, 1, 5, 7, 2);
  t_kv_check_contents(&kv);
  /* appending after a truncate writes at the new end */
  T_OK(t_kv_append_random(&kv, 0, 0, 4, 1.0f));
  check_lens(&kv, 0, 7, 3, 0);
  t_kv_check_contents(&kv);
  attention_all(&kv, "after truncate");
  T_OK(t_kv_truncate(&kv, 0, 0));
  check_lens(&kv, 0, 0, 0, 0);

  /* reset empties every layer of one sequence only */
  t_set_case("sequence ops: reset");
  T_OK(t_kv_reset(&kv, 1));
  check_lens(&kv, 1, 0, 0, 0);
  check_lens(&kv, 3, 0, 0, 9);
  T_OK(t_kv_reset(&kv, 1)); /* already empty */
  T_OK(t_kv_append_random(&kv, 1, 1, 3, 1.0f));
  check_lens(&kv, 1, 0, 3, 0);
  t_kv_check_contents(&kv);
  attention_all(&kv, "after reset");

  /* fork: every layer's contents and length; the old contents of dst dropped */
  t_set_case("sequence ops: fork");
  T_OK(t_kv_reset(&kv, 0));
  T_OK(t_kv_reset(&kv, 1));
  T_OK(t_kv_append_random(&kv, 0, 1, 7, 1.0f));
  T_OK(t_kv_append_random(&kv, 1, 1, 2, 1.0f));
  T_OK(t_kv_append_random(&kv, 2, 1, 5, 1.0f));
  for (int l = 0; l < 3; l++) T_OK(t_kv_append_random(&kv, l, 2, 12, 1.0f));
  T_OK(t_kv_fork(&kv, 2, 1));
  check_lens(&kv, 2, 7, 2, 5);
  check_lens(&kv, 1, 7, 2, 5);
  t_kv_check_contents(&kv);
  attention_all(&kv, "after fork");
  /* dst and src are independent afterwards */
  T_OK(t_kv_append_random(&kv, 0, 2, 3, 1.0f));
  T_OK(t_kv_append_random(&kv, 1, 1, 4, 1.0f));
  T_OK(t_kv_truncate(&kv, 1, 1));
  check_lens(&kv, 1, 1, 1, 1);
  check_lens(&kv, 2, 10, 2, 5);
  t_kv_check_contents(&kv);
  /* forking an empty sequence empties dst; forking into a lower slot */
  T_OK(t_kv_fork(&kv, 3, 0));
  check_lens(&kv, 3, 0, 0, 0);
  T_OK(t_kv_fork(&kv, 0, 2));
  check_lens(&kv, 0, 10, 2, 5);
  t_kv_check_contents(&kv);
  attention_all(&kv, "after second fork");

  /* filling to exactly max_seq_len works; one more is CAPACITY with nothing changed */
  t_set_case("sequence ops: capacity");
  T_OK(t_kv_append_random(&kv, 1, 3, 16, 1.0f));
  T_OK(t_kv_append_random(&kv, 0, 0, 6, 1.0f));
  check_lens(&kv, 0, 16, 2, 5);
  check_lens(&kv, 3, 0, 16, 0);
  {
    float kf[16 * 16], vf[16 * 16];
    t_fill_uniform(kf, 16 * 16, -1.0f, 1.0f);
    t_fill_uniform(vf, 16 * 16, -1.0f, 1.0f);
    T_STATUS(t_kv_append_f32(&kv, 0, 0, kf, vf, 1), M40LLM_ERR_CAPACITY);
    T_STATUS(t_kv_append_f32(&kv, 1, 0, kf, vf, 15), M40LLM_ERR_CAPACITY);
    T_OK(t_kv_append_f32(&kv, 1, 0, kf, vf, 14));
  }
  check_lens(&kv, 0, 16, 16, 5);
  t_kv_check_contents(&kv);
  attention_all(&kv, "at capacity");
  t_kv_destroy(&kv);
  t_set_case("");
}

/* ---- Attention on small shapes ------------------------------------------------------------- */

static void attention_shape(m40llm_context *ctx, int n_heads, int n_kv_heads, int head_dim) {
  t_kv kv;
  t_set_case("attention %d/%d heads, head_dim %d: setup", n_heads, n_kv_heads, head_dim);
  const int max_seqs = 5, max_len = 300;
  if (t_kv_create(&kv, ctx, 2, n_heads, n_kv_heads, head_dim, max_seqs, max_len) != M40LLM_OK)
    return;
  /* ragged: seq 3 stays empty; layer 0 gets other lengths than layer 1 */
  const int lens[5] = {1, t_rand_int(2, 40), 300, 0, t_rand_int(41, 299)};
  for (int s = 0; s < max_seqs; s++) {
    if (lens[s]) T_OK(t_kv_append_random(&kv, 1, s, lens[s], 1.0f));
    if (s != 3) T_OK(t_kv_append_random(&kv, 0, s, t_rand_int(1, 20), 1.0f));
  }
  const int32_t ids[9] = {2, 0, 3, 4, 1, 2, 3, 0, 2};
  const int n_ids = 9;
  const size_t stride = (size_t)n_heads * (size_t)head_dim;
  float *q = malloc(n_ids * stride * sizeof(float));
  float *got_batch = malloc(n_ids * stride * sizeof(float));
  float *got_single = malloc(n_ids * stride * sizeof(float));
  if (!T_CHECK(q && got_batch && got_single)) goto done;
  const float scales[3] = {0.0f, t_rand_float(0.05f, 0.5f), -0.125f};
  for (int si = 0; si < 3; si++) {
    for (int layer = 0; layer < 2; layer++) {
      t_set_case("attention %d/%d heads, head_dim %d, layer %d, scale %g", n_heads, n_kv_heads,
                 head_dim, layer, (double)scales[si]);
      t_fill_uniform(q, n_ids * stride, -3.0f, 3.0f);
      t_kv_check_attention(&kv, layer, ids, n_ids, q, scales[si], 1e-5, 1, got_batch);
      t_kv_check_attention(&kv, layer, ids, n_ids, q, scales[si], 1e-5, 0, got_single);
      /* the batch and the per-sequence calls agree (bit for bit on the CPU backend) */
      const double agree = backend_of(ctx) == M40LLM_BACKEND_CPU ? 0.0 : 1e-5;
      double num = 0.0, den = 0.0;
      for (size_t i = 0; i < n_ids * stride; i++) {
        double d = (double)got_batch[i] - (double)got_single[i];
        num += d * d;
        den += (double)got_single[i] * got_single[i];
      }
      T_CHECKF(sqrt(num) <= agree * sqrt(den), "batch and single calls differ: %g vs norm %g",
               sqrt(num), sqrt(den));
    }
  }
  /* repeated ids get their own q rows: the same sequence with different q gives other rows */
  t_set_case("attention %d/%d heads, head_dim %d: repeated ids", n_heads, n_kv_heads, head_dim);
  T_CHECK(memcmp(got_batch, got_batch + 5 * stride, stride * sizeof(float)) != 0);
done:
  free(q);
  free(got_batch);
  free(got_single);
  t_kv_destroy(&kv);
}

/* Logits far from zero: a softmax without max subtraction overflows (positive) or underflows to
 * 0/0 (negative); all-negative scores also catch a max taken on a float's bits as an int. Ramps
 * from -100 to +100 along the positions catch a running max that is not carried (FP32 exp
 * overflows past 88.7) and split-K parts whose maxima differ by far more than that. */
static void attention_extreme_logits(m40llm_context *ctx, int n_heads, int n_kv, int hd) {
  const int len = 24, ramp = 1000;
  t_kv kv;
  t_set_case("attention extreme logits %d/%d heads, head_dim %d: setup", n_heads, n_kv, hd);
  if (t_kv_create(&kv, ctx, 1, n_heads, n_kv, hd, 6, ramp) != M40LLM_OK) return;
  const size_t row = (size_t)n_kv * hd;
  float *k = malloc((size_t)ramp * row * sizeof(float));
  float *v = malloc((size_t)ramp * row * sizeof(float));
  float *q = malloc(6 * (size_t)n_heads * hd * sizeof(float));
  if (!T_CHECK(k && v && q)) goto done;
  /* seqs 0..2: first K component 1 everywhere; 3: ramp up, 4: ramp down, 5: high at both ends */
  for (int s = 0; s < 6; s++) {
    const int n = s < 3 ? len : ramp;
    t_fill_uniform(k, (size_t)n * row, -1.0f, 1.0f);
    t_fill_uniform(v, (size_t)n * row, -1.0f, 1.0f);
    for (int t = 0; t < n; t++) {
      const float x = -1.0f + 2.0f * (float)t / (float)(n - 1);
      const float k0 = s < 3 ? 1.0f : s == 3 ? x : s == 4 ? -x : 2.0f * fabsf(x) - 1.0f;
      for (int g = 0; g < n_kv; g++) k[(size_t)t * row + (size_t)g * hd] = k0;
    }
    T_OK(t_kv_append_f32(&kv, 0, s, k, v, n));
  }
  /* |logit| >= ~96 for every position of seqs 0..2: exp overflows FP32 above 88.7 and
   * underflows to zero below -103.9 */
  const float offsets[3] = {100.0f, -110.0f, -140.0f};
  for (int oi = 0; oi < 3; oi++) {
    t_set_case("attention extreme logits %d/%d heads, head_dim %d: offset %g", n_heads, n_kv, hd,
               (double)offsets[oi]);
    t_fill_uniform(q, 3 * (size_t)n_heads * hd, -1.0f, 1.0f);
    for (int r = 0; r < 3 * n_heads; r++) q[r * hd] = offsets[oi];
    const int32_t ids[3] = {0, 1, 2};
    /* logits near |100| carry FP32 rounding of ~1e-5 absolute, hence the looser bound */
    t_kv_check_attention(&kv, 0, ids, 3, q, 1.0f, 1e-4, 1, NULL);
    t_kv_check_attention(&kv, 0, ids, 3, q, 1.0f, 1e-4, 0, NULL);
  }
  t_set_case("attention extreme logits %d/%d heads, head_dim %d: ramps from -100 to +100",
             n_heads, n_kv, hd);
  {
    t_fill_uniform(q, 6 * (size_t)n_heads * hd, -1.0f, 1.0f);
    for (int r = 0; r < 6 * n_heads; r++) q[r * hd] = 100.0f;
    const int32_t ids[6] = {3, 4, 5, 3, 5, 4};
    t_kv_check_attention(&kv, 0, ids, 6, q, 1.0f, 1e-4, 1, NULL);
    t_kv_check_attention(&kv, 0, ids, 3, q, 1.0f, 1e-4, 0, NULL);
  }
  /* one position dominating: q along one key, scaled up */
  t_set_case("attention peaked softmax %d/%d heads, head_dim %d", n_heads, n_kv, hd);
  for (int h = 0; h < n_heads; h++) {
    const int g = h / (n_heads / n_kv), t = t_rand_int(0, len - 1);
    const uint16_t *kt = t_model_k(&kv.model, 0, 1) + (size_t)t * row + (size_t)g * hd;
    for (int d = 0; d < hd; d++) q[h * hd + d] = 8.0f * t_f16_to_f32(kt[d]);
  }
  {
    const int32_t id = 1;
    t_kv_check_attention(&kv, 0, &id, 1, q, 0.0f, 1e-5, 1, NULL);
  }
done:
  free(k);
  free(v);
  free(q);
  t_kv_destroy(&kv);
}

/* seq_ids sharing memory with out (issue 21): the library reads the ids once, before it writes
 * a row, so every row still belongs to the id the caller passed. On the CPU backend out is host
 * memory, so the caller's id array can be out itself; test_gpu.c does the same with managed
 * memory on the CUDA backend (t_check_ids_alias_out). */
void t_check_ids_alias_out(t_kv *kv, int32_t *ids_in_out, float *out, const float *dq,
                           const float *q) {
  const m40llm_kvcache_options *o = &kv->opts;
  const size_t stride = (size_t)o->n_heads * (size_t)o->head_dim;
  enum { N = 9 };
  const int32_t ids[N] = {2, 0, 1, 2, 1, 0, 2, 2, 1};
  float *got = malloc(N * stride * sizeof(float));
  double *ref = malloc(stride * sizeof(double));
  if (!T_CHECK(got && ref)) goto done;
  T_CHECK(N * sizeof(int32_t) <= stride * sizeof(float)); /* the ids lie in out's first row */
  memcpy(ids_in_out, ids, sizeof ids);
  if (!T_OK(m40llm_kvcache_attn_batch_f32q(out, kv->cache, 0, ids_in_out, N, dq, 0.0f)) ||
      !T_OK(m40llm_context_synchronize(kv->ctx)) ||
      !t_dev_download(kv->ctx, got, out, N * stride * sizeof(float)))
    goto done;
  for (int i = 0; i < N; i++) {
    t_ref_attention(ref, q + (size_t)i * stride, t_model_k(&kv->model, 0, ids[i]),
                    t_model_v(&kv->model, 0, ids[i]), t_model_len(&kv->model, 0, ids[i]),
                    o->n_heads, o->n_kv_heads, o->head_dim, 0.0f);
    const double err = t_rel_l2(got + (size_t)i * stride, ref, stride);
    T_CHECKF(err <= 1e-5, "row %d (seq %d): rel L2 %.3g", i, (int)ids[i], err);
  }
done:
  free(got);
  free(ref);
}

static void attention_ids_alias_out(m40llm_context *ctx) {
  if (backend_of(ctx) != M40LLM_BACKEND_CPU) return; /* host ids in device memory: test_gpu.c */
  t_kv kv;
  t_set_case("attention: seq_ids share memory with out");
  if (t_kv_create(&kv, ctx, 1, 4, 2, 16, 3, 40) != M40LLM_OK) return;
  T_OK(t_kv_append_random(&kv, 0, 0, 3, 1.0f));
  T_OK(t_kv_append_random(&kv, 0, 1, 17, 1.0f));
  T_OK(t_kv_append_random(&kv, 0, 2, 40, 1.0f));
  const size_t n = 9 * 4 * 16;
  float *q = malloc(n * sizeof(float));
  float *dq = NULL, *out = t_dev_alloc(ctx, n * sizeof(float));
  if (T_CHECK(q != NULL) && out) {
    t_fill_uniform(q, n, -2.0f, 2.0f);
    dq = t_dev_upload(ctx, q, n * sizeof(float));
    if (dq) t_check_ids_alias_out(&kv, (int32_t *)out, out, dq, q);
  }
  m40llm_free(ctx, dq);
  m40llm_free(ctx, out);
  free(q);
  t_kv_destroy(&kv);
}

void t_cases_attention_basic(m40llm_context *ctx) {
  attention_shape(ctx, 4, 4, 8);
  attention_shape(ctx, 8, 2, 16);
  attention_shape(ctx, 4, 1, 64);
  attention_shape(ctx, 6, 3, 32);
  attention_shape(ctx, 20, 2, 128); /* groups over 8: two tiles a K/V head, the second of 2 */
  attention_shape(ctx, 16, 1, 256);
  attention_extreme_logits(ctx, 4, 2, 16);
  attention_extreme_logits(ctx, 16, 2, 128); /* the tensor-core kernel on sm_80+ */
  attention_extreme_logits(ctx, 12, 4, 80);  /* the same with a 16-dim tail */
  attention_extreme_logits(ctx, 8, 1, 256);  /* the M40's wide 8-head tile, its lazy rescale */
  attention_ids_alias_out(ctx);
  t_set_case("");
}

/* ---- Masked positions ----------------------------------------------------------------------- */

/* K may hold infinities (append_f16 stores any half; append_f32 rounds |x| >= 65520 to inf). A
 * position whose K has -inf in dim d0, where q[d0] > 0 and the rest of K is finite, scores -inf:
 * it must have weight 0 wherever it falls (first, last, the first row of every 16-position tile,
 * whole splits), and a row whose every score is -inf is zeros. */
enum { MASK_FIRST, MASK_LAST, MASK_TILE_STARTS, MASK_ALL, MASK_ALL_BUT_LAST_5, MASK_ALL_BUT_FIRST_3,
       MASK_PATTERNS };
static const char *const mask_names[MASK_PATTERNS] = {
    "first", "last", "first row of every 16", "all", "all but the last 5", "all but the first 3"};

static int masked(int pattern, int t, int len) {
  switch (pattern) {
    case MASK_FIRST: return t == 0;
    case MASK_LAST: return t == len - 1;
    case MASK_TILE_STARTS: return t % 16 == 0;
    case MASK_ALL: return 1;
    case MASK_ALL_BUT_LAST_5: return t < len - 5;
    default: return t >= 3;
  }
}

static void attention_masked_shape(m40llm_context *ctx, int n_heads, int n_kv, int hd) {
  enum { N_LENS = 3, N_SEQS = N_LENS * MASK_PATTERNS };
  const int lens[N_LENS] = {1, 33, 257};
  t_kv kv;
  t_set_case("masked scores %d/%d heads, head_dim %d: setup", n_heads, n_kv, hd);
  if (t_kv_create(&kv, ctx, 1, n_heads, n_kv, hd, N_SEQS, 257) != M40LLM_OK) return;
  const size_t row = (size_t)n_kv * hd, stride = (size_t)n_heads * hd;
  uint16_t *k = malloc(257 * row * sizeof(uint16_t));
  uint16_t *v = malloc(257 * row * sizeof(uint16_t));
  float *q = malloc(N_SEQS * stride * sizeof(float));
  float *got = malloc(N_SEQS * stride * sizeof(float));
  int d0[N_SEQS];
  int32_t ids[N_SEQS];
  if (!T_CHECK(k && v && q && got)) goto done;
  for (int s = 0; s < N_SEQS; s++) {
    const int len = lens[s / MASK_PATTERNS], pattern = s % MASK_PATTERNS;
    d0[s] = t_rand_int(0, hd - 1);
    for (size_t i = 0; i < (size_t)len * row; i++) {
      k[i] = t_f32_to_f16(t_rand_float(-1.0f, 1.0f));
      v[i] = t_f32_to_f16(t_rand_float(-1.0f, 1.0f));
    }
    for (int t = 0; t < len; t++)
      if (masked(pattern, t, len))
        for (int g = 0; g < n_kv; g++) k[(size_t)t * row + (size_t)g * hd + (size_t)d0[s]] = 0xFC00;
    T_OK(t_kv_append_f16(&kv, 0, s, k, v, len));
  }
  /* the rows in shuffled order, so masked sequences sit next to every other kind in a batch */
  for (int i = 0; i < N_SEQS; i++) ids[i] = i;
  for (int i = N_SEQS - 1; i > 0; i--) {
    const int j = t_rand_int(0, i);
    const int32_t x = ids[i];
    ids[i] = ids[j];
    ids[j] = x;
  }
  for (int i = 0; i < N_SEQS; i++) {
    float *qi = q + (size_t)i * stride;
    t_fill_uniform(qi, stride, -1.0f, 1.0f);
    for (int h = 0; h < n_heads; h++) qi[(size_t)h * hd + (size_t)d0[ids[i]]] = t_rand_float(0.25f, 1.0f);
  }
  const float scales[2] = {0.0f, 0.3f};
  for (int si = 0; si < 2; si++)
    for (int use_batch = 1; use_batch >= 0; use_batch--) {
      t_set_case("masked scores %d/%d heads, head_dim %d, scale %g, %s", n_heads, n_kv, hd,
                 (double)scales[si], use_batch ? "batch" : "single calls");
      const double err =
          t_kv_check_attention(&kv, 0, ids, N_SEQS, q, scales[si], 1e-5, use_batch, got);
      if (!T_CHECKF(!isnan(err), "no output to check")) continue;
      for (int i = 0; i < N_SEQS; i++) {
        const int s = ids[i], len = lens[s / MASK_PATTERNS], pattern = s % MASK_PATTERNS;
        int all_masked = 1, zeros = 1;
        for (int t = 0; t < len; t++) all_masked &= masked(pattern, t, len);
        if (!all_masked) continue;
        for (size_t j = 0; j < stride; j++) zeros &= got[(size_t)i * stride + j] == 0.0f;
        T_CHECKF(zeros, "row %d (len %d, masked %s): every score is -inf but the output is not "
                 "all zeros", i, len, mask_names[pattern]);
      }
    }
done:
  free(k);
  free(v);
  free(q);
  free(got);
  t_kv_destroy(&kv);
}

void t_cases_attention_masked(m40llm_context *ctx) {
  const int dims[3] = {64, 128, 256};
  for (int i = 0; i < 3; i++) {
    attention_masked_shape(ctx, 4, 4, dims[i]); /* group 1 */
    attention_masked_shape(ctx, 8, 2, dims[i]); /* group 4 */
    attention_masked_shape(ctx, 8, 1, dims[i]); /* group 8: wide tiles at 128 and 256 */
  }
  t_set_case("");
}

/* ---- FP32 -> FP16 rounding ------------------------------------------------------------------ */

void t_cases_fp16_rounding(m40llm_context *ctx) {
  t_kv kv;
  t_set_case("fp16 rounding: setup");
  const int n_kv = 2, hd = 128, n_tok = 64;
  if (t_kv_create(&kv, ctx, 1, 2, n_kv, hd, 2, n_tok) != M40LLM_OK) return;
  const size_t n = (size_t)n_tok * (size_t)n_kv * (size_t)hd;
  float *x = malloc(n * sizeof(float));
  float *y = malloc(n * sizeof(float));
  uint16_t *hk = malloc(n * sizeof(uint16_t));
  uint16_t *hv = malloc(n * sizeof(uint16_t));
  if (!T_CHECK(x && y && hk && hv)) goto done;
  size_t i = 0;
  const float specials[] = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, -65504.0f, 65519.99f, 65520.0f,
                            -65520.0f, 1e9f, INFINITY, -INFINITY, 5.9604644775390625e-8f,
                            2.98023223876953125e-8f, 2.9802326e-8f, 1e-30f, -1e-30f,
                            1.401298464e-45f, 6.103515625e-5f, 6.0975552e-5f, 3.0517578125e-5f,
                            0.333333343f, 2049.0f, 2051.0f, 4097.0f, -3.14159265f};
  for (size_t s = 0; s < sizeof specials / sizeof specials[0]; s++) x[i++] = specials[s];
  /* exact ties and their neighbours, over the normal and subnormal range */
  while (i + 3 <= n / 2) {
    int e = t_rand_int(-24, 15);
    uint32_t h;
    if (e < -14) {
      h = (uint32_t)t_rand_int(0, 0x3FE); /* a subnormal half; tie to the next one */
      double lo = (double)h * ldexp(1.0, -24);
      double tie = lo + ldexp(1.0, -25);
      float f = (float)tie;
      x[i++] = f;
      x[i++] = nextafterf(f, INFINITY);
      x[i++] = nextafterf(f, 0.0f);
    } else {
      h = ((uint32_t)(e + 15) << 10) | (uint32_t)t_rand_int(0, 0x3FF);
      uint32_t b = t_f32_bits(t_f16_to_f32((uint16_t)h)) + 0x1000u; /* half an FP16 ulp up */
      float f = t_f32_from_bits(b);
      if (t_rand_u64() & 1) f = -f;
      x[i++] = f;
      x[i++] = t_f32_from_bits(t_f32_bits(f) + 1);
      x[i++] = t_f32_from_bits(t_f32_bits(f) - 1);
    }
  }
  /* random magnitudes from well below the subnormals to past the overflow */
  while (i < n) {
    uint32_t sign = (uint32_t)(t_rand_u64() & 1) << 31;
    uint32_t exp = (uint32_t)t_rand_int(127 - 30, 127 + 17);
    uint32_t mant = (uint32_t)(t_rand_u64() & 0x7FFFFF);
    x[i++] = t_f32_from_bits(sign | (exp << 23) | mant);
  }
  /* V gets the same values in another order, so K/V mix-ups show */
  for (size_t j = 0; j < n; j++) y[j] = x[n - 1 - j];

  t_set_case("fp16 rounding: append_f32 vs independent converter");
  if (T_OK(t_kv_append_f32(&kv, 0, 0, x, y, n_tok))) t_kv_check_contents(&kv);

  t_set_case("fp16 rounding: NaN stays NaN");
  {
    float kn[2 * 128], vn[2 * 128];
    for (int j = 0; j < 2 * 128; j++) {
      kn[j] = t_f32_from_bits(0x7FC00000u | (uint32_t)j);
      vn[j] = t_f32_from_bits(0xFF800001u + (uint32_t)j * 97u);
    }
    float *dk = t_dev_upload(ctx, kn, sizeof kn), *dv = t_dev_upload(ctx, vn, sizeof vn);
    uint16_t *rk = t_dev_alloc(ctx, 2 * 128 * sizeof(uint16_t));
    uint16_t *rv = t_dev_alloc(ctx, 2 * 128 * sizeof(uint16_t));
    uint16_t bk[2 * 128], bv[2 * 128];
    if (dk && dv && rk && rv && T_OK(m40llm_kvcache_append_f32(kv.cache, 0, 1, dk, dv, 1)) &&
        T_OK(m40llm_kvcache_read_f16(rk, rv, kv.cache, 0, 1, 0, 1)) &&
        t_dev_download(ctx, bk, rk, sizeof bk) && t_dev_download(ctx, bv, rv, sizeof bv)) {
      int nan_ok = 1;
      for (int j = 0; j < 2 * 128; j++) nan_ok &= t_f16_is_nan(bk[j]) && t_f16_is_nan(bv[j]);
      T_CHECKF(nan_ok, "FP32 NaN did not become an FP16 NaN");
    }
    m40llm_free(ctx, dk);
    m40llm_free(ctx, dv);
    m40llm_free(ctx, rk);
    m40llm_free(ctx, rv);
    T_OK(m40llm_kvcache_seq_reset(kv.cache, 1)); /* the model did not see this append */
  }

  /* append_f16 stores every bit pattern as is, NaNs and infinities included */
  t_set_case("fp16 rounding: append_f16 round trip of all 65536 patterns");
  for (int part = 0; part < 65536 / (int)(n / 2); part++) {
    for (size_t j = 0; j < n; j++) {
      hk[j] = (uint16_t)((size_t)part * (n / 2) + j % (n / 2));
      hv[j] = (uint16_t)~hk[j];
    }
    T_OK(m40llm_kvcache_seq_reset(kv.cache, 0));
    t_model_reset(&kv.model, 0);
    if (T_OK(t_kv_append_f16(&kv, 0, 0, hk, hv, n_tok))) t_kv_check_contents(&kv);
  }
done:
  free(x);
  free(y);
  free(hk);
  free(hv);
  t_kv_destroy(&kv);
  t_set_case("");
}
