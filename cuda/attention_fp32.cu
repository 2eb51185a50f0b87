// The FP32 split kernel's pass for the dispatcher, and its instances for the plain calls (the
// kernel: attention_fp32.cuh).
#include "attention_fp32.cuh"

// Built in attention_fp32_tiers.cu, attention_fp32_scores.cu and attention_fp32_tiers_scores.cu.
#define M40LLM_EXTERN(P) extern template SplitKernel fp32_plain_kernel<P>(int, int);
M40LLM_TIER_ONLY_PAIRS(M40LLM_EXTERN)
#undef M40LLM_EXTERN
#define M40LLM_EXTERN(P) extern template SplitKernel fp32_scores_kernel<P>(int, int);
M40LLM_KV_PAIRS(M40LLM_EXTERN)
M40LLM_TIER_ONLY_PAIRS(M40LLM_EXTERN)
#undef M40LLM_EXTERN

namespace {

int log2_small(int x) { return x >= 8 ? 3 : x >= 4 ? 2 : x >= 2 ? 1 : 0; }

}  // namespace

template <typename P>
int fp32_split_pass(m40llm_cuda_state *st, int head_dim, const Grouping &g, bool scores,
                    SplitPass *out) {
  const int dmax = dmax_for(head_dim);
  const SplitKernel kernel =
      scores ? fp32_scores_kernel<P>(g.gt, head_dim) : fp32_plain_kernel<P>(g.gt, head_dim);
  const bool exact = head_dim == dmax;  // its class's
  const bool dense = dense_tiles<P>(g.gt, dmax, exact);
  // A lean kernel reads a protected cache's kept rows in the splits of the codes (MIXED), but
  // where it exports scores (whose positions it takes a split's rows to be one run of): there in
  // splits of their own (PARTS).
  const bool kept_too = (P::K::kScaled || P::V::kScaled) && lean_kernel(g.gt, dmax, exact);
  SplitPass pass{kernel, kAttnThreads,
                 split_smem_floats(g.gt, dmax, head_dim,
                                   v_columns<typename P::V>(g.gt, dmax, exact), dense) *
                     sizeof(float),
                 tile_rows(g.gt, dmax, false, false, dense), 0, 0, false, kept_too && !scores,
                 kept_too, 0};
  int rc = kernel_waits(st, reinterpret_cast<const void *>(pass.kernel), &st->fp32_dependent,
                        &pass.dependent);
  if (rc != M40LLM_OK) return rc;
  int &occ =
      st->fp32_occupancy[P::K::kFormat][P::V::kFormat][log2_small(g.gt)][head_dim / 8][scores];
  if (occ == 0) {
    M40LLM_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, pass.kernel, pass.threads,
                                                                  pass.smem));
    if (occ < 1) occ = 1;
  }
  // The plan counts at most kAttnMinBlocksPerSm resident blocks, as tuned: kernels that fit 9
  // (52-56 registers) split finer and ran slower (compute_52 on an H100, B8 16/16 D256 L8K:
  // 390 us against 352).
  pass.target = st->sm_count * (occ < kAttnMinBlocksPerSm ? occ : kAttnMinBlocksPerSm) * kAttnWaves;
  *out = pass;
  return M40LLM_OK;
}

#define M40LLM_INSTANTIATE(P) \
  template int fp32_split_pass<P>(m40llm_cuda_state *, int, const Grouping &, bool, SplitPass *);
M40LLM_KV_PAIRS(M40LLM_INSTANTIATE)
M40LLM_TIER_ONLY_PAIRS(M40LLM_INSTANTIATE)
#undef M40LLM_INSTANTIATE
#define M40LLM_INSTANTIATE(P) template SplitKernel fp32_plain_kernel<P>(int, int);
M40LLM_KV_PAIRS(M40LLM_INSTANTIATE)
#undef M40LLM_INSTANTIATE
