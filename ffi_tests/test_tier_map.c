/* The backend's tier slot maps (m40llm_kvcache.tier_map, which the row ops keep from each op's
 * position) against the front end's host maps, on the CPU backend, through appends across the
 * window, moves between tiers, truncation, forks and resets. The kernels that read them (weights
 * and importance exported over tiers) are checked against float64 in test_gpu; here a slip in
 * an op's position shows without a GPU. */
#include <stdlib.h>

#include "internal.h"
#include "test_util.h"

enum { LAYERS = 2, SEQS = 3, LEN = 200, KVH = 2, D = 64 };

/* Returns the entries of the held slots that differ. */
static int differing(const m40llm_kvcache *c) {
  int bad = 0;
  for (int l = 0; l < LAYERS; l++)
    for (int s = 0; s < SEQS; s++)
      for (int t = 0; t < c->n_tiers; t++)
        for (int slot = 0; slot < m40llm_tier_counts(c, l, s)[t]; slot++)
          bad += m40llm_tier_map_at(c, t, l, s)[slot] != m40llm_tier_slot_pos(c, t, l, s)[slot];
  return bad;
}

int main(void) {
  t_rng_init();
  m40llm_context *ctx = NULL;
  m40llm_kvcache *c = NULL;
  m40llm_context_options co = M40LLM_CONTEXT_OPTIONS_INIT;
  co.backend = M40LLM_BACKEND_CPU;
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = LAYERS, o.n_heads = 4, o.n_kv_heads = KVH, o.head_dim = D;
  o.max_seqs = SEQS, o.max_seq_len = LEN, o.n_sinks = 2, o.window = 16;
  o.format = M40LLM_KV_Q8, o.v_format = M40LLM_KV_Q8;
  o.n_tiers = 3;
  const m40llm_kv_tier tiers[3] = {{M40LLM_KV_Q8, M40LLM_KV_Q8, 40},
                                   {M40LLM_KV_Q4, M40LLM_KV_Q3, 60},
                                   {M40LLM_KV_Q4, M40LLM_KV_Q2, LEN}};
  for (int t = 0; t < 3; t++) o.tiers[t] = tiers[t];
  float *k = malloc((size_t)LEN * KVH * D * sizeof(float));
  float *v = malloc((size_t)LEN * KVH * D * sizeof(float));
  if (!T_CHECK(k && v) || !T_OK(m40llm_context_create(&ctx, &co)) ||
      !T_OK(m40llm_kvcache_create(&c, ctx, &o)))
    goto done;
  t_fill_uniform(k, (size_t)LEN * KVH * D, -1.0f, 1.0f);
  t_fill_uniform(v, (size_t)LEN * KVH * D, -1.0f, 1.0f);
  int steps[5] = {0};
  for (int i = 0; i < 400; i++) {
    const int what = t_rand_int(0, 9), l = t_rand_int(0, LAYERS - 1), s = t_rand_int(0, SEQS - 1);
    const int len = *m40llm_len_slot(c, l, s);
    int rc = M40LLM_OK, kind = 0;
    if (what < 5) { /* appends, most steps: rows go through the window into the tiers */
      int n = t_rand_int(1, 40);
      if (n > LEN - len) n = LEN - len;
      if (n > 0) rc = m40llm_kvcache_append_f32(c, l, s, k, v, n);
    } else if (what < 8) {
      kind = 1;
      const int b = t_rand_int(0, len), e = t_rand_int(b, len);
      rc = m40llm_kvcache_tier_move(c, l, s, b, e, t_rand_int(0, 2));
      if (rc == M40LLM_ERR_CAPACITY) rc = M40LLM_OK; /* all or nothing: a full tier moves none */
    } else if (what == 8) {
      kind = 2 + t_rand_int(0, 2);
      if (kind == 2) rc = m40llm_kvcache_seq_truncate(c, s, t_rand_int(0, len));
      else if (kind == 3) rc = m40llm_kvcache_seq_fork(c, (s + 1) % SEQS, s);
      else rc = m40llm_kvcache_seq_reset(c, s);
    }
    steps[kind]++;
    if (!T_OK(rc)) break;
    const int bad = differing(c);
    if (!T_CHECKF(bad == 0, "step %d (kind %d): %d slot map entries differ from the host's", i,
                  kind, bad))
      break;
  }
  /* the run reached every kind of step, and moves filled the tiers */
  T_CHECKF(steps[0] > 0 && steps[1] > 0 && steps[2] > 0 && steps[3] > 0 && steps[4] > 0,
           "steps of each kind: %d %d %d %d %d", steps[0], steps[1], steps[2], steps[3], steps[4]);
done:
  free(k);
  free(v);
  m40llm_kvcache_destroy(c);
  m40llm_context_destroy(ctx);
  return t_finish();
}
