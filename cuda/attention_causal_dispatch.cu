// Causal attention from the host. On tensor cores (sm_80+): an FP16 cache's prompts (items of
// kCausalPrefillMinRows rows or more, or of a block's rows on a prefix of
// kCausalPrefillLongPrefix) through the prefill kernel (attention_causal_mma.cu);
// other items whose sliding windows leave out at most kCausalMmaMaxUnseen of their positions
// through the decode call's planner and combine over the items' rows packed into the split
// kernel's tiles (causal_on_tensor_cores, attend_rows). Otherwise the FP32 causal kernel
// (attention_causal_fp32.cu). The prefill and FP32 kernels share a launcher: it cuts a call's
// items into launches of kCausalMaxItems, plans each (blocks per item, splits along positions
// where the blocks alone would not fill the GPU) and launches the kernel and, for split plans,
// the decode call's combine (attention_combine.cu), one query row per combine item.
#include "attention_causal.cuh"
#include "io_rows.cuh"
#include "backend_cuda.h"

#include <type_traits>

namespace {

// Splits per (item, row tile) for a launch of `rows` query rows in `blocks` unsplit blocks whose
// longest item sees `longest` positions: enough to fill the GPU, none shorter than
// kCausalMinSplitRows, as many as the workspace reserved at cache creation holds (a call never
// allocates), and only where the combine can take every row as an item.
int causal_splits(const m40llm_cuda_state *st, const CausalPass &pass, long long blocks, int rows,
                  int longest, int n_heads, int head_dim) {
  if (rows > M40LLM_PLAN_MAX_ITEMS || blocks >= pass.target) return 1;
  long long s = (pass.target + blocks - 1) / blocks;
  const long long by_len = (longest + kCausalMinSplitRows - 1) / kCausalMinSplitRows;
  if (s > by_len) s = by_len;
  const long long room = (long long)(st->workspace_bytes / attn_partial_bytes(rows, n_heads, head_dim));
  if (s > room) s = room;
  return s > 1 ? (int)s : 1;
}

// One launch of a causal kernel's pass (the FP32 kernels', or the tensor-core prefill kernel's)
// over up to kCausalMaxItems items, and its combine where the plan splits.
int causal_launch(const m40llm_kvcache *c, int layer, const m40llm_append_item *items, int n,
                  const float *q, float *out, float scale, int window, const CausalPass &pass) {
  m40llm_cuda_state *st = cuda_state(c->ctx);
  const m40llm_kvcache_options *o = &c->opts;
  const Grouping g = grouping_for(o);
  bool combine_dependent = false;
  int rc = combine_prepare(st, &combine_dependent);
  if (rc != M40LLM_OK) return rc;

  CausalPlan plan;
  plan.n_items = n;
  plan.window = window;
  plan.sinks = c->slots > 0 ? c->n_sinks : 0;
  plan.ring = c->slots > 0 ? c->window : 0;
  int rows = 0, longest = 0;
  long long blocks = 0;
  for (int i = 0; i < n; i++) {
    plan.seq[i] = items[i].seq;
    plan.pos[i] = items[i].pos;
    plan.rows[i] = items[i].n_tokens;
    plan.row_first[i] = rows;
    plan.window_begin[i] = c->slots > 0 ? m40llm_window_begin(c, layer, items[i].seq) : 0;
    const int begin = window > 0 && items[i].pos - window + 1 > 0 ? items[i].pos - window + 1 : 0;
    plan.chunk[i] = items[i].pos + items[i].n_tokens - begin;  // every position: one split
    if (plan.chunk[i] > longest) longest = plan.chunk[i];
    rows += items[i].n_tokens;
    blocks += (long long)((items[i].n_tokens + pass.rows - 1) / pass.rows) * g.units;
  }
  plan.splits = causal_splits(st, pass, blocks, rows, longest, o->n_heads, o->head_dim);
  plan.block_begin[0] = 0;
  for (int i = 0; i < n; i++) {
    if (plan.splits > 1) {  // even cuts of the item's positions, whole tiles
      const int per = (plan.chunk[i] + plan.splits - 1) / plan.splits;
      plan.chunk[i] = (per + pass.tile - 1) / pass.tile * pass.tile;
    }
    plan.block_begin[i + 1] =
        plan.block_begin[i] + (plan.rows[i] + pass.rows - 1) / pass.rows * plan.splits;
  }

  CausalArgs a;
  const size_t layer_row = m40llm_kv_row(o, layer, 0, 0, 0);
  a.k = kv_planes_at(c->k, layer_row);
  a.v = kv_planes_at(c->v, layer_row);
  const size_t slot_row = m40llm_kv_protected_row(o, c->slots, layer, 0, 0, 0) * o->head_dim;
  a.kept_k = c->slots > 0 && c->k.fp16 ? reinterpret_cast<const __half *>(c->k.fp16 + slot_row) : nullptr;
  a.kept_v = c->slots > 0 && c->v.fp16 ? reinterpret_cast<const __half *>(c->v.fp16 + slot_row) : nullptr;
  a.q = q;
  a.out = out;
  a.part_o = a.part_m = a.part_l = nullptr;
  if (plan.splits > 1) {
    void *ws = nullptr;
    rc = m40llm_cuda_workspace(st, attn_partial_bytes(rows * plan.splits, o->n_heads, o->head_dim),
                               &ws);
    if (rc != M40LLM_OK) return rc;
    const size_t n_part = (size_t)rows * plan.splits * o->n_heads;
    a.part_o = static_cast<float *>(ws);
    a.part_m = a.part_o + n_part * o->head_dim;
    a.part_l = a.part_m + n_part;
  }
  a.head_stride = (size_t)o->max_seq_len * o->head_dim;
  a.seq_stride = (size_t)o->n_kv_heads * a.head_stride;
  a.slot_head_stride = (size_t)c->slots * o->head_dim;
  a.slot_seq_stride = (size_t)o->n_kv_heads * a.slot_head_stride;
  a.n_heads = o->n_heads;
  a.group = g.group;
  a.head_tiles = g.head_tiles;
  a.head_dim = o->head_dim;
  a.q_scale = scale * kLog2e;
  a.rot_scale = m40llm_rotation_scale(m40llm_rotation_block(o->head_dim));
  a.rot_k = c->k.rotated;
  a.rot_v = c->v.rotated;

  const dim3 grid((unsigned)plan.block_begin[n], (unsigned)g.units);
  pass.kernel<<<grid, pass.threads, pass.smem, st->stream>>>(a, plan);
  M40LLM_CUDA_CHECK_LAUNCH("the causal attention kernel");
  if (plan.splits == 1) return M40LLM_OK;

  // The combine, a query row an item: row j's partials are rows j * splits .. + splits - 1.
  m40llm_attn_plan cplan{};
  cplan.n_items = rows;
  cplan.max_splits = plan.splits;
  cplan.total_splits = rows * plan.splits;
  cplan.chunk = 0;
  for (int j = 0; j <= rows; j++) cplan.split_begin[j] = j * plan.splits;
  AttnArgs ca{};
  ca.out = out;
  ca.part_o = a.part_o;
  ca.part_m = a.part_m;
  ca.part_l = a.part_l;
  ca.n_heads = o->n_heads;
  ca.head_dim = o->head_dim;
  return combine_launch(st, ca, cplan, combine_dependent);
}

// Causal rows on tensor cores (sm_80+; a window masks): each item's rows in pieces of at
// most kCausalMmaMaxRows, fewer where the grids need (a piece is an item of its own: the rows
// before it are in the cache), a run of consecutive pieces of one row count (contiguous in q
// and out) in launches of up to M40LLM_PLAN_MAX_ITEMS (attend_rows: the decode call's plan,
// passes and combine). A batch of equal counts is one launch; a ragged one, a launch per change
// of count. One-row pieces without a window are the decode call's.
template <typename P>
int causal_on_tensor_cores(const m40llm_kvcache *c, int layer, const m40llm_append_item *items,
                           int n_items, const float *q, float *out, float scale, int window) {
  const size_t row = (size_t)c->opts.n_heads * (size_t)c->opts.head_dim;
  // The combine's grid takes an item's rows x heads along y (at most 65535).
  const int by_grid = 65535 / c->opts.n_heads > 1 ? 65535 / c->opts.n_heads : 1;
  const int most = kCausalMmaMaxRows < by_grid ? kCausalMmaMaxRows : by_grid;
  int32_t ids[M40LLM_PLAN_MAX_ITEMS], lens[M40LLM_PLAN_MAX_ITEMS];
  int n = 0, rows = 0;
  size_t first = 0;  // the run's first row
  const auto flush = [&]() {
    const int rc = n > 0 ? attend_rows<P>(c, layer, ids, lens, n, rows, window,
                                          q + first * row, out + first * row, scale)
                         : M40LLM_OK;
    first += (size_t)n * rows;
    n = 0;
    return rc;
  };
  for (int i = 0; i < n_items; i++) {
    for (int r0 = 0; r0 < items[i].n_tokens; r0 += most) {
      const int piece = items[i].n_tokens - r0 < most ? items[i].n_tokens - r0 : most;
      if (n == M40LLM_PLAN_MAX_ITEMS || (n > 0 && piece != rows)) {
        const int rc = flush();
        if (rc != M40LLM_OK) return rc;
      }
      rows = piece;
      ids[n] = items[i].seq;
      lens[n++] = items[i].pos + r0 + piece;
    }
  }
  return flush();
}

}  // namespace

