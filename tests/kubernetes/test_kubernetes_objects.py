"""Mechanism: instances as Kubernetes pods and roles as headless Services (the seed's communication
service), and what a pod's status means for the controller (controller spec, 'Our product
decisions': Kubernetes, instances as pods). Pure functions over the API's JSON: no cluster."""

from __future__ import annotations

import json

import pytest

from trainmaster.backends import kubernetes_objects as k8s
from trainmaster.backends.base import Resources
from trainmaster.contract import ContainerLaunch, Dependency, LaunchSpec
from trainmaster.contract import InstancePhase as Phase

HOST = k8s.HostRuntime("trainmaster.local/python:3.11", "/venv/bin/python", ("/usr", "/venv"))


def spec(**changes) -> LaunchSpec:
    base = dict(
        instance_id="9f1c/worker-1/2",
        job_id=4,
        job_name="digits",
        role="worker",
        index=1,
        attempt=2,
        argv=["python", "-m", "trainmaster.workloads.digits"],
        env={"PATH": "/usr/bin", "HOME": "/root", "SECRET_TOKEN": "x", "TM_DB_URL": "sqlite:///db"},
        cwd="/runs/4-digits",
        log_path="/runs/4-digits/logs/worker-1.log",
        instance_dir="/runs/4-digits/instances/worker-1",
        host=k8s.POD_IP,
        ports=[23456],
        cpu=0.5,
        memory=256 << 20,
    )
    base.update(changes)
    return LaunchSpec(**base)


def pod(phase="Pending", state=None, node="n1", ip="172.16.1.5", **extra) -> dict:
    status = {"phase": phase, **({"podIP": ip} if ip else {})}
    if state is not None:
        status["containerStatuses"] = [{"name": "main", "state": state}]
    status.update(extra.pop("status", {}))
    return {
        "metadata": {
            "name": "digits-worker-1",
            "annotations": {k8s.ANNOTATION_PORTS: "[23456]", k8s.ANNOTATION_INSTANCE: "9f1c/worker-1/2"},
            **extra.pop("metadata", {}),
        },
        "spec": {"nodeName": node} if node else {},
        "status": status,
    }


def test_pod_carries_labels_owner_never_restart_and_requests() -> None:
    owner = k8s.Owner("kubeflow.org/v1", "PyTorchJob", "digits", "uid-1", {"training.kubeflow.org/job-name": "digits"})
    manifest = k8s.pod_manifest(spec(), {"A": "1"}, "digits-worker-1", "ns", "digits-worker", HOST, owner)
    meta, pod_spec = manifest["metadata"], manifest["spec"]
    assert meta["labels"][k8s.LABEL_JOB] == "digits" and meta["labels"][k8s.LABEL_ROLE] == "worker"
    assert meta["labels"][k8s.LABEL_INDEX] == "1" and meta["labels"][k8s.LABEL_ATTEMPT] == "2"
    assert meta["labels"]["training.kubeflow.org/job-name"] == "digits"
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "name": "digits",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert pod_spec["restartPolicy"] == "Never" and pod_spec["automountServiceAccountToken"] is False
    container = pod_spec["containers"][0]
    assert container["resources"] == {
        "requests": {"cpu": "500m", "memory": str(256 << 20)},
        "limits": {"memory": str(256 << 20)},
    }
    assert container["ports"] == [{"containerPort": 23456, "protocol": "TCP"}]
    assert json.loads(meta["annotations"][k8s.ANNOTATION_PORTS]) == [23456]


