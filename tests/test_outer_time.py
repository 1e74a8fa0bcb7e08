"""OuterConfig(work="time") (cloudtrain.rounds) on real processes over gloo: equal-speed regions
run the same rounds as work="steps" and give its outer copy bit for bit; a slower region runs
fewer inner steps per round while the outer copy stays bit-identical on every rank and training
ends on `samples_done`; with weighting="samples" the pseudo-gradients are weighted by samples;
"auto" chooses H from the slowest region; a resume in the middle of a round equals the straight
run; bad input is refused. Each step is paced to take a time in
proportion to its batch, its compute included, so the measured step times (and so each region's
H_r) stay far from a rounding boundary on a busy machine."""

from __future__ import annotations

import dataclasses
import io
import time
import zlib

import pytest
import torch
from distributed import run_ranks
from models import batch, make_model

from cloudtrain import CompressionConfig
from cloudtrain.config import OuterConfig
from cloudtrain.rounds import Rounds, region_totals, round_steps, sample_weights

HIDDEN = 32
STREAMING = OuterConfig(
    sync_every=4, fragments=2, overlap=1, codec="quant", level=8, outer_lr=0.7, outer_momentum=0.9
)
"""Two fragments, each merged a step late: H_r = 4 in the slowest region, 6 in one 1.5x faster
(a median of 4 or more step times: one slow step - a checkpoint's - does not move it)."""

FAST, SLOW = 0.0075, 0.01125
"""Seconds a sample: steps of 8 samples paced to 60 and 90 ms, so the faster region's H_r is
4 x 1.5 = 6, with a margin of 1/12 either way (the first round's second step has DDP's bucket
rebuild, a collective of all ranks that makes a fast region wait for the slow one once)."""


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().data)


def build(outer: OuterConfig, regions: str):
    import cloudtrain

    model = make_model(HIDDEN)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = CompressionConfig(regions=regions, outer=outer, timeout_s=30)
    return model, opt, cloudtrain.CloudDDP(model, config, optimizer=opt)


def train_until(ddp, opt, rank, step, total, per_sample_s, stop=None):
    """The user's loop of a work="time" run from `step`: until the run has trained on `total`
    samples (or `stop(rounds, loop)` before a step), each step taking `per_sample_s` a sample.
    Returns the outer copy's checksums and the region's H_r at every round boundary passed, and
    the next step."""
    loop = ddp.outer
    rounds = []
    while ddp.samples_done < total and not (stop and stop(rounds, loop)):
        x, y = batch(rank, step)
        due = time.perf_counter() + per_sample_s * len(x)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        time.sleep(max(0.0, due - time.perf_counter()))  # the region's GPUs take this long
        start = loop.rounds.start
        opt.step()
        step += 1
        if loop.rounds.start != start:  # a round ended at this step
            rounds.append((tuple(crc(g) for g in loop.global_), loop.round_length()))
    return rounds, step


# -- equal speed: the same as work="steps" ------------------------------------------------------


def _equal(rank, world, total):
    import cloudtrain

    cloudtrain.init()
    runs = {}
    for work in ("steps", "time"):
        weighting = "samples" if work == "time" else "equal"  # (equal samples: no scale)
        outer = dataclasses.replace(STREAMING, work=work, weighting=weighting)
        model, opt, ddp = build(outer, "a,a,b,b")
        rounds, steps = train_until(ddp, opt, rank, 0, total, FAST)
        weights = ddp.outer.rounds.weights
        ddp.finish_outer()
        runs[work] = rounds, steps, ddp.samples_done, weights, [crc(p) for p in model.parameters()]
    return runs


def test_equal_speed_regions_run_the_steps_rounds_bit_for_bit():
    total = 4 * 8 * 12  # 12 steps of 4 ranks x 8 samples: 3 rounds of H = 4
    results = run_ranks(4, _equal, total, timeout=300)
    for rank, runs in enumerate(results):
        steps, time_ = runs["steps"], runs["time"]
        assert [h for _, h in time_[0]] == [4] * 3, f"rank {rank}: H_r should stay H: {time_[0]}"
        assert time_[1] == steps[1] == 12 and time_[2] == steps[2] == total
        assert time_[3] is None, "equal samples: the plain mean, no weights"
        assert time_[0] == steps[0], f"rank {rank}: outer copies differ from work='steps'"
        assert time_[4] == steps[4], f"rank {rank}: parameters differ from work='steps'"
    assert all(r["time"][4] == results[0]["time"][4] for r in results), "replicas differ"


