"""Kubeflow ``PyTorchJob``, ``TFJob`` (kubeflow.org/v1) and ``MPIJob`` (v1, v2beta1) as our jobs.

Each replica spec becomes a role named after its replica type, lower-cased (``Master`` ->
``master``, ``PS`` -> ``ps``). Kubeflow's implicit behaviour is made explicit in the converted
job, so that it reads the same whatever framework runs it: the dependencies between roles
(workers wait for the master, an MPI launcher waits for its workers) and the success policy
(the master, chief or launcher succeeding ends the job).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainmaster.errors import UserError
from trainmaster.spec.compat import kueue
from trainmaster.spec.compat.ignored import Report, join
from trainmaster.spec.compat.meta import metadata
from trainmaster.spec.compat.pod import from_template

GROUP = "kubeflow.org"
#: The replica types of a TFJob that make up TF_CONFIG's cluster (an evaluator is outside it)
TF_CLUSTER_ROLES = ("chief", "master", "worker", "ps")


@dataclass(frozen=True)
class Kind:
    """What differs between the Kubeflow job kinds."""

    replica_key: str  # spec.<replica_key> holds the replica specs
    versions: tuple[str, ...]
    container: str | None  # the main container's name (None: the first container)
    default_restart: dict[str, str]  # replica type (lower-case) -> Kubeflow's default; "" = any
    spec_keys: dict[str, str]  # kind-specific spec fields we do not carry, with the reason
    spec_fields: frozenset[str] = frozenset()  # every field of the kind's spec upstream
    replica_types: tuple[str, ...] = ()  # the replica types the operator accepts


KINDS: dict[str, Kind] = {
    "PyTorchJob": Kind(
        "pytorchReplicaSpecs",
        ("v1",),
        "pytorch",
        {"": "OnFailure"},
        {},
        frozenset({"runPolicy", "elasticPolicy", "pytorchReplicaSpecs", "nprocPerNode"}),
        ("Master", "Worker"),
    ),
    "TFJob": Kind(
        "tfReplicaSpecs",
        ("v1",),
        "tensorflow",
        {"": "Never"},
        {},
        frozenset({"runPolicy", "successPolicy", "tfReplicaSpecs", "enableDynamicWorker"}),
        ("Chief", "Master", "PS", "Worker", "Evaluator"),
    ),
    "MPIJob": Kind(
        "mpiReplicaSpecs",
        ("v1", "v2beta1"),
        None,
        {"launcher": "OnFailure", "": "Never"},
        {
            "sshAuthMountPath": "no SSH between instances locally",
            "launcherCreationPolicy": "the launcher always starts once every worker runs (WaitForWorkersReady)",
        },
        frozenset(
            {
                "slotsPerWorker",
                "cleanPodPolicy",
                "mpiReplicaSpecs",
                "mainContainer",
                "runPolicy",
                "runLauncherAsWorker",
                "sshAuthMountPath",
                "launcherCreationPolicy",
                "mpiImplementation",
            }
        ),
        ("Launcher", "Worker"),
    ),
}

_RESTART = {"Never": "Never", "OnFailure": "OnFailure", "Always": "Always", "ExitCode": "ExitCode"}

_RUN_POLICY_REASONS = {
    "managedBy": "the Trainmaster controller manages the job",
}
RUN_POLICY_FIELDS = {
    "cleanPodPolicy",
    "ttlSecondsAfterFinished",
    "activeDeadlineSeconds",
    "backoffLimit",
    "schedulingPolicy",
    "suspend",
    "managedBy",
}
SCHEDULING_POLICY_FIELDS = {"minAvailable", "queue", "minResources", "priorityClass", "scheduleTimeoutSeconds"}
MPI_IMPLEMENTATIONS = ("OpenMPI", "Intel", "MPICH")
_SCHEDULING_REASONS = {
    "minResources": "admission uses the roles' own resource requests",
    "scheduleTimeoutSeconds": "a gang waits in the queue until it fits",
}


def convert(raw: dict[str, Any], lenient: bool = False) -> tuple[dict[str, Any], list[str]]:
    """``raw`` (a kubeflow.org document) as a ``trainmaster/v1 Job`` and the ignored fields."""
    api_version, kind_name = raw.get("apiVersion"), raw.get("kind")
    group, _, version = str(api_version).partition("/")
    kind = KINDS.get(str(kind_name))
    if group != GROUP or kind is None:
        raise UserError(
            f"{api_version} {kind_name} is not supported",
            [
                "supported Kubeflow kinds: PyTorchJob and TFJob (kubeflow.org/v1), MPIJob "
                "(kubeflow.org/v1 or v2beta1); other jobs can be written as a trainmaster/v1 Job"
            ],
        )
    if version not in kind.versions:
        raise UserError(
            f"{api_version} {kind_name} is not supported",
            [f"apiVersion: {kind_name} is read in versions {', '.join(GROUP + '/' + v for v in kind.versions)}"],
        )
    report = Report(f"{api_version} {kind_name}", lenient=lenient)
    report.rest(
        raw, "", {"apiVersion", "kind", "metadata", "spec"}, {"status": "status is filled in by the controller"}
    )
    spec = report.mapping(raw.get("spec"), "spec")
    main_container = spec.get("mainContainer") if kind_name == "MPIJob" else None
    if not isinstance(main_container, (str, type(None))):
        report.invalid("spec.mainContainer", "must be a container name")
        main_container = None
    handled = {
        kind.replica_key,
        "runPolicy",
        "successPolicy",
        "slotsPerWorker",
        "mainContainer",
        "cleanPodPolicy",
        "elasticPolicy",
        "nprocPerNode",
        "enableDynamicWorker",
        "mpiImplementation",
        "runLauncherAsWorker",
    } & kind.spec_fields
    report.rest(spec, "spec", handled, kind.spec_keys, kind.spec_fields)
    params = _kind_params(str(kind_name), spec, report)
    roles = _roles(spec, kind, main_container or kind.container, report)
    if "elastic" in params:  # torchrun agents, every one a peer: the pytorch framework's node role
        for role in roles:
            if role["name"] == "worker":
                role["name"] = "node"
    promoted = kind_name == "PyTorchJob" and _promote_worker_zero(roles, kind.replica_key, report)
    if kind_name == "MPIJob":
        _mpi_workers_host_ranks(roles, report)
    names = [r["name"] for r in roles]
    _add_dependencies(str(kind_name), roles, names)
    job_spec: dict[str, Any] = {"framework": _framework(str(kind_name)), "roles": roles}
    if params:
        job_spec["frameworkParams"] = params
    status_policy = _status_policy(str(kind_name), spec, roles, names, report, promoted)
    if status_policy:
        job_spec["statusPolicy"] = status_policy
    scheduling = _run_policy(spec, roles, report, job_spec)
    kueue.apply(
        raw.get("metadata"),
        scheduling,
        "spec.runPolicy.schedulingPolicy.priorityClass",
        _pod_priorities(spec, kind.replica_key),
        report,
    )
    if scheduling:
        job_spec["scheduling"] = scheduling
    meta = metadata(raw.get("metadata"), f"{api_version} {kind_name}", report)
    report.finish()
    return {"apiVersion": "trainmaster/v1", "kind": "Job", "metadata": meta, "spec": job_spec}, report.lines


def _pod_priorities(spec: dict[str, Any], replica_key: str) -> list[tuple[str, Any]]:
    """(path, priorityClassName) of each replica's pod template that names one."""
    found = []
    replicas = spec.get(replica_key)
    for replica_type, replica_spec in (replicas if isinstance(replicas, dict) else {}).items():
        template = replica_spec.get("template") if isinstance(replica_spec, dict) else None
        pod = template.get("spec") if isinstance(template, dict) else None
        if isinstance(pod, dict) and "priorityClassName" in pod:
            found.append(
                (f"spec.{replica_key}.{replica_type}.template.spec.priorityClassName", pod["priorityClassName"])
            )
    return found


