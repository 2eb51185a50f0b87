/* m40llm_build_info_get: what the library was built with. The CUDA backend's facts come from
 * cuda/build_info.cu, where the build system's architecture list is checked against nvcc's. */
#include "internal.h"

int m40llm_build_info_get(m40llm_build_info *out) {
  if (!out) return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT, "out is NULL");
  if (out->version != M40LLM_BUILD_INFO_VERSION)
    return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT,
                       "out->version %u is not supported (expected %u; use "
                       "M40LLM_BUILD_INFO_INIT)",
                       out->version, M40LLM_BUILD_INFO_VERSION);
  m40llm_build_info info = M40LLM_BUILD_INFO_INIT;
  info.cuda = m40llm_built_with_cuda();
  info.cuda_architectures = "";
#ifdef M40LLM_HAVE_CUDA
  m40llm_cuda_build_info(&info);
#endif
  *out = info;
  return M40LLM_OK;
}
