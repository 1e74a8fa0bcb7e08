"""The codec contract: `Codec`, the abstract encode/decode pair every codec implements, and the
checks of its inputs that the codecs, error feedback and the hook share.

A subclass sets `name` and implements `layout`, `_encode` and `_decode`; `Codec` gives it the
public `encode` / `decode` / `accumulate`, exact sizes (`nbytes`) and the default level handling
(no level). dense.py and sparse.py hold the built-in codecs, registry.py builds them by name.
"""

from __future__ import annotations

import numbers
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from ..packet import Packet, PacketError, PartLayout, layout_nbytes, wire_nbytes
from ..rng import RandomKey

NONFINITE = ("raise", "pass")

Level = Any  # None | int | float | tuple of those (compositions)


def flat_float(x: Any, name: str = "x") -> torch.Tensor:
    """x as a flat contiguous floating-point tensor, or a TypeError naming the argument."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(
            f"{name}: expected a floating-point tensor (float32, float16, bfloat16), got {x.dtype}; "
            "gradients of integer or boolean tensors cannot be compressed"
        )
    return x.reshape(-1).contiguous()


def all_finite(x: torch.Tensor) -> bool:
    """True if x has no NaN or Inf. One fast reduction (a sum, which any NaN or Inf poisons); the
    elementwise check runs only when the sum is not finite, as a sum of large finite values can
    overflow. isfinite().all() alone is ~30x slower on the CPU."""
    if x.numel() == 0 or bool(torch.isfinite(x.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(x).all())


def check_finite(x: torch.Tensor, name: str = "x") -> None:
    if not all_finite(x):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(
            f"{name}: {bad} of {x.numel()} values are NaN or Inf. Fix the loss, or, with AMP's "
            "GradScaler (which skips such steps on every rank), set nonfinite='pass'"
        )


def is_number(value: Any) -> bool:
    """A real number that is not a bool (True is an int to Python, never a level here)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_nonfinite(nonfinite: str) -> str:
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite={nonfinite!r}; use one of {NONFINITE}")
    return nonfinite


