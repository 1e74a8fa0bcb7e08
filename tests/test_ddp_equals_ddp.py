"""CloudDDP under the contract PyTorch's own DDP tests hold DDP to (torch's distributed_test.py and
test_ddp_hooks.py): every scenario trains plain DDP and CloudDDP from the same weights on the same
data, on 2 real ranks over gloo, and every step's gradients (and buffers, and the GradScaler's
scale) must be exactly DDP's.

Each scenario runs CloudDDP three times in the same processes: at codec "none" in one region and
in two (the plain all-reduce), and at "topk:1.0" with each rank its own region - the compressed
data path (reduce in region, error feedback, packets on the wire, decode and sum) with nothing
dropped, so with 2 ranks (scaling by 1/2 is exact, and a sum of two numbers does not depend on
the order) it must give DDP's bits too. Lossy codecs are compared against a reference replay in
test_ddp_equals_replay.py. Also: a second comm hook, sparse gradients and join's
divide_by_initial_world_size=False are refused clearly; torch.compile of the wrapped model; and
codec "none" on 2 and 3 ranks over many small buckets, exactly DDP's (on 4 ranks in two regions
of two, whose sum is taken in another order: DDP's to rounding).

    .venv/bin/python -m pytest tests/test_ddp_equals_ddp.py -x -q
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from models import Branchy, batch, loss_of, make_model

WORLD = 2
STEPS = 4
TIMEOUT_S = 90.0
CONFIGS = {
    "one region, none": ("none", ("a", "a")),
    "two regions, none": ("none", "per-rank"),
    "two regions, topk:1.0": ("topk:1.0", "per-rank"),
}
"""CloudDDP configs every scenario runs: name -> (config, regions)."""


# -- models ---------------------------------------------------------------------------------------


class Tied(torch.nn.Module):
    """A language-model shape: the output projection shares the embedding's weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(10, 16)
        self.hidden = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 10, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(self.embed(tokens))))


class Normed(torch.nn.Module):
    """BatchNorm's running statistics are buffers DDP broadcasts from rank 0 at every forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(20, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.fc(x))))


class WithEmpty(torch.nn.Module):
    """Zero-element parameters between ordinary ones (a layer with no outputs, an empty bias)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(20, 16)
        self.nothing = torch.nn.Linear(16, 0)
        self.empty = torch.nn.Parameter(torch.zeros(0))
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        nothing = self.nothing(h).sum() + self.empty.sum()  # zero, but in the graph
        return self.head(h) + nothing


class Checkpointed(torch.nn.Module):
    """Activation checkpointing: the middle block's forward runs again inside backward."""

    def __init__(self, reentrant: bool):
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.fc = torch.nn.Linear(20, 32)
        self.block = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh())
        self.head = torch.nn.Linear(32, 5)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(h)


def _frozen() -> torch.nn.Module:
    model = make_model()
    for p in model[0].parameters():
        p.requires_grad_(False)
    return model


