// Importance placement on CUDA (M40LLM_PLACE_IMPORTANCE; the decisions are the front end's,
// c/src/tier_policy.c): after an observe call's attention has added its weights to the
// cache's accumulators (attn_observe_kernel, attention_weights.cu), each sequence's record
// (its tiers' least important rows, its window's scores), copied to pinned host memory on a
// stream of its own behind an event of the layer, which the host waits for at the layer's next
// append.
#include <climits>

#include "backend_cuda.h"
#include "common.cuh"

namespace {

// Items a launch takes: their ids and counts travel in its argument.
constexpr int kRankItems = 64;
// A block of 32 warps: a tier of up to 4,096 rows (a decode step's at 8K-10K contexts) ranked
// by one block, without the merge of several blocks' lists that longer tiers take.
constexpr int kRankThreads = 1024;
constexpr int kRankWarps = kRankThreads / 32;
// Rows of a tier a ranking block takes: each thread's loads issued together, then ranked (a
// tier's rows are gathers through its slot map, so a long loop a thread would be latency-bound).
constexpr int kRankPerThread = 4;
constexpr int kRankRows = kRankThreads * kRankPerThread;
constexpr int kLow = M40LLM_IMP_LOW;

struct RankArgs {
  const m40llm_imp_acc *acc;             // the layer's [max_seqs][max_seq_len]
  const int32_t *map[M40LLM_MAX_TIERS];  // each tier's slot maps of the layer, [max_seqs][rows]
  char *records;                         // the layer's [max_seqs] records
  double *part_score;                    // each chunk's least important rows of a tier with
  int32_t *part_pos;                     //   several: [item][tier][chunk][kLow]
  int32_t *done;                         // the cache's [max_seqs][M40LLM_MAX_TIERS] chunks done
  size_t record_bytes, max_seq_len;
  int rows[M40LLM_MAX_TIERS];
  int32_t seq[kRankItems], win_first[kRankItems], win_n[kRankItems];
  int32_t count[kRankItems][M40LLM_MAX_TIERS];
  int n_tiers, chunks;
};

// backend.h's m40llm_imp_score on the device: the double quotient, IEEE-rounded on both, so that
// the ranking is the host's.
__device__ __forceinline__ double imp_score(m40llm_imp_acc a) {
  return a.calls > 0 ? (double)a.sum / (double)a.calls : 0.0;
}

// Scores are ranked by their bits: for doubles >= +0 (a score is a sum of weights >= +0 over a
// count, never NaN) the unsigned order of the bits is the order of the values, +inf (the
// sentinel) last, so that key_below is m40llm_imp_below's order in integer compares. (In
// doubles, the ranking's comparisons were 391 DSETP in the sm_52 SASS, 1/32 of the M40's FP32
// rate.)
typedef unsigned long long score_key;
__device__ __forceinline__ score_key key_of(double s) {
  return static_cast<score_key>(__double_as_longlong(s));
}
__device__ __forceinline__ double score_of(score_key k) {
  return __longlong_as_double(static_cast<long long>(k));
}
__device__ __forceinline__ bool key_below(score_key a, int32_t pa, score_key b, int32_t pb) {
  return a < b || (a == b && pa < pb);
}
constexpr score_key kNoRow = 0x7ff0000000000000ULL;  // +inf

// A thread's kLow least important rows, in order, in registers: an insertion by
// compare-and-swap (no dynamic indexing).
struct LowList {
  score_key k[kLow];
  int32_t kp[kLow];
  __device__ void clear() {
#pragma unroll
    for (int i = 0; i < kLow; i++) k[i] = kNoRow, kp[i] = INT_MAX;
  }
  __device__ void insert(score_key sc, int32_t p) {
    if (!key_below(sc, p, k[kLow - 1], kp[kLow - 1])) return;
    k[kLow - 1] = sc, kp[kLow - 1] = p;
#pragma unroll
    for (int i = kLow - 1; i > 0; i--)
      if (key_below(k[i], kp[i], k[i - 1], kp[i - 1])) {
        const score_key ts = k[i];
        const int32_t tp = kp[i];
        k[i] = k[i - 1], kp[i] = kp[i - 1], k[i - 1] = ts, kp[i - 1] = tp;
      }
  }
  // The least of a warp's heads, in every lane.
  __device__ void warp_min(score_key *bs, int32_t *bp) const {
    *bs = k[0], *bp = kp[0];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const score_key os = __shfl_xor_sync(0xffffffffu, *bs, off);
      const int32_t op = __shfl_xor_sync(0xffffffffu, *bp, off);
      if (key_below(os, op, *bs, *bp)) *bs = os, *bp = op;
    }
  }
  // Takes out the head where it is position bp (positions are distinct: one thread holds it).
  __device__ void pop_if(int32_t bp) {
    if (kp[0] != bp) return;
#pragma unroll
    for (int i = 0; i < kLow - 1; i++) k[i] = k[i + 1], kp[i] = kp[i + 1];
    k[kLow - 1] = kNoRow, kp[kLow - 1] = INT_MAX;
  }
  // The warp's kLow least important, in order, into score[] and pos[] (lane 0 writes;
  // sentinels where the warp holds fewer).
  __device__ void warp_lowest(double *score, int32_t *pos) {
#pragma unroll
    for (int round = 0; round < kLow; round++) {
      score_key bs;
      int32_t bp;
      warp_min(&bs, &bp);
      pop_if(bp);
      if ((threadIdx.x & 31) == 0) score[round] = score_of(bs), pos[round] = bp;
    }
  }
};

