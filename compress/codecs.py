"""Gradient codecs: pure encode/decode pairs over a flat tensor, registered by name.

    codec = make_codec("topk")                       # or "quant", "randomk>topk>quant", ...
    packet = codec.encode(x, level=0.01, key=RandomKey(seed, step, bucket, rank))
    y = codec.decode(packet)                          # same numel and dtype as x
    codec.nbytes(x.numel(), 0.01)                     # exact wire bytes, known before encoding

Registry (`CodecKind`): dense codecs keep every element - `none` (as is), `fp16`, `bf16`,
`quant` (bits 2/4/8, per-group min/max scale, stochastic or nearest rounding, bit-packed), `sign`
(1 bit + per-group mean |x|, EF-signSGD); sparsifiers keep k = ceil(density * n) elements -
`topk` (exact k largest |x|), `topk-sampled` (same k, found from a sampled threshold, DGC),
`randomk` (indices from the shared RandomKey, none on the wire). Compositions chain sparsifiers
and end with a dense codec for the kept values, written with ">": "randomk>topk>quant" is
CocktailSGD's random-k, then top-k of those, then 4-bit values (level (0.1, 0.1, 4)). A later
sparsifier's indices are positions within the previous selection, so they code in fewer bits.

A level is the codec's one knob: bits for `quant`, density for sparsifiers, none for the rest; a
composition's level is a tuple with one entry per stage (None for stages without a knob).
`parse_spec("randomk:0.1>topk:0.1>quant:4")` gives codec and level from one string.

Error feedback lives in feedback.py; `encode_ef` is the hook it calls, fused where there is a
fused op. The hot ops come from ops.py: native kernels where built, reference.py otherwise.
Non-finite input: `nonfinite="raise"` (default) raises; "pass" lets NaN/Inf through
deterministically (NaN/Inf are selected first by top-k and poison their quantization
group), so every rank sums the same non-finite values and AMP's GradScaler skips the step on all.
"""

from __future__ import annotations

import enum
import math
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from . import ops, reference
from .indices import IndexDecodeError, decode_indices, encode_indices, index_nbytes
from .packet import Layout, Packet, PacketError, layout_nbytes, wire_nbytes
from .rng import RandomKey


class CodecKind(enum.Enum):
    """Every codec by name; an unknown name fails here, when the config is read."""

    NONE = "none"
    FP16 = "fp16"
    BF16 = "bf16"
    QUANT = "quant"
    SIGN = "sign"
    TOPK = "topk"
    TOPK_SAMPLED = "topk-sampled"
    RANDOMK = "randomk"

    @classmethod
    def parse(cls, name: str) -> CodecKind:
        try:
            return cls(name.strip())
        except ValueError:
            known = ", ".join(k.value for k in cls)
            raise ValueError(f"unknown codec {name!r}; known codecs: {known}") from None


SPARSIFIERS = (CodecKind.TOPK, CodecKind.TOPK_SAMPLED, CodecKind.RANDOMK)
ROUNDINGS = ("stochastic", "nearest")
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


def density_k(n: int, density: float) -> int:
    """Elements a sparsifier keeps: ceil(density * n), at least 1 of a non-empty tensor."""
    return 0 if n == 0 else min(n, max(1, math.ceil(density * n)))


