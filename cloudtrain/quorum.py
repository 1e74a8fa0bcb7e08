"""Who takes part in an elastic run's sync, decided alike on every rank (cloudtrain.elastic).

torchft's Lighthouse gives a quorum: the regions asking at a sync, each with what it announced
(`Member`). `decide` is a pure function of it, so every rank of every region computes the same
`View` with no further message:

- who is refused (another model, config, release or region size than the run's; a second
  process claiming a region that is present), and who leaves (a spot notice, per step),
- who contributes to this sync (the regions at the sync with the most syncs committed, of
  those the ones that agree on their digest where others trained apart) and who joins (every
  other: a new or restarted region, one whose last sync failed, or one that trained apart),
- from which contributor each joiner takes the state (the fastest measured link to it),
- which cross-region groups the sync runs on (reused where every member holds the same ones,
  made for the same members).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .topology import AUTO_REGION


class RegionLeft(Exception):
    """This region left the run after a sync (a spot notice): its pseudo-gradient was handed over.
    Raised from `optimizer.step()` on every rank of the region; save and exit 0."""


class ElasticRefused(RuntimeError):
    """This region may not join the run (another model, config or release; a region name that
    is present already). The others go on without it."""


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
    """CRC of its outer copy when it asked (per step: of its parameters)."""
    store: str
    """host:port of its TCP store, for the groups of a quorum it leads."""
    group: str = ""
    """The key of the cross groups it holds and whose last sync committed ("": none)."""
    links: tuple[tuple[Any, ...], ...] = ()
    """The links between regions it knows: cloudtrain.replan.LinkBook.rows()."""
    leaving: int = 0
    """> 0: it leaves the run at this quorum (per step, after a spot notice), and the others ask
    no regular quorum for this many steps, while its heartbeats time out in the Lighthouse."""
    spares: str = ""
    """The key of the quorum for whose members less one region it made cross groups ahead
    (cloudtrain.elastic.SpareGroups; "": none)."""
    synced: str = ""
    """The quorum of its last committed sync (`View.name`; "": none yet): regions equally far
    along with other digests trained apart where theirs differ (`_agreeing`)."""

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
            links=tuple(tuple(row) for row in data.get("links") or ()),
            leaving=int(data.get("leaving", 0)),
            spares=str(data.get("spares", "")),
            synced=str(data.get("synced", "")),
        )

    @property
    def rank_key(self) -> tuple[int, int]:
        return (self.commits, self.step)


@dataclass(frozen=True)
class View:
    """What one quorum means for this sync (`decide`)."""

    quorum_id: int
    key: str
    """Names this quorum's cross groups: the one every member holds, where it was made for these
    members (they are reused: making gloo groups across the WAN costs round trips), else a new
    one for this quorum. It ends with the members' region names: a group that a lost region was
    part of is never reused (a collective over it would wait for the lost region)."""
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
    """This region's index, or -1 when it was refused or left."""
    left: tuple[str, ...] = ()
    """Regions that leave the run at this quorum (Member.leaving): not members."""
    quiet: int = 0
    """Steps from this quorum in which the members ask no regular quorum (Member.leaving)."""
    created: float = 0.0
    """When the Lighthouse made the quorum (seconds since the epoch, its clock)."""

    @property
    def regions(self) -> tuple[str, ...]:
        return tuple(m.region for m in self.members)

    @property
    def name(self) -> str:
        """This quorum among all of the run's (its id and the Lighthouse's time of it)."""
        return f"{self.quorum_id}@{self.created!r}"

    @property
    def store(self) -> str:
        return self.members[self.contributors[0]].store


def _differs(mine: tuple, run: tuple) -> str:
    a, b = dict(mine), dict(run)
    names = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return ", ".join(f"{k} {a.get(k)!r} (the run's: {b.get(k)!r})" for k in names)


def decide(
    participants: Sequence[Member], quorum_id: int, key: str, me: str, created: float = 0.0
) -> View:
    """The view of a quorum (module docstring); the same on every rank that has the quorum.

    The run is what the most advanced participant (most syncs committed, then the latest sync
    step) runs, ties to the identity most of them share, then to the smallest region name; a
    participant of another identity is refused. Of two claiming one region, the more advanced
    stays (ties: the smaller replica id). If some members are at a sync, the contributors are
    those of them with the most syncs committed and the latest step, and of those the ones that
    agree on the digest (`_agreeing`); else (all are starting) those equal to the most advanced
    (syncs and outer copy). Everyone else joins, each from the contributor with the
    fastest measured link to it (in turn where none is measured: `_sources`). The
    cross groups are reused where every member holds the same ones, made for the same members
    (`key` and their names otherwise)."""
    if not participants:
        raise ValueError("decide: a quorum has at least one participant")
    top = max(p.rank_key for p in participants)
    tops = [p for p in participants if p.rank_key == top]
    by_identity: dict[tuple, list[Member]] = {}
    for p in tops:
        by_identity.setdefault(p.identity, []).append(p)
    run = _most_shared(list(by_identity.values()), lambda p: p.region)[0].identity
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
    left = tuple(r for r in sorted(by_region) if by_region[r].leaving)
    staying = [p for r, p in by_region.items() if r not in left]
    if (
        left
        and staying
        and max(p.rank_key for p in staying) < max(p.rank_key for p in by_region.values())
    ):
        left = ()  # nobody else holds the run's state: the leavers hand it over first
    quiet = max((by_region[r].leaving for r in left), default=0)
    members = tuple(by_region[r] for r in sorted(by_region) if r not in left)
    if not members:  # every valid participant leaves
        return View(quorum_id, key, (), (), (), {}, tuple(refused), -1, 0, -1, left, quiet, created)
    key = _group_key(members, key)
    syncing = [i for i, m in enumerate(members) if m.step >= 0]
    if syncing:
        best = max(members[i].rank_key for i in syncing)
        contributors = _agreeing([i for i in syncing if members[i].rank_key == best], members)
        step, fragment = best[1], members[contributors[0]].fragment
    else:
        lead = max(range(len(members)), key=lambda i: (members[i].commits, -i))
        ref = members[lead]
        contributors = tuple(
            i for i, m in enumerate(members) if (m.commits, m.digest) == (ref.commits, ref.digest)
        )
        step, fragment = -1, 0
    joiners = tuple(i for i in range(len(members)) if i not in contributors)
    sources = _sources(members, contributors, joiners)
    index = next((i for i, m in enumerate(members) if m.replica_id == me), -1)
    return View(
        quorum_id, key, members, contributors, joiners, sources, tuple(refused), step,
        fragment, index, left, quiet, created,
    )  # fmt: skip


