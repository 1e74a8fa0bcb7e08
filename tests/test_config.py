"""CompressionConfig, ControllerOptions and OuterConfig: every option checked when the config is
made, and the presets."""

from __future__ import annotations

import json
import math

import pytest

from cloudtrain import PRESETS, CompressionConfig
from cloudtrain.config import LADDER, ControllerOptions, OuterConfig


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_resolves(name: str) -> None:
    config = CompressionConfig.resolve(name)
    assert config == CompressionConfig.resolve(config)
    assert len(config.fingerprint()) == 16


def test_spec_gives_codec_and_level() -> None:
    config = CompressionConfig.resolve("randomk:0.1>topk:0.1>quant:4")
    assert config.codec == "randomk>topk>quant"
    assert config.level == (0.1, 0.1, 4)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("timeout_s", math.inf, "timeout_s=inf"),
        ("timeout_s", math.nan, "timeout_s=nan"),
        ("timeout_s", 0, "timeout_s=0"),
        ("timeout_s", True, "timeout_s=True"),
        ("timeout_s", "60", "timeout_s='60'"),
        ("seed", True, "seed=True"),
        ("seed", -1, "seed=-1"),
        ("seed", 2**63, "seed="),
        ("seed", 1.5, "seed=1.5"),
        ("group_size", 0, "group_size=0"),
        ("group_size", False, "group_size=False"),
        ("verify_every", -1, "verify_every"),
        ("verify_every", 2.0, "verify_every"),
        ("residual_dtype", "float16", "residual_dtype='float16'"),
        ("rounding", "up", "rounding='up'"),
        ("nonfinite", "ignore", "nonfinite='ignore'"),
        ("error_feedback", 1, "error_feedback=1"),
        ("regions", "moon", "regions='moon'"),
        ("regions", ["us", ""], "region name"),
        ("regions", [" us", "eu"], "region name"),
        ("regions", 3, "regions=3"),
        ("controller", 5, "controller"),
        ("controller", {"speed": "fast"}, "unknown controller options"),
        ("codec", "zip", "zip"),
        ("codec", "", "codec="),
    ],
)
def test_bad_values_are_named(field: str, value: object, words: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        CompressionConfig(**{field: value})
    assert words in str(info.value), str(info.value)


def test_level_is_checked_against_the_codec() -> None:
    with pytest.raises(ValueError, match="level"):
        CompressionConfig(codec="quant", level=3)
    with pytest.raises(ValueError, match="controller picks levels"):
        CompressionConfig(codec="auto", level=8)


def test_regions_as_one_string_are_split_and_stripped() -> None:
    assert CompressionConfig(regions="us, us ,eu,eu").regions == ("us", "us", "eu", "eu")
    assert CompressionConfig(regions=["us", "eu"]).regions == ("us", "eu")


def test_controller_options_are_typed_when_the_config_is_made() -> None:
    config = CompressionConfig(controller={"interval": 3, "ladder": [["none", None], ["quant", 8]]})
    assert isinstance(config.controller, ControllerOptions)
    assert config.controller.interval == 3
    assert config.controller.ladder == (("none", None), ("quant", 8))
    assert CompressionConfig().controller.ladder == LADDER
    # the same options either way: the same fingerprint on every rank
    assert (
        CompressionConfig(controller={"interval": 3}).fingerprint()
        == CompressionConfig(controller=ControllerOptions(interval=3)).fingerprint()
    )
    assert (
        CompressionConfig().fingerprint()
        != CompressionConfig(controller={"interval": 3}).fingerprint()
    )


@pytest.mark.parametrize(
    "options",
    [
        {"hidden_fraction": 0},
        {"hidden_fraction": math.inf},
        {"interval": 0},
        {"interval": True},
        {"patience": 1.5},
        {"margin": 1.5},
        {"ewma": 0},
        {"slack": -1},
        {"initial_compute_s": math.nan},
        {"ladder": ()},
        {"ladder": (("zip", None),)},
        {"ladder": (("quant", 3),)},
        {"ladder": "quant"},
        {"ladder": [["quant"]]},  # a TypeError or an unpacking error before
        {"ladder": [5]},
        {"tensorboard_dir": 3},
    ],
)
def test_bad_controller_options(options: dict) -> None:
    with pytest.raises(ValueError, match=f"{next(iter(options))}"):
        CompressionConfig(controller=options)


def test_timeout_is_one_timedelta() -> None:
    assert CompressionConfig(timeout_s=90).timeout.total_seconds() == 90


def test_resolve_names_what_it_could_not_read() -> None:
    with pytest.raises(ValueError, match="neither a preset"):
        CompressionConfig.resolve("topk-2pct")
    with pytest.raises(TypeError, match="preset name"):
        CompressionConfig.resolve(3)  # type: ignore[arg-type]


def test_tensorboard_folder_differs_per_rank_without_changing_the_fingerprint() -> None:
    """Each host (and a resumed run) may write its metrics elsewhere: not a mismatch."""
    fingerprints = {
        CompressionConfig(controller=c).fingerprint()
        for c in ({}, {"tensorboard_dir": "/a"}, {"tensorboard_dir": "/b/us-east-1"})
    }
    assert fingerprints == {CompressionConfig().fingerprint()}


def test_timeout_differs_per_rank_without_changing_the_fingerprint() -> None:
    assert (
        CompressionConfig(timeout_s=10).fingerprint()
        == CompressionConfig(timeout_s=20).fingerprint()
    )


def test_config_values_are_checked():
    with pytest.raises(ValueError, match="unknown codec 'gzip'"):
        CompressionConfig(codec="gzip")
    with pytest.raises(ValueError, match="neither a preset"):
        CompressionConfig.resolve("fast-please")
    with pytest.raises(ValueError, match="bits 2, 4 or 8"):
        CompressionConfig(codec="quant", level=3)
    with pytest.raises(ValueError, match="timeout_s=0"):
        CompressionConfig(timeout_s=0)
    with pytest.raises(ValueError, match="residual_dtype='float16'"):
        CompressionConfig(residual_dtype="float16")
    with pytest.raises(ValueError, match="regions='everywhere'"):
        CompressionConfig(regions="everywhere")
    with pytest.raises(ValueError, match="non-empty region name"):
        CompressionConfig(regions="us,,eu")
    assert CompressionConfig(regions="probe").regions == "probe"  # grouped by measured bandwidth
    assert CompressionConfig(regions="us,us,eu").regions == ("us", "us", "eu")
    with pytest.raises(ValueError, match="leave level unset"):
        CompressionConfig(codec="auto", level=0.1)
    with pytest.raises(ValueError, match="verify_every=-1"):
        CompressionConfig(verify_every=-1)
    assert CompressionConfig.resolve("cocktail").level == (0.1, 0.1, 4)
    assert CompressionConfig.resolve("topk:0.05").codec == "topk"


# -- the outer loop's options ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "options,match",
    [
        ({"sync_every": 0}, "sync_every"),
        ({"sync_every": "often"}, "sync_every"),
        ({"sync_every": 2.5}, "sync_every"),
        ({"outer_lr": 0}, "outer_lr"),
        ({"outer_lr": float("nan")}, "outer_lr"),
        ({"outer_momentum": -0.1}, "outer_momentum"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"nesterov": "yes"}, "nesterov"),
        ({"fragments": 0}, "fragments"),
        ({"fragments": 8, "sync_every": 4}, "fragments"),
        ({"overlap": -1}, "overlap"),
        ({"overlap": 4, "sync_every": 4}, "overlap"),
        ({"codec": "zip"}, "codec"),
        ({"codec": "quant", "level": 3}, "level"),
        ({"level": 8}, "level"),
        ({"error_feedback": 1}, "error_feedback"),
        ({"dtype": "float16"}, "dtype"),
        ({"H": 10}, "unknown outer options"),
    ],
)
def test_bad_outer_options(options, match):
    with pytest.raises(ValueError, match=match):
        CompressionConfig(outer=options)


