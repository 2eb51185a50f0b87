// The attention weights of m40llm_kvcache_attn_weights_ex: the FP32 split kernel writes each
// score (log2 domain) into the caller's rows as it computes it, and every split's (max, sum)
// partial into the workspace; once the call's splits are done, this kernel merges a head's
// partials into its softmax (max, sum) and turns its scores into weights in place, or, for
// m40llm_kvcache_attn_importance_ex, reduces them into each K/V row's importance, or, for
// m40llm_kvcache_attn_observe_ex, into the cache's accumulators.
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

// merged() with a warp's lanes loading the partials, for a block that merges several heads
// before its positions: one thread walking an item's splits took a memory round trip per few of
// them, twice, and at batch 1 every block of a long context paid that (the importance call
// at 32K contexts was 1.45x the plain call on the M40 path). The sum still runs in split order,
// so lane 0's state is merged()'s bit for bit: lane 0 takes each partial's weight and sum from
// `pairs` (the warp's own 32 x kImportanceMergeBatch in shared memory), a 16-byte load per 2
// splits where handing them round took 2 shuffles a split on every lane (the same time on an
// H100, fewer of the issue slots that the M40 runs out of).
__device__ SoftmaxState merged_by_warp(const AttnArgs &a, const m40llm_attn_plan &plan, int item,
                                       int h, float2 *pairs) {
  constexpr int B = kImportanceMergeBatch;
  const int lane = threadIdx.x & 31;
  const int first = plan.split_begin[item];
  const int n = plan.split_begin[item + 1] - first;
  const float *__restrict__ pm = a.part_m + (size_t)first * a.n_heads + h;
  const float *__restrict__ pl = a.part_l + (size_t)first * a.n_heads + h;
  // Lane l holds splits s0 + 32 b + l; those past n read as (-inf, 0), which weigh 0.
  float ms[B], ls[B];
  const auto load = [&](int s0) {
#pragma unroll
    for (int b = 0; b < B; b++) {
      const int s = s0 + 32 * b + lane;
      ms[b] = s < n ? pm[(size_t)s * a.n_heads] : -INFINITY;
      ls[b] = s < n ? pl[(size_t)s * a.n_heads] : 0.0f;
    }
  };
  // The first 32 x B partials stay in registers from the max to the sum: one round trip.
  load(0);
  float m = -INFINITY;
#pragma unroll
  for (int b = 0; b < B; b++) m = fmaxf(m, ms[b]);
  for (int s = 32 * B + lane; s < n; s += 32) m = fmaxf(m, pm[(size_t)s * a.n_heads]);
  SoftmaxState st = SoftmaxState::at_max(warp_max(m));
  for (int s0 = 0; s0 < n; s0 += 32 * B) {
    if (s0 > 0) load(s0);
#pragma unroll
    for (int b = 0; b < B; b++) pairs[32 * b + lane] = make_float2(st.weight(ms[b]), ls[b]);
    __syncwarp();
    // 8 pairs loaded at once (one after another, each waited on its load); those past n are
    // (0, 0), and fmaf(0, 0, l) is l.
    for (int k0 = 0; lane == 0 && k0 < n - s0 && k0 < 32 * B; k0 += 8) {
      float2 v[8];
#pragma unroll
      for (int k = 0; k < 8; k++) v[k] = pairs[k0 + k];
#pragma unroll
      for (int k = 0; k < 8; k++) st.l = fmaf(v[k].x, v[k].y, st.l);
    }
    __syncwarp();
  }
  return st;
}

