"""Pure-PyTorch reference of every hot operation in gradient compression.

These functions are the oracle the native kernels (csrc/, `torch.ops.cloudtrain.*`) must match
and the fallback where those kernels are not built; the codecs in codecs/ call them. Each one
states its exact arithmetic, because "match" means bit for bit wherever the math is
deterministic:

- selection `magnitude_topk` / `sampled_topk`: the k largest |x|, ties at the k-th value going to
  the lowest indices, indices returned ascending;
- `ef_topk_select`: residual add + selection + residual update in one call;
- `ef_quantize`: residual add + per-group scale + rounding + bit packing + residual update;
- `dequantize` / `dequantize_accumulate` / `sparse_accumulate`: decode packets and sum them in a
  fixed order, so every rank that sums the same bytes gets the same bits;
- `pack_bits` / `unpack_bits`: little-endian bit fields in bytes.

Conventions: flat (1-D) contiguous tensors; accumulation and residuals in float32 unless the
residual is bf16; indices int64. No function here touches torch's global RNG: randomness comes in
through an explicit `torch.Generator`.
"""

from __future__ import annotations

import math

import torch

QUANT_BITS = (1, 2, 4, 8)


# ---------------------------------------------------------------------------------------------
# bit packing


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes (each < 2**bits) into bytes, little-endian within each byte.

    Element i lands in bits [(i*bits) % 8, ...) of byte (i*bits) // 8. Any width 1..32 works; the
    widths that divide 8 take a fast path. Returns uint8 of ceil(n*bits/8) bytes.
    """
    n = codes.numel()
    nbytes = (n * bits + 7) // 8
    dev = codes.device
    if n == 0 or bits == 0:
        return torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    if bits == 8:
        return codes.to(torch.uint8).reshape(-1)
    if 8 % bits == 0:
        per = 8 // bits
        padded = torch.zeros(nbytes * per, dtype=torch.uint8, device=dev)
        padded[:n] = codes.reshape(-1)
        padded = padded.view(nbytes, per)
        out = padded[:, 0].clone()
        for j in range(1, per):
            out |= padded[:, j] << (j * bits)
        return out
    # General width: expand to a bit matrix (n, bits), then fold every 8 bits into a byte.
    shifts = torch.arange(bits, dtype=torch.int64, device=dev)
    bitmat = ((codes.reshape(-1).to(torch.int64).unsqueeze(1) >> shifts) & 1).to(torch.uint8)
    flat = torch.zeros(nbytes * 8, dtype=torch.uint8, device=dev)
    flat[: n * bits] = bitmat.reshape(-1)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=dev)
    return (flat.view(nbytes, 8) * weights).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_bits`: n codes of `bits` bits each (uint8 for bits <= 8, else int64)."""
    dev = packed.device
    if n == 0 or bits == 0:
        return torch.zeros(n, dtype=torch.uint8 if bits <= 8 else torch.int64, device=dev)
    packed = packed.reshape(-1)
    if bits == 8:
        return packed[:n]
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=dev)
        mask = (1 << bits) - 1
        return ((packed.unsqueeze(1) >> shifts) & mask).reshape(-1)[:n]
    bitvec = ((packed.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8, device=dev)) & 1).reshape(
        -1
    )
    bitmat = bitvec[: n * bits].view(n, bits).to(torch.int64)
    values = (bitmat << torch.arange(bits, dtype=torch.int64, device=dev)).sum(1)
    return values.to(torch.uint8) if bits <= 8 else values


# ---------------------------------------------------------------------------------------------
# top-k selection


