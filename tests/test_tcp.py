"""cloudtrain.tcp: what a host's TCP buffers let one connection carry, and the start-up warning
where they, not the links, set what the probe measured."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
from distributed import spawn_in_regions
from support import EMULATOR_MACHINE

from cloudtrain.probe import LinkMatrix
from cloudtrain.tcp import BUFFERS, NEAR, WAN_TCP, buffer_ceilings, buffer_warning, window_mbit

USUAL = 4 << 20  # Linux's usual tcp_wmem ceiling
BIG = int(WAN_TCP["net.ipv4.tcp_wmem"].split()[2])


def write_proc(root: Path, wmem: str, rmem: str) -> Path:
    (root / "tcp_wmem").write_text(wmem + "\n")
    (root / "tcp_rmem").write_text(rmem + "\n")
    return root


def test_buffer_ceilings_are_the_send_and_receive_maxima(tmp_path: Path) -> None:
    proc = write_proc(tmp_path, "4096\t16384\t4194304", "4096 131072 6291456")
    assert buffer_ceilings(proc) == (4194304, 6291456)
    assert buffer_ceilings(tmp_path / "nothing-here") is None
    assert buffer_ceilings(write_proc(tmp_path, "garbage", "4096 1 2")) is None


@pytest.mark.skipif(not Path("/proc/sys/net/ipv4/tcp_wmem").exists(), reason="not Linux")
def test_this_host_reads_its_ceilings() -> None:
    ceilings = buffer_ceilings()
    assert ceilings is not None and min(ceilings) >= 4096


def test_window_rate_follows_buffer_over_round_trip() -> None:
    # one flow with the usual 4 MiB on the emulator: 239 Mbit/s at 80 ms, 89 at 180 ms
    assert window_mbit(USUAL, 0.08) == pytest.approx(419.4, abs=0.1)
    assert window_mbit(USUAL, 0.18) == pytest.approx(186.4, abs=0.1)
    assert window_mbit(2 * USUAL, 0.08) == pytest.approx(2 * window_mbit(USUAL, 0.08))
    assert window_mbit(USUAL, 0.0) > 1e6  # no round trip: no window limit worth the name


def test_the_docs_give_hosts_of_their_own_the_same_settings() -> None:
    cloud = (Path(__file__).resolve().parents[1] / "docs" / "cloud.md").read_text()
    for key, value in WAN_TCP.items():
        assert f"\n{key} = {value}\n" in cloud, key


def matrix(mbit: dict[tuple[int, int], float], rtt: float) -> LinkMatrix:
    """A probe's matrix of 4 ranks (us: 0, 1; eu: 2, 3) with the given pairs' rates."""
    beta = tuple(tuple(mbit.get((i, j), 1.0) * 1e6 / 8 for j in range(4)) for i in range(4))
    alpha = tuple(tuple(0.0 if i // 2 == j // 2 else rtt for j in range(4)) for i in range(4))
    return LinkMatrix(alpha, beta)


REGION = ("us", "us", "eu", "eu")


def test_warns_of_what_this_rank_measured_near_its_own_buffers() -> None:
    """Probe readings with 4 MiB at 100 ms: 221-286 Mbit/s (the emulated test below)."""
    links = matrix({(0, 2): 283.0, (3, 1): 395.0}, 0.1)
    pairs = [(0, 2), (3, 1)]  # what a probe of us and eu measures across (the rest are copies)
    sending = buffer_warning(links, 0, pairs, REGION.__getitem__, (USUAL, BIG))
    assert "to eu 283 Mbit/s at 100 ms (4 MiB a round trip: 336 Mbit/s)" in sending
    for key in BUFFERS:
        assert f"{key}='{WAN_TCP[key]}'" in sending  # what to run, word for word
    assert "sudo sysctl -w" in sending and "/etc/sysctl.d/" in sending
    assert "congestion" not in sending
    # rank 1 received at 395 Mbit/s: its receive buffer is what bounds that, and it is large
    assert buffer_warning(links, 1, pairs, REGION.__getitem__, (USUAL, BIG)) == ""
    # with a 4 MiB receive ceiling too, rank 1 is named, as a receiver
    receiving = buffer_warning(links, 1, pairs, REGION.__getitem__, (USUAL, USUAL))
    assert "from eu 395 Mbit/s at 100 ms (4 MiB a round trip: 336 Mbit/s)" in receiving
    # ranks that measured nothing, and hosts with WAN_TCP's buffers or none to read, say nothing
    assert buffer_warning(links, 2, [], REGION.__getitem__, (USUAL, USUAL)) == ""
    assert buffer_warning(links, 0, pairs, REGION.__getitem__, (BIG, BIG)) == ""
    assert buffer_warning(links, 0, pairs, REGION.__getitem__, None) == ""


def test_links_the_buffers_do_not_hold_back_are_not_named() -> None:
    at_80 = matrix({(0, 2): 185.0}, 0.08)  # the probe read 156-185 through 200 Mbit/s, 80 ms
    assert buffer_warning(at_80, 0, [(0, 2)], REGION.__getitem__, (USUAL, USUAL)) == ""
    near = NEAR * window_mbit(USUAL, 0.08)
    just = matrix({(0, 2): near + 0.5}, 0.08)
    assert "to eu" in buffer_warning(just, 0, [(0, 2)], REGION.__getitem__, (USUAL, USUAL))
    slow = matrix({(0, 2): 45.0}, 0.18)  # 50 Mbit/s at 180 ms: 1.1 MB in flight
    assert buffer_warning(slow, 0, [(0, 2)], REGION.__getitem__, (USUAL, USUAL)) == ""


START_UP = """
import logging, sys
from datetime import timedelta
import torch.distributed as dist
import cloudtrain
from cloudtrain.config import CompressionConfig
from cloudtrain.topology import Topology
logging.basicConfig(stream=sys.stderr, format="%(message)s")
cloudtrain.init()
topo = Topology.discover(CompressionConfig(regions=sys.argv[1]), timedelta(seconds=60))
if topo.links is None:  # regions given: CloudDDP's start-up probe (found: measured already)
    topo.probe()
