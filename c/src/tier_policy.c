/* Importance placement (M40LLM_PLACE_IMPORTANCE): where a tiered cache puts a row leaving the
 * window, by the attention its observe calls gave it (bench/fidelity/results/buckets.md is the
 * study this rule comes from; bench/fidelity/lib_tiers.py ran it through the public calls).
 * The sums live in backend memory, where the observe calls' kernels add to them; the
 * decisions are the host's, as all of a tiered cache's bookkeeping is (tiers.c), so the sums of
 * a (layer, seq) are copied back before its first placement after an observe call. A victim is
 * a tier's least important row: each (layer, seq, tier) keeps its M40LLM_IMP_LOW least
 * important rows in order, rebuilt by a scan of the tier when it runs out or when the scores
 * change, so that a decode step's placement does not scan every row of every tier. */
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

int m40llm_policy_add_bytes(size_t *bytes, const m40llm_kvcache_options *o) {
  if (o->placement != M40LLM_PLACE_IMPORTANCE) return 1;
  const size_t len = (size_t)o->max_seq_len * sizeof(float);
  const size_t sums = (size_t)o->n_layers * (size_t)o->max_seqs;
  const size_t scratch = (size_t)o->max_seqs * (size_t)o->n_kv_heads;
  if (sums > SIZE_MAX / len || scratch > SIZE_MAX / len || sums * len > SIZE_MAX - scratch * len ||
      *bytes > SIZE_MAX - sums * len - scratch * len)
    return 0;
  *bytes += sums * len + scratch * len;
  return 1;
}

int m40llm_policy_alloc(m40llm_kvcache *c) {
  if (!on(c)) return M40LLM_OK;
  const m40llm_kvcache_options *o = &c->opts;
  const size_t seqs = (size_t)o->n_layers * (size_t)o->max_seqs;
  const size_t positions = seqs * (size_t)o->max_seq_len;
  const size_t scratch = (size_t)o->max_seqs * (size_t)o->n_kv_heads * (size_t)o->max_seq_len;
  c->imp_host = m40llm_host_calloc(positions, sizeof *c->imp_host);
  c->imp_stage = m40llm_host_calloc((size_t)o->max_seqs * (size_t)o->max_seq_len,
                                    sizeof *c->imp_stage);
  c->imp_seen = m40llm_host_calloc(positions, sizeof *c->imp_seen);
  c->imp_calls = m40llm_host_calloc(seqs, sizeof *c->imp_calls);
  c->imp_fresh = m40llm_host_calloc(seqs, sizeof *c->imp_fresh);
  c->imp_low = m40llm_host_calloc(seqs * M40LLM_MAX_TIERS * M40LLM_IMP_LOW, sizeof *c->imp_low);
  c->imp_n_low = m40llm_host_calloc(seqs * M40LLM_MAX_TIERS, sizeof *c->imp_n_low);
  c->imp_chain = m40llm_host_calloc((size_t)o->max_seqs * M40LLM_MAX_TIERS, sizeof *c->imp_chain);
  c->imp_chain_n = m40llm_host_calloc((size_t)o->max_seqs, sizeof *c->imp_chain_n);
  if (!c->imp_host || !c->imp_stage || !c->imp_seen || !c->imp_calls || !c->imp_fresh || !c->imp_low ||
      !c->imp_n_low || !c->imp_chain || !c->imp_chain_n)
    return FAIL(OUT_OF_MEMORY, "allocating the importance placement's host state");
  memset(c->imp_fresh, 1, seqs); /* the sums start at 0 on both sides */
  int rc = m40llm_malloc((void **)&c->imp_sum, c->ctx, positions * sizeof(float));
  if (rc == M40LLM_OK) rc = m40llm_malloc((void **)&c->imp_scratch, c->ctx, scratch * sizeof(float));
  if (rc == M40LLM_OK) rc = m40llm_memset(c->ctx, c->imp_sum, 0, positions * sizeof(float));
  /* decay 0 still reads the old value (0 x NaN would be NaN) */
  if (rc == M40LLM_OK) rc = m40llm_memset(c->ctx, c->imp_scratch, 0, scratch * sizeof(float));
  return rc;
}

