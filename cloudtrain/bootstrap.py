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
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0


def _timeout(timeout_s: float | None) -> timedelta:
    if timeout_s is None:
        timeout_s = float(os.environ.get("CLOUDTRAIN_TIMEOUT", DEFAULT_TIMEOUT_S))
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be positive (seconds)")
    return timedelta(seconds=timeout_s)


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


def init(backend: str | None = None, timeout_s: float | None = None) -> None:
    """Initialise the default process group for this launch (see module docstring)."""
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
        _set_device(int(env.get("LOCAL_RANK", 0)), backend)
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
        return
    store = dist.HashStore()
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
