"""Mechanism: each associated role's communication service (controller spec: a headless Service
per role) is made once every pod made for the role has an IP, at the latest
``SERVICE_WAIT_SECONDS`` after the first, and not at all when the role's pods are gone first.
The rule runs here on the backend's own bookkeeping, with the watched pods and the create pool
replaced by plain stand-ins (no cluster)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

pytest.importorskip("kubernetes", reason="the optional kubernetes extra (trainmaster[kubernetes]) is not installed")

from trainmaster.backends import kubernetes as backend_module  # noqa: E402
from trainmaster.backends import kubernetes_objects as k8s  # noqa: E402
from trainmaster.backends.kubernetes import KubernetesBackend  # noqa: E402


class Pods:
    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get(f"{namespace}/{name}")


class Pool:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def submit(self, fn: Any, *args: Any) -> None:
        self.calls.append(args)


def bare_backend() -> KubernetesBackend:
    backend = KubernetesBackend.__new__(KubernetesBackend)
    backend._lock = threading.RLock()
    backend._services = set()
    backend._role_services = {}
    backend.pods = Pods()  # type: ignore[assignment]
    backend._pool = Pool()  # type: ignore[assignment]
    return backend


def pod(index: int, ip: str = "") -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"j-worker-{index}",
            "namespace": "ns",
            "labels": {k8s.LABEL_JOB: "j", k8s.LABEL_JOB_UID: "u1", k8s.LABEL_ROLE: "worker"},
            "annotations": {k8s.ANNOTATION_PORTS: "[23456]"},
        },
        "spec": {"subdomain": "j-worker"},
        "status": {"podIP": ip} if ip else {},
    }


def seen(backend: KubernetesBackend, *pods: dict[str, Any]) -> None:
    for p in pods:
        backend.pods.objects[f"ns/{p['metadata']['name']}"] = p  # type: ignore[attr-defined]


def made(backend: KubernetesBackend) -> list[str]:
    return [key for key, _ in backend._pool.calls]  # type: ignore[attr-defined]


def test_the_service_waits_until_every_pod_of_the_role_has_an_ip() -> None:
    backend = bare_backend()
    seen(backend, pod(0), pod(1))
    backend._want_service(pod(0))
    backend._want_service(pod(1))
    backend._release_services()
    assert made(backend) == [], "no pod has an IP yet"
    seen(backend, pod(0, "10.0.0.2"))
    backend._release_services()
    assert made(backend) == [], "one pod of two has an IP"
    seen(backend, pod(1, "10.0.0.3"))
    backend._release_services()
    backend._release_services()
    assert made(backend) == ["ns/j-worker"], "once, when both have IPs"
    assert "ns/j-worker" in backend._services and not backend._role_services
    backend._want_service(pod(2))  # a later pod of the role (a restart): the Service is there
    assert not backend._role_services


def test_a_pod_still_being_created_holds_the_service() -> None:
    backend = bare_backend()
    backend._role_services["ns/j-worker"] = backend_module._RoleService(since=time.monotonic(), creating=1)
    seen(backend, pod(0, "10.0.0.2"))
    backend._want_service(pod(0, "10.0.0.2"))
    backend._release_services()
    assert made(backend) == []


def test_the_service_comes_after_the_wait_limit_even_if_a_pod_has_no_ip(monkeypatch) -> None:
    backend = bare_backend()
    seen(backend, pod(0), pod(1, "10.0.0.3"))
    backend._want_service(pod(0))
    backend._want_service(pod(1, "10.0.0.3"))
    backend._release_services()
    assert made(backend) == []
    monkeypatch.setattr(backend_module, "SERVICE_WAIT_SECONDS", 0.0)
    backend._release_services()
    assert made(backend) == ["ns/j-worker"]


def test_no_service_for_a_role_whose_pods_are_gone() -> None:
    backend = bare_backend()
    backend._want_service(pod(0))  # created, then deleted before it had an IP
    backend._release_services()
    assert made(backend) == [] and not backend._role_services


def test_the_service_is_made_from_the_role_pod() -> None:
    backend = bare_backend()
    seen(backend, pod(0, "10.0.0.2"))
    backend._want_service(pod(0, "10.0.0.2"))
    backend._release_services()
    (key, template), *_ = backend._pool.calls  # type: ignore[attr-defined]
    service = k8s.service_manifest(template)
    assert key == "ns/j-worker" and service["metadata"]["name"] == "j-worker"
    assert service["spec"]["selector"] == {k8s.LABEL_JOB_UID: "u1", k8s.LABEL_ROLE: "worker"}
