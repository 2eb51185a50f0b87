/*
 * A decode step in a CUDA graph (m40llm.h, "Graphs"). Each step's calls, one
 * m40llm_kvcache_append_attn_f32q per layer of two, are captured on the context's stream,
 * applied to one executable graph with cudaGraphExecUpdate (instantiated anew where the update
 * is refused) and launched, by the runtime's graph calls or by the library's (m40llm_graph_*,
 * every other shape); a twin cache makes the same calls eagerly (outputs and stored K/V
 * bit for bit: the same kernels) and a third the same on the CPU backend (outputs within 1e-5
 * of its float64). Lengths change every step (one token each, a step naming fewer sequences),
 * so every step's graph differs in its plan. Then the rule for buffers that grow: a 16-bit call
 * that would grow the staging buffer during a capture is refused before anything is written
 * or captured, the capture stays valid, and after the same call once outside a capture it is
 * captured.
 * CUDA builds only (the runtime's graph API): linked into test_gpu where it has cudart.
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

enum { LAYERS = 2, SEQS = 3 };

typedef struct {
  int kf, vf, n_heads, n_kv, d, sinks, window;
  int32_t len[SEQS]; /* each sequence's prompt, in every layer */
} graph_shape;

static m40llm_kvcache *create(m40llm_context *ctx, graph_shape s, int max_seq_len) {
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = LAYERS, o.n_heads = s.n_heads, o.n_kv_heads = s.n_kv, o.head_dim = s.d;
  o.max_seqs = SEQS, o.max_seq_len = max_seq_len;
  o.format = s.kf, o.v_format = s.vf, o.n_sinks = s.sinks, o.window = s.window;
  m40llm_kvcache *c = NULL;
  return T_OK(m40llm_kvcache_create(&c, ctx, &o)) ? c : NULL;
}

/* The steps' executable graph and what became of each capture applied to it: the runtime's
 * (exec), or the library's (lib, where use_lib). */
typedef struct {
  cudaGraphExec_t exec;
  int instantiated, updated;
  int use_lib;
  m40llm_graph *lib;
} step_graph;

/* Puts a step's captured graph into g->exec: updated in place where the topology is the same
 * (the cheap path), else instantiated anew. Returns whether g->exec holds it. */
static int graph_apply(step_graph *g, cudaGraph_t graph) {
  if (g->exec) {
#if CUDART_VERSION >= 12000
    cudaGraphExecUpdateResultInfo info;
    const cudaError_t e = cudaGraphExecUpdate(g->exec, graph, &info);
#else
    cudaGraphNode_t node;
    enum cudaGraphExecUpdateResult result;
    const cudaError_t e = cudaGraphExecUpdate(g->exec, graph, &node, &result);
#endif
    if (e == cudaSuccess) {
      g->updated++;
      return 1;
    }
    (void)cudaGetLastError(); /* a refused update must not surface at the next launch check */
    (void)cudaGraphExecDestroy(g->exec);
    g->exec = NULL;
  }
  if (!T_CHECK(cudaGraphInstantiateWithFlags(&g->exec, graph, 0) == cudaSuccess)) {
    g->exec = NULL;
    return 0;
  }
  g->instantiated++;
  return 1;
}

/* Per-layer buffers of one context: the step's k, v and q rows (SEQS rows each) and outputs. */
typedef struct {
  float *k[LAYERS], *v[LAYERS], *q[LAYERS], *out[LAYERS], *out2[LAYERS];
} step_bufs;

static int bufs_alloc(step_bufs *b, m40llm_context *ctx, size_t kv_bytes, size_t q_bytes,
                      int twin) {
  memset(b, 0, sizeof *b);
  for (int l = 0; l < LAYERS; l++) {
    b->k[l] = t_dev_alloc(ctx, kv_bytes), b->v[l] = t_dev_alloc(ctx, kv_bytes);
    b->q[l] = t_dev_alloc(ctx, q_bytes), b->out[l] = t_dev_alloc(ctx, q_bytes);
    if (twin) b->out2[l] = t_dev_alloc(ctx, q_bytes);
    if (!b->k[l] || !b->v[l] || !b->q[l] || !b->out[l] || (twin && !b->out2[l])) return 0;
  }
  return 1;
}

static void bufs_free(step_bufs *b, m40llm_context *ctx) {
  for (int l = 0; l < LAYERS; l++) {
    m40llm_free(ctx, b->k[l]), m40llm_free(ctx, b->v[l]), m40llm_free(ctx, b->q[l]);
    m40llm_free(ctx, b->out[l]), m40llm_free(ctx, b->out2[l]);
  }
}

