// Decode attention from the host: picks a kernel family and its pass for the cache, plans the
// splits, and launches the split kernel and, where a sequence has several splits, the combine.
// The families size their own launches (attention_fp32.cu, attention_mma.cu,
// attention_combine.cu); the workspace for the partials is the context's (backend.cu).
#include "attention.cuh"
#include "backend_cuda.h"
#include "io_rows.cuh"

namespace {

// The tensor-core family's passes (scores: the instances that export them) where this build has
// the family (M40LLM_TENSOR_CORES) and it runs on this GPU; otherwise p->pass.kernel is null.
template <typename P>
int tensor_core_passes(m40llm_cuda_state *st, int head_dim, bool scores, SplitPasses *p) {
  *p = SplitPasses{};
  if (!kTensorCores) return M40LLM_OK;
  return scores ? mma_split_scores_passes<P>(st, head_dim, p)
                : mma_split_passes<P>(st, head_dim, p);
}

// The split passes for a cache: the tensor-core family where this build and GPU have it (MHA
// too: it issues fewer instructions per K/V byte even with one query head), else the FP32 one
// for all three; scores: a call with weights, whose kernels export them.
template <typename P>
int split_passes_for(m40llm_cuda_state *st, const m40llm_kvcache_options *o, const Grouping &g,
                     bool scores, SplitPasses *p) {
  *p = SplitPasses{};
  int rc = tensor_core_passes<P>(st, o->head_dim, scores, p);
  if (rc != M40LLM_OK || p->pass.kernel) return rc;
  rc = fp32_split_pass<P>(st, o->head_dim, g, scores, &p->pass);
  p->direct = p->fine = p->pass;
  return rc;
}

// One launch's worth of sequences (at most M40LLM_PLAN_MAX_ITEMS: the plan is a kernel argument),
// `rows` query rows each (attend_rows).
// x: what the call does besides its output, for its first item (CallExport).
template <typename P>
int attend(const m40llm_kvcache *c, int layer, const int32_t *seq_ids, const int32_t *lens,
           int n_seqs, int rows, int window, const float *q, float *out, float scale,
           const CallExport &x) {
  float *const weights = x.weights;
  m40llm_cuda_state *st = cuda_state(c->ctx);
  const m40llm_kvcache_options *o = &c->opts;
  Grouping g = grouping_for(o);
  const int n_heads = rows * o->n_heads;  // an item's query heads, row by row
  const bool causal = rows > 1 || window > 0;
  if (causal) {  // K/V head h's rows (row, head) in tiles of the kernel's 8
    g.gt = kMaxGroupTile;
    g.head_tiles = (rows * g.group + kMaxGroupTile - 1) / kMaxGroupTile;
    g.units = o->n_kv_heads * g.head_tiles;
  }

  // Everything asked of the runtime is asked before the first launch, so a failed query never
  // follows a queued kernel.
  SplitPasses passes;
  bool combine_dependent = false;
  int rc = causal ? mma_causal_passes<P>(st, o->head_dim, &passes)
                  : split_passes_for<P>(st, o, g, weights != nullptr, &passes);
  if (rc != M40LLM_OK || (rc = combine_prepare(st, &combine_dependent)) != M40LLM_OK) return rc;
  m40llm_attn_plan plan;
  SplitPass pass = plan_split_pass(st, passes, g, seq_ids, lens, n_seqs, &plan);
  // Causal rows' partials take rows times a decode call's: fewer splits where the workspace
  // reserved at creation would not hold them (the call never allocates).
  while (causal && plan.max_splits > 1 &&
         attn_partial_bytes(plan.total_splits, n_heads, o->head_dim) > st->workspace_bytes) {
    for (SplitPass *sp : {&passes.pass, &passes.direct, &passes.fine, &passes.broad}) {
      sp->target /= 2;
      sp->fill /= 2;
    }
    pass = plan_split_pass(st, passes, g, seq_ids, lens, n_seqs, &plan);
  }
  // Protected tokens: a pass that reads the kept rows itself takes them in the same splits
  // (M40LLM_PLAN_MIXED: the tensor-core kernels, and the FP32 kernel's lean instances without
  // scores where the splits are long, kFp32MixedMinRows). Otherwise they get splits of their
  // own: in the same launch where the FP32 kernel runs them (M40LLM_PLAN_PARTS), else read by
  // the FP32 kernel's F16 instance from the FP16 slots in a second launch over the same plan.
  SplitPass kept_pass{};
  size_t slot_row = 0;
  if (c->slots > 0) {
    slot_row = m40llm_kv_protected_row(o, c->slots, layer, 0, 0, 0) * o->head_dim;
    int32_t window_begin[M40LLM_PLAN_MAX_ITEMS];
    // A causal item that ends before the window (a prompt's piece but the last) sees none of
    // it: its window starts at its end, its positions before it all codes.
    for (int i = 0; i < n_seqs; i++) {
      const int32_t wb = m40llm_window_begin(c, layer, seq_ids[i]);
      window_begin[i] = wb < lens[i] ? wb : lens[i];
    }
    plan.kept_k = c->k.fp16 + slot_row;
    plan.kept_v = c->v.fp16 + slot_row;
    if (pass.mixed && (!pass.parts || plan.chunk >= kFp32MixedMinRows)) {
      m40llm_attn_plan_mixed(&plan, window_begin, c->n_sinks, c->window);
    } else if (pass.parts) {
      m40llm_attn_plan_protect(&plan, window_begin, c->n_sinks, c->window, kept_chunk(pass.tile));
      plan.role = M40LLM_PLAN_PARTS;
    } else {
      rc = fp32_split_pass<KvPair<KvF16, KvF16>>(st, o->head_dim, g, weights != nullptr,
                                                 &kept_pass);
      if (rc != M40LLM_OK) return rc;
      m40llm_attn_plan_protect(&plan, window_begin, c->n_sinks, c->window,
                               kept_chunk(kept_pass.tile));
    }
  }

  AttnArgs a;
  const size_t layer_row = m40llm_kv_row(o, layer, 0, 0, 0);
  a.k = kv_planes_at(c->k, layer_row);
  a.v = kv_planes_at(c->v, layer_row);
  a.q = q;
  a.out = out;
  a.part_o = a.part_m = a.part_l = nullptr;
  plan.weights = weights;
  plan.weights_stride = (int64_t)x.weights_stride;
  plan.append_k = x.append_k;
  plan.append_v = x.append_v;
  plan.append_dtype = x.append_dtype;
  plan.causal_window = window;
  if (plan.max_splits > 1 || weights) {
    void *ws = nullptr;
    rc = m40llm_cuda_workspace(st, attn_partial_bytes(plan.total_splits, n_heads, o->head_dim),
                               &ws);
    if (rc != M40LLM_OK) return rc;
    const size_t n_part = (size_t)plan.total_splits * n_heads;
    a.part_o = static_cast<float *>(ws);
    a.part_m = a.part_o + n_part * o->head_dim;
    a.part_l = a.part_m + n_part;
  }
  a.seq_stride = (size_t)o->n_kv_heads * o->max_seq_len * o->head_dim;
  a.head_stride = (size_t)o->max_seq_len * o->head_dim;
  a.n_heads = n_heads;
  a.group = g.group;
  a.head_dim = o->head_dim;
  a.q_scale = scale * kLog2e;
  a.stages = pass.stages;
  a.rot_k = c->k.rotated;
  a.rot_v = c->v.rotated;
  a.rot_scale = m40llm_rotation_scale(m40llm_rotation_block(o->head_dim));

  const dim3 grid = split_grid(plan.total_splits, g);
  if (c->slots > 0 && !pass.mixed && !pass.parts) {
    // The kept rows first: most of this grid's blocks return at once, and the codes' grid, its
    // dependent, launches as they do.
    AttnArgs kept = a;  // this layer's FP16 slots, [seq][kv_head][slot][dim]
    kept.k = KvPlanes{{c->k.fp16 + slot_row, nullptr}};
    kept.v = KvPlanes{{c->v.fp16 + slot_row, nullptr}};
    kept.head_stride = (size_t)c->slots * o->head_dim;
    kept.seq_stride = (size_t)o->n_kv_heads * kept.head_stride;
    plan.role = M40LLM_PLAN_KEPT;
    rc = launch_attention_kernel(st->stream, "launching the attention split kernel (kept rows)",
                                 kept_pass.kernel, grid, kept_pass.threads, kept_pass.smem,
                                 kept_pass.dependent, kept, plan);
    if (rc != M40LLM_OK) return rc;
    plan.role = M40LLM_PLAN_CODES;
  }
  rc = launch_attention_kernel(st->stream, "launching the attention split kernel", pass.kernel,
                               grid, pass.threads, pass.smem, pass.dependent, a, plan);
  if (rc != M40LLM_OK) return rc;
  if (plan.max_splits > 1 && (rc = combine_launch(st, a, plan, combine_dependent)) != M40LLM_OK)
    return rc;
  return weights ? weights_launch(st, a, plan, x.imp) : M40LLM_OK;
}

}  // namespace

