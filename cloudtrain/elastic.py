"""Regions that come and go: a region is the unit of failure of an elastic run.

    model = CloudDDP(model, CompressionConfig(outer=..., elastic={"min_regions": 2}), optimizer=opt)
    # every region launched on its own (its own torchrun), with CLOUDTRAIN_REGION and
    # TORCHFT_LIGHTHOUSE=http://host:29510 (`cloudtrain lighthouse` runs one)

Where each part lives:

- cloudtrain.membership: torchft's Lighthouse decides who is present (the region's first rank
  heartbeats and asks it for a quorum at every sync; a majority rule against split brain; the
  pause below min_regions);
- cloudtrain.quorum: `decide`, a pure function of a quorum that every rank of every region
  computes alike - who is refused, who contributes, who joins and from whom;
- cloudtrain.transfer: the live state transfer to a joiner, checked by sha256 and digest;
- cloudtrain.replan: the links between regions and an "auto" outer loop's plan for the regions
  present;
- here: the sync over the regions present, redone until it commits (`ElasticRegion`); per step,
  without an outer loop, the hook's exchanges on the last quorum's groups, a failed step dropped
  (`ElasticSteps`, docs/elastic.md "Per-step mode"); groups made ahead (`SpareGroups`).

Per quorum each rank makes one gloo group of its own (`cross_group`) with its shard's owners in
the present regions (rank = region index), on the TCP store of the first contributor (kept while the
members are the same), and the outer loop's exchange runs on it unchanged (cloudtrain.datapath.CrossRegion over a `Topology`
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

import collections
import concurrent.futures
import dataclasses
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .bootstrap import control_group, gloo_group
from .collectives import CommError, all_gather_single, collective_failure
from .datapath import CrossRegion
from .membership import ElasticStats, Membership
from .options import AUTO
from .outer import DECIDE_AFTER, Schedule
from .plan import Plan, describe
from .quorum import ElasticRefused, RegionLeft, View, identity_of, is_spare_key, spare_key
from .replan import MIN_STEP_S, LinkBook, agree_links
from .stats import Scalars
from .topology import AUTO_REGION, Topology
from .transfer import StateTransfer

__all__ = ["ElasticRefused", "ElasticRegion", "ElasticStats", "RegionLeft", "identity_of"]

log = logging.getLogger("cloudtrain")

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
QUIET_WINDOW = 50
"""Per step: the last steps whose median times a leaving region's quiet period (View.quiet)."""


def _check_launch(options: Any, topo: Topology) -> tuple[str, str]:
    """The region's name and the Lighthouse's address; a launch that cannot be one region of an
    elastic run raises, saying what to set."""
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
    address = options.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
    if not address:
        raise ValueError(
            f"elastic: no Lighthouse: set {LIGHTHOUSE_ENV}=http://host:port or "
            "ElasticConfig(lighthouse=...) (`cloudtrain lighthouse` runs one)"
        )
    if "://" not in address:
        raise ValueError(
            f"elastic: {LIGHTHOUSE_ENV}={address!r}: give the Lighthouse's URL, e.g. "
            "http://10.0.0.5:29510"
        )
    return region, address


def cross_group(store: Any, rank: int, size: int, timeout: timedelta, ranks: Sequence[int]) -> Any:
    """A gloo process group of `size` ranks on `store` (a PrefixStore per quorum and shard), made
    outside torch.distributed's world - as torchft's own ProcessGroupGloo makes its groups - so
    that it can be made and dropped with each quorum. Group rank i stands for rank `ranks[i]` of
    the quorum's Topology: that translation is registered (`release_group` removes it), so the
    exchange's point-to-point calls (`dst=` a Topology rank) work on it unchanged."""
    return register_ranks(gloo_group(store, rank, size, timeout), ranks)


def store_client(address: str, timeout: timedelta) -> Any:
    """A client of the TCP store at `address` ("host:port": a quorum leader's)."""
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timeout)


def register_ranks(pg: Any, ranks: Sequence[int]) -> Any:
    """Group rank i of `pg` stands for Topology rank `ranks[i]` (`cross_group`)."""
    dist.distributed_c10d._world.pg_group_ranks[pg] = {r: i for i, r in enumerate(ranks)}
    return pg