def _skewed(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """Rank-dependent weights and buffers: DDP must start every replica from rank 0's."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.add_(0.5 * rank)
    return model


# -- scenarios ------------------------------------------------------------------------------------

SCENARIOS = {
    # name: (model factory(rank), DDP keyword arguments)
    "parity": (lambda rank: make_model(), {"bucket_cap_mb": 0.002}),
    "no_sync": (lambda rank: make_model(), {}),
    "unused_on_one_rank": (lambda rank: Branchy(), {"find_unused_parameters": True}),
    "unused_everywhere": (lambda rank: Branchy(), {"find_unused_parameters": True}),
    "static_graph": (lambda rank: Branchy(), {"static_graph": True}),
    "tied": (lambda rank: Tied(), {}),
    "frozen": (lambda rank: _frozen(), {}),
    "buffers": (lambda rank: _skewed(Normed(), rank), {"broadcast_buffers": True}),
    "local_buffers": (lambda rank: _skewed(Normed(), rank), {"broadcast_buffers": False}),
    "bucket_view": (
        lambda rank: make_model(),
        {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.002},
    ),
    "small_buckets": (lambda rank: make_model(), {"bucket_cap_mb": 1e-6}),
    "huge_bucket": (lambda rank: make_model(), {"bucket_cap_mb": 1000}),
    "bf16": (lambda rank: make_model(dtype=torch.bfloat16), {"bucket_cap_mb": 0.002}),
    "fp16": (lambda rank: make_model(dtype=torch.float16), {"bucket_cap_mb": 0.002}),
    "amp": (lambda rank: make_model(), {}),
    "join": (lambda rank: make_model(), {}),
    "join_by_active_ranks": (lambda rank: make_model(), {}),
    "zero_element": (lambda rank: WithEmpty(), {}),
    "checkpointing": (lambda rank: Checkpointed(reentrant=False), {}),
    # torch's DDP tests: reentrant checkpointing needs static_graph
    "reentrant_checkpointing": (lambda rank: Checkpointed(reentrant=True), {"static_graph": True}),
}


def _step_loss(ddp, scenario: str, rank: int, step: int) -> torch.Tensor:
    if scenario == "tied":
        g = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, 10, (8,), generator=g)
        return torch.nn.functional.cross_entropy(ddp(tokens), (tokens + 1) % 10)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(scenario, torch.float32)
    x, y = batch(rank, step, dtype)
    if scenario == "amp" and step == 2 and rank == 1:
        x[0, 0] = float("inf")  # the scaler must skip this step on every rank, for both
    if scenario == "unused_on_one_rank":
        return torch.nn.functional.cross_entropy(ddp(x, use_b=rank == 0 or step % 2 == 0), y)
    if scenario == "unused_everywhere":
        return torch.nn.functional.cross_entropy(ddp(x, use_b=step % 2 == 0), y)
    if scenario == "static_graph":  # head_b is never used: static_graph learns it once
        return torch.nn.functional.cross_entropy(ddp(x, use_b=False), y)
    if scenario == "amp":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_of(ddp, x, y)
    return loss_of(ddp, x, y)


def _grads(ddp) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in ddp.parameters()]


def _train(ddp, scenario: str, rank: int) -> dict:
    """STEPS optimizer steps; what every step left in the gradients, and the end state."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scenario == "amp" else None
    grads, scales = [], []
    uneven = scenario.startswith("join")
    steps = STEPS if not uneven else (STEPS + 2 if rank == 0 else STEPS - 1)

    def one(step: int) -> None:
        if scenario == "no_sync":  # two micro-batches accumulate locally, the third syncs
            with ddp.no_sync():
                for micro in range(2):
                    _step_loss(ddp, scenario, rank, 100 * step + micro).backward()
        loss = _step_loss(ddp, scenario, rank, step)
        if scaler is not None:
            scaler.scale(loss).backward()
            grads.append(_grads(ddp))
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            loss.backward()
            grads.append(_grads(ddp))
            opt.step()
        opt.zero_grad()

    if uneven:  # rank 1 runs out of inputs first and shadows rank 0's steps
        with ddp.join(divide_by_initial_world_size=scenario == "join"):
            for step in range(steps):
                one(step)
    else:
        for step in range(steps):
            one(step)
    return {
        "grads": grads,
        "scales": scales,
        "params": [p.detach().clone() for p in ddp.parameters()],
        "buffers": [b.detach().clone() for b in ddp.buffers()],
    }


def _contract(rank, world, scenarios):
    """Every scenario on these ranks: one spawn for all (importing torch's compiler stack, which
    DDP does, takes ~10 s a process on a loaded machine). A scenario that raises gives its
    traceback in place of its results; the timeout keeps a desynchronised one from hanging."""
    import traceback

    import torch.distributed as dist

    import cloudtrain
    from cloudtrain import CompressionConfig

    cloudtrain.init(timeout_s=TIMEOUT_S)
    results = {}
    for scenario in scenarios:
        if scenario in CHECKS:
            try:
                results[scenario] = CHECKS[scenario](rank)
            except Exception:
                results[scenario] = traceback.format_exc()
            dist.barrier()
            continue
        factory, kwargs = SCENARIOS[scenario]
        try:
            plain = torch.nn.parallel.DistributedDataParallel(factory(rank), **kwargs)
            out = {"ddp": _train(plain, scenario, rank)}
            for name, (config, regions) in CONFIGS.items():
                cfg = CompressionConfig.resolve(
                    config,
                    regions=regions,
                    nonfinite="pass" if scenario == "amp" else "raise",
                    timeout_s=TIMEOUT_S,
                )
                cloud = cloudtrain.CloudDDP(factory(rank), cfg, **kwargs)
                out[name] = _train(cloud, scenario, rank)
                out[name]["buckets"] = cloud.stats().buckets
                out[name]["compressed_steps"] = cloud.stats().compressed_steps
                cloud.comm.close()
        except Exception:
            out = traceback.format_exc()
        results[scenario] = out
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def contract() -> list[dict]:
    """Every scenario's and check's results by rank (one run of all of them)."""
    return run_ranks(WORLD, _contract, [*SCENARIOS, *CHECKS], timeout=600)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bit-equal, NaN where NaN (an AMP overflow step's gradient is non-finite)."""
    if a is None or b is None:
        return a is None and b is None
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bool(((a == b) | (a.isnan() & b.isnan())).all())
    )


def _differences(ddp: dict, cloud: dict) -> list[str]:
    found = []
    if len(ddp["grads"]) != len(cloud["grads"]):
        found.append(f"{len(cloud['grads'])} steps, DDP ran {len(ddp['grads'])}")
    for step, (a, b) in enumerate(zip(ddp["grads"], cloud["grads"], strict=False)):
        for i, (ga, gb) in enumerate(zip(a, b, strict=True)):
            if not _same(ga, gb):
                worst = (
                    "None vs a tensor"
                    if ga is None or gb is None
                    else f"max |diff| {(ga.float() - gb.float()).abs().max().item():.3g}"
                )
                found.append(f"step {step} parameter {i}: gradient differs from DDP's ({worst})")
    for what in ("params", "buffers"):
        for i, (a, b) in enumerate(zip(ddp[what], cloud[what], strict=True)):
            if not _same(a, b):
                found.append(f"{what[:-1]} {i} differs from DDP's after training")
    if ddp["scales"] != cloud["scales"]:
        found.append(f"GradScaler scales {cloud['scales']} vs DDP's {ddp['scales']}")
    return found


def _check(contract: list[dict], scenario: str) -> list[dict]:
    """The scenario's results by rank, after asserting that they are DDP's."""
    results = [by_scenario[scenario] for by_scenario in contract]
    for rank, out in enumerate(results):
        assert isinstance(out, dict), f"rank {rank} raised in scenario {scenario}:\n{out}"
        for name in CONFIGS:
            found = _differences(out["ddp"], out[name])
            assert not found, f"rank {rank}, CloudDDP {name}: " + "; ".join(found[:6])
        compressed = out["two regions, topk:1.0"]["compressed_steps"]
        assert compressed > 0, "the two-region run must take the compressed path"
        assert out["one region, none"]["compressed_steps"] == 0
        assert out["two regions, none"]["compressed_steps"] == 0
    return results


@pytest.mark.parametrize(
    "scenario",
    [
        "parity",
        "no_sync",
        "unused_on_one_rank",
        "unused_everywhere",
        "static_graph",
        "tied",
        "frozen",
        "buffers",
        "bucket_view",
        "local_buffers",
        "bf16",
        "fp16",
        "zero_element",
        "checkpointing",
        "reentrant_checkpointing",
    ],
)
def test_gradients_are_exactly_ddps(contract, scenario):
    _check(contract, scenario)


def test_many_small_buckets_and_one_huge_bucket_are_exactly_ddps(contract):
    small = _check(contract, "small_buckets")
    huge = _check(contract, "huge_bucket")
    params = len(list(make_model().parameters()))
    for name in CONFIGS:
        assert small[0][name]["buckets"] == params, "one bucket per parameter"
        assert huge[0][name]["buckets"] == 1


def test_amp_with_grad_scaler_is_exactly_ddps(contract):
    """CPU autocast in bfloat16 (what this machine has: no GPU, so CUDA's float16 autocast is
    not run here), a GradScaler, and an overflow at step 2 on one rank that both must skip
    identically (nonfinite="pass")."""
    results = _check(contract, "amp")
    scales = results[0]["ddp"]["scales"]
    assert scales[2] < scales[1], f"the overflow step must lower the scale: {scales}"


def test_uneven_inputs_under_join_are_exactly_ddps(contract):
    results = _check(contract, "join")
    assert len(results[0]["ddp"]["grads"]) == STEPS + 2
    assert len(results[1]["ddp"]["grads"]) == STEPS - 1


def test_join_dividing_by_the_ranks_still_training_is_ddps_or_refused(contract):
    """join(divide_by_initial_world_size=False): DDP divides by the ranks still training. A comm
    hook is not told that number, so CloudDDP must either match DDP or refuse the flag."""
    outs = [by_scenario["join_by_active_ranks"] for by_scenario in contract]
    assert len({type(out) for out in outs}) == 1, "every rank must refuse, or none"
    for out in outs:
        if isinstance(out, str):
            assert "ValueError" in out and "divide_by_initial_world_size" in out, out
    if all(isinstance(out, dict) for out in outs):
        _check(contract, "join_by_active_ranks")


# -- a second comm hook ---------------------------------------------------------------------------


def _second_hook(rank):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import cloudtrain

    cloud = cloudtrain.CloudDDP(make_model(), "none")
    errors = []
    for register in (
        lambda: cloud.register_comm_hook(None, default_hooks.allreduce_hook),
        lambda: cloud._register_builtin_comm_hook(
            torch.distributed.BuiltinCommHookType.FP16_COMPRESS
        ),
    ):
        try:
            register()
            errors.append(None)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    # the model still trains with CloudDDP's own hook
    loss_of(cloud, *batch(rank, 0)).backward()
    return errors, cloud.stats().steps


def test_a_second_comm_hook_is_refused_clearly(contract):
    for rank, by_check in enumerate(contract):
        out = by_check["second_hook"]
        assert isinstance(out, tuple), f"rank {rank} raised:\n{out}"
        errors, steps = out
        assert steps == 1
        for error in errors:
            assert error is not None, "a second hook must be refused"
            assert "CloudDDP" in error and "its own communication hook" in error, error


class Sparse(torch.nn.Module):
    def __init__(self, sparse=True):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(10, 8, sparse=sparse)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, tokens):
        return self.head(self.embed(tokens))


