"""Wire format: header fields round-trip, zstd only where it pays, and every kind of damage -
corruption anywhere, truncation, another version, another codec - raises PacketError."""

from __future__ import annotations

import struct

import pytest
import torch

from cloudtrain.compress import (
    HEADER_NBYTES,
    PacketError,
    RandomKey,
    from_wire,
    make_codec,
    parse_spec,
    read_header,
    to_wire,
)
from cloudtrain.compress.packet import FORMAT_VERSION

SPECS = ["none", "fp16", "quant:4", "sign", "topk:0.01", "randomk:0.1>topk:0.1>quant:4"]


def encoded(spec: str, n: int = 20_000, zstd: int | None = None):
    codec, level = parse_spec(spec)
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    packet = codec.encode(x, level, RandomKey(seed=11, step=22, bucket=33, rank=4))
    return codec, packet, to_wire(packet, zstd_level=zstd)


def test_header_carries_what_decoding_needs():
    codec, packet, wire = encoded("randomk:0.1>topk:0.1>quant:4")
    h = read_header(wire)
    assert h["numel"] == 20_000 and h["dtype"] == torch.float32
    assert h["key"] == RandomKey(seed=11, step=22, bucket=33, rank=4)
    assert h["codec_id"] == codec.id and h["level"] == (0.1, 0.1, 4.0)
    back = from_wire(wire.numpy().tobytes(), codec)  # bytes work as well as tensors
    assert back.level == packet.level and back.key == packet.key
    assert torch.equal(codec.decode(back), codec.decode(packet))


@pytest.mark.parametrize("spec", SPECS)
def test_zstd_only_when_it_shrinks(spec):
    codec, packet, plain = encoded(spec)
    _, _, zipped = encoded(spec, zstd=3)
    assert zipped.numel() <= plain.numel()
    assert torch.equal(codec.decode(from_wire(zipped, codec)), codec.decode(packet))


def test_zstd_shrinks_compressible_payloads():
    codec = make_codec("none")
    packet = codec.encode(torch.zeros(100_000))
    zipped = to_wire(packet, zstd_level=1)
    assert zipped.numel() < HEADER_NBYTES + 1000 < to_wire(packet).numel()
    assert read_header(zipped)["zstd"]
    assert torch.equal(codec.decode(from_wire(zipped, codec)), torch.zeros(100_000))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("zstd", [None, 3])
def test_any_flipped_byte_is_rejected(spec, zstd):
    codec, _, wire = encoded(spec, n=3000, zstd=zstd)
    positions = sorted(
        {
            0,
            4,
            5,
            8,
            12,
            20,
            44,
            80,
            HEADER_NBYTES - 1,
            HEADER_NBYTES,
            wire.numel() // 2,
            wire.numel() - 1,
        }
    )
    for pos in positions:
        bad = wire.clone()
        bad[pos] ^= 0x40
        with pytest.raises(PacketError):
            from_wire(bad, codec)


@pytest.mark.parametrize("spec", SPECS)
def test_truncated_and_overlong_packets_are_rejected(spec):
    codec, _, wire = encoded(spec, n=3000)
    for cut in (0, 10, HEADER_NBYTES - 1, HEADER_NBYTES, wire.numel() - 1):
        with pytest.raises(PacketError, match="truncated"):
            from_wire(wire[:cut], codec)
    with pytest.raises(PacketError, match="overlong"):
        from_wire(torch.cat([wire, torch.zeros(8, dtype=torch.uint8)]), codec)


def _rewrite_header(wire: torch.Tensor, offset: int, fmt: str, value) -> torch.Tensor:
    """Change one header field and fix up the CRC, as a foreign or newer sender would."""
    import zlib

    data = bytearray(wire.numpy().tobytes())
    struct.pack_into(fmt, data, offset, value)
    crc = zlib.crc32(bytes(data[HEADER_NBYTES:]), zlib.crc32(bytes(data[: HEADER_NBYTES - 4])))
    struct.pack_into("<I", data, HEADER_NBYTES - 4, crc)
    return torch.frombuffer(data, dtype=torch.uint8)


def test_wrong_version_is_rejected_with_a_clear_message():
    codec, _, wire = encoded("quant:8")
    newer = _rewrite_header(wire, 4, "<B", FORMAT_VERSION + 1)
    with pytest.raises(
        PacketError, match=f"format version {FORMAT_VERSION + 1}.*same cloudtrain release"
    ):
        from_wire(newer, codec)


def test_packet_of_another_codec_is_rejected():
    _, _, wire = encoded("quant:8")
    with pytest.raises(PacketError, match="ranks disagree on the compression config"):
        from_wire(wire, make_codec("quant", group_size=128))
    with pytest.raises(PacketError, match="ranks disagree"):
        from_wire(wire, make_codec("topk"))


def test_consistent_but_wrong_sizes_are_rejected():
    """A header whose CRC is right but whose numel does not fit the payload must not decode."""
    codec, _, wire = encoded("quant:8", n=3000)
    lying = _rewrite_header(wire, 12, "<Q", 3001)
    with pytest.raises(PacketError, match="part sizes"):
        from_wire(lying, codec)
    bad_level = _rewrite_header(wire, 48, "<d", 3.0)
    with pytest.raises(PacketError, match="does not fit codec"):
        from_wire(bad_level, codec)


def test_corrupt_indices_behind_a_valid_crc_are_rejected():
    """Even with a matching CRC (a buggy sender), index bytes that do not decode to k distinct
    ascending indices below n raise instead of scattering into the gradient."""
    codec, level = parse_spec("topk:0.01")
    packet = codec.encode(torch.randn(10_000), level)
    indices = packet.parts[0].clone()
    indices[:] = 0xFF  # Elias-Fano upper bits all ones: wrong count of indices
    forged = type(packet)(
        codec, level, packet.numel, packet.dtype, packet.key, (indices, packet.parts[1])
    )
    with pytest.raises(PacketError, match="corrupt packet"):
        codec.decode(from_wire(to_wire(forged), codec))


def test_not_a_packet():
    codec = make_codec("fp16")
    with pytest.raises(PacketError, match="not a cloudtrain packet"):
        from_wire(b"x" * 200, codec)
    with pytest.raises(PacketError, match="1-D uint8 tensor"):
        from_wire(torch.zeros(200), codec)
    with pytest.raises(PacketError, match="bytes or a uint8 tensor"):
        from_wire("text", codec)
