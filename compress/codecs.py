"""Gradient codecs: pure encode/decode pairs over a flat tensor, in a registry a user can extend.

    codec = make_codec("topk")                       # or "quant", "randomk>topk>quant", ...
    packet = codec.encode(x, level=0.01, key=RandomKey(seed, step, bucket, rank))
    y = codec.decode(packet)                          # same numel and dtype as x
    codec.nbytes(x.numel(), 0.01)                     # exact wire bytes, known before encoding

Built-in codecs. Dense ones keep every element: `none` (as is), `fp16`, `bf16`, `quant` (bits
2/4/8, per-group min/max scale, stochastic or nearest rounding, bit-packed), `sign` (1 bit +
per-group mean |x|, EF-signSGD). Sparsifiers keep k = ceil(density * n) elements: `topk` (exactly
the k largest |x|; the threshold is found from a sample first, as in DGC, unless sampled=False -
the kept elements are the same either way), `randomk` (indices from the shared RandomKey, none on
the wire). "topk-sampled" is an old name of `topk`. Compositions chain sparsifiers and end with a
dense codec for the kept values, written with ">": "randomk>topk>quant" is CocktailSGD's random-k,
then top-k of those, then 4-bit values (level (0.1, 0.1, 4)). A later sparsifier's indices are
positions within the previous selection, so they code in fewer bits.

A level is the codec's one knob: bits for `quant`, density for sparsifiers, none for the rest; a
composition's level is a tuple with one entry per stage (None for stages without a knob).
`parse_spec("randomk:0.1>topk:0.1>quant:4")` gives codec and level from one string.

Adding a codec: subclass `Codec` (a dense codec: `name`, `layout`, `_encode`, `_decode`; a level
if `takes_level`) or `Sparsifier` (a selection stage), and `register_codec("mine", factory)`.
The factory receives the parameters it names among those given to `make_codec` (`group_size`,
`rounding`, `nonfinite`, `sampled`, ...); the others are not passed. A registered dense codec can
also end a composition ("topk>mine").

Error feedback lives in feedback.py and is the only caller of `encode_ef`, the fused step it
runs (fused native ops where there are some, `x + r -> encode -> r = acc - decode` otherwise).
The hot ops come from ops.py: native kernels where built, reference.py otherwise. Non-finite
input: `nonfinite="raise"` (default) raises; "pass" lets NaN/Inf through deterministically
(NaN/Inf are selected first by top-k and poison their quantization group), so every rank sums the
same non-finite values and AMP's GradScaler skips the step on all.
"""

from __future__ import annotations

import enum
import inspect
import itertools
import math
import numbers
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from . import ops, reference
from .indices import IndexDecodeError, decode_indices, encode_indices, index_nbytes
from .packet import Packet, PacketError, PartLayout, layout_nbytes, wire_nbytes
from .rng import RandomKey


class CodecKind(enum.Enum):
    """The names of the built-in codecs (the registry also holds what users add)."""

    NONE = "none"
    FP16 = "fp16"
    BF16 = "bf16"
    QUANT = "quant"
    SIGN = "sign"
    TOPK = "topk"
    RANDOMK = "randomk"


ROUNDINGS = ("stochastic", "nearest")
NONFINITE = ("raise", "pass")
QUANT_LEVELS = (2, 4, 8)

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


def density_k(n: int, density: float) -> int:
    """Elements a sparsifier keeps: ceil(density * n), at least 1 of a non-empty tensor."""
    return 0 if n == 0 else min(n, max(1, math.ceil(density * n)))


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


