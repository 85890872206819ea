"""``pytorch``: torch.distributed jobs (Kubeflow PyTorchJob and Trainer v2 torch semantics).

Two shapes. PyTorchJob's: roles ``master`` (one instance, rank 0, whose first port is the
rendezvous port) and ``worker`` (ranks 1..N); workers depend on the master, and the job succeeds
when the master succeeds. Trainer v2's: one role ``node`` of N instances (the torch runtime's
``node`` job), node 0 being rank 0; every node waits until all are placed, so each knows node 0's
address; other roles (a dataset initializer) may run beside it.

Every training instance gets ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, the
``PET_*`` variables torchrun reads (``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``,
``PET_MASTER_ADDR``, ``PET_MASTER_PORT``) and, with one process per instance, ``LOCAL_RANK``;
``frameworkParams.nprocPerNode`` (``nprocPerNode``, Trainer's ``numProcPerNode``) makes
``WORLD_SIZE`` nodes x nproc. ``PATH`` starts with the controller's interpreter's folder, so a
bare ``torchrun`` or ``python3`` in a command is the one Trainmaster runs under.

Elastic (``frameworkParams.elastic``: ``minReplicas``, ``maxReplicas``, ``maxRestarts``; the
``elasticPolicy`` of a PyTorchJob or a Trainer torch policy): the job gets a ``rendezvous`` role,
one instance serving a c10d store (:mod:`trainmaster.frameworks.rendezvous`) that the controller
restarts if it ends, and ``node`` instances are torchrun elastic agents
(``PET_NNODES=min:max``, ``PET_RDZV_BACKEND=c10d``, ``PET_RDZV_ENDPOINT`` the store,
``PET_MAX_RESTARTS``). The group forms with whichever nodes are up, at least ``minReplicas``;
``trainmaster job scale JOB node N`` (min..max) adds agents, which the running ones admit at
their next rendezvous, or stops some, whose peers re-form without them; a node that dies is
restarted by its restart policy (OnFailure) while the others wait at the rendezvous. No restart
of the job as a whole: the agents restart their own worker processes, which resume from the
training script's checkpoint, as torchrun's elastic training expects.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from trainmaster.frameworks.base import Framework, InstanceContext
from trainmaster.spec.model import (
    Dependency,
    DependencyCondition,
    Job,
    RestartPolicy,
    RestartPolicyKind,
    Role,
    StatusPolicy,
)
from trainmaster.spec.model import RoleSelector

NODE, RENDEZVOUS = "node", "rendezvous"
#: seconds a formed group waits for more nodes before it starts (torchrun's default is 30)
LAST_CALL_SECONDS = 2


class PyTorchFramework(Framework):
    name = "pytorch"
    role_names = None  # master/worker, or node with any helper roles (initializers, rendezvous)
    default_dependencies = {"worker": ("master",)}
    single_instance_roles = ("master", RENDEZVOUS)
    port_roles = {"master": " for rendezvous", NODE: " for rendezvous (node 0)", RENDEZVOUS: " for the c10d store"}

    def role_command(self, job: Job, role: Role) -> list[str] | None:
        if role.name == RENDEZVOUS:
            return [sys.executable, "-m", "trainmaster.frameworks.rendezvous"]
        return None

    def validate(self, spec: dict[str, Any], roles: list[dict[str, Any]]) -> list[str]:
        errors = super().validate(spec, roles)
        names = [r.get("name") for r in roles if isinstance(r, dict)]
        if "master" in names and NODE in names:
            errors.append(
                "spec.roles: a pytorch job has either master/worker roles (PyTorchJob) or a node role (Trainer), not both"
            )
        elif "master" not in names and NODE not in names:
            errors.append(
                "spec.roles: framework 'pytorch' needs a role named 'master' (and 'worker'), or one named 'node'"
            )
        known = ("master", "worker") if "master" in names or NODE not in names else None
        if known is not None:
            for i, name in enumerate(names):
                if isinstance(name, str) and name not in known:
                    errors.append(
                        f"spec.roles[{i}].name: framework 'pytorch' has no role '{name}' (roles: master, worker; or node, as Trainer's torch runtimes)"
                    )
        for i, role in enumerate(roles):
            if (
                isinstance(role, dict)
                and role.get("name") != RENDEZVOUS
                and role.get("command") is None
                and not role.get("image")
            ):
                errors.append(
                    f"spec.roles[{i}].command: required (framework 'pytorch' has no built-in code for role '{role.get('name')}')"
                )
        params = spec.get("frameworkParams")
        params = params if isinstance(params, dict) else {}
        nproc = params.get("nprocPerNode", 1)
        if not isinstance(nproc, int) or isinstance(nproc, bool) or not 1 <= nproc <= 1024:
            errors.append("spec.frameworkParams.nprocPerNode: must be an integer from 1 to 1024")
        elastic = params.get("elastic")
        if elastic is not None:
            errors += _elastic_errors(elastic, roles, names)
        elif RENDEZVOUS in names:
            errors.append(
                "spec.roles: the rendezvous role is the elastic store: set spec.frameworkParams.elastic, or rename the role"
            )
        return errors

    def defaults(self, job: Job) -> Job:
        job = job.model_copy(deep=True)
        elastic = job.spec.framework_params.get("elastic")
        names = {r.name for r in job.spec.roles}
        if elastic is not None and RENDEZVOUS not in names:
            job.spec.roles.append(
                Role(name=RENDEZVOUS, restart_policy=RestartPolicy(policy=RestartPolicyKind.ALWAYS, max_restarts=100))
            )
        for role in job.spec.roles:
            if role.name != NODE or "depends_on" in role.model_fields_set:
                continue
            if elastic is not None:  # the agents meet at the store; they never wait for each other
                role.depends_on = [Dependency(role=RENDEZVOUS)]
            else:  # every node learns node 0's address (and its own rank) before it starts
                role.depends_on = [Dependency(role=NODE, condition=DependencyCondition.PLACED)]
            if elastic is not None and "restart_policy" not in role.model_fields_set:
                role.restart_policy = RestartPolicy(
                    policy=RestartPolicyKind.ON_FAILURE, max_restarts=int(elastic.get("maxRestarts", 3))
                )
        job = super().defaults(job)
        if job.spec.status_policy == StatusPolicy():
            if NODE in names:  # Trainer: the job succeeds when every node has (the store is then stopped)
                job.spec.status_policy = StatusPolicy(failed="any", succeeded=RoleSelector(roles=[NODE]))
            else:
                job.spec.status_policy = StatusPolicy(preset="kubeflow")
        return job

    def environment(self, ctx: InstanceContext) -> dict[str, str]:
        path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", os.defpath)])
        if ctx.role not in ("master", "worker", NODE):
            return {"PATH": path}
        nproc = int(ctx.params.get("nprocPerNode", 1))
        elastic = ctx.params.get("elastic")
        if elastic is not None and ctx.role == NODE:
            store = ctx.services.get(RENDEZVOUS, [""])[0]
            low, high = int(elastic["minReplicas"]), int(elastic["maxReplicas"])
            return {
                "PATH": path,
                "PET_NNODES": f"{low}:{high}",
                "PET_NPROC_PER_NODE": str(nproc),
                "PET_RDZV_BACKEND": "c10d",
                "PET_RDZV_ENDPOINT": store,
                "PET_RDZV_ID": f"{ctx.job_name}-{ctx.job_id}",
                # the store is served by the rendezvous role, never by an agent; a formed group
                # waits LAST_CALL_SECONDS for late nodes before training
                "PET_RDZV_CONF": (
                    f"is_host=0,last_call_timeout={LAST_CALL_SECONDS},join_timeout=600,"
                    "keep_alive_interval=1,keep_alive_max_attempt=3"
                ),
                "PET_MAX_RESTARTS": str(int(elastic.get("maxRestarts", 3))),
                "PET_MONITOR_INTERVAL": "0.5",
                # every round's rank 0 publishes the workers' MASTER_ADDR afresh: torch caches it from
                # the agent's first round, and a node that joins later (a replacement, a scale-up)
                # would wait for the address forever while rank 0 survived from that first round
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                "TM_ELASTIC_MIN": str(low),
                "TM_ELASTIC_MAX": str(high),
            }
        if ctx.role == NODE:
            master, rank = ctx.services[NODE][0], ctx.index
            nodes = ctx.replicas
        elif ctx.role == "master":
            master, rank = ctx.address, 0
            nodes = ctx.role_replicas.get("master", 0) + ctx.role_replicas.get("worker", 0)
        else:
            master, rank = ctx.services["master"][0], ctx.role_replicas.get("master", 0) + ctx.index
            nodes = ctx.role_replicas.get("master", 0) + ctx.role_replicas.get("worker", 0)
        host, _, port = master.rpartition(":")
        env = {
            "PATH": path,
            "MASTER_ADDR": host,
            "MASTER_PORT": port,
            "WORLD_SIZE": str(nodes * nproc),
            "RANK": str(rank),
            # torchrun reads its arguments from PET_* (as the Kubeflow operator sets them), so a
            # bare `torchrun script.py` starts nprocPerNode processes in a world of nodes x nproc
            "PET_NNODES": str(nodes),
            "PET_NPROC_PER_NODE": str(nproc),
            "PET_NODE_RANK": str(rank),
            "PET_MASTER_ADDR": host,
            "PET_MASTER_PORT": port,
        }
        if nproc == 1:  # the instance is the training process itself
            env.update({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank)})
        return env


def _elastic_errors(elastic: Any, roles: list[dict[str, Any]], names: list[Any]) -> list[str]:
    where = "spec.frameworkParams.elastic"
    if not isinstance(elastic, dict):
        return [f"{where}: must be a mapping with minReplicas and maxReplicas"]
    errors = []
    unknown = set(elastic) - {"minReplicas", "maxReplicas", "maxRestarts"}
    errors += [f"{where}.{k}: unknown field (minReplicas, maxReplicas, maxRestarts)" for k in sorted(unknown)]
    values = {}
    for key, low in (("minReplicas", 1), ("maxReplicas", 1), ("maxRestarts", 0)):
        value = elastic.get(key, 3 if key == "maxRestarts" else None)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= 10_000:
            errors.append(f"{where}.{key}: must be an integer of at least {low}")
        else:
            values[key] = value
    if NODE not in names:
        errors.append(f"{where}: an elastic job's training role is 'node' (torchrun agents); rename the role")
    if "minReplicas" in values and "maxReplicas" in values:
        low, high = values["minReplicas"], values["maxReplicas"]
        if low > high:
            errors.append(f"{where}.minReplicas: must not exceed maxReplicas ({low} > {high})")
        for i, role in enumerate(roles):
            if isinstance(role, dict) and role.get("name") == NODE:
                replicas = role.get("replicas", 1)
                if isinstance(replicas, int) and not low <= replicas <= high:
                    errors.append(
                        f"spec.roles[{i}].replicas: an elastic node role runs between minReplicas and maxReplicas ({low}-{high}), not {replicas}"
                    )
    return errors
