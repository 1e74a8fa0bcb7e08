// cloudtrain::ef_quantize on CUDA: one warp per group. The warp reads its group coalesced and
// reduces min/max (as order-preserving integers: exact, NaN-propagating) or sum|acc| with
// shuffles; then it reads the group again (from L1/L2), 32 consecutive elements at a time, codes
// them, writes their residual, and packs the codes of each byte with shuffles. group_size % 8
// == 0, so groups own whole bytes and no two warps write the same byte.
//
// Arithmetic and RNG are those of the CPU kernel (csrc/cpu/quantize.cpp, csrc/common.h):
// nearest rounding matches the reference bit for bit, stochastic rounding matches the CPU
// kernel bit for bit (same counter-based hash of (seed, element index)). The 1-bit scale is an
// fp32 warp sum, equal to torch's sum up to float rounding.
#include "device.h"

namespace cloudtrain::cuda {
namespace {

constexpr int kWarps = 8;  // groups per block

template <int G, int R, int Bits, bool Stochastic>
__global__ void quantize_kernel(const void* g, void* r, int64_t n, int64_t group_size,
                                int64_t groups, uint64_t seed, uint8_t* codes, float* lo_out,
                                float* step_out) {
  const int lane = threadIdx.x & 31;
  const int64_t grp = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (grp >= groups) return;  // whole warps leave together
  const int64_t s = grp * group_size;
  const int64_t e = s + group_size < n ? s + group_size : n;

  float lo, step;
  if constexpr (Bits == 1) {
    float sum = 0.0f;
    for (int64_t i = s + lane; i < e; i += 32) sum = __fadd_rn(sum, fabsf(acc_at<G, R>(g, r, i)));
    for (int o = 16; o > 0; o >>= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xFFFFFFFFu, sum, o));
    const float scale = __fdiv_rn(sum, static_cast<float>(e - s));
    lo = -scale;
    step = __fmul_rn(2.0f, scale);
  } else {
    int32_t mn = INT32_MAX, mx = INT32_MIN;
    for (int64_t i = s + lane; i < e; i += 32) {
      const int32_t o = ordered_int(acc_at<G, R>(g, r, i));
      mn = min(mn, o);
      mx = max(mx, o);
    }
    for (int o = 16; o > 0; o >>= 1) {
      mn = min(mn, __shfl_xor_sync(0xFFFFFFFFu, mn, o));
      mx = max(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, o));
    }
    float fmn = ordered_float(mn), fmx = ordered_float(mx);
    if (fmn != fmn || fmx != fmx) fmn = fmx = __int_as_float(0x7FC00000);  // NaN propagates
    lo = fmn;
    step = __fdiv_rn(__fsub_rn(fmx, fmn), static_cast<float>((1 << Bits) - 1));
  }
  if (lane == 0) {
    lo_out[grp] = lo;
    step_out[grp] = step;
  }

  // Codes, residual and packing, 32 consecutive elements per step (coalesced). The 8 / Bits
  // lanes that share a byte OR their shifted codes together with shuffles; the first writes it.
  constexpr int kPer = 8 / Bits;
  const float top = static_cast<float>((1 << Bits) - 1);
  for (int64_t base = s; base < e; base += 32) {  // uniform across the warp
    const int64_t i = base + lane;
    const bool in = i < e;
    uint32_t code = 0;
    if (in) {
      const float a = acc_at<G, R>(g, r, i);
      if constexpr (Bits == 1) {
        code = a >= 0.0f;
      } else {
        const float t = step > 0.0f ? __fdiv_rn(__fsub_rn(a, lo), step) : 0.0f;
        const float u = Stochastic ? uniform(seed, static_cast<uint64_t>(i)) : 0.5f;
        float v = __fadd_rn(t, u);
        v = v > top ? top : v;
        v = v == v ? v : 0.0f;                                // NaN -> 0, as torch's uint8 cast
        code = static_cast<uint32_t>(static_cast<int32_t>(v));  // v >= 0: floor
      }
      if constexpr (R != kNone) {
        const float decoded = __fadd_rn(lo, __fmul_rn(static_cast<float>(code), step));
        store_residual<R>(r, i, __fsub_rn(a, decoded));
      }
    }
    uint32_t packed = code << ((lane % kPer) * Bits);
#pragma unroll
    for (int o = 1; o < kPer; o <<= 1) packed |= __shfl_xor_sync(0xFFFFFFFFu, packed, o);
    // s is a multiple of 8, so lane % kPer == 0 starts a byte: (i * Bits) / 8 exactly
    if (in && lane % kPer == 0) codes[(i * Bits) >> 3] = static_cast<uint8_t>(packed);
  }
}

template <int G, int R, int Bits, bool Stochastic>
void launch(const void* grad, void* residual, int64_t n, int64_t group_size, uint64_t seed,
            uint8_t* codes, float* lo, float* step, cudaStream_t stream) {
  const int64_t groups = (n + group_size - 1) / group_size;
  const int64_t blocks = (groups + kWarps - 1) / kWarps;
  const auto grid = static_cast<unsigned>(blocks);
  quantize_kernel<G, R, Bits, Stochastic><<<grid, kWarps * 32, 0, stream>>>(
      grad, residual, n, group_size, groups, seed, codes, lo, step);
  CT_LAUNCH_CHECK();
}

}  // namespace

void ef_quantize(const void* grad, Dtype grad_dtype, void* residual, Dtype residual_dtype,
                 int64_t n, int bits, int64_t group_size, bool stochastic, uint64_t seed,
                 uint8_t* codes, float* lo, float* step, cudaStream_t stream) {
  if (n == 0) return;
  if (group_size < 8 || group_size % 8 != 0)
    throw std::runtime_error("cloudtrain CUDA ef_quantize: group_size must be a multiple of 8");
  dispatch(grad_dtype, residual_dtype, [&](auto g_tag, auto r_tag) {
    constexpr int G = decltype(g_tag)::value;
    constexpr int R = decltype(r_tag)::value;
    auto run = [&](auto bits_tag, auto stochastic_tag) {
      launch<G, R, decltype(bits_tag)::value, decltype(stochastic_tag)::value>(
          grad, residual, n, group_size, seed, codes, lo, step, stream);
    };
    using std::integral_constant;
    using Yes = integral_constant<bool, true>;
    using No = integral_constant<bool, false>;
    switch (bits) {
      case 1:
        return run(integral_constant<int, 1>{}, No{});
      case 2:
        return stochastic ? run(integral_constant<int, 2>{}, Yes{})
                          : run(integral_constant<int, 2>{}, No{});
      case 4:
        return stochastic ? run(integral_constant<int, 4>{}, Yes{})
                          : run(integral_constant<int, 4>{}, No{});
      case 8:
        return stochastic ? run(integral_constant<int, 8>{}, Yes{})
                          : run(integral_constant<int, 8>{}, No{});
      default:
        throw std::runtime_error("cloudtrain CUDA ef_quantize: bits must be 1, 2, 4 or 8");
    }
  });
}

}  // namespace cloudtrain::cuda
