/* How a batch of decode-attention rows is cut into GPU blocks (split-K over positions). Pure
 * host logic, shared by the CUDA backend and its tests. */
#ifndef M40LLM_ATTENTION_PLAN_H
#define M40LLM_ATTENTION_PLAN_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Sequences per launch: the plan travels as a kernel argument (4 KB limit on sm_52). */
#define M40LLM_PLAN_MAX_ITEMS 128
/* Splits per launch: the split kernels' grid y (65535 on every GPU). */
#define M40LLM_PLAN_MAX_SPLITS 65535

typedef struct m40llm_attn_plan {
  int32_t n_items;
  int32_t chunk;        /* positions per split; the last split of an item may be shorter */
  int32_t total_splits; /* blocks along grid y */
  int32_t max_splits;   /* 1 means no combine pass is needed */
  int32_t seq[M40LLM_PLAN_MAX_ITEMS];
  int32_t len[M40LLM_PLAN_MAX_ITEMS];
  int32_t split_begin[M40LLM_PLAN_MAX_ITEMS + 1]; /* item i owns splits [begin[i], begin[i+1]) */
  /* Caches with protected tokens (m40llm_attn_plan_protect): which rows this launch takes, the
   * cache's sinks and window, and each item's first window position. */
  int32_t role; /* M40LLM_PLAN_ALL, _KEPT, _CODES, _MIXED, _PARTS or _TIER */
  int32_t sinks, window;
  int32_t kept_chunk; /* rows per split of the kept parts (M40LLM_PLAN_TIER: 0 where they lead
                         an item's rows) */
  int32_t window_begin[M40LLM_PLAN_MAX_ITEMS];
  /* M40LLM_PLAN_TIER: item i's first split in the call's numbering of partials (the combine's
   * plan), and its positions (len is the part's rows) */
  int32_t split_base[M40LLM_PLAN_MAX_ITEMS];
  int32_t full_len[M40LLM_PLAN_MAX_ITEMS];
  /* M40LLM_PLAN_MIXED, _PARTS and _TIER: this layer's FP16 slots of K and V,
   * [seq][kv_head][slot][dim] (the backend's device memory; set by the caller) */
  const void *kept_k, *kept_v;
  /* m40llm_kvcache_attn_weights_ex: where item i's query head h writes its scores of
   * position p, weights[(i * n_heads + h) * weights_stride + p] (NULL: none); every split then
   * stores its (max, sum) partial, one split or several. */
  float *weights;
  int64_t weights_stride;
  /* M40LLM_PLAN_TIER, for exported scores (either family) and the FP32 instances' masks: the
   * tier's slot -> position map of this layer, [seq][map_stride] (the rows of a tier's part are
   * slots: their scores go to positions, and those at or past full_len[i] are masked) */
  const int32_t *map;
  int32_t map_stride;
  /* The tensor-core kernel's causal rows (kMmaCausal): a query row sees only the last
   * causal_window positions up to its own (0: all of them) */
  int32_t causal_window;
  /* A decode step's new rows (m40llm_kvcache_append_attn_ex on an F16 cache, NULL: none):
   * item i's K/V head h row at append_k/append_v + (i * n_kv_heads + h) * head_dim elements of
   * m40llm_dtype append_dtype, which the launch writes at position len[i] - 1 before it reads
   * it (the F16 instances; set by the caller) */
  const void *append_k, *append_v;
  int32_t append_dtype;
  /* M40LLM_PLAN_TIER on the tensor cores: a launch made on the stream after another launch of
   * its call, as a programmatic dependent of it (1), or not (0). It waits for that launch only
   * before it ends, so its completion orders every launch of the call before the combine. Its
   * inputs are ready when it starts: a launch starts only once every block of the one before it
   * has, so after every block of the call's first launch passed its wait for the stream's
   * earlier work, whose writes were then flushed (the chained launches read them without a
   * wait of their own; they share only disjoint partials with each other). */
  int32_t chained;
} m40llm_attn_plan;

