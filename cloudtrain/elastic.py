"""Regions that come and go: a region is the unit of failure of an outer-loop run.

    model = CloudDDP(model, CompressionConfig(outer=..., elastic={"min_regions": 2}), optimizer=opt)
    # every region launched on its own (its own torchrun), with CLOUDTRAIN_REGION and
    # TORCHFT_LIGHTHOUSE=http://host:29510 (`cloudtrain lighthouse` runs one)

Membership is torchft's: one process per region (the region's first rank) heartbeats to a
torchft Lighthouse and asks it for a quorum at every sync; the Lighthouse decides who is present
(heartbeat timeout, min_replicas, a majority of the heartbeating regions: one Lighthouse, so two
halves of a partition can never both have a quorum). Everything else is cloudtrain's and is
decided by `decide`, a pure function of the quorum that every rank of every region computes
alike:

- who is refused (another model, config, release or region size than the run's; a second
  process claiming a region that is present),
- who contributes to this sync (the regions at the sync with the most syncs committed) and who
  joins (every other: a new or restarted region, or one whose last sync failed),
- from which contributor each joiner takes the state.

Per quorum each rank makes one gloo group of its own (`cross_group`) with its shard's owners in
the present regions (rank = region index), on the TCP store of the first contributor, and the
outer loop's exchange runs on it unchanged (cloudtrain.datapath.CrossRegion over a `Topology`
of the present regions). A joiner receives the state (outer copy, momentum, inner optimizer
state, buffers, the step and the schedule) from its source region: rank j of the source sends
chunk j to rank j of the joiner (k parallel flows, each 1/k of the bytes; zstd where it pays),
the joiner's ranks gather the chunks inside their region, check the sha256 the source sent and
the outer copy's digest the source announced in the quorum; its parameters become the outer
copy, so its pseudo-gradient at this sync is exactly zero, and the mean divides by the
contributors. After every sync whose membership changed, the present regions compare the outer
copy's digest (`ReplicaMismatch` if it differs).

A sync fails (a region died or stalled in it, or in making the groups or the transfer: a
CommError within `exchange_timeout_s`): the region agrees on it inside itself, puts its
error-feedback residual back as it was, and asks for a new quorum; the Lighthouse leaves the lost
region out once its heartbeats stop. A region whose sync failed while the others' succeeded is
one sync behind at the next quorum, and joins (heals) like a new one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import os
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from .bootstrap import _address_towards, control_group
from .collectives import CommError, all_gather_single, collective_failure
from .datapath import CrossRegion
from .plan import Plan, ceil_div
from .topology import AUTO_REGION, Topology

log = logging.getLogger("cloudtrain")

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
TRANSFER_TAG = 0x5E1F
"""The tag of the state transfer's point-to-point messages on a cross group."""
HEADER_BYTES = 64
"""A transfer's header: total and raw length, zstd flag, sha256 of the raw payload."""
ZSTD_PAYS = 0.9
"""The state is sent zstd-compressed where that leaves at most this share of its bytes."""


class RegionLeft(Exception):
    """This region left the run after a sync (a spot notice): its pseudo-gradient was handed over.
    Raised from `optimizer.step()` on every rank of the region; save and exit 0."""


class ElasticRefused(RuntimeError):
    """This region may not join the run (another model, config or release; a region name that
    is present already). The others go on without it."""


# -- the quorum, as every rank sees it -------------------------------------------------------


@dataclass(frozen=True)
class Member:
    """One region of a quorum, as it announced itself (its QuorumMember's data)."""

    replica_id: str
    region: str
    identity: tuple[tuple[str, str], ...]
    """What must be the same in every region: release, config, model, ranks per region."""
    commits: int
    """Syncs this region has committed."""
    step: int
    """The inner step of the sync it asks for; -1: it is joining (at its start)."""
    fragment: int
    digest: int
    """CRC of its outer copy when it asked."""
    store: str
    """host:port of its TCP store, for the groups of a quorum it leads."""
    group: str = ""
    """The key of the cross groups it holds and whose last sync committed ("": none)."""

    @classmethod
    def of(cls, member: Any) -> Member:
        data = member.data or {}
        return cls(
            replica_id=member.replica_id,
            region=str(data.get("region", "")),
            identity=tuple(
                sorted((str(k), str(v)) for k, v in (data.get("identity") or {}).items())
            ),
            commits=int(data.get("commits", member.step)),
            step=int(data.get("step", -1)),
            fragment=int(data.get("fragment", 0)),
            digest=int(data.get("digest", 0)),
            store=member.store_address,
            group=str(data.get("group", "")),
        )

    @property
    def rank_key(self) -> tuple[int, int]:
        return (self.commits, self.step)


