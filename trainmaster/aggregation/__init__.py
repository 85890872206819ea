"""In-network-style gradient aggregation: workers, forwarding nodes and a parameter node over UDP.

Public entry points: ``AggregationClient`` (a worker, ``allreduce(array) -> array``),
``ForwardingNode``, ``ParameterNode``, ``Fabric`` (start a tier as processes), ``FaultPlan``
(packet faults), ``KillPlan`` (process faults).
"""

from trainmaster.aggregation.fabric import Fabric
from trainmaster.aggregation.kills import KillPlan
from trainmaster.aggregation.parameter_node import ParameterNode
from trainmaster.aggregation.quantize import BlockFloat, FixedScale
from trainmaster.aggregation.switch import ForwardingNode
from trainmaster.aggregation.transport import FaultPlan, UdpTransport
from trainmaster.aggregation.worker import (
    AggregationClient,
    AggregationError,
    WorkerConfig,
    WorkerLostError,
)

__all__ = [
    "AggregationClient",
    "AggregationError",
    "BlockFloat",
    "Fabric",
    "FaultPlan",
    "FixedScale",
    "ForwardingNode",
    "KillPlan",
    "ParameterNode",
    "UdpTransport",
    "WorkerConfig",
    "WorkerLostError",
]