/* A decode step's calls on one cache: append_attn in every layer. */
static int step_calls(m40llm_kvcache *c, const step_bufs *b, float *const *out,
                      const int32_t *ids, int n) {
  for (int l = 0; l < LAYERS; l++) {
    const int rc = m40llm_kvcache_append_attn_f32q(out[l], c, l, ids, n, b->k[l], b->v[l],
                                                   b->q[l], l == 1 ? 0.11f : 0.0f);
    if (rc != M40LLM_OK) return rc;
  }
  return M40LLM_OK;
}

/* Captures a step's calls on g's stream and launches them as the graph of sg. */
static int step_as_graph(step_graph *sg, m40llm_context *ctx, m40llm_kvcache *c,
                         const step_bufs *b, const int32_t *ids, int n) {
  if (sg->use_lib) {
    if (!T_OK(m40llm_graph_capture_begin(ctx))) return 0;
    const int rc = step_calls(c, b, b->out, ids, n);
    m40llm_graph *const before = sg->lib;
    int updated = -1;
    if (!T_OK(rc)) {
      T_OK(m40llm_graph_capture_end(NULL, ctx, NULL)); /* discarded */
      return 0;
    }
    if (!T_OK(m40llm_graph_capture_end(&sg->lib, ctx, &updated))) return 0;
    T_CHECKF(before == NULL || sg->lib == before, "the graph handle changed on re-capture");
    T_CHECKF(updated == 0 || (updated == 1 && before != NULL), "out_updated %d (first: %d)",
             updated, before == NULL);
    if (updated == 1) sg->updated++;
    else sg->instantiated++;
    return T_OK(m40llm_graph_launch(sg->lib));
  }
  cudaStream_t st = (cudaStream_t)m40llm_context_cuda_stream(ctx);
  if (!T_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess))
    return 0;
  const int rc = step_calls(c, b, b->out, ids, n);
  cudaGraph_t graph = NULL;
  const cudaError_t end = cudaStreamEndCapture(st, &graph);
  int ok = T_OK(rc) && T_CHECKF(end == cudaSuccess, "end of capture: %s", cudaGetErrorString(end));
  ok = ok && graph_apply(sg, graph) && T_CHECK(cudaGraphLaunch(sg->exec, st) == cudaSuccess);
  if (graph) (void)cudaGraphDestroy(graph);
  return ok;
}

/* Stored rows of the steps in both caches, bit for bit (read_f16 of every layer and sequence). */
static void same_contents(m40llm_context *ctx, m40llm_kvcache *a, m40llm_kvcache *b,
                          size_t row, int max_len) {
  const size_t bytes = (size_t)max_len * row * sizeof(uint16_t);
  uint16_t *d[4], *h[4];
  int ok = 1;
  for (int i = 0; i < 4; i++) {
    d[i] = t_dev_alloc(ctx, bytes), h[i] = malloc(bytes);
    ok = ok && d[i] && T_CHECK(h[i] != NULL);
  }
  for (int l = 0; ok && l < LAYERS; l++) {
    for (int s = 0; ok && s < SEQS; s++) {
      int la = -1, lb = -2;
      ok = T_OK(m40llm_kvcache_seq_len(&la, a, l, s)) && T_OK(m40llm_kvcache_seq_len(&lb, b, l, s));
      if (!ok || !T_CHECKF(la == lb, "layer %d seq %d: lengths %d (graph) and %d (eager)", l, s,
                           la, lb))
        continue;
      const size_t n = (size_t)la * row * sizeof(uint16_t);
      ok = T_OK(m40llm_kvcache_read_f16(d[0], d[1], a, l, s, 0, la)) &&
           T_OK(m40llm_kvcache_read_f16(d[2], d[3], b, l, s, 0, la));
      for (int i = 0; ok && i < 4; i++) ok = t_dev_download(ctx, h[i], d[i], n);
      if (ok)
        T_CHECKF(memcmp(h[0], h[2], n) == 0 && memcmp(h[1], h[3], n) == 0,
                 "layer %d seq %d: stored K/V of the graph steps differ from the eager ones", l, s);
    }
  }
  for (int i = 0; i < 4; i++) m40llm_free(ctx, d[i]), free(h[i]);
}

