#include "attention_plan.h"

#include <stddef.h>

void m40llm_attn_plan_build(m40llm_attn_plan *plan, const int32_t *seq_ids, const int32_t *lens,
                            int n_items, int units, int target_blocks, int min_blocks,
                            int min_chunk, int tile) {
  int64_t total_len = 0;
  int32_t max_len = 1;
  for (int i = 0; i < n_items; i++) {
    total_len += lens[i];
    if (lens[i] > max_len) max_len = lens[i];
  }
  int64_t chunk = max_len;
  if ((int64_t)n_items * units < target_blocks && total_len > 0) {
    /* Enough splits that all items together make about target_blocks blocks. */
    int64_t want = (total_len * units + target_blocks - 1) / target_blocks;
    /* Small problems: min_chunk must not leave SMs idle. */
    const int64_t fill = (total_len * units + min_blocks - 1) / min_blocks;
    if (fill < min_chunk) min_chunk = (int)fill;
    if (want < min_chunk) want = min_chunk;
    /* The longest item in the nearest whole number of even pieces (so a batch of equal lengths
     * has no short last split that idles its SM): at least 2/3 of want, a whole number of tiles. */
    int64_t pieces = (2 * (int64_t)max_len + want) / (2 * want);
    if (pieces < 1) pieces = 1;
    want = (max_len + pieces - 1) / pieces;
    want = (want + tile - 1) / tile * tile;
    if (want < chunk) chunk = want;
  }
  plan->n_items = n_items;
  plan->chunk = (int32_t)chunk;
  plan->max_splits = 1;
  int32_t begin = 0;
  for (int i = 0; i < n_items; i++) {
    const int32_t splits = lens[i] > 0 ? (int32_t)((lens[i] + chunk - 1) / chunk) : 1;
    plan->seq[i] = seq_ids[i];
    plan->len[i] = lens[i];
    plan->split_begin[i] = begin;
    begin += splits;
    if (splits > plan->max_splits) plan->max_splits = splits;
  }
  plan->split_begin[n_items] = begin;
  plan->total_splits = begin;
  plan->role = M40LLM_PLAN_ALL;
  plan->kept_k = plan->kept_v = NULL;
  plan->weights = NULL;
  plan->weights_stride = 0;
  plan->map = NULL;
  plan->map_stride = 0;
  plan->causal_window = 0;
  plan->append_k = plan->append_v = NULL;
  plan->append_dtype = 0;
  plan->chained = 0;
}

void m40llm_attn_plan_mixed(m40llm_attn_plan *plan, const int32_t *window_begin, int32_t sinks,
                            int32_t window) {
  plan->role = M40LLM_PLAN_MIXED;
  plan->sinks = sinks;
  plan->window = window;
  for (int i = 0; i < plan->n_items; i++) plan->window_begin[i] = window_begin[i];
}

int32_t m40llm_attn_protect_extra(int32_t sinks, int32_t window, int32_t kept_chunk) {
  /* the kept rows in splits of kept_chunk, over three parts; the codes' part at most one more */
  return (sinks + window + kept_chunk - 1) / kept_chunk + 3;
}

/* Splits of an item's kept parts (parts 0-2) at kept_chunk rows a split. */
static int32_t kept_splits(const m40llm_attn_parts *p, int32_t kept_chunk) {
  int32_t splits = 0;
  for (int k = 0; k < 3; k++) splits += (p->count[k] + kept_chunk - 1) / kept_chunk;
  return splits;
}

/* Item i's splits in a protected plan at kept_chunk rows a kept split (an empty item: one,
 * which writes zeros). */
static int32_t protect_item_splits(const m40llm_attn_plan *plan, int i,
                                   const int32_t *window_begin, int32_t sinks, int32_t window,
                                   int32_t kept_chunk) {
  const m40llm_attn_parts p = m40llm_attn_item_parts(plan->len[i], window_begin[i], sinks, window);
  const int32_t splits =
      kept_splits(&p, kept_chunk) + (p.count[3] + plan->chunk - 1) / plan->chunk;
  return splits > 0 ? splits : 1;
}

/* Item i's splits in a tiered launch: its part's rows, after its kept parts where kept_chunk
 * is set. */
static int32_t tier_item_splits(const m40llm_attn_plan *plan, int i, const int32_t *full_len,
                                const int32_t *window_begin, int32_t sinks, int32_t window,
                                int32_t kept_chunk) {
  int32_t splits = (plan->len[i] + plan->chunk - 1) / plan->chunk;
  if (kept_chunk > 0) {
    const m40llm_attn_parts p = m40llm_attn_item_parts(full_len[i], window_begin[i], sinks, window);
    splits += kept_splits(&p, kept_chunk);
  }
  return splits;
}

