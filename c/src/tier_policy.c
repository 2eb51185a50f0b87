/* Importance placement (M40LLM_PLACE_IMPORTANCE): where a tiered cache puts a row leaving the
 * window, by the attention its observe calls gave it (bench/fidelity/results/buckets.md is the
 * study this rule comes from; bench/fidelity/lib_tiers.py ran it through the public calls).
 * The accumulators live in backend memory, where the observe calls' kernels add to them; the
 * decisions are the host's, as all of a tiered cache's bookkeeping is (tiers.c). A victim is a
 * tier's least important row: each (layer, seq, tier) keeps its M40LLM_IMP_LOW least
 * important rows in order. An observe call ranks them on the backend, with the scores of the
 * window's rows (the rows that can leave next), and its copy to the host lands while the GPU
 * goes on: the host waits for it at the layer's next append, a step later, not at the call.
 * Where an append could run a list out (more rows leave than it holds) or meet one that a
 * move, a truncate, a fork or a row appended straight into a tier made stale, the host first
 * copies the (layer, seq)'s accumulators back (a wait for the stream), before the append
 * changes anything, and rebuilds the list by a scan. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define FAIL(code, ...) m40llm_fail(M40LLM_ERR_##code, __VA_ARGS__)

static int on(const m40llm_kvcache *c) { return c->opts.placement == M40LLM_PLACE_IMPORTANCE; }

static size_t seq_index(const m40llm_kvcache *c, int layer, int seq) {
  return (size_t)layer * (size_t)c->opts.max_seqs + (size_t)seq;
}

static size_t row_of(const m40llm_kvcache *c, int layer, int seq) {
  return seq_index(c, layer, seq) * (size_t)c->opts.max_seq_len;
}

static size_t record_bytes(int window) {
  return sizeof(m40llm_imp_record) + (size_t)window * sizeof(double);
}

int m40llm_policy_add_bytes(size_t *bytes, const m40llm_kvcache_options *o, int window) {
  if (o->placement != M40LLM_PLACE_IMPORTANCE) return 1;
  const size_t len = (size_t)o->max_seq_len;
  const size_t seqs = (size_t)o->n_layers * (size_t)o->max_seqs;
  const size_t done = (size_t)o->max_seqs * M40LLM_MAX_TIERS * sizeof(int32_t);
  const size_t acc = sizeof(m40llm_imp_acc), rec = record_bytes(window);
  if (seqs > SIZE_MAX / len / acc || seqs > SIZE_MAX / rec) return 0;
  const size_t parts[3] = {seqs * len * acc, done, seqs * rec};
  for (int i = 0; i < 3; i++) {
    if (*bytes > SIZE_MAX - parts[i]) return 0;
    *bytes += parts[i];
  }
  return 1;
}

int m40llm_policy_alloc(m40llm_kvcache *c) {
  if (!on(c)) return M40LLM_OK;
  const m40llm_kvcache_options *o = &c->opts;
  const size_t seqs = (size_t)o->n_layers * (size_t)o->max_seqs;
  const size_t positions = seqs * (size_t)o->max_seq_len;
  const size_t done = (size_t)o->max_seqs * M40LLM_MAX_TIERS * sizeof(int32_t);
  c->imp_record_bytes = record_bytes(c->window);
  c->imp_host = m40llm_host_calloc(positions, sizeof *c->imp_host);
  c->imp_fetch = m40llm_host_calloc((size_t)o->max_seq_len, sizeof *c->imp_fetch);
  c->imp_full = m40llm_host_calloc(seqs, sizeof *c->imp_full);
  c->imp_pending = m40llm_host_calloc(seqs, sizeof *c->imp_pending);
  c->imp_landed = m40llm_host_calloc((size_t)o->n_layers, sizeof *c->imp_landed);
  c->imp_low = m40llm_host_calloc(seqs * M40LLM_MAX_TIERS * M40LLM_IMP_LOW, sizeof *c->imp_low);
  c->imp_n_low = m40llm_host_calloc(seqs * M40LLM_MAX_TIERS, sizeof *c->imp_n_low);
  c->imp_since = m40llm_host_calloc(seqs, sizeof *c->imp_since);
  if (!c->imp_host || !c->imp_fetch || !c->imp_full || !c->imp_pending || !c->imp_landed ||
      !c->imp_low || !c->imp_n_low || !c->imp_since)
    return FAIL(OUT_OF_MEMORY, "allocating the importance placement's host state");
  memset(c->imp_full, 1, seqs); /* every score is 0 on both sides */
  int rc = m40llm_malloc((void **)&c->imp_acc, c->ctx, positions * sizeof(m40llm_imp_acc));
  if (rc == M40LLM_OK) rc = m40llm_malloc((void **)&c->imp_done, c->ctx, done);
  if (rc == M40LLM_OK) rc = m40llm_malloc(&c->imp_rank, c->ctx, seqs * c->imp_record_bytes);
  if (rc == M40LLM_OK) rc = m40llm_memset(c->ctx, c->imp_acc, 0, positions * sizeof(m40llm_imp_acc));
  if (rc == M40LLM_OK) rc = m40llm_memset(c->ctx, c->imp_done, 0, done);
  if (rc == M40LLM_OK) rc = m40llm_context_result(c->ctx, c->ctx->ops->policy_alloc(c));
  return rc;
}

