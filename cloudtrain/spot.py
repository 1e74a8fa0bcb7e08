"""Spot interruption: notice it on EC2, agree on a step across ranks, checkpoint, exit cleanly.

EC2 warns a spot instance two minutes before it reclaims it: the instance metadata item
`spot/instance-action` appears ({"action": "terminate", "time": "2026-11-29T23:30:00Z"}); before
that it answers 404. `SpotWatcher` polls it (IMDSv2: a session token from PUT /latest/api/token,
then GET with the token) in a daemon thread, every 5 s by default. The metadata endpoint is
http://169.254.169.254 unless given as an argument or in CLOUDTRAIN_IMDS_ENDPOINT. Any failure to
reach it is logged once and otherwise ignored: a watcher never stops a training.

Ranks notice at different moments, so they must not act on their own notice. `PreemptionGuard`
is called by every rank at every step boundary; it all-reduces (MAX) the local flags, so all
ranks see the first notice at the same step, save the same checkpoint and leave together:

    watcher = SpotWatcher().start()
    guard = PreemptionGuard(watcher)
    for step in range(start, total):
        train_one_step()
        if guard.should_stop():
            checkpointer.save(step + 1, model=model, optimizer=optimizer, ...)
            sys.exit(0)

Exit 0 after the save: horovodrun and torchrun tear the whole job down when one rank fails, and a
preempted job did nothing wrong. The restarted job resumes from the newest checkpoint (see
cloudtrain.checkpoint). A SIGTERM handler can call `guard.request_stop()` to the same effect.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import torch

from .bootstrap import control_group

log = logging.getLogger(__name__)

IMDS_ENDPOINT_ENV = "CLOUDTRAIN_IMDS_ENDPOINT"
DEFAULT_IMDS_ENDPOINT = "http://169.254.169.254"
TOKEN_PATH = "/latest/api/token"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
INSTANCE_ACTION_PATH = "spot/instance-action"


class InstanceMetadata:
    """A minimal IMDSv2 client: `get("spot/instance-action")` -> text, or None for 404.

    Proxies from the environment are bypassed (the endpoint is link-local). Other HTTP errors and
    network errors raise (urllib.error.URLError, OSError) for the caller to handle.
    """

    def __init__(
        self, endpoint: str | None = None, *, timeout_s: float = 1.0, token_ttl_s: int = 21600
    ) -> None:
        endpoint = endpoint or os.environ.get(IMDS_ENDPOINT_ENV) or DEFAULT_IMDS_ENDPOINT
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        self.token_ttl_s = token_ttl_s
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._token: str | None = None
        self._token_expires = 0.0

    def _fetch_token(self) -> str:
        if self._token is None or time.monotonic() >= self._token_expires:
            req = urllib.request.Request(
                self.endpoint + TOKEN_PATH,
                method="PUT",
                headers={TOKEN_TTL_HEADER: str(self.token_ttl_s)},
            )
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                self._token = resp.read().decode().strip()
            # Renew well before expiry rather than race it.
            self._token_expires = time.monotonic() + 0.9 * self.token_ttl_s
        return self._token

    def get(self, path: str) -> str | None:
        """GET /latest/meta-data/<path>; None when the item does not exist (404)."""
        url = f"{self.endpoint}/latest/meta-data/{path.lstrip('/')}"
        for attempt in range(2):
            req = urllib.request.Request(url, headers={TOKEN_HEADER: self._fetch_token()})
            try:
                with self._opener.open(req, timeout=self.timeout_s) as resp:
                    return resp.read().decode()
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    return None
                if e.code == 401 and attempt == 0:
                    self._token = None  # expired or revoked token: get a new one, once
                    continue
                raise
        raise AssertionError("unreachable")


@dataclass(frozen=True)
class SpotNotice:
    """EC2's spot interruption notice."""

    action: str
    """"terminate", "stop" or "hibernate" ("unknown" when the notice could not be parsed)."""
    time: str
    """When EC2 acts, as it wrote it (ISO 8601 UTC, e.g. 2026-11-29T23:30:00Z); may be empty."""

    @classmethod
    def parse(cls, text: str) -> SpotNotice:
        try:
            body = json.loads(text)
            return cls(action=str(body["action"]), time=str(body.get("time", "")))
        except (ValueError, KeyError, TypeError):
            # The item exists only when an action is scheduled: act on it even if it is garbled.
            log.warning("spot: unparsable instance-action %r; treating it as a notice", text[:200])
            return cls(action="unknown", time="")

    def seconds_left(self) -> float | None:
        """Seconds until EC2 acts, or None when the time is unknown."""
        try:
            when = datetime.fromisoformat(self.time.replace("Z", "+00:00"))
        except ValueError:
            return None
        return when.timestamp() - time.time()


