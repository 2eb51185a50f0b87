// The attention weights of m40llm_kvcache_attn_weights_ex: the FP32 split kernel writes each
// score (log2 domain) into the caller's rows as it computes it, and every split's (max, sum)
// partial into the workspace; once the call's splits are done, this kernel merges a head's
// partials into its softmax (max, sum) and turns its scores into weights in place, or, for
// m40llm_kvcache_attn_importance_ex, reduces them into each K/V row's importance.
#include <math.h>

#include "attention.cuh"

namespace {

// One block per (item, query head, 1 / gridDim.z of the item's positions): the item's splits
// merged (each block of the head again: a few partials), then its positions. (A block per head
// alone left a batch of one sequence with a block per query head, each walking the whole
// context.)
// This block's positions [begin, end) of its item (blockIdx.x): slice blockIdx.z of gridDim.z.
__device__ __forceinline__ void block_slice(const m40llm_attn_plan &plan, int *begin, int *end) {
  const long long len = plan.len[blockIdx.x];
  const long long chunk = (len + (long long)gridDim.z - 1) / gridDim.z;
  *begin = (int)min(len, blockIdx.z * chunk);
  *end = (int)min(len, (long long)*begin + chunk);
}

// Query head h's softmax (max, sum) over all the item's splits.
__device__ __forceinline__ SoftmaxState merged(const AttnArgs &a, const m40llm_attn_plan &plan,
                                               int item, int h) {
  const int first = plan.split_begin[item];
  const int n = plan.split_begin[item + 1] - first;
  float m = -INFINITY;
  for (int s = 0; s < n; s++) m = fmaxf(m, a.part_m[(size_t)(first + s) * a.n_heads + h]);
  SoftmaxState st = SoftmaxState::at_max(m);
  for (int s = 0; s < n; s++) {
    const size_t p = (size_t)(first + s) * a.n_heads + h;
    st.add_partial(a.part_m[p], a.part_l[p]);
  }
  return st;
}

__global__ void __launch_bounds__(kWeightsThreads)
    attn_weights_kernel(const AttnArgs a, const m40llm_attn_plan plan) {
  const int item = blockIdx.x, h = blockIdx.y;
  int begin, end;
  block_slice(plan, &begin, &end);
  if (begin >= end) return;
  const SoftmaxState st = merged(a, plan, item, h);
  // Every score -inf (or none): weights 0, as the output is zeros.
  const float inv_l = st.inv_sum();
  float *row = plan.weights + ((size_t)item * a.n_heads + h) * plan.weights_stride;
  for (int p = begin + threadIdx.x; p < end; p += kWeightsThreads)
    row[p] = st.weight(row[p]) * inv_l;
}

// A block per (item, K/V head g, kImportanceChunk positions): each of g's query heads merged
// into shared memory (its max, as SoftmaxState::weight takes it, and 1 / sum), then for each
// position the largest of its weights over those heads, added to the decayed importance. The
// weights (in the scratch buffer) are the ones attn_weights_kernel would write, the same
// operations in the same order.
__global__ void __launch_bounds__(kWeightsThreads)
    attn_importance_kernel(const AttnArgs a, const m40llm_attn_plan plan,
                           const ImportanceArgs imp) {
  extern __shared__ float head_state[];  // [group] reference maxima, then [group] 1 / sum
  const int item = blockIdx.x, g = blockIdx.y;
  int begin, end;
  block_slice(plan, &begin, &end);
  if (begin >= end) return;
  for (int j = threadIdx.x; j < a.group; j += blockDim.x) {
    const SoftmaxState st = merged(a, plan, item, g * a.group + j);
    head_state[j] = SoftmaxState::reference(st.m);
    head_state[a.group + j] = st.inv_sum();
  }
  __syncthreads();
  const float *__restrict__ scores =
      plan.weights + ((size_t)item * a.n_heads + (size_t)g * a.group) * plan.weights_stride;
  float *__restrict__ row = imp.rows + ((size_t)item * (a.n_heads / a.group) + g) * imp.stride;
  // The loads of a position are issued together (unrolled, row read first): one after another
  // they made this kernel twice the weights kernel's time.
  for (int p = begin + threadIdx.x; p < end; p += kWeightsThreads) {
    const float old = row[p];
    float most = 0.0f;
#pragma unroll 8
    for (int j = 0; j < a.group; j++)
      most = fmaxf(most, exp2f(scores[(size_t)j * plan.weights_stride + p] - head_state[j]) *
                             head_state[a.group + j]);
    row[p] = fmaf(imp.decay, old, most);
  }
}

}  // namespace

int scores_stage(m40llm_cuda_state *st, size_t floats, float **out) {
  const int rc = m40llm_cuda_grow(st, &st->scores, &st->scores_bytes, floats * sizeof(float),
                                  "scratch buffer of an importance call's weights");
  *out = static_cast<float *>(st->scores);
  return rc;
}

int weights_launch(m40llm_cuda_state *st, const AttnArgs &a, const m40llm_attn_plan &plan,
                   const ImportanceArgs &imp) {
  int longest = 1;
  for (int i = 0; i < plan.n_items; i++) longest = plan.len[i] > longest ? plan.len[i] : longest;
  const long long per_block = imp.rows ? kImportanceChunk : kWeightsChunk;
  const long long chunks = (longest + per_block - 1) / per_block;
  const unsigned z = (unsigned)(chunks < 65535 ? chunks : 65535);
  if (!imp.rows)
    return launch_attention_kernel(st, "launching attn_weights_kernel", attn_weights_kernel,
                                   dim3((unsigned)plan.n_items, (unsigned)a.n_heads, z),
                                   kWeightsThreads, 0, false, a, plan);
  const dim3 grid((unsigned)plan.n_items, (unsigned)(a.n_heads / a.group), z);
  attn_importance_kernel<<<grid, kWeightsThreads, 2 * (size_t)a.group * sizeof(float),
                           st->stream>>>(a, plan, imp);
  M40LLM_CUDA_CHECK_LAUNCH("attn_importance_kernel");
  return M40LLM_OK;
}