void m40llm_policy_free(m40llm_kvcache *c) {
  if (c->ctx->ops->policy_free) c->ctx->ops->policy_free(c);
  m40llm_free(c->ctx, c->imp_acc);
  m40llm_free(c->ctx, c->imp_done);
  m40llm_free(c->ctx, c->imp_rank);
  free(c->imp_host);
  free(c->imp_fetch);
  free(c->imp_full);
  free(c->imp_pending);
  free(c->imp_landed);
  free(c->imp_low);
  free(c->imp_n_low);
  free(c->imp_since);
}

void m40llm_policy_forget(m40llm_kvcache *c, int layer, int seq) {
  if (on(c))
    memset(&c->imp_n_low[seq_index(c, layer, seq) * M40LLM_MAX_TIERS], 0, M40LLM_MAX_TIERS);
}

int m40llm_policy_due(const m40llm_kvcache *c, int layer, const int32_t *ids, int n) {
  const int every = c->opts.observe_interval;
  if (!on(c) || every == 0) return 0;
  for (int i = 0; i < n; i++)
    if (c->imp_since[seq_index(c, layer, ids[i])] >= every - 1) return 1;
  return 0;
}

void m40llm_policy_plain_call(m40llm_kvcache *c, int layer, const int32_t *ids, int n) {
  if (!on(c)) return;
  for (int i = 0; i < n; i++) { /* a sequence the call names twice counts once */
    int *since = &c->imp_since[seq_index(c, layer, ids[i])];
    if (!c->batch_seen[ids[i]] && *since < c->opts.observe_interval) ++*since;
    c->batch_seen[ids[i]] = 1;
  }
  for (int i = 0; i < n; i++) c->batch_seen[ids[i]] = 0;
}

void m40llm_policy_observed(m40llm_kvcache *c, int layer, const int32_t *ids, int n) {
  c->imp_observed++;
  c->imp_landed[layer] = 0;
  for (int i = 0; i < n; i++) {
    const size_t s = seq_index(c, layer, ids[i]);
    c->imp_since[s] = 0;
    c->imp_pending[s] = 1;
    c->imp_full[s] = 0;
  }
}

void m40llm_policy_unknown(m40llm_kvcache *c, int layer, const int32_t *ids, int n) {
  for (int i = 0; i < n; i++) {
    const size_t s = seq_index(c, layer, ids[i]);
    c->imp_pending[s] = 0;
    c->imp_full[s] = 0;
    m40llm_policy_forget(c, layer, ids[i]);
  }
}

/* The least important rows of tier t of (layer, seq): n entries, most important last. */
typedef struct {
  int32_t *pos;
  uint8_t *n;
} low_list;

static low_list low_of(const m40llm_kvcache *c, int layer, int seq, int t) {
  const size_t i = seq_index(c, layer, seq) * M40LLM_MAX_TIERS + (size_t)t;
  const low_list l = {&c->imp_low[i * M40LLM_IMP_LOW], &c->imp_n_low[i]};
  return l;
}

int m40llm_policy_settle(m40llm_kvcache *c, int layer, int seq) {
  if (!on(c) || !c->imp_pending[seq_index(c, layer, seq)]) return M40LLM_OK;
  if (!c->imp_landed[layer]) {
    const int rc = m40llm_context_result(c->ctx, c->ctx->ops->tier_rank_wait(c, layer));
    if (rc != M40LLM_OK) return rc;
    c->imp_landed[layer] = 1;
  }
  m40llm_imp_record *r = m40llm_imp_record_at(c, c->imp_records, layer, seq);
  double *score = &c->imp_host[row_of(c, layer, seq)];
  for (int t = 0; t < c->n_tiers; t++) {
    const low_list l = low_of(c, layer, seq, t);
    *l.n = (uint8_t)r->n_low[t];
    for (int i = 0; i < r->n_low[t]; i++) {
      l.pos[i] = r->low_pos[t][i];
      score[l.pos[i]] = r->low_score[t][i];
    }
  }
  const double *win = m40llm_imp_window(r);
  for (int i = 0; i < r->win_n; i++) score[r->win_first + i] = win[i];
  c->imp_pending[seq_index(c, layer, seq)] = 0;
  return M40LLM_OK;
}

