// The one file that binds the CUDA kernels (kernels.h, CUDA runtime only) to torch: argument
// checks (../checks.h, shared with the CPU ops), device guard, current stream, output and
// scratch tensors from torch's caching allocator, TORCH_LIBRARY_IMPL(cloudtrain, CUDA, m).
// Built only where torch has CUDA (setup.py); uses c10/cuda headers, nothing from ATen/cuda.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "../checks.h"
#include "kernels.h"

namespace cloudtrain::cuda {
namespace {

Dtype dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return Dtype::kFloat32;
    case at::kBFloat16:
      return Dtype::kBFloat16;
    case at::kHalf:
      return Dtype::kFloat16;
    default:
      TORCH_CHECK(false, "cloudtrain: unsupported dtype ", t.scalar_type());
  }
  return Dtype::kNone;
}

Dtype dtype_of(const std::optional<at::Tensor>& t) {
  return t.has_value() ? dtype_of(*t) : Dtype::kNone;
}

// Scratch buffers as uint8 CUDA tensors, alive until the op returns (stream-ordered reuse).
struct TorchScratch {
  at::Device device;
  std::vector<at::Tensor> held;

  static void* alloc(void* ctx, size_t bytes) {
    auto* self = static_cast<TorchScratch*>(ctx);
    const auto size = static_cast<int64_t>(bytes > 0 ? bytes : 1);
    const auto options = at::TensorOptions().dtype(at::kByte).device(self->device);
    self->held.push_back(at::empty({size}, options));
    return self->held.back().data_ptr();
  }
  Scratch view() { return Scratch{&TorchScratch::alloc, this}; }
};

cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

void* data_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr() : nullptr;
}

std::tuple<at::Tensor, at::Tensor> ef_topk_select_cuda(const at::Tensor& grad,
                                                       const std::optional<at::Tensor>& residual,
                                                       int64_t k, bool sampled) {
  (void)sampled;  // same result either way
  check_ef_topk_select(grad, residual, k);
  TORCH_CHECK(grad.numel() <= 0xFFFFFFFFLL, "cloudtrain::ef_topk_select: grad has ", grad.numel(),
              " elements; the CUDA kernel takes at most 2^32 - 1 (split the bucket)");
  const c10::cuda::CUDAGuard guard(grad.device());
  at::Tensor indices = at::empty({k}, grad.options().dtype(at::kLong));
  at::Tensor values = at::empty({k}, grad.options().dtype(at::kFloat));
  TorchScratch scratch{grad.device(), {}};
  ef_topk_select(grad.data_ptr(), dtype_of(grad), data_or_null(residual), dtype_of(residual),
                 grad.numel(), k, indices.data_ptr<int64_t>(), values.data_ptr<float>(),
                 scratch.view(), stream_of(grad));
  return {indices, values};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ef_quantize_cuda(
    const at::Tensor& grad, const std::optional<at::Tensor>& residual, int64_t bits,
    int64_t group_size, bool stochastic, int64_t seed) {
  check_ef_quantize(grad, residual, bits, group_size);
  TORCH_CHECK(group_size % 8 == 0, "cloudtrain::ef_quantize: group_size=", group_size,
              " is not a multiple of 8, which the CUDA kernel needs (cloudtrain.compress.ops "
              "falls back to the reference for it)");
  const c10::cuda::CUDAGuard guard(grad.device());
  const int64_t n = grad.numel();
  at::Tensor codes = at::empty({(n * bits + 7) / 8}, grad.options().dtype(at::kByte));
  at::Tensor lo = at::empty({num_groups(n, group_size)}, grad.options().dtype(at::kFloat));
  at::Tensor step = at::empty({num_groups(n, group_size)}, grad.options().dtype(at::kFloat));
  ef_quantize(grad.data_ptr(), dtype_of(grad), data_or_null(residual), dtype_of(residual), n,
              static_cast<int>(bits), group_size, stochastic, static_cast<uint64_t>(seed),
              codes.data_ptr<uint8_t>(), lo.data_ptr<float>(), step.data_ptr<float>(),
              stream_of(grad));
  return {codes, lo, step};
}

void dequantize_accumulate_cuda(const at::Tensor& out, at::TensorList codes, at::TensorList lo,
                                at::TensorList step, at::IntArrayRef bits, int64_t group_size) {
  check_dequantize_accumulate(out, codes, lo, step, bits, group_size);
  const c10::cuda::CUDAGuard guard(out.device());
  std::vector<QuantPacket> packets;
  for (size_t p = 0; p < codes.size(); ++p)
    packets.push_back(QuantPacket{codes[p].data_ptr<uint8_t>(), lo[p].data_ptr<float>(),
                                  step[p].data_ptr<float>(), static_cast<int>(bits[p])});
  dequantize_accumulate(out.data_ptr<float>(), out.numel(), packets.data(),
                        static_cast<int>(packets.size()), group_size, stream_of(out));
}

void sparse_accumulate_cuda(const at::Tensor& out, at::TensorList indices, at::TensorList values) {
  check_sparse_accumulate(out, indices, values);
  const c10::cuda::CUDAGuard guard(out.device());
  std::vector<SparsePacket> packets;
  for (size_t p = 0; p < indices.size(); ++p)
    packets.push_back(SparsePacket{indices[p].data_ptr<int64_t>(), values[p].data_ptr(),
                                   dtype_of(values[p]), indices[p].numel()});
  TorchScratch scratch{out.device(), {}};
  const int bad = sparse_accumulate(out.data_ptr<float>(), out.numel(), packets.data(),
                                    static_cast<int>(packets.size()), scratch.view(),
                                    stream_of(out));
  TORCH_CHECK(bad < 0, "cloudtrain::sparse_accumulate: indices[", bad,
              "] holds an index out of range for out of ", out.numel(), " elements");
}

}  // namespace

TORCH_LIBRARY_IMPL(cloudtrain, CUDA, m) {
  m.impl("ef_topk_select", &ef_topk_select_cuda);
  m.impl("ef_quantize", &ef_quantize_cuda);
  m.impl("dequantize_accumulate", &dequantize_accumulate_cuda);
  m.impl("sparse_accumulate", &sparse_accumulate_cuda);
}

}  // namespace cloudtrain::cuda
