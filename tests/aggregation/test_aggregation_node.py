"""What both node roles share (aggregation/node.py): one datagram's handling and per-hop sends."""

from __future__ import annotations

import json

import pytest

from trainmaster.aggregation.node import DatagramNode, by_next_hop
from trainmaster.aggregation.parameter_node import ParameterNode
from trainmaster.aggregation.protocol import Header, Kind, decode, encode
from trainmaster.aggregation.switch import ForwardingNode
from trainmaster.aggregation.transport import UdpTransport


def test_down_going_packets_go_once_per_next_hop() -> None:
    """Multicast down the tree: the workers of a bitmap are grouped by their next hop, each
    copy naming only that hop's workers; a worker without a route is left out."""
    a, b = ("127.0.0.1", 1001), ("127.0.0.1", 1002)
    routes = {0: a, 1: b, 2: a, 5: b}
    assert by_next_hop(0b100111, routes) == {a: 0b101, b: 0b100010}
    assert by_next_hop(0b1000, routes) == {}  # rank 3 has no route


@pytest.mark.parametrize("role", ["ps", "switch"])
def test_both_roles_drop_invalid_datagrams_and_answer_stats_and_shutdown(role: str) -> None:
    """Corrupted packets are dropped like lost ones (not counted, no exception), STATS is
    answered with the role's own counters to the asker, SHUTDOWN ends ``serve``."""
    peer = UdpTransport("peer")
    ps = ParameterNode()
    node: DatagramNode = ps if role == "ps" else ForwardingNode(ps.address)
    try:
        node.handle(b"\x07" + bytes(40), peer.address)  # wrong protocol version
        node.handle(b"short", peer.address)
        assert node.counters.packets_in == 0
        node.handle(encode(Header(Kind.STATS, 0)), peer.address)
        got = peer.recv(2.0)
        assert got is not None
        h, body = decode(got[0])
        stats = json.loads(bytes(body))
        assert h.kind == Kind.STATS and stats["role"] == role and stats["packets_in"] == 1
        node.handle(encode(Header(Kind.SHUTDOWN, 0)), peer.address)
        node.serve(until=None)  # returns at once: SHUTDOWN was handled, and closes the transport
    finally:
        peer.close()
        for n in {id(node): node, id(ps): ps}.values():
            n.transport.close()