@dataclass(frozen=True)
class View:
    """What one quorum means for this sync (`decide`)."""

    quorum_id: int
    key: str
    """Names this quorum's cross groups: the one every member holds (they are reused: making
    gloo groups across the WAN costs round trips), else a new one for this quorum."""
    members: tuple[Member, ...]
    """The regions taking part, by region name (a member's index is its region index)."""
    contributors: tuple[int, ...]
    """Members whose pseudo-gradients this sync averages."""
    joiners: tuple[int, ...]
    """Members that receive the state from a contributor first (their pseudo-gradient is 0)."""
    sources: dict[int, int]
    """Joiner -> the contributor it receives the state from."""
    refused: tuple[tuple[str, str], ...]
    """(replica id, why) of the participants left out."""
    step: int
    """The inner step of this sync; -1 when no member is at a sync (all are starting)."""
    fragment: int
    me: int
    """This region's index, or -1 when it was refused."""

    @property
    def regions(self) -> tuple[str, ...]:
        return tuple(m.region for m in self.members)

    @property
    def store(self) -> str:
        return self.members[self.contributors[0]].store


def _differs(mine: tuple, run: tuple) -> str:
    a, b = dict(mine), dict(run)
    names = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return ", ".join(f"{k} {a.get(k)!r} (the run's: {b.get(k)!r})" for k in names)


def decide(participants: Sequence[Member], quorum_id: int, key: str, me: str) -> View:
    """The view of a quorum (module docstring); the same on every rank that has the quorum.

    The run is what the most advanced participant (most syncs committed, then the latest sync
    step) runs, ties to the identity most of them share, then to the smallest region name; a
    participant of another identity is refused. Of two claiming one region, the more advanced
    stays (ties: the smaller replica id). If some members are at a sync, the contributors are
    those of them with the most syncs committed; else (all are starting) those equal to the most
    advanced (syncs and outer copy). Everyone else joins, each from a contributor in turn. The
    cross groups are reused where every member holds the same ones (`key` otherwise)."""
    if not participants:
        raise ValueError("decide: a quorum has at least one participant")
    top = max(p.rank_key for p in participants)
    tops = [p for p in participants if p.rank_key == top]
    counts: dict[tuple, int] = {}
    for p in tops:
        counts[p.identity] = counts.get(p.identity, 0) + 1
    run = min(counts, key=lambda i: (-counts[i], min(p.region for p in tops if p.identity == i)))
    refused: list[tuple[str, str]] = []
    by_region: dict[str, Member] = {}
    for p in sorted(participants, key=lambda p: (tuple(-x for x in p.rank_key), p.replica_id)):
        if p.identity != run:
            refused.append((p.replica_id, f"it differs from the run: {_differs(p.identity, run)}"))
        elif not p.region or p.region.startswith(AUTO_REGION):
            refused.append((p.replica_id, "it has no region name: set CLOUDTRAIN_REGION"))
        elif p.region in by_region:
            refused.append((p.replica_id, f"region {p.region!r} is in the run already"))
        else:
            by_region[p.region] = p
    members = tuple(by_region[r] for r in sorted(by_region))
    held = {m.group for m in members}
    if len(held) == 1 and "" not in held:
        key = held.pop()
    syncing = [i for i, m in enumerate(members) if m.step >= 0]
    if syncing:
        best = max(members[i].rank_key for i in syncing)
        contributors = tuple(i for i in syncing if members[i].rank_key == best)
        step, fragment = best[1], members[contributors[0]].fragment
    else:
        lead = max(range(len(members)), key=lambda i: (members[i].commits, -i))
        ref = members[lead]
        contributors = tuple(
            i for i, m in enumerate(members) if (m.commits, m.digest) == (ref.commits, ref.digest)
        )
        step, fragment = -1, 0
    joiners = tuple(i for i in range(len(members)) if i not in contributors)
    sources = {j: contributors[n % len(contributors)] for n, j in enumerate(joiners)}
    index = next((i for i, m in enumerate(members) if m.replica_id == me), -1)
    return View(
        quorum_id, key, members, contributors, joiners, sources, tuple(refused), step,
        fragment, index,
    )  # fmt: skip


