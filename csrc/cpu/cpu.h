// Helpers of the CPU kernels: dtype dispatch and fixed chunking of a range for at::parallel_for.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <type_traits>

#include "../common.h"

// Hot loops are compiled for AVX-512 and AVX2 besides the baseline, picked at load time
// (GCC function multi-versioning); the arithmetic is the same IEEE fp32 in every clone.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define CT_VECTOR_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CT_VECTOR_CLONES
#endif
#if defined(__GNUC__)
#define CT_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define CT_ALWAYS_INLINE inline
#endif

namespace cloudtrain::cpu {

// What the residual is: absent, float32, or bfloat16 (kept as raw bits).
enum Residual : int { kNone = 0, kF32 = 1, kBF16 = 2 };

template <typename T>
struct Type {
  using type = T;
};

// f(Type<G>{}, std::integral_constant<int, R>{}) for the grad dtype G and residual kind R.
template <typename F>
void dispatch_grad_residual(const at::Tensor& grad, const std::optional<at::Tensor>& residual,
                            F&& f) {
  const int r = !residual.has_value()                      ? kNone
                : residual->scalar_type() == at::kFloat ? kF32
                                                         : kBF16;
  auto with_residual = [&](auto g) {
    switch (r) {
      case kNone:
        return f(g, std::integral_constant<int, kNone>{});
      case kF32:
        return f(g, std::integral_constant<int, kF32>{});
      default:
        return f(g, std::integral_constant<int, kBF16>{});
    }
  };
  switch (grad.scalar_type()) {
    case at::kFloat:
      return with_residual(Type<float>{});
    case at::kBFloat16:
      return with_residual(Type<c10::BFloat16>{});
    default:
      return with_residual(Type<c10::Half>{});
  }
}

// acc(i) = float(grad[i]) + float(residual[i]) in fp32, as reference.py computes it.
template <typename G, int R>
struct Acc {
  const G* g;
  const float* rf;
  const uint16_t* rb;
  float operator()(int64_t i) const {
    float a = static_cast<float>(g[i]);
    if constexpr (R == kF32) a = a + rf[i];
    if constexpr (R == kBF16) a = a + bf16_to_float(rb[i]);
    return a;
  }
};

template <typename G, int R>
Acc<G, R> make_acc(const at::Tensor& grad, const std::optional<at::Tensor>& residual) {
  const float* rf = nullptr;
  const uint16_t* rb = nullptr;
  if constexpr (R == kF32) rf = residual->data_ptr<float>();
  if constexpr (R == kBF16) rb = reinterpret_cast<const uint16_t*>(residual->data_ptr());
  return Acc<G, R>{reinterpret_cast<const G*>(grad.data_ptr()), rf, rb};
}

// f(b) for b in [0, count), handed out one at a time to torch's intra-op threads as they come
// free (a shared machine stalls some threads; static halves would wait for the slowest). Each
// block writes its own part of the output, so results never depend on who ran what.
template <typename F>
void for_each_block(int64_t count, F&& f) {
  if (count <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::clamp<int64_t>(at::get_num_threads(), 1, count);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t b = next.fetch_add(1); b < count; b = next.fetch_add(1)) f(b);
  });
}

// [0, n) cut into `count` contiguous chunks, at most `per_thread` per thread and at least
// min_len long (and < 2^31, so per-chunk counts fit 32 bits). Results never depend on the
// chunking: chunks only split the work, and their outputs are joined in chunk (= index) order.
struct Chunks {
  int64_t n, count;
  Chunks(int64_t n_, int64_t min_len, int64_t per_thread) : n(n_) {
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    count = std::clamp<int64_t>(n / min_len, 1, threads * per_thread);
    count = std::max<int64_t>(count, (n >> 31) + 1);
  }
  int64_t begin(int64_t c) const { return n / count * c + std::min(c, n % count); }
  int64_t end(int64_t c) const { return begin(c + 1); }
  // f(chunk, begin, end) for every chunk, chunks spread over torch's intra-op threads.
  template <typename F>
  void run(F&& f) const {
    for_each_block(count, [&](int64_t c) { f(c, begin(c), end(c)); });
  }
};

}  // namespace cloudtrain::cpu
