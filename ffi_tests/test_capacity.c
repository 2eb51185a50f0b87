/* The capacity planner (m40llm_kvcache_max_seq_len and _on_device): every answer is checked
 * against m40llm_kvcache_bytes_needed (the answer fits, one position more does not), for every
 * format, with the edges (budgets below one position, budgets past INT_MAX positions or past
 * size_t), NULL arguments and bad options. The device call runs where a GPU is present. */
#include <limits.h>
#include <stddef.h>
#include <math.h>
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
                                                        M40LLM_ROTATE_NONE, 0, 0, 0, {{0, 0, 0}}, 0,
                                                        0, 0.0f},
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

/* ---- m40llm_kvcache_plan_tiers ---- */

static const int tier_pairs[5][2] = {{M40LLM_KV_Q8, M40LLM_KV_Q8},
                                     {M40LLM_KV_Q8, M40LLM_KV_Q4},
                                     {M40LLM_KV_Q4, M40LLM_KV_Q4},
                                     {M40LLM_KV_Q4, M40LLM_KV_Q3},
                                     {M40LLM_KV_Q4, M40LLM_KV_Q2}};

/* Options of n tiers drawn from tier_pairs in random order (repeats allowed), rows as junk the
 * planner must overwrite. */
static m40llm_kvcache_options tiered(int n_layers, int n_kv_heads, int head_dim, int max_seqs,
                                     int max_seq_len, int n) {
  m40llm_kvcache_options o = shape(n_layers, n_kv_heads, head_dim, max_seqs, 0, 0);
  o.max_seq_len = max_seq_len;
  o.n_sinks = t_rand_int(0, 8);
  o.window = t_rand_int(0, 3) == 0 ? 0 : t_rand_int(1, 256);
  o.placement = t_rand_int(0, 1) ? M40LLM_PLACE_IMPORTANCE : M40LLM_PLACE_FIRST_FREE;
  o.n_tiers = n;
  for (int t = 0; t < n; t++) {
    const int p = t_rand_int(0, 4);
    o.tiers[t] = (m40llm_kv_tier){tier_pairs[p][0], tier_pairs[p][1], t_rand_int(-5, 99)};
  }
  o.format = o.tiers[0].k_format;
  o.v_format = o.tiers[0].v_format;
  return o;
}

/* Options of the shape with the study's four pairs (K8V8, K8V4, K4V3, K4V2), rows 0. */
static m40llm_kvcache_options study_tiers(int n_layers, int n_kv_heads, int head_dim,
                                          int max_seqs, int max_seq_len) {
  m40llm_kvcache_options o = shape(n_layers, n_kv_heads, head_dim, max_seqs, M40LLM_KV_Q8,
                                   M40LLM_KV_Q8);
  static const int study[4] = {0, 1, 3, 4};
  o.max_seq_len = max_seq_len;
  o.n_tiers = 4;
  for (int t = 0; t < 4; t++)
    o.tiers[t] = (m40llm_kv_tier){tier_pairs[study[t]][0], tier_pairs[study[t]][1], 0};
  return o;
}

/* The stored K/V's bytes of o with these rows: the planner's measure, without what the
 * importance placement keeps besides. */
static size_t tier_bytes_of(m40llm_kvcache_options o, const int *rows) {
  for (int t = 0; t < o.n_tiers; t++) o.tiers[t].rows = rows[t];
  o.placement = M40LLM_PLACE_FIRST_FREE;
  size_t bytes = 0;
  T_OK(m40llm_kvcache_bytes_needed(&bytes, &o));
  return bytes;
}

static double values_of(const m40llm_kvcache_options *o) {
  return 2.0 * o->n_layers * o->max_seqs * (double)o->max_seq_len * o->n_kv_heads * o->head_dim;
}

