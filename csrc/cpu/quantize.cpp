// cloudtrain::ef_quantize on the CPU: residual add + per-group scale + rounding + bit packing +
// residual update, one read of grad and residual, group by group (a group stays in L1).
//
// Arithmetic (compress/reference.py, ef_quantize), in this order, fp32, no FMA
// (-ffp-contract=off): lo = min, step = (max - lo) / (2^bits - 1), t = (acc - lo) / step (a
// division), code = min(floor(t + u), 2^bits - 1) with u = 0.5 (nearest) or uniform(seed, index)
// (stochastic), code 0 where step is not > 0 or t is NaN; 1 bit: s = sum|acc| / count,
// lo = -s, step = 2s, code = acc >= 0. residual = acc - (lo + code * step).
// min/max and everything after them are exact; the 1-bit sum runs in double here and in fp32
// pairwise in torch, so lo/step of `sign` agree to float rounding only.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "../checks.h"
#include "cpu.h"

namespace cloudtrain::cpu {
namespace {

constexpr int64_t kTile = 4096;  // groups longer than this are streamed twice

// Appends codes of `bits` bits, little-endian within each byte (reference.pack_bits).
struct BitWriter {
  uint8_t* out;
  int bits;
  uint32_t carry = 0;
  int used = 0;  // bits of `carry` in use

  CT_ALWAYS_INLINE void put(const uint8_t* c, int64_t len) {
    int64_t j = 0;
    while (used != 0 && j < len) push(c[j++]);
    switch (bits) {
      case 8:
        std::memcpy(out, c + j, len - j);
        out += len - j;
        j = len;
        break;
      case 4:
        for (; j + 2 <= len; j += 2) *out++ = static_cast<uint8_t>(c[j] | c[j + 1] << 4);
        break;
      case 2:
        for (; j + 4 <= len; j += 4)
          *out++ = static_cast<uint8_t>(c[j] | c[j + 1] << 2 | c[j + 2] << 4 | c[j + 3] << 6);
        break;
      default:
        for (; j + 8 <= len; j += 8) {
          uint32_t byte = 0;
          for (int b = 0; b < 8; ++b) byte |= static_cast<uint32_t>(c[j + b]) << b;
          *out++ = static_cast<uint8_t>(byte);
        }
    }
    while (j < len) push(c[j++]);
  }
  void push(uint8_t code) {
    carry |= static_cast<uint32_t>(code) << used;
    used += bits;
    if (used == 8) flush();
  }
  void flush() {
    if (used) *out++ = static_cast<uint8_t>(carry);
    carry = 0;
    used = 0;
  }
};

template <typename G, int R, bool Stochastic>
struct Quantizer {
  Acc<G, R> acc;
  float* rf;
  uint16_t* rb;
  int64_t n, group_size;
  int bits;
  uint64_t seed;
  uint8_t* codes;
  float* lo;
  float* step;

  CT_ALWAYS_INLINE void load(int64_t s, int64_t len, float* a) const {
    for (int64_t j = 0; j < len; ++j) a[j] = acc(s + j);
  }

  // Ask for grad and residual [b, e) now, so that memory works while the CPU codes this group.
  CT_ALWAYS_INLINE void prefetch(int64_t b, int64_t e) const {
    constexpr int64_t kLine = 64;
    const auto* g = reinterpret_cast<const char*>(acc.g);
    for (int64_t i = b * int64_t{sizeof(G)}; i < e * int64_t{sizeof(G)}; i += kLine)
      __builtin_prefetch(g + i);
    const char* r = R == kF32 ? reinterpret_cast<const char*>(rf)  // residual, written soon
                              : reinterpret_cast<const char*>(rb);
    const int64_t size = R == kF32 ? 4 : 2;
    if constexpr (R != kNone)
      for (int64_t i = b * size; i < e * size; i += kLine) __builtin_prefetch(r + i, 1);
  }

