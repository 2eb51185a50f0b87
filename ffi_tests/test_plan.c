/* The split-K plan (c/src/attention_plan.c), host logic only: on random batches, every item's
 * positions are covered by non-empty splits of whole tiles, the split count stays under the
 * bound the workspace is reserved for, and the longest item is cut evenly. With protected
 * tokens, the parts of an item read each protected position's FP16 slot once and every other
 * position's codes once; a tiered call's launches read every row once and number their splits
 * for one combine. */
#include <stdint.h>
#include <string.h>

#include "attention_plan.h"
#include "kv_format.h"
#include "test_util.h"

static void check_plan(const int32_t *lens, int n, int units, int target, int min_blocks,
                       int min_chunk, int tile) {
  int32_t ids[M40LLM_PLAN_MAX_ITEMS];
  for (int i = 0; i < n; i++) ids[i] = (i * 7) % 300;
  m40llm_attn_plan p;
  m40llm_attn_plan_build(&p, ids, lens, n, units, target, min_blocks, min_chunk, tile);
  int32_t max_len = 1;
  for (int i = 0; i < n; i++)
    if (lens[i] > max_len) max_len = lens[i];
  const int split = (int64_t)n * units < target;
  T_CHECKF(p.n_items == n && p.chunk >= 1, "n_items %d, chunk %d", p.n_items, p.chunk);
  T_CHECKF(split ? p.chunk % tile == 0 || p.chunk == max_len : p.chunk == max_len,
           "chunk %d, tile %d, longest %d", p.chunk, tile, max_len);
  int max_splits = 1;
  for (int i = 0; i < n; i++) {
    const int s = p.split_begin[i + 1] - p.split_begin[i];
    if (s > max_splits) max_splits = s;
    T_CHECKF(p.seq[i] == ids[i] && p.len[i] == lens[i], "item %d copied", i);
    /* ceil(len / chunk) splits, at least one: the last one holds a position */
    const int want = lens[i] > 0 ? (int)(((int64_t)lens[i] + p.chunk - 1) / p.chunk) : 1;
    T_CHECKF(s == want, "item %d (len %d, chunk %d): %d splits, expected %d", i, lens[i], p.chunk,
             s, want);
  }
  T_CHECKF(p.split_begin[0] == 0 && p.total_splits == p.split_begin[n] &&
               p.max_splits == max_splits,
           "totals %d / %d, max %d / %d", p.total_splits, p.split_begin[n], p.max_splits,
           max_splits);
  const int bound = 3 * ((target + units - 1) / units) + 1;
  T_CHECKF(!split || p.total_splits < bound, "%d splits, bound %d (n %d, units %d, target %d)",
           p.total_splits, bound, n, units, target);
  /* even pieces: the longest item's last split is short by at most one tile per split */
  const int pieces = (int)(((int64_t)max_len + p.chunk - 1) / p.chunk);
  const int64_t last = max_len - (int64_t)(pieces - 1) * p.chunk;
  T_CHECKF(pieces == 1 || last >= (int64_t)p.chunk - (int64_t)pieces * tile,
           "longest %d in %d pieces of %d: last %lld", max_len, pieces, p.chunk, (long long)last);
}

/* An item of length len whose window starts at window_begin (as the cache keeps it: at least
 * min(sinks, len), at most len, and no more than `window` below len): its parts. */
static void check_parts(int len, int window_begin, int sinks, int window) {
  const m40llm_attn_parts p = m40llm_attn_item_parts(len, window_begin, sinks, window);
  static unsigned char slot_seen[1 << 12], pos_seen[1 << 14];
  memset(slot_seen, 0, (size_t)(sinks + window));
  memset(pos_seen, 0, (size_t)len);
  int ok = 1;
  for (int k = 0; k < 3; k++)
    for (int r = p.first[k]; r < p.first[k] + p.count[k]; r++) {
      ok &= p.count[k] >= 0 && r >= 0 && r < sinks + window && !slot_seen[r];
      if (r >= 0 && r < sinks + window) slot_seen[r] = 1;
    }
  for (int r = p.first[3]; r < p.first[3] + p.count[3]; r++) {
    ok &= r >= 0 && r < len && !pos_seen[r];
    if (r >= 0 && r < len) pos_seen[r] = 1;
  }
  /* Every protected position's slot is read, every other position's codes. */
  for (int pos = 0; pos < len; pos++) {
    const int kept = pos < sinks || pos >= window_begin;
    if (kept) ok &= slot_seen[m40llm_kv_protected_slot(sinks, window, pos)] && !pos_seen[pos];
    else ok &= pos_seen[pos];
  }
  int kept_rows = 0;
  for (int k = 0; k < 3; k++) kept_rows += p.count[k];
  ok &= kept_rows + p.count[3] == len;
  T_CHECKF(ok, "len %d, window begins at %d, %d sinks, window %d: parts %d@%d %d@%d %d@%d %d@%d",
           len, window_begin, sinks, window, p.count[0], p.first[0], p.count[1], p.first[1],
           p.count[2], p.first[2], p.count[3], p.first[3]);
}