class Codec(ABC):
    """A pure encode/decode pair. Subclasses define the name, levels, layout and math."""

    name: str
    is_composite = False

    def __init__(self, nonfinite: str = "raise") -> None:
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite={nonfinite!r}; use one of {NONFINITE}")
        self.nonfinite = nonfinite

    @property
    def id(self) -> int:
        """32-bit id on the wire: a CRC of the full description, parameters included."""
        return zlib.crc32(self.name.encode())

    def __repr__(self) -> str:
        return f"<codec {self.name}>"

    # -- levels -------------------------------------------------------------------------------
    @abstractmethod
    def check_level(self, level: Level) -> Level:
        """The level in canonical form, or ValueError saying the valid range."""

    @abstractmethod
    def level_floats(self, level: Level) -> tuple[float, ...]:
        """The level as the floats the wire header carries."""

    @abstractmethod
    def level_from_floats(self, values: Sequence[float]) -> Level:
        """Inverse of level_floats (validated)."""

    # -- sizes --------------------------------------------------------------------------------
    @abstractmethod
    def layout(self, numel: int, level: Level, dtype: torch.dtype = torch.float32) -> Layout:
        """The packet's parts, (dtype, count) each, for an input of numel elements of dtype."""

    def nbytes(self, numel: int, level: Level = None, dtype: torch.dtype = torch.float32) -> int:
        """Exact bytes on the wire (header included, no zstd) - known before encoding."""
        if not isinstance(numel, int) or numel < 0:
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

    @abstractmethod
    def encode_ef(
        self, x: torch.Tensor, residual: torch.Tensor, level: Level, key: RandomKey
    ) -> Packet:
        """Encode x + residual and leave in `residual` (fp32 or bf16) what the packet did not
        carry. Called by ErrorFeedback, which validated x; fused where the reference allows."""

    def accumulate(self, packets: Sequence[Packet], out: torch.Tensor) -> torch.Tensor:
        """out (fp32) += decode(p) for each packet, in order."""
        for p in packets:
            self._check_packet(p)
            if p.numel != out.numel():
                raise ValueError(
                    f"packet of {p.numel} elements cannot accumulate into {out.numel()}"
                )
            out.add_(self._decode(p).to(torch.float32))
        return out

    # -- subclass hooks -------------------------------------------------------------------------
    @abstractmethod
    def _encode(self, x: torch.Tensor, level: Level, key: RandomKey) -> tuple[torch.Tensor, ...]:
        """Parts of the packet for flat x (validated)."""

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

    @staticmethod
    def _device(packet: Packet) -> torch.device:
        return packet.parts[0].device if packet.parts else torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# dense codecs


class Dense(Codec):
    """Every element kept: none / fp16 / bf16 (casts), quant (2/4/8 bits), sign (1 bit)."""

    _CAST: ClassVar[dict[CodecKind, torch.dtype]] = {
        CodecKind.FP16: torch.float16,
        CodecKind.BF16: torch.bfloat16,
    }

    def __init__(
        self,
        kind: CodecKind,
        group_size: int = 512,
        rounding: str = "stochastic",
        nonfinite: str = "raise",
    ) -> None:
        super().__init__(nonfinite)
        if kind in SPARSIFIERS:
            raise ValueError(f"{kind.value!r} is a sparsifier, not a dense codec")
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(
                f"group_size={group_size!r} must be a positive int (elements per scale)"
            )
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding={rounding!r}; use one of {ROUNDINGS}")
        self.kind = kind
        self.group_size = group_size
        self.rounding = rounding
        if kind is CodecKind.QUANT:
            self.name = f"quant(group={group_size},{rounding})"
        elif kind is CodecKind.SIGN:
            self.name = f"sign(group={group_size})"
        else:
            self.name = kind.value

    @property
    def quantizes(self) -> bool:
        return self.kind in (CodecKind.QUANT, CodecKind.SIGN)

    def check_level(self, level: Level) -> Level:
        if self.kind is CodecKind.QUANT:
            if isinstance(level, float) and level.is_integer():
                level = int(level)
            if isinstance(level, bool) or level not in (2, 4, 8):
                raise ValueError(
                    f"level={level!r} for codec 'quant' is out of range: use bits 2, 4 or 8"
                )
            return int(level)
        if level is not None:
            raise ValueError(f"codec {self.kind.value!r} takes no level, got level={level!r}")
        return None

    def level_floats(self, level: Level) -> tuple[float, ...]:
        return () if level is None else (float(level),)

    def level_from_floats(self, values: Sequence[float]) -> Level:
        if self.kind is CodecKind.QUANT:
            if len(values) != 1:
                raise ValueError(f"codec 'quant' carries one level, got {len(values)}")
            return self.check_level(values[0])
        if values:
            raise ValueError(f"codec {self.kind.value!r} carries no level, got {len(values)}")
        return None

    def _bits(self, level: Level) -> int:
        return 1 if self.kind is CodecKind.SIGN else level

    def layout(self, numel: int, level: Level, dtype: torch.dtype = torch.float32) -> Layout:
        if self.quantizes:
            groups = reference.num_groups(numel, self.group_size)
            codes = (numel * self._bits(level) + 7) // 8
            return ((torch.uint8, codes), (torch.float32, groups), (torch.float32, groups))
        return ((self._CAST.get(self.kind, dtype), numel),)

    def _encode(self, x, level, key):
        if self.quantizes:
            return self._quantize(x, None, level, key)
        if self.kind is CodecKind.FP16:
            # Saturate instead of overflowing to Inf; error feedback keeps the excess.
            finite = torch.isfinite(x)
            x = torch.where(finite, x.clamp(-65504.0, 65504.0), x)
        return (x.to(self._CAST.get(self.kind, x.dtype)),)

    def _quantize(self, x, residual, level, key):
        stochastic = self.kind is CodecKind.QUANT and self.rounding == "stochastic"
        return ops.ef_quantize(x, residual, self._bits(level), self.group_size, stochastic, key)

    def _decode(self, packet):
        if self.quantizes:
            codes, lo, step = packet.parts
            return reference.dequantize(
                codes, lo, step, self._bits(packet.level), packet.numel, self.group_size
            )
        return packet.parts[0]

    def encode_ef(self, x, residual, level, key):
        if self.quantizes:
            parts = self._quantize(x, residual, level, key)
            return Packet(self, level, x.numel(), x.dtype, key, parts)
        acc = x.to(torch.float32) + residual.to(torch.float32)
        # `none` sends the input's dtype, the casts their own; both decode exactly what was sent
        parts = self._encode(acc.to(x.dtype) if self.kind is CodecKind.NONE else acc, level, key)
        residual.copy_(acc - parts[0].to(torch.float32))
        return Packet(self, level, x.numel(), x.dtype, key, parts)

    def accumulate(self, packets, out):
        if not self.quantizes:
            return super().accumulate(packets, out)
        for p in packets:
            self._check_packet(p)
            if p.numel != out.numel():
                raise ValueError(
                    f"packet of {p.numel} elements cannot accumulate into {out.numel()}"
                )
        return ops.dequantize_accumulate(
            out, [p.parts for p in packets], [self._bits(p.level) for p in packets], self.group_size
        )


