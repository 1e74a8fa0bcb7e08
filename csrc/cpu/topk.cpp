// cloudtrain::ef_topk_select on the CPU: top-k with error feedback, exact, near memory speed.
//
// The result is a function of the values alone (reference.py): the k largest mag_key(acc), ties
// at the k-th key going to the lowest indices, indices ascending. How it is found:
//
// 1. sampled (n >= 2^18, k <= n/16): a threshold T is read from a sample of 1024 evenly
//    spread blocks (max(2^16, n/256) elements), set low so that it admits ~1.5k candidates.
//    One pass over grad (+ residual) then computes acc, leaves it in an fp32 residual, and
//    collects every (index, acc) with key >= T, branch-free, per chunk in index order. The
//    exact selection runs on the candidates (radix histograms). The k largest are all >= T
//    whenever at least k elements are, so this is exact. When T admits fewer than k (or
//    absurdly many), fall back to
// 2. radix: a histogram of the key's high 16 bits, then of the low 16 bits inside the bin that
//    holds the k-th key, gives the k-th key exactly and, per chunk, how many elements lie above
//    it and how many tie with it; a last pass writes each chunk's selection at its offset.
// Small inputs take nth_element over all keys.
//
// Residual: fp32 is written in the first pass and its k selected entries zeroed after; bf16
// cannot hold acc exactly, so it is written by a last pass (acc recomputed, selected zeroed).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <functional>
#include <memory>
#include <vector>

#include "../checks.h"
#include "cpu.h"

