/*
 * Importance placement (m40llm_kvcache_options.placement = M40LLM_PLACE_IMPORTANCE) against a
 * host mirror of the header's rule, fed with the library's own weights: before each observe
 * call the test makes the same call's importance export (decay 0) on the same cache, whose
 * largest value over the K/V heads it adds to its own sums, in float as the rule says, so that
 * its scores are the cache's bit for bit and every decision can be predicted exactly. A twin
 * cache with the default placement is driven by the public calls to the mirror's decisions
 * (each victim moved one tier down with m40llm_kvcache_tier_move, bottom first; its append then
 * puts the leaving row in the first free tier, the mirror's choice): both caches must place every
 * position where the mirror does, hold the same values (read_f16 bit for bit) and attend alike
 * (1e-5 relative), and the stats count the mirror's demotions. Decode appends of one token a
 * sequence, observe calls every few steps, a truncate and a fork part-way, GQA groups of 3 and
 * 2, a tier of 0 rows, margins of hysteresis (demote_margin); errors of the options and of the
 * call.
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

typedef struct {
  m40llm_kvcache_options o;
  int sinks, window;
  float *sum;   /* [layer][seq][pos] */
  int *seen;    /* [layer][seq][pos]: observe calls before pos was appended */
  int *calls;   /* [layer][seq] */
  int *tier;    /* [layer][seq][pos]: -1 while in an FP16 slot */
  int *lo;      /* [layer][seq]: the window's start, as the library keeps it */
  int *len;     /* [layer][seq] */
  int *count;   /* [layer][seq][M40LLM_MAX_TIERS] */
  long long demoted, moved; /* the rule's moves; the caller's (tier_move) */
  long long spared; /* tiers whose least important row the margin kept: less important, not
                       by the factor */
  float *same_k, *same_v; /* NULL, or the row that half the appended rows are (equal scores) */
} mirror;

static size_t at(const mirror *m, int layer, int seq) {
  return (size_t)layer * (size_t)m->o.max_seqs + (size_t)seq;
}

static int mirror_init(mirror *m, const m40llm_kvcache_options *o) {
  memset(m, 0, sizeof *m);
  m->o = *o;
  m->sinks = o->n_sinks < o->max_seq_len ? o->n_sinks : o->max_seq_len;
  m->window = o->window < o->max_seq_len - m->sinks ? o->window : o->max_seq_len - m->sinks;
  const size_t seqs = (size_t)o->n_layers * (size_t)o->max_seqs;
  const size_t pos = seqs * (size_t)o->max_seq_len;
  m->sum = calloc(pos, sizeof *m->sum);
  m->seen = calloc(pos, sizeof *m->seen);
  m->tier = calloc(pos, sizeof *m->tier);
  m->calls = calloc(seqs, sizeof *m->calls);
  m->lo = calloc(seqs, sizeof *m->lo);
  m->len = calloc(seqs, sizeof *m->len);
  m->count = calloc(seqs * M40LLM_MAX_TIERS, sizeof *m->count);
  return m->sum && m->seen && m->tier && m->calls && m->lo && m->len && m->count;
}

static void mirror_free(mirror *m) {
  free(m->same_k);
  free(m->same_v);
  free(m->sum);
  free(m->seen);
  free(m->tier);
  free(m->calls);
  free(m->lo);
  free(m->len);
  free(m->count);
}

/* The header's score: the sum over the observe calls that saw the row, over their number. */
static double score(const mirror *m, int layer, int seq, int p) {
  const size_t r = at(m, layer, seq) * (size_t)m->o.max_seq_len + (size_t)p;
  const int calls = m->calls[at(m, layer, seq)] - m->seen[r];
  return calls > 0 ? (double)m->sum[r] / (double)calls : 0.0;
}

/* Tier t's least important row (ties: the earlier position), or -1 if it holds none. */
static int least(const mirror *m, int layer, int seq, int t) {
  const int *tier = &m->tier[at(m, layer, seq) * (size_t)m->o.max_seq_len];
  int best = -1;
  for (int p = 0; p < m->len[at(m, layer, seq)]; p++)
    if (tier[p] == t && (best < 0 || score(m, layer, seq, p) < score(m, layer, seq, best)))
      best = p;
  return best;
}

/* Position e leaves the window: the mirror's decision, applied to the twin before its append
 * (victims one tier down, bottom first). Returns the status of the twin's moves. */
static int place(mirror *m, m40llm_kvcache *twin, int layer, int seq, int e) {
  int *count = &m->count[at(m, layer, seq) * M40LLM_MAX_TIERS];
  int *tier = &m->tier[at(m, layer, seq) * (size_t)m->o.max_seq_len];
  int use[M40LLM_MAX_TIERS], n_use = 0;
  for (int t = 0; t < m->o.n_tiers; t++)
    if (m->o.tiers[t].rows > 0) use[n_use++] = t;
  int dest = -1, free_at = -1;
  for (int u = 0; u < n_use && dest < 0; u++) {
    if (count[use[u]] < m->o.tiers[use[u]].rows) {
      dest = free_at = u;
    } else {
      const double s_e = score(m, layer, seq, e);
      const double s_v = score(m, layer, seq, least(m, layer, seq, use[u]));
      if (s_e > (1.0 + (double)m->o.demote_margin) * s_v)
        dest = u;
      else if (s_e > s_v)
        m->spared++;
    }
  }
  for (int u = dest; u < n_use && free_at < 0; u++)
    if (count[use[u]] < m->o.tiers[use[u]].rows) free_at = u;
  if (!T_CHECKF(dest >= 0 && free_at >= 0, "no tier for position %d", e)) return -1;
  int rc = M40LLM_OK;
  for (int u = free_at - 1; u >= dest && rc == M40LLM_OK; u--) {
    const int v = least(m, layer, seq, use[u]);
    rc = m40llm_kvcache_tier_move(twin, layer, seq, v, v + 1, use[u + 1]);
    tier[v] = use[u + 1];
    m->demoted++;
  }
  count[use[free_at]]++;
  tier[e] = use[dest];
  return rc;
}

/* Rows alike have equal weights, and equal scores where the same calls saw them in the same
 * tier: the order of equal scores (the earlier position first) decides. */
static int mirror_same_rows(mirror *m) {
  const size_t row = (size_t)m->o.n_kv_heads * (size_t)m->o.head_dim;
  m->same_k = malloc(row * sizeof(float));
  m->same_v = malloc(row * sizeof(float));
  if (!m->same_k || !m->same_v) return 0;
  t_fill_kv_values(m->same_k, (size_t)m->o.n_kv_heads, m->o.head_dim, 0);
  t_fill_kv_values(m->same_v, (size_t)m->o.n_kv_heads, m->o.head_dim, 1);
  return 1;
}

/* One append of counts[i] tokens to each of ids: to the cache in one batched call, to the twin
 * a token at a time, each leaving row's placement by the mirror first (a batch's rows leave in
 * order, each placed before the next, as the twin's single appends place them). */
/* twin_batch: the twin takes the rows in the same batched append (rows leaving the window in
 * the append they came in are quantized from the input, not from an FP16 slot), for rows no
 * observe call has seen, which displace nothing. */