// The first n of a ranked list into tier t's entries of record r (lane 0 of the warp).
__device__ void write_low(m40llm_imp_record *r, int t, int n, const double *score,
                          const int32_t *pos) {
  if ((threadIdx.x & 31) != 0) return;
  for (int i = 0; i < n; i++) r->low_score[t][i] = score[i], r->low_pos[t][i] = pos[i];
  r->n_low[t] = n;
}

// A block per (item, tier, chunk of kRankRows rows), and one more per item (tier n_tiers,
// chunk 0) for its window's scores. A chunk's block: each warp's kLow least important rows
// (its threads' lists, kLow rounds of a warp-wide minimum), then warp 0's of those. A tier of
// one chunk writes them into the record; a tier of several writes them into the partials, and
// its last block to finish (the cache's counter of the (sequence, tier), reset by that block)
// merges every chunk's into the record.
__global__ void __launch_bounds__(kRankThreads) tier_rank_kernel(const RankArgs a) {
  const int item = blockIdx.x, t = blockIdx.y, chunk = blockIdx.z, seq = a.seq[item];
  const m40llm_imp_acc *__restrict__ acc = a.acc + (size_t)seq * a.max_seq_len;
  m40llm_imp_record *r =
      reinterpret_cast<m40llm_imp_record *>(a.records + (size_t)seq * a.record_bytes);
  if (t == a.n_tiers) {
    if (chunk > 0) return;
    double *win = reinterpret_cast<double *>(r + 1);
    for (int i = threadIdx.x; i < a.win_n[item]; i += blockDim.x)
      win[i] = imp_score(acc[a.win_first[item] + i]);
    if (threadIdx.x == 0) r->win_first = a.win_first[item], r->win_n = a.win_n[item];
    return;
  }
  const int begin = chunk * kRankRows, count = a.count[item][t];
  if (begin >= count && chunk > 0) return;  // only the chunks that hold rows count
  const int32_t *__restrict__ map = a.map[t] + (size_t)seq * (size_t)a.rows[t];
  int32_t p[kRankPerThread];
#pragma unroll
  for (int j = 0; j < kRankPerThread; j++) {
    const int s = begin + j * kRankThreads + (int)threadIdx.x;
    p[j] = s < count ? map[s] : -1;
  }
  m40llm_imp_acc x[kRankPerThread];
#pragma unroll
  for (int j = 0; j < kRankPerThread; j++) x[j] = p[j] >= 0 ? acc[p[j]] : m40llm_imp_acc{0.0f, 0};
  LowList l;
  l.clear();
#pragma unroll
  for (int j = 0; j < kRankPerThread; j++)
    if (p[j] >= 0) l.insert(key_of(imp_score(x[j])), p[j]);
  __shared__ double w_score[kRankWarps * kLow];
  __shared__ int32_t w_pos[kRankWarps * kLow];
  __shared__ bool last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  l.warp_lowest(w_score + warp * kLow, w_pos + warp * kLow);
  __syncthreads();
  if (warp != 0) return;
  const int n = count < kLow ? count : kLow;
  l.clear();
  for (int i = lane; i < kRankWarps * kLow; i += 32) l.insert(key_of(w_score[i]), w_pos[i]);
  const int chunks = (count + kRankRows - 1) / kRankRows;
  if (chunks <= 1) {  // the block's list is the tier's (a tier of no rows: n 0)
    double bs[kLow];
    int32_t bp[kLow];
    l.warp_lowest(bs, bp);
    write_low(r, t, n, bs, bp);
    return;
  }
  const size_t base = ((size_t)item * M40LLM_MAX_TIERS + (size_t)t) * (size_t)a.chunks * kLow;
  l.warp_lowest(a.part_score + base + (size_t)chunk * kLow, a.part_pos + base + (size_t)chunk * kLow);
  // The last chunk's block sees every other's partials (the fence before its count, the
  // classic reduction's pattern).
  __threadfence();
  int32_t *done = a.done + (size_t)seq * M40LLM_MAX_TIERS + t;
  if (lane == 0) last = atomicAdd(done, 1) == chunks - 1;
  __syncwarp();
  if (!last) return;
  __threadfence();
  l.clear();
  const volatile double *ps = a.part_score + base;
  const volatile int32_t *pp = a.part_pos + base;
  for (int i = lane; i < chunks * kLow; i += 32)
    if (pp[i] != INT_MAX) l.insert(key_of(ps[i]), pp[i]);
  double bs[kLow];
  int32_t bp[kLow];
  l.warp_lowest(bs, bp);
  write_low(r, t, n, bs, bp);
  if (lane == 0) *done = 0;
}