void m40llm_policy_free(m40llm_kvcache *c) {
  m40llm_free(c->ctx, c->imp_sum);
  m40llm_free(c->ctx, c->imp_scratch);
  free(c->imp_host);
  free(c->imp_stage);
  free(c->imp_seen);
  free(c->imp_calls);
  free(c->imp_fresh);
  free(c->imp_low);
  free(c->imp_n_low);
  free(c->imp_chain);
  free(c->imp_chain_n);
}

void m40llm_policy_forget(m40llm_kvcache *c, int layer, int seq) {
  if (on(c))
    memset(&c->imp_n_low[seq_index(c, layer, seq) * M40LLM_MAX_TIERS], 0, M40LLM_MAX_TIERS);
}

void m40llm_policy_observed(m40llm_kvcache *c, int layer, const int32_t *ids, int n) {
  for (int i = 0; i < n; i++) {
    const size_t s = seq_index(c, layer, ids[i]);
    c->imp_calls[s]++;
    c->imp_fresh[s] = 0;
    m40llm_policy_forget(c, layer, ids[i]);
  }
}

void m40llm_policy_appended(m40llm_kvcache *c, int layer, int seq, int pos, int n) {
  if (!on(c)) return;
  const int32_t calls = c->imp_calls[seq_index(c, layer, seq)];
  int32_t *seen = &c->imp_seen[row_of(c, layer, seq)];
  double *score = &c->imp_host[row_of(c, layer, seq)];
  for (int p = pos; p < pos + n; p++) seen[p] = calls, score[p] = 0.0; /* no call saw it */
}

int m40llm_policy_truncate(m40llm_kvcache *c, int layer, int seq, int old_len, int new_len) {
  if (!on(c) || old_len <= new_len) return M40LLM_OK;
  /* Positions appended again start from 0. */
  const size_t row = row_of(c, layer, seq);
  memset(&c->imp_host[row + (size_t)new_len], 0, (size_t)(old_len - new_len) * sizeof(double));
  m40llm_policy_forget(c, layer, seq);
  return m40llm_memset(c->ctx, &c->imp_sum[row + (size_t)new_len], 0,
                       (size_t)(old_len - new_len) * sizeof(float));
}

int m40llm_policy_fork(m40llm_kvcache *c, int layer, int dst, int src, int old_dst_len) {
  if (!on(c)) return M40LLM_OK;
  const size_t d = seq_index(c, layer, dst), s = seq_index(c, layer, src);
  const size_t len = (size_t)*m40llm_len_slot(c, layer, src);
  const size_t max_len = (size_t)c->opts.max_seq_len;
  memcpy(&c->imp_host[d * max_len], &c->imp_host[s * max_len], len * sizeof(double));
  memcpy(&c->imp_seen[d * max_len], &c->imp_seen[s * max_len], len * sizeof(int32_t));
  c->imp_calls[d] = c->imp_calls[s];
  c->imp_fresh[d] = c->imp_fresh[s];
  m40llm_policy_forget(c, layer, dst);
  int rc = len == 0 ? M40LLM_OK
                    : m40llm_memcpy_device(c->ctx, &c->imp_sum[d * max_len],
                                           &c->imp_sum[s * max_len], len * sizeof(float));
  /* dst's own positions past src's length: appended again, they start from 0 */
  if (rc == M40LLM_OK && (size_t)old_dst_len > len) {
    memset(&c->imp_host[d * max_len + len], 0, ((size_t)old_dst_len - len) * sizeof(double));
    rc = m40llm_memset(c->ctx, &c->imp_sum[d * max_len + len], 0,
                       ((size_t)old_dst_len - len) * sizeof(float));
  }
  return rc;
}