  // Groups [g0, g1); codes of group g0 start on a byte boundary.
  CT_VECTOR_CLONES void run(int64_t g0, int64_t g1) const {
    const int64_t tile = std::min(group_size, kTile);
    std::vector<float> a(tile);
    std::vector<uint8_t> c(tile);
    BitWriter w{codes + g0 * group_size * bits / 8, bits};
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t s = g * group_size, e = std::min(n, s + group_size), len = e - s;
      const bool streamed = len > tile;
      prefetch(e, std::min(n, e + std::min(group_size, kTile)));  // the next group, meanwhile
      // group scale
      float l, st;
      if (bits == 1) {
        double lanes[4] = {0, 0, 0, 0};  // four running sums: vectorisable, still in double
        for (int64_t t = s; t < e; t += tile) {
          const int64_t tl = std::min(tile, e - t);
          load(t, tl, a.data());
          int64_t j = 0;
          for (; j + 4 <= tl; j += 4)
            for (int q = 0; q < 4; ++q) lanes[q] += std::fabs(a[j + q]);
          for (; j < tl; ++j) lanes[0] += std::fabs(a[j]);
        }
        const double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
        const float scale = static_cast<float>(sum) / static_cast<float>(len);
        l = -scale;
        st = 2.0f * scale;
      } else {
        int32_t imn = std::numeric_limits<int32_t>::max();
        int32_t imx = std::numeric_limits<int32_t>::min();
        for (int64_t t = s; t < e; t += tile) {
          const int64_t tl = std::min(tile, e - t);
          load(t, tl, a.data());
          for (int64_t j = 0; j < tl; ++j) {
            const int32_t o = ordered_int(a[j]);
            imn = o < imn ? o : imn;
            imx = o > imx ? o : imx;
          }
        }
        float mn = ordered_float(imn), mx = ordered_float(imx);
        if (mn != mn || mx != mx)  // a NaN sorts beyond +-inf; torch.amin/amax propagate it
          mn = mx = std::numeric_limits<float>::quiet_NaN();
        l = mn;
        st = (mx - mn) / static_cast<float>((1 << bits) - 1);
      }
      lo[g] = l;
      step[g] = st;
      // codes and residual
      for (int64_t t = s; t < e; t += tile) {
        const int64_t tl = std::min(tile, e - t);
        if (streamed) load(t, tl, a.data());
        uint8_t* cd = bits == 8 ? w.out : c.data();
        encode(t, tl, a.data(), cd, l, st);
        if (bits == 8)
          w.out += tl;
        else
          w.put(cd, tl);
      }
    }
    w.flush();
  }

  // Codes of acc a[0, len) (elements s...), and the residual they leave. Members are copied to
  // locals first: stores through uint8_t* may alias anything, which would defeat vectorising.
  // Everything called from run() is inlined into it, so it is compiled for each vector clone.
  CT_ALWAYS_INLINE void encode(int64_t s, int64_t len, const float* a, uint8_t* c, float l,
                               float st) const {
    // The RNG counter runs in 32-bit lanes (index = hi * 2^32 + lo): cut at multiples of 2^32.
    for (int64_t done = 0; done < len;) {
      const auto room = static_cast<int64_t>((uint64_t{1} << 32) - static_cast<uint32_t>(s + done));
      const int64_t part = Stochastic ? std::min(len - done, room) : len - done;
      encode_part(s + done, part, a + done, c + done, l, st);
      done += part;
    }
  }

