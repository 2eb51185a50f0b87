// The tensor-core family's passes for a uniform cache's call with weights (weights and
// importance calls): the instances that also write each score at its position
// (kMmaDirectScores), a translation unit of their own so that a build compiles them beside the
// plain ones (attention_mma.cu; the kernel: attention_mma.cuh).
#include "attention_mma.cuh"

template <typename P>
int mma_split_scores_passes(m40llm_cuda_state *st, int head_dim, SplitPasses *p) {
  return mma_register_passes<P, kMmaDirectScores>(st, head_dim, p);
}

#define M40LLM_INSTANTIATE(P) \
  template int mma_split_scores_passes<P>(m40llm_cuda_state *, int, SplitPasses *);
M40LLM_KV_PAIRS(M40LLM_INSTANTIATE)
#undef M40LLM_INSTANTIATE
