"""The local WAN emulator (cloudtrain.tools.netem): real namespaces, real tbf, the real delay line,
real TCP and gloo.

Tests that build emulators need root and iproute2; without them they skip with the reason. With
them, the emulator must work: a failure to build one fails the test (it never reads as
"unavailable"). Each emulator gets a name unique to this run and is torn down by a fixture
finalizer, also when the test fails; the finalizer also checks that no namespace and no relay of
that name is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from support import EMULATOR_MACHINE

from cloudtrain.tcp import WAN_TCP, window_mbit
from cloudtrain.tools import netem
from cloudtrain.tools.netem import (
    Emulator,
    WanSpec,
    check_name,
    link_profile,
    parse_mbit,
    parse_regions,
    teardown,
)
from cloudtrain.tools.netem.host import _sysctl

pytestmark = pytest.mark.timeout(120)

needs_root = pytest.mark.skipif(
    not EMULATOR_MACHINE, reason="the WAN emulator needs root and iproute2"
)
DELAYED = (netem.DELAY_LINE, netem.DELAY_NETEM)
PY = sys.executable
CLI = [PY, "-m", "cloudtrain.cli", "netem"]


@pytest.fixture
def unique_name(request):
    """A fresh emulator name per call; everything under it is removed at the end of the test,
    and nothing of it may be left: no namespace, no relay process."""
    ok, why = netem.available()
    assert ok, f"root with iproute2 but the emulator reports itself unavailable: {why}"
    names = []

    def make() -> str:
        names.append(f"t{os.getpid() % 100000}-{uuid.uuid4().hex[:6]}")
        return names[-1]

    def cleanup() -> None:
        for name in names:
            teardown(name)
        for name in names:
            assert our_namespaces(name) == set() and relay_pids(name) == []

    request.addfinalizer(cleanup)
    return make


def relay_pids(name: str) -> list[int]:
    """Live relay processes of emulator `name`, from /proc (what `ps` shows)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and not gone(int(proc.name)):
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"relay" in argv and f"--name={name}".encode() in argv:
                pids.append(int(proc.name))
    return pids


def our_namespaces(name: str) -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if f"-{name}-" in line}