  CT_ALWAYS_INLINE void encode_part(int64_t s, int64_t len, const float* a, uint8_t* c, float l,
                                    float st) const {
    float* r32 = R == kF32 ? rf + s : nullptr;
    uint16_t* r16 = R == kBF16 ? rb + s : nullptr;
    const uint64_t key = seed;
    // 32-bit loop counter and RNG lanes: len <= kTile, and s + len never crosses 2^32 here
    const auto n32 = static_cast<uint32_t>(len);
    if (bits == 1) {
      for (uint32_t j = 0; j < n32; ++j) {
        const float code = a[j] >= 0.0f ? 1.0f : 0.0f;
        c[j] = static_cast<uint8_t>(code);
        residual(r32, r16, j, a[j], l, st, code);
      }
      return;
    }
    const float top = static_cast<float>((1 << bits) - 1);
    if (!(st > 0.0f)) {  // constant (or NaN) group: t = 0, every code 0
      for (uint32_t j = 0; j < n32; ++j) {
        c[j] = 0;
        residual(r32, r16, j, a[j], l, st, 0.0f);
      }
      return;
    }
    const uint32_t hi = static_cast<uint32_t>(static_cast<uint64_t>(s) >> 32);
    const uint32_t lo0 = static_cast<uint32_t>(s);
    for (uint32_t j = 0; j < n32; ++j) {
      const float t = (a[j] - l) / st;
      const float u = Stochastic ? uniform_at(key, lo0 + j, hi) : 0.5f;
      float v = t + u;
      v = v > top ? top : v;
      v = v == v ? v : 0.0f;           // NaN (an Inf in the group) -> code 0, as torch's uint8 cast
      const float code = std::floor(v);  // in [0, top]: converts to uint8 exactly
      c[j] = static_cast<uint8_t>(static_cast<int32_t>(code));
      residual(r32, r16, j, a[j], l, st, code);
    }
  }

  CT_ALWAYS_INLINE static void residual(float* r32, uint16_t* r16, uint32_t j, float a, float l,
                                        float st, float code) {
    if constexpr (R != kNone) {
      const float decoded = l + code * st;
      const float r = a - decoded;
      if constexpr (R == kF32) r32[j] = r;
      if constexpr (R == kBF16) r16[j] = bf16_bits(r);
    }
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> ef_quantize_cpu(
    const at::Tensor& grad, const std::optional<at::Tensor>& residual, int64_t bits,
    int64_t group_size, bool stochastic, int64_t seed) {
  check_ef_quantize(grad, residual, bits, group_size);
  const int64_t n = grad.numel();
  const int64_t groups = num_groups(n, group_size);
  at::Tensor codes = at::empty({(n * bits + 7) / 8}, grad.options().dtype(at::kByte));
  at::Tensor lo = at::empty({groups}, grad.options().dtype(at::kFloat));
  at::Tensor step = at::empty({groups}, grad.options().dtype(at::kFloat));
  if (n == 0) return {codes, lo, step};
  // Tasks own whole bytes: a task starts at a group whose first element is a multiple of 8.
  const int64_t unit = 8 / std::gcd<int64_t>(group_size, 8);  // groups per aligned unit
  const int64_t units = (groups + unit - 1) / unit;
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / unit / group_size);
  dispatch_grad_residual(grad, residual, [&](auto g, auto r) {
    using G = typename decltype(g)::type;
    constexpr int R = decltype(r)::value;
    float* rf = R == kF32 ? residual->data_ptr<float>() : nullptr;
    uint16_t* rb = R == kBF16 ? reinterpret_cast<uint16_t*>(residual->data_ptr()) : nullptr;
    auto body = [&](auto q) {
      for_each_block((units + grain - 1) / grain, [&](int64_t b) {
        q.run(b * grain * unit, std::min(groups, (b + 1) * grain * unit));
      });
    };
    const Acc<G, R> acc = make_acc<G, R>(grad, residual);
    const auto s = static_cast<uint64_t>(seed);
    uint8_t* c = codes.data_ptr<uint8_t>();
    float* l = lo.data_ptr<float>();
    float* st = step.data_ptr<float>();
    const int b = static_cast<int>(bits);
    if (stochastic && bits > 1)
      body(Quantizer<G, R, true>{acc, rf, rb, n, group_size, b, s, c, l, st});
    else
      body(Quantizer<G, R, false>{acc, rf, rb, n, group_size, b, s, c, l, st});
  });
  return {codes, lo, step};
}

}  // namespace

TORCH_LIBRARY_IMPL(cloudtrain, CPU, m) { m.impl("ef_quantize", &ef_quantize_cpu); }

}  // namespace cloudtrain::cpu
