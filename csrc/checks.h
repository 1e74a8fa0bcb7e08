// Argument checks shared by the CPU implementations and the CUDA bindings: every bad input gets a
// TORCH_CHECK (a Python RuntimeError) that names the op and the argument, never a crash.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

namespace cloudtrain {

inline void check_flat(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), "cloudtrain::", op, ": ", name,
              " must be a contiguous 1-D tensor, got shape ", t.sizes(), " with strides ",
              t.strides());
}

inline void check_device(const at::Tensor& t, const at::Tensor& ref, const char* op,
                         const char* name, const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), "cloudtrain::", op, ": ", name, " is on ", t.device(),
              " but ", ref_name, " is on ", ref.device());
}

inline bool is_float_grad(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

inline void check_grad(const at::Tensor& grad, const char* op) {
  TORCH_CHECK(is_float_grad(grad.scalar_type()), "cloudtrain::", op,
              ": grad must be float32, bfloat16 or float16, got ", grad.scalar_type());
  check_flat(grad, op, "grad");
}

inline void check_residual(const std::optional<at::Tensor>& residual, const at::Tensor& grad,
                           const char* op) {
  if (!residual.has_value()) return;
  const at::Tensor& r = *residual;
  TORCH_CHECK(r.scalar_type() == at::kFloat || r.scalar_type() == at::kBFloat16, "cloudtrain::",
              op, ": residual must be float32 or bfloat16, got ", r.scalar_type());
  check_device(r, grad, op, "residual", "grad");
  check_flat(r, op, "residual");
  TORCH_CHECK(r.numel() == grad.numel(), "cloudtrain::", op, ": residual has ", r.numel(),
              " elements but grad has ", grad.numel());
}

inline void check_bits(int64_t bits, const char* op, const char* name) {
  TORCH_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8, "cloudtrain::", op, ": ", name,
              "=", bits, " is not supported; use one of 1, 2, 4, 8");
}

inline void check_ef_topk_select(const at::Tensor& grad, const std::optional<at::Tensor>& residual,
                                 int64_t k) {
  check_grad(grad, "ef_topk_select");
  check_residual(residual, grad, "ef_topk_select");
  TORCH_CHECK(k >= 0 && k <= grad.numel(), "cloudtrain::ef_topk_select: k=", k,
              " must be in [0, grad.numel()=", grad.numel(), "]");
}

// elements per scale at most (compress.ops.MAX_GROUP_SIZE): products with a unit of groups
// and byte offsets stay far from overflow
constexpr int64_t kMaxGroupSize = int64_t{1} << 30;

inline void check_group_size(int64_t group_size, const char* op) {
  TORCH_CHECK(group_size >= 1 && group_size <= kMaxGroupSize, "cloudtrain::", op, ": group_size=",
              group_size, " must be in [1, 2^30]");
}

inline void check_ef_quantize(const at::Tensor& grad, const std::optional<at::Tensor>& residual,
                              int64_t bits, int64_t group_size) {
  check_grad(grad, "ef_quantize");
  check_residual(residual, grad, "ef_quantize");
  check_bits(bits, "ef_quantize", "bits");
  check_group_size(group_size, "ef_quantize");
}

// n >= 0, group_size >= 1: no overflow whatever group_size (n + group_size - 1 would wrap)
inline int64_t num_groups(int64_t n, int64_t group_size) {
  return n == 0 ? 0 : (n - 1) / group_size + 1;
}

inline void check_dequantize_accumulate(const at::Tensor& out, at::TensorList codes,
                                        at::TensorList lo, at::TensorList step,
                                        at::IntArrayRef bits, int64_t group_size) {
  const char* op = "dequantize_accumulate";
  TORCH_CHECK(out.scalar_type() == at::kFloat, "cloudtrain::", op, ": out must be float32, got ",
              out.scalar_type());
  check_flat(out, op, "out");
  check_group_size(group_size, op);
  const size_t count = codes.size();
  TORCH_CHECK(lo.size() == count && step.size() == count && bits.size() == count,
              "cloudtrain::", op, ": codes, lo, step and bits must have one entry per packet, got ",
              codes.size(), ", ", lo.size(), ", ", step.size(), " and ", bits.size());
  const int64_t n = out.numel();
  const int64_t groups = num_groups(n, group_size);
  for (size_t p = 0; p < count; ++p) {
    check_bits(bits[p], op, "bits[i]");
    TORCH_CHECK(codes[p].scalar_type() == at::kByte, "cloudtrain::", op, ": codes[", p,
                "] must be uint8, got ", codes[p].scalar_type());
    TORCH_CHECK(lo[p].scalar_type() == at::kFloat && step[p].scalar_type() == at::kFloat,
                "cloudtrain::", op, ": lo[", p, "] and step[", p, "] must be float32, got ",
                lo[p].scalar_type(), " and ", step[p].scalar_type());
    check_flat(codes[p], op, "codes[i]");
    check_flat(lo[p], op, "lo[i]");
    check_flat(step[p], op, "step[i]");
    check_device(codes[p], out, op, "codes[i]", "out");
    check_device(lo[p], out, op, "lo[i]", "out");
    check_device(step[p], out, op, "step[i]", "out");
    TORCH_CHECK(codes[p].numel() == (n * bits[p] + 7) / 8, "cloudtrain::", op, ": codes[", p,
                "] has ", codes[p].numel(), " bytes, expected ", (n * bits[p] + 7) / 8, " for ",
                n, " elements of ", bits[p], " bits");
    TORCH_CHECK(lo[p].numel() == groups && step[p].numel() == groups, "cloudtrain::", op,
                ": lo[", p, "] and step[", p, "] must have ", groups, " entries (groups of ",
                group_size, "), got ", lo[p].numel(), " and ", step[p].numel());
  }
}

inline void check_sparse_accumulate(const at::Tensor& out, at::TensorList indices,
                                    at::TensorList values) {
  const char* op = "sparse_accumulate";
  TORCH_CHECK(out.scalar_type() == at::kFloat, "cloudtrain::", op, ": out must be float32, got ",
              out.scalar_type());
  check_flat(out, op, "out");
  TORCH_CHECK(indices.size() == values.size(), "cloudtrain::", op,
              ": indices and values must have one entry per packet, got ", indices.size(), " and ",
              values.size());
  for (size_t p = 0; p < indices.size(); ++p) {
    TORCH_CHECK(indices[p].scalar_type() == at::kLong, "cloudtrain::", op, ": indices[", p,
                "] must be int64, got ", indices[p].scalar_type());
    TORCH_CHECK(is_float_grad(values[p].scalar_type()), "cloudtrain::", op, ": values[", p,
                "] must be float32, bfloat16 or float16, got ", values[p].scalar_type());
    check_flat(indices[p], op, "indices[i]");
    check_flat(values[p], op, "values[i]");
    check_device(indices[p], out, op, "indices[i]", "out");
    check_device(values[p], out, op, "values[i]", "out");
    TORCH_CHECK(indices[p].numel() == values[p].numel(), "cloudtrain::", op, ": indices[", p,
                "] has ", indices[p].numel(), " entries but values[", p, "] has ",
                values[p].numel());
  }
}

}  // namespace cloudtrain