static void graph_case(m40llm_context *ctx, m40llm_context *cpu, graph_shape s, int steps,
                       int use_lib) {
  t_set_case("graph step K %d / V %d, %d/%d heads, head_dim %d, window %d: setup", s.kf, s.vf,
             s.n_heads, s.n_kv, s.d, s.window);
  const size_t row = (size_t)s.n_kv * (size_t)s.d, qrow = (size_t)s.n_heads * (size_t)s.d;
  const size_t kv_bytes = SEQS * row * sizeof(float), q_bytes = SEQS * qrow * sizeof(float);
  int max_len = 0, prompt_rows = 0;
  for (int i = 0; i < SEQS; i++) {
    max_len = s.len[i] > max_len ? s.len[i] : max_len;
    prompt_rows += s.len[i];
  }
  max_len += steps;
  m40llm_kvcache *g = create(ctx, s, max_len), *e = create(ctx, s, max_len);
  m40llm_kvcache *c = create(cpu, s, max_len);
  step_bufs dev, host;
  const int have = bufs_alloc(&dev, ctx, kv_bytes, q_bytes, 1) &&
                   bufs_alloc(&host, cpu, kv_bytes, q_bytes, 0);
  float *k = malloc((size_t)prompt_rows * row * sizeof(float));
  float *v = malloc((size_t)prompt_rows * row * sizeof(float));
  float *q = malloc(q_bytes), *og = malloc(q_bytes), *oe = malloc(q_bytes), *oc = malloc(q_bytes);
  double *ref = malloc(SEQS * qrow * sizeof(double));
  float *pk = NULL, *pv = NULL, *ck = NULL, *cv = NULL;
  step_graph sg = {NULL, 0, 0, use_lib, NULL};
  if (!g || !e || !c || !have || !T_CHECK(k && v && q && og && oe && oc && ref)) goto done;

  /* The prompts: the same rows into all three caches, one ragged batch a layer. */
  const int32_t all[SEQS] = {0, 1, 2};
  for (int l = 0; l < LAYERS; l++) {
    t_fill_uniform(k, (size_t)prompt_rows * row, -2.0f, 2.0f);
    t_fill_uniform(v, (size_t)prompt_rows * row, -3.0f, 3.0f);
    const size_t bytes = (size_t)prompt_rows * row * sizeof(float);
    pk = t_dev_upload(ctx, k, bytes), pv = t_dev_upload(ctx, v, bytes);
    ck = t_dev_upload(cpu, k, bytes), cv = t_dev_upload(cpu, v, bytes);
    const int ok = pk && pv && ck && cv &&
                   T_OK(m40llm_kvcache_append_batch_f32(g, l, all, s.len, SEQS, pk, pv)) &&
                   T_OK(m40llm_kvcache_append_batch_f32(e, l, all, s.len, SEQS, pk, pv)) &&
                   T_OK(m40llm_kvcache_append_batch_f32(c, l, all, s.len, SEQS, ck, cv));
    m40llm_free(ctx, pk), m40llm_free(ctx, pv), m40llm_free(cpu, ck), m40llm_free(cpu, cv);
    if (!ok) goto done;
  }

  /* Step 0 is the warm-up the header asks for (eager on every cache); the others are graphs
   * on g. Step 2 names two sequences, in another order. */
  for (int step = 0; step < steps; step++) {
    t_set_case("graph step K %d / V %d, %d/%d heads, head_dim %d, window %d: step %d", s.kf,
               s.vf, s.n_heads, s.n_kv, s.d, s.window, step);
    int32_t ids[SEQS];
    const int n = step == 2 ? 2 : SEQS;
    for (int i = 0; i < n; i++) ids[i] = (int32_t)((i + step) % SEQS);
    for (int l = 0; l < LAYERS; l++) {
      t_fill_uniform(k, SEQS * row, -2.0f, 2.0f);
      t_fill_uniform(v, SEQS * row, -3.0f, 3.0f);
      t_fill_uniform(q, SEQS * qrow, -1.0f, 1.0f);
      if (!T_OK(m40llm_memcpy_to_device(ctx, dev.k[l], k, kv_bytes)) ||
          !T_OK(m40llm_memcpy_to_device(ctx, dev.v[l], v, kv_bytes)) ||
          !T_OK(m40llm_memcpy_to_device(ctx, dev.q[l], q, q_bytes)) ||
          !T_OK(m40llm_memcpy_to_device(cpu, host.k[l], k, kv_bytes)) ||
          !T_OK(m40llm_memcpy_to_device(cpu, host.v[l], v, kv_bytes)) ||
          !T_OK(m40llm_memcpy_to_device(cpu, host.q[l], q, q_bytes)) ||
          !T_OK(m40llm_memset(ctx, dev.out[l], 0xFF, q_bytes)) ||
          !T_OK(m40llm_memset(ctx, dev.out2[l], 0xFF, q_bytes)) ||
          !T_OK(m40llm_memset(cpu, host.out[l], 0xFF, q_bytes)))
        goto done;
    }
    const int ok = (step == 0 ? T_OK(step_calls(g, &dev, dev.out, ids, n))
                              : step_as_graph(&sg, ctx, g, &dev, ids, n)) &&
                   T_OK(step_calls(e, &dev, dev.out2, ids, n)) &&
                   T_OK(step_calls(c, &host, host.out, ids, n)) &&
                   T_OK(m40llm_context_synchronize(ctx));
    if (!ok) goto done;
    const size_t used = (size_t)n * qrow * sizeof(float);
    for (int l = 0; l < LAYERS; l++) {
      if (!t_dev_download(ctx, og, dev.out[l], used) ||
          !t_dev_download(ctx, oe, dev.out2[l], used) ||
          !t_dev_download(cpu, oc, host.out[l], used))
        goto done;
      T_CHECKF(memcmp(og, oe, used) == 0,
               "layer %d: the graph's output differs from the eager calls'", l);
      for (size_t i = 0; i < (size_t)n * qrow; i++) ref[i] = oc[i];
      const double err = t_rel_l2(og, ref, (size_t)n * qrow);
      T_CHECKF(err <= 1e-5, "layer %d: graph vs the CPU backend: relative L2 %.3g (bound 1e-5)", l,
               err);
    }
  }
  t_set_case("graph step K %d / V %d, %d/%d heads, head_dim %d, window %d: after the steps",
             s.kf, s.vf, s.n_heads, s.n_kv, s.d, s.window);
  same_contents(ctx, g, e, row, max_len);
  /* Same topology from step to step, lengths and plans aside: the update path was taken. */
  T_CHECKF(sg.updated >= 1, "no step's graph was applied by cudaGraphExecUpdate (%d instantiated)",
           sg.instantiated);
done:
  if (sg.exec) (void)cudaGraphExecDestroy(sg.exec);
  m40llm_graph_destroy(sg.lib);
  bufs_free(&dev, ctx);
  bufs_free(&host, cpu);
  free(k), free(v), free(q), free(og), free(oe), free(oc), free(ref);
  m40llm_kvcache_destroy(g);
  m40llm_kvcache_destroy(e);
  m40llm_kvcache_destroy(c);
}

