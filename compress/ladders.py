"""The ladders of codecs the controllers climb: rungs from no compression to the most.

    from cloudtrain.compress.ladders import LADDER, OUTER_LADDER, rung_spec
    codec_name, level = LADDER[4]                     # ("topk>quant", (0.1, 8))
    rung_spec(LADDER[4])                              # "topk:0.1>quant:8", for parse_spec

A rung is (codec name, level), as make_codec and Codec.check_level take them. `LADDER` is the
cross-region controller's default (cloudtrain.config.ControllerOptions.ladder), `OUTER_LADDER`
what the outer loop picks its pseudo-gradients' codec from (cloudtrain.outer); the bench's zstd
table covers `LADDER`. They live in this layer so that the core and the bench read the same
rungs, and none of compress/ imports the core.
"""

from __future__ import annotations

from .codecs.base import Level

LADDER: tuple[tuple[str, Level], ...] = (
    ("none", None),
    ("bf16", None),
    ("quant", 8),
    ("quant", 4),
    ("topk>quant", (0.1, 8)),
    ("topk>quant", (0.01, 8)),
    ("topk>quant", (0.001, 8)),
    ("topk>quant", (0.0001, 8)),
)
"""Rungs from no compression to the most; each is (codec name, level)."""

OUTER_LADDER: tuple[tuple[str, Level], ...] = (
    ("none", None),
    ("bf16", None),
    ("quant", 8),
    ("quant", 4),
    ("topk>quant", (0.1, 4)),
    ("topk>quant", (0.02, 2)),
)
"""Codecs of the pseudo-gradients, least compressed first; the last is SparseLoCo's kind
(top-k + 2-bit with error feedback)."""


def rung_spec(rung: tuple[str, Level]) -> str:
    """The rung as a codec spec: ("topk>quant", (0.1, 8)) -> "topk:0.1>quant:8" (parse_spec's
    input; each stage of the name takes one entry of a tuple level)."""
    name, level = rung
    levels = level if isinstance(level, tuple) else (level,)
    return ">".join(
        n if lv is None else f"{n}:{lv}" for n, lv in zip(name.split(">"), levels, strict=True)
    )
