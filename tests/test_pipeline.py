"""The pipelined exchange (staleness s): step t applies the summed gradient of step t - s, the
same on every rank; checked against a single-process replay, bit-identical replicas, and a resume
in the middle of the pipeline."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from models import assert_identical, batch, loss_of, make_model, params_of, train_span

from cloudtrain import CompressionConfig

LR = 0.05


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
