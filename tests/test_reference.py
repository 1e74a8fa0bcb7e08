"""The pure-PyTorch reference ops (the oracle of the native kernels) and index coding."""

from __future__ import annotations

import pytest
import torch

from cloudtrain.compress import RandomKey, make_codec
from cloudtrain.compress import reference as ref
from cloudtrain.compress.indices import (
    IndexCoding,
    IndexDecodeError,
    choose_coding,
    decode_indices,
    encode_indices,
    index_nbytes,
)

SIZES = [0, 1, 7, 8, 9, 1000, 2**16 + 3]


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 7, 8, 12, 17, 31])
@pytest.mark.parametrize("n", SIZES)
def test_pack_unpack_round_trip(bits, n):
    g = torch.Generator().manual_seed(bits * 1000 + n)
    codes = torch.randint(0, 2**bits, (n,), generator=g)
    packed = ref.pack_bits(codes if bits > 8 else codes.to(torch.uint8), bits)
    assert packed.dtype == torch.uint8 and packed.numel() == (n * bits + 7) // 8
    assert torch.equal(ref.unpack_bits(packed, bits, n).to(torch.int64), codes)


def test_pack_bits_layout_is_little_endian_within_bytes():
    assert (
        ref.pack_bits(torch.tensor([1, 0, 1, 1, 0, 0, 0, 1], dtype=torch.uint8), 1).item()
        == 0b10001101
    )
    assert ref.pack_bits(torch.tensor([3, 0, 2, 1], dtype=torch.uint8), 2).item() == 0b01100011
    assert ref.pack_bits(torch.tensor([0xA, 0x5], dtype=torch.uint8), 4).item() == 0x5A
    # 3-bit fields cross byte boundaries: 0b111 at element 2 occupies bits 6, 7 of byte 0, bit 0 of byte 1
    assert ref.pack_bits(torch.tensor([0, 0, 7]), 3).tolist() == [0b11000000, 0b00000001]


@pytest.mark.parametrize(
    "n,k",
    [
        (1, 1),
        (10, 1),
        (10, 10),
        (1000, 10),
        (1000, 300),
        (1000, 900),
        (10**6, 1000),
        (2**20 + 3, 7),
    ],
)
def test_index_coding_round_trip_and_exact_size(n, k):
    g = torch.Generator().manual_seed(n + k)
    idx = torch.randperm(n, generator=g)[:k].sort().values
    data = encode_indices(idx, n)
    assert data.numel() == index_nbytes(n, k)
    assert torch.equal(decode_indices(data, n, k), idx)


