"""The outer loop (cloudtrain.outer) on real processes over gloo: the outer copy bit-identical
everywhere, the regions training apart between syncs, equal replicas after sync_all(), exact resume
with a fragment in flight, DDP's parameters at H = 1, fragments + overlap + compressed
pseudo-gradients with error feedback + Nesterov against a plain replay of the algorithm, the
schedule choice, and the errors for a missing or foreign optimizer (the outer options themselves
are checked in test_config.py)."""

from __future__ import annotations

import zlib

import pytest
import torch
from distributed import run_ranks
from models import batch, make_model

from cloudtrain import CompressionConfig
from cloudtrain.config import OuterConfig
from cloudtrain.costs import LinkEstimate
from cloudtrain.outer import OUTER_LADDER, SyncSetting, choose_schedule

HIDDEN = 32
"""The width of the outer loop's model (make_model(HIDDEN)): narrower than the per-step tests'."""


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().data)


def train_step(model, opt, rank: int, step: int) -> None:
    x, y = batch(rank, step)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


# -- replicas ------------------------------------------------------------------------------------


def _replicas(rank, world, outer, steps):
    import cloudtrain

    cloudtrain.init()
    model = make_model(HIDDEN)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = CompressionConfig(regions="a,a,b,b", outer=outer)
    ddp = cloudtrain.CloudDDP(model, config, optimizer=opt)
    loop = ddp.outer
    trace = []
    for step in range(steps):
        train_step(ddp, opt, rank, step)
        trace.append(
            (
                tuple(crc(g) for g in loop.global_),
                tuple(crc(loop.parts.local(f)) for f in range(loop.fragments)),
            )
        )
    ddp.finish_outer()
    final = [crc(p) for p in model.parameters()]
    return trace, final, ddp.stats().wan_bytes_sent


