/* The capacity planner (m40llm_kvcache_max_seq_len and _on_device): every answer is checked
 * against m40llm_kvcache_bytes_needed (the answer fits, one position more does not), for every
 * format, with the edges (budgets below one position, budgets past INT_MAX positions or past
 * size_t), NULL arguments and bad options. The device call runs where a GPU is present. */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

static const struct {
  const char *name;
  int k, v;
} formats[] = {{"F16", M40LLM_KV_F16, M40LLM_KV_SAME},
               {"Q8", M40LLM_KV_Q8, M40LLM_KV_SAME},
               {"Q4", M40LLM_KV_Q4, M40LLM_KV_SAME},
               {"K Q8 / V Q4", M40LLM_KV_Q8, M40LLM_KV_Q4},
               {"K Q4 / V Q3", M40LLM_KV_Q4, M40LLM_KV_Q3},
               {"K Q4 / V Q2", M40LLM_KV_Q4, M40LLM_KV_Q2}};
enum { N_FORMATS = sizeof formats / sizeof formats[0] };

static m40llm_kvcache_options shape(int n_layers, int n_kv_heads, int head_dim, int max_seqs,
                                    int format, int v_format) {
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = n_layers;
  o.n_kv_heads = n_kv_heads;
  o.n_heads = n_kv_heads * 4;
  o.head_dim = head_dim;
  o.max_seqs = max_seqs;
  o.format = format;
  o.v_format = v_format;
  return o;
}

/* Whether a cache of o with len positions fits budget, as bytes_needed says (a size it refuses
 * does not fit). */
static int fits(m40llm_kvcache_options o, int len, size_t budget) {
  size_t bytes = 0;
  o.max_seq_len = len;
  return m40llm_kvcache_bytes_needed(&bytes, &o) == M40LLM_OK && bytes <= budget;
}

static size_t bytes_at(m40llm_kvcache_options o, int len) {
  size_t bytes = 0;
  o.max_seq_len = len;
  T_OK(m40llm_kvcache_bytes_needed(&bytes, &o));
  return bytes;
}

/* Plans o for budget, checks that the answer fits and one more does not; returns the answer
 * (0 when the call failed). */
static int check_plan(const m40llm_kvcache_options *o, size_t budget) {
  int len = 0;
  if (!T_OK(m40llm_kvcache_max_seq_len(&len, o, budget))) return 0;
  T_CHECKF(len >= 1 && fits(*o, len, budget), "answer %d does not fit %zu bytes", len, budget);
  T_CHECKF(len == INT_MAX || !fits(*o, len + 1, budget), "answer %d + 1 still fits %zu bytes",
           len, budget);
  return len;
}

static void test_every_format(void) {
  for (int f = 0; f < N_FORMATS; f++) {
    t_set_case("plan, %s, random shapes and budgets", formats[f].name);
    for (int i = 0; i < 40; i++) {
      const m40llm_kvcache_options o =
          shape(t_rand_int(1, 80), t_rand_int(1, 16), 32 * t_rand_int(1, 8), t_rand_int(1, 64),
                formats[f].k, formats[f].v);
      const size_t one = bytes_at(o, 1);
      /* Any budget from one position up to 1 TiB. */
      check_plan(&o, one + (size_t)(t_rand_unit() * (double)((size_t)1 << 40)));
      /* Exactly L positions fit; a byte less and only L - 1 do. */
      const int want = t_rand_int(2, 1 << 20);
      const size_t exact = bytes_at(o, want);
      T_INT_EQ(check_plan(&o, exact), want);
      T_INT_EQ(check_plan(&o, exact - 1), want - 1);
      T_INT_EQ(check_plan(&o, bytes_at(o, want + 1) - 1), want);
    }
  }
}

