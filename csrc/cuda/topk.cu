// cloudtrain::ef_topk_select on CUDA: exact top-k with error feedback in one pass over grad.
//
// Same contract as the CPU kernel (csrc/cpu/topk.cpp): the k largest mag_key(acc), ties at the
// k-th going to the lowest indices, indices ascending. Here:
// 1. sampled (n >= 2^20, k <= n/16): mag_key of 65536 strided elements, sorted on the device;
//    the threshold T is the sample's ks-th largest (ks ~ 1.5 k m / n + slack, as on the CPU).
//    One fused pass computes acc, leaves it in an fp32 residual and appends every element with
//    key >= T to a candidate list (a block scan and one atomic per tile of 2048; the order does
//    not matter, the sort below fixes it). The host reads the candidate count (one stream
//    sync) to size the sort. If T admitted fewer than k (or more than the buffer holds), fall
//    back to 2.
// 2. full: every element is a candidate.
// Candidates carry a 64-bit key (mag_key << 32 | ~index): a descending radix sort (CUB) puts
// larger magnitudes first and, among equal magnitudes, lower indices first; the first k are the
// answer, sorted again by index. Residual: fp32 written in the pass and zeroed at the k indices;
// bf16 written afterwards from a recomputed acc, then zeroed.
#include <cub/cub.cuh>

#include <cmath>

#include "device.h"

namespace cloudtrain::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kItems = 8;  // elements per thread per tile of the sampled pass
constexpr int64_t kSample = 1 << 16;

__device__ __forceinline__ uint64_t candidate_key(float a, int64_t i) {
  return static_cast<uint64_t>(mag_key(a)) << 32 | static_cast<uint32_t>(~static_cast<uint32_t>(i));
}

template <int G, int R>
__global__ void sample_kernel(const void* g, const void* r, int64_t m, int64_t stride,
                              uint32_t* keys) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j < m) keys[j] = mag_key(acc_at<G, R>(g, r, j * stride));
}

// Sampled pass: acc (-> fp32 residual) and candidates with key >= *threshold. Each block takes
// tiles of kThreads * kItems elements (coalesced loads), counts its hits with a block scan and
// reserves room for them with one atomicAdd per tile.
template <int G, int R, bool WriteF32>
__global__ void __launch_bounds__(kThreads)
    collect_kernel(const void* g, void* r, int64_t n, const uint32_t* threshold,
                   unsigned long long* count, int64_t cap, uint64_t* keys, float* vals) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ unsigned long long tile_base;
  const uint32_t t = *threshold;
  constexpr int64_t kTile = static_cast<int64_t>(kThreads) * kItems;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kTile; base < n;
       base += static_cast<int64_t>(gridDim.x) * kTile) {  // uniform across the block
    float a[kItems];
    bool hit[kItems];
    int mine = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = base + j * kThreads + threadIdx.x;
      a[j] = 0.0f;
      hit[j] = false;
      if (i < n) {
        a[j] = acc_at<G, R>(g, r, i);
        if constexpr (WriteF32) static_cast<float*>(r)[i] = a[j];
        hit[j] = mag_key(a[j]) >= t;
      }
      mine += hit[j];
    }
    int offset = 0, total = 0;
    Scan(scan_storage).ExclusiveSum(mine, offset, total);
    if (threadIdx.x == 0 && total > 0)
      tile_base = atomicAdd(count, static_cast<unsigned long long>(total));
    __syncthreads();
    if (total > 0) {
      unsigned long long p = tile_base + offset;
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        if (hit[j]) {
          if (p < static_cast<unsigned long long>(cap)) {
            keys[p] = candidate_key(a[j], base + j * kThreads + threadIdx.x);
            vals[p] = a[j];
          }
          ++p;
        }
      }
    }
    __syncthreads();  // scan_storage and tile_base are reused by the next tile
  }
}

// Full path: every element is a candidate.
template <int G, int R, bool WriteF32>
__global__ void all_keys_kernel(const void* g, void* r, int64_t n, uint64_t* keys, float* vals) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const float a = acc_at<G, R>(g, r, i);
    if constexpr (WriteF32) static_cast<float*>(r)[i] = a;
    keys[i] = candidate_key(a, i);
    vals[i] = a;
  }
}

