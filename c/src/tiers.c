/* A tiered cache's bookkeeping (m40llm_kvcache_options.n_tiers > 0): which tier and slot holds
 * each quantized row, kept on the host, and the row ops that make the backend's tiers follow.
 * Every change is computed here in host order, so the counts and maps always say what the
 * stream will have done; a backend only writes rows (ops->tier_rows). Ops handed over in one
 * call never touch what another op of the call reads, except that an op of a chain may write
 * what an earlier op of its chain read (an importance placement's cascade): a change that needs
 * any other order (rows leaving the window before new rows take their FP16 slots; rows leaving
 * a tier before its last rows fill the holes) is made in phases, each flushed before the next. */
#include <string.h>

#include "internal.h"

typedef struct {
  m40llm_kvcache *c;
  int layer, n;
  const void *k_in, *v_in;
  int dtype;
  uint16_t *k_out, *v_out;
  int n_chains;
  uint8_t links[M40LLM_TIER_OPS]; /* each chain's ops (backend.h) */
} op_list;

static int flush(op_list *l) {
  if (l->n == 0) return M40LLM_OK;
  const int n = l->n, chains = l->n_chains;
  l->n = l->n_chains = 0;
  return m40llm_context_result(
      l->c->ctx, l->c->ctx->ops->tier_rows(l->c, l->layer, l->c->ops, n, l->links, chains,
                                           l->k_in, l->v_in, l->dtype, l->k_out, l->v_out));
}

/* An op on its own: a chain of one. */
static int push_op(op_list *l, m40llm_row_op op) {
  l->c->ops[l->n++] = op;
  l->links[l->n_chains++] = 1;
  return l->n == M40LLM_TIER_OPS ? flush(l) : M40LLM_OK;
}

/* The next link of the open chain (open 0: the op starts a chain): a chain cut by a full list
 * goes on as a new chain of the next call, which runs after this one. */
static int push_link(op_list *l, m40llm_row_op op, int open) {
  if (open && l->n > 0) {
    l->c->ops[l->n++] = op;
    l->links[l->n_chains - 1]++;
    return l->n == M40LLM_TIER_OPS ? flush(l) : M40LLM_OK;
  }
  return push_op(l, op);
}

/* pos: the row's position (written into the tier's map where `to` is a tier). */
static int push(op_list *l, int seq, int from, int src, int to, int dst, int pos) {
  const m40llm_row_op op = {seq, src, dst, pos, (int16_t)from, (int16_t)to};
  return push_op(l, op);
}

/* The first tier with a free row: there is one for every row that can leave the window (the
 * tiers' rows were checked against it at create). */
static int first_free_tier(const m40llm_kvcache *c, int layer, int seq) {
  const int32_t *count = m40llm_tier_counts(c, layer, seq);
  int t = 0;
  while (t < c->n_tiers - 1 && count[t] >= c->opts.tiers[t].rows) t++;
  return t;
}

/* Gives position pos the next slot of tier t. */
static int claim(m40llm_kvcache *c, int layer, int seq, int pos, int t) {
  const int slot = m40llm_tier_counts(c, layer, seq)[t]++;
  m40llm_tier_slot_pos(c, t, layer, seq)[slot] = pos;
  m40llm_tier_where_of(c, layer, seq)[pos] = m40llm_tier_where(t, slot);
  return slot;
}

/* Closes the holes (slot map entries of -1) of tier t of (layer, seq), `freed` of them: the
 * rows past the new count move into the holes below it (sources and targets never overlap). */
static int compact(op_list *l, int layer, int seq, int t, int freed) {
  m40llm_kvcache *c = l->c;
  int32_t *count = &m40llm_tier_counts(c, layer, seq)[t];
  int32_t *map = m40llm_tier_slot_pos(c, t, layer, seq);
  uint32_t *where = m40llm_tier_where_of(c, layer, seq);
  const int keep = *count - freed;
  int rc = M40LLM_OK;
  for (int hole = 0, from = keep; hole < keep && rc == M40LLM_OK; hole++) {
    if (map[hole] >= 0) continue;
    while (map[from] < 0) from++;
    map[hole] = map[from];
    rc = push(l, seq, t, from, t, hole, map[hole]);
    where[map[hole]] = m40llm_tier_where(t, hole);
    from++;
  }
  *count = keep;
  return rc;
}

