// The attention weights of m40llm_kvcache_attn_weights_ex: the FP32 split kernel writes each
// score (log2 domain) into the caller's rows as it computes it, and every split's (max, sum)
// partial into the workspace; once the call's splits are done, this kernel merges a head's
// partials into its softmax (max, sum) and turns its scores into weights in place.
#include <math.h>

#include "attention.cuh"

namespace {

// One block per (item, query head, 1 / gridDim.z of the item's positions): the item's splits
// merged (each block of the head again: a few partials), then its positions. (A block per head
// alone left a batch of one sequence with a block per query head, each walking the whole
// context.)
__global__ void __launch_bounds__(kWeightsThreads)
    attn_weights_kernel(const AttnArgs a, const m40llm_attn_plan plan) {
  const int item = blockIdx.x, h = blockIdx.y;
  const long long chunk = (plan.len[item] + (long long)gridDim.z - 1) / gridDim.z;
  const long long begin = blockIdx.z * chunk;
  const int end = (int)min((long long)plan.len[item], begin + chunk);
  if (begin >= end) return;
  const int first = plan.split_begin[item];
  const int n = plan.split_begin[item + 1] - first;
  float m = -INFINITY;
  for (int s = 0; s < n; s++) m = fmaxf(m, a.part_m[(size_t)(first + s) * a.n_heads + h]);
  SoftmaxState st = SoftmaxState::at_max(m);
  for (int s = 0; s < n; s++) {
    const size_t p = (size_t)(first + s) * a.n_heads + h;
    st.add_partial(a.part_m[p], a.part_l[p]);
  }
  // Every score -inf (or none): weights 0, as the output is zeros.
  const float inv_l = st.inv_sum();
  float *row = plan.weights + ((size_t)item * a.n_heads + h) * plan.weights_stride;
  for (int p = (int)begin + threadIdx.x; p < end; p += kWeightsThreads)
    row[p] = st.weight(row[p]) * inv_l;
}

}  // namespace

int weights_launch(m40llm_cuda_state *st, const AttnArgs &a, const m40llm_attn_plan &plan) {
  int longest = 1;
  for (int i = 0; i < plan.n_items; i++) longest = plan.len[i] > longest ? plan.len[i] : longest;
  const int chunks = (longest + kWeightsChunk - 1) / kWeightsChunk;
  const dim3 grid((unsigned)plan.n_items, (unsigned)a.n_heads,
                  (unsigned)(chunks < 65535 ? chunks : 65535));
  return launch_attention_kernel(st, "launching attn_weights_kernel", attn_weights_kernel, grid,
                                 kWeightsThreads, 0, false, a, plan);
}