// An observe call's first: a block per (item, 8 query heads), a warp per head merging its
// partials (merged_by_warp) into states[item * n_heads + h]: its max as SoftmaxState::weight
// takes it, and 1 / sum. Once for the call: attn_observe_kernel's blocks need every head's, and
// with each block merging them itself that kernel took 19.9 us under the profiler, against 3.7
// for this launch and 12.1 for the same kernel after it (B8 32/8 L8K). (The importance kernel's
// blocks merge only their group's heads: this launch more cost its calls 1-25%.)
__global__ void __launch_bounds__(kWeightsThreads)
    attn_head_state_kernel(const AttnArgs a, const m40llm_attn_plan plan, float2 *states) {
  __shared__ float2 pairs[kWeightsThreads / 32][32 * kImportanceMergeBatch];  // a warp's merge
  const int item = blockIdx.x, h = blockIdx.y * (kWeightsThreads / 32) + (threadIdx.x >> 5);
  if (h >= a.n_heads) return;
  const SoftmaxState st = merged_by_warp(a, plan, item, h, pairs[threadIdx.x >> 5]);
  if ((threadIdx.x & 31) == 0)
    states[(size_t)item * a.n_heads + h] =
        make_float2(SoftmaxState::reference(st.m), st.inv_sum());
}