int m40llm_cuda_attention_causal(const m40llm_kvcache *c, int layer,
                                 const m40llm_append_item *items, int n_items, const void *q,
                                 void *out, int dtype, float scale, int window) {
  M40LLM_CUDA_ENTER(c->ctx);
  if (c->n_tiers > 0 && window > 0)
    return m40llm_fail(M40LLM_ERR_UNSUPPORTED,
                       "causal attention over a tiered cache with a sliding window (%d): the CPU "
                       "backend only in this version",
                       window);
  const size_t row = (size_t)c->opts.n_heads * (size_t)c->opts.head_dim;
  size_t rows = 0;
  for (int i = 0; i < n_items; i++) rows += (size_t)items[i].n_tokens;
  return with_f32_rows(cuda_state(c->ctx), q, out, rows * row, dtype,
                       [&](const float *q32, float *out32) {
    if (c->n_tiers > 0) return tier_attention_causal(c, layer, items, n_items, q32, out32, scale);
    return with_kv_pair(c->k.layout.fmt->format, c->v.layout.fmt->format, [&](auto pair) -> int {
      using P = decltype(pair);
      m40llm_cuda_state *st = cuda_state(c->ctx);
      const int gt = grouping_for(&c->opts).gt;
      SplitPasses mma;
      CausalPass fp32, few, prefill{};
      int rc = mma_causal_passes<P>(st, c->opts.head_dim, &mma);
      if (rc == M40LLM_OK) rc = causal_fp32_pass<P>(st, c->opts.head_dim, gt, false, &fp32);
      if (rc == M40LLM_OK) rc = causal_fp32_pass<P>(st, c->opts.head_dim, gt, true, &few);
      if (rc == M40LLM_OK && std::is_same<P, KvPair<KvF16, KvF16>>::value && !c->k.rotated &&
          !c->v.rotated && c->slots == 0)
        rc = causal_mma_pass(st, c->opts.head_dim, gt, &prefill);
      if (rc != M40LLM_OK) return rc;
      // Items in runs of one road, in order. Prompts (kCausalPrefillMinRows rows or more), and
      // rows that fill a prefill block on a long prefix (kCausalPrefillLongPrefix), take the
      // tensor-core prefill kernel where there is one. Otherwise the tensor cores' decode
      // tiles read every position before an item's last row (a window masks them), so an item
      // whose windows leave out more than kCausalMmaMaxUnseen of them takes the FP32 kernel,
      // which reads only what its rows see: a launch whose every item's query vectors fit a
      // block of the pass for few rows (`few`, causal_fp32_pass) takes that pass (a run's
      // launches stay what they are whatever its items' rows).
      enum Road { kPrefill, kDecodeTiles, kFp32 };
      const auto road = [&](const m40llm_append_item &it) {
        if (prefill.kernel && (it.n_tokens >= kCausalPrefillMinRows ||
                               (it.n_tokens >= prefill.rows && it.pos >= kCausalPrefillLongPrefix)))
          return kPrefill;
        const long long begin = window > 0 && it.pos - window + 1 > 0 ? it.pos - window + 1 : 0;
        return mma.pass.kernel && begin <= kCausalMmaMaxUnseen * (it.pos + it.n_tokens)
                   ? kDecodeTiles
                   : kFp32;
      };
      size_t done = 0;  // rows of the runs before
      for (int first = 0, end; first < n_items; first = end) {
        const Road r = road(items[first]);
        for (end = first + 1; end < n_items && road(items[end]) == r; end++) {
        }
        size_t run_rows = 0;
        for (int i = first; i < end; i++) run_rows += (size_t)items[i].n_tokens;
        if (r == kDecodeTiles) {
          rc = causal_on_tensor_cores<P>(c, layer, items + first, end - first, q32 + done * row,
                                         out32 + done * row, scale, window);
        } else {
          size_t at = done;
          for (int i = first; rc == M40LLM_OK && i < end; i += kCausalMaxItems) {
            const int n = end - i < kCausalMaxItems ? end - i : kCausalMaxItems;
            bool fits_few = r == kFp32 && few.kernel != fp32.kernel;
            for (int j = i; fits_few && j < i + n; j++) fits_few = items[j].n_tokens <= few.rows;
            rc = causal_launch(c, layer, items + i, n, q32 + at * row, out32 + at * row, scale,
                               window, r == kPrefill ? prefill : fits_few ? few : fp32);
            for (int j = i; j < i + n; j++) at += (size_t)items[j].n_tokens;
          }
        }
        if (rc != M40LLM_OK) return rc;
        done += run_rows;
      }
      return M40LLM_OK;
    });
  });
}
