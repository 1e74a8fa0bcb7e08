"""CompressionConfig: how CloudDDP compresses gradients, as one frozen, validated value.

    CompressionConfig()                               # "auto": per-link adaptive
    CompressionConfig.resolve("topk-1pct")            # a preset by name
    CompressionConfig.resolve("randomk:0.1>topk:0.1>quant:4")   # any codec spec
    CompressionConfig(codec="quant", level=4, residual_dtype="bfloat16")

Compression applies to traffic between regions only; inside a region gradients are reduced
densely. Every rank must use the same config (CloudDDP checks a fingerprint before the first
step). Every field has a default; a bad value raises when the config is made, saying how to fix
it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from .compress import Codec, feedback, parse_spec
from .compress.codecs import NONFINITE, ROUNDINGS, CodecKind, make_codec
from .compress.ladders import LADDER

AUTO = "auto"

PRESETS: dict[str, dict[str, Any]] = {
    "auto": {"codec": AUTO},
    "none": {"codec": "none", "error_feedback": False},
    "fp16": {"codec": "fp16", "error_feedback": False},
    "bf16": {"codec": "bf16", "error_feedback": False},
    "quant8": {"codec": "quant", "level": 8},
    "quant4": {"codec": "quant", "level": 4},
    "sign": {"codec": "sign"},
    "topk-10pct": {"codec": "topk", "level": 0.1},
    "topk-1pct": {"codec": "topk", "level": 0.01},
    "topk-0.1pct": {"codec": "topk", "level": 0.001},
    "cocktail": {"codec": "randomk>topk>quant", "level": (0.1, 0.1, 4)},
    "diloco": {"codec": "none", "error_feedback": False, "outer": {}},
    "diloco-sparse": {
        "codec": "none",
        "error_feedback": False,
        "outer": {"codec": "topk>quant", "level": (0.02, 2)},
    },
    "diloco-int8": {
        "codec": "none",
        "error_feedback": False,
        "outer": {"codec": "quant", "level": 8},
    },
    "diloco-4bit": {
        "codec": "none",
        "error_feedback": False,
        "outer": {"sync_every": 50, "codec": "quant", "level": 4, "outer_momentum": 0.5},
    },
}
"""Named configs. "cocktail" is CocktailSGD's random-k 10% -> top-k 10% of those -> 4-bit.
"diloco" is the outer loop (OuterConfig's defaults: the pseudo-gradients' codec chosen per link);
"diloco-sparse" sends them SparseLoCo-style (top-k 2% -> 2-bit, error feedback), "diloco-int8"
as INTELLECT-1 does (8-bit); "diloco-4bit" syncs every 50 steps in 4 bits with outer momentum 0.5
(README: over 500x less traffic than DDP, within 2% of its loss on the char transformer at 2000
steps)."""


RESIDUAL_DTYPES = {str(d).removeprefix("torch."): d for d in feedback.RESIDUAL_DTYPES}
"""Residual dtypes by name, as ErrorFeedback keeps them."""


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


MAX_STALENESS = 16
"""The most steps an exchange may be applied late."""


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
    quality_bound: float | None = 0.02
    """The quality guard (cloudtrain.guard): the most a region's compression may change the
    update a momentum of 0.9 integrates, as a squared relative error (0.02: about 14 %) before
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
        if not isinstance(self.ladder, tuple) or not self.ladder:
            raise ValueError("ladder: give at least one (codec, level) rung")
        for name, level in self.ladder:
            make_codec(name).check_level(level)  # raises for an unknown codec or a bad level
        if self.tensorboard_dir is not None and not isinstance(self.tensorboard_dir, str):
            raise ValueError(f"tensorboard_dir={self.tensorboard_dir!r} must be a path or None")

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> ControllerOptions:
        """Options from a plain dict (e.g. read from JSON): unknown keys are an error."""
        known = set(cls.__dataclass_fields__)
        unknown = set(options) - known
        if unknown:
            raise ValueError(
                f"unknown controller options {sorted(unknown)}; known: {sorted(known)}"
            )
        opts = dict(options)
        if "ladder" in opts:
            opts["ladder"] = tuple(
                (name, tuple(lv) if isinstance(lv, list) else lv) for name, lv in opts["ladder"]
            )
        return cls(**opts)


