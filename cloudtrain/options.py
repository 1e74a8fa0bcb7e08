"""The options of CompressionConfig's parts, each one frozen and validated: the controller's
(ControllerOptions), the outer loop's (OuterConfig) and an elastic run's (ElasticConfig). They are
given as CompressionConfig(controller=..., outer=..., elastic=...) - as these types or as dicts of
their fields - and imported from cloudtrain.config as well.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .compress.codecs import make_codec
from .compress.ladders import LADDER

AUTO = "auto"
"""The controller's choice (a codec, a level, sync_every)."""


def read_text(what: str, path: str | Path) -> str:
    """The text of a file the user named (`what`: how they named it, e.g. "--probe"); an error
    naming it and why where it cannot be read."""
    try:
        return Path(path).read_text()
    except OSError as e:
        raise ValueError(f"{what} {path}: {e.strerror or e}") from None


def read_json(what: str, path: str | Path) -> Any:
    """read_text's file as JSON; an error naming it where it is not JSON."""
    try:
        return json.loads(read_text(what, path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path}: not JSON ({e})") from None


def as_level(level: Any) -> Any:
    """A codec level as a config holds it: a chain's levels, as JSON gives them (a list), become
    a tuple; any other level is itself."""
    return tuple(level) if isinstance(level, list) else level


def _number(
    name: str, value: Any, lo: float, hi: float, *, integer: bool = False, open_lo: bool = False
) -> None:
    """Raise ValueError unless value is a finite number (an int where `integer`) in [lo, hi]
    ((lo, hi] with open_lo). bool is not a number here."""
    kind = int if integer else (int, float)
    ok = (
        isinstance(value, kind)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > lo if open_lo else value >= lo)
        and value <= hi
    )
    if not ok:
        what = "an int" if integer else "a number"
        lo_, hi_ = (int(lo), int(hi)) if integer else (lo, hi)
        interval = f"({lo_:g}, {hi_:g}]" if open_lo else f"[{lo_:g}, {hi_:g}]"
        raise ValueError(f"{name}={value!r} must be {what} in {interval}")


def _known(cls: type, options: dict[str, Any], what: str) -> dict[str, Any]:
    """A copy of `options` (a plain dict, e.g. read from JSON) if every key is a field of `cls`;
    otherwise a ValueError naming the unknown keys and the known ones."""
    known = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"unknown {what} options {sorted(unknown)}; known: {sorted(known)}")
    return dict(options)


MAX_STALENESS = 16
"""The most steps an exchange may be applied late."""

QUALITY_BOUND = 0.015
"""ControllerOptions.quality_bound's default (docs/quality.md: 0.02 until 2026-12-02)."""
QUALITY_BOUND_BEFORE = 0.02
"""The default it replaced, which config fingerprints keep (CompressionConfig.fingerprint)."""