static void step_append(m40llm_context *ctx, m40llm_kvcache *c, m40llm_kvcache *twin, mirror *m,
                        int layer, const int32_t *ids, const int32_t *counts, int n,
                        int twin_batch) {
  const long long demoted = m->demoted;
  const int heads = m->o.n_kv_heads, d = m->o.head_dim;
  const size_t row = (size_t)heads * (size_t)d;
  int total = 0;
  for (int i = 0; i < n; i++) total += counts[i];
  float *k = malloc((size_t)total * row * sizeof(float));
  float *v = malloc((size_t)total * row * sizeof(float));
  if (!T_CHECK(k && v)) goto out;
  t_fill_kv_values(k, (size_t)total * heads, d, 0);
  t_fill_kv_values(v, (size_t)total * heads, d, 1);
  for (int r = 0; r < total && m->same_k; r++)
    if (t_rand_int(0, 1) == 0) {
      memcpy(k + (size_t)r * row, m->same_k, row * sizeof(float));
      memcpy(v + (size_t)r * row, m->same_v, row * sizeof(float));
    }
  for (int i = 0, r = 0; i < n; i++)
    for (int j = 0; j < counts[i]; j++, r++) {
      const size_t s = at(m, layer, ids[i]);
      const int pos = m->len[s], lo_before = m->lo[s];
      const int lo_after = pos + 1 - m->window > lo_before ? pos + 1 - m->window : lo_before;
      const int q0 = lo_before > m->sinks ? lo_before : m->sinks;
      const int q1 = lo_after > m->sinks ? lo_after : m->sinks;
      for (int e = q0; e < q1 && e < pos; e++)
        if (place(m, twin, layer, ids[i], e) != M40LLM_OK) goto out;
      if (!twin_batch) {
        float *dk = t_dev_upload(ctx, k + (size_t)r * row, row * sizeof(float));
        float *dv = t_dev_upload(ctx, v + (size_t)r * row, row * sizeof(float));
        T_OK(m40llm_kvcache_append_f32(twin, layer, ids[i], dk, dv, 1));
        m40llm_free(ctx, dk);
        m40llm_free(ctx, dv);
      }
      m->seen[s * (size_t)m->o.max_seq_len + (size_t)pos] = m->calls[s];
      m->tier[s * (size_t)m->o.max_seq_len + (size_t)pos] = -1;
      m->len[s] = pos + 1;
      m->lo[s] = lo_after;
      /* a row appended past the window (window 0) takes the first free tier */
      if (pos >= m->sinks && pos < lo_after) {
        int t = 0;
        while (t < m->o.n_tiers - 1 &&
               m->count[s * M40LLM_MAX_TIERS + (size_t)t] >= m->o.tiers[t].rows)
          t++;
        m->count[s * M40LLM_MAX_TIERS + (size_t)t]++;
        m->tier[s * (size_t)m->o.max_seq_len + (size_t)pos] = t;
      }
    }
  float *dk = t_dev_upload(ctx, k, (size_t)total * row * sizeof(float));
  float *dv = t_dev_upload(ctx, v, (size_t)total * row * sizeof(float));
  T_OK(m40llm_kvcache_append_batch_f32(c, layer, ids, counts, n, dk, dv));
  if (twin_batch) {
    T_CHECK(m->demoted == demoted);
    T_OK(m40llm_kvcache_append_batch_f32(twin, layer, ids, counts, n, dk, dv));
  }
  m40llm_free(ctx, dk);
  m40llm_free(ctx, dv);
out:
  free(k);
  free(v);
}

/* A caller's own move on both caches and the mirror: the least important row of a random tier
 * of (layer, seq) (the head of the cache's own list of it) into another tier with room, if
 * there is one; the cache must forget what it knew of both tiers' order. */
static void random_move(m40llm_kvcache *c, m40llm_kvcache *twin, mirror *m, int layer, int seq) {
  const size_t s = at(m, layer, seq);
  int *tier = &m->tier[s * (size_t)m->o.max_seq_len], *count = &m->count[s * M40LLM_MAX_TIERS];
  const int p = least(m, layer, seq, t_rand_int(0, m->o.n_tiers - 1));
  if (p < 0) return;
  for (int t = 0; t < m->o.n_tiers; t++)
    if (t != tier[p] && count[t] < m->o.tiers[t].rows) {
      T_OK(m40llm_kvcache_tier_move(c, layer, seq, p, p + 1, t));
      T_OK(m40llm_kvcache_tier_move(twin, layer, seq, p, p + 1, t));
      count[tier[p]]--, count[t]++, tier[p] = t;
      m->moved++;
      return;
    }
}

/* Every position of (layer, seq): the tier of both caches against the mirror. */
static void check_tiers(m40llm_kvcache *c, m40llm_kvcache *twin, const mirror *m, int layer,
                        int seq) {
  const size_t s = at(m, layer, seq);
  int bad = 0, first = -1, got = 0, got_twin = 0;
  for (int p = 0; p < m->len[s]; p++) {
    int t = -9, tt = -9;
    T_OK(m40llm_kvcache_tier_of(&t, c, layer, seq, p));
    T_OK(m40llm_kvcache_tier_of(&tt, twin, layer, seq, p));
    const int want = m->tier[s * (size_t)m->o.max_seq_len + (size_t)p];
    if ((t != want || tt != want) && bad++ == 0) first = p, got = t, got_twin = tt;
  }
  T_CHECKF(bad == 0, "layer %d seq %d: %d position(s) off the mirror's tiers, first %d: %d "
           "(twin %d), the mirror says %d", layer, seq, bad, first, got, got_twin,
           first >= 0 ? m->tier[s * (size_t)m->o.max_seq_len + (size_t)first] : 0);
}

/* An observe call on ids: first the same call's importance (decay 0) into the mirror, then the
 * observe, whose output must be the export call's; the twin attends within 1e-5 of it. */
