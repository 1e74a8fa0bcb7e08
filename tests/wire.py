"""The packet header, restated here from its documented layout and not imported from the
packet module, so that an accidental change of the wire format fails a test (test_packet.py)
instead of passing along with it; and `forge`, which builds what a buggy or hostile sender could
put on the wire: a packet with header fields (and the payload) replaced and a valid CRC
(test_packet.py, test_fuzz.py).

    forge(wire, body=None, **fields)    e.g. forge(wire, numel=2**28, l0=1e-6)
"""

from __future__ import annotations

import struct
import zlib

import torch

HEADER = struct.Struct("<4sBBBBIQQQII4dI8III")
"""magic, format version, flags (bit 0: the payload is zstd-compressed), dtype, level count, codec id, numel, seed, step, bucket, rank, four
levels, part count, eight part sizes, payload length, CRC-32 (of the header before it and the
payload): 120 bytes, little-endian."""
FIELDS = ["magic", "version", "flags", "dtype", "nlevels", "codec_id", "numel", "seed", "step"]
FIELDS += ["bucket", "rank", "l0", "l1", "l2", "l3", "nparts"]
FIELDS += [f"size{i}" for i in range(8)] + ["payload_len", "crc"]


def with_crc(values: list, body: bytes) -> bytes:
    """The header of `values` (the CRC among them replaced by the right one), then `body`."""
    values = [*values[:-1], 0]
    crc = zlib.crc32(body, zlib.crc32(HEADER.pack(*values)[:-4]))
    return HEADER.pack(*values[:-1], crc) + body


def forge(wire: torch.Tensor | bytes, body: bytes | None = None, **fields) -> bytes:
    """The packet `wire` with some header fields (by FIELDS name) and, given `body`, the payload
    replaced (payload_len then follows it); the CRC fixed."""
    data = bytes(wire.numpy().tobytes()) if isinstance(wire, torch.Tensor) else bytes(wire)
    values = list(HEADER.unpack(data[: HEADER.size]))
    for name, value in fields.items():
        values[FIELDS.index(name)] = value
    if body is None:
        body = data[HEADER.size :]
    else:
        values[FIELDS.index("payload_len")] = len(body)
    return with_crc(values, body)
