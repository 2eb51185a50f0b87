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

typedef struct m40llm_attn_plan {
  int32_t n_items;
  int32_t chunk;        /* positions per split; the last split of an item may be shorter */
  int32_t total_splits; /* blocks along grid x */
  int32_t max_splits;   /* 1 means no combine pass is needed */
  int32_t seq[M40LLM_PLAN_MAX_ITEMS];
  int32_t len[M40LLM_PLAN_MAX_ITEMS];
  int32_t split_begin[M40LLM_PLAN_MAX_ITEMS + 1]; /* item i owns splits [begin[i], begin[i+1]) */
} m40llm_attn_plan;

/* units: blocks per (item, split), i.e. KV heads times query-head chunks. target_blocks: how
 * many blocks fill the GPU. Items are split only when items x units falls short of that, into
 * pieces of at least min_chunk positions unless that would leave fewer than min_blocks blocks
 * (one per SM), and chunks are whole multiples of tile that cut the longest item evenly. A plan
 * has fewer than 3 * ceil(target_blocks / units) + 1 splits. */
void m40llm_attn_plan_build(m40llm_attn_plan *plan, const int32_t *seq_ids, const int32_t *lens,
                            int n_items, int units, int target_blocks, int min_blocks,
                            int min_chunk, int tile);

#ifdef __cplusplus
}
#endif

#endif