def _agreeing(candidates: Sequence[int], members: Sequence[Member]) -> tuple[int, ...]:
    """Of the members equally advanced (the same syncs committed, the same step), those that
    contribute. Where their digests differ and no two that differ committed their last sync in
    the same quorum, they trained apart (with min_regions 1, one went on alone while the other
    was cut off, then the other way round): the digest most of them share contributes (ties:
    the smallest region name's), and the others take its state as joiners. Where two that differ
    did commit the same last sync, their replicas drifted (a bug, or arithmetic that differs
    between their machines): all contribute, and the replica check raises ReplicaMismatch."""
    by_digest: dict[int, list[int]] = {}
    for i in candidates:
        by_digest.setdefault(members[i].digest, []).append(i)
    if len(by_digest) == 1:
        return tuple(candidates)
    synced = [{members[i].synced for i in group} for group in by_digest.values()]
    if any(a & b for k, a in enumerate(synced) for b in synced[k + 1 :]):
        return tuple(candidates)
    return tuple(_most_shared(list(by_digest.values()), lambda i: members[i].region))


def _most_shared(groups: Sequence[Sequence[Any]], name: Any) -> Sequence[Any]:
    """The largest of `groups`; ties to the one holding the smallest `name(item)`."""
    return min(groups, key=lambda g: (-len(g), min(name(x) for x in g)))


def spare_key(parent: str, lost: str, regions: Sequence[str]) -> str:
    """The key of the cross groups made ahead under quorum key `parent` for its members less
    `lost` (`regions`, in order; cloudtrain.elastic.SpareGroups)."""
    return f"{parent}/spare:{lost}/{'+'.join(regions)}"


def is_spare_key(key: str) -> bool:
    """Whether `key` names groups made ahead (`spare_key`)."""
    return "/spare:" in key


def _made_for(key: str) -> list[str]:
    """The regions a group key's groups were made for (its last part)."""
    return key.rsplit("/", 1)[-1].split("+")


def _group_key(members: Sequence[Member], fresh: str) -> str:
    """The key of the cross groups a quorum of `members` runs on. A key ends with the regions its
    groups were made for: the groups every member holds where they were made for these
    members; else, where these are the members of the quorum whose spares every member made
    less one region, that spare; else new ones (`fresh` and the regions)."""
    names = [m.region for m in members]
    made_for = "/" + "+".join(names)
    held = {m.group for m in members}
    reuse = held.pop() if len(held) == 1 else ""
    if reuse.endswith(made_for):
        return reuse
    spares = {m.spares for m in members}
    parent = spares.pop() if len(spares) == 1 else ""
    lost = set(_made_for(parent)) - set(names) if parent else set()
    if len(lost) == 1 and set(names) < set(_made_for(parent)):
        return spare_key(parent, lost.pop(), names)
    return fresh + made_for


def _sources(
    members: Sequence[Member], contributors: Sequence[int], joiners: Sequence[int]
) -> dict[int, int]:
    """Each joiner's source: the contributor with the fastest link to it that the members have
    measured (their books merged: cloudtrain.replan), then the one with the fewest joiners so
    far, then the first - so, with nothing measured, the joiners spread over the contributors
    in turn."""
    from .replan import LinkBook

    book = LinkBook.merged(LinkBook.from_rows(m.links) for m in members)
    load = dict.fromkeys(contributors, 0)
    out = {}
    for j in joiners:
        to = members[j].region

        def order(c: int, to: str = to) -> tuple[float, int, int]:
            return (-(book.bandwidth(members[c].region, to) or 0.0), load[c], c)

        out[j] = min(contributors, key=order)
        load[out[j]] += 1
    return out


def identity_of(description: dict[str, Any]) -> dict[str, str]:
    """A region's identity (release, config, model) as short strings for the quorum's data."""
    model = hashlib.sha256(repr(description["model"]).encode()).hexdigest()[:16]
    return {"version": str(description["version"]), "config": description["config"], "model": model}
