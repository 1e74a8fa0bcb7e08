"""What crosses regions this step: the `Plan`, and the codecs it names, built once from the config.

A plan gives, for every region (by region index), the (codec name, level) its shard owners send
with, and the staleness at which a step's exchange is applied. It is fixed by the config, or decided by the controller on rank 0 and broadcast, so every
rank knows every packet's size before any collective starts - the invariant that keeps ranks
from disagreeing about a collective's shape. The hook and the controller both import this
module; it imports neither.

`Codecs` is the one place codecs are made: with the config's group size and rounding, so what the
controller's byte model counts is what the data path sends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .compress import Codec
from .compress.codecs import Level

Rung = tuple[str, Level]
"""(codec name, level): one setting of one sender's compression."""

NONE: Rung = ("none", None)


@dataclass(frozen=True)
class Plan:
    """What each region's shard owners send: (codec name, level) by region index."""

    senders: tuple[Rung, ...]
    staleness: int = 0
    """Steps after which a step's exchange is applied (cloudtrain.pipeline); 0: synchronous."""

    @classmethod
    def same(cls, rung: Rung, regions: int, staleness: int = 0) -> Plan:
        return cls(tuple(rung for _ in range(regions)), staleness)

    @property
    def uniform(self) -> bool:
        """Every sender's packet has the same size: one all_gather moves them all."""
        return len(set(map(repr, self.senders))) == 1

    @property
    def lossless(self) -> bool:
        """Nothing is compressed: the step's gradients cross as one plain all-reduce."""
        return all(name == NONE[0] for name, _ in self.senders)


class Codecs:
    """Codecs by name, made once each from the config (`CompressionConfig.make_codec`)."""

    __slots__ = ("_by_name", "_config")

    def __init__(self, config: Any) -> None:
        self._config = config
        self._by_name: dict[str, Codec] = {}

    def __call__(self, name: str) -> Codec:
        codec = self._by_name.get(name)
        if codec is None:
            codec = self._by_name[name] = self._config.make_codec(name)
        return codec

    def wire_nbytes(self, rung: Rung, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Exact bytes of one packet of `numel` elements at this rung (header included)."""
        return self(rung[0]).nbytes(numel, rung[1], dtype)

    def step_nbytes(self, rung: Rung, shard_numels: Sequence[int], receivers: int) -> int:
        """Bytes a sender puts on its link per step at this rung: its packet for every bucket's
        shard, once per receiving region."""
        return receivers * sum(self.wire_nbytes(rung, m) for m in shard_numels)
