// Importance placement on CUDA (M40LLM_PLACE_IMPORTANCE; the decisions are the front end's,
// c/src/tier_policy.c): an observe call's weights, reduced over the K/V heads, into the
// cache's importance sums.
#include "backend_cuda.h"
#include "common.cuh"

namespace {

constexpr int kObserveThreads = 256;
// Items a launch takes: their ids and lengths travel in its argument.
constexpr int kObserveItems = 64;
// Positions a block takes at least (few blocks for short rows, enough for long ones).
constexpr int kObserveChunk = 256;

struct ObserveArgs {
  const float *scratch;  // [item][n_kv_heads][max_seq_len]: the call's weights, from item `first`
  float *sums;           // the layer's [max_seqs][max_seq_len]
  int32_t seq[kObserveItems], len[kObserveItems];
  int first, n_kv_heads, max_seq_len;
};

// A block per (item, chunk of positions): each position's largest weight over the K/V heads
// added to its sum (a plain add, as the host's `+=`).
__global__ void __launch_bounds__(kObserveThreads) tier_observe_kernel(const ObserveArgs a) {
  const int item = blockIdx.x;
  const size_t len_max = (size_t)a.max_seq_len;
  const float *__restrict__ w =
      a.scratch + ((size_t)(a.first + item) * (size_t)a.n_kv_heads) * len_max;
  float *__restrict__ sum = a.sums + (size_t)a.seq[item] * len_max;
  for (int p = blockIdx.y * blockDim.x + threadIdx.x; p < a.len[item];
       p += gridDim.y * blockDim.x) {
    float most = 0.0f;
    for (int g = 0; g < a.n_kv_heads; g++) most = fmaxf(most, w[(size_t)g * len_max + p]);
    sum[p] = sum[p] + most;
  }
}

}  // namespace

int m40llm_cuda_tier_observe(const m40llm_kvcache *c, int layer, const int32_t *seq_ids,
                             int n_seqs) {
  M40LLM_CUDA_ENTER(c->ctx);
  const m40llm_kvcache_options *o = &c->opts;
  for (int first = 0; first < n_seqs; first += kObserveItems) {
    ObserveArgs a;
    a.scratch = c->imp_scratch;
    a.sums = c->imp_sum + (size_t)layer * (size_t)o->max_seqs * (size_t)o->max_seq_len;
    a.first = first;
    a.n_kv_heads = o->n_kv_heads;
    a.max_seq_len = o->max_seq_len;
    const int n = n_seqs - first < kObserveItems ? n_seqs - first : kObserveItems;
    int longest = 1;
    for (int i = 0; i < n; i++) {
      a.seq[i] = seq_ids[first + i];
      a.len[i] = *m40llm_len_slot(c, layer, a.seq[i]);
      longest = a.len[i] > longest ? a.len[i] : longest;
    }
    const unsigned chunks = (unsigned)((longest + kObserveChunk - 1) / kObserveChunk);
    tier_observe_kernel<<<dim3((unsigned)n, chunks), kObserveThreads, 0,
                          cuda_state(c->ctx)->stream>>>(a);
    M40LLM_CUDA_CHECK_LAUNCH("tier_observe_kernel");
  }
  return M40LLM_OK;
}
