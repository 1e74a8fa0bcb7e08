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
import os
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from .compress import Codec, feedback, parse_spec
from .compress.codecs import NONFINITE, ROUNDINGS, CodecKind, make_codec
from .compress.ladders import LADDER  # noqa: F401  (the controller's rungs: cloudtrain.config.LADDER)
from .options import (  # noqa: F401  (the parts' options, importable from here too)
    AUTO,
    MAX_STALENESS,
    OUTER_DTYPES,
    QUALITY_BOUND,
    QUALITY_BOUND_BEFORE,
    ControllerOptions,
    ElasticConfig,
    OuterConfig,
    _number,
    as_level,
    read_json,
)

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
    "diloco-streaming": {
        "codec": "none",
        "error_feedback": False,
        "outer": {"sync_every": 100, "fragments": 4, "overlap": 1, "codec": "quant", "level": 4},
    },
}
"""Named configs. "cocktail" is CocktailSGD's random-k 10% -> top-k 10% of those -> 4-bit.
"diloco" is the outer loop (OuterConfig's defaults: the pseudo-gradients' codec chosen per link);
"diloco-sparse" sends them SparseLoCo-style (top-k 2% -> 2-bit, error feedback), "diloco-int8"
as INTELLECT-1 does (8-bit); "diloco-4bit" syncs every 50 steps in 4 bits with outer momentum 0.5
(README: over 500x less traffic than DDP, within 2% of its loss on the char transformer at 2000
steps); "diloco-streaming" is Streaming DiLoCo's schedule: H = 100, four fragments in turn (one
syncs every 25 steps), each exchange hidden behind the next inner step, 4-bit."""