def test_environment_names_the_pod_ip_first_and_keeps_nothing_of_the_controller() -> None:
    """The pod's own address is `$(TM_POD_IP)` until it has one: the kubelet expands it in every
    later value; the submitting machine's variables and the store's URL stay behind."""
    s = spec()
    resolved = {**k8s.base_environment(s), "TM_HOST": k8s.POD_IP, "MASTER_ADDR": "172.16.1.4", "TM_DB_URL": "x"}
    env = k8s.pod_environment(s, resolved)
    assert env[0] == {"name": "TM_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    names = [e["name"] for e in env]
    assert "SECRET_TOKEN" not in names and "HOME" not in names and "TM_DB_URL" not in names
    assert {"name": "TM_HOST", "value": "$(TM_POD_IP)"} in env and {"name": "PATH", "value": "/usr/bin"} in env


def test_host_runtime_mounts_this_machines_python_and_the_job_folders() -> None:
    manifest = k8s.pod_manifest(spec(), {"TM_OUTPUT_DIR": "/runs/4-digits/output"}, "p", "ns", "s", HOST)
    pod_spec = manifest["spec"]
    container = pod_spec["containers"][0]
    assert container["image"] == HOST.image and container["imagePullPolicy"] == "Never"
    assert container["command"][:3] == ["/venv/bin/python", "-m", "trainmaster.backends.kubernetes_entry"]
    assert container["command"][-3:] == ["python", "-m", "trainmaster.workloads.digits"]
    mounts = {m["mountPath"]: m.get("readOnly", False) for m in container["volumeMounts"]}
    assert mounts["/usr"] is True and mounts["/venv"] is True
    assert mounts["/runs/4-digits"] is False  # the working directory holds the instances' and output folders
    assert pod_spec["hostPID"] is True


def test_a_role_image_runs_as_written_and_without_a_host_runtime_an_image_is_required() -> None:
    launch = ContainerLaunch(
        image="busybox:1",
        command=["sh"],
        args=["-c", "true"],
        working_dir="/w",
        pull_policy="Never",
        mounts=[
            {"source": "/runs/4-digits", "target": "/runs/4-digits", "read_only": False},
            {"source": "/runs/4-digits/volumes/worker/scratch", "target": "/scratch", "read_only": False},
            {"source": "/data/shared", "target": "/data", "read_only": True},
        ],
    )
    context = {"output_dir": "/runs/4-digits/output"}
    s = spec(container=launch, env_inputs={"framework": "command", "context": context, "role_env": {}})
    manifest = k8s.pod_manifest(s, {}, "p", "ns", "s", None)
    container = manifest["spec"]["containers"][0]
    assert (container["image"], container["command"], container["args"]) == ("busybox:1", ["sh"], ["-c", "true"])
    assert container["workingDir"] == "/w" and "hostPID" not in manifest["spec"]
    # the controller's job folder is not a node's: an emptyDir is one, a hostPath the operator allowed stays
    volumes = {v["name"]: v for v in manifest["spec"]["volumes"]}
    assert [m["mountPath"] for m in container["volumeMounts"]] == ["/scratch", "/data"]
    assert volumes["v1"] == {"name": "v1", "emptyDir": {}} and volumes["v2"]["hostPath"] == {"path": "/data/shared"}
    with pytest.raises(ValueError, match="has no image"):
        k8s.pod_manifest(spec(), {}, "p", "ns", "s", None)


def test_the_role_service_is_headless_and_selects_its_instances() -> None:
    """Made from one of the role's pods: its subdomain, labels, ports and owner."""
    owner = k8s.Owner("kubeflow.org/v1", "PyTorchJob", "digits", "u-1")
    pod = k8s.pod_manifest(spec(), {}, "digits-worker-1", "ns", "digits-worker", HOST, owner)
    service = k8s.service_manifest(pod)
    assert service["metadata"]["name"] == "digits-worker" and service["metadata"]["namespace"] == "ns"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {k8s.LABEL_JOB_UID: "9f1c", k8s.LABEL_ROLE: "worker"}
    assert service["metadata"]["ownerReferences"] == [owner.reference()]
    assert [p["port"] for p in service["spec"]["ports"]] == [23456]
    assert k8s.service_key(pod) == "ns/digits-worker"
    assert k8s.service_key({"metadata": {"name": "other"}, "spec": {}}) is None


def test_names_are_dns_labels() -> None:
    assert k8s.PodNames("kubeflow").pod(spec()) == "digits-worker-1"
    unique = k8s.PodNames("unique").pod(spec())
    assert unique.startswith("digits-worker-1-") and len(unique) == len("digits-worker-1-") + 5
    long = k8s.PodNames("kubeflow").service(spec(job_name="j" * 60))
    assert len(long) <= 63 and long[0].isalpha()
    assert k8s.PodNames("kubeflow").service(spec(job_name="1job")) == "s-1job-worker"


@pytest.mark.parametrize(
    ("the_pod", "phase", "reason"),
    [
        (
            pod(
                node=None,
                ip=None,
                status={
                    "conditions": [
                        {
                            "type": "PodScheduled",
                            "status": "False",
                            "reason": "Unschedulable",
                            "message": "0/2 nodes: Insufficient cpu",
                        }
                    ]
                },
            ),
            Phase.STARTING,
            "Unschedulable",
        ),
        (pod(state={"waiting": {"reason": "ContainerCreating"}}), Phase.STARTING, "ContainerCreating"),
        (
            pod(state={"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image x"}}),
            Phase.STARTING,
            "ImagePullBackOff",
        ),
        (
            pod(state={"waiting": {"reason": "ErrImageNeverPull", "message": "image x not present"}}),
            Phase.EXITED,
            "ImagePullBackOff",
        ),
        (pod("Running", {"running": {"startedAt": "2026-01-01T00:00:00Z"}}), Phase.RUNNING, ""),
        (pod("Succeeded", {"terminated": {"exitCode": 0, "reason": "Completed"}}), Phase.EXITED, ""),
        (pod("Failed", {"terminated": {"exitCode": 7, "reason": "Error"}}), Phase.EXITED, ""),
        (pod("Failed", {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}), Phase.EXITED, "OOMKilled"),
        (
            pod("Failed", None, status={"reason": "Evicted", "message": "The node was low on resource: memory."}),
            Phase.EXITED,
            "Evicted",
        ),
        (
            pod(
                "Failed",
                {"terminated": {"exitCode": 128, "reason": "StartError", "message": 'exec: "nope": not found'}},
            ),
            Phase.EXITED,
            "StartFailed",
        ),
        (
            pod("Running", {"running": {}}, metadata={"deletionTimestamp": "2026-01-01T00:00:00Z"}),
            Phase.LOST,
            "Deleted",
        ),
    ],
)
def test_pod_states_become_reasons_a_user_reads(the_pod: dict, phase: Phase, reason: str) -> None:
    obs = k8s.pod_observation(the_pod)
    assert (obs.phase, obs.reason) == (phase, reason)
    if the_pod["status"].get("podIP"):
        assert (obs.host, obs.ports) == ("172.16.1.5", [23456])  # the instance's address once its pod has one


