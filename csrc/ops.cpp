// Every op's schema, once. Implementations: csrc/cpu/*.cpp (CPU), csrc/cuda/bindings.cpp (CUDA).
// Python: cloudtrain.compress.ops (typed wrappers, fake kernels, the pure-PyTorch fallback).
// Each op must match its reference in compress/reference.py - exactly where the math is
// deterministic; see that file for the arithmetic.
#include <Python.h>
#include <torch/library.h>

// Importing cloudtrain._C runs the static registrations below and in the other sources.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "cloudtrain native ops", -1,
                                      nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(cloudtrain, m) {
  m.set_python_module("cloudtrain.compress.ops");  // where the fake (meta) kernels live
  // acc = grad + residual (fp32); the k largest |acc| (NaN first, ties to the lowest index);
  // residual = acc with those k zeroed. Returns (indices int64[k] ascending, values fp32[k]).
  // `sampled` selects the reference's algorithm; the result is the same either way.
  m.def(
      "ef_topk_select(Tensor grad, Tensor(a!)? residual, int k, bool sampled=False)"
      " -> (Tensor indices, Tensor values)");
  // acc = grad + residual; per group of group_size: lo/step scale, codes rounded (nearest, or
  // stochastic from the counter-based RNG keyed by seed), packed little-endian;
  // residual = acc - decode. Returns (codes uint8[ceil(n*bits/8)], lo fp32[G], step fp32[G]).
  m.def(
      "ef_quantize(Tensor grad, Tensor(a!)? residual, int bits, int group_size, bool stochastic,"
      " int seed) -> (Tensor codes, Tensor lo, Tensor step)");
  // out += lo + code * step for each packet, in list order, in one pass over out.
  m.def(
      "dequantize_accumulate(Tensor(a!) out, Tensor[] codes, Tensor[] lo, Tensor[] step,"
      " int[] bits, int group_size) -> ()");
  // out[indices] += values for each packet, in list order (indices distinct within a packet).
  m.def("sparse_accumulate(Tensor(a!) out, Tensor[] indices, Tensor[] values) -> ()");
}