namespace cloudtrain::cpu {
namespace {

struct Stored {  // acc after the first pass left it in an fp32 residual
  const float* p;
  float operator()(int64_t i) const { return p[i]; }
};

struct NoWrite {
  void operator()(int64_t, float) const {}
};

struct WriteF32 {
  float* p;
  void operator()(int64_t i, float a) const { p[i] = a; }
};

// Walk candidates in index order and keep those above kth plus the first `need` equal to it.
struct Emitter {
  uint32_t kth;
  int64_t need;
  int64_t* idx;
  float* val;
  int64_t pos = 0;
  void operator()(int64_t i, float a) {
    const uint32_t key = mag_key(a);
    if (key > kth || (key == kth && need > 0)) {
      need -= key == kth;
      idx[pos] = i;
      val[pos] = a;
      ++pos;
    }
  }
};

// kth key and the number of ties at it to take, from keys of the candidates (any order).
std::pair<uint32_t, int64_t> kth_key(std::vector<uint32_t> keys, int64_t k) {
  std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<uint32_t>());
  const uint32_t kth = keys[k - 1];
  int64_t above = 0;
  for (uint32_t key : keys) above += key > kth;
  return {kth, k - above};
}

template <typename Src, typename Hook>
void small_select(int64_t n, int64_t k, const Src& src, const Hook& hook, int64_t* idx,
                  float* val) {
  std::vector<float> acc(n);
  std::vector<uint32_t> keys(n);
  for (int64_t i = 0; i < n; ++i) {
    acc[i] = src(i);
    hook(i, acc[i]);
    keys[i] = mag_key(acc[i]);
  }
  auto [kth, need] = kth_key(std::move(keys), k);
  Emitter emit{kth, need, idx, val};
  for (int64_t i = 0; i < n; ++i) emit(i, acc[i]);
}

constexpr int64_t kHighBins = ((kInfBits + 1) >> 16) + 1;  // key >> 16 <= 0x7F80 (NaN)
constexpr int64_t kLowBins = 1 << 16;

// First pass: src + hook (e.g. writing acc into an fp32 residual); later passes: again.
template <typename SrcA, typename Hook, typename SrcB>
void radix_select(int64_t n, int64_t k, const SrcA& src_a, const Hook& hook, const SrcB& src_b,
                  int64_t* idx, float* val) {
  const Chunks chunks(n, 1 << 16, 2);
  const int64_t nc = chunks.count;
  std::vector<uint32_t> high(nc * kHighBins, 0);
  chunks.run([&](int64_t c, int64_t b, int64_t e) {
    uint32_t* h = &high[c * kHighBins];
    for (int64_t i = b; i < e; ++i) {
      const float a = src_a(i);
      hook(i, a);
      ++h[mag_key(a) >> 16];
    }
  });
  int64_t above = 0;
  int64_t b1 = kHighBins - 1;
  for (;; --b1) {
    int64_t count = 0;
    for (int64_t c = 0; c < nc; ++c) count += high[c * kHighBins + b1];
    if (above + count >= k) break;
    above += count;
  }
  std::vector<uint32_t> low(nc * kLowBins, 0);
  chunks.run([&](int64_t c, int64_t b, int64_t e) {
    uint32_t* h = &low[c * kLowBins];
    for (int64_t i = b; i < e; ++i) {
      const uint32_t key = mag_key(src_b(i));
      if ((key >> 16) == static_cast<uint32_t>(b1)) ++h[key & 0xFFFF];
    }
  });
  int64_t b2 = kLowBins - 1;
  for (;; --b2) {
    int64_t count = 0;
    for (int64_t c = 0; c < nc; ++c) count += low[c * kLowBins + b2];
    if (above + count >= k) break;
    above += count;
  }
  const uint32_t kth = static_cast<uint32_t>(b1 << 16 | b2);
  // Per chunk: elements above kth, ties at kth it may take (lowest indices first), offset.
  std::vector<int64_t> offset(nc), take(nc);
  int64_t pos = 0, ties_before = 0, need = k - above;
  for (int64_t c = 0; c < nc; ++c) {
    int64_t chunk_above = 0;
    for (int64_t b = b1 + 1; b < kHighBins; ++b) chunk_above += high[c * kHighBins + b];
    for (int64_t b = b2 + 1; b < kLowBins; ++b) chunk_above += low[c * kLowBins + b];
    const int64_t ties = low[c * kLowBins + b2];
    take[c] = std::clamp<int64_t>(need - ties_before, 0, ties);
    ties_before += ties;
    offset[c] = pos;
    pos += chunk_above + take[c];
  }
  TORCH_CHECK(pos == k, "cloudtrain::ef_topk_select: internal error, selected ", pos, " of ", k);
  chunks.run([&](int64_t c, int64_t b, int64_t e) {
    Emitter emit{kth, take[c], idx + offset[c], val + offset[c]};
    for (int64_t i = b; i < e; ++i) emit(i, src_b(i));
  });
}

// Growable (index, value) list with room written past its size (branch-free appends).
struct Candidates {
  std::unique_ptr<int64_t[]> idx;  // uninitialised storage: appends write past `size`
  std::unique_ptr<float[]> val;
  int64_t size = 0, capacity = 0;
  void reserve_more(int64_t m) {
    if (size + m <= capacity) return;
    capacity = std::max(2 * capacity, size + m);
    std::unique_ptr<int64_t[]> grown_idx(new int64_t[capacity]);
    std::unique_ptr<float[]> grown_val(new float[capacity]);
    std::copy(idx.get(), idx.get() + size, grown_idx.get());
    std::copy(val.get(), val.get() + size, grown_val.get());
    idx = std::move(grown_idx);
    val = std::move(grown_val);
  }
};

// One chunk [b, e) of the sampled pass: acc (and the hook) for every element, and each (i, acc)
// with key >= t appended to `out`, found from a bit mask of 32 keys at a time.
// Appending stops (computing does not) once the candidates overflow `cap`.
template <typename Src, typename Hook>
CT_VECTOR_CLONES void collect_chunk(const Src& src, const Hook& hook, int64_t b, int64_t e,
                                    uint32_t t, int64_t cap, Candidates& out,
                                    std::atomic<int64_t>& total, std::atomic<bool>& overflow) {
  constexpr int64_t kBlock = 256, kSub = 32;
  float acc[kBlock];
  uint32_t key[kBlock];
  int64_t unreported = 0;
  for (int64_t s = b; s < e; s += kBlock) {
    const int64_t len = std::min(kBlock, e - s);
    for (int64_t j = 0; j < len; ++j) {
      const float a = src(s + j);
      hook(s + j, a);
      acc[j] = a;
      key[j] = mag_key(a);
    }
    if (overflow.load(std::memory_order_relaxed)) continue;  // finish the hook's pass
    out.reserve_more(len);
    int64_t* oi = out.idx.get() + out.size;
    float* ov = out.val.get() + out.size;
    int64_t cnt = 0;
    for (int64_t q = 0; q < len; q += kSub) {  // a bit mask per 32, then its set bits only
      const int64_t qe = std::min(len, q + kSub);
      uint32_t mask = 0;
      for (int64_t j = q; j < qe; ++j) mask |= static_cast<uint32_t>(key[j] >= t) << (j - q);
      for (; mask != 0; mask &= mask - 1) {
        const int64_t j = q + __builtin_ctz(mask);
        oi[cnt] = s + j;
        ov[cnt] = acc[j];
        ++cnt;
      }
    }
    out.size += cnt;
    unreported += cnt;
    if (unreported >= 4096) {
      if (total.fetch_add(unreported) + unreported > cap) overflow = true;
      unreported = 0;
    }
  }
  if (total.fetch_add(unreported) + unreported > cap) overflow = true;
}

// Step 1 of the file comment. Returns false (hook applied everywhere all the same) when the
// sampled threshold admitted fewer than k or too many candidates.
template <typename Src, typename Hook>
bool sampled_select(int64_t n, int64_t k, const Src& src, const Hook& hook, int64_t* idx,
                    float* val) {
  constexpr int64_t kBlocks = 1024;
  const int64_t len = (std::max<int64_t>(1 << 16, n / 256) + kBlocks - 1) / kBlocks;
  const int64_t stride = n / kBlocks;  // >= 256 >= len for n >= 2^18
  const int64_t m = kBlocks * len;
  std::vector<uint32_t> sample(m);
  at::parallel_for(0, kBlocks, 64, [&](int64_t b, int64_t e) {
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t start = blk * stride + (stride - len) / 2;
      for (int64_t j = 0; j < len; ++j) sample[blk * len + j] = mag_key(src(start + j));
    }
  });
  const double expected = static_cast<double>(k) * m / n;
  const int64_t ks = std::min<int64_t>(
      m, static_cast<int64_t>(std::ceil(1.5 * expected + 6 * std::sqrt(expected) + 16)));
  std::nth_element(sample.begin(), sample.begin() + (ks - 1), sample.end(),
                   std::greater<uint32_t>());
  const uint32_t threshold = sample[ks - 1];
  const int64_t cap = std::min<int64_t>(
      n, 3 * static_cast<int64_t>(std::ceil(static_cast<double>(ks) * n / m)) + (1 << 16));

