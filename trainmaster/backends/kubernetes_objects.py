"""The Kubernetes side of the Kubernetes backend, as plain data: the Pod and headless Service of
an instance built from its :class:`LaunchSpec`, what a Pod's status means for the controller
(:class:`Observation`, with reasons a user can read), and what the nodes can still hold.

Pure functions over JSON-shaped dicts (the API's own shapes), so every rule here is tested
without a cluster and the manifests print as they are sent (``job run --dry-run``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainmaster.backends.base import Observation, Resources
from trainmaster.contract import InstancePhase as Phase
from trainmaster.contract import SECRET_VARIABLES, LaunchSpec

MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "trainmaster"
LABEL_JOB = "trainmaster.io/job-name"
LABEL_JOB_UID = "trainmaster.io/job-uid"
LABEL_ROLE = "trainmaster.io/role"
LABEL_INDEX = "trainmaster.io/index"
LABEL_ATTEMPT = "trainmaster.io/attempt"
ANNOTATION_INSTANCE = "trainmaster.io/instance-id"
ANNOTATION_PORTS = "trainmaster.io/ports"
ANNOTATION_WAITS = "trainmaster.io/waits-for"  # the environment file a pod in its wait step waits for
ANNOTATION_LAUNCH = "trainmaster.io/launch"  # its LaunchSpec (a new controller's backend finishes the wait)
ANNOTATION_LOG = "trainmaster.io/log-path"  # where a controller's backend follows its log into
POD_IP_VARIABLE = "TM_POD_IP"
# the host an instance is placed on before its pod has an IP: the kubelet expands it in every
# environment value (a variable defined earlier in the list, here from the downward API)
POD_IP = f"$({POD_IP_VARIABLE})"
CONTAINER = "main"
TERMINATION_LOG = "/dev/termination-log"
# the controller's variables a pod keeps; the rest of the submitting machine's environment stays
# there (a pod on a cluster does not inherit its submitter's shell)
PASS_THROUGH = ("PATH", "LANG", "LC_ALL", "PYTHONUNBUFFERED", "PYTHONHASHSEED", "OMP_NUM_THREADS")
# the controller's secrets (its store, its token): pods reach nothing of it
WITHHELD = SECRET_VARIABLES
# a container that waits for one of these will not start on its own (no registry, no fix in time)
FATAL_WAITING = ("ErrImageNeverPull", "InvalidImageName", "CreateContainerConfigError", "CreateContainerError")
START_FAILED = "StartFailed"


@dataclass(frozen=True)
class Owner:
    """The object whose deletion deletes an instance's pod and its role's Service (an owner
    reference: the garbage collector cascades), and labels the operator adds (Kubeflow's)."""

    api_version: str
    kind: str
    name: str
    uid: str
    labels: dict[str, str] = field(default_factory=dict)
    namespace: str = ""  # where the job's pods go (a custom resource's namespace); "" = the backend's

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True)
class HostRuntime:
    """How a role without an image runs: this machine's software in a pod. The image holds
    mount points only; ``mounts`` (read-only) bring this machine's Python, virtual environment
    and ``/usr``; the job's own folders are mounted read-write; the pod shares the machine's PID
    namespace so an instance's pid is the machine's (as the other backends report it). Only
    for clusters whose nodes are this machine (``trainmaster cluster up``)."""

    image: str
    python: str
    mounts: tuple[str, ...]


@dataclass(frozen=True)
class PodNames:
    """``kubeflow``: ``<job>-<role>-<index>``, as Kubeflow names its pods (the job's name is
    unique in its namespace: a custom resource's); ``unique``: with a short hash of the job's
    uid, for jobs submitted from a store (two runs of one file may share a namespace)."""

    style: str = "unique"

    def pod(self, spec: LaunchSpec) -> str:
        base = f"{spec.job_name}-{spec.role}-{spec.index}"
        return dns_label(base if self.style == "kubeflow" else f"{base}-{short_hash(job_uid(spec))}")

    def service(self, spec: LaunchSpec) -> str:
        base = f"{spec.job_name}-{spec.role}"
        return dns_label(base if self.style == "kubeflow" else f"{base}-{short_hash(job_uid(spec))}", letter=True)


