"""What one cluster is made of: typed options, and every name, address, port and path derived
from them, recorded once on disk so ``status`` and ``down`` (in another process) see the same.

Every machine-wide name carries the cluster's name, so two clusters (two engineers' test runs,
a user's and a test's) never share a namespace, link, cgroup or socket:

- network namespace of node k >= 2: ``tmk-<name>-n<k>``; veth ``tk<name>h<k>`` (machine side)
  and ``tk<name>n<k>`` (node side); bridge ``tk<name>b<k>`` for node k's pods;
- cgroup parent of node k's pods: ``/tmk-<name>-n<k>`` in every cgroup v1 hierarchy;
- addresses: one /20 of 172.16.0.0/12 per cluster: ``.0.k`` is node k, ``.k.0/24`` node k's
  pods, ``.15.0/24`` the service range;
- state under ``$TRAINMASTER_HOME/cluster/<name>/`` (kubeconfig, certificates, logs, pids,
  every daemon's data).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainmaster.errors import UserError
from trainmaster.store.db import home
from trainmaster.testbed import iproute

NAME_PATTERN = re.compile(r"^[a-z][a-z0-9]{0,5}$")  # link names stay within the kernel's 15 characters
MAX_NODES = 8
SERVICE_OCTET = 15  # the /24 of the cluster's /20 that holds service IPs
SOCKET_ROOT = "/run/tmk"
KUBELET_ROOT = "/var/lib/tmk"


def state_root() -> Path:
    return home() / "cluster"


@dataclass(frozen=True)
class ClusterOptions:
    """One cluster: ``nodes`` kubelets (node 1 in the machine's network namespace, each other in
    its own), one etcd, apiserver, controller-manager and scheduler."""

    name: str = "tm"
    nodes: int = 1

    def validate(self) -> None:
        if not NAME_PATTERN.match(self.name):
            raise UserError(
                f"--name: {self.name!r} must be 1-6 characters, a lowercase letter then lowercase letters or "
                "digits (it is part of link names, which the kernel limits to 15 characters)"
            )
        if not 1 <= self.nodes <= MAX_NODES:
            raise UserError(f"--nodes: {self.nodes} must be from 1 to {MAX_NODES}")


@dataclass(frozen=True)
class NodeLayout:
    """One node's names, addresses and folders."""

    index: int
    name: str  # the Kubernetes node name
    address: str  # node IP (on a veth)
    pod_subnet: str  # /24 its pods get their IPs from
    namespace: str | None  # its network namespace (None: the machine's own, node 1)
    host_link: str  # veth end in the machine's namespace
    node_link: str  # veth end carrying the node IP
    bridge: str  # CNI bridge of its pods
    cgroup_root: str  # parent cgroup of its pods, in every v1 hierarchy
    folder: str  # its state folder
    kubelet_port: int

    @property
    def path(self) -> Path:
        return Path(self.folder)

    @property
    def socket_folder(self) -> str:
        """Where its containerd's sockets are: short (a Unix socket path has at most 107
        bytes, a Trainmaster home's can be longer), and named after the node (unique on the
        machine: a cluster's name is)."""
        return f"{SOCKET_ROOT}/{self.name}"

    @property
    def containerd_socket(self) -> str:
        return f"{self.socket_folder}/containerd.sock"

    @property
    def kubelet_root(self) -> str:
        """The kubelet's ``--root-dir``: short for the same reason (it makes its device-plugin
        and pod-resources sockets there), on disk (pods' emptyDir volumes live in it)."""
        return f"{KUBELET_ROOT}/{self.name}"

    @property
    def network_name(self) -> str:
        """The CNI network's name (host-local keeps its leases per network name)."""
        return f"tmk-{self.name}"


