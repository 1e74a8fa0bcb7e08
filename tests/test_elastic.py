"""Regions that come and go (cloudtrain.elastic): the quorum decision, and real runs.

The runs launch every region on its own (its own processes and torch.distributed world) with
`cloudtrain.tools.chaos`'s worker against a real torchft Lighthouse; faults are SIGKILLs of
every process of a region, a spot notice comes from a fake metadata server (tests/test_spot.py).
Every process and network namespace started is removed again (Cluster.stop, netem teardown).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from cloudtrain.quorum import Member, decide
from cloudtrain.tools import chaos
from tests.distributed import free_port
from tests.test_netem import needs_root
from tests.test_spot import NOTICE, _serve_imds

IDENTITY = (("config", "c"), ("model", "m"), ("ranks", "2"), ("version", "1"))
HEARTBEAT_S = 1.5
"""The Lighthouse's heartbeat timeout in these runs: a lost region is noticed within it."""


def member(region: str, commits: int = 3, step: int = 30, identity=IDENTITY, rid=None) -> Member:
    return Member(rid or f"{region}:x", region, identity, commits, step, 0, 7, f"{region}:1")


# -- the quorum decision (pure) ---------------------------------------------------------------


def test_decide_behind_region_joins_from_a_contributor() -> None:
    view = decide([member("b"), member("a"), member("c", commits=1, step=-1)], 5, "k", "c:x")
    assert view.regions == ("a", "b", "c")
    assert view.contributors == (0, 1) and view.joiners == (2,) and view.sources == {2: 0}
    assert view.step == 30 and view.me == 2 and not view.refused


def test_decide_refuses_another_model_and_a_second_claim_on_a_region() -> None:
    other = (("config", "c"), ("model", "OTHER"), ("ranks", "2"), ("version", "1"))
    view = decide(
        [member("a"), member("b"), member("z", identity=other), member("a", 1, -1, rid="a:y")],
        1, "k", "z:x",
    )  # fmt: skip
    why = dict(view.refused)
    assert view.me == -1 and view.regions == ("a", "b")
    assert "model 'OTHER' (the run's: 'm')" in why["z:x"]
    assert "region 'a' is in the run already" in why["a:y"]


def test_decide_parts_that_trained_apart_heal_from_the_part_most_agree_on() -> None:
    """Equally advanced regions with other digests, whose last syncs were in other quorums,
    trained apart (min_regions 1, each alone in turn): the digest most of them share
    contributes (ties: the smallest region name's), the others join from it, where averaging
    them all failed the replica check. Where two that differ committed their last sync in the
    same quorum, their replicas drifted: all contribute, and the replica check raises."""
    a, b, c = (
        dataclasses.replace(member(r), digest=d, synced=q)
        for r, d, q in zip("abc", (5, 9, 9), ("1@1.0", "2@2.0", "2@2.0"), strict=True)
    )
    view = decide([a, b, c], 1, "k", "a:x")
    assert view.contributors == (1, 2) and view.joiners == (0,) and view.step == 30
    view = decide([a, b], 1, "k", "b:x")
    assert view.contributors == (0,) and view.joiners == (1,) and view.sources == {1: 0}
    view = decide([b, c], 1, "k", "b:x")  # agreeing: both contribute, as before
    assert view.contributors == (0, 1) and not view.joiners
    drifted = dataclasses.replace(a, synced="2@2.0")
    view = decide([drifted, b], 1, "k", "b:x")
    assert view.contributors == (0, 1) and not view.joiners


def test_decide_all_starting_contribute_when_equal() -> None:
    view = decide([member("a", 0, -1), member("b", 0, -1)], 1, "k", "a:x")
    assert view.step == -1 and view.contributors == (0, 1) and view.joiners == ()


def test_decide_reuses_the_cross_groups_only_where_every_member_holds_them() -> None:
    a, b, c = member("a"), member("b"), member("c")
    held = [dataclasses.replace(m, group="g/1/a+b") for m in (a, b)]
    assert decide(held, 2, "fresh", "a:x").key == "g/1/a+b"
    assert decide([held[0], b], 2, "fresh", "a:x").key == "fresh/a+b"
    assert decide([*held, member("c", 1, -1)], 2, "fresh", "a:x").key == "fresh/a+b+c"
    # a group that c was part of, c lost: a collective on it would wait for c - made anew
    lost = [dataclasses.replace(m, group="g/1/a+b+c") for m in (a, b)]
    assert decide(lost, 3, "fresh", "a:x").key == "fresh/a+b"
    assert decide([*lost, dataclasses.replace(c, group="g/1/a+b+c")], 3, "f", "a:x").key == (
        "g/1/a+b+c"
    )