def dns_label(text: str, letter: bool = False) -> str:
    """``text`` as a DNS label (63 characters of ``[a-z0-9-]``; a Service's starts with a
    letter): kept as it is when it already is one, else shortened with a hash of the whole."""
    clean = re.sub(r"[^a-z0-9-]", "-", text.lower()).strip("-") or "x"
    if letter and not clean[0].isalpha():
        clean = "s-" + clean
    if len(clean) > 63:
        clean = clean[:57].rstrip("-") + "-" + short_hash(text)
    return clean


def job_uid(spec: LaunchSpec) -> str:
    """The job's uid: the first part of the instance id (``<job uid>/<role>-<index>/<attempt>``)."""
    return spec.instance_id.split("/", 1)[0]


def short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:5]


def label_value(text: str) -> str:
    """``text`` as a label value (63 characters of ``[-A-Za-z0-9_.]``, alphanumeric at both ends)."""
    clean = re.sub(r"[^-A-Za-z0-9_.]", "-", text)[:63].strip("-_.")
    return clean or "x"


def labels(spec: LaunchSpec) -> dict[str, str]:
    return {
        MANAGED_BY: MANAGER,
        LABEL_JOB: label_value(spec.job_name),
        LABEL_JOB_UID: label_value(job_uid(spec)),
        LABEL_ROLE: label_value(spec.role),
        LABEL_INDEX: str(spec.index),
        LABEL_ATTEMPT: str(spec.attempt),
    }