// Chunks of kRankRows the largest tier of c takes, and the bytes of a launch's partials.
int rank_chunks(const m40llm_kvcache *c) {
  int rows = 1;
  for (int t = 0; t < c->n_tiers; t++)
    rows = c->opts.tiers[t].rows > rows ? c->opts.tiers[t].rows : rows;
  return (rows + kRankRows - 1) / kRankRows;
}
// Entries of each of a launch's partials arrays (a launch takes at most this many items:
// distinct sequences).
size_t rank_partials(const m40llm_kvcache *c) {
  const int items = c->opts.max_seqs < kRankItems ? c->opts.max_seqs : kRankItems;
  return (size_t)items * M40LLM_MAX_TIERS * (size_t)rank_chunks(c) * kLow;
}
size_t rank_partial_bytes(const m40llm_kvcache *c) {
  return rank_partials(c) * (sizeof(double) + sizeof(int32_t));
}

// The CUDA backend's own part of a cache's policy state. The records' copies run on a stream
// of their own (`copy`, after the ranking's event `ranked`), so that the context's stream goes
// on while they land; each layer's event `landed` marks its last copy done, for the host and
// for the next ranking of the layer, which rewrites the records the copy reads.
struct PolicyState {
  cudaStream_t copy;
  bool has_copy;
  cudaEvent_t ranked;
  bool has_ranked;
  int n_events;           // layers' events made so far
  cudaEvent_t landed[1];  // [n_layers]
};

}  // namespace

int m40llm_cuda_policy_alloc(m40llm_kvcache *c) {
  M40LLM_CUDA_ENTER(c->ctx);
  const int layers = c->opts.n_layers;
  PolicyState *ps = static_cast<PolicyState *>(
      m40llm_host_calloc(1, sizeof(PolicyState) + (size_t)(layers - 1) * sizeof(cudaEvent_t)));
  if (!ps) return m40llm_fail(M40LLM_ERR_OUT_OF_MEMORY, "allocating the policy's events");
  c->imp_backend = ps;
  M40LLM_CUDA_TRY(cudaStreamCreateWithFlags(&ps->copy, cudaStreamNonBlocking));
  ps->has_copy = true;
  M40LLM_CUDA_TRY(cudaEventCreateWithFlags(&ps->ranked, cudaEventDisableTiming));
  ps->has_ranked = true;
  for (; ps->n_events < layers; ps->n_events++)
    M40LLM_CUDA_TRY(cudaEventCreateWithFlags(&ps->landed[ps->n_events], cudaEventDisableTiming));
  const size_t bytes = (size_t)layers * (size_t)c->opts.max_seqs * c->imp_record_bytes;
  M40LLM_CUDA_TRY(cudaHostAlloc(&c->imp_records, bytes, cudaHostAllocDefault));
  // The rankings' partials live in the context's workspace (after the call's attention on the
  // stream): reserved here, so that an observe call never allocates.
  void *ws = nullptr;
  return m40llm_cuda_workspace(cuda_state(c->ctx), rank_partial_bytes(c), &ws);
}

void m40llm_cuda_policy_free(m40llm_kvcache *c) {
  PolicyState *ps = static_cast<PolicyState *>(c->imp_backend);
  if (!ps) return;
  // Teardown cannot report failures; the copies into the records end first.
  (void)cudaSetDevice(c->ctx->device);
  (void)cudaStreamSynchronize(cuda_state(c->ctx)->stream);
  if (ps->has_copy) (void)cudaStreamSynchronize(ps->copy);
  for (int i = 0; i < ps->n_events; i++) (void)cudaEventDestroy(ps->landed[i]);
  if (ps->has_ranked) (void)cudaEventDestroy(ps->ranked);
  if (ps->has_copy) (void)cudaStreamDestroy(ps->copy);
  if (c->imp_records) (void)cudaFreeHost(c->imp_records);
  (void)cudaGetLastError();
  c->imp_records = nullptr;
  c->imp_backend = nullptr;
  free(ps);
}

