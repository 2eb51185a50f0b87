/* 16-bit floating-point conversions, and the element types of the caller's rows (m40llm_dtype). */
#include <string.h>

#include "internal.h"

uint16_t m40llm_f32_to_f16(float f) {
  uint32_t x;
  memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) { /* inf or NaN; NaN stays a quiet NaN */
    return (uint16_t)(sign | 0x7c00u | (abs > 0x7f800000u ? 0x0200u | ((abs >> 13) & 0x3ffu) : 0u));
  }
  if (abs >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past 65504 */
  if (abs >= 0x38800000u) {                                  /* normal half */
    const uint32_t mant_rounded = abs + 0xfffu + ((abs >> 13) & 1u);
    return (uint16_t)(sign | ((mant_rounded - 0x38000000u) >> 13));
  }
  if (abs < 0x33000000u) return (uint16_t)sign; /* below half the smallest subnormal */
  /* subnormal half: shift the full significand into place, rounding to nearest even */
  const uint32_t e = abs >> 23;
  const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e; /* 14..24 */
  uint32_t h = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (h & 1u))) h++;
  return (uint16_t)(sign | h);
}

float m40llm_f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t x;
  if (exp == 0x1fu) {
    x = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    x = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    x = sign;
  } else { /* subnormal: normalise */
    exp = 113u;
    while (!(mant & 0x400u)) {
      mant <<= 1;
      exp--;
    }
    x = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  memcpy(&f, &x, sizeof f);
  return f;
}

uint16_t m40llm_f32_to_bf16(float f) {
  uint32_t x;
  memcpy(&x, &f, sizeof x);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x0040u); /* quiet NaN */
  x += 0x7fffu + ((x >> 16) & 1u); /* to nearest even; overflow carries into inf */
  return (uint16_t)(x >> 16);
}

float m40llm_bf16_to_f32(uint16_t h) {
  const uint32_t x = (uint32_t)h << 16;
  float f;
  memcpy(&f, &x, sizeof f);
  return f;
}

size_t m40llm_dtype_size(int dtype) {
  switch (dtype) {
    case M40LLM_DTYPE_F32: return sizeof(float);
    case M40LLM_DTYPE_F16:
    case M40LLM_DTYPE_BF16: return sizeof(uint16_t);
    default: return 0;
  }
}

float m40llm_dtype_load(const void *p, int dtype, size_t i) {
  if (dtype == M40LLM_DTYPE_F16) return m40llm_f16_to_f32(((const uint16_t *)p)[i]);
  if (dtype == M40LLM_DTYPE_BF16) return m40llm_bf16_to_f32(((const uint16_t *)p)[i]);
  return ((const float *)p)[i];
}

void m40llm_dtype_store(void *p, int dtype, size_t i, float x) {
  if (dtype == M40LLM_DTYPE_F16) ((uint16_t *)p)[i] = m40llm_f32_to_f16(x);
  else if (dtype == M40LLM_DTYPE_BF16) ((uint16_t *)p)[i] = m40llm_f32_to_bf16(x);
  else ((float *)p)[i] = x;
}
