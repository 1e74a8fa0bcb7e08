"""Batch shares by measured throughput (cloudtrain.shares): the plan of shares, their schedule,
ShareSampler, and CloudDDP with a global batch on real processes over gloo - shares follow a
rank made slower, are the same on every rank, weight the gradients to the exact mean over the
global batch (a replay), give today's results bit for bit where the ranks are equally fast, and
resume exactly."""

from __future__ import annotations

import time

import pytest
import torch
from distributed import run_ranks
from models import assert_identical, make_model, params_of

from cloudtrain import CompressionConfig
from cloudtrain.shares import (
    SHARE_LEAD,
    BatchShares,
    equal_shares,
    plan_shares,
    proportional,
)

# -- the plan ----------------------------------------------------------------------------------


def test_shares_follow_throughput_and_sum_to_the_global_batch():
    assert proportional(256, [1, 1, 2, 2]) == (43, 43, 85, 85)
    assert proportional(10, [1, 1000]) == (1, 9), "every rank keeps a sample"
    for weights in ([3.0, 1.0, 7.5], [1e-3, 1.0], [5.0] * 7):
        shares = proportional(97, weights)
        assert sum(shares) == 97 and min(shares) >= 1


def test_shares_change_only_where_the_step_gets_shorter_by_the_margin():
    equal = equal_shares(256, 4)
    assert equal == (64,) * 4
    noisy = [100.0, 96.0, 104.0, 99.0]  # measurement noise: no reason to move samples
    assert plan_shares(256, noisy, equal) == equal
    slow = [100.0, 100.0, 50.0, 50.0]  # region b half as fast: it gets half the samples
    assert plan_shares(256, slow, equal) == (85, 85, 43, 43)
    assert plan_shares(256, [100.0, None, 50.0, 50.0], equal) == equal, "not all measured yet"
    assert plan_shares(256, [], equal) == equal, "nothing measured yet"


def test_a_global_batch_smaller_than_the_ranks_is_refused():
    with pytest.raises(ValueError, match="global_batch=3 cannot give each of the 4 ranks"):
        BatchShares(3, 4)
    with pytest.raises(ValueError, match="global_batch"):
        CompressionConfig(global_batch=0)
    with pytest.raises(ValueError, match="planned by the per-step controller"):
        CompressionConfig.resolve("topk-1pct", global_batch=64)
    with pytest.raises(ValueError, match="outer loop"):
        CompressionConfig.resolve("diloco", global_batch=64)


def test_a_schedule_change_takes_effect_after_the_lead_and_weights_by_share():
    shares = BatchShares(12, 2)
    assert shares.weight(0, 0, 2) == 0.5 and shares.at(100) == (6, 6)
    assert shares.change(10, (8, 4))
    assert shares.at(10 + SHARE_LEAD - 1) == (6, 6) and shares.at(10 + SHARE_LEAD) == (8, 4)
    assert shares.weight(10 + SHARE_LEAD, 1, 2) == 4 / 12
    assert not shares.change(20, (8, 4)), "the shares in force are no change"
    with pytest.raises(ValueError, match="do not split 12 samples"):
        shares.change(30, (8, 5))
    again = BatchShares(12, 2)
    again.load_state_dict(shares.state_dict())
    assert again.changes == shares.changes
    with pytest.raises(ValueError, match="resume with the same global_batch"):
        BatchShares(16, 2).load_state_dict(shares.state_dict())
    shares.drawn_through = 40 + SHARE_LEAD
    with pytest.raises(RuntimeError, match="at most 7 steps ahead"):
        shares.change(40, (4, 8))


# -- on real processes -----------------------------------------------------------------------


class Slowed(torch.nn.Module):
    """The test model, whose forward takes `ms_per_sample` of sleep per sample more: a slower
    GPU whose time scales with the batch (sleeping leaves the CPU to the other ranks)."""

    def __init__(self, ms_per_sample: float) -> None:
        super().__init__()
        self.net, self.ms = make_model(), ms_per_sample

    def forward(self, x):
        time.sleep(self.ms * len(x) / 1000)
        return self.net(x)