static void observe(m40llm_context *ctx, m40llm_kvcache *c, m40llm_kvcache *twin, mirror *m,
                    int layer, const int32_t *ids, int n, float *dimp) {
  const size_t q_row = (size_t)m->o.n_heads * (size_t)m->o.head_dim;
  const size_t len_max = (size_t)m->o.max_seq_len;
  const size_t imp_n = (size_t)n * (size_t)m->o.n_kv_heads * len_max;
  float *q = malloc((size_t)n * q_row * sizeof(float));
  float *o1 = malloc((size_t)n * q_row * sizeof(float)), *o2 = malloc((size_t)n * q_row * sizeof(float));
  float *o3 = malloc((size_t)n * q_row * sizeof(float)), *imp = malloc(imp_n * sizeof(float));
  float *dq = NULL, *dout = t_dev_alloc(ctx, (size_t)n * q_row * sizeof(float));
  int32_t *dids = t_dev_upload(ctx, ids, (size_t)n * sizeof *ids);
  if (!T_CHECK(q && o1 && o2 && o3 && imp && dout && dids)) goto out;
  t_fill_uniform(q, (size_t)n * q_row, -1.0f, 1.0f);
  dq = t_dev_upload(ctx, q, (size_t)n * q_row * sizeof(float));
  if (!T_OK(m40llm_kvcache_attn_importance_ex(dout, dimp, len_max, 0.0f, c, layer, ids, n, dq,
                                              M40LLM_DTYPE_F32, 0.0f)) ||
      !t_dev_download(ctx, o1, dout, (size_t)n * q_row * sizeof(float)) ||
      !t_dev_download(ctx, imp, dimp, imp_n * sizeof(float)))
    goto out;
  for (int i = 0; i < n; i++) {
    const size_t s = at(m, layer, ids[i]);
    for (int p = 0; p < m->len[s]; p++) {
      float most = 0.0f;
      for (int g = 0; g < m->o.n_kv_heads; g++) {
        const float w = imp[((size_t)i * (size_t)m->o.n_kv_heads + (size_t)g) * len_max + (size_t)p];
        most = w > most ? w : most;
      }
      m->sum[s * len_max + (size_t)p] += most;
    }
    m->calls[s]++;
  }
  if (!T_OK(m40llm_kvcache_attn_observe_ex(dout, c, layer, ids, n, dq, M40LLM_DTYPE_F32, 0.0f)) ||
      !t_dev_download(ctx, o2, dout, (size_t)n * q_row * sizeof(float)) ||
      !T_OK(m40llm_kvcache_attn_batch_f32q(dout, twin, layer, ids, n, dq, 0.0f)) ||
      !t_dev_download(ctx, o3, dout, (size_t)n * q_row * sizeof(float)))
    goto out;
  T_CHECKF(memcmp(o1, o2, (size_t)n * q_row * sizeof(float)) == 0,
           "layer %d: the observe call's output differs from the importance call's", layer);
  double *ref = malloc((size_t)n * q_row * sizeof(double));
  if (T_CHECK(ref)) {
    for (size_t j = 0; j < (size_t)n * q_row; j++) ref[j] = o3[j];
    const double err = t_rel_l2(o2, ref, (size_t)n * q_row);
    T_CHECKF(err <= 1e-5, "layer %d: observe output %.3g off the twin's (relative L2)", layer, err);
  }
  free(ref);
out:
  m40llm_free(ctx, dq);
  m40llm_free(ctx, dout);
  m40llm_free(ctx, dids);
  free(q);
  free(o1);
  free(o2);
  free(o3);
  free(imp);
}

/* read_f16 of every position of (layer, seq): the same bits in both caches. */
static void check_values(m40llm_context *ctx, m40llm_kvcache *c, m40llm_kvcache *twin,
                         const mirror *m, int layer, int seq) {
  const int len = m->len[at(m, layer, seq)];
  if (len == 0) return;
  const size_t n = (size_t)len * (size_t)m->o.n_kv_heads * (size_t)m->o.head_dim;
  uint16_t *dk = t_dev_alloc(ctx, n * 2), *dv = t_dev_alloc(ctx, n * 2);
  uint16_t *k1 = malloc(n * 2), *v1 = malloc(n * 2), *k2 = malloc(n * 2), *v2 = malloc(n * 2);
  if (T_CHECK(dk && dv && k1 && v1 && k2 && v2) &&
      T_OK(m40llm_kvcache_read_f16(dk, dv, c, layer, seq, 0, len)) &&
      t_dev_download(ctx, k1, dk, n * 2) && t_dev_download(ctx, v1, dv, n * 2) &&
      T_OK(m40llm_kvcache_read_f16(dk, dv, twin, layer, seq, 0, len)) &&
      t_dev_download(ctx, k2, dk, n * 2) && t_dev_download(ctx, v2, dv, n * 2))
    T_CHECKF(memcmp(k1, k2, n * 2) == 0 && memcmp(v1, v2, n * 2) == 0,
             "layer %d seq %d: read_f16 differs from the twin's", layer, seq);
  m40llm_free(ctx, dk);
  m40llm_free(ctx, dv);
  free(k1);
  free(v1);
  free(k2);
  free(v2);
}

static void mirror_truncate(mirror *m, int seq, int new_len) {
  for (int l = 0; l < m->o.n_layers; l++) {
    const size_t s = at(m, l, seq);
    for (int p = new_len; p < m->len[s]; p++) {
      const size_t r = s * (size_t)m->o.max_seq_len + (size_t)p;
      if (m->tier[r] >= 0) m->count[s * M40LLM_MAX_TIERS + (size_t)m->tier[r]]--;
      m->sum[r] = 0.0f;
    }
    if (m->len[s] > new_len) m->len[s] = new_len;
    if (m->lo[s] > new_len) m->lo[s] = new_len;
  }
}

static void mirror_fork(mirror *m, int dst, int src) {
  const size_t len = (size_t)m->o.max_seq_len;
  for (int l = 0; l < m->o.n_layers; l++) {
    const size_t d = at(m, l, dst), s = at(m, l, src);
    memcpy(&m->sum[d * len], &m->sum[s * len], len * sizeof *m->sum);
    memcpy(&m->seen[d * len], &m->seen[s * len], len * sizeof *m->seen);
    memcpy(&m->tier[d * len], &m->tier[s * len], len * sizeof *m->tier);
    memcpy(&m->count[d * M40LLM_MAX_TIERS], &m->count[s * M40LLM_MAX_TIERS],
           M40LLM_MAX_TIERS * sizeof *m->count);
    m->calls[d] = m->calls[s], m->lo[d] = m->lo[s], m->len[d] = m->len[s];
  }
}

/* A cache of these options (placement aside) and its twin, `steps` decode steps of every
 * sequence but the last (the fork's), an observe call every `every` steps. */
/* prompt: tokens appended to each sequence first, in one append of the batch (rows no observe
 * call has seen: the first free tier). */
