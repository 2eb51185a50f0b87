// The tensor-core family's passes for a tiered call with weights (observe, weights and importance
// calls): the tier instances that also write each score at its position (kMmaTierScores), every
// tier pair, a translation unit of their own so that a build compiles them beside the plain
// ones (attention_mma_tiers.cu; the kernel: attention_mma.cuh).
#include "attention_mma.cuh"

template <typename P>
int mma_tier_scores_passes(m40llm_cuda_state *st, int head_dim, SplitPasses *p) {
  return mma_register_passes<P, kMmaTierScores>(st, head_dim, p);
}

#define M40LLM_INSTANTIATE(P) \
  template int mma_tier_scores_passes<P>(m40llm_cuda_state *, int, SplitPasses *);
M40LLM_KV_PAIRS(M40LLM_INSTANTIATE)
M40LLM_TIER_ONLY_PAIRS(M40LLM_INSTANTIATE)
#undef M40LLM_INSTANTIATE