@dataclass(frozen=True)
class ControllerOptions:
    hidden_fraction: float = 0.5
    """Share of a step's compute time the cross-region exchange may take (it overlaps backward)."""
    interval: int = 5
    """Steps between decisions (at least: more where gathering the observations across regions
    takes longer than this many steps)."""
    patience: int = 2
    """Decisions in a row a lighter rung must fit before compressing less."""
    margin: float = 0.7
    """A lighter rung 'fits with margin' when it needs at most this share of the budget."""
    ewma: float = 0.5
    """Weight of the newest bandwidth measurement."""
    slack: float = 0.2
    """When no rung fits: the lightest rung at most this share of a step's compute time slower
    than the fastest rung (the time a step may give up for accuracy)."""
    ladder: tuple[tuple[str, Any], ...] = LADDER
    min_density: float = 0.01
    """A floor under the quality guard: never send a sparser share of a shard than this
    (top-k 1 %), whatever the guard measures: below it error feedback holds back most of the
    gradient for many steps."""
    max_staleness: int = 1
    """The deepest pipeline the controller may choose when CompressionConfig.staleness is None
    (a step's exchange applied up to this many steps late), and only as deep as the quality
    guard allows (docs/quality.md: with momentum a stale update is rarely safe). 1 is Pipe-SGD's
    width-2 pipeline."""
    quality_bound: float | None = QUALITY_BOUND
    """The quality guard (cloudtrain.guard): the most a region's compression may change the
    update a momentum of 0.9 integrates, as a squared relative error (0.015: about 12 %) before
    its rung is lowered; None turns the guard off (the ceilings, then, are the cost model's)."""
    drift_bound: float = 0.05
    """The quality guard's test for a pipeline: the most the gradient may change per step, as a
    squared relative change, for a one-step-stale update to stay close to the exact one."""
    quality_sample: int = 4096
    """Elements of each shard the quality guard measures, per packet."""
    initial_compute_s: float = 0.1
    """Compute time per step assumed until the first one is measured."""
    tensorboard_dir: str | None = None
    """Write metrics for TensorBoard here (needs the tensorboard package)."""

    def __post_init__(self) -> None:
        _number("hidden_fraction", self.hidden_fraction, 0, 10, open_lo=True)
        _number("interval", self.interval, 1, 1e9, integer=True)
        _number("patience", self.patience, 1, 1e9, integer=True)
        _number("margin", self.margin, 0, 1, open_lo=True)
        _number("ewma", self.ewma, 0, 1, open_lo=True)
        _number("slack", self.slack, 0, 10)
        _number("initial_compute_s", self.initial_compute_s, 0, 3600, open_lo=True)
        _number("min_density", self.min_density, 0, 1)
        _number("max_staleness", self.max_staleness, 0, MAX_STALENESS, integer=True)
        if self.quality_bound is not None:
            _number("quality_bound", self.quality_bound, 0, 100, open_lo=True)
        _number("drift_bound", self.drift_bound, 0, 100)
        _number("quality_sample", self.quality_sample, 1, 2**24, integer=True)
        if not isinstance(self.ladder, (tuple, list)) or not self.ladder:
            raise ValueError(
                f"ladder={self.ladder!r}: give at least one (codec, level) rung, e.g. "
                "(('quant', 8), ('quant', 4))"
            )
        rungs = []
        for rung in self.ladder:  # lists (as JSON gives them) become the tuples a rung is
            if not isinstance(rung, (tuple, list)) or len(rung) != 2:
                raise ValueError(
                    f"ladder: rung {rung!r} is not a (codec, level) pair, e.g. ('quant', 4) or "
                    "('topk>quant', (0.01, 8))"
                )
            name, level = rung[0], as_level(rung[1])
            try:
                make_codec(name).check_level(level)
            except ValueError as e:  # an unknown codec or a bad level
                raise ValueError(f"ladder: rung {rung!r}: {e}") from None
            rungs.append((name, level))
        object.__setattr__(self, "ladder", tuple(rungs))
        if self.tensorboard_dir is not None and not isinstance(self.tensorboard_dir, str):
            raise ValueError(f"tensorboard_dir={self.tensorboard_dir!r} must be a path or None")

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> ControllerOptions:
        """Options from a plain dict (e.g. read from JSON): unknown keys are an error."""
        return cls(**_known(cls, options, "controller"))


OUTER_DTYPES = ("float32", "bfloat16")

WORK_MODES = ("steps", "time")
"""OuterConfig.work: what a round between two syncs is made of - a count of inner steps, the
same in every region, or a time budget (cloudtrain.rounds)."""

WEIGHTINGS = ("equal", "samples")
"""OuterConfig.weighting: the regions' pseudo-gradients averaged alike, or by their samples."""


