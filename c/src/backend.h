/* The operations a backend provides. The front end (context.c, kvcache.c) checks every argument
 * and then calls the context's table: the CPU backend (cpu_backend.c) or the CUDA backend
 * (cuda/backend.cu). A backend may assume its arguments are valid, lengths and capacity
 * included; the limits that are its own (e.g. the CUDA kernels' head_dim rule) it checks in
 * check_cache. */
#ifndef M40LLM_BACKEND_H
#define M40LLM_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "m40llm.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { M40LLM_COPY_H2D, M40LLM_COPY_D2H, M40LLM_COPY_D2D };

/* One sequence's share of an append (the backends' append op: rows written from position pos
 * on), or of a causal attention (query rows at positions pos .. pos + n_tokens - 1). */
typedef struct m40llm_append_item {
  int32_t seq, pos, n_tokens;
} m40llm_append_item;

/* What a decode attention call does besides its output. It exports the weights
 * (m40llm_kvcache_attn_weights_ex: n_heads rows of weights_stride floats a query row) or the
 * importance (m40llm_kvcache_attn_importance_ex: n_kv_heads rows of importance_stride floats a
 * query row, updated with decay), one of the two, each stride at least the longest length; or,
 * where the backend's attention_appends says it can, it appends: append_k and append_v hold
 * one [n_kv_heads][head_dim] row a query row, of the call's element type, which the call
 * writes at its sequence's last position (the lengths already count it) before reading it.
 * observe: the call is m40llm_kvcache_attn_observe_ex's (weights and importance NULL): it adds
 * each position's largest weight over every query head (as the importance call with decay 0
 * computes it per K/V head) to its accumulator in c->imp_acc's row of (layer, seq_ids[i]) and
 * counts the call, for every position below the sequence's length. A backend with graphs
 * refuses it during a capture before it queues anything (the tier_rank that follows reaches
 * the host by a copy and an event the host waits for). */
typedef struct m40llm_attn_export {
  float *weights;
  size_t weights_stride;
  float *importance;
  size_t importance_stride;
  float decay;
  const void *append_k, *append_v;
  int observe;
} m40llm_attn_export;

/* A row op of a tiered cache: where one row (one sequence's position: every K/V head, K and
 * V) comes from and goes to. A tier t >= 0 names slot src/dst of that tier; the other places: */
enum {
  M40LLM_ROW_KEPT = -1,   /* the FP16 slot of position src/dst (sinks, or the window's ring) */
  M40LLM_ROW_INPUT = -2,  /* row src of the appended rows: widened to FP32, rotated where the
                             tensor is */
  M40LLM_ROW_OUTPUT = -3  /* row dst of read_f16's output: rotated back, rounded to FP16 */
};
/* Ops from a tier to itself copy the stored bytes; the others decode the row to FP32 (the
 * stored, rotated frame) and encode it where it goes (quantized, or rounded to FP16). An op
 * into a tier also writes the row's position, pos, into the tier's slot map in backend memory
 * (m40llm_kvcache.tier_map), which the kernels that need a tier row's position read. */
typedef struct m40llm_row_op {
  int32_t seq, src, dst, pos;
  int16_t from, to;
} m40llm_row_op;
/* Row ops a backend call takes: they travel, with their chains' first ops (a byte each), as a
 * CUDA kernel argument (4 KB on sm_52). */
#define M40LLM_TIER_OPS 168

/* Importance placement (M40LLM_PLACE_IMPORTANCE). A position's accumulator: the sum of the
 * weights the observe calls gave it and the number of those calls (its score is sum / calls,
 * in double, or 0 where calls is 0: m40llm_imp_score). */
typedef struct m40llm_imp_acc {
  float sum;
  int32_t calls;
} m40llm_imp_acc;
/* The host's score and order of rows (cuda/tier_policy.cu has the device's, the same). */
static inline double m40llm_imp_score(m40llm_imp_acc a) {
  return a.calls > 0 ? (double)a.sum / (double)a.calls : 0.0;
}
/* Less important: the lower score, then the earlier position. */
static inline int m40llm_imp_below(double a, int32_t pa, double b, int32_t pb) {
  return a < b || (a == b && pa < pb);
}
/* Rows a tier's list of its least important rows holds at most. */
#define M40LLM_IMP_LOW 8
/* What an observe call ranks for each (layer, seq) it saw, from the state its stream position
 * sees: for each tier t < n_tiers, its min(rows held, M40LLM_IMP_LOW) least important rows in
 * order (score, then position: the less important first), and the scores of the window's
 * positions win_first .. win_first + win_n - 1 (win_first = m40llm_window_begin, win_n <=
 * c->window), as doubles after the record (m40llm_imp_window). */