# -- one region slower ---------------------------------------------------------------------------


def _slower(rank, world, total, regions, slow_ranks):
    import cloudtrain

    cloudtrain.init()
    _, opt, ddp = build(dataclasses.replace(STREAMING, work="time", weighting="samples"), regions)
    per_sample = SLOW if rank in slow_ranks else FAST
    rounds, steps = train_until(ddp, opt, rank, 0, total, per_sample)
    weights = ddp.outer.rounds.weights
    ddp.finish_outer()
    ddp.verify_replicas()  # raises unless every rank holds the same parameters
    return rounds, steps, ddp.samples_done, weights, ddp.samples_seen


def test_a_slower_region_runs_fewer_steps_and_the_outer_copy_stays_identical():
    """With weighting="samples": the pseudo-gradients scaled, the outer copy still the same bits
    on every rank."""
    # region b 1.5x slower: after the first round (H = 4 everywhere, 4 x 4 x 8 samples) a runs 6
    # steps a round, b 4 (2 x 6 x 8 + 2 x 4 x 8 = 160 samples)
    total = 128 + 3 * 160
    results = run_ranks(4, _slower, total, "a,a,b,b", (2, 3), timeout=300)
    rounds = [[h for _, h in r[0]] for r in results]  # H_r of rounds 1, 2, ...
    assert rounds[0] == rounds[1] and rounds[2] == rounds[3] == [4] * len(rounds[0]), rounds
    assert all(h >= 5 for h in rounds[0]), f"region a should run 6 steps a round: {rounds}"
    for k in range(len(rounds[0])):  # the same outer copy after each round, whatever the count
        assert len({r[0][k][0] for r in results}) == 1, f"outer copies differ after round {k}"
    for rank, r in enumerate(results):  # every region stopped after the same round
        assert r[1] == 4 + sum(rounds[rank][:-1]), f"rank {rank}: {r[1]} inner steps"
    assert len({r[2] for r in results}) == 1 and results[0][2] >= total
    assert results[0][2] == sum(r[4] for r in results), "samples_done is not the ranks' samples"
    last = [16 * rounds[0][-2], 16 * 4]  # the last round's samples of a and b
    assert {r[3] for r in results} == {sample_weights(last)}, f"not weighted {last}"


# -- resume in the middle of a round -------------------------------------------------------------


def _resume(rank, world, total):
    import cloudtrain

    cloudtrain.init()
    outer = dataclasses.replace(STREAMING, work="time")
    per_sample = SLOW if rank == 1 else FAST
    model, opt, ddp = build(outer, "per-rank")

    def mid_round(rounds, loop):  # round 2, fragment 1 just sent (merged at the next step)
        position = loop.step - loop.rounds.start
        return len(rounds) == 2 and position == loop.offset(1, loop.round_length())

    _, at = train_until(ddp, opt, rank, 0, total, per_sample, stop=mid_round)
    in_flight, position = sorted(ddp.outer.flights), ddp.outer.step - ddp.outer.rounds.start
    buffer = io.BytesIO()  # as a checkpoint holds it: plain data
    torch.save((model.state_dict(), opt.state_dict(), ddp.comm_state_dict()), buffer)
    rounds, _ = train_until(ddp, opt, rank, at, total, per_sample)
    straight = rounds, [crc(p) for p in model.parameters()], ddp.samples_done

    model, opt, ddp = build(outer, "per-rank")
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    model.load_state_dict(state[0])
    opt.load_state_dict(state[1])
    ddp.load_comm_state_dict(state[2])
    rounds, _ = train_until(ddp, opt, rank, at, total, per_sample)
    resumed = rounds, [crc(p) for p in model.parameters()], ddp.samples_done
    return straight, resumed, in_flight, position