enum {
  M40LLM_PLAN_ALL = 0,   /* every row of each item, from one tensor */
  M40LLM_PLAN_KEPT = 1,  /* the rows kept in FP16 slots (parts 0-2 below) */
  M40LLM_PLAN_CODES = 2, /* the quantized rows (part 3) */
  /* every row of each item in one launch, splits as for ALL: a split's rows are the item's parts
   * in order (parts 0-2 from the FP16 slots at kept_k/kept_v, then part 3), and the kernel cuts
   * its range into them (the FP32 kernel takes the kept rows in slot order where their slots are
   * one run: the same rows, numbered otherwise) */
  M40LLM_PLAN_MIXED = 3,
  /* the splits of m40llm_attn_plan_protect, every part in one launch: a split of a kept part
   * reads the FP16 slots at kept_k/kept_v, the others the codes */
  M40LLM_PLAN_PARTS = 4,
  /* one launch of a tiered cache's call (m40llm_attn_plan_tier): len[i] is the rows of one part
   * (a tier's, from slot 0), each preceded, where kept_k is set, by the item's kept parts
   * (parts 0-2 of full_len and window_begin): in splits of kept_chunk rows of their own, or
   * with kept_chunk 0 as the first rows of len[i] (the item's rows numbered as in a MIXED plan,
   * the tier's slots from 0 as its codes); block y of item i is split split_base[i] + y -
   * split_begin[i] of the call, and every split writes a partial */
  M40LLM_PLAN_TIER = 5
};

#ifdef __CUDACC__
#define M40LLM_PLAN_INLINE __host__ __device__ static inline
#else
#define M40LLM_PLAN_INLINE static inline
#endif

/* An item of a cache with protected tokens, as its splits take it: part 0 the sinks (slots 0 ..),
 * part 1 the window from its first ring slot to the ring's end, part 2 the rest of the window
 * (from the ring's start), each a run of FP16 slot rows from `first`; part 3 the quantized rows,
 * positions from `first`. Each part has splits of its own (none when empty): of kept_chunk rows
 * for the kept parts (few rows: short splits run them in parallel), of chunk for the codes. */
typedef struct m40llm_attn_parts {
  int32_t count[4], first[4];
} m40llm_attn_parts;

M40LLM_PLAN_INLINE m40llm_attn_parts m40llm_attn_item_parts(int32_t len, int32_t window_begin,
                                                            int32_t sinks, int32_t window) {
  m40llm_attn_parts p;
  const int32_t kept_window = len - window_begin;
  const int32_t ring0 = kept_window > 0 ? (window_begin - sinks) % window : 0;
  p.count[0] = len < sinks ? len : sinks;
  p.first[0] = 0;
  p.count[1] = kept_window < window - ring0 ? kept_window : window - ring0;
  p.first[1] = sinks + ring0;
  p.count[2] = kept_window - p.count[1];
  p.first[2] = sinks;
  p.count[3] = window_begin > sinks ? window_begin - sinks : 0;
  p.first[3] = sinks;
  return p;
}

/* Split j of item i in a launch of M40LLM_PLAN_TIER whose kept parts have splits of their own
 * (kept_chunk > 0 where kept_k is set; the tensor-core kernels, whose kept rows lead an item,
 * number their splits themselves): its number in the call (the combine's plan), whether it is
 * of a kept part, and its rows: FP16 slot rows of a kept part, else the part's rows from slot 0
 * (none for the empty splits m40llm_attn_plan_tier_number adds). */
typedef struct m40llm_attn_tier_split {
  int32_t split, kept, begin, end;
} m40llm_attn_tier_split;