// A block per (item, K/V head g, slice of positions), the grid one wave of resident blocks (or
// fewer, at least kImportanceChunk positions a block): a warp per query head of g merges its
// partials into shared memory (its max, as SoftmaxState::weight takes it, and 1 / sum), then for
// each position the largest of its weights over those heads, added to the decayed importance.
// The weights (in the scratch buffer) are the ones attn_weights_kernel would write, the same
// operations in the same order.
__global__ void __launch_bounds__(kWeightsThreads, kImportanceBlocksPerSm)
    attn_importance_kernel(const AttnArgs a, const m40llm_attn_plan plan,
                           const ImportanceArgs imp) {
  extern __shared__ float head_state[];  // [group] reference maxima, then [group] 1 / sum
  __shared__ float2 pairs[kWeightsThreads / 32][32 * kImportanceMergeBatch];  // a warp's merge
  const int item = blockIdx.x, g = blockIdx.y;
  int begin, end;
  block_slice(plan, &begin, &end);
  if (begin >= end) return;
  float2 *const own = pairs[threadIdx.x >> 5];
  for (int j = threadIdx.x >> 5; j < a.group; j += kWeightsThreads / 32) {
    const SoftmaxState st = merged_by_warp(a, plan, item, g * a.group + j, own);
    if ((threadIdx.x & 31) == 0) {
      head_state[j] = SoftmaxState::reference(st.m);
      head_state[a.group + j] = st.inv_sum();
    }
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

// An observe call's: a block per (item, slice of positions), kObservePositions positions at a
// time, each position's heads shared among kObserveHeadGroups threads (a thread's loads issued
// together: with a thread a position, loading every head in turn, the kernel took 1.6x the
// time): for each position the largest of its weights over every query head added to its
// accumulator, and the call counted. The weights are attn_importance_kernel's, and the largest
// of them over the K/V heads is what its rows at decay 0 held, bit for bit.
__global__ void __launch_bounds__(kObservePositions * kObserveHeadGroups)
    attn_observe_kernel(const AttnArgs a, const m40llm_attn_plan plan, const ImportanceArgs imp) {
  extern __shared__ float2 head_states[];  // [n_heads] (reference max, 1 / sum)
  __shared__ float part[kObserveHeadGroups][kObservePositions];
  const int item = blockIdx.x;
  int begin, end;
  block_slice(plan, &begin, &end);
  if (begin >= end) return;
  for (int h = threadIdx.x; h < a.n_heads; h += blockDim.x)
    head_states[h] = imp.states[(size_t)item * a.n_heads + h];
  __syncthreads();
  const int at = threadIdx.x % kObservePositions, first = threadIdx.x / kObservePositions;
  const float *__restrict__ scores = plan.weights + (size_t)item * a.n_heads * plan.weights_stride;
  m40llm_imp_acc *__restrict__ acc = imp.acc + (size_t)plan.seq[item] * imp.acc_stride;
  for (int p0 = begin; p0 < end; p0 += kObservePositions) {
    const int p = p0 + at;
    float most = 0.0f;
    if (p < end) {
#pragma unroll 8
      for (int h = first; h < a.n_heads; h += kObserveHeadGroups)
        most = fmaxf(most,
                     exp2f(scores[(size_t)h * plan.weights_stride + p] - head_states[h].x) *
                         head_states[h].y);
    }
    part[first][at] = most;
    __syncthreads();
    if (first == 0 && p < end) {
      const m40llm_imp_acc old = acc[p];
#pragma unroll
      for (int g = 1; g < kObserveHeadGroups; g++) most = fmaxf(most, part[g][at]);
      acc[p] = m40llm_imp_acc{old.sum + most, old.calls + 1};
    }
    __syncthreads();  // the next positions rewrite part
  }
}

}  // namespace

int scores_stage(m40llm_cuda_state *st, size_t floats, size_t states, float **out,
                 float2 **out_states) {
  const size_t at = (floats + 1) / 2 * 2;  // the states 8-byte aligned
  const int rc = m40llm_cuda_grow(st, &st->scores, &st->scores_bytes,
                                  at * sizeof(float) + states * sizeof(float2),
                                  "scratch buffer of an importance call's weights");
  *out = static_cast<float *>(st->scores);
  *out_states = reinterpret_cast<float2 *>(*out + at);
  return rc;
}

int weights_launch(m40llm_cuda_state *st, const AttnArgs &a, const m40llm_attn_plan &plan,
                   const ImportanceArgs &imp) {
  int longest = 1;
  for (int i = 0; i < plan.n_items; i++) longest = plan.len[i] > longest ? plan.len[i] : longest;
  if (imp.acc) {
    constexpr int heads_a_block = kWeightsThreads / 32;
    attn_head_state_kernel<<<dim3((unsigned)plan.n_items,
                                  (unsigned)((a.n_heads + heads_a_block - 1) / heads_a_block)),
                             kWeightsThreads, 0, st->stream>>>(a, plan, imp.states);
    M40LLM_CUDA_CHECK_LAUNCH("attn_head_state_kernel");
    const long long slices = (longest + kObservePositions - 1) / kObservePositions;
    attn_observe_kernel<<<dim3((unsigned)plan.n_items, 1,
                               (unsigned)(slices < 65535 ? slices : 65535)),
                          kObservePositions * kObserveHeadGroups,
                          (size_t)a.n_heads * sizeof(float2), st->stream>>>(a, plan, imp);
    M40LLM_CUDA_CHECK_LAUNCH("attn_observe_kernel");
    return M40LLM_OK;
  }
  const long long per_block = imp.rows ? kImportanceChunk : kWeightsChunk;
  long long chunks = (longest + per_block - 1) / per_block;
  if (imp.rows) {
    const long long pairs = (long long)plan.n_items * (a.n_heads / a.group);
    const long long wave = ((long long)st->sm_count * kImportanceBlocksPerSm + pairs - 1) / pairs;
    // Whole chunks a block: a slice of 1.3 chunks takes as long as one of 2.
    const long long per = (chunks + wave - 1) / wave;
    chunks = (chunks + per - 1) / per;
  }
  const unsigned z = (unsigned)(chunks < 65535 ? chunks : 65535);
  if (!imp.rows)
    return launch_attention_kernel(st->stream, "launching attn_weights_kernel", attn_weights_kernel,
                                   dim3((unsigned)plan.n_items, (unsigned)a.n_heads, z),
                                   kWeightsThreads, 0, false, a, plan);
  const dim3 grid((unsigned)plan.n_items, (unsigned)(a.n_heads / a.group), z);
  attn_importance_kernel<<<grid, kWeightsThreads, 2 * (size_t)a.group * sizeof(float),
                           st->stream>>>(a, plan, imp);
  M40LLM_CUDA_CHECK_LAUNCH("attn_importance_kernel");
  return M40LLM_OK;
}
