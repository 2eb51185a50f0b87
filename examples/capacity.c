/*
 * capacity: how many tokens of KV cache fit on a Tesla M40 (12 GiB and 24 GiB) next to a
 * model's weights, for common 7-13B models and every K/V format.
 *
 *   capacity
 *
 * Planning only (m40llm_kvcache_max_seq_len): no GPU is needed. Assumed, per model: weights
 * quantized to 4 bits (parameters x 4.5 bits / 8 bytes, as Q4_K-like formats store them with
 * their scales), and a reserve of 1 GiB for the CUDA context, activations, logits and the
 * attention workspace; what remains holds K and V. The tables give the tokens each sequence can
 * hold (max_seq_len) with 1 sequence and with 8; that is memory, not the model's trained
 * context length. Then tiered caches whose tiers' rows m40llm_kvcache_plan_tiers sets for a
 * target of bits a value (sinks and window included), with the rows each tier gets. Last,
 * where a GPU is present, the same plan against its free memory now
 * (m40llm_kvcache_max_seq_len_on_device).
 */
#include <stddef.h>
#include <stdio.h>

#include "m40llm.h"

#define GIB ((double)(1u << 30))
#define RESERVE ((size_t)1 << 30)

typedef struct model {
  const char *name;
  double params; /* parameters, for the weights' bytes */
  int n_layers, n_heads, n_kv_heads, head_dim;
} model;

static const model models[] = {
    {"Llama-3-8B", 8.03e9, 32, 32, 8, 128},  {"Mistral-7B", 7.24e9, 32, 32, 8, 128},
    {"Qwen2.5-7B", 7.62e9, 28, 28, 4, 128},  {"Gemma-2-9B", 9.24e9, 42, 16, 8, 256},
    {"Llama-2-13B", 13.02e9, 40, 40, 40, 128},
};

static const struct {
  const char *name;
  int k, v;
} formats[] = {{"F16", M40LLM_KV_F16, M40LLM_KV_SAME},
               {"Q8", M40LLM_KV_Q8, M40LLM_KV_SAME},
               {"Q4", M40LLM_KV_Q4, M40LLM_KV_SAME},
               {"K8/V4", M40LLM_KV_Q8, M40LLM_KV_Q4},
               {"K4/V3", M40LLM_KV_Q4, M40LLM_KV_Q3},
               {"K4/V2", M40LLM_KV_Q4, M40LLM_KV_Q2}};
#define N_FORMATS ((int)(sizeof formats / sizeof formats[0]))

static const int seq_counts[] = {1, 8};

static size_t weight_bytes(const model *m) { return (size_t)(m->params * 4.5 / 8.0); }

static m40llm_kvcache_options options(const model *m, int max_seqs, int f) {
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = m->n_layers;
  o.n_heads = m->n_heads;
  o.n_kv_heads = m->n_kv_heads;
  o.head_dim = m->head_dim;
  o.max_seqs = max_seqs;
  o.format = formats[f].k;
  o.v_format = formats[f].v;
  return o;
}

/* One table: a row per model, tokens per sequence for each sequence count and format. */
static int table(double gpu_gib) {
  const size_t gpu = (size_t)(gpu_gib * GIB);
  printf("\nTesla M40 %.0f GiB: KV budget = %.0f GiB - weights - %.0f GiB reserve\n", gpu_gib,
         gpu_gib, RESERVE / GIB);
  printf("%-12s %7s %7s |", "model", "weights", "KV");
  for (size_t s = 0; s < sizeof seq_counts / sizeof seq_counts[0]; s++)
    printf(" %-*s |", 8 * N_FORMATS - 1,
           seq_counts[s] == 1 ? "tokens, 1 sequence" : "tokens each, 8 sequences");
  printf("\n%-12s %7s %7s |", "", "GiB", "GiB");
  for (size_t s = 0; s < sizeof seq_counts / sizeof seq_counts[0]; s++) {
    for (size_t f = 0; f < sizeof formats / sizeof formats[0]; f++)
      printf(" %7s", formats[f].name);
    printf(" |");
  }
  printf("\n");
  for (size_t i = 0; i < sizeof models / sizeof models[0]; i++) {
    const model *m = &models[i];
    const size_t used = weight_bytes(m) + RESERVE;
    const size_t budget = gpu > used ? gpu - used : 0;
    printf("%-12s %7.2f %7.2f |", m->name, weight_bytes(m) / GIB, budget / GIB);
    for (size_t s = 0; s < sizeof seq_counts / sizeof seq_counts[0]; s++) {
      for (size_t f = 0; f < sizeof formats / sizeof formats[0]; f++) {
        const m40llm_kvcache_options o = options(m, seq_counts[s], (int)f);
        int tokens = 0;
        const int rc = m40llm_kvcache_max_seq_len(&tokens, &o, budget);
        if (rc == M40LLM_OK) {
          printf(" %7d", tokens);
        } else if (rc == M40LLM_ERR_CAPACITY) {
          printf(" %7s", "-"); /* not even one token fits */
        } else {
          fprintf(stderr, "\n%s: %s\n", m40llm_status_string(rc), m40llm_last_error_message());
          return 1;
        }
      }
      printf(" |");
    }
    printf("\n");
  }
  return 0;
}

