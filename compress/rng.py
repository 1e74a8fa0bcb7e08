"""Randomness for codecs, derived from (seed, step, bucket[, rank]) and never from torch's global RNG.

Random-k must pick the same indices on every rank (so none go on the wire): its generator comes
from (seed, step, bucket). Stochastic rounding should be independent across ranks: its generator
(or, for the native kernels, the integer seed of their counter-based RNG) also mixes in the
sending rank. Both are reproducible, so a resumed run repeats them exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix(*words: int) -> int:
    """A 63-bit hash of non-negative integers, stable across processes and platforms."""
    h = 0
    for w in words:
        h = _splitmix64(h ^ (w & _MASK64))
    return h >> 1


@dataclass(frozen=True)
class RandomKey:
    """Where a packet's randomness comes from: the run's seed, the step, the gradient bucket and
    the sending rank."""

    seed: int = 0
    step: int = 0
    bucket: int = 0
    """The packet stream: CloudDDP's data path passes one id per (DDP bucket, shard)
    (cloudtrain.datapath.CrossRegion.packet_id), not DDP's bucket index."""
    rank: int = 0
    """The sender (CloudDDP passes the sending region)."""

    def __post_init__(self) -> None:
        for name in ("seed", "step", "bucket", "rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < 2**63:
                raise ValueError(f"RandomKey.{name}={value!r} must be an int in [0, 2**63)")

    def shared(self, stream: int = 0) -> torch.Generator:
        """A CPU generator identical on every rank: (seed, step, bucket, stream)."""
        return torch.Generator().manual_seed(mix(self.seed, self.step, self.bucket, 0x5EED, stream))

    def private_seed(self) -> int:
        """The 63-bit integer behind `private`: (seed, step, bucket, rank). The native kernels key
        their counter-based RNG with it (compress/ops.py), so their draws depend on the key and
        the element index only, never on threads or scheduling."""
        return mix(self.seed, self.step, self.bucket, 0x9A7E, self.rank)

    def private(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator on `device` that differs per sending rank: (seed, step, bucket, rank)."""
        return torch.Generator(device=device).manual_seed(self.private_seed())
