// The tensor-core family's passes for the uniform caches, and its instances for them (the
// kernel: attention_mma.cuh).
#include "attention_mma.cuh"

template <typename P>
int mma_split_passes(m40llm_cuda_state *st, int head_dim, SplitPasses *p) {
  *p = SplitPasses{};
  const int warps = mma_warps(head_dim);
  const bool stage =
      !kQuantPair<P> && head_dim >= kMmaStagedMinDim && head_dim <= kMmaStagedMaxDim;
  int rc = pass_for<P, kMmaDirect>(st, head_dim, warps, &p->direct);
  if (rc == M40LLM_OK && p->direct.kernel && stage)
    rc = pass_for<P, kMmaStaged>(st, head_dim, warps, &p->pass);
  if (rc == M40LLM_OK && p->direct.kernel)
    rc = pass_for<P, kMmaDirect>(st, head_dim, warps / 2, &p->fine);
  if (rc == M40LLM_OK && p->direct.kernel && mma_broad_warps(head_dim))
    rc = pass_for<P, kMmaDirect>(st, head_dim, mma_broad_warps(head_dim), &p->broad);
  if (rc != M40LLM_OK) return rc;
  if (!p->pass.kernel) p->pass = p->direct;
  if (!p->fine.kernel) p->fine = p->direct;
  return M40LLM_OK;
}

#define M40LLM_INSTANTIATE(P) \
  template int mma_split_passes<P>(m40llm_cuda_state *, int, SplitPasses *);
M40LLM_KV_PAIRS(M40LLM_INSTANTIATE)
#undef M40LLM_INSTANTIATE
