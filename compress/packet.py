"""Packets: what a codec puts on the wire, and their byte format.

A `Packet` is the tensors (parts) a codec's encode produced plus what is needed to decode them:
which codec (by id), its level, the input's numel and dtype, and the RandomKey the randomness came
from. `to_wire` turns it into one uint8 tensor, `from_wire` back; the format is

    header (120 bytes, little-endian; see _HEADER)
    payload: the parts' bytes, each padded to 8 bytes, optionally zstd-compressed

The header carries a format version, the codec id, its levels, numel, dtype, the RandomKey, the
size of every part, the payload size, and a CRC32 of header and payload. `from_wire` checks every
one of these against the codec it is told to expect - and, given `expect=Expected(numel, level,
key, zstd)`, against what the receiver's plan says this packet must be - before it allocates or
decompresses anything, and raises `PacketError` on any mismatch: a corrupt, truncated, foreign,
out-of-step or wrong-version packet is never summed into a gradient, and a hostile one cannot
make the receiver allocate more than the packet it expects (without `expect`, a header's numel
is taken as declared: a sparse packet may then ask decode for a large output). A codec accepts
the ids of its old names too (`Codec.wire_ids`: "topk-sampled" packets decode as "topk"), so
the format version stays 1.

Without zstd the wire size is fixed by (codec, numel, level, dtype): `wire_nbytes` gives it before
encoding, which is what fixed-size collectives and the controller plan with. The zstd stage
(zstandard) is kept only where it makes the bytes smaller, so its size is known after encoding;
zstd.py measures what it saves and costs, so a caller can decide per link whether it pays.

This module knows codecs only through `WireCodec`, the few members the writer and reader call
(the codecs import this module, never the other way round): any `Codec` is one.
"""

from __future__ import annotations

import struct
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .rng import RandomKey

FORMAT_VERSION = 1
MAX_LEVELS = 4
MAX_PARTS = 8
ALIGN = 8

_MAGIC = b"CTPK"
_HEADER = struct.Struct(
    "<4s"  # magic
    "B"  # format version
    "B"  # flags (bit 0: payload is zstd-compressed)
    "B"  # input dtype code
    "B"  # number of levels used
    "I"  # codec id
    "Q"  # numel
    "Q"  # seed
    "Q"  # step
    "I"  # bucket
    "I"  # sending rank
    f"{MAX_LEVELS}d"  # levels
    "I"  # number of parts
    f"{MAX_PARTS}I"  # byte size of each part (unpadded)
    "I"  # payload bytes that follow the header
    "I"  # CRC32 of the header before this field and of the payload
)
HEADER_NBYTES = _HEADER.size
_FLAG_ZSTD = 1
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# A zstd block decodes to at most 128 KiB and takes at least 4 bytes (an RLE block: 3 bytes of
# header, 1 of content), so no frame of c bytes holds more than 32768 * c: a larger declared size
# is a lie, refused before anything is allocated for it.
_ZSTD_MAX_RATIO = 32768

_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}

PartLayout = tuple[tuple[torch.dtype, int], ...]
"""The parts of a packet: (dtype, number of elements) each, fixed by codec, numel and level."""


class WireCodec(Protocol):
    """What to_wire and from_wire need from a codec: its identity on the wire, its level as the
    header's floats and back, and the parts a packet of it holds. `Codec` implements it."""

    name: str
    """The codec's description, named in errors."""

    @property
    def id(self) -> int:
        """The 32-bit id the header carries."""

    @property
    def wire_ids(self) -> frozenset[int]:
        """Every id a packet this codec decodes may carry (its own and its old names')."""

    def check_level(self, level: Any) -> Any:
        """The level in canonical form, or ValueError / TypeError."""

    def level_floats(self, level: Any) -> tuple[float, ...]:
        """The level as the floats the header carries."""

    def level_from_floats(self, values: Sequence[float]) -> Any:
        """The level the header's floats describe (validated)."""

    def layout(self, numel: int, level: Any, dtype: torch.dtype = torch.float32) -> PartLayout:
        """The parts of a packet for numel elements of dtype at this level."""


class PacketError(ValueError):
    """A packet that must not be decoded: corrupt, truncated, foreign or of another version."""


@dataclass(frozen=True)
class Packet:
    """A codec's output. `parts` travel; codec, level, numel, dtype and key describe them."""

    codec: WireCodec
    level: object
    numel: int
    dtype: torch.dtype
    key: RandomKey
    parts: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        """Payload bytes (parts padded to 8), excluding the header."""
        return sum(_padded(p.numel() * p.element_size()) for p in self.parts)


