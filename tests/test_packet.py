"""Wire format: header fields round-trip, zstd only where it pays, and every kind of damage -
corruption anywhere, truncation, another version, another codec - raises PacketError."""

from __future__ import annotations

import struct

import pytest
import torch
from wire import HEADER, forge

from cloudtrain.compress import (
    HEADER_NBYTES,
    Expected,
    PacketError,
    RandomKey,
    cut,
    from_wire,
    make_codec,
    parse_spec,
    read_header,
    to_wire,
    wire_zstd_gain,
    zstd_gain,
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
    for end in (0, 10, HEADER_NBYTES - 1, HEADER_NBYTES, wire.numel() - 1):
        with pytest.raises(PacketError, match="truncated"):
            from_wire(wire[:end], codec)
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
    # a level the codec does not have (3 bits), at the first level's place (byte 44)
    bad_level = torch.frombuffer(bytearray(forge(wire, l0=3.0)), dtype=torch.uint8)
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


# -- the receiver's plan: from_wire(..., expect=Expected(...)) ----------------------------------


def test_header_layout_is_as_documented():
    assert HEADER.size == HEADER_NBYTES == 120
    _, _, wire = encoded("quant:4")
    assert forge(wire) == bytes(wire.numpy().tobytes())


KEY = RandomKey(seed=11, step=22, bucket=33, rank=4)


@pytest.mark.parametrize("spec", SPECS)
def test_expected_packets_pass(spec):
    codec, packet, wire = encoded(spec)
    level = parse_spec(spec)[1]
    back = from_wire(wire, codec, expect=Expected(20_000, level, KEY, dtype=torch.float32))
    assert torch.equal(codec.decode(back), codec.decode(packet))
    _, _, zipped = encoded(spec, zstd=3)
    back = from_wire(zipped, codec, expect=Expected(20_000, level, KEY, zstd=True))
    assert torch.equal(codec.decode(back), codec.decode(packet))


@pytest.mark.parametrize(
    "change,match",
    [
        (
            {"key": RandomKey(seed=11, step=23, bucket=33, rank=4)},
            "packet is for step 22, bucket 33, sender 4; expected step 23, bucket 33, sender 4: "
            "ranks are out of step",
        ),
        ({"key": RandomKey(seed=11, step=22, bucket=34, rank=4)}, "expected step 22, bucket 34"),
        ({"key": RandomKey(seed=11, step=22, bucket=33, rank=5)}, "sender 4; expected .*sender 5"),
        ({"key": RandomKey(seed=12, step=22, bucket=33, rank=4)}, "seed 11; expected 12"),
        ({"numel": 20_001}, "holds 20000 elements; expected 20001"),
        ({"level": (0.1, 0.1, 8)}, r"level \(0.1, 0.1, 4\) .*; expected \(0.1, 0.1, 8\)"),
        ({"level": (0.2, 0.1, 4)}, "expected \\(0.2, 0.1, 4\\): ranks disagree on the plan"),
        ({"dtype": torch.bfloat16}, "encodes torch.float32; expected torch.bfloat16"),
    ],
)
def test_every_field_is_checked_against_the_plan(change, match):
    spec = "randomk:0.1>topk:0.1>quant:4"
    codec, _, wire = encoded(spec)
    fields = {"numel": 20_000, "level": (0.1, 0.1, 4), "key": KEY, **change}
    with pytest.raises(PacketError, match=match):
        from_wire(wire, codec, expect=Expected(**fields))


def test_zstd_only_where_the_plan_asked_for_it():
    codec = make_codec("none")
    packet = codec.encode(torch.zeros(10_000))
    zipped = to_wire(packet, zstd_level=1)
    with pytest.raises(PacketError, match="zstd-compressed; expected no zstd"):
        from_wire(zipped, codec, expect=Expected(10_000, None, RandomKey()))
    back = from_wire(zipped, codec, expect=Expected(10_000, None, RandomKey(), zstd=True))
    assert torch.equal(codec.decode(back), torch.zeros(10_000))
    # a plan with zstd accepts plain payloads too: the sender keeps zstd only where it shrinks
    back = from_wire(to_wire(packet), codec, expect=Expected(10_000, None, RandomKey(), zstd=True))
    assert torch.equal(codec.decode(back), torch.zeros(10_000))


def test_bad_expected_values_are_caller_errors():
    with pytest.raises(ValueError, match="Expected.numel=-1"):
        Expected(-1, None, RandomKey())
    with pytest.raises(TypeError, match="Expected.key: expected a RandomKey"):
        Expected(10, None, (0, 0, 0, 0))
    with pytest.raises(TypeError, match="Expected.zstd"):
        Expected(10, None, RandomKey(), zstd=1)
    codec, _, wire = encoded("quant:4")
    with pytest.raises(ValueError, match="expect.level=3 does not fit"):
        from_wire(wire, codec, expect=Expected(20_000, 3, KEY))


def zstd_frame(declared: int | None, body: bytes = b"\x01\x00\x00") -> bytes:
    """A zstd frame header (single segment, 8-byte content size) declaring `declared` bytes,
    then `body` (default: one empty last raw block)."""
    if declared is None:
        return b"\x28\xb5\x2f\xfd" + b"\x00\x50" + body  # no content size, window descriptor
    return b"\x28\xb5\x2f\xfd" + b"\xe0" + declared.to_bytes(8, "little") + body


def test_hostile_headers_raise_packet_error_without_allocating():
    """Hostile headers (a step past 2**63, a tiny frame claiming 1 TiB, a random-k packet claiming
    2**28 elements), each refused before anything is allocated for it."""
    none = make_codec("none")
    _, _, small = encoded("none", n=64)
    # a step that no RandomKey holds
    with pytest.raises(PacketError, match="step 9223372036854775808 is not below 2\\*\\*63"):
        from_wire(forge(small, step=2**63), none)
    with pytest.raises(PacketError, match="seed .* is not below 2\\*\\*63"):
        from_wire(forge(small, seed=2**64 - 1), none)
    # a 16-byte frame that claims 1 TiB, in a header laid out for 1 GiB (2**28 fp32)
    tib = zstd_frame(2**40)
    assert len(tib) == 16
    gib = dict(numel=2**28, size0=2**30, flags=1)
    with pytest.raises(PacketError, match="declares 1099511627776 bytes; expected 1073741824"):
        from_wire(forge(small, tib, **gib), none)
    # the same frame claiming exactly the layout's 1 GiB: more than 16 bytes of zstd can hold
    with pytest.raises(PacketError, match="zstd frame of 16 bytes declares 1073741824"):
        from_wire(forge(small, zstd_frame(2**30), **gib), none)
    # a header whose own part size claims 1 TiB does not fit the layout
    with pytest.raises(PacketError, match="part sizes"):
        from_wire(forge(small, tib, numel=2**38, flags=1), none)
    # with the plan's numel, the size is refused before the frame is even read
    with pytest.raises(PacketError, match="holds 268435456 elements; expected 64"):
        from_wire(forge(small, tib, **gib), none, expect=Expected(64, None, KEY, zstd=True))
    # a random-k packet of 136 bytes that claims 2**28 elements (decode would allocate 1 GiB)
    randomk, density = make_codec("randomk"), 4 / 2**28
    packet = randomk.encode(torch.ones(64), 4 / 64, KEY)
    claim = forge(to_wire(packet), numel=2**28, l0=density)
    assert len(claim) == 136 and from_wire(claim, randomk).numel == 2**28  # consistent...
    with pytest.raises(PacketError, match="holds 268435456 elements; expected 64"):
        from_wire(claim, randomk, expect=Expected(64, 4 / 64, KEY))  # ...but not the plan's


def test_zstd_frames_must_state_their_exact_size_and_nothing_more():
    import zstandard

    codec = make_codec("none")
    packet = codec.encode(torch.zeros(4096), None, KEY)
    raw = to_wire(packet)[HEADER_NBYTES:].numpy().tobytes()
    plain = to_wire(packet)
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    with pytest.raises(PacketError, match="zstd frame declares no size; expected 16384"):
        from_wire(forge(plain, unsized, flags=1), codec)
    framed = zstandard.ZstdCompressor().compress(raw)
    with pytest.raises(PacketError, match="does not decompress"):
        from_wire(forge(plain, framed + b"\x00" * 8, flags=1), codec)  # trailing bytes
    with pytest.raises(PacketError, match="does not start with a zstd frame"):
        from_wire(forge(plain, b"\x00" * 64, flags=1), codec)
    with pytest.raises(PacketError, match="frame declares 8192 bytes; expected 16384"):
        from_wire(forge(plain, zstandard.ZstdCompressor().compress(raw[:8192]), flags=1), codec)
    with pytest.raises(PacketError, match="keeps zstd only where it shrinks"):
        from_wire(forge(plain, raw, flags=1), codec)  # "compressed" but as large as raw
    assert torch.equal(
        codec.decode(from_wire(forge(plain, framed, flags=1), codec)), packet.parts[0]
    )


def test_zstd_gain_measures_what_the_stage_saves_and_costs():
    codec = make_codec("none")
    zeros = zstd_gain(codec, None, torch.zeros(100_000), zstd_level=1)
    plain = to_wire(codec.encode(torch.zeros(100_000)))
    zipped = to_wire(codec.encode(torch.zeros(100_000)), zstd_level=1)
    assert zeros.ratio == pytest.approx(plain.numel() / zipped.numel())  # the wire's own ratio
    assert zeros.ratio > 100 and zeros.encode_s_per_byte > 0 and zeros.decode_s_per_byte > 0
    noise = zstd_gain(codec, None, torch.rand(100_000, generator=torch.Generator().manual_seed(0)))
    assert 1.0 <= noise.ratio < 1.2  # random mantissas barely compress; never below 1
    # on a slow link the saved bytes outweigh the CPU; on an infinitely fast one nothing is saved
    assert zeros.net_seconds_per_byte(bandwidth=50e6 / 8) > 0
    assert zeros.net_seconds_per_byte(bandwidth=float("inf")) < 0
    empty = zstd_gain(codec, None, torch.empty(0))
    assert (empty.ratio, empty.encode_s_per_byte) == (1.0, 0.0)


def test_a_trial_on_a_sample_of_a_wire_measures_the_stage():
    codec = make_codec("none")
    wire = to_wire(codec.encode(torch.zeros(100_000)))
    whole, sample = wire_zstd_gain(wire), wire_zstd_gain(wire, sample_bytes=4096)
    assert whole.ratio > sample.ratio > 10  # zeros: the more of them, the higher the ratio
    assert wire_zstd_gain(wire[:HEADER_NBYTES]).ratio == 1.0  # no payload, nothing to gain


@pytest.mark.parametrize("spec", SPECS)
def test_a_packet_cut_from_a_larger_buffer_is_the_packet(spec):
    codec, packet, plain = encoded(spec)
    _, _, zipped = encoded(spec, zstd=1)
    buffer = torch.full((plain.numel(),), 0xAB, dtype=torch.uint8)  # the plan's size, unzipped
    buffer[: zipped.numel()] = zipped
    back = from_wire(cut(buffer), codec)
    assert torch.equal(codec.decode(back), codec.decode(packet))
    assert torch.equal(cut(plain), plain)


def test_a_cut_never_believes_more_than_the_buffer_holds():
    _, _, wire = encoded("quant:4", zstd=1)
    with pytest.raises(PacketError, match="more than the .* the plan allows"):
        cut(wire[:-1])  # the header says one byte more than arrived
    with pytest.raises(PacketError, match="truncated"):
        cut(wire[:10])
    lying = wire.clone()
    lying[HEADER_NBYTES - 8 : HEADER_NBYTES - 4] = 0xFF  # a payload of 4 GiB
    with pytest.raises(PacketError, match="more than"):
        cut(lying)
    # a shorter length than sent: cut, then refused by the checksum
    lying = wire.clone()
    lying[HEADER_NBYTES - 8] -= 1
    with pytest.raises(PacketError):
        from_wire(cut(lying), make_codec("quant"))


def test_bench_zstd_table_covers_the_ladder():
    from cloudtrain.compress.bench import ZSTD_CASES as LADDER
    from cloudtrain.compress.bench import ZSTD_LEVELS, bench_zstd

    x = torch.randn(20_000, generator=torch.Generator().manual_seed(0))
    rows = bench_zstd(x, LADDER, repeats=1)
    assert [(r["case"], r["zstd_level"]) for r in rows] == [
        (c, z) for c in LADDER for z in ZSTD_LEVELS
    ]
    for r in rows:
        assert r["ratio"] >= 1 and r["encode_ns_per_byte"] > 0 and r["pays_below_mbit"] >= 0
