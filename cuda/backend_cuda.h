// The CUDA backend's operations that live outside backend.cu, which puts them in its table.
#pragma once

#include "internal.h"

int m40llm_cuda_reserve_for(m40llm_kvcache *c);  // attention_dispatch.cu
// The scratch an observe call of n_seqs rows, the longest of `longest` positions, needs, grown
// (attention_dispatch.cu).
int m40llm_cuda_prepare_observe(const m40llm_kvcache *c, int n_seqs, int longest);
int m40llm_cuda_attention(const m40llm_kvcache *c, int layer, const int32_t *seq_ids, int n_seqs,
                          const void *q, void *out, int dtype, float scale,
                          const m40llm_attn_export *x);
int m40llm_cuda_attention_causal(const m40llm_kvcache *c, int layer,
                                 const m40llm_append_item *items, int n_items, const void *q,
                                 void *out, int dtype, float scale,
                                 int window);  // attention_causal_dispatch.cu
int m40llm_cuda_append(const m40llm_kvcache *c, int layer, const m40llm_append_item *items,
                       int n_items, const void *k, const void *v, int dtype);  // append.cu
// Tiered caches: the backend's tier_rows op, buffers checked (tiers.cu); the workspace for their
// decode attention's partials reserved (attention_tiers.cu, whose attention attention.cuh
// declares).
int m40llm_cuda_tier_rows(const m40llm_kvcache *c, int layer, const m40llm_row_op *ops,
                          int n_ops, const uint8_t *links, int n_chains, const void *k_in,
                          const void *v_in, int dtype, uint16_t *k_out, uint16_t *v_out);
int m40llm_cuda_tier_reserve(const m40llm_kvcache *c);
// Importance placement: the backend's policy_alloc, policy_free, tier_rank and tier_rank_wait
// ops (tier_policy.cu).
int m40llm_cuda_policy_alloc(m40llm_kvcache *c);
void m40llm_cuda_policy_free(m40llm_kvcache *c);
int m40llm_cuda_tier_rank(const m40llm_kvcache *c, int layer, const int32_t *seq_ids,
                          int n_seqs);
int m40llm_cuda_tier_rank_wait(const m40llm_kvcache *c, int layer);
// Positions [pos, pos + n_tokens) of tensor t decoded to FP16 rows (read.cu).
int m40llm_cuda_read_decoded(const m40llm_kvcache *c, const m40llm_kv_tensor &t, uint16_t *out,
                             int layer, int seq, int pos, int n_tokens);

// Graphs (graph.cu): the capture of the context's stream begun, ended into *exec (a
// cudaGraphExec_t; NULL: a new one; exec NULL: the capture discarded), launched, released.
int m40llm_cuda_graph_begin(m40llm_context *ctx);
int m40llm_cuda_graph_end(m40llm_context *ctx, void **exec, int *updated);
int m40llm_cuda_graph_launch(m40llm_context *ctx, void *exec);
int m40llm_cuda_capturing(const m40llm_context *ctx);
void m40llm_cuda_graph_destroy(void *exec);

struct m40llm_cuda_state;
// M40LLM_OK if the context's kernels can address p (device, managed, or mapped pinned memory),
// else M40LLM_ERR_INVALID_ARGUMENT naming it; remembers the last few that passed.
int m40llm_cuda_check_pointer(m40llm_cuda_state *st, const void *p, const char *name);

// For m40llm_context_device_info version 2: the architecture the GPU's kernels were compiled
// for, and whether they are SASS built in for it rather than JIT-compiled PTX (build_info.cu).
int m40llm_cuda_device_code(int *kernel_arch, int *native);
// Whether F16 caches run the tensor-core kernels on the context's GPU: the dispatcher's own
// decision (attention_dispatch.cu).
int m40llm_cuda_tensor_cores(m40llm_cuda_state *st, int *out);