/* Plans o for bits and checks the answer from the outside: the rows every position that can
 * leave the window needs, in at most two tiers adjacent in cost that bracket the target (or
 * all in the dearest), within the target, and no row of the cheaper one could move up. The
 * costs come from bytes_needed; the rows and the bracket are this test's own arithmetic.
 * Returns the status. */
static int check_tier_plan(m40llm_kvcache_options *o, double bits) {
  const m40llm_kvcache_options before = *o;
  const int sinks = o->n_sinks < o->max_seq_len ? o->n_sinks : o->max_seq_len;
  const int room = o->max_seq_len - sinks;
  const int need = room - (o->window < room ? o->window : room);
  const double budget = floor(bits * values_of(o) / 8.0);
  size_t cost[M40LLM_MAX_TIERS];
  for (int t = 0; t < o->n_tiers; t++) {
    int rows[M40LLM_MAX_TIERS] = {0};
    rows[t] = need;
    cost[t] = tier_bytes_of(*o, rows);
  }
  size_t lo_cost = SIZE_MAX, hi_cost = 0;
  for (int t = 0; t < o->n_tiers; t++) {
    lo_cost = cost[t] < lo_cost ? cost[t] : lo_cost;
    hi_cost = cost[t] > hi_cost ? cost[t] : hi_cost;
  }
  const int rc = m40llm_kvcache_plan_tiers(o, bits);
  if ((double)lo_cost > budget) {
    T_FAIL_WITH(rc, M40LLM_ERR_CAPACITY, "cheapest");
    T_CHECK(memcmp(o, &before, sizeof *o) == 0);
    return rc;
  }
  if (!T_OK(rc)) return rc;
  int sum = 0, used = 0, hi = -1, lo = -1;
  for (int t = 0; t < o->n_tiers; t++) {
    T_CHECKF(o->tiers[t].rows >= 0, "tier %d got %d rows", t, o->tiers[t].rows);
    T_CHECK(o->tiers[t].k_format == before.tiers[t].k_format &&
            o->tiers[t].v_format == before.tiers[t].v_format);
    sum += o->tiers[t].rows;
    if (o->tiers[t].rows == 0) continue;
    used++;
    if (hi < 0 || cost[t] > cost[hi]) lo = hi, hi = t; else lo = t;
  }
  T_INT_EQ(sum, need);
  T_CHECKF(used <= 2, "%d tiers hold rows", used);
  if (o->placement == M40LLM_PLACE_IMPORTANCE) { /* planned as the stored K/V alone */
    m40llm_kvcache_options first_free = before;
    first_free.placement = M40LLM_PLACE_FIRST_FREE;
    if (T_OK(m40llm_kvcache_plan_tiers(&first_free, bits)))
      for (int t = 0; t < o->n_tiers; t++) T_INT_EQ(first_free.tiers[t].rows, o->tiers[t].rows);
  }
  const size_t bytes = tier_bytes_of(*o, (int[M40LLM_MAX_TIERS]){o->tiers[0].rows,
                                                                 o->tiers[1].rows,
                                                                 o->tiers[2].rows,
                                                                 o->tiers[3].rows});
  T_CHECKF((double)bytes <= budget, "%zu bytes for a budget of %.0f", bytes, budget);
  if ((double)hi_cost <= budget) {
    if (need > 0) T_CHECKF(used == 1 && cost[hi] == hi_cost, "within the target, not all in "
                           "the dearest tier");
    return rc;
  }
  if (need == 0) return rc;
  /* Two tiers (or one of them at 0 or need rows): the pair adjacent in cost that brackets. */
  int a = hi, b = lo;
  if (used == 1) {  /* the other of the pair holds none: find it by the bracket */
    a = b = -1;
    for (int t = 0; t < o->n_tiers; t++) {
      if ((double)cost[t] > budget && (a < 0 || cost[t] < cost[a])) a = t;
      if ((double)cost[t] <= budget && (b < 0 || cost[t] > cost[b])) b = t;
    }
    T_CHECKF(o->tiers[b].rows == need, "the rows are not in the bracket's cheaper tier");
    int up[M40LLM_MAX_TIERS] = {0};
    up[a] = 1, up[b] = need - 1;
    T_CHECKF((double)tier_bytes_of(*o, up) > budget, "a row in tier %d still fits", a);
    return rc;
  }
  T_CHECKF((double)cost[a] > budget && (double)cost[b] <= budget, "the pair does not bracket");
  for (int t = 0; t < o->n_tiers; t++)
    T_CHECKF(!(cost[t] < cost[a] && cost[t] > cost[b]), "tier %d lies between the pair", t);
  int up[M40LLM_MAX_TIERS];
  for (int t = 0; t < M40LLM_MAX_TIERS; t++) up[t] = t < o->n_tiers ? o->tiers[t].rows : 0;
  up[a]++, up[b]--;
  T_CHECKF((double)tier_bytes_of(*o, up) > budget, "a row more in tier %d still fits", a);
  return rc;
}

