"""Regions lost, restarted and leaving, on the emulated WAN: an elastic run measured.

    sudo cloudtrain chaos                       # 3 regions x 2 ranks, 200 Mbit/s, 80 ms, kill+rejoin
    sudo cloudtrain chaos --scenario chaos --events 8 --steps 400
    sudo cloudtrain chaos --scenario baseline   # the same run, nobody killed: the quality to match

Every region is launched on its own (its own processes, its own torch.distributed world, as its
own torchrun would), in its namespaces of the emulated network (cloudtrain.tools.netem); a
Lighthouse (`cloudtrain lighthouse`) runs in a namespace of its own. Each region trains the
digits MLP with the outer loop (CompressionConfig(outer=..., elastic=...)) on its own draws of
the data. Scenarios:

- `kill`: at step --kill-at every process of the last region gets SIGKILL; --restart-after
  seconds later it is started again with the same command and rejoins;
- `chaos`: --events random kills and restarts of whole regions (never below --min-regions alive);
- `baseline`: nobody killed.

Reports (JSON with --json): the survivors' longest step around each kill and their normal sync,
the detection time (kill to the survivors' quorum without the region), the join time (restart to
the region's first committed sync), the bytes moved for recovery, test accuracy against the
baseline, and whether every present region ends with the same parameters.

The worker (`python -m cloudtrain.tools.chaos --worker`) is one rank of one region; local rank 0
prints one JSON line per step and a last `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

LIGHTHOUSE_PORT = 29510


# -- one rank ---------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    import cloudtrain
    from cloudtrain.config import OuterConfig
    from cloudtrain.elastic import RegionLeft
    from cloudtrain.tools.data import digits, digits_mlp

    torch.set_num_threads(1)
    cloudtrain.init()
    import torch.distributed as dist

    rank = dist.get_rank()
    region = os.environ["CLOUDTRAIN_REGION"]
    x_train, y_train, x_test, y_test = digits(args.seed)
    torch.manual_seed(args.seed)
    net = digits_mlp(args.hidden)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    outer = OuterConfig(sync_every=args.sync_every, codec=args.codec, level=args.level)
    elastic = {
        "min_regions": args.min_regions,
        "exchange_timeout_s": args.exchange_timeout,
        "quorum_timeout_s": args.quorum_timeout,
        "spot": args.spot,
        "spot_poll_s": args.spot_poll,
    }
    config = cloudtrain.CompressionConfig(
        codec="none", error_feedback=False, outer=outer, elastic=elastic, timeout_s=120
    )
    t_start = time.time()
    model = cloudtrain.CloudDDP(net, config, optimizer=opt)
    joined = time.time()
    per_rank = args.batch // dist.get_world_size()
    seed = zlib.crc32(region.encode()) + args.seed
    left = False
    while model.steps_done < args.steps:
        step = model.steps_done
        gen = torch.Generator().manual_seed(seed * 100_003 + step)
        idx = torch.randint(len(x_train), (args.batch,), generator=gen)
        mine = idx[rank * per_rank : (rank + 1) * per_rank]
        t0 = time.time()
        loss = F.cross_entropy(model(x_train[mine]), y_train[mine])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        try:
            opt.step()
        except RegionLeft:
            left = True
        if rank == 0:
            line = {"step": model.steps_done, "t": time.time(), "dt": time.time() - t0}
            line["regions"] = list(model.elastic.stats.regions)
            print(json.dumps(line), flush=True)
        if left:
            break
        if args.pace:
            time.sleep(args.pace)
    if not left:
        model.finish_outer()
    with torch.no_grad():
        accuracy = (net(x_test).argmax(1) == y_test).float().mean().item()
    digest = 0
    for p in net.parameters():
        digest = zlib.crc32(p.detach().contiguous().view(torch.uint8).numpy().data, digest)
    stats = model.stats()
    if rank == 0:
        result = {
            "region": region,
            "accuracy": accuracy,
            "digest": digest,
            "left": left,
            "steps": model.steps_done,
            "started": t_start,
            "joined": joined,
            "finished": time.time(),
            "elastic": stats.elastic,
            "wan_bytes_sent": stats.wan_bytes_sent,
        }
        print("RESULT " + json.dumps(result), flush=True)
    model.close()
    dist.destroy_process_group()
    return 0


# -- regions on the emulated WAN --------------------------------------------------------------


@dataclass
class RegionProcs:
    """One incarnation of a region: its processes and what its first rank printed."""

    name: str
    procs: list[subprocess.Popen]
    started: float
    lines: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] | None = None
    killed: float | None = None
    reader: threading.Thread | None = None

    def read(self) -> None:
        assert self.procs[0].stdout is not None
        for raw in self.procs[0].stdout:
            raw = raw.strip()
            if raw.startswith("RESULT "):
                self.result = json.loads(raw[7:])
            elif raw.startswith("{"):
                self.lines.append(json.loads(raw))

    @property
    def step(self) -> int:
        return self.lines[-1]["step"] if self.lines else 0

    def kill(self) -> None:
        self.killed = time.time()
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs)


class Cluster:
    """Regions of `ranks` ranks each on an Emulator whose last region ("lh", one rank) holds the
    Lighthouse. `start(region)` launches (or relaunches) every rank of a region."""

    def __init__(self, wan: Any, regions: Sequence[str], ranks: int, worker_args: list[str],
                 env: dict[str, str] | None = None, log_dir: str | None = None) -> None:  # fmt: skip
        self.wan, self.regions, self.ranks = wan, list(regions), ranks
        self.worker_args, self.env = worker_args, env or {}
        self.log_dir = log_dir
        self.ports = {r: 29600 + 10 * i for i, r in enumerate(self.regions)}
        self.current: dict[str, RegionProcs] = {}
        self.history: list[RegionProcs] = []
        lh = wan.ranks("lh")[0]
        self.lighthouse_url = f"http://{wan.address(lh)}:{LIGHTHOUSE_PORT}"
        self.lighthouse: subprocess.Popen | None = None

    def start_lighthouse(self, min_regions: int, heartbeat_s: float) -> None:
        lh = self.wan.ranks("lh")[0]
        argv = [
            sys.executable, "-m", "cloudtrain.tools.lighthouse",
            "--bind", f"0.0.0.0:{LIGHTHOUSE_PORT}", "--min-regions", str(min_regions),
            "--heartbeat-timeout-s", str(heartbeat_s),
        ]  # fmt: skip
        self.lighthouse = self.wan.popen(
            lh, argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        assert self.lighthouse.stdout is not None
        line = self.lighthouse.stdout.readline()
        if not line.startswith("lighthouse"):
            raise RuntimeError(f"the Lighthouse did not start: {line!r}")

    def start(self, region: str, extra_env: dict[str, str] | None = None) -> RegionProcs:
        ranks = self.wan.ranks(region)
        env = {
            **self.env,
            "WORLD_SIZE": str(len(ranks)),
            "MASTER_ADDR": self.wan.address(ranks[0]),
            "MASTER_PORT": str(self.ports[region]),
            "TORCHFT_LIGHTHOUSE": self.lighthouse_url,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **(extra_env or {}),
        }
        argv = [sys.executable, "-m", "cloudtrain.tools.chaos", "--worker", *self.worker_args]
        procs = []
        for local, rank in enumerate(ranks):
            log = subprocess.DEVNULL
            if self.log_dir:
                name = f"{region}-{len(self.history)}-r{local}.log"
                log = open(os.path.join(self.log_dir, name), "w")  # noqa: SIM115 - kept open by the child
            procs.append(
                self.wan.popen(
                    rank,
                    argv,
                    env={**env, "RANK": str(local)},
                    stdout=subprocess.PIPE if local == 0 else subprocess.DEVNULL,
                    stderr=log,
                    text=True,
                )  # fmt: skip
            )
        run = RegionProcs(region, procs, time.time())
        run.reader = threading.Thread(target=run.read, daemon=True)
        run.reader.start()
        self.current[region] = run
        self.history.append(run)
        return run

    def wait(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        for run in list(self.current.values()):
            for p in run.procs:
                left = max(1.0, deadline - time.time())
                try:
                    p.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    raise TimeoutError(
                        f"region {run.name} did not finish in {timeout_s} s"
                    ) from None
            if run.reader is not None:
                run.reader.join(10)

    def stop(self) -> None:
        for run in self.history:
            if run.alive():
                run.kill()
        if self.lighthouse is not None and self.lighthouse.poll() is None:
            self.lighthouse.kill()
            self.lighthouse.wait()


def worker_argv(args: argparse.Namespace) -> list[str]:
    return [
        "--steps", str(args.steps), "--sync-every", str(args.sync_every),
        "--codec", args.codec, "--level", str(args.level), "--min-regions", str(args.min_regions),
        "--hidden", str(args.hidden), "--batch", str(args.batch), "--lr", str(args.lr),
        "--seed", str(args.seed), "--exchange-timeout", str(args.exchange_timeout),
        "--quorum-timeout", str(args.quorum_timeout), "--pace", str(args.pace),
    ]  # fmt: skip


def survivors_around(cluster: Cluster, killed: RegionProcs, window_s: float = 30.0) -> dict:
    """The survivors' longest step from the kill until `window_s` later, their normal sync (the
    median of their sync steps before the kill) and the detection time (kill to the first step
    line that shows the region gone)."""
    out: dict[str, Any] = {}
    t = killed.killed or 0.0
    for run in cluster.history:
        if run is killed or run.name == killed.name:
            continue
        after = [ln for ln in run.lines if t <= ln["t"] <= t + window_s]
        before = [ln for ln in run.lines if ln["t"] < t]
        gone = next((ln for ln in run.lines if ln["t"] >= t and killed.name not in ln["regions"]),
                    None)  # fmt: skip
        syncs = sorted(
            ln["dt"] for ln in before if ln["dt"] > 3 * _median([x["dt"] for x in before])
        )
        out[run.name] = {
            "longest_step_s": max((ln["dt"] for ln in after), default=None),
            "normal_sync_s": _median(syncs) if syncs else None,
            "normal_step_s": _median([ln["dt"] for ln in before]),
            "detected_s": None if gone is None else gone["t"] - t,
        }
    return out


def _median(xs: Sequence[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def run_scenario(args: argparse.Namespace) -> dict[str, Any]:
    from cloudtrain.tools.netem import Emulator, teardown

    names = [f"r{i}" for i in range(args.regions)]
    layout = {**dict.fromkeys(names, args.ranks), "lh": 1}
    name = f"ch{os.getpid() % 10000}-{uuid.uuid4().hex[:3]}"
    report: dict[str, Any] = {"scenario": args.scenario, "regions": names, "ranks": args.ranks}
    rng = random.Random(args.seed)
    try:
        with Emulator(layout, args.mbit, rtt_ms=args.rtt_ms, name=name) as wan:
            report["network"] = f"{args.mbit} Mbit/s, {args.rtt_ms} ms RTT, {wan.emulation}"
            cluster = Cluster(wan, names, args.ranks, worker_argv(args), log_dir=args.logs)
            try:
                cluster.start_lighthouse(args.min_regions, args.heartbeat)
                for r in names:
                    cluster.start(r)
                events = []
                if args.scenario == "kill":
                    victim = cluster.current[names[-1]]
                    _wait_step(cluster, victim, args.kill_at, args.timeout)
                    victim.kill()
                    events.append(("kill", victim))
                    time.sleep(args.restart_after)
                    events.append(("start", cluster.start(victim.name)))
                elif args.scenario == "chaos":
                    for _ in range(args.events):
                        time.sleep(rng.uniform(args.min_gap, args.max_gap))
                        alive = [r for r in names if cluster.current[r].alive()]
                        dead = [r for r in names if not cluster.current[r].alive()]
                        if dead and (len(alive) <= args.min_regions or rng.random() < 0.5):
                            events.append(("start", cluster.start(rng.choice(dead))))
                        elif len(alive) > args.min_regions:
                            victim = cluster.current[rng.choice(alive)]
                            victim.kill()
                            events.append(("kill", victim))
                    for r in names:
                        if not cluster.current[r].alive():
                            events.append(("start", cluster.start(r)))
                cluster.wait(args.timeout)
                report["events"] = [
                    (kind, run.name, run.killed or run.started) for kind, run in events
                ]
                report["around_kills"] = [
                    survivors_around(cluster, run) for kind, run in events if kind == "kill"
                ]
                finals = {r: cluster.current[r].result for r in names}
                report["results"] = finals
                digests = {r: res["digest"] for r, res in finals.items() if res}
                report["replicas_equal"] = len(set(digests.values())) == 1 and len(digests) == len(
                    names
                )
                report["counters"] = wan.counters()
            finally:
                cluster.stop()
    finally:
        teardown(name)
    return report


def _wait_step(cluster: Cluster, run: RegionProcs, step: int, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while run.step < step:
        if time.time() > deadline or not run.alive():
            raise TimeoutError(f"region {run.name} did not reach step {step}")
        time.sleep(0.05)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scenario", choices=("kill", "chaos", "baseline"), default="kill")
    parser.add_argument("--regions", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mbit", type=float, default=200.0)
    parser.add_argument("--rtt-ms", type=float, default=80.0)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--codec", default="quant")
    parser.add_argument("--level", type=int, default=8)
    parser.add_argument("--min-regions", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heartbeat", type=float, default=2.0, help="Lighthouse heartbeat timeout")
    parser.add_argument("--exchange-timeout", type=float, default=10.0)
    parser.add_argument("--quorum-timeout", type=float, default=20.0)
    parser.add_argument("--pace", type=float, default=0.0, help="seconds of sleep per step")
    parser.add_argument("--spot", action="store_true")
    parser.add_argument("--spot-poll", type=float, default=0.5)
    parser.add_argument("--kill-at", type=int, default=60)
    parser.add_argument("--restart-after", type=float, default=5.0)
    parser.add_argument("--events", type=int, default=6)
    parser.add_argument("--min-gap", type=float, default=3.0)
    parser.add_argument("--max-gap", type=float, default=8.0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--logs", default=None, help="folder for every rank's stderr")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return worker(args)
    report = run_scenario(args)
    print(json.dumps(report, indent=None if args.json else 2, default=str))
    return 0 if report.get("replicas_equal") else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="cloudtrain chaos")
    configure(parser)
    sys.exit(run(parser.parse_args()))
