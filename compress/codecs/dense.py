"""Dense codecs: every element is kept, cast to a narrower dtype or coded in a few bits.

`none` (as is), `fp16`, `bf16` (`Cast`: one part, the values in the wire dtype); `quant` (bits
2/4/8) and `sign` (1 bit, EF-signSGD) (`Grouped`: bit-packed codes with a (lo, step) scale per
group of `group_size`). A dense codec is used alone or codes the kept values of a sparse one.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import ClassVar

import torch

from .. import ops, reference
from ..packet import Packet, PartLayout
from .base import Codec, Level, is_number

ROUNDINGS = ("stochastic", "nearest")
QUANT_LEVELS = (2, 4, 8)


class Cast(Codec):
    """The values as they are in another (or the input's) float dtype: one part of numel."""

    wire_dtype: ClassVar[torch.dtype | None] = None
    """The dtype on the wire; None: the input's."""

    def layout(self, numel: int, level: Level, dtype: torch.dtype = torch.float32) -> PartLayout:
        return ((self.wire_dtype or dtype, numel),)

    def _encode(self, x, level, key):
        return (x.to(self.wire_dtype or x.dtype),)

    def _decode(self, packet):
        return packet.parts[0]

    def encode_ef(self, x, residual, level, key):
        # a 16-bit wire rounds the fp32 sum once (not via x.dtype first); `none` sends x.dtype
        acc = x.to(torch.float32) + residual.to(torch.float32)
        (sent,) = self._encode(acc if self.wire_dtype else acc.to(x.dtype), level, key)
        residual.copy_(acc - sent.to(torch.float32))
        return Packet(self, level, x.numel(), x.dtype, key, (sent,))


class NoneCodec(Cast):
    """Lossless: the input's own dtype."""

    name = "none"


class Fp16(Cast):
    """Half precision; values beyond fp16's range saturate (error feedback keeps the excess)."""

    name = "fp16"
    wire_dtype = torch.float16

    def _encode(self, x, level, key):
        finite = torch.isfinite(x)
        return (torch.where(finite, x.clamp(-65504.0, 65504.0), x).to(torch.float16),)


class Bf16(Cast):
    """bfloat16: fp32's range, 8 bits of mantissa."""

    name = "bf16"
    wire_dtype = torch.bfloat16


class Grouped(Codec):
    """Codes of a few bits per element with a (lo, step) scale per group of `group_size`:
    value = lo + code * step. Parts: packed codes, lo fp32[G], step fp32[G]."""

    stochastic: bool = False

    def __init__(self, group_size: int = 512, nonfinite: str = "raise") -> None:
        super().__init__(nonfinite)
        if (
            not isinstance(group_size, int)
            or isinstance(group_size, bool)
            or not 1 <= group_size <= ops.MAX_GROUP_SIZE
        ):
            raise ValueError(
                f"group_size={group_size!r} must be an int in [1, 2^30] (elements per scale)"
            )
        self.group_size = group_size

    @abstractmethod
    def bits(self, level: Level) -> int:
        """Bits per code at this level."""

    def layout(self, numel: int, level: Level, dtype: torch.dtype = torch.float32) -> PartLayout:
        groups = reference.num_groups(numel, self.group_size)
        codes = (numel * self.bits(level) + 7) // 8
        return ((torch.uint8, codes), (torch.float32, groups), (torch.float32, groups))

    def _quantize(self, x, residual, level, key):
        return ops.ef_quantize(x, residual, self.bits(level), self.group_size, self.stochastic, key)

    def _encode(self, x, level, key):
        return self._quantize(x, None, level, key)

    def _decode(self, packet):
        codes, lo, step = packet.parts
        return reference.dequantize(
            codes, lo, step, self.bits(packet.level), packet.numel, self.group_size
        )

    def encode_ef(self, x, residual, level, key):
        parts = self._quantize(x, residual, level, key)
        return Packet(self, level, x.numel(), x.dtype, key, parts)

    def accumulate(self, packets, out):
        for p in packets:
            self._check_accumulate(p, out)
        return ops.dequantize_accumulate(
            out, [p.parts for p in packets], [self.bits(p.level) for p in packets], self.group_size
        )


class Quant(Grouped):
    """Uniform quantization at 2, 4 or 8 bits (the level) between each group's min and max."""

    takes_level = True

    def __init__(
        self, group_size: int = 512, rounding: str = "stochastic", nonfinite: str = "raise"
    ) -> None:
        super().__init__(group_size, nonfinite)
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding={rounding!r}; use one of {ROUNDINGS}")
        self.rounding = rounding
        self.stochastic = rounding == "stochastic"
        self.name = f"quant(group={group_size},{rounding})"

    def check_level(self, level: Level) -> Level:
        if (
            is_number(level)
            and math.isfinite(level)
            and float(level).is_integer()
            and int(level) in QUANT_LEVELS
        ):
            return int(level)
        raise ValueError(f"level={level!r} for codec 'quant' is out of range: use bits 2, 4 or 8")

    def bits(self, level: Level) -> int:
        return level


class Sign(Grouped):
    """1 bit per element (the sign) and the group's mean |x| (EF-signSGD)."""

    def __init__(self, group_size: int = 512, nonfinite: str = "raise") -> None:
        super().__init__(group_size, nonfinite)
        self.name = f"sign(group={group_size})"

    def bits(self, level: Level) -> int:
        return 1