def test_outer_with_a_per_step_codec_verify_or_a_bad_value_is_an_error():
    with pytest.raises(ValueError, match="verify_every"):
        CompressionConfig(verify_every=10, outer={})
    with pytest.raises(ValueError, match="outer.codec"):
        CompressionConfig(codec="quant", level=8, outer={})
    with pytest.raises(ValueError, match="OuterConfig"):
        CompressionConfig(outer=50)


def test_presets():
    sparse = CompressionConfig.resolve("diloco-sparse").outer
    assert (sparse.codec, sparse.level, sparse.error_feedback) == ("topk>quant", (0.02, 2), True)
    assert CompressionConfig.resolve("diloco-int8").outer.level == 8
    four = CompressionConfig.resolve("diloco-4bit").outer
    assert (four.sync_every, four.codec, four.level, four.outer_momentum) == (50, "quant", 4, 0.5)
    assert CompressionConfig.resolve("diloco").outer == OuterConfig()
    assert all(CompressionConfig.resolve(name) for name in PRESETS)


@pytest.mark.parametrize("name", ["auto", "topk-1pct", "cocktail", "diloco-4bit", "diloco-sparse"])
def test_a_config_round_trips_through_json(name, tmp_path):
    config = CompressionConfig.resolve(name, regions="us,us,eu,eu", controller={"interval": 7})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    assert CompressionConfig.resolve(str(path)) == config
    assert CompressionConfig.resolve(str(path), timeout_s=9).timeout_s == 9
    with pytest.raises(ValueError, match="unknown CompressionConfig fields"):
        CompressionConfig.from_dict({**config.to_dict(), "codek": "topk"})
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="config file .*broken.json"):
        CompressionConfig.resolve(str(tmp_path / "broken.json"))


def test_the_config_classes_the_docs_use_are_exported():
    import cloudtrain
    from cloudtrain import options, quorum

    for name in ("OuterConfig", "ElasticConfig", "ControllerOptions"):
        assert getattr(cloudtrain, name) is getattr(options, name) and name in cloudtrain.__all__
    for name in ("RegionLeft", "ElasticRefused"):  # docs/elastic.md's loop catches RegionLeft
        assert getattr(cloudtrain, name) is getattr(quorum, name) and name in cloudtrain.__all__


def test_a_chains_levels_may_be_a_list():
    """As JSON gives them (a list was refused by a message quoting the list it asked for)."""
    listed = CompressionConfig(codec="randomk>topk>quant", level=[0.1, 0.1, 4])
    assert listed == CompressionConfig(codec="randomk>topk>quant", level=(0.1, 0.1, 4))
    assert OuterConfig(codec="topk>quant", level=[0.02, 2]).level == (0.02, 2)


def test_resolve_takes_a_json_files_path_as_a_path_too(tmp_path):
    from pathlib import Path

    (tmp_path / "c.JSON").write_text(json.dumps({"codec": "quant", "level": 8}))
    for given in (Path(tmp_path / "c.JSON"), str(tmp_path / "c.JSON")):
        assert CompressionConfig.resolve(given) == CompressionConfig.resolve("quant8")


def test_staleness_with_an_outer_loop_is_refused_naming_overlap():
    with pytest.raises(ValueError, match="set outer.overlap, and leave staleness unset"):
        CompressionConfig.resolve("diloco", staleness=3)
    assert CompressionConfig.resolve("diloco", staleness=0).staleness == 0
