"""Mechanism: operator mode (controller spec, 'Our product decisions': Kubernetes, an operator
mode in which jobs are custom resources applied with kubectl and their status is written back):
CRDs with the status subresource, Kubeflow conditions and replicaStatuses, Volcano's phase,
a Failed condition naming the field of a malformed resource, cascading deletion, and a standby
replica that takes over from a killed leader without running any instance twice. Two operator
processes (out of the cluster) serve the session's cluster; the cluster is the state of record."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kube_helpers import REPO, TRAINMASTER, apply, as_training_job, condition, env_of, get_json, kubectl, wait_for
from test_jobs import must_show_jobs

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(600)]

LEASE = "trainmaster-operator"


class Operators:
    """Two operator processes; ``start``/``kill`` by identity."""

    def __init__(self, cluster: Any, folder: Path):
        self.cluster, self.folder = cluster, folder
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, identity: str) -> None:
        log = open(self.folder / f"{identity}.log", "ab")
        self.processes[identity] = subprocess.Popen(
            [TRAINMASTER, "operator", "--runtime", "host", "--identity", identity, "--lease-seconds", "8"],
            cwd=REPO,
            env=env_of(self.cluster, TRAINMASTER_HOME=str(self.folder / identity)),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def leader(self) -> str:
        lease = get_json(self.cluster, "lease", LEASE, "-n", "default")
        return str(lease["spec"].get("holderIdentity") or "")

    def log(self, identity: str) -> str:
        return (self.folder / f"{identity}.log").read_text(errors="replace")[-4000:]

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def operators(k8s_cluster, tmp_path_factory) -> Iterator[Operators]:
    ops = Operators(k8s_cluster, tmp_path_factory.mktemp("operators"))
    ops.start("op-a")
    wait_for(lambda: ops.leader() == "op-a" if _lease_exists(k8s_cluster) else False, 90, "op-a leading")
    ops.start("op-b")
    try:
        yield ops
    finally:
        ops.stop_all()


def _lease_exists(cluster: Any) -> bool:
    return bool(kubectl(cluster, "get", "lease", LEASE, "-n", "default", "--ignore-not-found", "-o", "name"))


def test_crds_are_installed_with_the_status_subresource(k8s_cluster, operators) -> None:
    for crd in (
        "trainingjobs.trainmaster.io",
        "pytorchjobs.kubeflow.org",
        "tfjobs.kubeflow.org",
        "mpijobs.kubeflow.org",
        "jobs.batch.volcano.sh",
    ):
        found = get_json(k8s_cluster, "crd", crd)
        assert found["apiVersion"] == "apiextensions.k8s.io/v1"
        assert all(v["subresources"] == {"status": {}} for v in found["spec"]["versions"])


def test_every_framework_runs_through_kubectl_apply(k8s_cluster, operators) -> None:
    """The five jobs applied with kubectl at once; ``kubectl wait --for=condition=Succeeded``
    returns for the Kubeflow kinds and ours, Volcano's phase becomes Completed."""
    jobs = must_show_jobs()
    jobs["digits"] = as_training_job(jobs["digits"])
    for document in jobs.values():
        apply(k8s_cluster, document)
    names = ["tmjob/pytorch-digits", "pytorchjob/torchrun-allreduce", "tfjob/tf-parameter-server", "mpijob/pi"]
    try:
        kubectl(k8s_cluster, "wait", "--for=condition=Succeeded", *names, "--timeout=420s", timeout=450)
        wait_for(
            lambda: (
                (get_json(k8s_cluster, "vcjob", "web-check").get("status") or {}).get("state", {}).get("phase")
                == "Completed"
            ),
            120,
            "the Volcano job Completed",
            step=1.0,
        )
    except AssertionError:
        print(kubectl(k8s_cluster, "get", "pods", "-o", "wide"), operators.log(operators.leader()))
        raise
    table = kubectl(k8s_cluster, "get", "pytorchjobs")
    assert "torchrun-allreduce" in table and "Succeeded" in table
    pytorchjob = get_json(k8s_cluster, "pytorchjob", "torchrun-allreduce")
    replicas = pytorchjob["status"]["replicaStatuses"]
    assert replicas["Master"] == {"active": 0, "succeeded": 1, "failed": 0}
    # the job ends when its master succeeds (Kubeflow's policy): a worker still finishing is stopped
    assert replicas["Worker"]["active"] == 0 and replicas["Worker"]["failed"] == 0
    assert [c["type"] for c in pytorchjob["status"]["conditions"]] == ["Created", "Running", "Succeeded"]
    assert condition(pytorchjob, "Running")["status"] == "False"
    master_log = kubectl(k8s_cluster, "logs", "torchrun-allreduce-master-0")
    assert "all_reduce sum = 6" in master_log and "PET_MASTER_ADDR" in master_log
    assert "pi is approximately 3.14159" in kubectl(k8s_cluster, "logs", "pi-launcher-0")
    # the digits job's trainmaster.report() reached the leader's instance channel over TCP (a
    # point that could not be stored is said on stderr, after the channel's timeout)
    digits_log = kubectl(k8s_cluster, "logs", "pytorch-digits-master-0")
    assert "accuracy" in digits_log.lower() and "report():" not in digits_log, digits_log[-1500:]
    volcano = get_json(k8s_cluster, "vcjob", "web-check")
    assert volcano["status"]["state"]["phase"] == "Completed" and volcano["status"]["succeeded"] >= 2
    pod = get_json(k8s_cluster, "pod", "pi-launcher-0")  # kept after the job (the workers were stopped)
    owner = pod["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("MPIJob", "pi", True)
    assert pod["metadata"]["labels"]["training.kubeflow.org/replica-type"] == "launcher"
    assert pod["spec"]["restartPolicy"] == "Never"
    services = get_json(k8s_cluster, "services", "-l", "trainmaster.io/job-name=pi")["items"]
    assert sorted(s["metadata"]["name"] for s in services) == ["pi-launcher", "pi-worker"]
    assert all(s["spec"]["clusterIP"] == "None" for s in services)
    for name in names + ["vcjob/web-check"]:
        kubectl(k8s_cluster, "delete", name, "--wait=false")


def sleeper(name: str, seconds: int, replicas: int = 2, report: bool = False) -> dict[str, Any]:
    """A TrainingJob whose instances print one line when they start, then sleep (and with
    ``report``, then ``trainmaster.report()`` one point and print whether it was stored)."""
    code = f"import os, time; print('started', os.environ['TM_ROLE'], os.environ['TM_REPLICA_INDEX'], flush=True); time.sleep({seconds})"
    if report:
        code += "; import trainmaster; print('reported', trainmaster.report(step=1, loss=0.5), flush=True)"
    return {
        "apiVersion": "trainmaster.io/v1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {"roles": [{"name": "sleeper", "replicas": replicas, "command": ["python", "-c", code]}]},
    }


def running_pods(cluster: Any, job: str) -> dict[str, dict[str, Any]]:
    pods = get_json(cluster, "pods", "-l", f"trainmaster.io/job-name={job}")["items"]
    return {p["metadata"]["name"]: p for p in pods if p["status"].get("phase") == "Running"}


def test_a_standby_takes_over_from_a_killed_leader_and_nothing_runs_twice(k8s_cluster, operators) -> None:
    """kill -9 of the leading operator mid-job: the standby takes the Lease within 15 s, takes
    the job's running pods up (from the cluster: no store survives the leader) and finishes the
    job; every instance started exactly once (one pod each, attempt 1, no container restart,
    one start line in its log). Mechanism: the instance channel outlives leadership (the same
    address, the same token key from the cluster): the pods the killed leader started report()
    to the new leader after the take-over, and it stores their points."""
    leader = operators.leader()
    standby = next(i for i in operators.processes if i != leader)
    apply(k8s_cluster, sleeper("failover", 25, report=True))

    def both_running() -> dict[str, dict[str, Any]] | None:
        pods = running_pods(k8s_cluster, "failover")
        return pods if len(pods) == 2 else None

    before = wait_for(both_running, 90, "2 pods Running")
    killed = time.monotonic()
    os.kill(operators.processes[leader].pid, signal.SIGKILL)
    wait_for(lambda: operators.leader() == standby, 30, f"{standby} holding the Lease", step=0.1)
    took_over = time.monotonic() - killed
    print(f"the standby {standby} leads {took_over:.1f} s after the leader {leader} was killed")
    operators.processes[leader].wait()
    operators.start(leader)  # the next standby
    wait_for(
        lambda: (condition(get_json(k8s_cluster, "tmjob", "failover"), "Succeeded") or {}).get("status") == "True",
        120,
        "the job Succeeded under the new leader",
    )
    after = get_json(k8s_cluster, "pods", "-l", "trainmaster.io/job-name=failover")["items"]
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in after} == {
        n: p["metadata"]["uid"] for n, p in before.items()
    }, "the same two pods, none made again"
    for pod in after:
        assert pod["metadata"]["labels"]["trainmaster.io/attempt"] == "1"
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
        log = kubectl(k8s_cluster, "logs", pod["metadata"]["name"])
        assert log.count("started") == 1
        assert "reported True" in log and "report():" not in log, log[-1500:]
    assert took_over <= 15.0, f"took {took_over:.1f} s"
    kubectl(k8s_cluster, "delete", "tmjob/failover")