__global__ void take_kernel(const uint64_t* keys, const float* vals, int64_t k, uint32_t* idx,
                            float* v) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j < k) {
    idx[j] = ~static_cast<uint32_t>(keys[j]);
    v[j] = vals[j];
  }
}

__global__ void finish_kernel(const uint32_t* idx, const float* v, int64_t k, int64_t* indices,
                              float* values) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j < k) {
    indices[j] = static_cast<int64_t>(idx[j]);
    values[j] = v[j];
  }
}

// k == n: every element sent, nothing left behind.
template <int G, int R>
__global__ void everything_kernel(const void* g, void* r, int64_t n, int64_t* indices,
                                  float* values) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    indices[i] = i;
    values[i] = acc_at<G, R>(g, r, i);
    store_residual<R>(r, i, 0.0f);
  }
}

// residual = acc (fp32 or rounded to bf16)
template <int G, int R>
__global__ void residual_kernel(const void* g, void* r, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    store_residual<R>(r, i, acc_at<G, R>(g, r, i));
}

template <typename T>
__global__ void zero_at_kernel(T* r, const int64_t* indices, int64_t k) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j < k) r[indices[j]] = T(0);
}

inline unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>((n + kThreads - 1) / kThreads);
}

// The first k of `count` candidates in (magnitude desc, index asc) order -> indices ascending.
void select_candidates(const uint64_t* keys, const float* vals, int64_t count, int64_t k,
                       int64_t* indices, float* values, const Scratch& scratch,
                       cudaStream_t stream) {
  uint64_t* sorted_keys = scratch.get<uint64_t>(count);
  float* sorted_vals = scratch.get<float>(count);
  size_t bytes = 0;
  CT_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(
      nullptr, bytes, keys, sorted_keys, vals, sorted_vals, count, 0, 63, stream));
  void* temp = scratch.get<uint8_t>(bytes);
  CT_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(
      temp, bytes, keys, sorted_keys, vals, sorted_vals, count, 0, 63, stream));

  uint32_t* idx = scratch.get<uint32_t>(k);
  float* v = scratch.get<float>(k);
  uint32_t* idx_sorted = scratch.get<uint32_t>(k);
  float* v_sorted = scratch.get<float>(k);
  take_kernel<<<blocks_for(k), kThreads, 0, stream>>>(sorted_keys, sorted_vals, k, idx, v);
  CT_LAUNCH_CHECK();
  bytes = 0;
  CT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, idx, idx_sorted, v, v_sorted, k,
                                                0, 32, stream));
  temp = scratch.get<uint8_t>(bytes);
  CT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, bytes, idx, idx_sorted, v, v_sorted, k, 0,
                                                32, stream));
  finish_kernel<<<blocks_for(k), kThreads, 0, stream>>>(idx_sorted, v_sorted, k, indices, values);
  CT_LAUNCH_CHECK();
}

template <int G, int R, bool WriteF32>
void full_select(const void* g, void* r, int64_t n, int64_t k, int64_t* indices, float* values,
                 const Scratch& scratch, cudaStream_t stream) {
  uint64_t* keys = scratch.get<uint64_t>(n);
  float* vals = scratch.get<float>(n);
  all_keys_kernel<G, R, WriteF32><<<grid_for(n, kThreads), kThreads, 0, stream>>>(g, r, n, keys,
                                                                                   vals);
  CT_LAUNCH_CHECK();
  select_candidates(keys, vals, n, k, indices, values, scratch, stream);
}

