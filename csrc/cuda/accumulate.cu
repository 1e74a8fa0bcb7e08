// cloudtrain::dequantize_accumulate and cloudtrain::sparse_accumulate on CUDA.
//
// dequantize_accumulate: one thread per element of out adds packet after packet, in list order -
// the same fp32 adds, in the same order, as reference.py - and writes out once. Up to kBatch
// packets go to one launch (kernel arguments); more take further launches, still in order.
// sparse_accumulate: indices are checked first (one stream sync), then one scatter-add launch
// per packet, in order; indices are distinct within a packet, so no two threads of a launch
// touch the same element.
#include <climits>
#include <vector>

#include "device.h"

namespace cloudtrain::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kBatch = 32;

struct PacketBatch {
  QuantPacket packets[kBatch];
  int count;
};

// One thread per element (coalesced): its group once, then every packet's code, in order.
// Index arithmetic in 32 bits where everything fits (64-bit division is slow on the GPU).
template <typename Index>
__global__ void dequantize_accumulate_kernel(float* out, int64_t n, int64_t group_size,
                                             PacketBatch batch) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const auto g = static_cast<int64_t>(static_cast<Index>(i) / static_cast<Index>(group_size));
    float sum = out[i];
    for (int p = 0; p < batch.count; ++p) {
      const QuantPacket& q = batch.packets[p];
      const int64_t bit = i * q.bits;  // bits divides 8: a code never spans two bytes
      const uint32_t code = (static_cast<uint32_t>(q.codes[bit >> 3]) >> (bit & 7)) &
                            ((1u << q.bits) - 1u);
      sum = __fadd_rn(sum, __fadd_rn(q.lo[g], __fmul_rn(static_cast<float>(code), q.step[g])));
    }
    out[i] = sum;
  }
}

__global__ void set_kernel(int* flag, int value) { *flag = value; }

__global__ void check_indices_kernel(const int64_t* idx, int64_t k, int64_t n, int packet,
                                     int* first_bad) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < k;
       j += stride)
    if (idx[j] < 0 || idx[j] >= n) atomicMin(first_bad, packet);
}

template <int V>
__global__ void scatter_add_kernel(float* out, const int64_t* idx, const void* values,
                                   int64_t k) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < k;
       j += stride) {
    const int64_t i = idx[j];
    out[i] = __fadd_rn(out[i], load<V>(values, j));
  }
}

}  // namespace

void dequantize_accumulate(float* out, int64_t n, const QuantPacket* packets, int count,
                           int64_t group_size, cudaStream_t stream) {
  if (n == 0 || count == 0) return;
  const int grid = grid_for(n, kThreads);
  const bool narrow = n <= 0xFFFFFFFFLL && group_size <= 0xFFFFFFFFLL;
  for (int first = 0; first < count; first += kBatch) {
    PacketBatch batch{};
    batch.count = count - first < kBatch ? count - first : kBatch;
    for (int p = 0; p < batch.count; ++p) batch.packets[p] = packets[first + p];
    if (narrow)
      dequantize_accumulate_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(out, n, group_size,
                                                                            batch);
    else
      dequantize_accumulate_kernel<uint64_t><<<grid, kThreads, 0, stream>>>(out, n, group_size,
                                                                            batch);
    CT_LAUNCH_CHECK();
  }
}

int sparse_accumulate(float* out, int64_t n, const SparsePacket* packets, int count,
                      const Scratch& scratch, cudaStream_t stream) {
  if (count == 0) return -1;
  int* first_bad = scratch.get<int>(1);
  set_kernel<<<1, 1, 0, stream>>>(first_bad, INT_MAX);
  CT_LAUNCH_CHECK();
  for (int p = 0; p < count; ++p) {
    if (packets[p].count == 0) continue;
    check_indices_kernel<<<grid_for(packets[p].count, kThreads), kThreads, 0, stream>>>(
        packets[p].indices, packets[p].count, n, p, first_bad);
    CT_LAUNCH_CHECK();
  }
  int bad = INT_MAX;
  CT_CUDA_CHECK(cudaMemcpyAsync(&bad, first_bad, sizeof(bad), cudaMemcpyDeviceToHost, stream));
  CT_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (bad != INT_MAX) return bad;
  for (int p = 0; p < count; ++p) {
    const SparsePacket& sp = packets[p];
    if (sp.count == 0) continue;
    const int grid = grid_for(sp.count, kThreads);
    const int64_t* idx = sp.indices;
    switch (sp.dtype) {
      case Dtype::kFloat32:
        scatter_add_kernel<kF32><<<grid, kThreads, 0, stream>>>(out, idx, sp.values, sp.count);
        break;
      case Dtype::kBFloat16:
        scatter_add_kernel<kBF16><<<grid, kThreads, 0, stream>>>(out, idx, sp.values, sp.count);
        break;
      case Dtype::kFloat16:
        scatter_add_kernel<kF16><<<grid, kThreads, 0, stream>>>(out, idx, sp.values, sp.count);
        break;
      default:
        throw std::runtime_error("cloudtrain CUDA sparse_accumulate: values must be float32, "
                                 "bfloat16 or float16");
    }
    CT_LAUNCH_CHECK();
  }
  return -1;
}

}  // namespace cloudtrain::cuda