def root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def in_rank(wan: Emulator, rank: int, code: str, *args: str) -> str:
    proc = wan.popen(rank, [PY, "-c", code, *args], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return out


# --- no root needed -----------------------------------------------------------------------


def test_profiles_and_parsing():
    assert link_profile("us-eu") == netem.LinkProfile(210, 80)
    assert link_profile("us-asia").rtt_ms == 180 and link_profile("eu-asia").rtt_ms == 230
    assert link_profile("us-us").rtt_ms == 65
    assert link_profile("intra-zone") == netem.LinkProfile(5000, 0.2)
    assert link_profile("500mbit") == netem.LinkProfile(500, 0)
    assert link_profile("42mbit") == netem.LinkProfile(42, 0)
    assert link_profile("2gbit") == netem.LinkProfile(2000, 0)
    with pytest.raises(ValueError, match="unknown link profile"):
        link_profile("us-mars")
    assert parse_regions("us:2,eu:1") == {"us": 2, "eu": 1}
    assert list(parse_regions("eu:1,us:2")) == ["eu", "us"]  # order numbers the ranks
    with pytest.raises(ValueError, match="REGION:RANKS"):
        parse_regions("us=2")
    assert parse_mbit("100", ["us", "eu"]) == {"us": 100.0, "eu": 100.0}
    assert parse_mbit("us=1000,eu=50", ["us", "eu"]) == {"us": 1000.0, "eu": 50.0}


def test_pair_rtt_is_the_mean_of_the_regions_shares():
    one = WanSpec({"us": 1, "eu": 1, "asia": 1}, dict.fromkeys(("us", "eu", "asia"), 100.0), 80)
    assert one.pair_rtt_ms("us", "eu") == one.pair_rtt_ms("eu", "asia") == 80
    assert one.link_delay_ms("us") == 20 and one.pair_rtt_ms("us", "us") == 0
    # us-eu 80, us-asia 180, eu-asia 230 ms (the profiles' figures) as shares
    shares = {"us": 30.0, "eu": 130.0, "asia": 330.0}
    spec = WanSpec(dict.fromkeys(shares, 1), dict.fromkeys(shares, 100.0), shares)
    pairs = (("us", "eu"), ("us", "asia"), ("eu", "asia"))
    assert [spec.pair_rtt_ms(a, b) for a, b in pairs] == [80, 180, 230]
    # one way from a to b crosses a's link and b's link
    assert spec.link_delay_ms("us") + spec.link_delay_ms("eu") == spec.pair_rtt_ms("us", "eu") / 2
    with pytest.raises(ValueError, match="one share per region"):
        WanSpec({"us": 1, "eu": 1}, {"us": 1.0, "eu": 1.0}, {"us": 30.0})
    with pytest.raises(ValueError, match="rtt_ms"):
        WanSpec({"us": 1}, {"us": 1.0}, -1.0)


def test_bad_config_is_rejected_with_a_fix():
    with pytest.raises(ValueError, match="one per region"):
        WanSpec({"us": 1, "eu": 1}, {"us": 100.0})
    with pytest.raises(ValueError, match="positive"):
        WanSpec({"us": 1}, {"us": 0.0})
    with pytest.raises(ValueError, match="bad emulator name"):
        WanSpec({"us": 1}, {"us": 1.0}, name="Has Space")
    with pytest.raises(ValueError, match="ranks must be"):
        WanSpec({"us": 0}, {"us": 1.0})


def test_addresses_are_deterministic_and_ranks_go_region_by_region():
    wan = Emulator({"us": 2, "eu": 3}, {"us": 1000, "eu": 50}, name="layout")
    assert [wan.region(r) for r in range(5)] == ["us", "us", "eu", "eu", "eu"]
    assert [wan.address(r) for r in (0, 1, 2, 4)] == [
        "10.77.0.1",
        "10.77.0.2",
        "10.77.1.1",
        "10.77.1.3",
    ]
    assert wan.namespace(3) == "ct-layout-r3" and wan.ranks("eu") == [2, 3, 4]
    env = wan.env(3, {"RANK": "3"})
    assert env["GLOO_SOCKET_IFNAME"] == "eth0" and env["MASTER_ADDR"] == "10.77.0.1"
    assert env["CLOUDTRAIN_REGION"] == "eu" and env["RANK"] == "3"


@pytest.mark.parametrize("bad", ["../../x", "..", "", "a/b", "x" * 33, "-x", "a\x00b", "A"])
def test_emulator_names_are_plain_names(bad):
    with pytest.raises(ValueError, match="bad emulator name"):
        check_name(bad)
    with pytest.raises(ValueError, match="bad emulator name"):
        teardown(bad)
    assert check_name("t1-abc") == "t1-abc"


@needs_root
def test_down_with_a_path_as_name_touches_nothing_outside_the_state_folder():
    """`down --name ../x` once resolved /run/cloudtrain-netem/../x.json, deleting a file there."""
    victim = Path(f"/run/ct-victim-{uuid.uuid4().hex[:8]}.json")
    victim.write_text("{}")
    try:
        name = f"../{victim.stem}"
        proc = subprocess.run([*CLI, "down", "--name", name], capture_output=True, text=True)
        assert proc.returncode == 2 and "bad emulator name" in proc.stderr, proc.stderr
        assert victim.exists()
    finally:
        victim.unlink(missing_ok=True)


def test_tbf_bucket_holds_a_gso_packet_and_queue_a_bdp():
    p = netem.tbf_params(100)
    assert p["rate"] == 100_000_000 and p["burst"] >= 64 * 1024
    assert p["limit"] >= p["burst"] + 100e6 / 8 * 0.020
    assert netem.tbf_params(100, rtt_ms=200)["limit"] >= 100e6 / 8 * 0.2


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root+setpriv")
def test_without_root_the_cli_says_root_is_needed():
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    if subprocess.run([*drop, PY, "-c", "import cloudtrain.tools.netem"]).returncode != 0:
        pytest.skip("user nobody cannot import cloudtrain from this checkout")
    proc = subprocess.run([*drop, *CLI, "status"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "needs root" in proc.stderr, proc.stderr


# --- real namespaces ----------------------------------------------------------------------


@needs_root
def test_up_down_leaves_nothing_and_never_touches_the_root_namespace(unique_name):
    name = unique_name()
    links_before = root_links()
    with Emulator({"us": 2, "eu": 2}, 100, name=name) as wan:
        assert our_namespaces(name) == {f"ct-{name}-wan", *map(wan.namespace, range(4))}
        assert Path(f"/run/cloudtrain-netem/{name}.json").exists()
        assert root_links() == links_before
        assert wan.emulation == netem.RATE_ONLY and wan.relays == {}
    assert our_namespaces(name) == set()
    assert not Path(f"/run/cloudtrain-netem/{name}.json").exists()
    assert root_links() == links_before


@needs_root
def test_every_rank_reaches_every_address_and_its_loopback(unique_name):
    # A refused connection proves the address answered; a timeout or "unreachable" would not.
    probe = """
import socket, sys
for host in sys.argv[1:]:
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect((host, 9))
    except ConnectionRefusedError:
        continue
    raise SystemExit(f"{host} did not answer")
import fcntl, struct
req = struct.pack("256s", b"eth0")
print(socket.inet_ntoa(fcntl.ioctl(socket.socket(), 0x8915, req)[20:24]))
"""
    with Emulator({"us": 2, "eu": 1, "asia": 1}, 100, name=unique_name()) as wan:
        everyone = [wan.address(r) for r in range(wan.world_size)]
        for rank in range(wan.world_size):
            assert in_rank(wan, rank, probe, "127.0.0.1", *everyone).strip() == wan.address(rank)


@needs_root
def test_shaped_link_runs_at_its_rate_and_intra_region_runs_free(unique_name):
    with Emulator({"us": 2, "eu": 1}, 100, name=unique_name()) as wan:
        before = wan.counters()
        wan_mbit = wan.measure_mbit(0, 2, seconds=1.0)
        after = wan.counters()
        intra_mbit = wan.measure_mbit(0, 1, seconds=0.5)
        after_intra = wan.counters()
    print(f"across 100 Mbit/s: {wan_mbit:.1f} Mbit/s; inside a region: {intra_mbit:.0f} Mbit/s")
    assert 85 <= wan_mbit <= 101, wan_mbit
    assert intra_mbit > 5 * 100, intra_mbit
    # At least the payload that arrived crossed us's uplink and eu's downlink.
    payload = wan_mbit * 1e6 / 8 * 1.0 * 0.9
    assert after["us"]["tx_bytes"] - before["us"]["tx_bytes"] >= payload
    assert after["eu"]["rx_bytes"] - before["eu"]["rx_bytes"] >= payload
    # Traffic inside a region does not touch the WAN link.
    assert after_intra["us"]["tx_bytes"] - after["us"]["tx_bytes"] < 1e6


@needs_root
def test_slow_region_is_the_bottleneck_and_set_rate_acts_live(unique_name):
    with Emulator({"us": 1, "eu": 1}, {"us": 1000, "eu": 100}, name=unique_name()) as wan:
        uplink = wan.measure_mbit(1, 0, seconds=0.8)  # eu sender: its 100 Mbit/s uplink
        wan.set_rate("eu", 25)
        downlink = wan.measure_mbit(0, 1, seconds=0.8)  # into eu: its 25 Mbit/s downlink
        assert wan.mbit == {"us": 1000.0, "eu": 25.0}
        assert Emulator.attach(wan.name).mbit == wan.mbit  # the state file follows
    print(f"eu uplink at 100: {uplink:.1f} Mbit/s; eu downlink after set_rate 25: {downlink:.1f}")
    assert 85 <= uplink <= 101, uplink
    assert 21 <= downlink <= 25.5, downlink


@needs_root
def test_asymmetric_links_each_way(unique_name):
    """Uplink and downlink rates of a region may differ: each direction gets the sender's uplink
    or the receiver's downlink, whichever is slower."""
    ups, downs = {"us": 400, "eu": 50}, {"us": 1000, "eu": 1000}
    with Emulator({"us": 1, "eu": 1}, ups, name=unique_name(), down_mbit=downs) as wan:
        us_to_eu = wan.measure_mbit(0, 1, seconds=0.8)
        eu_to_us = wan.measure_mbit(1, 0, seconds=0.8)
        wan.set_rate("eu", 80, down_mbit=200)
        into_eu = wan.measure_mbit(0, 1, seconds=0.8)
        assert Emulator.attach(wan.name).spec.down("eu") == 200.0
    print(f"us->eu {us_to_eu:.0f}, eu->us {eu_to_us:.0f}, into eu after 200 down: {into_eu:.0f}")
    assert 340 <= us_to_eu <= 404, us_to_eu
    assert 42 <= eu_to_us <= 50.5, eu_to_us
    assert 170 <= into_eu <= 202, into_eu


ECHO_SERVER = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2]))); print("ready", flush=True)
while True:
    c, _ = srv.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while b := c.recv(1):
        c.sendall(b)
