"""Regions lost, restarted and leaving, on the emulated WAN: an elastic run measured.

    sudo cloudtrain chaos                       # 3 regions x 2 ranks, 200 Mbit/s, 80 ms, kill+rejoin
    sudo cloudtrain chaos --scenario chaos --events 8 --steps 400
    sudo cloudtrain chaos --scenario baseline   # the same run, nobody killed: the quality to match

Every region is launched on its own (its own processes, its own torch.distributed world, as its
own torchrun would), in its namespaces of the emulated network (cloudtrain.tools.netem); a
Lighthouse (`cloudtrain lighthouse`) runs in a namespace of its own. Each region trains the
digits MLP with the outer loop (CompressionConfig(outer=..., elastic=...)) on its own draws of
the data (`--mode step`: per-step mode, every step's gradients crossing). Scenarios:

- `kill`: at step --kill-at every process of the last region gets SIGKILL; --restart-after
  seconds later it is started again with the same command and rejoins;
- `chaos`: --events random kills and restarts of whole regions (never below --min-regions alive);
- `baseline`: nobody killed.

Reports (JSON with --json): the survivors' longest step around each kill and their normal sync,
the detection time (kill to the survivors' quorum without the region), the join time (restart to
the region's first committed sync), `rejoined_s` (restart to its first sync with parameters equal
to another region's), the bytes moved for recovery (cloudtrain's count; and, whichever engine
trains, `join_rx_bytes`: what the restarted region's WAN link received from its restart to
`rejoined_s` - the state, its syncs and the quorums' traffic, from the interface counters), test
accuracy against the baseline, and whether every present region ends with the same parameters.

`--engine torchft` runs the same regions, model, data and schedule with torchft's own DiLoCo
(its Manager, Lighthouse quorum and live healing; `worker_torchft`) on the same links, for the
comparison: `sudo cloudtrain chaos --regions 2 --engine torchft` beside `--engine cloudtrain`.

The worker (`python -m cloudtrain.tools.chaos --worker`) is one rank of one region; local rank 0
prints one JSON line per step and a last `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

# -- one rank ---------------------------------------------------------------------------------


def _config(args: argparse.Namespace) -> Any:
    import cloudtrain
    from cloudtrain.config import OuterConfig

    elastic = {
        "min_regions": args.min_regions,
        "start_regions": args.start_regions,
        "exchange_timeout_s": args.exchange_timeout,
        "quorum_timeout_s": args.quorum_timeout,
        "spot": args.spot,
        "spot_poll_s": args.spot_poll,
        "heartbeat_timeout_s": args.heartbeat,  # the Lighthouse's
    }
    board = {"tensorboard_dir": args.tensorboard} if args.tensorboard else {}
    level = None if args.codec == "auto" else args.level
    if args.mode == "step":  # every step's gradients cross, a quorum every --sync-every steps
        return cloudtrain.CompressionConfig(
            codec=args.codec, level=level, elastic={**elastic, "quorum_every": args.sync_every},
            timeout_s=120, controller=board,
        )  # fmt: skip
    outer = OuterConfig(sync_every=args.sync_every, codec=args.codec, level=level)
    return cloudtrain.CompressionConfig(
        codec="none", error_feedback=False, outer=outer, elastic=elastic, timeout_s=120,
        controller=board,
    )  # fmt: skip


def _total(args: argparse.Namespace) -> int:
    """--steps, or the step the harness wrote into --stop-file (it ends a run of unknown length)."""
    if args.stop_file and os.path.exists(args.stop_file):
        with open(args.stop_file) as f:
            text = f.read().strip()
        if text:
            return int(text)
    return args.steps


def _draw(
    args: argparse.Namespace, data: tuple, region: str, rank: int, k: int, step: int
) -> tuple:
    """This rank's part of its region's batch at `step` (k ranks a region): the same draws
    whichever engine trains, and again after a restart."""
    import torch

    x_train, y_train = data
    per_rank = args.batch // k
    seed = zlib.crc32(region.encode()) + args.seed
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    idx = torch.randint(len(x_train), (args.batch,), generator=gen)
    mine = idx[rank * per_rank : (rank + 1) * per_rank]
    return x_train[mine], y_train[mine]


def _train(model: Any, opt: Any, args: argparse.Namespace, data: tuple, rank: int) -> bool:
    """Steps until the run's total (one JSON line a step on rank 0); True if the region left."""
    import torch.nn.functional as F

    from cloudtrain.elastic import RegionLeft

    elastic = model.elastic
    outer = model.outer
    while model.steps_done < _total(args):
        commits = elastic.commits
        x, y = _draw(args, data, elastic.region, rank, elastic.k, model.steps_done)
        t0 = time.time()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        left = False
        try:
            opt.step()
        except RegionLeft:
            left = True
        if rank == 0:
            line = {"step": model.steps_done, "t": time.time(), "dt": time.time() - t0}
            line["regions"] = list(model.elastic.stats.regions)
            synced = (  # the outer loop's syncs (its H may be planned); per step, quorums
                elastic.commits != commits
                if outer is not None
                else model.steps_done % args.sync_every == 0
            )
            if synced:  # the replica's digest
                line["digest"] = _digest(model.module)
                if outer is not None:
                    line["h"] = outer.schedule.sync_every
                elif model.comm.controller is not None:  # per step with "auto": its plan
                    line["plan"] = model.comm.controller.snapshot()["plan"]
            print(json.dumps(line), flush=True)
        if left:
            return True
        if args.pace:
            time.sleep(args.pace)
    return False


