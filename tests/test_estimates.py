"""The controller's estimates (cloudtrain.estimates) in process: a link's estimate does not feed on
the rung being sent - packets that arrive slowly (a late sender, a round trip that dominates a
small packet) never lower it but ask for a re-probe, which alone sets it; the leaders' matrix is
read in region order; the estimates round-trip through their state."""

from __future__ import annotations

import pytest

from cloudtrain.estimates import STALE_DECISIONS, Estimates, Interval, region_links
from cloudtrain.guard import QualitySums
from cloudtrain.probe import LinkMatrix

MBIT = 1e6 / 8


def interval(arrivals=((), ()), probed=None) -> Interval:
    quality = [QualitySums(), QualitySums()]
    return Interval(0.05, 0.1, [list(a) for a in arrivals], {}, [[], []], quality, probed)


def started() -> Estimates:
    est = Estimates.start(2)
    est.bandwidth, est.rtt = [100 * MBIT, 100 * MBIT], [0.08, 0.08]
    return est


def test_slow_packets_ask_for_a_probe_and_lower_nothing():
    est = started()
    # 4 MB packets that took 1 s beyond the round trip: 32 Mbit/s, a third of the estimate
    slow = [(4_000_000, 1.08)] * 3
    assert est.observe_links(interval((slow, slow)), True, 1, 0.5) is True
    assert est.bandwidth == [100 * MBIT, 100 * MBIT]
    est.since_probe = 0  # just probed: slow packets wait for the next probe
    assert est.observe_links(interval((slow, slow)), True, 1, 0.5) is False


def test_only_a_probe_lowers_an_estimate_and_packets_raise_it():
    est = started()
    probed = [[0.0, 40 * MBIT], [60 * MBIT, 0.0]]  # region 0 -> 1 at 40, 1 -> 0 at 60
    est.observe_links(interval(probed=probed), True, 2, 0.5)  # two shard owners share a link
    assert est.bandwidth == [pytest.approx(20 * MBIT), pytest.approx(30 * MBIT)]
    assert est.since_probe == 0 and est.unmeasured == [0, 0]
    fast = [(4_000_000, 0.08 + 4_000_000 / (40 * MBIT))] * 2  # 40 Mbit/s per owner: a rise
    est.observe_links(interval((fast, ())), True, 2, 0.5)
    assert est.bandwidth[0] == pytest.approx(0.5 * 40 * MBIT + 0.5 * 20 * MBIT)


def test_a_link_left_unmeasured_is_reprobed():
    est = started()
    for decision in range(STALE_DECISIONS - 1):
        assert est.observe_links(interval(), True, 1, 0.5) is False, decision
    assert est.observe_links(interval(), True, 1, 0.5) is True


def test_the_leaders_probe_is_read_in_region_order():
    # leaders are ranks 2 (region 0) and 0 (region 1): the group's rank order is the reverse
    gathered = [
        {"compute": [], "received": {}, "leader_links": [[0.0, 7.0], [3.0, 0.0]]},
        {"compute": [], "received": {}},
        {"compute": [], "received": {}},
        {"compute": [], "received": {}},
    ]
    seen = Interval.of(gathered, [[2, 3], [0, 1]])
    assert seen.probed == [[0.0, 3.0], [7.0, 0.0]]


def test_region_links_take_the_slowest_pair_and_share_it_among_the_owners():
    beta = ((0, 10e6, 4e6, 5e6), (10e6, 0, 6e6, 6e6), (3e6, 3e6, 0, 9e6), (3e6, 2e6, 9e6, 0))
    alpha = tuple(tuple(0.08 if (i < 2) != (j < 2) else 0.0 for j in range(4)) for i in range(4))
    links = region_links(LinkMatrix(alpha, beta), [[0, 1], [2, 3]], 2)
    assert [lk.bandwidth for lk in links] == [2e6, 1e6] and [lk.rtt for lk in links] == [0.08] * 2


def test_estimates_round_trip_through_their_state():
    est = started()
    est.observe_links(interval((((4_000_000, 0.3),), ())), True, 1, 0.5)
    assert Estimates.from_state(est.state_dict()) == est
