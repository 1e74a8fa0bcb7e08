"""The prober on the real emulated WAN: it measures a tbf-shaped link to within 15% of its rate,
fits the emulated round-trip time to within 10%, and clustering on its measurements recovers the
emulator's regions.

Needs root and iproute2 (skips without them); with them the emulator must come up, else the test
fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
from distributed import RankFailed, run_ranks, spawn_in_regions
from support import EMULATOR_MACHINE

from cloudtrain.probe import (
    DISAGREE,
    LinkMatrix,
    _measure,
    disagreeing,
    expand,
    fit_measured,
    representative_pairs,
    rounds,
)
from cloudtrain.tools import netem
from cloudtrain.tools.netem import Emulator, teardown

pytestmark = pytest.mark.timeout(240)
emulated = pytest.mark.skipif(
    not EMULATOR_MACHINE, reason="the WAN emulator needs root and iproute2"
)

PROBE = """
import json, torch.distributed as dist
import cloudtrain
from cloudtrain.probe import probe, cluster_regions
cloudtrain.init()
links = probe()
if dist.get_rank() == 0:
    print(json.dumps({"beta": [[b if b != float("inf") else None for b in row] for row in links.beta],
                      "alpha": links.alpha, "regions": cluster_regions(links)}))
dist.destroy_process_group()
"""


@pytest.fixture
def wan_name():
    ok, why = netem.available()
    assert ok, f"root with iproute2 but the emulator reports itself unavailable: {why}"
    name = f"p{os.getpid() % 100000}-{uuid.uuid4().hex[:6]}"
    yield name
    teardown(name)
    assert netem.leftovers(name) == [] and netem.relay_processes(name) == []


def run_probe(wan: Emulator) -> dict:
    procs = spawn_in_regions(wan, PROBE, 29531)
    outs = [p.communicate(timeout=150)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return json.loads(outs[0].strip().splitlines()[-1])


@emulated
def test_probe_measures_the_shaped_rate_within_15_percent(wan_name):
    with Emulator({"us": 1, "eu": 1}, mbit=100, name=wan_name) as wan:
        result = run_probe(wan)
    for i, j in ((0, 1), (1, 0)):
        mbit = 8 * result["beta"][i][j] / 1e6
        assert 85 <= mbit <= 115, f"link {i}->{j} measured at {mbit:.1f} Mbit/s, shaped at 100"


@emulated
def test_clustering_on_measurements_recovers_the_regions(wan_name):
    with Emulator({"us": 2, "eu": 2}, mbit={"us": 100, "eu": 200}, name=wan_name) as wan:
        result = run_probe(wan)
    assert result["regions"] == [0, 0, 1, 1], result
    cross = 8 * result["beta"][0][2] / 1e6
    inside = 8 * result["beta"][0][1] / 1e6
    assert inside > 5 * cross, (inside, cross)


@emulated
def test_probe_command_fits_the_emulated_rtt_within_10_percent(wan_name):
    """`cloudtrain probe --netem`: 80 ms between the regions, none inside one."""
    up = [sys.executable, "-m", "cloudtrain.cli", "netem", "up", "--regions", "us:2,eu:2",
          "--mbit", "100", "--rtt-ms", "80", "--name", wan_name]  # fmt: skip
    res = subprocess.run(up, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    cmd = [sys.executable, "-m", "cloudtrain.cli", "probe", "--netem", wan_name, "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result["emulated"]["emulation"] in (netem.DELAY_LINE, netem.DELAY_NETEM)
    rtt = result["emulated"]["rtt_ms"]
    fitted = [[1000 * a for a in row] for row in result["alpha_s"]]
    print("fitted latency, ms:", [[round(a, 1) for a in row] for row in fitted])
    for i in range(4):
        for j in range(4):
            if i // 2 != j // 2:
                assert rtt[i][j] == 80
                assert 72 <= fitted[i][j] <= 88, (i, j, fitted)
            elif i != j:
                assert rtt[i][j] == 0 and fitted[i][j] < 8, (i, j, fitted)


ASYMMETRIC = """
import json, torch.distributed as dist
import cloudtrain, cloudtrain.probe as probing
from cloudtrain.probe import probe, representative_pairs
gathered, measure_rounds = [], probing._measure_rounds
def kept(*args):  # each gathering's matrix, as probe gets it (then probe goes on with it)
    sent, seen = measure_rounds(*args)
    gathered.append([[8 * b / 1e6 for _, b in row] for row in seen])
    return sent, seen
probing._measure_rounds = kept
cloudtrain.init()
links = probe(pairs=representative_pairs([[0, 1], [2, 3]]), region=[0, 0, 1, 1])
if dist.get_rank() == 0:
    print(json.dumps({"mbit": [[links.mbit(i, j) if i != j else 0 for j in range(4)]
                               for i in range(4)], "again": links.again, "gathered": gathered}))