def worker(args: argparse.Namespace) -> int:
    """One rank of one region: join, train, print the RESULT line (module docstring)."""
    import torch

    import cloudtrain
    from cloudtrain.elastic import ElasticRefused
    from cloudtrain.tools.data import digits, digits_mlp

    torch.set_num_threads(1)
    cloudtrain.init()
    import torch.distributed as dist

    rank, region = dist.get_rank(), os.environ["CLOUDTRAIN_REGION"]
    x_train, y_train, x_test, y_test = digits(args.seed)
    torch.manual_seed(args.seed)
    net = digits_mlp(args.hidden)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    t_start = time.time()
    try:
        model = cloudtrain.CloudDDP(net, _config(args), optimizer=opt)
    except ElasticRefused as e:
        if rank == 0:
            print("RESULT " + json.dumps({"region": region, "refused": str(e)}), flush=True)
        dist.destroy_process_group()
        return 3
    joined = time.time()
    left = _train(model, opt, args, (x_train, y_train), rank)
    model.finish_outer()  # as docs/elastic.md's loop: nothing to do in a region that left
    with torch.no_grad():
        accuracy = (net(x_test).argmax(1) == y_test).float().mean().item()
    stats = model.stats()
    if rank == 0:
        result = {
            "region": region, "accuracy": accuracy, "digest": _digest(net), "left": left,
            "steps": model.steps_done, "started": t_start, "joined": joined,
            "finished": time.time(), "elastic": stats.elastic,
            "wan_bytes_sent": stats.wan_bytes_sent,
        }  # fmt: skip
        print("RESULT " + json.dumps(result), flush=True)
    model.close()
    dist.destroy_process_group()
    return 0


