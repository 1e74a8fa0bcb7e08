"""Wire coding of the sorted, distinct indices a sparsifier keeps: k indices out of n.

Three codings; for given (n, k) the smallest is used, so the size is known before encoding (the
controller plans packet sizes, and fixed-size packets need it):

- Elias-Fano (delta coding with a size fixed by (n, k)): each index splits into l = floor(log2(n/k))
  low bits, stored verbatim, and a high part, stored as unary-coded gaps in a bit vector of
  k + (n-1 >> l) + 1 bits. About 2 + log2(n/k) bits per index: 8.6 bits at 1% density against 32.
  A data-dependent varint coding of the gaps would be about as small on average, but its size is
  only known after encoding, which fixed-size collectives cannot use.
- bitmap: one bit per element; the smallest above roughly 25% density.
- u32: 32-bit little-endian indices (n <= 2**31); smallest only for a few indices into a huge range.
"""

from __future__ import annotations

import enum

import torch

from .reference import pack_bits, unpack_bits


class IndexCoding(enum.IntEnum):
    ELIAS_FANO = 1
    BITMAP = 2
    U32 = 3


class IndexDecodeError(ValueError):
    """Index bytes that do not decode to k distinct ascending indices below n."""


def _ef_low_bits(n: int, k: int) -> int:
    return max(0, (n // k).bit_length() - 1) if k else 0  # floor(log2(n / k)), in integers


def _nbytes(coding: IndexCoding, n: int, k: int) -> int:
    if coding is IndexCoding.ELIAS_FANO:
        low = _ef_low_bits(n, k)
        return (k * low + 7) // 8 + (k + ((n - 1) >> low) + 1 + 7) // 8
    if coding is IndexCoding.BITMAP:
        return (n + 7) // 8
    return 4 * k


def choose_coding(n: int, k: int) -> IndexCoding:
    """The smallest coding for k of n indices (ties: the order of IndexCoding)."""
    candidates = [IndexCoding.ELIAS_FANO, IndexCoding.BITMAP]
    if n <= 2**31:  # int32 on the wire
        candidates.append(IndexCoding.U32)
    return min(candidates, key=lambda c: _nbytes(c, n, k))


def index_nbytes(n: int, k: int) -> int:
    """Exact number of bytes `encode_indices` produces for k indices out of n."""
    if k == 0:
        return 0
    return _nbytes(choose_coding(n, k), n, k)


def encode_indices(indices: torch.Tensor, n: int) -> torch.Tensor:
    """Sorted distinct int64 indices in [0, n) -> uint8 bytes (exactly index_nbytes(n, k))."""
    k = indices.numel()
    if k == 0:
        return torch.empty(0, dtype=torch.uint8)
    coding = choose_coding(n, k)
    if coding is IndexCoding.U32:
        return indices.to(torch.int32).view(torch.uint8)
    if coding is IndexCoding.BITMAP:
        bitmap = torch.zeros(n, dtype=torch.uint8)
        bitmap[indices] = 1
        return pack_bits(bitmap, 1)
    low = _ef_low_bits(n, k)
    low_bytes = pack_bits(indices & ((1 << low) - 1), low)
    upper = torch.zeros(k + ((n - 1) >> low) + 1, dtype=torch.uint8)
    upper[(indices >> low) + torch.arange(k, dtype=torch.int64)] = 1
    return torch.cat([low_bytes, pack_bits(upper, 1)])


def decode_indices(data: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of `encode_indices`; raises IndexDecodeError unless the bytes hold exactly k
    distinct ascending indices below n (a corrupt packet must not scatter into a gradient)."""
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    coding = choose_coding(n, k)
    if data.numel() != _nbytes(coding, n, k):
        raise IndexDecodeError(
            f"{data.numel()} index bytes, expected {_nbytes(coding, n, k)} for k={k} of n={n}"
        )
    if coding is IndexCoding.U32:
        indices = data.view(torch.int32).to(torch.int64)
    elif coding is IndexCoding.BITMAP:
        indices = unpack_bits(data, 1, n).nonzero().squeeze(1)
    else:
        low = _ef_low_bits(n, k)
        nlow = (k * low + 7) // 8
        upper_len = k + ((n - 1) >> low) + 1
        ones = unpack_bits(data[nlow:], 1, upper_len).nonzero().squeeze(1)
        if ones.numel() != k:
            raise IndexDecodeError(
                f"Elias-Fano upper bits hold {ones.numel()} indices, expected {k}"
            )
        high = ones - torch.arange(k, dtype=torch.int64)
        indices = (high << low) | unpack_bits(data[:nlow], low, k).to(torch.int64)
    if indices.numel() != k:
        raise IndexDecodeError(f"decoded {indices.numel()} indices, expected {k}")
    if k and (indices[0] < 0 or indices[-1] >= n or (k > 1 and bool((indices.diff() <= 0).any()))):
        raise IndexDecodeError(f"indices are not distinct, ascending and below n={n}")
    return indices