template <typename P>
int attend_rows(const m40llm_kvcache *c, int layer, const int32_t *seq_ids, const int32_t *lens,
                int n, int rows, int window, const float *q, float *out, float scale) {
  return attend<P>(c, layer, seq_ids, lens, n, rows, window, q, out, scale,
                   CallExport{nullptr, 0, {nullptr, 0, 0.0f}, c->opts.n_heads,
                              c->opts.n_kv_heads});
}

#define M40LLM_INSTANTIATE(P)                                                                  \
  template int attend_rows<P>(const m40llm_kvcache *, int, const int32_t *, const int32_t *, \
                              int, int, int, const float *, float *, float);
M40LLM_KV_PAIRS(M40LLM_INSTANTIATE)
#undef M40LLM_INSTANTIATE

int m40llm_cuda_reserve_for(m40llm_kvcache *c) {
  M40LLM_CUDA_ENTER(c->ctx);
  const m40llm_kvcache_options *o = &c->opts;
  if (c->n_tiers > 0) return m40llm_cuda_tier_reserve(c);
  const Grouping g = grouping_for(o);
  return with_kv_pair(c->k.layout.fmt->format, c->v.layout.fmt->format, [&](auto pair) -> int {
    using P = decltype(pair);
    SplitPasses p, scored;
    int rc = split_passes_for<P>(cuda_state(c->ctx), o, g, false, &p);
    if (rc != M40LLM_OK ||
        (rc = split_passes_for<P>(cuda_state(c->ctx), o, g, true, &scored)) != M40LLM_OK)
      return rc;
    // The bound attention_plan.h promises, for any pass's plans (a call with weights: its
    // passes').
    int target = 0;
    for (const SplitPasses *s : {&p, &scored})
      for (const SplitPass *sp : {&s->pass, &s->direct, &s->fine, &s->broad})
        target = sp->target > target ? sp->target : target;
    int max_splits = 3 * ((target + g.units - 1) / g.units) + 1;
    // A call with weights keeps every split's partial, a lone split's too: a launch's items.
    if (max_splits < M40LLM_PLAN_MAX_ITEMS) max_splits = M40LLM_PLAN_MAX_ITEMS;
    if (c->slots > 0)  // m40llm_attn_plan_protect's, for the smallest tile any pass has
      max_splits += M40LLM_PLAN_MAX_ITEMS *
                    m40llm_attn_protect_extra(c->n_sinks, c->window, kept_chunk(1));
    void *ws = nullptr;
    return m40llm_cuda_workspace(cuda_state(c->ctx),
                                 attn_partial_bytes(max_splits, o->n_heads, o->head_dim), &ws);
  });
}