def pod_environment(spec: LaunchSpec, resolved: dict[str, str]) -> list[dict[str, Any]]:
    """The container's ``env``: the pod's IP first (every later value may name it), then the
    instance's variables without the controller's own environment."""
    env: list[dict[str, Any]] = [
        {"name": POD_IP_VARIABLE, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    for name, value in resolved.items():
        if name in WITHHELD or name == POD_IP_VARIABLE:
            continue
        env.append({"name": name, "value": value})
    return env


def base_environment(spec: LaunchSpec) -> dict[str, str]:
    """What of the controller's environment an instance keeps: a few neutral variables."""
    return {k: v for k, v in spec.env.items() if k in PASS_THROUGH}


def resources(spec: LaunchSpec) -> dict[str, Any]:
    """Requests from the role's resources; memory is also the limit (an instance over it is
    OOMKilled, as the node agent's cgroup limit does); CPU is a request only (no CFS throttling)."""
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if spec.cpu > 0:
        requests["cpu"] = f"{max(1, math.ceil(spec.cpu * 1000))}m"
    if spec.memory > 0:
        requests["memory"] = limits["memory"] = str(spec.memory)
    if spec.gpu > 0:
        limits["nvidia.com/gpu"] = str(spec.gpu)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def pod_manifest(
    spec: LaunchSpec,
    resolved_env: dict[str, str],
    name: str,
    namespace: str,
    service: str,
    host: HostRuntime | None,
    owner: Owner | None = None,
    entry_module: str = "trainmaster.backends.kubernetes_entry",
) -> dict[str, Any]:
    """The Pod of one attempt. ``restartPolicy: Never``: the controller's restart policies
    decide, and each attempt is its own pod."""
    meta_labels = {**labels(spec), **(owner.labels if owner else {})}
    container: dict[str, Any] = {
        "name": CONTAINER,
        "env": pod_environment(spec, resolved_env),
        "resources": resources(spec),
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.ports:
        container["ports"] = [{"containerPort": p, "protocol": "TCP"} for p in spec.ports]
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,  # an instance needs nothing of the API
        "enableServiceLinks": False,  # no cluster DNS and no kube-proxy here: the registry has the addresses
        "dnsPolicy": "Default",
        "hostname": name,
        "subdomain": service,
        "terminationGracePeriodSeconds": 5,
        "containers": [container],
    }
    if spec.container is not None:  # the role's own image
        launch = spec.container
        container["image"] = launch.image
        container["imagePullPolicy"] = launch.pull_policy
        if launch.command is not None:
            container["command"] = list(launch.command)
        if launch.args is not None:
            container["args"] = list(launch.args)
        if launch.working_dir:
            container["workingDir"] = launch.working_dir
        folder = job_folder(spec)
        for i, mount in enumerate(launch.mounts):
            source, target = str(mount["source"]), str(mount["target"])
            if folder and _inside(source, os.path.join(folder, "volumes")):  # an emptyDir volume of the role
                volumes.append({"name": f"v{i}", "emptyDir": {}})
            elif folder and _inside(source, folder):
                continue  # the controller's own folder: a node of a cluster has none of it
            else:  # a hostPath volume the operator allowed
                volumes.append({"name": f"v{i}", "hostPath": {"path": source}})
            mounts.append({"name": f"v{i}", "mountPath": target, "readOnly": bool(mount.get("read_only"))})
        if host is not None and launch.image == host.image:
            _add_host_mounts(host, volumes, mounts)
    else:  # this machine's software, mounted into the host runtime image
        if host is None:
            raise ValueError(
                f"role {spec.role} has no image: on a cluster of other machines give it one "
                "(spec.roles[].image), or run on a cluster of this machine (trainmaster cluster up)"
            )
        container["image"] = host.image
        container["imagePullPolicy"] = "Never"
        record = os.path.join(spec.instance_dir, ATTEMPT_RECORD)
        wait_for = os.path.join(spec.instance_dir, ENV_FILE) if spec.depends else ""
        container["command"] = [host.python, "-m", entry_module, spec.cwd or "", record, wait_for, "--", *spec.argv]
        _add_host_mounts(host, volumes, mounts)
        for i, folder in enumerate(job_folders(spec, resolved_env)):
            # a missing working directory is the role's mistake (a refused start), never created
            kind = "Directory" if folder == os.path.normpath(spec.cwd or "") else "DirectoryOrCreate"
            volumes.append({"name": f"job{i}", "hostPath": {"path": folder, "type": kind}})
            mounts.append({"name": f"job{i}", "mountPath": folder})
        pod_spec["hostPID"] = True
    if volumes:
        pod_spec["volumes"] = volumes
        container["volumeMounts"] = mounts
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": meta_labels,
        "annotations": {
            ANNOTATION_INSTANCE: spec.instance_id,
            ANNOTATION_PORTS: json.dumps(list(spec.ports)),
            ANNOTATION_LOG: spec.log_path,
        },
    }
    if spec.container is None and spec.depends:
        metadata["annotations"][ANNOTATION_WAITS] = os.path.join(spec.instance_dir, ENV_FILE)
        metadata["annotations"][ANNOTATION_LAUNCH] = json.dumps(spec.to_dict())
    if owner is not None:
        metadata["ownerReferences"] = [owner.reference()]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


ATTEMPT_RECORD = "pod-attempt.json"  # written by the host runtime entry: {"pid": ...}
ENV_FILE = "pod-env.json"  # written by the backend for a pod in its wait step: {"env": ...} or why it gives up


def _add_host_mounts(host: HostRuntime, volumes: list[dict[str, Any]], mounts: list[dict[str, Any]]) -> None:
    for i, path in enumerate(host.mounts):
        volumes.append({"name": f"host{i}", "hostPath": {"path": path, "type": "Directory"}})
        mounts.append({"name": f"host{i}", "mountPath": path, "readOnly": True})


def job_folder(spec: LaunchSpec) -> str:
    """The job's folder on the controller's machine (its output folder's parent), or ""."""
    output = (spec.env_inputs.get("context") or {}).get("output_dir")
    return os.path.dirname(os.path.normpath(str(output))) if output else ""


def _inside(path: str, root: str) -> bool:
    path, root = os.path.normpath(path), os.path.normpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


def job_folders(spec: LaunchSpec, env: dict[str, str]) -> list[str]:
    """The job's folders a host-runtime pod writes (read-write): the job's folder (the output
    folder's parent: instances, output, the MPI hostfile...), its instance folder's parent and
    its working directory, without one inside another."""
    candidates = [str(Path(spec.instance_dir).parent)]
    output = (spec.env_inputs.get("context") or {}).get("output_dir") or env.get("TM_OUTPUT_DIR")
    if output:
        candidates.append(os.path.dirname(os.path.normpath(str(output))))
    if spec.cwd:
        candidates.append(spec.cwd)
    chosen: list[str] = []
    for path in sorted({os.path.normpath(c) for c in candidates}, key=len):
        if not any(path == c or path.startswith(c.rstrip("/") + "/") for c in chosen):
            chosen.append(path)
    return chosen


def service_manifest(pod: dict[str, Any]) -> dict[str, Any]:
    """The communication service of a pod's role: a headless Service selecting the role's
    instances' pods, named by the pod's ``subdomain`` (their DNS names where the cluster runs
    DNS; the registry has the addresses either way). Made from one of the role's pods (its
    labels, ports and owner), so a new controller that adopts pods can make it too."""
    meta = pod["metadata"]
    labels_ = meta.get("labels") or {}
    selector = {LABEL_JOB_UID: labels_[LABEL_JOB_UID], LABEL_ROLE: labels_[LABEL_ROLE]}
    metadata: dict[str, Any] = {
        "name": pod["spec"]["subdomain"],
        "namespace": meta.get("namespace", ""),
        "labels": {MANAGED_BY: MANAGER, **selector, LABEL_JOB: labels_[LABEL_JOB]},
    }
    if meta.get("ownerReferences"):
        metadata["ownerReferences"] = [dict(r) for r in meta["ownerReferences"]]
    role_ports = json.loads((meta.get("annotations") or {}).get(ANNOTATION_PORTS) or "[]")
    ports = [{"name": f"p{i}", "port": p, "targetPort": p, "protocol": "TCP"} for i, p in enumerate(role_ports)]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "clusterIP": "None",
            "selector": selector,
            "publishNotReadyAddresses": True,  # peers need each other's names before they are Ready
            "ports": ports or [{"name": "none", "port": 1, "targetPort": 1}],
        },
    }