void m40llm_attn_plan_protect(m40llm_attn_plan *plan, const int32_t *window_begin, int32_t sinks,
                              int32_t window, int32_t kept_chunk) {
  /* Many items with long windows can pass grid y at kept_chunk rows a split (128 items of 16K
   * at 32 rows come to 65K splits). Doubling keeps it a whole number of tiles; at sinks +
   * window every kept part is one split. */
  for (; kept_chunk < sinks + window; kept_chunk *= 2) {
    int64_t total = 0;
    for (int i = 0; i < plan->n_items; i++)
      total += protect_item_splits(plan, i, window_begin, sinks, window, kept_chunk);
    if (total <= M40LLM_PLAN_MAX_SPLITS) break;
  }
  int32_t begin = 0;
  plan->sinks = sinks;
  plan->window = window;
  plan->kept_chunk = kept_chunk;
  plan->max_splits = 1;
  for (int i = 0; i < plan->n_items; i++) {
    const int32_t splits = protect_item_splits(plan, i, window_begin, sinks, window, kept_chunk);
    plan->window_begin[i] = window_begin[i];
    plan->split_begin[i] = begin;
    begin += splits;
    if (splits > plan->max_splits) plan->max_splits = splits;
  }
  plan->split_begin[plan->n_items] = begin;
  plan->total_splits = begin;
}

void m40llm_attn_plan_tier(m40llm_attn_plan *plan, const int32_t *full_len,
                           const int32_t *window_begin, int32_t sinks, int32_t window,
                           int32_t kept_chunk) {
  /* As in m40llm_attn_plan_protect, with room for the two splits an item that
   * m40llm_attn_plan_tier_number may add to the first launch. */
  for (; kept_chunk > 0 && kept_chunk < sinks + window; kept_chunk *= 2) {
    int64_t total = 0;
    for (int i = 0; i < plan->n_items; i++)
      total += tier_item_splits(plan, i, full_len, window_begin, sinks, window, kept_chunk);
    if (total <= M40LLM_PLAN_MAX_SPLITS - 2 * plan->n_items) break;
  }
  int32_t begin = 0;
  plan->role = M40LLM_PLAN_TIER;
  plan->sinks = sinks;
  plan->window = window;
  plan->kept_chunk = kept_chunk;
  for (int i = 0; i < plan->n_items; i++) {
    const int32_t splits =
        tier_item_splits(plan, i, full_len, window_begin, sinks, window, kept_chunk);
    plan->full_len[i] = full_len[i];
    plan->window_begin[i] = window_begin[i];
    plan->split_begin[i] = begin;
    begin += splits;
  }
  plan->split_begin[plan->n_items] = begin;
  plan->total_splits = begin;
}

void m40llm_attn_plan_tier_number(m40llm_attn_plan *launches, int n, m40llm_attn_plan *combine) {
  m40llm_attn_plan *first = &launches[0];
  combine->n_items = first->n_items;
  combine->max_splits = 2;
  combine->role = M40LLM_PLAN_ALL;
  int32_t begin = 0, first_begin = 0;
  for (int i = 0; i < combine->n_items; i++) {
    int32_t splits = 0;
    for (int l = 0; l < n; l++)
      splits += launches[l].split_begin[i + 1] - launches[l].split_begin[i];
    const int32_t extra = splits < 2 ? 2 - splits : 0;
    /* the first launch's splits of item i, its empty ones included, from first_begin on */
    const int32_t own = first->split_begin[i + 1] - first->split_begin[i] + extra;
    first->split_begin[i] = first_begin;
    first_begin += own;
    combine->seq[i] = first->seq[i];
    combine->len[i] = first->full_len[i];
    combine->split_begin[i] = begin;
    for (int l = 0; l < n; l++) {
      launches[l].split_base[i] = begin;
      begin += l == 0 ? own : launches[l].split_begin[i + 1] - launches[l].split_begin[i];
    }
    if (splits + extra > combine->max_splits) combine->max_splits = splits + extra;
  }
  /* split_begin[i + 1] of the first launch was read above before it was moved: set the end last */
  first->split_begin[combine->n_items] = first_begin;
  first->total_splits = first_begin;
  combine->split_begin[combine->n_items] = begin;
  combine->total_splits = begin;
  for (int l = 0; l < n; l++) launches[l].max_splits = combine->max_splits;
}