M40LLM_PLAN_INLINE m40llm_attn_tier_split m40llm_attn_tier_split_of(const m40llm_attn_plan *plan,
                                                                    int32_t i, int32_t j) {
  m40llm_attn_tier_split s;
  s.split = plan->split_base[i] + j;
  s.kept = 0;
  if (plan->kept_k) {
    const m40llm_attn_parts parts =
        m40llm_attn_item_parts(plan->full_len[i], plan->window_begin[i], plan->sinks, plan->window);
    for (int k = 0; k < 3; k++) {
      const int32_t splits = (parts.count[k] + plan->kept_chunk - 1) / plan->kept_chunk;
      if (j < splits) {
        const int32_t end = parts.first[k] + parts.count[k];
        s.kept = 1;
        s.begin = parts.first[k] + j * plan->kept_chunk;
        s.end = end < s.begin + plan->kept_chunk ? end : s.begin + plan->kept_chunk;
        return s;
      }
      j -= splits;
    }
  }
  const int64_t begin = (int64_t)j * plan->chunk;
  s.begin = begin < plan->len[i] ? (int32_t)begin : plan->len[i];
  s.end = plan->len[i] - s.begin < plan->chunk ? plan->len[i] : s.begin + plan->chunk;
  return s;
}

/* units: blocks per (item, split), i.e. KV heads times query-head chunks. target_blocks: how
 * many blocks fill the GPU. Items are split only when items x units falls short of that, into
 * pieces of at least min_chunk positions unless that would leave fewer than min_blocks blocks
 * (one per SM), and chunks are whole multiples of tile that cut the longest item evenly. A plan
 * has fewer than 3 * ceil(target_blocks / units) + 1 splits. */
void m40llm_attn_plan_build(m40llm_attn_plan *plan, const int32_t *seq_ids, const int32_t *lens,
                            int n_items, int units, int target_blocks, int min_blocks,
                            int min_chunk, int tile);

/* Re-cuts a built plan for a cache with protected tokens: each item's parts
 * (m40llm_attn_item_parts) get splits of their own (an item has at most
 * m40llm_attn_protect_extra more splits than before). kept_chunk (rows per kept split) is
 * doubled while the plan would have more than M40LLM_PLAN_MAX_SPLITS splits and a kept part
 * more than one. Sets sinks, window, kept_chunk and window_begin; role is the caller's, per
 * launch. */
void m40llm_attn_plan_protect(m40llm_attn_plan *plan, const int32_t *window_begin, int32_t sinks,
                              int32_t window, int32_t kept_chunk);
/* Marks a built plan as M40LLM_PLAN_MIXED for a cache with protected tokens: sets sinks, window
 * and window_begin; the splits stay as built; kept_k and kept_v are the caller's. */
void m40llm_attn_plan_mixed(m40llm_attn_plan *plan, const int32_t *window_begin, int32_t sinks,
                            int32_t window);
/* Re-cuts a built plan (over one part's rows of each item) as a launch of a tiered cache's call,
 * M40LLM_PLAN_TIER: an item without rows has no splits, and with kept_chunk > 0 the item's kept
 * parts (m40llm_attn_item_parts of full_len and window_begin) come first, in splits of
 * kept_chunk rows (doubled as in m40llm_attn_plan_protect, leaving m40llm_attn_plan_tier_number
 * two splits an item of room under M40LLM_PLAN_MAX_SPLITS). kept_k and kept_v are the
 * caller's (kept_k set where kept_chunk > 0, or where the plan was built over the kept rows and
 * the tier's together, kept_chunk 0). */
void m40llm_attn_plan_tier(m40llm_attn_plan *plan, const int32_t *full_len,
                           const int32_t *window_begin, int32_t sinks, int32_t window,
                           int32_t kept_chunk);
/* Numbers the splits of a tiered call's n launches (plans of the same items) for one combine:
 * item by item, each item's splits of every launch together in launch order (split_base), at
 * least two an item (the first launch gets empty ones: every item is merged, an empty one into
 * zeros). Builds the combine's plan and sets every launch's max_splits to its. */
void m40llm_attn_plan_tier_number(m40llm_attn_plan *launches, int n, m40llm_attn_plan *combine);

/* The most splits m40llm_attn_plan_protect adds to one item. */
int32_t m40llm_attn_protect_extra(int32_t sinks, int32_t window, int32_t kept_chunk);

#ifdef __cplusplus
}
#endif

#endif