def _framework(kind_name: str) -> str:
    """The framework running this kind (each is built in)."""
    return {"PyTorchJob": "pytorch", "TFJob": "tensorflow", "MPIJob": "mpi"}[kind_name]


def _roles(spec: dict[str, Any], kind: Kind, container: str | None, report: Report) -> list[dict[str, Any]]:
    path = join("spec", kind.replica_key)
    replica_specs = report.mapping(spec.get(kind.replica_key), path)
    roles = []
    known = {t.lower(): t for t in kind.replica_types}
    for replica_type, replica_spec in replica_specs.items():
        where = join(path, str(replica_type))
        if str(replica_type).lower() not in known:
            report.unknown(path, str(replica_type), kind.replica_types)
            continue
        replica_spec = report.mapping(replica_spec, where)
        name = str(replica_type).lower()
        report.rest(replica_spec, where, {"replicas", "restartPolicy", "template"}, {})
        pod = from_template(replica_spec.get("template"), join(where, "template"), report, container)
        role: dict[str, Any] = {"name": name, "replicas": replica_spec.get("replicas", 1), **pod.role}
        if pod.restart_policy is not None:
            report.ignore(
                join(where, "template.spec.restartPolicy"),
                "the replica spec's restartPolicy applies (Kubeflow overrides the pod's)",
            )
        default = kind.default_restart.get(name, kind.default_restart[""])
        role["restartPolicy"] = {
            "policy": _restart(replica_spec.get("restartPolicy", default), join(where, "restartPolicy"), report)
        }
        roles.append(role)
    return roles


