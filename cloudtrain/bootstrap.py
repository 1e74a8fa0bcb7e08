"""`cloudtrain.init()`: start torch.distributed however the job was launched.

- Already initialised: nothing to do.
- Under `horovodrun` (HOROVOD_RANK / HOROVOD_SIZE set): hvd.init(); rank 0 picks its address and
  a free port and shares them with hvd.broadcast_object (horovodrun sets no MASTER_ADDR); every
  rank then joins over TCP. Horovod is imported only here, so it is optional.
- Under torchrun or with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment: env://.
- Otherwise: a single process (world size 1), so scripts also run on their own.

The backend is NCCL where CUDA is available (each rank on its local GPU), else gloo. Every
collective of the default group times out after `timeout_s` (CLOUDTRAIN_TIMEOUT, default 300 s)
instead of torch's 30 minutes, so a dead peer is reported, not waited for.

At exit, `init` gives torch's collective threads a moment with the GIL (`_drain_at_exit`): a
thread that finished the last collective may still need the GIL to let go of its tensors, and
one that asks after the interpreter has begun to finalize aborts the process ("terminate called
without an active exception", SIGABRT) after the script has done all its work.

`control_group()` is the gloo group over all ranks that cloudtrain's own small collectives
(checkpoint agreement, the preemption vote) run in, with that same timeout whoever initialised the
default group: a rank that never arrives is reported after CLOUDTRAIN_TIMEOUT, not torch's 30 min.

`GroupsInMaking` makes several gloo groups at once, each on a thread with its own client of the
run's store: a group's rendezvous across the WAN is several store round trips, which one client
serves one at a time.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import itertools
import math
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "CLOUDTRAIN_TIMEOUT"


def timeout_seconds(timeout_s: float | None = None) -> float:
    """`timeout_s`, else CLOUDTRAIN_TIMEOUT, else 300: a finite number of seconds > 0."""
    if timeout_s is None:
        raw = os.environ.get(TIMEOUT_ENV, "").strip()
        if not raw:
            return DEFAULT_TIMEOUT_S
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(
                f"{TIMEOUT_ENV}={raw!r} is not a number: set it to the collective timeout in "
                "seconds, e.g. CLOUDTRAIN_TIMEOUT=300"
            ) from None
        if not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"{TIMEOUT_ENV}={raw!r} must be a finite number of seconds > 0, e.g. 300"
            )
        return value
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
        raise ValueError(f"timeout_s={timeout_s!r} must be a number of seconds")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s={timeout_s!r} must be a finite number of seconds > 0")
    return float(timeout_s)


def _timeout(timeout_s: float | None) -> timedelta:
    return timedelta(seconds=timeout_seconds(timeout_s))


_control_groups: dict[float, tuple[Any, Any]] = {}
"""timeout -> (the default group it was made under, the group or its GroupsInMaking)."""


def control_group(timeout_s: float | None = None) -> Any:
    """A gloo group of all ranks with cloudtrain's timeout (see the module docstring), or None
    when torch.distributed is not initialised. Created on first use - a collective call, so every
    rank must make its first call with a given timeout at the same point of the program."""
    if not start_control_group(timeout_s):
        return None
    seconds = timeout_seconds(timeout_s)
    world, group = _control_groups[seconds]
    if isinstance(group, GroupsInMaking):
        group = group.wait()["control"]
        _control_groups[seconds] = (world, group)
    return group


def start_control_group(timeout_s: float | None = None) -> bool:
    """Begin making control_group(timeout_s), so that its rendezvous overlaps other work (every
    rank at the same point, as control_group's first call). False where torch.distributed is not
    initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    seconds = timeout_seconds(timeout_s)
    world = dist.group.WORLD
    cached = _control_groups.get(seconds)
    # A group made under an earlier init_process_group is unusable: make a new one.
    if cached is None or cached[0] is not world:
        ranks = {"control": list(range(dist.get_world_size()))}
        _control_groups[seconds] = (world, GroupsInMaking(ranks, timedelta(seconds=seconds)))
    return True


def gloo_group(
    store: Any, rank: int, size: int, timeout: timedelta, name: str | None = None
) -> Any:
    """A gloo process group of `size` ranks on `store` (prefixed for it), made outside
    torch.distributed's world, as torchft's ProcessGroupGloo makes its groups: so it can be made
    on a thread. `name`: its group name (`GroupsInMaking` registers it under that name)."""
    pg = dist.ProcessGroup(store, rank, size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    backend = dist.ProcessGroupGloo(store, rank, size, timeout)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    if torch.cuda.is_available():
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, backend)
    if name is not None:
        pg._set_group_name(name)
    return pg


class GroupsInMaking:
    """Gloo groups of the run's ranks, made at once (all ranks start the same groups in the same
    order, as with dist.new_group).

    A gloo group's rendezvous is several round trips on the run's TCP store (its ranks' addresses,
    then the connections), and one client of the store serves one request at a time: made one
    after another (new_group), 6 groups of 2 regions x 2 ranks took 7.4 s at 180 ms; made on
    threads each with its own client of the store (`Store.clone`), 2.9 s. `wait()` registers them
    in torch.distributed's world, as new_group does (get_backend, get_rank(group),
    destroy_process_group see them); a rank outside a group gets dist.GroupMember.NON_GROUP_MEMBER
    for it, as from new_group."""

    _batches = itertools.count()
    """Numbers the batches (the same on every rank: all ranks start the same batches)."""

    def __init__(self, ranks: Mapping[str, Sequence[int]], timeout: timedelta) -> None:
        store = dist.distributed_c10d._get_default_store()
        me = dist.get_rank()
        batch = next(GroupsInMaking._batches)
        # a group's ranks numbered in ascending order of theirs, as by new_group
        self._ranks = {name: sorted(members) for name, members in ranks.items()}
        self._pending: dict[str, tuple[str, Any, concurrent.futures.Future]] = {}
        self._groups: dict[str, Any] | None = None
        for name, members in self._ranks.items():
            if me not in members:
                continue
            group_name = f"cloudtrain.{batch}.{name}"
            prefix = f"{group_name}/"
            made: concurrent.futures.Future = concurrent.futures.Future()
            args = (made, store, prefix, members.index(me), members)
            threading.Thread(
                target=self._make, args=(*args, timeout, group_name), daemon=True,
                name=f"cloudtrain-group-{name}",
            ).start()  # fmt: skip
            self._pending[name] = (group_name, dist.PrefixStore(prefix, store), made)

    @staticmethod
    def _make(
        made: concurrent.futures.Future, store: Any, prefix: str, rank: int, members: list[int],
        timeout: timedelta, name: str,
    ) -> None:  # fmt: skip
        try:
            # the thread's own client of the store (a round trip to connect, made here too)
            own = dist.PrefixStore(prefix, store.clone())
            made.set_result(gloo_group(own, rank, len(members), timeout, name))
        except BaseException as e:  # handed to wait(), on the caller's thread
            made.set_exception(e)

    def wait(self) -> dict[str, Any]:
        """The groups by name, registered (each rank's own; others NON_GROUP_MEMBER). Raises
        RuntimeError naming the group whose rendezvous failed (a peer that never came, within the
        timeout)."""
        if self._groups is not None:
            return self._groups
        groups: dict[str, Any] = {}
        for name, members in self._ranks.items():
            if name not in self._pending:
                groups[name] = dist.GroupMember.NON_GROUP_MEMBER
                continue
            group_name, store, made = self._pending[name]
            try:
                pg = made.result()
            except Exception as e:
                raise RuntimeError(
                    f"cloudtrain: making the gloo process group {name!r} of ranks {members} "
                    f"failed ({type(e).__name__}: {e}); is every rank of it running and able to "
                    "reach the others?"
                ) from e
            dist.distributed_c10d._register_pg_in_world(
                pg, backend_name="gloo", store=store, group_name=group_name,
                backend_config=str(dist.distributed_c10d.BackendConfig(dist.Backend.GLOO)),
                rank_mapping={rank: i for i, rank in enumerate(members)},
                add_to_default_tag=True,
            )  # fmt: skip
            groups[name] = pg
        self._groups = groups
        return groups


def _backend(backend: str | None) -> str:
    if backend:
        return backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def _address_towards(peer: str | None) -> str:
    """This host's address on the interface that reaches `peer` (no packet is sent)."""
    if peer:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((peer, 9))
                return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _set_device(local_rank: int, backend: str) -> None:
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


EXIT_DRAIN_S = 0.1


def _drain_at_exit() -> None:
    """Sleep briefly, without the GIL, before the interpreter finalizes. torch (2.13, gloo seen)
    lets go of a finished collective's tensors on its own worker thread, which then takes the
    GIL; a script that exits right after its last collective (a result all-reduced, then
    destroy_process_group) can reach finalization first, and that thread's late GIL request
    aborts the process. Measured with plain DDP over gloo, 2 ranks on 2 cores: 2-5 aborted exits
    in 10 without this, none in 16 with it. Registered by `init`, whatever the launch."""
    time.sleep(EXIT_DRAIN_S)


def _rendezvous(addr: str, port: str) -> str:
    """ "host:port" of the env:// rendezvous, checked: a port that is not one, or a host that
    does not resolve, is named now (torch retries a name it cannot resolve until the timeout)."""
    if not (port.isdigit() and 0 < int(port) < 65536):
        raise RuntimeError(f"cloudtrain.init: MASTER_PORT={port!r} is not a TCP port (1-65535)")
    try:
        socket.getaddrinfo(addr, int(port), type=socket.SOCK_STREAM)
    except OSError as e:
        raise RuntimeError(
            f"cloudtrain.init: MASTER_ADDR={addr!r} does not resolve ({e.strerror or e}); give "
            "rank 0's address or a name every host resolves"
        ) from None
    return f"{addr}:{port}"


def init(backend: str | None = None, timeout_s: float | None = None) -> None:
    """Initialise the default process group for this launch (see module docstring)."""
    atexit.unregister(_drain_at_exit)  # once, however often init runs
    atexit.register(_drain_at_exit)  # also where the group was started by the script itself
    if dist.is_initialized():
        return
    backend = _backend(backend)
    timeout = _timeout(timeout_s)
    env = os.environ
    if "HOROVOD_RANK" in env and "HOROVOD_SIZE" in env:
        try:
            import horovod.torch as hvd
        except ImportError as e:
            raise RuntimeError(
                "launched by horovodrun but horovod is not importable; install it with "
                "scripts/install-horovod (make test/demo do)"
            ) from e
        hvd.init()
        rank, world = hvd.rank(), hvd.size()
        _set_device(hvd.local_rank(), backend)
        address = None
        if rank == 0:
            host = env.get("CLOUDTRAIN_MASTER_ADDR") or _address_towards(
                env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
            )
            address = (host, _free_port(host if host != "127.0.0.1" else ""))
        host, port = hvd.broadcast_object(address, root_rank=0, name="cloudtrain.init")
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{port}",
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
        return
    if "RANK" in env and "WORLD_SIZE" in env:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise RuntimeError(
                f"RANK and WORLD_SIZE are set but {', '.join(missing)} is not; launch with torchrun or set them"
            )
        where = _rendezvous(env["MASTER_ADDR"], env["MASTER_PORT"])
        _set_device(int(env.get("LOCAL_RANK", 0)), backend)
        try:
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        except dist.DistNetworkError as e:  # the same type, saying which address and why
            why = str(e).splitlines()[0].rstrip(".")
            serves = env["RANK"] == "0" and not env.get("TORCHELASTIC_USE_AGENT_STORE")
            raise type(e)(
                f"cloudtrain.init: rank 0 could not serve the rendezvous at {where} "
                f"(MASTER_ADDR:MASTER_PORT): {why}; is the port taken (an earlier run still up)?"
                if serves
                else f"cloudtrain.init: rank {env['RANK']} could not reach the rendezvous at "
                f"{where} (MASTER_ADDR:MASTER_PORT): {why}; check that rank 0 runs there and "
                "that the port is open between the hosts"
            ) from e
        return
    store = dist.HashStore()
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
