// The FP32 split kernel's instances for m40llm_kvcache_attn_weights_ex: they export each score
// (kScores). A translation unit of their own, so that a build compiles the two halves of the
// instances in parallel.
#include "attention_fp32.cuh"

#define M40LLM_INSTANTIATE(P) template SplitKernel fp32_scores_kernel<P>(int, int);
M40LLM_KV_PAIRS(M40LLM_INSTANTIATE)
#undef M40LLM_INSTANTIATE