def test_decide_runs_the_survivors_of_a_lost_region_on_the_groups_made_ahead() -> None:
    """Every member made spare groups under quorum key K (SpareGroups): a quorum of K's regions
    less one runs on the spare made for it; less two, or a region not in K, on new groups."""
    parent = "q7/1.2/a+b+c+d"
    a, b, _, d, e = (dataclasses.replace(member(r), spares=parent) for r in "abcde")
    assert decide([a, b, d], 8, "fresh", "a:x").key == "q7/1.2/a+b+c+d/spare:c/a+b+d"
    assert decide([a, b], 8, "fresh", "a:x").key == "fresh/a+b"  # two lost
    assert decide([a, b, d, e], 8, "fresh", "a:x").key == "fresh/a+b+d+e"
    assert decide([a, b, member("d")], 8, "fresh", "a:x").key == "fresh/a+b+d"  # d holds none


def test_decide_gives_a_joiner_the_contributor_with_the_fastest_measured_link() -> None:
    """The links the members announce (cloudtrain.replan) pick each joiner's source: the
    fastest to it, whoever measured it; unmeasured, the joiners spread over the contributors."""
    links = tuple((a, b, 0.08, bw, 1) for a, b, bw in (("a", "d", 1e6), ("b", "d", 5e6),
                                                       ("c", "d", 2e6), ("a", "e", 3e6)))  # fmt: skip
    ps = [member("a"), member("b"), member("c"), member("d", 1, -1), member("e", 1, -1)]
    view = decide([dataclasses.replace(ps[0], links=links), *ps[1:]], 1, "k", "d:x")
    assert view.joiners == (3, 4) and view.sources == {3: 1, 4: 0}
    view = decide([*ps, member("f", 1, -1)], 1, "k", "d:x")  # nothing measured: in turn
    assert view.sources == {3: 0, 4: 1, 5: 2}


def test_decide_leaves_out_a_region_that_announces_it_leaves() -> None:
    """Per step, a spot notice: the leaver takes part in the quorum announcing it leaves, the
    others' view is without it (no failed step) and says how long to ask no regular quorum."""
    leaving = dataclasses.replace(member("b"), leaving=12)
    view = decide([member("a"), leaving, member("c")], 4, "k", "a:x")
    assert view.regions == ("a", "c") and view.left == ("b",) and view.quiet == 12
    assert view.contributors == (0, 1) and view.me == 0 and view.key == "k/a+c"
    mine = decide([member("a"), leaving, member("c")], 4, "k", "b:x")
    assert mine.me == -1 and "b" in mine.left and not mine.refused
    alone = decide([leaving], 5, "k", "b:x")
    assert alone.members == () and alone.left == ("b",) and alone.me == -1
    # the others are joining: b holds the run's state, so it stays to hand it over first
    view = decide([leaving, member("c", 0, -1)], 6, "k", "b:x")
    assert view.left == () and view.regions == ("b", "c") and view.sources == {1: 0}


def test_decide_is_the_same_whatever_the_order() -> None:
    ps = [member("a"), member("b", 2, 20), member("c", 3, 30), member("d", 0, -1)]
    views = set()
    for seed in range(6):
        random.Random(seed).shuffle(ps)
        v = decide(ps, 1, "k", "a:x")
        views.add((v.regions, v.contributors, v.joiners, tuple(sorted(v.sources.items()))))
    assert len(views) == 1