/* A tiered call: n launches over the same items (the first with the kept parts where `kept`),
 * numbered for one combine. Every split of every launch is its own partial, an item's together,
 * each item has two at least, every row of each launch's part and every kept slot is read once,
 * and the total stays within the bound the workspace is reserved for. */
static void check_tier_call(int n_items, int n, int kept, int units, int target, int long_window) {
  static m40llm_attn_plan launches[5];
  static m40llm_attn_plan combine;
  static int32_t rows[5][M40LLM_PLAN_MAX_ITEMS];
  static unsigned char seen_split[5 * M40LLM_PLAN_MAX_SPLITS], seen_row[20000];
  int32_t ids[M40LLM_PLAN_MAX_ITEMS], full[M40LLM_PLAN_MAX_ITEMS], wb[M40LLM_PLAN_MAX_ITEMS];
  const int sinks = t_rand_int(0, 5);
  const int window = long_window ? 18000 : t_rand_int(0, 2) ? t_rand_int(1, 200) : 0;
  const int kept_chunk = long_window ? 32 : 32 * t_rand_int(1, 4);
  for (int i = 0; i < n_items; i++) {
    ids[i] = t_rand_int(0, 999);
    full[i] = long_window ? 19000 : t_rand_int(0, 3) ? t_rand_int(0, 19000) : t_rand_int(0, 3);
    const int lowest = full[i] < sinks ? full[i] : sinks;
    if (long_window) wb[i] = full[i] - window;
    else if (window > 0)
      wb[i] = t_rand_int(lowest > full[i] - window ? lowest : full[i] - window, full[i]);
    else
      wb[i] = full[i] > lowest ? full[i] : lowest;
    int left = wb[i] > sinks ? wb[i] - sinks : 0; /* the quantized rows, spread over the tiers */
    for (int l = 0; l < n; l++) {
      rows[l][i] = l == n - 1 ? left : t_rand_int(0, left);
      left -= rows[l][i];
    }
  }
  int64_t bound = 2 * M40LLM_PLAN_MAX_ITEMS +
                  (kept ? M40LLM_PLAN_MAX_ITEMS * m40llm_attn_protect_extra(sinks, window, kept_chunk) : 0);
  for (int l = 0; l < n; l++) {
    const int tile = 16 << t_rand_int(0, 3);
    m40llm_attn_plan_build(&launches[l], ids, rows[l], n_items, units, target, 132, 2 * tile, tile);
    launches[l].kept_k = kept && l == 0 ? (const void *)ids : NULL;
    m40llm_attn_plan_tier(&launches[l], full, wb, sinks, window, kept && l == 0 ? kept_chunk : 0);
    const int64_t b = 3 * ((target + units - 1) / units) + 1;
    bound += b > M40LLM_PLAN_MAX_ITEMS ? b : M40LLM_PLAN_MAX_ITEMS;
  }
  m40llm_attn_plan_tier_number(launches, n, &combine);
  int fits = 1;
  for (int l = 0; l < n; l++) fits &= launches[l].total_splits <= M40LLM_PLAN_MAX_SPLITS;
  T_CHECKF(fits, "a launch passes grid y's %d splits", M40LLM_PLAN_MAX_SPLITS);
  if (long_window && kept)
    T_CHECKF(launches[0].kept_chunk > kept_chunk, "128 x 18K windows: kept_chunk %d",
             launches[0].kept_chunk);
  int ok = combine.n_items == n_items && combine.split_begin[0] == 0 &&
           combine.total_splits == combine.split_begin[n_items] && combine.total_splits <= bound &&
           combine.total_splits <= (int)sizeof seen_split;
  T_CHECKF(ok, "%d splits in all (bound %lld)", combine.total_splits, (long long)bound);
  if (!ok) return;
  memset(seen_split, 0, (size_t)combine.total_splits);
  for (int i = 0; i < n_items && ok; i++) {
    const int first = combine.split_begin[i], last = combine.split_begin[i + 1];
    ok &= combine.seq[i] == ids[i] && last - first >= 2 && last - first <= combine.max_splits;
    const m40llm_attn_parts parts = m40llm_attn_item_parts(full[i], wb[i], sinks, window);
    for (int l = 0; l < n && ok; l++) {
      const m40llm_attn_plan *p = &launches[l];
      const int with_kept = kept && l == 0;
      memset(seen_row, 0, (size_t)rows[l][i] + 1);
      int kept_rows = 0, part_rows = 0;
      ok &= p->role == M40LLM_PLAN_TIER && p->max_splits == combine.max_splits;
      for (int j = 0; j < p->split_begin[i + 1] - p->split_begin[i]; j++) {
        const m40llm_attn_tier_split s = m40llm_attn_tier_split_of(p, i, j);
        ok &= s.split >= first && s.split < last && !seen_split[s.split];
        if (s.split >= first && s.split < last) seen_split[s.split] = 1;
        ok &= s.begin <= s.end &&
              s.end - s.begin <= (s.kept ? p->kept_chunk : p->chunk);
        ok &= !s.kept || with_kept;
        if (s.kept) kept_rows += s.end - s.begin;
        else part_rows += s.end - s.begin;
        if (!s.kept) /* rows of the part: in range, each once */
          for (int r = s.begin; r < s.end && ok; r++) {
            ok &= r >= 0 && r < rows[l][i] && !seen_row[r];
            seen_row[r] = 1;
          }
      }
      ok &= part_rows == rows[l][i];
      ok &= kept_rows == (with_kept ? parts.count[0] + parts.count[1] + parts.count[2] : 0);
    }
    for (int s = first; s < last; s++) ok &= seen_split[s];
  }
  T_CHECKF(ok, "items %d, launches %d, kept %d: a split or a row is missing or twice", n_items, n,
           kept);
}

