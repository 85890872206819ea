"""Results replicated by the network: one IP multicast send per result instead of one per worker.

A real aggregation switch (SwitchML) replicates each result to every worker's port in its
hardware. A forwarding node in software that sends one unicast copy per worker pays a system
call and the kernel's UDP path per copy (at 8 workers and 1 Gbit/s most of its CPU: 8 copies x 4
GSO sends of 64 KiB per 256 KB slice). On one L2 segment the Linux bridge can do the
replication instead: the node sends a result once to a multicast group, the bridge clones the
frame to each member's port (an skb clone each, no copy of the data in the node's process).

Each job has a group of its own at each forwarding node, so the tenants of a shared node do not
receive each other's results, nor the workers of a job's other nodes the results a node sends
to its own (``group_for``: a hash of the job and the node's address into a configurable range
of the organization-local scope, RFC 2365). The bridge's IGMP snooping forwards a group only to
its members' ports while a querier is present, and floods it to every port otherwise; either
way a worker still drops a result whose job, round or slice is not one it waits for, as before
(two pairs may also share a group). A worker joins its job's group on its own interface before
its HELLO and says so in the HELLO (the group and its data socket's address). A forwarding node
sends a job's results to the group only for the workers that said so *directly* (the HELLO came
from the address it names, not through a lower node) from inside the subnet of its own
interface (the same L2 segment), and only when every such worker is to receive the result (the
first answer of a slice); a resent result (one worker asked again), a lower forwarding node, a
worker on another segment and the shared-memory transport stay unicast.

The bridge learns a member's port from the IGMP report its kernel sends on the join (and
repeats once); after that only from the answers to its general queries, every 125 s. A port
whose reports were missed, or whose learned entry the bridge dropped (a restart, a flush, an
expired entry), receives none of the group's results until then, and its worker gets every
result by asking again (a unicast resend per slice, each after a retransmission timeout). So a
worker that has to ask again renews its membership (leaves and joins the group: a fresh
report), at most every ``REJOIN_INTERVAL_S``; the bridge forwards the group to its port again
within the report's delay (up to 0.2 s in IGMPv2). A leave does not interrupt the others: the
bridge, as querier, asks the port before it drops it, and the join's report answers.

A membership that never works (the host's reports are filtered, a bridge or a firewall keeps
the group off its port) would make the worker renew it once a second for good and wait a
retransmission timeout for every result. So a renewal is judged at the next one: it *failed*
when, since it, results came that the parameter node sent again because this worker asked
(flagged RETRANSMIT: the fabric works) and none as first sent (those come from the group, or
unicast to a lone member, whom a node does not multicast to). After
``MAX_FAILED_REJOINS`` failed renewals in a row the worker leaves the group and says HELLO to
its forwarding node again, without the group: the node takes it out of the job's members, as it
does for any HELLO without one, and sends it every result unicast from then on (the other
members stay on the group). The HELLO is repeated at the next resends (at most every
``REJOIN_INTERVAL_S``) until a result comes for a slice sent only once: the first answers now
come unicast. The worker's stats say so (``unicast_fallbacks``), and so does a warning in its
log; the choice holds for the rest of that client's job. A renewal after which no result came
at all (a straggler, a dead node) is not judged: the group is not what failed; nor is a
working member one whose every slice a straggler made it resend for a while: the first results,
when the straggler's packets complete the slices, still come.
"""

from __future__ import annotations

import functools
import ipaddress
import zlib

import psutil

# organization-local scope (RFC 2365): never forwarded beyond the site; TTL 1 keeps results on
# the segment anyway
DEFAULT_NETWORK = "239.192.0.0/16"
# a worker asking for resends renews its group membership at most this often: a lost packet
# costs a report or two, never a storm of them
REJOIN_INTERVAL_S = 1.0
# renewals in a row after which resent results came but none from the group: the worker then
# receives its results unicast for good (about this many REJOIN_INTERVAL_S after the first loss)
MAX_FAILED_REJOINS = 3


def parse_network(text: str) -> ipaddress.IPv4Network:
    """A range of IPv4 multicast groups to take the jobs' groups from, validated."""
    try:
        network = ipaddress.IPv4Network(text)
    except ValueError as err:
        raise ValueError(f"multicast network {text!r}: {err}") from None
    if not network.is_multicast:
        raise ValueError(f"multicast network {text!r} is not in 224.0.0.0/4")
    if network.subnet_of(ipaddress.IPv4Network("224.0.0.0/24")):
        raise ValueError(f"multicast network {text!r} is link-local control (224.0.0.0/24): bridges flood it")
    if network.num_addresses < 4:
        raise ValueError(f"multicast network {text!r} has fewer than 4 groups")
    return network


@functools.lru_cache(maxsize=4096)
def group_for(job: int, node: tuple[str, int], network: str = DEFAULT_NETWORK) -> str:
    """The multicast group of ``job``'s results from the forwarding node at ``node`` (the
    address its workers send to): one per job and node, so that neither another tenant's
    workers nor the workers of another node of the same job (a lower level on the same
    segment) receive them. A hash into the range (its first and last address unused): two
    pairs may share a group, which costs their workers bandwidth, never a wrong sum."""
    net = parse_network(network)
    key = f"{job}|{node[0]}|{node[1]}".encode()
    return str(net[1 + zlib.crc32(key) % (net.num_addresses - 2)])


def segment_of(address: str) -> ipaddress.IPv4Interface | None:
    """The interface (address and subnet) that holds ``address``, when multicast can replicate
    results on it: up, multicast-capable, not loopback; None otherwise (a wildcard bind names
    no interface)."""
    stats = psutil.net_if_stats()
    for name, addrs in psutil.net_if_addrs().items():
        flags = set(getattr(stats.get(name), "flags", "").split(","))
        if "loopback" in flags or "multicast" not in flags or not stats[name].isup:
            continue
        for addr in addrs:
            if addr.address == address and addr.netmask:
                return ipaddress.IPv4Interface(f"{address}/{addr.netmask}")
    return None