static void test_plan_tiers(void) {
  t_set_case("plan tiers, random shapes, tiers and targets");
  for (int i = 0; i < 300; i++) {
    m40llm_kvcache_options o = tiered(t_rand_int(1, 40), t_rand_int(1, 8), 32 * t_rand_int(1, 8),
                                       t_rand_int(1, 16), t_rand_int(1, 40000),
                                       t_rand_int(1, M40LLM_MAX_TIERS));
    check_tier_plan(&o, 2.0 + 10.0 * t_rand_unit());
  }

  /* Llama-3-8B's shape, one 32K sequence, the study's four pairs; 6 bits splits K8V4 and K4V3. */
  t_set_case("plan tiers, the study's pairs at 6 bits");
  m40llm_kvcache_options o = study_tiers(32, 8, 128, 1, 32768);
  if (T_OK(check_tier_plan(&o, 6.0))) {
    T_CHECK(o.tiers[0].rows == 0 && o.tiers[3].rows == 0);
    T_CHECKF(o.tiers[1].rows > 0 && o.tiers[2].rows > 0, "rows %d, %d", o.tiers[1].rows,
             o.tiers[2].rows);
  }
  /* Exact costs as targets: each pair alone, and the bracket's edges. */
  t_set_case("plan tiers, targets at a tier's own cost");
  for (int t = 0; t < 4; t++) {
    m40llm_kvcache_options e = o;
    int rows[M40LLM_MAX_TIERS] = {0};
    rows[t] = o.max_seq_len - 4 - 128;
    const double bits = 8.0 * (double)tier_bytes_of(e, rows) / values_of(&e);
    if (T_OK(check_tier_plan(&e, bits))) T_INT_EQ(e.tiers[t].rows, rows[t]);
    e = o;
    check_tier_plan(&e, nextafter(bits, 0.0));
    e = o;
    check_tier_plan(&e, nextafter(bits, 100.0));
  }
  t_set_case("plan tiers, all positions in the window");
  m40llm_kvcache_options w = o;
  w.max_seq_len = 100;
  if (T_OK(check_tier_plan(&w, 16.0)))
    for (int t = 0; t < 4; t++) T_INT_EQ(w.tiers[t].rows, 0);
  w = o;
  w.max_seq_len = 100;
  check_tier_plan(&w, 15.9);
}

