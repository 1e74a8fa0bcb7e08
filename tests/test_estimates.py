"""The controller's estimates (cloudtrain.estimates) in process: a link's estimate does not feed on
the rung being sent - packets that arrive slowly (a late sender, a round trip that dominates a
small packet) never lower it; a re-probe alone sets it, and comes later while re-probes agree;
the estimates round-trip through their state."""

from __future__ import annotations

import math

import pytest

from cloudtrain.estimates import (
    MAX_PROBE_EVERY,
    MEASURED_DECISIONS,
    PROBE_EVERY,
    REPROBE_SHARE,
    STALE_DECISIONS,
    Estimates,
    Interval,
    region_links,
)
from cloudtrain.guard import QualitySums
from cloudtrain.probe import LinkMatrix

MBIT = 1e6 / 8


def interval(arrivals=((), ()), probed=None, step_s=0.1, probe_s=0.0) -> Interval:
    quality = [QualitySums(), QualitySums()]
    arrivals = [list(a) for a in arrivals]
    return Interval(0.05, step_s, arrivals, {}, [[], []], quality, probed, None, probe_s)


def started() -> Estimates:
    est = Estimates.start(2)
    # a 160 ms round trip: a packet whose receive was posted ahead takes the one-way 80 ms
    est.bandwidth, est.rtt = [100 * MBIT, 100 * MBIT], [0.16, 0.16]
    return est


def test_slow_packets_lower_nothing_and_ask_for_a_probe_only_when_they_slowed():
    est = started()
    # 4 MB packets that took 1 s beyond the one-way latency: 32 Mbit/s, a third of the estimate -
    # the rate these packets arrive at (their senders' lateness in it): nothing is lowered
    slow = [(4_000_000, 1.08)] * 3
    assert est.observe_links(interval((slow, slow)), True, 1, 0.5) is False
    assert est.bandwidth == [100 * MBIT, 100 * MBIT]
    assert est.packet_rate == [pytest.approx(32 * MBIT)] * 2
    # half that rate later is a drop, but a probe is asked for only STALE_DECISIONS after the last
    slower = [(4_000_000, 2.08)] * 3
    for decision in range(2, STALE_DECISIONS):
        assert est.observe_links(interval((slower, slower)), True, 1, 0.5) is False, decision
    assert est.observe_links(interval((slower, slower)), True, 1, 0.5) is True
    assert est.bandwidth == [100 * MBIT, 100 * MBIT]


def test_smaller_packets_after_a_plan_change_set_a_new_baseline_and_ask_for_no_probe():
    est = started()
    # 4 MB packets at 80 Mbit/s; then a plan that compresses twice as much: 2 MB packets, whose
    # fixed costs (round trip, lateness) weigh twice - they arrive at 40, as a slower link's would
    big = [(4_000_000, 0.08 + 4_000_000 / (80 * MBIT))] * 3
    small = [(2_000_000, 0.08 + 2_000_000 / (40 * MBIT))] * 3
    assert est.observe_links(interval((big, big)), True, 1, 0.5) is False
    for decision in range(2, 2 * STALE_DECISIONS):
        assert est.observe_links(interval((small, small)), True, 1, 0.5) is False, decision
    assert est.packet_bytes == [2_000_000] * 2 and est.packet_rate == [pytest.approx(40 * MBIT)] * 2
    # past STALE_DECISIONS and short of PROBE_EVERY: the 2 MB packets at their own rate ask for
    # nothing, and the same packets at half it are a drop
    assert est.copy().observe_links(interval((small, small)), True, 1, 0.5) is False
    slower = [(2_000_000, 0.08 + 2_000_000 / (20 * MBIT))] * 3
    assert est.observe_links(interval((slower, slower)), True, 1, 0.5) is True
    assert est.since_probe < PROBE_EVERY