# ---------------------------------------------------------------------------------------------
# dense codecs: every element kept


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
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
            raise ValueError(
                f"group_size={group_size!r} must be a positive int (elements per scale)"
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


# ---------------------------------------------------------------------------------------------
# sparsifiers and compositions


class Sparsifier(ABC):
    """One selection stage of a sparse codec: which k of m elements to keep.

    `wire_indices` False means the indices are derived from the RandomKey alone (`replay`), so
    none go on the wire; True means the stage's indices are coded into the packet.
    """

    name: str
    old_names: ClassVar[tuple[str, ...]] = ()
    """Former names of this stage, whose packets still decode (their codec ids)."""
    wire_indices: ClassVar[bool] = True

    @abstractmethod
    def select(self, x: torch.Tensor, k: int, key: RandomKey, stage: int) -> torch.Tensor:
        """Ascending int64 indices of the k elements of flat fp32 x to keep."""

    def replay(self, m: int, k: int, key: RandomKey, stage: int) -> torch.Tensor:
        """The indices `select` chose, from the key alone (stages without wire indices)."""
        raise NotImplementedError(f"{self.name!r} puts its indices on the wire")

    def __repr__(self) -> str:
        return f"<sparsifier {self.name}>"


class TopK(Sparsifier):
    """The k largest |x| (NaN, then Inf first; ties to the lowest indices). With sampled=True the
    reference finds a threshold from a sample before the exact selection (DGC); the kept elements
    are the same, so it is not part of the codec's identity (the native kernels choose their own
    algorithm)."""

    name = "topk"
    old_names = ("topk-sampled",)

    def __init__(self, sampled: bool = True) -> None:
        if not isinstance(sampled, bool):
            raise ValueError(f"sampled={sampled!r} must be True or False")
        self.sampled = sampled

    def select(self, x, k, key, stage):
        return ops.ef_topk_select(x, None, k, self.sampled)[0]


class RandomK(Sparsifier):
    """k distinct indices drawn from the shared RandomKey: the same on every rank, none sent."""

    name = "randomk"
    wire_indices = False

    def select(self, x, k, key, stage):
        return self.replay(x.numel(), k, key, stage).to(x.device)

    def replay(self, m, k, key, stage):
        return _random_indices(m, k, key, stage)


class Sparse(Codec):
    """One or more sparsifier stages, then a dense codec for the kept values.

    Stage i keeps k_i = density_k(n_{i-1}, level_i) of the previous stage's n_{i-1} elements.
    Stages with wire indices put them (positions within the previous selection) on the wire;
    random-k stages derive theirs from the shared RandomKey, so every rank picks the same ones.
    """

    def __init__(
        self, stages: Sequence[Sparsifier], values: Codec | None = None, nonfinite: str = "raise"
    ) -> None:
        super().__init__(nonfinite)
        if not stages or not all(isinstance(s, Sparsifier) for s in stages):
            raise ValueError("a sparse codec needs one or more sparsifier stages (topk, randomk)")
        values = NoneCodec(nonfinite) if values is None else values
        if not isinstance(values, Codec) or isinstance(values, Sparse):
            raise ValueError(f"the kept values need a dense codec, got {values!r}")
        self.stages = tuple(stages)
        self.values = values
        self.is_composite = len(self.stages) > 1 or not isinstance(values, NoneCodec)
        self.name = self._name([s.name for s in self.stages])
        self.takes_level = True

    def _name(self, stage_names: Sequence[str]) -> str:
        return ">".join([*stage_names, self.values.name] if self.is_composite else stage_names)

    @property
    def wire_ids(self) -> frozenset[int]:
        choices = [(s.name, *s.old_names) for s in self.stages]
        return frozenset(zlib.crc32(self._name(c).encode()) for c in itertools.product(*choices))

    # levels: one density per stage, then the value codec's level where it has one
    def check_level(self, level: Level) -> Level:
        nstages = len(self.stages)
        has_level = self.values.takes_level
        entries = level if isinstance(level, tuple) else (level,)
        if not has_level and len(entries) == nstages + 1:
            if entries[-1] is not None:
                raise ValueError(
                    f"codec {self.values.name!r} takes no level, got {entries[-1]!r} "
                    f"(in level={level!r} of {self.name!r})"
                )
            entries = entries[:-1]
        if len(entries) != nstages + has_level:
            raise ValueError(
                f"codec {self.name!r} takes {nstages + has_level} level values "
                f"(a density per sparsifier{', then the values codec level' if has_level else ''})"
                f", got level={level!r}"
            )
        densities = []
        for stage, d in zip(self.stages, entries, strict=False):
            if not is_number(d) or not 0 < d <= 1:
                raise ValueError(
                    f"level={d!r} for {stage.name!r} is out of range: use a density in (0, 1], "
                    "e.g. 0.01 for 1%"
                )
            densities.append(float(d))
        canonical = (
            (*densities, self.values.check_level(entries[-1])) if has_level else tuple(densities)
        )
        return canonical if self.is_composite else canonical[0]

    def _split(self, level: Level) -> tuple[tuple[float, ...], Level]:
        level = level if isinstance(level, tuple) else (level,)
        nstages = len(self.stages)
        return level[:nstages], (level[nstages] if len(level) > nstages else None)

    def level_floats(self, level: Level) -> tuple[float, ...]:
        densities, vlevel = self._split(level)
        return tuple(densities) + self.values.level_floats(vlevel)

    def level_from_floats(self, values: Sequence[float]) -> Level:
        return self.check_level(tuple(values))

    def _ks(self, numel: int, densities: Sequence[float]) -> list[int]:
        ks, m = [], numel
        for d in densities:
            m = density_k(m, d)
            ks.append(m)
        return ks

    def kept(self, numel: int, level: Level) -> int:
        """Elements the packet carries values for."""
        densities, _ = self._split(self.check_level(level))
        return self._ks(numel, densities)[-1]

    def layout(self, numel: int, level: Level, dtype: torch.dtype = torch.float32) -> PartLayout:
        densities, vlevel = self._split(level)
        parts, m = [], numel
        for stage, k in zip(self.stages, self._ks(numel, densities), strict=True):
            if stage.wire_indices:
                parts.append((torch.uint8, index_nbytes(m, k)))
            m = k
        return (*parts, *self.values.layout(m, vlevel, torch.float32))

    def _select(
        self, acc: torch.Tensor, level: Level, key: RandomKey, residual: torch.Tensor | None
    ):
        """Run the stages on acc. Returns (global positions, kept values, index parts).

        With a residual and a single top-k stage this is the fused op, which also leaves acc
        (zeroed at the kept positions) in the residual.
        """
        densities, _ = self._split(level)
        ks = self._ks(acc.numel(), densities)
        if residual is not None and len(self.stages) == 1 and isinstance(self.stages[0], TopK):
            positions, values = ops.ef_topk_select(acc, residual, ks[0], self.stages[0].sampled)
            return positions, values, (encode_indices(positions.cpu(), acc.numel()),)
        if residual is not None:
            acc = acc.to(torch.float32) + residual.to(torch.float32)
            residual.copy_(acc)
        positions, current, index_parts = None, acc.to(torch.float32), []
        for i, (stage, k) in enumerate(zip(self.stages, ks, strict=True)):
            m = current.numel()
            local = stage.select(current, k, key, i)
            if stage.wire_indices:
                index_parts.append(encode_indices(local.cpu(), m).to(current.device))
            positions = local if positions is None else positions[local]
            current = current[local]
        if residual is not None:
            residual[positions] = 0
        return positions, current, tuple(index_parts)

    def _encode(self, x, level, key):
        return self._encode_with(x, level, key, None)

    def encode_ef(self, x, residual, level, key):
        return Packet(
            self, level, x.numel(), x.dtype, key, self._encode_with(x, level, key, residual)
        )

    def _encode_with(self, x, level, key, residual):
        _, vlevel = self._split(level)
        positions, values, index_parts = self._select(x, level, key, residual)
        value_parts = self.values._encode(values, vlevel, key)
        if residual is not None and not isinstance(self.values, NoneCodec) and values.numel():
            # what the value codec lost stays in the residual
            decoded = self._decode_values(value_parts, values.numel(), vlevel, key)
            residual[positions] = (values - decoded).to(residual.dtype)
        return (*index_parts, *value_parts)

    def _decode_values(self, parts, k, vlevel, key):
        return self.values._decode(
            Packet(self.values, vlevel, k, torch.float32, key, tuple(parts))
        ).to(torch.float32)

    def positions_and_values(self, packet: Packet) -> tuple[torch.Tensor, torch.Tensor]:
        """Global indices (ascending) and fp32 values the packet carries."""
        densities, vlevel = self._split(packet.level)
        ks = self._ks(packet.numel, densities)
        device = self._device(packet)
        positions, m, next_part = None, packet.numel, 0
        for i, (stage, k) in enumerate(zip(self.stages, ks, strict=True)):
            if stage.wire_indices:
                try:
                    local = decode_indices(packet.parts[next_part].cpu(), m, k)
                except IndexDecodeError as e:
                    raise PacketError(f"corrupt packet: {e}") from e
                next_part += 1
            else:
                local = stage.replay(m, k, packet.key, i)
            local = local.to(device)
            positions = local if positions is None else positions[local]
            m = k
        values = self._decode_values(packet.parts[next_part:], m, vlevel, packet.key)
        return positions, values

    def _decode(self, packet):
        positions, values = self.positions_and_values(packet)
        out = torch.zeros(packet.numel, dtype=torch.float32, device=values.device)
        out[positions] = values
        return out

    def accumulate(self, packets, out):
        pairs = []
        for p in packets:
            self._check_accumulate(p, out)
            pairs.append(self.positions_and_values(p))
        return ops.sparse_accumulate(out, pairs)


def _random_indices(m: int, k: int, key: RandomKey, stage: int) -> torch.Tensor:
    """k distinct indices of [0, m), ascending, the same on every rank for the same key.

    Drawn on the CPU from the shared generator (never torch's global RNG). Below a quarter
    density, oversample with replacement and thin to k distinct (O(k log k)); above, permute.
    """
    if k >= m:
        return torch.arange(m, dtype=torch.int64)
    gen = key.shared(stream=stage)
    if 4 * k > m:
        return torch.randperm(m, generator=gen)[:k].sort().values
    draws = math.ceil(-m * math.log1p(-k / m) * 1.05) + 16
    unique = torch.randint(m, (draws,), generator=gen).unique()
    while unique.numel() < k:  # rare: draw more until there are enough distinct ones
        more = torch.randint(m, (draws,), generator=gen)
        unique = torch.cat([unique, more]).unique()
    keep = torch.randperm(unique.numel(), generator=gen)[:k]
    return unique[keep].sort().values


# ---------------------------------------------------------------------------------------------
# the registry and construction

CodecFactory = Callable[..., "Codec | Sparsifier"]
"""Builds a dense codec or a sparsifier stage from the parameters it names (keywords)."""

_REGISTRY: dict[str, CodecFactory] = {}
_ALIASES: dict[str, str] = {"topk-sampled": "topk"}


def _accepted(factory: CodecFactory) -> set[str] | None:
    """Keyword parameters the factory takes; None if it takes any (**kwargs)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }


def register_codec(name: str, factory: CodecFactory, *, replace: bool = False) -> None:
    """Make `name` usable in make_codec / parse_spec / a config's codec.

    `factory(**params)` returns a `Codec` (dense: usable alone or to code a composition's kept
    values) or a `Sparsifier` (a selection stage); it receives only the parameters its signature
    names (group_size, rounding, nonfinite, sampled, ...). A class is a factory. Every rank must
    register the same codecs; packets name their codec by a CRC of `Codec.name`.
    """
    if (
        not isinstance(name, str)
        or not name
        or name != name.strip()
        or any(c in name for c in ">:")
    ):
        raise ValueError(
            f"codec name {name!r}: use a non-empty name without spaces, '>' or ':' (they separate "
            "stages and levels in a spec)"
        )
    if not callable(factory):
        raise TypeError(
            f"factory for codec {name!r} must be callable, got {type(factory).__name__}"
        )
    if (name in _REGISTRY or name in _ALIASES) and not replace:
        raise ValueError(f"codec {name!r} is already registered; pass replace=True to replace it")
    _ALIASES.pop(name, None)
    _REGISTRY[name] = factory


def registered_codecs() -> tuple[str, ...]:
    """The registered codec names, in registration order (aliases not included)."""
    return tuple(_REGISTRY)


for _name, _factory in (
    (CodecKind.NONE.value, NoneCodec),
    (CodecKind.FP16.value, Fp16),
    (CodecKind.BF16.value, Bf16),
    (CodecKind.QUANT.value, Quant),
    (CodecKind.SIGN.value, Sign),
    (CodecKind.TOPK.value, TopK),
    (CodecKind.RANDOMK.value, RandomK),
):
    register_codec(_name, _factory)


def _factory(name: str) -> CodecFactory:
    name = _ALIASES.get(name, name)
    if name not in _REGISTRY:
        aliases = ", ".join(f"{a} (= {b})" for a, b in _ALIASES.items())
        raise ValueError(
            f"unknown codec {name!r}; known codecs: {', '.join(_REGISTRY)}"
            + (f"; old names: {aliases}" if aliases else "")
        )
    return _REGISTRY[name]


def _build(name: str, params: dict[str, Any]) -> Codec | Sparsifier:
    factory = _factory(name)
    accepted = _accepted(factory)
    built = factory(
        **(params if accepted is None else {k: v for k, v in params.items() if k in accepted})
    )
    if not isinstance(built, (Codec, Sparsifier)) or isinstance(built, Sparse):
        raise TypeError(
            f"the factory of codec {name!r} returned {built!r}; it must return a dense Codec or a "
            "Sparsifier"
        )
    return built


def make_codec(name: str, **params: Any) -> Codec:
    """A codec by registered name or composition ("randomk>topk>quant"). Unknown names raise,
    listing the registered ones. `params` go to every stage that takes them: group_size and
    rounding (quant, sign), nonfinite (all), sampled (topk), and those of registered codecs; a
    parameter no registered codec takes raises (a typo), unless a factory takes **kwargs."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"codec name must be a non-empty string, got {name!r}")
    known: set[str] | None = set()
    for factory in _REGISTRY.values():
        accepted = _accepted(factory)
        if accepted is None:
            known = None
            break
        known |= accepted
    if known is not None and set(params) - known:
        raise ValueError(
            f"unknown codec parameter(s) {sorted(set(params) - known)}; the registered codecs "
            f"take {sorted(known)}"
        )
    names = [part.strip() for part in name.split(">")]
    built = [_build(n, params) for n in names]
    nonfinite = params.get("nonfinite", "raise")
    if isinstance(built[-1], Codec):
        values, stages = built[-1], built[:-1]
    else:
        values, stages = None, built
    if any(not isinstance(s, Sparsifier) for s in stages):
        raise ValueError(
            f"codec {name!r}: only sparsifiers (topk, randomk, ...) can come before '>'; a dense "
            f"codec (none, fp16, bf16, quant, sign, ...) may only come last"
        )
    if not stages:
        return values
    return Sparse(stages, values if values is not None else _build("none", params), nonfinite)


def _parse_number(spec: str, name: str, value: str) -> int | float:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    raise ValueError(f"codec spec {spec!r}: level {value!r} of {name!r} is not a number")


def parse_spec(spec: str, **params: Any) -> tuple[Codec, Level]:
    """ "topk:0.01", "quant:8", "fp16", "randomk:0.1>topk:0.1>quant:4" -> (codec, level).

    Levels are checked as given: "quant:8.9" or "topk:0.1>fp16:5" raise, never round or drop."""
    if not isinstance(spec, str):
        raise ValueError(f"codec spec must be a string, got {spec!r}")
    names, levels = [], []
    for stage in spec.split(">"):
        name, sep, value = stage.strip().partition(":")
        name, value = name.strip(), value.strip()
        if sep and not value:
            raise ValueError(f"codec spec {spec!r}: ':' after {name!r} but no level")
        names.append(name)
        levels.append(_parse_number(spec, name, value) if value else None)
    codec = make_codec(">".join(names), **params)
    level = tuple(levels) if codec.is_composite else levels[0]
    return codec, codec.check_level(level)
