/* The capacity planner: the longest max_seq_len whose cache fits a byte budget. It asks
 * m40llm_kvcache_bytes_needed instead of repeating the layout's arithmetic, so it counts
 * whatever planes the options call for, now and as layouts change; it only assumes that more
 * positions never need fewer bytes. */
#include <limits.h>
#include <math.h>
#include <stdio.h>

#include "internal.h"

#define FAIL(code, ...) m40llm_fail(M40LLM_ERR_##code, __VA_ARGS__)

/* Whether a cache of len positions a sequence fits budget. A size bytes_needed refuses (one
 * past size_t) does not fit. */
static int fits(m40llm_kvcache_options *o, int len, size_t budget) {
  size_t bytes = 0;
  o->max_seq_len = len;
  return m40llm_kvcache_bytes_needed(&bytes, o) == M40LLM_OK && bytes <= budget;
}

/* Checks o (the current version) as bytes_needed does, with max_seq_len 1: *one gets the bytes
 * of one position a sequence. */
static int check_one(size_t *one, m40llm_kvcache_options *o) {
  if (o->n_tiers != 0)
    return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT,
                       "opts->n_tiers is %d: a tiered cache's rows are given per tier, not "
                       "planned from a budget", o->n_tiers);
  o->max_seq_len = 1;
  return m40llm_kvcache_bytes_needed(one, o);
}

/* The search over o, checked (one: its bytes at length 1); budget from where budget_is says. */
static int plan(int *out, m40llm_kvcache_options *o, size_t one, size_t budget,
                const char *budget_is) {
  if (one > budget)
    return FAIL(CAPACITY,
                "a cache of one position a sequence needs %zu bytes, more than the budget (%s) "
                "of %zu bytes",
                one, budget_is, budget);
  /* The lengths the search refuses as too large for size_t are answers, not failures: keep
   * the thread's last message as the caller left it. */
  char last[512];
  snprintf(last, sizeof last, "%s", m40llm_last_error_message());
  /* fits(lo) and, while lo < INT_MAX, !fits(hi). */
  int lo = 1, hi = INT_MAX;
  if (fits(o, INT_MAX, budget)) lo = INT_MAX;
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    if (fits(o, mid, budget))
      lo = mid;
    else
      hi = mid;
  }
  m40llm_fail(M40LLM_OK, "%s", last);
  *out = lo;
  return M40LLM_OK;
}

int m40llm_kvcache_max_seq_len(int *out_max_seq_len, const m40llm_kvcache_options *opts,
                               size_t budget_bytes) {
  if (!out_max_seq_len) return FAIL(INVALID_ARGUMENT, "out_max_seq_len is NULL");
  m40llm_kvcache_options o;
  size_t one = 0;
  int rc = m40llm_kvcache_read_options(&o, opts);
  if (rc != M40LLM_OK || (rc = check_one(&one, &o)) != M40LLM_OK) return rc;
  return plan(out_max_seq_len, &o, one, budget_bytes, "budget_bytes");
}

int m40llm_kvcache_max_seq_len_on_device(int *out_max_seq_len, m40llm_context *ctx,
                                         const m40llm_kvcache_options *opts,
                                         size_t reserve_bytes) {
  if (!out_max_seq_len) return FAIL(INVALID_ARGUMENT, "out_max_seq_len is NULL");
  if (!ctx) return FAIL(INVALID_ARGUMENT, "ctx is NULL");
  m40llm_kvcache_options o;
  size_t one = 0;
  int rc = m40llm_kvcache_read_options(&o, opts);
  if (rc != M40LLM_OK || (rc = check_one(&one, &o)) != M40LLM_OK) return rc;
  if (ctx->backend == M40LLM_BACKEND_CPU)
    return FAIL(UNSUPPORTED,
                "the CPU backend has no device memory to plan against: pass a budget to "
                "m40llm_kvcache_max_seq_len");
  if ((rc = ctx->ops->check_cache(&o)) != M40LLM_OK) return rc;
  m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
  if ((rc = m40llm_context_device_info(&info, ctx)) != M40LLM_OK) return rc;
  if (info.free_memory <= reserve_bytes)
    return FAIL(CAPACITY, "device %d has %zu bytes free, not more than reserve_bytes (%zu)",
                info.device, info.free_memory, reserve_bytes);
  return plan(out_max_seq_len, &o, one, info.free_memory - reserve_bytes,
              "the device's free memory less reserve_bytes");
}

/* ---- Tier rows for a target of bits per value ---- */