int m40llm_cuda_tensor_cores(m40llm_cuda_state *st, int *out) {
  // Every head_dim the family serves is compiled for the same architectures: one answers for all.
  SplitPasses p;
  const int rc = tensor_core_passes<KvPair<KvF16, KvF16>>(st, 128, false, &p);
  if (rc == M40LLM_OK) *out = p.pass.kernel != nullptr;
  return rc;
}

// The scratch an importance or observe call's scores take: a launch's items at a time (launches
// on one stream run in order, so each reuses it), rows as long as the batch's longest, and after
// them an observe call's softmax state a query head.
static int stage_scores(const m40llm_kvcache *c, int n_seqs, size_t longest, bool observe,
                        float **weights, float2 **states) {
  const int items = n_seqs < M40LLM_PLAN_MAX_ITEMS ? n_seqs : M40LLM_PLAN_MAX_ITEMS;
  const size_t heads = (size_t)items * c->opts.n_heads;
  return scores_stage(cuda_state(c->ctx), heads * longest, observe ? heads : 0, weights, states);
}

int m40llm_cuda_prepare_observe(const m40llm_kvcache *c, int n_seqs, int longest) {
  float *weights = nullptr;
  float2 *states = nullptr;
  return stage_scores(c, n_seqs, longest > 1 ? (size_t)longest : 1, true, &weights, &states);
}