def release_group(pg: Any) -> None:
    """Forget a quorum's group (`cross_group`): its translation of ranks (its gloo pairs close
    when it is collected)."""
    if pg is None:
        return
    dist.distributed_c10d._world.pg_group_ranks.pop(pg, None)


class SpareGroups:
    """This rank's cross groups made ahead for the quorums that lose one region.

    Making a gloo group across the WAN takes several round trips (its rendezvous on a TCP store
    and the connections: 0.6 s at 80 ms was measured), and the survivors of a lost region would
    wait for it between noticing the loss and going on. So after a sync of three or more regions
    commits, every rank makes, on threads, its shard's group of each set of those regions less
    one (`cloudtrain.quorum.spare_key`); each region announces whose spares it holds
    (Member.spares), and a quorum of exactly such a set runs on the one made for it. Spares are
    dropped when the next are made, or once one is taken (they include the lost region)."""

    def __init__(self, local: int, k: int, timeout: timedelta, control: bool = False) -> None:
        """`control`: each spare also has the group of all the regions' ranks (per step with
        "auto": the controller's decisions)."""
        self.local, self.k, self.timeout, self.control = local, k, timeout, control
        self.key = ""
        """The quorum key whose spares are held ("": none)."""
        self._made: dict[str, concurrent.futures.Future] = {}

    def make(self, view: View) -> None:
        """After `view`'s sync committed (every rank of the region alike)."""
        if view.key == self.key:
            return
        self.release()
        if len(view.members) < 3:  # one region lost leaves one: no group across
            return
        self.key = view.key
        for lost in view.regions:
            if lost == view.regions[view.me]:
                continue
            regions = [r for r in view.regions if r != lost]
            key = spare_key(view.key, lost, regions)
            me = regions.index(view.regions[view.me])
            made: concurrent.futures.Future = concurrent.futures.Future()
            args = (made, key, view.store, me, len(regions))
            # a daemon: a group whose rendezvous waits for a region lost meanwhile must not hold
            # the process's exit up (it gives up after the timeout)
            threading.Thread(
                target=self._make, args=args, name="cloudtrain-spare", daemon=True
            ).start()
            self._made[key] = made

    def _make(
        self, made: concurrent.futures.Future, key: str, address: str, me: int, size: int
    ) -> None:
        try:
            store = store_client(address, self.timeout)  # a client of its own: the thread's
            prefixed = dist.PrefixStore(f"{key}/cross{self.local}", store)
            cross = gloo_group(prefixed, me, size, self.timeout)
            control = None
            if self.control:
                prefixed = dist.PrefixStore(f"{key}/control", store)
                control = gloo_group(
                    prefixed, me * self.k + self.local, size * self.k, self.timeout
                )
            made.set_result((cross, control))
        except BaseException as e:
            made.set_exception(e)

    def take(self, view: View) -> tuple[Any, Any] | None:
        """The groups made ahead for `view` (waited for; its error raised): this rank's shard's
        and, with `control`, all ranks'; or None. The other spares are dropped."""
        made = self._made.pop(view.key, None)
        self.release()
        if made is None:
            return None
        cross, control = made.result(timeout=self.timeout.total_seconds())
        n = len(view.members)
        if control is not None:
            register_ranks(control, range(n * self.k))
        return register_ranks(cross, [r * self.k + self.local for r in range(n)]), control

    def release(self) -> None:
        """Forget the spares (one still being made is dropped once made)."""
        self._made.clear()
        self.key = ""


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