class Codec(ABC):
    """A pure encode/decode pair over a flat tensor.

    A subclass sets `name` (its identity on the wire: the codec id is a CRC of it, so put every
    parameter that changes the bytes into it) and implements `layout`, `_encode` and `_decode`.
    A codec with a level sets `takes_level` and overrides `check_level` (and, if its level is not
    one float, `level_floats` / `level_from_floats`).
    """

    name: str
    takes_level: ClassVar[bool] = False
    """Whether the level carries a value (bits, density); False: the level is always None."""
    is_composite = False

    def __init__(self, nonfinite: str = "raise") -> None:
        self.nonfinite = _check_nonfinite(nonfinite)

    @property
    def id(self) -> int:
        """32-bit id on the wire: a CRC of the full description, parameters included."""
        return zlib.crc32(self.name.encode())

    @property
    def wire_ids(self) -> frozenset[int]:
        """Every id a packet this codec decodes may carry: its own, and those of old names of
        the same codec (a "topk-sampled" packet is a "topk" packet)."""
        return frozenset({self.id})

    def __repr__(self) -> str:
        return f"<codec {self.name}>"

    # -- levels -------------------------------------------------------------------------------
    def check_level(self, level: Level) -> Level:
        """The level in canonical form, or ValueError saying the valid range."""
        if level is not None:
            raise ValueError(f"codec {self.name!r} takes no level, got level={level!r}")
        return None

    def level_floats(self, level: Level) -> tuple[float, ...]:
        """The level as the floats the wire header carries."""
        return () if level is None else (float(level),)

    def level_from_floats(self, values: Sequence[float]) -> Level:
        """Inverse of level_floats (validated)."""
        if len(values) != int(self.takes_level):
            raise ValueError(
                f"codec {self.name!r} carries {int(self.takes_level)} level values, "
                f"got {len(values)}"
            )
        return self.check_level(values[0] if values else None)

    # -- sizes --------------------------------------------------------------------------------
    @abstractmethod
    def layout(self, numel: int, level: Level, dtype: torch.dtype = torch.float32) -> PartLayout:
        """The packet's parts, (dtype, count) each, for an input of numel elements of dtype."""

    def nbytes(self, numel: int, level: Level = None, dtype: torch.dtype = torch.float32) -> int:
        """Exact bytes on the wire (header included, no zstd) - known before encoding."""
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise ValueError(f"numel={numel!r} must be a non-negative int")
        return wire_nbytes(self.layout(numel, self.check_level(level), dtype))

    def payload_nbytes(
        self, numel: int, level: Level = None, dtype: torch.dtype = torch.float32
    ) -> int:
        return layout_nbytes(self.layout(numel, self.check_level(level), dtype))

    # -- public encode/decode -----------------------------------------------------------------
    def encode(self, x: torch.Tensor, level: Level = None, key: RandomKey | None = None) -> Packet:
        """Encode a floating-point tensor (flattened; any layout). Returns a Packet."""
        x = flat_float(x)
        level = self.check_level(level)
        key = key or RandomKey()
        if self.nonfinite == "raise":
            check_finite(x)
        return Packet(self, level, x.numel(), x.dtype, key, self._encode(x, level, key))

    def decode(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode into `out` (any float dtype, packet.numel elements) or a new flat tensor."""
        self._check_packet(packet)
        if out is None:
            out = torch.empty(packet.numel, dtype=packet.dtype, device=self._device(packet))
        elif (
            not isinstance(out, torch.Tensor)
            or not out.is_floating_point()
            or out.numel() != packet.numel
        ):
            raise ValueError(f"out: expected a floating-point tensor of {packet.numel} elements")
        if packet.numel:
            decoded = self._decode(packet)
            out.view(-1).copy_(decoded) if out.is_contiguous() else out.copy_(
                decoded.view(out.shape)
            )
        return out

    def encode_ef(
        self, x: torch.Tensor, residual: torch.Tensor, level: Level, key: RandomKey
    ) -> Packet:
        """Encode x + residual and leave in `residual` (fp32 or bf16) what the packet did not
        carry. Only ErrorFeedback calls this (it validated x, level and residual); codecs with a
        fused op override it. The packet describes an input of x's dtype, so that is what is
        encoded: acc rounded to x.dtype, the rounding kept in the residual too."""
        acc = x.to(torch.float32) + residual.to(torch.float32)
        parts = self._encode(acc.to(x.dtype), level, key)
        packet = Packet(self, level, x.numel(), x.dtype, key, parts)
        residual.copy_(acc - self._decode(packet).to(torch.float32))
        return packet

    def accumulate(self, packets: Sequence[Packet], out: torch.Tensor) -> torch.Tensor:
        """out (fp32) += decode(p) for each packet, in order."""
        for p in packets:
            self._check_accumulate(p, out)
            out.add_(self._decode(p).to(torch.float32))
        return out

    # -- subclass hooks -------------------------------------------------------------------------
    @abstractmethod
    def _encode(self, x: torch.Tensor, level: Level, key: RandomKey) -> tuple[torch.Tensor, ...]:
        """Parts of the packet for flat x (validated), matching `layout` exactly."""

    @abstractmethod
    def _decode(self, packet: Packet) -> torch.Tensor:
        """Flat decoded tensor (fp32, or packet.dtype for lossless dtype codecs)."""

    def _check_packet(self, packet: Packet) -> None:
        if not isinstance(packet, Packet):
            raise TypeError(f"packet: expected a Packet, got {type(packet).__name__}")
        if packet.codec.id != self.id:
            raise PacketError(
                f"packet: made by codec {packet.codec.name!r}, cannot decode with {self.name!r}"
            )

    def _check_accumulate(self, packet: Packet, out: torch.Tensor) -> None:
        self._check_packet(packet)
        if packet.numel != out.numel():
            raise ValueError(
                f"packet of {packet.numel} elements cannot accumulate into {out.numel()}"
            )

    @staticmethod
    def _device(packet: Packet) -> torch.device:
        return packet.parts[0].device if packet.parts else torch.device("cpu")
