// cloudtrain::dequantize_accumulate and cloudtrain::sparse_accumulate on the CPU.
//
// Both add packets into out in list order, so each element sees the same sequence of fp32 adds
// as reference.py's loop (out + (lo + code * step), packet after packet) and every rank that sums
// the same bytes gets the same bits. dequantize_accumulate does it in one pass over out: a block
// of out stays in cache while every packet is added to it.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "../checks.h"
#include "cpu.h"

namespace cloudtrain::cpu {
namespace {

template <int Bits>
inline uint32_t code_at(const uint8_t* codes, int64_t i) {
  constexpr int per = 8 / Bits;
  constexpr uint32_t mask = (1u << Bits) - 1;
  return (codes[i / per] >> ((i % per) * Bits)) & mask;
}

template <int Bits>
CT_VECTOR_CLONES void add_packet(float* out, int64_t s, int64_t e, const uint8_t* codes, float l,
                                 float st) {
  for (int64_t i = s; i < e; ++i) {
    const float decoded = l + static_cast<float>(code_at<Bits>(codes, i)) * st;
    out[i] = out[i] + decoded;
  }
}

void dequantize_accumulate_cpu(const at::Tensor& out, at::TensorList codes, at::TensorList lo,
                               at::TensorList step, at::IntArrayRef bits, int64_t group_size) {
  check_dequantize_accumulate(out, codes, lo, step, bits, group_size);
  const int64_t n = out.numel();
  const size_t count = codes.size();
  if (n == 0 || count == 0) return;
  std::vector<const uint8_t*> c(count);
  std::vector<const float*> l(count), st(count);
  for (size_t p = 0; p < count; ++p) {
    c[p] = codes[p].data_ptr<uint8_t>();
    l[p] = lo[p].data_ptr<float>();
    st[p] = step[p].data_ptr<float>();
  }
  float* o = out.data_ptr<float>();
  constexpr int64_t kBlock = 8192;  // multiple of 8: blocks own whole code bytes
  for_each_block((n + kBlock - 1) / kBlock, [&](int64_t blk) {
    const int64_t b = blk * kBlock, e = std::min(n, b + kBlock);
    for (size_t p = 0; p < count; ++p) {
      for (int64_t s = b; s < e;) {
        const int64_t g = s / group_size;
        const int64_t t = std::min(e, (g + 1) * group_size);
        switch (bits[p]) {
          case 8:
            add_packet<8>(o, s, t, c[p], l[p][g], st[p][g]);
            break;
          case 4:
            add_packet<4>(o, s, t, c[p], l[p][g], st[p][g]);
            break;
          case 2:
            add_packet<2>(o, s, t, c[p], l[p][g], st[p][g]);
            break;
          default:
            add_packet<1>(o, s, t, c[p], l[p][g], st[p][g]);
        }
        s = t;
      }
    }
  });
}

template <typename V>
void scatter_add(float* out, const int64_t* idx, const V* val, int64_t k) {
  // indices are distinct within a packet, so threads never touch the same element
  at::parallel_for(0, k, 1 << 14, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) out[idx[j]] = out[idx[j]] + static_cast<float>(val[j]);
  });
}

void sparse_accumulate_cpu(const at::Tensor& out, at::TensorList indices, at::TensorList values) {
  check_sparse_accumulate(out, indices, values);
  const int64_t n = out.numel();
  for (size_t p = 0; p < indices.size(); ++p) {  // validate everything before adding anything
    const int64_t* idx = indices[p].data_ptr<int64_t>();
    const int64_t k = indices[p].numel();
    int64_t bad = -1;
    for (int64_t j = 0; j < k && bad < 0; ++j)
      if (idx[j] < 0 || idx[j] >= n) bad = j;
    TORCH_CHECK(bad < 0, "cloudtrain::sparse_accumulate: indices[", p, "][", bad, "]=",
                bad < 0 ? 0 : idx[bad], " is out of range for out of ", n, " elements");
  }
  float* o = out.data_ptr<float>();
  for (size_t p = 0; p < indices.size(); ++p) {
    const int64_t* idx = indices[p].data_ptr<int64_t>();
    const int64_t k = indices[p].numel();
    switch (values[p].scalar_type()) {
      case at::kFloat:
        scatter_add(o, idx, values[p].data_ptr<float>(), k);
        break;
      case at::kBFloat16:
        scatter_add(o, idx, values[p].data_ptr<at::BFloat16>(), k);
        break;
      default:
        scatter_add(o, idx, values[p].data_ptr<at::Half>(), k);
    }
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(cloudtrain, CPU, m) {
  m.impl("dequantize_accumulate", &dequantize_accumulate_cpu);
  m.impl("sparse_accumulate", &sparse_accumulate_cpu);
}

}  // namespace cloudtrain::cpu