DATA = 4096
LOSSLESS = {"interval": 2, "ladder": (("none", None),)}
"""One rung, no compression: the plan never depends on timing, gradients are all-reduced."""


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(
        torch.randn(DATA, 20, generator=g), torch.randint(0, 5, (DATA,), generator=g)
    )


def _shared(
    rank, world, ms_per_sample, steps, global_batch, resume=None, save_at=None, regions="per-rank"
):
    """CloudDDP(auto, global_batch) over ShareSampler's batches: params, the schedule of shares,
    the batches' indices by step, and (with save_at) the states at that step. `regions`:
    "per-rank", or each rank's region, given as a cluster gives it (CLOUDTRAIN_REGION)."""
    import os

    import cloudtrain

    if regions != "per-rank":
        os.environ["CLOUDTRAIN_REGION"], regions = regions.split(",")[rank], "env"
    cloudtrain.init()
    cfg = CompressionConfig(regions=regions, controller=LOSSLESS, global_batch=global_batch)
    slowed = Slowed(ms_per_sample[rank])
    model = cloudtrain.CloudDDP(slowed, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dataset = data()
    sampler = cloudtrain.ShareSampler(dataset, model, seed=3)
    if resume is not None:
        model.module.load_state_dict(resume["model"][rank])
        opt.load_state_dict(resume["opt"][rank])
        model.load_comm_state_dict(resume["comm"][rank])
        sampler.load_state_dict(resume["sampler"][rank])
    drawn, saved, start = {}, None, model.steps_done
    for indices in sampler:
        step = model.steps_done
        if step == steps:
            break
        if step == save_at:
            saved = {
                "model": slowed.state_dict(),
                "opt": opt.state_dict(),
                "comm": model.comm_state_dict(),
                "sampler": sampler.state_dict(),
            }
        drawn[step] = indices
        x, y = dataset[indices]
        assert model.batch_size() == len(indices)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    model.verify_replicas()
    model.close()
    schedule = list(model.comm.shares.changes)
    throughput = model.stats().controller["throughput"]["by_rank"]
    assert model.steps_done == steps and start <= steps
    return params_of(slowed), schedule, drawn, saved, throughput


def test_shares_follow_a_slower_rank_and_are_the_same_on_every_rank():
    steps = 30
    results = run_ranks(2, _shared, [2.0, 6.0], steps, 64, timeout=240)
    assert_identical([r[0] for r in results])
    schedules = [r[1] for r in results]
    assert all(s == schedules[0] for s in schedules), "every rank holds the same shares"
    final = schedules[0][-1][1]
    assert final[0] + final[1] == 64
    assert final[0] >= 2 * final[1], f"rank 1 computes 3x slower; shares {schedules[0]}"
    rates = results[0][4]
    assert rates[0] > 2 * rates[1], f"measured samples/s by rank: {rates}"
    # the ranks' batches of a step are the step's global batch, without overlap
    for step in range(steps):
        mine = [set(r[2][step]) for r in results]
        assert not mine[0] & mine[1] and len(mine[0] | mine[1]) == 64


def _replay(schedule, drawn_by_rank, steps):
    """One process: at every step each rank's slice's mean-loss gradient, weighted by its share
    and summed in rank order - what the hook's weighted all-reduce computes."""
    torch.set_num_threads(1)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dataset, shares = data(), BatchShares(64, 2)
    shares.changes = [(s, tuple(b)) for s, b in schedule]
    exact_mean_checked = False
    for step in range(steps):
        grads = []
        for rank, drawn in enumerate(drawn_by_rank):
            x, y = dataset[drawn[step]]
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            w = shares.weight(step, rank, 2)
            grads.append([p.grad.clone().mul_(w) for p in model.parameters()])
        summed = [a + b for a, b in zip(*grads, strict=True)]
        if shares.at(step)[0] != shares.at(step)[1] and not exact_mean_checked:
            # the weighted sum is the gradient of the mean loss over the whole global batch
            x, y = dataset[drawn_by_rank[0][step] + drawn_by_rank[1][step]]
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            for s, p in zip(summed, model.parameters(), strict=True):
                torch.testing.assert_close(s, p.grad, rtol=1e-5, atol=1e-6)
            exact_mean_checked = True
        for p, g in zip(model.parameters(), summed, strict=True):
            p.grad = g
        opt.step()
    assert exact_mean_checked, "the shares never differed: nothing weighted to check"
    return params_of(model)


def test_weighted_gradients_are_the_mean_over_the_global_batch_bit_for_bit():
    steps = 26
    results = run_ranks(2, _shared, [1.0, 4.0], steps, 64, timeout=240)
    schedule = results[0][1]
    replayed = _replay(schedule, [r[2] for r in results], steps)
    assert_identical([results[0][0], replayed])


def _equal(rank, world, shared, steps):
    """Equal ranks: with a global batch of 2 x 16 drawn by ShareSampler, or (shared False) each
    rank reading the same 16 samples by hand without one."""
    import cloudtrain

    cloudtrain.init()
    options = {"controller": LOSSLESS, "regions": "per-rank"}
    cfg = CompressionConfig(global_batch=32 if shared else None, **options)
    slowed = Slowed(3.0)
    model = cloudtrain.CloudDDP(slowed, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dataset = data()
    order = torch.randperm(DATA, generator=torch.Generator().manual_seed(3))
    batches = (
        iter(cloudtrain.ShareSampler(dataset, model, seed=3))
        if shared
        else (order[s * 32 + 16 * rank : s * 32 + 16 * (rank + 1)].tolist() for s in range(steps))
    )
    for _ in range(steps):
        x, y = dataset[next(batches)]
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    shares = None if model.comm.shares is None else model.comm.shares.changes
    return params_of(slowed), shares


def test_equal_ranks_give_todays_results_bit_for_bit():
    steps = 24
    shared = run_ranks(2, _equal, True, steps, timeout=240)
    plain = run_ranks(2, _equal, False, steps, timeout=240)
    assert shared[0][1] == [(0, (16, 16))], "equal ranks keep equal shares"
    assert_identical([shared[0][0], plain[0][0], shared[1][0], plain[1][0]])


def test_resume_keeps_the_shares_and_the_samplers_position(tmp_path):
    steps, save_at = 30, 20
    straight = run_ranks(2, _shared, [1.0, 4.0], steps, 64, None, save_at, timeout=240)
    saved = [r[3] for r in straight]
    state = {key: [s[key] for s in saved] for key in ("model", "opt", "comm", "sampler")}
    # the resumed run draws the same batches with the same shares up to where a decision made
    # after the resume could take effect (SHARE_LEAD steps after the next due step)
    stop = save_at + SHARE_LEAD
    resumed = run_ranks(2, _shared, [1.0, 4.0], stop, 64, state, timeout=240)
    for a, b in zip(straight, resumed, strict=True):
        for step in range(save_at, stop):
            assert _at(a[1], step) == _at(b[1], step), f"step {step}'s shares differ"
            assert a[2][step] == b[2][step], f"step {step}'s batch differs after the resume"
    assert len(set(_at(straight[0][1], save_at))) > 1, "shares never differed: nothing kept"


def _broken_off(rank, world):
    """Three steps trained, four batches drawn ahead and thrown away (a loader's prefetch, when
    a loop is broken out of for an evaluation), then a new loop over the sampler."""
    import cloudtrain

    cloudtrain.init()
    cfg = CompressionConfig(regions="per-rank", controller=LOSSLESS, global_batch=64)
    model = cloudtrain.CloudDDP(Slowed(0.0), cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dataset = data()
    sampler = cloudtrain.ShareSampler(dataset, model, seed=3)

    def train(indices):
        x, y = dataset[indices]
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    drawn, first = {}, iter(sampler)
    for _ in range(3):
        drawn[model.steps_done] = next(first)
        train(drawn[model.steps_done])
    thrown = [next(first) for _ in range(4)]
    state = sampler.state_dict()
    for indices in sampler:
        if model.steps_done == 8:
            break
        drawn[model.steps_done] = indices
        train(indices)
    model.close()
    return drawn, thrown, state


def test_a_new_loop_draws_again_what_the_loop_before_drew_and_threw_away():
    for drawn, thrown, state in run_ranks(2, _broken_off, timeout=120):
        assert state == {"epoch": 0, "position": 3}, state
        assert [drawn[step] for step in range(3, 7)] == thrown, "batches skipped"
        assert sorted(drawn) == list(range(8))


def _wrong_batch(rank, world):
    """A batch that is not the rank's share, refused at the forward; then the right one, and
    a share made of two micro-batches (no_sync, then the syncing forward)."""
    import cloudtrain

    cloudtrain.init()
    cfg = CompressionConfig(regions="per-rank", controller=LOSSLESS, global_batch=64)
    model = cloudtrain.CloudDDP(Slowed(0.0), cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = data()[:32]

    def step(n):
        torch.nn.functional.cross_entropy(model(x[:n]), y[:n]).backward()

    try:
        step(5)
        refused = None
    except ValueError as e:
        refused = str(e)
    step(32)
    opt.step()
    opt.zero_grad()
    with model.no_sync():
        step(16)
    step(16)
    opt.step()
    model.verify_replicas()
    sampler_errors = []
    for dataset, given, options in (
        (63, model, {}), (64, model.module, {}), (iter(range(64)), model, {}),
        (64, model, {"seed": "3"}),
    ):  # fmt: skip
        try:
            cloudtrain.ShareSampler(dataset, given, **options)
        except ValueError as e:
            sampler_errors.append(str(e))
    model.close()
    return refused, model.steps_done, sampler_errors


def test_a_batch_that_is_not_the_share_is_refused_and_the_model_trains_on():
    """Refused at the forward, before DDP's: the next step trains (refused inside the
    backward, it left DDP's reducer in a state its next step failed an internal assert on).
    A sampler over fewer samples than a global batch, or given the bare module, is refused."""
    for refused, steps, sampler_errors in run_ranks(2, _wrong_batch, timeout=120):
        assert refused is not None and "had 5 samples" in refused and "is 32" in refused, refused
        assert steps == 2
        small, bare, unsized, seed = sampler_errors
        assert "63 samples, fewer than one global batch (64)" in small, small
        assert "must be the cloudtrain.CloudDDP this sampler feeds" in bare, bare
        assert "range_iterator without a length" in unsized, unsized
        assert "seed='3' an int" in seed, seed


def test_resume_on_fewer_ranks_a_region_plans_the_shares_anew():
    """Saved by 2 regions x 2 ranks with shares in force and a decision on its way (it carries
    shares for 4 ranks), resumed by 2 regions x 1 rank, each rank loading what its rank saved:
    the shares start equal, are planned anew from what the 2 ranks measure, and the decision
    saved does not stop the run (it raised 'do not split' at the first step it was due)."""
    save_at = 20
    four = run_ranks(4, _shared, [1.0, 1.0, 4.0, 4.0], save_at + 1, 64, None, save_at, "a,a,b,b",
                     timeout=300)  # fmt: skip
    saved = [four[r][3] for r in (0, 1)]  # each rank loads what its rank saved
    pending = saved[0]["comm"]["controller"]["pending"]
    assert pending is not None and len(pending["shares"]) == 4, pending
    assert len(set(_at(four[0][1], save_at))) > 1, "shares never differed: nothing to carry"
    state = {key: [s[key] for s in saved] for key in ("model", "opt", "comm", "sampler")}
    steps = save_at + 3 * SHARE_LEAD
    two = run_ranks(2, _shared, [1.0, 4.0], steps, 64, state, None, "a,b", timeout=300)
    schedule = two[0][1]
    assert all(r[1] == schedule for r in two), "every rank holds the same shares"
    assert [len(r[2][save_at]) for r in two] == [32, 32], "the shares start equal again"
    final = schedule[-1][1]
    assert final[0] > final[1], f"rank 1 computes 4x slower: the shares {schedule}"
    assert_identical([r[0] for r in two])


def _at(changes, step):
    shares = BatchShares(64, 2)
    shares.changes = changes
    return shares.at(step)