/* The backend's check of a call's buffers, before any map changes. */
static int check_buffers(const op_list *l) {
  return m40llm_context_result(
      l->c->ctx, l->c->ctx->ops->tier_rows(l->c, l->layer, l->c->ops, 0, NULL, 0, l->k_in,
                                           l->v_in, l->dtype, l->k_out, l->v_out));
}

/* The positions [*first, *end) of an item that its append takes out of the window; the
 * quantized rows end at *q_end after it (the new rows below it never enter the window). */
static void leaving(const m40llm_kvcache *c, int layer, const m40llm_append_item *it, int *first,
                    int *end, int *q_end) {
  const int lo = *m40llm_lo_slot(c, layer, it->seq), last = it->pos + it->n_tokens;
  const int lo_after = lo < last - c->window ? last - c->window : lo;
  *q_end = c->n_sinks + m40llm_quantized_rows(c, lo_after, last);
  *first = c->n_sinks + m40llm_quantized_rows(c, lo, it->pos);
  *end = *q_end < it->pos ? *q_end : it->pos;
}

/* Rows leaving the window placed by importance, in rounds: each round places every item's
 * next leaving row, each row's cascade one chain (an op writes the slot the one before it read;
 * none reads what another wrote), a launch a round (the next row's cascade may read what this
 * one wrote: the GPU reads tier rows through the read-only cache, which a later launch sees
 * fresh). A decode step's append is one round. */
static int place_by_importance(op_list *l, const m40llm_append_item *items, int n_items) {
  m40llm_kvcache *c = l->c;
  int rc = M40LLM_OK;
  for (int i = 0; i < n_items && rc == M40LLM_OK; i++) {
    int first, end, q_end;
    leaving(c, l->layer, &items[i], &first, &end, &q_end);
    if (first < end) rc = m40llm_policy_prepare(c, l->layer, items[i].seq, end - first);
  }
  m40llm_row_op chain[M40LLM_MAX_TIERS];
  for (int r = 0, more = 1; more && rc == M40LLM_OK; r++) {
    more = 0;
    for (int i = 0; i < n_items && rc == M40LLM_OK; i++) {
      int first, end, q_end, n = 0;
      leaving(c, l->layer, &items[i], &first, &end, &q_end);
      if (first + r >= end) continue;
      more = 1;
      rc = m40llm_policy_place(c, l->layer, items[i].seq, first + r, chain, &n);
      for (int k = 0; k < n && rc == M40LLM_OK; k++) rc = push_link(l, chain[k], k > 0);
    }
    if (rc == M40LLM_OK) rc = flush(l);
  }
  return rc;
}

int m40llm_tiers_append(m40llm_kvcache *c, int layer, const m40llm_append_item *items,
                        int n_items, const void *k, const void *v, int dtype) {
  op_list l = {c, layer, 0, k, v, dtype, NULL, NULL, 0, {0}};
  int rc = check_buffers(&l);
  for (int i = 0; i < n_items && rc == M40LLM_OK; i++)
    rc = m40llm_policy_settle(c, layer, items[i].seq);
  /* The rows that leave the window, from their FP16 slots, before anything overwrites them. */
  if (c->opts.placement == M40LLM_PLACE_IMPORTANCE) {
    if (rc == M40LLM_OK) rc = place_by_importance(&l, items, n_items);
  } else {
    for (int i = 0; i < n_items && rc == M40LLM_OK; i++) {
      int first, end, q_end;
      leaving(c, layer, &items[i], &first, &end, &q_end);
      for (int p = first; p < end && rc == M40LLM_OK; p++) {
        const int t = first_free_tier(c, layer, items[i].seq);
        rc = push(&l, items[i].seq, M40LLM_ROW_KEPT, p, t, claim(c, layer, items[i].seq, p, t),
                  p);
      }
    }
  }
  if (rc == M40LLM_OK) rc = flush(&l);
  /* The new rows: to their FP16 slots, or to a tier where they never enter the window. */
  for (int i = 0, row = 0; i < n_items && rc == M40LLM_OK; i++) {
    const m40llm_append_item *it = &items[i];
    int first, end, q_end;
    leaving(c, layer, it, &first, &end, &q_end);
    for (int p = it->pos; p < it->pos + it->n_tokens && rc == M40LLM_OK; p++, row++) {
      if (p >= c->n_sinks && p < q_end) {
        /* never observed: the first free tier; the policy's lists of the tier are stale */
        const int t = first_free_tier(c, layer, it->seq);
        rc = push(&l, it->seq, M40LLM_ROW_INPUT, row, t, claim(c, layer, it->seq, p, t), p);
        m40llm_policy_forget(c, layer, it->seq);
      } else {
        rc = push(&l, it->seq, M40LLM_ROW_INPUT, row, M40LLM_ROW_KEPT, p, p);
      }
    }
  }
  if (rc == M40LLM_OK) rc = flush(&l);
  for (int i = 0; i < n_items && rc == M40LLM_OK; i++)
    m40llm_policy_appended(c, layer, items[i].seq, items[i].pos, items[i].n_tokens);
  return rc;
}