dist.destroy_process_group()
"""


@emulated
def test_directions_that_disagree_at_once_are_measured_again_one_way_at_a_time(wan_name):
    """us's link carries 200 Mbit/s each way, eu's 50 up and 200 down: measured at once, the
    two directions read more than DISAGREE apart, so the slower is measured again alone; it
    still reads apart from the faster, which is measured again alone too, and each reads its
    own link's rate (us->eu's acknowledgements no longer wait behind eu->us's probe on eu's
    uplink)."""
    shaped = {"us": 200, "eu": 50}
    with Emulator({"us": 2, "eu": 2}, shaped, down_mbit=200, name=wan_name) as wan:
        procs = spawn_in_regions(wan, ASYMMETRIC, 29533)
        outs = [p.communicate(timeout=150)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    result = json.loads(outs[0].strip().splitlines()[-1])
    # the slower first; alone it still reads apart from the faster, so the faster goes too
    assert [tuple(p) for p in result["again"]] == [(3, 1), (0, 2)], result
    # three gatherings: both at once, then eu->us alone, then us->eu alone; each alone is kept
    at_once, eu_alone, us_alone = result["gathered"]
    us_eu, eu_us = result["mbit"][0][2], result["mbit"][3][1]
    assert (eu_us, us_eu) == (eu_alone[3][1], us_alone[0][2]), result
    assert 150 <= us_eu <= 250 and 37.5 <= eu_us <= 62.5, (us_eu, eu_us, at_once)


def test_only_opposite_directions_measured_at_once_that_disagree_are_measured_again():
    region = [0, 0, 1, 1]
    batches = rounds(representative_pairs([[0, 1], [2, 3]]), region)
    assert batches[0] == [(0, 2), (3, 1)]  # both directions across at once

    def beta(us_eu: float, eu_us: float, inside: float = 1e9) -> list[list[float]]:
        b = [[inside] * 4 for _ in range(4)]
        b[0][2], b[3][1] = us_eu, eu_us
        return b

    assert disagreeing(batches, region, beta(100.0, 100.0 / DISAGREE)) == []  # at the bound
    assert disagreeing(batches, region, beta(100.0, 79.0)) == [((3, 1), (0, 2))]  # (slow, fast)
    assert disagreeing(batches, region, beta(40.0, 100.0)) == [((0, 2), (3, 1))]
    # inside a region, rates far from the links across: not a direction across
    assert disagreeing(batches, region, beta(100.0, 100.0, inside=1.0)) == []
    # one rank a region: the two directions share both ranks, so they run one after the other
    one = rounds(representative_pairs([[0], [1]]), [0, 1])
    assert one == [[(0, 1)], [(1, 0)]]
    assert disagreeing(one, [0, 1], [[0.0, 100.0], [10.0, 0.0]]) == []


def test_rounds_share_no_rank_and_no_link_and_keep_every_pair_once():
    members = [[0, 1], [2, 3], [4, 5]]
    region = [0, 0, 1, 1, 2, 2]
    pairs = representative_pairs(members)
    assert len(pairs) == 6 + 6  # each way between every two regions, two inside each
    batches = rounds(pairs, region)
    assert sorted(p for b in batches for p in b) == sorted(pairs)
    for batch in batches:
        ranks = [r for pair in batch for r in pair]
        assert len(ranks) == len(set(ranks)), batch
        ups = [region[i] for i, j in batch if region[i] != region[j]]
        downs = [region[j] for i, j in batch if region[i] != region[j]]
        assert len(ups) == len(set(ups)) and len(downs) == len(set(downs)), batch
    assert len(batches) < len(pairs)  # some are measured at once
    # 2 regions x 2: both directions across at once, then each region's inside pairs together
    assert rounds(representative_pairs([[0, 1], [2, 3]]), [0, 0, 1, 1]) == [
        [(0, 2), (3, 1)],
        [(0, 1), (2, 3)],
        [(1, 0), (3, 2)],
    ]
    # regions unknown: one pair at a time (two flows might share a link no one knows)
    assert rounds([(0, 1), (2, 3)]) == [[(0, 1)], [(2, 3)]]


def test_expand_takes_each_link_from_the_pair_that_measured_it():
    members = [[0, 1], [2, 3]]
    n = 4
    beta = [[float(10 * i + j) if (i, j) in representative_pairs(members) else 0.0
             for j in range(n)] for i in range(n)]  # fmt: skip
    alpha = [[0.0] * n for _ in range(n)]
    links = expand(LinkMatrix(tuple(map(tuple, alpha)), tuple(map(tuple, beta)), 0), members)
    assert links.beta[0][2] == links.beta[1][3] == 2.0  # us -> eu: measured 0 -> 2
    assert links.beta[2][0] == links.beta[3][1] == 31.0  # eu -> us: measured 3 -> 1
    assert links.beta[1][0] == links.beta[0][1] == 1.0  # inside us: 0 -> 1
    assert links.beta[3][2] == 23.0  # inside eu: 2 -> 3


def test_the_best_repeated_size_sets_the_bandwidth_not_a_transfer_that_lost_packets():
    """A probe's bandwidth is the best rate of the sizes it repeated (the size that showed it,
    and twice that where it read slow, as a message that overran the shaper's queue does), each
    by its fastest time less the fastest ping; sizes timed once only led up to them."""
    rtt = 0.08
    lossy = [(1, rtt), (1, rtt + 0.001), (600_000, rtt + 0.09)]  # once: led up, not counted
    lossy += [(1_200_000, rtt + 0.33)]  # slow (losses recovered): twice its size instead
    lossy += [(2_400_000, rtt + 0.38), (2_400_000, rtt + 0.40)]
    alpha, beta = fit_measured(lossy)
    assert alpha == rtt and beta == pytest.approx(2_400_000 / 0.38)
    plain = [(1, rtt), (1_000_000, rtt + 0.2), (1_000_000, rtt + 0.16), (500_000, rtt + 0.1)]
    assert fit_measured(plain)[1] == pytest.approx(1_000_000 / 0.16)
    once = [(1, rtt), (500_000, rtt + 0.1), (1_000_000, rtt + 0.25)]  # none repeated: the largest
    assert fit_measured(once)[1] == pytest.approx(1_000_000 / 0.25)


def _measure_pair(rank: int, world: int, repeats: int) -> list[tuple[int, float]]:
    import cloudtrain

    cloudtrain.init()
    return _measure(0, 1, None, 0.05, 8 * 1024 * 1024, repeats, 64 * 1024)


def test_a_size_repeated_goes_under_one_announcement():
    """Every announcement is a one-byte ping (a round trip); the repeats of the size that shows
    bandwidth - or of twice it, where it read slow - go under one. Real gloo ranks on loopback
    (where the first size is the largest, so the size is repeated)."""
    repeats = 4
    samples, received = run_ranks(2, _measure_pair, repeats)
    assert received == []  # the receiver keeps no samples
    pings = [t for b, t in samples if b == 1]
    messages = [b for b, _ in samples if b > 1]
    last = messages[-1]
    assert messages.count(last) >= repeats  # the size that shows bandwidth, repeated
    # the warm-up (not a sample) and each size leading up announced once, the repeats - of
    # that size (repeats - 1 of them), or of twice it (repeats) - once between them
    assert len(messages) - len(pings) in (repeats - 3, repeats - 2), samples
    assert all(b == last for b in messages[len(messages) - repeats + 1 :])


def _announcing(rank: int, world: int, header: list[int]) -> None:
    """Rank 0 plays a sender by hand: `header` announced; where the receiver takes it (a count
    of 2, the most `repeats=2` sends), two messages of that size, each until its ack, then the
    end - with the count left over, as the probe leaves it. Rank 1 is the probe's receiver."""
    import torch
    import torch.distributed as dist

    import cloudtrain

    cloudtrain.init()
    if rank == 1:
        return _measure(0, 1, None, 0.05, 1024 * 1024, 2, 64 * 1024)
    ack = torch.zeros(1, dtype=torch.uint8)
    dist.send(torch.tensor(header, dtype=torch.int64), dst=1)
    if header[1] != 2:  # refused: the receiver is gone
        return None
    dist.recv(ack, src=1)  # its receive is posted
    for _ in range(2):
        dist.send(torch.zeros(header[0], dtype=torch.uint8), dst=1)
        dist.recv(ack, src=1)
    dist.send(torch.tensor([0, header[1]], dtype=torch.int64), dst=1)
    return None


def test_a_receiver_takes_as_many_messages_as_announced_then_the_end():
    """Two messages under one announcement (the most the probe sends with repeats=2), each
    acked, then the end whatever count it carries: both ranks finish, the receiver with no
    samples of its own."""
    assert run_ranks(2, _announcing, [300_000, 2]) == [None, []]


@pytest.mark.parametrize(
    "header, named",
    [
        ([1000, 50], "announced 50 message(s) of 1000 bytes"),
        ([1000, 0], "announced 0 message(s) of 1000 bytes"),
        ([1024 * 1024 + 1, 1], "announced 1 message(s) of 1048577 bytes"),
    ],
)
def test_an_announced_count_or_size_is_checked_before_it_is_received(header, named):
    """No declared size is trusted: a count of messages beyond what the probe sends (or none),
    or a size beyond its largest message, raises, naming it, before the receiver posts a receive
    for any of them."""
    results = run_ranks(2, _announcing, header, allow_failures=True)
    assert results[0] is None
    assert isinstance(results[1], RankFailed)
    assert f"rank 0 {named} where 1 to 2 of 1 to 1048576 bytes were expected" in results[1].text