def test_exit_codes_oom_and_the_entrys_termination_message() -> None:
    assert k8s.pod_observation(pod("Failed", {"terminated": {"exitCode": 7}})).exit_code == 7
    oom = k8s.pod_observation(pod("Failed", {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}))
    assert "memory" in oom.message
    message = json.dumps({"cpu_seconds": 1.5, "peak_rss": 50 << 20})
    done = k8s.pod_observation(
        pod("Succeeded", {"terminated": {"exitCode": 0, "reason": "Completed", "message": message}})
    )
    assert (done.cpu_seconds, done.peak_rss) == (1.5, 50 << 20)
    refused = json.dumps({"reason": "StartFailed", "message": "program 'nope' not found (No such file or directory)"})
    obs = k8s.pod_observation(pod("Failed", {"terminated": {"exitCode": 127, "reason": "Error", "message": refused}}))
    assert (obs.reason, obs.message) == ("StartFailed", "program 'nope' not found (No such file or directory)")


def test_a_pod_of_a_node_that_is_not_ready_is_lost() -> None:
    obs = k8s.pod_observation(pod("Running", {"running": {}}), node_ready=False)
    assert obs.phase == Phase.LOST and obs.reason == "NodeLost" and "n1" in obs.message
    # an ended pod keeps its exit, wherever its node went
    assert (
        k8s.pod_observation(pod("Succeeded", {"terminated": {"exitCode": 0}}), node_ready=False).phase == Phase.EXITED
    )


def node(name: str, cpu: str, memory: str, ready: bool = True) -> dict:
    return {
        "metadata": {"name": name},
        "status": {
            "allocatable": {"cpu": cpu, "memory": memory},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def bound(node_name: str, cpu: str, memory: str, phase: str = "Running") -> dict:
    return {
        "spec": {"nodeName": node_name, "containers": [{"resources": {"requests": {"cpu": cpu, "memory": memory}}}]},
        "status": {"phase": phase},
    }


def test_gang_admission_is_allocatable_minus_the_requests_of_running_pods() -> None:
    """Gang: every instance of the job fits at once on the Ready nodes, after what is bound."""
    nodes = [node("n1", "2", "4Gi"), node("n2", "2", "4Gi"), node("n3", "64", "1Ti", ready=False)]
    pods = [bound("n1", "1500m", "1Gi"), bound("n2", "1", "1Gi"), bound("n2", "1", "1Gi", phase="Succeeded")]
    rooms = k8s.free_rooms(nodes, pods)
    assert {r.name: r.cpu for r in rooms} == {"n1": 0.5, "n2": 1.0}
    assert k8s.gang_fits(rooms, [Resources(cpu=1, memory=1 << 30), Resources(cpu=0.5, memory=1 << 30)]) == (True, "")
    fits, why = k8s.gang_fits(rooms, [Resources(cpu=1)] * 2)
    assert not fits and "1 of 2 instances do not fit" in why and "n1: 0.5 CPU" in why
    assert k8s.total_capacity(nodes).cpu == 4


@pytest.mark.parametrize(
    ("text", "value"), [("250m", 0.25), ("2", 2), ("1Gi", 2**30), ("128974848", 128974848), ("1k", 1000)]
)
def test_quantities(text: str, value: float) -> None:
    assert k8s.quantity(text) == value


def test_job_folders_are_not_nested() -> None:
    s = spec(cwd="/work/elsewhere", instance_dir="/runs/4-digits/instances/worker-1")
    assert sorted(k8s.job_folders(s, {"TM_OUTPUT_DIR": "/runs/4-digits/output"})) == [
        "/runs/4-digits",
        "/work/elsewhere",
    ]
    nested = spec(cwd=None, instance_dir="/runs/4-digits/instances/worker-1")
    assert k8s.job_folders(nested, {"TM_OUTPUT_DIR": "/runs/4-digits/output"}) == ["/runs/4-digits"]


def test_a_dependency_is_carried_in_the_spec() -> None:
    s = spec(depends=[Dependency("master", "Running", 30.0, 1)])
    assert LaunchSpec.from_dict(s.to_dict()).depends == s.depends
