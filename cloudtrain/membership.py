"""A region's membership of an elastic run, through torchft's Lighthouse (cloudtrain.elastic).

The region's first rank heartbeats to the Lighthouse (a thread, every `heartbeat_s`) and asks it
for a quorum at every sync with what the region announces (its name, identity, syncs committed,
step, outer copy's digest, the cross groups it holds); every rank of the region gets the same
`View` (cloudtrain.quorum.decide). The Lighthouse decides who is present: a region whose
heartbeats stop for its heartbeat timeout is left out, and a quorum needs its `min_replicas` and
a majority of the regions heartbeating - one Lighthouse per run, so two halves of a partition
can never both have a quorum. Fewer regions than `min_regions` (or `start_regions` in a fresh
run) pause the region, logged, until enough are back: it never trains alone silently.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist

from .bootstrap import _address_towards
from .quorum import ElasticRefused, Member, View, decide

log = logging.getLogger("cloudtrain")


@dataclass
class ElasticStats:
    """What membership cost this region (CloudDDP.stats().elastic). In per-step mode a "sync"
    is a quorum (every elastic.quorum_every steps) and a failed one a dropped step."""

    regions: tuple[str, ...] = ()
    quorum_id: int = -1
    syncs: int = 0
    changes: int = 0
    lost: list[str] = field(default_factory=list)
    left_regions: list[str] = field(default_factory=list)
    """Regions that left at a quorum, handing over (per step: after a spot notice)."""
    joined: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    failed_syncs: int = 0
    pauses: int = 0
    paused_s: float = 0.0
    recovery_bytes_sent: int = 0
    recovery_bytes_received: int = 0
    recovery_s: float = 0.0
    replans: int = 0
    """Schedules planned for the regions present (an "auto" outer loop: cloudtrain.replan)."""
    links_probed: int = 0
    """Pairs of regions whose links this region's plans measured."""
    plan: dict[str, Any] = field(default_factory=dict)
    """The schedule in force: the step it was planned at, H, each region's codec and link."""
    longest_sync_s: float = 0.0
    last_sync_s: float = 0.0
    left: bool = False

    def snapshot(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def scalars(self) -> dict[str, float]:
        """The figures that change over a run, for TensorBoard (`elastic/<name>`)."""
        counts = {"regions_present": len(self.regions), "lost": len(self.lost),
                  "joined": len(self.joined), "refused": len(self.refused)}  # fmt: skip
        sums = ("syncs", "changes", "failed_syncs", "pauses", "paused_s", "recovery_bytes_sent",
                "recovery_bytes_received", "recovery_s", "last_sync_s", "replans",
                "links_probed")  # fmt: skip
        out = {**counts, **{name: getattr(self, name) for name in sums}}
        if self.plan:
            out["sync_every"] = self.plan["sync_every"]
        return {f"elastic/{name}": float(value) for name, value in out.items()}


class Membership:
    """The region's heartbeats and quorums (module docstring): on every rank of the region;
    only the first (local 0) talks to the Lighthouse and holds the TCP store of the quorums it
    leads, the others get its answers over the region's `group`."""

    def __init__(
        self,
        options: Any,
        address: str,
        region: str,
        identity: dict[str, str],
        local: int,
        k: int,
        group: Any,
        stats: ElasticStats,
    ) -> None:
        self.options, self.region, self.identity = options, region, identity
        self.local, self.k, self.group, self.stats = local, k, group, stats
        self.replica_id = f"{region}:{uuid.uuid4().hex[:12]}"
        self.last: tuple[str, ...] = ()
        """The regions of the last committed sync."""
        self.links: list[tuple[str, str, float]] = []
        """The links between regions this region knows, (from, to, bytes/s of one flow),
        announced in its quorum data (cloudtrain.replan; the quorum's choice of sources)."""
        self.leaving = 0
        """> 0: the region leaves at its next quorum (cloudtrain.quorum.Member.leaving)."""
        self.spares = ""
        """The quorum key whose spare groups the region holds (Member.spares)."""
        self.synced = ""
        """The quorum of the region's last committed sync (Member.synced)."""
        self._stop = threading.Event()
        self._client = self._heartbeat = self._store = None
        timeout = timedelta(seconds=options.exchange_timeout_s)
        store_addr = None
        if local == 0:
            from torchft._torchft import LighthouseClient

            connect = timedelta(seconds=options.quorum_timeout_s)
            self._client = LighthouseClient(address, connect_timeout=connect)
            host = _address_towards(urlparse(address).hostname)
            self._store = dist.TCPStore(
                "0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timeout
            )
            store_addr = f"{host}:{self._store.port}"
            self._heartbeat = threading.Thread(
                target=self._beat, args=(LighthouseClient(address, connect_timeout=connect),),
                name="cloudtrain-heartbeat", daemon=True,
            )  # fmt: skip
            self._heartbeat.start()
        got = [store_addr]
        dist.broadcast_object_list(got, src=0, group=group)
        self.store_address = got[0]

    def say(self, message: str, *args: Any) -> None:
        """Log a warning of the region's (the same on each of its ranks) once: from its first
        rank; the others at debug level."""
        (log.warning if self.local == 0 else log.debug)(message, *args)

    def _beat(self, client: Any) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                client.heartbeat(self.replica_id, timeout=timedelta(seconds=5))
                failing = False
            except Exception as e:
                if not failing:
                    log.warning("cloudtrain elastic: heartbeat to the Lighthouse failed: %s", e)
                failing = True
            self._stop.wait(self.options.heartbeat_s)

    def close(self) -> None:
        """Stop heartbeating: the Lighthouse leaves this region out after its heartbeat timeout."""
        self._stop.set()
        if self._heartbeat is not None:  # a heartbeat in flight ends within its 5 s timeout
            self._heartbeat.join(10)
            self._heartbeat = None

    def ask(self, step: int, fragment: int, commits: int, digest: Callable[[], int],
            group_key: str, quiet: bool = False) -> View | None:  # fmt: skip
        """Rank 0 asks the Lighthouse; every rank of the region gets the same View (None: no
        quorum in time - a pause, logged unless `quiet`). The cross groups are offered for reuse
        only where every rank of the region still holds them (`group_key`, agreed by the
        caller)."""
        view = None
        if self.local == 0:
            data = {
                "region": self.region,
                "identity": self.identity,
                "commits": commits,
                "step": step,
                "fragment": fragment,
                "digest": digest(),
                "group": group_key,
                "links": self.links,
                "leaving": self.leaving,
                "spares": self.spares,
                "synced": self.synced,
            }
            try:
                q = self._client.quorum(
                    replica_id=self.replica_id,
                    timeout=timedelta(seconds=self.options.quorum_timeout_s),
                    address="",
                    store_address=self.store_address,
                    step=commits,
                    world_size=self.k,
                    shrink_only=False,
                    data=data,
                )
                key = f"cloudtrain/{q.quorum_id}/{q.created.seconds}.{q.created.nanos}"
                created = q.created.seconds + q.created.nanos / 1e9
                view = decide([Member.of(p) for p in q.participants], q.quorum_id, key,
                              self.replica_id, created)  # fmt: skip
            except Exception as e:
                if not quiet:
                    others = [r for r in self.last if r != self.region]
                    log.warning(
                        "cloudtrain elastic: region %s paused at step %s: no quorum within %g s "
                        "(%s)%s", self.region, step, self.options.quorum_timeout_s,
                        str(e).splitlines()[0],
                        f"; the last sync's other regions: {others} (if one of them stopped "
                        "heartbeating, the Lighthouse forms no quorum below its --min-regions)"
                        if others else "",
                    )  # fmt: skip
        got = [view]
        dist.broadcast_object_list(got, src=0, group=self.group)
        return got[0]

    def quorum(self, step: int, fragment: int, commits: int, digest: Callable[[], int],
               group_key: str) -> View:  # fmt: skip
        """A view with at least min_regions regions in it; waits (a pause) until there is one."""
        t0 = said = time.perf_counter()
        paused = False
        while True:
            # paused, a failed ask is logged once a quorum timeout (a Lighthouse that refuses
            # connections fails at once, every second)
            quiet = paused and time.perf_counter() - said < self.options.quorum_timeout_s
            said = said if quiet else time.perf_counter()
            view = self.ask(step, fragment, commits, digest, group_key, quiet)
            if view is not None and self.region in view.left:
                return view  # it leaves: the caller says so
            if view is not None and view.me < 0:
                self.close()
                why = dict(view.refused).get(self.replica_id, "")
                raise ElasticRefused(f"cloudtrain elastic: region {self.region} refused: {why}")
            need = self.needed(view, commits)
            if view is not None and len(view.members) >= need:
                break
            if view is not None and set(self.last) - set(view.regions):
                # lost while too few are left to sync: counted now, not only at the next commit
                self.stats.lost += [r for r in self.last if r not in view.regions]
                self.stats.changes += 1
                self.last = view.regions
            if not paused:
                self.stats.pauses += 1
                have = "no quorum" if view is None else f"regions {list(view.regions)}"
                self.say(
                    "cloudtrain elastic: region %s pauses at step %s: %s, at least %d needed",
                    self.region, step, have, need,
                )  # fmt: skip
                paused = True
            time.sleep(min(1.0, self.options.quorum_timeout_s))
        if paused:
            self.stats.paused_s += time.perf_counter() - t0
            self.say("cloudtrain elastic: region %s resumes: %s", self.region, list(view.regions))
        for _, why in view.refused:
            self.stats.refused.append(why)
        return view

    def needed(self, view: View | None, commits: int) -> int:
        """Regions that must be present: min_regions, or start_regions in a fresh run."""
        fresh = commits == 0 and (view is None or all(m.commits == 0 for m in view.members))
        start = self.options.start_regions or self.options.min_regions
        return max(self.options.min_regions, start) if fresh else self.options.min_regions

    def note(self, view: View) -> bool:
        """Log and count a change of membership; True if the members differ from the last sync."""
        regions = view.regions
        self.stats.regions, self.stats.quorum_id = regions, view.quorum_id
        if regions == self.last and not view.joiners:
            return False
        lost = [r for r in self.last if r not in regions and r not in view.left]
        joined = [view.members[j].region for j in view.joiners]
        self.stats.lost += lost
        self.stats.left_regions += list(view.left)
        self.stats.joined += joined
        self.stats.changes += 1
        self.say(
            "cloudtrain elastic: region %s at step %s: regions %s (lost %s, left %s, joining %s; "
            "contributors %s) at %.3f",
            self.region, view.step, list(regions), lost, list(view.left), joined,
            [view.members[i].region for i in view.contributors], time.time(),
        )  # fmt: skip
        return True
