"""The testbed: hosts as network namespaces joined through a switch namespace by tbf-capped
veth links (issue #16, part 1)."""

from __future__ import annotations

import ipaddress
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainmaster.testbed import SWITCH, Testbed, TestbedOptions, parse_rate, remove
from trainmaster.testbed.iproute import namespaces

PROBE = str(Path(__file__).with_name("netprobe.py"))
PY = sys.executable


def _serve(bed: Testbed, host: str, port: int) -> subprocess.Popen[str]:
    server = bed.exec(host, [PY, PROBE, "serve", str(port)], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    assert server.stdout.readline().strip() == "listening"
    return server


def test_hosts_get_their_own_addresses_and_reach_each_other_through_the_switch(make_testbed):
    """Each host is a namespace with one address of the testbed's /24; host<->host and
    host<->switch-host traffic crosses the links."""
    bed = make_testbed(hosts=3, link_rate=parse_rate("1gbit"))
    assert [bed.namespace(h) for h in bed.host_names] == [f"{bed.options.prefix}-h{i}" for i in (1, 2, 3)]
    assert set(bed.namespace(h) for h in [*bed.host_names, SWITCH]) <= set(namespaces())
    addresses = [bed.address(h) for h in [*bed.host_names, SWITCH]]
    assert all(ipaddress.IPv4Address(a) in bed.subnet for a in addresses)
    assert len(set(addresses)) == 4
    shown = bed.run("h2", ["ip", "-j", "-4", "addr", "show", "dev", "eth0"])
    assert json.loads(shown.stdout)[0]["addr_info"][0]["local"] == bed.address("h2")
    for source, target in (("h1", "h3"), ("h3", SWITCH)):
        server = _serve(bed, target, 7001)
        sent = bed.run(source, [PY, PROBE, "send", bed.address(target), "7001", "100000"])
        assert sent.returncode == 0, sent.stderr
        out, _ = server.communicate(timeout=30)
        assert int(out.split()[-1]) == 100000


def test_hosts_are_isolated_from_the_machines_network(make_testbed):
    """A host has no route to the machine's own addresses, and the machine has none to it."""
    bed = make_testbed(hosts=2)
    own = [
        a["local"]
        for link in json.loads(
            subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, text=True, check=True).stdout
        )
        for a in link.get("addr_info", [])
        if not a["local"].startswith("127.")
    ]
    for address in own[:2]:
        probe = bed.run("h1", [PY, PROBE, "connect", address, "22"])
        assert probe.stdout.strip() == "ENETUNREACH", (address, probe.stdout, probe.stderr)
    # the machine holds no address of the testbed's subnet and none of its interfaces
    assert not [a for a in own if ipaddress.IPv4Address(a) in bed.subnet]
    links = subprocess.run(["ip", "-j", "link"], capture_output=True, text=True, check=True)
    assert not any(l["ifname"].startswith(("p1", "br0")) for l in json.loads(links.stdout))


def test_tbf_cap_limits_throughput_and_counters_count_the_bytes(make_testbed):
    """A TCP transfer over a 20 Mbit/s link runs at that rate (loosely: within 2x), and the
    interfaces' counters see every byte once on each link it crosses."""
    bed = make_testbed(hosts=2, link_rate=parse_rate("20mbit"))
    before = bed.counters()
    server = _serve(bed, "h2", 7002)
    size = 3_000_000  # 1.2 s at 20 Mbit/s
    sent = bed.run("h1", [PY, PROBE, "send", bed.address("h2"), "7002", str(size)])
    assert sent.returncode == 0, sent.stderr
    server.communicate(timeout=30)
    _, seconds = sent.stdout.split()
    rate_bits = size * 8 / float(seconds)
    assert 10e6 <= rate_bits <= 21e6, f"{rate_bits / 1e6:.1f} Mbit/s on a 20 Mbit/s link"
    after = bed.counters()
    up = after["h1"].up_bytes - before["h1"].up_bytes
    down = after["h2"].down_bytes - before["h2"].down_bytes
    assert size <= up < size * 1.1 and size <= down < size * 1.1, (up, down)
    status = bed.status()
    assert {m.up_cap for m in status.members if m.name != SWITCH} == {"20mbit"}
    assert {m.down_cap for m in status.members if m.name != SWITCH} == {"20mbit"}


def test_down_from_another_process_removes_everything_and_is_idempotent(make_testbed):
    """The state on disk lets a separate ``trainmaster testbed down`` find and remove it."""
    bed = make_testbed(hosts=2, link_rate=None)
    prefix = bed.options.prefix
    cli = [PY, "-m", "trainmaster", "testbed"]
    status = subprocess.run([*cli, "status", "--prefix", prefix, "--json"], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["present"] is True
    for _ in range(2):
        done = subprocess.run([*cli, "down", "--prefix", prefix], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    assert not [ns for ns in namespaces() if ns.startswith(prefix + "-")]
    gone = subprocess.run([*cli, "status", "--prefix", prefix], capture_output=True, text=True, timeout=60)
    assert gone.returncode == 2 and "no testbed" in gone.stderr and "Traceback" not in gone.stderr


def test_a_crash_half_way_through_up_leaves_nothing_down_cannot_remove(unique_prefix):
    """Namespaces of a half-built testbed, without any state file, are found by name."""
    for ns in (f"{unique_prefix}-sw", f"{unique_prefix}-h1"):
        subprocess.run(["ip", "netns", "add", ns], check=True, timeout=20)
    assert sorted(remove(unique_prefix)) == [f"{unique_prefix}-h1", f"{unique_prefix}-sw"]
    bed = Testbed.up(TestbedOptions(hosts=1, prefix=unique_prefix))  # up over leftovers works too
    Testbed.up(TestbedOptions(hosts=2, prefix=unique_prefix))
    assert sorted(ns for ns in namespaces() if ns.startswith(unique_prefix + "-")) == [
        f"{unique_prefix}-h1",
        f"{unique_prefix}-h2",
        f"{unique_prefix}-sw",
    ]
    bed.down()


def test_cli_refuses_bad_options_and_non_root_clearly(monkeypatch):
    """User mistakes: exit 2, one line saying what to do, no traceback."""
    bad = subprocess.run(
        [PY, "-m", "trainmaster", "testbed", "up", "--hosts", "2", "--link", "fast"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "not a rate" in bad.stderr and "Traceback" not in bad.stderr
    many = subprocess.run(
        [PY, "-m", "trainmaster", "testbed", "up", "--hosts", "500"], capture_output=True, text=True, timeout=60
    )
    assert many.returncode == 2 and "--hosts must be between 1 and 200" in many.stderr
    from trainmaster.cli.main import main

    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as exit_info:
        main(["testbed", "down", "--prefix", "nobody"])
    assert exit_info.value.code == 2


def test_down_stops_processes_still_running_on_hosts(make_testbed):
    """A namespace outlives its name while a process is inside it: down stops them first."""
    bed = make_testbed(hosts=2, link_rate=None)
    polite = bed.exec("h1", [PY, "-c", "import time; time.sleep(600)"])
    stubborn = bed.exec(
        SWITCH, [PY, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"]
    )
    time.sleep(0.5)  # let the second one install its handler
    from trainmaster.testbed.testbed import remove as remove_with_grace

    remove_with_grace(bed.options.prefix, grace=0.5)
    assert polite.wait(timeout=10) == -signal.SIGTERM
    assert stubborn.wait(timeout=10) == -signal.SIGKILL
