// The tensor-core family's passes for a tiered call's launches (M40LLM_PLAN_TIER), and their
// instances: every tier pair, a translation unit of their own so that a build compiles them
// beside the uniform caches' (the kernel: attention_mma.cuh); and the kernel of every pair that
// runs a short call's tiers in one launch (attn_mma_tiers_kernel).
#include "attention_mma.cuh"

template <typename P>
int mma_tier_passes(m40llm_cuda_state *st, int head_dim, SplitPasses *p) {
  return mma_register_passes<P, kMmaTier>(st, head_dim, p);
}

#define M40LLM_INSTANTIATE(P) \
  template int mma_tier_passes<P>(m40llm_cuda_state *, int, SplitPasses *);
M40LLM_KV_PAIRS(M40LLM_INSTANTIATE)
M40LLM_TIER_ONLY_PAIRS(M40LLM_INSTANTIATE)
#undef M40LLM_INSTANTIATE

#if M40LLM_MMA_ONE_LAUNCH
// Every tier of a call in one launch: a block finds its launch by grid y and runs that tier's
// pair as attn_mma_kernel's tier instance would (the pair's code is a run-time branch a block,
// the same for all its threads; the kernel takes the registers of the hungriest pair).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
template <typename P, int NC, int W>
__device__ __forceinline__ void tier_block(int pair, const AttnArgs &a,
                                           const m40llm_attn_plan &plan,
                                           const MmaShared<NC, 0, W> &shared) {
  if constexpr (kQuantPair<P>)
    if (pair == kv_pair_id(P::K::kFormat, P::V::kFormat))
      attn_mma_block<P, NC, 0, kMmaTier, W>(a, plan, shared);
}
#endif

template <int NC, int W>
__global__ void __launch_bounds__(32 * W, mma_min_blocks(32 * NC, W))
    attn_mma_tiers_kernel(const __grid_constant__ MmaTierLaunch l) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  M40LLM_MMA_SHARED(MmaShared<NC M40LLM_COMMA 0 M40LLM_COMMA W>, shared);
  int j = 0;
  for (int k = 1; k < l.n; k++) j += block_split() >= l.y0[k];
#define M40LLM_TIER_BLOCK(P) tier_block<P, NC, W>(l.pair[j], l.args[j], l.plan[j], shared);
  M40LLM_KV_PAIRS(M40LLM_TIER_BLOCK)
  M40LLM_TIER_ONLY_PAIRS(M40LLM_TIER_BLOCK)
#undef M40LLM_TIER_BLOCK
#else
  (void)l;  // compiled for an older GPU: the host never launches this image
#endif
}

namespace {

using TiersKernel = void (*)(MmaTierLaunch);

// Blocks of mma_warps() warps and of half that, as the pairs' own kernels have.
template <int NC>
TiersKernel tiers_kernel_of(int warps) {
  constexpr int W = mma_warps(32 * NC);
  if constexpr (!kMmaOneLaunch) {
    (void)warps;
    return nullptr;
  } else {
    return warps == W ? attn_mma_tiers_kernel<NC, W>
                      : warps == W / 2 ? attn_mma_tiers_kernel<NC, W / 2> : nullptr;
  }
}

TiersKernel tiers_kernel(int head_dim, int warps) {
  switch (head_dim) {  // the quantized formats' head_dims: whole groups of 32
    case 32: return tiers_kernel_of<1>(warps);
    case 64: return tiers_kernel_of<2>(warps);
    case 96: return tiers_kernel_of<3>(warps);
    case 128: return tiers_kernel_of<4>(warps);
    case 192: return tiers_kernel_of<6>(warps);
    case 256: return tiers_kernel_of<8>(warps);
    default: return nullptr;
  }
}

}  // namespace

int mma_tiers_passes(m40llm_cuda_state *st, int head_dim, SplitPasses *p, bool *have) {
  *p = SplitPasses{};
  *have = false;
  if (head_dim % 16 != 0 || head_dim / 16 >= 17) return M40LLM_OK;
  const int warps = mma_warps(head_dim);
  m40llm_cuda_state::MmaInfo &wide = st->mma_tiers[0][head_dim / 16];
  m40llm_cuda_state::MmaInfo &half = st->mma_tiers[1][head_dim / 16];
  if (wide.usable == 0 && tiers_kernel(head_dim, warps)) {  // its parameters: a 12.1 driver
    int driver = 0;
    M40LLM_CUDA_TRY(cudaDriverGetVersion(&driver));
    if (driver < 12010) wide.usable = half.usable = -1;
  }
  int rc = mma_pass_of(st, tiers_kernel(head_dim, warps), head_dim, warps, false, true, wide,
                       &p->pass);
  if (rc != M40LLM_OK || wide.usable <= 0) return rc;
  rc = mma_pass_of(st, tiers_kernel(head_dim, warps / 2), head_dim, warps / 2, false, true, half,
                   &p->fine);
  if (rc != M40LLM_OK) return rc;
  if (half.usable <= 0) p->fine = p->pass;
  p->direct = p->pass;
  *have = true;
  return M40LLM_OK;
}

int mma_tiers_launch(cudaStream_t stream, int head_dim, const SplitPass &pass, dim3 grid,
                     bool dependent, const MmaTierLaunch &l) {
  const TiersKernel k = tiers_kernel(head_dim, pass.threads / 32);
  if (!k)
    return m40llm_fail(M40LLM_ERR_UNSUPPORTED, "no kernel for every tier at head_dim %d", head_dim);
  return launch_attention_kernel(stream, "launching the attention split kernel (every tier)", k,
                                 grid, pass.threads, pass.smem, dependent, l);
}
#endif