OUTER_DTYPES = ("float32", "bfloat16")


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

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> OuterConfig:
        """Options from a plain dict (e.g. read from JSON): unknown keys are an error."""
        unknown = set(options) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown outer options {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}"
            )
        opts = dict(options)
        if isinstance(opts.get("level"), list):
            opts["level"] = tuple(opts["level"])
        return cls(**opts)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class ElasticConfig:
    """Regions that come and go (cloudtrain.elastic, docs/elastic.md): each region is launched on
    its own and joins the run through a torchft Lighthouse; a lost region's survivors go on, a
    restarted or new region gets the live state from a peer and is counted from the next sync.
    Outer loop only (CompressionConfig(outer=...)), with a fixed sync_every and codec and no
    overlap."""

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

    spot: bool = False
    """Watch the EC2 spot notice on every rank (cloudtrain.spot.SpotWatcher); a notice makes the
    region leave after the next sync, its pseudo-gradient handed over."""

    spot_poll_s: float = 5.0
    """Seconds between two polls of the spot notice."""

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
        if not isinstance(self.spot, bool):
            raise ValueError(f"elastic.spot={self.spot!r} must be True or False")
        _number("elastic.spot_poll_s", self.spot_poll_s, 0, 3600, open_lo=True)

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> ElasticConfig:
        """Options from a plain dict (e.g. read from JSON): unknown keys are an error."""
        unknown = set(options) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown elastic options {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}"
            )
        return cls(**options)


