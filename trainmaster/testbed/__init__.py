"""Testbeds: real hosts (network namespaces) joined by rate-capped links, on one machine.

How every multi-host claim of the project is tested without a cluster: ``Testbed.up`` builds
N hosts and a switch host, ``Testbed.exec`` runs a process on a host, ``Testbed.counters``
reads the bytes each link carried, ``Testbed.down`` / ``remove`` leaves nothing behind.
"""

from trainmaster.testbed.options import TestbedOptions, format_rate, parse_rate
from trainmaster.testbed.testbed import SWITCH, LinkCounters, Testbed, TestbedStatus, remove

__all__ = [
    "SWITCH",
    "LinkCounters",
    "Testbed",
    "TestbedOptions",
    "TestbedStatus",
    "format_rate",
    "parse_rate",
    "remove",
]
