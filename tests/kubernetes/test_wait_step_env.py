"""Mechanism: the wait step of a pod of this machine's software (controller spec: dependencies;
the Kubernetes backend writes the environment file its first process waits for once the
dependencies hold). A restarted dependent instance (an MPI launcher whose workers run) has
its dependencies holding at once: its gate writes the new environment file in the pass that
starts it, while its pod is still being created in the pool. The earlier attempt's file must
be gone before that write, never after it (removed after it, the pod would wait for a file
that no longer comes until its dependency timeout). Run on the backend's own start and create
path with the API's pod create replaced by a stand-in and a pool whose threads start late, as
on a loaded machine (no cluster)."""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest

pytest.importorskip("kubernetes", reason="the optional kubernetes extra (trainmaster[kubernetes]) is not installed")

from trainmaster.backends import kubernetes_objects as k8s  # noqa: E402
from trainmaster.backends.base import LaunchRequest, Placement  # noqa: E402
from trainmaster.backends.kubernetes import KubernetesBackend  # noqa: E402
from trainmaster.contract import Dependency, LaunchSpec  # noqa: E402


class LatePool(ThreadPoolExecutor):
    """A pool whose tasks begin ``delay`` seconds after they are handed over."""

    def __init__(self, delay: float):
        super().__init__(4, thread_name_prefix="late-create")
        self.delay = delay

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:  # type: ignore[override]
        def late() -> Any:
            time.sleep(self.delay)
            return fn(*args, **kwargs)

        return super().submit(late)


class Core:
    """The API's pod create: answers with the pod as sent."""

    def __init__(self) -> None:
        self.created: list[str] = []

    def create_namespaced_pod(self, namespace: str, body: dict[str, Any], **_: Any) -> Any:
        self.created.append(body["metadata"]["name"])
        answer = type("Answer", (), {})()
        answer.data = json.dumps({**body, "metadata": {**body["metadata"], "namespace": namespace, "uid": "p1"}})
        return answer

    def read_namespaced_pod(self, name: str, namespace: str, **_: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        raise ApiException(status=404, reason="Not Found")  # no earlier attempt's pod left


class Pods:
    def get(self, namespace: str, name: str) -> None:
        return None

    def items(self) -> list[dict[str, Any]]:
        return []

    def put(self, pod: dict[str, Any]) -> None:
        pass


def backend(delay: float) -> tuple[KubernetesBackend, Core]:
    b = KubernetesBackend.__new__(KubernetesBackend)
    b._lock = threading.RLock()
    b.namespace = "ns"
    b.names = k8s.PodNames("kubeflow")
    b._owner_of = lambda spec: k8s.Owner("kubeflow.org/v2beta1", "MPIJob", "pi", "u1", namespace="ns")
    b.host = k8s.HostRuntime("trainmaster.local/python:3.11", sys.executable, ())
    for table in ("_held", "_where", "_creating", "_job_uids", "_log_paths", "_role_services", "_refused"):
        setattr(b, table, {})
    b._services = set()
    b._wakes = []
    b._channel_checked = True
    b.fence = lambda: None
    b.pods = Pods()  # type: ignore[assignment]
    b.core = Core()
    b._pool = LatePool(delay)
    # the workers run: the launcher's dependencies hold as soon as it is started
    b._dependencies = lambda spec: ({"worker": ["10.0.0.2:2222", "10.0.0.3:2222"]}, [])  # type: ignore[method-assign]
    return b, b.core


def launcher(tmp_path: Path, attempt: int) -> LaunchRequest:
    spec = LaunchSpec(
        instance_id=f"u1/launcher-0/{attempt}",
        job_id=1,
        job_name="pi",
        role="launcher",
        index=0,
        attempt=attempt,
        argv=["mpirun", "true"],
        env={"TM_ROLE": "launcher"},
        cwd=None,
        log_path=str(tmp_path / "launcher.log"),
        instance_dir=str(tmp_path / "launcher-0"),
        host="",
        depends=[Dependency(role="worker", condition="Running", timeout=600.0, replicas=2)],
    )
    return LaunchRequest(Placement("kubernetes", []), spec)


@pytest.mark.parametrize("attempt", [1, 2])
def test_a_dependent_pods_new_environment_file_outlives_its_create(tmp_path: Path, attempt: int) -> None:
    b, core = backend(delay=0.3)
    env_file = tmp_path / "launcher-0" / k8s.ENV_FILE
    if attempt > 1:  # the earlier attempt's file, as it left it
        env_file.parent.mkdir(parents=True)
        env_file.write_text(json.dumps({"env": {"TM_ROLE": "launcher", "STALE": "1"}}))
    handles = list(b.start([launcher(tmp_path, attempt)]))
    assert len(handles) == 1
    b.wait_created(5.0)
    b._pool.shutdown(wait=True)
    assert core.created == ["pi-launcher-0"], f"the launcher's pod is created ({b._refused})"
    assert env_file.exists(), "the environment file the gate wrote was removed by the pod's create"
    written = json.loads(env_file.read_text())
    assert "STALE" not in written["env"], f"the earlier attempt's file was left: {written}"
    assert written["env"]["TM_ROLE"] == "launcher"
