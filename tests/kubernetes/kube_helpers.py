"""Helpers of the Kubernetes tests: kubectl against the session's cluster, the API as JSON,
waits that say what they waited for (a plain module: imported by the tests of this folder)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import yaml

REPO = Path(__file__).resolve().parents[2]
TRAINMASTER = str(Path(sys.executable).parent / "trainmaster")


def kubectl_program() -> str:
    from trainmaster.cluster.binaries import find_binaries

    try:
        return find_binaries().kubectl
    except Exception:
        return shutil.which("kubectl") or "kubectl"


def env_of(cluster: Any, **extra: str) -> dict[str, str]:
    """The environment of a command that uses the cluster (kubectl, trainmaster): its kubeconfig,
    and image-less roles run as this machine's software in pods."""
    return {
        **os.environ,
        "KUBECONFIG": str(cluster.layout.kubeconfig),
        "TRAINMASTER_K8S_HOST_RUNTIME": "1",
        **extra,
    }


def kubectl(cluster: Any, *args: str, stdin: str | None = None, timeout: float = 120, check: bool = True) -> str:
    done = subprocess.run(
        [kubectl_program(), *args], input=stdin, capture_output=True, text=True, timeout=timeout, env=env_of(cluster)
    )
    if check and done.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def get_json(cluster: Any, *args: str) -> Any:
    return json.loads(kubectl(cluster, "get", *args, "-o", "json"))


def apply(cluster: Any, document: dict[str, Any] | str, namespace: str = "default") -> None:
    text = document if isinstance(document, str) else yaml.safe_dump(document)
    kubectl(cluster, "apply", "-n", namespace, "-f", "-", stdin=text)


def pods_of(cluster: Any, selector: str, namespace: str = "default") -> list[dict[str, Any]]:
    return list(get_json(cluster, "pods", "-n", namespace, "-l", selector)["items"])


def wait_for(check: Callable[[], Any], timeout: float, what: str, step: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(step)
    raise AssertionError(f"waited {timeout:.0f} s for {what} (last: {last!r})")


def example(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((REPO / "examples" / name).read_text()))


def as_training_job(document: dict[str, Any]) -> dict[str, Any]:
    """Our job file as the operator's TrainingJob resource (same spec)."""
    return {
        "apiVersion": "trainmaster.io/v1",
        "kind": "TrainingJob",
        "metadata": {"name": document["metadata"]["name"]},
        "spec": document["spec"],
    }


def condition(resource: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for c in (resource.get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return dict(c)
    return None