def identity_of(description: dict[str, Any]) -> dict[str, str]:
    """A region's identity (release, config, model) as short strings for the quorum's data."""
    model = hashlib.sha256(repr(description["model"]).encode()).hexdigest()[:16]
    return {"version": str(description["version"]), "config": description["config"], "model": model}


# -- groups made per quorum ------------------------------------------------------------------


def cross_group(store: Any, rank: int, size: int, timeout: timedelta, ranks: Sequence[int]) -> Any:
    """A gloo process group of `size` ranks on `store` (a PrefixStore per quorum and shard), made
    outside torch.distributed's world - as torchft's own ProcessGroupGloo makes its groups - so
    that it can be made and dropped with each quorum. Group rank i stands for rank `ranks[i]` of
    the quorum's Topology: that translation is registered (`release_group` removes it), so the
    exchange's point-to-point calls (`dst=` a Topology rank) work on it unchanged."""
    pg = dist.ProcessGroup(store, rank, size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    backend = dist.ProcessGroupGloo(store, rank, size, timeout)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    if torch.cuda.is_available():
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, backend)
    dist.distributed_c10d._world.pg_group_ranks[pg] = {r: i for i, r in enumerate(ranks)}
    return pg


def release_group(pg: Any) -> None:
    """Forget a quorum's group (`cross_group`): its translation of ranks (its gloo pairs close
    when it is collected)."""
    if pg is None:
        return
    dist.distributed_c10d._world.pg_group_ranks.pop(pg, None)


def view_topology(
    view: View, local: int, per_region: int, region_group: Any, cross: Any
) -> Topology:
    """The present regions as a Topology (rank r*k + i is rank i of region r), whose groups are
    this rank's region group and this quorum's cross group of its shard: what CrossRegion needs."""
    names = tuple(m.region for m in view.members for _ in range(per_region))
    topo = Topology(view.me * per_region + local, len(names), names)
    topo.groups[f"region{view.me}"] = region_group
    topo.groups[f"cross{local}"] = cross
    return topo


def outer_digest(tensors: Sequence[torch.Tensor]) -> int:
    """CRC of the outer copy, fragment after fragment (what every present region must agree on)."""
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().data, crc)
    return crc


# -- the region's membership -----------------------------------------------------------------


