// Decode attention over a tiered cache (m40llm_kvcache_options.n_tiers > 0). Each tier is a
// uniform cache of its own formats whose rows, in any order (softmax does not care), fill slots
// 0 .. count - 1 of its planes, so the split kernels run it as a uniform cache's: a launch per
// tier that holds rows of the call's items, of the kernel for the tier's pair (on sm_80+ the
// tensor-core kernel's tier instances, attention_mma_tiers.cu; else the FP32 kernel), over a
// plan of M40LLM_PLAN_TIER (each item's rows of that tier), and the FP16 slots' kept parts in
// the first such tier's launch where its kernel runs them (else in an F16 launch of their own).
// Every split writes a partial, numbered so that each item's partials of all launches lie
// together, and the one combine of the uniform caches merges them. The launches overlap, each
// planned for its share of the call's rows: together they fill the GPU as one launch would,
// without a launch's ramp and tail per tier. Where every
// launch is a tensor-core kernel that waits as a programmatic dependent (sm_90), they are
// chained on the context's stream (m40llm_attn_plan::chained: a launch's blocks start as the
// one before it has started all of its own, and the combine follows as a dependent); elsewhere
// they run side by side on streams forked from it (m40llm_cuda_state::side). A short call runs
// them as one launch of the kernel of every pair (attn_mma_tiers_kernel, whose parameters carry
// every plan: CUDA 12.1+ builds), where the launches' starts and tails would cost more than
// that kernel's slower steps (kTierOneLaunchRowsPerSm). A call that exports weights or importance
// (an observe call too) makes the same launches, whose kernels write each score at its
// position, a tier's rows at the positions of the tier's slot map (m40llm_kvcache.tier_map,
// kept by the row ops): the tensor-core tier kernels' instances with scores where they run
// (with the FP32 kernels' an observe call took 1.95-3.1x the plain call's time on an H200, now
// 1.6-2.3x), else the FP32 kernels' instances with scores; the uniform caches' weights kernel
// reads them over the call's partials. A causal call (limits) runs the FP32 instances with
// scores, which mask a tier's rows by their positions.
#include "attention.cuh"
#include "backend_cuda.h"