def test_resume_in_the_middle_of_a_round_equals_the_straight_run():
    """Saved in the third round, with fragment 1 in flight, in each region at its own step
    (rank 1 is 1.5x slower: step 2 of its 4 against step 3 of 6 - between the same two syncs
    everywhere, as a checkpoint must be); the resumed run's rounds and parameters are the
    straight run's, bit for bit."""
    total = 64 + 4 * 80  # round 0: 4 + 4 steps of 8 samples, then 6 + 4 a round
    results = run_ranks(2, _resume, total, timeout=300)
    for rank, (straight, resumed, in_flight, position) in enumerate(results):
        assert in_flight == [1] and position == (3 if rank == 0 else 2), (in_flight, position)
        assert [h for _, h in straight[0]] == ([6] * 3 if rank == 0 else [4] * 3), straight[0]
        assert resumed == straight, f"rank {rank}: the resumed run differs from the straight one"
    assert results[0][0][1] != results[1][0][1], "the regions should differ by their last step"


def _auto(rank, world):
    import cloudtrain

    cloudtrain.init()
    outer = OuterConfig(sync_every="auto", fragments=2, work="time")
    *_, ddp = build(outer, "per-rank")
    opt = ddp.outer.optimizer
    rounds, steps = train_until(ddp, opt, rank, 0, 2 * 8 * 5 * 3, FAST * (1 + rank))
    ddp.finish_outer()
    ddp.verify_replicas()
    return ddp.outer.schedule, [h for _, h in rounds], steps


def test_auto_schedule_chooses_h_from_the_slowest_region():
    """sync_every="auto": H from the slowest rank's step (a gather before rank 0 chooses), the
    same on every rank; then rounds as with a fixed H."""
    (s0, h0, n0), (s1, h1, n1) = run_ranks(2, _auto, timeout=120)
    assert s0 == s1 and s0.sync_every >= 5, (s0, s1)
    assert h1 == [s0.sync_every] * len(h1) and all(h >= s0.sync_every for h in h0), (h0, h1)
    assert n0 >= n1


def _short_h(rank, world, total):
    import cloudtrain

    cloudtrain.init()
    outer = OuterConfig(sync_every=3, work="time")  # the codecs "auto": chosen at DECIDE_AFTER
    *_, ddp = build(outer, "per-rank")
    opt = ddp.outer.optimizer
    rounds, steps = train_until(ddp, opt, rank, 0, total, FAST, lambda _, loop: loop.step >= 40)
    ddp.finish_outer()
    ddp.verify_replicas()
    return [h for _, h in rounds], steps, ddp.samples_done


def test_an_h_shorter_than_the_wait_for_the_codecs_still_syncs():
    """sync_every=3 with the codecs "auto", which are chosen after DECIDE_AFTER = 5 steps: the
    first round, whose end passed before that, ends there in every region (it never ended: no
    sync, samples_done stuck at 0, a user's `while samples_done < total` loop endless); then
    rounds of 3."""
    total = 2 * 8 * 12
    results = run_ranks(2, _short_h, total, timeout=120)
    for h, steps, done in results:
        assert done >= total and steps == 5 + 3 * 3, (h, steps, done)  # 80 + 3 x 48 samples
        assert h == [3] * 4, h


# -- the pieces, and bad input -------------------------------------------------------------------


def test_round_steps_fill_the_slowest_regions_time():
    assert round_steps(10, [0.1, 0.05, 0.031], 1, 0) == (10, 20, 32)
    assert round_steps(10, [1.0, 0.01], 4, 2) == (10, 1000)
    assert round_steps(2, [1.0, 3.0], 4, 0) == (6, 4)  # at least one sync step per fragment
    assert round_steps(2, [1.0, 3.0], 1, 3) == (6, 4)  # and more than the overlap
    assert round_steps(5, [0.2, 0.0], 1, 0) == (5, 5)  # no step timed: H


def test_sample_weights_give_the_sample_weighted_mean():
    assert sample_weights([64, 64]) is None  # the plain mean, untouched
    assert sample_weights([0, 0]) is None
    w = sample_weights([48, 32])
    assert w == (1.2, 0.8)
    deltas = [torch.full((3,), 1.0), torch.full((3,), 6.0)]
    mean = sum(d * wr for d, wr in zip(deltas, w, strict=True)) / 2
    assert torch.allclose(mean, (48 * deltas[0] + 32 * deltas[1]) / 80)


