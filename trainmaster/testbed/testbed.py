"""A testbed: N hosts as network namespaces, joined through a switch namespace by capped links.

Layout (prefix ``tm``, 3 hosts)::

    tm-h1 [eth0 10.x.y.1] ==link== [p1]\\
    tm-h2 [eth0 10.x.y.2] ==link== [p2]-- br0 [10.x.y.254]   (namespace tm-sw: the switch host)
    tm-h3 [eth0 10.x.y.3] ==link== [p3]/

Each link is a veth pair created inside the namespaces (nothing is ever added to the machine's
own network), capped with a ``tbf`` qdisc on *both* ends, so each direction is limited: eth0's
egress is the host's uplink, p<i>'s egress its downlink. Processes on the switch host (a
forwarding node) reach every host through that host's link, as a top-of-rack switch would.

The state file under ``<trainmaster home>/testbed/<prefix>.json`` is written *before* anything
is created, and ``down`` removes every namespace named after the prefix whether or not the state
file survived, so a crash at any point leaves nothing that the next ``up``/``down`` cannot remove.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import time
import zlib
from dataclasses import asdict, dataclass
from typing import Any

from trainmaster.errors import UserError
from trainmaster.testbed import iproute
from trainmaster.testbed.agents import stop_host_agents
from trainmaster.testbed.options import TestbedOptions, format_rate, state_dir

SWITCH = "sw"
SWITCH_OCTET = 254
HOST_DEVICE = "eth0"
BRIDGE = "br0"


@dataclass(frozen=True)
class LinkCounters:
    """Bytes a host's link carried, counted at the host's end: ``up`` = host -> switch."""

    host: str
    up_bytes: int
    down_bytes: int
    up_packets: int
    down_packets: int


@dataclass(frozen=True)
class HostStatus:
    name: str  # h1.. or sw
    namespace: str
    address: str
    device: str
    up_cap: str  # as tc reports it now, "uncapped" when no tbf is there
    down_cap: str
    counters: LinkCounters | None


@dataclass(frozen=True)
class TestbedStatus:
    __test__ = False

    prefix: str
    subnet: str
    hosts: int
    link_rate: str
    switch_link_rate: str
    mtu: int
    present: bool  # every namespace of the recorded testbed exists
    members: list[HostStatus]


class Testbed:
    """Create, inspect and remove one testbed; hosts are ``h1..hN`` and the switch host ``sw``."""

    __test__ = False

    def __init__(self, options: TestbedOptions, subnet: str | None = None):
        self.options = options
        self.subnet = ipaddress.IPv4Network(subnet) if subnet else _choose_subnet(options.prefix)

    # ---- names and addresses -------------------------------------------------------------
    @property
    def host_names(self) -> list[str]:
        return [f"h{i}" for i in range(1, self.options.hosts + 1)]

    def namespace(self, host: str) -> str:
        self._check_host(host)
        return f"{self.options.prefix}-{host}"

    def address(self, host: str) -> str:
        self._check_host(host)
        octet = SWITCH_OCTET if host == SWITCH else int(host[1:])
        return str(self.subnet.network_address + octet)

    def _check_host(self, host: str) -> None:
        if host != SWITCH and host not in self.host_names:
            raise UserError(
                f"no host {host!r} on testbed {self.options.prefix!r}; hosts are "
                f"{', '.join(self.host_names)} and {SWITCH} (the switch host)"
            )

    # ---- lifecycle ---------------------------------------------------------------------
    @classmethod
    def up(cls, options: TestbedOptions) -> Testbed:
        """Create the testbed; an older one with the same prefix is removed first."""
        iproute.require_root_and_tools()
        remove(options.prefix)
        bed = cls(options)
        bed._write_state()  # intent first: a crash below leaves a record for ``down``
        try:
            bed._create()
        except BaseException:
            remove(options.prefix)
            raise
        return bed

    def _create(self) -> None:
        o, sw = self.options, self.namespace(SWITCH)
        iproute.run("ip", "netns", "add", sw)
        iproute.run("ip", "link", "set", "lo", "up", ns=sw)
        iproute.run("ip", "link", "add", BRIDGE, "type", "bridge", ns=sw)
        # IGMP snooping forwards a multicast group only to its members' ports while a querier
        # is present, and floods it to every port otherwise (the aggregation's results, sent
        # to a group per job, would cross every link): the bridge is the querier, as a switch
        # or router of a real segment is. Its queries ask for answers within 0.1 s, and for as
        # long from enabling it the bridge still floods (measured: a test started right after
        # the testbed's creation had its results flooded with the kernel's default of 10 s)
        iproute.run("ip", "link", "set", BRIDGE, "type", "bridge", "mcast_query_response_interval", "10", ns=sw)
        iproute.run("ip", "link", "set", BRIDGE, "type", "bridge", "mcast_querier", "1", ns=sw)
        for host in self.host_names:
            ns, port = self.namespace(host), f"p{host[1:]}"
            iproute.run("ip", "netns", "add", ns)
            iproute.run("ip", "link", "set", "lo", "up", ns=ns)
            # created inside the switch namespace, the peer moved straight into the host's:
            # no name is ever taken in the machine's own namespace
            iproute.run(
                "ip",
                "link",
                "add",
                port,
                "mtu",
                str(o.mtu),
                "type",
                "veth",
                "peer",
                "name",
                HOST_DEVICE,
                "mtu",
                str(o.mtu),
                "netns",
                ns,
                ns=sw,
            )
            iproute.run("ip", "link", "set", port, "master", BRIDGE, "up", ns=sw)
            iproute.run("ip", "addr", "add", f"{self.address(host)}/24", "dev", HOST_DEVICE, ns=ns)
            iproute.run("ip", "link", "set", HOST_DEVICE, "up", ns=ns)
            _cap(ns, HOST_DEVICE, o.link_rate, o)
            _cap(sw, port, o.link_rate, o)
        iproute.run("ip", "link", "set", BRIDGE, "mtu", str(o.mtu), "up", ns=sw)
        iproute.run("ip", "addr", "add", f"{self.address(SWITCH)}/24", "dev", BRIDGE, ns=sw)
        _cap(sw, BRIDGE, o.switch_link_rate, o)

    def down(self) -> None:
        remove(self.options.prefix)

    # ---- inspection -----------------------------------------------------------------------
    def counters(self) -> dict[str, LinkCounters]:
        """Bytes on each host's link so far (``h1..hN``), read from the interfaces' counters."""
        return {host: _counters(host, self.namespace(host), HOST_DEVICE) for host in self.host_names}

    def status(self) -> TestbedStatus:
        present = set(iproute.namespaces())
        members = []
        for host in [*self.host_names, SWITCH]:
            ns = self.namespace(host)
            if ns not in present:
                members.append(HostStatus(host, ns, self.address(host), "-", "-", "-", None))
                continue
            if host == SWITCH:
                members.append(HostStatus(host, ns, self.address(host), BRIDGE, _tc_rate(ns, BRIDGE), "-", None))
            else:
                members.append(
                    HostStatus(
                        host,
                        ns,
                        self.address(host),
                        HOST_DEVICE,
                        _tc_rate(ns, HOST_DEVICE),
                        _tc_rate(self.namespace(SWITCH), f"p{host[1:]}"),
                        _counters(host, ns, HOST_DEVICE),
                    )
                )
        o = self.options
        return TestbedStatus(
            o.prefix,
            str(self.subnet),
            o.hosts,
            format_rate(o.link_rate),
            format_rate(o.switch_link_rate),
            o.mtu,
            all(m.namespace in present for m in members),
            members,
        )

    # ---- running processes on hosts ----------------------------------------------------------
    def exec_argv(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run inside ``host``: ``ip netns exec`` execs it (same pid)."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def exec(self, host: str, argv: list[str], **popen: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host``'s network namespace (a ``subprocess.Popen``)."""
        return subprocess.Popen(self.exec_argv(host, argv), **popen)

    def run(self, host: str, argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on ``host`` to completion (output captured as text)."""
        return subprocess.run(
            self.exec_argv(host, argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )

    # ---- the record on disk --------------------------------------------------------------------
    def _write_state(self) -> None:
        path = state_dir() / f"{self.options.prefix}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"options": asdict(self.options), "subnet": str(self.subnet)}))
        os.replace(tmp, path)

    @classmethod
    def load(cls, prefix: str = "tm") -> Testbed:
        """The testbed recorded under ``prefix`` (by ``up``, possibly in another process)."""
        path = state_dir() / f"{prefix}.json"
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(
                f"no testbed {prefix!r} is up (no {path}); start one with: trainmaster testbed up --hosts 3"
            ) from None
        return cls(TestbedOptions(**record["options"]), subnet=record["subnet"])


def remove(prefix: str, grace: float = 3.0) -> list[str]:
    """Remove every namespace of testbed ``prefix`` and its record; returns what was removed.

    The hosts' node agents are stopped first (their instances with them, cgroups included);
    other processes still running on a host are stopped then (SIGTERM, then SIGKILL after
    ``grace`` seconds): a namespace lives on, unnamed, while a process is in it. Deleting a
    namespace deletes its veth ends (and so their peers) and its qdiscs with it.
    Idempotent, and it needs no state file: namespaces are found by their names."""

    iproute.require_root_and_tools()
    stop_host_agents(prefix)  # first: each stops its instances and removes their cgroups
    pattern = re.compile(rf"^{re.escape(prefix)}-(?:{SWITCH}|h\d+)$")
    doomed = [ns for ns in iproute.namespaces() if pattern.match(ns)]
    _stop_processes(doomed, grace)
    for ns in doomed:
        iproute.run("ip", "netns", "delete", ns)
    (state_dir() / f"{prefix}.json").unlink(missing_ok=True)
    return doomed


def _stop_processes(namespaces: list[str], grace: float) -> None:
    """Stop every process inside ``namespaces`` (``ip netns pids``): politely, then by force."""

    def pids() -> set[int]:
        found: set[int] = set()
        for ns in namespaces:
            found.update(int(p) for p in iproute.run("ip", "netns", "pids", ns, check=False).stdout.split())
        return found - {os.getpid()}

    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        left = pids()
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        delay = 0.02
        while left and time.monotonic() < deadline:  # sleeping, not spinning: 20 ms to 0.5 s
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
            left = {pid for pid in left if _alive(pid)}
        if not left:
            return


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie waiting for its parent."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _cap(ns: str, device: str, rate: int | None, o: TestbedOptions) -> None:
    """Limit ``device``'s egress to ``rate`` bits/s with a token bucket (``tc ... tbf``).

    The bucket holds 2 ms of traffic (at least two full frames), so a burst never exceeds the
    rate by much; the queue holds ``queue_ms`` of traffic, which is what a sender's window
    may put in flight before the link drops, as a switch's buffer would."""
    if rate is None:
        return
    rate_bytes = rate // 8
    burst = max(2 * (o.mtu + 64), rate_bytes // 500)
    limit = rate_bytes * o.queue_ms // 1000 + burst
    iproute.run(
        "tc",
        "qdisc",
        "replace",
        "dev",
        device,
        "root",
        "tbf",
        "rate",
        f"{rate}bit",
        "burst",
        str(burst),
        "limit",
        str(limit),
        ns=ns,
    )


def _tc_rate(ns: str, device: str) -> str:
    for qdisc in iproute.run_json("tc", "qdisc", "show", "dev", device, ns=ns):
        if qdisc.get("kind") == "tbf":
            return format_rate(int(qdisc["options"]["rate"]) * 8)
    return "uncapped"


def _counters(host: str, ns: str, device: str) -> LinkCounters:
    (link,) = iproute.run_json("ip", "-s", "link", "show", "dev", device, ns=ns)
    stats = link["stats64"]
    return LinkCounters(
        host, stats["tx"]["bytes"], stats["rx"]["bytes"], stats["tx"]["packets"], stats["rx"]["packets"]
    )


def _choose_subnet(prefix: str) -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 derived from the prefix that overlaps none of the machine's own
    addresses or routes (the testbed's addresses exist only inside its namespaces, but a user
    reading ``status`` should never see one that looks like the machine's)."""
    taken = iproute.machine_networks()
    seed = zlib.crc32(prefix.encode())
    for attempt in range(256):
        value = (seed + attempt * 7919) % (200 * 256)
        candidate = ipaddress.IPv4Network(f"10.{value // 256 + 50}.{value % 256}.0/24")
        if not any(candidate.overlaps(t) for t in taken):
            return candidate
    raise UserError("could not find a free private /24 for the testbed in 10.0.0.0/8")