namespace {

constexpr int kMaxLaunches = M40LLM_MAX_TIERS + 1;  // the tiers and, at most, the kept parts

// What the launches of a call have in common; each sets its tensors.
AttnArgs common_args(const m40llm_kvcache *c, float scale) {
  const m40llm_kvcache_options *o = &c->opts;
  const Grouping g = grouping_for(o);
  AttnArgs a{};
  a.n_heads = o->n_heads;
  a.group = g.group;
  a.head_dim = o->head_dim;
  a.q_scale = scale * kLog2e;
  a.rot_k = c->k.rotated;
  a.rot_v = c->v.rotated;
  a.rot_scale = m40llm_rotation_scale(m40llm_rotation_block(o->head_dim));
  return a;
}

// Rows of D elements in planes [seq][kv_head][row], `rows` a head.
void set_tensors(AttnArgs *a, KvPlanes k, KvPlanes v, size_t rows, const m40llm_kvcache_options *o) {
  a->k = k;
  a->v = v;
  a->head_stride = rows * o->head_dim;
  a->seq_stride = (size_t)o->n_kv_heads * a->head_stride;
}

// The blocks a tier's launch is planned for: its share of a launch's `target` by rows, since
// the launches run side by side or chained (at least an SM's worth: a launch of fewer leaves SMs
// idle where the others end first). Chained launches planned by their share of the bytes
// without the floor took 1.2-1.3x as long at B8 32/8 D128 L8K and B1 L32K on an H200.
// A chained launch (`chained`) takes a whole number of blocks an SM: its kernel is issue-bound,
// so where some SMs held two of its blocks and others one, the launch took as long as the SMs
// with two. Two tiers of 59% and 41% of the rows (what m40llm_kvcache_plan_tiers gives for 6
// bits), planned for 156 and 109 blocks of two an SM's 264, took 1.44x the time of 132 each at
// B1 32/8 D128 L32K, and 36% and 64% (5.5 bits) 1.08x at B8 L8K, on an H200.
int share_of_target(int target, int64_t rows, int64_t all_rows, int sm_count, bool chained) {
  if (all_rows <= 0) return target;
  const int64_t share = ((int64_t)target * rows + all_rows - 1) / all_rows;
  if (chained && sm_count > 0 && target >= sm_count) {
    const int64_t per_sm = (share + sm_count / 2) / sm_count;  // the nearest whole number
    return (int)(per_sm < 1 ? sm_count : per_sm * sm_count > target ? target : per_sm * sm_count);
  }
  return share < sm_count ? (sm_count < target ? sm_count : target) : (int)share;
}

// A tier's passes: the tensor-core family's where it has them (not for masked rows), else the
// FP32 family's, whose instances with scores where the call exports them or masks rows by
// their positions (masked). chainable: the tensor-core kernels as programmatic dependents,
// whose tier instances take m40llm_attn_plan::chained (null: not asked).
template <typename P>
int tier_passes(m40llm_cuda_state *st, int head_dim, const Grouping &g, bool scores, bool masked,
                SplitPasses *out, bool *chainable = nullptr) {
  *out = SplitPasses{};
  if (chainable) *chainable = false;
  if (kTensorCores && !masked) {
    const int rc = scores ? mma_tier_scores_passes<P>(st, head_dim, out)
                          : mma_tier_passes<P>(st, head_dim, out);
    if (chainable) *chainable = out->pass.kernel && out->pass.dependent && out->pass.mixed;
    if (rc != M40LLM_OK || out->pass.kernel) return rc;
  }
  const int rc = fp32_split_pass<P>(st, head_dim, g, scores || masked, &out->pass);
  out->pass.mixed = false;  // a tier launch's kept rows lead its items only on tensor cores
  out->direct = out->fine = out->pass;
  return rc;
}

// A call's launches for up to M40LLM_PLAN_MAX_ITEMS sequences, planned before any is made.
struct TierCall {
  int n = 0;
  bool chain = true;  // every launch chained after the first on the stream, not side by side
  bool one = false;   // every launch in one (MmaTierLaunch): the blocks of one pass
  int pair[kMaxLaunches];  // kv_pair_id of each launch's formats
  SplitPass pass[kMaxLaunches];
  AttnArgs args[kMaxLaunches];
  m40llm_attn_plan plan[kMaxLaunches];
  m40llm_attn_plan combine;
};

// The tier whose launch reads the FP16 slots: the first that holds rows of the items, or the
// first tier where none does. A tier none of the items has rows in makes no launch other than
// that: the tiers m40llm_kvcache_plan_tiers leaves empty each made a launch of the slots alone,
// and a decode step at B8 32/8 D128 L8K (32 layers) took 1.03-1.06x as long on an H200.
int lead_tier(const m40llm_kvcache *c, int layer, const int32_t *seq_ids, int n_items) {
  for (int t = 0; t < c->n_tiers; t++)
    for (int i = 0; i < n_items; i++)
      if (m40llm_tier_counts(c, layer, seq_ids[i])[t] > 0) return t;
  return 0;
}

// Whether a call's tiers run as one launch (*one) and its pass: where this build has the kernel
// of every pair at once (CUDA 12.1+, tensor cores; not for a call that exports scores or masks
// rows by position: `scores`), for a call of at least kTierOneLaunchMinLaunches launches and at
// most kTierOneLaunchRowsPerSm rows x units an SM; the pass a uniform cache's call over the same
// rows would take (kept_rows: each item's FP16 slot rows).
int one_launch_pass(const m40llm_kvcache *c, int layer, const int32_t *seq_ids, int n_items,
                    const int32_t *kept_rows, bool scores, bool *one, SplitPass *out) {
  *one = false;
#if M40LLM_MMA_ONE_LAUNCH
  if (!kMmaOneLaunch || scores || c->n_tiers < kTierOneLaunchMinLaunches) return M40LLM_OK;
  m40llm_cuda_state *st = cuda_state(c->ctx);
  const Grouping g = grouping_for(&c->opts);
  int32_t rows[M40LLM_PLAN_MAX_ITEMS];
  int64_t unit_rows = 0, tier_rows[M40LLM_MAX_TIERS] = {0};
  const int lead = lead_tier(c, layer, seq_ids, n_items);
  for (int i = 0; i < n_items; i++) {
    rows[i] = kept_rows[i];
    tier_rows[lead] += kept_rows[i];  // the lead tier's launch reads them
    for (int t = 0; t < c->n_tiers; t++) {
      const int32_t n = m40llm_tier_counts(c, layer, seq_ids[i])[t];
      rows[i] += n;
      tier_rows[t] += n;
    }
    unit_rows += (int64_t)rows[i] * g.units;
  }
  int live = 0;  // launches with rows
  for (int t = 0; t < c->n_tiers; t++) live += tier_rows[t] > 0;
  if (live < kTierOneLaunchMinLaunches ||
      unit_rows > (int64_t)kTierOneLaunchRowsPerSm * st->sm_count)
    return M40LLM_OK;
  SplitPasses passes;
  bool have = false;
  const int rc = mma_tiers_passes(st, c->opts.head_dim, &passes, &have);
  if (rc != M40LLM_OK || !have) return rc;
  m40llm_attn_plan plan;
  *out = plan_split_pass(st, passes, g, seq_ids, rows, n_items, &plan);
  *one = true;
#else
  (void)c, (void)layer, (void)seq_ids, (void)n_items, (void)kept_rows, (void)scores, (void)out;
#endif
  return M40LLM_OK;
}

// Plans the call over items seq_ids[0 .. n_items); scores: kernels that export them.
// limits: each item's visible positions (a causal call's query row: the positions before it and
// its own: the FP32 kernels, which mask a tier's rows by their positions), or null for every
// position of its sequence.
int plan_call(const m40llm_kvcache *c, int layer, const int32_t *seq_ids, const int32_t *limits,
              int n_items, float scale, bool scores, TierCall *call) {
  m40llm_cuda_state *st = cuda_state(c->ctx);
  const m40llm_kvcache_options *o = &c->opts;
  const Grouping g = grouping_for(o);
  int32_t full_len[M40LLM_PLAN_MAX_ITEMS], window_begin[M40LLM_PLAN_MAX_ITEMS];
  int32_t rows[M40LLM_PLAN_MAX_ITEMS], kept_rows[M40LLM_PLAN_MAX_ITEMS];
  int64_t all_rows = 0, all_kept = 0;
  for (int i = 0; i < n_items; i++) {
    full_len[i] = limits ? limits[i] : *m40llm_len_slot(c, layer, seq_ids[i]);
    window_begin[i] = m40llm_window_begin(c, layer, seq_ids[i]);
    if (window_begin[i] > full_len[i]) window_begin[i] = full_len[i];  // no window row visible
    const m40llm_attn_parts parts =
        m40llm_attn_item_parts(full_len[i], window_begin[i], c->n_sinks, c->window);
    kept_rows[i] = c->slots > 0 ? parts.count[0] + parts.count[1] + parts.count[2] : 0;
    all_kept += kept_rows[i];
    for (int t = 0; t < c->n_tiers; t++) all_rows += m40llm_tier_counts(c, layer, seq_ids[i])[t];
  }
  const size_t slot_row = m40llm_kv_protected_row(o, c->slots, layer, 0, 0, 0) * o->head_dim;
  const AttnArgs a = common_args(c, scale);
  bool kept_done = c->slots == 0;
  call->n = 0;
  // One launch (the kernel of every pair at once): its pass is the one a uniform cache's call
  // of the same rows would take, and each tier plans for its share of that pass's blocks.
  SplitPass one_pass{};
  const bool fp32_scores = scores || limits;  // the FP32 kernels' instances, where they run
  int rc = one_launch_pass(c, layer, seq_ids, n_items, kept_rows, fp32_scores, &call->one,
                           &one_pass);
  if (rc != M40LLM_OK) return rc;
  // The tiers that launch (with rows in the call, and the lead tier for the FP16 slots) and
  // their passes; the call is chained where every launch's kernel can be, decided before any
  // launch is planned (a chained launch's blocks are planned otherwise).
  const int lead_t = lead_tier(c, layer, seq_ids, n_items);
  bool launches[M40LLM_MAX_TIERS] = {false};
  SplitPasses tier_pass[M40LLM_MAX_TIERS];
  for (int t = 0; t < c->n_tiers; t++) {
    launches[t] = t == lead_t;
    for (int i = 0; i < n_items && !launches[t]; i++)
      launches[t] = m40llm_tier_counts(c, layer, seq_ids[i])[t] > 0;
    if (!launches[t]) continue;
    rc = with_tier_pair(o->tiers[t].k_format, o->tiers[t].v_format, [&](auto pair) -> int {
      bool chainable = false;
      const int rc = tier_passes<decltype(pair)>(st, o->head_dim, g, scores, limits != nullptr,
                                                 &tier_pass[t], &chainable);
      call->chain = call->chain && chainable;
      return rc;
    });
    if (rc != M40LLM_OK) return rc;
  }
  for (int t = 0; t < c->n_tiers; t++) {
    if (!launches[t]) continue;
    int64_t tier_rows = 0;
    for (int i = 0; i < n_items; i++) {
      rows[i] = m40llm_tier_counts(c, layer, seq_ids[i])[t];
      tier_rows += rows[i];
    }
    SplitPasses passes = tier_pass[t];
    // The tensor-core kernels (a tier's own, or every pair's in one launch) read the kept
    // rows as an item's first rows (no splits of their own), the FP32 kernel's lean ones in
    // splits of their own.
    const bool lead = !kept_done && (call->one || passes.pass.mixed);
    if (lead)
      for (int i = 0; i < n_items; i++) rows[i] += kept_rows[i];
    // Shares of the rows the tier launches take (the kept rows where they lead an item; in
    // splits of their own or a launch of their own they are no launch's share).
    // A small launch plans one block an SM at least (not its kernel's fill: it shares the GPU).
    for (SplitPass *sp : {&passes.pass, &passes.direct, &passes.fine}) {
      sp->target = share_of_target(sp->target, tier_rows + (lead ? all_kept : 0),
                                   all_rows + (passes.pass.mixed ? all_kept : 0), st->sm_count,
                                   call->chain);
      sp->fill = 0;
    }
    if (!kept_done && !lead && !passes.pass.parts) {  // the kept parts in an F16 launch
      int32_t none[M40LLM_PLAN_MAX_ITEMS] = {0};
      SplitPass *kept = &call->pass[call->n];
      if ((rc = fp32_split_pass<KvPair<KvF16, KvF16>>(st, o->head_dim, g, fp32_scores, kept)) !=
          M40LLM_OK)
        return rc;
      m40llm_attn_plan *p = &call->plan[call->n];
      m40llm_attn_plan_build(p, seq_ids, none, n_items, g.units, kept->target, st->sm_count, 1,
                             kept->tile);
      p->kept_k = c->k.fp16 + slot_row;  // the kernel reads them as its tensors
      p->kept_v = c->v.fp16 + slot_row;
      m40llm_attn_plan_tier(p, full_len, window_begin, c->n_sinks, c->window,
                            kept_chunk(kept->tile));
      call->args[call->n] = a;
      set_tensors(&call->args[call->n], KvPlanes{{c->k.fp16 + slot_row, nullptr}},
                  KvPlanes{{c->v.fp16 + slot_row, nullptr}}, c->slots, o);
      call->n++;
      kept_done = true;
    }
    m40llm_attn_plan *p = &call->plan[call->n];
    SplitPass pass =
        call->one ? one_pass : plan_split_pass(st, passes, g, seq_ids, rows, n_items, p);
    if (call->one) {  // a share of the pass's blocks, and of the smallest plan's (the SMs)
      const int64_t mine = tier_rows + (lead ? all_kept : 0), all = all_rows + all_kept;
      const auto share = [&](int64_t blocks) {
        return all > 0 ? (int)((blocks * mine + all - 1) / all) : 1;
      };
      m40llm_attn_plan_build(p, seq_ids, rows, n_items, g.units, share(pass.target),
                             share(st->sm_count), split_min_chunk(g, pass.tile), pass.tile);
    }
    const bool with_kept = !kept_done;  // this launch's kernel reads the FP16 slots
    p->kept_k = with_kept ? c->k.fp16 + slot_row : nullptr;
    p->kept_v = with_kept ? c->v.fp16 + slot_row : nullptr;
    m40llm_attn_plan_tier(p, full_len, window_begin, c->n_sinks, c->window,
                          with_kept && !lead ? kept_chunk(pass.tile) : 0);
    p->map = m40llm_tier_map_at(c, t, layer, 0);
    p->map_stride = o->tiers[t].rows;
    kept_done = true;
    call->pair[call->n] = kv_pair_id(o->tiers[t].k_format, o->tiers[t].v_format);
    call->pass[call->n] = pass;
    call->args[call->n] = a;
    set_tensors(&call->args[call->n],
                kv_planes_at(c->tier_k[t], m40llm_tier_row(c, t, layer, 0, 0, 0)),
                kv_planes_at(c->tier_v[t], m40llm_tier_row(c, t, layer, 0, 0, 0)),
                o->tiers[t].rows, o);
    call->n++;
  }
  m40llm_attn_plan_tier_number(call->plan, call->n, &call->combine);
  return M40LLM_OK;
}

#if M40LLM_MMA_ONE_LAUNCH
// A call's launches as one (TierCall::one), each launch's blocks after the ones before it in
// grid y, on the context's stream; a: the call's q, out and partials.
int launch_one(m40llm_cuda_state *st, const m40llm_kvcache_options *o, const TierCall &call,
               const AttnArgs &a) {
  MmaTierLaunch l{};
  int y = 0;
  for (int k = 0; k < call.n; k++) {
    if (call.plan[k].total_splits == 0) continue;
    // The call's splits are near its pass's target (kTierOneLaunchRowsPerSm): far from either.
    if (l.n == M40LLM_MAX_TIERS || y > M40LLM_PLAN_MAX_SPLITS - call.plan[k].total_splits)
      return m40llm_fail(M40LLM_ERR_UNSUPPORTED, "a tiered call of %d launches and %d splits",
                         call.n, y + call.plan[k].total_splits);
    l.args[l.n] = with_call_io(call.args[k], a);
    m40llm_attn_plan &p = l.plan[l.n];
    p = call.plan[k];
    for (int i = 0; i <= p.n_items; i++) p.split_begin[i] += y;
    l.pair[l.n] = call.pair[k];
    l.y0[l.n] = y;
    l.n++;
    y += p.total_splits;
  }
  const SplitPass &pass = call.pass[0];
  return mma_tiers_launch(st->stream, o->head_dim, pass, split_grid(y, grouping_for(o)),
                          pass.dependent, l);
}
#endif

// The side streams and their events, once a context: of the stream's priority, and not
// synchronizing with the legacy default stream (the events order them).
int side_streams(m40llm_cuda_state *st) {
  if (st->has_side) return M40LLM_OK;
  int priority = 0;
  M40LLM_CUDA_TRY(cudaStreamGetPriority(st->stream, &priority));
  M40LLM_CUDA_TRY(cudaEventCreateWithFlags(&st->fork, cudaEventDisableTiming));
  int made = 0;  // streams with their events
  cudaError_t err = cudaSuccess;
  for (; made < M40LLM_MAX_TIERS; made++) {
    err = cudaStreamCreateWithPriority(&st->side[made], cudaStreamNonBlocking, priority);
    if (err != cudaSuccess) break;
    if ((err = cudaEventCreateWithFlags(&st->join[made], cudaEventDisableTiming)) != cudaSuccess) {
      (void)cudaStreamDestroy(st->side[made]);
      break;
    }
  }
  if (made == M40LLM_MAX_TIERS) {
    st->has_side = true;
    return M40LLM_OK;
  }
  const int rc = m40llm_cuda_error(err, "creating a tiered call's streams");
  for (int i = 0; i < made; i++) {
    (void)cudaStreamDestroy(st->side[i]);
    (void)cudaEventDestroy(st->join[i]);
  }
  (void)cudaEventDestroy(st->fork);
  return rc;
}

}  // namespace

