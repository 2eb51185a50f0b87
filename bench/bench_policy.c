/* What importance placement (M40LLM_PLACE_IMPORTANCE, issue 15) costs a decode step: LAYERS
 * layers of a tiered cache (the study's pairs K8V8, K8V4, K4V3, K4V2 with shares 0.1, 0.2, 0.3,
 * 0.4 of the rows; rotation, 4 sinks and a 128-row window: the defaults), SEQS sequences on a
 * prompt of PROMPT positions, 32/8 heads, head_dim 128. A step is, per layer, one batched
 * append of a token to every sequence and one attention call:
 *   first free   the default placement, attn_batch every step
 *   every 4th    importance placement, the plain call every step, of which the cache makes
 *                every 4th an observe call (observe_interval 4, the default, the study's): each
 *                observe ranks the tiers on the GPU; the next append of the layer waits for
 *                that ranking's copy to the host
 *   every step   importance placement, observe_interval 1: every call observes
 *   margin M     every 4th, with demote_margin M (options version 7): a leaving row displaces
 *                only rows it passes by the factor 1 + M (this bench's rows are alike, so their
 *                scores are close: the margin's best case)
 * Host microseconds a step (STEPS steps enqueued back to back, then a synchronize; median of
 * SAMPLES), after the prompt and enough steps that every step moves rows down the tiers. The
 * modes "..., a wait each step" synchronize after every step, as a model does for its logits
 * (the host's work is then not hidden behind the GPU's queue); their "x first" is against
 * the first such mode.
 * Usage: bench_policy [out.json [device]] (default bench_policy.json, device 0). */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>

#include "bench_util.h"
#include "m40llm.h"

enum { LAYERS = 8, SEQS = 8, HEADS = 32, KV_HEADS = 8, DIM = 128, PROMPT = 8192, STEPS = 32,
       SAMPLES = 5 };

#define CHECK(x) BENCH_CHECK(x, -1.0)

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

typedef struct {
  const char *name;
  int placement, every; /* every: the cache's observe_interval (0: no observe calls) */
  int wait;             /* synchronize after every step */
  float margin;         /* demote_margin */
} mode;

static const mode modes[] = {
    {"first free", M40LLM_PLACE_FIRST_FREE, 0, 0, 0.0f},
    {"importance, observe every 4th", M40LLM_PLACE_IMPORTANCE, 4, 0, 0.0f},
    {"importance, observe every step", M40LLM_PLACE_IMPORTANCE, 1, 0, 0.0f},
    {"importance, every 4th, margin 0.25", M40LLM_PLACE_IMPORTANCE, 4, 0, 0.25f},
    {"importance, every 4th, margin 1", M40LLM_PLACE_IMPORTANCE, 4, 0, 1.0f},
    {"first free, a wait each step", M40LLM_PLACE_FIRST_FREE, 0, 1, 0.0f},
    {"importance, every 4th, a wait", M40LLM_PLACE_IMPORTANCE, 4, 1, 0.0f}};
enum { MODES = sizeof modes / sizeof modes[0] };