int m40llm_cuda_attention(const m40llm_kvcache *c, int layer, const int32_t *seq_ids,
                          int n_seqs, const void *q, void *out, int dtype, float scale,
                          const m40llm_attn_export *x) {
  M40LLM_CUDA_ENTER(c->ctx);
  const m40llm_kvcache_options *o = &c->opts;
  const size_t row = (size_t)o->n_heads * (size_t)o->head_dim;
  CallExport ex{x ? x->weights : nullptr, x ? x->weights_stride : 0, {nullptr, 0, 0.0f},
                o->n_heads, o->n_kv_heads};
  if (x && (x->importance || x->observe)) {
    size_t longest = 1;
    for (int i = 0; i < n_seqs; i++) {
      const size_t len = (size_t)*m40llm_len_slot(c, layer, seq_ids[i]);
      longest = len > longest ? len : longest;
    }
    float2 *states = nullptr;
    const int rc = stage_scores(c, n_seqs, longest, x->observe, &ex.weights, &states);
    if (rc != M40LLM_OK) return rc;
    ex.weights_stride = longest;
    if (x->observe) {
      ex.imp.acc = c->imp_acc + (size_t)layer * (size_t)o->max_seqs * (size_t)o->max_seq_len;
      ex.imp.acc_stride = o->max_seq_len;
    } else {
      ex.imp = ImportanceArgs{x->importance, (int64_t)x->importance_stride, x->decay};
    }
    ex.imp.states = states;
  }
  if (x && x->append_k) {  // attention_appends: an F16 cache, never tiered
    ex.append_k = static_cast<const char *>(x->append_k);
    ex.append_v = static_cast<const char *>(x->append_v);
    ex.append_dtype = dtype;
    ex.append_row_bytes = (size_t)o->n_kv_heads * o->head_dim * m40llm_dtype_size(dtype);
  }
  if (c->n_tiers > 0)
    return with_f32_rows(cuda_state(c->ctx), q, out, (size_t)n_seqs * row, dtype,
                         [&](const float *q32, float *out32) {
                           return tier_attention(c, layer, seq_ids, nullptr, n_seqs, q32, out32,
                                                 scale, ex);
                         });
  return with_f32_rows(cuda_state(c->ctx), q, out, (size_t)n_seqs * row, dtype,
                       [&](const float *q32, float *out32) {
    return with_kv_pair(c->k.layout.fmt->format, c->v.layout.fmt->format, [&](auto pair) -> int {
      using P = decltype(pair);
      for (int first = 0; first < n_seqs; first += M40LLM_PLAN_MAX_ITEMS) {
        const int n =
            n_seqs - first < M40LLM_PLAN_MAX_ITEMS ? n_seqs - first : M40LLM_PLAN_MAX_ITEMS;
        int32_t lens[M40LLM_PLAN_MAX_ITEMS];
        for (int i = 0; i < n; i++) lens[i] = *m40llm_len_slot(c, layer, seq_ids[first + i]);
        const int rc = attend<P>(c, layer, seq_ids + first, lens, n, 1, 0,
                                 q32 + (size_t)first * row, out32 + (size_t)first * row, scale,
                                 ex.at(first));
        if (rc != M40LLM_OK) return rc;
      }
      return M40LLM_OK;
    });
  });
}