// The most partials a call's launches write for M40LLM_PLAN_MAX_ITEMS sequences, reserved: each
// tier's plan within attention_plan.h's bound (for a plain call's pass or one with weights), the
// kept parts' splits and the empty ones.
int m40llm_cuda_tier_reserve(const m40llm_kvcache *c) {
  m40llm_cuda_state *st = cuda_state(c->ctx);
  const int rc = side_streams(st);
  if (rc != M40LLM_OK) return rc;
  const m40llm_kvcache_options *o = &c->opts;
  const Grouping g = grouping_for(o);
  int64_t splits = 2 * M40LLM_PLAN_MAX_ITEMS;
  if (c->slots > 0)  // for the smallest tile any pass has
    splits += M40LLM_PLAN_MAX_ITEMS * m40llm_attn_protect_extra(c->n_sinks, c->window, kept_chunk(1));
  int one_target = 0;  // a short call's tiers take shares of the one launch's target
#if M40LLM_MMA_ONE_LAUNCH
  SplitPasses one;
  bool have = false;
  const int one_rc = mma_tiers_passes(st, o->head_dim, &one, &have);
  if (one_rc != M40LLM_OK) return one_rc;
  if (have) one_target = one.pass.target > one.fine.target ? one.pass.target : one.fine.target;
#endif
  for (int t = 0; t < c->n_tiers; t++) {
    int target = 0;
    const int rc = with_tier_pair(o->tiers[t].k_format, o->tiers[t].v_format, [&](auto pair) -> int {
      SplitPasses p;
      int rc = M40LLM_OK;
      // A plain call's passes (those of a call with weights: the same tensor-core ones, else
      // the FP32 instances with scores), and a causal one's (masked).
      for (const bool masked : {false, true})
        for (const bool scores : {false, true})
          if (rc == M40LLM_OK && (rc = tier_passes<decltype(pair)>(st, o->head_dim, g, scores,
                                                                   masked, &p)) == M40LLM_OK)
          for (const SplitPass &sp : {p.pass, p.direct, p.fine})
            target = sp.target > target ? sp.target : target;
      return rc;
    });
    if (rc != M40LLM_OK) return rc;
    target = one_target > target ? one_target : target;
    const int64_t bound = 3 * ((target + g.units - 1) / g.units) + 1;
    splits += bound > M40LLM_PLAN_MAX_ITEMS ? bound : M40LLM_PLAN_MAX_ITEMS;
  }
  void *ws = nullptr;
  return m40llm_cuda_workspace(st, attn_partial_bytes((int)splits, o->n_heads, o->head_dim), &ws);
}