/* Tiered caches (mixed precision, issue 15) of the fidelity study's four pairs, their rows
 * planned for a target of stored bits a value (m40llm_kvcache_plan_tiers, every byte of the
 * stored K/V counted): the positions the budget holds at that target, one sequence. */
static const double targets[] = {5.5, 6.0, 7.0};
#define N_TARGETS ((int)(sizeof targets / sizeof targets[0]))

static int tiered_table(double gpu_gib) {
  static const int pairs[4][2] = {{M40LLM_KV_Q8, M40LLM_KV_Q8},
                                  {M40LLM_KV_Q8, M40LLM_KV_Q4},
                                  {M40LLM_KV_Q4, M40LLM_KV_Q3},
                                  {M40LLM_KV_Q4, M40LLM_KV_Q2}};
  const size_t gpu = (size_t)(gpu_gib * GIB);
  printf("\nTesla M40 %.0f GiB, tiers K8V8 / K8V4 / K4V3 / K4V2 planned for a target, 1 sequence\n",
         gpu_gib);
  printf("%-12s %7s |", "model", "KV GiB");
  for (int b = 0; b < N_TARGETS; b++) printf(" %4.1f bits: tokens, rows a tier      |", targets[b]);
  printf("\n");
  for (size_t i = 0; i < sizeof models / sizeof models[0]; i++) {
    const model *m = &models[i];
    const size_t used = weight_bytes(m) + RESERVE;
    const size_t budget = gpu > used ? gpu - used : 0;
    printf("%-12s %7.2f |", m->name, budget / GIB);
    for (int b = 0; b < N_TARGETS; b++) {
      m40llm_kvcache_options o = options(m, 1, 1);
      o.n_tiers = 4;
      for (int t = 0; t < 4; t++) o.tiers[t] = (m40llm_kv_tier){pairs[t][0], pairs[t][1], 0};
      /* At the target every position costs target x its values' bits, so this many fit. */
      const double position_bits = 2.0 * m->n_layers * m->n_kv_heads * m->head_dim * targets[b];
      const double fit = (double)budget * 8.0 / position_bits;
      o.max_seq_len = fit < 1.0 ? 1 : fit > 2e9 ? 2000000000 : (int)fit;
      size_t bytes = 0;
      int rc = m40llm_kvcache_plan_tiers(&o, targets[b]);
      if (rc == M40LLM_OK) rc = m40llm_kvcache_bytes_needed(&bytes, &o);
      if (rc == M40LLM_OK && bytes <= budget)
        printf(" %7d: %6d %6d %6d %6d |", o.max_seq_len, o.tiers[0].rows, o.tiers[1].rows,
               o.tiers[2].rows, o.tiers[3].rows);
      else if (rc == M40LLM_OK || rc == M40LLM_ERR_CAPACITY)
        printf(" %-36s |", "-"); /* the target is below what the tiers can hold */
      else {
        fprintf(stderr, "\n%s: %s\n", m40llm_status_string(rc), m40llm_last_error_message());
        return 1;
      }
    }
    printf("\n");
  }
  return 0;
}

/* The first model in Q8, one sequence, against this machine's GPU as it is now: its free
 * memory less the weights still to load and the same reserve. */
static int this_machine(void) {
  m40llm_context *ctx = NULL;
  m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
  int tokens = 0;
  int rc = m40llm_context_create(&ctx, NULL); /* the GPU if there is one, else the CPU */
  if (rc == M40LLM_OK) rc = m40llm_context_device_info(&info, ctx);
  if (rc == M40LLM_OK && info.backend == M40LLM_BACKEND_CUDA) {
    const m40llm_kvcache_options o = options(&models[0], 1, 1);
    rc = m40llm_kvcache_max_seq_len_on_device(&tokens, ctx, &o,
                                              weight_bytes(&models[0]) + RESERVE);
  }
  m40llm_context_destroy(ctx);
  if (rc == M40LLM_OK && info.backend == M40LLM_BACKEND_CPU)
    printf("\nThis machine has no usable GPU: no device memory to plan against.\n");
  else if (rc == M40LLM_OK)
    printf("\nThis machine's %s (%.2f GiB free): %s, Q8, 1 sequence: %d tokens\n", info.name,
           info.free_memory / GIB, models[0].name, tokens);
  else if (rc == M40LLM_ERR_CAPACITY)
    printf("\nThis machine's %s: %s\n", info.name, m40llm_last_error_message());
  else
    fprintf(stderr, "%s: %s\n", m40llm_status_string(rc), m40llm_last_error_message());
  return rc == M40LLM_OK || rc == M40LLM_ERR_CAPACITY ? 0 : 1;
}

int main(void) {
  printf("KV cache capacity (m40llm_kvcache_max_seq_len). Assumed: weights in 4 bits\n"
         "(parameters x 4.5 / 8 bytes), a %.0f GiB reserve (CUDA context, activations,\n"
         "attention workspace). Tokens each sequence can hold; K8/V4 = K in Q8, V in Q4\n"
         "(K4/V3, K4/V2: V in Q3, Q2).\n",
         RESERVE / GIB);
  if (table(12.0) != 0 || table(24.0) != 0) return 1;
  if (tiered_table(12.0) != 0 || tiered_table(24.0) != 0) return 1;
  return this_machine();
}