def _sparse(rank):
    """DDP reduces sparse gradients; CloudDDP's buckets are dense tensors it compresses, so it
    must refuse a model that makes sparse gradients when it is made, naming the parameter -
    not fail inside backward(). (Nothing past the constructor runs: a rank that raised in the
    middle of a step would leave the other waiting.)"""
    import cloudtrain
    from cloudtrain import CompressionConfig

    config = CompressionConfig.resolve("none", regions=("a", "a"), timeout_s=TIMEOUT_S)
    errors = []
    for sparse in (True, rank == 1):  # on every rank; then on rank 1 only
        try:
            cloudtrain.CloudDDP(Sparse(sparse), config).close()
            errors.append(None)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    return errors


def test_sparse_gradients_are_refused_when_cloudddp_is_made(contract):
    """...on every rank, also where one rank's model alone makes them (the others raise it,
    naming that rank, where they waited in their next collective)."""
    for rank, by_check in enumerate(contract):
        for error in by_check["sparse"]:
            assert error is not None, f"rank {rank}: CloudDDP accepted a sparse embedding"
            assert error.startswith("ValueError") and "'embed.weight'" in error, error
            assert "sparse" in error
        assert ("on rank 1:" in by_check["sparse"][1]) == (rank != 1), by_check["sparse"][1]