def _promote_worker_zero(roles: list[dict[str, Any]], replica_key: str, report: Report) -> bool:
    """A PyTorchJob without a Master: Kubeflow makes worker 0 rank 0 and points MASTER_ADDR at
    it. Here worker 0 becomes a one-replica ``master`` role (the pytorch framework's rank 0)."""
    names = [r["name"] for r in roles]
    if "master" in names or "worker" not in names:
        return False
    index = names.index("worker")
    worker = roles[index]
    replicas = worker.get("replicas", 1)
    if not isinstance(replicas, int) or replicas < 1:
        return False
    master = {**worker, "name": "master", "replicas": 1}
    roles.insert(index, master)
    if replicas == 1:
        roles.remove(worker)
    else:
        worker["replicas"] = replicas - 1
    report.approximate(
        join(join("spec", replica_key), "Worker"),
        "no Master: worker 0 runs as "
        "the role 'master' (rank 0, MASTER_ADDR), as Kubeflow makes it rank 0; the "
        "job succeeds when every instance succeeded",
    )
    return True


def _mpi_workers_host_ranks(roles: list[dict[str, Any]], report: Report) -> None:
    """An MPIJob's workers run an SSH server (``sshd -De``) or sleep, for the launcher's
    ``mpirun`` to start ranks in: here that part is the mpi framework's rank host."""
    for role in roles:
        if role["name"] == "worker" and "command" in role:
            shown = " ".join(str(a) for a in [*role.pop("command"), *role.pop("args", [])])[:80]
            report.approximate(
                "spec.mpiReplicaSpecs.Worker",
                f"the workers run Trainmaster's rank host, in "
                f"which the launcher's mpirun starts the ranks (the part of the SSH server), "
                f"not '{shown}'",
            )


def _restart(value: Any, path: str, report: Report) -> Any:
    if not isinstance(value, str) or value not in _RESTART:
        report.invalid(path, f"must be one of Always, OnFailure, Never, ExitCode (not {str(value)[:40]!r})")
        return "Never"
    return _RESTART.get(value, value)  # anything else fails validation with this role's path


def _add_dependencies(kind_name: str, roles: list[dict[str, Any]], names: list[str]) -> None:
    """Kubeflow's start order, stated as dependsOn (condition Running)."""
    wanted: dict[str, list[str]] = {}
    if kind_name == "PyTorchJob":
        wanted = {"worker": ["master"]}
    elif kind_name == "MPIJob":
        wanted = {"launcher": ["worker"]}
    elif kind_name == "TFJob":
        # every replica's TF_CONFIG lists every cluster address, so each waits until all the
        # cluster's instances are placed (not running: the operator starts them all at once)
        cluster = [n for n in names if n in TF_CLUSTER_ROLES]
        for role in roles:
            role["dependsOn"] = [{"role": n, "condition": "Placed"} for n in cluster]
        return
    for role in roles:
        deps = [d for d in wanted.get(role["name"], []) if d in names and d != role["name"]]
        if deps:
            role["dependsOn"] = [{"role": d} for d in deps]