"""

ECHO_CLIENT = """
import json, socket, sys, time
connect, rtts = [], []
for _ in range(5):  # the fastest of several: a busy machine only ever adds
    t = time.monotonic()
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])))  # SYN, SYN-ACK: one round trip
    connect.append(time.monotonic() - t)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(5):
        t = time.monotonic(); s.sendall(b"x"); s.recv(1); rtts.append(time.monotonic() - t)
    s.close()
print(json.dumps({"connect_ms": 1000 * min(connect), "echo_ms": 1000 * min(rtts)}))
"""


def round_trips(wan: Emulator, src: int, dst: int, port: int = 7000) -> dict[str, float]:
    """TCP connect time and 1-byte echo time (the fastest of several) from rank src to dst."""
    server = wan.popen(
        dst, [PY, "-c", ECHO_SERVER, wan.address(dst), str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout.readline().strip() == "ready"
        return json.loads(in_rank(wan, src, ECHO_CLIENT, wan.address(dst), str(port)))
    finally:
        server.kill()
        server.wait()


@needs_root
def test_delay_line_delays_by_the_configured_rtt_and_carries_the_rate(unique_name):
    """80 ms between regions: a round trip across regions takes 80 ms (+-10%), one inside a
    region none of it; one TCP flow through the 100 Mbit/s link gets most of the rate, never
    more. (At 80 ms one flow spends its first half second or so in slow start; here it got 87-91
    Mbit/s over 3 s, so 60% leaves room for a busy machine while catching a relay that drops
    or stalls frames.)"""
    with Emulator({"us": 2, "eu": 1}, 100, rtt_ms=80, name=unique_name()) as wan:
        assert wan.emulation in DELAYED, wan.emulation_note
        if wan.emulation == netem.DELAY_LINE:
            assert set(wan.relays) == {"us", "eu"} and relay_pids(wan.name) != []
            state = json.loads(Path(f"/run/cloudtrain-netem/{wan.name}.json").read_text())
            assert state["relays"] == wan.relays and state["relay"]["mbit"] > 200
        cross = round_trips(wan, 0, 2)
        inside = round_trips(wan, 0, 1)
        back = round_trips(wan, 2, 0, port=7001)
        mbit = wan.measure_mbit(0, 2, seconds=3.0)
    print(f"across: {cross}, back: {back}, inside a region: {inside}; TCP {mbit:.1f} Mbit/s")
    assert wan.rtt_ms(0, 2) == 80 and wan.rtt_ms(0, 1) == 0
    for measured in (cross["connect_ms"], cross["echo_ms"], back["echo_ms"]):
        assert 72 <= measured <= 88, (cross, back)
    assert inside["echo_ms"] < 5 and inside["connect_ms"] < 5, inside
    assert 60 <= mbit <= 110, mbit


@needs_root
def test_one_flow_is_held_back_by_the_link_not_by_its_window(unique_name):
    """Every rank's namespace has the TCP settings the Terraform's hosts boot with
    (cloudtrain.tcp.WAN_TCP), so one TCP flow through 400 Mbit/s at 100 ms (5 MB in flight)
    carries more than 0.8x of 4 MiB a round trip, where a flow with the machine's usual 4 MiB
    buffer carries 0.5-0.6x of it (the kernel's bookkeeping takes the rest): 397 Mbit/s over
    3 s, its first second left out."""
    with Emulator({"us": 1, "eu": 1}, 400, rtt_ms=100, name=unique_name()) as wan:
        assert wan.emulation in DELAYED, wan.emulation_note
        for rank in range(wan.world_size):
            for key, value in WAN_TCP.items():
                path = "/proc/sys/" + key.replace(".", "/")
                seen = subprocess.run(
                    ["ip", "netns", "exec", wan.namespace(rank), "cat", path],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                assert seen.split() == value.split(), (rank, key, seen)
        assert "TCP settings the ranks lack" not in wan.emulation_note
        # a setting the kernel refuses is reported, not passed over
        refused = _sysctl(wan.namespace(0), {"net.ipv4.tcp_congestion_control": "no-such-cc"})
        assert refused == [
            "net.ipv4.tcp_congestion_control: asked 'no-such-cc', has "
            f"{WAN_TCP['net.ipv4.tcp_congestion_control']!r}"
        ]
        mbit = wan.measure_mbit(0, 1, seconds=4.0, skip_s=1.0)  # its first second left out
        with pytest.raises(ValueError, match="leave out less than the flow's 1.0 s"):
            wan.measure_mbit(0, 1, seconds=1.0, skip_s=1.0)
    print(f"one flow: {mbit:.0f} Mbit/s; 4 MiB a round trip: {window_mbit(4 << 20, 0.1):.0f}")
    assert 0.8 * window_mbit(4 << 20, 0.1) <= mbit <= 420, mbit


@needs_root
def test_per_region_rtt_shares_give_each_pair_its_rtt(unique_name):
    shares = {"us": 30, "eu": 130, "asia": 330}  # us-eu 80, us-asia 180, eu-asia 230 ms
    with Emulator(dict.fromkeys(shares, 1), 100, rtt_ms=shares, name=unique_name()) as wan:
        measured = {
            (a, b): round_trips(wan, a, b, port=7000 + a)["echo_ms"]
            for a, b in ((0, 1), (0, 2), (1, 2))
        }
    print(measured)
    for (a, b), ms in measured.items():
        assert 0.9 * wan.rtt_ms(a, b) <= ms <= 1.1 * wan.rtt_ms(a, b), measured


@needs_root
def test_a_rate_the_relay_cannot_carry_is_refused(unique_name):
    name = unique_name()
    with pytest.raises(netem.EmulatorError, match="delay relay"):
        Emulator({"us": 1, "eu": 1}, 100_000, rtt_ms=40, name=name).up()
    assert our_namespaces(name) == set() and relay_pids(name) == []
    with Emulator({"us": 1, "eu": 1}, 100, rtt_ms=40, name=unique_name()) as wan:
        with pytest.raises(netem.EmulatorError, match="lower the rate"):
            wan.set_rate("eu", 100_000)
        assert wan.mbit["eu"] == 100


@needs_root
def test_gloo_all_reduce_across_two_regions(unique_name):
    worker = """
import os, sys
from datetime import timedelta
import torch
import torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:29500",
                        rank=rank, world_size=2, timeout=timedelta(seconds=60))