@dataclass(frozen=True)
class Expected:
    """What the receiver's plan says a packet must be: from_wire checks these before it
    allocates or decompresses anything."""

    numel: int
    """Elements of the input the packet encodes (the receiver's shard size)."""
    level: Any
    """The sender's level in the plan (compared with `codec.check_level(level)`)."""
    key: RandomKey
    """(seed, step, bucket, sending rank) the packet must carry: another one is out of step."""
    zstd: bool = False
    """Whether the plan lets the sender zstd-compress the payload; if not, zstd is refused."""
    dtype: torch.dtype | None = None
    """The input's dtype (the bucket's), checked when given."""

    def __post_init__(self) -> None:
        if not isinstance(self.numel, int) or isinstance(self.numel, bool) or self.numel < 0:
            raise ValueError(f"Expected.numel={self.numel!r} must be a non-negative int")
        if not isinstance(self.key, RandomKey):
            raise TypeError(f"Expected.key: expected a RandomKey, got {type(self.key).__name__}")
        if not isinstance(self.zstd, bool):
            raise TypeError(f"Expected.zstd={self.zstd!r} must be True or False")
        if self.dtype is not None:
            dtype_code(self.dtype)


def _padded(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout_nbytes(layout: PartLayout) -> int:
    return sum(_padded(count * dtype.itemsize) for dtype, count in layout)


def wire_nbytes(layout: PartLayout) -> int:
    """Exact wire size of a packet with this layout, without the zstd stage."""
    return HEADER_NBYTES + layout_nbytes(layout)


def dtype_code(dtype: torch.dtype) -> int:
    if dtype not in _DTYPE_CODES:
        raise TypeError(f"dtype {dtype} has no wire code; use one of {list(_DTYPE_CODES)}")
    return _DTYPE_CODES[dtype]


def _crc(header: bytes, payload: torch.Tensor) -> int:
    return zlib.crc32(payload.numpy().data, zlib.crc32(header[:-4]))


def _payload(parts: tuple[torch.Tensor, ...], raw_sizes: list[int]) -> torch.Tensor:
    """The parts' bytes, each padded to ALIGN, as one uint8 tensor on the CPU."""
    payload = torch.zeros(sum(_padded(s) for s in raw_sizes), dtype=torch.uint8)
    offset = 0
    for part, size in zip(parts, raw_sizes, strict=True):
        payload[offset : offset + size] = (
            part.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        )
        offset += _padded(size)
    return payload


_contexts = threading.local()


def _compressor(zstd_level: int) -> Any:
    """This thread's zstd compressor at this level (a context is not for two threads at once,
    and making one per packet costs more than a small packet's compression)."""
    import zstandard

    made = _contexts.__dict__.setdefault("compressors", {})
    if zstd_level not in made:
        made[zstd_level] = zstandard.ZstdCompressor(level=zstd_level, write_content_size=True)
    return made[zstd_level]


def zstd_frame(payload: torch.Tensor, zstd_level: int) -> bytes:
    """The payload as one zstd frame that states its content size (from_wire requires it), by
    this thread's compressor: the stage to_wire runs, and what zstd.py times."""
    return _compressor(zstd_level).compress(payload.numpy().data)


def to_wire(packet: Packet, zstd_level: int | None = None) -> torch.Tensor:
    """Packet -> uint8 tensor (header + payload). With zstd_level set, the payload is
    zstd-compressed if (and only if) that makes it smaller."""
    levels = packet.codec.level_floats(packet.level)
    if len(packet.parts) > MAX_PARTS or len(levels) > MAX_LEVELS:
        raise ValueError(f"a packet holds at most {MAX_PARTS} parts and {MAX_LEVELS} levels")
    raw_sizes = [p.numel() * p.element_size() for p in packet.parts]
    payload = _payload(packet.parts, raw_sizes)
    flags = 0
    if zstd_level is not None and payload.numel() > 0:
        packed = zstd_frame(payload, zstd_level)
        if len(packed) < payload.numel():
            payload = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
            flags |= _FLAG_ZSTD
    fields = (
        _MAGIC,
        FORMAT_VERSION,
        flags,
        dtype_code(packet.dtype),
        len(levels),
        packet.codec.id,
        packet.numel,
        packet.key.seed,
        packet.key.step,
        packet.key.bucket,
        packet.key.rank,
        *levels,
        *([0.0] * (MAX_LEVELS - len(levels))),
        len(raw_sizes),
        *raw_sizes,
        *([0] * (MAX_PARTS - len(raw_sizes))),
        payload.numel(),
    )
    header = _HEADER.pack(*fields, 0)
    header = _HEADER.pack(*fields, _crc(header, payload))
    out = torch.empty(HEADER_NBYTES + payload.numel(), dtype=torch.uint8)
    out[:HEADER_NBYTES] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    out[HEADER_NBYTES:] = payload
    return out


def _as_bytes_tensor(buf: torch.Tensor | bytes | bytearray | memoryview) -> torch.Tensor:
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise PacketError(
                f"a packet is a 1-D uint8 tensor, got {buf.dtype} of shape {tuple(buf.shape)}"
            )
        return buf.cpu().contiguous()
    if isinstance(buf, (bytes, bytearray, memoryview)):
        return (
            torch.frombuffer(bytearray(buf), dtype=torch.uint8)
            if len(buf)
            else torch.empty(0, dtype=torch.uint8)
        )
    raise PacketError(f"a packet is bytes or a uint8 tensor, got {type(buf).__name__}")


def read_header(buf: torch.Tensor | bytes | bytearray | memoryview) -> dict:
    """Parse and check the header (magic, version, sizes, CRC) without knowing the codec."""
    data = _as_bytes_tensor(buf)
    if data.numel() < HEADER_NBYTES:
        raise PacketError(
            f"truncated packet: {data.numel()} bytes, a header alone is {HEADER_NBYTES}"
        )
    header = data[:HEADER_NBYTES].numpy().tobytes()
    fields = _HEADER.unpack(header)
    magic, version, flags, dtype_c, nlevels, codec_id, numel, seed, step, bucket, rank = fields[:11]
    levels = fields[11 : 11 + MAX_LEVELS]
    nparts = fields[11 + MAX_LEVELS]
    sizes = fields[12 + MAX_LEVELS : 12 + MAX_LEVELS + MAX_PARTS]
    payload_len, crc = fields[-2:]
    if magic != _MAGIC:
        raise PacketError(f"not a cloudtrain packet (magic {magic!r}, expected {_MAGIC!r})")
    if version != FORMAT_VERSION:
        raise PacketError(
            f"packet format version {version}, this cloudtrain reads version {FORMAT_VERSION}; "
            "all ranks must run the same cloudtrain release"
        )
    if data.numel() != HEADER_NBYTES + payload_len:
        raise PacketError(
            f"truncated or overlong packet: {data.numel()} bytes, the header says {HEADER_NBYTES + payload_len}"
        )
    payload = data[HEADER_NBYTES:]
    if _crc(header, payload) != crc:
        raise PacketError("packet checksum mismatch: the bytes were corrupted on the way")
    if (
        nlevels > MAX_LEVELS
        or nparts > MAX_PARTS
        or dtype_c not in _CODE_DTYPES
        or flags & ~_FLAG_ZSTD
    ):
        raise PacketError("malformed packet header")
    for field, value in (("seed", seed), ("step", step)):
        if value >= 2**63:
            raise PacketError(f"malformed packet header: {field} {value} is not below 2**63")
    return {
        "zstd": bool(flags & _FLAG_ZSTD),
        "dtype": _CODE_DTYPES[dtype_c],
        "codec_id": codec_id,
        "numel": numel,
        "key": RandomKey(seed, step, bucket, rank),
        "level": tuple(levels[:nlevels]),
        "part_sizes": tuple(sizes[:nparts]),
        "payload": payload,
    }


def _check_expected(h: dict, codec: WireCodec, level: object, expect: Expected) -> None:
    """Every field of the header against the plan (cheap comparisons, nothing allocated)."""
    if not isinstance(expect, Expected):
        raise TypeError(f"expect: expected an Expected, got {type(expect).__name__}")
    key, want = h["key"], expect.key
    if (key.step, key.bucket, key.rank) != (want.step, want.bucket, want.rank):
        raise PacketError(
            f"packet is for step {key.step}, bucket {key.bucket}, sender {key.rank}; expected "
            f"step {want.step}, bucket {want.bucket}, sender {want.rank}: ranks are out of step"
        )
    if key.seed != want.seed:
        raise PacketError(
            f"packet has seed {key.seed}; expected {want.seed}: ranks run with different seeds"
        )
    if h["numel"] != expect.numel:
        raise PacketError(
            f"packet holds {h['numel']} elements; expected {expect.numel}: the ranks' gradient "
            "buckets differ"
        )
    try:
        want_level = codec.check_level(expect.level)
    except (ValueError, TypeError) as e:
        raise ValueError(f"expect.level={expect.level!r} does not fit {codec.name!r}: {e}") from e
    if level != want_level:
        raise PacketError(
            f"packet has level {level!r} of {codec.name!r}; expected {want_level!r}: ranks "
            "disagree on the plan"
        )
    if expect.dtype is not None and h["dtype"] != expect.dtype:
        raise PacketError(f"packet encodes {h['dtype']}; expected {expect.dtype}")
    if h["zstd"] and not expect.zstd:
        raise PacketError(
            "packet payload is zstd-compressed; expected no zstd: the plan did not ask for it"
        )


def _unzstd(payload: torch.Tensor, raw_len: int) -> torch.Tensor:
    """Decompress a one-frame zstd payload that must hold exactly raw_len bytes. The frame's
    declared size is checked first: zstd allocates what a frame declares."""
    import zstandard

    data = payload.numpy().tobytes()
    if data[:4] != _ZSTD_MAGIC:
        raise PacketError("zstd payload does not start with a zstd frame")
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise PacketError(f"zstd frame header is unreadable: {e}") from e
    if declared != raw_len:
        said = "no size" if declared < 0 else f"{declared} bytes"
        raise PacketError(f"zstd frame declares {said}; expected {raw_len} (the codec's layout)")
    if declared > _ZSTD_MAX_RATIO * len(data):
        raise PacketError(
            f"zstd frame of {len(data)} bytes declares {declared}: more than zstd can hold"
        )
    try:
        raw = zstandard.ZstdDecompressor().decompress(
            data, max_output_size=raw_len, allow_extra_data=False
        )
    except zstandard.ZstdError as e:
        raise PacketError(f"zstd payload does not decompress: {e}") from e
    if len(raw) != raw_len:
        raise PacketError(f"zstd payload holds {len(raw)} bytes; expected {raw_len}")
    return (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if raw
        else torch.empty(0, dtype=torch.uint8)
    )


def from_wire(
    buf: torch.Tensor | bytes | bytearray | memoryview,
    codec: WireCodec,
    *,
    expect: Expected | None = None,
) -> Packet:
    """uint8 tensor or bytes -> Packet, checked against the codec the receiver expects and, with
    `expect`, against the receiver's plan: numel, level, RandomKey (seed, step, bucket, sender)
    and whether zstd may be used. Every declared size is checked before anything is allocated or
    decompressed.

    Raises PacketError - and only PacketError, whatever the bytes - for a corrupt, truncated,
    wrong-version, foreign, out-of-step or oversized packet. Without `expect`, a packet's numel is
    taken as declared: a receiver that knows what it expects should say so.
    """
    h = read_header(buf)
    if h["codec_id"] not in codec.wire_ids:
        raise PacketError(
            f"packet is from codec id {h['codec_id']:#010x}, expected {codec.name!r} ({codec.id:#010x}); "
            "ranks disagree on the compression config"
        )
    try:
        level = codec.level_from_floats(h["level"])
    except (ValueError, TypeError) as e:
        raise PacketError(f"packet header does not fit codec {codec.name!r}: {e}") from e
    if expect is not None:
        _check_expected(h, codec, level, expect)
    try:
        layout = codec.layout(h["numel"], level, h["dtype"])
    except (ValueError, TypeError) as e:
        raise PacketError(f"packet header does not fit codec {codec.name!r}: {e}") from e
    expected = tuple(count * dtype.itemsize for dtype, count in layout)
    if expected != h["part_sizes"]:
        raise PacketError(
            f"packet part sizes {h['part_sizes']} do not match codec {codec.name!r}: {expected}"
        )
    payload = h["payload"]
    raw_len = layout_nbytes(layout)
    if h["zstd"]:
        if payload.numel() >= raw_len:
            raise PacketError(
                f"zstd payload of {payload.numel()} bytes for {raw_len} raw: the sender keeps "
                "zstd only where it shrinks the payload"
            )
        payload = _unzstd(payload, raw_len)
    if payload.numel() != raw_len:
        raise PacketError(f"payload is {payload.numel()} bytes, the layout needs {raw_len}")
    parts, offset = [], 0
    for dtype, count in layout:
        size = count * dtype.itemsize
        parts.append(payload[offset : offset + size].view(dtype))
        offset += _padded(size)
    return Packet(codec, level, h["numel"], h["dtype"], h["key"], tuple(parts))


def cut(buf: torch.Tensor) -> torch.Tensor:
    """A packet received into a buffer of the largest size the plan allows for it (a zstd
    sender's packet is shorter, by how much only the sender knew): the packet's own bytes, as
    many as its header states - after checking the buffer holds that many. from_wire then checks
    the rest (magic, version, CRC, every size) as for any packet."""
    if buf.numel() < HEADER_NBYTES:
        raise PacketError(
            f"truncated packet: {buf.numel()} bytes, a header alone is {HEADER_NBYTES}"
        )
    payload_len = struct.unpack_from("<I", buf[HEADER_NBYTES - 8 : HEADER_NBYTES - 4].numpy())[0]
    if HEADER_NBYTES + payload_len > buf.numel():
        raise PacketError(
            f"packet declares {HEADER_NBYTES + payload_len} bytes, more than the "
            f"{buf.numel()} the plan allows its sender"
        )
    return buf[: HEADER_NBYTES + payload_len]
