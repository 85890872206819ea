"""Stand up, inspect and remove a real Kubernetes cluster on this machine.

The control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler) runs as
processes of the machine. Each node is a containerd and a kubelet sharing one private mount
namespace (their own ``/var/log/pods``, ``/var/log/containers``, ``/run/netns``,
``/run/containerd`` and ``/var/lib/cni``: a kubelet deletes log folders of pods it does not know,
so two kubelets must never see each other's); node 1 uses the machine's network namespace,
every other node its own, joined to the machine by a veth pair and routes. Every name carries
the cluster's (:mod:`trainmaster.cluster.layout`), every daemon is recorded by pid
(:mod:`trainmaster.cluster.processes`), and :func:`remove` stops exactly those, kills what runs
in the nodes' cgroups, and deletes the nodes' links, namespaces and cgroups.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from trainmaster.cluster import images
from trainmaster.cluster.binaries import Binaries, find_binaries
from trainmaster.cluster.layout import KUBELET_ROOT, SOCKET_ROOT, ClusterLayout, ClusterOptions, NodeLayout, state_root
from trainmaster.cluster.pki import Pki, write_pki
from trainmaster.cluster.processes import Daemons, alive, pids_with_argument, signal_and_wait
from trainmaster.errors import UserError
from trainmaster.testbed import iproute

CGROUP_ROOT = "/sys/fs/cgroup"
NETNS_DIR = "/run/netns"
# folders a kubelet or containerd writes at fixed places: each node gets its own under these
PRIVATE_FOLDERS = ("/var/log/pods", "/var/log/containers", "/run/netns", "/run/containerd", "/var/lib/cni")
READY_TIMEOUT = 120.0
# no component may reach for cloud metadata (nothing outside the machine is contacted)
QUIET_ENV = {"AWS_EC2_METADATA_DISABLED": "true"}


@dataclass(frozen=True)
class NodeStatus:
    name: str
    address: str
    namespace: str
    ready: bool
    kubelet_pid: int | None
    containerd_pid: int | None


@dataclass(frozen=True)
class ClusterStatus:
    name: str
    version: str
    server: str
    kubeconfig: str
    subnet: str
    api_ready: bool
    nodes: list[NodeStatus]
    daemons: dict[str, int | None]


class Cluster:
    """One cluster of this machine, as recorded under ``$TRAINMASTER_HOME/cluster/<name>/``."""

    def __init__(self, layout: ClusterLayout):
        self.layout = layout
        self.daemons = Daemons(layout.folder)
        self.pki = Pki(layout.folder / "pki")

    # ---- lifecycle ---------------------------------------------------------------------------
    @classmethod
    def up(
        cls,
        options: ClusterOptions,
        binaries: Binaries | None = None,
        progress: Callable[[str], None] = lambda _: None,
        root: Path | None = None,
    ) -> Cluster:
        """Create the cluster (its state in ``root``, default the Trainmaster home's
        ``cluster/``); an older one of the same name there is removed first. Returns once the
        API answers and every node is Ready (or raises, having removed what it made)."""
        options.validate()
        _require_root()
        found = binaries or find_binaries()
        root = root or state_root()
        remove(options.name, root=root)
        clash = _clash(options.name)
        if clash:
            raise UserError(
                f"a cluster named {options.name!r} of another Trainmaster home runs on this machine ({clash}); "
                "choose another --name, or take that one down from its home (trainmaster cluster down)"
            )
        layout = ClusterLayout.plan(options, found.folder, found.version, root)
        layout.save()  # intent first: a crash below leaves a record for ``down``
        cluster = cls(layout)
        started = time.monotonic()
        try:
            cluster._create(found, progress)
        except BaseException:
            remove(options.name, root=root)
            raise
        progress(f"cluster {options.name} ready in {time.monotonic() - started:.1f} s")
        return cluster

    @classmethod
    def load(cls, name: str = "tm", root: Path | None = None) -> Cluster:
        return cls(ClusterLayout.load(name, root))

    def down(self) -> None:
        remove(self.layout.name, root=Path(self.layout.root))

    def _create(self, binaries: Binaries, progress: Callable[[str], None]) -> None:
        lay = self.layout
        for sub in ("logs", "pids", "etcd"):
            (lay.folder / sub).mkdir(parents=True, exist_ok=True)
        write_pki(
            lay.folder / "pki",
            [lay.api_address, "127.0.0.1", str(ipaddress.IPv4Network(lay.service_subnet).network_address + 1)],
            ["kubernetes", "kubernetes.default", "kubernetes.default.svc", "localhost"],
        )
        tokens = self._write_tokens()
        progress("network: node links, addresses and routes")
        self._create_network()
        with ThreadPoolExecutor(max_workers=2) as pool:
            tars = pool.submit(images.build_image_tars, Path(lay.root) / "images", binaries.pause)
            progress("control plane: etcd, kube-apiserver")
            self._start_control_plane(tokens)
            image_tars = tars.result()
        progress(f"nodes: containerd, images ({', '.join(t.tag for t in image_tars)}), kubelet")
        for node in lay.nodes:
            self._start_node(node, tokens[f"system:node:{node.name}"], image_tars)
        self._wait_api(READY_TIMEOUT)
        progress("control plane: kube-controller-manager, kube-scheduler")
        self._start_controllers(tokens["admin"])
        self._write_kubeconfig(lay.kubeconfig, tokens["admin"], "admin")
        progress(f"waiting for {len(lay.nodes)} node(s) to be Ready")
        self._wait_nodes_ready(READY_TIMEOUT)

    # ---- identity ------------------------------------------------------------------------------
    def _write_tokens(self) -> dict[str, str]:
        """Static bearer tokens: the admin (system:masters, also used by the controller-manager
        and scheduler) and one per node (``system:node:<name>`` in ``system:nodes``: the Node
        authorizer lets a kubelet touch only its own objects)."""
        tokens = {"admin": secrets.token_hex(16)}
        lines = [f'{tokens["admin"]},admin,admin,"system:masters"']
        for node in self.layout.nodes:
            user = f"system:node:{node.name}"
            tokens[user] = secrets.token_hex(16)
            lines.append(f'{tokens[user]},{user},{user},"system:nodes"')
        path = self.layout.folder / "pki" / "tokens.csv"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        (self.layout.folder / "pki" / "admin.token").write_text(tokens["admin"])
        (self.layout.folder / "pki" / "admin.token").chmod(0o600)
        return tokens

    def admin_token(self) -> str:
        return (self.layout.folder / "pki" / "admin.token").read_text().strip()

    def _write_kubeconfig(self, path: Path, token: str, user: str) -> None:
        import yaml

        ca = self.pki.ca_cert.read_text()
        import base64

        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": f"tmk-{self.layout.name}",
                    "cluster": {
                        "server": self.layout.server,
                        "certificate-authority-data": base64.b64encode(ca.encode()).decode(),
                    },
                }
            ],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [
                {"name": f"tmk-{self.layout.name}", "context": {"cluster": f"tmk-{self.layout.name}", "user": user}}
            ],
            "current-context": f"tmk-{self.layout.name}",
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(config, f, sort_keys=False)

    # ---- network -------------------------------------------------------------------------------
    def _create_network(self) -> None:
        first = self.layout.nodes[0]
        for node in self.layout.nodes:
            iproute.run("ip", "link", "add", node.host_link, "type", "veth", "peer", "name", node.node_link)
            iproute.run("ip", "link", "set", node.host_link, "up")
            if node.namespace is None:  # node 1: the machine's namespace holds its address
                iproute.run("ip", "addr", "add", f"{node.address}/32", "dev", node.node_link)
                iproute.run("ip", "link", "set", node.node_link, "up")
                continue
            iproute.run("ip", "netns", "add", node.namespace)
            iproute.run("ip", "link", "set", "lo", "up", ns=node.namespace)
            iproute.run("ip", "link", "set", node.node_link, "netns", node.namespace)
            iproute.run("ip", "addr", "add", f"{node.address}/32", "dev", node.node_link, ns=node.namespace)
            iproute.run("ip", "link", "set", node.node_link, "up", ns=node.namespace)
            iproute.run(
                "ip",
                "route",
                "add",
                "default",
                "via",
                first.address,
                "dev",
                node.node_link,
                "onlink",
                ns=node.namespace,
            )
            iproute.run("ip", "route", "add", f"{node.address}/32", "dev", node.host_link)
            iproute.run("ip", "route", "add", node.pod_subnet, "via", node.address, "dev", node.host_link)
        # pods of one node reach another node's pods through the machine (the CNI bridge
        # plugin turns this on as well, when it makes node 1's bridge)
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")

    # ---- control plane ---------------------------------------------------------------------------
    def _start_control_plane(self, tokens: dict[str, str]) -> None:
        lay, pki = self.layout, self.pki
        etcd = shutil.which("etcd")
        if etcd is None:
            raise UserError("etcd is not installed; run `make k8s-deps` (apt-get install etcd-server)")
        self.daemons.start(
            "etcd",
            [
                etcd,
                f"--name=tmk-{lay.name}",
                f"--data-dir={lay.folder / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{lay.etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{lay.etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{lay.etcd_peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{lay.etcd_peer_port}",
                f"--initial-cluster=tmk-{lay.name}=http://127.0.0.1:{lay.etcd_peer_port}",
                "--log-level=warn",
                "--logger=zap",
            ],
            QUIET_ENV,
        )
        _wait(
            lambda: _http_ok(f"http://127.0.0.1:{lay.etcd_port}/health"),
            30.0,
            f"etcd of cluster {lay.name} answering on 127.0.0.1:{lay.etcd_port}",
            self.daemons.logs / "etcd.log",
        )
        self.daemons.start(
            "kube-apiserver",
            [
                lay.binary("kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{lay.etcd_port}",
                f"--bind-address={lay.api_address}",
                f"--advertise-address={lay.api_address}",
                f"--secure-port={lay.api_port}",
                "--insecure-port=0",
                f"--cert-dir={lay.folder / 'pki'}",
                f"--tls-cert-file={pki.apiserver_cert}",
                f"--tls-private-key-file={pki.apiserver_key}",
                f"--client-ca-file={pki.ca_cert}",
                f"--token-auth-file={lay.folder / 'pki' / 'tokens.csv'}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki.service_account_pub}",
                f"--service-account-signing-key-file={pki.service_account_key}",
                f"--service-cluster-ip-range={lay.service_subnet}",
                f"--kubelet-client-certificate={pki.kubelet_client_cert}",
                f"--kubelet-client-key={pki.kubelet_client_key}",
                "--kubelet-preferred-address-types=InternalIP",
                # a lost node's pods are evicted after 2 s of NotReady, not the default 300 s
                "--default-not-ready-toleration-seconds=2",
                "--default-unreachable-toleration-seconds=2",
                "--profiling=false",
                "--v=1",
            ],
            QUIET_ENV,
        )

    def _wait_api(self, timeout: float) -> None:
        _wait(
            lambda: self.api_get("/readyz", timeout=2.0) is not None,
            timeout,
            f"kube-apiserver of cluster {self.layout.name} ready at {self.layout.server}",
            self.daemons.logs / "kube-apiserver.log",
        )

    def _start_controllers(self, admin: str) -> None:
        lay = self.layout
        component = lay.folder / "component.kubeconfig"
        self._write_kubeconfig(component, admin, "admin")
        self.daemons.start(
            "kube-controller-manager",
            [
                lay.binary("kube-controller-manager"),
                f"--kubeconfig={component}",
                "--leader-elect=false",
                "--controllers=*,-nodeipam,-cloud-node-lifecycle",
                f"--service-account-private-key-file={self.pki.service_account_key}",
                f"--root-ca-file={self.pki.ca_cert}",
                f"--cluster-name=tmk-{lay.name}",
                "--node-monitor-grace-period=8s",
                "--node-monitor-period=1s",
                "--port=0",
                "--secure-port=0",
                "--profiling=false",
                "--v=1",
            ],
            QUIET_ENV,
        )
        self.daemons.start(
            "kube-scheduler",
            [
                lay.binary("kube-scheduler"),
                f"--kubeconfig={component}",
                "--leader-elect=false",
                "--port=0",
                "--secure-port=0",
                "--profiling=false",
                "--v=1",
            ],
            QUIET_ENV,
        )

    # ---- nodes -----------------------------------------------------------------------------
    def _start_node(self, node: NodeLayout, token: str, image_tars: list[images.ImageTar]) -> None:
        folder = node.path
        for sub in ("containerd/root", "containerd/state", "containerd/opt", "runc", "cni", "certs"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        Path(node.socket_folder).mkdir(parents=True, exist_ok=True)
        Path(node.kubelet_root).mkdir(parents=True, exist_ok=True)
        for target in PRIVATE_FOLDERS:
            Path(target).mkdir(parents=True, exist_ok=True)
            (folder / "private" / target.strip("/").replace("/", "-")).mkdir(parents=True, exist_ok=True)
        _create_cgroup_root(node.cgroup_root)
        self._write_node_configs(node, token)
        # the mount namespace holder: binds the private folders, then sleeps; containerd and the
        # kubelet join its namespaces (nsenter execs them: their pids are the daemons')
        binds = " && ".join(
            f"mount --bind {folder / 'private' / t.strip('/').replace('/', '-')} {t}" for t in PRIVATE_FOLDERS
        )
        holder = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", f"{binds} && exec sleep infinity"]
        if node.namespace is not None:
            holder = ["nsenter", f"--net={NETNS_DIR}/{node.namespace}", "--", *holder]
        record = self.daemons.start(f"{node.name}-namespaces", holder)
        _wait(
            lambda: _mounted_in(record.pid, "/var/lib/cni"),
            10.0,
            f"the mount namespace of node {node.name}",
            Path(record.log),
        )
        enter = ["nsenter", f"--target={record.pid}", "--mount", "--net", "--"]
        self.daemons.start(
            f"{node.name}-containerd",
            [*enter, "containerd", "--config", str(folder / "containerd.toml")],
            QUIET_ENV,
        )
        _wait(
            lambda: _ctr_ok(node.containerd_socket),
            30.0,
            f"containerd of node {node.name} at {node.containerd_socket}",
            self.daemons.logs / f"{node.name}-containerd.log",
        )
        images.import_images(node.containerd_socket, image_tars)
        self.start_kubelet(node.index)

    def start_kubelet(self, index: int) -> None:
        """(Re)start node ``index``'s kubelet in its node's namespaces (after a test killed it)."""
        node = self.layout.nodes[index - 1]
        folder = node.path
        holder = self.daemons.get(f"{node.name}-namespaces")
        if holder is None or not alive(holder.pid):
            raise RuntimeError(f"node {node.name} has no namespaces any more (its holder process ended)")
        enter = ["nsenter", f"--target={holder.pid}", "--mount", "--net", "--"]
        self.daemons.start(
            f"{node.name}-kubelet",
            [
                *enter,
                self.layout.binary("kubelet"),
                f"--config={folder / 'kubelet.yaml'}",
                f"--kubeconfig={folder / 'kubelet.kubeconfig'}",
                "--container-runtime=remote",
                f"--container-runtime-endpoint=unix://{node.containerd_socket}",
                f"--containerd={node.containerd_socket}",
                f"--node-ip={node.address}",
                f"--hostname-override={node.name}",
                f"--root-dir={node.kubelet_root}",
                f"--cert-dir={folder / 'certs'}",
                "--v=1",
            ],
            QUIET_ENV,
        )

    def _write_node_configs(self, node: NodeLayout, token: str) -> None:
        import yaml

        folder = node.path
        self._write_kubeconfig(folder / "kubelet.kubeconfig", token, f"system:node:{node.name}")
        (folder / "containerd.toml").write_text(
            CONTAINERD_CONFIG.format(
                root=folder / "containerd" / "root",
                state=folder / "containerd" / "state",
                opt=folder / "containerd" / "opt",
                socket=node.containerd_socket,
                runc_root=folder / "runc",
                cni_conf=folder / "cni",
                pause=images.PAUSE,
            )
        )
        gateway = str(ipaddress.IPv4Network(node.pod_subnet).network_address + 1)
        conflist = {
            "cniVersion": "0.4.0",
            "name": node.network_name,
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": node.bridge,
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": node.pod_subnet, "gateway": gateway}]],
                        # every other node's pods are reached through this node's gateway
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(folder / "cni-leases"),
                    },
                },
                {"type": "loopback"},
            ],
        }
        (folder / "cni" / "10-trainmaster.conflist").write_text(json.dumps(conflist, indent=1))
        kubelet = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": node.address,
            "port": node.kubelet_port,
            "readOnlyPort": 0,
            "healthzPort": 0,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": node.cgroup_root,
            "failSwapOn": False,
            "resolvConf": "",
            "makeIPTablesUtilChains": False,
            "imageGCHighThresholdPercent": 100,  # imported images cannot be pulled again: never collect them
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {
                "memory.available": "1Mi",
                "nodefs.available": "1%",
                "nodefs.inodesFree": "1%",
                "imagefs.available": "1%",
            },
            "nodeLeaseDurationSeconds": 8,
            # a pod whose kill raced another deletion (the garbage collector's and its controller's)
            # is retried at the next sync: 10 s, not the default minute
            "syncFrequency": "10s",
            "nodeStatusUpdateFrequency": "2s",
            # the API client limits of current kubelets (Kubernetes 1.27 raised the defaults from
            # 5 per second, bursts of 10, for both): a node reports each starting pod's status with a
            # GET and a PATCH, up to twice (Pending, then Running), so at 1.20's 5 per second 32 pods
            # started within 4 s were reported Running only after 17-24 s, whoever made the pods
            "kubeAPIQPS": 50,
            "kubeAPIBurst": 100,
            "eventRecordQPS": 50,
            "eventBurst": 100,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(self.pki.ca_cert)},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "clusterDomain": "cluster.local",
            "serializeImagePulls": False,
        }
        (folder / "kubelet.yaml").write_text(yaml.safe_dump(kubelet, sort_keys=False))

    def _wait_nodes_ready(self, timeout: float) -> None:
        names = [n.name for n in self.layout.nodes]
        _wait(
            lambda: set(names) <= self.ready_nodes(),
            timeout,
            f"node(s) {', '.join(names)} Ready",
            self.daemons.logs / f"{names[-1]}-kubelet.log",
        )

    # ---- the API, without the kubernetes client (it is an optional extra) -----------------------
    def api_get(self, path: str, timeout: float = 5.0) -> Any | None:
        """GET ``path`` from the apiserver as admin; None when it does not answer (yet)."""
        context = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        request = urllib.request.Request(
            self.layout.server + path, headers={"Authorization": f"Bearer {self.admin_token()}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=context) as answer:
                body = answer.read().decode()
        except (urllib.error.URLError, OSError, ValueError):
            return None
        try:
            return json.loads(body)
        except ValueError:
            return body

    def ready_nodes(self) -> set[str]:
        answer = self.api_get("/api/v1/nodes")
        if not isinstance(answer, dict):
            return set()
        ready = set()
        for item in answer.get("items", []):
            for condition in item.get("status", {}).get("conditions", []):
                if condition.get("type") == "Ready" and condition.get("status") == "True":
                    ready.add(item["metadata"]["name"])
        return ready

    def status(self) -> ClusterStatus:
        lay = self.layout
        api = self.api_get("/readyz", timeout=2.0) is not None
        ready = self.ready_nodes() if api else set()
        nodes = []
        for node in lay.nodes:
            kubelet = self.daemons.get(f"{node.name}-kubelet")
            containerd = self.daemons.get(f"{node.name}-containerd")
            nodes.append(
                NodeStatus(
                    node.name,
                    node.address,
                    node.namespace or "(the machine's)",
                    node.name in ready,
                    kubelet.pid if kubelet and alive(kubelet.pid) else None,
                    containerd.pid if containerd and alive(containerd.pid) else None,
                )
            )
        daemons: dict[str, int | None] = {}
        for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
            record = self.daemons.get(name)
            daemons[name] = record.pid if record and alive(record.pid) else None
        return ClusterStatus(lay.name, lay.version, lay.server, str(lay.kubeconfig), lay.subnet, api, nodes, daemons)

    def kubelet_pid(self, node_index: int) -> int | None:
        record = self.daemons.get(f"{self.layout.nodes[node_index - 1].name}-kubelet")
        return record.pid if record and alive(record.pid) else None


CONTAINERD_CONFIG = """\
version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", \
"io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  restrict_oom_score_adj = true
  enable_selinux = false
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = "{runc_root}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni_conf}"
"""


# ---- removal ------------------------------------------------------------------------------------
def remove(name: str, grace: float = 5.0, root: Path | None = None) -> list[str]:
    """Remove cluster ``name``: stop its daemons by their recorded pids (kubelets first, then
    what runs in the nodes' cgroups, the containerds and their shims, the control plane), then
    delete the nodes' cgroups, links and namespaces and the record. Idempotent; returns what it
    removed. Needs no live daemon: names come from the record, or from the cluster's name."""
    _require_root()
    removed: list[str] = []
    root = root or state_root()
    folder = root / name
    try:
        layout: ClusterLayout | None = ClusterLayout.load(name, root)
    except UserError:
        layout = None
    daemons = Daemons(folder)
    nodes = layout.nodes if layout else []
    node_names = [n.name for n in nodes] or sorted(
        {r.name.rsplit("-", 1)[0] for r in daemons.records() if r.name.endswith("-kubelet")}
    )
    daemons.stop([f"{n}-kubelet" for n in node_names], grace)
    removed += [f"kubelet {n}" for n in node_names]
    for node in nodes:
        _kill_cgroup_tree(node.cgroup_root)
    for node in nodes:
        # shims outlive a killed containerd: they carry its socket as their -address
        signal_and_wait(pids_with_argument(node.containerd_socket), grace)
    daemons.stop([f"{n}-containerd" for n in node_names], grace)
    daemons.stop([f"{n}-namespaces" for n in node_names], 1.0)
    daemons.stop(["kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"], grace)
    for record in daemons.records():  # anything else it recorded
        daemons.stop([record.name], grace)
    for node in nodes:
        _kill_cgroup_tree(node.cgroup_root)
        _remove_cgroup_root(node.cgroup_root)
        for link in (node.host_link, node.node_link, node.bridge):
            if iproute.run("ip", "link", "show", link, check=False).returncode == 0:
                iproute.run("ip", "link", "delete", link, check=False)
                removed.append(f"link {link}")
        shutil.rmtree(node.socket_folder, ignore_errors=True)
        shutil.rmtree(node.kubelet_root, ignore_errors=True)
        if node.namespace and node.namespace in iproute.namespaces():
            iproute.run("ip", "netns", "delete", node.namespace, check=False)
            removed.append(f"netns {node.namespace}")
    removed += _remove_by_name(name)
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(str(folder))
    return removed


def _remove_by_name(name: str) -> list[str]:
    """What still carries cluster ``name``'s names on the machine without a record saying so
    (a cluster whose home was deleted, or an ``up`` killed before it wrote its record): node
    cgroups ``tmk-<name>-n<k>`` (their processes killed first), links ``tk<name>{h,n,b}<k>`` and
    namespaces ``tmk-<name>-n<k>``. Every name carries the cluster's, so nothing of another
    cluster matches."""
    removed: list[str] = []
    node = re.compile(rf"tmk-{re.escape(name)}-n\d+")
    roots = sorted({p.name for h in _hierarchies() if h.is_dir() for p in h.iterdir() if node.fullmatch(p.name)})
    for root in roots:
        _kill_cgroup_tree(f"/{root}")
        _remove_cgroup_root(f"/{root}")
        removed.append(f"cgroup /{root}")
    link = re.compile(rf"tk{re.escape(name)}[hnb]\d+")
    listed = iproute.run("ip", "-o", "link", "show", check=False).stdout
    for found in sorted({m.group(0) for m in re.finditer(rf"(?<=: ){link.pattern}(?=[@:])", listed)}):
        iproute.run("ip", "link", "delete", found, check=False)
        removed.append(f"link {found}")
    for namespace in iproute.namespaces():
        if node.fullmatch(namespace):
            iproute.run("ip", "netns", "delete", namespace, check=False)
            removed.append(f"netns {namespace}")
    folder = re.compile(rf"{re.escape(name)}-n\d+")  # a node's socket folder and kubelet root
    for top in (Path(SOCKET_ROOT), Path(KUBELET_ROOT)):
        for stale in sorted(top.glob(f"{name}-n*")) if top.is_dir() else []:
            if folder.fullmatch(stale.name):
                shutil.rmtree(stale, ignore_errors=True)
                removed.append(f"folder {stale}")
    return removed


def _clash(name: str) -> str:
    """What of a same-named cluster (made from another home) is on the machine, or ""."""
    link = f"tk{name}h1"
    if iproute.run("ip", "link", "show", link, check=False).returncode == 0:
        return f"link {link}"
    for hierarchy in _hierarchies():
        if (hierarchy / f"tmk-{name}-n1").exists():
            return f"cgroup {hierarchy / f'tmk-{name}-n1'}"
    return ""


# ---- cgroups ----------------------------------------------------------------------------------
def _hierarchies() -> list[Path]:
    """Mount points of the machine's cgroup v1 hierarchies."""
    found = []
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 2 and parts[2] == "cgroup" and parts[1].startswith(CGROUP_ROOT):
                found.append(Path(parts[1]))
    return found


def _create_cgroup_root(root: str) -> None:
    """Create a kubelet's ``cgroupRoot`` in every v1 hierarchy (the kubelet refuses to start
    without it); a cpuset group needs its parent's CPUs and memory nodes before it can hold tasks."""
    for hierarchy in _hierarchies():
        group = hierarchy / root.strip("/")
        group.mkdir(exist_ok=True)
        if (hierarchy / "cpuset.cpus").exists():
            for knob in ("cpuset.cpus", "cpuset.mems"):
                (group / knob).write_text((hierarchy / knob).read_text())


def _cgroup_pids(root: str) -> set[int]:
    pids: set[int] = set()
    for hierarchy in _hierarchies():
        top = hierarchy / root.strip("/")
        if not top.is_dir():
            continue
        for folder, _dirs, files in os.walk(top):
            if "cgroup.procs" in files:
                try:
                    pids.update(int(p) for p in (Path(folder) / "cgroup.procs").read_text().split())
                except OSError:
                    continue
    return pids


def _kill_cgroup_tree(root: str, timeout: float = 15.0) -> None:
    """SIGKILL every process in ``root``'s cgroups (the node's pods), until none is left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = {p for p in _cgroup_pids(root) if p != os.getpid() and alive(p)}
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _remove_cgroup_root(root: str) -> None:
    for hierarchy in [*_hierarchies(), Path(CGROUP_ROOT) / "unified"]:
        top = hierarchy / root.strip("/")
        if not top.is_dir():
            continue
        for folder, _dirs, _files in sorted(os.walk(top), key=lambda entry: -len(entry[0])):
            try:
                os.rmdir(folder)
            except OSError:
                pass


# ---- small helpers ---------------------------------------------------------------------------
def _require_root() -> None:
    if os.geteuid() != 0:
        raise UserError(
            "a cluster needs root: network namespaces, veth links, cgroups and mounts can only be made by "
            "root; run as root (e.g. sudo trainmaster cluster up)"
        )


def _wait(check: Callable[[], bool], timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.05
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(delay)
        delay = min(delay * 1.5, 1.0)
    tail = ""
    if log is not None and log.exists():
        tail = "; the last lines of " + str(log) + ":\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    raise RuntimeError(f"waited {timeout:.0f} s for {what}{tail}")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _ctr_ok(socket_path: str) -> bool:
    if not os.path.exists(socket_path):
        return False
    done = subprocess.run(["ctr", "--address", socket_path, "version"], capture_output=True, timeout=10)
    return done.returncode == 0


def _mounted_in(pid: int, target: str) -> bool:
    try:
        with open(f"/proc/{pid}/mounts") as f:
            return any(line.split()[1] == target for line in f)
    except OSError:
        return False