def magnitude_topk(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of `mag` (>= 0, no NaN), ascending.

    Ties at the k-th largest value go to the lowest indices, so the selection is a function of the
    values alone, never of the sort algorithm.
    """
    n = mag.numel()
    if k >= n:
        return torch.arange(n, dtype=torch.int64, device=mag.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=mag.device)
    threshold = torch.topk(mag, k, sorted=False).values.min()
    above = (mag > threshold).nonzero().squeeze(1)
    at = (mag == threshold).nonzero().squeeze(1)[: k - above.numel()]
    return torch.cat([above, at]).sort().values


def sampled_topk(mag: torch.Tensor, k: int, sample_fraction: float = 0.01) -> torch.Tensor:
    """Same result as `magnitude_topk`, found faster when k << n (Deep Gradient Compression).

    A threshold is estimated from a strided sample of `mag`, set a little low so that it usually
    admits a few more than k candidates; the exact selection then runs on the candidates only.
    When the estimate admits fewer than k (undershoot), the exact selection runs on everything.
    Either way the output is exactly the k entries `magnitude_topk` returns.
    """
    n = mag.numel()
    m = max(4096, int(n * sample_fraction))
    if k <= 0 or k >= n or 4 * m >= n:
        return magnitude_topk(mag, k)
    stride = n // m
    sample = mag[::stride]
    expected = k * sample.numel() / n
    ks = min(sample.numel(), math.ceil(1.25 * expected + 4 * math.sqrt(expected) + 4))
    threshold = torch.topk(sample, ks, sorted=False).values.min()
    candidates = (mag >= threshold).nonzero().squeeze(1)
    if candidates.numel() < k:
        return magnitude_topk(mag, k)
    return candidates[magnitude_topk(mag[candidates], k)]


def _selection_magnitude(acc: torch.Tensor) -> torch.Tensor:
    # NaN ranks above everything, then Inf, then the finite values (the order of torch.topk), so
    # non-finite values are selected first, deterministically; the caller decides whether
    # non-finite input is allowed at all. With a NaN present the magnitudes move to float64,
    # where NaN -> inf and Inf -> 2 * float32 max keep all three classes apart (nan_to_num alone
    # would turn Inf into float32 max, tied with a finite value).
    mag = acc.abs()
    if mag.isnan().any():
        mag = mag.double().nan_to_num(nan=math.inf, posinf=2.0 * torch.finfo(torch.float32).max)
    return mag


def ef_topk_select(
    grad: torch.Tensor, residual: torch.Tensor | None, k: int, sampled: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k with error feedback, fused: acc = grad + residual; pick the k largest |acc|;
    residual = acc with the picked entries zeroed. Returns (indices int64 ascending, values fp32).

    With residual None there is no feedback: the selection runs on grad alone.
    """
    acc = grad.to(torch.float32)
    if residual is not None:
        acc = acc + residual.to(torch.float32)
    mag = _selection_magnitude(acc)
    indices = sampled_topk(mag, k) if sampled else magnitude_topk(mag, k)
    values = acc[indices]
    if residual is not None:
        residual.copy_(acc)
        residual[indices] = 0
    return indices, values


# ---------------------------------------------------------------------------------------------
# quantization


def num_groups(n: int, group_size: int) -> int:
    return (n + group_size - 1) // group_size


def _grouped(x: torch.Tensor, group_size: int, pad_with_last: bool) -> torch.Tensor:
    """(groups, group_size) view of x. The last group is padded with x's last element (leaves the
    group's min and max unchanged) or with zeros (leaves its sum of |x| unchanged)."""
    n = x.numel()
    g = num_groups(n, group_size)
    pad = g * group_size - n
    if pad:
        filler = x[-1:].expand(pad) if pad_with_last else x.new_zeros(pad)
        x = torch.cat([x, filler])
    return x.view(g, group_size)


def ef_quantize(
    grad: torch.Tensor,
    residual: torch.Tensor | None,
    bits: int,
    group_size: int,
    stochastic: bool,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize with error feedback, fused. Returns (codes packed uint8, lo fp32[G], step fp32[G]).

    acc = grad + residual (fp32), cut into G groups of `group_size` (the last one short). Every
    group decodes as value = lo + code * step, code in [0, 2**bits - 1]:
    - bits 2, 4, 8: lo = min(acc), step = (max(acc) - lo) / (2**bits - 1); code = floor(t + u),
      t = (acc - lo) / step, with u ~ U[0, 1) from `generator` (stochastic: unbiased) or u = 0.5
      (nearest); clamped to the code range; a constant group (step 0) gets code 0.
    - bits 1 (EF-signSGD): s = mean(|acc|) over the group, lo = -s, step = 2s, code = acc >= 0.
    Then residual = acc - (lo + code * step), computed as a multiply, then an add, then a subtract.
    """
    if bits not in QUANT_BITS:
        raise ValueError(f"bits={bits} is not supported; use one of {QUANT_BITS}")
    n = grad.numel()
    acc = grad.to(torch.float32)
    if residual is not None:
        acc = acc + residual.to(torch.float32)
    if n == 0:
        empty = torch.empty(0, dtype=torch.float32, device=acc.device)
        return torch.empty(0, dtype=torch.uint8, device=acc.device), empty, empty.clone()
    groups = _grouped(acc, group_size, pad_with_last=bits != 1)  # (G, group_size)
    if bits == 1:
        counts = torch.full((groups.shape[0],), group_size, dtype=torch.float32, device=acc.device)
        counts[-1] = n - (groups.shape[0] - 1) * group_size
        scale = groups.abs().sum(1) / counts
        lo, step = -scale, 2 * scale
        codes = (groups >= 0).to(torch.uint8)
    else:
        top = (1 << bits) - 1
        lo = groups.amin(1)
        step = (groups.amax(1) - lo) / top
        t = (groups - lo.unsqueeze(1)) / step.unsqueeze(1)
        t = torch.where(step.unsqueeze(1) > 0, t, torch.zeros_like(t))
        if stochastic:
            u = torch.rand(
                groups.shape, generator=generator, dtype=torch.float32, device=acc.device
            )
        else:
            u = torch.full_like(t, 0.5)
        codes = torch.floor(t + u).clamp_(0, top).to(torch.uint8)
    if residual is not None:
        decoded = lo.unsqueeze(1) + codes.to(torch.float32) * step.unsqueeze(1)
        residual.copy_(acc - decoded.reshape(-1)[:n])
    return pack_bits(codes.reshape(-1)[:n], bits), lo, step


def dequantize(
    packed: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, bits: int, n: int, group_size: int
) -> torch.Tensor:
    """Decode `ef_quantize`'s output: fp32[n], value = lo + code * step per group."""
    if n == 0:
        return torch.empty(0, dtype=torch.float32, device=lo.device)
    g = lo.numel()
    codes = torch.zeros(g * group_size, dtype=torch.float32, device=lo.device)
    codes[:n] = unpack_bits(packed, bits, n)
    decoded = lo.unsqueeze(1) + codes.view(g, group_size) * step.unsqueeze(1)
    return decoded.reshape(-1)[:n]


def dequantize_accumulate(
    out: torch.Tensor,
    packets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    bits: list[int],
    group_size: int,
) -> torch.Tensor:
    """out += dequantize(p) for each (packed, lo, step) packet, in list order. out: fp32[n].

    The order is part of the contract: every rank sums the same packets in the same order, so
    every rank gets the same bits.
    """
    for (packed, lo, step), b in zip(packets, bits, strict=True):
        out.add_(dequantize(packed, lo, step, b, out.numel(), group_size))
    return out


def sparse_accumulate(
    out: torch.Tensor, packets: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """out[indices] += values for each (indices, values) packet, in list order. out: fp32[n].

    Indices within one packet are distinct, so each element sees one add per packet, in packet
    order: the result is deterministic.
    """
    for indices, values in packets:
        out[indices] = out[indices] + values.to(torch.float32)
    return out