def test_only_a_probe_lowers_an_estimate_and_packets_faster_than_the_link_raise_nothing():
    est = started()
    probed = [[0.0, 40 * MBIT], [60 * MBIT, 0.0]]  # region 0 -> 1 at 40, 1 -> 0 at 60
    est.observe_links(interval(probed=probed), True, 2, 0.5)  # two shard owners share a link
    # a fall is confirmed by the next re-probe, at the next decision, before it lowers anything
    assert est.bandwidth == [100 * MBIT, 100 * MBIT]
    assert est.fall == [pytest.approx(20 * MBIT), pytest.approx(30 * MBIT)]
    assert est.observe_links(interval(), True, 2, 0.5) is True
    est.observe_links(interval(probed=probed), True, 2, 0.5)
    assert est.bandwidth == [pytest.approx(20 * MBIT), pytest.approx(30 * MBIT)]
    assert est.since_probe == 0 and est.fall == [None, None]
    # 40 Mbit/s per owner: what the link carries when the owners take turns - no rise
    turns = [(4_000_000, 0.08 + 4_000_000 / (40 * MBIT))] * 2
    est.observe_links(interval((turns, ())), True, 2, 0.5)
    assert est.bandwidth[0] == pytest.approx(20 * MBIT)
    # 60 Mbit/s from one owner alone, or three times the link: a sender early by part of its
    # transfer reads that fast too (its receive was posted ahead) - no rise
    for mbit in (60, 120):
        fast = [(4_000_000, 0.08 + 4_000_000 / (mbit * MBIT))] * 2
        est.observe_links(interval((fast, ())), True, 2, 0.5)
        assert est.bandwidth[0] == pytest.approx(20 * MBIT)


def test_reprobes_come_later_while_they_agree_and_sooner_once_one_does_not():
    est = started()

    def wait() -> int:  # decisions until the next re-probe is asked for
        decisions = 1
        while not est.observe_links(interval(), True, 1, 0.5):
            decisions += 1
        return decisions

    moved = [[0.0, 50 * MBIT], [95 * MBIT, 0.0]]  # region 0's link halved
    agreeing = [[0.0, 55 * MBIT], [90 * MBIT, 0.0]]  # within 25 % of the estimates since
    waits = [wait()]
    for probed in (moved, moved, agreeing, agreeing, agreeing, agreeing):
        est.observe_links(interval(probed=probed), True, 1, 0.5)
        waits.append(wait())
    # the fall confirmed at once, then a re-probe soon after it moved the estimate
    assert waits == [PROBE_EVERY, 1, STALE_DECISIONS, 2 * STALE_DECISIONS, 4 * STALE_DECISIONS,
                     MAX_PROBE_EVERY, MAX_PROBE_EVERY]  # fmt: skip
    assert est.bandwidth == [pytest.approx(55 * MBIT), pytest.approx(90 * MBIT)]


def test_a_low_reading_that_the_next_reprobe_does_not_confirm_lowers_nothing():
    est = started()
    est.observe_links(interval(probed=[[0.0, 30 * MBIT], [95 * MBIT, 0.0]]), True, 1, 0.5)
    assert est.bandwidth == [100 * MBIT, pytest.approx(95 * MBIT)]  # region 1 agreed: set
    assert est.observe_links(interval(), True, 1, 0.5) is True
    est.observe_links(interval(probed=[[0.0, 97 * MBIT], [96 * MBIT, 0.0]]), True, 1, 0.5)
    assert est.bandwidth == [pytest.approx(97 * MBIT), pytest.approx(96 * MBIT)]
    assert est.fall == [None, None]


def test_reprobes_keep_to_their_share_of_the_run():
    est = started()
    # a re-probe that held every rank 6 s, 0.44 s steps, a decision every 5 steps: the next
    # comes after 6 / (0.02 * 0.44 * 5) = 137 decisions, packets that slowed or not
    agreeing = [[0.0, 100 * MBIT], [100 * MBIT, 0.0]]
    est.observe_links(interval(probed=agreeing, step_s=0.44, probe_s=6.0), True, 1, 0.5, 5)
    affordable = math.ceil(6.0 / (REPROBE_SHARE * 0.44 * 5))
    assert affordable == 137 > est.probe_every
    est.observe_links(
        interval(((big := [(4_000_000, 0.5)] * 3), big), step_s=0.44), True, 1, 0.5, 5
    )
    slow = [(4_000_000, 3.0)] * 3  # a sixth of the baseline's rate
    for decision in range(2, affordable):
        asked = est.observe_links(interval((slow, slow), step_s=0.44), True, 1, 0.5, 5)
        assert asked is False, decision
    assert est.observe_links(interval((slow, slow), step_s=0.44), True, 1, 0.5, 5) is True


def test_the_probe_is_read_from_rank_0():
    gathered = [
        {"compute": [], "received": {}, "probed": [[0.0, 3.0], [7.0, 0.0]]},
        {"compute": [], "received": {}},
    ]
    assert Interval.of(gathered, [[0], [1]]).probed == [[0.0, 3.0], [7.0, 0.0]]
    assert Interval.of(gathered[1:] * 2, [[0], [1]]).probed is None