x = torch.full((1 << 20,), float(rank + 1))  # 4 MiB
dist.all_reduce(x)
assert bool((x == 3).all()), x[:4]
print("ok", os.environ["CLOUDTRAIN_REGION"])
dist.destroy_process_group()  # leaving gloo's threads running at exit can abort the process
"""
    with Emulator({"us": 1, "eu": 1}, 100, name=unique_name()) as wan:
        before = wan.counters()
        procs = [
            wan.popen(r, [PY, "-c", worker, str(r)], stdout=subprocess.PIPE, text=True)
            for r in (0, 1)
        ]
        try:
            outs = [p.communicate(timeout=90)[0].strip() for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        after = wan.counters()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs == ["ok us", "ok eu"]
    assert after["us"]["tx_bytes"] - before["us"]["tx_bytes"] >= 2 << 20  # it crossed the WAN


@needs_root
def test_set_rate_under_full_queues_keeps_flows_moving(unique_name):
    """A drop from 1000 to 50 Mbit/s in the middle of all-reduces: every flow carries on at the
    new rate. (`tc qdisc change` of a tbf with a full queue was seen to stall TCP for minutes.)"""
    worker = """
import json, os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:29500",
                        rank=rank, world_size=4, timeout=timedelta(seconds=20))
x = torch.ones(1_000_000)
for step in range(1, 19):
    start = time.monotonic()
    dist.all_reduce(x)
    x.fill_(1)
    if rank == 0:
        print(json.dumps({"step": step, "s": time.monotonic() - start}), flush=True)