/* Median host microseconds a step of mode m; -1 on failure. */
static double run(m40llm_context *ctx, const mode *m, double *bits, long long *demoted,
                  long long *observed) {
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = LAYERS, o.n_heads = HEADS, o.n_kv_heads = KV_HEADS, o.head_dim = DIM;
  o.max_seqs = SEQS, o.max_seq_len = PROMPT + STEPS * (SAMPLES + 1);
  const int pairs[4][2] = {{M40LLM_KV_Q8, M40LLM_KV_Q8}, {M40LLM_KV_Q8, M40LLM_KV_Q4},
                           {M40LLM_KV_Q4, M40LLM_KV_Q3}, {M40LLM_KV_Q4, M40LLM_KV_Q2}};
  const double share[4] = {0.1, 0.2, 0.3, 0.4};
  const int rows = o.max_seq_len - o.n_sinks - o.window;
  o.n_tiers = 4;
  for (int t = 0, left = rows; t < 4; t++) {
    o.tiers[t] = (m40llm_kv_tier){pairs[t][0], pairs[t][1], t == 3 ? left : (int)(share[t] * rows)};
    left -= o.tiers[t].rows;
  }
  o.format = pairs[0][0], o.v_format = pairs[0][1];
  o.placement = m->placement;
  o.observe_interval = m->every;
  o.demote_margin = m->margin;
  m40llm_kvcache *c = NULL;
  float *kv = NULL, *q = NULL, *out = NULL;
  const size_t row = (size_t)KV_HEADS * DIM, q_row = (size_t)HEADS * DIM;
  int32_t ids[SEQS];
  for (int i = 0; i < SEQS; i++) ids[i] = i;
  double t[SAMPLES], result = -1.0;
  if (m40llm_kvcache_create(&c, ctx, &o) != M40LLM_OK ||
      m40llm_malloc((void **)&kv, ctx, (size_t)PROMPT * row * sizeof(float)) != M40LLM_OK ||
      m40llm_malloc((void **)&q, ctx, SEQS * q_row * sizeof(float)) != M40LLM_OK ||
      m40llm_malloc((void **)&out, ctx, SEQS * q_row * sizeof(float)) != M40LLM_OK) {
    fprintf(stderr, "%s: %s\n", m->name, m40llm_last_error_message());
    goto out;
  }
  /* varied small values: 0x3c.. and 0x3b.. bytes make FP32 0.0115 and 0.0029 */
  CHECK(m40llm_memset(ctx, kv, 0x3c, (size_t)PROMPT * row * sizeof(float)));
  CHECK(m40llm_memset(ctx, q, 0x3b, SEQS * q_row * sizeof(float)));
  for (int l = 0; l < LAYERS; l++)
    for (int s = 0; s < SEQS; s++) CHECK(m40llm_kvcache_append_f32(c, l, s, kv, kv, PROMPT));
  for (int r = -1; r < SAMPLES; r++) { /* r = -1: warm-up, every tier full */
    CHECK(m40llm_context_synchronize(ctx));
    const double t0 = now_us();
    for (int i = 0; i < STEPS; i++)
      for (int l = 0; l < LAYERS; l++) {
        CHECK(m40llm_kvcache_append_batch_f32(c, l, ids, NULL, SEQS, kv, kv));
        CHECK(m40llm_kvcache_attn_batch_f32q(out, c, l, ids, SEQS, q, 0.0f));
        if (m->wait && l == LAYERS - 1) CHECK(m40llm_context_synchronize(ctx));
      }
    CHECK(m40llm_context_synchronize(ctx));
    if (r >= 0) t[r] = (now_us() - t0) / STEPS;
  }
  qsort(t, SAMPLES, sizeof t[0], cmp_double);
  m40llm_tier_stats st = M40LLM_TIER_STATS_INIT;
  CHECK(m40llm_kvcache_tier_stats(&st, c));
  *bits = st.bits_per_value;
  *demoted = (long long)st.demoted_rows;
  *observed = (long long)st.observe_calls;
  result = t[SAMPLES / 2];
out:
  m40llm_free(ctx, kv);
  m40llm_free(ctx, q);
  m40llm_free(ctx, out);
  m40llm_kvcache_destroy(c);
  return result;
}

int main(int argc, char **argv) {
  const char *path = argc > 1 ? argv[1] : "bench_policy.json";
  m40llm_context_options co = M40LLM_CONTEXT_OPTIONS_INIT;
  co.backend = M40LLM_BACKEND_CUDA;
  co.device = argc > 2 ? atoi(argv[2]) : 0;
  m40llm_context *ctx = NULL;
  if (m40llm_context_create(&ctx, &co) != M40LLM_OK) {
    fprintf(stderr, "context: %s\n", m40llm_last_error_message());
    return 1;
  }
  double us[MODES], bits[MODES];
  long long demoted[MODES], observed[MODES];
  int failed = 0;
  for (int i = 0; i < MODES && !failed; i++) {
    us[i] = run(ctx, &modes[i], &bits[i], &demoted[i], &observed[i]);
    failed = us[i] < 0;
  }
  m40llm_context_destroy(ctx);
  if (failed) return 1;
  printf("decode step of %d layers, %d sequences x %d positions, %d/%d heads, head_dim %d, "
         "tiers K8V8/K8V4/K4V3/K4V2 (0.1/0.2/0.3/0.4)\n", LAYERS, SEQS, PROMPT, HEADS, KV_HEADS,
         DIM);
  printf("%-36s %10s %8s %8s %10s %9s\n", "placement", "us/step", "x first", "bits", "demoted",
         "observes");
  FILE *f = fopen(path, "w");
  if (f) fprintf(f, "{\n  \"layers\": %d, \"seqs\": %d, \"prompt\": %d, \"rows\": [\n", LAYERS, SEQS, PROMPT);
  for (int i = 0, base = 0; i < MODES; i++) {
    if (i > 0 && modes[i].wait != modes[i - 1].wait) base = i; /* the first free of its kind */
    const double x = us[i] / us[base];
    printf("%-36s %10.1f %8.3f %8.3f %10lld %9lld\n", modes[i].name, us[i], x, bits[i],
           demoted[i], observed[i]);
    if (f)
      fprintf(f, "    {\"placement\": \"%s\", \"wait_each_step\": %d, \"demote_margin\": %g, "
              "\"us_per_step\": %.2f, \"x_first_free\": %.4f, \"bits_per_value\": %.4f, "
              "\"demoted_rows\": %lld, \"observe_calls\": %lld}%s\n",
              modes[i].name, modes[i].wait, (double)modes[i].margin, us[i], x, bits[i],
              demoted[i], observed[i], i + 1 < MODES ? "," : "");
  }
  if (f) fprintf(f, "  ]\n}\n"), fclose(f);
  return 0;
}
