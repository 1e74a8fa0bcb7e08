// Helpers of the CUDA kernels (included by the .cu files only, compiled by nvcc): typed loads,
// acc = grad + residual, dtype dispatch, error checks. A .h so that the Makefile sees it change.
// fp32 arithmetic goes through __fadd_rn / __fmul_rn / __fdiv_rn: IEEE round-to-nearest, never
// contracted into an FMA (nvcc -fmad=false as well), so results match the CPU bit for bit.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../common.h"
#include "kernels.h"

namespace cloudtrain::cuda {

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("cloudtrain CUDA error in ") + what + ": " +
                             cudaGetErrorString(err));
}
#define CT_CUDA_CHECK(expr) ::cloudtrain::cuda::check((expr), #expr)
#define CT_LAUNCH_CHECK() ::cloudtrain::cuda::check(cudaGetLastError(), __func__)

constexpr int kNone = static_cast<int>(Dtype::kNone);
constexpr int kF32 = static_cast<int>(Dtype::kFloat32);
constexpr int kBF16 = static_cast<int>(Dtype::kBFloat16);
constexpr int kF16 = static_cast<int>(Dtype::kFloat16);

template <int D>
__device__ __forceinline__ float load(const void* p, int64_t i) {
  if constexpr (D == kF32) return static_cast<const float*>(p)[i];
  if constexpr (D == kBF16) return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  if constexpr (D == kF16) return __half2float(static_cast<const __half*>(p)[i]);
  return 0.0f;
}

// acc(i) = float(grad[i]) + float(residual[i]), one fp32 rounding, as reference.py.
template <int G, int R>
__device__ __forceinline__ float acc_at(const void* g, const void* r, int64_t i) {
  float a = load<G>(g, i);
  if constexpr (R != kNone) a = __fadd_rn(a, load<R>(r, i));
  return a;
}

template <int R>
__device__ __forceinline__ void store_residual(void* r, int64_t i, float x) {
  if constexpr (R == kF32) static_cast<float*>(r)[i] = x;
  if constexpr (R == kBF16) static_cast<uint16_t*>(r)[i] = bf16_bits(x);
}

// f(integral_constant<int, G>, integral_constant<int, R>) for grad dtype G and residual R.
template <typename F>
void dispatch(Dtype grad, Dtype residual, F&& f) {
  auto with_residual = [&](auto g) {
    switch (residual) {
      case Dtype::kNone:
        return f(g, std::integral_constant<int, kNone>{});
      case Dtype::kFloat32:
        return f(g, std::integral_constant<int, kF32>{});
      case Dtype::kBFloat16:
        return f(g, std::integral_constant<int, kBF16>{});
      default:
        throw std::runtime_error("cloudtrain CUDA: residual must be float32 or bfloat16");
    }
  };
  switch (grad) {
    case Dtype::kFloat32:
      return with_residual(std::integral_constant<int, kF32>{});
    case Dtype::kBFloat16:
      return with_residual(std::integral_constant<int, kBF16>{});
    case Dtype::kFloat16:
      return with_residual(std::integral_constant<int, kF16>{});
    default:
      throw std::runtime_error("cloudtrain CUDA: grad must be float32, bfloat16 or float16");
  }
}

// Blocks for a grid-stride loop over n items: enough to fill the device, no more.
inline int grid_for(int64_t n, int threads) {
  int device = 0, sms = 0;
  CT_CUDA_CHECK(cudaGetDevice(&device));
  CT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<int>(std::clamp<int64_t>(blocks, 1, static_cast<int64_t>(sms) * 32));
}

}  // namespace cloudtrain::cuda