@dataclass
class ElasticStats:
    """What membership cost this region (CloudDDP.stats().elastic)."""

    regions: tuple[str, ...] = ()
    quorum_id: int = -1
    syncs: int = 0
    changes: int = 0
    lost: list[str] = field(default_factory=list)
    joined: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    failed_syncs: int = 0
    pauses: int = 0
    paused_s: float = 0.0
    recovery_bytes_sent: int = 0
    recovery_bytes_received: int = 0
    recovery_s: float = 0.0
    longest_sync_s: float = 0.0
    last_sync_s: float = 0.0
    left: bool = False

    def snapshot(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ElasticRegion:
    """This region's part in an elastic run (module docstring): one per CloudDDP, on every rank
    of the region. The outer loop calls `sync(fragment)` at every sync step; CloudDDP calls
    `join()` once, before the first step."""

    def __init__(
        self,
        config: Any,
        topo: Topology,
        loop: Any,
        module: torch.nn.Module,
        set_step: Callable[[int], None],
        identity: dict[str, str],
    ) -> None:
        self.options = config.elastic
        if not topo.single_region:
            raise ValueError(
                f"elastic: this launch has ranks in {len(topo.regions)} regions "
                f"({topo.describe()}); launch each region on its own (its own torchrun or "
                "horovodrun) - regions find each other through the Lighthouse"
            )
        region = topo.regions[0]
        if region.startswith(AUTO_REGION):
            raise ValueError(
                "elastic: the region has no name; set CLOUDTRAIN_REGION (or regions=) on every "
                "rank of the region"
            )
        address = self.options.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not address:
            raise ValueError(
                f"elastic: no Lighthouse: set {LIGHTHOUSE_ENV}=http://host:port or "
                "ElasticConfig(lighthouse=...) (`cloudtrain lighthouse` runs one)"
            )
        self.config = config
        self.loop, self.module, self.set_step = loop, module, set_step
        self.region, self.local, self.k = region, topo.rank, topo.world_size
        self.identity = {**identity, "ranks": str(self.k)}
        self.timeout = timedelta(seconds=self.options.exchange_timeout_s)
        self.group = control_group(config.timeout_s)  # the region's own gloo group
        self.commits = 0
        self.stats = ElasticStats()
        self.replica_id = f"{region}:{uuid.uuid4().hex[:12]}"
        self._last: tuple[str, ...] = ()
        self._stores: dict[str, Any] = {}
        self._stop = threading.Event()
        self._client = self._heartbeat = self._store = None
        self._received: dict[str, Any] | None = None
        self._group: Any = None
        """The last quorum's cross group (released when the next is made)."""
        self._group_key = ""
        """Its key while its last sync committed; "" once a sync on it failed."""
        store_addr = None
        if self.local == 0:
            from torchft._torchft import LighthouseClient

            connect = timedelta(seconds=self.options.quorum_timeout_s)
            self._client = LighthouseClient(address, connect_timeout=connect)
            host = _address_towards(urlparse(address).hostname)
            self._store = dist.TCPStore(
                "0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=self.timeout
            )
            store_addr = f"{host}:{self._store.port}"
            self._heartbeat = threading.Thread(
                target=self._beat, args=(LighthouseClient(address, connect_timeout=connect),),
                name="cloudtrain-heartbeat", daemon=True,
            )  # fmt: skip
            self._heartbeat.start()
        got = [store_addr]
        dist.broadcast_object_list(got, src=0, group=self.group)
        self.store_address = got[0]
        self.guard = None
        if self.options.spot:
            from .spot import PreemptionGuard, SpotWatcher

            self.guard = PreemptionGuard(
                SpotWatcher(interval_s=self.options.spot_poll_s).start(), process_group=self.group
            )
        log.info("cloudtrain elastic: region %s (%d ranks) joins via %s", region, self.k, address)

    # -- heartbeats ---------------------------------------------------------------------------
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
        if self.guard is not None and self.guard.watcher is not None:
            self.guard.watcher.stop(0)

    # -- the quorum ---------------------------------------------------------------------------
    def _ask(self, step: int, fragment: int) -> View | None:
        """Rank 0 asks the Lighthouse; every rank of the region gets the same View (None: no
        quorum in time - a pause). The cross groups are offered for reuse only where every
        rank of the region still holds them."""
        if not self._agree(bool(self._group_key)):
            self._group_key = ""
        view = None
        if self.local == 0:
            loop = self.loop
            data = {
                "region": self.region,
                "identity": self.identity,
                "commits": self.commits,
                "step": step,
                "fragment": fragment,
                "digest": outer_digest(loop.global_),
                "group": self._group_key,
            }
            try:
                q = self._client.quorum(
                    replica_id=self.replica_id,
                    timeout=timedelta(seconds=self.options.quorum_timeout_s),
                    address="",
                    store_address=self.store_address,
                    step=self.commits,
                    world_size=self.k,
                    shrink_only=False,
                    data=data,
                )
                key = f"cloudtrain/{q.quorum_id}/{q.created.seconds}.{q.created.nanos}"
                view = decide([Member.of(p) for p in q.participants], q.quorum_id, key,
                              self.replica_id)  # fmt: skip
            except Exception as e:
                log.warning(
                    "cloudtrain elastic: region %s paused at step %s: no quorum within %g s (%s)",
                    self.region, step, self.options.quorum_timeout_s, str(e).splitlines()[0],
                )  # fmt: skip
        got = [view]
        dist.broadcast_object_list(got, src=0, group=self.group)
        return got[0]

    def _quorum(self, step: int, fragment: int) -> View:
        """A view with at least min_regions regions in it; waits (a pause) until there is one."""
        t0 = time.perf_counter()
        paused = False
        while True:
            view = self._ask(step, fragment)
            if view is not None and view.me < 0:
                self.close()
                why = dict(view.refused).get(self.replica_id, "")
                raise ElasticRefused(f"cloudtrain elastic: region {self.region} refused: {why}")
            need = self._needed(view)
            if view is not None and len(view.members) >= need:
                break
            if not paused:
                self.stats.pauses += 1
                have = "no quorum" if view is None else f"regions {list(view.regions)}"
                log.warning(
                    "cloudtrain elastic: region %s pauses at step %s: %s, at least %d needed",
                    self.region, step, have, need,
                )  # fmt: skip
                paused = True
            time.sleep(min(1.0, self.options.quorum_timeout_s))
        if paused:
            self.stats.paused_s += time.perf_counter() - t0
            log.warning(
                "cloudtrain elastic: region %s resumes: %s", self.region, list(view.regions)
            )
        for _, why in view.refused:
            self.stats.refused.append(why)
        return view

    def _needed(self, view: View | None) -> int:
        """Regions that must be present: min_regions, or start_regions in a fresh run."""
        fresh = self.commits == 0 and (view is None or all(m.commits == 0 for m in view.members))
        start = self.options.start_regions or self.options.min_regions
        return max(self.options.min_regions, start) if fresh else self.options.min_regions

    def _note(self, view: View) -> bool:
        """Log and count a change of membership; True if the members differ from the last sync."""
        regions = view.regions
        self.stats.regions, self.stats.quorum_id = regions, view.quorum_id
        if regions == self._last and not view.joiners:
            return False
        lost = [r for r in self._last if r not in regions]
        joined = [view.members[j].region for j in view.joiners]
        self.stats.lost += lost
        self.stats.joined += joined
        self.stats.changes += 1
        log.warning(
            "cloudtrain elastic: region %s at step %s: regions %s (lost %s, joining %s; "
            "contributors %s) at %.3f",
            self.region, view.step, list(regions), lost, joined,
            [view.members[i].region for i in view.contributors], time.time(),
        )  # fmt: skip
        return True

    # -- joining and syncing ------------------------------------------------------------------
    def join(self) -> None:
        """Before the first step (all ranks of the region): take part in the next quorum; where
        the run is ahead, receive its state and take part in its sync."""
        t0 = time.perf_counter()
        view = self._until_committed(-1, 0)
        log.warning(
            "cloudtrain elastic: region %s joined in %.1f s at step %s (regions %s)",
            self.region, time.perf_counter() - t0, self.loop.step, list(view.regions),
        )  # fmt: skip

    def sync(self, fragment: int) -> None:
        """Fragment `fragment`'s sync at the loop's current step, over the regions present (all
        ranks of the region), redone with a new quorum until it commits; then, after a spot
        notice, the region leaves (RegionLeft)."""
        leaving = self.guard is not None and self.guard.should_stop()
        t0 = time.perf_counter()
        self._until_committed(self.loop.step, fragment)
        took = time.perf_counter() - t0
        self.stats.last_sync_s = took
        self.stats.longest_sync_s = max(self.stats.longest_sync_s, took)
        if leaving:
            self.stats.left = True
            self.close()
            log.warning(
                "cloudtrain elastic: region %s leaves after step %s (spot notice), its "
                "pseudo-gradient handed over", self.region, self.loop.step,
            )  # fmt: skip
            raise RegionLeft(f"region {self.region} left the run after step {self.loop.step}")

    def _until_committed(self, step: int, fragment: int) -> View:
        """Quorums until one's sync commits. A region that took a state and then saw the sync
        fail asks as a joiner again (it takes the state again: its pseudo-gradient must be 0)."""
        joining = step < 0
        while True:
            view = self._quorum(-1 if joining else step, fragment)
            done, loaded = self._attempt(view)
            if done:
                return view
            joining = joining or loaded

    def _attempt(self, view: View) -> tuple[bool, bool]:
        """One try at a quorum's sync: groups, the state transfer, the exchange, agreed inside
        the region. (committed, a state was loaded); not committed: ask again."""
        loop = self.loop
        changed = self._note(view)
        ok, cross, why = True, None, ""
        try:
            cross = self._cross(view)
        except CommError as e:
            ok, why = False, str(e)
        try:  # every rank of the region takes part, whatever failed before (it agrees after)
            if view.me in view.joiners:
                self._received = self._receive(view, cross)
            elif any(s == view.me for s in view.sources.values()):
                self._send(view, cross)
        except CommError as e:
            ok, why = False, why or str(e)
        if not self._agree(ok):
            return self._failed(view, why or "another rank of the region failed"), False
        loaded = view.me in view.joiners
        if loaded:
            self._load(view)
            changed = True
        if view.step < 0:  # all were starting: nobody syncs
            return self._committed(view, cross, changed, None), loaded
        fragment = view.fragment
        ef = loop.ef
        ef_key = (fragment, self.local)
        saved = None if ef is None else ef.residuals.get(ef_key)
        saved = None if saved is None else saved.clone()
        topo = view_topology(view, self.local, self.k, self.group, cross)
        path = CrossRegion(self.config, topo, loop.codecs, ef, loop.stats)
        path.timeout = self.timeout  # a region lost in the exchange is noticed within this
        rung = loop.schedule.rungs[0]
        regions = len(view.members)
        plan = Plan((rung,) * regions, zstd=(self.config.zstd is not False,) * regions)
        local = loop.parts.local(fragment)
        delta = loop.global_[fragment].float() - local
        failures: list[BaseException] = []
        mean = loop._exchange(
            fragment, delta, loop.step, path=path, plan=plan,
            divisor=len(view.contributors), failures=failures,
        )  # fmt: skip
        if not self._agree(not failures):
            if ef is not None:  # the packet never counted: its residual as it was
                ef.take(ef_key)
                if saved is not None:
                    ef.put(ef_key, saved)
            why = str(failures[0]) if failures else "another rank of the region failed"
            return self._failed(view, why), loaded
        loop._apply(fragment, mean, local, local)
        if fragment == 0 and loop.buffers is not None:
            self._reconcile_buffers(view, cross)
        return self._committed(view, cross, changed, fragment), loaded

    def _reconcile_buffers(self, view: View, cross: Any) -> None:
        """The present regions' buffers made one (cloudtrain.buffers): this rank's with its
        counterparts', then the region's first rank's inside the region. Not fatal: a region
        lost here is noticed at the next sync, and the buffers differ until then."""
        try:
            self.loop.buffers.across_regions(cross, self.timeout, f" at step {view.step}")
        except CommError as e:
            log.warning("cloudtrain elastic: buffers not reconciled at step %s: %s", view.step, e)
            self._group_key = ""
        self.loop.buffers.in_region()

    def _committed(self, view: View, cross: Any, changed: bool, fragment: int | None) -> bool:
        """A sync done: counted, and checked across regions where membership changed."""
        self._group_key = view.key if cross is not None else ""
        if fragment is not None:
            self.commits += 1
        self.stats.syncs += 1
        self._last = view.regions
        if changed and len(view.members) > 1:
            self._verify(view, cross)
        return True

    def _failed(self, view: View, why: str) -> bool:
        self.stats.failed_syncs += 1
        self._group_key = ""  # a group a collective failed on is not used again
        log.warning(
            "cloudtrain elastic: region %s: sync at step %s with regions %s failed, asking for a "
            "new quorum: %s", self.region, view.step, list(view.regions), why.splitlines()[0],
        )  # fmt: skip
        return False

    def _agree(self, ok: bool) -> bool:
        """True on every rank of the region if it is True on all (the region's gloo group)."""
        if self.k == 1:
            return ok
        flag = torch.tensor([int(ok)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def _cross(self, view: View) -> Any:
        """This quorum's group of this rank's shard owners (None alone)."""
        if len(view.members) == 1:
            return None
        if view.key == self._group_key and self._group is not None:
            return self._group
        self._group_key = ""
        address = view.store
        t0 = time.perf_counter()
        try:
            store = self._stores.get(address)
            if store is None:
                host, port = address.rsplit(":", 1)
                store = dist.TCPStore(
                    host, int(port), is_master=False, wait_for_workers=False, timeout=self.timeout
                )
                self._stores[address] = store
            prefixed = dist.PrefixStore(f"{view.key}/cross{self.local}", store)
            ranks = [r * self.k + self.local for r in range(len(view.members))]
            release_group(self._group)
            self._group = None
            self._group = cross_group(prefixed, view.me, len(view.members), self.timeout, ranks)
            return self._group
        except Exception as e:
            raise CommError(
                collective_failure(
                    f"making the cross-region group on {address}",
                    view.regions,
                    self.local,
                    f" at step {view.step}",
                    time.perf_counter() - t0,
                    e,
                    timeout_s=self.options.exchange_timeout_s,
                    knob="elastic.exchange_timeout_s",
                )
            ) from e

    # -- the state a joiner receives ------------------------------------------------------------
    def _payload(self) -> dict[str, Any]:
        from .outer import _cpu_copy

        loop = self.loop
        trainable = {id(p) for p in loop.params}
        rest = {
            name: t.detach().cpu().clone()
            for name, t in self.module.state_dict(keep_vars=True).items()
            if id(t) not in trainable
        }
        return {
            "step": loop.step,
            "commits": self.commits,
            "global": [g.detach().cpu().clone() for g in loop.global_],
            "momentum": [None if m is None else m.detach().cpu().clone() for m in loop.momentum],
            "optimizer": _cpu_copy(loop.optimizer.state_dict()),
            "module": rest,
            "schedule": dataclasses.asdict(loop.schedule),
        }

    def _send(self, view: View, cross: Any) -> None:
        """A source region's ranks send the state to its joiners (module docstring): rank 0
        serializes it, the region shares the bytes, rank j sends chunk j to rank j of each."""
        t0 = time.perf_counter()
        raw = None
        if self.local == 0:
            buffer = io.BytesIO()
            torch.save(self._payload(), buffer)
            raw = buffer.getvalue()
        got = [raw]
        dist.broadcast_object_list(got, src=0, group=self.group)  # inside the region
        if cross is None:
            raise CommError("cloudtrain elastic: no cross-region group to send the state on")
        raw = got[0]
        wire, packed = raw, 0
        import zstandard

        small = zstandard.ZstdCompressor(level=1).compress(raw)
        if len(small) <= ZSTD_PAYS * len(raw):
            wire, packed = small, 1
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        header[:8] = torch.tensor([len(wire)], dtype=torch.int64).view(torch.uint8)
        header[8:16] = torch.tensor([len(raw)], dtype=torch.int64).view(torch.uint8)
        header[16] = packed
        header[17:49] = torch.frombuffer(bytearray(hashlib.sha256(raw).digest()), dtype=torch.uint8)
        chunk = ceil_div(len(wire), self.k)
        data = torch.frombuffer(bytearray(wire), dtype=torch.uint8)
        piece = data[self.local * chunk : (self.local + 1) * chunk]
        mine = [j for j, s in view.sources.items() if s == view.me]
        works = []
        for j in mine:
            works.append(dist.isend(header, group=cross, group_dst=j, tag=TRANSFER_TAG))
            if piece.numel():
                works.append(dist.isend(piece, group=cross, group_dst=j, tag=TRANSFER_TAG))
        self._wait(works, view, "sending the state", t0)
        sent = len(mine) * (HEADER_BYTES + piece.numel())
        self.stats.recovery_bytes_sent += sent
        self.loop.stats.wan_bytes_sent += sent
        self.stats.recovery_s += time.perf_counter() - t0

    def _wait(self, works: list[Any], view: View, stage: str, t0: float) -> None:
        try:
            for w in works:
                w.wait(self.timeout)
        except Exception as e:
            raise CommError(
                collective_failure(
                    stage,
                    view.regions,
                    self.local,
                    f" at step {view.step}",
                    time.perf_counter() - t0,
                    e,
                    timeout_s=self.options.exchange_timeout_s,
                    knob="elastic.exchange_timeout_s",
                )
            ) from e

    def _receive(self, view: View, cross: Any) -> dict[str, Any] | None:
        """This rank's chunk from its counterpart in the source region, then the region's
        chunks gathered; checked against the sha256 sent and the digest announced. A rank whose
        part failed takes part in the gather all the same (the region agrees after it)."""
        t0 = time.perf_counter()
        src = view.sources[view.me]
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        failure = None
        try:
            if cross is None:
                raise CommError("cloudtrain elastic: no cross-region group to receive the state on")
            self._wait([dist.irecv(header, group=cross, group_src=src, tag=TRANSFER_TAG)], view,
                       "receiving the state's header", t0)  # fmt: skip
        except CommError as e:
            failure = e
        total, raw_len = (int(v) for v in header[:16].view(torch.int64))
        chunk = ceil_div(total, self.k)
        piece = torch.zeros(chunk, dtype=torch.uint8)
        lo = self.local * chunk
        if failure is None and lo < total:
            mine = piece[: min(chunk, total - lo)]
            try:
                self._wait([dist.irecv(mine, group=cross, group_src=src, tag=TRANSFER_TAG)],
                           view, "receiving the state", t0)  # fmt: skip
            except CommError as e:
                failure = e
        self.stats.recovery_bytes_received += HEADER_BYTES + piece.numel()
        sizes = torch.tensor([chunk], dtype=torch.int64)
        if self.k > 1:  # every rank of the region takes part, whatever happened to its chunk
            everyone = torch.zeros(self.k, dtype=torch.int64)
            all_gather_single(everyone, sizes, group=self.group)
            if failure is None and int(everyone.min()) != int(everyone.max()):
                failure = CommError("cloudtrain elastic: the region's ranks got different headers")
            width = int(everyone.max())
            piece = torch.cat([piece, piece.new_zeros(width - chunk)]) if width > chunk else piece
            whole = torch.zeros(self.k * width, dtype=torch.uint8)
            all_gather_single(whole, piece, group=self.group)
        else:
            whole = piece
        if failure is not None:
            raise failure
        wire = whole[:total].numpy().tobytes()
        if header[16]:
            import zstandard

            wire = zstandard.ZstdDecompressor().decompress(wire, max_output_size=raw_len)
        digest = bytes(header[17:49].tolist())
        if len(wire) != raw_len or hashlib.sha256(wire).digest() != digest:
            raise CommError(
                f"cloudtrain elastic: the state received from region "
                f"{view.members[src].region} does not match its sha256: not used"
            )
        state = torch.load(io.BytesIO(wire), weights_only=False)
        if outer_digest(state["global"]) != view.members[src].digest:
            raise CommError(
                f"cloudtrain elastic: the outer copy received from region "
                f"{view.members[src].region} differs from the one it announced: not used"
            )
        self.stats.recovery_s += time.perf_counter() - t0
        return state

    @torch.no_grad()
    def _load(self, view: View) -> None:
        """A joiner takes the state received: the outer copy as its parameters (so its
        pseudo-gradient is zero), the source's momentum, inner optimizer state, buffers, step."""
        from .outer import Schedule

        loop, state = self.loop, self._received
        self._received = None
        device = loop.global_[0].device
        loop.global_ = [g.to(device) for g in state["global"]]
        loop.momentum = [None if m is None else m.to(device) for m in state["momentum"]]
        loop.schedule = Schedule.from_state(state["schedule"])
        loop.optimizer.load_state_dict(state["optimizer"])
        own = self.module.state_dict(keep_vars=True)
        for name, value in state["module"].items():
            own[name].detach().copy_(value)
        for f in range(loop.fragments):
            loop.parts.write(f, loop.global_[f].float())
        if loop.ef is not None:
            loop.ef.reset()  # nothing of this region's was held back
        loop.step = int(state["step"])
        self.set_step(loop.step)
        self.commits = int(state["commits"])
        log.warning(
            "cloudtrain elastic: region %s took the state of region %s at step %s (%d bytes "
            "received by this rank)", self.region, view.members[view.sources[view.me]].region,
            loop.step, self.stats.recovery_bytes_received,
        )  # fmt: skip

    def _verify(self, view: View, cross: Any) -> None:
        """After a change of membership: every present region holds the same outer copy."""
        from .hook import ReplicaMismatch

        mine = torch.tensor([outer_digest(self.loop.global_)], dtype=torch.int64)
        out = torch.zeros(len(view.members), dtype=torch.int64)
        t0 = time.perf_counter()
        try:
            self._wait([all_gather_single(out, mine, group=cross, async_op=True)], view,
                       "the outer copy's check", t0)  # fmt: skip
        except CommError as e:
            log.warning("cloudtrain elastic: outer copy check not done: %s", e)
            self._group_key = ""
            return
        if len(set(out.tolist())) != 1:
            raise ReplicaMismatch(
                f"cloudtrain elastic: after step {view.step} the regions' outer copies differ: "
                + ", ".join(
                    f"{m.region} {d:#x}" for m, d in zip(view.members, out.tolist(), strict=True)
                )
            )

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"commits": self.commits}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.commits = int(state.get("commits", 0))

    def snapshot(self) -> dict[str, Any]:
        return self.stats.snapshot()