int main(void) {
  t_rng_init();
  for (int iter = 0; iter < 200000; iter++) {
    t_set_case("protected parts %d", iter);
    const int sinks = t_rand_int(0, 8), window = t_rand_int(0, 3) == 0 ? 0 : t_rand_int(1, 300);
    const int len = t_rand_int(0, 10000);
    const int lowest = len < sinks ? len : sinks, highest = len - window;
    const int window_begin = t_rand_int(lowest > highest ? lowest : highest, len);
    check_parts(len, window > 0 ? window_begin : (len > lowest ? len : lowest), sinks, window);
  }
  /* The plan: every part's rows in splits of their own, one split at least. */
  {
    t_set_case("protected plan");
    int32_t lens[M40LLM_PLAN_MAX_ITEMS], wb[M40LLM_PLAN_MAX_ITEMS], ids[M40LLM_PLAN_MAX_ITEMS];
    for (int iter = 0; iter < 2000; iter++) {
      /* long windows (every 4th plan, and the last: 128 items of 20K with 18K windows, full)
       * pass grid y's bound at 32 rows a kept split */
      const int last = iter == 1999;
      const int n = last ? M40LLM_PLAN_MAX_ITEMS : t_rand_int(1, M40LLM_PLAN_MAX_ITEMS), sinks = 4;
      const int window = last ? 18000 : t_rand_int(0, 3) == 0 ? t_rand_int(4000, 20000) : 128;
      for (int i = 0; i < n; i++) {
        ids[i] = i;
        lens[i] = last ? 20000 : t_rand_int(0, 20000);
        const int lowest = lens[i] < sinks ? lens[i] : sinks;
        wb[i] = last ? lens[i] - window
                     : t_rand_int(lowest > lens[i] - window ? lowest : lens[i] - window, lens[i]);
      }
      m40llm_attn_plan p;
      m40llm_attn_plan_build(&p, ids, lens, n, 8, 1056, 132, 512, 64);
      int32_t before[M40LLM_PLAN_MAX_ITEMS];
      for (int i = 0; i < n; i++) before[i] = p.split_begin[i + 1] - p.split_begin[i];
      const int kept_chunk = last ? 32 : 32 * t_rand_int(1, 4);
      m40llm_attn_plan_protect(&p, wb, sinks, window, kept_chunk);
      /* kept_chunk doubled only as far as the bound needs: at half, the plan would pass it */
      int64_t at_half = 0;
      for (int i = 0; i < n; i++) {
        const m40llm_attn_parts parts = m40llm_attn_item_parts(lens[i], wb[i], sinks, window);
        int64_t splits = (parts.count[3] + p.chunk - 1) / p.chunk;
        const int half = p.kept_chunk / 2;
        for (int k = 0; k < 3; k++) splits += (parts.count[k] + half - 1) / half;
        at_half += splits > 0 ? splits : 1;
      }
      int ok = p.split_begin[0] == 0 && p.split_begin[n] == p.total_splits &&
               p.total_splits <= M40LLM_PLAN_MAX_SPLITS && p.kept_chunk % kept_chunk == 0 &&
               (p.kept_chunk == kept_chunk || at_half > M40LLM_PLAN_MAX_SPLITS);
      T_CHECKF(ok, "plan %d: %d splits, kept_chunk %d (from %d)", iter, p.total_splits,
               p.kept_chunk, kept_chunk);
      if (last)
        T_CHECKF(p.kept_chunk > kept_chunk, "128 x 18K windows: kept_chunk %d", p.kept_chunk);
      for (int i = 0; i < n; i++) {
        const m40llm_attn_parts parts = m40llm_attn_item_parts(lens[i], wb[i], sinks, window);
        int want = 0;
        for (int k = 0; k < 4; k++) {
          const int chunk = k < 3 ? p.kept_chunk : p.chunk;
          want += (parts.count[k] + chunk - 1) / chunk;
        }
        ok &= p.split_begin[i + 1] - p.split_begin[i] == (want > 0 ? want : 1);
        ok &= p.split_begin[i + 1] - p.split_begin[i] <=
              before[i] + m40llm_attn_protect_extra(sinks, window, kept_chunk);
        ok &= p.split_begin[i + 1] - p.split_begin[i] <= p.max_splits;
        ok &= p.window_begin[i] == wb[i];
      }
      T_CHECKF(ok, "plan %d: splits per part", iter);
    }
  }
  for (int iter = 0; iter < 3000; iter++) {
    t_set_case("tiered call %d", iter);
    check_tier_call(t_rand_int(1, M40LLM_PLAN_MAX_ITEMS), t_rand_int(1, 5), t_rand_int(0, 1),
                    t_rand_int(1, 64), t_rand_int(1, 4000), 0);
  }
  t_set_case("tiered call, 128 x 18K windows");
  check_tier_call(M40LLM_PLAN_MAX_ITEMS, 2, 1, 1, 1056, 1);
  static const int tiles[] = {8, 16, 32, 64, 128, 256};
  int32_t lens[M40LLM_PLAN_MAX_ITEMS];
  for (int iter = 0; iter < 20000; iter++) {
    t_set_case("random plan %d", iter);
    const int n = t_rand_int(1, M40LLM_PLAN_MAX_ITEMS);
    const int max_len = t_rand_int(0, 3) == 0 ? t_rand_int(1, 600) : t_rand_int(1, 300000);
    const int equal = t_rand_int(0, 2) == 0;
    for (int i = 0; i < n; i++) lens[i] = equal ? max_len : t_rand_int(0, max_len);
    const int tile = tiles[t_rand_int(0, 5)];
    check_plan(lens, n, t_rand_int(1, 64), t_rand_int(1, 4000), t_rand_int(1, 200),
               tile * t_rand_int(1, 8), tile);
  }
  /* the case the even cut is for: 32 x 8K on 8 units, 528 blocks */
  t_set_case("32 x 8192, 8 units");
  for (int i = 0; i < 32; i++) lens[i] = 8192;
  m40llm_attn_plan p;
  int32_t ids[32] = {0};
  m40llm_attn_plan_build(&p, ids, lens, 32, 8, 528, 132, 512, 64);
  T_CHECKF(p.chunk == 4096 && p.total_splits == 64, "chunk %d, %d splits", p.chunk,
           p.total_splits);
  t_set_case("");
  return t_finish();
}