def test_deleting_a_resource_deletes_its_pods_and_services(k8s_cluster, operators) -> None:
    apply(k8s_cluster, sleeper("doomed", 300))
    wait_for(lambda: len(running_pods(k8s_cluster, "doomed")) == 2, 90, "2 pods Running")
    # the role's Service follows once every pod of the role has an IP
    wait_for(
        lambda: get_json(k8s_cluster, "services", "-l", "trainmaster.io/job-name=doomed")["items"],
        30,
        "the role's Service",
    )
    kubectl(k8s_cluster, "delete", "tmjob/doomed", "--wait=false")

    def gone() -> bool:
        pods = get_json(k8s_cluster, "pods", "-l", "trainmaster.io/job-name=doomed")["items"]
        services = get_json(k8s_cluster, "services", "-l", "trainmaster.io/job-name=doomed")["items"]
        return not pods and not services

    wait_for(gone, 120, "no pod and no service of the deleted job")


def test_a_malformed_resource_fails_naming_the_field_and_the_operator_keeps_serving(k8s_cluster, operators) -> None:
    bad = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "malformed"},
        "spec": {
            "pytorchReplicaSpecs": {
                "Master": {
                    "replicas": 1,
                    "template": {"spec": {"containers": [{"name": "pytorch", "image": "x", "command": ["true"]}]}},
                },
                "Worker": {
                    "replicas": "many",
                    "template": {"spec": {"containers": [{"name": "pytorch", "image": "x", "command": ["true"]}]}},
                },
            }
        },
    }
    apply(k8s_cluster, bad)
    failed = wait_for(
        lambda: condition(get_json(k8s_cluster, "pytorchjob", "malformed"), "Failed"), 60, "a Failed condition"
    )
    assert failed["status"] == "True" and failed["reason"] == "InvalidSpec"
    assert "spec.pytorchReplicaSpecs.Worker.replicas: must be an integer" in failed["message"], failed["message"]
    apply(k8s_cluster, sleeper("after-malformed", 1, replicas=1))
    kubectl(k8s_cluster, "wait", "--for=condition=Succeeded", "tmjob/after-malformed", "--timeout=90s", timeout=120)
    kubectl(k8s_cluster, "delete", "pytorchjob/malformed", "tmjob/after-malformed")