dist.destroy_process_group()
"""
    with Emulator({"us": 2, "eu": 2}, 1000, name=unique_name()) as wan:
        procs = [
            wan.popen(r, [PY, "-c", worker, str(r)], stdout=subprocess.PIPE, text=True)
            for r in range(4)
        ]
        seconds = []
        try:
            for line in procs[0].stdout:
                info = json.loads(line)
                seconds.append(info["s"])
                if info["step"] == 12:  # queues are full: rank 0 is mid-stream into the next
                    wan.set_rate("us", 50)
                    wan.set_rate("eu", 50)
            codes = [p.wait(timeout=60) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    assert codes == [0, 0, 0, 0], f"a rank failed (a stalled flow times out in 20 s): {codes}"
    fast, slow = sorted(seconds[2:12])[5], sorted(seconds[13:])[2]
    print(f"all-reduce of 4 MB: {fast * 1e3:.0f} ms at 1000 Mbit/s, {slow * 1e3:.0f} ms at 50")
    assert slow > 5 * fast  # the new rate holds


CRASHING_CHILD = """
import sys, time
from cloudtrain.tools.netem import Emulator
wan = Emulator({"us": 1, "eu": 1}, 100, rtt_ms=40, name=sys.argv[1]).up()
print(wan.popen(0, ["sleep", "60"]).pid, flush=True)
time.sleep(60)
"""


def start_child(name: str) -> tuple[subprocess.Popen, int]:
    child = subprocess.Popen([PY, "-c", CRASHING_CHILD, name], stdout=subprocess.PIPE, text=True)
    sleeper = int(child.stdout.readline())
    return child, sleeper


def wait_gone(pids: list[int], seconds: float = 5) -> bool:
    deadline = time.monotonic() + seconds
    while not all(map(gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return all(map(gone, pids))


@needs_root
@pytest.mark.parametrize("state_file", ["kept", "lost"])
def test_down_cleans_up_after_sigkill(unique_name, state_file):
    name = unique_name()
    links_before = root_links()
    child, sleeper = start_child(name)
    child.kill()
    child.wait()
    relays = relay_pids(name)
    # the crash left it all behind: namespaces, a rank's process, the relays
    assert len(our_namespaces(name)) == 3 and not gone(sleeper)
    state = json.loads(Path(f"/run/cloudtrain-netem/{name}.json").read_text())
    if state["emulation"] == netem.DELAY_LINE:
        assert sorted(relays) == sorted(state["relays"].values()) and len(relays) == 2
    if state_file == "lost":
        Path(f"/run/cloudtrain-netem/{name}.json").unlink()
    proc = subprocess.run([*CLI, "down", "--name", name], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert f"ct-{name}-wan" in proc.stdout
    assert our_namespaces(name) == set()
    assert not Path(f"/run/cloudtrain-netem/{name}.json").exists()
    assert root_links() == links_before
    assert wait_gone([sleeper, *relays]) and relay_pids(name) == []


@needs_root
def test_a_relay_whose_namespace_was_deleted_by_hand_is_still_stopped(unique_name):
    """`ip netns del` of the wan namespace only unmounts it: the relay inside keeps it (and its
    TAPs) alive, out of `ip netns list`'s sight. teardown finds the relay by its command line."""
    name = unique_name()
    wan = Emulator({"us": 1, "eu": 1}, 100, rtt_ms=20, name=name).up(persist=True)
    relays = relay_pids(name)
    assert len(relays) == 2 and sorted(relays) == sorted(netem.relay_processes(name))
    subprocess.run(["ip", "netns", "del", wan.wan_namespace], check=True)
    assert not any(map(gone, relays))
    teardown(name)
    assert wait_gone(relays) and our_namespaces(name) == set()


