"""The quality guard: "auto" compresses and pipelines only as far as the update stays close to the
exact synchronous one.

Compression with error feedback and a pipelined exchange both change the update the optimizer
applies, and how much a model suffers from that the controller cannot see from bytes and seconds:
the same top-k 10 % costs nothing on one model and 5 % of the loss on another, and a one-step-stale
gradient sets some models back by a third of their accuracy (docs/quality.md). So the guard
measures the damage where it happens, on every compressed step, on each shard owner, for a fixed
sample of its shard (`QualityProbe`, on the communication thread):

    x_t   the region's exact gradient of step t (its ranks' sum, before error feedback)
    d_t   its decoded packet: x_t + residual before - residual after
    a_t   what every rank applies for the region at step t: d of step t - s (s: the pipeline's
          depth; nothing in its first s steps)
    M_t = g M_{t-1} + x_t        E_t = g E_{t-1} + (a_t - x_t)      C_t = g C_{t-1} + (d_t - x_t)
    error        |E|^2 / |M|^2   squared relative error of the update a momentum of g = 0.9 integrates
    compression  |C|^2 / |M|^2   the same for the packet alone (no staleness)
    drift        |x_t - x_{t-1}|^2 / |x_t|^2   how far a one-step-old gradient is from the fresh one

Why through a momentum of 0.9: it is what SGD's usual momentum and Adam's first moment integrate.
Error feedback's error at a single step is large (top-k 1 % sends a hundredth of the gradient) but
mostly cancels within that window; what error feedback holds back for longer, or sends in lumps,
does not. Why the drift for staleness: with momentum b a one-step delay is stable only where
lr x curvature < 1 - b, against 2 (1 + b) without it, and in a stable synchronous run the drift
measures lr x curvature along the gradient (about 1.4 on every workload of docs/quality.md after
its first steps: far from the 0.1 a momentum of 0.9 leaves). The drift includes the sampling noise
of a region's gradient, so it errs on the safe side.

The rules (`QualityGuard`, decided on rank 0 with the controller's plan and broadcast with it, so
every rank holds the same guard):

- a region whose packets' compression error over an interval exceeds `quality_bound` gets a
  ceiling below the rung it sent with, at once; that rung may be tried again only after a backoff
  that doubles with each failure;
- a ceiling rises by one rung (a trial) only when the cost model wants more compression than it
  allows, the rung in force kept its error under half the bound for `patience` decisions, and the
  next rung is not in backoff;
- the pipeline may go one step deeper only while every region's drift stayed under
  `drift_bound` for `patience` decisions; a pipelined interval whose error exceeds the bound ends
  the pipeline (with a backoff);
- the first ceiling is the heaviest dense rung (4-bit): sparse rungs are sent only after a measured
  trial at the rung below them kept quality.

The guard only lowers what "auto" may choose; pinned settings (a fixed codec, `staleness=`) are
the user's. Its cost: a few vector operations on the sample per packet (timed as the "guard"
stage in CommStats.seconds) and five numbers per rank in the controller's gather; no bytes on the
data path.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .plan import Rung, describe, rung_density

MOMENTUM = 0.9
"""g: the memory through which the applied update is compared with the exact one."""

MIN_STEPS = 3
"""Steps a region must have been measured in an interval before the guard judges it."""


@dataclass
class _Track:
    """One packet stream's measurement: its sample and the momentum-filtered sums."""

    valid: int
    """Elements of the stream's gradient (its packets' numel without padding)."""
    index: torch.Tensor
    """(k,) sampled positions in the shard."""
    exact: torch.Tensor  # (k,) M
    error: torch.Tensor  # (k,) E
    packet: torch.Tensor  # (k,) C
    previous: torch.Tensor | None = None  # (k,) x of the last step
    queued: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (step, d) not applied


@dataclass(frozen=True)
class QualitySums:
    """One rank's measurement over an interval, summed over its packet streams and steps."""

    error: float = 0.0
    compression: float = 0.0
    norm: float = 0.0
    drift: float = 0.0
    gradient: float = 0.0
    steps: int = 0

    def __add__(self, other: QualitySums) -> QualitySums:
        return QualitySums(
            self.error + other.error,
            self.compression + other.compression,
            self.norm + other.norm,
            self.drift + other.drift,
            self.gradient + other.gradient,
            max(self.steps, other.steps),
        )

    @property
    def error_ratio(self) -> float | None:
        return self.error / self.norm if self.norm > 0 and self.steps >= MIN_STEPS else None

    @property
    def compression_ratio(self) -> float | None:
        return self.compression / self.norm if self.norm > 0 and self.steps >= MIN_STEPS else None

    @property
    def drift_ratio(self) -> float | None:
        return self.drift / self.gradient if self.gradient > 0 and self.steps >= MIN_STEPS else None