static uint16_t *random_bf16(size_t n) {
  uint16_t *x = malloc(n * sizeof *x);
  if (T_CHECK(x != NULL))
    for (size_t i = 0; i < n; i++) x[i] = (uint16_t)(t_f32_bits(t_rand_float(-1.0f, 1.0f)) >> 16);
  return x;
}

/* The warm-up rule: on a fresh context the first 16-bit call allocates the staging buffer, which
 * a capture cannot hold. */
static void growth_case(void) {
  t_set_case("graph: a buffer that must grow is refused during a capture");
  enum { H = 8, KV = 2, D = 64, N = 2 };
  m40llm_context_options o = M40LLM_CONTEXT_OPTIONS_INIT;
  o.backend = M40LLM_BACKEND_CUDA;
  m40llm_context *ctx = NULL;
  if (!T_OK(m40llm_context_create(&ctx, &o))) return;
  const graph_shape s = {M40LLM_KV_F16, M40LLM_KV_SAME, H, KV, D, 0, 0, {5, 9, 1}};
  m40llm_kvcache *a = create(ctx, s, 32), *b = create(ctx, s, 32);
  const size_t kv_n = N * KV * D, q_n = N * H * D, prompt_n = 14 * KV * D; /* 9 + 5 rows */
  uint16_t *k = random_bf16(kv_n), *v = random_bf16(kv_n), *q = random_bf16(q_n);
  uint16_t *p = random_bf16(prompt_n);
  uint16_t *ha = malloc(q_n * 2), *hb = malloc(q_n * 2);
  void *dk = NULL, *dv = NULL, *dq = NULL, *dp = NULL, *oa = NULL, *ob = NULL;
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  cudaStream_t st = (cudaStream_t)m40llm_context_cuda_stream(ctx);
  const int32_t ids[N] = {1, 0};
  if (!a || !b || !k || !v || !q || !p || !T_CHECK(ha && hb)) goto done;
  dk = t_dev_upload(ctx, k, kv_n * 2), dv = t_dev_upload(ctx, v, kv_n * 2);
  dq = t_dev_upload(ctx, q, q_n * 2), dp = t_dev_upload(ctx, p, prompt_n * 2);
  oa = t_dev_alloc(ctx, q_n * 2), ob = t_dev_alloc(ctx, q_n * 2);
  if (!dk || !dv || !dq || !dp || !oa || !ob || !T_OK(m40llm_memset(ctx, oa, 0xFF, q_n * 2)) ||
      !T_OK(m40llm_memset(ctx, ob, 0xFF, q_n * 2)))
    goto done;
  /* the same prompts (9 and 5 rows, K = V) in a and b; BF16 appends stage nothing */
  const int32_t lens[N] = {s.len[ids[0]], s.len[ids[1]]};
  if (!T_OK(m40llm_kvcache_append_batch_ex(a, 0, ids, lens, N, dp, dp, M40LLM_DTYPE_BF16)) ||
      !T_OK(m40llm_kvcache_append_batch_ex(b, 0, ids, lens, N, dp, dp, M40LLM_DTYPE_BF16)) ||
      !T_OK(m40llm_context_synchronize(ctx)))
    goto done;

  if (!T_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess))
    goto done;
  T_FAIL_WITH(m40llm_kvcache_append_attn_ex(oa, a, 0, ids, N, dk, dv, dq, M40LLM_DTYPE_BF16, 0.0f),
              M40LLM_ERR_UNSUPPORTED, "captured");
  T_FAIL_WITH(m40llm_kvcache_attn_batch_ex(oa, a, 0, ids, N, dq, M40LLM_DTYPE_BF16, 0.0f),
              M40LLM_ERR_UNSUPPORTED, "captured");
  const cudaError_t end = cudaStreamEndCapture(st, &graph);
  size_t nodes = 1;
  T_CHECKF(end == cudaSuccess, "the refusal invalidated the capture: %s", cudaGetErrorString(end));
  if (graph && T_CHECK(cudaGraphGetNodes(graph, NULL, &nodes) == cudaSuccess))
    T_CHECKF(nodes == 0, "the refused calls left %zu node(s) in the capture", nodes);
  if (graph) (void)cudaGraphDestroy(graph);
  graph = NULL;
  for (int i = 0; i < N; i++) {
    int len = -1;
    if (T_OK(m40llm_kvcache_seq_len(&len, a, 0, ids[i]))) T_INT_EQ(len, s.len[ids[i]]);
  }

  t_set_case("graph: after one call outside a capture, the same call is captured");
  if (!T_OK(m40llm_kvcache_append_attn_ex(ob, b, 0, ids, N, dk, dv, dq, M40LLM_DTYPE_BF16, 0.0f)) ||
      !T_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess))
    goto done;
  const int rc =
      m40llm_kvcache_append_attn_ex(oa, a, 0, ids, N, dk, dv, dq, M40LLM_DTYPE_BF16, 0.0f);
  const cudaError_t end2 = cudaStreamEndCapture(st, &graph);
  if (T_OK(rc) && T_CHECK(end2 == cudaSuccess) &&
      T_CHECK(cudaGraphInstantiateWithFlags(&exec, graph, 0) == cudaSuccess) &&
      T_CHECK(cudaGraphLaunch(exec, st) == cudaSuccess) && T_OK(m40llm_context_synchronize(ctx)) &&
      t_dev_download(ctx, ha, oa, q_n * 2) && t_dev_download(ctx, hb, ob, q_n * 2))
    T_CHECKF(memcmp(ha, hb, q_n * 2) == 0, "the captured BF16 step differs from the eager one");
