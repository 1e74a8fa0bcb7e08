// The CUDA kernels' host API: raw pointers, element counts and a cudaStream_t - CUDA runtime
// only, no torch, so every .cu here compiles with a bare nvcc. bindings.cpp (the one file that
// uses torch's CUDA headers) validates tensors and calls these. Errors throw std::runtime_error.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace cloudtrain::cuda {

// Element types of grad / residual / values. kNone: no residual.
enum class Dtype : int { kNone = 0, kFloat32 = 1, kBFloat16 = 2, kFloat16 = 3 };

// Device scratch memory from the caller (torch's caching allocator): every call returns a new
// buffer, valid until the op returns; stream-ordered on the op's stream.
struct Scratch {
  void* (*alloc)(void* ctx, size_t bytes);
  void* ctx;
  template <typename T>
  T* get(size_t count) const {
    return static_cast<T*>(alloc(ctx, count * sizeof(T)));
  }
};

// ef_topk_select: writes k indices (ascending) and values; updates residual in place.
// Requires 0 <= k <= n < 2^32. Synchronises the stream once (to size the candidate buffers).
void ef_topk_select(const void* grad, Dtype grad_dtype, void* residual, Dtype residual_dtype,
                    int64_t n, int64_t k, int64_t* indices, float* values, const Scratch& scratch,
                    cudaStream_t stream);

// ef_quantize: bits in {1, 2, 4, 8}, group_size % 8 == 0 (groups own whole bytes).
// codes: ceil(n * bits / 8) bytes; lo, step: ceil(n / group_size) floats.
void ef_quantize(const void* grad, Dtype grad_dtype, void* residual, Dtype residual_dtype,
                 int64_t n, int bits, int64_t group_size, bool stochastic, uint64_t seed,
                 uint8_t* codes, float* lo, float* step, cudaStream_t stream);

struct QuantPacket {
  const uint8_t* codes;
  const float* lo;
  const float* step;
  int bits;
};

// out[0, n) += lo + code * step for each packet, in order.
void dequantize_accumulate(float* out, int64_t n, const QuantPacket* packets, int count,
                           int64_t group_size, cudaStream_t stream);

struct SparsePacket {
  const int64_t* indices;
  const void* values;
  Dtype dtype;
  int64_t count;
};

// out[indices] += values for each packet, in order. Returns the first packet with an index
// outside [0, n) (and adds nothing), or -1. Synchronises the stream once (that check).
int sparse_accumulate(float* out, int64_t n, const SparsePacket* packets, int count,
                      const Scratch& scratch, cudaStream_t stream);

}  // namespace cloudtrain::cuda
