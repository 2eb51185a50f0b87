// The rotation of quantized K/V (the normalized Walsh-Hadamard transform over blocks of the
// row: m40llm_rotate_f32 in c/src/kv_format.c) on rows in shared memory, by a group of
// threads: the same FP32 operations, so the append kernel stores what the CPU backend stores.
#pragma once

// Rotates n_rows rows of dim floats in place: row r's element i at x[r * row_stride + at(i)].
// Threads tid of n_threads take part, sync() makes their shared-memory writes visible to each
// other (__syncthreads for a block, __syncwarp for a warp); it is called after the last step.
template <typename At, typename Sync>
__device__ __forceinline__ void rotate_rows(float *x, int n_rows, int row_stride, int dim,
                                            float scale, int tid, int n_threads, At at,
                                            Sync sync) {
  const int block = dim & -dim, half = dim / 2;
  for (int h = 1; h < block; h <<= 1) {
    // Pair j of a row: the j-th element with bit h clear, and that element + h.
    for (int t = tid; t < n_rows * half; t += n_threads) {
      const int j = t % half, i = (j / h) * 2 * h + j % h;
      float *row = x + (t / half) * row_stride;
      const float a = row[at(i)], c = row[at(i + h)];
      row[at(i)] = a + c;
      row[at(i + h)] = a - c;
    }
    sync();
  }
  for (int t = tid; t < n_rows * dim; t += n_threads) x[(t / dim) * row_stride + at(t % dim)] *= scale;
  sync();
}

struct IdentityIndex {
  __device__ int operator()(int i) const { return i; }
};