def test_region_totals_and_round_state():
    reports = [(0.01, 8), (0.03, 8), (0.02, 16)]  # by rank; ranks 0, 1 one region, 2 another
    assert region_totals(reports, [(0, 1), (2,)]) == ([0.03, 0.02], [16, 16])
    rounds = Rounds(7, (3, 2), (1.2, 0.8), samples_at_start=100, samples_done=500)
    # a resumed run's sample counter starts again from 0: the round's own samples carry over
    back = Rounds.from_state(rounds.state_dict(samples_now=124), samples_now=0)
    assert back == Rounds(7, (3, 2), (1.2, 0.8), samples_at_start=-24, samples_done=500)


def test_work_steps_keeps_every_fingerprint():
    """Pinned: the fingerprints of these configs on main before OuterConfig.work existed."""
    configs = [
        CompressionConfig(outer=OuterConfig()),
        CompressionConfig(outer=OuterConfig(host_copy=True)),
        CompressionConfig(outer=OuterConfig(sync_every=5, codec="quant", level=8)),
        CompressionConfig.resolve("diloco"),
        CompressionConfig.resolve("diloco-4bit"),
    ]
    assert [c.fingerprint() for c in configs] == [
        "a46e6b72a675027e",
        "12e422919658bfad",
        "75e9d1ef8d63b7ed",
        "15b37e550bc69cc8",
        "a900174aaf730196",
    ]
    assert (
        CompressionConfig(outer=OuterConfig(work="time")).fingerprint() != configs[0].fingerprint()
    )
    # the guard's default bound moved (0.02 -> 0.015): states saved with the default still load;
    # another bound is another config
    default = CompressionConfig(outer=OuterConfig())
    same = CompressionConfig(outer=OuterConfig(), controller={"quality_bound": 0.015})
    other = CompressionConfig(outer=OuterConfig(), controller={"quality_bound": 0.03})
    assert default.controller.quality_bound == 0.015
    assert same.fingerprint() == default.fingerprint() != other.fingerprint()


@pytest.mark.parametrize("work", ["fast", None, "Time", 1])
def test_bad_work_names_the_field_and_the_choices(work):
    with pytest.raises(ValueError, match=r"outer\.work=.*\['steps', 'time'\]"):
        OuterConfig(work=work)


@pytest.mark.parametrize("weighting", ["tokens", None])
def test_bad_weighting_names_the_field_and_the_choices(weighting):
    with pytest.raises(ValueError, match=r"outer\.weighting=.*\['equal', 'samples'\]"):
        OuterConfig(work="time", weighting=weighting)


def test_weighting_by_samples_needs_work_time():
    with pytest.raises(ValueError, match="weighting='samples' needs work='time'"):
        OuterConfig(weighting="samples")


def test_work_time_is_refused_with_elastic():
    outer = OuterConfig(sync_every=10, codec="quant", level=8, work="time")
    with pytest.raises(ValueError, match="work='time'.*not supported yet"):
        CompressionConfig(outer=outer, elastic=True, timeout_s=300)


def _old_state(rank, world):
    import cloudtrain

    cloudtrain.init()
    *_, ddp = build(dataclasses.replace(STREAMING, work="time"), "per-rank")
    state = ddp.outer.state_dict()
    state["format"] = 1
    del state["rounds"]
    try:
        ddp.outer.load_state_dict(state)
    except ValueError as e:
        return str(e)
    return None


def test_a_state_without_the_round_is_refused_by_work_time():
    for message in run_ranks(2, _old_state, timeout=120):
        assert message is not None and "work='steps'" in message


def test_work_time_is_refused_with_fully_shard():
    """At the fully_shard call, before any process group or FSDP unit is made."""
    import cloudtrain

    config = CompressionConfig(outer=dataclasses.replace(STREAMING, work="time"))
    with pytest.raises(ValueError, match="fully_shard is not supported yet"):
        cloudtrain.fully_shard(make_model(), config=config)
