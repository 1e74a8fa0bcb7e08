"""Index coding (compress/indices.py): every coding round-trips at its edge sizes with exactly the
size predicted before encoding, and bytes that do not hold k distinct ascending indices below n
raise IndexDecodeError (PacketError once inside a packet) - never another error, never a scatter
out of range."""

from __future__ import annotations

import pytest
import torch

from cloudtrain.compress import PacketError, RandomKey, from_wire, make_codec, to_wire
from cloudtrain.compress.indices import (
    IndexCoding,
    IndexDecodeError,
    choose_coding,
    decode_indices,
    encode_indices,
    index_nbytes,
)
from cloudtrain.compress.reference import pack_bits, unpack_bits


def sample(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """k distinct ascending indices below n (also for n far beyond what randperm can hold)."""
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    if n <= 1 << 22:
        return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k].sort().values
    edges = torch.tensor([0, n - 1])  # the extremes, where off-by-one errors live
    if k <= 2:
        return edges[2 - k :]
    g = torch.Generator().manual_seed(seed)
    picked = torch.randint(1, n - 1, (4 * k,), generator=g, dtype=torch.int64).unique()
    return torch.cat([picked[: k - 2], edges]).sort().values


# (n, k, the coding that must be chosen): each coding at its edges
CASES = [
    (1, 1, IndexCoding.ELIAS_FANO),  # 1 byte, tied with the bitmap: ties go to Elias-Fano
    (2, 1, IndexCoding.BITMAP),
    (8, 8, IndexCoding.BITMAP),  # all of them: one byte
    (9, 9, IndexCoding.BITMAP),  # a second byte with one used bit
    (1000, 250, IndexCoding.BITMAP),
    (1000, 999, IndexCoding.BITMAP),
    (1000, 10, IndexCoding.ELIAS_FANO),
    (1024, 1, IndexCoding.ELIAS_FANO),  # n / k a power of two: l = log2(n) exactly
    (1025, 1, IndexCoding.ELIAS_FANO),
    (10**6, 10**4, IndexCoding.ELIAS_FANO),
    (2**20 + 3, 7, IndexCoding.ELIAS_FANO),
    (2**31, 1, IndexCoding.U32),  # the largest n U32 can address
    (2**31, 2, IndexCoding.U32),
    (2**31, 3, IndexCoding.ELIAS_FANO),  # 12 bytes, tied with U32
    (2**31 + 1, 1, IndexCoding.ELIAS_FANO),  # beyond int32: U32 is not a choice
    (2**40, 3, IndexCoding.ELIAS_FANO),
]


@pytest.mark.parametrize("n,k,coding", CASES)
def test_each_coding_round_trips_at_its_edges(n, k, coding):
    assert choose_coding(n, k) is coding
    for seed in range(3):
        idx = sample(n, k, seed)
        data = encode_indices(idx, n)
        assert data.dtype == torch.uint8 and data.numel() == index_nbytes(n, k)
        assert torch.equal(decode_indices(data, n, k), idx)


@pytest.mark.parametrize("n", [1, 5, 64, 1000])
def test_first_last_and_every_index(n):
    for idx in (torch.tensor([0]), torch.tensor([n - 1]), torch.arange(n)):
        data = encode_indices(idx, n)
        assert data.numel() == index_nbytes(n, idx.numel())
        assert torch.equal(decode_indices(data, n, idx.numel()), idx)


def test_no_indices_take_no_bytes():
    assert index_nbytes(1000, 0) == 0
    assert encode_indices(torch.empty(0, dtype=torch.int64), 1000).numel() == 0
    assert decode_indices(torch.empty(0, dtype=torch.uint8), 1000, 0).numel() == 0