def test_region_links_take_the_slowest_pair_and_share_it_among_the_owners():
    beta = ((0, 10e6, 4e6, 5e6), (10e6, 0, 6e6, 6e6), (3e6, 3e6, 0, 9e6), (3e6, 2e6, 9e6, 0))
    alpha = tuple(tuple(0.08 if (i < 2) != (j < 2) else 0.0 for j in range(4)) for i in range(4))
    links = region_links(LinkMatrix(alpha, beta), [[0, 1], [2, 3]], 2)
    assert [lk.bandwidth for lk in links] == [2e6, 1e6] and [lk.rtt for lk in links] == [0.08] * 2
    # a round trip out and back is one back and out: the fastest ping either way sets both
    late = tuple(
        tuple(0.09 if (i < 2) and j >= 2 else a for j, a in enumerate(r))
        for i, r in enumerate(alpha)
    )
    links = region_links(LinkMatrix(late, beta), [[0, 1], [2, 3]], 2)
    assert [lk.rtt for lk in links] == [0.08] * 2


def test_estimates_round_trip_through_their_state():
    est = started()
    est.observe_links(interval((((4_000_000, 0.3),), ())), True, 1, 0.5)
    assert Estimates.from_state(est.state_dict()) == est


def test_a_held_low_reading_leaves_the_wait_for_scheduled_reprobes_as_it_was():
    est = started()
    est.probe_every = MAX_PROBE_EVERY  # after re-probes that agreed
    est.observe_links(interval(probed=[[0.0, 30 * MBIT], [98 * MBIT, 0.0]]), True, 1, 0.5)
    assert est.fall[0] == pytest.approx(30 * MBIT) and est.probe_every == MAX_PROBE_EVERY
    # confirmed: the link moved, so the next re-probe comes soon
    est.observe_links(interval(probed=[[0.0, 32 * MBIT], [98 * MBIT, 0.0]]), True, 1, 0.5)
    assert est.bandwidth[0] == pytest.approx(32 * MBIT) and est.probe_every == STALE_DECISIONS


def test_estimates_hold_one_entry_per_region():
    est = Estimates([None, None, None], [0.1, 0.1, 0.1])  # built directly, not by start()
    assert est.fall == [None] * 3 and est.packet_bytes == [0] * 3 and est.packet_rate == [None] * 3
    old = started().state_dict()
    for key in ("fall", "packet_bytes", "packet_rate"):  # a state saved before they existed
        del old[key]
    assert Estimates.from_state(old).fall == [None, None]
    with pytest.raises(ValueError, match="Estimates.rtt has 1 entries for 2 regions"):
        Estimates([None, None], [0.1])


def test_a_measured_plain_all_reduce_holds_only_while_the_links_stay_within_2x():
    """The plain all-reduce's measured time stands for the "none" rung until the links are
    found much faster or much slower than when it was measured. A link that fell from 1000 to
    50 Mbit/s kept a 1000 Mbit/s measurement, and the controller sent the plain path over it
    (the drop scenario: 10 steps of 1.1 s)."""

    def measured_at(mbit):
        est = Estimates([mbit * 1e6 / 8] * 2, [0.0] * 2)
        est.observe_stages({"allreduce": 0.04}, 0.5)
        return est

    def after(est, mbit):
        est.bandwidth = [mbit * 1e6 / 8] * 2
        est.observe_stages({"encode": 0.001}, 0.5)  # a compressed interval: no plain time
        return est.allreduce_s

    assert after(measured_at(500), 500) == 0.04
    assert after(measured_at(500), 300) == 0.04  # within 2x: the measurement holds
    assert after(measured_at(500), 25) is None  # the link fell
    assert after(measured_at(500), 1100) is None  # the link is much faster


def test_a_plan_that_takes_twice_as_long_as_before_drops_the_other_plans_times():
    """A link that falls shows in the steps before a re-probe reads it: the plan in force takes
    3x what it took, the estimates unchanged. The other plans' times are of before the fall
    (the drop scenario took the plain path, measured at 1000 Mbit/s, as 'measured faster' and
    sent it over 50 Mbit/s for 10 steps of 1.1 s)."""
    est = Estimates([60e6] * 2, [0.0] * 2, compute_s=0.08)
    plain, eight = ((0, 0), 0), ((2, 2), 0)
    est.observe_step(plain, 0.12, 0.5)
    est.observe_step(eight, 0.11, 0.5)
    assert not est.observe_step(eight, 0.15, 0.5)  # within 2x: smoothed, the others kept
    assert set(est.measured_steps) == {plain, eight}
    assert est.measured_steps[eight][0] == pytest.approx(0.13)
    est.allreduce_s, est.allreduce_bw = 0.02, 60e6  # the plain path, measured before too
    assert est.observe_step(eight, 0.37, 0.5)  # the link fell: a re-probe is asked for
    assert est.measured_steps == {eight: (0.37, 60e6, 0.08, 0)} and est.allreduce_s is None


