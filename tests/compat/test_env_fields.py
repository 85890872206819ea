"""Mechanism: a pod's ``env[].valueFrom`` as an instance's facts (issue #22). ``fieldRef`` paths
with a meaning here (``status.podIP``, ``status.hostIP``, ``spec.nodeName``, ``metadata.name``,
``metadata.uid``) become the role's ``envFields``, resolved per attempt with the rest of the
environment; ``metadata.namespace`` is ``default``; ``resourceFieldRef`` of cpu/memory becomes its
value at once (Kubernetes' rounding up over the divisor); every other source is refused with its
field path (noted and left unset with ``--lenient``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller_harness import run_job_file, run_logs
from trainmaster.errors import UserError
from trainmaster.spec.compat import convert

FIELDS = {
    "POD_IP": "status.podIP",
    "HOST_IP": "status.hostIP",
    "NODE": "spec.nodeName",
    "POD_NAME": "metadata.name",
    "POD_UID": "metadata.uid",
    "POD_NAMESPACE": "metadata.namespace",
}
RESOURCES = {
    "MEM_MI": {"resource": "limits.memory", "divisor": "1Mi"},
    "CPU_MILLI": {"resource": "requests.cpu", "divisor": "1m"},
    "CPUS": {"resource": "limits.cpu"},
}


def pytorchjob(env: list[dict[str, Any]], command: list[str] | None = None) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "pytorch",
        "image": "localhost/none:0",
        "command": command or ["python", "-c", "pass"],
        "env": env,
        "resources": {"limits": {"memory": "300Mi", "cpu": "500m"}},
    }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "facts", "namespace": "team-a"},
        "spec": {
            "pytorchReplicaSpecs": {
                "Master": {"replicas": 1, "restartPolicy": "Never", "template": {"spec": {"containers": [container]}}}
            }
        },
    }


def value_from(fields: dict[str, str], resources: dict[str, dict[str, str]]) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": k, "valueFrom": {"fieldRef": {"fieldPath": v}}} for k, v in fields.items()]
    env += [{"name": k, "valueFrom": {"resourceFieldRef": v}} for k, v in resources.items()]
    return env


def test_value_from_maps_instance_facts_and_resources() -> None:
    converted = convert(pytorchjob(value_from(FIELDS, RESOURCES)))
    assert converted is not None
    role = converted.document["spec"]["roles"][0]
    assert role["envFields"] == {k: v for k, v in FIELDS.items() if k != "POD_NAMESPACE"}
    # 300Mi / 1Mi; 0.5 cores in millicores; 0.5 cores rounded up to whole cores, as Kubernetes does
    assert role["env"] == {"POD_NAMESPACE": "default", "MEM_MI": "300", "CPU_MILLI": "500", "CPUS": "1"}
    assert any("fieldPath: approximated: there are no namespaces" in line for line in converted.ignored)


@pytest.mark.parametrize(
    ("source", "where", "says"),
    [
        ({"fieldRef": {"fieldPath": "metadata.labels['app']"}}, "valueFrom.fieldRef.fieldPath", "metadata.labels"),
        ({"fieldRef": {"fieldPath": "status.podIPs"}}, "valueFrom.fieldRef.fieldPath", "status.podIPs"),
        (
            {"resourceFieldRef": {"resource": "limits.ephemeral-storage"}},
            "valueFrom.resourceFieldRef.resource",
            "ephemeral",
        ),
        (
            {"resourceFieldRef": {"resource": "limits.cpu", "divisor": "lots"}},
            "valueFrom.resourceFieldRef.resource",
            "lots",
        ),
        ({"secretKeyRef": {"name": "s", "key": "k"}}, "valueFrom.secretKeyRef", "secretKeyRef"),
        ({"configMapKeyRef": {"name": "c", "key": "k"}}, "valueFrom.configMapKeyRef", "configMapKeyRef"),
    ],
)
def test_value_from_without_a_meaning_here_is_refused_by_path(source: dict[str, Any], where: str, says: str) -> None:
    raw = pytorchjob([{"name": "X", "valueFrom": source}])
    with pytest.raises(UserError) as refused:
        convert(raw)
    text = str(refused.value) + " ".join(refused.value.details)
    assert f"containers[0].env[0].{where}: not supported" in text and says in text, text
    lenient = convert(raw, lenient=True)
    assert lenient is not None and "X" not in lenient.document["spec"]["roles"][0].get("env", {})
    assert any("X is not set" in line for line in lenient.ignored)


def test_native_env_fields_are_checked() -> None:
    from trainmaster.loading import LoadOptions, load_document

    role = {"name": "main", "command": ["true"], "env": {"A": "1"}, "envFields": {"A": "status.podIP"}}
    job = {"apiVersion": "trainmaster/v1", "kind": "Job", "metadata": {"name": "x"}, "spec": {"roles": [role]}}
    with pytest.raises(UserError, match="A: set in both env and envFields"):
        load_document(job, "job", LoadOptions())
    role.update(env={}, envFields={"A": "metadata.labels"})
    with pytest.raises(UserError, match="status.podIP"):
        load_document(job, "job", LoadOptions())


PRINT = "import os; print(' '.join(f'{k}={os.environ[k]}' for k in NAMES), flush=True)"


def test_value_from_resolves_per_instance_on_the_host(tmp_path: Path) -> None:
    """A converted PyTorchJob run with ``trainmaster run`` on the host: each variable holds the
    instance's fact (its address, Kubeflow's pod name, a UUID of the attempt)."""
    names = sorted([*FIELDS, *RESOURCES])
    job = pytorchjob(value_from(FIELDS, RESOURCES), [sys.executable, "-c", PRINT.replace("NAMES", repr(names))])
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    proc, status = run_job_file(path, tmp_path, timeout=120)
    logs = run_logs(tmp_path)
    assert proc.returncode == 0 and status["state"] == "succeeded", proc.stderr[-2000:] + logs[-2000:]
    facts = dict(item.split("=", 1) for item in re.search(r"CPUS=.*", logs).group(0).split())  # type: ignore[union-attr]
    assert facts["POD_IP"] == facts["HOST_IP"] == facts["NODE"] == "127.0.0.1", facts
    assert facts["POD_NAME"] == "facts-master-0" and facts["POD_NAMESPACE"] == "default", facts
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-5[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}", facts["POD_UID"]), facts
    assert (facts["MEM_MI"], facts["CPU_MILLI"], facts["CPUS"]) == ("300", "500", "1"), facts
