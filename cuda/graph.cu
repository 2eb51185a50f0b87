// Graphs of a context's calls (m40llm.h, "Graphs"): the context's stream captured, the captured
// graph applied to an executable one (updated in place where the runtime takes it), launched.
#include "backend_cuda.h"
#include "common.cuh"

namespace {

cudaStreamCaptureStatus capture_status(cudaStream_t st, cudaError_t *err) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  *err = cudaStreamIsCapturing(st, &status);
  return status;
}

// cudaGraphExecUpdate, whose signature changed in CUDA 12. A refusal (another topology: e.g.
// a sequence now needs the combine kernel) is not an error: the caller instantiates instead.
bool update_in_place(cudaGraphExec_t exec, cudaGraph_t graph) {
#if CUDART_VERSION >= 12000
  cudaGraphExecUpdateResultInfo info;
  const cudaError_t err = cudaGraphExecUpdate(exec, graph, &info);
#else
  cudaGraphNode_t node;
  cudaGraphExecUpdateResult result;
  const cudaError_t err = cudaGraphExecUpdate(exec, graph, &node, &result);
#endif
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err == cudaSuccess;
}

}  // namespace

int m40llm_cuda_capturing(const m40llm_context *ctx) {
  cudaError_t err;
  const cudaStreamCaptureStatus status = capture_status(cuda_state(ctx)->stream, &err);
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err != cudaSuccess || status != cudaStreamCaptureStatusNone;
}

int m40llm_cuda_graph_begin(m40llm_context *ctx) {
  M40LLM_CUDA_ENTER(ctx);
  const cudaStream_t st = cuda_state(ctx)->stream;
  cudaError_t err;
  const cudaStreamCaptureStatus status = capture_status(st, &err);
  if (err != cudaSuccess) return m40llm_cuda_error(err, "cudaStreamIsCapturing");
  if (status != cudaStreamCaptureStatusNone)
    return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT,
                       "the context's stream is already being captured (end that capture with "
                       "m40llm_graph_capture_end first)");
  // Thread-local: only this thread's unsafe CUDA calls (a synchronize, an allocation) end it.
  M40LLM_CUDA_TRY(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  return M40LLM_OK;
}

int m40llm_cuda_graph_end(m40llm_context *ctx, void **exec, int *updated) {
  M40LLM_CUDA_ENTER(ctx);
  const cudaStream_t st = cuda_state(ctx)->stream;
  cudaError_t err;
  const cudaStreamCaptureStatus status = capture_status(st, &err);
  if (err != cudaSuccess) return m40llm_cuda_error(err, "cudaStreamIsCapturing");
  if (status == cudaStreamCaptureStatusNone)
    return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT,
                       "the context's stream is not being captured (m40llm_graph_capture_begin "
                       "starts a capture)");
  cudaGraph_t graph = nullptr;
  err = cudaStreamEndCapture(st, &graph);
  if (err != cudaSuccess) {
    if (graph) (void)cudaGraphDestroy(graph);
    return m40llm_cuda_error(err,
                             "cudaStreamEndCapture (the capture was invalidated: something that "
                             "cannot be captured ran on the stream or this thread during it)");
  }
  if (!exec) {  // discarded
    M40LLM_CUDA_TRY(cudaGraphDestroy(graph));
    return M40LLM_OK;
  }
  int rc = M40LLM_OK;
  const cudaGraphExec_t old = static_cast<cudaGraphExec_t>(*exec);
  if (old && update_in_place(old, graph)) {
    *updated = 1;
  } else {
    cudaGraphExec_t fresh = nullptr;
    err = cudaGraphInstantiateWithFlags(&fresh, graph, 0);
    if (err != cudaSuccess) {
      rc = m40llm_cuda_error(err, "cudaGraphInstantiateWithFlags");
    } else {
      if (old) (void)cudaGraphExecDestroy(old);  // released once its launches in flight end
      *exec = fresh;
      *updated = 0;
    }
  }
  (void)cudaGraphDestroy(graph);
  return rc;
}

int m40llm_cuda_graph_launch(m40llm_context *ctx, void *exec) {
  M40LLM_CUDA_ENTER(ctx);
  M40LLM_CUDA_TRY(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec), cuda_state(ctx)->stream));
  return M40LLM_OK;
}

void m40llm_cuda_graph_destroy(void *exec) {
  (void)cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec));
  (void)cudaGetLastError();
}