static void test_plan_tiers_errors(void) {
  t_set_case("plan tiers, bad arguments leave opts unchanged");
  m40llm_kvcache_options o = tiered(4, 2, 64, 3, 1000, 2);
  const m40llm_kvcache_options before = o;
  T_FAIL_WITH(m40llm_kvcache_plan_tiers(NULL, 6.0), M40LLM_ERR_INVALID_ARGUMENT, "opts");
  const double bad_bits[] = {0.0, -1.0, NAN, INFINITY, -INFINITY};
  for (size_t i = 0; i < sizeof bad_bits / sizeof bad_bits[0]; i++)
    T_FAIL_WITH(m40llm_kvcache_plan_tiers(&o, bad_bits[i]), M40LLM_ERR_INVALID_ARGUMENT,
                "bits_per_value");
  T_FAIL_WITH(m40llm_kvcache_plan_tiers(&o, 0.5), M40LLM_ERR_CAPACITY, "cheapest");
  m40llm_kvcache_options none = o;
  none.n_tiers = 0;
  T_FAIL_WITH(m40llm_kvcache_plan_tiers(&none, 6.0), M40LLM_ERR_INVALID_ARGUMENT, "n_tiers");
  none.n_tiers = M40LLM_MAX_TIERS + 1;
  T_FAIL_WITH(m40llm_kvcache_plan_tiers(&none, 6.0), M40LLM_ERR_INVALID_ARGUMENT, "n_tiers");
  m40llm_kvcache_options v3 = o;
  v3.version = 3;
  T_FAIL_WITH(m40llm_kvcache_plan_tiers(&v3, 6.0), M40LLM_ERR_INVALID_ARGUMENT, "n_tiers");
  /* Options bytes_needed refuses fail as it does. */
  m40llm_kvcache_options bad[6];
  for (int i = 0; i < 6; i++) bad[i] = o;
  bad[0].n_layers = 0;
  bad[1].max_seq_len = 0;
  bad[2].head_dim = 48;
  bad[3].tiers[1].k_format = M40LLM_KV_Q2;
  bad[4].format = M40LLM_KV_Q4 + M40LLM_KV_Q8 - bad[4].format; /* not the first tier's */
  bad[5].version = M40LLM_KVCACHE_OPTIONS_VERSION + 1;
  for (int i = 0; i < 6; i++) {
    t_set_case("plan tiers, bad options %d", i);
    m40llm_kvcache_options with = bad[i];
    with.tiers[0].rows = with.max_seq_len;
    for (int t = 1; t < with.n_tiers; t++) with.tiers[t].rows = 0;
    size_t bytes = 0;
    const int want = m40llm_kvcache_bytes_needed(&bytes, &with);
    if (!T_CHECK(want != M40LLM_OK)) continue;
    char want_msg[512];
    snprintf(want_msg, sizeof want_msg, "%s", m40llm_last_error_message());
    const m40llm_kvcache_options was = bad[i];
    T_FAIL_WITH(m40llm_kvcache_plan_tiers(&bad[i], 6.0), want, want_msg);
    T_CHECK(memcmp(&bad[i], &was, sizeof was) == 0);
  }
  T_CHECK(memcmp(&o, &before, sizeof o) == 0);
}

/* Callers of options versions 4, 5 and 6 (structs that end before placement, before
 * observe_interval, before demote_margin): the planner reads and writes no field past them (the
 * ASan build catches that) and gives the rows the current version's struct gets. */
static void test_plan_tiers_old_versions(void) {
  const size_t sizes[3] = {offsetof(m40llm_kvcache_options, placement),
                           offsetof(m40llm_kvcache_options, observe_interval),
                           offsetof(m40llm_kvcache_options, demote_margin)};
  for (int v = 0; v < 3; v++) {
    t_set_case("plan tiers, version-%d options", 4 + v);
    m40llm_kvcache_options now = study_tiers(8, 2, 64, 2, 5000);
    if (!T_OK(m40llm_kvcache_plan_tiers(&now, 6.0))) continue;
    m40llm_kvcache_options *old = malloc(sizes[v]);
    if (!T_CHECK(old != NULL)) continue;
    memcpy(old, &now, sizes[v]);
    old->version = 4 + v;
    for (int t = 0; t < 4; t++) old->tiers[t].rows = -1;
    if (T_OK(m40llm_kvcache_plan_tiers(old, 6.0)))
      for (int t = 0; t < 4; t++) T_INT_EQ(old->tiers[t].rows, now.tiers[t].rows);
    free(old);
  }
}