/* o's bytes (as bytes_needed counts them) with each tier's rows from rows[]. */
static int tier_bytes(size_t *out, m40llm_kvcache_options *o, const int *rows) {
  for (int t = 0; t < o->n_tiers; t++) o->tiers[t].rows = rows[t];
  return m40llm_kvcache_bytes_needed(out, o);
}

int m40llm_kvcache_plan_tiers(m40llm_kvcache_options *opts, double bits_per_value) {
  if (!opts) return FAIL(INVALID_ARGUMENT, "opts is NULL");
  if (!(bits_per_value > 0.0) || isinf(bits_per_value))
    return FAIL(INVALID_ARGUMENT, "bits_per_value is %g, must be a positive finite number",
                bits_per_value);
  m40llm_kvcache_options o;
  int rc = m40llm_kvcache_read_options(&o, opts);
  if (rc != M40LLM_OK) return rc;
  if (o.n_tiers < 1 || o.n_tiers > M40LLM_MAX_TIERS)
    return FAIL(INVALID_ARGUMENT,
                "opts->n_tiers is %d: the planner gives rows to tiers whose formats opts names "
                "(1..%d of them, options version 4 or later)", o.n_tiers, M40LLM_MAX_TIERS);
  /* Every check bytes_needed makes, with the rows no plan exceeds. */
  int rows[M40LLM_MAX_TIERS] = {0};
  size_t bytes = 0;
  rows[0] = o.max_seq_len;
  if ((rc = tier_bytes(&bytes, &o, rows)) != M40LLM_OK) return rc;
  /* The target is the stored K/V's, as m40llm_tier_stats counts it: not the placement's. */
  o.placement = M40LLM_PLACE_FIRST_FREE;
  /* The rows that can leave the window: every one gets a tier, no tier gets more. */
  int sinks = 0, window = 0;
  m40llm_kv_protection(&o, o.format, o.v_format == M40LLM_KV_SAME ? o.format : o.v_format,
                       &sinks, &window);
  const int need = o.max_seq_len - sinks - window > 0 ? o.max_seq_len - sinks - window : 0;
  const double values = 2.0 * o.n_layers * o.max_seqs * (double)o.max_seq_len * o.n_kv_heads *
                        o.head_dim;
  const double budget_d = floor(bits_per_value * values / 8.0);
  const size_t budget = budget_d >= (double)SIZE_MAX ? SIZE_MAX : (size_t)budget_d;

  /* Each tier's cost with every row in it (bytes are linear in each tier's rows), and the
   * tiers by cost, dearest first (stable: of equal costs the first named). */
  size_t all_in[M40LLM_MAX_TIERS] = {0};
  int order[M40LLM_MAX_TIERS] = {0};
  for (int t = 0; t < o.n_tiers; t++) {
    int one[M40LLM_MAX_TIERS] = {0};
    one[t] = need;
    if ((rc = tier_bytes(&all_in[t], &o, one)) != M40LLM_OK) return rc;
    int i = t;
    for (; i > 0 && all_in[order[i - 1]] < all_in[t]; i--) order[i] = order[i - 1];
    order[i] = t;
  }
  rows[0] = 0;
  const int top = order[0], bottom = order[o.n_tiers - 1];
  if (all_in[bottom] > budget)  /* the least target, rounded up so that it plans */
    return FAIL(CAPACITY,
                "%g bits per value is below what these tiers can hold: %.4f bits with every "
                "row that leaves the window (%d of %d positions) in the cheapest, tier %d "
                "(%zu bytes for a budget of %zu)", bits_per_value,
                ceil(8e4 * (double)all_in[bottom] / values) / 1e4, need, o.max_seq_len, bottom,
                all_in[bottom], budget);
  if (all_in[top] <= budget) {
    rows[top] = need;
  } else {
    /* The two tiers adjacent in cost whose costs bracket the budget share the rows: the
     * dearer as many as fit (of equal costs, each the first named). */
    int j = 1;
    while (all_in[order[j]] > budget) j++;
    int i = j - 1;
    while (i > 0 && all_in[order[i - 1]] == all_in[order[i]]) i--;
    const int hi = order[i], lo = order[j];
    int fit = 0, over = need; /* fit fits, over does not */
    while (over - fit > 1) {
      const int mid = fit + (over - fit) / 2;
      int mix[M40LLM_MAX_TIERS] = {0};
      mix[hi] = mid;
      mix[lo] = need - mid;
      if ((rc = tier_bytes(&bytes, &o, mix)) != M40LLM_OK) return rc;
      if (bytes <= budget)
        fit = mid;
      else
        over = mid;
    }
    rows[hi] = fit;
    rows[lo] = need - fit;
  }
  for (int t = 0; t < o.n_tiers; t++) opts->tiers[t].rows = rows[t];
  return M40LLM_OK;
}