@needs_root
def test_teardown_never_touches_a_namespace_it_did_not_create(unique_name):
    name = unique_name()
    foreign = [f"ct-{name}-wan", f"ct-{name}-r0"]  # named like ours, made by someone else
    try:
        for ns in foreign:
            subprocess.run(["ip", "netns", "add", ns], check=True)
        assert netem.leftovers(name) == [] and netem.leftovers(None).count(foreign[0]) == 0
        assert teardown(name) == []
        assert our_namespaces(name) == set(foreign)
    finally:
        for ns in foreign:
            subprocess.run(["ip", "netns", "del", ns])


DOWN_ALL = """
set -e
mkdir -p /run/netns /run/cloudtrain-netem
mount -t tmpfs ct-test /run/netns
mount -t tmpfs ct-test /run/cloudtrain-netem
ip netns add ct-{foreign}-wan
ip netns add ct-{foreign}-r0
ip netns add other-ns
{cli} up --regions a:1,b:1 --mbit 100 --rtt-ms 40 --name {ours} > /dev/null
echo "before: $(ip netns list | cut -d' ' -f1 | sort | tr '\n' ' ')"
{cli} down --all
echo "after: $(ip netns list | cut -d' ' -f1 | sort | tr '\n' ' ')"
ip netns del ct-{foreign}-wan; ip netns del ct-{foreign}-r0; ip netns del other-ns
"""


