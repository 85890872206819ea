"""What ``trainmaster cluster manifests`` prints: the CRDs, a namespace, the operator's service
account with least-privilege RBAC, and its Deployment (two replicas, one leading on a Lease).

The RBAC grants exactly what the operator does: read and watch its resources and write their
``status``; read the Kubeflow Trainer runtimes a TrainJob names; create, read, watch and delete pods; create and read services; read nodes (gang
admission and lost nodes); list pods of every namespace (what other tenants' pods request);
and, in its own namespace only, get/create/update its Lease. It creates no CRD (this file does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainmaster.cluster import images
from trainmaster.operator.kinds import CRD_KINDS, KINDS, RUNTIME_KINDS, crd_manifest

NAME = "trainmaster-operator"
WORK_DIR = "/var/lib/trainmaster/operator"  # a folder of the node: its jobs' pods mount their folders from it


@dataclass(frozen=True)
class ManifestOptions:
    image: str = ""  # default: this installation's python image (this machine's Python, mounted)
    namespace: str = "trainmaster-system"
    replicas: int = 2
    api_address: str = ""  # where pods reach the API (a cluster without kube-proxy: the apiserver's own)
    runtime: str = "host"


def rbac_rules() -> list[dict[str, Any]]:
    by_group: dict[str, list[str]] = {}
    for kind in KINDS:
        by_group.setdefault(kind.group, []).append(kind.plural)
    rules: list[dict[str, Any]] = []
    for group, plurals in by_group.items():
        rules.append({"apiGroups": [group], "resources": plurals, "verbs": ["get", "list", "watch"]})
        rules.append({"apiGroups": [group], "resources": [f"{p}/status" for p in plurals], "verbs": ["get", "patch"]})
    rules.append(  # the runtimes a TrainJob names: read, never written
        {
            "apiGroups": sorted({k.group for k in RUNTIME_KINDS}),
            "resources": [k.plural for k in RUNTIME_KINDS],
            "verbs": ["get", "list"],
        }
    )
    rules += [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "create", "delete"]},
        {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "create"]},
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
    ]
    return rules


def operator_manifests(options: ManifestOptions) -> list[dict[str, Any]]:
    ns = options.namespace
    host = not options.image
    image = options.image or images.PYTHON
    labels = {"app.kubernetes.io/name": NAME, "app.kubernetes.io/managed-by": "trainmaster"}
    env: list[dict[str, Any]] = [
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if options.api_address:  # no kube-proxy: the kubernetes Service's ClusterIP does not route
        address, _, port = options.api_address.rpartition(":")
        env += [
            {"name": "KUBERNETES_SERVICE_HOST", "value": address},
            {"name": "KUBERNETES_SERVICE_PORT", "value": port},
        ]
    command = ["trainmaster", "operator", "--identity", "$(POD_NAME)", "--no-install-crds"]
    if options.runtime:
        command += ["--runtime", options.runtime]
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if host:  # this machine's Python, as the python image's pods have it
        env.append({"name": "TRAINMASTER_K8S_HOST_RUNTIME", "value": "1"})
        command = [images.python_executable(), "-m", "trainmaster", *command[1:], "--work-dir", WORK_DIR]
        for i, path in enumerate(images.host_runtime_mounts()):
            volumes.append({"name": f"host{i}", "hostPath": {"path": path, "type": "Directory"}})
            mounts.append({"name": f"host{i}", "mountPath": path, "readOnly": True})
        volumes.append({"name": "work", "hostPath": {"path": WORK_DIR, "type": "DirectoryOrCreate"}})
        mounts.append({"name": "work", "mountPath": WORK_DIR})
    container: dict[str, Any] = {
        "name": "operator",
        "image": image,
        "imagePullPolicy": "Never" if host else "IfNotPresent",
        "command": command,
        "env": env,
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": False},
    }
    if mounts:
        container["volumeMounts"] = mounts
    pod_spec: dict[str, Any] = {
        "serviceAccountName": NAME,
        "containers": [container],
        "terminationGracePeriodSeconds": 10,
        "dnsPolicy": "Default",
        "enableServiceLinks": False,
    }
    if volumes:
        pod_spec["volumes"] = volumes
    return [
        *[crd_manifest(kind) for kind in CRD_KINDS],
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": labels}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": NAME, "namespace": ns, "labels": labels}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": NAME, "labels": labels},
            "rules": rbac_rules(),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": NAME, "labels": labels},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": NAME},
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": ns}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": f"{NAME}-lease", "namespace": ns, "labels": labels},
            "rules": [
                {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]},
                # the instance channel's key, shared by every leader (operator.Operator._channel_key)
                {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": f"{NAME}-lease", "namespace": ns, "labels": labels},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{NAME}-lease"},
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": ns}],
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": NAME, "namespace": ns, "labels": labels},
            "spec": {
                "replicas": options.replicas,
                "selector": {"matchLabels": {"app.kubernetes.io/name": NAME}},
                "template": {"metadata": {"labels": labels}, "spec": pod_spec},
            },
        },
    ]
