/* Internal declarations shared by the C front end and the backends. */
#ifndef M40LLM_INTERNAL_H
#define M40LLM_INTERNAL_H

#include "backend.h"
#include "kv_format.h"
#include "m40llm.h"

#ifdef __cplusplus
extern "C" {
#endif

struct m40llm_context {
  int backend; /* M40LLM_BACKEND_CUDA or M40LLM_BACKEND_CPU */
  int device;  /* -1 on the CPU */
  int check_pointers; /* m40llm_context_options.check_pointers */
  const m40llm_backend_ops *ops;
  void *state; /* the backend's own (the CUDA backend's m40llm_cuda_state) */
  /* Set when a call met M40LLM_ERR_CONTEXT_LOST (a sticky CUDA error): every later call that
   * would use the backend fails fast with lost_why. */
  int lost;
  char lost_why[320];
};

/* M40LLM_OK, or M40LLM_ERR_CONTEXT_LOST (with its message) for a lost context. */
int m40llm_context_check(const m40llm_context *ctx);
/* Passes a backend call's status through, recording a context loss. */
int m40llm_context_result(m40llm_context *ctx, int status);

struct m40llm_kvcache {
  m40llm_context *ctx;
  m40llm_kvcache_options opts;
  m40llm_kv_tensor k, v; /* backend memory */
  /* Authoritative lengths, [layer][seq], on the host: every change goes through this API in
   * host order, so they always match what the stream will see. */
  int *lens;
  /* Protected tokens (m40llm_kv_protection): FP16 slots a head, sinks then the window's ring. */
  int n_sinks, window, slots;
  /* [layer][seq]: positions from max(lo, n_sinks) to the length have their FP16 copy in the
   * ring (the window's; appends raise it, truncation lowers it). */
  int *lo;
  /* Tiered caches (opts.n_tiers > 0; otherwise n_tiers is 0 and the rest unused; tiers.c):
   * each tier's K and V rows in backend memory, [layer][seq][kv_head][slot] with
   * tiers[t].rows slots (no positional planes: k and v hold only the FP16 slots); on the host,
   * each tier's slot -> position map (tier_pos[t], [layer][seq][slot]), the position -> (tier,
   * slot) map of the quantized rows (where, [layer][seq][pos], m40llm_tier_where), the rows
   * each tier holds (tier_count, [layer][seq][M40LLM_MAX_TIERS]), and the row ops being
   * gathered for the backend (ops, M40LLM_TIER_OPS of them); the rows tier_move has moved.
   * In backend memory too, each tier's slot -> position map (tier_map[t], as tier_pos): the
   * backend's row ops keep it (m40llm_row_op.pos), in stream order, for the kernels that need
   * a tier row's position (exported weights, causal masks). */
  int n_tiers;
  int64_t tier_moved;
  m40llm_kv_tensor tier_k[M40LLM_MAX_TIERS], tier_v[M40LLM_MAX_TIERS];
  int32_t *tier_pos[M40LLM_MAX_TIERS];
  int32_t *tier_map[M40LLM_MAX_TIERS];
  uint32_t *where;
  int32_t *tier_count;
  m40llm_row_op *ops;
  /* A batched append's scratch, max_seqs entries each (ids cannot repeat, so a batch has at
   * most max_seqs): the caller's ids and counts copied as items, for each sequence 1 + the
   * batch index that named it (0: none; all 0 between calls), and append-and-attend's ids for
   * the attention. Allocated with the cache so that appends never allocate. */
  m40llm_append_item *batch;
  int *batch_seen;
  int32_t *batch_ids;
  /* Importance placement (opts.placement == M40LLM_PLACE_IMPORTANCE; tier_policy.c). Backend
   * memory: each (layer, seq)'s accumulators, a position's sum of the weights its observe calls
   * gave it and their number (imp_acc, [layer][seq][max_seq_len]), the ranking's counters
   * (imp_done, [max_seqs][M40LLM_MAX_TIERS], zeroed at create: on CUDA, a tier's blocks that
   * have ranked their rows), and what the last
   * observe call of each (layer, seq) ranked (imp_rank, [layer][seq] records of
   * imp_record_bytes: m40llm_imp_record), which the backend makes readable on the host at
   * imp_records (its own: pinned on CUDA; imp_backend holds what else it needs, per-layer
   * events). Host: each row's score where known (imp_host: the window's rows and the lists'
   * as of the last observe call, every row where imp_full[layer][seq]; 0 for rows appended
   * since), the landing rows of a full copy of one (layer, seq)'s accumulators (imp_fetch,
   * [max_seq_len]), which (layer, seq) have a record not yet read (imp_pending) and which
   * layers' records have landed (imp_landed); per (layer, seq, tier) its least important rows'
   * positions, most important last (imp_low, [layer][seq][tier][M40LLM_IMP_LOW]; imp_n_low
   * entries, 0: not known), and the rows the cascade has moved down (imp_demoted); per (layer,
   * seq) the plain calls that named it since the last observe call that did (imp_since, up to
   * opts.observe_interval), and the observe calls made (imp_observed). */
  struct m40llm_imp_acc *imp_acc, *imp_fetch;
  int32_t *imp_done;
  void *imp_rank, *imp_records, *imp_backend;
  size_t imp_record_bytes;
  double *imp_host;
  int32_t *imp_low;
  uint8_t *imp_full, *imp_pending, *imp_landed, *imp_n_low;
  int64_t imp_demoted;
  int *imp_since;
  int64_t imp_observed;
};

/* The caller's options of any known version as the current version (later fields defaulted);
 * M40LLM_ERR_INVALID_ARGUMENT for NULL or an unknown version. Only reads and converts: the
 * fields are checked by m40llm_kvcache_bytes_needed and create. */
int m40llm_kvcache_read_options(m40llm_kvcache_options *out, const m40llm_kvcache_options *in);

static inline int *m40llm_len_slot(const m40llm_kvcache *c, int layer, int seq) {
  return &c->lens[(size_t)layer * (size_t)c->opts.max_seqs + (size_t)seq];
}

static inline int *m40llm_lo_slot(const m40llm_kvcache *c, int layer, int seq) {
  return &c->lo[(size_t)layer * (size_t)c->opts.max_seqs + (size_t)seq];
}

/* The first window position of (layer, seq): positions below min(n_sinks, length) and from
 * here to the length are read from the FP16 slots, the rest from the quantized rows. */
static inline int m40llm_window_begin(const m40llm_kvcache *c, int layer, int seq) {
  const int len = *m40llm_len_slot(c, layer, seq), lo = *m40llm_lo_slot(c, layer, seq);
  const int w = lo > c->n_sinks ? lo : c->n_sinks;
  return w < len ? w : len;
}

/* Whether position pos of (layer, seq) is read from the FP16 slots. */
static inline int m40llm_is_protected(const m40llm_kvcache *c, int layer, int seq, int pos) {
  return c->slots > 0 && (pos < c->n_sinks || pos >= m40llm_window_begin(c, layer, seq));
}

/* Tiers: a quantized row's entry in the position map, and back. */
static inline uint32_t m40llm_tier_where(int tier, int slot) {
  return (uint32_t)slot << 2 | (uint32_t)tier;
}
static inline int m40llm_where_tier(uint32_t w) { return (int)(w & 3u); }
static inline int m40llm_where_slot(uint32_t w) { return (int)(w >> 2); }

static inline int32_t *m40llm_tier_counts(const m40llm_kvcache *c, int layer, int seq) {
  return &c->tier_count[((size_t)layer * (size_t)c->opts.max_seqs + (size_t)seq) *
                        (size_t)M40LLM_MAX_TIERS];
}

/* Row index of (layer, seq, kv_head, slot) in tier t's K or V planes. */
static inline size_t m40llm_tier_row(const m40llm_kvcache *c, int t, int layer, int seq,
                                     int kv_head, int slot) {
  const m40llm_kvcache_options *o = &c->opts;
  return (((size_t)layer * (size_t)o->max_seqs + (size_t)seq) * (size_t)o->n_kv_heads +
          (size_t)kv_head) * (size_t)o->tiers[t].rows + (size_t)slot;
}

/* How many positions of (layer, seq) are quantized rows (in tiers, for a tiered cache): those
 * from n_sinks up to the window's first position, given the window start lo and the length. */
static inline int m40llm_quantized_rows(const m40llm_kvcache *c, int lo, int len) {
  int w = lo > c->n_sinks ? lo : c->n_sinks;
  w = w < len ? w : len;
  return w > c->n_sinks ? w - c->n_sinks : 0;
}

/* Tiers (tiers.c): the tiered cache's appends, moves, truncation and reads, as row ops for the
 * backend; the maps are the front end's. Arguments are checked by the caller. */
int m40llm_tiers_append(m40llm_kvcache *c, int layer, const m40llm_append_item *items,
                        int n_items, const void *k, const void *v, int dtype);
int m40llm_tiers_move(m40llm_kvcache *c, int layer, int seq, int begin, int end, int tier);
int m40llm_tiers_truncate(m40llm_kvcache *c, int layer, int seq, int new_len);
int m40llm_tiers_read(m40llm_kvcache *c, uint16_t *k_out, uint16_t *v_out, int layer, int seq,
                      int pos, int n_tokens);
/* Importance placement (tier_policy.c), for caches with M40LLM_PLACE_IMPORTANCE (the others'
 * calls do nothing). alloc: the state, backend memory zeroed; free: releases it. */
int m40llm_policy_alloc(m40llm_kvcache *c);
void m40llm_policy_free(m40llm_kvcache *c);
/* Bytes of backend memory the policy's state takes (0 without it) with a window of `window`
 * rows, added to *bytes; 0 on overflow. */
int m40llm_policy_add_bytes(size_t *bytes, const m40llm_kvcache_options *o, int window);
/* The cache's own observe calls (opts.observe_interval): whether a plain call of layer on
 * checked ids is due to observe (one of its sequences is), and a plain call of theirs made (not
 * an observe; ids may repeat). */
int m40llm_policy_due(const m40llm_kvcache *c, int layer, const int32_t *ids, int n);
void m40llm_policy_plain_call(m40llm_kvcache *c, int layer, const int32_t *ids, int n);
/* After the backend's observe of checked ids: their records are on their way, their scores
 * stale; their counts of plain calls start again. */
void m40llm_policy_observed(m40llm_kvcache *c, int layer, const int32_t *ids, int n);
/* After an observe of checked ids failed once the backend was called (it may have counted the
 * call in some sums): what the host knows of their order and scores is dropped, so that it
 * copies the sums back before it places a row by them. */
void m40llm_policy_unknown(m40llm_kvcache *c, int layer, const int32_t *ids, int n);
/* Before anything changes or reads (layer, seq)'s placement state: its record, where an
 * observe call left one, read (a wait for the backend's copy of the layer's records, once per
 * observe call of the layer). */
int m40llm_policy_settle(m40llm_kvcache *c, int layer, int seq);
/* Positions [pos, pos + n) of (layer, seq) appended: they start with no call seen. */
void m40llm_policy_appended(m40llm_kvcache *c, int layer, int seq, int pos, int n);
/* (layer, seq) truncated from old_len to new_len, and forked from src to dst, whose length was
 * old_dst_len (after the front end's maps; both settled before). */
int m40llm_policy_truncate(m40llm_kvcache *c, int layer, int seq, int old_len, int new_len);
int m40llm_policy_fork(m40llm_kvcache *c, int layer, int dst, int src, int old_dst_len);
/* (layer, seq)'s tiers changed other than by a placement: what the policy knew of their order
 * is gone. */
void m40llm_policy_forget(m40llm_kvcache *c, int layer, int seq);
/* Before an append places `leaving` rows of (layer, seq): every score a placement might read
 * made known first (a copy of the accumulators, which waits for the stream, where a list could
 * run out or is not known), so that a failure comes before anything changes. */
int m40llm_policy_prepare(m40llm_kvcache *c, int layer, int seq, int leaving);
/* Places position e of (layer, seq), leaving the window, by importance: updates the maps and
 * counts and writes the row ops that do it into chain[0 .. *n) (at most M40LLM_MAX_TIERS), in
 * the order they must run (each op writes the slot the one before it read: a chain of
 * backend.h's tier_rows), the last one e's from its FP16 slot. */
int m40llm_policy_place(m40llm_kvcache *c, int layer, int seq, int e, m40llm_row_op *chain,
                        int *n);

/* The record of (layer, seq) in a buffer of records (imp_rank or imp_records). */
static inline m40llm_imp_record *m40llm_imp_record_at(const m40llm_kvcache *c, void *records,
                                                      int layer, int seq) {
  return (m40llm_imp_record *)((char *)records +
                               ((size_t)layer * (size_t)c->opts.max_seqs + (size_t)seq) *
                                   c->imp_record_bytes);
}
/* A record's window scores: win_n doubles after it. */
static inline double *m40llm_imp_window(m40llm_imp_record *r) { return (double *)(r + 1); }

static inline uint32_t *m40llm_tier_where_of(const m40llm_kvcache *c, int layer, int seq) {
  return c->where +
         ((size_t)layer * (size_t)c->opts.max_seqs + (size_t)seq) * (size_t)c->opts.max_seq_len;
}
static inline int32_t *m40llm_tier_slot_pos(const m40llm_kvcache *c, int t, int layer, int seq) {
  return c->tier_pos[t] +
         ((size_t)layer * (size_t)c->opts.max_seqs + (size_t)seq) * (size_t)c->opts.tiers[t].rows;
}
/* The same entry of the backend's copy (tier_map: backend memory). */
static inline int32_t *m40llm_tier_map_at(const m40llm_kvcache *c, int t, int layer, int seq) {
  return c->tier_map[t] +
         ((size_t)layer * (size_t)c->opts.max_seqs + (size_t)seq) * (size_t)c->opts.tiers[t].rows;
}

/* Records a failure for m40llm_last_error_message() and returns status. */
int m40llm_fail(int status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Host memory of the library: every host allocation goes through these (free() releases it), so
 * that tests can make each one fail in turn. */
void *m40llm_host_malloc(size_t bytes);
void *m40llm_host_calloc(size_t n, size_t size);
void *m40llm_host_aligned_alloc(size_t alignment, size_t bytes);

/* Test-only: when set, called before every host allocation above with its size; a nonzero
 * return makes that allocation fail (return NULL). Not part of the API; not thread-safe. */
extern int (*m40llm_host_alloc_hook)(size_t bytes);

/* IEEE binary16 conversions, round-to-nearest-even (what CUDA's __float2half_rn does). */
uint16_t m40llm_f32_to_f16(float f);
float m40llm_f16_to_f32(uint16_t h);
/* bfloat16: round-to-nearest-even from FP32 (NaN stays a quiet NaN); widening is exact. */
uint16_t m40llm_f32_to_bf16(float f);
float m40llm_bf16_to_f32(uint16_t h);
/* Bytes of one element of an m40llm_dtype, or 0 for a value that is none. */
size_t m40llm_dtype_size(int dtype);
/* Element i of a row of type dtype as FP32 (exact), and x stored as element i (rounded once). */
float m40llm_dtype_load(const void *p, int dtype, size_t i);
void m40llm_dtype_store(void *p, int dtype, size_t i, float x);

#ifdef __cplusplus
}
#endif

#endif