@dataclass(frozen=True)
class ClusterLayout:
    """Everything derived from :class:`ClusterOptions`, fixed at ``up`` and recorded on disk."""

    options: ClusterOptions
    subnet: str  # the cluster's /20
    etcd_port: int
    etcd_peer_port: int
    api_port: int
    version: str
    binaries: str  # folder of kube-apiserver, kubelet, ...
    root: str  # the Trainmaster home's cluster folder it was made in
    nodes: list[NodeLayout] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.options.name

    @property
    def folder(self) -> Path:
        return Path(self.root) / self.name

    @property
    def kubeconfig(self) -> Path:
        return self.folder / "kubeconfig"

    @property
    def api_address(self) -> str:
        return self.nodes[0].address

    @property
    def server(self) -> str:
        return f"https://{self.api_address}:{self.api_port}"

    @property
    def service_subnet(self) -> str:
        net = ipaddress.IPv4Network(self.subnet)
        return str(ipaddress.IPv4Network(f"{net.network_address + SERVICE_OCTET * 256}/24"))

    def binary(self, program: str) -> str:
        return os.path.join(self.binaries, program)

    @classmethod
    def plan(cls, options: ClusterOptions, binaries: str, version: str, root: Path | None = None) -> ClusterLayout:
        options.validate()
        root = root or state_root()
        subnet = choose_subnet(options.name, root)
        net = ipaddress.IPv4Network(subnet)
        folder = root / options.name
        ports = free_ports(3 + options.nodes)
        nodes = []
        for k in range(1, options.nodes + 1):
            nodes.append(
                NodeLayout(
                    index=k,
                    name=f"{options.name}-n{k}",
                    address=str(net.network_address + k),
                    pod_subnet=str(ipaddress.IPv4Network(f"{net.network_address + k * 256}/24")),
                    namespace=None if k == 1 else f"tmk-{options.name}-n{k}",
                    host_link=f"tk{options.name}h{k}",
                    node_link=f"tk{options.name}n{k}",
                    bridge=f"tk{options.name}b{k}",
                    cgroup_root=f"/tmk-{options.name}-n{k}",
                    folder=str(folder / f"n{k}"),
                    kubelet_port=ports[2 + k],
                )
            )
        return cls(options, subnet, ports[0], ports[1], ports[2], version, binaries, str(root), nodes)

    # ---- the record on disk ----------------------------------------------------------------------
    def save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / "cluster.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls, name: str = "tm", root: Path | None = None) -> ClusterLayout:
        path = (root or state_root()) / name / "cluster.json"
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(
                f"no cluster {name!r} is up (no {path}); start one with: trainmaster cluster up --nodes 1"
            ) from None
        return cls(
            ClusterOptions(**record["options"]),
            record["subnet"],
            record["etcd_port"],
            record["etcd_peer_port"],
            record["api_port"],
            record["version"],
            record["binaries"],
            record["root"],
            [NodeLayout(**n) for n in record["nodes"]],
        )


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free now on every address (bound together, then released)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("0.0.0.0", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def choose_subnet(name: str, root: Path) -> str:
    """A /20 of 172.16.0.0/12 derived from the name that overlaps none of the machine's
    addresses or routes (another cluster's included: its bridge and routes are the machine's)."""
    taken = iproute.machine_networks()
    taken += [ipaddress.IPv4Network(c.subnet) for c in _recorded_clusters(root) if c.name != name]
    seed = zlib.crc32(name.encode())
    for attempt in range(256):
        value = (seed + attempt * 97) % 256
        candidate = ipaddress.IPv4Network(f"172.{16 + value // 16}.{(value % 16) * 16}.0/20")
        if not any(candidate.overlaps(t) for t in taken):
            return str(candidate)
    raise UserError("could not find a free /20 in 172.16.0.0/12 for the cluster's nodes, pods and services")


def _recorded_clusters(root: Path) -> list[ClusterLayout]:
    found = []
    for path in root.glob("*/cluster.json") if root.is_dir() else []:
        try:
            found.append(ClusterLayout.load(path.parent.name, root))
        except (UserError, ValueError, KeyError, TypeError):
            continue
    return found