void m40llm_policy_appended(m40llm_kvcache *c, int layer, int seq, int pos, int n) {
  if (!on(c)) return;
  double *score = &c->imp_host[row_of(c, layer, seq)];
  for (int p = pos; p < pos + n; p++) score[p] = 0.0; /* no call saw it */
}

int m40llm_policy_truncate(m40llm_kvcache *c, int layer, int seq, int old_len, int new_len) {
  if (!on(c) || old_len <= new_len) return M40LLM_OK;
  /* Positions appended again start from 0. */
  const size_t row = row_of(c, layer, seq);
  memset(&c->imp_host[row + (size_t)new_len], 0, (size_t)(old_len - new_len) * sizeof(double));
  m40llm_policy_forget(c, layer, seq);
  return m40llm_memset(c->ctx, &c->imp_acc[row + (size_t)new_len], 0,
                       (size_t)(old_len - new_len) * sizeof(m40llm_imp_acc));
}

int m40llm_policy_fork(m40llm_kvcache *c, int layer, int dst, int src, int old_dst_len) {
  if (!on(c)) return M40LLM_OK;
  const size_t d = seq_index(c, layer, dst), s = seq_index(c, layer, src);
  const size_t len = (size_t)*m40llm_len_slot(c, layer, src);
  const size_t max_len = (size_t)c->opts.max_seq_len;
  memcpy(&c->imp_host[d * max_len], &c->imp_host[s * max_len], len * sizeof(double));
  c->imp_full[d] = c->imp_full[s];
  m40llm_policy_forget(c, layer, dst);
  int rc = len == 0 ? M40LLM_OK
                    : m40llm_memcpy_device(c->ctx, &c->imp_acc[d * max_len],
                                           &c->imp_acc[s * max_len], len * sizeof(m40llm_imp_acc));
  /* dst's own positions past src's length: appended again, they start from 0 */
  if (rc == M40LLM_OK && (size_t)old_dst_len > len) {
    memset(&c->imp_host[d * max_len + len], 0, ((size_t)old_dst_len - len) * sizeof(double));
    rc = m40llm_memset(c->ctx, &c->imp_acc[d * max_len + len], 0,
                       ((size_t)old_dst_len - len) * sizeof(m40llm_imp_acc));
  }
  return rc;
}

/* Every row's score of (layer, seq) from a copy of its accumulators (which waits for the
 * stream): for a list to be rebuilt by a scan. */
static int fetch_all(m40llm_kvcache *c, int layer, int seq) {
  const size_t s = seq_index(c, layer, seq);
  if (c->imp_full[s]) return M40LLM_OK;
  const int len = *m40llm_len_slot(c, layer, seq);
  const int rc = m40llm_memcpy_to_host(c->ctx, c->imp_fetch, &c->imp_acc[row_of(c, layer, seq)],
                                       (size_t)len * sizeof(m40llm_imp_acc));
  if (rc != M40LLM_OK) return rc;
  double *score = &c->imp_host[row_of(c, layer, seq)];
  for (int p = 0; p < len; p++)
    score[p] = m40llm_imp_score(c->imp_fetch[p]);
  c->imp_full[s] = 1;
  return M40LLM_OK;
}

/* A row's importance (its sum over the observe calls that saw it, over their number: imp_host),
 * and its position. */
typedef struct {
  double score;
  int pos;
} key;

static key key_of(const m40llm_kvcache *c, int layer, int seq, int pos) {
  const key k = {c->imp_host[row_of(c, layer, seq) + (size_t)pos], pos};
  return k;
}

/* Less important; ties by position, the earlier first. */
static int below(key a, key b) { return m40llm_imp_below(a.score, a.pos, b.score, b.pos); }

/* Puts pos into the list in order if it is among the rows the list must hold: below its last
 * entry, or anywhere while the list holds every row of the tier. The list stays the tier's n
 * least important rows. */
static void low_insert(const m40llm_kvcache *c, int layer, int seq, low_list l, int pos,
                       int whole) {
  const key k = key_of(c, layer, seq, pos);
  int n = *l.n;
  if (n == 0 && !whole) return;
  if (n > 0 && !below(k, key_of(c, layer, seq, l.pos[n - 1])) && !whole) return;
  if (n == M40LLM_IMP_LOW) n--; /* the last entry drops out */
  int i = n;
  while (i > 0 && below(k, key_of(c, layer, seq, l.pos[i - 1]))) l.pos[i] = l.pos[i - 1], i--;
  l.pos[i] = pos;
  *l.n = (uint8_t)(n + 1);
}

