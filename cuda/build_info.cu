// What the CUDA backend was built for, and which of that a GPU runs. The build system names the
// architectures in M40LLM_CUDA_ARCHITECTURES (CMake's CUDA_ARCHITECTURES form, written by
// CMakeLists.txt and by rust/m40llm-sys/build.rs alike); nvcc alone knows what it compiles
// (__CUDA_ARCH_LIST__) but not which of it is SASS and which PTX, so the two are checked against
// each other here, at compile time.
#include "backend_cuda.h"
#include "common.cuh"
#include "tuning.cuh"

#ifndef M40LLM_CUDA_ARCHITECTURES
#error "M40LLM_CUDA_ARCHITECTURES must name the architectures built (CMakeLists.txt and rust/m40llm-sys/build.rs define it)"
#endif
#ifndef __CUDA_ARCH_LIST__
#error "nvcc defines no __CUDA_ARCH_LIST__: m40llm needs CUDA 11.8 or newer"
#endif

namespace {

constexpr char kArchs[] = M40LLM_CUDA_ARCHITECTURES;
// The architectures nvcc compiles, as __CUDA_ARCH__ values (520 for compute_52).
constexpr int kCompiled[] = {__CUDA_ARCH_LIST__};

constexpr bool starts_with(const char *s, const char *prefix) {
  while (*prefix)
    if (*s++ != *prefix++) return false;
  return true;
}

// The entry of a list that starts at s[i]: "NN-real" or "NN-virtual", NN possibly followed by
// letters (CMake's 90a: the same architecture number); end is where the next one starts.
struct Entry {
  bool ok;
  int arch;
  bool real;
  int end;
};

constexpr Entry entry_at(const char *s, int i) {
  Entry e{false, 0, false, i};
  int j = i;
  while (s[j] >= '0' && s[j] <= '9') e.arch = 10 * e.arch + (s[j++] - '0');
  if (j == i) return e;
  while (s[j] >= 'a' && s[j] <= 'z') j++;
  if (starts_with(s + j, "-real")) {
    e.real = true;
    j += 5;
  } else if (starts_with(s + j, "-virtual")) {
    j += 8;
  } else {
    return e;
  }
  e.ok = s[j] == ';' || s[j] == '\0';
  e.end = s[j] == ';' ? j + 1 : j;
  return e;
}

// Whether kArchs lists arch: as SASS where `sass`, else as SASS or PTX.
constexpr bool listed(int arch, bool sass) {
  for (int i = 0; kArchs[i] != '\0';) {
    const Entry e = entry_at(kArchs, i);
    if (!e.ok) return false;
    if (e.arch == arch && (e.real || !sass)) return true;
    i = e.end;
  }
  return false;
}

constexpr bool compiled(int arch) {
  for (int c : kCompiled)
    if (c == 10 * arch) return true;
  return false;
}

// Whether kArchs is well formed and names exactly the architectures nvcc compiles.
constexpr bool matches_nvcc() {
  if (kArchs[0] == '\0') return false;
  for (int i = 0; kArchs[i] != '\0';) {
    const Entry e = entry_at(kArchs, i);
    if (!e.ok || !compiled(e.arch)) return false;
    i = e.end;
  }
  for (int c : kCompiled)
    if (!listed(c / 10, false)) return false;
  return true;
}

static_assert(matches_nvcc(),
              "M40LLM_CUDA_ARCHITECTURES does not name what nvcc compiles (__CUDA_ARCH_LIST__): "
              "give the architectures through CMAKE_CUDA_ARCHITECTURES (CMake) or "
              "M40LLM_CUDA_ARCHS / CUDA_COMPUTE_CAP (cargo), not as extra -gencode flags");

constexpr int newest_compiled() {
  int newest = 0;
  for (int c : kCompiled) newest = c > newest ? c : newest;
  return newest;
}

// Never launched: its attributes say which of the build's images the GPU loads. Every .cu file
// is compiled for the same architectures, so the library's kernels load the same one.
__global__ void probe_kernel() {}

}  // namespace

void m40llm_cuda_build_info(m40llm_build_info *out) {
  out->cuda_architectures = kArchs;
  out->cuda_toolkit_version = CUDART_VERSION;
  out->tensor_cores = kTensorCores && newest_compiled() >= 800;
}

int m40llm_cuda_device_code(int *kernel_arch, int *native) {
  cudaFuncAttributes attr;
  M40LLM_CUDA_TRY(cudaFuncGetAttributes(&attr, probe_kernel));
  // binaryVersion is the SASS the GPU runs: one built in, or the JIT's, made for exactly this
  // GPU's architecture, of which the build can then have had no SASS (the driver would have
  // taken it). ptxVersion is the architecture either was compiled from.
  *native = listed(attr.binaryVersion, true);
  *kernel_arch = attr.ptxVersion;
  return M40LLM_OK;
}