  const Chunks chunks(n, 1 << 16, 8);
  std::vector<Candidates> found(chunks.count);
  const auto expected_found = static_cast<int64_t>(1.25 * ks * n / m / chunks.count) + 1024;
  for (Candidates& f : found) f.reserve_more(expected_found);  // no regrowth, as a rule
  std::atomic<int64_t> total{0};
  std::atomic<bool> overflow{false};
  chunks.run([&](int64_t c, int64_t b, int64_t e) {
    collect_chunk(src, hook, b, e, threshold, cap, found[c], total, overflow);
  });
  if (overflow || total.load() < k) return false;

  // the k-th key among the candidates: a histogram of its high 16 bits, then of the low 16
  // bits inside the bin that holds it (O(candidates), like radix_select)
  std::vector<int64_t> high(kHighBins, 0), low(kLowBins, 0);
  for (const Candidates& cs : found)
    for (int64_t j = 0; j < cs.size; ++j) ++high[mag_key(cs.val[j]) >> 16];
  int64_t above = 0, b1 = kHighBins - 1;
  for (; above + high[b1] < k; --b1) above += high[b1];
  for (const Candidates& cs : found)
    for (int64_t j = 0; j < cs.size; ++j) {
      const uint32_t key = mag_key(cs.val[j]);
      if ((key >> 16) == static_cast<uint32_t>(b1)) ++low[key & 0xFFFF];
    }
  int64_t b2 = kLowBins - 1;
  for (; above + low[b2] < k; --b2) above += low[b2];
  const auto kth = static_cast<uint32_t>(b1 << 16 | b2);
  // Per chunk (in parallel): how many lie above kth and tie with it; then each chunk writes its
  // selection at its offset, the ties going to the lowest indices.
  const int64_t nc = chunks.count;
  std::vector<int64_t> chunk_above(nc), chunk_ties(nc), offset(nc), take(nc);
  for_each_block(nc, [&](int64_t c) {
    for (int64_t j = 0; j < found[c].size; ++j) {
      const uint32_t key = mag_key(found[c].val[j]);
      chunk_above[c] += key > kth;
      chunk_ties[c] += key == kth;
    }
  });
  int64_t pos = 0, ties_before = 0;
  for (int64_t c = 0; c < nc; ++c) {
    take[c] = std::clamp<int64_t>(k - above - ties_before, 0, chunk_ties[c]);
    ties_before += chunk_ties[c];
    offset[c] = pos;
    pos += chunk_above[c] + take[c];
  }
  TORCH_CHECK(pos == k, "cloudtrain::ef_topk_select: internal error, selected ", pos, " of ", k);
  for_each_block(nc, [&](int64_t c) {
    Emitter emit{kth, take[c], idx + offset[c], val + offset[c]};
    for (int64_t j = 0; j < found[c].size; ++j) emit(found[c].idx[j], found[c].val[j]);
  });
  return true;
}