def test_the_chosen_coding_is_the_smallest():
    for n in (1, 10, 100, 1000, 10**6, 2**31, 2**31 + 1):
        for k in {1, 2, n // 100, n // 10, n // 4, n // 2, n} - {0}:
            size = index_nbytes(n, k)
            assert size <= (n + 7) // 8  # bitmap
            if n <= 2**31:
                assert size <= 4 * k  # u32


@pytest.mark.parametrize("n,k,coding", CASES)
def test_wrong_lengths_raise(n, k, coding):
    data = encode_indices(sample(n, k), n)
    with pytest.raises(IndexDecodeError, match=f"expected {data.numel()} for k={k} of n={n}"):
        decode_indices(data[:-1], n, k)
    with pytest.raises(IndexDecodeError, match="index bytes"):
        decode_indices(torch.cat([data, torch.zeros(1, dtype=torch.uint8)]), n, k)


def test_corrupt_u32_indices_raise():
    n = 2**31
    for bad in ([5, 5], [9, 3], [-1, 3], [3, -7]):  # repeated, descending, negative (int32)
        data = torch.tensor(bad, dtype=torch.int32).view(torch.uint8)
        with pytest.raises(IndexDecodeError, match="distinct, ascending and below n"):
            decode_indices(data, n, 2)


def test_corrupt_bitmap_raises():
    idx = torch.tensor([1, 4, 6, 7, 9, 12, 15, 19])
    data = encode_indices(idx, 20)
    assert choose_coding(20, 8) is IndexCoding.BITMAP
    extra = data.clone()
    extra[0] |= 1  # a ninth index
    with pytest.raises(IndexDecodeError, match="decoded 9 indices, expected 8"):
        decode_indices(extra, 20, 8)
    missing = data.clone()
    missing[0] &= ~(1 << 4) & 0xFF
    with pytest.raises(IndexDecodeError, match="decoded 7 indices, expected 8"):
        decode_indices(missing, 20, 8)
    beyond = data.clone()
    beyond[2] |= 0x80  # bit 23: past n = 20, in the last byte's padding, is not an index
    assert torch.equal(decode_indices(beyond, 20, 8), idx)


def test_corrupt_elias_fano_raises():
    n, k = 1000, 10
    idx = sample(n, k, seed=1)
    data = encode_indices(idx, n)
    assert choose_coding(n, k) is IndexCoding.ELIAS_FANO
    ones = data.clone()
    ones[-3:] = 0xFF  # too many unary ones in the upper bits
    with pytest.raises(IndexDecodeError, match="upper bits hold .* indices, expected 10"):
        decode_indices(ones, n, k)
    # the same high part for two indices whose low bits descend: not ascending
    low = max(0, (n // k).bit_length() - 1)
    pair = torch.tensor([(3 << low) + 5, (3 << low) + 6] + [(i + 4) << low for i in range(8)])
    data = encode_indices(pair, n)
    nlow = (k * low + 7) // 8
    lows = unpack_bits(data[:nlow], low, k).to(torch.int64)
    lows[[0, 1]] = lows[[1, 0]]
    forged = torch.cat([pack_bits(lows, low), data[nlow:]])
    with pytest.raises(IndexDecodeError, match="distinct, ascending"):
        decode_indices(forged, n, k)


@pytest.mark.parametrize("n,k", [(1000, 10), (1000, 400), (2**31, 3), (10**5, 1000), (37, 5)])
def test_random_bytes_decode_to_valid_indices_or_raise(n, k):
    """Whatever the bytes: k distinct ascending indices below n, or IndexDecodeError."""
    size = index_nbytes(n, k)
    g = torch.Generator().manual_seed(n + k)
    accepted = 0
    for _ in range(2000):
        data = torch.randint(0, 256, (size,), generator=g, dtype=torch.uint8)
        try:
            idx = decode_indices(data, n, k)
        except IndexDecodeError:
            continue
        accepted += 1
        assert idx.numel() == k and idx.dtype == torch.int64
        assert int(idx[0]) >= 0 and int(idx[-1]) < n and bool((idx.diff() > 0).all())
    assert accepted < 2000  # random bytes are not all valid codes


def test_corrupt_indices_in_a_packet_are_a_packet_error():
    codec = make_codec("topk")
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    packet = codec.encode(x, 0.01, RandomKey(step=1))
    indices = packet.parts[0].clone()
    indices[-4:] = 0xFF
    forged = type(packet)(
        codec, packet.level, packet.numel, packet.dtype, packet.key, (indices, packet.parts[1])
    )
    with pytest.raises(PacketError, match="corrupt packet: Elias-Fano upper bits"):
        codec.decode(from_wire(to_wire(forged), codec))
