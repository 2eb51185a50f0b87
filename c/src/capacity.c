/* The capacity planner: the longest max_seq_len whose cache fits a byte budget. It asks
 * m40llm_kvcache_bytes_needed instead of repeating the layout's arithmetic, so it counts
 * whatever planes the options call for, now and as layouts change; it only assumes that more
 * positions never need fewer bytes. */
#include <limits.h>
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
