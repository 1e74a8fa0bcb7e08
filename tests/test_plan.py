"""cloudtrain.plan in process: a `Plan` says what each region's shard owners send (`same`,
`zstd_for`), whether one all_gather of equal packets moves them (`uniform`) and whether nothing
is compressed (`lossless`); `Codecs` makes each codec once with the config's parameters, and its
byte counts are the bytes real packets have on the wire.

    .venv/bin/pytest tests/test_plan.py -q
"""

from __future__ import annotations

import pytest
import torch
from support import grad_like

from cloudtrain import CompressionConfig
from cloudtrain.compress import to_wire
from cloudtrain.plan import NONE, Codecs, Plan

RUNGS = [NONE, ("fp16", None), ("quant", 4), ("topk", 0.01), ("topk>quant", (0.1, 8))]
RUNG_IDS = [f"{name}:{level}" for name, level in RUNGS]


@pytest.mark.parametrize("rung", RUNGS, ids=RUNG_IDS)
def test_same_gives_every_region_the_rung(rung):
    plan = Plan.same(rung, 3, staleness=2)
    assert plan.senders == (rung, rung, rung) and plan.staleness == 2 and plan.zstd == ()
    assert [plan.zstd_for(r) for r in range(3)] == [False, False, False]
    zipped = Plan.same(rung, 3, zstd=True)
    assert zipped.zstd == (True, True, True) and zipped.staleness == 0
    assert [zipped.zstd_for(r) for r in range(3)] == [True, True, True]


def test_zstd_for_is_per_region():
    plan = Plan((("quant", 8), ("quant", 8)), zstd=(False, True))
    assert [plan.zstd_for(r) for r in range(2)] == [False, True]


def test_lossless_is_none_everywhere():
    assert Plan.same(NONE, 2).lossless and Plan.same(NONE, 2, zstd=True).lossless
    assert not Plan((NONE, ("quant", 8))).lossless
    assert not Plan.same(("topk", 1.0), 2).lossless, "topk:1.0 still goes through packets"


def test_codecs_are_made_once_with_the_configs_parameters():
    config = CompressionConfig(group_size=128, rounding="nearest")
    codecs = Codecs(config)
    quant = codecs("quant")
    assert codecs("quant") is quant
    assert quant.group_size == 128 and quant.rounding == "nearest"
    assert quant.name == config.make_codec("quant").name
    assert codecs("topk") is not quant


@pytest.mark.parametrize("rung", RUNGS, ids=RUNG_IDS)
@pytest.mark.parametrize("numel", [1, 1000, 4099])
def test_byte_counts_are_the_bytes_of_real_packets(rung, numel):
    codecs = Codecs(CompressionConfig())
    codec = codecs(rung[0])
    packet = to_wire(codec.encode(grad_like(numel), rung[1]))
    assert codecs.wire_nbytes(rung, numel) == packet.numel()
    shards = [numel, 7]
    assert codecs.step_nbytes(rung, shards, receivers=2) == 2 * sum(
        codecs.wire_nbytes(rung, m) for m in shards
    )


def test_wire_nbytes_counts_the_inputs_dtype():
    codecs = Codecs(CompressionConfig())
    x = grad_like(1000, torch.bfloat16)
    assert (
        codecs.wire_nbytes(NONE, 1000, torch.bfloat16) == to_wire(codecs("none").encode(x)).numel()
    )
    assert codecs.wire_nbytes(NONE, 1000, torch.bfloat16) < codecs.wire_nbytes(NONE, 1000)
