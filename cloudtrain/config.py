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
from dataclasses import dataclass, field
from typing import Any

import torch

from .compress import Codec, parse_spec
from .compress.codecs import NONFINITE, ROUNDINGS, CodecKind, make_codec

AUTO = "auto"

PRESETS: dict[str, dict[str, Any]] = {
    "auto": {"codec": AUTO},
    "none": {"codec": "none", "error_feedback": False},
    "fp16": {"codec": "fp16", "error_feedback": False},
    "bf16": {"codec": "bf16", "error_feedback": False},
    "quant8": {"codec": "quant", "level": 8},
    "quant4": {"codec": "quant", "level": 4},
    "sign": {"codec": "sign"},
    "topk-10pct": {"codec": "topk-sampled", "level": 0.1},
    "topk-1pct": {"codec": "topk-sampled", "level": 0.01},
    "topk-0.1pct": {"codec": "topk-sampled", "level": 0.001},
    "cocktail": {"codec": "randomk>topk>quant", "level": (0.1, 0.1, 4)},
}
"""Named configs. "cocktail" is CocktailSGD's random-k 10% -> top-k 10% of those -> 4-bit."""

_RESIDUAL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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

    verify_every: int = 0
    """Every N steps check that all replicas' parameters agree bit for bit (0: never)."""

    controller: dict = field(default_factory=dict)
    """Options of the adaptive controller when codec is "auto" (see cloudtrain.controller)."""

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
        if self.residual_dtype not in _RESIDUAL_DTYPES:
            raise ValueError(
                f"residual_dtype={self.residual_dtype!r}; use one of {list(_RESIDUAL_DTYPES)}"
            )
        if isinstance(self.regions, str) and "," in self.regions:
            object.__setattr__(self, "regions", tuple(self.regions.split(",")))  # "us,us,eu,eu"
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
            if not regions or not all(isinstance(r, str) and r for r in regions):
                raise ValueError("regions: give a non-empty region name for every rank")
            object.__setattr__(self, "regions", regions)
        if not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s!r} must be a positive number of seconds")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed={self.seed!r} must be an int in [0, 2**63)")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size={self.group_size!r} must be a positive int")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding={self.rounding!r}; use one of {ROUNDINGS}")
        if self.nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite={self.nonfinite!r}; use one of {NONFINITE}")
        if not isinstance(self.verify_every, int) or self.verify_every < 0:
            raise ValueError(
                f"verify_every={self.verify_every!r} must be an int >= 0 (0 turns it off)"
            )
        if not isinstance(self.controller, dict):
            raise ValueError("controller: options as a dict, e.g. {'hidden_fraction': 0.8}")

    @classmethod
    def resolve(
        cls, config: CompressionConfig | str | None = None, **overrides: Any
    ) -> CompressionConfig:
        """A config from itself, a preset name, or a codec spec ("topk:0.01"), with overrides."""
        if config is None:
            config = AUTO
        if isinstance(config, CompressionConfig):
            return dataclasses.replace(config, **overrides) if overrides else config
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
    def residual_torch_dtype(self) -> torch.dtype:
        return _RESIDUAL_DTYPES[self.residual_dtype]

    def fingerprint(self) -> str:
        """What all ranks must agree on, as a short stable hash (timeouts may differ per rank)."""
        fields = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "timeout_s"
        }
        text = json.dumps(fields, sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