# -- torch.compile --------------------------------------------------------------------------------


def _compiled(rank):
    import cloudtrain
    from cloudtrain import CompressionConfig

    torch._dynamo.config.optimize_ddp = True  # the default: graph split at bucket boundaries
    out = {}
    for name, make in (
        ("ddp", lambda: torch.nn.parallel.DistributedDataParallel(make_model())),
        (
            "cloud",
            lambda: cloudtrain.CloudDDP(
                make_model(),
                CompressionConfig.resolve("topk:1.0", regions="per-rank", timeout_s=TIMEOUT_S),
            ),
        ),
    ):
        ddp = make()
        compiled = torch.compile(ddp)
        out[name] = _train(compiled, "parity", rank)
        out[name]["scales"] = []
        if name == "cloud":
            out["compressed_steps"] = ddp.stats().compressed_steps
    return out


def test_torch_compile_of_the_wrapped_model_is_exactly_ddps(contract):
    """torch.compile with its default backend (inductor, C++ code generated and compiled here:
    ~30 s on these shared cores), Dynamo's DDPOptimizer splitting the graph at bucket
    boundaries; compiled DDP and compiled CloudDDP run the same kernels, so the same bits."""
    for rank, by_check in enumerate(contract):
        out = by_check["compile"]
        assert isinstance(out, dict), f"rank {rank} raised:\n{out}"
        found = _differences(out["ddp"], out["cloud"])
        assert not found, "; ".join(found[:6])
        assert out["compressed_steps"] == STEPS