// Step 1 of the file comment; false when the threshold admitted fewer than k or too many
// candidates (an fp32 residual then holds acc all the same).
template <int G, int R>
bool sampled_select(const void* g, void* r, int64_t n, int64_t k, int64_t* indices,
                    float* values, const Scratch& scratch, cudaStream_t stream) {
  const int64_t m = kSample;
  uint32_t* sample = scratch.get<uint32_t>(m);
  uint32_t* sorted = scratch.get<uint32_t>(m);
  sample_kernel<G, R><<<blocks_for(m), kThreads, 0, stream>>>(g, r, m, n / m, sample);
  CT_LAUNCH_CHECK();
  size_t bytes = 0;
  CT_CUDA_CHECK(
      cub::DeviceRadixSort::SortKeysDescending(nullptr, bytes, sample, sorted, m, 0, 32, stream));
  void* temp = scratch.get<uint8_t>(bytes);
  CT_CUDA_CHECK(
      cub::DeviceRadixSort::SortKeysDescending(temp, bytes, sample, sorted, m, 0, 32, stream));
  const double expected = static_cast<double>(k) * m / n;
  const int64_t ks = std::min<int64_t>(
      m, static_cast<int64_t>(std::ceil(1.5 * expected + 6 * std::sqrt(expected) + 16)));
  const int64_t cap = std::min<int64_t>(
      n, 3 * static_cast<int64_t>(std::ceil(static_cast<double>(ks) * n / m)) + (1 << 16));

  unsigned long long* count = scratch.get<unsigned long long>(1);
  uint64_t* keys = scratch.get<uint64_t>(cap);
  float* vals = scratch.get<float>(cap);
  CT_CUDA_CHECK(cudaMemsetAsync(count, 0, sizeof(*count), stream));
  const int grid = grid_for((n + kItems - 1) / kItems, kThreads);
  collect_kernel<G, R, R == kF32><<<grid, kThreads, 0, stream>>>(g, r, n, sorted + (ks - 1),
                                                                 count, cap, keys, vals);
  CT_LAUNCH_CHECK();
  unsigned long long found = 0;
  CT_CUDA_CHECK(cudaMemcpyAsync(&found, count, sizeof(found), cudaMemcpyDeviceToHost, stream));
  CT_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (found < static_cast<unsigned long long>(k) || found > static_cast<unsigned long long>(cap))
    return false;
  select_candidates(keys, vals, static_cast<int64_t>(found), k, indices, values, scratch, stream);
  return true;
}

}  // namespace

void ef_topk_select(const void* grad, Dtype grad_dtype, void* residual, Dtype residual_dtype,
                    int64_t n, int64_t k, int64_t* indices, float* values, const Scratch& scratch,
                    cudaStream_t stream) {
  if (n == 0) return;
  if (n > 0xFFFFFFFFLL || k < 0 || k > n)
    throw std::runtime_error("cloudtrain CUDA ef_topk_select: needs 0 <= k <= n < 2^32");
  dispatch(grad_dtype, residual_dtype, [&](auto g_tag, auto r_tag) {
    constexpr int G = decltype(g_tag)::value;
    constexpr int R = decltype(r_tag)::value;
    const int grid = grid_for(n, kThreads);
    if (k == n) {
      everything_kernel<G, R><<<grid, kThreads, 0, stream>>>(grad, residual, n, indices, values);
      CT_LAUNCH_CHECK();
      return;
    }
    if (k > 0) {
      const bool sample = n >= (1 << 20) && k <= n / 16;
      const bool done = sample && sampled_select<G, R>(grad, residual, n, k, indices, values,
                                                       scratch, stream);
      if (!done) {
        if (sample && R == kF32)  // the sampled pass already left acc in the residual
          full_select<kF32, kNone, false>(residual, nullptr, n, k, indices, values, scratch,
                                          stream);
        else
          full_select<G, R, R == kF32>(grad, residual, n, k, indices, values, scratch, stream);
      }
      if constexpr (R == kF32) {
        zero_at_kernel<float><<<blocks_for(k), kThreads, 0, stream>>>(
            static_cast<float*>(residual), indices, k);
        CT_LAUNCH_CHECK();
        return;
      }
    }
    if constexpr (R != kNone) {  // k == 0 (fp32 or bf16), or bf16 after the selection
      residual_kernel<G, R><<<grid, kThreads, 0, stream>>>(grad, residual, n);
      CT_LAUNCH_CHECK();
      if constexpr (R == kBF16) {
        if (k > 0) {
          zero_at_kernel<uint16_t><<<blocks_for(k), kThreads, 0, stream>>>(
              static_cast<uint16_t*>(residual), indices, k);
          CT_LAUNCH_CHECK();
        }
      }
    }
  });
}

}  // namespace cloudtrain::cuda