@needs_root
@pytest.mark.skipif(not shutil.which("unshare"), reason="needs unshare (util-linux)")
def test_down_all_removes_only_what_this_emulator_made(unique_name):
    """`down --all` in a private mount namespace (so it sees none of the emulators other test
    runs have up at the same time): our emulator goes, namespaces named like ours stay."""
    ours, foreign = unique_name(), unique_name()
    script = DOWN_ALL.format(cli=" ".join([*CLI]), ours=ours, foreign=foreign)
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    before, removed, after = proc.stdout.strip().splitlines()[-3:]
    assert f"ct-{ours}-wan" in before and f"ct-{ours}-r1" in before
    assert f"ct-{ours}-wan" in removed and f"ct-{foreign}" not in removed
    assert set(after.removeprefix("after:").split()) == {
        f"ct-{foreign}-wan",
        f"ct-{foreign}-r0",
        "other-ns",
    }
    assert relay_pids(ours) == []


@needs_root
def test_sigterm_cleans_up(unique_name):
    name = unique_name()
    child, sleeper = start_child(name)
    child.send_signal(signal.SIGTERM)
    relays = relay_pids(name)
    assert child.wait(timeout=30) == 128 + signal.SIGTERM
    assert our_namespaces(name) == set() and wait_gone(relays)
    assert not Path(f"/run/cloudtrain-netem/{name}.json").exists()
    assert gone(sleeper)


@needs_root
def test_cli_up_status_rate_exec_down(unique_name):
    name = unique_name()

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)

    up = cli("up", "--regions", "us:2,eu:1", "--profile", "us-eu", "--name", name)
    assert up.returncode == 0, up.stderr
    again = cli("up", "--regions", "us:1", "--mbit", "5", "--name", name)
    assert again.returncode == 1 and "exists already" in again.stderr
    assert cli("rate", "--region", "eu", "--mbit", "50", "--name", name).returncode == 0
    status = json.loads(cli("status", "--name", name, "--json").stdout)
    (emu,) = status["emulators"]
    assert emu["emulation"] in DELAYED and emu["rtt_ms"] == 80
    assert {r: v["mbit"] for r, v in emu["regions"].items()} == {"us": 210.0, "eu": 50.0}
    assert emu["regions"]["eu"]["addresses"] == ["10.77.1.1"]
    assert set(emu["counters"]) == {"us", "eu"}
    ex = cli("exec", "2", "--name", name, "--", "sh", "-c", "echo $GLOO_SOCKET_IFNAME $MASTER_ADDR")
    assert ex.stdout.split() == ["eth0", "10.77.0.1"], ex.stderr
    text = cli("status", "--name", name).stdout
    assert "rate + delay (" in text and "80 ms RTT" in text, text
    if emu["emulation"] == netem.DELAY_LINE:  # its note follows the rates: the busiest link
        assert "420 Mbit/s" in emu["note"], emu["note"]  # us: 210 up + 210 down
        assert cli("rate", "--region", "us", "--mbit", "30", "--name", name).returncode == 0
        note = json.loads(cli("status", "--name", name, "--json").stdout)["emulators"][0]["note"]
        assert "100 Mbit/s" in note, note  # now eu's 50 + 50
    # its namespace removed by hand: status names it and the way out, down still cleans up
    subprocess.run(["ip", "netns", "del", f"ct-{name}-wan"], check=True)
    stale = cli("status", "--name", name)
    assert stale.returncode == 1 and "Traceback" not in stale.stderr, stale.stderr
    assert f"`cloudtrain netem down --name {name}` cleans it up" in stale.stderr, stale.stderr
    down = cli("down", "--name", name)
    assert down.returncode == 0 and our_namespaces(name) == set()
