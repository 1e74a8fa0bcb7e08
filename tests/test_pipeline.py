"""The pipelined exchange (staleness s): step t applies the summed gradient of step t - s, the
same on every rank.

First cloudtrain.pipeline.Pipeline in process (no process started): flights whose exchanges have
landed - a real Exchange holding the bucket's sum where CrossRegion.finish leaves it - applied
by parameter across DDP's rebuild, every gradient exactly once when s changes, each exchange
finished once and only when due, and finish_all/state_dict/load_state_dict continuing exactly.
Then CloudDDP on real processes: against a single-process replay, bit-identical replicas, and a
resume in the middle of the pipeline.

    .venv/bin/pytest tests/test_pipeline.py -q
"""

from __future__ import annotations

import io

import pytest
import torch
from distributed import run_ranks
from models import assert_identical, batch, loss_of, make_model, params_of, train_span

from cloudtrain import CompressionConfig
from cloudtrain.datapath import Exchange, Shard
from cloudtrain.layout import layout_numel
from cloudtrain.pipeline import Pipeline
from cloudtrain.plan import NONE, Plan

LR = 0.05

# -- Pipeline in process ----------------------------------------------------------------------------

INITIAL = ((2, 0, 4), (1, 4, 4), (0, 8, 3))
"""DDP's first bucket: parameters 0 (3 elements), 1 (4) and 2 (4), in reverse order."""
REBUILT = {0: ((0, 0, 3), (1, 3, 4)), 1: ((2, 0, 4),)}
"""DDP's buckets after its rebuild: by index, (parameter, offset, numel)."""


class Exchanges:
    """The exchanges of a run whose packets have all landed: `start` gives the Exchange of a
    bucket's exchange, holding the bucket's sum where CrossRegion.finish leaves it (the region's
    gathered, padded buffer; this rank owns no shard); `finish` returns it, as CrossRegion.finish
    does once the packets are in, and counts what it finished."""

    def __init__(self) -> None:
        self.finished: list[tuple[int, int]] = []

    def start(self, step: int, index: int, summed: torch.Tensor) -> Exchange:
        n = summed.numel()
        shard = Shard(padded=summed.clone(), n=n, m=n, mine=None)
        return Exchange(step, index, Plan.same(NONE, 2), shard, f" at step {step}, bucket {index}")

    def finish(self, flight: Exchange) -> torch.Tensor:
        self.finished.append((flight.step, flight.index))
        return flight.shard.padded[: flight.shard.n]


def summed(step: int, n: int = 11) -> torch.Tensor:
    """A bucket's sum at `step`: 2**step everywhere, so a sum of several steps says which."""
    return torch.full((n,), 2.0**step)


def steps_in(values: torch.Tensor) -> list[int]:
    """The steps whose sums (2**step) add up to `values`, all of whose elements are equal."""
    assert bool((values == values[0]).all()), values
    total = int(values[0].item())
    return [t for t in range(total.bit_length()) if total >> t & 1]


def test_a_flight_is_finished_and_applied_only_when_due():
    pipeline, wire = Pipeline(), Exchanges()
    buf = torch.zeros(11)
    for step in range(2):  # staleness 2: steps 0 and 1 apply nothing
        pipeline.add(step, INITIAL, wire.start(step, 0, summed(step)))
        pipeline.apply_due(step - 2, INITIAL, buf, wire.finish)
        assert torch.equal(buf, torch.zeros(11))
    assert wire.finished == [], "an exchange is not waited for before it is due"
    pipeline.add(2, INITIAL, wire.start(2, 0, summed(2)))
    pipeline.apply_due(0, INITIAL, buf, wire.finish)
    assert torch.equal(buf, summed(0))
    assert wire.finished == [(0, 0)]
    assert [f.step for f in pipeline.flights] == [1, 2] and bool(pipeline)


def test_apply_due_matches_by_parameter_across_ddps_rebuild():
    """Step 0's exchange was started in DDP's first layout; at step 1 (staleness 1) DDP hands
    over its rebuilt buckets, in another order: each parameter gets its own values, and the
    exchange is finished once, for the first bucket that needs it."""
    pipeline, wire = Pipeline(), Exchanges()
    values = torch.arange(
        11, dtype=torch.float32
    )  # parameter 2 at [0, 4), 1 at [4, 8), 0 at [8, 11)
    pipeline.add(0, INITIAL, wire.start(0, 0, values))
    buf1 = torch.zeros(4)
    pipeline.apply_due(0, REBUILT[1], buf1, wire.finish)
    assert torch.equal(buf1, values[0:4])
    assert len(pipeline.flights) == 1 and pipeline.flights[0].applied == {2}
    buf0 = torch.zeros(7)
    pipeline.apply_due(0, REBUILT[0], buf0, wire.finish)
    assert torch.equal(buf0, torch.cat([values[8:11], values[4:8]]))
    assert not pipeline, "every parameter of the flight was applied: it is gone"
    assert wire.finished == [(0, 0)]


def test_apply_due_casts_into_the_buckets_dtype():
    pipeline, wire = Pipeline(), Exchanges()
    pipeline.add(0, INITIAL, wire.start(0, 0, torch.full((11,), 1.0 / 3)))
    buf = torch.zeros(11, dtype=torch.bfloat16)
    pipeline.apply_due(0, INITIAL, buf, wire.finish)
    assert torch.equal(buf, torch.full((11,), 1.0 / 3).bfloat16())


STALENESS = [2, 2, 2, 2, 0, 0, 3, 3, 3, 3, 1, 1]
"""Staleness by step: down from 2 to 0 at step 4, up to 3 at step 6, down to 1 at step 10."""
APPLIED = [[], [], [0], [1], [2, 3, 4], [5], [], [], [], [6], [7, 8, 9], [10]]
"""The steps whose gradients each step applies: a smaller s applies several at once, a larger
one leaves steps with nothing; every step's exactly once."""