CHECKS = {"second_hook": _second_hook, "sparse": _sparse, "compile": _compiled}
"""Checks that are no scenario compared with DDP, run in the same spawn as the scenarios."""


# -- 2, 3 and 4 ranks, several buckets, codec "none" ---------------------------------------------


def _versus_ddp(rank, world, config, regions, bucket_cap_mb):
    import cloudtrain
    from cloudtrain import CompressionConfig

    cloudtrain.init()
    plain = torch.nn.parallel.DistributedDataParallel(make_model(), bucket_cap_mb=bucket_cap_mb)
    cloud = cloudtrain.CloudDDP(
        make_model(),
        CompressionConfig.resolve(config, regions=regions),
        bucket_cap_mb=bucket_cap_mb,
    )
    exact, worst = True, 0.0
    for step in range(5):
        x, y = batch(rank, step)
        for m in (plain, cloud):
            m.zero_grad()
            loss_of(m, x, y).backward()
        for a, b in zip(plain.parameters(), cloud.parameters(), strict=True):
            exact &= torch.equal(a.grad, b.grad)
            worst = max(worst, (a.grad - b.grad).abs().max().item())
    return exact, worst, cloud.stats().buckets


@pytest.mark.parametrize(
    "world,regions",
    [(2, "env"), (3, "env"), (2, "per-rank")],
)
def test_codec_none_gives_exactly_ddps_gradients(world, regions):
    results = run_ranks(world, _versus_ddp, "none", regions, 0.002)
    for exact, worst, buckets in results:
        assert buckets > 1, "the test model must span several buckets"
        assert exact, f"gradients differ from DDP's by up to {worst}"


def test_codec_none_across_two_regions_of_two_matches_ddp_to_rounding():
    results = run_ranks(4, _versus_ddp, "none", ("a", "a", "b", "b"), 0.002)
    for _, worst, _ in results:
        assert worst < 1e-6
