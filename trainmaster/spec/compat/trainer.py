"""Kubeflow Trainer v2 (``trainer.kubeflow.org/v1alpha1``): a ``TrainJob`` with its runtime.

A ``TrainJob`` names a ``TrainingRuntime`` or ``ClusterTrainingRuntime`` (``spec.runtimeRef``):
a JobSet template (replicated jobs) with an ``mlPolicy``. The runtime comes from the files given
with the TrainJob, or from those installed with ``trainmaster runtime add``
(:class:`RuntimeDoc` either way). Both are read strictly, as the other Kubernetes kinds are
(:mod:`.ignored`): an unknown field is an error with a did-you-mean, a field with no local
meaning a note, a field that would change what runs and that we cannot honour a refusal, every
problem at once. The two schema generations are read: v2.1's ``podTemplateOverrides``,
``spec.labels``/``annotations`` and ``torch.numProcPerNode``/``elasticPolicy``, and master's
``runtimePatches``, ``activeDeadlineSeconds`` and ``torch.envInjection``.

What the result means, as the Trainer controller builds its JobSet:

* each replicated job becomes a role of the same name with ``replicas x parallelism``
  instances; the trainer's job (label ``trainjob-ancestor-step: trainer``, else ``node``) takes
  the TrainJob's ``trainer`` (image, command, args, env, numNodes, resourcesPerNode);
* ``dependsOn`` ``Ready`` / ``Complete`` become dependencies on ``Running`` / ``Succeeded``;
  the JobSet's ``successPolicy`` the job's status policy; its ``failurePolicy`` the roles'
  restart policy (:func:`_failure_policy`: what restarts is the failed replicated job, not the
  whole job, unless a rule says ``RestartJobSet``);
* ``mlPolicy.torch`` runs the ``pytorch`` framework's ``node`` role (torchrun's ``PET_*``,
  ``numProcPerNode``, ``elasticPolicy``); ``mlPolicy.mpi`` the ``mpi`` framework (the ``node``
  job is its rank hosts, the ``launcher`` its launcher, ``numProcPerNode`` the hostfile's slots);
  no ``mlPolicy`` the ``command`` framework with the roles as they are.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass
from typing import Any, Iterable

from trainmaster.errors import UserError
from trainmaster.spec.compat.ignored import Report, join
from trainmaster.spec.compat.meta import OBJECT_META_FIELDS, metadata
from trainmaster.spec.compat.pod import CONTAINER_FIELDS, POD_SPEC_FIELDS, from_template

GROUP = "trainer.kubeflow.org"
VERSION = "v1alpha1"
RUNTIME_KINDS = ("ClusterTrainingRuntime", "TrainingRuntime")
KINDS = ("TrainJob", *RUNTIME_KINDS)
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
TRAINER_JOB = "node"  # the trainer's replicated job when none carries the ancestor label

TRAINJOB_SPEC_FIELDS = {
    "runtimeRef",
    "trainer",
    "initializer",
    "runtimePatches",  # master (v2.2+)
    "activeDeadlineSeconds",  # master
    "podTemplateOverrides",  # v2.1
    "labels",  # v2.1
    "annotations",  # v2.1
    "suspend",
    "managedBy",
}
TRAINER_FIELDS = {"image", "command", "args", "env", "numNodes", "numProcPerNode", "resourcesPerNode"}
INITIALIZER_FIELDS = {"storageUri", "env", "secretRef"}
RUNTIME_SPEC_FIELDS = {"mlPolicy", "podGroupPolicy", "template"}
ML_POLICIES = ("torch", "mpi", "jax", "xgboost", "flux")
TORCH_FIELDS = {"numProcPerNode", "elasticPolicy", "envInjection"}
ELASTIC_FIELDS = {"minNodes", "maxNodes", "maxRestarts", "metrics"}
MPI_FIELDS = {"numProcPerNode", "mpiImplementation", "sshAuthMountPath", "runLauncherAsNode"}
JOBSET_FIELDS = {
    "replicatedJobs",
    "network",
    "successPolicy",
    "failurePolicy",
    "startupPolicy",
    "suspend",
    "coordinator",
    "managedBy",
    "ttlSecondsAfterFinished",
    "volumeClaimPolicies",
}
REPLICATED_JOB_FIELDS = {"name", "groupName", "template", "replicas", "dependsOn"}
JOB_SPEC_FIELDS = {
    "template",
    "parallelism",
    "completions",
    "backoffLimit",
    "backoffLimitPerIndex",
    "maxFailedIndexes",
    "completionMode",
    "activeDeadlineSeconds",
    "ttlSecondsAfterFinished",
    "podFailurePolicy",
    "successPolicy",
    "suspend",
    "manualSelector",
    "selector",
    "podReplacementPolicy",
    "managedBy",
}
FAILURE_ACTIONS = (
    "FailJobSet",
    "RestartJobSet",
    "RestartJobSetAndIgnoreMaxRestarts",
    "RestartJob",
    "RestartJobAndIgnoreMaxRestarts",
)
#: a failurePolicy rule's action -> the restart scope of the roles it targets ("Fail": none)
ACTION_SCOPES = {
    "FailJobSet": "Fail",
    "RestartJobSet": "Job",
    "RestartJobSetAndIgnoreMaxRestarts": "Job",
    "RestartJob": "Role",
    "RestartJobAndIgnoreMaxRestarts": "Role",
}
OVERRIDE_POD_FIELDS = {
    "serviceAccountName",
    "nodeSelector",
    "affinity",
    "tolerations",
    "volumes",
    "initContainers",
    "containers",
    "schedulingGates",
    "imagePullSecrets",
    "securityContext",
}
#: Kubernetes' default backoffLimit of a Job: how often a pod of a replicated job is recreated
JOB_BACKOFF_LIMIT = 6
_NOTES = {
    "managedBy": "the Trainmaster controller manages the job",
    "network": "instances find each other through TM_SERVICE_<ROLE> and the framework's variables, not DNS",
    "coordinator": "the framework's variables name rank 0 (MASTER_ADDR, the hostfile)",
    "volumeClaimPolicies": "no PersistentVolumeClaims locally; roles share files through their job folder",
    "groupName": "JobSet groups only label pods",
}


@dataclass(frozen=True)
class RuntimeDoc:
    """A runtime a TrainJob may name: the document, and where it came from (a file, the store)."""

    kind: str
    name: str
    document: dict[str, Any]
    source: str


def is_trainer(raw: dict[str, Any]) -> bool:
    return str(raw.get("apiVersion") or "").partition("/")[0] == GROUP


def is_runtime(raw: Any) -> bool:
    return isinstance(raw, dict) and is_trainer(raw) and raw.get("kind") in RUNTIME_KINDS


def runtime_doc(raw: dict[str, Any], source: str, lenient: bool = False) -> RuntimeDoc:
    """``raw`` read strictly as a runtime (every problem at once), with its kind and name."""
    kind = _check_head(raw)
    if kind not in RUNTIME_KINDS:
        raise UserError(f"{source}: a {kind} is not a runtime (expected {' or '.join(RUNTIME_KINDS)})")
    report = Report(f"{GROUP}/{VERSION} {kind}", lenient=lenient)
    name = _runtime_name(raw, report)
    _Runtime(raw, report, f"{kind}/{name}:").read()
    report.finish()
    return RuntimeDoc(kind=kind, name=name, document=raw, source=source)


def runtime_notes(raw: dict[str, Any], lenient: bool = False) -> list[str]:
    """What reading the runtime ``raw`` on its own notes (its cluster-only fields)."""
    kind = _check_head(raw)
    report = Report(f"{GROUP}/{VERSION} {kind}", lenient=lenient)
    name = _runtime_name(raw, report)
    _Runtime(raw, report, f"{kind}/{name}:").read()
    report.finish()
    return report.lines


def convert(
    raw: dict[str, Any], runtimes: Iterable[RuntimeDoc], lenient: bool = False
) -> tuple[dict[str, Any], list[str]]:
    """A ``TrainJob`` with the runtime it names, as a ``trainmaster/v1 Job`` and its notes."""
    kind = _check_head(raw)
    if kind != "TrainJob":
        raise UserError(
            f"{GROUP}/{VERSION} {kind} is a runtime, not a job",
            [
                "give it with the TrainJob that names it (`trainmaster run trainjob.yaml runtime.yaml`) "
                "or install it: `trainmaster runtime add FILE`"
            ],
        )
    report = Report(f"{GROUP}/{VERSION} TrainJob", lenient=lenient)
    report.rest(
        raw, "", {"apiVersion", "kind", "metadata", "spec"}, {"status": "status is filled in by the controller"}
    )
    spec = report.mapping(raw.get("spec"), "spec")
    report.rest(spec, "spec", TRAINJOB_SPEC_FIELDS, {})
    if "runtimePatches" in spec and "podTemplateOverrides" in spec:
        report.invalid(
            "spec.podTemplateOverrides",
            "v2.1's podTemplateOverrides and master's runtimePatches are two generations of the same "
            "field; use one (runtimePatches)",
        )
    runtime = _resolve(spec, list(runtimes), report)
    meta = metadata(raw.get("metadata"), f"{GROUP}/{VERSION} TrainJob", report)
    if runtime is None:
        report.finish()
        raise report.error("spec.runtimeRef", "no runtime")  # finish raised already when unresolved
    document = copy.deepcopy(runtime.document)
    rt_report_prefix = f"{runtime.kind}/{runtime.name}:"
    template = _patched_template(document, spec, report, rt_report_prefix)
    job_spec = _Runtime(document, report, rt_report_prefix).build(spec, template)
    for key, value in (("labels", spec.get("labels")), ("annotations", spec.get("annotations"))):
        values = report.mapping(value, f"spec.{key}")
        if values:
            meta.setdefault(key, {}).update({str(k): str(v) for k, v in values.items()})
    meta.setdefault("annotations", {})["trainer.kubeflow.org/runtime"] = (
        f"{runtime.kind}/{runtime.name} ({runtime.source})"
    )
    run_policy: dict[str, Any] = {}
    if spec.get("suspend") is not None:
        if isinstance(spec["suspend"], bool):
            run_policy["suspend"] = spec["suspend"]
        else:
            report.invalid("spec.suspend", "must be true or false")
    if spec.get("activeDeadlineSeconds") is not None:
        value = spec["activeDeadlineSeconds"]
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            run_policy["activeDeadlineSeconds"] = value
        else:
            report.invalid("spec.activeDeadlineSeconds", "must be an integer of at least 1 (seconds)")
    if run_policy:
        job_spec.setdefault("runPolicy", {}).update(run_policy)
    if spec.get("managedBy") not in (None, "trainer.kubeflow.org/trainjob-controller"):
        report.ignore("spec.managedBy", "the Trainmaster controller manages the job")
    report.finish()
    return {"apiVersion": "trainmaster/v1", "kind": "Job", "metadata": meta, "spec": job_spec}, report.lines


# ---- the head of a document, and the runtime reference ---------------------------------------


def _check_head(raw: dict[str, Any]) -> str:
    api_version, kind = raw.get("apiVersion"), raw.get("kind")
    group, _, version = str(api_version).partition("/")
    if kind not in KINDS:
        raise UserError(
            f"{api_version} {kind} is not supported",
            [f"kind: {GROUP} kinds read here: {', '.join(KINDS)}"],
        )
    if version != VERSION:
        why = " (a design proposal's version, never served by the Trainer's CRDs)" if version == "v2alpha1" else ""
        raise UserError(
            f"{api_version} {kind} is not supported",
            [f"apiVersion: {api_version!s} is not served{why}; Trainer v2 kinds are {GROUP}/{VERSION}"],
        )
    return str(kind)


def _runtime_name(raw: dict[str, Any], report: Report) -> str:
    meta = report.mapping(raw.get("metadata"), "metadata")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise report.error("metadata.name", "a runtime needs a name (TrainJobs name it in spec.runtimeRef.name)")
    return name


def _resolve(spec: dict[str, Any], runtimes: list[RuntimeDoc], report: Report) -> RuntimeDoc | None:
    ref = report.mapping(spec.get("runtimeRef"), "spec.runtimeRef")
    report.rest(ref, "spec.runtimeRef", {"name", "apiGroup", "kind"}, {})
    name, kind = ref.get("name"), ref.get("kind", "ClusterTrainingRuntime")
    group = ref.get("apiGroup", GROUP)
    if not isinstance(name, str) or not name:
        report.invalid("spec.runtimeRef.name", "required: the name of the TrainingRuntime or ClusterTrainingRuntime")
        return None
    if group != GROUP:
        report.invalid("spec.runtimeRef.apiGroup", f"must be {GROUP} (not {str(group)[:40]!r})")
        return None
    if kind not in RUNTIME_KINDS:
        report.invalid("spec.runtimeRef.kind", f"must be one of {', '.join(RUNTIME_KINDS)} (not {str(kind)[:40]!r})")
        return None
    candidates = [r for r in runtimes if r.name == name]
    for runtime in candidates:
        if runtime.kind == kind:
            return runtime
    other = (
        f"; a {candidates[0].kind} of that name is ({candidates[0].source}): set spec.runtimeRef.kind"
        if candidates
        else ""
    )
    if not candidates:
        known = {r.name.lower(): r.name for r in runtimes}
        close = difflib.get_close_matches(name.lower(), sorted(known), n=1, cutoff=0.8)
        other = f" (did you mean {known[close[0]]!r}? runtime names are case-sensitive)" if close else ""
    report.invalid(
        "spec.runtimeRef.name",
        f"no {kind} named {name!r} was given or is installed{other}; give its file after the TrainJob's "
        "(`trainmaster run trainjob.yaml runtime.yaml`) or install it (`trainmaster runtime add FILE`)",
    )
    return None


# ---- the TrainJob's changes to the runtime's template ----------------------------------------


def _patched_template(document: dict[str, Any], spec: dict[str, Any], report: Report, prefix: str) -> dict[str, Any]:
    """The runtime's JobSet template with the TrainJob's ``runtimePatches`` (master) or
    ``podTemplateOverrides`` (v2.1) merged in (containers, env and volumes by name, as a strategic
    merge does; other pod fields replaced)."""
    runtime_spec = report.mapping(document.get("spec"), prefix + "spec")
    template = report.mapping(runtime_spec.get("template"), prefix + "spec.template")
    jobset = report.mapping(template.get("spec"), prefix + "spec.template.spec")
    jobs = {
        str(j.get("name")): j
        for j in report.sequence(jobset.get("replicatedJobs"), prefix + "spec.template.spec.replicatedJobs")
        if isinstance(j, dict)
    }
    for i, patch in enumerate(report.sequence(spec.get("runtimePatches"), "spec.runtimePatches")):
        where = join("spec.runtimePatches", i)
        patch = report.mapping(patch, where)
        report.rest(patch, where, {"manager", "time", "trainingRuntimeSpec"}, {})
        if not isinstance(patch.get("manager"), str) or not patch.get("manager"):
            report.invalid(
                join(where, "manager"), "required: who owns this patch (e.g. trainer.kubeflow.org/kubeflow-sdk)"
            )
        rts = report.mapping(patch.get("trainingRuntimeSpec"), join(where, "trainingRuntimeSpec"))
        report.rest(rts, join(where, "trainingRuntimeSpec"), {"template"}, {})
        tpl_where = join(join(where, "trainingRuntimeSpec"), "template")
        tpl = report.mapping(rts.get("template"), tpl_where)
        report.rest(tpl, tpl_where, {"metadata", "spec"}, {})
        _note_metadata(tpl.get("metadata"), join(tpl_where, "metadata"), report, "JobSet")
        tspec = report.mapping(tpl.get("spec"), join(tpl_where, "spec"))
        report.rest(tspec, join(tpl_where, "spec"), {"replicatedJobs"}, {})
        for k, rjob in enumerate(
            report.sequence(tspec.get("replicatedJobs"), join(join(tpl_where, "spec"), "replicatedJobs"))
        ):
            rwhere = join(join(join(tpl_where, "spec"), "replicatedJobs"), k)
            rjob = report.mapping(rjob, rwhere)
            report.rest(rjob, rwhere, {"name", "template"}, {})
            target = jobs.get(str(rjob.get("name")))
            if target is None:
                report.invalid(
                    join(rwhere, "name"),
                    f"the runtime has no replicated job {rjob.get('name')!r} (it has {', '.join(jobs)})",
                )
                continue
            jt = report.mapping(rjob.get("template"), join(rwhere, "template"))
            report.rest(jt, join(rwhere, "template"), {"metadata", "spec"}, {})
            _note_metadata(jt.get("metadata"), join(join(rwhere, "template"), "metadata"), report, "Job")
            js = report.mapping(jt.get("spec"), join(join(rwhere, "template"), "spec"))
            report.rest(js, join(join(rwhere, "template"), "spec"), {"template"}, {})
            pt_where = join(join(join(rwhere, "template"), "spec"), "template")
            pt = report.mapping(js.get("template"), pt_where)
            report.rest(pt, pt_where, {"metadata", "spec"}, {})
            _note_metadata(pt.get("metadata"), join(pt_where, "metadata"), report, "pod")
            _merge_pod(target, report.mapping(pt.get("spec"), join(pt_where, "spec")), join(pt_where, "spec"), report)
    for i, override in enumerate(report.sequence(spec.get("podTemplateOverrides"), "spec.podTemplateOverrides")):
        where = join("spec.podTemplateOverrides", i)
        override = report.mapping(override, where)
        report.rest(override, where, {"targetJobs", "metadata", "spec"}, {})
        _note_metadata(override.get("metadata"), join(where, "metadata"), report, "pod")
        targets = report.sequence(override.get("targetJobs"), join(where, "targetJobs"))
        if not targets:
            report.invalid(join(where, "targetJobs"), "required: the replicated jobs this override applies to")
        for k, target_ref in enumerate(targets):
            twhere = join(join(where, "targetJobs"), k)
            target_ref = report.mapping(target_ref, twhere)
            report.rest(target_ref, twhere, {"name"}, {})
            target = jobs.get(str(target_ref.get("name")))
            if target is None:
                report.invalid(
                    join(twhere, "name"),
                    f"the runtime has no replicated job {target_ref.get('name')!r} (it has {', '.join(jobs)})",
                )
                continue
            _merge_pod(target, report.mapping(override.get("spec"), join(where, "spec")), join(where, "spec"), report)
    return template


def _note_metadata(value: Any, path: str, report: Report, what: str) -> None:
    meta = report.mapping(value, path)
    report.rest(meta, path, (), {}, OBJECT_META_FIELDS, f"{what} metadata has no meaning locally")


def _merge_pod(job: dict[str, Any], patch: dict[str, Any], path: str, report: Report) -> None:
    """Merge a pod spec patch into a replicated job's pod template spec."""
    for key in patch:
        if key in OVERRIDE_POD_FIELDS:
            continue
        if key in POD_SPEC_FIELDS:  # a pod field that upstream's webhook does not let a TrainJob patch
            report.invalid(
                join(path, key),
                f"a pod's {key} cannot be patched by a TrainJob (the fields that can: {', '.join(sorted(OVERRIDE_POD_FIELDS))})",
            )
        else:
            report.unknown(path, str(key), OVERRIDE_POD_FIELDS)
    pod: Any = job
    for key in ("template", "spec", "template", "spec"):
        child = pod.get(key)
        if child is None:
            child = pod[key] = {}
        if not isinstance(child, dict):
            report.invalid(path, f"the replicated job {job.get('name')!r} has no pod template to patch")
            return
        pod = child
    for key, value in patch.items():
        if key not in OVERRIDE_POD_FIELDS:
            continue
        if key in ("containers", "initContainers"):
            if not isinstance(pod.get(key), list):
                pod[key] = []
            have = {c.get("name"): c for c in pod[key] if isinstance(c, dict)}
            for i, container in enumerate(report.sequence(value, join(path, key))):
                cwhere = join(join(path, key), i)
                container = report.mapping(container, cwhere)
                for extra in container:
                    if extra in ("name", "env", "volumeMounts"):
                        continue
                    if extra in CONTAINER_FIELDS:
                        report.invalid(join(cwhere, extra), "only env and volumeMounts of a container can be patched")
                    else:
                        report.unknown(cwhere, str(extra), ("name", "env", "volumeMounts"))
                target = have.get(container.get("name"))
                if target is None:
                    report.ignore(
                        cwhere,
                        f"the replicated job {job.get('name')!r} has no {key[:-1]} {container.get('name')!r}; nothing to patch",
                    )
                    continue
                for field, name in (("env", "name"), ("volumeMounts", "mountPath")):
                    merged = _merged(target.get(field), container.get(field), name)
                    if merged is not None:
                        target[field] = merged
        elif key == "volumes":
            merged = _merged(pod.get("volumes"), value, "name")
            if merged is not None:
                pod["volumes"] = merged
        else:
            pod[key] = value