done:
  if (exec) (void)cudaGraphExecDestroy(exec);
  if (graph) (void)cudaGraphDestroy(graph);
  m40llm_free(ctx, dk), m40llm_free(ctx, dv), m40llm_free(ctx, dq), m40llm_free(ctx, dp);
  m40llm_free(ctx, oa), m40llm_free(ctx, ob);
  free(k), free(v), free(q), free(p), free(ha), free(hb);
  m40llm_kvcache_destroy(a);
  m40llm_kvcache_destroy(b);
  m40llm_context_destroy(ctx);
}

/* The library's graph calls out of order and with wrong arguments: a clear status, and the
 * capture left as the header says. */
static void api_case(m40llm_context *ctx) {
  t_set_case("graph API: order and arguments");
  m40llm_graph *g = NULL;
  T_FAIL_WITH(m40llm_graph_capture_end(&g, ctx, NULL), M40LLM_ERR_INVALID_ARGUMENT,
              "not being captured");
  T_CHECK(g == NULL);
  unsigned char *buf = t_dev_alloc(ctx, 256), host[256];
  if (!buf || !T_OK(m40llm_memset(ctx, buf, 0, 256)) || !T_OK(m40llm_graph_capture_begin(ctx))) {
    m40llm_free(ctx, buf);
    return;
  }
  T_FAIL_WITH(m40llm_graph_capture_begin(ctx), M40LLM_ERR_INVALID_ARGUMENT, "already");
  /* A captured memset runs when the graph is launched, not when it is captured. */
  T_OK(m40llm_memset(ctx, buf, 0x5A, 256));
  int updated = -1;
  if (T_OK(m40llm_graph_capture_end(&g, ctx, &updated)) && T_CHECK(g != NULL)) {
    T_INT_EQ(updated, 0);
    if (t_dev_download(ctx, host, buf, 256)) T_CHECK(t_all_bytes((const char *)host, 256, 0));
    T_OK(m40llm_graph_launch(g));
    if (t_dev_download(ctx, host, buf, 256)) T_CHECK(t_all_bytes((const char *)host, 256, 0x5A));
  }
  /* A graph of another context leaves the capture running; graph NULL then discards it. */
  m40llm_context_options o = M40LLM_CONTEXT_OPTIONS_INIT;
  o.backend = M40LLM_BACKEND_CUDA;
  m40llm_context *other = NULL;
  if (g && T_OK(m40llm_context_create(&other, &o)) && T_OK(m40llm_graph_capture_begin(other))) {
    m40llm_graph *mine = g;
    T_FAIL_WITH(m40llm_graph_capture_end(&mine, other, NULL), M40LLM_ERR_INVALID_ARGUMENT,
                "another context");
    T_CHECK(mine == g);
    T_OK(m40llm_graph_capture_end(NULL, other, NULL));
    T_FAIL_WITH(m40llm_graph_capture_end(NULL, other, NULL), M40LLM_ERR_INVALID_ARGUMENT,
                "not being captured");
  }
  /* A capture invalidated by an uncapturable call (a synchronize) fails at its end with the
   * CUDA error; the handle and the stream stay usable. */
  if (g && T_OK(m40llm_graph_capture_begin(ctx))) {
    T_CHECK(m40llm_context_synchronize(ctx) != M40LLM_OK);
    m40llm_graph *const before = g;
    T_FAIL_WITH(m40llm_graph_capture_end(&g, ctx, NULL), M40LLM_ERR_CUDA, "invalidated");
    T_CHECK(g == before);
    T_OK(m40llm_graph_launch(g));
    T_OK(m40llm_context_synchronize(ctx));
  }
  m40llm_graph_destroy(g);
  m40llm_context_destroy(other);
  m40llm_free(ctx, buf);
}