def test_a_measured_step_time_is_compared_for_measured_decisions_only():
    """A plan's measured time ages a decision at a time and goes after MEASURED_DECISIONS: a
    link that falls unseen by the estimates must not leave a plan of before reading fast."""
    est = Estimates([60e6] * 2, [0.0] * 2, compute_s=0.08)
    plain, eight = ((0, 0), 0), ((2, 2), 0)
    four = ((3, 3), 0)
    est.observe_step(four, 0.3, 0.5)
    est.observe_step(plain, 0.12, 0.5)
    for _ in range(MEASURED_DECISIONS):
        assert not est.observe_step(eight, 0.2, 0.5)
    assert est.measured_steps[plain][3] == MEASURED_DECISIONS  # still compared
    est.observe_step(eight, 0.2, 0.5)
    # a time of before that reads faster than the plan in force goes; a slower one stays (it
    # does no harm, and dropped, the plan would be tried again)
    assert set(est.measured_steps) == {eight, four}
    # and it travels with the state (a state saved before ages were kept: measured now)
    again = Estimates.from_state(est.state_dict())
    assert again.measured_steps == est.measured_steps
    old = est.state_dict()
    old["measured_steps"] = [m[:5] for m in old["measured_steps"]]
    loaded = Estimates.from_state(old).measured_steps
    assert loaded == {p: (*m[:3], 0) for p, m in est.measured_steps.items()}


def test_a_measured_plain_all_reduce_is_compared_for_measured_decisions_only():
    """The plain path's measured time ages as a plan's step time does: the drop scenario's
    plain path, measured at 1000 Mbit/s in the first steps, read 20 ms over the fallen link
    while the estimates still held 447 Mbit/s, and the controller took it."""
    est = Estimates([60e6] * 2, [0.0] * 2)
    est.observe_stages({"allreduce": 0.02}, 0.5)
    for _ in range(MEASURED_DECISIONS):
        est.observe_stages({"encode": 0.001}, 0.5)
    assert est.allreduce_s == 0.02 and est.allreduce_age == MEASURED_DECISIONS
    assert Estimates.from_state(est.state_dict()).allreduce_age == MEASURED_DECISIONS
    est.observe_stages({"encode": 0.001}, 0.5)
    assert est.allreduce_s is None


def test_the_estimates_are_unsettled_from_a_jump_or_a_low_reading_until_a_reprobe_answers():
    """A plan in force that took twice its time, or a re-probe's low reading held in `fall`,
    leaves the estimates unsettled (the controller takes no lighter rung then) until a re-probe
    answers: one that agrees settles them; a low reading, after a jump or not, waits for the
    next re-probe to confirm it."""
    est = started()
    est.observe_links(interval(probed=[[0.0, 10 * MBIT], [98 * MBIT, 0.0]]), True, 1, 0.5)
    assert est.unsettled and est.bandwidth[0] == 100 * MBIT  # read low once: a fall held
    est.observe_links(interval(probed=[[0.0, 11 * MBIT], [98 * MBIT, 0.0]]), True, 1, 0.5)
    assert not est.unsettled and est.bandwidth[0] == pytest.approx(11 * MBIT)  # confirmed
    eight = ((2, 2), 0)
    est.observe_step(eight, 0.11, 0.5)
    assert not est.unsettled
    assert est.observe_step(eight, 0.37, 0.5) and est.unsettled
    assert Estimates.from_state(est.state_dict()).unsettled  # it travels with the state
    est.observe_links(interval(probed=[[0.0, 11 * MBIT], [97 * MBIT, 0.0]]), True, 1, 0.5)
    assert not est.unsettled  # a re-probe that agrees settles them
    # a low reading after a jump waits for its second all the same: the steps are every
    # link's, and the reading may be one transfer's losses
    est.observe_step(eight, 0.12, 0.5)
    assert est.observe_step(eight, 0.37, 0.5)
    est.observe_links(interval(probed=[[0.0, 1 * MBIT], [97 * MBIT, 0.0]]), True, 1, 0.5)
    assert est.unsettled and est.fall[0] == pytest.approx(1 * MBIT)
    assert est.bandwidth[0] == pytest.approx(11 * MBIT)
