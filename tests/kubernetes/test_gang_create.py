"""Mechanism: a gang's pods are created at once (controller spec: gang scheduling; the Kubernetes
backend hands a whole start to its create pool), the first of a start alone: the others are sent
once the API answered it, so one pod reaches its node's kubelet (whose status client is
rate-limited) as early as it can: a first attempt's lead is created on the pass's own thread
(no pool thread to wake, no interpreter to share with the rest of the pass), a later attempt's
(which may wait for its predecessor's pod to go) in the pool, the others then waiting for it no
longer than ``LEAD_WAIT_SECONDS``; the operator's status write waits for a pass's creates
(``wait_created``). Run on the backend's own
start path and a real thread pool, with the API's create replaced by a stand-in that records
when each create was sent and answered (no cluster)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("kubernetes", reason="the optional kubernetes extra (trainmaster[kubernetes]) is not installed")

from trainmaster.backends import kubernetes as backend_module  # noqa: E402
from trainmaster.backends import kubernetes_objects as k8s  # noqa: E402
from trainmaster.backends.base import LaunchRequest, Placement  # noqa: E402
from trainmaster.backends.kubernetes import KubernetesBackend  # noqa: E402
from trainmaster.contract import ContainerLaunch, LaunchSpec  # noqa: E402


class Creates:
    """Stands in for ``_create``: each create takes ``seconds`` (the lead's ``lead_seconds``)
    and is recorded as (pod, sent, answered)."""

    def __init__(self, seconds: float = 0.02, lead_seconds: float = 0.2):
        self.seconds, self.lead_seconds = seconds, lead_seconds
        self.log: list[tuple[str, float, float]] = []
        self.threads: dict[str, str] = {}  # pod -> the thread that created it
        self._lock = threading.Lock()

    def __call__(self, spec: LaunchSpec, services: dict[str, list[str]]) -> None:
        sent = time.monotonic()
        time.sleep(self.lead_seconds if spec.index == 0 else self.seconds)
        with self._lock:
            self.log.append((f"w{spec.index}", sent, time.monotonic()))
            self.threads[f"w{spec.index}"] = threading.current_thread().name


class Pods:
    """The backend's watched pods: none."""

    def get(self, namespace: str, name: str) -> None:
        return None


def backend_with(creates: Creates, threads: int = 16) -> KubernetesBackend:
    backend = KubernetesBackend.__new__(KubernetesBackend)
    backend._lock = threading.RLock()
    backend.namespace = "ns"
    backend.names = k8s.PodNames("kubeflow")
    backend._owner_of = None
    backend.host = None
    for table in ("_held", "_where", "_creating", "_job_uids", "_log_paths", "_role_services"):
        setattr(backend, table, {})
    backend._services = set()
    backend.pods = Pods()  # type: ignore[assignment]
    backend._pool = ThreadPoolExecutor(threads, thread_name_prefix="test-create")
    backend._create = creates  # type: ignore[method-assign]
    return backend


def gang(tmp_path: Path, size: int, attempt: int = 1) -> list[LaunchRequest]:
    def spec(index: int) -> LaunchSpec:
        return LaunchSpec(
            instance_id=f"u1/worker-{index}/{attempt}",
            job_id=1,
            job_name="j",
            role="worker",
            index=index,
            attempt=attempt,
            argv=[],
            env={},
            cwd=None,
            log_path=str(tmp_path / f"w{index}.log"),
            instance_dir=str(tmp_path / f"w{index}"),
            host="",
            container=ContainerLaunch(image="busybox", command=["true"]),
        )

    return [LaunchRequest(Placement("kubernetes", []), spec(i)) for i in range(size)]


def started(backend: KubernetesBackend, requests: list[LaunchRequest]) -> None:
    handles = list(backend.start(requests))
    assert len(handles) == len(requests)
    backend.wait_created(5.0)
    backend._pool.shutdown(wait=True)


def test_a_starts_first_pod_is_answered_before_the_others_are_sent(tmp_path: Path) -> None:
    creates = Creates()
    backend = backend_with(creates)
    started(backend, gang(tmp_path, 8))
    by_pod = {pod: (sent, answered) for pod, sent, answered in creates.log}
    assert sorted(by_pod) == [f"w{i}" for i in range(8)], "every pod of the gang is created"
    lead_answered = by_pod["w0"][1]
    early = [pod for pod, (sent, _) in by_pod.items() if pod != "w0" and sent < lead_answered]
    assert early == [], f"sent before the first pod was answered: {early}"
    # the others go together once it is: not one after another
    others = [sent for pod, (sent, _) in by_pod.items() if pod != "w0"]
    assert max(others) - min(others) < 7 * creates.seconds, "the rest of the gang is created at once"


def test_a_first_attempts_lead_is_created_on_the_passs_thread_the_others_in_the_pool(tmp_path: Path) -> None:
    creates = Creates()
    backend = backend_with(creates)
    started(backend, gang(tmp_path, 4))
    assert creates.threads["w0"] == threading.current_thread().name, creates.threads
    assert all(creates.threads[f"w{i}"].startswith("test-create") for i in (1, 2, 3)), creates.threads


def test_a_later_attempts_lead_goes_to_the_pool_and_the_others_wait_no_longer_than_the_lead_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backend_module, "LEAD_WAIT_SECONDS", 0.1)
    creates = Creates(lead_seconds=2.0)  # a restart's first create, held while its predecessor's pod goes
    backend = backend_with(creates)
    begun = time.monotonic()
    started(backend, gang(tmp_path, 4, attempt=2))
    assert creates.threads["w0"].startswith("test-create"), "a later attempt's create must not hold the pass"
    by_pod = {pod: sent for pod, sent, _ in creates.log}
    assert all(by_pod[f"w{i}"] - begun < 1.0 for i in (1, 2, 3)), f"the others waited out the first: {by_pod}"


def test_wait_created_returns_once_every_create_is_answered(tmp_path: Path) -> None:
    creates = Creates(seconds=0.05, lead_seconds=0.1)
    backend = backend_with(creates)
    list(backend.start(gang(tmp_path, 4)))
    backend.wait_created(5.0)
    assert len(creates.log) == 4, "wait_created returned before every create was answered"
    assert all(f.done() for f in backend._creating.values())
    backend._pool.shutdown(wait=True)