class ElasticRegion:
    """This region's part in an elastic run (module docstring): one per CloudDDP, on every rank
    of the region. The outer loop calls `sync(fragment)` at every sync step; CloudDDP calls
    `join()` once, before the first step."""

    def __init__(
        self,
        config: Any,
        topo: Topology,
        replica: Any,
        identity: dict[str, str],
    ) -> None:
        self.options = config.elastic
        region, address = _check_launch(self.options, topo)
        self.config = config
        self.replica = replica
        """What a joiner receives (cloudtrain.transfer: OuterReplica, StepReplica)."""
        self.loop = getattr(replica, "loop", None)
        self.region, self.local, self.k = region, topo.rank, topo.world_size
        self.timeout = timedelta(seconds=self.options.exchange_timeout_s)
        self.group = control_group(config.timeout_s)  # the region's own gloo group
        self.commits = 0
        self.stats = ElasticStats()
        self.members = Membership(
            self.options, address, region, {**identity, "ranks": str(self.k)}, self.local,
            self.k, self.group, self.stats,
        )  # fmt: skip
        self.transfer = StateTransfer(
            region, self.group, self.local, self.k, self.options.exchange_timeout_s, self.stats,
            replica,
        )  # fmt: skip
        self._stores: dict[str, Any] = {}
        self.auto = config.outer is None and config.codec == AUTO  # per step: a controller
        self.spares = SpareGroups(self.local, self.k, self.timeout, control=self.auto)
        self._received: dict[str, Any] | None = None
        self._group: Any = None
        """The last quorum's cross group (released when the next is made)."""
        self.control: Any = None
        """Its group of every present rank, where one was made (ElasticSteps with "auto")."""
        self._group_key = ""
        """Its key while its last sync committed; "" once a sync on it failed."""
        self._broken = False
        """A collective on this quorum's groups failed (a lost region, noticed later): the sync
        commits, its groups are not offered again."""
        self.book: LinkBook | None = None
        """The links measured between regions, where the outer loop's H or codec is "auto" (its
        schedule is then planned for the regions present: cloudtrain.replan), or per step with
        "auto" (a controller is made for them: ElasticSteps)."""
        if self.auto or (
            self.loop is not None and AUTO in (config.outer.sync_every, config.outer.codec)
        ):
            self.book = LinkBook()
        if self.loop is not None and self.book is not None:
            self.loop.schedule = Schedule(DECIDE_AFTER, (), 0.0, False)  # provisional
        self.guard = None
        if self.options.spot:
            from .spot import PreemptionGuard, SpotWatcher

            self.guard = PreemptionGuard(
                SpotWatcher(interval_s=self.options.spot_poll_s).start(), process_group=self.group
            )
        board = config.controller.tensorboard_dir
        self.scalars = (  # the region's first rank, a folder per region
            Scalars(os.path.join(board, region)) if board is not None and self.local == 0 else None
        )
        log.info("cloudtrain elastic: region %s (%d ranks) joins via %s", region, self.k, address)

    def close(self) -> None:
        """Stop heartbeating: the Lighthouse leaves this region out after its heartbeat timeout."""
        self.members.close()
        self.spares.release()
        if self.guard is not None and self.guard.watcher is not None:
            self.guard.watcher.stop(0)
        if self.scalars is not None:
            self.scalars.close()

    def _quorum(self, step: int, fragment: int) -> View:
        """The next quorum's view (cloudtrain.membership), offering the cross groups for reuse
        only where every rank of the region still holds them."""
        if not self._agree(bool(self._group_key)):
            self._group_key = ""
        if not self._agree(bool(self.spares.key)):  # every rank of the region holds its own
            self.spares.release()
        if self.book is not None:  # for the quorum's choice of a joiner's source
            self.members.links = self.book.rows()
        self.members.spares = self.spares.key
        try:
            view = self.members.quorum(
                step, fragment, self.commits, self.replica.digest,
                self._group_key,
            )  # fmt: skip
        except ElasticRefused:
            self.close()
            raise
        if self.region in view.left:  # it announced it leaves: the others were told
            self._leave(", the others told at the quorum")
        return view

    def join(self) -> None:
        """Before the first step (all ranks of the region): take part in the next quorum; where
        the run is ahead, receive its state and take part in its sync."""
        t0 = time.perf_counter()
        view = self._until_committed(-1, 0)
        self._write_scalars()
        self.members.say(
            "cloudtrain elastic: region %s joined in %.1f s at step %s (regions %s)",
            self.region, time.perf_counter() - t0, self.replica.step, list(view.regions),
        )  # fmt: skip

    def sync(self, fragment: int) -> None:
        """Fragment `fragment`'s sync at the loop's current step, over the regions present (all
        ranks of the region), redone with a new quorum until it commits; then, after a spot
        notice, the region leaves (RegionLeft)."""
        leaving = self.guard is not None and self.guard.should_stop()
        self._timed_until_committed(self.loop.step, fragment)
        if leaving:
            self._leave(", its pseudo-gradient handed over")

    def _timed_until_committed(self, step: int, fragment: int) -> None:
        """`_until_committed`, its seconds counted as the last (and maybe longest) sync."""
        t0 = time.perf_counter()
        self._until_committed(step, fragment)
        took = time.perf_counter() - t0
        self.stats.last_sync_s = took
        self.stats.longest_sync_s = max(self.stats.longest_sync_s, took)
        self._write_scalars()

    def _leave(self, handed: str) -> None:
        """After a spot notice: stop heartbeating and raise RegionLeft (every rank)."""
        self.stats.left = True
        self.close()
        step = self.replica.step
        self.members.say(
            "cloudtrain elastic: region %s leaves after step %s (spot notice)%s",
            self.region, step, handed,
        )  # fmt: skip
        raise RegionLeft(f"region {self.region} left the run after step {step}")

    def _write_scalars(self) -> None:
        """Membership, stalls and recoveries so far, for TensorBoard, at the loop's step."""
        if self.scalars is not None:
            self.scalars.write(self.replica.step, self.stats.scalars())

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

    def _prepare(self, view: View) -> tuple[bool, Any, bool, bool]:
        """A quorum's groups and state transfer, agreed inside the region: (done, the cross
        group, a state was loaded, membership changed); not done: ask again."""
        changed = self.members.note(view)
        ok, cross, why = True, None, ""
        try:
            cross = self._cross(view)
        except CommError as e:
            ok, why = False, str(e)
        try:  # every rank of the region takes part, whatever failed before (it agrees after)
            if view.me in view.joiners:
                self._received = self.transfer.receive(view, cross)
            elif any(s == view.me for s in view.sources.values()):
                self.transfer.send(view, cross, self.commits)
        except CommError as e:
            ok, why = False, why or str(e)
        if not self._agree(ok):
            why = why or "another rank of the region failed"
            return self._failed(view, why), cross, False, changed
        loaded = view.me in view.joiners
        if loaded:
            me, source = view.members[view.me], view.members[view.sources[view.me]]
            if me.step >= 0 and me.rank_key == source.rank_key:  # (quorum._agreeing)
                self.members.say(
                    "cloudtrain elastic: region %s trained apart from %s (the same syncs and "
                    "step, another digest): it takes %s's state, its own since they parted is "
                    "dropped", self.region, source.region, source.region,
                )  # fmt: skip
            state, self._received = self._received, None
            self.commits = self.transfer.load(view, state)
            changed = True
        return True, cross, loaded, changed

    def _attempt(self, view: View) -> tuple[bool, bool]:
        """One try at a quorum's sync: groups, the state transfer, the exchange, agreed inside
        the region. (committed, a state was loaded); not committed: ask again."""
        loop = self.loop
        ready, cross, loaded, changed = self._prepare(view)
        if not ready:
            return False, loaded
        if view.step < 0:  # all were starting: nobody syncs
            return self._committed(view, cross, changed, None), loaded
        fragment = view.fragment
        schedule = loop.schedule
        if self.book is not None and fragment == 0 and schedule.regions != view.regions:
            try:
                schedule = self._replan(view, cross)
            except CommError as e:  # alike on every rank of the region (_replan)
                return self._failed(view, str(e)), loaded
        ef = loop.ef
        ef_key = (fragment, self.local)
        saved = None if ef is None else ef.residuals.get(ef_key)
        saved = None if saved is None else saved.clone()
        topo = view_topology(view, self.local, self.k, self.group, cross)
        path = CrossRegion(self.config, topo, loop.codecs, ef, loop.stats)
        path.timeout = self.timeout  # a region lost in the exchange is noticed within this
        rungs = schedule.rungs_of(view.regions, loop.ladder[-1])
        plan = Plan(rungs, zstd=(self.config.zstd is not False,) * len(rungs))
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
        if schedule is not loop.schedule:  # planned at this sync: in force from it
            self._take_plan(view, schedule)
        if fragment == 0 and loop.buffers is not None:
            self._reconcile_buffers(view, cross, loop.buffers)
        return self._committed(view, cross, changed, fragment), loaded

    def _replan(self, view: View, cross: Any) -> Schedule:
        """The schedule for the regions of `view` (cloudtrain.replan; every rank of the region):
        the links agreed with the other regions (`_agreed_links`) and the slowest region's step;
        every rank then chooses the same schedule. A failure is a CommError on every rank."""
        assert self.loop is not None
        loop, t0 = self.loop, time.perf_counter()
        steps, probed = self._agreed_links(view, cross, loop._step_s())
        step_s = max(max(steps), MIN_STEP_S)
        links = self.book.links(view.regions, loop.cut)
        chosen = loop.choose(links, step_s)
        schedule = dataclasses.replace(chosen, regions=view.regions, start=view.step)
        self.members.say(
            "cloudtrain elastic: region %s at step %s: plan for regions %s (%d pairs probed, "
            "%.2f s): %s", self.region, view.step, list(view.regions), probed,
            time.perf_counter() - t0, schedule.describe(step_s, links),
        )  # fmt: skip
        return schedule

    def _agreed_links(self, view: View, cross: Any, mine: Any) -> tuple[list[Any], int]:
        """The links between the regions of `view` and each region's value (`mine` this one's),
        the same on every rank of every present region (cloudtrain.replan): the region's first
        rank gathers the books and values with the others' first ranks, probing the pairs no
        region has measured, and shares the result in the region; this region's book becomes
        the merged one. (Every region's values, the pairs probed.) A failure is a CommError on
        every rank of the region."""
        assert self.book is not None
        t0 = time.perf_counter()
        got: list[Any] = [None]
        if self.local == 0:
            try:
                if cross is None:  # alone
                    got[0] = (self.book, [mine], 0)
                else:
                    got[0] = agree_links(self.book, view.regions, cross, mine, view.created)
            except Exception as e:
                got[0] = self._making_failed("agreeing on the links", view.regions, view, t0, e)
        dist.broadcast_object_list(got, src=0, group=self.group)  # inside the region
        if isinstance(got[0], CommError):
            raise got[0]
        self.book, values, probed = got[0]
        self.stats.links_probed += probed
        return values, probed

    def _take_plan(self, view: View, schedule: Schedule) -> None:
        """A schedule planned at the sync that just committed: the loop's from now on."""
        assert self.loop is not None and self.book is not None
        self.loop.schedule = schedule
        self.stats.replans += 1
        self.stats.plan = {
            "step": view.step,
            "sync_every": schedule.sync_every,
            "codecs": {
                name: describe(rung)
                for name, rung in zip(schedule.regions, schedule.rungs, strict=True)
            },
            "links": {  # each region's, as the plan had it: one shard owner's share
                name: {"mbit_per_sender": 8 * link.bandwidth / 1e6, "rtt_ms": 1000 * link.rtt}
                for name, link in zip(
                    view.regions, self.book.links(view.regions, self.loop.cut), strict=True
                )
            },
            "fits": schedule.fits,
        }

    def _reconcile_buffers(self, view: View, cross: Any, buffers: Any) -> None:
        """The present regions' buffers made one (cloudtrain.buffers): this rank's with its
        counterparts', then the region's first rank's inside the region. Not fatal: a region
        lost here is noticed at the next sync, and the buffers differ until then."""
        try:
            buffers.across_regions(cross, self.timeout, f" at step {view.step}")
        except CommError as e:
            log.warning("cloudtrain elastic: buffers not reconciled at step %s: %s", view.step, e)
            self._broken = True
        buffers.in_region()

    def _committed(self, view: View, cross: Any, changed: bool, fragment: int | None) -> bool:
        """A sync done: counted, and checked across regions where membership changed."""
        self._group_key = view.key if cross is not None and not self._broken else ""
        self._broken = False
        if fragment is not None:
            self.commits += 1
        self.stats.syncs += 1
        self.members.last, self.members.synced = view.regions, view.name
        if changed and len(view.members) > 1:
            self._verify_change(view, cross)
        if self._group_key:
            self.spares.make(view)
        return True

    def _verify_change(self, view: View, cross: Any) -> None:
        """After a sync whose membership changed: the regions' outer copies compared."""
        self._verify(view, cross)

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
            release_group(self._group)
            release_group(self.control)
            self._group = self.control = None
            spare = self.spares.take(view)  # made ahead, where it was
            if spare is not None:
                self._group, self.control = spare
                log.info("cloudtrain elastic: regions %s on groups made ahead", list(view.regions))
            elif is_spare_key(view.key):  # (its prefix is the spare's: never made twice)
                raise CommError(f"this rank holds no group made ahead for {view.key}")
            else:
                prefixed = dist.PrefixStore(f"{view.key}/cross{self.local}", self._store(address))
                ranks = [r * self.k + self.local for r in range(len(view.members))]
                self._group = cross_group(prefixed, view.me, len(view.members), self.timeout, ranks)
            return self._group
        except Exception as e:
            what = f"making the cross-region group on {address}"
            raise self._making_failed(what, view.regions, view, t0, e) from e

    def _making_failed(
        self, what: str, peers: Sequence[str], view: View, t0: float, e: BaseException
    ) -> CommError:
        """The CommError of a group that could not be made (within exchange_timeout_s)."""
        text = collective_failure(
            what, peers, self.local, f" at step {view.step}", time.perf_counter() - t0, e,
            timeout_s=self.options.exchange_timeout_s, knob="elastic.exchange_timeout_s",
        )  # fmt: skip
        return CommError(text)

    def _store(self, address: str) -> Any:
        """A client of the TCP store at `address` (kept: quorums reuse their leaders' stores)."""
        store = self._stores.get(address)
        if store is None:
            store = self._stores[address] = store_client(address, self.timeout)
        return store

    def _verify(self, view: View, cross: Any) -> None:
        """After a change of membership: every present region holds the same outer copy."""
        from .hook import ReplicaMismatch

        mine = torch.tensor([self.replica.digest()], dtype=torch.int64)
        out = torch.zeros(len(view.members), dtype=torch.int64)
        t0 = time.perf_counter()
        try:
            self.transfer.wait(lambda: [all_gather_single(out, mine, group=cross, async_op=True)], view,
                       f"the {self.replica.what}'s check", t0)  # fmt: skip
        except CommError as e:
            log.warning("cloudtrain elastic: %s check not done: %s", self.replica.what, e)
            self._group_key = ""
            return
        if len(set(out.tolist())) != 1:
            raise ReplicaMismatch(
                f"cloudtrain elastic: after step {view.step} the {self.replica.what} differs between "
                "the regions: "
                + ", ".join(
                    f"{m.region} {d:#x}" for m, d in zip(view.members, out.tolist(), strict=True)
                )
            )

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"commits": self.commits}
        if self.book is not None:
            out["links"] = self.book.rows()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.commits = int(state.get("commits", 0))
        if self.book is not None:
            self.book = LinkBook.from_rows(state.get("links", ()))

    def snapshot(self) -> dict[str, Any]:
        return self.stats.snapshot()