@dataclass(frozen=True)
class CompressionConfig:
    codec: str = AUTO
    """Codec for cross-region traffic: a name or composition from cloudtrain.compress
    ("topk", "randomk>topk>quant", ...) or "auto" (the controller picks per link)."""

    level: Any = None
    """The codec's level (bits for quant, density for sparsifiers, a tuple for compositions)."""

    error_feedback: bool = True
    """Keep what compression dropped and send it later (needed for top-k and low-bit codecs)."""

    residual_dtype: str = "float32"
    """dtype of the error-feedback residuals: "float32", or "bfloat16" for half the memory."""

    regions: Any = "env"
    """Region of each rank: "env" (CLOUDTRAIN_REGION, else the host's region from
    CLOUDTRAIN_HOST_REGIONS; ranks without one are grouped by measured bandwidth), "probe" (always
    by measured bandwidth), "per-rank" (each rank its own region), or a region name per rank (a sequence, or one string
    "us,us,eu,eu")."""

    timeout_s: float = 300.0
    """Seconds any collective may take before it raises, naming the stage and the peers."""

    seed: int = 0
    """Seed of the shared random-k indices and of stochastic rounding (never torch's RNG)."""

    group_size: int = 512
    """Elements per quantization scale (quant, sign)."""

    rounding: str = "stochastic"
    """Quantization rounding: "stochastic" (unbiased) or "nearest"."""

    nonfinite: str = "raise"
    """NaN/Inf in a gradient: "raise" (on every rank, the same step) or "pass" (every rank gets the
    same non-finite sum; AMP's GradScaler then skips the step). Residuals are never poisoned."""

    staleness: int | None = None
    """Apply each step's exchange across regions this many steps later, so its round trip hides
    behind the next steps' compute (cloudtrain.pipeline). None: the controller's choice with
    "auto", else 0. 0 is exact synchronous SGD."""

    zstd: bool | None = None
    """The packets' zstd stage (each packet's payload zstd-compressed where that shrinks it, for
    CPU on both ends): None - with "auto", the controller switches it on for a link where its
    measured ratio saves more link time than it costs (off with a fixed codec), and the outer
    loop's pseudo-gradients always go through it (one packet per H steps); True - always;
    False - never."""

    verify_every: int = 0
    """Every N steps check that all replicas' parameters agree bit for bit (0: never)."""

    controller: ControllerOptions | dict = field(default_factory=ControllerOptions)
    """Options of the adaptive controller when codec is "auto": ControllerOptions, or a dict of
    its fields (checked, and turned into ControllerOptions, when the config is made)."""

    outer: OuterConfig | dict | None = None
    """The outer loop (OuterConfig, or its fields as a dict): gradients are then reduced inside
    each region only, and parameters cross regions every few steps (CloudDDP needs optimizer=).
    None: every step's gradients cross regions."""

    elastic: ElasticConfig | dict | bool | None = None
    """Regions that come and go (ElasticConfig, its fields as a dict, or True for its defaults):
    each region launched on its own joins the run, a lost one is survived, a spot notice makes a
    region leave at the next sync (cloudtrain.elastic). None: a fixed set of ranks, as before."""

    def __post_init__(self) -> None:
        if not isinstance(self.codec, str) or not self.codec.strip():
            raise ValueError(f"codec={self.codec!r}: name a codec, e.g. 'topk', or use 'auto'")
        if self.codec != AUTO:
            codec = self.make_codec()
            try:
                codec.check_level(self.level)
            except ValueError as e:
                raise ValueError(f"CompressionConfig.level: {e}") from None
        elif self.level not in (None, AUTO):
            raise ValueError(
                f"level={self.level!r} with codec='auto': the controller picks levels; leave level unset"
            )
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback={self.error_feedback!r} must be True or False")
        if self.residual_dtype not in RESIDUAL_DTYPES:
            raise ValueError(
                f"residual_dtype={self.residual_dtype!r}; use one of {list(RESIDUAL_DTYPES)}"
            )
        if isinstance(self.regions, str) and "," in self.regions:  # "us,us,eu,eu"
            object.__setattr__(self, "regions", tuple(r.strip() for r in self.regions.split(",")))
        if isinstance(self.regions, str):
            if self.regions not in ("env", "probe", "per-rank"):
                raise ValueError(
                    f"regions={self.regions!r}; use 'env', 'probe', 'per-rank' or a region name "
                    "per rank (a list, or 'us,us,eu,eu')"
                )
        else:
            try:
                regions = tuple(self.regions)
            except TypeError:
                raise ValueError(
                    f"regions={self.regions!r}; use 'env', 'probe', 'per-rank' or a region name "
                    "per rank"
                ) from None
            if not regions or not all(isinstance(r, str) and r.strip() == r and r for r in regions):
                raise ValueError(
                    f"regions={self.regions!r}: give a non-empty region name, without spaces "
                    "around it, for every rank"
                )
            object.__setattr__(self, "regions", regions)
        _number("timeout_s", self.timeout_s, 0, 7 * 24 * 3600, open_lo=True)
        _number("seed", self.seed, 0, 2**63 - 1, integer=True)
        _number("group_size", self.group_size, 1, 2**31 - 1, integer=True)
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding={self.rounding!r}; use one of {ROUNDINGS}")
        if self.nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite={self.nonfinite!r}; use one of {NONFINITE}")
        _number("verify_every", self.verify_every, 0, 2**63 - 1, integer=True)
        if self.zstd is not None and not isinstance(self.zstd, bool):
            raise ValueError(f"zstd={self.zstd!r}: True, False, or None (the controller's choice)")
        if self.staleness is not None:
            _number(
                "staleness",
                self.staleness,
                0,
                MAX_STALENESS,
                integer=True,
            )
        if isinstance(self.controller, dict):
            object.__setattr__(self, "controller", ControllerOptions.from_dict(self.controller))
        elif not isinstance(self.controller, ControllerOptions):
            raise ValueError(
                "controller: a ControllerOptions, or its fields as a dict, e.g. "
                "{'hidden_fraction': 0.8}"
            )
        if isinstance(self.outer, dict):
            object.__setattr__(self, "outer", OuterConfig.from_dict(self.outer))
        elif self.outer is not None and not isinstance(self.outer, OuterConfig):
            raise ValueError(
                "outer: an OuterConfig, its fields as a dict (e.g. {'sync_every': 50}), or None"
            )
        if self.outer is not None and self.codec not in (AUTO, CodecKind.NONE.value):
            raise ValueError(
                f"codec={self.codec!r} with an outer loop: gradients then never cross regions "
                "per step; give the pseudo-gradients' codec as outer.codec and leave codec unset"
            )
        if self.elastic is True:
            object.__setattr__(self, "elastic", ElasticConfig())
        elif self.elastic is False:
            object.__setattr__(self, "elastic", None)
        elif isinstance(self.elastic, dict):
            object.__setattr__(self, "elastic", ElasticConfig.from_dict(self.elastic))
        elif self.elastic is not None and not isinstance(self.elastic, ElasticConfig):
            raise ValueError(
                "elastic: an ElasticConfig, its fields as a dict (e.g. {'min_regions': 2}), True "
                "or None"
            )
        if self.elastic is not None:
            self._check_elastic()
        if self.outer is not None and self.verify_every:
            raise ValueError(
                f"verify_every={self.verify_every} with an outer loop: regions' replicas differ "
                "between syncs by design; leave verify_every at 0 and call verify_replicas() "
                "after CloudDDP.finish_outer()"
            )

    def _check_elastic(self) -> None:
        outer = self.outer
        if outer is None:
            raise ValueError(
                "elastic=... needs the outer loop (e.g. 'diloco-4bit', or outer=OuterConfig(...)): "
                "regions agree on who is present only at syncs; per-step mode is not elastic"
            )
        if outer.sync_every == AUTO or outer.codec == AUTO:
            raise ValueError(
                "elastic=... with outer.sync_every or outer.codec 'auto': give both (e.g. "
                "sync_every=50, codec='quant', level=8); every region must know them before it "
                "joins"
            )
        slowest = max(self.elastic.quorum_timeout_s, self.elastic.exchange_timeout_s)
        if slowest >= self.timeout_s:
            raise ValueError(
                f"elastic quorum_timeout_s/exchange_timeout_s ({slowest:g}) must be below "
                f"timeout_s={self.timeout_s:g}: the region's own ranks wait that long for the "
                "one that asks the Lighthouse or moves the state"
            )
        if outer.overlap:
            raise ValueError(
                f"elastic=... with outer.overlap={outer.overlap}: an exchange in flight while "
                "regions come and go is not supported; use overlap=0"
            )

    @classmethod
    def resolve(
        cls, config: CompressionConfig | str | None = None, **overrides: Any
    ) -> CompressionConfig:
        """A config from itself, a preset name, or a codec spec ("topk:0.01"), with overrides."""
        if config is None:
            config = AUTO
        if isinstance(config, CompressionConfig):
            return dataclasses.replace(config, **overrides) if overrides else config
        if isinstance(config, str) and config.endswith(
            ".json"
        ):  # e.g. what `cloudtrain plan --emit` wrote
            return cls.from_dict({**cls._read_json(config), **overrides})
        if not isinstance(config, str):
            raise TypeError(
                f"config: a CompressionConfig, a preset name or a codec spec, got {type(config).__name__}"
            )
        if config in PRESETS:
            return cls(**{**PRESETS[config], **overrides})
        try:
            _, level = parse_spec(config)
        except ValueError as e:
            raise ValueError(
                f"config {config!r} is neither a preset ({', '.join(PRESETS)}) nor a codec spec: {e}"
            ) from None
        names = ">".join(stage.split(":")[0].strip() for stage in config.split(">"))
        return cls(**{"codec": names, "level": level, **overrides})

    @staticmethod
    def _read_json(path: str) -> dict[str, Any]:
        try:
            with open(path) as f:
                fields = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"config file {path}: {e}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"config file {path}: a JSON object of CompressionConfig fields")
        return fields

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> CompressionConfig:
        """A config from its fields as plain values (to_dict's form, e.g. read from JSON):
        unknown fields are an error, lists become the tuples the fields hold."""
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(
                f"unknown CompressionConfig fields {sorted(unknown)}; known: "
                f"{sorted(f.name for f in dataclasses.fields(cls))}"
            )
        fields = dict(fields)
        if isinstance(fields.get("level"), list):
            fields["level"] = tuple(fields["level"])
        if isinstance(fields.get("regions"), list):
            fields["regions"] = tuple(fields["regions"])
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values (JSON-able): from_dict gives the same config back."""
        out = dataclasses.asdict(self)
        out["controller"] = {
            k: v for k, v in out["controller"].items()
            if v != getattr(ControllerOptions(), k)
        }  # fmt: skip
        return json.loads(json.dumps(out))

    def make_codec(self, name: str | None = None) -> Codec:
        """The config's codec, or codec `name` with the config's parameters. CloudDDP checks
        non-finite values itself, so codecs pass them through."""
        name = self.codec if name is None else name
        return make_codec(
            name, group_size=self.group_size, rounding=self.rounding, nonfinite="pass"
        )

    @property
    def lossless(self) -> bool:
        return self.codec == CodecKind.NONE.value

    @property
    def timeout(self) -> timedelta:
        """timeout_s as the timedelta torch.distributed takes."""
        return timedelta(seconds=self.timeout_s)

    @property
    def residual_torch_dtype(self) -> torch.dtype:
        return RESIDUAL_DTYPES[self.residual_dtype]

    def fingerprint(self) -> str:
        """What all ranks must agree on, as a short stable hash (timeouts may differ per rank)."""
        fields = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "timeout_s"
        }
        if fields["zstd"] is None:  # states saved before the option existed still load
            del fields["zstd"]
        if fields["elastic"] is None:  # (as zstd)
            del fields["elastic"]
        else:  # the Lighthouse's address may differ per region, like the timeout
            fields["elastic"] = dataclasses.replace(fields["elastic"], lighthouse=None)
        if isinstance(self.outer, OuterConfig) and not self.outer.host_copy:  # likewise
            fields["outer"] = repr(self.outer).replace(", host_copy=False)", ")")
        text = json.dumps(fields, sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