RESIDUAL_DTYPES = {str(d).removeprefix("torch."): d for d in feedback.RESIDUAL_DTYPES}
"""Residual dtypes by name, as ErrorFeedback keeps them."""


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

    global_batch: int | None = None
    """Samples per step over all ranks, shared among them by measured throughput (cloudtrain.
    shares: a rank twice as fast gets twice the samples; gradients weighted by share, so the
    update is the mean over the global batch). Draw each rank's batch with cloudtrain.
    ShareSampler or CloudDDP.batch_size(). Needs "auto" (its controller plans the shares) and no
    outer loop. None: every rank brings its own batch, as with DDP."""

    def __post_init__(self) -> None:
        if not isinstance(self.codec, str) or not self.codec.strip():
            raise ValueError(f"codec={self.codec!r}: name a codec, e.g. 'topk', or use 'auto'")
        object.__setattr__(self, "level", as_level(self.level))
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
        if self.global_batch is not None:
            self._check_global_batch()
        if self.outer is not None and self.staleness:
            raise ValueError(
                f"staleness={self.staleness} with an outer loop: it delays per-step exchanges, "
                "which the outer loop does not make; to apply its syncs late, set "
                "outer.overlap, and leave staleness unset"
            )
        if self.outer is not None and self.verify_every:
            raise ValueError(
                f"verify_every={self.verify_every} with an outer loop: regions' replicas differ "
                "between syncs by design; leave verify_every at 0 and call verify_replicas() "
                "after CloudDDP.finish_outer()"
            )

    def _check_elastic_steps(self) -> None:
        """Per-step mode: exchanges finished within their step, shares of a fixed world."""
        if self.global_batch is not None:
            raise ValueError(
                f"elastic=... with global_batch={self.global_batch}: batch shares by throughput "
                "are planned for a fixed set of ranks; leave global_batch unset in an elastic run"
            )
        if self.staleness:
            raise ValueError(
                f"elastic=... with staleness={self.staleness}: a step's exchange must finish in "
                "its step for a lost region's step to be dropped; leave staleness at 0"
            )
        if self.verify_every:
            raise ValueError(
                f"elastic=... with verify_every={self.verify_every}: the present regions' "
                "parameters are compared after every change of membership; leave verify_every at 0"
            )

    def _check_global_batch(self) -> None:
        _number("global_batch", self.global_batch, 1, 2**31 - 1, integer=True)
        if self.codec != AUTO or self.outer is not None:
            raise ValueError(
                f"global_batch={self.global_batch} with codec={self.codec!r}"
                f"{' and an outer loop' if self.outer is not None else ''}: batch shares are "
                "planned by the per-step controller; use codec 'auto' without outer (the outer "
                "loop balances regions with outer=OuterConfig(work='time'))"
            )

    def _check_elastic(self) -> None:
        outer = self.outer
        slowest = max(self.elastic.quorum_timeout_s, self.elastic.exchange_timeout_s)
        if slowest >= self.timeout_s:
            raise ValueError(
                f"elastic quorum_timeout_s/exchange_timeout_s ({slowest:g}) must be below "
                f"timeout_s={self.timeout_s:g}: the region's own ranks wait that long for the "
                "one that asks the Lighthouse or moves the state"
            )
        if outer is None:
            self._check_elastic_steps()
            return
        if outer.overlap:
            raise ValueError(
                f"elastic=... with outer.overlap={outer.overlap}: an exchange in flight while "
                "regions come and go is not supported; use overlap=0"
            )
        if outer.work != "steps":
            raise ValueError(
                f"elastic=... with outer.work={outer.work!r}: rounds by time in an elastic run are "
                "not supported yet; use work='steps'"
            )

    @classmethod
    def resolve(
        cls, config: CompressionConfig | str | None = None, **overrides: Any
    ) -> CompressionConfig:
        """A config from itself, a preset name, a codec spec ("topk:0.01") or a JSON file's
        path (a str or a Path ending in .json), with overrides."""
        if config is None:
            config = AUTO
        if isinstance(config, CompressionConfig):
            return dataclasses.replace(config, **overrides) if overrides else config
        if isinstance(config, os.PathLike):
            config = os.fspath(config)
        if isinstance(config, str) and config.lower().endswith(
            ".json"
        ):  # e.g. what `cloudtrain plan --emit` wrote
            fields = read_json("config file", config)
            if not isinstance(fields, dict):
                raise ValueError(f"config file {config}: a JSON object of CompressionConfig fields")
            return cls.from_dict({**fields, **overrides})
        if not isinstance(config, str):
            raise TypeError(
                "config: a CompressionConfig, a preset name, a codec spec or a .json file's "
                f"path, got {type(config).__name__}"
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
        """What all ranks must agree on, as a short stable hash (timeouts and TensorBoard folders
        may differ per rank)."""
        fields = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "timeout_s"
        }
        if fields["zstd"] is None:  # states saved before the option existed still load
            del fields["zstd"]
        if fields["elastic"] is None:  # (as zstd)
            del fields["elastic"]
        else:  # the Lighthouse's address may differ per region, like the timeout
            elastic = repr(dataclasses.replace(fields["elastic"], lighthouse=None))
            if self.elastic.quorum_every == 10:  # (as outer's later fields) the default
                elastic = elastic.replace(" quorum_every=10,", "")
            # the Lighthouse's setting, not the run's (as its address)
            elastic = re.sub(r", heartbeat_timeout_s=[^,)]*\)$", ")", elastic)
            fields["elastic"] = elastic
        if fields["global_batch"] is None:  # (as zstd)
            del fields["global_batch"]
        # where a rank writes TensorBoard metrics may differ per rank (another host's folder), and
        # so may a resumed run's
        fields["controller"] = dataclasses.replace(fields["controller"], tensorboard_dir=None)
        if fields["controller"].quality_bound == QUALITY_BOUND:  # the default, fingerprinted as
            # it was before it moved to 0.015: states saved with the default still load (only
            # rank 0 decides with the bound's value; the guard's state has the same form)
            fields["controller"] = dataclasses.replace(
                fields["controller"], quality_bound=QUALITY_BOUND_BEFORE
            )
        if isinstance(self.outer, OuterConfig):  # likewise: the later fields at their defaults
            text = repr(self.outer).replace(", weighting='equal')", ")")
            text = text.replace(", work='steps')", ")")
            if not self.outer.host_copy:
                text = text.replace(", host_copy=False)", ")")
            fields["outer"] = text
        text = json.dumps(fields, sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