@pytest.mark.parametrize(
    "outer",
    [
        OuterConfig(sync_every=3, codec="quant", level=8, outer_lr=0.7, outer_momentum=0.9),
        OuterConfig(
            sync_every=4,
            fragments=2,
            overlap=1,
            codec="topk>quant",
            level=(0.1, 4),
            outer_lr=0.7,
            outer_momentum=0.9,
            dtype="bfloat16",
        ),
    ],
    ids=["diloco", "streaming"],
)
def test_outer_copy_bit_identical_and_replicas_equal_after_finish(outer):
    steps = 13
    results = run_ranks(4, _replicas, outer, steps, timeout=300)
    traces = [r[0] for r in results]
    h, frags = outer.sync_every, outer.fragments
    for step in range(steps):
        t = step + 1  # inner steps done
        globals_ = {tr[step][0] for tr in traces}
        assert len(globals_) == 1, f"outer copies differ across ranks after step {t}"
        for region in ((0, 1), (2, 3)):
            assert traces[region[0]][step][1] == traces[region[1]][step][1], (
                f"ranks {region} of one region differ after step {t}"
            )
        for f in range(frags):
            merged = (t - f * h // frags - outer.overlap) % h == 0 and t > outer.overlap
            locals_f = {tr[step][1][f] for tr in traces}
            if merged and outer.overlap == 0:
                assert len(locals_f) == 1, f"fragment {f} differs across regions after its sync"
            if not merged:
                assert len(locals_f) == 2, f"regions should train apart at step {t}, fragment {f}"
    assert traces[0][0][0] != traces[0][-1][0], "no outer step happened"
    finals = [r[1] for r in results]
    assert all(f == finals[0] for f in finals), "replicas differ after sync_all()"
    sent = [r[2] for r in results]
    assert all(s > 0 for s in sent), f"no pseudo-gradient crossed regions: {sent}"


def _amp_skips(rank, world, outer, steps, overflow):
    import cloudtrain

    cloudtrain.init()
    # a buffer: DDP broadcasts it from rank 0 at every forward, a collective of all ranks
    model = torch.nn.Sequential(make_model(HIDDEN), torch.nn.BatchNorm1d(5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = CompressionConfig(regions="a,a,b,b", nonfinite="pass", timeout_s=30, outer=outer)
    ddp = cloudtrain.CloudDDP(model, config, optimizer=opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    region = "ab"[rank // 2]
    skipped = 0
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        if overflow.get(step) == region:  # this region's gradients overflow: its step is skipped
            loss = loss * float("inf")
        before = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
        ddp.comm_state_dict()  # as a checkpoint would, every step
    ddp.finish_outer()
    loop = ddp.outer
    return [crc(p) for p in model.parameters()], [crc(g) for g in loop.global_], skipped, loop.step


@pytest.mark.parametrize("overlap", [0, 1])
def test_amp_skipped_steps_keep_the_regions_schedules_together(overlap):
    """GradScaler skips the optimizer step of a region whose gradients overflowed, and only that
    region's: the outer loop counts gradient syncs, so the skipping region still syncs with the
    others: region b skips a sync step of fragment 1 and catches up before anything else of all
    ranks (a checkpoint's state, DDP's buffer broadcast in the next forward); then both sync
    fragment 0 on the last step (counting optimizer steps, b would be one short and its
    exchanges one fewer than a's)."""
    steps = 12
    outer = OuterConfig(
        sync_every=4, fragments=2, overlap=overlap, outer_lr=0.7, outer_momentum=0.9
    )
    overflow = {5: "b"}
    results = run_ranks(4, _amp_skips, outer, steps, overflow, timeout=300)
    assert [r[2] for r in results] == [0, 0, 1, 1], "region b should have skipped one step"
    assert all(r[3] == steps for r in results), [r[3] for r in results]
    assert all(r[1] == results[0][1] for r in results), "outer copies differ across ranks"
    assert all(r[0] == results[0][0] for r in results), "replicas differ after sync_all()"


# -- resume --------------------------------------------------------------------------------------


def _resume(rank, world, outer, steps, save_at, folder, regions):
    import cloudtrain
    from cloudtrain.checkpoint import Checkpointer

    cloudtrain.init()
    config = CompressionConfig(regions=regions, outer=outer)

    def build():
        model = make_model(HIDDEN)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt, cloudtrain.CloudDDP(model, config, optimizer=opt)

    model, opt, ddp = build()
    saved = None
    for step in range(steps):
        train_step(ddp, opt, rank, step)
        if step + 1 == save_at:  # through a checkpoint, as a resume after a reclaim reads it
            in_flight = sorted(ddp.outer.flights)
            comm = ddp.comm_state_dict()
            Checkpointer(folder).save(step + 1, model=model, optimizer=opt, comm_state=comm)
    straight = [p.detach().clone() for p in model.parameters()]

    model, opt, ddp = build()
    loaded = Checkpointer(folder).load()  # weights_only=True: the outer state is plain data
    saved = (loaded["model"], loaded["optimizer"], loaded["comm_state"])
    without = {k: v for k, v in saved[2].items() if k != "outer"}
    try:
        ddp.load_comm_state_dict(without)
        refused = None
    except ValueError as e:
        refused = str(e)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    ddp.load_comm_state_dict(saved[2])
    for step in range(save_at, steps):
        train_step(ddp, opt, rank, step)
    resumed = [p.detach().clone() for p in model.parameters()]
    return in_flight, straight, resumed, refused


@pytest.mark.parametrize("regions", ["per-rank", "a,a,b,b", "a,a"])
def test_resume_with_a_fragment_in_flight_is_bit_identical(tmp_path, regions):
    """Through a real checkpoint (one folder, one copy of the model and optimizer: region 0's)
    and a fresh CloudDDP: each region gets its own parameters and inner optimizer state back."""
    outer = OuterConfig(
        sync_every=4,
        fragments=2,
        overlap=2,
        codec="quant",
        level=4,
        outer_lr=0.7,
        outer_momentum=0.9,
    )
    # fragment 1 syncs at steps 2, 6, 10 and merges 2 steps later: in flight after step 6
    world = len(regions.split(",")) if "," in regions else 2
    results = run_ranks(world, _resume, outer, 12, 6, str(tmp_path), regions, timeout=300)
    for in_flight, straight, resumed, refused in results:
        assert refused is not None and "no outer-loop state" in refused
        assert in_flight == [1]
        for a, b in zip(straight, resumed, strict=True):
            assert torch.equal(a, b), "the resumed run's parameters differ from the straight run's"
    if regions == "a,a":  # one region: every rank the same model all along
        return
    assert not all(torch.equal(a, b) for a, b in zip(results[0][1], results[-1][1], strict=True)), (
        "the two regions should differ by their last steps"
    )


# -- DDP at H = 1 --------------------------------------------------------------------------------


def _versus_ddp(rank, world, steps):
    import cloudtrain

    cloudtrain.init()
    plain_model = make_model(HIDDEN)
    plain = torch.nn.parallel.DistributedDataParallel(plain_model)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.1)
    model = make_model(HIDDEN)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = OuterConfig(sync_every=1, codec="none", error_feedback=False)
    ddp = cloudtrain.CloudDDP(
        model, CompressionConfig(regions="a,a,b,b", outer=outer), optimizer=opt
    )
    for step in range(steps):
        train_step(plain, plain_opt, rank, step)
        train_step(ddp, opt, rank, step)
    worst = max(
        (a - b).abs().max().item()
        for a, b in zip(plain_model.parameters(), model.parameters(), strict=True)
    )
    moved = max(
        (a - b).abs().max().item()
        for a, b in zip(make_model(HIDDEN).parameters(), model.parameters(), strict=True)
    )
    return worst, moved


def test_h1_plain_sgd_outer_averaging_gives_ddps_parameters():
    for worst, moved in run_ranks(4, _versus_ddp, 6, timeout=300):
        assert moved > 1e-2  # training moved the parameters: the comparison means something
        assert worst < 1e-6, f"outer loop at H=1 differs from DDP by {worst}"


# -- the outer step against a replay ----------------------------------------------------------

REPLAYED = OuterConfig(
    sync_every=4,
    fragments=2,
    overlap=1,
    codec="topk",  # deterministic (no rounding noise): the replay can send the same values
    level=0.1,
    outer_lr=0.7,
    outer_momentum=0.9,
)


def inner_optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _replayed(rank, world, steps):
    import cloudtrain

    cloudtrain.init()
    model = make_model(HIDDEN)
    opt = inner_optimizer(model.parameters())
    ddp = cloudtrain.CloudDDP(
        model, CompressionConfig(regions="a,a,b,b", outer=REPLAYED), optimizer=opt
    )
    for step in range(steps):
        train_step(ddp, opt, rank, step)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat, torch.cat(ddp.outer.global_)


def outer_replay(steps: int, regions=((0, 1), (2, 3))) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Streaming DiLoCo written out plainly, in one process: each region's model trains on the
    mean of its ranks' gradients with its own inner SGD; fragment f (of F, the parameters laid
    end to end and cut in F) is sent at the inner steps t with (t - f H/F) mod H = 0: its
    pseudo-gradient (outer copy - local), cut into one shard per rank of the region, top-k 10 %
    with error feedback per (region, shard); the regions' decoded shards summed in region order
    and divided by the number of regions; merged `overlap` steps later by Nesterov SGD on the
    outer copy, the local parameters becoming it plus what the region learnt since the send."""
    cfg = REPLAYED
    codec = CompressionConfig().make_codec("topk")
    models = [make_model(HIDDEN) for _ in regions]
    opts = [inner_optimizer(m.parameters()) for m in models]
    params = [list(m.parameters()) for m in models]

    def flat(r):
        return torch.cat([p.detach().reshape(-1) for p in params[r]]).clone()

    n = flat(0).numel()
    bounds = [f * n // cfg.fragments for f in range(cfg.fragments + 1)]
    outer = [flat(0)[bounds[f] : bounds[f + 1]].clone() for f in range(cfg.fragments)]
    momentum: list[torch.Tensor | None] = [None] * cfg.fragments
    shards = len(regions[0])
    residual: dict = {}
    flights: dict[int, tuple] = {}  # fragment -> (merge step, mean, each region's local at send)

    def write(r, f, values):
        full = flat(r)
        full[bounds[f] : bounds[f + 1]] = values
        at = 0
        with torch.no_grad():
            for p in params[r]:
                p.copy_(full[at : at + p.numel()].view_as(p))
                at += p.numel()

    for step in range(steps):
        for r, ranks in enumerate(regions):
            grads = []
            for rank in ranks:
                x, y = batch(rank, step)
                models[r].zero_grad()
                torch.nn.functional.cross_entropy(models[r](x), y).backward()
                grads.append([p.grad.clone() for p in params[r]])
            for i, p in enumerate(params[r]):  # the region's all-reduce of gradients / k
                p.grad = sum(g[i] * (1.0 / len(ranks)) for g in grads)
            opts[r].step()
        t = step + 1
        for f in sorted(flights):
            merge, mean, at_send = flights[f]
            if merge != t:
                continue
            del flights[f]
            buf = mean.clone() if momentum[f] is None else momentum[f] * cfg.outer_momentum + mean
            momentum[f] = buf
            outer[f] = outer[f] - cfg.outer_lr * (mean + cfg.outer_momentum * buf)
            for r in range(len(regions)):
                now = flat(r)[bounds[f] : bounds[f + 1]]
                write(r, f, outer[f] + (now - at_send[r]))
        for f in range(cfg.fragments):
            if (t - f * cfg.sync_every // cfg.fragments) % cfg.sync_every:
                continue
            size = bounds[f + 1] - bounds[f]
            m = -(-size // shards)
            summed = torch.zeros(shards * m)
            at_send = [flat(r)[bounds[f] : bounds[f + 1]] for r in range(len(regions))]
            for r in range(len(regions)):
                delta = torch.cat([outer[f] - at_send[r], torch.zeros(shards * m - size)])
                for s in range(shards):
                    acc = delta[s * m : (s + 1) * m] + residual.get((f, r, s), 0.0)
                    sent = codec.decode(codec.encode(acc, cfg.level))
                    residual[f, r, s] = acc - sent
                    summed[s * m : (s + 1) * m] += sent
            flights[f] = (t + cfg.overlap, summed[:size] / len(regions), at_send)
    return [flat(r) for r in range(len(regions))], torch.cat(outer)


def test_streaming_outer_steps_equal_a_replay_of_the_algorithm():
    """Fragments, overlap, top-k with error feedback on the pseudo-gradients and Nesterov
    momentum with lr 0.7: every rank's parameters and the outer copy equal the plain replay."""
    steps = 14  # fragment 0 sends at 4, 8, 12, fragment 1 at 2, 6, 10, 14; merges one later
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank computes its gradients
    try:
        local, outer = outer_replay(steps)
    finally:
        torch.set_num_threads(threads)
    results = run_ranks(4, _replayed, steps, timeout=300)
    start = torch.cat([p.detach().reshape(-1) for p in make_model(HIDDEN).parameters()])
    assert (
        outer - start
    ).abs().max() > 1e-2  # outer steps moved it: the comparison means something
    for rank, (flat, global_) in enumerate(results):
        assert torch.allclose(global_, outer, rtol=1e-5, atol=1e-6), (
            f"rank {rank}: outer copy differs by {(global_ - outer).abs().max()}"
        )
        expected = local[rank // 2]
        assert torch.allclose(flat, expected, rtol=1e-5, atol=1e-6), (
            f"rank {rank}: parameters differ by {(flat - expected).abs().max()}"
        )
    assert not torch.equal(results[0][0], results[2][0])  # the regions trained apart since


def _auto(rank, world, steps):
    import cloudtrain

    cloudtrain.init()
    model = make_model(HIDDEN)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = {"sync_every": "auto", "fragments": 2}
    ddp = cloudtrain.CloudDDP(
        model, CompressionConfig(regions="per-rank", outer=outer), optimizer=opt
    )
    for step in range(steps):
        train_step(ddp, opt, rank, step)
    ddp.finish_outer()
    return ddp.outer.schedule, [crc(p) for p in model.parameters()]


def test_auto_schedule_is_rank_0s_choice_on_every_rank():
    from cloudtrain.outer import SYNC_CHOICES

    (s0, p0), (s1, p1) = run_ranks(2, _auto, 7, timeout=300)
    assert s0 == s1 and s0.sync_every in SYNC_CHOICES and len(s0.rungs) == 2
    assert all(rung in OUTER_LADDER for rung in s0.rungs)
    assert p0 == p1


# -- choosing H and the codec --------------------------------------------------------------------


def nbytes(rung, m):
    return CompressionConfig().make_codec(rung[0]).nbytes(m, rung[1], torch.float32)


def test_schedule_fast_link_smallest_h_no_compression():
    s = choose_schedule(SyncSetting(1_000_000, [LinkEstimate(1e10, 1e-4)] * 2, 2, 0.1), nbytes)
    assert (s.sync_every, s.rungs, s.fits) == (5, (("none", None),) * 2, True)


def test_schedule_slow_link_compresses_per_region_and_fits_the_budget():
    links = [
        LinkEstimate(50e6 / 8, 0.18),
        LinkEstimate(1e9, 0.18),
    ]  # 50 Mbit/s out of region 0, fast out of 1
    s = choose_schedule(SyncSetting(1_400_000, links, 2, 0.05), nbytes)
    assert s.fits
    budget = 0.1 * 0.05 * s.sync_every
    assert s.exchange_s <= budget
    assert OUTER_LADDER.index(s.rungs[0]) > OUTER_LADDER.index(s.rungs[1])
    # one H smaller does not fit with any codec
    smaller = choose_schedule(
        SyncSetting(1_400_000, links, 2, 0.05),
        nbytes,
        sync_every=[h for h in (5, 10, 20, 50, 100, 200) if h < s.sync_every][-1],
    )
    assert not smaller.fits


def test_schedule_overlap_hides_exchange_in_tau_steps():
    links = [LinkEstimate(50e6 / 8, 0.18)] * 2
    s = choose_schedule(SyncSetting(1_400_000, links, 2, 0.05, fragments=4, overlap=5), nbytes)
    assert s.fits and s.exchange_s <= 5 * 0.05 and s.sync_every > 5
    never = choose_schedule(SyncSetting(1_400_000, links, 2, 0.05, overlap=1), nbytes)  # < 1 RTT
    assert not never.fits
    # the bytes take 6 of the 50 ms at top-k 10% + 4-bit; more compression would not be faster
    assert never.rungs[0] == ("topk>quant", (0.1, 4))
    assert never.exchange_s <= 0.18 + 0.05


def test_schedule_round_trip_bound_link_compresses_only_what_saves_time():
    links = [LinkEstimate(1e10, 0.5)] * 2  # fast, far: the RTT alone exceeds every budget
    s = choose_schedule(SyncSetting(1_000_000, links, 1, 0.01), nbytes, sync_every=10)
    assert not s.fits and s.rungs == (("none", None),) * 2


def test_schedule_bad_inputs():
    with pytest.raises(ValueError, match="step_s"):
        SyncSetting(10, [LinkEstimate(1e6, 0)], 1, 0.0)
    with pytest.raises(ValueError, match="positive"):
        SyncSetting(0, [LinkEstimate(1e6, 0)], 1, 0.1)
    with pytest.raises(ValueError, match="overlap=-1"):
        SyncSetting(10, [LinkEstimate(1e6, 0)], 1, 0.1, overlap=-1)


# -- errors --------------------------------------------------------------------------------------


def test_missing_optimizer_is_an_error_naming_the_fix():
    import cloudtrain

    with pytest.raises(ValueError, match="optimizer=opt"):
        cloudtrain.CloudDDP(make_model(HIDDEN), "diloco")


def _wrong_optimizer(rank, world):
    import cloudtrain

    cloudtrain.init()
    other = torch.optim.SGD(make_model(HIDDEN).parameters(), lr=0.1)
    try:
        cloudtrain.CloudDDP(make_model(HIDDEN), "diloco", optimizer=other)
    except ValueError as e:
        return str(e)
    return None


def test_optimizer_of_another_model_is_an_error():
    (message,) = run_ranks(1, _wrong_optimizer)
    assert message is not None and "does not hold" in message
