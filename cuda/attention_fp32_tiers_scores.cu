// The FP32 split kernel's instances that export scores (m40llm_kvcache_attn_weights_ex and
// importance) for the tier pairs that no uniform cache has (M40LLM_TIER_ONLY_PAIRS). A
// translation unit of their own, so that a build compiles them beside the other instances.
#include "attention_fp32.cuh"

#define M40LLM_INSTANTIATE(P) template SplitKernel fp32_scores_kernel<P>(int, int);
M40LLM_TIER_ONLY_PAIRS(M40LLM_INSTANTIATE)
#undef M40LLM_INSTANTIATE