def worker_torchft(args: argparse.Namespace) -> int:
    """One rank of one region running torchft's own DiLoCo instead (--engine torchft): the same
    MLP, data draws, inner optimizer and sync_every, torch DDP inside the region, torchft's
    Manager (its Lighthouse quorum, its gloo group across regions, live healing over that group)
    and torchft.local_sgd.DiLoCo with a plain-averaging outer step (SGD, lr 1, no momentum: what
    the cloudtrain worker's OuterConfig does); pseudo-gradients in fp32 (torchft's quantization
    needs a GPU). Prints the same lines as `worker`, with "participants" for "regions"."""
    from datetime import timedelta
    from urllib.parse import urlparse

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.local_sgd import DiLoCo

    from cloudtrain.bootstrap import _address_towards
    from cloudtrain.tools.data import digits, digits_mlp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, k, region = dist.get_rank(), dist.get_world_size(), os.environ["CLOUDTRAIN_REGION"]
    x_train, y_train, x_test, y_test = digits(args.seed)
    torch.manual_seed(args.seed)
    net = digits_mlp(args.hidden)
    ddp = torch.nn.parallel.DistributedDataParallel(net)  # inside the region only
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    outer = torch.optim.SGD(net.parameters(), lr=1.0)
    timeout = timedelta(seconds=args.exchange_timeout)
    pg = ProcessGroupGloo(timeout=timeout)
    lighthouse = os.environ["TORCHFT_LIGHTHOUSE"]
    t_start = time.time()
    manager = Manager(
        pg=pg, min_replica_size=1, use_async_quorum=False,
        load_state_dict=lambda sd: (net.load_state_dict(sd["model"]),
                                    opt.load_state_dict(sd["inner"])),
        state_dict=lambda: {"model": net.state_dict(), "inner": opt.state_dict()},
        replica_id=region, rank=rank, world_size=k, timeout=timeout,
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
        store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
        hostname=_address_towards(urlparse(lighthouse).hostname),
        checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")),
    )  # fmt: skip
    joined = time.time()
    h, local = args.sync_every, 0
    steps = lambda: manager.current_step() * h + local  # noqa: E731
    with DiLoCo(manager, [net], opt, outer, sync_every=h, pin_memory=False):
        while steps() < _total(args):
            x, y = _draw(args, (x_train, y_train), region, rank, k, steps())
            t0 = time.time()
            loss = F.cross_entropy(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()  # DiLoCo's hook: at every h-th step the quorum, the sync, the commit
            local = (local + 1) % h
            if rank == 0:
                line = {"step": steps(), "t": time.time(), "dt": time.time() - t0,
                        "participants": manager.num_participants()}  # fmt: skip
                if local == 0:
                    line["digest"] = _digest(net)
                print(json.dumps(line), flush=True)
            if args.pace:
                time.sleep(args.pace)
    with torch.no_grad():
        accuracy = (net(x_test).argmax(1) == y_test).float().mean().item()
    if rank == 0:
        result = {
            "region": region, "engine": "torchft", "accuracy": accuracy, "digest": _digest(net),
            "left": False, "steps": steps(), "started": t_start, "joined": joined,
            "finished": time.time(),
        }  # fmt: skip
        print("RESULT " + json.dumps(result), flush=True)
    manager.shutdown(wait=False)
    dist.destroy_process_group()
    return 0


def _digest(net: Any) -> int:
    """CRC of the parameters, bit for bit."""
    import torch

    digest = 0
    for p in net.parameters():
        digest = zlib.crc32(p.detach().contiguous().view(torch.uint8).numpy().data, digest)
    return digest


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


class LocalNet:
    """Regions on this host's loopback (no WAN shaping): what `Cluster` needs of an Emulator,
    for runs where only membership matters (a fake metadata server on 127.0.0.1 is reachable)."""

    def __init__(self, layout: dict[str, int]) -> None:
        self.layout = [(r, i) for r, n in layout.items() for i in range(n)]

    def ranks(self, region: str) -> list[int]:
        return [k for k, (r, _) in enumerate(self.layout) if r == region]

    def address(self, rank: int) -> str:
        return "127.0.0.1"

    def popen(self, rank: int, argv: Sequence[str], env: dict[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen:  # fmt: skip
        full = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "CLOUDTRAIN_REGION": self.layout[rank][0]}
        return subprocess.Popen(list(argv), env={**full, **(env or {})}, **kwargs)


class Cluster:
    """Regions of `ranks` ranks each on an Emulator (or a LocalNet) whose region "lh" (one rank)
    holds the Lighthouse. `start(region)` launches (or relaunches) every rank of a region, as
    its own torchrun would; `ports`: each region's MASTER_PORT and the Lighthouse's."""

    def __init__(self, wan: Any, regions: Sequence[str], worker_args: list[str],
                 log_dir: str | None = None, ports: Sequence[int] | None = None) -> None:  # fmt: skip
        self.wan, self.regions = wan, list(regions)
        self.worker_args = worker_args
        self.log_dir = log_dir
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
        ports = list(ports or [29600 + 10 * i for i in range(len(self.regions) + 1)])
        self.ports = dict(zip(self.regions, ports, strict=False))
        self.lighthouse_port = ports[len(self.regions)]
        self.current: dict[str, RegionProcs] = {}
        self.history: list[RegionProcs] = []
        lh = wan.ranks("lh")[0]
        self.lighthouse_url = f"http://{wan.address(lh)}:{self.lighthouse_port}"
        self.lighthouse: subprocess.Popen | None = None

    def start_lighthouse(self, min_regions: int, heartbeat_s: float) -> None:
        lh = self.wan.ranks("lh")[0]
        argv = [
            sys.executable, "-m", "cloudtrain.tools.lighthouse",
            "--bind", f"0.0.0.0:{self.lighthouse_port}", "--min-regions", str(min_regions),
            "--heartbeat-timeout-s", str(heartbeat_s),
        ]  # fmt: skip
        self.lighthouse = self.wan.popen(
            lh, argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        assert self.lighthouse.stdout is not None
        line = self.lighthouse.stdout.readline()
        if not line.startswith("lighthouse"):
            raise RuntimeError(f"the Lighthouse did not start: {line!r}")

    def start(self, region: str, extra_env: dict[str, str] | None = None,
              args: Sequence[str] = ()) -> RegionProcs:  # fmt: skip
        """Every rank of `region` (again): the same command, or with `args` added."""
        ranks = self.wan.ranks(region)
        env = {
            "WORLD_SIZE": str(len(ranks)),
            "MASTER_ADDR": self.wan.address(ranks[0]),
            "MASTER_PORT": str(self.ports[region]),
            "TORCHFT_LIGHTHOUSE": self.lighthouse_url,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **(extra_env or {}),
        }
        argv = [
            sys.executable,
            "-m",
            "cloudtrain.tools.chaos",
            "--worker",
            *self.worker_args,
            *args,
        ]
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
                )
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
        "--engine", args.engine, "--mode", args.mode, "--steps", str(args.steps),
        "--sync-every", str(args.sync_every),
        "--codec", args.codec, "--level", str(args.level), "--min-regions", str(args.min_regions),
        "--start-regions", str(args.start_regions or args.regions),
        "--hidden", str(args.hidden), "--batch", str(args.batch), "--lr", str(args.lr),
        "--seed", str(args.seed), "--exchange-timeout", str(args.exchange_timeout),
        "--heartbeat", str(args.heartbeat),
        "--quorum-timeout", str(args.quorum_timeout), "--pace", str(args.pace),
        *(["--stop-file", args.stop_file] if args.stop_file else []),
        *(["--tensorboard", args.tensorboard] if args.tensorboard else []),
    ]  # fmt: skip


def survivors_around(cluster: Cluster, killed: RegionProcs) -> dict[str, Any]:
    """What each survivor of a kill saw: its longest step from the kill until the region was
    started again (or 30 s), its normal sync (the median of its sync steps before the kill), the
    detection time (kill to the end of its first step without the region) and the step at
    which the restarted region joined it (join_stall_s)."""
    out: dict[str, Any] = {}
    regions = len(cluster.regions)
    t = killed.killed or 0.0
    again = next((r for r in cluster.history if r.name == killed.name and r.started > t), None)
    end = t + 30.0  # until the restart's heartbeats begin (it then joins the survivors' sync)
    if again is not None:
        end = (again.result or {}).get("started", again.started)
    for run in cluster.history:
        if run.name == killed.name or run.started > t or (run.killed or t + 1) < t:
            continue
        after = [ln for ln in run.lines if t <= ln["t"] <= end]
        before = [ln for ln in run.lines if ln["t"] < t]
        # a torchft line counts participants only: the region is there while as many take part
        # as did just before the kill
        total = before[-1].get("participants", regions) if before else regions
        gone = next((ln for ln in after if not _present(ln, killed.name, total)), None)
        back = next((ln for ln in run.lines if ln["t"] > end and _present(ln, killed.name, total)),
                    None)  # fmt: skip
        out[run.name] = {
            "longest_step_s": max((ln["dt"] for ln in after), default=None),
            "normal_sync_s": _median([ln["dt"] for ln in before[1:] if "digest" in ln]),
            "normal_step_s": _median([ln["dt"] for ln in before if "digest" not in ln]),
            "detected_s": None if gone is None else gone["t"] - t,
            "join_stall_s": None if back is None else back["dt"],
        }
    return out


def rejoined_s(cluster: Cluster, run: RegionProcs) -> float | None:
    """Seconds from a region's (re)start to its first sync whose parameters equal another
    region's at the same step (the digests its first rank prints at syncs); None if never."""
    theirs = {
        (ln["step"], ln["digest"])
        for other in cluster.history
        if other.name != run.name
        for ln in other.lines
        if "digest" in ln
    }
    first = next(
        (ln for ln in run.lines if "digest" in ln and (ln["step"], ln["digest"]) in theirs), None
    )
    return None if first is None else first["t"] - run.started


def _present(line: dict[str, Any], region: str, total: int) -> bool:
    """Whether `region` took part in the step of a rank-0 line: named in its regions, or (a
    torchft worker's line, which has only a count) at least `total` regions took part - as many
    as when it was known to be there."""
    if "regions" in line:
        return region in line["regions"]
    return line["participants"] >= total


def _median(xs: Sequence[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


@contextlib.contextmanager
def network(args: argparse.Namespace, layout: dict[str, int]) -> Iterator[tuple[Any, str]]:
    """The emulated WAN (root), or with --local this host's loopback; and its description."""
    if args.local:
        yield LocalNet(layout), "loopback (no WAN shaping)"
        return
    from cloudtrain.tools.netem import Emulator, teardown

    name = f"ch{os.getpid() % 10000}-{uuid.uuid4().hex[:3]}"
    try:
        with Emulator(layout, args.mbit, rtt_ms=args.rtt_ms, name=name) as wan:
            yield wan, f"{args.mbit} Mbit/s, {args.rtt_ms} ms RTT, {wan.emulation}"
    finally:
        teardown(name)


def free_ports(n: int) -> list[int]:
    """n TCP ports nothing listens on now (loopback runs), below the kernel's range of ephemeral
    ports: a region started a minute after its port was chosen finds it free, where a port from
    that range may meanwhile be any connection's own (a store client's, gloo's: EADDRINUSE)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    candidates = random.Random().sample(range(max(1024, ephemeral - 12000), ephemeral), 200)
    ports: list[int] = []
    for port in candidates:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"no {n} free TCP ports below {ephemeral} on loopback")


def chaos_events(cluster: Cluster, args: argparse.Namespace) -> list[tuple[str, RegionProcs]]:
    """Once every region trains, --events random kills and restarts of whole regions,
    --min-gap..--max-gap seconds apart;
    a region is killed only while more than --min-regions regions that have trained are alive
    (the run's state lives on in them); at the end every dead region is started again."""
    rng = random.Random(args.seed)
    names, events = cluster.regions, []
    deadline = time.time() + args.timeout
    for r in names:  # the run has begun: every region has trained
        _wait_step(cluster, cluster.current[r], 1, deadline - time.time())
    while len(events) < args.events:
        if time.time() > deadline:
            raise TimeoutError(f"chaos: {len(events)} of {args.events} events in {args.timeout} s")
        time.sleep(rng.uniform(args.min_gap, args.max_gap))
        trained = [r for r in names if cluster.current[r].alive() and cluster.current[r].lines]
        dead = [r for r in names if not cluster.current[r].alive()]
        if dead and (len(trained) <= args.min_regions or rng.random() < 0.5):
            events.append(("start", cluster.start(rng.choice(dead))))
        elif len(trained) > args.min_regions:
            victim = cluster.current[rng.choice(trained)]
            victim.kill()
            events.append(("kill", victim))
    for r in names:
        if not cluster.current[r].alive():
            events.append(("start", cluster.start(r)))
    if args.stop_file:  # all back and training together: end the run 3 syncs from now
        together = lambda: all(  # noqa: E731
            cluster.current[r].lines
            and all(_present(cluster.current[r].lines[-1], n, len(names)) for n in names)
            for r in names
        )
        while not together():
            if time.time() > deadline:
                raise TimeoutError(f"chaos: the regions were not all back in {args.timeout} s")
            time.sleep(0.2)
        h = max(  # the H in force ("auto": as the regions print it at syncs)
            (ln["h"] for r in names for ln in cluster.current[r].lines if "h" in ln),
            default=args.sync_every if args.sync_every != "auto" else 10,
        )
        stop = (max(cluster.current[r].step for r in names) // h + 3) * h
        with open(args.stop_file, "w") as f:
            f.write(str(stop))
    return events


def run_scenario(args: argparse.Namespace) -> dict[str, Any]:
    """One scenario (module docstring), every process and namespace removed after it."""
    names = [f"r{i}" for i in range(args.regions)]
    layout = {**dict.fromkeys(names, args.ranks), "lh": 1}
    report: dict[str, Any] = {"scenario": args.scenario, "regions": names, "ranks": args.ranks}
    if args.scenario == "chaos" and not args.stop_file:  # the run ends once all are back
        args.stop_file = os.path.join(tempfile.mkdtemp(prefix="cloudtrain-chaos-"), "stop")
    stop, samples = threading.Event(), []
    with network(args, layout) as (net, described):
        report["network"] = described
        ports = free_ports(len(names) + 1) if args.local else None
        cluster = Cluster(net, names, worker_argv(args), log_dir=args.logs, ports=ports)
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
                if not args.local:  # what its link receives from now on (join_rx_bytes)
                    samples = _sample_rx(net, victim.name, stop)
                events.append(("start", cluster.start(victim.name)))
            elif args.scenario == "chaos":
                events = chaos_events(cluster, args)
            cluster.wait(args.timeout)
        finally:
            stop.set()
            cluster.stop()
        report["events"] = [(kind, run.name, run.killed or run.started) for kind, run in events]
        report["around_kills"] = [
            survivors_around(cluster, run) for kind, run in events if kind == "kill"
        ]
        report["rejoined_s"] = [rejoined_s(cluster, run) for kind, run in events if kind == "start"]
        if samples:  # from the restart to its first sync equal to another region's
            back = report["rejoined_s"][0]
            t0, rx0 = samples[0]
            rx = next((b for t, b in samples if back is not None and t >= t0 + back), None)
            report["join_rx_bytes"] = None if rx is None else rx - rx0
        finals = {r: cluster.current[r].result for r in names}
        report["results"] = finals
        digests = [res["digest"] for res in finals.values() if res and "digest" in res]
        report["replicas_equal"] = len(set(digests)) == 1 and len(digests) == len(names)
        if not args.local:
            report["counters"] = net.counters()
    return report


def _sample_rx(net: Any, region: str, stop: threading.Event) -> list[tuple[float, int]]:
    """(time, bytes received by `region`'s WAN link) every 0.1 s from now until `stop`."""
    samples = [(time.time(), net.counters()[region]["rx_bytes"])]

    def sample() -> None:
        while not stop.wait(0.1):
            samples.append((time.time(), net.counters()[region]["rx_bytes"]))

    threading.Thread(target=sample, daemon=True).start()
    return samples


def _int_or_auto(text: str) -> int | str:
    return text if text == "auto" else int(text)


def _wait_step(cluster: Cluster, run: RegionProcs, step: int, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while run.step < step:
        if time.time() > deadline or not run.alive():
            raise TimeoutError(f"region {run.name} did not reach step {step}")
        time.sleep(0.05)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scenario", choices=("kill", "chaos", "baseline"), default="kill")
    parser.add_argument(
        "--engine",
        choices=("cloudtrain", "torchft"),
        default="cloudtrain",
        help="who trains: cloudtrain's elastic outer loop, or torchft's own DiLoCo beside it",
    )
    parser.add_argument("--regions", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mbit", type=float, default=200.0)
    parser.add_argument("--rtt-ms", type=float, default=80.0)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument(
        "--mode", choices=("outer", "step"), default="outer",
        help="outer: the outer loop syncs every --sync-every steps; step: every step's gradients "
        "cross regions (per-step mode), a quorum every --sync-every steps",
    )  # fmt: skip
    parser.add_argument(
        "--sync-every", type=_int_or_auto, default=10,
        help="outer: H, or 'auto' (planned for the regions present); step: the quorum's interval",
    )  # fmt: skip
    parser.add_argument("--codec", default="quant", help="a codec, or 'auto'")
    parser.add_argument("--level", type=int, default=8)
    parser.add_argument("--min-regions", type=int, default=1)
    parser.add_argument(
        "--start-regions", type=int, default=0, help="regions a fresh run waits for (0: all)"
    )
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
    parser.add_argument(
        "--tensorboard", default=None, help="TensorBoard folder (a sub-folder per region)"
    )
    parser.add_argument("--local", action="store_true", help="on loopback, no WAN (no root)")
    parser.add_argument(
        "--stop-file",
        default=None,
        help="chaos: the step the run ends at is written here once every region is back "
        "(--steps is then an upper bound)",
    )


def run(args: argparse.Namespace) -> int:
    if args.sync_every == "auto" and (args.engine, args.mode) != ("cloudtrain", "outer"):
        raise SystemExit(
            "chaos: --sync-every auto is the outer loop's (--mode outer); give a number"
        )
    if args.codec == "auto" and args.engine != "cloudtrain":
        raise SystemExit("chaos: --codec auto is cloudtrain's; give a codec")
    if args.worker:
        return worker_torchft(args) if args.engine == "torchft" else worker(args)
    report = run_scenario(args)
    print(json.dumps(report, indent=None if args.json else 2, default=str))
    return 0 if report.get("replicas_equal") else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="cloudtrain chaos")
    configure(parser)
    sys.exit(run(parser.parse_args()))
