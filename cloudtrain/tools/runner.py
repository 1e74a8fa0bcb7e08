"""One benchmark run: every rank of one method on one workload, launched on loopback or in the
emulated network, and its worker (`python -m cloudtrain.tools.bench --worker ...`).

    run = run_method("cloud-auto", args, wan, ["us", "us", "eu", "eu"], progress)

A method is plain DDP ("ddp", or "ddp-loopback" beside an emulated network), PyTorch's fp16 or
PowerSGD hook, no communication at all ("compute"), "cloud-<preset>": CloudDDP with any preset
(or codec spec) and `--overrides` (CompressionConfig fields as JSON); or, for a workload whose
model has `blocks` (the char transformers), "hsdp": torch's own FSDP2 HSDP (fully_shard per block
and at the root on the regions' 2-D mesh: a dense all-reduce across regions), or
"shard-<preset>": cloudtrain.fully_shard on the same units with that preset. The optimizer of a
sharded method is built after sharding, as FSDP2 wants, and every rank evaluates (a sharded
forward is a collective inside the region). Rank 0 prints a JSON line
per step and a last `RESULT {json}`; the driver reads them, and the bytes that crossed the
emulated links from their interface counters.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOOPBACK = ("compute", "ddp-loopback")
"""Methods run on loopback, beside the emulated network: the floor and the baseline."""
UNSHAPED_MBIT = 1e5
"""What "unshaped" puts on the region links: beyond anything two cores can send."""
SETTLED = "CLOUDTRAIN_BENCH_SETTLED"
"""Set for rank 0: it says SETTLED once every rank's collectives are done (the run's WAN bytes
end there, before any connection closes) and waits for a line on stdin before the ranks exit."""


def is_sharded(method: str) -> bool:
    """Whether `method` shards the model with FSDP2 (module docstring)."""
    return method == "hsdp" or method.startswith("shard-")


class Sharded:
    """A model sharded with FSDP2, in the shape the bench's loop and result read from a CloudDDP:
    called as the model, with `comm` (its ShardedComm; None for torch's own HSDP), `stats()`,
    `outer`, `finish_outer()` and `close()`."""

    def __init__(self, model: Any, comm: Any) -> None:
        self.model, self.comm = model, comm

    @property
    def outer(self) -> Any:
        return getattr(self.comm, "outer", None)  # the ShardedComm makes it at its set-up

    @property
    def units(self) -> int:
        """The FSDP units: each block and the root."""
        return len(self.model.blocks) + 1

    def __call__(self, x: Any) -> Any:
        return self.model(x)

    def stats(self) -> Any:
        return self.comm.stats()

    def finish_outer(self) -> None:
        if self.comm is not None:
            self.comm.finish_outer()

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()


def _shard(method: str, trainer: Any, overrides: dict | None) -> Sharded:
    """Shard the trainer's model per block and at the root (as torchtitan does) and build its
    optimizer anew on the shards."""
    import cloudtrain

    model = trainer.model
    if not hasattr(model, "blocks") or trainer.rebuild is None:
        raise SystemExit(
            f"cloudtrain bench: --method {method} shards a transformer's blocks; use a workload "
            "that has them (charlm, charlm-wide)"
        )
    if method == "hsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = cloudtrain.device_mesh()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        comm = None
    else:
        config = cloudtrain.CompressionConfig.resolve(
            method.removeprefix("shard-"), **(overrides or {})
        )
        for block in model.blocks:
            cloudtrain.fully_shard(block, config=config)
        cloudtrain.fully_shard(model, config=config)
        comm = cloudtrain.ShardedComm.of(model)
    trainer.optimizer = trainer.rebuild(model)
    return Sharded(model, comm)


def _wrap(method: str, model, world: int, opt=None, overrides: dict | None = None):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    import cloudtrain

    if method == "compute":
        return model
    if method in ("ddp", "ddp-loopback"):
        return DistributedDataParallel(model)
    if method == "fp16":
        ddp = DistributedDataParallel(model)
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp
    if method == "powersgd":
        # One bucket: PowerSGD's hook issues collectives from callbacks, which fails on gloo
        # with several buckets in flight ("Received data size doesn't match expected size").
        ddp = DistributedDataParallel(model, bucket_cap_mb=1024)
        state = powerSGD_hook.PowerSGDState(
            process_group=dist.group.WORLD, matrix_approximation_rank=2, start_powerSGD_iter=10
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return ddp
    config = cloudtrain.CompressionConfig.resolve(
        method.removeprefix("cloud-"), **(overrides or {})
    )
    return cloudtrain.CloudDDP(model, config, optimizer=opt)  # the outer loop hooks opt.step()


def accelerator(ms_per_sample: float, samples: int) -> None:
    """The bench's emulated accelerator (--sample-ms, and --slowdown K for --slow-region): after
    its forward a rank sleeps ms_per_sample per sample of its batch, as a GPU's forward and
    backward take time in proportion to the batch - K times as long in the slow region. Sleeping
    leaves the CPU to the other ranks, so that on a machine of few cores the ranks' speeds are
    set by the knob, not by who gets a core."""
    if ms_per_sample > 0:
        time.sleep(ms_per_sample * samples / 1000)


def _train(args: argparse.Namespace, ddp: Any, trainer: Any, rank: int, world: int) -> tuple:
    """The training loop of one rank: (step seconds, rank 0's quality curve, samples by step,
    the last loss, each step's end on the wall clock)."""
    opt = trainer.optimizer
    slow = os.environ.get("CLOUDTRAIN_REGION") == args.slow_region
    ms_per_sample = args.sample_ms * (args.slowdown if slow else 1.0)
    shares = getattr(getattr(ddp, "comm", None), "shares", None)  # with a global batch
    step_times, curve, samples, ends = [], [], [], []
    trained = 0.0
    # the outer loop working by time: regions run different numbers of inner steps, so every
    # rank trains until the run's samples (counted alike everywhere) reach --steps global batches
    outer = getattr(getattr(ddp, "outer", None), "outer", None)
    by_time = getattr(outer, "work", "steps") == "time"
    total = trainer.per_rank * world * args.steps
    step, done = 0, False
    while not done:
        share = None if shares is None else shares.at(ddp.steps_done)
        x, y = trainer.batch(rank, world, share)
        clock = min(ddp.samples_done * args.steps // total, args.steps - 1) if by_time else step
        trainer.set_lr(clock, args.steps)  # by samples with work="time"
        t0 = time.perf_counter()
        out = ddp(x)
        accelerator(ms_per_sample, len(x))
        loss = trainer.loss(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        samples.append(len(x))
        done = ddp.samples_done >= total if by_time else step + 1 == args.steps
        if done and hasattr(ddp, "finish_outer"):
            ddp.finish_outer()  # an outer loop's last sync: the replicas become one model
        took = time.perf_counter() - t0
        step_times.append(took)
        ends.append(time.time())
        trained += took
        evaluates = (step + 1) % args.eval_every == 0 or done
        if evaluates and rank != 0 and is_sharded(args.method):
            trainer.evaluate(trainer.model)  # a sharded forward needs the region's every rank
        if rank == 0:
            line = {"step": step + 1, "ms": 1000 * took}
            if evaluates:
                quality = trainer.evaluate(trainer.model)
                curve.append((trained, quality))
                line["acc"] = quality
            print(json.dumps(line), flush=True)
        step += 1
    return step_times, curve, samples, loss, ends


def _result(args: argparse.Namespace, ddp: Any, trainer: Any, step_times, curve, loss) -> dict:
    """Rank 0's RESULT: times, curve, and what CloudDDP counted and planned."""
    from .memory import peak_rss_bytes, rank_memory

    model = trainer.model
    result: dict[str, Any] = {
        "step_times": step_times,
        "curve": curve,
        "loss": loss.item(),
        "metric": trainer.metric,
        "numel": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "memory": {**rank_memory(model, trainer.optimizer, ddp), "peak_rss": peak_rss_bytes()},
        "per_rank": trainer.per_rank,
        "units": getattr(ddp, "units", None),
    }
    comm = getattr(ddp, "comm", None)
    if comm is not None:
        stats = ddp.stats()
        result["wan_bytes_reported"] = stats.wan_bytes_sent
        seconds = stats.seconds.items()
        result["comm_ms_per_step"] = {k: 1000 * v / len(step_times) for k, v in seconds}
        result["sends"] = [list(r) for r in comm.plan.senders]  # the plan the run ended on
        outer = getattr(ddp, "outer", None)
        if outer is not None and outer.schedule is not None:  # the outer loop's choice
            sched = outer.schedule
            codecs = ", ".join(f"{n}:{lv}" for n, lv in sched.rungs)
            result["plans"] = [(outer.step, [f"every {sched.sync_every} steps, {codecs}"])]
            result["outer_schedule"] = [
                sched.sync_every, [list(r) for r in sched.rungs],
                outer.outer.fragments, outer.outer.overlap,
            ]  # fmt: skip
            result["staleness"] = [outer.outer.overlap]
        elif comm.controller is not None:
            result["links"] = stats.controller["links"]
            result["plan_by_region"] = stats.controller["plan"]
            if args.true_link:  # the cost model's pick for the link as it is (estimates bench)
                true = {name: tuple(link) for name, link in json.loads(args.true_link).items()}
                try:
                    plan = comm.controller.plan_for_links(true, comm.shard_numels())
                    settled = comm.controller.plan_for_links(true, comm.shard_numels(), True)
                except ValueError as e:  # a flow that carried nothing: no link to plan for
                    print(f"cloudtrain bench: {e}", file=sys.stderr)
                    plan = settled = None
                result["true_link_plan"], result["true_link_settled"] = plan, settled
            history, ladder = comm.controller.history, comm.controller.options.ladder
            result["plans"] = [(h["step"], h["levels"]) for h in history]
            # the plans in force and the steps they took effect at (a decision gathered at one
            # due step takes effect at the next), from the start-up plan on, and their zstd
            # stage by region
            ctl = comm.controller
            first = [(0, [ladder[r] for r in ctl.first_rungs], list(ctl.first_zstd))]
            applied = [
                (h.get("applied", h["step"]), [ladder[r] for r in h["rungs"]], h.get("zstd", []))
                for h in history
            ]  # (a history resumed from before "applied" was recorded: its decision steps)
            result["plan_history"] = first + applied
            result["decisions"] = [h["text"] for h in history]
            result["staleness"] = sorted({h["staleness"] for h in history} | {comm.plan.staleness})
        else:
            result["plans"] = [(0, [f"{n}:{lv}" for n, lv in comm.plan.senders])]
            result["staleness"] = [comm.plan.staleness]
    return result


def worker(args: argparse.Namespace) -> int:
    """One rank: train, print JSON lines (progress, then the result) on rank 0."""
    import torch

    import cloudtrain
    from cloudtrain.tools.workloads import WORKLOADS

    torch.set_num_threads(1)
    if args.method == "compute":  # no process group: nothing but this rank's own work
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    else:
        cloudtrain.init()
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
    options = {"hidden": args.hidden} if args.workload == "bench-mlp" else {}
    options.update({k: v for k in ("lr", "momentum") if (v := getattr(args, k)) is not None})
    per_rank = args.batch // world if args.workload == "bench-mlp" else None
    trainer = WORKLOADS[args.workload].build(args.seed, per_rank, **options)
    model, opt = trainer.model, trainer.optimizer
    overrides = json.loads(args.overrides) if args.overrides else {}
    if "global_batch" in overrides and overrides["global_batch"] is None:  # the workload's own
        overrides["global_batch"] = trainer.per_rank * world
    wrapped_at = time.time()
    if is_sharded(args.method):
        ddp = _shard(args.method, trainer, overrides)
    else:
        ddp = _wrap(args.method, model, world, opt, overrides)
    step_times, curve, samples, loss, ends = _train(args, ddp, trainer, rank, world)
    if args.rank_report:  # every rank's own samples and seconds (the hetero-compute bench)
        with open(os.path.join(args.rank_report, f"rank{rank}.json"), "w") as f:
            json.dump({"samples": samples, "step_times": step_times, "ends": ends}, f)
    if rank == 0:
        result = _result(args, ddp, trainer, step_times, curve, loss)
        result["ready_s"] = ends[0] - wrapped_at  # from the wrapper's construction: a step done
        print("RESULT " + json.dumps(result), flush=True)
    if args.method != "compute":
        import torch.distributed as dist

        if isinstance(ddp, cloudtrain.CloudDDP | Sharded):
            ddp.close()  # its background collectives (a decision on its way) finish
        dist.barrier()  # every rank's last collective is done
        if rank == 0 and os.environ.get(SETTLED) == "1":
            print("SETTLED", flush=True)  # the driver reads the WAN counters now
            sys.stdin.readline()  # ... and says when it has
        dist.barrier()  # no rank closes a connection before then
        # Leave without tearing gloo down: now and then one rank of four was killed by SIGABRT
        # in process-group teardown at exit (plain DDP's PowerSGD run as well as CloudDDP's),
        # after its work was done. Nothing is left to flush but our own streams.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


# -- the driver -----------------------------------------------------------------------------------


@dataclass
class Run:
    method: str
    step_ms: float
    wan_bytes: int | None
    accuracy: float
    curve: list
    plans: list | None
    step_times: list
    comm_ms: dict | None = None
    decisions: list | None = None
    staleness: list | None = None
    metric: str = "accuracy"
    """What `accuracy` holds: "accuracy", or "loss" for a language model's workload."""
    numel: int = 0
    sends: list | None = None
    """CloudDDP's plan at the end: (codec, level) by region."""
    outer_schedule: list | None = None
    """The outer loop's [H, rungs by region, fragments, overlap]."""
    links: dict | None = None
    """The controller's link estimates at the end, by region (stats().controller["links"])."""
    plan_history: list | None = None
    """The controller's plans: (the step it took effect at, (codec, level) by region), from the
    start-up plan (step 0) on."""
    plan_by_region: dict | None = None
    """The controller's plan in force at the end, by region (stats().controller["plan"])."""
    true_link_plan: dict | None = None
    """With --true-link: the cost model's rung for each region's link as it is."""
    true_link_settled: dict | None = None
    """With --true-link: the rung decisions from the plan in force would settle on, each
    region's link as it is (hysteresis included)."""
    ready_s: float | None = None
    """Seconds from the wrapper's construction to the end of the first step."""
    memory: dict | None = None
    """Rank 0's memory: tensor bytes by category (tools.memory.rank_memory) and peak_rss."""
    per_rank: int = 0
    """Samples per rank and step."""
    units: int | None = None
    """A sharded method's FSDP units (each its own collectives)."""


def worker_argv(method: str, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable, "-m", "cloudtrain.tools.bench", "--worker", "--method", method,
        "--steps", str(args.steps), "--hidden", str(args.hidden), "--batch", str(args.batch),
        "--seed", str(args.seed), "--eval-every", str(args.eval_every),
        *(["--lr", str(args.lr)] if args.lr is not None else []),
        *(["--momentum", str(args.momentum)] if args.momentum is not None else []),
        "--workload", args.workload, *(["--overrides", args.overrides] if args.overrides else []),
        "--sample-ms", str(args.sample_ms), "--slowdown", str(args.slowdown),
        "--slow-region", args.slow_region,
        *(["--rank-report", args.rank_report] if args.rank_report else []),
        *(["--true-link", args.true_link] if args.true_link else []),
    ]  # fmt: skip


def save_report(report: dict[str, Any], out: str, name: str) -> Path:
    """Write a bench report as out/<name>.json (the folder made if need be) and note the path
    in the report itself, under "json"."""
    path = Path(out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    report["json"] = str(path)
    return path


_RUNS = itertools.count()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(
    method: str, args: argparse.Namespace, wan: Any, regions: list[str]
) -> list[subprocess.Popen]:
    world = len(regions)
    # in the emulated network a port of its own per run (a port just closed may still be held)
    port = str(_free_port() if wan is None else 29600 + next(_RUNS) % 400)
    procs = []
    for rank in range(world):
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
               "CLOUDTRAIN_REGION": regions[rank], "PYTHONWARNINGS": "ignore",
               # c10d warns on every connection that namespace addresses have no host name
               "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
               "PYTHONFAULTHANDLER": "1"}  # fmt: skip
        out = subprocess.PIPE if rank == 0 else subprocess.DEVNULL
        if rank == 0:
            env[SETTLED] = "1"
        pipes = {"stdout": out, "stdin": out, "text": True}
        if wan is None or method in LOOPBACK:
            full = {**os.environ, "MASTER_ADDR": "127.0.0.1", **env}
            procs.append(subprocess.Popen(worker_argv(method, args), env=full, **pipes))
        else:
            procs.append(wan.popen(rank, worker_argv(method, args), env=env, **pipes))
    return procs


def run_method(
    method: str,
    args: argparse.Namespace,
    wan: Any,
    regions: list[str],
    progress: Any,
    drop: Any = None,
) -> Run:
    procs = _launch(method, args, wan, regions)
    result, before, after = None, None, None
    for line in procs[0].stdout:
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
            continue
        if line.startswith("SETTLED"):  # every rank's collectives are done, no connection closed
            after = wan.counters() if wan is not None else None
            procs[0].stdin.write("read\n")
            procs[0].stdin.flush()
            continue
        try:
            info = json.loads(line)
        except json.JSONDecodeError:
            continue
        progress.update(1)
        if wan is not None and info.get("step") == args.warmup:
            before = wan.counters()  # steady state only: not the start-up broadcasts
        if drop is not None and info.get("step") == args.drop_at:
            drop()
    codes = [p.wait(timeout=600) for p in procs]
    if result is None or any(codes):
        raise SystemExit(
            f"cloudtrain bench: {method} failed (exit codes {codes}); run it alone to see why"
        )
    wan_bytes = None
    if wan is not None and method not in LOOPBACK and before is not None:
        after = after or wan.counters()  # (a worker that never said SETTLED: after its exit)
        wan_bytes = sum(after[r]["tx_bytes"] - before[r]["tx_bytes"] for r in after)
    times = result["step_times"][args.warmup :]
    return Run(
        method,
        1000 * statistics.median(times),
        wan_bytes,
        result["curve"][-1][1],
        result["curve"],
        result.get("plans"),
        result["step_times"],
        result.get("comm_ms_per_step"),
        result.get("decisions"),
        result.get("staleness"),
        result.get("metric", "accuracy"),
        result.get("numel", 0),
        result.get("sends"),
        result.get("outer_schedule"),
        result.get("links"),
        result.get("plan_history"),
        result.get("plan_by_region"),
        result.get("true_link_plan"),
        result.get("true_link_settled"),
        result.get("ready_s"),
        result.get("memory"),
        result.get("per_rank", 0),
        result.get("units"),
    )