template <typename G, int R>
void ef_topk_select_impl(const at::Tensor& grad, const std::optional<at::Tensor>& residual,
                         int64_t k, int64_t* idx, float* val) {
  const int64_t n = grad.numel();
  const Acc<G, R> acc = make_acc<G, R>(grad, residual);
  float* rf = R == kF32 ? residual->data_ptr<float>() : nullptr;
  uint16_t* rb = R == kBF16 ? reinterpret_cast<uint16_t*>(residual->data_ptr()) : nullptr;
  const Chunks chunks(n, 1 << 15, 4);

  if (k == n) {  // everything is sent; nothing stays behind
    chunks.run([&](int64_t, int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        idx[i] = i;
        val[i] = acc(i);
        if constexpr (R == kF32) rf[i] = 0.0f;
        if constexpr (R == kBF16) rb[i] = 0;
      }
    });
    return;
  }
  if (k > 0) {
    const NoWrite none;
    if constexpr (R == kF32) {
      const WriteF32 write{rf};
      const Stored stored{rf};
      if (n < (1 << 16)) {
        small_select(n, k, acc, write, idx, val);
      } else if (n < (1 << 18) || k > n / 16 || !sampled_select(n, k, acc, write, idx, val)) {
        // a failed sampled pass already left acc in the residual
        const bool written = n >= (1 << 18) && k <= n / 16;
        if (written)
          radix_select(n, k, stored, none, stored, idx, val);
        else
          radix_select(n, k, acc, write, stored, idx, val);
      }
      for_each_block((k + 4095) / 4096, [&](int64_t b) {  // scattered writes: in parallel
        for (int64_t j = b * 4096; j < std::min(k, (b + 1) * 4096); ++j) rf[idx[j]] = 0.0f;
      });
      return;
    } else {
      if (n < (1 << 16))
        small_select(n, k, acc, none, idx, val);
      else if (n < (1 << 18) || k > n / 16 || !sampled_select(n, k, acc, none, idx, val))
        radix_select(n, k, acc, none, acc, idx, val);
    }
  }
  if constexpr (R == kF32) {  // k == 0: residual = acc
    chunks.run([&](int64_t, int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) rf[i] = acc(i);
    });
  }
  if constexpr (R == kBF16) {  // residual = bf16(acc), zero where sent
    chunks.run([&](int64_t, int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) rb[i] = bf16_bits(acc(i));
      for (const int64_t* j = std::lower_bound(idx, idx + k, b); j < idx + k && *j < e; ++j)
        rb[*j] = 0;
    });
  }
}

std::tuple<at::Tensor, at::Tensor> ef_topk_select_cpu(const at::Tensor& grad,
                                                      const std::optional<at::Tensor>& residual,
                                                      int64_t k, bool sampled) {
  (void)sampled;  // same result either way; this kernel picks its own strategy
  check_ef_topk_select(grad, residual, k);
  at::Tensor indices = at::empty({k}, grad.options().dtype(at::kLong));
  at::Tensor values = at::empty({k}, grad.options().dtype(at::kFloat));
  dispatch_grad_residual(grad, residual, [&](auto g, auto r) {
    using G = typename decltype(g)::type;
    ef_topk_select_impl<G, decltype(r)::value>(grad, residual, k, indices.data_ptr<int64_t>(),
                                               values.data_ptr<float>());
  });
  return {indices, values};
}

}  // namespace

TORCH_LIBRARY_IMPL(cloudtrain, CPU, m) { m.impl("ef_topk_select", &ef_topk_select_cpu); }

}  // namespace cloudtrain::cpu
