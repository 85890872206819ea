"""The few iproute2 commands the testbed needs (``ip``, ``tc``), with errors that say what failed.

iproute2 rather than a netlink library: its commands are what a user types to inspect a
testbed by hand (``ip netns``, ``tc -n NS qdisc show``), and every step is one visible command.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
from typing import Any

from trainmaster.errors import UserError

COMMAND_TIMEOUT = 20.0  # a netlink command that takes longer than this is stuck, not slow


class NetworkCommandError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message holds the command and its stderr."""


def require_root_and_tools() -> None:
    """Testbeds need root (namespaces, links, qdiscs) and iproute2: say so before trying."""
    if os.geteuid() != 0:
        raise UserError(
            "testbeds need root: network namespaces, veth links and tc qdiscs can "
            "only be created by root; run as root (e.g. sudo trainmaster testbed ...)"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise UserError(
            f"testbeds need iproute2 ({', '.join(missing)} not found); install it: apt-get install -y iproute2"
        )


def run(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip``/``tc`` (``args[0]``), inside namespace ``ns`` when given (``-n ns``)."""
    argv = [args[0], *(("-n", ns) if ns else ()), *args[1:]]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise NetworkCommandError(f"'{' '.join(argv)}' did not finish within {COMMAND_TIMEOUT:.0f} s") from None
    if check and done.returncode != 0:
        raise NetworkCommandError(f"'{' '.join(argv)}' failed: {done.stderr.strip()}")
    return done


def run_json(*args: str, ns: str | None = None) -> Any:
    """``ip -j ...`` / ``tc -j ...`` parsed; an empty answer is an empty list."""
    out = run(args[0], "-j", *args[1:], ns=ns).stdout.strip()
    return json.loads(out) if out else []


def namespaces() -> list[str]:
    """Names of the machine's named network namespaces (``ip netns list``)."""
    return [entry["name"] for entry in run_json("ip", "netns", "list")]


def machine_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks this machine already uses: its addresses' subnets and its routes'
    destinations (the default route aside). A testbed or cluster picks its subnets outside them."""
    taken = [
        ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}", strict=False)
        for link in run_json("ip", "-4", "addr")
        for a in link.get("addr_info", [])
    ]
    taken += [
        ipaddress.IPv4Network(r["dst"]) for r in run_json("ip", "-4", "route") if r.get("dst", "default") != "default"
    ]
    return taken