/* A cache of planned options, filled on a backend (either placement): every position finds a
 * tier, and its stored bits (m40llm_tier_stats) are within the target. */
static void test_plan_tiers_filled(int backend) {
  t_set_case("plan tiers, a planned cache filled, %s",
             backend == M40LLM_BACKEND_CPU ? "CPU" : "CUDA");
  m40llm_context_options co = M40LLM_CONTEXT_OPTIONS_INIT;
  co.backend = backend;
  m40llm_context *ctx = NULL;
  if (!T_OK(m40llm_context_create(&ctx, &co))) return;
  const double targets[] = {4.9, 5.5, 6.0, 7.25, 9.0};
  for (size_t i = 0; i < sizeof targets / sizeof targets[0]; i++) {
    m40llm_kvcache_options o = study_tiers(2, 2, 64, 2, 700);
    o.n_sinks = 4;
    o.window = 32;
    o.placement = i % 2 ? M40LLM_PLACE_IMPORTANCE : M40LLM_PLACE_FIRST_FREE;
    if (!T_OK(m40llm_kvcache_plan_tiers(&o, targets[i]))) continue;
    m40llm_kvcache *c = NULL;
    if (!T_OK(m40llm_kvcache_create(&c, ctx, &o))) continue;
    const size_t row = (size_t)o.n_kv_heads * (size_t)o.head_dim;
    float *k = malloc(row * (size_t)o.max_seq_len * sizeof *k);
    float *v = malloc(row * (size_t)o.max_seq_len * sizeof *v);
    float *dk = NULL, *dv = NULL;
    if (T_CHECK(k && v) && T_OK(m40llm_malloc((void **)&dk, ctx, row * o.max_seq_len * 4)) &&
        T_OK(m40llm_malloc((void **)&dv, ctx, row * o.max_seq_len * 4))) {
      for (size_t j = 0; j < row * (size_t)o.max_seq_len; j++) {
        k[j] = 2.0f * t_rand_unit() - 1.0f;
        v[j] = 2.0f * t_rand_unit() - 1.0f;
      }
      T_OK(m40llm_memcpy_to_device(ctx, dk, k, row * o.max_seq_len * 4));
      T_OK(m40llm_memcpy_to_device(ctx, dv, v, row * o.max_seq_len * 4));
      for (int layer = 0; layer < o.n_layers; layer++)
        for (int seq = 0; seq < o.max_seqs; seq++)
          T_OK(m40llm_kvcache_append_f32(c, layer, seq, dk, dv, o.max_seq_len));
      m40llm_tier_stats st = M40LLM_TIER_STATS_INIT;
      if (T_OK(m40llm_kvcache_tier_stats(&st, c))) {
        T_CHECKF(st.bits_per_value <= targets[i], "%.4f bits stored for a target of %.2f",
                 st.bits_per_value, targets[i]);
        /* every tier row used: the positions past the sinks and windows fill them */
        for (int t = 0; t < st.n_tiers; t++)
          T_CHECKF(st.free_rows[t] == 0, "tier %d has %lld rows free", t,
                   (long long)st.free_rows[t]);
        T_CHECK(st.kept_rows == (int64_t)o.n_layers * o.max_seqs * (o.n_sinks + o.window));
      }
    }
    m40llm_free(ctx, dk);
    m40llm_free(ctx, dv);
    free(k);
    free(v);
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
  test_plan_tiers();
  test_plan_tiers_errors();
  test_plan_tiers_old_versions();
  test_plan_tiers_filled(M40LLM_BACKEND_CPU);
  int gpus = 0;
  T_OK(m40llm_cuda_device_count(&gpus));
  if (gpus > 0)
    test_plan_tiers_filled(M40LLM_BACKEND_CUDA);
  else
    t_skip("plan tiers, a planned cache filled on CUDA: no CUDA build or no GPU");
  t_set_case("");
  return t_finish();
}