def test_elastic_config_says_what_it_needs() -> None:
    from cloudtrain import CompressionConfig
    from cloudtrain.config import OuterConfig

    assert CompressionConfig(elastic=True).codec == "auto"  # a controller per membership
    with pytest.raises(ValueError, match="global_batch=64.*leave global_batch unset"):
        CompressionConfig(global_batch=64, elastic=True)
    with pytest.raises(ValueError, match="staleness=1"):
        CompressionConfig(codec="topk", level=0.01, staleness=1, elastic=True)
    with pytest.raises(ValueError, match="verify_every=5"):
        CompressionConfig(codec="topk", level=0.01, verify_every=5, elastic=True)
    with pytest.raises(ValueError, match="quorum_every"):
        CompressionConfig(codec="topk", level=0.01, elastic={"quorum_every": 0})
    assert CompressionConfig(codec="topk", level=0.01, elastic=True).elastic.quorum_every == 10
    auto = CompressionConfig.resolve("diloco", elastic=True)  # planned for the regions present
    assert auto.outer.sync_every == auto.outer.codec == "auto" and auto.elastic.min_regions == 1
    with pytest.raises(ValueError, match="overlap=1"):
        CompressionConfig(outer=OuterConfig(overlap=1), elastic=True)
    with pytest.raises(ValueError, match="unknown elastic options"):
        CompressionConfig(
            outer=OuterConfig(sync_every=10, codec="quant", level=8), elastic={"x": 1}
        )
    with pytest.raises(ValueError, match="heartbeat_s=5.0 is not below.*timeout_s=3.0"):
        CompressionConfig(elastic={"heartbeat_s": 5.0})
    fixed = OuterConfig(sync_every=10, codec="quant", level=8)
    a = CompressionConfig(outer=fixed, elastic={"lighthouse": "http://a:1"})
    b = CompressionConfig(outer=fixed, elastic={"lighthouse": "http://b:2"})
    assert a.fingerprint() == b.fingerprint()  # regions may reach the Lighthouse by other names
    assert (
        a.fingerprint() != CompressionConfig(outer=fixed, elastic={"min_regions": 2}).fingerprint()
    )


# -- real runs --------------------------------------------------------------------------------


def worker_args(steps: int, pace: float, **extra: object) -> list[str]:
    args = {
        "steps": steps, "sync-every": 10, "codec": "quant", "level": 8, "min-regions": 1,
        "start-regions": 2, "hidden": 64, "batch": 64, "lr": 0.05, "seed": 0,
        "exchange-timeout": 10, "quorum-timeout": 20, "pace": pace, "heartbeat": HEARTBEAT_S,
        **extra,
    }  # fmt: skip
    out = []
    for k, v in args.items():
        out += [f"--{k}"] if v is True else [f"--{k}", str(v)]
    return out


@contextmanager
def cluster_on(net, regions, args, tmp_path, min_regions=1) -> Iterator[chaos.Cluster]:
    ports = [free_port() for _ in range(len(regions) + 1)]
    cluster = chaos.Cluster(net, regions, args, log_dir=str(tmp_path), ports=ports)
    try:
        cluster.start_lighthouse(min_regions, HEARTBEAT_S)
        yield cluster
    finally:
        cluster.stop()
        for run in cluster.history:
            assert not run.alive()


