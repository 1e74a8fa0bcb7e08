"""What the packets' zstd stage gains on a link: a cost model from a timed trial.

    gain = zstd_gain(codec, level, sample)           # encode a sample, then time zstd on it
    gain = wire_zstd_gain(to_wire(packet), 1, sample_bytes=65536)   # on a packet already made
    gain.net_seconds_per_byte(bandwidth, receivers)  # > 0: zstd pays on this link
    gain.pays_below()                                # the link speed (bytes/s) below which it pays

The stage itself is packet.py's (to_wire compresses a payload only where that makes it smaller,
from_wire checks and decompresses it); this module only measures it, with the same compressor,
so the controller and the bench can turn it on per link where the link time it saves exceeds the
CPU it costs.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from .codecs.base import Codec, Level
from .packet import HEADER_NBYTES, to_wire, zstd_frame
from .rng import RandomKey

# This thread's decompressor, made once: a trial on a small packet costs less than making one.
_decompressors = threading.local()


@dataclass(frozen=True)
class ZstdGain:
    """The zstd stage measured on one codec's packets. Per-byte figures are per byte of the
    packet without zstd (`codec.nbytes`, what the plan knows before encoding)."""

    ratio: float
    """Wire bytes without zstd / with zstd (>= 1: the stage is skipped where it does not shrink)."""
    encode_s_per_byte: float
    """CPU seconds the sender spends compressing, per byte."""
    decode_s_per_byte: float
    """CPU seconds a receiver spends decompressing, per byte."""

    def saved_per_byte(self, receivers: int = 1) -> float:
        """Bytes the stage keeps off the sender's link per byte of its packet, which crosses the
        link once to each of `receivers` regions."""
        return receivers * (1 - 1 / max(self.ratio, 1.0))

    def cpu_per_byte(self) -> float:
        """CPU seconds per byte on the exchange's path: the sender compresses once, and each
        receiver (on its own machine, at the same time) decompresses once."""
        return self.encode_s_per_byte + self.decode_s_per_byte

    def net_seconds_per_byte(self, bandwidth: float, receivers: int = 1) -> float:
        """Link seconds the stage saves minus CPU seconds it costs, per byte of a packet sent
        over a link of `bandwidth` bytes/s to `receivers` regions. Positive: zstd pays."""
        return self.saved_per_byte(receivers) / bandwidth - self.cpu_per_byte()

    def pays_below(self, receivers: int = 1, margin: float = 1.0) -> float:
        """The link speed (bytes/s) below which the link time saved is `margin` x the CPU it
        costs (0: never)."""
        cpu = self.cpu_per_byte()
        return self.saved_per_byte(receivers) / (margin * cpu) if cpu > 0 else 0.0


def zstd_gain(
    codec: Codec,
    level: Level,
    sample: torch.Tensor,
    zstd_level: int = 1,
    *,
    key: RandomKey | None = None,
    repeats: int = 3,
) -> ZstdGain:
    """Encode `sample` (e.g. a real gradient) with codec at level, then time the zstd stage on
    that packet (`wire_zstd_gain`), so a caller can turn the stage on for a link where
    `net_seconds_per_byte` is positive."""
    packet = codec.encode(sample, level, key or RandomKey())
    return wire_zstd_gain(to_wire(packet), zstd_level, repeats=repeats)


def wire_zstd_gain(
    wire: torch.Tensor, zstd_level: int = 1, *, sample_bytes: int | None = None, repeats: int = 1
) -> ZstdGain:
    """The zstd stage timed on a packet already on the wire without it (`to_wire(packet)`): the
    ratio it would get and its CPU cost per byte (best of `repeats`). With `sample_bytes`, on
    that many bytes of the payload in 16 chunks spread over it (every part of a packet - indices
    and values - is sampled), a trial that costs little on a large packet."""
    import zstandard

    payload = wire[HEADER_NBYTES:]
    if sample_bytes is not None and payload.numel() > sample_bytes:
        chunk = max(sample_bytes // 16, 1)
        starts = torch.linspace(0, payload.numel() - chunk, 16).long().tolist()
        payload = torch.cat([payload[a : a + chunk] for a in starts])
    if payload.numel() == 0:
        return ZstdGain(1.0, 0.0, 0.0)
    plain = HEADER_NBYTES + payload.numel()
    encode_s = decode_s = float("inf")
    packed = b""
    if not hasattr(_decompressors, "decompressor"):
        _decompressors.decompressor = zstandard.ZstdDecompressor()
    decompressor = _decompressors.decompressor
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        packed = zstd_frame(payload, zstd_level)
        t1 = time.perf_counter()
        decompressor.decompress(packed, max_output_size=payload.numel())
        t2 = time.perf_counter()
        encode_s, decode_s = min(encode_s, t1 - t0), min(decode_s, t2 - t1)
    zipped = HEADER_NBYTES + min(len(packed), payload.numel())
    return ZstdGain(plain / zipped, encode_s / plain, decode_s / plain)