int m40llm_policy_ready(m40llm_kvcache *c, int layer, const m40llm_append_item *items, int n,
                        const int32_t *leaving) {
  int lo = c->opts.max_seqs, hi = -1;
  for (int i = 0; i < n; i++)
    if (leaving[i] && !c->imp_fresh[seq_index(c, layer, items[i].seq)]) {
      lo = items[i].seq < lo ? items[i].seq : lo;
      hi = items[i].seq > hi ? items[i].seq : hi;
    }
  if (hi < 0) return M40LLM_OK;
  /* One copy for the layer's rows lo..hi (a wait for the backend each, so not one a row). */
  const size_t max_len = (size_t)c->opts.max_seq_len;
  const size_t n_floats = (size_t)(hi - lo) * max_len + (size_t)*m40llm_len_slot(c, layer, hi);
  const int rc = n_floats == 0 ? M40LLM_OK
                               : m40llm_memcpy_to_host(c->ctx, c->imp_stage,
                                                       &c->imp_sum[row_of(c, layer, lo)],
                                                       n_floats * sizeof(float));
  if (rc != M40LLM_OK) return rc;
  for (int seq = lo; seq <= hi; seq++) {
    const size_t s = seq_index(c, layer, seq);
    const float *sum = &c->imp_stage[(size_t)(seq - lo) * max_len];
    const int32_t *seen = &c->imp_seen[s * max_len];
    double *score = &c->imp_host[s * max_len];
    for (int p = 0; p < *m40llm_len_slot(c, layer, seq); p++) {
      const int32_t calls = c->imp_calls[s] - seen[p];
      score[p] = calls > 0 ? (double)sum[p] / (double)calls : 0.0;
    }
    c->imp_fresh[s] = 1;
  }
  return M40LLM_OK;
}

/* A row's importance (its sum over the observe calls that saw it, over their number: imp_host
 * since the last copy), and its position. */
typedef struct {
  double score;
  int pos;
} key;

static key key_of(const m40llm_kvcache *c, int layer, int seq, int pos) {
  const key k = {c->imp_host[row_of(c, layer, seq) + (size_t)pos], pos};
  return k;
}

/* Less important; ties by position, the earlier first. */
static int below(key a, key b) { return a.score < b.score || (a.score == b.score && a.pos < b.pos); }

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

/* The least important row of tier t (which holds rows): its list, rebuilt when empty. */
static int lowest(const m40llm_kvcache *c, int layer, int seq, int t) {
  low_list l = low_of(c, layer, seq, t);
  if (*l.n == 0) {
    const int32_t *map = m40llm_tier_slot_pos(c, t, layer, seq);
    const int count = m40llm_tier_counts(c, layer, seq)[t];
    for (int s = 0; s < count; s++) low_insert(c, layer, seq, l, map[s], *l.n < M40LLM_IMP_LOW);
  }
  return l.pos[0];
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
  int dest = -1, free_at = -1;
  for (int u = 0; u < n_use && dest < 0; u++) {
    const int t = use[u];
    if (count[t] < c->opts.tiers[t].rows)
      dest = free_at = u;
    else if (key_of(c, layer, seq, lowest(c, layer, seq, t)).score < ke.score)
      dest = u;
  }
  for (int u = dest; u >= 0 && u < n_use && free_at < 0; u++)
    if (count[use[u]] < c->opts.tiers[use[u]].rows) free_at = u;
  if (dest < 0 || free_at < 0) /* the create check makes room for every row that can leave */
    return FAIL(CAPACITY, "no tier of layer %d seq %d has room for position %d", layer, seq, e);
  /* Bottom up: the lowest row of each full tier from free_at - 1 to dest one tier down, into
   * the free row, then each into the slot the one below it left; e into dest's. */
  int slot = count[use[free_at]]++;
  *n = 0;
  for (int u = free_at - 1; u >= dest; u--) {
    const int from = use[u], to = use[u + 1];
    const int v = lowest(c, layer, seq, from);
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