static void run(m40llm_context *ctx, m40llm_kvcache_options o, int prompt, int steps, int every,
                int ties) {
  t_set_case("placement by importance: %d/%d heads, head_dim %d, %d tiers, sinks %d, window %d, "
             "prompt %d, observe every %d, margin %g%s", o.n_heads, o.n_kv_heads, o.head_dim,
             o.n_tiers, o.n_sinks, o.window, prompt, every, (double)o.demote_margin,
             ties ? ", half the rows alike" : "");
  m40llm_kvcache *c = NULL, *twin = NULL;
  mirror m;
  o.placement = M40LLM_PLACE_IMPORTANCE;
  m40llm_kvcache_options ot = o;
  ot.placement = M40LLM_PLACE_FIRST_FREE;
  const size_t imp_bytes =
      (size_t)o.max_seqs * (size_t)o.n_kv_heads * (size_t)o.max_seq_len * sizeof(float);
  float *dimp = t_dev_alloc(ctx, imp_bytes);
  if (!T_CHECK(mirror_init(&m, &o)) || !dimp || !T_OK(m40llm_memset(ctx, dimp, 0, imp_bytes)) ||
      (ties && !T_CHECK(mirror_same_rows(&m))) ||
      !T_OK(m40llm_kvcache_create(&c, ctx, &o)) || !T_OK(m40llm_kvcache_create(&twin, ctx, &ot)))
    goto out;
  const int n = o.max_seqs - 1;
  int32_t ids[8], counts[8];
  for (int i = 0; i < n; i++) ids[i] = n - 1 - i; /* not in order */
  for (int i = 0; i < n && prompt > 0; i++) counts[i] = prompt;
  for (int l = 0; l < o.n_layers && prompt > 0; l++)
    step_append(ctx, c, twin, &m, l, ids, counts, n, 1);
  for (int step = 0; step < steps; step++) {
    /* part-way: seq 0 cut back into its quantized rows, then grown again */
    if (step == steps / 2) {
      const int new_len = m.len[at(&m, 0, 0)] / 2;
      T_OK(m40llm_kvcache_seq_truncate(c, 0, new_len));
      T_OK(m40llm_kvcache_seq_truncate(twin, 0, new_len));
      mirror_truncate(&m, 0, new_len);
    }
    /* mostly one token a sequence; some appends of 2-3 take several rows out of the window */
    for (int i = 0; i < n; i++) counts[i] = t_rand_int(0, 3) == 0 ? t_rand_int(2, 3) : 1;
    for (int l = 0; l < o.n_layers; l++) {
      step_append(ctx, c, twin, &m, l, ids, counts, n, 0);
      if (step % every == every - 1) observe(ctx, c, twin, &m, l, ids, n, dimp);
      /* sometimes a second call before the next append, on the first and last ids: its
       * records replace the first call's, and the copy spans sequences it did not see */
      if (step % every == every - 1 && t_rand_int(0, 4) == 0) {
        const int32_t ends[2] = {ids[0], ids[n - 1]};
        observe(ctx, c, twin, &m, l, ends, 2, dimp);
      }
      if (t_rand_int(0, 3) == 0) random_move(c, twin, &m, l, ids[t_rand_int(0, n - 1)]);
    }
    if (t_rand_int(0, 9) == 0 || step == steps - 1)
      for (int l = 0; l < o.n_layers; l++)
        for (int i = 0; i < n; i++) check_tiers(c, twin, &m, l, ids[i]);
  }
  /* forks go on from their source's state: into the unused sequence, and over seq 2, longer
   * than its source (its own sums past the source's length must not come back) */
  T_OK(m40llm_kvcache_seq_fork(c, n, 1));
  T_OK(m40llm_kvcache_seq_fork(twin, n, 1));
  mirror_fork(&m, n, 1);
  T_OK(m40llm_kvcache_seq_fork(c, 2, 0));
  T_OK(m40llm_kvcache_seq_fork(twin, 2, 0));
  mirror_fork(&m, 2, 0);
  const int32_t forked[3] = {n, 2, 0}, ones[3] = {1, 1, 1};
  for (int step = 0; step < 40; step++)
    for (int l = 0; l < o.n_layers; l++) {
      step_append(ctx, c, twin, &m, l, forked, ones, 3, 0);
      if (step % every == every - 1) observe(ctx, c, twin, &m, l, forked, 3, dimp);
    }
  for (int l = 0; l < o.n_layers; l++)
    for (int s = 0; s < o.max_seqs; s++) {
      check_tiers(c, twin, &m, l, s);
      check_values(ctx, c, twin, &m, l, s);
    }
  m40llm_tier_stats st = M40LLM_TIER_STATS_INIT, st_twin = M40LLM_TIER_STATS_INIT;
  if (T_OK(m40llm_kvcache_tier_stats(&st, c)) && T_OK(m40llm_kvcache_tier_stats(&st_twin, twin))) {
    T_CHECKF(st.demoted_rows == m.demoted && m.demoted > 0,
             "demoted_rows %lld, the mirror moved %lld", (long long)st.demoted_rows, m.demoted);
    /* a margin's cases must have met rows it kept in their tiers */
    T_CHECKF((o.demote_margin > 0.0f) == (m.spared > 0), "margin %g spared %lld rows",
             (double)o.demote_margin, m.spared);
    T_CHECK(st.moved_rows == m.moved && st_twin.moved_rows == m.demoted + m.moved &&
            st_twin.demoted_rows == 0);
    for (int t = 0; t < o.n_tiers; t++) T_CHECK(st.rows[t] == st_twin.rows[t]);
  }
out:
  m40llm_kvcache_destroy(c);
  m40llm_kvcache_destroy(twin);
  m40llm_free(ctx, dimp);
  mirror_free(&m);
}

static m40llm_kvcache_options shape(int n_heads, int n_kv_heads, int head_dim, int len, int sinks,
                                    int window) {
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = 2;
  o.n_heads = n_heads;
  o.n_kv_heads = n_kv_heads;
  o.head_dim = head_dim;
  o.max_seqs = 4;
  o.max_seq_len = len;
  o.n_sinks = sinks;
  o.window = window;
  /* the study's pairs, the top tier small so that it fills early */
  const int rows = len - sinks - window;
  const int pairs[4][3] = {{M40LLM_KV_Q8, M40LLM_KV_Q8, rows / 6}, {M40LLM_KV_Q8, M40LLM_KV_Q4, rows / 5},
                           {M40LLM_KV_Q4, M40LLM_KV_Q3, rows / 4}, {M40LLM_KV_Q4, M40LLM_KV_Q2, rows}};
  o.n_tiers = 4;
  for (int t = 0; t < 4; t++) o.tiers[t] = (m40llm_kv_tier){pairs[t][0], pairs[t][1], pairs[t][2]};
  o.format = o.tiers[0].k_format;
  o.v_format = o.tiers[0].v_format;
  return o;
}

/* auto_observe's two caches and the test's model of the header's count (since[layer][seq]: the
 * plain calls that named the sequence since the last observe call that did). */
enum { AUTO_SEQS = 4 };
typedef struct {
  m40llm_context *ctx;
  m40llm_kvcache *c, *twin;
  m40llm_kvcache_options o;
  int cuda;
  int since[2][AUTO_SEQS];
  long long observed;  /* observe calls the model counts */
  float *dq, *dout, *dout_twin, *dk, *dv, *dimp; /* device: q, outputs, K/V of 4 rows; importance */
  float *h1, *h2;
} twins;

/* The model: whether a call of distinct ids is due, and what a call does to the counts. */
static int model_due(const twins *t, int layer, const int32_t *ids, int n) {
  for (int i = 0; i < n; i++)
    if (t->since[layer][ids[i]] >= t->o.observe_interval - 1) return 1;
  return 0;
}
static void model_call(twins *t, int layer, const int32_t *ids, int n, int observed) {
  int named[AUTO_SEQS] = {0};
  for (int i = 0; i < n; i++) named[ids[i]] = 1;
  for (int s = 0; s < AUTO_SEQS; s++)
    if (named[s] && observed) t->since[layer][s] = 0;
    else if (named[s] && t->since[layer][s] < t->o.observe_interval) t->since[layer][s]++;
  t->observed += observed;
}

/* One attention call of ids on both caches: c's plain call (last_token for one id), the twin's
 * an observe call where the model says c's is due (can: the call could observe), else plain;
 * the same kind of call on both, so the same kernels and the same bits. */