# ---- the runtime ---------------------------------------------------------------------------


class _Runtime:
    """One runtime document read (``read``) or built into a job with a TrainJob (``build``)."""

    def __init__(self, raw: dict[str, Any], report: Report, prefix: str):
        self.raw, self.report, self.prefix = raw, report, prefix

    def p(self, path: str) -> str:
        return self.prefix + path

    def read(self) -> dict[str, Any]:
        """Check the runtime's own fields; the JobSet template is read when a job is built."""
        r = self.report
        r.rest(self.raw, self.prefix.rstrip(":"), {"apiVersion", "kind", "metadata", "spec"}, {})
        meta = r.mapping(self.raw.get("metadata"), self.p("metadata"))
        r.rest(
            meta,
            self.p("metadata"),
            {"name", "labels", "annotations"},
            {"namespace": "there are no namespaces locally; runtimes are named globally"},
            OBJECT_META_FIELDS,
            "set by Kubernetes",
        )
        spec = r.mapping(self.raw.get("spec"), self.p("spec"))
        r.rest(spec, self.p("spec"), RUNTIME_SPEC_FIELDS, {})
        template = r.mapping(spec.get("template"), self.p("spec.template"))
        r.rest(template, self.p("spec.template"), {"metadata", "spec"}, {})
        _note_metadata(template.get("metadata"), self.p("spec.template.metadata"), r, "JobSet")
        jobset = r.mapping(template.get("spec"), self.p("spec.template.spec"))
        r.rest(jobset, self.p("spec.template.spec"), JOBSET_FIELDS, {})
        jobs = r.sequence(jobset.get("replicatedJobs"), self.p("spec.template.spec.replicatedJobs"))
        if not jobs:
            r.invalid(self.p("spec.template.spec.replicatedJobs"), "required: the replicated jobs the runtime runs")
        policy = r.mapping(spec.get("mlPolicy"), self.p("spec.mlPolicy"))
        r.rest(policy, self.p("spec.mlPolicy"), {"numNodes", *ML_POLICIES}, {})
        fields = {"torch": TORCH_FIELDS, "mpi": MPI_FIELDS, "flux": {"numProcPerNode"}, "jax": set(), "xgboost": set()}
        for key, known in fields.items():
            where = self.p(f"spec.mlPolicy.{key}")
            inner = r.mapping(policy.get(key), where)
            r.rest(inner, where, known, {})
            if key == "torch" and inner.get("elasticPolicy") is not None:
                elastic_where = join(where, "elasticPolicy")
                r.rest(r.mapping(inner["elasticPolicy"], elastic_where), elastic_where, ELASTIC_FIELDS, {})
        return spec

    def build(self, trainjob: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
        r = self.report
        spec = self.read()
        policy = r.mapping(spec.get("mlPolicy"), self.p("spec.mlPolicy"))
        chosen = [k for k in ML_POLICIES if k in policy]
        if len(chosen) > 1:
            r.invalid(
                self.p("spec.mlPolicy"), f"only one of {', '.join(ML_POLICIES)} may be set (not {', '.join(chosen)})"
            )
        framework_policy = chosen[0] if chosen else None
        for unsupported in ("jax", "xgboost", "flux"):
            if framework_policy == unsupported:
                r.unsupported(
                    self.p(f"spec.mlPolicy.{unsupported}"),
                    f"no {unsupported} framework runs here (JAX's, XGBoost's and Flux's distributed "
                    "variables are not provided); use a torch or mpi runtime, or a runtime with no mlPolicy "
                    "whose commands need no framework",
                )
        trainer = r.mapping(trainjob.get("trainer"), "spec.trainer")
        r.rest(trainer, "spec.trainer", TRAINER_FIELDS, {})
        jobset = r.mapping(template.get("spec"), self.p("spec.template.spec"))
        jobs = [j for j in r.sequence(jobset.get("replicatedJobs"), self.p("spec.template.spec.replicatedJobs"))]
        trainer_job = _trainer_job(jobs)
        num_nodes = _count(trainer.get("numNodes"), "spec.trainer.numNodes", r, minimum=1)
        if num_nodes is None:
            num_nodes = _count(policy.get("numNodes"), self.p("spec.mlPolicy.numNodes"), r, minimum=1)
        params: dict[str, Any] = {}
        framework = "command"
        if framework_policy == "torch":
            framework = "pytorch"
            params = self._torch(r.mapping(policy.get("torch"), self.p("spec.mlPolicy.torch")), trainer, num_nodes)
        elif framework_policy == "mpi":
            framework = "mpi"
            params = self._mpi(r.mapping(policy.get("mpi"), self.p("spec.mlPolicy.mpi")), trainer)
        roles: list[dict[str, Any]] = []
        names: list[str] = []
        for i, job in enumerate(jobs):
            where = self.p(join("spec.template.spec.replicatedJobs", i))
            job = r.mapping(job, where)
            role = self._role(
                job,
                where,
                trainer if job is trainer_job else None,
                num_nodes if (job.get("name") == "node" if framework == "mpi" else job is trainer_job) else None,
                framework,
            )
            if role is not None:
                roles.append(role)
                names.append(str(job.get("name")))
        self._initializer(trainjob.get("initializer"), roles)
        if framework == "mpi":
            for role in roles:
                if role["name"] == "node":
                    role["name"] = "worker"  # the mpi framework's rank hosts (sshd in the node pods)
                    role.pop("command", None)
                    role.pop("args", None)
                    role.pop("image", None)
                    role.pop("runtime", None)
                for dep in role.get("dependsOn", []):
                    if dep["role"] == "node":
                        dep["role"] = "worker"
            names = ["worker" if n == "node" else n for n in names]
            self.report.approximate(
                self.p("spec.template.spec.replicatedJobs[node]"),
                "the node job's sshd is Trainmaster's rank host (the role 'worker'), in which the launcher's mpirun starts ranks",
            )
        job_spec: dict[str, Any] = {"framework": framework, "roles": roles}
        if params:
            job_spec["frameworkParams"] = params
        status = self._success_policy(jobset, names)
        if status:
            job_spec["statusPolicy"] = status
        self._failure_policy(jobset, roles, names)
        self._startup_policy(jobset, roles, names)
        self._jobset_rest(jobset, job_spec)
        gang = r.mapping(spec.get("podGroupPolicy"), self.p("spec.podGroupPolicy"))
        r.rest(gang, self.p("spec.podGroupPolicy"), {"coscheduling", "volcano"}, {})
        if gang:
            for key, value in gang.items():
                inner = r.mapping(value, self.p(f"spec.podGroupPolicy.{key}"))
                reasons = {
                    "scheduleTimeoutSeconds": "a gang waits in the queue until it fits",
                    "networkTopology": "the local backend has no network topology",
                }
                r.rest(inner, self.p(f"spec.podGroupPolicy.{key}"), (), reasons)
            total = sum(_instances(role) for role in roles)
            job_spec["scheduling"] = {"minAvailable": max(1, total)}
        return job_spec

    # -- the ml policies --

    def _torch(self, torch: dict[str, Any], trainer: dict[str, Any], num_nodes: int | None) -> dict[str, Any]:
        r = self.report
        params: dict[str, Any] = {}
        nproc_path, nproc = "spec.trainer.numProcPerNode", trainer.get("numProcPerNode")
        if nproc is None:
            nproc_path, nproc = self.p("spec.mlPolicy.torch.numProcPerNode"), torch.get("numProcPerNode")
        if nproc is not None:
            value = _nproc(nproc, trainer, nproc_path, r)
            if value is not None:
                params["nprocPerNode"] = value
        injection = r.mapping(torch.get("envInjection"), self.p("spec.mlPolicy.torch.envInjection"))
        if injection:
            r.approximate(
                self.p("spec.mlPolicy.torch.envInjection"),
                "torchrun's PET_* variables are given to every instance of the trainer's role (node), not to chosen containers",
            )
        elastic = torch.get("elasticPolicy")
        if elastic is not None:
            where = self.p("spec.mlPolicy.torch.elasticPolicy")
            elastic = r.mapping(elastic, where)
            if "metrics" in elastic:
                r.ignore(
                    join(where, "metrics"),
                    "no autoscaler here: scale between minNodes and maxNodes with `trainmaster job scale JOB node N`",
                )
            low = _count(elastic.get("minNodes"), join(where, "minNodes"), r, minimum=1)
            high = _count(elastic.get("maxNodes"), join(where, "maxNodes"), r, minimum=1)
            restarts = _count(elastic.get("maxRestarts"), join(where, "maxRestarts"), r, minimum=0)
            nodes = num_nodes or 1
            low = low if low is not None else nodes
            high = high if high is not None else max(nodes, low)
            if low > high:
                r.invalid(join(where, "minNodes"), f"must not exceed maxNodes ({low} > {high})")
            params["elastic"] = {"minReplicas": low, "maxReplicas": high}
            if restarts is not None:
                params["elastic"]["maxRestarts"] = restarts
        return params

    def _mpi(self, mpi: dict[str, Any], trainer: dict[str, Any]) -> dict[str, Any]:
        r = self.report
        where = self.p("spec.mlPolicy.mpi")
        if "sshAuthMountPath" in mpi:
            r.ignore(
                join(where, "sshAuthMountPath"),
                "no SSH between instances locally: mpirun reaches the rank hosts through Trainmaster's remote-shell agent",
            )
        params: dict[str, Any] = {}
        nproc_path, nproc = "spec.trainer.numProcPerNode", trainer.get("numProcPerNode")
        if nproc is None:
            nproc_path, nproc = join(where, "numProcPerNode"), mpi.get("numProcPerNode")
        if nproc is not None:
            value = _count(nproc, nproc_path, r, minimum=1)
            if value is not None:
                params["slotsPerWorker"] = value
        implementation = mpi.get("mpiImplementation")
        if implementation is not None:
            if implementation in ("OpenMPI", "Intel", "MPICH"):
                params["mpiImplementation"] = implementation
            else:
                r.invalid(join(where, "mpiImplementation"), "must be one of OpenMPI, Intel, MPICH")
        if mpi.get("runLauncherAsNode"):
            r.approximate(
                join(where, "runLauncherAsNode"),
                "the launcher holds no ranks here: the node role runs numNodes rank hosts (upstream: numNodes - 1 "
                "node pods and the launcher), so the job runs the same numNodes x numProcPerNode ranks",
            )
        return params

    # -- the replicated jobs --

    def _role(
        self,
        job: dict[str, Any],
        where: str,
        trainer: dict[str, Any] | None,
        num_nodes: int | None,
        framework: str,
    ) -> dict[str, Any] | None:
        r = self.report
        r.rest(job, where, REPLICATED_JOB_FIELDS, {"groupName": _NOTES["groupName"]})
        name = job.get("name")
        if not isinstance(name, str) or not name:
            r.invalid(join(where, "name"), "required: the replicated job's name")
            return None
        replicas = _count(job.get("replicas", 1), join(where, "replicas"), r, minimum=0)
        jt_where = join(where, "template")
        jt = r.mapping(job.get("template"), jt_where)
        r.rest(jt, jt_where, {"metadata", "spec"}, {})
        jt_meta = r.mapping(jt.get("metadata"), join(jt_where, "metadata"))
        r.rest(jt_meta, join(jt_where, "metadata"), (), {}, OBJECT_META_FIELDS, "Job metadata has no meaning locally")
        js_where = join(jt_where, "spec")
        js = r.mapping(jt.get("spec"), js_where)
        refused = (
            "activeDeadlineSeconds",
            "podFailurePolicy",
            "successPolicy",
            "backoffLimitPerIndex",
            "maxFailedIndexes",
            "suspend",
        )
        for key in refused:
            if key in js:
                r.unsupported(
                    join(js_where, key),
                    "a per-Job policy that is not carried here; set it on the TrainJob or remove it",
                )
        r.rest(
            js,
            js_where,
            {"template", "parallelism", "completions", "backoffLimit", *refused},
            {
                "ttlSecondsAfterFinished": "a replicated job's pods are kept until the job is deleted",
                "podReplacementPolicy": "an instance is replaced once it has ended",
                "completionMode": "instances are indexed (TM_INDEX) as in Indexed mode",
                "manualSelector": "no pod selectors locally",
                "selector": "no pod selectors locally",
                "managedBy": _NOTES["managedBy"],
            },
            JOB_SPEC_FIELDS,
            "",
        )
        parallelism = _count(js.get("parallelism", 1), join(js_where, "parallelism"), r, minimum=0)
        completions = js.get("completions")
        if completions is not None and completions != js.get("parallelism", 1):
            r.approximate(
                join(js_where, "completions"), "each instance runs once to completion: completions follows parallelism"
            )
        pod_where = join(js_where, "template")
        pod_template = copy.deepcopy(r.mapping(js.get("template"), pod_where))
        container = "node" if trainer is not None else name
        if trainer is not None:
            self._apply_trainer(pod_template, trainer, container)
        pod = from_template(pod_template, pod_where, r, container)
        role: dict[str, Any] = {"name": name, **pod.role}
        count = num_nodes if num_nodes is not None else (replicas or 0) * (parallelism or 0)
        if count == 0:
            r.ignore(where, "a replicated job of no instances does not run")
            return None
        role["replicas"] = count
        backoff = js.get("backoffLimit", JOB_BACKOFF_LIMIT)
        policy = pod.restart_policy or "OnFailure"  # JobSet's default for its pods
        role["restartPolicy"] = {"policy": "OnFailure" if policy == "OnFailure" else "Never"}
        if _count(backoff, join(js_where, "backoffLimit"), r, minimum=0) is not None:
            role["restartPolicy"]["maxRestarts"] = min(int(backoff), 1000)
        deps = []
        for k, dep in enumerate(r.sequence(job.get("dependsOn"), join(where, "dependsOn"))):
            dwhere = join(join(where, "dependsOn"), k)
            dep = r.mapping(dep, dwhere)
            r.rest(dep, dwhere, {"name", "status"}, {})
            status = dep.get("status")
            if status not in ("Ready", "Complete"):
                r.invalid(join(dwhere, "status"), "must be Ready or Complete")
                continue
            deps.append({"role": str(dep.get("name")), "condition": "Running" if status == "Ready" else "Succeeded"})
        if deps:
            role["dependsOn"] = deps
        return role

    def _apply_trainer(self, pod_template: dict[str, Any], trainer: dict[str, Any], container_name: str) -> None:
        """The TrainJob's ``trainer`` onto the trainer job's main container (``node``)."""
        r = self.report
        pod = pod_template.setdefault("spec", {})
        if not isinstance(pod, dict) or not isinstance(pod.get("containers", []), list):
            return  # not a pod: the pod reader reports it at its path
        containers = pod.setdefault("containers", [])
        target = next((c for c in containers if isinstance(c, dict) and c.get("name") == container_name), None)
        if target is None:
            target = containers[0] if containers and isinstance(containers[0], dict) else None
        if target is None:
            target = {"name": container_name}
            containers.append(target)
        for key in ("image", "command", "args"):
            if trainer.get(key) is not None:
                value = trainer[key]
                if key != "image" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                    r.invalid(f"spec.trainer.{key}", "must be a list of strings")
                    continue
                target[key] = value
                if key == "command" and trainer.get("args") is None:
                    target.pop("args", None)  # Kubernetes: a new command drops the image's CMD, not the runtime's args
        env = _merged(target.get("env"), r.sequence(trainer.get("env"), "spec.trainer.env"), "name")
        if env is not None:
            target["env"] = env
        if trainer.get("resourcesPerNode") is not None:
            target["resources"] = r.mapping(trainer["resourcesPerNode"], "spec.trainer.resourcesPerNode")

    def _initializer(self, value: Any, roles: list[dict[str, Any]]) -> None:
        """``spec.initializer``: the dataset/model initializers' ``STORAGE_URI`` and env."""
        r = self.report
        init = r.mapping(value, "spec.initializer")
        r.rest(init, "spec.initializer", {"dataset", "model"}, {})
        for key in ("dataset", "model"):
            if init.get(key) is None:
                continue
            where = f"spec.initializer.{key}"
            part = r.mapping(init[key], where)
            r.rest(
                part,
                where,
                {"storageUri", "env"},
                {"secretRef": "Secrets do not exist locally; give the credentials under env"},
            )
            role = next((x for x in roles if x["name"] == f"{key}-initializer"), None)
            if role is None:
                r.unsupported(
                    where,
                    f"the runtime has no {key}-initializer job to run it; name a runtime that has one, or remove it",
                )
                continue
            env = role.setdefault("env", {})
            if part.get("storageUri") is not None:
                env["STORAGE_URI"] = str(part["storageUri"])
            for i, entry in enumerate(r.sequence(part.get("env"), join(where, "env"))):
                entry = r.mapping(entry, join(join(where, "env"), i))
                if isinstance(entry.get("value"), str) and isinstance(entry.get("name"), str):
                    env[entry["name"]] = entry["value"]
                else:
                    r.unsupported(join(join(where, "env"), i), "only env entries with a value are carried here")

    # -- the JobSet's policies --

    def _success_policy(self, jobset: dict[str, Any], names: list[str]) -> dict[str, Any] | None:
        r = self.report
        where = self.p("spec.template.spec.successPolicy")
        policy = r.mapping(jobset.get("successPolicy"), where)
        if not policy:
            return {"failed": "any", "succeeded": "all"}  # JobSet: every replicated job completes
        r.rest(policy, where, {"operator", "targetReplicatedJobs"}, {})
        targets = [str(t) for t in r.sequence(policy.get("targetReplicatedJobs"), join(where, "targetReplicatedJobs"))]
        targets = ["worker" if t == "node" and "worker" in names else t for t in targets] or names
        missing = [t for t in targets if t not in names]
        if missing:
            r.invalid(join(where, "targetReplicatedJobs"), f"no replicated job named {', '.join(missing)}")
            return None
        operator = policy.get("operator", "All")
        if operator == "All":
            return {"failed": "any", "succeeded": {"roles": targets}}
        if operator == "Any":
            if len(targets) > 1:
                r.approximate(
                    join(where, "operator"),
                    "Any over several replicated jobs: the job succeeds when any instance of them does",
                )
            return (
                {"failed": "any", "succeeded": {"roles": targets}}
                if len(targets) == 1
                else {"failed": "any", "succeeded": {"instances": 1}}
            )
        r.invalid(join(where, "operator"), "must be All or Any")
        return None

    def _failure_policy(self, jobset: dict[str, Any], roles: list[dict[str, Any]], names: list[str]) -> None:
        """JobSet's ``failurePolicy``. Without one, a failed pod of a replicated job is recreated
        by its Job, up to ``backoffLimit``: here the instance alone restarts (the role's restart
        policy, scope Instance), nothing else. With one, a failed replicated job is handled by the
        first rule that targets it, else by JobSet's default, ``RestartJobSet``: ``RestartJob``
        restarts only that replicated job (our scope Role: JobSet #1129), ``RestartJobSet`` every
        role (scope Job), ``FailJobSet`` none, each up to ``maxRestarts``."""
        r = self.report
        where = self.p("spec.template.spec.failurePolicy")
        policy = r.mapping(jobset.get("failurePolicy"), where)
        if not policy:
            return
        r.rest(policy, where, {"maxRestarts", "restartStrategy", "rules"}, {})
        max_restarts = _count(policy.get("maxRestarts", 0), join(where, "maxRestarts"), r, minimum=0) or 0
        strategy = policy.get("restartStrategy", "Recreate")
        if strategy not in ("Recreate", "BlockingRecreate", "InPlaceRestart"):
            r.invalid(join(where, "restartStrategy"), "must be Recreate, BlockingRecreate or InPlaceRestart")
        elif strategy != "Recreate":
            r.approximate(
                join(where, "restartStrategy"), f"{strategy}: the instances restarting are stopped, then started afresh"
            )
        scope_of: dict[str, str] = {}
        unlimited: set[str] = set()
        for i, rule in enumerate(r.sequence(policy.get("rules"), join(where, "rules"))):
            rwhere = join(join(where, "rules"), i)
            rule = r.mapping(rule, rwhere)
            r.rest(
                rule,
                rwhere,
                {"name", "action", "targetReplicatedJobs", "onJobFailureReasons"},
                {
                    "onJobFailureMessagePatterns": "failure messages are Kubernetes Job messages; "
                    "the rule applies to any failure"
                },
            )
            action = rule.get("action")
            if not isinstance(action, str) or action not in ACTION_SCOPES:
                r.invalid(join(rwhere, "action"), f"must be one of {', '.join(FAILURE_ACTIONS)}")
                continue
            if rule.get("onJobFailureReasons"):
                r.approximate(
                    join(rwhere, "onJobFailureReasons"),
                    "the rule applies to every failure of its replicated jobs (a local instance fails one way)",
                )
            targets = [
                str(t) for t in r.sequence(rule.get("targetReplicatedJobs"), join(rwhere, "targetReplicatedJobs"))
            ] or names
            for target in targets:
                target = "worker" if target == "node" and "worker" in names else target
                if target not in names:
                    r.invalid(join(rwhere, "targetReplicatedJobs"), f"no replicated job named {target}")
                elif target not in scope_of:  # the first rule that matches wins
                    scope_of[target] = ACTION_SCOPES[str(action)]
                    if str(action).endswith("IgnoreMaxRestarts"):
                        unlimited.add(target)
        for role in roles:
            scope = scope_of.get(role["name"], "Job")  # JobSet's default action: RestartJobSet
            if scope == "Fail":
                role["restartPolicy"] = {"policy": "Never"}
                continue
            limit = 1000 if role["name"] in unlimited else max_restarts
            if limit:
                role["restartPolicy"] = {"policy": "OnFailure", "scope": scope, "maxRestarts": limit}
        if max_restarts and any(scope_of.get(n, "Job") != "Fail" for n in names):
            r.approximate(
                where,
                "a failed instance restarts its replicated job (RestartJob) or every role (RestartJobSet) at once; "
                "its pod is not first recreated up to its Job's backoffLimit",
            )

    def _startup_policy(self, jobset: dict[str, Any], roles: list[dict[str, Any]], names: list[str]) -> None:
        where = self.p("spec.template.spec.startupPolicy")
        policy = self.report.mapping(jobset.get("startupPolicy"), where)
        self.report.rest(policy, where, {"startupPolicyOrder"}, {})
        order = policy.get("startupPolicyOrder", "AnyOrder")
        if order == "InOrder":  # each replicated job starts once the previous one is ready
            for before, role in zip(roles, roles[1:]):
                deps = role.setdefault("dependsOn", [])
                if not any(d["role"] == before["name"] for d in deps):
                    deps.append({"role": before["name"]})
        elif order != "AnyOrder":
            self.report.invalid(join(where, "startupPolicyOrder"), "must be AnyOrder or InOrder")

    def _jobset_rest(self, jobset: dict[str, Any], job_spec: dict[str, Any]) -> None:
        r = self.report
        base = self.p("spec.template.spec")
        for key in ("network", "coordinator", "managedBy", "volumeClaimPolicies"):
            if key in jobset:
                r.ignore(join(base, key), _NOTES[key])
        if jobset.get("suspend"):
            job_spec.setdefault("runPolicy", {})["suspend"] = True
        ttl = jobset.get("ttlSecondsAfterFinished")
        if ttl is not None and r.count(ttl, join(base, "ttlSecondsAfterFinished")):
            job_spec.setdefault("runPolicy", {})["ttlSecondsAfterFinished"] = ttl


def _merged(base: Any, patch: Any, key: str) -> list[Any] | None:
    """``base`` with ``patch``'s entries replacing those of the same ``key`` (a strategic
    merge of a list of named entries); None, leaving ``base`` as it is, when either is not a list
    (the pod reader reports it) or there is nothing to merge."""
    base = [] if base is None else base
    if not isinstance(base, list) or not isinstance(patch, list) or not patch:
        return None

    def name(entry: Any) -> str:
        return repr(entry.get(key)) if isinstance(entry, dict) else repr(entry)

    merged = {name(entry): entry for entry in base}
    for entry in patch:
        merged[name(entry)] = entry
    return list(merged.values())


def _trainer_job(jobs: list[Any]) -> dict[str, Any] | None:
    for job in jobs:
        if isinstance(job, dict):
            template = job.get("template")
            meta = template.get("metadata") if isinstance(template, dict) else None
            labels = meta.get("labels") if isinstance(meta, dict) else None
            if isinstance(labels, dict) and labels.get(ANCESTOR_LABEL) == "trainer":
                return job
    return next((j for j in jobs if isinstance(j, dict) and j.get("name") == TRAINER_JOB), None)


def _instances(role: dict[str, Any]) -> int:
    value = role.get("replicas", 1)
    return value if isinstance(value, int) else 1


def _count(value: Any, path: str, report: Report, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= 2**31 - 1:
        return value
    report.invalid(path, f"{str(value)[:40]!r} must be an integer of at least {minimum}")
    return None


def _nproc(value: Any, trainer: dict[str, Any], path: str, report: Report) -> int | None:
    """torch ``numProcPerNode``: a number, or v2.1's ``auto``/``cpu``/``gpu`` (the GPUs in
    ``resourcesPerNode``, else one process: this machine's processes are CPU ones)."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 1024:
        return value
    if value in ("auto", "cpu", "gpu"):
        resources = trainer.get("resourcesPerNode")
        gpus = 0
        for part in ("limits", "requests"):
            section = resources.get(part) if isinstance(resources, dict) else None
            for name in ("nvidia.com/gpu", "amd.com/gpu"):
                if isinstance(section, dict) and isinstance(section.get(name), int):
                    gpus = max(gpus, section[name])
        per_gpu = bool(gpus) and value != "cpu"
        chosen = gpus if per_gpu else 1
        report.approximate(
            path,
            f"{value!r}: {chosen} process(es) per node ({'one per GPU requested' if per_gpu else 'one CPU process'})",
        )
        return chosen
    report.invalid(path, f"{str(value)[:40]!r} must be a number of processes (1-1024) or auto, cpu, gpu")
    return None
