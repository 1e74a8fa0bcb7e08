// Arithmetic shared by the CPU (csrc/cpu) and CUDA (csrc/cuda) kernels: no torch, no CUDA
// headers, so both g++ and a bare nvcc compile it.
//
// - mag_key: the order used by top-k. |x| as its IEEE bits (monotone for non-negative floats,
//   -0 and +0 both map to 0); every NaN maps to one key just above +inf: NaN ranks above Inf,
//   Inf above every finite value, like torch.topk and compress/reference.py
//   (_selection_magnitude).
// - uniform: the counter-based RNG of stochastic rounding. u = hash(seed, element index), so a
//   code depends on (seed, index) only - not on threads, blocks or scheduling - and the CPU and the
//   CUDA kernels draw the same u for the same element. The hash is two keyed rounds of
//   `lowbias32` (C. Wellons' 32-bit integer hash), 24 bits out, like torch.rand's float32 grid.
// - bf16_bits: float -> bfloat16 with round-to-nearest-even, as torch's copy_ does.
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define CT_HD __host__ __device__ __forceinline__
#else
#define CT_HD inline
#endif

namespace cloudtrain {

CT_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

CT_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

constexpr uint32_t kInfBits = 0x7F800000u;

// Top-k order key of a value: larger key = larger magnitude; all NaNs tie, above +-inf.
CT_HD uint32_t mag_key(float x) {
  const uint32_t u = float_bits(x) & 0x7FFFFFFFu;
  return u > kInfBits ? kInfBits + 1 : u;
}

CT_HD float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// Round to nearest even. NaN becomes 0xFFFF on the CPU (what torch's vectorised CPU copy writes)
// and the canonical 0x7FFF on CUDA (what __float2bfloat16 writes); either way it stays NaN.
CT_HD uint16_t bf16_bits(float x) {
#if defined(__CUDA_ARCH__)
  constexpr uint32_t kNaN = 0x7FFFu;
#else
  constexpr uint32_t kNaN = 0xFFFFu;
#endif
  const uint32_t u = float_bits(x);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > kInfBits ? kNaN : rounded);  // branch-free
}

// A signed integer with the order of the float (-0 just below +0, NaNs beyond +-inf): exact
// min/max that compilers vectorise, which they will not do for floats because of NaN.
CT_HD int32_t ordered_int(float x) {
  const int32_t i = static_cast<int32_t>(float_bits(x));
  return i ^ ((i >> 31) & 0x7FFFFFFF);
}

CT_HD float ordered_float(int32_t o) {
  return bits_float(static_cast<uint32_t>(o ^ ((o >> 31) & 0x7FFFFFFF)));
}

CT_HD uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// u in [0, 1) on a 2^-24 grid, a pure function of (seed, index); index = hi * 2^32 + lo.
CT_HD float uniform_at(uint64_t seed, uint32_t lo, uint32_t hi) {
  uint32_t h = lowbias32(lo ^ static_cast<uint32_t>(seed));
  h = lowbias32(h ^ hi ^ static_cast<uint32_t>(seed >> 32) ^ 0x9E3779B9u);
  return static_cast<float>(h >> 8) * 5.9604644775390625e-8f;  // 2^-24
}

CT_HD float uniform(uint64_t seed, uint64_t index) {
  return uniform_at(seed, static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32));
}

}  // namespace cloudtrain
