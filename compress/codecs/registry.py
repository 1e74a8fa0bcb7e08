"""Codecs by name: the registry, `make_codec` for a name or composition, `parse_spec` for a
codec and its level in one string.

    register_codec("mine", MyCodec)                  # a Codec subclass or a Sparsifier: a factory
    codec = make_codec("topk>quant", group_size=256) # each factory gets the parameters it names
    codec, level = parse_spec("randomk:0.1>topk:0.1>quant:4")

A factory receives, of the parameters given to make_codec, the ones its signature names (found
with inspect.signature), so a user's `Codec` subclass registers as it is; a parameter that no
registered factory names is a typo and raises.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from typing import Any

from .base import Codec, Level
from .dense import Bf16, Fp16, NoneCodec, Quant, Sign
from .sparse import RandomK, Sparse, Sparsifier, TopK


class CodecKind(enum.Enum):
    """The names of the built-in codecs (the registry also holds what users add)."""

    NONE = "none"
    FP16 = "fp16"
    BF16 = "bf16"
    QUANT = "quant"
    SIGN = "sign"
    TOPK = "topk"
    RANDOMK = "randomk"


CodecFactory = Callable[..., "Codec | Sparsifier"]
"""Builds a dense codec or a sparsifier stage from the parameters it names (keywords)."""

_REGISTRY: dict[str, CodecFactory] = {}
_ALIASES: dict[str, str] = {"topk-sampled": "topk"}


def _accepted(factory: CodecFactory) -> set[str] | None:
    """Keyword parameters the factory takes; None if it takes any (**kwargs)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }


def register_codec(name: str, factory: CodecFactory, *, replace: bool = False) -> None:
    """Make `name` usable in make_codec / parse_spec / a config's codec.

    `factory(**params)` returns a `Codec` (dense: usable alone or to code a composition's kept
    values) or a `Sparsifier` (a selection stage); it receives only the parameters its signature
    names (group_size, rounding, nonfinite, sampled, ...). A class is a factory. Every rank must
    register the same codecs; packets name their codec by a CRC of `Codec.name`.
    """
    if (
        not isinstance(name, str)
        or not name
        or name != name.strip()
        or any(c in name for c in ">:")
    ):
        raise ValueError(
            f"codec name {name!r}: use a non-empty name without spaces, '>' or ':' (they separate "
            "stages and levels in a spec)"
        )
    if not callable(factory):
        raise TypeError(
            f"factory for codec {name!r} must be callable, got {type(factory).__name__}"
        )
    if (name in _REGISTRY or name in _ALIASES) and not replace:
        raise ValueError(f"codec {name!r} is already registered; pass replace=True to replace it")
    _ALIASES.pop(name, None)
    _REGISTRY[name] = factory


def registered_codecs() -> tuple[str, ...]:
    """The registered codec names, in registration order (aliases not included)."""
    return tuple(_REGISTRY)


for _name, _factory in (
    (CodecKind.NONE.value, NoneCodec),
    (CodecKind.FP16.value, Fp16),
    (CodecKind.BF16.value, Bf16),
    (CodecKind.QUANT.value, Quant),
    (CodecKind.SIGN.value, Sign),
    (CodecKind.TOPK.value, TopK),
    (CodecKind.RANDOMK.value, RandomK),
):
    register_codec(_name, _factory)


def _factory(name: str) -> CodecFactory:
    name = _ALIASES.get(name, name)
    if name not in _REGISTRY:
        aliases = ", ".join(f"{a} (= {b})" for a, b in _ALIASES.items())
        raise ValueError(
            f"unknown codec {name!r}; known codecs: {', '.join(_REGISTRY)}"
            + (f"; old names: {aliases}" if aliases else "")
        )
    return _REGISTRY[name]


def _build(name: str, params: dict[str, Any]) -> Codec | Sparsifier:
    factory = _factory(name)
    accepted = _accepted(factory)
    built = factory(
        **(params if accepted is None else {k: v for k, v in params.items() if k in accepted})
    )
    if not isinstance(built, (Codec, Sparsifier)) or isinstance(built, Sparse):
        raise TypeError(
            f"the factory of codec {name!r} returned {built!r}; it must return a dense Codec or a "
            "Sparsifier"
        )
    return built


def make_codec(name: str, **params: Any) -> Codec:
    """A codec by registered name or composition ("randomk>topk>quant"). Unknown names raise,
    listing the registered ones. `params` go to every stage that takes them: group_size and
    rounding (quant, sign), nonfinite (all), sampled (topk), and those of registered codecs; a
    parameter no registered codec takes raises (a typo), unless a factory takes **kwargs."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"codec name must be a non-empty string, got {name!r}")
    known: set[str] | None = set()
    for factory in _REGISTRY.values():
        accepted = _accepted(factory)
        if accepted is None:
            known = None
            break
        known |= accepted
    if known is not None and set(params) - known:
        raise ValueError(
            f"unknown codec parameter(s) {sorted(set(params) - known)}; the registered codecs "
            f"take {sorted(known)}"
        )
    names = [part.strip() for part in name.split(">")]
    built = [_build(n, params) for n in names]
    nonfinite = params.get("nonfinite", "raise")
    if isinstance(built[-1], Codec):
        values, stages = built[-1], built[:-1]
    else:
        values, stages = None, built
    if any(not isinstance(s, Sparsifier) for s in stages):
        raise ValueError(
            f"codec {name!r}: only sparsifiers (topk, randomk, ...) can come before '>'; a dense "
            f"codec (none, fp16, bf16, quant, sign, ...) may only come last"
        )
    if not stages:
        return values
    return Sparse(stages, values if values is not None else _build("none", params), nonfinite)


def _parse_number(spec: str, name: str, value: str) -> int | float:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    raise ValueError(f"codec spec {spec!r}: level {value!r} of {name!r} is not a number")


def parse_spec(spec: str, **params: Any) -> tuple[Codec, Level]:
    """ "topk:0.01", "quant:8", "fp16", "randomk:0.1>topk:0.1>quant:4" -> (codec, level).

    Levels are checked as given: "quant:8.9" or "topk:0.1>fp16:5" raise, never round or drop."""
    if not isinstance(spec, str):
        raise ValueError(f"codec spec must be a string, got {spec!r}")
    names, levels = [], []
    for stage in spec.split(">"):
        name, sep, value = stage.strip().partition(":")
        name, value = name.strip(), value.strip()
        if sep and not value:
            raise ValueError(f"codec spec {spec!r}: ':' after {name!r} but no level")
        names.append(name)
        levels.append(_parse_number(spec, name, value) if value else None)
    codec = make_codec(">".join(names), **params)
    level = tuple(levels) if codec.is_composite else levels[0]
    return codec, codec.check_level(level)