static void test_edges(void) {
  const m40llm_kvcache_options o = shape(32, 8, 128, 1, M40LLM_KV_F16, M40LLM_KV_SAME);
  const size_t one = bytes_at(o, 1); /* 2 x 32 x 8 x 128 x 2 bytes */
  T_CHECK(one == (size_t)131072);

  t_set_case("plan, budget below one position");
  const size_t small[] = {0, 1, one - 1};
  for (size_t i = 0; i < sizeof small / sizeof small[0]; i++) {
    int len = 12345;
    T_FAIL_WITH(m40llm_kvcache_max_seq_len(&len, &o, small[i]), M40LLM_ERR_CAPACITY,
                "one position");
    T_INT_EQ(len, 12345);
  }
  T_INT_EQ(check_plan(&o, one), 1);

  t_set_case("plan, opts->max_seq_len is ignored and opts unchanged");
  const int ignored[] = {0, -7, 1, INT_MAX, INT_MIN};
  const size_t budget = (size_t)12 << 30;
  T_INT_EQ(check_plan(&o, budget), 98304); /* 12 GiB / 128 KiB */
  for (size_t i = 0; i < sizeof ignored / sizeof ignored[0]; i++) {
    m40llm_kvcache_options with = o;
    with.max_seq_len = ignored[i];
    const m40llm_kvcache_options before = with;
    T_INT_EQ(check_plan(&with, budget), 98304);
    T_CHECK(memcmp(&with, &before, sizeof with) == 0);
  }

  t_set_case("plan, budgets past INT_MAX positions");
  const m40llm_kvcache_options tiny = shape(1, 1, 1, 1, M40LLM_KV_F16, M40LLM_KV_SAME);
  T_INT_EQ(check_plan(&tiny, SIZE_MAX), INT_MAX);
  T_INT_EQ(check_plan(&tiny, (size_t)4 * INT_MAX), INT_MAX);
  T_INT_EQ(check_plan(&tiny, (size_t)4 * INT_MAX - 1), INT_MAX - 1);
  T_INT_EQ(check_plan(&o, SIZE_MAX), INT_MAX); /* 2^48 bytes: fits a 64-bit size_t */

  /* 2^46 bytes a position: 2^18 positions would be 2^64, past size_t. The lengths bytes_needed
   * refuses on the way are not failures: the thread's last message stays the caller's. */
  t_set_case("plan, budgets past size_t");
  const m40llm_kvcache_options wide = shape(1 << 16, 16, 256, 1 << 16, M40LLM_KV_F16,
                                            M40LLM_KV_SAME);
  T_FAIL_WITH(m40llm_kvcache_bytes_needed(NULL, &wide), M40LLM_ERR_INVALID_ARGUMENT, "out_bytes");
  char before[512];
  snprintf(before, sizeof before, "%s", m40llm_last_error_message());
  int len = 0;
  T_OK(m40llm_kvcache_max_seq_len(&len, &wide, SIZE_MAX));
  T_CHECKF(strcmp(m40llm_last_error_message(), before) == 0, "last message became \"%s\"",
           m40llm_last_error_message());
  if (SIZE_MAX == UINT64_MAX) T_INT_EQ(check_plan(&wide, SIZE_MAX), (1 << 18) - 1);
}

static void test_bad_arguments(void) {
  const m40llm_kvcache_options good = shape(4, 2, 64, 3, M40LLM_KV_Q8, M40LLM_KV_SAME);
  int len = 12345;

  t_set_case("plan, NULL arguments");
  T_FAIL_WITH(m40llm_kvcache_max_seq_len(NULL, &good, SIZE_MAX), M40LLM_ERR_INVALID_ARGUMENT,
              "out_max_seq_len");
  T_FAIL_WITH(m40llm_kvcache_max_seq_len(&len, NULL, SIZE_MAX), M40LLM_ERR_INVALID_ARGUMENT,
              "opts");
  T_INT_EQ(len, 12345);

  /* Each bad option fails as bytes_needed fails on it (with max_seq_len 1): status and message. */
  m40llm_kvcache_options bad[14];
  int n = 0;
  for (int i = 0; i < 14; i++) bad[i] = good;
  bad[n++].version = 0;
  bad[n++].version = M40LLM_KVCACHE_OPTIONS_VERSION + 1;
  bad[n++].n_layers = 0;
  bad[n++].n_heads = -1;
  bad[n].n_heads = 6;
  bad[n++].n_kv_heads = 4;
  bad[n++].n_kv_heads = 0;
  bad[n++].head_dim = 0;
  bad[n++].head_dim = 257;
  bad[n++].head_dim = 48; /* Q8 needs a multiple of 32 */
  bad[n++].max_seqs = 0;
  bad[n++].format = 5;
  bad[n++].format = M40LLM_KV_Q2; /* V only */
  bad[n++].v_format = -2;
  bad[n].n_layers = INT_MAX; /* past size_t with one position */
  bad[n].max_seqs = INT_MAX;
  bad[n].n_heads = bad[n].n_kv_heads = 16;
  bad[n++].head_dim = 256;
  for (int i = 0; i < n; i++) {
    t_set_case("plan, bad options %d", i);
    m40llm_kvcache_options at_one = bad[i];
    at_one.max_seq_len = 1;
    size_t bytes = 0;
    const int want = m40llm_kvcache_bytes_needed(&bytes, &at_one);
    if (!T_CHECK(want != M40LLM_OK)) continue;
    char want_msg[512];
    snprintf(want_msg, sizeof want_msg, "%s", m40llm_last_error_message());
    T_FAIL_WITH(m40llm_kvcache_max_seq_len(&len, &bad[i], SIZE_MAX), want, want_msg);
    T_INT_EQ(len, 12345);
  }
}

/* A version-1 caller's struct ends before v_format: the planner must not read past it (the ASan
 * build catches that) and plans it as an FP16 cache. */