def test_index_coding_picks_the_smallest():
    assert choose_coding(10**6, 10**4) is IndexCoding.ELIAS_FANO
    assert choose_coding(1000, 900) is IndexCoding.BITMAP
    # 1% density: about 2 + log2(100) = 8.6 bits per index against 32
    assert index_nbytes(10**6, 10**4) < 10**4 * 9 / 8 + 16
    for n, k in [(100, 1), (10**6, 10**4), (5000, 2500)]:
        assert index_nbytes(n, k) <= min(4 * k, (n + 7) // 8)


def test_corrupt_index_bytes_raise():
    idx = torch.tensor([3, 10, 500, 999])
    data = encode_indices(idx, 1000)
    with pytest.raises(IndexDecodeError, match="index bytes"):
        decode_indices(data[:-1], 1000, 4)
    bad = data.clone()
    bad[-1] = 0xFF
    with pytest.raises(IndexDecodeError):
        decode_indices(bad, 1000, 4)
    assert choose_coding(2**31, 2) is IndexCoding.U32  # a couple of indices into a huge range
    repeated = torch.tensor([5, 5], dtype=torch.int32).view(torch.uint8)
    with pytest.raises(IndexDecodeError, match="distinct, ascending"):
        decode_indices(repeated, 2**31, 2)
    assert decode_indices(
        encode_indices(torch.tensor([7, 2**31 - 1]), 2**31), 2**31, 2
    ).tolist() == [7, 2**31 - 1]


@pytest.mark.parametrize("n", [1, 7, 1000, 100_003])
@pytest.mark.parametrize("k_frac", [0.001, 0.1, 1.0])
@pytest.mark.parametrize("sampled", [False, True])
def test_ef_topk_select(n, k_frac, sampled):
    g = torch.Generator().manual_seed(n)
    grad, residual = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.3
    acc = grad + residual
    k = max(1, int(k_frac * n))
    r = residual.clone()
    idx, vals = ref.ef_topk_select(grad, r, k, sampled)
    assert idx.numel() == k and bool((idx.diff() > 0).all())
    assert torch.equal(vals, acc[idx])
    expect = acc.clone()
    expect[idx] = 0
    assert torch.equal(r, expect), "residual keeps exactly what was not sent"
    assert torch.equal(idx, topk_by_stable_sort(acc.abs(), k))


def topk_by_stable_sort(mag: torch.Tensor, k: int) -> torch.Tensor:
    """The oracle of top-k selection, by another algorithm than the reference's: a stable sort
    by descending magnitude keeps equal values in index order, so its first k are the k largest
    with ties at the k-th value going to the lowest indices."""
    return torch.sort(mag, descending=True, stable=True).indices[:k].sort().values


@pytest.mark.parametrize("n", [1, 2, 10, 1000, 100_003])
@pytest.mark.parametrize("k_frac", [0.0, 0.001, 0.1, 0.5, 1.0])
@pytest.mark.parametrize(
    "kind", ["random", "ties", "constant", "zeros", "sorted", "few-large"], ids=str
)
def test_magnitude_and_sampled_topk_match_a_stable_sort(n, k_frac, kind):
    g = torch.Generator().manual_seed(n)
    mag = {
        "random": lambda: torch.rand(n, generator=g),
        "ties": lambda: torch.randint(0, 5, (n,), generator=g).float(),
        "constant": lambda: torch.full((n,), 0.5),
        "zeros": lambda: torch.zeros(n),
        "sorted": lambda: torch.linspace(0, 1, n),
        "few-large": lambda: torch.cat([torch.zeros(n - n // 100), torch.rand(n // 100) + 1]),
    }[kind]()
    k = int(k_frac * n)
    expect = topk_by_stable_sort(mag, k)
    assert torch.equal(ref.magnitude_topk(mag, k), expect)
    assert torch.equal(ref.sampled_topk(mag, k), expect)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 511, 512, 513, 5000])
def test_ef_quantize_residual_is_the_exact_error(bits, n):
    g = torch.Generator().manual_seed(bits + n)
    grad, residual = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1
    r = residual.clone()
    packed, lo, step = ref.ef_quantize(
        grad, r, bits, 512, stochastic=True, generator=torch.Generator().manual_seed(0)
    )
    decoded = ref.dequantize(packed, lo, step, bits, n, 512)
    assert torch.equal(r, (grad + residual) - decoded)
    assert packed.numel() == (n * bits + 7) // 8 and lo.numel() == (n + 511) // 512


def test_constant_group_decodes_exactly():
    x = torch.full((1000,), 0.25)
    packed, lo, step = ref.ef_quantize(
        x, None, 4, 512, stochastic=True, generator=torch.Generator()
    )
    assert torch.equal(step, torch.zeros(2))
    assert torch.equal(ref.dequantize(packed, lo, step, 4, 1000, 512), x)


def test_accumulate_order_is_the_contract():
    """dequantize_accumulate and sparse_accumulate sum packets in list order: the same as adding
    them one by one, bit for bit, and the same on every rank that gets the same packets."""
    codec = make_codec("quant")
    xs = [torch.randn(3000, generator=torch.Generator().manual_seed(i)) * 10**i for i in range(4)]
    packets = [
        codec.encode(x, b, RandomKey(rank=i))
        for i, (x, b) in enumerate(zip(xs, [8, 4, 2, 8], strict=True))
    ]
    out = torch.zeros(3000)
    codec.accumulate(packets, out)
    one_by_one = torch.zeros(3000)
    for p in packets:
        one_by_one += codec.decode(p)
    assert torch.equal(out, one_by_one)

    sparse = make_codec("topk")
    sp = [sparse.encode(x, 0.1) for x in xs]
    out2 = torch.zeros(3000)
    sparse.accumulate(sp, out2)
    one_by_one = torch.zeros(3000)
    for p in sp:
        one_by_one += sparse.decode(p)
    assert torch.equal(out2, one_by_one)
    with pytest.raises(ValueError, match="cannot accumulate into 2999"):
        sparse.accumulate(sp, torch.zeros(2999))


def test_ef_quantize_rejects_bad_bits():
    with pytest.raises(ValueError, match=r"bits=3 is not supported; use one of \(1, 2, 4, 8\)"):
        ref.ef_quantize(torch.ones(4), None, 3, 512, False)