class ElasticSteps(ElasticRegion):
    """This region's part in an elastic per-step run (docs/elastic.md, "Per-step mode"): every
    step's gradients cross regions on the last quorum's groups; a step whose exchange failed is
    dropped by every region that saw it fail and a new quorum is asked at once.

    Between two steps (the optimizer's step hooks, CloudDDP registers them): `before_step`
    agrees inside the region whether the step's exchange completed - where it did not, the
    gradients are set to None (the optimizer then changes nothing), the hook's step and
    residuals are put back as they were, and the step is not counted; `after_step` counts it and
    asks a quorum every `quorum_every` steps and after a failed step; after a spot notice the
    region leaves instead (it holds nothing the others need). A region that dropped a step the
    others completed is one step behind at the next quorum and heals from a peer (its
    parameters, buffers, optimizer state, step and bucket layouts; its residuals start at
    zero). Every quorum whose groups changed points the hook at the present regions
    (`CommState.use_regions`), with "auto" under a controller made for them (`_controller`);
    one whose membership changed checks their parameters' digests (regions that trained apart
    heal from one part first: cloudtrain.quorum._agreeing); every quorum makes their buffers
    equal."""

    def __init__(self, config: Any, topo: Topology, replica: Any, identity: dict[str, str]) -> None:
        super().__init__(config, topo, replica, identity)
        self.comm = replica.comm
        self.every = self.options.quorum_every
        self.buffers: Any = None
        """The module's buffers (cloudtrain.buffers), made equal across regions at every quorum:
        DDP broadcasts them inside the region only, as its process group is the region."""
        self._ok = True
        self._view: View | None = None
        """The last quorum's view whose groups the hook uses."""
        self._region_groups: dict[int, Any] = {}
        self._generation = 0
        """Dropped steps so far: the region's groups are made anew after one (a collective one
        rank issued alone leaves a gloo group unusable)."""
        self._quiet_until = 0
        """No regular quorum before this many steps committed: a region left (View.quiet)."""
        self.calibration: list[float] | None = None
        """With "auto": the CPU seconds per element of each rung the regions agreed on."""
        self._times: collections.deque[float] = collections.deque(maxlen=QUIET_WINDOW)
        self._last = time.perf_counter()

    def _attempt(self, view: View) -> tuple[bool, bool]:
        ready, cross, loaded, changed = self._prepare(view)
        if not ready:
            return False, loaded
        why = ""
        made = self.k > 1 and view.me not in self._region_groups  # alike on the region's ranks
        try:
            region = self._region_group(view)
        except CommError as e:
            region, why = None, str(e)
        if made and not self._agree(not why):  # a retry starts anew, on keys nobody half-wrote
            self._new_region_groups()
            return self._failed(view, why or "another rank of the region failed"), loaded
        held = self.comm.path.topo.groups
        new = (
            held.get(f"cross{self.local}") is not cross
            or held.get(f"region{view.me}") is not region
        )
        if changed or new:
            topo = view_topology(view, self.local, self.k, region, cross)
            if cross is None:  # alone: the region's own all-reduce, DDP's hook
                topo.groups["dense"] = region
            # with "auto", a controller for new groups (alike in every region: `changed` is
            # this region's view of the last quorum, which a pause may have moved on)
            controller = None if new else self.comm.controller
            if self.auto and new and cross is not None:
                try:
                    controller = self._controller(view, topo, cross)
                except CommError as e:
                    why = str(e)
                if not self._agree(not why):
                    return self._failed(view, why or "another rank of the region failed"), loaded
            self.comm.use_regions(topo, self.timeout, controller)
        self._view = view
        if view.quiet:  # the same count in every region: joiners took the source's commits
            self._quiet_until = self.commits + view.quiet
        if self.buffers is not None:
            self._reconcile_buffers(view, cross, self.buffers)
        return self._committed(view, cross, changed, None), loaded

    def _controller(self, view: View, topo: Topology, cross: Any) -> Any:
        """With "auto": a controller for the regions of `view` (cloudtrain.controller), made
        alike in every region. The links are agreed as the outer loop's plans agree them
        (`_agreed_links`: only pairs no region measured are probed), and so is the CPU time of
        each rung (the first region's, timed once); its decisions run on the quorum's group of
        every present rank, its pipeline is never deeper than 0, and it starts afresh - seeded
        from the links, its quality guard at its first ceiling - at every change of the
        regions' groups. A failure is a CommError."""
        from .controller import Controller, calibrate

        comm = self.comm
        mine = self.calibration
        if mine is None and self.local == 0:  # timed once, on the region's own CPU
            codecs, options = comm.path.codecs, self.config.controller
            senders = len(view.members)
            mine = calibrate(codecs, options, comm.shard_numels(), senders, comm.layouts.device)
        values, _ = self._agreed_links(view, cross, mine)
        self.calibration = values[0]  # the first region's: the same everywhere
        topo.links = self.book.matrix(view.regions, self.k)
        topo.groups["control"] = self._control(view)
        return Controller(
            dataclasses.replace(self.config, staleness=0), topo, comm.path.codecs,
            comm.shard_numels(), comm.layouts.device, calibration=self.calibration, own=topo,
            start=comm.step,
        )  # fmt: skip

    def _control(self, view: View) -> Any:
        """The quorum's group of every present rank (made ahead where its cross groups were)."""
        if self.control is not None:
            return self.control
        t0 = time.perf_counter()
        n = len(view.members) * self.k
        try:
            prefixed = dist.PrefixStore(f"{view.key}/control", self._store(view.store))
            self.control = cross_group(prefixed, view.me * self.k + self.local, n, self.timeout,
                                       range(n))  # fmt: skip
        except Exception as e:
            raise self._making_failed("making the decisions' group", view.regions, view, t0,
                                      e) from e  # fmt: skip
        return self.control

    def _region_group(self, view: View) -> Any:
        """The region's own group, its ranks numbered as in `view`, where it is region `me`
        (rank me*k + i; `cross_group`): the hook's reduce-scatter addresses them so. Made once
        per index and generation, on the region's first rank's store."""
        if self.k == 1:
            return None
        me = view.me
        group = self._region_groups.get(me)
        if group is not None:
            return group
        t0 = time.perf_counter()
        try:
            prefixed = dist.PrefixStore(
                f"{view.members[me].replica_id}/region{me}/{self._generation}",
                self._store(self.members.store_address),
            )
            ranks = [me * self.k + i for i in range(self.k)]
            group = cross_group(prefixed, self.local, self.k, self.timeout, ranks)
        except Exception as e:
            raise self._making_failed(
                "making the region's group", [self.region], view, t0, e
            ) from e
        self._region_groups[me] = group
        return group

    def _new_region_groups(self) -> None:
        """The region's groups dropped, the next made on new keys (every rank of the region)."""
        for group in self._region_groups.values():
            release_group(group)
        self._region_groups.clear()
        self._generation += 1

    def _verify_change(self, view: View, cross: Any) -> None:
        """After a quorum whose membership changed: the present regions' parameters compared,
        with no message - the contributors announced their digests in the quorum (taken between
        the same steps), and a joiner's state was checked against its source's on loading."""
        from .hook import ReplicaMismatch

        digests = {view.members[i].digest for i in view.contributors}
        if len(digests) > 1:
            seen = ", ".join(
                f"{view.members[i].region} {view.members[i].digest:#x}" for i in view.contributors
            )
            raise ReplicaMismatch(
                f"cloudtrain elastic: at step {view.step} the parameter sets differ between the "
                f"regions: {seen}"
            )

    def verify(self) -> None:
        """CloudDDP.verify_replicas() in a per-step elastic run: the present regions' parameters'
        digests compared now, each rank with its counterparts (ReplicaMismatch)."""
        view = self._view
        if view is not None and len(view.members) > 1 and self._group is not None:
            self._verify(view, self._group)

    def before_step(self) -> None:
        """Before the optimizer's step (every rank of the region): drop the step where any rank
        of the region saw its exchange fail."""
        failure = self.comm.step_failure
        self._ok = self._agree(failure is None)
        if self._ok:
            return
        self.comm.drop_step()
        for p in self.replica.module.parameters():
            p.grad = None
        self.stats.failed_syncs += 1
        self._group_key = ""  # a group a collective failed on is not used again
        self._new_region_groups()
        log.warning(
            "cloudtrain elastic: region %s dropped step %s (regions %s): %s", self.region,
            self.comm.step, list(self.members.last),
            (str(failure) if failure else "another rank of the region failed").splitlines()[0],
        )  # fmt: skip

    def after_step(self) -> None:
        """After the optimizer's step: count it; a quorum when due (module docstring). After a
        spot notice the region leaves at its next quorum, announced (Member.leaving): the others
        go on without it from there, with no step failed and no heartbeat timeout waited for,
        and ask no regular quorum until its heartbeats have timed out in the Lighthouse."""
        now = time.perf_counter()
        self._times.append(now - self._last)
        self._last = now
        if self._ok:
            self.commits += 1
        if self.guard is not None and not self.members.leaving and self.guard.should_stop():
            if not self._ok:  # the others drop this step too, and find the region gone
                self._leave("")
            step_s = max(statistics.median(self._times), 1e-3)
            self.members.leaving = max(1, math.ceil(self.options.heartbeat_timeout_s / step_s))
        due = self.commits % self.every == 0 and self.commits >= self._quiet_until
        if self._ok and not due:  # (a leaving region too: the others would not be there)
            return
        self._timed_until_committed(self.comm.step, 0)
        self._last = time.perf_counter()  # a quorum's seconds are not a step's
