"""A real Kubernetes cluster on this machine: ``trainmaster cluster up --nodes N | status | down``.

Built from Debian's ``kubernetes`` source package once (``make k8s-deps``, see
:mod:`trainmaster.cluster.binaries`); see docs/kubernetes.md.
"""

from trainmaster.cluster.binaries import Binaries, find_binaries
from trainmaster.cluster.cluster import Cluster, ClusterStatus, NodeStatus, remove
from trainmaster.cluster.layout import ClusterLayout, ClusterOptions, NodeLayout

__all__ = [
    "Binaries",
    "Cluster",
    "ClusterLayout",
    "ClusterOptions",
    "ClusterStatus",
    "NodeLayout",
    "NodeStatus",
    "find_binaries",
    "remove",
]