/* A call with weights captured on a fresh context without a call before it (its workspace is
 * reserved at create, for 130 rows of one sequence pair: two launches of items, each split's
 * partial kept), against the same call made eagerly after the graph ran. */
static void weights_case(void) {
  t_set_case("graph of a call with weights, no call before the capture");
  m40llm_context_options o = M40LLM_CONTEXT_OPTIONS_INIT;
  o.backend = M40LLM_BACKEND_CUDA;
  m40llm_context *ctx = NULL;
  if (!T_OK(m40llm_context_create(&ctx, &o))) return;
  t_kv kv;
  enum { ROWS = 130, H = 16, D = 128, LEN = 300 };
  if (t_kv_create(&kv, ctx, 1, H, 2, D, 2, LEN) != M40LLM_OK) {
    m40llm_context_destroy(ctx);
    return;
  }
  int32_t ids[ROWS];
  for (int i = 0; i < ROWS; i++) ids[i] = i % 3 == 0;
  const size_t qn = (size_t)ROWS * H * D, wn = (size_t)ROWS * H * LEN;
  float *q = malloc(qn * sizeof(float));
  float *host = malloc(2 * (qn + wn) * sizeof(float));
  float *dq = NULL, *dev = NULL;
  m40llm_graph *g = NULL;
  if (!T_CHECK(q && host) || !T_OK(t_kv_append_random(&kv, 0, 0, 50, 1.0f)) ||
      !T_OK(t_kv_append_random(&kv, 0, 1, LEN, 1.0f)))
    goto done;
  t_fill_uniform(q, qn, -1.0f, 1.0f);
  dq = t_dev_upload(ctx, q, qn * sizeof(float));
  dev = t_dev_alloc(ctx, 2 * (qn + wn) * sizeof(float)); /* graph's out, weights; eager's */
  if (!dq || !dev || !T_OK(m40llm_memset(ctx, dev, 0, 2 * (qn + wn) * sizeof(float))) ||
      !T_OK(m40llm_graph_capture_begin(ctx)))
    goto done;
  const int rc = m40llm_kvcache_attn_weights_ex(dev, dev + qn, LEN, kv.cache, 0, ids, ROWS, dq,
                                                M40LLM_DTYPE_F32, 0.0f);
  T_OK(rc);
  if (!T_OK(m40llm_graph_capture_end(rc == M40LLM_OK ? &g : NULL, ctx, NULL)) || !g ||
      !T_OK(m40llm_graph_launch(g)) ||
      !T_OK(m40llm_kvcache_attn_weights_ex(dev + qn + wn, dev + 2 * qn + wn, LEN, kv.cache, 0,
                                           ids, ROWS, dq, M40LLM_DTYPE_F32, 0.0f)) ||
      !t_dev_download(ctx, host, dev, 2 * (qn + wn) * sizeof(float)))
    goto done;
  T_CHECKF(memcmp(host, host + qn + wn, (qn + wn) * sizeof(float)) == 0,
           "the graph's output and weights differ from the eager call's");
  double sum = 0.0; /* row 1 is sequence 0 (50 positions): its first head's weights */
  for (int p = 0; p < 50; p++) sum += host[qn + (size_t)H * LEN + p];
  T_CHECKF(fabs(sum - 1.0) < 1e-5, "weights of row 1, head 0 sum to %.9g", sum);
done:
  m40llm_graph_destroy(g);
  m40llm_free(ctx, dq);
  m40llm_free(ctx, dev);
  free(q);
  free(host);
  t_kv_destroy(&kv);
  m40llm_context_destroy(ctx);
}