static void both_attend(twins *t, int layer, const int32_t *ids, int n, int can, const char *what) {
  const size_t bytes = (size_t)n * (size_t)t->o.n_heads * (size_t)t->o.head_dim * sizeof(float);
  const int due = can && model_due(t, layer, ids, n);
  T_OK(n == 1 ? m40llm_kvcache_attn_last_token_f32q(t->dout, t->c, layer, ids[0], t->dq, 0.0f)
              : m40llm_kvcache_attn_batch_f32q(t->dout, t->c, layer, ids, n, t->dq, 0.0f));
  T_OK(due ? m40llm_kvcache_attn_observe_ex(t->dout_twin, t->twin, layer, ids, n, t->dq,
                                            M40LLM_DTYPE_F32, 0.0f)
           : m40llm_kvcache_attn_batch_f32q(t->dout_twin, t->twin, layer, ids, n, t->dq, 0.0f));
  model_call(t, layer, ids, n, due);
  if (t_dev_download(t->ctx, t->h1, t->dout, bytes) &&
      t_dev_download(t->ctx, t->h2, t->dout_twin, bytes))
    T_CHECKF(memcmp(t->h1, t->h2, bytes) == 0, "layer %d, %s (observe %s): the output differs "
             "from the twin's", layer, what, due ? "due" : "not due");
}

enum { CALL_PLAIN, CALL_APPEND_ATTN, CALL_REPEATS, CALL_EXPLICIT, CALL_CAPTURED, CALL_SINGLES,
       CALL_OTHERS, CALL_REPEATED_PAIR };

/* A decode step of one layer on both caches: a token appended to every sequence, then calls of
 * the kind given. */
static void twin_step(twins *t, int layer, int kind) {
  const size_t q_row = (size_t)t->o.n_heads * (size_t)t->o.head_dim;
  const size_t kv_row = (size_t)t->o.n_kv_heads * (size_t)t->o.head_dim;
  const int32_t ids[AUTO_SEQS] = {2, 0, 3, 1}, repeats[3] = {1, 3, 1}, pair[2] = {3, 0};
  const int32_t repeated_pair[2] = {3, 1}; /* the sequences `repeats` names */
  float *hq = malloc((size_t)AUTO_SEQS * q_row * sizeof(float));
  float *hkv = malloc((size_t)AUTO_SEQS * kv_row * sizeof(float));
  if (!T_CHECK(hq && hkv)) goto out;
  t_fill_uniform(hq, (size_t)AUTO_SEQS * q_row, -1.0f, 1.0f);
  if (!T_OK(m40llm_memcpy_to_device(t->ctx, t->dq, hq, (size_t)AUTO_SEQS * q_row * sizeof(float))))
    goto out;
  t_fill_kv_values(hkv, (size_t)AUTO_SEQS * t->o.n_kv_heads, t->o.head_dim, 0);
  if (!T_OK(m40llm_memcpy_to_device(t->ctx, t->dk, hkv, (size_t)AUTO_SEQS * kv_row * sizeof(float))))
    goto out;
  t_fill_kv_values(hkv, (size_t)AUTO_SEQS * t->o.n_kv_heads, t->o.head_dim, 1);
  if (!T_OK(m40llm_memcpy_to_device(t->ctx, t->dv, hkv, (size_t)AUTO_SEQS * kv_row * sizeof(float))))
    goto out;
  T_OK(m40llm_kvcache_append_batch_f32(t->twin, layer, ids, NULL, AUTO_SEQS, t->dk, t->dv));
  if (kind == CALL_APPEND_ATTN) { /* append and attend in one call on c */
    const size_t bytes = (size_t)AUTO_SEQS * q_row * sizeof(float);
    const int due = model_due(t, layer, ids, AUTO_SEQS);
    T_OK(m40llm_kvcache_append_attn_f32q(t->dout, t->c, layer, ids, AUTO_SEQS, t->dk, t->dv,
                                         t->dq, 0.0f));
    T_OK(due ? m40llm_kvcache_attn_observe_ex(t->dout_twin, t->twin, layer, ids, AUTO_SEQS,
                                              t->dq, M40LLM_DTYPE_F32, 0.0f)
             : m40llm_kvcache_attn_batch_f32q(t->dout_twin, t->twin, layer, ids, AUTO_SEQS, t->dq,
                                              0.0f));
    model_call(t, layer, ids, AUTO_SEQS, due);
    if (t_dev_download(t->ctx, t->h1, t->dout, bytes) &&
        t_dev_download(t->ctx, t->h2, t->dout_twin, bytes))
      T_CHECKF(memcmp(t->h1, t->h2, bytes) == 0, "layer %d, append_attn (observe %s): the "
               "output differs from the twin's", layer, due ? "due" : "not due");
    goto out;
  }
  T_OK(m40llm_kvcache_append_batch_f32(t->c, layer, ids, NULL, AUTO_SEQS, t->dk, t->dv));
  switch (kind) {
    case CALL_REPEATS: /* a sequence named twice: plain, and the ones it names counted once */
      both_attend(t, layer, repeats, 3, 0, "a sequence named twice");
      break;
    case CALL_CAPTURED: { /* plain in a graph capture, counted as a plain call */
      m40llm_graph *g = NULL;
      if (!T_OK(m40llm_graph_capture_begin(t->ctx))) break;
      T_OK(m40llm_kvcache_attn_batch_f32q(t->dout, t->c, layer, ids, AUTO_SEQS, t->dq, 0.0f));
      T_OK(m40llm_kvcache_attn_batch_f32q(t->dout_twin, t->twin, layer, ids, AUTO_SEQS, t->dq,
                                          0.0f));
      if (T_OK(m40llm_graph_capture_end(&g, t->ctx, NULL))) T_OK(m40llm_graph_launch(g));
      m40llm_graph_destroy(g);
      model_call(t, layer, ids, AUTO_SEQS, 0);
      const size_t bytes = (size_t)AUTO_SEQS * q_row * sizeof(float);
      if (t_dev_download(t->ctx, t->h1, t->dout, bytes) &&
          t_dev_download(t->ctx, t->h2, t->dout_twin, bytes))
        T_CHECKF(memcmp(t->h1, t->h2, bytes) == 0, "layer %d, captured: the output differs",
                 layer);
      break;
    }
    case CALL_REPEATED_PAIR:
      both_attend(t, layer, repeated_pair, 2, 1, "the sequences named twice before");
      break;
    case CALL_SINGLES: /* a call a sequence: each counted and observed on its own */
      for (int i = 0; i < AUTO_SEQS; i++) both_attend(t, layer, &ids[i], 1, 1, "one sequence");
      break;
    case CALL_OTHERS: { /* neither a failed call nor an export counts; then two of the four */
      const int32_t one = ids[0];
      T_FAIL_WITH(m40llm_kvcache_attn_batch_f32q(t->dout, t->c, layer, ids, AUTO_SEQS, NULL, 0.0f),
                  M40LLM_ERR_INVALID_ARGUMENT, "q");
      T_FAIL_WITH(m40llm_kvcache_attn_last_token_f32q(t->dout, t->c, layer, AUTO_SEQS, t->dq, 0.0f),
                  M40LLM_ERR_OUT_OF_RANGE, "seq");
      T_FAIL_WITH(m40llm_kvcache_append_attn_f32q(t->dout, t->c, layer, repeats, 3, t->dk, t->dv,
                                                  t->dq, 0.0f),
                  M40LLM_ERR_INVALID_ARGUMENT, "seq_ids");
      const size_t stride = (size_t)t->o.max_seq_len;
      T_OK(m40llm_kvcache_attn_importance_ex(t->dout, t->dimp, stride, 0.0f, t->c, layer, ids,
                                             AUTO_SEQS, t->dq, M40LLM_DTYPE_F32, 0.0f));
      T_OK(m40llm_kvcache_attn_weights_ex(t->dout, t->dimp, stride, t->c, layer, &one, 1, t->dq,
                                          M40LLM_DTYPE_F32, 0.0f));
      both_attend(t, layer, pair, 2, 1, "two of the sequences");
      break;
    }
    default:
      both_attend(t, layer, ids, AUTO_SEQS, 1, "the batch");
  }
  /* a caller's own observe call on both: it starts the count again for its sequences */
  if (kind == CALL_EXPLICIT) {
    T_OK(m40llm_kvcache_attn_observe_ex(t->dout, t->c, layer, pair, 2, t->dq, M40LLM_DTYPE_F32, 0.0f));
    T_OK(m40llm_kvcache_attn_observe_ex(t->dout_twin, t->twin, layer, pair, 2, t->dq,
                                        M40LLM_DTYPE_F32, 0.0f));
    model_call(t, layer, pair, 2, 1);
  }
out:
  free(hq);
  free(hkv);
}

