// The rotation of quantized K/V (the normalized Walsh-Hadamard transform over blocks of the
// row: m40llm_rotate_f32 in c/src/kv_format.c), one row a warp, in registers: lane l holds dims
// l, l + 32, l + 64, .. of the row (head_dim a multiple of 32). Butterflies of dims less than 32
// apart cross lanes by shuffles, the others pair a lane's own registers. Each butterfly is the
// same FP32 (a + c, a - c) as the CPU's, and the stages come in the same order, so the append
// kernel stores what the CPU backend stores.
#pragma once

// v[e] is dim lane + 32 e of the row, for e < dim / 32 (EMAX >= that, a compile-time bound).
template <int EMAX>
__device__ __forceinline__ void warp_rotate(float (&v)[EMAX], int dim, float scale) {
  const int lane = threadIdx.x & 31, block = dim & -dim;
  for (int h = 1; h < block && h < 32; h <<= 1) {
#pragma unroll
    for (int e = 0; e < EMAX; e++) {
      const float other = __shfl_xor_sync(0xffffffffu, v[e], h);
      v[e] = lane & h ? other - v[e] : v[e] + other;  // (a + c) below, (a - c) above
    }
  }
#pragma unroll
  for (int k = 1; k < EMAX; k <<= 1) {
    if (32 * k >= block) break;
#pragma unroll
    for (int e = 0; e < EMAX; e++) {
      if (!(e & k) && (e | k) < EMAX) {
        const float a = v[e], c = v[e | k];
        v[e] = a + c;
        v[e | k] = a - c;
      }
    }
  }
#pragma unroll
  for (int e = 0; e < EMAX; e++) v[e] *= scale;
}