class SpotWatcher:
    """Polls the spot interruption notice in a daemon thread; `.notice` is set once it appears.

    endpoint: instance metadata base URL (default: CLOUDTRAIN_IMDS_ENDPOINT, else
    http://169.254.169.254). interval_s: time between polls. timeout_s: per HTTP request.
    on_notice: called once, from the watcher thread, with the notice.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        interval_s: float = 5.0,
        timeout_s: float = 1.0,
        on_notice: Callable[[SpotNotice], Any] | None = None,
    ) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError(
                f"SpotWatcher(interval_s={interval_s}, timeout_s={timeout_s}): both must be > 0"
            )
        self.imds = InstanceMetadata(endpoint, timeout_s=timeout_s)
        self.interval_s = interval_s
        self.on_notice = on_notice
        self.notice: SpotNotice | None = None
        self.errors = 0
        """Failed polls so far (the first is logged as a warning, the rest at debug level)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def noticed(self) -> bool:
        return self.notice is not None

    def poll(self) -> SpotNotice | None:
        """Ask once; returns the notice if there is one. Never raises."""
        if self.notice is not None:
            return self.notice
        try:
            text = self.imds.get(INSTANCE_ACTION_PATH)
        except Exception as e:
            self.errors += 1
            level = logging.WARNING if self.errors == 1 else logging.DEBUG
            log.log(
                level,
                "spot: cannot read instance metadata at %s (%s); no spot notices until it answers",
                self.imds.endpoint,
                e,
            )
            return None
        if text is None:
            return None
        self.notice = SpotNotice.parse(text)
        log.warning("spot: interruption notice: %s at %s", self.notice.action, self.notice.time)
        if self.on_notice is not None:
            try:
                self.on_notice(self.notice)
            except Exception:
                log.exception("spot: on_notice callback failed")
        return self.notice

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.poll() is not None:
                return  # the notice stays; there is nothing more to learn
            self._stop.wait(self.interval_s)

    def start(self) -> SpotWatcher:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cloudtrain-spot", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def __enter__(self) -> SpotWatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _flag_device(group: Any) -> torch.device:
    import torch.distributed as dist

    # NCCL reduces only CUDA tensors; gloo (and "cpu:gloo,cuda:nccl") takes CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class PreemptionGuard:
    """Makes all ranks agree on the step at which to stop.

    watcher: a SpotWatcher (or None: only request_stop() stops). check_every: agree every this
    many calls; each agreement is one tiny all-reduce, a round trip over the slowest link, and
    the two-minute warning leaves room for a few steps between checks. process_group: the group
    to agree in (default: cloudtrain's own gloo group of all ranks, whose collectives time out
    after timeout_s - default CLOUDTRAIN_TIMEOUT - so a rank that died is reported, not waited
    for). Every rank must call should_stop() at the same points.
    """

    def __init__(
        self,
        watcher: SpotWatcher | None = None,
        *,
        check_every: int = 1,
        process_group: Any = None,
        timeout_s: float | None = None,
    ) -> None:
        if check_every < 1:
            raise ValueError(f"PreemptionGuard(check_every={check_every}) must be at least 1")
        self.watcher = watcher
        self.check_every = check_every
        self.process_group = process_group
        self.timeout_s = timeout_s
        self.stopped = False
        """True once the ranks have agreed to stop; should_stop() returns True from then on."""
        self._requested = False
        self._calls = 0

    def request_stop(self) -> None:
        """Ask to stop at the next agreement (e.g. from a SIGTERM handler). Local to this rank."""
        self._requested = True

    def local_flag(self) -> bool:
        """Whether this rank alone wants to stop."""
        return self._requested or (self.watcher is not None and self.watcher.noticed)

    def should_stop(self) -> bool:
        """True on every rank at the same call once any rank has a notice. Collective."""
        if self.stopped:
            return True
        self._calls += 1
        if self._calls % self.check_every:
            return False
        import torch.distributed as dist

        flag = self.local_flag()
        if dist.is_available() and dist.is_initialized():
            group = self.process_group or control_group(self.timeout_s)
            t = torch.tensor([int(flag)], dtype=torch.int32, device=_flag_device(group))
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            flag = bool(t.item())
        if flag:
            self.stopped = True
            log.warning(
                "spot: all ranks stop after this step (local notice: %s)", self.local_flag()
            )
        return flag
