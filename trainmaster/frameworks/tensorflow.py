"""``tensorflow``: tf.distribute jobs (Kubeflow TFJob semantics): every instance gets ``TF_CONFIG``.

Roles ``chief`` or ``master`` (one instance), ``worker``, ``ps`` and ``evaluator``, as a TFJob's
replica types lower-cased. As the Kubeflow training operator writes it, ``TF_CONFIG`` is::

    {"cluster": {"chief": [...], "worker": [...], "ps": [...]},
     "task": {"type": "worker", "index": 1}, "environment": "cloud"}

with one ``host:port`` per instance of every role in index order; the evaluator is not part of
the training cluster (the operator leaves it out of ``cluster``, as ``tf.estimator`` wants) but
gets the cluster and its own task. Every instance must know every address before it starts,
including those of instances started after it; so each role depends on every cluster role with
the condition ``Placed`` (every instance has a host and ports, possibly still waiting itself),
which never deadlocks. A restarted instance gets a new port, which peers that are already
running do not learn: TFJob's default restart policy is Never, and a job that restarts
instances should use a Kubernetes-like fixed port set (not offered here).
"""

from __future__ import annotations

import json

from trainmaster.frameworks.base import Framework, InstanceContext
from trainmaster.spec.compat.kubeflow import TF_CLUSTER_ROLES
from trainmaster.spec.model import Dependency, DependencyCondition, Job, RoleSelector, StatusPolicy

#: Roles in the training cluster (``TF_CONFIG.cluster``), a TFJob's as Kubeflow defines them;
#: the evaluator is not one of them.
CLUSTER_ROLES = TF_CLUSTER_ROLES


class TensorFlowFramework(Framework):
    name = "tensorflow"
    role_names = ("chief", "master", "worker", "ps", "evaluator")
    single_instance_roles = ("chief", "master")
    port_roles = {r: " (its address is in every replica's TF_CONFIG)" for r in CLUSTER_ROLES}

    def validate(self, spec: dict[str, object], roles: list[dict[str, object]]) -> list[str]:
        errors = super().validate(spec, roles)
        names = [r.get("name") for r in roles]
        if "chief" in names and "master" in names:
            errors.append("spec.roles: a TensorFlow job has a chief or a master, not both")
        return errors

    def defaults(self, job: Job) -> Job:
        job = super().defaults(job)
        cluster = [r.name for r in job.spec.roles if r.name in CLUSTER_ROLES]
        for role in job.spec.roles:
            if "depends_on" in role.model_fields_set:
                continue
            role.depends_on = [Dependency(role=name, condition=DependencyCondition.PLACED) for name in cluster]
        if job.spec.status_policy == StatusPolicy():
            leader = next((r.name for r in job.spec.roles if r.name in ("chief", "master")), None)
            job.spec.status_policy = (
                StatusPolicy(failed="any", succeeded=RoleSelector(roles=[leader]))
                if leader
                else StatusPolicy(preset="tfjob-allworkers")
            )
        return job

    def environment(self, ctx: InstanceContext) -> dict[str, str]:
        return {"TF_CONFIG": tf_config(ctx)}


def tf_config(ctx: InstanceContext) -> str:
    """The instance's ``TF_CONFIG`` (JSON), from the placed addresses of the cluster roles."""
    cluster = {role: list(ctx.services.get(role, [])) for role in CLUSTER_ROLES if ctx.role_replicas.get(role)}
    if ctx.role in cluster and ctx.index < len(cluster[ctx.role]):
        cluster[ctx.role][ctx.index] = ctx.address  # its own address, as placed (never stale)
    return json.dumps(
        {"cluster": cluster, "task": {"type": ctx.role, "index": ctx.index}, "environment": "cloud"}, sort_keys=True
    )
