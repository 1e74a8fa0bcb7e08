"""CloudDDP's lossy path in every DDP mode gives the gradients it should, not merely the same on
every replica: each step's gradients must be bit for bit those of a reference replay of the data
path (tests/replay.py) fed with each rank's local gradient from an unwrapped copy of the model.
Modes: bf16 and fp16 parameters, AMP (CPU autocast in bfloat16 with a GradScaler: this machine
has no GPU), no_sync accumulation, find_unused_parameters (a head one rank leaves out),
static_graph, several buckets (DDP's rebuild moves the residuals); on 2 ranks each its own region,
and on 4 ranks in two regions of two (sharded exchange). The lossless path in the same modes is
compared with plain DDP in test_ddp_equals_ddp.py. Also 50 steps of top-k, the cocktail and 4-bit
quantization on 2 and 4 ranks (regions of two, and interleaved), and the zstd stage, which must
change the bytes and not the bits.

And error feedback loses nothing: summed over the steps, the gradient applied plus every rank's
residual is, per parameter, the sum of the gradients - also for a head no rank uses after step 0
(find_unused_parameters: DDP does not write its slot back, the hook must take it back).

    .venv/bin/python -m pytest tests/test_ddp_equals_replay.py -x -q
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from models import Branchy, assert_identical, batch, loss_of, make_model, params_of
from replay import Replay, every_rank, flat_gradient

WORLD = 2
STEPS = 8
TIMEOUT_S = 90.0
CONFIG = "topk-1pct"
MODES = ("bf16", "fp16", "amp", "no_sync", "unused", "static_graph", "buckets")


def _model(mode: str) -> torch.nn.Module:
    if mode in ("unused", "static_graph"):
        return Branchy()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode, torch.float32)
    return make_model(dtype=dtype)


def _loss(model, mode: str, rank: int, step: int) -> torch.Tensor:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode, torch.float32)
    x, y = batch(rank, step, dtype)
    if mode == "unused":  # rank 1 leaves head_b out on odd steps, rank 0 never does
        return torch.nn.functional.cross_entropy(model(x, use_b=rank == 0 or step % 2 == 0), y)
    if mode == "static_graph":  # head_b is never used
        return torch.nn.functional.cross_entropy(model(x, use_b=False), y)
    if mode == "amp":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_of(model, x, y)
    return loss_of(model, x, y)


def _backward(model, mode: str, rank: int, step: int, scaler) -> None:
    loss = _loss(model, mode, rank, step)
    (scaler.scale(loss) if scaler is not None else loss).backward()


def _versus_replay(rank, world, mode, regions):
    """Train CloudDDP; alongside, an unwrapped copy on the same weights gives this rank's local
    gradient, and the replay turns every rank's into what the bucket must hold."""
    import cloudtrain
    from cloudtrain import CompressionConfig

    cfg = CompressionConfig.resolve(CONFIG, regions=regions, timeout_s=TIMEOUT_S)
    kwargs = {
        "unused": {"find_unused_parameters": True},
        "static_graph": {"static_graph": True},
        "buckets": {"bucket_cap_mb": 0.002},  # several after DDP's rebuild at step 1
    }.get(mode, {})
    model, shadow = _model(mode), _model(mode)
    cloud = cloudtrain.CloudDDP(model, cfg, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if mode == "amp" else None
    shadow_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if mode == "amp" else None
    replay = Replay(cfg, cloud.topology.members, world)
    params, shadow_params = list(model.parameters()), list(shadow.parameters())
    mismatches, untouched, buckets = [], 0, 0
    for step in range(STEPS):
        if mode == "no_sync":  # two micro-batches accumulate locally, the third syncs
            with cloud.no_sync():
                for micro in range(2):
                    _backward(cloud, mode, rank, 100 * step + micro, scaler)
                    _backward(shadow, mode, rank, 100 * step + micro, shadow_scaler)
        _backward(cloud, mode, rank, step, scaler)
        _backward(shadow, mode, rank, step, shadow_scaler)
        layouts = dict(cloud.comm.layouts.layouts)
        flats = {
            b: every_rank(flat_gradient(shadow_params, layout), world)
            for b, layout in sorted(layouts.items())
        }
        expected = replay.step(step, layouts, flats)
        buckets = max(buckets, len(layouts))
        for b, layout in layouts.items():
            for pi, offset, numel in layout:
                want = expected[b][offset : offset + numel].view_as(params[pi])
                got = params[pi].grad
                if got is None:  # unused on every rank: DDP leaves the gradient alone
                    assert all(f[offset : offset + numel].eq(0).all() for f in flats[b])
                    untouched += 1
                elif not torch.equal(got, want):
                    worst = (got.float() - want.float()).abs().max().item()
                    mismatches.append((step, pi, worst))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        shadow.zero_grad()
        with torch.no_grad():  # the shadow follows the replicas' weights
            for s, p in zip(shadow_params, params, strict=True):
                s.copy_(p)
    sent = cloud.stats().wan_bytes_sent
    params_now = [p.detach().clone() for p in params]
    return mismatches, untouched, cloud.comm.step, sent, params_now, buckets


def _every_mode(rank, world, modes, regions):
    """All modes, then the conservation run, in one spawn (importing torch's compiler stack,
    which DDP does, costs ~10 s a process on a loaded machine); a mode that raises gives its
    traceback instead."""
    import traceback

    import torch.distributed as dist

    import cloudtrain

    cloudtrain.init(timeout_s=TIMEOUT_S)
    results = {}
    for mode in modes:
        try:
            if mode.startswith("conservation"):
                results[mode] = _conservation(rank, world, regions, mode.endswith("bucket_view"))
            else:
                results[mode] = _versus_replay(rank, world, mode, regions)
        except Exception:
            results[mode] = traceback.format_exc()
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def replayed() -> list[dict]:
    """Every mode's results by rank: 2 ranks, each its own region."""
    modes = [*MODES, "conservation", "conservation_bucket_view"]
    return run_ranks(WORLD, _every_mode, modes, "per-rank", timeout=600)


@pytest.fixture(scope="module")
def replayed_in_two_regions_of_two() -> list[dict]:
    """4 ranks in regions of 2: the bucket is reduce-scattered in the region, each rank owns
    and exchanges half of it (the last half padded), and the halves are gathered back."""
    modes = [*MODES, "conservation"]
    return run_ranks(4, _every_mode, modes, ("us", "us", "eu", "eu"), timeout=600)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("regions", ["per-rank", "us,us,eu,eu"])
def test_lossy_gradients_equal_the_reference_replay(request, regions, mode):
    fixture = "replayed" if regions == "per-rank" else "replayed_in_two_regions_of_two"
    results = [by_mode[mode] for by_mode in request.getfixturevalue(fixture)]
    for rank, out in enumerate(results):
        assert isinstance(out, tuple), f"rank {rank} raised in mode {mode}:\n{out}"
    for rank, (mismatches, untouched, comm_steps, sent, _, buckets) in enumerate(results):
        assert mismatches == [], (
            f"rank {rank}: (step, parameter, max |diff|) where CloudDDP's gradient is not the "
            f"replay's: {mismatches[:6]}"
        )
        assert comm_steps == STEPS and sent > 0
        assert buckets > 1 if mode == "buckets" else buckets == 1
        if mode == "static_graph":
            assert untouched == 2 * STEPS, "head_b (weight, bias) is never used"
        else:
            assert untouched == 0
    assert_identical([out[4] for out in results])


# -- 50 steps on 2 and 4 ranks, and the zstd stage ------------------------------------------------

REFERENCE_STEPS = 50


def _versus_reference(rank, world, config, regions, steps, zstd=None):
    """Replay CloudDDP's math with the codec library alone (tests/replay.py) and compare every
    step's gradient, including DDP's bucket rebuild after the first step (residuals return to
    the gradients)."""
    import cloudtrain
    from cloudtrain import CompressionConfig

    cloudtrain.init()
    cfg = CompressionConfig.resolve(config, regions=regions, zstd=zstd)
    model = make_model()
    shadow = make_model()  # same weights, no DDP: this rank's local gradient
    cloud = cloudtrain.CloudDDP(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    replay = Replay(cfg, cloud.topology.members, world)
    params, shadow_params = list(model.parameters()), list(shadow.parameters())
    mismatches = []
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss_of(cloud, x, y).backward()
        shadow.zero_grad()
        loss_of(shadow, x, y).backward()
        layouts = dict(cloud.comm.layouts.layouts)
        flats = {
            b: every_rank(flat_gradient(shadow_params, lay), world) for b, lay in layouts.items()
        }
        expected = replay.step(step, layouts, flats)
        for b, lay in layouts.items():
            got = flat_gradient(params, lay)
            if not torch.equal(got, expected[b]):
                mismatches.append((step, (got - expected[b]).abs().max().item()))
        opt.step()
        with torch.no_grad():  # keep the shadow on the replicas' weights
            for s, p in zip(shadow_params, params, strict=True):
                s.copy_(p)
    cloud.verify_replicas()
    return mismatches, params_of(model), len(cloud.comm.layouts.layouts), cloud.stats()


@pytest.mark.parametrize(
    "world,config,regions",
    [
        (2, "topk-1pct", "per-rank"),
        (2, "cocktail", "per-rank"),
        (4, "quant4", ("us", "us", "eu", "eu")),
        (4, "topk-1pct", ("us", "eu", "us", "eu")),
    ],
)
def test_lossy_update_equals_the_reference_and_replicas_agree(world, config, regions):
    results = run_ranks(world, _versus_reference, config, regions, REFERENCE_STEPS, timeout=300)
    for mismatches, _, buckets, _ in results:
        assert buckets == 1
        assert mismatches == [], (
            f"steps where CloudDDP's gradient differs from the reference: {mismatches[:5]}"
        )
    assert_identical([r[1] for r in results])


def test_the_zstd_stage_changes_the_bytes_not_the_bits():
    """zstd=True: every packet zstd-compressed where that shrinks it, received into a buffer of
    its size without zstd and cut by its header - the same gradients as the reference replay
    (which knows nothing of zstd), in fewer bytes than without the stage."""
    regions = ("us", "us", "eu", "eu")
    plain = run_ranks(4, _versus_reference, "quant4", regions, REFERENCE_STEPS, False, timeout=300)
    zstd = run_ranks(4, _versus_reference, "quant4", regions, REFERENCE_STEPS, True, timeout=300)
    for mismatches, *_ in zstd:
        assert mismatches == [], f"zstd changed the gradients: {mismatches[:5]}"
    assert_identical([r[1] for r in plain + zstd])
    sent = [sum(r[3].wan_bytes_sent for r in run) for run in (plain, zstd)]
    print(f"bytes across regions: {sent[0]} without zstd, {sent[1]} with")
    assert 0 < sent[1] < 0.95 * sent[0], sent


# -- error feedback conserves the gradient --------------------------------------------------------

CONSERVATION_STEPS = 12


def _conservation(rank, world, regions, bucket_view):
    """Plain SGD, top-k 10 %, find_unused_parameters (and gradient_as_bucket_view, the bucket
    then being the gradients), head_b used at step 0 only (on every rank). Per parameter, in float64: the gradients applied over the steps, every rank's residual
    (held by the error feedback or waiting for its parameter), and the sum of every rank's local
    gradients / world."""
    import torch.distributed as dist

    import cloudtrain
    from cloudtrain import CompressionConfig

    cloudtrain.init(timeout_s=TIMEOUT_S)
    cfg = CompressionConfig.resolve("topk:0.1", regions=regions, timeout_s=TIMEOUT_S)
    model, shadow = Branchy(), Branchy()
    cloud = cloudtrain.CloudDDP(
        model, cfg, find_unused_parameters=True, gradient_as_bucket_view=bucket_view
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    params, shadow_params = list(model.parameters()), list(shadow.parameters())
    names = [name for name, _ in model.named_parameters()]
    applied = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    truth = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    for step in range(CONSERVATION_STEPS):
        x, y = batch(rank, step)
        for m in (cloud, shadow):
            torch.nn.functional.cross_entropy(m(x, use_b=step == 0), y).backward()
        for i, (p, s) in enumerate(zip(params, shadow_params, strict=True)):
            local = torch.zeros(p.numel()) if s.grad is None else s.grad.reshape(-1) / world
            dist.all_reduce(local)
            truth[i] += local.double()
            if p.grad is not None:
                applied[i] += p.grad.reshape(-1).double()
        opt.step()
        opt.zero_grad()
        shadow.zero_grad()
        with torch.no_grad():
            for s, p in zip(shadow_params, params, strict=True):
                s.copy_(p)
    held = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    layouts = cloud.comm.layouts
    for (index, shard), residual in cloud.comm.ef.residuals.items():
        m = residual.numel()
        for pi, offset, numel in layouts.layouts[index]:
            a, b = max(shard * m, offset), min((shard + 1) * m, offset + numel)
            if a < b:
                held[pi][a - offset : b - offset] += residual[
                    a - shard * m : b - shard * m
                ].double()
    for pi, pieces in layouts.pending.items():
        for start, piece in pieces:
            held[pi][start : start + piece.numel()] += piece.double()
    for h in held:
        dist.all_reduce(h)
    return names, applied, held, truth


def _lost(results: list[dict], run: str, heads: tuple[str, ...]) -> dict[str, str]:
    """Parameters of `heads` whose gradient is not all in the updates and the residuals."""
    out = results[0][run]
    assert isinstance(out, tuple), f"rank 0 raised:\n{out}"
    lost = {}
    for name, a, h, t in zip(*out, strict=True):
        if not name.startswith(heads):
            continue
        gap = (t - a - h).abs().max().item()
        if gap > 1e-6 * max(1.0, t.abs().max().item()):
            lost[name] = f"{(t - a - h).norm().item() / t.norm().item():.1%} of its gradient"
    return lost


CONSERVATION_RUNS = [
    ("replayed", "conservation"),
    ("replayed", "conservation_bucket_view"),
    ("replayed_in_two_regions_of_two", "conservation"),
]


@pytest.mark.parametrize("fixture,run", CONSERVATION_RUNS)
def test_error_feedback_loses_nothing_of_parameters_used_every_step(request, fixture, run):
    lost = _lost(request.getfixturevalue(fixture), run, ("body", "head_a"))
    assert not lost, f"error feedback lost gradient mass: {lost}"


@pytest.mark.parametrize("fixture,run", CONSERVATION_RUNS)
def test_error_feedback_loses_nothing_of_a_head_unused_after_step_0(request, fixture, run):
    lost = _lost(request.getfixturevalue(fixture), run, ("head_b",))
    assert not lost, f"error feedback lost gradient mass: {lost}"
