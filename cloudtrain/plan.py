"""What crosses regions this step: the `Plan`, and the codecs it names, built once from the config.

A plan gives, for every region (by region index), the (codec name, level) its shard owners send
with, whether they zstd-compress their packets, and the staleness at which a step's exchange is
applied. It is fixed by the config, or decided by the controller on rank 0 and broadcast, so
every rank knows every packet's size (a zstd packet's: the most it may be) before any collective
starts - the invariant that keeps ranks from disagreeing about a collective's shape. The hook
and the controller both import this module; it imports neither.

`Codecs` is the one place codecs are made: with the config's group size and rounding, so what the
controller's byte model counts is what the data path sends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .compress import Codec, to_wire, wire_zstd_gain
from .compress.codecs import Level

Rung = tuple[str, Level]
"""(codec name, level): one setting of one sender's compression."""

NONE: Rung = ("none", None)

ZSTD_LEVEL = 1
"""zstd level of the packets' zstd stage: level 1 saves as much as 3 on gradient packets
(`python -m cloudtrain.compress.bench`) at half the CPU."""

ZSTD_SAMPLE = 1 << 16
"""Elements of the packet Codecs.zstd_ratio compresses (a ratio within 1 % of a 1M-element
packet's, in a few ms)."""


@dataclass(frozen=True)
class Plan:
    """What each region's shard owners send: (codec name, level) by region index."""

    senders: tuple[Rung, ...]
    staleness: int = 0
    """Steps after which a step's exchange is applied (cloudtrain.pipeline); 0: synchronous."""
    zstd: tuple[bool, ...] = ()
    """By region index: its packets go through the zstd stage (kept where it shrinks them, so
    their size is known only to the sender: receivers take them into a buffer of the size
    without zstd and cut them by their header). Empty: no region's."""

    @classmethod
    def same(cls, rung: Rung, regions: int, staleness: int = 0, zstd: bool = False) -> Plan:
        return cls(
            tuple(rung for _ in range(regions)), staleness, (True,) * regions if zstd else ()
        )

    def zstd_for(self, region: int) -> bool:
        return bool(self.zstd) and self.zstd[region]

    @property
    def lossless(self) -> bool:
        """Nothing is compressed: the step's gradients cross as one plain all-reduce."""
        return all(name == NONE[0] for name, _ in self.senders)


class Codecs:
    """Codecs by name, made once each from the config (`CompressionConfig.make_codec`)."""

    __slots__ = ("_by_name", "_config", "_zstd_ratios")

    def __init__(self, config: Any) -> None:
        self._config = config
        self._by_name: dict[str, Codec] = {}
        self._zstd_ratios: dict[Rung, float] = {}

    def __call__(self, name: str) -> Codec:
        codec = self._by_name.get(name)
        if codec is None:
            codec = self._by_name[name] = self._config.make_codec(name)
        return codec

    def wire_nbytes(self, rung: Rung, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Exact bytes of one packet of `numel` elements at this rung (header included)."""
        return self(rung[0]).nbytes(numel, rung[1], dtype)

    def zstd_ratio(self, rung: Rung) -> float:
        """How many times smaller the zstd stage (ZSTD_LEVEL) makes this rung's packet of
        ZSTD_SAMPLE normally distributed values (1: not at all): what a forecast counts where
        the stage is on and nothing was measured. A pseudo-gradient, the sum of many steps'
        gradients, is close to normal: on the bench's MLP's after 25-150 SGD steps, 4-bit
        1.15-1.16 (1.15 on normal values), 8-bit 1.06 (1.06); its top-k rungs' indices shrink
        too, which normal values' do not (top-k 2 % + 2-bit 1.10 against 1.00, top-k 10 % +
        4-bit 1.08 against 1.05); Laplace's values, whose mass sits nearer zero: 4-bit 1.28.
        Computed once per rung, from a generator of its own (the run's random state is not
        touched)."""
        ratio = self._zstd_ratios.get(rung)
        if ratio is None:
            values = torch.randn(ZSTD_SAMPLE, generator=torch.Generator().manual_seed(0))
            wire = to_wire(self(rung[0]).encode(values, rung[1]))
            ratio = self._zstd_ratios[rung] = wire_zstd_gain(wire, ZSTD_LEVEL).ratio
        return ratio

    def step_nbytes(self, rung: Rung, shard_numels: Sequence[int], receivers: int) -> int:
        """Bytes a sender puts on its link per step at this rung: its packet for every bucket's
        shard, once per receiving region."""
        return receivers * sum(self.wire_nbytes(rung, m) for m in shard_numels)


def rung_density(rung: Rung) -> float:
    """Share of the elements a rung sends (1 for dense codecs): a composition's sparsifier
    densities multiplied."""
    name, level = rung
    stages = name.split(">")
    levels = level if isinstance(level, tuple) else (level,)
    density = 1.0
    for stage, value in zip(stages, levels, strict=False):
        if stage.strip() in ("topk", "topk-sampled", "randomk"):
            density *= float(value)
    return density


def describe(rung: Rung) -> str:
    """A rung in words, for logs and stats: "no compression", "4-bit", "top-k 1% + 8-bit"."""
    name, level = rung
    if name == "none":
        return "no compression"
    if name == "quant":
        return f"{level}-bit"
    if name.startswith("topk"):
        density, bits = level
        return f"top-k {100 * density:g}% + {bits}-bit"
    return name


def ceil_div(n: int, d: int) -> int:
    """n / d rounded up: the elements of one of d shards of n (the last one padded)."""
    return -(-n // d)
