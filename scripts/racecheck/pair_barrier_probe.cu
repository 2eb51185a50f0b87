// Does compute-sanitizer's racecheck order shared-memory accesses across a __syncthreads() that
// follows barriers of pairs of warps (bar.sync id, 64)? attn_mma_kernel splits head_dims over
// 128 between two warps, which exchange partial scores through a double buffer at such a
// barrier, step by step; afterwards each warp stores its state and output, and after a
// __syncthreads() every warp reads the others'. This kernel does the same in a few lines and
// is race-free by construction (each store is two pair barriers, or a block barrier, before
// any load of its word), so a hazard that racecheck reports here is the tool's.
// scripts/gpu_check.sh's sanitize step runs it to know how to read the library's report.
#include <cstdio>

__global__ void pairs_then_block(float *out, int steps0, int steps1) {
  __shared__ float4 s_part[2][4][32];
  __shared__ float s_state[2][8];
  extern __shared__ float4 s_out[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, pair = warp / 2;
  const int n = pair == 0 ? steps0 : steps1;  // the pairs' step counts differ, as a split's may
  float acc = 0.0f;
  int part = 0;
  for (int i = 0; i < n; i++) {
    s_part[part][warp][lane] = make_float4(i + lane, 1, 2, 3);
    asm volatile("bar.sync %0, 64;" ::"r"(1 + pair) : "memory");
    acc += s_part[part][warp ^ 1][lane].x;
    part ^= 1;
  }
  if ((warp & 1) == 0 && lane < 8) s_state[pair][lane] = acc;
  s_out[warp * 32 + lane] = make_float4(acc, acc, acc, acc);
  __syncthreads();
  out[threadIdx.x] = s_out[((warp + 1) & 3) * 32 + lane].x + s_state[(pair + 1) & 1][lane & 7];
}

int main() {
  float *d = nullptr;
  if (cudaMalloc(&d, 128 * sizeof(float)) != cudaSuccess) return 2;
  for (int steps1 = 2; steps1 <= 3; steps1++)
    pairs_then_block<<<4, 128, 128 * sizeof(float4)>>>(d, 3, steps1);
  const cudaError_t err = cudaDeviceSynchronize();
  std::printf("%s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