int m40llm_tiers_move(m40llm_kvcache *c, int layer, int seq, int begin, int end, int tier) {
  const uint32_t *where = m40llm_tier_where_of(c, layer, seq);
  const int q_end = c->n_sinks + m40llm_quantized_rows(c, *m40llm_lo_slot(c, layer, seq),
                                                       *m40llm_len_slot(c, layer, seq));
  if (begin < c->n_sinks) begin = c->n_sinks;
  if (end > q_end) end = q_end;
  int moving = 0, freed[M40LLM_MAX_TIERS] = {0};
  for (int p = begin; p < end; p++) moving += m40llm_where_tier(where[p]) != tier;
  int rc = m40llm_policy_settle(c, layer, seq);
  if (rc != M40LLM_OK) return rc;
  const int free_rows = c->opts.tiers[tier].rows - m40llm_tier_counts(c, layer, seq)[tier];
  if (moving > free_rows)
    return m40llm_fail(M40LLM_ERR_CAPACITY,
                       "moving %d row(s) of layer %d seq %d into tier %d, which has %d free: "
                       "none was moved", moving, layer, seq, tier, free_rows);
  op_list l = {c, layer, 0, NULL, NULL, 0, NULL, NULL, 0, {0}};
  for (int p = begin; p < end && rc == M40LLM_OK; p++) {
    const uint32_t w = where[p];
    const int from = m40llm_where_tier(w), slot = m40llm_where_slot(w);
    if (from == tier) continue;
    m40llm_tier_slot_pos(c, from, layer, seq)[slot] = -1;
    freed[from]++;
    rc = push(&l, seq, from, slot, tier, claim(c, layer, seq, p, tier), p);
  }
  if (rc == M40LLM_OK) rc = flush(&l);
  for (int t = 0; t < c->n_tiers && rc == M40LLM_OK; t++)
    if (freed[t] > 0) rc = compact(&l, layer, seq, t, freed[t]);
  if (rc == M40LLM_OK) rc = flush(&l);
  if (rc == M40LLM_OK) c->tier_moved += moving;
  m40llm_policy_forget(c, layer, seq);
  return rc;
}

int m40llm_tiers_truncate(m40llm_kvcache *c, int layer, int seq, int new_len) {
  op_list l = {c, layer, 0, NULL, NULL, 0, NULL, NULL, 0, {0}};
  int rc = m40llm_policy_settle(c, layer, seq);
  for (int t = 0; t < c->n_tiers && rc == M40LLM_OK; t++) {
    int32_t *map = m40llm_tier_slot_pos(c, t, layer, seq);
    int freed = 0;
    for (int s = 0; s < m40llm_tier_counts(c, layer, seq)[t]; s++)
      if (map[s] >= new_len) map[s] = -1, freed++;
    if (freed > 0) rc = compact(&l, layer, seq, t, freed);
  }
  return rc == M40LLM_OK ? flush(&l) : rc;
}

int m40llm_tiers_read(m40llm_kvcache *c, uint16_t *k_out, uint16_t *v_out, int layer, int seq,
                      int pos, int n_tokens) {
  op_list l = {c, layer, 0, NULL, NULL, 0, k_out, v_out, 0, {0}};
  const uint32_t *where = m40llm_tier_where_of(c, layer, seq);
  int rc = check_buffers(&l);
  for (int r = 0; r < n_tokens && rc == M40LLM_OK; r++) {
    const int p = pos + r;
    if (m40llm_is_protected(c, layer, seq, p))
      rc = push(&l, seq, M40LLM_ROW_KEPT, p, M40LLM_ROW_OUTPUT, r, p);
    else
      rc = push(&l, seq, m40llm_where_tier(where[p]), m40llm_where_slot(where[p]),
                M40LLM_ROW_OUTPUT, r, p);
  }
  return rc == M40LLM_OK ? flush(&l) : rc;
}