def _status_policy(
    kind_name: str,
    spec: dict[str, Any],
    roles: list[dict[str, Any]],
    names: list[str],
    report: Report,
    promoted: bool = False,
) -> dict[str, Any] | None:
    if kind_name == "PyTorchJob":
        if "node" in names:  # elastic: the pytorch framework's default (every node succeeded)
            return None
        if promoted:  # Kubeflow: with no Master, the job succeeds when every worker did
            return {"preset": "default"}
        return {"preset": "kubeflow"} if "master" in names else None
    if kind_name == "MPIJob":
        return {"failed": "any", "succeeded": {"roles": ["launcher"]}} if "launcher" in names else None
    success = spec.get("successPolicy")
    if success == "AllWorkers":
        return {"preset": "tfjob-allworkers"}
    if success not in (None, "", "Default"):
        report.ignore(
            "spec.successPolicy",
            f"unknown TFJob success policy {success!r}; the default (chief, else a worker, succeeding) applies",
        )
    if "chief" in names:
        return {"failed": "any", "succeeded": {"roles": ["chief"]}}
    if "master" in names:
        return {"preset": "kubeflow"}
    if "worker" in names:
        # TFJob: with no chief, worker 0 finishing ends the job; here any worker finishing does.
        for role in roles:
            if role["name"] == "worker":
                role["statusPolicy"] = {"succeeded": 1}
        return {"preset": "tfjob-allworkers"}
    return None


def _run_policy(
    spec: dict[str, Any], roles: list[dict[str, Any]], report: Report, job_spec: dict[str, Any]
) -> dict[str, Any]:
    """``runPolicy``: backoffLimit, activeDeadlineSeconds, ttlSecondsAfterFinished and suspend
    become our ``runPolicy`` (same names and meanings), cleanPodPolicy is honoured or its
    difference stated; ``schedulingPolicy`` becomes ``scheduling`` (returned)."""
    run_policy = report.mapping(spec.get("runPolicy"), "spec.runPolicy")
    report.rest(
        run_policy,
        "spec.runPolicy",
        {
            "backoffLimit",
            "schedulingPolicy",
            "activeDeadlineSeconds",
            "suspend",
            "ttlSecondsAfterFinished",
            "cleanPodPolicy",
        },
        _RUN_POLICY_REASONS,
        RUN_POLICY_FIELDS,
    )
    ours = {
        key: run_policy[key]
        for key in ("backoffLimit", "activeDeadlineSeconds", "ttlSecondsAfterFinished", "suspend")
        if run_policy.get(key) is not None
    }
    if ours:
        job_spec["runPolicy"] = ours
    if "backoffLimit" in run_policy and report.count(run_policy["backoffLimit"], "spec.runPolicy.backoffLimit"):
        for role in roles:  # no instance may restart more often than the whole job may
            role["restartPolicy"]["maxRestarts"] = run_policy["backoffLimit"]
    for where, value in (
        ("spec.runPolicy.cleanPodPolicy", run_policy.get("cleanPodPolicy")),
        ("spec.cleanPodPolicy", spec.get("cleanPodPolicy")),
    ):
        _clean_pod_policy(where, value, report)
    policy = report.mapping(run_policy.get("schedulingPolicy"), "spec.runPolicy.schedulingPolicy")
    report.rest(
        policy,
        "spec.runPolicy.schedulingPolicy",
        {"minAvailable", "queue", "priorityClass"},
        _SCHEDULING_REASONS,
        SCHEDULING_POLICY_FIELDS,
    )
    scheduling: dict[str, Any] = {
        key: policy[key] for key in ("minAvailable", "queue", "priorityClass") if key in policy
    }
    return scheduling


def _clean_pod_policy(where: str, value: Any, report: Report) -> None:
    """Kubeflow's cleanPodPolicy: what happens to pods when the job ends. ``Running`` (stop the
    ones still running) is what the controller always does; ``All`` also deletes the ended pods;
    ``None`` leaves running pods running."""
    if value is None or value == "Running":
        return
    if value == "All":
        report.approximate(
            where,
            "All: instances still running are stopped when the job ends (as "
            "Running); the ended instances' logs and records are kept until the job is "
            "deleted (runPolicy.ttlSecondsAfterFinished or `trainmaster job delete`)",
        )
    elif value == "None":
        report.approximate(
            where,
            "None: instances still running when the job ends are stopped "
            "(as Running), since no controller would watch a process of an ended job",
        )
    else:
        report.invalid(where, f"must be one of All, Running, None (not {str(value)[:40]!r})")