@dataclass(frozen=True)
class OuterConfig:
    """The outer loop (DiLoCo / Streaming DiLoCo, cloudtrain.outer): inner steps reduce gradients
    inside each region only; every `sync_every` steps each fragment's pseudo-gradient
    (outer copy - local parameters) crosses regions compressed, is averaged, and an outer SGD
    step on the outer copy gives the new parameters."""

    sync_every: int | str = AUTO
    """H: inner steps between two syncs of a fragment, or "auto": the smallest H whose exchange
    fits the measured link and step time (cloudtrain.outer.choose_schedule)."""

    outer_lr: float = 1.0
    """Learning rate of the outer SGD step (1 with momentum 0: plain averaging of the regions)."""

    outer_momentum: float = 0.0
    """Momentum of the outer SGD step (DiLoCo: 0.9 with lr 0.7 and nesterov)."""

    nesterov: bool = True
    """Nesterov momentum in the outer step (no effect at momentum 0)."""

    fragments: int = 1
    """Parts of the parameters synced on staggered schedules (Streaming DiLoCo); 1: all at once."""

    overlap: int = 0
    """tau: inner steps a fragment's exchange may run behind (on a background thread) before its
    result is merged; 0 waits for it at the sync step."""

    codec: str = AUTO
    """Codec of the pseudo-gradients across regions, or "auto" (chosen per link)."""

    level: Any = None
    """The codec's level (as CompressionConfig.level)."""

    error_feedback: bool = True
    """Keep what the codec dropped from a pseudo-gradient and send it with the next one."""

    dtype: str = "float32"
    """dtype of the outer copy, its momentum and the residuals: "float32", or "bfloat16" for
    half their memory."""

    host_copy: bool = False
    """Keep the outer copy and its momentum in host memory, as INTELLECT-1 does: the accelerator
    holds the model only, and a sync moves one fragment to and from the host."""

    work: str = "steps"
    """"steps": every region runs sync_every inner steps between two syncs; "time": each runs as
    many as fit in the time the slowest region takes for sync_every, and the pseudo-gradients
    may be weighted by samples (`weighting`; cloudtrain.rounds; train while
    CloudDDP.samples_done is below your total, not for a count of steps)."""

    weighting: str = "equal"
    """With work="time": "equal" averages the regions' pseudo-gradients alike (as work="steps"
    does); "samples" weights each by the samples its region trained on in the round,
    sum n_r Delta_r / sum n_r (measured against each other: docs/outer-loop.md)."""

    def __post_init__(self) -> None:
        if self.sync_every != AUTO:
            try:
                _number("outer.sync_every", self.sync_every, 1, 2**31 - 1, integer=True)
            except ValueError as e:
                raise ValueError(f"{e}, or 'auto'") from None
        _number("outer.outer_lr", self.outer_lr, 0, 100, open_lo=True)
        _number("outer.outer_momentum", self.outer_momentum, 0, 1)
        if self.outer_momentum == 1:
            raise ValueError("outer.outer_momentum=1 never forgets a step; use a value below 1")
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"outer.nesterov={self.nesterov!r} must be True or False")
        _number("outer.fragments", self.fragments, 1, 4096, integer=True)
        _number("outer.overlap", self.overlap, 0, 2**31 - 1, integer=True)
        if isinstance(self.sync_every, int):
            if self.fragments > self.sync_every:
                raise ValueError(
                    f"outer.fragments={self.fragments} > sync_every={self.sync_every}: each "
                    "fragment needs its own sync step; use at most sync_every fragments"
                )
            if self.overlap >= self.sync_every:
                raise ValueError(
                    f"outer.overlap={self.overlap} must be below sync_every={self.sync_every}: a "
                    "fragment's exchange has to be merged before its next sync"
                )
        if not isinstance(self.codec, str) or not self.codec.strip():
            raise ValueError(f"outer.codec={self.codec!r}: name a codec, e.g. 'quant', or 'auto'")
        object.__setattr__(self, "level", as_level(self.level))
        if self.codec != AUTO:
            try:
                make_codec(self.codec).check_level(self.level)
            except ValueError as e:
                raise ValueError(f"outer.codec/level: {e}") from None
        elif self.level is not None:
            raise ValueError(
                f"outer.level={self.level!r} with outer.codec='auto': the level is chosen per "
                "link; leave it unset or name a codec"
            )
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"outer.error_feedback={self.error_feedback!r} must be True or False")
        if self.dtype not in OUTER_DTYPES:
            raise ValueError(f"outer.dtype={self.dtype!r}; use one of {list(OUTER_DTYPES)}")
        if not isinstance(self.host_copy, bool):
            raise ValueError(f"outer.host_copy={self.host_copy!r} must be True or False")
        if self.work not in WORK_MODES:
            raise ValueError(f"outer.work={self.work!r}; use one of {list(WORK_MODES)}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"outer.weighting={self.weighting!r}; use one of {list(WEIGHTINGS)}")
        if self.weighting == "samples" and self.work != "time":
            raise ValueError(
                "outer.weighting='samples' needs work='time': the regions' samples are gathered "
                "at its round boundaries (with work='steps' every region runs the same steps)"
            )

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> OuterConfig:
        """Options from a plain dict (e.g. read from JSON): unknown keys are an error."""
        return cls(**_known(cls, options, "outer"))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class ElasticConfig:
    """Regions that come and go (cloudtrain.elastic, docs/elastic.md): each region is launched on
    its own and joins the run through a torchft Lighthouse; a lost region's survivors go on, a
    restarted or new region gets the live state from a peer and is counted from the next sync.
    The outer loop (CompressionConfig(outer=...)) with no overlap, or per step with staleness 0;
    "auto" (the outer loop's sync_every and codec, at its next fragment-0 sync; the per-step
    controller, at the quorum) is planned again for the regions present after they change
    (cloudtrain.replan, cloudtrain.elastic)."""

    lighthouse: str | None = None
    """The torchft Lighthouse's address ("http://host:port"); None: TORCHFT_LIGHTHOUSE. (Not part
    of the config's fingerprint: regions may reach it by different names.)"""

    min_regions: int = 1
    """Fewer regions present than this pause training at the next sync until enough are back
    (they never train alone). The Lighthouse's own --min_replicas should be the same."""

    start_regions: int = 0
    """A fresh run (no region has committed a sync yet) starts training once this many regions
    are present, so that the first regions do not train alone while the others are still
    starting; 0: min_regions."""

    exchange_timeout_s: float = 30.0
    """Seconds a collective across regions (an exchange, a state transfer, making the groups)
    may take before the region is taken as lost and the sync is redone with those present: the
    bound on noticing a partition."""

    quorum_timeout_s: float = 60.0
    """Seconds one quorum request waits before it is logged as a pause and asked again."""

    heartbeat_s: float = 0.1
    """Seconds between the region's heartbeats to the Lighthouse."""

    quorum_every: int = 10
    """Per-step mode: steps between two quorums. A region lost in between is noticed by the
    exchange it fails, whose step is dropped and a quorum asked at once; a joining region waits
    for the others' next quorum, at most this many steps. (The outer loop asks at every sync.)"""

    spot: bool = False
    """Watch the EC2 spot notice on every rank (cloudtrain.spot.SpotWatcher); a notice makes the
    region leave after the next sync, its pseudo-gradient handed over (per step: at its next
    quorum, which the others are told at)."""

    spot_poll_s: float = 5.0
    """Seconds between two polls of the spot notice."""

    heartbeat_timeout_s: float = 3.0
    """The Lighthouse's --heartbeat-timeout-s (`cloudtrain lighthouse`'s default). Per step, a
    region that leaves on a spot notice leaves at a quorum, and the others then ask no regular
    quorum until this long has passed (in steps): the Lighthouse would hold their quorum until
    the leaver's heartbeats have timed out. (Not part of the config's fingerprint.)"""

    def __post_init__(self) -> None:
        if self.lighthouse is not None and (
            not isinstance(self.lighthouse, str) or "://" not in self.lighthouse
        ):
            raise ValueError(
                f"elastic.lighthouse={self.lighthouse!r}: give the Lighthouse's URL, e.g. "
                "'http://10.0.0.5:29510', or None to read TORCHFT_LIGHTHOUSE"
            )
        _number("elastic.min_regions", self.min_regions, 1, 4096, integer=True)
        _number("elastic.start_regions", self.start_regions, 0, 4096, integer=True)
        _number("elastic.exchange_timeout_s", self.exchange_timeout_s, 0, 86400, open_lo=True)
        _number("elastic.quorum_timeout_s", self.quorum_timeout_s, 0, 86400, open_lo=True)
        _number("elastic.heartbeat_s", self.heartbeat_s, 0, 60, open_lo=True)
        _number("elastic.quorum_every", self.quorum_every, 1, 2**31 - 1, integer=True)
        if not isinstance(self.spot, bool):
            raise ValueError(f"elastic.spot={self.spot!r} must be True or False")
        _number("elastic.spot_poll_s", self.spot_poll_s, 0, 3600, open_lo=True)
        _number("elastic.heartbeat_timeout_s", self.heartbeat_timeout_s, 0, 3600, open_lo=True)
        if self.heartbeat_s >= self.heartbeat_timeout_s:
            raise ValueError(
                f"elastic.heartbeat_s={self.heartbeat_s} is not below "
                f"elastic.heartbeat_timeout_s={self.heartbeat_timeout_s}: the Lighthouse would "
                "take a live region as lost between two heartbeats; beat several times a timeout"
            )

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> ElasticConfig:
        """Options from a plain dict (e.g. read from JSON): unknown keys are an error."""
        return cls(**_known(cls, options, "elastic"))