/* A tiered cache's calls, whose launches run on streams forked from the context's and joined
 * back into it (branches of the graph), made eagerly and then captured into one graph and
 * launched: output and weights bit for bit the eager calls'. A batch with rows in every tier
 * (four launches), then one whose rows are all in the first tier (one launch: no fork, another
 * graph shape applied to the same graph); FP16 sinks and window throughout. (cases_tiers.c
 * checks the eager calls against float64.) */
static void tiers_case(m40llm_context *ctx) {
  t_set_case("graph of a tiered cache's calls");
  enum { H = 8, KV = 2, D = 64, LEN = 400, ROWS = 3 };
  static const int pairs[4][2] = {{M40LLM_KV_Q8, M40LLM_KV_Q8}, {M40LLM_KV_Q8, M40LLM_KV_Q4},
                                  {M40LLM_KV_Q4, M40LLM_KV_Q3}, {M40LLM_KV_Q4, M40LLM_KV_Q2}};
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = 1;
  o.n_heads = H;
  o.n_kv_heads = KV;
  o.head_dim = D;
  o.max_seqs = 3;
  o.max_seq_len = LEN;
  o.n_sinks = 4;
  o.window = 16;
  o.n_tiers = 4;
  for (int t = 0; t < 4; t++) o.tiers[t] = (m40llm_kv_tier){pairs[t][0], pairs[t][1], LEN};
  o.format = pairs[0][0];
  o.v_format = pairs[0][1];
  m40llm_kvcache *c = NULL;
  if (!T_OK(m40llm_kvcache_create(&c, ctx, &o))) return;
  const int lens[3] = {LEN, 77, 150};
  const size_t kv_n = (size_t)LEN * KV * D, qn = (size_t)ROWS * H * D, wn = (size_t)ROWS * H * LEN;
  const size_t half = 2 * qn + wn; /* a run's outputs: plain, with weights, the weights */
  float *k = malloc(kv_n * sizeof(float)), *v = malloc(kv_n * sizeof(float));
  float *q = malloc(qn * sizeof(float)), *host = malloc(2 * half * sizeof(float));
  float *dk = NULL, *dv = NULL, *dq = NULL, *dev = NULL;
  m40llm_graph *g = NULL;
  if (!T_CHECK(k && v && q && host)) goto done;
  t_fill_kv_values(k, (size_t)LEN * KV, D, 0);
  t_fill_kv_values(v, (size_t)LEN * KV, D, 1);
  t_fill_uniform(q, qn, -1.0f, 1.0f);
  dk = t_dev_upload(ctx, k, kv_n * sizeof(float));
  dv = t_dev_upload(ctx, v, kv_n * sizeof(float));
  dq = t_dev_upload(ctx, q, qn * sizeof(float));
  dev = t_dev_alloc(ctx, 2 * half * sizeof(float));
  if (!dk || !dv || !dq || !dev) goto done;
  for (int s = 0; s < 3; s++)
    if (!T_OK(m40llm_kvcache_append_f32(c, 0, s, dk, dv, lens[s]))) goto done;
  /* sequence 0 over all four tiers, 1 in the first only, 2 in the first and the last */
  if (!T_OK(m40llm_kvcache_tier_move(c, 0, 0, 60, 160, 1)) ||
      !T_OK(m40llm_kvcache_tier_move(c, 0, 0, 160, 300, 2)) ||
      !T_OK(m40llm_kvcache_tier_move(c, 0, 0, 300, LEN, 3)) ||
      !T_OK(m40llm_kvcache_tier_move(c, 0, 2, 10, 90, 3)))
    goto done;
  const int32_t batches[2][ROWS] = {{0, 1, 2}, {1, 1, 1}};
  for (int b = 0; b < 2; b++) {
    t_set_case("graph of a tiered cache's calls, batch %d", b);
    if (!T_OK(m40llm_memset(ctx, dev, 0, 2 * half * sizeof(float)))) goto done;
    for (int run = 0; run < 2; run++) { /* eager (the warm-up), then captured and launched */
      float *out = dev + (size_t)run * half;
      if (run == 1 && !T_OK(m40llm_graph_capture_begin(ctx))) goto done;
      int rc = m40llm_kvcache_attn_batch_f32q(out, c, 0, batches[b], ROWS, dq, 0.0f);
      if (rc == M40LLM_OK)
        rc = m40llm_kvcache_attn_weights_ex(out + qn, out + 2 * qn, LEN, c, 0, batches[b], ROWS,
                                            dq, M40LLM_DTYPE_F32, 0.0f);
      T_OK(rc);
      if (run == 1 && (!T_OK(m40llm_graph_capture_end(rc == M40LLM_OK ? &g : NULL, ctx, NULL)) ||
                       !g || !T_OK(m40llm_graph_launch(g))))
        goto done;
    }
    if (!t_dev_download(ctx, host, dev, 2 * half * sizeof(float))) goto done;
    T_CHECKF(memcmp(host, host + half, half * sizeof(float)) == 0,
             "the graph's outputs and weights differ from the eager calls'");
    for (int i = 0; i < ROWS; i++) { /* each row's first head's weights sum to 1 */
      double sum = 0.0;
      for (int p = 0; p < lens[batches[b][i]]; p++) sum += host[2 * qn + (size_t)i * H * LEN + p];
      T_CHECKF(fabs(sum - 1.0) < 1e-5, "weights of row %d, head 0 sum to %.9g", i, sum);
    }
  }
done:
  m40llm_graph_destroy(g);
  m40llm_free(ctx, dk);
  m40llm_free(ctx, dv);
  m40llm_free(ctx, dq);
  m40llm_free(ctx, dev);
  free(k);
  free(v);
  free(q);
  free(host);
  m40llm_kvcache_destroy(c);
}

void t_cases_graph(m40llm_context *ctx, m40llm_context *cpu, int small) {
  api_case(ctx);
  weights_case();
  tiers_case(ctx);
  const int steps = small ? 5 : 9;
  /* GQA with groups of 4 (head_dim 64 and a model's 128) and of 3 (quantized, K Q8 / V Q4,
   * with protected tokens: the window moves every step); prompts of 1, 31, 33, 257 tokens. */
  const graph_shape shapes[] = {
      {M40LLM_KV_F16, M40LLM_KV_SAME, 8, 2, 64, 0, 0, {1, 31, 257}},
      {M40LLM_KV_F16, M40LLM_KV_SAME, 32, 8, 128, 0, 0, {33, 1, 130}},
      {M40LLM_KV_Q8, M40LLM_KV_Q4, 12, 4, 64, 4, 16, {257, 5, 40}},
  };
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
    graph_case(ctx, cpu, shapes[i], steps, i > 0);
  growth_case();
  t_set_case("");
}