def wait_until(cond, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while not cond():
        if time.time() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


def logs(tmp_path, region: str) -> str:
    return "".join(p.read_text() for p in sorted(tmp_path.glob(f"{region}-*-r0.log")))


def first_sync_after_join_equal(cluster: chaos.Cluster, survivor: str, joiner) -> int:
    """The joiner's first digest line (a sync step) equals the survivor's at the same step."""
    line = next(ln for ln in joiner.lines if "digest" in ln)
    theirs = next(
        ln for run in cluster.history if run.name == survivor for ln in run.lines
        if ln["step"] == line["step"] and "digest" in ln
    )  # fmt: skip
    assert line["digest"] == theirs["digest"], (line, theirs)
    return line["step"]


def kill_and_restart(
    tmp_path, args: list[str], wan: dict, victim: str, kill_at: int, wait_s: float
) -> tuple:
    """Regions on the emulated WAN (`Emulator(**wan)`, a region "lh" for the Lighthouse), the
    worker run with `args`: every process of `victim` SIGKILLed at its step `kill_at`, and
    started again with the same command once r0 has gone on without it; the run waited for
    (`wait_s`) and everything torn down. (cluster, its first runs by region, the restarted)."""
    from cloudtrain.tools.netem import Emulator, teardown

    name = f"el{os.getpid() % 10000}-{uuid.uuid4().hex[:3]}"
    regions = [r for r in wan["regions"] if r != "lh"]
    try:
        with (
            Emulator(**wan, name=name) as net,
            cluster_on(net, regions, args, tmp_path) as cluster,
        ):
            runs = {r: cluster.start(r) for r in regions}
            wait_until(lambda: runs[victim].step >= kill_at, 200, f"{victim} at step {kill_at}")
            runs[victim].kill()
            gone = lambda: any(victim not in ln["regions"] for ln in runs["r0"].lines)  # noqa: E731
            wait_until(gone, 60, f"r0 going on without {victim}")
            again = cluster.start(victim)
            cluster.wait(wait_s)
    finally:
        teardown(name)
    return cluster, runs, again


def kill_r1_and_restart(tmp_path, args: list[str], wait_s: float) -> tuple:
    """2 regions x 2 ranks at 200 Mbit/s, 80 ms: r1 SIGKILLed at its step 30 and started again
    (kill_and_restart). (cluster, r0, the killed r1, the restarted r1)."""
    wan = {"regions": {"r0": 2, "r1": 2, "lh": 1}, "mbit": 200, "rtt_ms": 80}
    cluster, runs, again = kill_and_restart(tmp_path, args, wan, "r1", 30, wait_s)
    return cluster, runs["r0"], runs["r1"], again


@needs_root
@pytest.mark.timeout(240)
def test_region_killed_survivors_go_on_and_it_rejoins_bit_identical(tmp_path) -> None:
    """2 regions x 2 ranks at 200 Mbit/s, 80 ms: SIGKILL every process of r1 at step 30; r0
    keeps its processes and goes on (its longest step: detection + one sync); r1 started again
    with the same command heals from r0 and equals it from its first sync."""
    cluster, r0, r1, again = kill_r1_and_restart(tmp_path, worker_args(300, 0.08), 180)
    around = chaos.survivors_around(cluster, r1)["r0"]
    print("elastic kill figures:", around)
    sync = around["normal_sync_s"]
    # noticed once its heartbeats stop, at r0's next sync (10 steps later at most)
    assert around["detected_s"] is not None and around["detected_s"] <= HEARTBEAT_S + 3.0
    assert around["longest_step_s"] <= HEARTBEAT_S + sync + 1.0, around
    assert r0.procs[0].returncode == 0 and again.procs[0].returncode == 0
    a, b = r0.result, again.result
    assert a["steps"] == b["steps"] == 300 and a["digest"] == b["digest"]
    assert a["elastic"]["lost"] == ["r1"] and "r1" in a["elastic"]["joined"]
    assert b["elastic"]["recovery_bytes_received"] > 0
    assert a["elastic"]["recovery_bytes_sent"] == b["elastic"]["recovery_bytes_received"]
    first_sync_after_join_equal(cluster, "r0", again)


@needs_root
@pytest.mark.timeout(300)
def test_per_step_region_killed_survivors_drop_one_step_and_it_rejoins(tmp_path) -> None:
    """Per-step mode (every step's gradients cross, 8-bit with error feedback), 2 regions x 2
    ranks at 200 Mbit/s, 80 ms: SIGKILL every process of r1 at step 30. r0's exchange fails at
    once (the peer's connections close), it drops that one step - nothing applied, its step and
    residuals as before it - asks a quorum without r1 and goes on; its longest step is within
    detection + one normal step. r1 started again with the same command heals from r0 at r0's
    next quorum and equals it bit for bit from then on."""
    args = worker_args(260, 0.02, mode="step")
    cluster, r0, r1, again = kill_r1_and_restart(tmp_path, args, 240)
    around = chaos.survivors_around(cluster, r1)["r0"]
    print("per-step kill figures:", around, "rejoined", chaos.rejoined_s(cluster, again))
    assert around["detected_s"] is not None and around["detected_s"] <= HEARTBEAT_S + 3.0
    normal = around["normal_step_s"]
    assert around["longest_step_s"] <= HEARTBEAT_S + normal + 1.0, around
    assert r0.procs[0].returncode == 0 and again.procs[0].returncode == 0
    a, b = r0.result, again.result
    assert a["steps"] == b["steps"] == 260 and a["digest"] == b["digest"]
    assert a["elastic"]["lost"] == ["r1"] and "r1" in a["elastic"]["joined"]
    assert a["elastic"]["failed_syncs"] >= 1  # the step r1 died in, dropped
    assert a["elastic"]["recovery_bytes_sent"] == b["elastic"]["recovery_bytes_received"] > 0
    first_sync_after_join_equal(cluster, "r0", again)
    assert a["accuracy"] > 0.9, a


def plans_seen(run) -> list[tuple[tuple[str, ...], int]]:
    """(regions, H) of each sync a region's first rank printed, in order, repeats dropped."""
    out: list[tuple[tuple[str, ...], int]] = []
    for ln in run.lines:
        if "h" in ln and (not out or out[-1] != (tuple(ln["regions"]), ln["h"])):
            out.append((tuple(ln["regions"]), ln["h"]))
    return out


def kill_r2_of_three_and_restart(tmp_path, args: list[str], kill_at: int, wait_s: float) -> tuple:
    """3 regions of one rank on the emulated WAN whose links differ - r2 far (180 ms to the
    others, 80 ms between r0 and r1) and its uplink slow (50 Mbit/s), r0's 100, r1's 200 - r2
    SIGKILLed at its step `kill_at` and started again (kill_and_restart). (cluster, r0, r1, the
    restarted r2)."""
    up = {"r0": 100, "r1": 200, "r2": 50, "lh": 100}
    down = {"r0": 200, "r1": 200, "r2": 200, "lh": 100}
    rtt = {"r0": 80, "r1": 80, "r2": 280, "lh": 0}  # a pair's round trip: the mean of its two
    wan = {"regions": {"r0": 1, "r1": 1, "r2": 1, "lh": 1}, "mbit": up, "rtt_ms": rtt,
           "down_mbit": down}  # fmt: skip
    cluster, runs, again = kill_and_restart(tmp_path, args, wan, "r2", kill_at, wait_s)
    return cluster, runs["r0"], runs["r1"], again


@needs_root
@pytest.mark.timeout(300)
def test_auto_outer_loop_plans_again_for_the_regions_present(tmp_path) -> None:
    """The outer loop with sync_every and codec "auto", a 1.1 M-parameter MLP, 3 regions of one
    rank on the emulated WAN whose links differ (kill_r2_of_three_and_restart: r2 far and slow,
    r0's uplink 100 Mbit/s, r1's 200). The first plan probes every pair and
    syncs rarely enough for r2's round trip, the slower uplinks sending more compressed; r2
    SIGKILLed, the survivors plan again for their own links - more often, without probing - and
    when r2 is back (the same command) again for all three, from the links already measured. r2
    takes the state from r1, whose link to it is the faster (the rule before the links were
    measured would give r0), and all end equal."""
    from cloudtrain.compress.ladders import OUTER_LADDER
    from cloudtrain.plan import describe

    args = worker_args(
        700, 0.08, hidden=1024, **{"sync-every": "auto", "codec": "auto", "start-regions": 3}
    )
    cluster, r0, r1, again = kill_r2_of_three_and_restart(tmp_path, args, 120, 200)
    seen = plans_seen(r0)
    print("plans (regions, H) at r0's syncs:", seen, "\nr0's plan:", r0.result["elastic"]["plan"])
    three, two = ("r0", "r1", "r2"), ("r0", "r1")
    first = next(h for regions, h in seen if regions == three)
    without = next(h for regions, h in seen if regions == two)
    back = [h for regions, h in seen[seen.index((two, without)) :] if regions == three]
    assert without < first and back and back[-1] > without, seen
    a, c = r0.result["elastic"], again.result["elastic"]
    assert a["links_probed"] == 6 and c["links_probed"] == 0  # the return measured nothing
    assert a["replans"] >= 3 and a["plan"]["sync_every"] == back[-1]
    rank = {describe(rung): i for i, rung in enumerate(OUTER_LADDER)}  # more compression: later
    codecs = {r: rank[text] for r, text in a["plan"]["codecs"].items()}
    assert codecs["r2"] >= codecs["r0"] >= codecs["r1"] and codecs["r2"] > codecs["r1"], a["plan"]
    assert "took the state of region r1" in logs(tmp_path, "r2")
    assert r0.result["digest"] == r1.result["digest"] == again.result["digest"]
    assert r0.result["steps"] == again.result["steps"] == 700
    first_sync_after_join_equal(cluster, "r0", again)


@needs_root
@pytest.mark.timeout(300)
def test_per_step_auto_plans_for_the_regions_present(tmp_path) -> None:
    """Per step with codec "auto", 3 regions of one rank on the emulated WAN whose links differ
    (kill_r2_of_three_and_restart): a controller is made for the regions present at every change - its
    links agreed (the first quorum probes every pair, nobody probes again), its plan by region
    name - r2 SIGKILLed, the survivors' controller plans for r0 and r1 alone; r2 started again
    with the same command is planned for again without a probe, and all end equal."""
    args = worker_args(260, 0.02, mode="step", hidden=256, codec="auto", **{"start-regions": 3})
    _, r0, r1, again = kill_r2_of_three_and_restart(tmp_path, args, 60, 240)
    plans: list[tuple[str, ...]] = []
    for ln in r0.lines:
        if "plan" in ln and (not plans or plans[-1] != tuple(ln["plan"])):
            plans.append(tuple(ln["plan"]))
    print("per-step auto, regions planned for at r0's quorums:", plans, r0.result["elastic"])
    three, two = ("r0", "r1", "r2"), ("r0", "r1")
    assert plans[0] == three and two in plans and plans[-1] == three, plans
    assert plans.index(two) < len(plans) - 1
    a, c = r0.result["elastic"], again.result["elastic"]
    assert a["links_probed"] == 6 and c["links_probed"] == 0, (a, c)
    assert a["lost"] == ["r2"] and "r2" in a["joined"] and a["failed_syncs"] >= 1
    assert r0.result["digest"] == r1.result["digest"] == again.result["digest"]
    assert r0.result["steps"] == again.result["steps"] == 260
    assert r0.result["accuracy"] > 0.9, r0.result


@pytest.mark.timeout(240)
def test_spot_notice_leaves_at_a_sync_a_mismatched_joiner_is_refused(tmp_path) -> None:
    """On loopback: r0 alone pauses (never trains alone, logged) until r1 is there; a joiner
    with another model is refused, named, and never disturbs them; a spot notice in r1 makes it
    leave at its next sync and r0 goes on without a stall beyond one normal sync."""
    net = chaos.LocalNet({"r0": 2, "r1": 2, "bad": 1, "lh": 1})
    with (
        _serve_imds() as imds,
        _serve_imds() as quiet,
        cluster_on(
            net,
            ["r0", "r1", "bad"],
            worker_args(240, 0.1, spot=True, **{"spot-poll": 0.2}),
            tmp_path,
        ) as cluster,
    ):
        r0 = cluster.start("r0", {"CLOUDTRAIN_IMDS_ENDPOINT": quiet.url})
        wait_until(lambda: "pauses" in logs(tmp_path, "r0"), 90, "r0 logs a pause")
        time.sleep(2)
        assert r0.step == 0 and not r0.lines, "r0 trained alone"
        r1 = cluster.start("r1", {"CLOUDTRAIN_IMDS_ENDPOINT": imds.url})
        wait_until(lambda: r1.step >= 20, 120, "r1 at step 20")
        bad = cluster.start("bad", {"CLOUDTRAIN_IMDS_ENDPOINT": quiet.url}, ["--hidden", "32"])
        wait_until(lambda: bad.result is not None, 60, "the mismatched joiner refused")
        assert bad.procs[0].wait(30) == 3
        why = bad.result["refused"]
        assert (
            "region bad refused" in why and "model" in why and "ranks '1' (the run's: '2')" in why
        )
        noticed = time.time()
        imds.notice = NOTICE
        cluster.wait(180)
        assert r1.result["left"] and r1.result["steps"] < 240
        a = r0.result
        assert a["steps"] == 240 and not a["left"] and a["elastic"]["failed_syncs"] == 0
        assert any("differs from the run" in w for w in a["elastic"]["refused"])
        before = [ln["dt"] for ln in r0.lines if ln["t"] < noticed]
        sync = sorted(before)[-len(before) // 10]  # a sync step: the slowest tenth
        after = [ln["dt"] for ln in r0.lines if ln["t"] > noticed]
        assert max(after) <= 2 * sync + 0.5, (max(after), sync)
        assert "leaves after step" in logs(tmp_path, "r1")
        assert "resumes" in logs(tmp_path, "r0")


@pytest.mark.timeout(120)
def test_per_step_a_spot_notice_leaves_at_a_quorum_the_other_does_not_stall(tmp_path) -> None:
    """Per step on loopback: a spot notice in r1 makes it leave at its next quorum, announced -
    r0 drops no step and waits for no heartbeat timeout (before: a failed exchange, a dropped
    step and the Lighthouse's 1.5 s), and asks no quorum while r1's heartbeats time out."""
    net = chaos.LocalNet({"r0": 1, "r1": 1, "lh": 1})
    args = worker_args(300, 0.02, mode="step", spot=True, **{"spot-poll": 0.2})
    with (
        _serve_imds() as imds,
        _serve_imds() as quiet,
        cluster_on(net, ["r0", "r1"], args, tmp_path) as cluster,
    ):
        r0 = cluster.start("r0", {"CLOUDTRAIN_IMDS_ENDPOINT": quiet.url})
        r1 = cluster.start("r1", {"CLOUDTRAIN_IMDS_ENDPOINT": imds.url})
        wait_until(lambda: r1.step >= 40, 90, "r1 at step 40")
        noticed = time.time()
        imds.notice = NOTICE
        cluster.wait(120)
    assert r1.result["left"] and r1.result["steps"] < 300 and r0.result["steps"] == 300
    a = r0.result["elastic"]
    assert a["left_regions"] == ["r1"] and a["lost"] == [] and a["failed_syncs"] == 0, a
    quorums = sorted(ln["dt"] for ln in r0.lines if ln["t"] < noticed and "digest" in ln)
    after = max(ln["dt"] for ln in r0.lines if ln["t"] > noticed)
    assert after <= 2 * quorums[len(quorums) // 2] + 0.3, (after, quorums)
    assert "the others told at the quorum" in logs(tmp_path, "r1")


@pytest.mark.timeout(240)
def test_below_min_regions_the_survivor_pauses_until_the_region_is_back(tmp_path) -> None:
    """On loopback, min_regions 2: SIGKILL r1 at step 20; r0 never trains alone - it pauses at
    its next sync, logged and counted, and does not step - until r1, started again, has joined;
    then both finish with the same parameters. TensorBoard (a folder per region) shows the
    membership, the pause and the recovery."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = tmp_path / "tb"
    net = chaos.LocalNet({"r0": 1, "r1": 1, "lh": 1})
    args = worker_args(120, 0.05, **{"min-regions": 2, "tensorboard": str(board)})
    with cluster_on(net, ["r0", "r1"], args, tmp_path) as cluster:
        r0, r1 = cluster.start("r0"), cluster.start("r1")
        wait_until(lambda: r1.step >= 20, 90, "r1 at step 20")
        before = logs(tmp_path, "r0").count("pauses at step")
        r1.kill()
        wait_until(lambda: logs(tmp_path, "r0").count("pauses at step") > before, 60, "a pause")
        held = r0.step
        time.sleep(3)
        assert r0.step == held, "r0 trained alone below min_regions"
        again = cluster.start("r1")
        cluster.wait(180)
    assert "resumes" in logs(tmp_path, "r0")
    a, b = r0.result, again.result
    assert a["steps"] == b["steps"] == 120 and a["digest"] == b["digest"]
    assert a["elastic"]["pauses"] >= 1 and a["elastic"]["paused_s"] >= 3, a["elastic"]
    scalars = EventAccumulator(str(board / "r0"))
    scalars.Reload()
    series = {tag: [e.value for e in scalars.Scalars(tag)] for tag in scalars.Tags()["scalars"]}
    assert series["elastic/regions_present"][0] == 2 and series["elastic/lost"][-1] >= 1
    assert series["elastic/pauses"][-1] >= 1 and series["elastic/paused_s"][-1] >= 3
    assert series["elastic/joined"][-1] >= 1, series
    rejoined = EventAccumulator(str(board / "r1"))  # the restarted r1 writes its own
    rejoined.Reload()
    assert rejoined.Scalars("elastic/recovery_bytes_received")[-1].value > 0


@pytest.mark.timeout(180)
def test_no_quorum_names_the_last_syncs_regions_and_an_outage_logs_once_a_timeout(tmp_path):
    """On loopback, 2 regions x 2 ranks, min_regions 2 on the Lighthouse too: r1 SIGKILLed, the
    Lighthouse forms no quorum for r0, whose pause line names r1 (the last sync's other region);
    with the Lighthouse killed as well, r0's failed asks are logged once a quorum timeout (3 s),
    not at every retry; the region's lines come from its first rank only."""
    net = chaos.LocalNet({"r0": 2, "r1": 2, "lh": 1})
    args = worker_args(400, 0.05, **{"min-regions": 2, "quorum-timeout": 3})
    with cluster_on(net, ["r0", "r1"], args, tmp_path, min_regions=2) as cluster:
        r0, r1 = cluster.start("r0"), cluster.start("r1")
        wait_until(lambda: r1.step >= 20, 90, "r1 at step 20")
        r1.kill()
        named = "the last sync's other regions: ['r1'] (if one of them stopped heartbeating"
        wait_until(lambda: named in logs(tmp_path, "r0"), 60, "a pause naming r1")
        cluster.lighthouse.kill()
        cluster.lighthouse.wait()
        time.sleep(2)  # (an ask in flight ends)
        before = logs(tmp_path, "r0").count("no quorum within")
        time.sleep(9)
        asked = logs(tmp_path, "r0").count("no quorum within") - before
        assert 1 <= asked <= 4, f"{asked} pause lines in 9 s with a 3 s quorum timeout"
        held = r0.step
    assert r0.step == held
    first = logs(tmp_path, "r0")
    second = "".join(p.read_text() for p in tmp_path.glob("r0-*-r1.log"))
    assert "pauses at step" in first and "; contributors [" in first
    assert "pauses at step" not in second and "; contributors [" not in second, second


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["outer", "step"])
def test_chaos_random_kills_and_restarts_end_with_equal_replicas(tmp_path, mode) -> None:
    """3 regions of one rank on loopback, 5 random kills and restarts of whole regions (never
    fewer than one region that has trained alive); once all are back the harness ends the run 3
    syncs later: every region finishes within the bound, at the same step, with the same
    parameters. Per step, the MLP is wide enough (1.2 MB) for DDP's buckets to differ between a
    joiner's first step (one bucket of every parameter) and the run's (rebuilt): the joiner
    reduces them as the run's layouts."""
    parser = argparse.ArgumentParser()
    chaos.configure(parser)
    wide = ["--hidden", "4096"] if mode == "step" else []
    args = parser.parse_args(
        ["--scenario", "chaos", "--mode", mode, *wide, "--local", "--regions", "3", "--ranks",
         "1", "--events", "5", "--min-gap", "1.5", "--max-gap", "3", "--steps", "5000", "--pace",
         "0.04", "--heartbeat", str(HEARTBEAT_S), "--timeout", "150", "--logs", str(tmp_path),
         "--seed", "3" if mode == "outer" else "4"]
    )  # fmt: skip
    report = chaos.run_scenario(args)
    print(f"chaos ({mode}):", report["events"], report["around_kills"])
    kinds = [kind for kind, *_ in report["events"]]
    assert len(kinds) >= 5 and "kill" in kinds and "start" in kinds, kinds
    assert report["replicas_equal"], report["results"]
    steps = {r["steps"] for r in report["results"].values()}
    assert len(steps) == 1 and steps.pop() < 5000, report["results"]  # ended at the stop step


@pytest.mark.timeout(240)
def test_chaos_runs_torchfts_own_diloco_beside_ours(tmp_path) -> None:
    """The comparison the chaos bench makes (--engine torchft): the same kill and restart with
    torchft's Manager and DiLoCo on the same regions. The survivor notices the loss and goes on,
    the restarted region heals from it (torchft's live recovery), and both end equal; the
    report's measures read torchft's lines (participants, not region names)."""
    parser = argparse.ArgumentParser()
    chaos.configure(parser)
    args = parser.parse_args(
        ["--engine", "torchft", "--local", "--regions", "2", "--ranks", "1", "--steps", "150",
         "--pace", "0.04", "--sync-every", "10", "--kill-at", "30", "--restart-after", "0",
         "--heartbeat", str(HEARTBEAT_S), "--timeout", "150", "--logs", str(tmp_path)]
    )  # fmt: skip
    report = chaos.run_scenario(args)
    print("torchft:", report["around_kills"], report["rejoined_s"])
    assert report["replicas_equal"], report["results"]
    assert {r["engine"] for r in report["results"].values()} == {"torchft"}
    around = report["around_kills"][0]["r0"]
    assert around["detected_s"] is not None and around["detected_s"] < 30, around
    assert report["rejoined_s"][0] is not None, report
    assert all(r["steps"] == 150 for r in report["results"].values()), report["results"]