# ---------------------------------------------------------------------------------------------
# sparsifiers and compositions


class Sparse(Codec):
    """One or more sparsifier stages, then a dense codec for the kept values.

    Stage i keeps k_i = density_k(n_{i-1}, level_i) of the previous stage's n_{i-1} elements.
    Top-k stages put their indices (positions within the previous selection) on the wire;
    random-k stages derive theirs from the shared RandomKey, so every rank picks the same ones.
    """

    def __init__(
        self, stages: Sequence[CodecKind], values: Dense, nonfinite: str = "raise"
    ) -> None:
        super().__init__(nonfinite)
        if not stages or any(s not in SPARSIFIERS for s in stages):
            raise ValueError(
                "a sparse codec needs one or more sparsifier stages (topk, topk-sampled, randomk)"
            )
        self.stages = tuple(stages)
        self.values = values
        self.is_composite = len(self.stages) > 1 or values.kind is not CodecKind.NONE
        names = [s.value for s in self.stages]
        if self.is_composite:
            names.append(values.name)
        self.name = ">".join(names)

    # levels: one density per stage, then the value codec's bits where it has them
    def check_level(self, level: Level) -> Level:
        nstages = len(self.stages)
        has_bits = self.values.kind is CodecKind.QUANT
        entries = level if isinstance(level, tuple) else (level,)
        if not has_bits and len(entries) == nstages + 1 and entries[-1] is None:
            entries = entries[:-1]
        if len(entries) != nstages + has_bits:
            raise ValueError(
                f"codec {self.name!r} takes {nstages + has_bits} level values "
                f"(a density per sparsifier{', then bits' if has_bits else ''}), got level={level!r}"
            )
        densities = []
        for stage, d in zip(self.stages, entries, strict=False):
            if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1:
                raise ValueError(
                    f"level={d!r} for {stage.value!r} is out of range: use a density in (0, 1], "
                    "e.g. 0.01 for 1%"
                )
            densities.append(float(d))
        canonical = (
            (*densities, self.values.check_level(entries[-1])) if has_bits else tuple(densities)
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

    def layout(self, numel: int, level: Level, dtype: torch.dtype = torch.float32) -> Layout:
        densities, vlevel = self._split(level)
        parts, m = [], numel
        for stage, k in zip(self.stages, self._ks(numel, densities), strict=True):
            if stage is not CodecKind.RANDOMK:
                parts.append((torch.uint8, index_nbytes(m, k)))
            m = k
        return (*parts, *self.values.layout(m, vlevel, torch.float32))

    def _select(
        self, acc: torch.Tensor, level: Level, key: RandomKey, residual: torch.Tensor | None
    ):
        """Run the stages on acc. Returns (global positions, kept values, index parts).

        With a residual and a single top-k stage this is the fused reference op, which also
        leaves acc (zeroed at the kept positions) in the residual.
        """
        densities, _ = self._split(level)
        ks = self._ks(acc.numel(), densities)
        if (
            residual is not None
            and len(self.stages) == 1
            and self.stages[0] is not CodecKind.RANDOMK
        ):
            sampled = self.stages[0] is CodecKind.TOPK_SAMPLED
            positions, values = ops.ef_topk_select(acc, residual, ks[0], sampled)
            return positions, values, (encode_indices(positions, acc.numel()),)
        if residual is not None:
            acc = acc.to(torch.float32) + residual.to(torch.float32)
            residual.copy_(acc)
        positions, current, index_parts = None, acc.to(torch.float32), []
        for i, (stage, k) in enumerate(zip(self.stages, ks, strict=True)):
            m = current.numel()
            if stage is CodecKind.RANDOMK:
                local = _random_indices(m, k, key, i).to(current.device)
            else:
                local, _ = ops.ef_topk_select(current, None, k, stage is CodecKind.TOPK_SAMPLED)
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
        if residual is not None and self.values.kind is not CodecKind.NONE and values.numel():
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
            if stage is CodecKind.RANDOMK:
                local = _random_indices(m, k, packet.key, i)
            else:
                try:
                    local = decode_indices(packet.parts[next_part].cpu(), m, k)
                except IndexDecodeError as e:
                    raise PacketError(f"corrupt packet: {e}") from e
                next_part += 1
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
            self._check_packet(p)
            if p.numel != out.numel():
                raise ValueError(
                    f"packet of {p.numel} elements cannot accumulate into {out.numel()}"
                )
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
# construction


def make_codec(
    name: str,
    *,
    group_size: int = 512,
    rounding: str = "stochastic",
    nonfinite: str = "raise",
) -> Codec:
    """A codec by registry name or composition ("randomk>topk>quant"). Unknown names raise,
    listing the known ones. group_size and rounding apply to quant/sign value coding."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"codec name must be a non-empty string, got {name!r}")
    kinds = [CodecKind.parse(part) for part in name.split(">")]
    dense = dict(group_size=group_size, rounding=rounding, nonfinite=nonfinite)
    if kinds[-1] not in SPARSIFIERS:
        values = Dense(kinds[-1], **dense)
        stages = kinds[:-1]
    else:
        values = Dense(CodecKind.NONE, **dense)
        stages = kinds
    if any(k not in SPARSIFIERS for k in stages):
        raise ValueError(
            f"codec {name!r}: only sparsifiers (topk, topk-sampled, randomk) can come before "
            "'>'; a dense codec (none, fp16, bf16, quant, sign) may only come last"
        )
    if not stages:
        return values
    return Sparse(stages, values, nonfinite=nonfinite)


def parse_spec(spec: str, **params: Any) -> tuple[Codec, Level]:
    """ "topk:0.01", "quant:8", "fp16", "randomk:0.1>topk:0.1>quant:4" -> (codec, level)."""
    names, levels = [], []
    for stage in spec.split(">"):
        name, _, value = stage.strip().partition(":")
        names.append(name.strip())
        if value.strip():
            try:
                number = float(value)
            except ValueError:
                raise ValueError(
                    f"codec spec {spec!r}: level {value!r} of {name!r} is not a number"
                ) from None
            levels.append(int(number) if CodecKind.parse(name) is CodecKind.QUANT else number)
        else:
            levels.append(None)
    codec = make_codec(">".join(names), **params)
    if not codec.is_composite:
        return codec, codec.check_level(levels[0])
    if (
        isinstance(codec, Sparse)
        and codec.values.kind is not CodecKind.QUANT
        and len(levels) > len(codec.stages)
    ):
        levels = levels[: len(codec.stages)]
    return codec, codec.check_level(tuple(levels))