class QualityProbe:
    """Measures, on a shard owner, how far the applied update is from the exact one (module
    docstring). Called on the communication thread for every packet it encodes; `take` between
    steps."""

    __slots__ = ("_sums", "_tracks", "sample")

    def __init__(self, sample: int = 4096) -> None:
        self.sample = sample
        self._tracks: dict[Hashable, _Track] = {}
        self._sums = _Running()

    def positions(self, key: Hashable, valid: int) -> torch.Tensor:
        """The sampled positions of packet stream `key` (whose first `valid` elements are
        gradient, the rest padding): every stride-th, from an offset fixed by the key."""
        track = self._tracks.get(key)
        if track is None or track.valid != valid:  # new, or DDP rebuilt its buckets
            stride = max(1, valid // self.sample) if valid > 0 else 1
            offset = (zlib.crc32(repr(key).encode()) & 0xFFFF) % stride
            index = torch.arange(offset, max(valid, 0), stride)[: self.sample]
            zeros = torch.zeros(index.numel())
            track = _Track(valid, index, zeros.clone(), zeros.clone(), zeros.clone())
            self._tracks[key] = track
        return track.index

    def observe(
        self,
        key: Hashable,
        step: int,
        staleness: int,
        exact: torch.Tensor,
        before: torch.Tensor | None,
        after: torch.Tensor | None,
    ) -> None:
        """Stream `key` sent `exact` (its gradient at `positions(key)`) at `step`, with those
        positions' residual `before` and `after` its encoding (None: none), in a pipeline
        `staleness` steps deep."""
        track = self._tracks[key]
        exact = exact.detach().float().cpu()
        decoded = exact.clone()
        if before is not None:
            decoded += before.float().cpu()
        if after is not None:
            decoded -= after.float().cpu()
        track.queued.append((step, decoded))
        applied = torch.zeros_like(exact)
        for s, d in track.queued:
            if s <= step - staleness:
                applied += d
        track.queued = [(s, d) for s, d in track.queued if s > step - staleness]
        track.exact.mul_(MOMENTUM).add_(exact)
        track.error.mul_(MOMENTUM).add_(applied - exact)
        track.packet.mul_(MOMENTUM).add_(decoded - exact)
        drift = None if track.previous is None else float((exact - track.previous).square().sum())
        track.previous = exact
        self._sums.add(key, track, drift, float(exact.square().sum()))

    def take(self) -> QualitySums:
        """What was measured since the last call (summed over streams; steps counted once)."""
        sums, self._sums = self._sums.total(), _Running()
        return sums

    def state_dict(self) -> dict[str, Any]:
        return {
            "sample": self.sample,
            "tracks": [
                {
                    "key": key,
                    "valid": t.valid,
                    "index": t.index.clone(),
                    "exact": t.exact.clone(),
                    "error": t.error.clone(),
                    "packet": t.packet.clone(),
                    "previous": None if t.previous is None else t.previous.clone(),
                    "queued": [(s, d.clone()) for s, d in t.queued],
                }
                for key, t in self._tracks.items()
            ],
            "interval": self._sums.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sample = int(state["sample"])
        self._tracks = {}
        for t in state["tracks"]:
            key = tuple(t["key"]) if isinstance(t["key"], list) else t["key"]
            self._tracks[key] = _Track(
                int(t["valid"]),
                t["index"].clone(),
                t["exact"].clone(),
                t["error"].clone(),
                t["packet"].clone(),
                None if t["previous"] is None else t["previous"].clone(),
                [(int(s), d.clone()) for s, d in t["queued"]],
            )
        self._sums = _Running()
        if state.get("interval") is not None:
            self._sums.load_state_dict(state["interval"])


class _Running:
    """The interval's sums, added to by `QualityProbe.observe`."""

    __slots__ = ("compression", "drift", "error", "gradient", "norm", "steps")

    def __init__(self) -> None:
        self.error = self.compression = self.norm = self.drift = self.gradient = 0.0
        self.steps: dict[Hashable, int] = {}

    def add(self, key: Hashable, track: _Track, drift: float | None, gradient: float) -> None:
        self.error += float(track.error.square().sum())
        self.compression += float(track.packet.square().sum())
        self.norm += float(track.exact.square().sum())
        if drift is not None:
            self.drift += drift
            self.gradient += gradient
        self.steps[key] = self.steps.get(key, 0) + 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "sums": [self.error, self.compression, self.norm, self.drift, self.gradient],
            "steps": list(self.steps.items()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.error, self.compression, self.norm, self.drift, self.gradient = state["sums"]
        self.steps = {(tuple(k) if isinstance(k, list) else k): int(n) for k, n in state["steps"]}

    def total(self) -> QualitySums:
        steps = min(self.steps.values()) if self.steps else 0
        return QualitySums(
            self.error, self.compression, self.norm, self.drift, self.gradient, steps
        )


# -- the decision (rank 0) ------------------------------------------------------------------------


@dataclass
class QualityGuard:
    """Ceilings on "auto"'s compression per region and on its pipeline's depth (module docstring).
    Its state is part of every decision, so every rank holds the same guard."""

    ceilings: list[int]
    """By region: the most compressed ladder rung the cost model may choose."""
    max_staleness: int = 0
    """The deepest pipeline the cost model may choose."""
    decisions: int = 0
    calm: list[int] = field(default_factory=list)
    drift_calm: int = 0
    grace: list[int] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    """'region:rung' or 'staleness:depth' -> how often it failed."""
    retry: dict[str, int] = field(default_factory=dict)
    """Same keys -> the decision from which it may be tried again."""
    last: dict[str, Any] = field(default_factory=dict)
    """What the guard measured and decided at the last decision (for stats() and the log)."""
    said: list[str] = field(default_factory=list)
    """Explanations already logged once (a refusal that holds is not repeated every decision)."""

    @classmethod
    def start(cls, ladder: Sequence[Rung], regions: int) -> QualityGuard:
        return cls([first_ceiling(ladder)] * regions, calm=[0] * regions, grace=[0] * regions)

    def decide(
        self,
        reports: Sequence[QualitySums],
        ran: Sequence[int],
        ran_staleness: int,
        wanted: Sequence[int],
        wanted_staleness: int,
        bound: float,
        drift_bound: float,
        patience: int,
    ) -> list[str]:
        """Update the ceilings from the interval's measurement of each region (`reports`, made
        under rungs `ran` and pipeline depth `ran_staleness`) and what the cost model wants.
        Returns the log lines of what changed."""
        self.decisions += 1
        notes: list[str] = []
        measured = []
        for r, report in enumerate(reports):
            measured.append(self._region(r, report, ran[r], wanted[r], bound, patience, notes))
        notes += self._staleness(reports, ran_staleness, wanted_staleness, bound, drift_bound,
                                 patience)  # fmt: skip
        self.last = {
            "decision": self.decisions,
            "error": [report.error_ratio for report in reports],
            "compression": measured,
            "drift": [report.drift_ratio for report in reports],
            "ceilings": list(self.ceilings),
            "max_staleness": self.max_staleness,
            "limits_speed": [w > c for w, c in zip(wanted, self.ceilings, strict=True)]
            + [wanted_staleness > self.max_staleness],
        }
        return notes

    def _region(
        self,
        r: int,
        report: QualitySums,
        rung: int,
        wanted: int,
        bound: float,
        patience: int,
        notes: list[str],
    ) -> float | None:
        error = report.compression_ratio
        if self.grace[r] > 0:  # the interval after a change still carries the old rung's error
            self.grace[r] -= 1
            return error
        if error is not None and error > bound and rung > 0:
            key = f"{r}:{rung}"
            self.failures[key] = self.failures.get(key, 0) + 1
            self.retry[key] = self.decisions + patience * 2 ** self.failures[key]
            self.ceilings[r] = min(self.ceilings[r], rung - 1)
            self.calm[r], self.grace[r] = 0, 1
            notes.append(
                f"region {r}: rung {rung} moved the update {math.sqrt(error):.0%} from the exact "
                f"one (error {error:.3f} > {bound:g}): ceiling now rung {self.ceilings[r]}, rung "
                f"{rung} tried again from decision {self.retry[key]}"
            )
            return error
        # evidence for a heavier rung: decisions in a row at the ceiling itself, with room
        roomy = rung == self.ceilings[r] and error is not None and error <= bound / 2
        self.calm[r] = self.calm[r] + 1 if roomy else 0
        trial = self.ceilings[r] + 1
        if (
            wanted > self.ceilings[r]
            and self.calm[r] >= patience
            and self.retry.get(f"{r}:{trial}", 0) <= self.decisions
        ):
            self.ceilings[r], self.calm[r] = trial, 0
            notes.append(
                f"region {r}: rung {rung} kept quality (error {error:.3f}): trying {trial}"
            )
        return error

    def _staleness(
        self,
        reports: Sequence[QualitySums],
        ran: int,
        wanted: int,
        bound: float,
        drift_bound: float,
        patience: int,
    ) -> list[str]:
        errors = [r.error_ratio for r in reports if r.error_ratio is not None]
        drifts = [r.drift_ratio for r in reports if r.drift_ratio is not None]
        if ran > 0 and errors and max(errors) > bound:
            key = f"staleness:{ran}"
            self.failures[key] = self.failures.get(key, 0) + 1
            self.retry[key] = self.decisions + patience * 2 ** self.failures[key]
            self.max_staleness, self.drift_calm = ran - 1, 0
            return [
                f"a pipeline {ran} step(s) deep moved the update {math.sqrt(max(errors)):.0%} from "
                f"the exact one (error {max(errors):.3f} > {bound:g}): depth now at most "
                f"{self.max_staleness}"
            ]
        calm = bool(drifts) and len(drifts) == len(reports) and max(drifts) <= drift_bound
        self.drift_calm = self.drift_calm + 1 if calm else 0
        deeper = self.max_staleness + 1
        if (
            wanted > self.max_staleness
            and self.drift_calm >= patience
            and self.retry.get(f"staleness:{deeper}", 0) <= self.decisions
        ):
            self.max_staleness, self.drift_calm = deeper, 0
            return [
                f"the gradient drifts {max(drifts):.3f} per step: pipeline depth {deeper} allowed"
            ]
        if wanted > self.max_staleness and drifts and "no pipeline" not in self.said:
            self.said.append("no pipeline")
            return [
                f"no pipeline: the gradient moves {math.sqrt(max(drifts)):.0%} of its size per "
                f"step (drift {max(drifts):.2f} > {drift_bound:g}), so a stale update would be far "
                "from the exact one; each step waits for its round trip (the outer loop, e.g. "
                "config 'diloco', keeps the round trips off the steps)"
            ]
        return []

    def snapshot(self, names: Sequence[str], ladder: Sequence[Rung]) -> dict[str, Any]:
        """The guard in words, by region name (for CloudDDP.stats())."""
        last, none = self.last, [None] * len(names)
        return {
            "ceiling": {n: describe(ladder[c]) for n, c in zip(names, self.ceilings, strict=True)},
            "max_staleness": self.max_staleness,
            "compression_error": dict(zip(names, last.get("compression", none), strict=True)),
            "update_error": dict(zip(names, last.get("error", none), strict=True)),
            "drift": dict(zip(names, last.get("drift", none), strict=True)),
            "keeps_quality_over_speed": any(last.get("limits_speed", ())),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "ceilings": list(self.ceilings),
            "max_staleness": self.max_staleness,
            "decisions": self.decisions,
            "calm": list(self.calm),
            "drift_calm": self.drift_calm,
            "grace": list(self.grace),
            "failures": dict(self.failures),
            "retry": dict(self.retry),
            "last": dict(self.last),
            "said": list(self.said),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> QualityGuard:
        return cls(
            [int(c) for c in state["ceilings"]],
            int(state["max_staleness"]),
            int(state["decisions"]),
            [int(c) for c in state["calm"]],
            int(state["drift_calm"]),
            [int(g) for g in state["grace"]],
            {str(k): int(v) for k, v in state["failures"].items()},
            {str(k): int(v) for k, v in state["retry"].items()},
            dict(state["last"]),
            [str(x) for x in state.get("said", [])],
        )


def first_ceiling(ladder: Sequence[Rung]) -> int:
    """The heaviest rung before the first sparse one (the whole ladder if none is sparse)."""
    for i, rung in enumerate(ladder):
        if rung_density(rung) < 1:
            return max(i - 1, 0)
    return len(ladder) - 1