int tier_attention(const m40llm_kvcache *c, int layer, const int32_t *seq_ids,
                   const int32_t *limits, int n_seqs, const float *q, float *out, float scale,
                   const CallExport &x) {
  m40llm_cuda_state *st = cuda_state(c->ctx);
  const m40llm_kvcache_options *o = &c->opts;
  const size_t row = (size_t)o->n_heads * o->head_dim;
  bool combine_dependent = false;
  int rc = combine_prepare(st, &combine_dependent);
  for (int first = 0; first < n_seqs && rc == M40LLM_OK; first += M40LLM_PLAN_MAX_ITEMS) {
    const int n = n_seqs - first < M40LLM_PLAN_MAX_ITEMS ? n_seqs - first : M40LLM_PLAN_MAX_ITEMS;
    const CallExport xn = x.at(first);
    TierCall call;
    void *ws = nullptr;
    if ((rc = plan_call(c, layer, seq_ids + first, limits ? limits + first : nullptr, n, scale,
                        xn.weights != nullptr, &call)) != M40LLM_OK ||
        (rc = m40llm_cuda_workspace(
             st, attn_partial_bytes(call.combine.total_splits, o->n_heads, o->head_dim), &ws)) !=
            M40LLM_OK)
      break;
    const size_t n_part = (size_t)call.combine.total_splits * o->n_heads;
    AttnArgs a = call.args[0];
    a.q = q + (size_t)first * row;
    a.out = out + (size_t)first * row;
    a.part_o = static_cast<float *>(ws);
    a.part_m = a.part_o + n_part * o->head_dim;
    a.part_l = a.part_m + n_part;
#if M40LLM_MMA_ONE_LAUNCH
    if (call.one) {
      if ((rc = launch_one(st, o, call, a)) == M40LLM_OK)
        rc = combine_launch(st, a, call.combine, combine_dependent);
      continue;
    }
#endif
    // Launches with splits: the first on the stream, the others chained after it there, or
    // beside it on the side streams.
    int live = 0;
    for (int l = 0; l < call.n; l++) live += call.plan[l].total_splits > 0;
    const bool side = live > 1 && !call.chain;
    if (side && (rc = m40llm_cuda_status(cudaEventRecord(st->fork, st->stream),
                                "forking a tiered call's streams")) != M40LLM_OK)
      break;
    int made = 0, joins = 0;
    for (int l = 0; l < call.n && rc == M40LLM_OK; l++) {
      if (call.plan[l].total_splits == 0) continue;
      cudaStream_t stream = made == 0 || !side ? st->stream : st->side[made - 1];
      if (made > 0 && side &&
          (rc = m40llm_cuda_status(cudaStreamWaitEvent(stream, st->fork, 0),
                                   "forking a tiered call's streams")) != M40LLM_OK)
        break;
      const AttnArgs al = with_call_io(call.args[l], a);
      call.plan[l].weights = xn.weights;
      call.plan[l].weights_stride = (int64_t)xn.weights_stride;
      call.plan[l].chained = made > 0 && !side;
      const SplitPass &p = call.pass[l];
      rc = launch_attention_kernel(
          stream, "launching the attention split kernel (a tier)", p.kernel,
          split_grid(call.plan[l].total_splits, grouping_for(o)), p.threads,
          p.smem, p.dependent && (made == 0 || !side), al, call.plan[l]);
      if (made > 0 && side) {  // joined whether its launch failed or not: it is in a capture
        const int jr = m40llm_cuda_status(cudaEventRecord(st->join[joins], stream),
                                 "joining a tiered call's streams");
        if (jr == M40LLM_OK) joins++;
        else (void)cudaStreamSynchronize(stream);  // unjoinable: not left running behind the call
        if (rc == M40LLM_OK) rc = jr;
      }
      made++;
    }
    // Every side stream that waited on the fork is joined, after a failure too: nothing of the
    // call is left unordered behind the stream (or a capture unjoined).
    for (int j = 0; j < joins; j++) {
      const int jr = m40llm_cuda_status(cudaStreamWaitEvent(st->stream, st->join[j], 0),
                               "joining a tiered call's streams");
      if (rc == M40LLM_OK) rc = jr;
    }
    // After the joins the kernel before the combine on the stream is an event's wait.
    if (rc == M40LLM_OK) rc = combine_launch(st, a, call.combine, combine_dependent && !side);
    if (rc == M40LLM_OK && xn.weights) {  // over every position of the items (combine.len)
      call.combine.weights = xn.weights;
      call.combine.weights_stride = (int64_t)xn.weights_stride;
      rc = weights_launch(st, a, call.combine, xn.imp);
    }
  }
  return rc;
}

int tier_attention_causal(const m40llm_kvcache *c, int layer, const m40llm_append_item *items,
                          int n_items, const float *q, float *out, float scale) {
  const size_t row = (size_t)c->opts.n_heads * c->opts.head_dim;
  const CallExport none{nullptr, 0, {nullptr, 0, 0.0f}, c->opts.n_heads, c->opts.n_kv_heads};
  int32_t ids[M40LLM_PLAN_MAX_ITEMS], limits[M40LLM_PLAN_MAX_ITEMS];
  int n = 0, rc = M40LLM_OK;
  size_t done = 0;  // query rows of the calls before
  const auto flush = [&] {
    rc = tier_attention(c, layer, ids, limits, n, q + done * row, out + done * row, scale, none);
    done += (size_t)n;
    n = 0;
  };
  for (int i = 0; i < n_items && rc == M40LLM_OK; i++)
    for (int j = 0; j < items[i].n_tokens && rc == M40LLM_OK; j++) {
      ids[n] = items[i].seq;
      limits[n] = items[i].pos + j + 1;
      if (++n == M40LLM_PLAN_MAX_ITEMS) flush();
    }
  if (rc == M40LLM_OK && n > 0) flush();
  return rc;
}
