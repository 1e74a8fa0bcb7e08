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

from cloudtrain.tcp import BUFFERS, NEAR, WAN_TCP, buffer_ceiling, window_limited, window_mbit

USUAL = 4 << 20  # Linux's usual tcp_wmem ceiling


def write_proc(root: Path, wmem: str, rmem: str) -> Path:
    (root / "tcp_wmem").write_text(wmem + "\n")
    (root / "tcp_rmem").write_text(rmem + "\n")
    return root


def test_buffer_ceiling_is_the_smaller_of_send_and_receive(tmp_path: Path) -> None:
    assert buffer_ceiling(write_proc(tmp_path, "4096\t16384\t4194304", "4096 131072 6291456")) == (
        4194304
    )
    assert buffer_ceiling(write_proc(tmp_path, "4096 16384 67108864", "4096 87380 6291456")) == (
        6291456
    )
    assert buffer_ceiling(tmp_path / "nothing-here") is None
    assert buffer_ceiling(write_proc(tmp_path, "garbage", "4096 1 2")) is None


def test_this_host_reads_a_ceiling() -> None:
    ceiling = buffer_ceiling()
    assert ceiling is not None and ceiling >= 4096


def test_window_rate_follows_buffer_over_round_trip() -> None:
    # one flow with the usual 4 MiB on the emulator: 239 Mbit/s at 80 ms, 89 at 180 ms
    assert window_mbit(USUAL, 0.08) == pytest.approx(419.4, abs=0.1)
    assert window_mbit(USUAL, 0.18) == pytest.approx(186.4, abs=0.1)
    assert window_mbit(2 * USUAL, 0.08) == pytest.approx(2 * window_mbit(USUAL, 0.08))
    assert window_mbit(USUAL, 0.0) > 1e6  # no round trip: no window limit worth the name


def test_warns_only_about_links_that_read_what_the_buffers_allow() -> None:
    links = {
        "eu": (239.0, 0.08),  # 1000 Mbit/s link, window-limited
        "asia": (45.0, 0.18),  # 50 Mbit/s link: far under the 186 of 4 MiB a round trip
        "ap": (190.0, 0.08),  # 200 Mbit/s link at 80 ms, which 4 MiB does not hold back
        "near": (950.0, 0.0001),  # in the same data centre
    }
    message = window_limited(links, USUAL)
    assert "to eu 239 Mbit/s at 80 ms (the buffer a round trip: 419 Mbit/s)" in message
    assert "asia" not in message and "near" not in message and "ap" not in message
    assert "at most 4 MiB" in message
    for key in BUFFERS:
        assert f"{key}='{WAN_TCP[key]}'" in message  # what to run, word for word
    assert "congestion" not in message
    assert window_limited({"asia": links["asia"], "near": links["near"]}, USUAL) == ""
    # just under NEAR of the window rate: not held back
    assert window_limited({"eu": (NEAR * window_mbit(USUAL, 0.08) - 1, 0.08)}, USUAL) == ""


def test_no_warning_with_the_wan_buffers_or_without_a_reading() -> None:
    big = int(WAN_TCP["net.ipv4.tcp_wmem"].split()[2])
    assert window_limited({"eu": (239.0, 0.08), "ap": (950.0, 0.18)}, big) == ""
    assert window_limited({"eu": (239.0, 0.08)}, None) == ""


START_UP = """
import logging, sys
from datetime import timedelta
import torch.distributed as dist
import cloudtrain
from cloudtrain.config import CompressionConfig
from cloudtrain.topology import Topology
logging.basicConfig(stream=sys.stderr, format="%(message)s")
cloudtrain.init()
topo = Topology.discover(CompressionConfig(), timedelta(seconds=60))
topo.probe()
dist.barrier()
dist.destroy_process_group()
"""


PROBE_COMMAND = "import runpy; runpy.run_module('cloudtrain.tools.probe', run_name='__main__')"


@pytest.mark.skipif(not EMULATOR_MACHINE, reason="the WAN emulator needs root and iproute2")
@pytest.mark.timeout(240)
def test_start_up_names_the_host_whose_buffers_hold_its_link_back() -> None:
    """400 Mbit/s at 100 ms: region us's hosts keep the usual 4 MiB send buffer (untuned
    hosts), eu's have WAN_TCP's (the emulator's, as the Terraform's hosts boot). The start-up
    probe's warning, and `cloudtrain probe`'s, come from us, name its link to eu and the fix;
    eu says nothing."""
    from cloudtrain.tools.netem import Emulator, teardown

    name = f"tcp{os.getpid() % 10000}-{uuid.uuid4().hex[:4]}"
    try:
        # two ranks a region: `cloudtrain probe` finds regions by the links' gap
        with Emulator({"us": 2, "eu": 2}, 400, rtt_ms=100, name=name) as wan:
            untuned = "net.ipv4.tcp_wmem=4096 16384 4194304"
            for rank in wan.ranks("us"):
                subprocess.run(
                    ["ip", "netns", "exec", wan.namespace(rank), "sysctl", "-q", "-w", untuned],
                    check=True,
                )
            said = {}
            for what, script in (("start-up", START_UP), ("cloudtrain probe", PROBE_COMMAND)):
                procs = spawn_in_regions(wan, script, 29541, stderr=subprocess.PIPE)
                outs = [p.communicate(timeout=180) for p in procs]
                assert [p.returncode for p in procs] == [0] * 4, [o[1][-2000:] for o in outs]
                said[what] = {region: outs[wan.ranks(region)[0]][1] for region in ("us", "eu")}
    finally:
        teardown(name)
    start_up, command = said["start-up"], said["cloudtrain probe"]
    print(start_up["us"], command["us"])
    assert "region us: this host's TCP buffers (at most 4 MiB" in start_up["us"]
    assert "to eu " in start_up["us"]
    assert "net.ipv4.tcp_wmem='4096 16384 67108864'" in start_up["us"]
    us, eu = wan.ranks("us")[0], wan.ranks("eu")[0]
    assert f"rank {us}: this host's TCP buffers (at most 4 MiB" in command["us"]
    assert f"to rank {eu} " in command["us"]
    assert "TCP buffers" not in start_up["eu"] + command["eu"]