def test_a_change_of_staleness_applies_each_gradient_exactly_once():
    pipeline, wire = Pipeline(), Exchanges()
    applied = []
    for step, s in enumerate(STALENESS):
        pipeline.add(step, INITIAL, wire.start(step, 0, summed(step)))
        buf = torch.zeros(11)
        pipeline.apply_due(step - s, INITIAL, buf, wire.finish)
        applied.append(steps_in(buf))
    assert applied == APPLIED
    assert [f.step for f in pipeline.flights] == [11]
    assert sorted(wire.finished) == [(t, 0) for t in range(11)], "each exchange finished once"


def test_finish_all_state_dict_and_load_state_dict_continue_exactly():
    """A save in the middle of a rebuild: step 0's flight half applied, step 1's not due. The
    restored pipeline applies what the original would, and finishes nothing again."""
    pipeline, wire = Pipeline(), Exchanges()
    pipeline.add(0, INITIAL, wire.start(0, 0, torch.arange(11, dtype=torch.float32)))
    pipeline.add(1, INITIAL, wire.start(1, 0, summed(1)))
    pipeline.apply_due(0, REBUILT[1], torch.zeros(4), wire.finish)
    with pytest.raises(RuntimeError, match=r"finish_all\(\) before state_dict\(\)"):
        pipeline.state_dict()
    pipeline.finish_all(wire.finish)
    assert wire.finished == [(0, 0), (1, 0)], "in the order they were started"
    saved = io.BytesIO()
    torch.save(pipeline.state_dict(), saved)  # as in a checkpoint
    restored = Pipeline()
    restored.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=False), "cpu")
    assert [(f.step, f.layout, f.applied, f.exchange) for f in restored.flights] == [
        (0, INITIAL, {2}, None),
        (1, INITIAL, frozenset(), None),
    ]
    for upto, index in [(0, 0), (1, 1), (1, 0)]:
        bufs = [torch.zeros(layout_numel(REBUILT[index])) for _ in range(2)]
        for p, buf in zip((pipeline, restored), bufs, strict=True):
            p.apply_due(upto, REBUILT[index], buf, wire.finish)
        assert torch.equal(bufs[0], bufs[1]), (upto, index)
    assert not pipeline and not restored
    assert len(wire.finished) == 2, "values saved are not finished again"


# -- CloudDDP on ranks -----------------------------------------------------------------------------


def _pipelined(rank, world, config, staleness, steps, regions):
    import cloudtrain

    cloudtrain.init()
    model = make_model()
    cloud = cloudtrain.CloudDDP(
        model, CompressionConfig.resolve(config, regions=regions, staleness=staleness)
    )
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss_of(cloud, x, y).backward()
        opt.step()
    return params_of(model), cloud.stats().steps


def _replay(world: int, staleness: int, steps: int) -> list[torch.Tensor]:
    """Pipe-SGD by hand: the mean gradient of step t - s (computed at that step's parameters)
    is applied at step t; nothing for t < s."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    queue: list[list[torch.Tensor]] = []
    for step in range(steps):
        grads = []
        for rank in range(world):
            model.zero_grad()
            x, y = batch(rank, step)
            loss_of(model, x, y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        queue.append([sum(g[i] for g in grads) / world for i in range(len(grads[0]))])
        opt.zero_grad()
        if step >= staleness:
            for p, g in zip(model.parameters(), queue[step - staleness], strict=True):
                p.grad = g
        else:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        opt.step()
    return params_of(model)


@pytest.mark.parametrize("staleness", [1, 3])
def test_lossless_pipeline_equals_the_pipe_sgd_replay(staleness):
    results = run_ranks(4, _pipelined, "none", staleness, 12, "a,a,b,b")
    assert_identical([params for params, _ in results])
    expected = _replay(4, staleness, 12)
    for got, want in zip(results[0][0], expected, strict=True):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
    # and it is not the synchronous result: the delay is real
    sync = _replay(4, 0, 12)
    assert not all(torch.allclose(a, b, atol=1e-4) for a, b in zip(expected, sync, strict=True))


@pytest.mark.parametrize("staleness", [1, 2, 3])
def test_lossy_pipeline_keeps_replicas_identical(staleness):
    results = run_ranks(4, _pipelined, "topk-10pct", staleness, 50, "a,a,b,b")
    assert_identical([params for params, _ in results])
    assert all(steps == 50 for _, steps in results)


def test_resume_in_the_middle_of_the_pipeline_is_bit_identical(tmp_path):
    config = CompressionConfig.resolve("topk-10pct", regions="a,a,b,b", staleness=2)
    several = {"bucket_cap_mb": 0.001}  # several buckets
    straight = run_ranks(4, train_span, config, 0, 16, None, several)
    run_ranks(4, train_span, config, 0, 9, str(tmp_path), several, True)
    resumed = run_ranks(4, train_span, config, 9, 16, str(tmp_path), several, True)
    straight, resumed = [p for p, _ in straight], [p for p, _ in resumed]
    assert_identical(straight)
    for a, b in zip(straight, resumed, strict=True):
        for pa, pb in zip(a, b, strict=True):
            assert torch.equal(pa, pb), "a resumed pipeline must continue exactly"


def test_staleness_is_checked():
    with pytest.raises(ValueError, match="staleness=-1"):
        CompressionConfig(staleness=-1)
    with pytest.raises(ValueError, match="staleness=True"):
        CompressionConfig(staleness=True)
    with pytest.raises(ValueError, match="staleness=99"):
        CompressionConfig(staleness=99)
