// The online-softmax state every attention kernel and the combine keep: a running max m and a
// running sum l of exp2(x - m) over what they have seen (scores live in the log2 domain). Each
// kernel also keeps an output accumulator that it rescales by what raise() returns and adds to
// with the weights of weight() and add_partial().
//
// A score of -inf (a masked position: K may hold infinities) has weight 0 wherever it falls:
// while every score seen is -inf, m stays -inf, and the weights and factors are taken against
// the lowest finite float instead of m, so no exp2(-inf - -inf) makes a NaN. A state that saw only -inf has l = 0, and
// its output is zeros (inv_sum()).
#pragma once

#include <float.h>
#include <math.h>

// A kernel may keep its running max until a score passes it by more than this (log2 units), so
// that its weights stay under 2^8 and most tiles skip the max's reduction and the rescale; the
// state's (m, l) is then exact about the max it kept, which any merge takes as it is.
constexpr float kSoftmaxSlack = 8.0f;

// exp2 with subnormal results flushed to 0 (MUFU.EX2 and its range step: 2 instructions on sm_52
// where exp2f takes 5): for a weight, 2^-126 of the max's is below what any sum it joins resolves.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A plain aggregate, so that it can live in shared memory: start from SoftmaxState::empty().
struct SoftmaxState {
  float m, l;

  __device__ __forceinline__ static SoftmaxState empty() { return SoftmaxState{-INFINITY, 0.0f}; }
  // An empty state whose max is already m (the largest of the states it will merge).
  __device__ __forceinline__ static SoftmaxState at_max(float m) { return SoftmaxState{m, 0.0f}; }

  // m, or the lowest finite float in place of -inf: one FMNMX.
  __device__ __forceinline__ static float reference(float m) { return fmaxf(m, -FLT_MAX); }

  // Raises the running max to cover x_max (the largest of what comes next) and returns the
  // factor that everything accumulated so far must be rescaled by; l is rescaled here.
  __device__ __forceinline__ float raise(float x_max) {
    const float m_new = fmaxf(m, x_max);
    const float alpha = exp2f(m - reference(m_new));
    m = m_new;
    l *= alpha;
    return alpha;
  }

  // The weight of score x against the running max (raised to cover x first).
  __device__ __forceinline__ float weight(float x) const { return exp2f(x - reference(m)); }

  // Merges another state's (max mp, sum lp), raise()d to cover mp first; returns the weight the
  // caller's accumulator takes that state's output with.
  __device__ __forceinline__ float add_partial(float mp, float lp) {
    const float w = weight(mp);
    l = fmaf(w, lp, l);
    return w;
  }

  // 1 / l, or 0 where nothing had weight (the output is then zeros).
  __device__ __forceinline__ float inv_sum() const { return l > 0.0f ? 1.0f / l : 0.0f; }
  // o / l, or 0 where nothing had weight.
  __device__ __forceinline__ float normalise(float o) const { return l > 0.0f ? o / l : 0.0f; }
};
