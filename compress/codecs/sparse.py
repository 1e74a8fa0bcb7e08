"""Sparse codecs: sparsifier stages that choose which elements to keep, then a dense codec for
the kept values.

`TopK` keeps the k largest |x| and puts their indices on the wire; `RandomK` draws k indices
from the shared RandomKey (`_random_indices`), so every rank knows them and none travel.
`Sparse` chains one or more stages and codes the survivors with a dense codec ("randomk>topk>
quant"); stage i keeps `density_k(n_{i-1}, level_i)` elements.
"""

from __future__ import annotations

import itertools
import math
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch

from .. import ops
from ..indices import IndexDecodeError, decode_indices, encode_indices, index_nbytes
from ..packet import Packet, PacketError, PartLayout
from ..rng import RandomKey
from .base import Codec, Level, is_number
from .dense import NoneCodec


def density_k(n: int, density: float) -> int:
    """Elements a sparsifier keeps: ceil(density * n), at least 1 of a non-empty tensor."""
    return 0 if n == 0 else min(n, max(1, math.ceil(density * n)))


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