def _kind_params(kind_name: str, spec: dict[str, Any], report: Report) -> dict[str, Any]:
    """The kind's job-wide fields that change what runs: honoured as framework parameters, or
    refused. PyTorchJob ``nprocPerNode`` (torchrun processes per instance), MPIJob
    ``slotsPerWorker`` and ``mpiImplementation`` (the hostfile's slots and format)."""
    params: dict[str, Any] = {}
    if kind_name == "PyTorchJob":
        if spec.get("elasticPolicy") is not None:
            elastic = _elastic_policy(report.mapping(spec["elasticPolicy"], "spec.elasticPolicy"), spec, report)
            if elastic is not None:
                params["elastic"] = elastic
        nproc = spec.get("nprocPerNode")
        if nproc is not None:
            if isinstance(nproc, str) and nproc.isdigit():
                nproc = int(nproc)
            if isinstance(nproc, int) and not isinstance(nproc, bool) and 1 <= nproc <= 1024:
                params["nprocPerNode"] = nproc
            else:
                report.unsupported(
                    "spec.nprocPerNode",
                    f"{str(nproc)[:40]!r}: only a number of "
                    "processes (1-1024) is supported ('auto', 'cpu', 'gpu' are not)",
                )
    elif kind_name == "TFJob":
        if spec.get("enableDynamicWorker"):
            report.unsupported("spec.enableDynamicWorker", "workers are not added to a running TensorFlow cluster here")
    elif kind_name == "MPIJob":
        slots = spec.get("slotsPerWorker")
        if slots is not None:
            if isinstance(slots, int) and not isinstance(slots, bool) and 1 <= slots <= 1024:
                params["slotsPerWorker"] = slots
            else:
                report.invalid("spec.slotsPerWorker", "must be an integer from 1 to 1024")
        implementation = spec.get("mpiImplementation")
        if implementation is not None:
            if implementation in MPI_IMPLEMENTATIONS:
                params["mpiImplementation"] = implementation
            else:
                report.invalid("spec.mpiImplementation", f"must be one of {', '.join(MPI_IMPLEMENTATIONS)}")
        if spec.get("runLauncherAsWorker"):
            report.unsupported("spec.runLauncherAsWorker", "the launcher is never one of the hosts that run ranks here")
    return params


_ELASTIC_NOTES = {
    "rdzvHost": "the controller runs the c10d store as the job's rendezvous role; its address is given to the agents",
    "rdzvPort": "the controller runs the c10d store as the job's rendezvous role, on a port it picks",
    "rdzvId": "the rendezvous is named after the job and its id",
    "rdzvConf": "the controller sets the rendezvous' timeouts (a 2 s last call, 3 s to notice a dead node)",
    "metrics": "no autoscaler here: scale between minReplicas and maxReplicas with `trainmaster job scale JOB node N`",
}


def _elastic_policy(policy: dict[str, Any], spec: dict[str, Any], report: Report) -> dict[str, Any] | None:
    """A PyTorchJob's ``elasticPolicy``: the Worker replicas become torchrun elastic agents (the
    pytorch framework's ``node`` role) between ``minReplicas`` and ``maxReplicas``, meeting at a
    c10d store the controller runs; ``maxRestarts`` is torchrun's. Only the c10d backend is run."""
    where = "spec.elasticPolicy"
    report.rest(
        policy,
        where,
        {"minReplicas", "maxReplicas", "maxRestarts", "rdzvBackend", "nProcPerNode"},
        _ELASTIC_NOTES,
    )
    replicas = report.mapping(spec.get("pytorchReplicaSpecs"), "spec.pytorchReplicaSpecs")
    refused = False
    if any(str(k).lower() == "master" for k in replicas):
        report.unsupported(
            "spec.pytorchReplicaSpecs.Master",
            "an elastic PyTorchJob runs Workers only (every agent is a peer at the rendezvous); remove the Master",
        )
        refused = True
    backend = policy.get("rdzvBackend", "c10d")
    if backend != "c10d":
        report.unsupported(join(where, "rdzvBackend"), f"{str(backend)[:40]!r}: only the c10d rendezvous runs here")
        refused = True
    if refused:
        return None
    worker = report.mapping(
        next((v for k, v in replicas.items() if str(k).lower() == "worker"), None), "spec.pytorchReplicaSpecs.Worker"
    )
    count = worker.get("replicas", 1)
    out: dict[str, Any] = {}
    for key in ("minReplicas", "maxReplicas", "maxRestarts"):
        if key in policy and report.count(policy[key], join(where, key)):
            out[key] = policy[key]
    out.setdefault("minReplicas", count if isinstance(count, int) else 1)
    out.setdefault("maxReplicas", max(out["minReplicas"], count if isinstance(count, int) else 1))
    if policy.get("nProcPerNode") is not None:
        report.approximate(join(where, "nProcPerNode"), "deprecated upstream: spec.nprocPerNode is read instead")
    return out