def service_key(pod: dict[str, Any]) -> str | None:
    """``<namespace>/<Service>`` of a pod's role, or None for a pod of no role Service (one
    this backend did not make)."""
    meta, spec_ = pod.get("metadata") or {}, pod.get("spec") or {}
    labels_ = meta.get("labels") or {}
    if not spec_.get("subdomain") or LABEL_JOB_UID not in labels_ or LABEL_ROLE not in labels_:
        return None
    return f"{meta.get('namespace', '')}/{spec_['subdomain']}"


# ---- what a pod's status means --------------------------------------------------------------
def _container_status(pod: dict[str, Any]) -> dict[str, Any]:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == CONTAINER:
            return dict(status)
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return dict(statuses[0]) if statuses else {}


def _condition(pod: dict[str, Any], kind: str) -> dict[str, Any]:
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind:
            return dict(condition)
    return {}


def termination_details(message: str) -> dict[str, Any]:
    """What the host runtime entry wrote as its termination message (one JSON object), or {}."""
    try:
        data = json.loads(message.strip().splitlines()[-1]) if message.strip() else {}
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def pod_observation(pod: dict[str, Any], node_ready: bool = True) -> Observation:
    """The controller's view of one pod. ``node_ready``: whether its node is Ready (a pod of a
    lost node is Lost at once, whatever its last reported phase)."""
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    ip = status.get("podIP") or ""
    node = (pod.get("spec") or {}).get("nodeName") or ""
    ports = json.loads(((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_PORTS, "null") or "null")
    where = {"host": ip, "ports": ports} if ip else {}
    container = _container_status(pod)
    state = container.get("state") or {}
    if phase in ("Succeeded", "Failed"):
        return _ended(pod, status, container, where)
    if node and not node_ready:
        return Observation(
            Phase.LOST,
            reason="NodeLost",
            message=f"its node {node} is not Ready (the kubelet stopped reporting); the pod is deleted",
            **where,
        )
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return Observation(Phase.LOST, reason="Deleted", message=f"pod {_name(pod)} is being deleted", **where)
    if "running" in state:
        started = _epoch(state["running"].get("startedAt"))
        return Observation(Phase.RUNNING, command_started=started, **where)
    if "terminated" in state:  # the pod's phase lags its container's
        return _ended(pod, status, container, where)
    waiting = state.get("waiting") or {}
    reason = waiting.get("reason", "")
    if reason in FATAL_WAITING:
        return Observation(
            Phase.EXITED,
            exit_code=127,
            reason="ImagePullBackOff" if reason in ("ErrImageNeverPull", "InvalidImageName") else START_FAILED,
            message=f"{reason}: {waiting.get('message', '')}".strip(": "),
            **where,
        )
    if reason:  # ContainerCreating, ImagePullBackOff, ErrImagePull...
        return Observation(Phase.STARTING, reason=reason, message=waiting.get("message", ""), **where)
    scheduled = _condition(pod, "PodScheduled")
    if scheduled.get("status") == "False":
        return Observation(
            Phase.STARTING,
            reason=scheduled.get("reason") or "Unschedulable",
            message=scheduled.get("message", "no node can hold it now"),
        )
    return Observation(Phase.STARTING, reason="Pending" if not node else "ContainerCreating", **where)


def _ended(
    pod: dict[str, Any], status: dict[str, Any], container: dict[str, Any], where: dict[str, Any]
) -> Observation:
    terminated = (container.get("state") or {}).get("terminated") or (container.get("lastState") or {}).get(
        "terminated"
    )
    if not terminated:  # evicted or failed before its container ran
        reason = status.get("reason") or "Failed"
        return Observation(
            Phase.EXITED,
            exit_code=137,
            reason=reason,
            message=status.get("message") or f"pod {_name(pod)} {reason.lower()}",
            **where,
        )
    code = int(terminated.get("exitCode", 1))
    reason = terminated.get("reason", "")
    details = termination_details(terminated.get("message") or "")
    message = str(details.get("message") or "")
    if details.get("reason"):
        reason = str(details["reason"])
    elif reason in ("ContainerCannotRun", "StartError"):
        reason, message = START_FAILED, terminated.get("message", "")
    elif reason in ("Completed", "Error"):
        reason = ""  # the exit code says it
    if status.get("reason") == "Evicted":
        reason, message = "Evicted", status.get("message", "")
    if reason == "OOMKilled" and not message:
        message = "the instance used more memory than its limit (resources.memory)"
    return Observation(
        Phase.EXITED,
        exit_code=code,
        reason=reason,
        message=message,
        command_started=_epoch(terminated.get("startedAt")),
        cpu_seconds=float(details.get("cpu_seconds") or 0.0),
        peak_rss=int(details.get("peak_rss") or 0),
        **where,
    )


def waiting(pod: dict[str, Any]) -> bool:
    """Whether a host-runtime pod is still in its wait step (its environment file not written)."""
    path = ((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_WAITS)
    return bool(path) and not os.path.exists(str(path))


def _name(pod: dict[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("name", "?"))


def _epoch(stamp: Any) -> float | None:
    from datetime import datetime

    if isinstance(stamp, datetime):
        return stamp.timestamp()
    if isinstance(stamp, str) and stamp:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    return None


# ---- capacity -----------------------------------------------------------------------------------
_UNITS = {
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
    "K": 1000,
    "k": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "m": 0.001,
}


def quantity(text: str | int | float | None) -> float:
    """A Kubernetes quantity ("250m", "2Gi", "1e3") as a number."""
    if text is None or text == "":
        return 0.0
    if isinstance(text, (int, float)):
        return float(text)
    for suffix in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * _UNITS[suffix]
    return float(text)


@dataclass
class NodeRoom:
    """One Ready node: what it offers (allocatable) and what its live pods requested."""

    name: str
    cpu: float
    memory: float
    gpu: float

    def fits(self, cpu: float, memory: float, gpu: float) -> bool:
        return cpu <= self.cpu + 1e-9 and memory <= self.memory and gpu <= self.gpu

    def take(self, cpu: float, memory: float, gpu: float) -> None:
        self.cpu, self.memory, self.gpu = self.cpu - cpu, self.memory - memory, self.gpu - gpu


def node_ready(node: dict[str, Any]) -> bool:
    spec = node.get("spec") or {}
    if spec.get("unschedulable"):
        return False
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


def pod_requests(pod: dict[str, Any]) -> tuple[float, float, float]:
    cpu = memory = gpu = 0.0
    for container in (pod.get("spec") or {}).get("containers") or []:
        res = container.get("resources") or {}
        requests = {**(res.get("limits") or {}), **(res.get("requests") or {})}  # a limit alone is the request
        cpu += quantity(requests.get("cpu"))
        memory += quantity(requests.get("memory"))
        gpu += quantity(requests.get("nvidia.com/gpu"))
    return cpu, memory, gpu


def free_rooms(nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> list[NodeRoom]:
    """Each Ready node's allocatable minus the requests of the pods bound to it that still run."""
    rooms = {}
    for node in nodes:
        if not node_ready(node):
            continue
        alloc = (node.get("status") or {}).get("allocatable") or {}
        name = node["metadata"]["name"]
        rooms[name] = NodeRoom(
            name, quantity(alloc.get("cpu")), quantity(alloc.get("memory")), quantity(alloc.get("nvidia.com/gpu"))
        )
    for pod in pods:
        room = rooms.get((pod.get("spec") or {}).get("nodeName") or "")
        if room is not None and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            room.take(*pod_requests(pod))
    return list(rooms.values())


def total_capacity(nodes: list[dict[str, Any]]) -> Resources:
    rooms = free_rooms(nodes, [])
    return Resources(
        cpu=sum(r.cpu for r in rooms), memory=int(sum(r.memory for r in rooms)), gpu=int(sum(r.gpu for r in rooms))
    )


def gang_fits(rooms: list[NodeRoom], bundles: list[Resources]) -> tuple[bool, str]:
    """Whether every bundle fits on the nodes at once (first fit, largest first, as a scheduler
    placing the whole gang would); the reason names what is missing when not."""
    left = [NodeRoom(r.name, r.cpu, r.memory, r.gpu) for r in rooms]
    wanted = sorted(((float(b.cpu), float(b.memory), float(b.gpu)) for b in bundles), reverse=True)
    for i, (cpu, memory, gpu) in enumerate(wanted):
        room = next((r for r in left if r.fits(cpu, memory, gpu)), None)
        if room is None:
            free = ", ".join(f"{r.name}: {r.cpu:g} CPU, {r.memory / 2**20:.0f} MiB" for r in left) or "no Ready node"
            return False, (
                f"{len(wanted) - i} of {len(wanted)} instances do not fit now (the next needs {cpu:g} CPU, "
                f"{memory / 2**20:.0f} MiB, {gpu:g} GPU; free after running pods' requests: {free})"
            )
        room.take(cpu, memory, gpu)
    return True, ""