/* The cache's own observe calls (m40llm_kvcache_options.observe_interval = every), made by a
 * loop of plain calls, against a twin with observe_interval 0 whose caller makes the observe
 * calls where the header says the cache makes its own: every tier decision, every output bit
 * and the count of observe calls must be the twin's. Among the calls: append_attn, a call that
 * names a sequence twice when due (made plain: it stays due), calls a sequence (counted a
 * sequence), calls of two of the four sequences, failed calls and exports (counted nothing), a
 * caller's own observe call (the count starts again), and on CUDA calls inside a graph capture
 * (made plain). */
static void auto_observe(m40llm_context *ctx, int every, int steps) {
  t_set_case("placement by importance: the cache's own observe calls, every %d", every);
  m40llm_kvcache_options o = shape(6, 3, 64, steps + 32, 2, 4); /* the last loop's steps too */
  o.max_seqs = AUTO_SEQS;
  o.placement = M40LLM_PLACE_IMPORTANCE;
  o.observe_interval = every;
  m40llm_kvcache_options ot = o;
  ot.observe_interval = 0;
  twins t = {ctx, NULL, NULL, o, 0, {{0}}, 0, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
  m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
  t.cuda = T_OK(m40llm_context_device_info(&info, ctx)) && info.backend == M40LLM_BACKEND_CUDA;
  const size_t q_bytes = AUTO_SEQS * (size_t)o.n_heads * (size_t)o.head_dim * sizeof(float);
  const size_t kv_bytes = AUTO_SEQS * (size_t)o.n_kv_heads * (size_t)o.head_dim * sizeof(float);
  const size_t imp_bytes = AUTO_SEQS * (size_t)o.n_heads * (size_t)o.max_seq_len * sizeof(float);
  t.dq = t_dev_alloc(ctx, q_bytes);
  t.dout = t_dev_alloc(ctx, q_bytes);
  t.dout_twin = t_dev_alloc(ctx, q_bytes);
  t.dk = t_dev_alloc(ctx, kv_bytes);
  t.dv = t_dev_alloc(ctx, kv_bytes);
  t.dimp = t_dev_alloc(ctx, imp_bytes);
  t.h1 = malloc(q_bytes);
  t.h2 = malloc(q_bytes);
  if (!T_CHECK(t.dq && t.dout && t.dout_twin && t.dk && t.dv && t.dimp && t.h1 && t.h2) ||
      !T_OK(m40llm_kvcache_create(&t.c, ctx, &o)) || !T_OK(m40llm_kvcache_create(&t.twin, ctx, &ot)))
    goto out;
  static const int kinds[] = {CALL_PLAIN, CALL_PLAIN,   CALL_APPEND_ATTN, CALL_REPEATS,
                              CALL_PLAIN, CALL_SINGLES, CALL_OTHERS,      CALL_EXPLICIT,
                              CALL_PLAIN, CALL_CAPTURED, CALL_SINGLES,    CALL_PLAIN};
  const int n_kinds = sizeof kinds / sizeof kinds[0];
  for (int step = 0; step < steps; step++)
    for (int l = 0; l < o.n_layers; l++) {
      const int kind = kinds[(step * 5 + l) % n_kinds];
      twin_step(&t, l, kind == CALL_CAPTURED && !t.cuda ? CALL_PLAIN : kind);
    }
  /* Stays due: where sequence 1 or 3 is due, a call naming 1 twice (and on CUDA a captured call)
   * is made plain, and the next call of theirs alone observes. */
  for (int l = 0; l < o.n_layers; l++) {
    const int32_t ones[2] = {1, 3};
    for (int k = 0; k < (t.cuda ? 2 : 1); k++) {
      while (!model_due(&t, l, ones, 2)) twin_step(&t, l, CALL_PLAIN);
      twin_step(&t, l, k == 0 ? CALL_REPEATS : CALL_CAPTURED);
      T_CHECK(model_due(&t, l, ones, 2));
      twin_step(&t, l, CALL_REPEATED_PAIR);
    }
  }
  int bad = 0, first_l = 0, first_s = 0, first_p = 0;
  for (int l = 0; l < o.n_layers; l++)
    for (int s = 0, len = 0; s < AUTO_SEQS && T_OK(m40llm_kvcache_seq_len(&len, t.c, l, s)); s++)
      for (int p = 0; p < len; p++) {
        int a = -9, b = -9;
        T_OK(m40llm_kvcache_tier_of(&a, t.c, l, s, p));
        T_OK(m40llm_kvcache_tier_of(&b, t.twin, l, s, p));
        if (a != b && bad++ == 0) first_l = l, first_s = s, first_p = p;
      }
  T_CHECKF(bad == 0, "%d position(s) in another tier than the twin's, first layer %d seq %d "
           "position %d", bad, first_l, first_s, first_p);
  m40llm_tier_stats st = M40LLM_TIER_STATS_INIT, st_twin = M40LLM_TIER_STATS_INIT;
  if (T_OK(m40llm_kvcache_tier_stats(&st, t.c)) && T_OK(m40llm_kvcache_tier_stats(&st_twin, t.twin))) {
    T_CHECKF(st.observe_calls == t.observed && st_twin.observe_calls == t.observed,
             "observe_calls %lld (twin %lld), the model counts %lld", (long long)st.observe_calls,
             (long long)st_twin.observe_calls, t.observed);
    T_CHECKF(st.demoted_rows == st_twin.demoted_rows && st.demoted_rows > 0,
             "demoted_rows %lld, the twin's %lld", (long long)st.demoted_rows,
             (long long)st_twin.demoted_rows);
    for (int k = 0; k < o.n_tiers; k++) T_CHECK(st.rows[k] == st_twin.rows[k]);
  }
out:
  m40llm_kvcache_destroy(t.c);
  m40llm_kvcache_destroy(t.twin);
  m40llm_free(ctx, t.dq);
  m40llm_free(ctx, t.dout);
  m40llm_free(ctx, t.dout_twin);
  m40llm_free(ctx, t.dk);
  m40llm_free(ctx, t.dv);
  m40llm_free(ctx, t.dimp);
  free(t.h1);
  free(t.h2);
}

static void errors(m40llm_context *ctx) {
  t_set_case("placement by importance: errors");
  m40llm_kvcache_options o = shape(4, 2, 64, 200, 2, 16);
  m40llm_kvcache *c = NULL;
  size_t bytes = 0, plain_bytes = 0, policy_bytes = 0;
  o.placement = 2;
  T_FAIL_WITH(m40llm_kvcache_bytes_needed(&bytes, &o), M40LLM_ERR_INVALID_ARGUMENT, "placement");
  T_FAIL_WITH(m40llm_kvcache_create(&c, ctx, &o), M40LLM_ERR_INVALID_ARGUMENT, "placement");
  T_CHECK(c == NULL);
  o.placement = M40LLM_PLACE_IMPORTANCE;
  o.observe_interval = -1;
  T_FAIL_WITH(m40llm_kvcache_bytes_needed(&bytes, &o), M40LLM_ERR_INVALID_ARGUMENT,
              "observe_interval");
  T_FAIL_WITH(m40llm_kvcache_create(&c, ctx, &o), M40LLM_ERR_INVALID_ARGUMENT, "observe_interval");
  T_CHECK(c == NULL);
  o.observe_interval = 4;
  const float bad_margins[3] = {-0.25f, NAN, INFINITY};
  for (int i = 0; i < 3; i++) {
    o.demote_margin = bad_margins[i];
    T_FAIL_WITH(m40llm_kvcache_bytes_needed(&bytes, &o), M40LLM_ERR_INVALID_ARGUMENT,
                "demote_margin");
    T_FAIL_WITH(m40llm_kvcache_create(&c, ctx, &o), M40LLM_ERR_INVALID_ARGUMENT, "demote_margin");
    T_CHECK(c == NULL);
  }
  o.demote_margin = 0.0f;
  /* the current version's default: the cache observes every 4th call; version 5's struct ends
   * before it */
  m40llm_kvcache_options v5 = o, now;
  memset(&now, 0x5a, sizeof now);
  if (T_OK(m40llm_kvcache_options_init(&now, M40LLM_KVCACHE_OPTIONS_VERSION)))
    T_INT_EQ(now.observe_interval, 4);
  memset(&v5, 0x5a, sizeof v5);
  if (T_OK(m40llm_kvcache_options_init(&v5, 5))) T_INT_EQ(v5.observe_interval, 0x5a5a5a5a);
  m40llm_kvcache_options untiered = o;
  untiered.n_tiers = 0;
  T_FAIL_WITH(m40llm_kvcache_create(&c, ctx, &untiered), M40LLM_ERR_INVALID_ARGUMENT, "n_tiers");
  /* the observe call's softmax states of every query head in shared memory on CUDA */
  m40llm_kvcache_options many = o;
  many.n_heads = 4098;
  m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
  if (T_OK(m40llm_context_device_info(&info, ctx)) && info.backend == M40LLM_BACKEND_CUDA) {
    T_FAIL_WITH(m40llm_kvcache_create(&c, ctx, &many), M40LLM_ERR_UNSUPPORTED, "4096 query heads");
    T_CHECK(c == NULL);
  } else if (T_OK(m40llm_kvcache_create(&c, ctx, &many))) {
    m40llm_kvcache_destroy(c);
    c = NULL;
  }
  /* the accumulators (layers x seqs x positions, a float and a count), the ranking's counters
   * (seqs x 4 tiers) and a record per (layer, seq): 4 tiers' counts, 8 positions and 8 double
   * scores, the window's first and count, and a double per window row */
  m40llm_kvcache_options plain = o;
  plain.placement = M40LLM_PLACE_FIRST_FREE;
  const size_t record = 4 * 4 + 4 * 8 * 4 + 4 * 8 * 8 + 2 * 4 + 16 * 8;
  if (T_OK(m40llm_kvcache_bytes_needed(&plain_bytes, &plain)) &&
      T_OK(m40llm_kvcache_bytes_needed(&policy_bytes, &o)))
    T_INT_EQ(policy_bytes - plain_bytes,
             (size_t)2 * 4 * 200 * 8 + (size_t)4 * 4 * 4 + (size_t)2 * 4 * record);
  /* version 4 callers: no placement field, the default */
  m40llm_kvcache_options v4 = plain, back;
  v4.version = 4;
  v4.placement = 99; /* not the caller's: past its struct */
  m40llm_kvcache *c4 = NULL;
  if (T_OK(m40llm_kvcache_create(&c4, ctx, &v4))) {
    back = o;
    back.version = M40LLM_KVCACHE_OPTIONS_VERSION;
    if (T_OK(m40llm_kvcache_get_options(&back, c4))) T_INT_EQ(back.placement, M40LLM_PLACE_FIRST_FREE);
    /* observe needs the placement */
    const size_t row = 4 * 64;
    float *dq = t_dev_alloc(ctx, row * sizeof(float)), *dout = t_dev_alloc(ctx, row * sizeof(float));
    const int32_t one = 0;
    if (dq && dout && T_OK(m40llm_memset(ctx, dout, 0x7f, row * sizeof(float))))
      T_FAIL_WITH(m40llm_kvcache_attn_observe_ex(dout, c4, 0, &one, 1, dq, M40LLM_DTYPE_F32, 0.0f),
                  M40LLM_ERR_INVALID_ARGUMENT, "PLACE_IMPORTANCE");
    m40llm_free(ctx, dq);
    m40llm_free(ctx, dout);
  }
  m40llm_kvcache_destroy(c4);
  c4 = NULL;
  /* version 5 callers: no observe_interval field, no observe calls but their own */
  m40llm_kvcache_options v5_opts = o;
  v5_opts.version = 5;
  v5_opts.observe_interval = 99; /* past its struct */
  if (T_OK(m40llm_kvcache_create(&c4, ctx, &v5_opts))) {
    back = o;
    back.version = M40LLM_KVCACHE_OPTIONS_VERSION;
    if (T_OK(m40llm_kvcache_get_options(&back, c4))) T_INT_EQ(back.observe_interval, 0);
    m40llm_tier_stats v2 = M40LLM_TIER_STATS_INIT;
    v2.version = 2;
    v2.observe_calls = 77; /* past a version-2 struct: not written */
    if (T_OK(m40llm_kvcache_tier_stats(&v2, c4))) T_CHECK(v2.observe_calls == 77 && v2.version == 2);
  }
  m40llm_kvcache_destroy(c4);
  c4 = NULL;
  /* version 6 callers: no demote_margin field (a struct of its size, so the ASan build sees a
   * read past it), a margin of 0 */
  const size_t v6_size = offsetof(m40llm_kvcache_options, demote_margin);
  m40llm_kvcache_options *v6_opts = malloc(v6_size), v6 = o, v6_init, v7_init;
  v6.version = 6;
  if (T_CHECK(v6_opts != NULL)) memcpy(v6_opts, &v6, v6_size);
  if (v6_opts && T_OK(m40llm_kvcache_bytes_needed(&bytes, v6_opts)) &&
      T_OK(m40llm_kvcache_create(&c4, ctx, v6_opts))) {
    back = o;
    back.version = M40LLM_KVCACHE_OPTIONS_VERSION;
    back.demote_margin = 9.0f;
    if (T_OK(m40llm_kvcache_get_options(&back, c4))) T_CHECK(back.demote_margin == 0.0f);
    back.version = 6; /* a version-6 caller's struct: nothing written past it */
    back.demote_margin = 9.0f;
    if (T_OK(m40llm_kvcache_get_options(&back, c4)))
      T_CHECK(back.version == 6 && back.demote_margin == 9.0f && back.observe_interval == 4);
  }
  m40llm_kvcache_destroy(c4);
  free(v6_opts);
  memset(&v6_init, 0x5a, sizeof v6_init);
  memset(&v7_init, 0x5a, sizeof v7_init);
  if (T_OK(m40llm_kvcache_options_init(&v6_init, 6))) { /* nothing written past its struct */
    const unsigned char *past =
        (const unsigned char *)&v6_init + offsetof(m40llm_kvcache_options, demote_margin);
    T_CHECK(past[0] == 0x5a && past[1] == 0x5a && past[2] == 0x5a && past[3] == 0x5a);
  }
  if (T_OK(m40llm_kvcache_options_init(&v7_init, 7))) T_CHECK(v7_init.demote_margin == 0.0f);
  if (!T_OK(m40llm_kvcache_create(&c, ctx, &o))) return;
  const size_t row = 4 * 64;
  float *dq = t_dev_alloc(ctx, 3 * row * sizeof(float)), *dout = t_dev_alloc(ctx, 3 * row * sizeof(float));
  float *out = malloc(3 * row * sizeof(float));
  const int32_t twice[3] = {1, 2, 1}, bad[2] = {0, 4};
  if (dq && dout && out && T_OK(m40llm_memset(ctx, dout, 0x7f, 3 * row * sizeof(float)))) {
    T_FAIL_WITH(m40llm_kvcache_attn_observe_ex(dout, NULL, 0, twice, 1, dq, M40LLM_DTYPE_F32, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "cache");
    T_FAIL_WITH(m40llm_kvcache_attn_observe_ex(dout, c, 0, twice, 3, dq, M40LLM_DTYPE_F32, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "repeats");
    T_FAIL_WITH(m40llm_kvcache_attn_observe_ex(dout, c, 0, bad, 2, dq, M40LLM_DTYPE_F32, 0.0f),
                M40LLM_ERR_OUT_OF_RANGE, "seq_ids[1]");
    T_FAIL_WITH(m40llm_kvcache_attn_observe_ex(dout, c, 2, bad, 1, dq, M40LLM_DTYPE_F32, 0.0f),
                M40LLM_ERR_OUT_OF_RANGE, "layer");
    T_FAIL_WITH(m40llm_kvcache_attn_observe_ex(dout, c, 0, bad, 1, NULL, M40LLM_DTYPE_F32, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "q");
    if (t_dev_download(ctx, out, dout, 3 * row * sizeof(float)))
      T_CHECK(t_all_bytes(out, 3 * row * sizeof(float), 0x7f)); /* nothing written */
    /* a repeat after a failure is not remembered: the ids' marks are cleared */
    const int32_t fine[2] = {2, 1};
    T_OK(m40llm_kvcache_attn_observe_ex(dout, c, 0, fine, 2, dq, M40LLM_DTYPE_F32, 0.0f));
    /* CUDA: not in a graph capture (its ranking reaches the host by a copy the host waits
     * for), refused before anything is queued */
    m40llm_device_info di = M40LLM_DEVICE_INFO_INIT;
    if (T_OK(m40llm_context_device_info(&di, ctx)) && di.backend == M40LLM_BACKEND_CUDA &&
        T_OK(m40llm_memset(ctx, dout, 0x7f, 3 * row * sizeof(float))) &&
        T_OK(m40llm_graph_capture_begin(ctx))) {
      T_FAIL_WITH(m40llm_kvcache_attn_observe_ex(dout, c, 0, fine, 2, dq, M40LLM_DTYPE_F32, 0.0f),
                  M40LLM_ERR_UNSUPPORTED, "graph");
      m40llm_graph *g = NULL;
      T_OK(m40llm_graph_capture_end(&g, ctx, NULL));
      if (g) T_OK(m40llm_graph_launch(g)); /* an empty graph: nothing of the call in it */
      m40llm_graph_destroy(g);
      if (t_dev_download(ctx, out, dout, 3 * row * sizeof(float)))
        T_CHECK(t_all_bytes(out, 3 * row * sizeof(float), 0x7f));
      T_OK(m40llm_kvcache_attn_observe_ex(dout, c, 0, fine, 2, dq, M40LLM_DTYPE_F32, 0.0f));
    }
  }
  free(out);
  m40llm_free(ctx, dq);
  m40llm_free(ctx, dout);
  m40llm_kvcache_destroy(c);
}

void t_cases_policy(m40llm_context *ctx, int small) {
  errors(ctx);
  const int steps = small ? 120 : 300;
  const int len = 2 * steps + 3 * 40 + 8; /* appends of up to 2 tokens on average, the forks' */
  run(ctx, shape(6, 3, 64, len, 2, 16), 0, steps, 2, 0); /* groups of 2, K/V heads 3 */
  run(ctx, shape(6, 3, 64, len, 2, 16), 0, steps, 2, 1);
  run(ctx, shape(8, 2, 128, len, 4, 8), 0, steps, 3, 0); /* groups of 4 */
  /* hysteresis: a leaving row displaces only rows it passes by the margin */
  m40llm_kvcache_options margin = shape(6, 3, 64, len, 2, 16);
  margin.demote_margin = 0.5f;
  run(ctx, margin, 0, steps, 2, 0);
  margin = shape(8, 2, 128, len, 4, 8);
  margin.demote_margin = 0.125f;
  run(ctx, margin, 0, steps, 1, 1);
  m40llm_kvcache_options gap = shape(9, 3, 64, len, 0, 12);
  gap.tiers[1].rows = 0;             /* passed over */
  gap.tiers[3].rows = gap.max_seq_len; /* room for the rows tier 1 would have held */
  run(ctx, gap, 0, steps, 1, 0);
  /* observe calls rarer than rows leave a window of 4: rows no call saw (score 0, ties), and
   * placements on orders the last observe call did not reset */
  run(ctx, shape(6, 3, 64, len, 2, 4), 0, steps, 6, 0);
  /* rarer still: the lists a truncate or a caller's move made stale are met before a call resets
   * them */
  run(ctx, shape(4, 2, 64, len, 2, 4), 0, steps, 25, 1);
  /* a full middle tier of 4,300 rows after a prompt: its order (which every leaving row that
   * does not stay in tier 0 is compared with) is ranked on CUDA in two chunks of 4,096 rows and
   * merged; the truncate cuts one sequence's tier down to one chunk */
  const int prompt = 4500, long_steps = 16;
  m40llm_kvcache_options big = shape(4, 2, 64, prompt + 3 * long_steps + 3 * 40 + 8, 2, 16);
  big.n_layers = 1;
  big.n_tiers = 3;
  big.tiers[0].rows = 64;
  big.tiers[1] = (m40llm_kv_tier){M40LLM_KV_Q8, M40LLM_KV_Q4, 4300};
  big.tiers[2] = (m40llm_kv_tier){M40LLM_KV_Q4, M40LLM_KV_Q2, big.max_seq_len};
  run(ctx, big, prompt, long_steps, 1, 1);
  auto_observe(ctx, 3, small ? 60 : 150);
  auto_observe(ctx, 1, small ? 40 : 100);
}