int m40llm_cuda_tier_rank(const m40llm_kvcache *c, int layer, const int32_t *seq_ids,
                          int n_seqs) {
  M40LLM_CUDA_ENTER(c->ctx);
  const m40llm_kvcache_options *o = &c->opts;
  cudaStream_t stream = cuda_state(c->ctx)->stream;
  const size_t layer_seqs = (size_t)layer * (size_t)o->max_seqs;
  char *records = static_cast<char *>(c->imp_rank) + layer_seqs * c->imp_record_bytes;
  void *ws = nullptr;
  const int rc = m40llm_cuda_workspace(cuda_state(c->ctx), rank_partial_bytes(c), &ws);
  if (rc != M40LLM_OK) return rc;
  const int chunks = rank_chunks(c);
  const size_t parts = rank_partials(c);
  PolicyState *ps = static_cast<PolicyState *>(c->imp_backend);
  // The layer's last copy has read the records this call rewrites (a no-op for none).
  M40LLM_CUDA_TRY(cudaStreamWaitEvent(stream, ps->landed[layer], 0));
  int lo = o->max_seqs, hi = -1;
  for (int first = 0; first < n_seqs; first += kRankItems) {
    const int n = n_seqs - first < kRankItems ? n_seqs - first : kRankItems;
    RankArgs r;
    r.acc = c->imp_acc + layer_seqs * (size_t)o->max_seq_len;
    r.records = records;
    r.record_bytes = c->imp_record_bytes;
    r.max_seq_len = (size_t)o->max_seq_len;
    r.n_tiers = c->n_tiers;
    r.chunks = chunks;
    r.part_score = static_cast<double *>(ws);
    r.part_pos = reinterpret_cast<int32_t *>(r.part_score + parts);
    r.done = c->imp_done;
    for (int t = 0; t < M40LLM_MAX_TIERS; t++) {
      r.rows[t] = t < c->n_tiers ? o->tiers[t].rows : 0;
      r.map[t] = r.rows[t] > 0 ? m40llm_tier_map_at(c, t, layer, 0) : nullptr;
    }
    for (int i = 0; i < n; i++) {
      const int seq = seq_ids[first + i];
      r.seq[i] = seq;
      r.win_first[i] = m40llm_window_begin(c, layer, seq);
      r.win_n[i] = *m40llm_len_slot(c, layer, seq) - r.win_first[i];
      for (int t = 0; t < M40LLM_MAX_TIERS; t++)
        r.count[i][t] = t < c->n_tiers ? m40llm_tier_counts(c, layer, seq)[t] : 0;
      lo = seq < lo ? seq : lo;
      hi = seq > hi ? seq : hi;
    }
    tier_rank_kernel<<<dim3((unsigned)n, (unsigned)c->n_tiers + 1, (unsigned)chunks),
                       kRankThreads, 0, stream>>>(r);
    M40LLM_CUDA_CHECK_LAUNCH("tier_rank_kernel");
  }
  // One copy for the records of sequences lo..hi (the others in it are older records, which
  // the host has read or will read the same), on the copy stream.
  const size_t off = (layer_seqs + (size_t)lo) * c->imp_record_bytes;
  M40LLM_CUDA_TRY(cudaEventRecord(ps->ranked, stream));
  M40LLM_CUDA_TRY(cudaStreamWaitEvent(ps->copy, ps->ranked, 0));
  M40LLM_CUDA_TRY(cudaMemcpyAsync(static_cast<char *>(c->imp_records) + off,
                                  static_cast<const char *>(c->imp_rank) + off,
                                  (size_t)(hi - lo + 1) * c->imp_record_bytes,
                                  cudaMemcpyDeviceToHost, ps->copy));
  M40LLM_CUDA_TRY(cudaEventRecord(ps->landed[layer], ps->copy));
  return M40LLM_OK;
}

int m40llm_cuda_tier_rank_wait(const m40llm_kvcache *c, int layer) {
  M40LLM_CUDA_ENTER(c->ctx);
  M40LLM_CUDA_TRY(
      cudaEventSynchronize(static_cast<PolicyState *>(c->imp_backend)->landed[layer]));
  return M40LLM_OK;
}