int m40llm_policy_prepare(m40llm_kvcache *c, int layer, int seq, int leaving) {
  if (c->imp_full[seq_index(c, layer, seq)]) return M40LLM_OK;
  const int32_t *count = m40llm_tier_counts(c, layer, seq);
  /* A placement pops at most one entry of a tier's list and an insertion never shortens it, so
   * a list of `leaving` entries or more lasts; only a tier that is or may become full is read. */
  for (int t = 0; t < c->n_tiers; t++)
    if (c->opts.tiers[t].rows > 0 && count[t] + leaving >= c->opts.tiers[t].rows &&
        *low_of(c, layer, seq, t).n < leaving)
      return fetch_all(c, layer, seq);
  return M40LLM_OK;
}

/* The least important row of tier t (which holds rows) into *pos: its list's first, the list
 * rebuilt by a scan of the tier when empty (after m40llm_policy_prepare, without a copy). */
static int lowest(m40llm_kvcache *c, int layer, int seq, int t, int *pos) {
  low_list l = low_of(c, layer, seq, t);
  if (*l.n == 0) {
    const int rc = fetch_all(c, layer, seq);
    if (rc != M40LLM_OK) return rc;
    const int32_t *map = m40llm_tier_slot_pos(c, t, layer, seq);
    const int count = m40llm_tier_counts(c, layer, seq)[t];
    for (int s = 0; s < count; s++) low_insert(c, layer, seq, l, map[s], *l.n < M40LLM_IMP_LOW);
  }
  *pos = l.pos[0];
  return M40LLM_OK;
}

static void low_pop(const m40llm_kvcache *c, int layer, int seq, int t) {
  low_list l = low_of(c, layer, seq, t);
  memmove(l.pos, l.pos + 1, (size_t)(*l.n - 1) * sizeof *l.pos);
  (*l.n)--;
}

int m40llm_policy_place(m40llm_kvcache *c, int layer, int seq, int e, m40llm_row_op *chain,
                        int *n) {
  int32_t *count = m40llm_tier_counts(c, layer, seq);
  uint32_t *where = m40llm_tier_where_of(c, layer, seq);
  /* The tiers that hold rows, in order: "one tier down" is the next of these. */
  int use[M40LLM_MAX_TIERS], n_use = 0;
  for (int t = 0; t < c->n_tiers; t++)
    if (c->opts.tiers[t].rows > 0) use[n_use++] = t;
  const key ke = key_of(c, layer, seq, e);
  int dest = -1, free_at = -1, v, rc;
  for (int u = 0; u < n_use && dest < 0; u++) {
    const int t = use[u];
    if (count[t] < c->opts.tiers[t].rows) {
      dest = free_at = u;
    } else {
      if ((rc = lowest(c, layer, seq, t, &v)) != M40LLM_OK) return rc;
      if (ke.score > (1.0 + (double)c->opts.demote_margin) * key_of(c, layer, seq, v).score)
        dest = u;
    }
  }
  for (int u = dest; u >= 0 && u < n_use && free_at < 0; u++)
    if (count[use[u]] < c->opts.tiers[use[u]].rows) free_at = u;
  if (dest < 0 || free_at < 0) /* the create check makes room for every row that can leave */
    return FAIL(CAPACITY, "no tier of layer %d seq %d has room for position %d", layer, seq, e);
  /* Bottom up: the lowest row of each full tier from free_at - 1 to dest one tier down, into
   * the free row, then each into the slot the one below it left; e into dest's. A failure
   * (a list rebuilt from a copy that failed) comes before anything changes. */
  for (int u = free_at - 1; u >= dest; u--)
    if ((rc = lowest(c, layer, seq, use[u], &v)) != M40LLM_OK) return rc;
  int slot = count[use[free_at]]++;
  *n = 0;
  for (int u = free_at - 1; u >= dest; u--) {
    const int from = use[u], to = use[u + 1];
    (void)lowest(c, layer, seq, from, &v); /* known: each tier's list is only popped once */
    const int v_slot = m40llm_where_slot(where[v]);
    low_pop(c, layer, seq, from);
    const m40llm_row_op op = {seq, v_slot, slot, v, (int16_t)from, (int16_t)to};
    chain[(*n)++] = op;
    m40llm_tier_slot_pos(c, to, layer, seq)[slot] = v;
    where[v] = m40llm_tier_where(to, slot);
    low_insert(c, layer, seq, low_of(c, layer, seq, to), v, 0);
    slot = v_slot;
    c->imp_demoted++;
  }
  const m40llm_row_op op = {seq, e, slot, e, M40LLM_ROW_KEPT, (int16_t)use[dest]};
  chain[(*n)++] = op;
  m40llm_tier_slot_pos(c, use[dest], layer, seq)[slot] = e;
  where[e] = m40llm_tier_where(use[dest], slot);
  low_insert(c, layer, seq, low_of(c, layer, seq, use[dest]), e, 0);
  return M40LLM_OK;
}