static void test_version_1(void) {
  t_set_case("plan, version-1 options");
  typedef struct {
    unsigned version;
    int n_layers, n_heads, n_kv_heads, head_dim, max_seqs, max_seq_len, format;
  } options_v1;
  _Static_assert(sizeof(options_v1) == offsetof(m40llm_kvcache_options, v_format), "v1 layout");
  options_v1 *old = malloc(sizeof *old);
  if (!T_CHECK(old != NULL)) return;
  *old = (options_v1){1, 32, 32, 8, 128, 1, 0, M40LLM_KV_Q4};
  const m40llm_kvcache_options *as_v1 = (const m40llm_kvcache_options *)(void *)old;
  int len = 0;
  if (T_OK(m40llm_kvcache_max_seq_len(&len, as_v1, (size_t)1 << 30)))
    T_INT_EQ(len, check_plan(&(m40llm_kvcache_options){M40LLM_KVCACHE_OPTIONS_VERSION, 32, 32, 8,
                                                        128, 1, 0, M40LLM_KV_Q4, M40LLM_KV_SAME,
                                                        M40LLM_ROTATE_NONE, 0, 0, 0, {{0, 0, 0}}, 0, 0},
                             (size_t)1 << 30));
  free(old);
}

static void test_on_device_cpu(void) {
  t_set_case("plan on device, CPU backend");
  m40llm_context_options co = M40LLM_CONTEXT_OPTIONS_INIT;
  co.backend = M40LLM_BACKEND_CPU;
  m40llm_context *ctx = NULL;
  if (!T_OK(m40llm_context_create(&ctx, &co))) return;
  const m40llm_kvcache_options o = shape(4, 2, 64, 3, M40LLM_KV_F16, M40LLM_KV_SAME);
  int len = 12345;
  T_FAIL_WITH(m40llm_kvcache_max_seq_len_on_device(&len, ctx, &o, 0), M40LLM_ERR_UNSUPPORTED,
              "m40llm_kvcache_max_seq_len");
  T_FAIL_WITH(m40llm_kvcache_max_seq_len_on_device(NULL, ctx, &o, 0),
              M40LLM_ERR_INVALID_ARGUMENT, "out_max_seq_len");
  T_FAIL_WITH(m40llm_kvcache_max_seq_len_on_device(&len, NULL, &o, 0),
              M40LLM_ERR_INVALID_ARGUMENT, "ctx");
  T_FAIL_WITH(m40llm_kvcache_max_seq_len_on_device(&len, ctx, NULL, 0),
              M40LLM_ERR_INVALID_ARGUMENT, "opts");
  m40llm_kvcache_options bad = o;
  bad.n_layers = 0;
  T_FAIL_WITH(m40llm_kvcache_max_seq_len_on_device(&len, ctx, &bad, 0),
              M40LLM_ERR_INVALID_ARGUMENT, "n_layers");
  T_INT_EQ(len, 12345);
  m40llm_context_destroy(ctx);
}

/* On a GPU: the answer fits the free memory less the reserve, a cache of it can be created,
 * the CUDA backend's head_dim rule applies, and a reserve of everything leaves nothing. */
static void test_on_device_gpu(void) {
  int count = 0;
  T_OK(m40llm_cuda_device_count(&count));
  if (count == 0) {
    t_skip("plan on device: no CUDA build or no GPU");
    return;
  }
  t_set_case("plan on device, CUDA backend");
  m40llm_context_options co = M40LLM_CONTEXT_OPTIONS_INIT;
  co.backend = M40LLM_BACKEND_CUDA;
  m40llm_context *ctx = NULL;
  if (!T_OK(m40llm_context_create(&ctx, &co))) return;
  m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
  T_OK(m40llm_context_device_info(&info, ctx));
  m40llm_kvcache_options o = shape(32, 8, 128, 1, M40LLM_KV_Q8, M40LLM_KV_SAME);
  int len = 12345;
  T_FAIL_WITH(m40llm_kvcache_max_seq_len_on_device(&len, ctx, &o, SIZE_MAX),
              M40LLM_ERR_CAPACITY, "free");
  m40llm_kvcache_options odd = shape(2, 2, 12, 1, M40LLM_KV_F16, M40LLM_KV_SAME);
  T_FAIL_WITH(m40llm_kvcache_max_seq_len_on_device(&len, ctx, &odd, 0), M40LLM_ERR_UNSUPPORTED,
              "head_dim");
  T_INT_EQ(len, 12345);
  if (T_OK(m40llm_kvcache_max_seq_len_on_device(&len, ctx, &o, M40LLM_DEVICE_RESERVE_DEFAULT))) {
    T_CHECKF(fits(o, len, info.total_memory), "answer %d does not fit the device", len);
    o.max_seq_len = len;
    m40llm_kvcache *c = NULL;
    T_OK(m40llm_kvcache_create(&c, ctx, &o));
    m40llm_kvcache_destroy(c);
  }
  m40llm_context_destroy(ctx);
}

int main(void) {
  t_rng_init();
  test_every_format();
  test_edges();
  test_bad_arguments();
  test_version_1();
  test_on_device_cpu();
  test_on_device_gpu();
  t_set_case("");
  return t_finish();
}
