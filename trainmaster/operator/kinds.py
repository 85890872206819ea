"""The custom resources the operator serves, and their CustomResourceDefinitions.

Our own ``TrainingJob`` (trainmaster.io/v1: ``spec`` is a trainmaster job's spec), Kubeflow's
``PyTorchJob``, ``TFJob`` (kubeflow.org/v1) and ``MPIJob`` (v2beta1 and v1) and Volcano's ``Job``
(batch.volcano.sh/v1alpha1), and Kubeflow Trainer v2's ``TrainJob`` (trainer.kubeflow.org/v1alpha1),
whose ``TrainingRuntime`` (namespaced) and ``ClusterTrainingRuntime`` are read through the API
(:data:`RUNTIME_KINDS`: their CRDs are installed, they are never run themselves). Every CRD is
apiextensions.k8s.io/v1 with the status subresource (status is written only through it, so a
user's ``kubectl apply`` never overwrites it) and a structural schema that keeps the spec as
written (``x-kubernetes-preserve-unknown-fields``): the compat layer validates it and names the
wrong field in a Failed condition, as a conversion webhook would not be able to say.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ResourceKind:
    group: str
    versions: tuple[str, ...]  # served; the first is stored
    kind: str
    plural: str
    short_names: tuple[str, ...]
    status: str  # how its status is written: "kubeflow", "volcano" or "trainmaster"
    printer: tuple[tuple[str, str, str], ...]  # (name, type, jsonPath)
    scope: str = "Namespaced"  # or "Cluster" (ClusterTrainingRuntime)

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{self.group}"

    @property
    def storage_version(self) -> str:
        return self.versions[0]

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.storage_version}"


KUBEFLOW_COLUMNS = (
    ("State", "string", ".status.conditions[-1:].type"),
    ("Age", "date", ".metadata.creationTimestamp"),
)

KINDS: tuple[ResourceKind, ...] = (
    ResourceKind(
        "trainmaster.io",
        ("v1",),
        "TrainingJob",
        "trainingjobs",
        ("tmjob",),
        "trainmaster",
        (
            ("Framework", "string", ".spec.framework"),
            ("State", "string", ".status.state"),
            ("Reason", "string", ".status.reason"),
            ("Age", "date", ".metadata.creationTimestamp"),
        ),
    ),
    ResourceKind("kubeflow.org", ("v1",), "PyTorchJob", "pytorchjobs", ("ptjob",), "kubeflow", KUBEFLOW_COLUMNS),
    ResourceKind("kubeflow.org", ("v1",), "TFJob", "tfjobs", ("tfjob",), "kubeflow", KUBEFLOW_COLUMNS),
    ResourceKind("kubeflow.org", ("v2beta1", "v1"), "MPIJob", "mpijobs", ("mpij",), "kubeflow", KUBEFLOW_COLUMNS),
    ResourceKind(
        "batch.volcano.sh",
        ("v1alpha1",),
        "Job",
        "jobs",
        ("vcjob", "vj"),
        "volcano",
        (
            ("Status", "string", ".status.state.phase"),
            ("MinAvailable", "integer", ".status.minAvailable"),
            ("Running", "integer", ".status.running"),
            ("Age", "date", ".metadata.creationTimestamp"),
        ),
    ),
    ResourceKind("trainer.kubeflow.org", ("v1alpha1",), "TrainJob", "trainjobs", (), "trainer", KUBEFLOW_COLUMNS),
)


#: Kubeflow Trainer v2's runtimes: the operator reads the one a TrainJob names (spec.runtimeRef)
RUNTIME_KINDS: tuple[ResourceKind, ...] = (
    ResourceKind(
        "trainer.kubeflow.org",
        ("v1alpha1",),
        "TrainingRuntime",
        "trainingruntimes",
        (),
        "runtime",
        (("Age", "date", ".metadata.creationTimestamp"),),
    ),
    ResourceKind(
        "trainer.kubeflow.org",
        ("v1alpha1",),
        "ClusterTrainingRuntime",
        "clustertrainingruntimes",
        (),
        "runtime",
        (("Age", "date", ".metadata.creationTimestamp"),),
        scope="Cluster",
    ),
)

#: every CRD the operator installs (and ``trainmaster cluster manifests`` prints)
CRD_KINDS: tuple[ResourceKind, ...] = (*KINDS, *RUNTIME_KINDS)


def kind_of(api_version: str, kind: str) -> ResourceKind | None:
    group = api_version.partition("/")[0]
    return next((k for k in KINDS if k.group == group and k.kind == kind), None)


def crd_manifest(kind: ResourceKind) -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": {
            "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": kind.crd_name, "labels": {"app.kubernetes.io/managed-by": "trainmaster"}},
        "spec": {
            "group": kind.group,
            "scope": kind.scope,
            "names": {
                "kind": kind.kind,
                "plural": kind.plural,
                "singular": kind.kind.lower(),
                "listKind": f"{kind.kind}List",
                "shortNames": list(kind.short_names),
            },
            "versions": [
                {
                    "name": version,
                    "served": True,
                    "storage": version == kind.storage_version,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": name, "type": type_, "jsonPath": path} for name, type_, path in kind.printer
                    ],
                }
                for version in kind.versions
            ],
        },
    }
