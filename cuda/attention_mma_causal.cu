// The tensor-core family's passes for causal rows (kMmaCausal: several query rows of an item
// in one tile, each masked at its own position; attend_rows in attention_dispatch.cu), and
// their instances: the uniform caches' pairs, a translation unit of their own so that a build
// compiles them beside the decode kernels (the kernel: attention_mma.cuh).
#include "attention_mma.cuh"

template <typename P>
int mma_causal_passes(m40llm_cuda_state *st, int head_dim, SplitPasses *p) {
  return mma_register_passes<P, kMmaCausal>(st, head_dim, p);
}

#define M40LLM_INSTANTIATE(P) \
  template int mma_causal_passes<P>(m40llm_cuda_state *, int, SplitPasses *);
M40LLM_KV_PAIRS(M40LLM_INSTANTIATE)
#undef M40LLM_INSTANTIATE