dist.barrier()
dist.destroy_process_group()
"""


PROBE_COMMAND = "import runpy; runpy.run_module('cloudtrain.tools.probe', run_name='__main__')"


@pytest.mark.skipif(not EMULATOR_MACHINE, reason="the WAN emulator needs root and iproute2")
@pytest.mark.timeout(240)
def test_start_up_names_the_host_whose_buffers_hold_its_link_back() -> None:
    """400 Mbit/s at 100 ms: region us's hosts keep the usual 4 MiB send buffer, a loss-based
    congestion control and slow start after idle (untuned hosts), eu's have WAN_TCP's (the
    emulator's, as the Terraform's hosts boot). The start-up probe's warning (regions given, or
    found by the probe), and `cloudtrain probe`'s, come from us, name its link to eu and the
    fixes; eu says nothing."""
    from cloudtrain.tools.netem import Emulator, teardown

    name = f"tcp{os.getpid() % 10000}-{uuid.uuid4().hex[:4]}"
    try:
        # two ranks a region: `cloudtrain probe` finds regions by the links' gap
        with Emulator({"us": 2, "eu": 2}, 400, rtt_ms=100, name=name) as wan:
            untuned = [
                "net.ipv4.tcp_wmem=4096 16384 4194304",
                "net.ipv4.tcp_slow_start_after_idle=1",
                "net.ipv4.tcp_congestion_control=reno",  # (a namespace may take reno or bbr)
            ]
            for rank in wan.ranks("us"):
                subprocess.run(
                    ["ip", "netns", "exec", wan.namespace(rank), "sysctl", "-q", "-w", *untuned],
                    check=True,
                )
            said = {}
            for what, script in (
                ("start-up", START_UP.replace("sys.argv[1]", "'env'")),
                ("regions found", START_UP.replace("sys.argv[1]", "'probe'")),
                ("cloudtrain probe", PROBE_COMMAND),
            ):
                procs = spawn_in_regions(wan, script, 29541, stderr=subprocess.PIPE)
                outs = [p.communicate(timeout=180) for p in procs]
                assert [p.returncode for p in procs] == [0] * 4, [o[1][-2000:] for o in outs]
                said[what] = {region: outs[wan.ranks(region)[0]][1] for region in ("us", "eu")}
    finally:
        teardown(name)
    start_up, command = said["start-up"], said["cloudtrain probe"]
    print(start_up["us"], command["us"])
    # rank 0 sends us's link to eu in the start-up probe (eu's last rank sends the other way)
    us, eu = wan.ranks("us")[0], wan.ranks("eu")[0]
    assert f"rank {us} (us): this host's TCP buffers" in start_up["us"]
    assert "to eu " in start_up["us"] and "(4 MiB a round trip" in start_up["us"]
    assert "net.ipv4.tcp_wmem='4096 16384 67108864'" in start_up["us"]
    # regions found by the links: every pair measured, so each us rank names its own links
    found = said["regions found"]
    assert f"rank {us} (measured" in found["us"] and "to measured" in found["us"], found["us"]
    assert f"rank {us}: this host's TCP buffers" in command["us"]
    assert f"to rank {eu} " in command["us"]
    assert "TCP buffers" not in start_up["eu"] + found["eu"] + command["eu"]
    # us's hosts restart idle connections from the initial window: said, with the fix
    for said_us in (start_up["us"], found["us"], command["us"]):
        assert "(net.ipv4.tcp_slow_start_after_idle = 1, and a congestion" in said_us, said_us
        assert "sudo sysctl -w net.ipv4.tcp_slow_start_after_idle=0" in said_us
    assert "slow_start_after_idle" not in start_up["eu"] + found["eu"] + command["eu"]


def test_a_host_that_restarts_idle_connections_is_read_as_such(tmp_path: Path) -> None:
    """An idle connection pays where the host restarts it from the initial window and its
    congestion control is not BBR (which restarts at its bandwidth estimate: on the emulated
    50 Mbit/s link at 180 ms 250 KB after 1.5 s idle took 239 ms either way under BBR, 377
    against 211 under Reno)."""
    from cloudtrain.tcp import restarts_after_idle

    assert restarts_after_idle(tmp_path) is None  # nothing to read: not Linux
    for idle, control, pays in (("1", "cubic", True), ("1", "bbr", False), ("0", "cubic", False)):
        (tmp_path / "tcp_slow_start_after_idle").write_text(f"{idle}\n")
        (tmp_path / "tcp_congestion_control").write_text(f"{control}\n")
        assert restarts_after_idle(tmp_path) is pays, (idle, control)
