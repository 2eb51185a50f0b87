/* Graphs of a context's calls (m40llm.h, "Graphs"): the front end's checks around the backend's
 * capture, update and launch. */
#include <stdlib.h>

#include "internal.h"

struct m40llm_graph {
  m40llm_context *ctx;
  void *exec; /* the backend's executable graph */
};

static int has_graphs(const m40llm_context *ctx) {
  if (ctx->ops->graph_begin) return M40LLM_OK;
  return m40llm_fail(M40LLM_ERR_UNSUPPORTED,
                     "graphs need the CUDA backend (this context runs on the CPU, whose calls "
                     "complete before they return)");
}

int m40llm_graph_capture_begin(m40llm_context *ctx) {
  if (!ctx) return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT, "ctx is NULL");
  int rc = has_graphs(ctx);
  if (rc == M40LLM_OK) rc = m40llm_context_check(ctx);
  return rc != M40LLM_OK ? rc : m40llm_context_result(ctx, ctx->ops->graph_begin(ctx));
}

int m40llm_graph_capture_end(m40llm_graph **graph, m40llm_context *ctx, int *out_updated) {
  if (!ctx) return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT, "ctx is NULL");
  if (graph && *graph && (*graph)->ctx != ctx)
    return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT,
                       "*graph was captured on another context (pass NULL for a new graph)");
  int rc = has_graphs(ctx);
  if (rc == M40LLM_OK) rc = m40llm_context_check(ctx);
  if (rc != M40LLM_OK) return rc;
  if (!graph) return m40llm_context_result(ctx, ctx->ops->graph_end(ctx, NULL, NULL));
  m40llm_graph *g = *graph;
  if (!g) {
    g = m40llm_host_calloc(1, sizeof *g);
    if (!g) {
      /* The capture ends anyway (discarded), so the stream is not left capturing. */
      (void)m40llm_context_result(ctx, ctx->ops->graph_end(ctx, NULL, NULL));
      return m40llm_fail(M40LLM_ERR_OUT_OF_MEMORY, "allocating a graph handle (the capture "
                                                   "is discarded)");
    }
    g->ctx = ctx;
  }
  int updated = 0;
  rc = m40llm_context_result(ctx, ctx->ops->graph_end(ctx, &g->exec, &updated));
  if (rc != M40LLM_OK) {
    if (!*graph) free(g);
    return rc;
  }
  *graph = g;
  if (out_updated) *out_updated = updated;
  return M40LLM_OK;
}

int m40llm_graph_launch(m40llm_graph *graph) {
  if (!graph) return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT, "graph is NULL");
  const int rc = m40llm_context_check(graph->ctx);
  return rc != M40LLM_OK ? rc
                         : m40llm_context_result(graph->ctx,
                                                 graph->ctx->ops->graph_launch(graph->ctx,
                                                                               graph->exec));
}

void m40llm_graph_destroy(m40llm_graph *graph) {
  if (!graph) return;
  graph->ctx->ops->graph_destroy(graph->exec);
  free(graph);
}