typedef struct m40llm_imp_record {
  int32_t n_low[M40LLM_MAX_TIERS];
  int32_t low_pos[M40LLM_MAX_TIERS][M40LLM_IMP_LOW];
  double low_score[M40LLM_MAX_TIERS][M40LLM_IMP_LOW];
  int32_t win_first, win_n;
} m40llm_imp_record;

typedef struct m40llm_backend_ops {
  int kind; /* m40llm_backend */
  /* Devices this backend can open (0: none, which is not an error). */
  int (*device_count)(int *out_count);
  /* Why the last device_count on this thread found none (the runtime's own words), or NULL
   * where the backend has no devices to count. */
  const char *(*no_device_reason)(void);
  /* Sets ctx->state; user_stream is the caller's stream or NULL. */
  int (*init)(m40llm_context *ctx, int device, void *user_stream);
  void (*fini)(m40llm_context *ctx);
  int (*synchronize)(m40llm_context *ctx);
  void *(*stream)(const m40llm_context *ctx);
  /* Fills the fields of out->version; out is the front end's own, M40LLM_DEVICE_INFO_INIT. */
  int (*device_info)(m40llm_device_info *out, const m40llm_context *ctx);
  int (*malloc)(void **out, m40llm_context *ctx, size_t bytes);
  int (*free)(m40llm_context *ctx, void *ptr);
  int (*memcpy)(m40llm_context *ctx, void *dst, const void *src, size_t bytes, int kind);
  int (*memset)(m40llm_context *ctx, void *dst, int value, size_t bytes);
  /* Options this backend cannot serve: M40LLM_ERR_UNSUPPORTED with a message. */
  int (*check_cache)(const m40llm_kvcache_options *opts);
  /* A new cache's planes are allocated: reserve what its calls need so they never allocate. */
  int (*cache_created)(m40llm_kvcache *c);
  /* Writes, for each item, positions [pos, pos + n_tokens) of (layer, seq) from
   * [n_tokens][n_kv_heads][dim] rows of k and v of element type dtype (m40llm_dtype, valid),
   * F16 rows stored as they are in an F16 tensor, the others as their FP32 values; the items' rows
   * packed in item order, rotated where the tensor is; a quantized tensor's FP16 slots get the
   * positions p < c->n_sinks and p >= pos + n_tokens - c->window (the window after this
   * append). Items name distinct sequences, each n_tokens >= 1; n_items >= 1. */
  int (*append)(const m40llm_kvcache *c, int layer, const m40llm_append_item *items,
                int n_items, const void *k, const void *v, int dtype);
  int (*read_f16)(const m40llm_kvcache *c, uint16_t *k_out, uint16_t *v_out, int layer,
                  int seq, int pos, int n_tokens);
  /* Copies src_seq's stored positions of every layer to dst_seq (lengths, window starts and
   * tier counts are the caller's). */
  int (*fork)(const m40llm_kvcache *c, int dst_seq, int src_seq);
  /* Readies a decode attention call of n_rows query rows of element type dtype from q into
   * out, so that what would fail it fails here, before the caller writes anything: append_attn
   * calls it before its append. observe_len > 0: the call observes (m40llm_attn_export.observe),
   * its longest sequence that long. (CUDA: the pointer-kind check of q and out, the 16-bit
   * rows' staging buffer and an observe call's scores' scratch grown to the call's size.) */
  int (*prepare_attention)(const m40llm_kvcache *c, int n_rows, const void *q, const void *out,
                           int dtype, int observe_len);
  /* Nonzero where `attention` on c can take a decode step's appended rows (x->append_k and
   * append_v) and write them itself; NULL or zero: append_attn makes the two calls. */
  int (*attention_appends)(const m40llm_kvcache *c);
  /* Decode attention of n_seqs query rows; each seq_ids[i] is valid, scale final; q and out
   * of element type dtype (m40llm_dtype, valid). x: NULL, or what the call exports besides
   * its output, checked (m40llm_attn_export). */
  int (*attention)(const m40llm_kvcache *c, int layer, const int32_t *seq_ids, int n_seqs,
                   const void *q, void *out, int dtype, float scale,
                   const m40llm_attn_export *x);
  /* Causal attention (m40llm_kvcache_attn_causal_f32q) of checked items: each names a distinct
   * sequence, n_tokens >= 1 query rows and pos = its length - n_tokens (the first row's
   * position; row i sees positions [max(0, pos + i - window + 1) if window > 0 else 0,
   * pos + i]); the items' rows packed in q and out in item order. n_items >= 1, scale final. */
  int (*attention_causal)(const m40llm_kvcache *c, int layer, const m40llm_append_item *items,
                          int n_items, const void *q, void *out, int dtype, float scale,
                          int window);
  /* Tiered caches (c->n_tiers > 0): the
   * front end (tiers.c) keeps the maps and counts and asks for rows to be written, n_ops
   * (>= 1, <= M40LLM_TIER_OPS) row ops at a time, on layer `layer`: each op's row, every K/V
   * head of it, K and V, from `from` to `to` (m40llm_row_op). The ops come in n_chains chains,
   * links[i] ops each, in order (the counts sum to n_ops): a chain's ops run one after another,
   * so that an op may write what an earlier op of its chain read; no op reads what another op
   * of the call writes (CUDA reads tier rows through the read-only cache). k_in and v_in: the call's appended rows ([row][kv_head][dim] of element
   * type dtype) for ops from M40LLM_ROW_INPUT; k_out and v_out (FP16, either may be NULL) for
   * ops to M40LLM_ROW_OUTPUT. n_ops 0 only checks those buffers (CUDA: that the GPU can address
   * them), before the front end changes its maps. */
  int (*tier_rows)(const m40llm_kvcache *c, int layer, const m40llm_row_op *ops, int n_ops,
                   const uint8_t *links, int n_chains, const void *k_in, const void *v_in,
                   int dtype, uint16_t *k_out, uint16_t *v_out);
  /* Importance placement (M40LLM_PLACE_IMPORTANCE). policy_alloc, after the front end's state
   * is made: sets c->imp_records, host memory of c->imp_rank's size where the records become
   * readable, and c->imp_backend, what else the backend needs; policy_free releases them (either
   * may be NULL: a failed create). tier_rank, after an observe call's attention added its
   * weights to the accumulators (m40llm_attn_export.observe): writes the record of each (layer,
   * seq_ids[i]) into c->imp_rank and starts copying them to c->imp_records, where they are once
   * tier_rank_wait(c, layer) returns. c->imp_done, zeroed at create, is the backend's to use and
   * leave zeroed after each call. ids distinct and valid; not during a graph capture. */
  int (*policy_alloc)(m40llm_kvcache *c);
  void (*policy_free)(m40llm_kvcache *c);
  int (*tier_rank)(const m40llm_kvcache *c, int layer, const int32_t *seq_ids, int n_seqs);
  int (*tier_rank_wait)(const m40llm_kvcache *c, int layer);
  /* Graphs of the context's calls (NULL where the backend has none). graph_begin starts a
   * capture of the context's stream; graph_end ends it and puts the captured graph into *exec
   * (an executable graph; NULL for a new one): updated in place where the runtime can
   * (*updated = 1), else a new one instantiated and the old released (*updated = 0); on
   * failure *exec is unchanged, and the capture is over unless there was none. exec NULL
   * discards the capture. */
  int (*graph_begin)(m40llm_context *ctx);
  int (*graph_end)(m40llm_context *ctx, void **exec, int *updated);
  int (*graph_launch)(m40llm_context *ctx, void *exec);
  void (*graph_destroy)(void *exec);
  /* Whether the context's stream is being captured into a graph, by the library's calls or the
   * caller's own (1 also where that cannot be told): a cache then makes none of its own observe
   * calls. */
  int (*capturing)(const m40llm_context *ctx);
} m40llm_backend_ops;

extern const m40llm_backend_ops m40llm_cpu_backend;
/* Defined only in builds with the CUDA backend (M40LLM_HAVE_CUDA). */
extern const m40llm_backend_ops m40llm_cuda_backend;

/* The CUDA backend's build facts (cuda/build_info.cu, CUDA builds only): fills
 * cuda_architectures, cuda_toolkit_version and tensor_cores. */
void m40llm_cuda_build_info(m40llm_build_info *out);

#ifdef __cplusplus
}
#endif

#endif
