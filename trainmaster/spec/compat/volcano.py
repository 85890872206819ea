"""Volcano ``batch.volcano.sh/v1alpha1 Job`` as our job.

Tasks become roles (same names), ``task.dependsOn`` becomes ``dependsOn`` (condition Running),
the job's ``minAvailable``/``queue``/``priorityClassName`` become ``scheduling``, ``maxRetry``
becomes ``maxRestarts`` and the lifecycle ``policies`` (event -> action) become restart and
status policies where they have a local meaning. Volcano keeps a job running until its pods
end; our status policies decide as soon as the outcome is known, which is the same outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainmaster.errors import UserError
from trainmaster.spec.compat import kueue
from trainmaster.spec.compat.ignored import Report, join
from trainmaster.spec.compat.meta import metadata
from trainmaster.spec.compat.pod import from_template

API_VERSION = "batch.volcano.sh/v1alpha1"

_SPEC_REASONS = {
    "schedulerName": "the Trainmaster controller schedules instances (gang size, queue and priority carry over)",
    "volumes": "volumes are not created or mounted locally",
    "runningEstimate": "no backfill scheduling locally",
    "networkTopology": "all instances run on this machine",
}
_TASK_REASONS = {
    "topologyPolicy": "no NUMA/topology placement locally",
    "partitionPolicy": "no network-topology partitions locally",
}
_PLUGIN_REASONS = {
    "ssh": "no SSH between local instances (none is needed: they share this machine)",
}
#: Plugins whose variables and files jobs read; not provided yet, so refused rather than ignored.
_PLUGINS_UNSUPPORTED = {
    "mpi": "the mpi plugin's hostfile is not written; use a Kubeflow MPIJob or the mpi framework",
}
SPEC_FIELDS = {
    "schedulerName",
    "minAvailable",
    "volumes",
    "tasks",
    "policies",
    "plugins",
    "runningEstimate",
    "queue",
    "maxRetry",
    "ttlSecondsAfterFinished",
    "priorityClassName",
    "minSuccess",
    "networkTopology",
}
TASK_FIELDS = {
    "name",
    "replicas",
    "template",
    "policies",
    "topologyPolicy",
    "minAvailable",
    "maxRetry",
    "dependsOn",
    "partitionPolicy",
}
#: Volcano's lifecycle events and actions (pkg/apis/bus/v1alpha1), for its own admission checks.
EVENTS = {
    "*",
    "PodFailed",
    "PodEvicted",
    "PodPending",
    "PodRunning",
    "Unknown",
    "TaskCompleted",
    "TaskFailed",
    "OutOfSync",
    "CommandIssued",
    "JobUpdated",
}
ACTIONS = {
    "AbortJob",
    "RestartJob",
    "RestartTask",
    "RestartPod",
    "RestartPartition",
    "TerminateJob",
    "CompleteJob",
    "ResumeJob",
    "SyncJob",
    "EnqueueJob",
    "SyncQueue",
    "OpenQueue",
    "CloseQueue",
}
_FAILURE_EVENTS = {"PodFailed", "TaskFailed"}
_RESTART_ACTIONS = {"RestartPod": "Instance", "RestartTask": "Role", "RestartJob": "Job"}
_FAIL_ACTIONS = {"AbortJob", "TerminateJob"}


@dataclass
class _Effects:
    """What a list of lifecycle policies means for one role (or, at job level, every role)."""

    restart: bool = False  # restart failed instances
    scope: str = "Instance"  # what a restart restarts: RestartPod, RestartTask, RestartJob
    event_restart: bool = False  # a PodFailed/TaskFailed policy restarts (whatever the exit code)
    exit_codes: list[int] = field(default_factory=list)  # exitCode policies that restart
    abort_codes: list[int] = field(default_factory=list)  # exitCode policies that end the job
    decides_failure: bool = False  # some policy handles a failure event
    completes_job: bool = False  # TaskCompleted -> CompleteJob


def convert(raw: dict[str, Any], lenient: bool = False) -> tuple[dict[str, Any], list[str]]:
    """``raw`` (a batch.volcano.sh document) as a ``trainmaster/v1 Job`` and the ignored fields."""
    source = f"{raw.get('apiVersion')} {raw.get('kind')}"
    if raw.get("apiVersion") != API_VERSION or raw.get("kind") != "Job":
        raise UserError(f"{source} is not supported", [f"the supported Volcano kind is Job ({API_VERSION})"])
    report = Report(source, lenient=lenient)
    report.rest(
        raw, "", {"apiVersion", "kind", "metadata", "spec"}, {"status": "status is filled in by the controller"}
    )
    spec = report.mapping(raw.get("spec"), "spec")
    handled = {
        "tasks",
        "minAvailable",
        "queue",
        "priorityClassName",
        "maxRetry",
        "minSuccess",
        "policies",
        "plugins",
        "ttlSecondsAfterFinished",
    }
    report.rest(spec, "spec", handled, _SPEC_REASONS, SPEC_FIELDS)
    if "maxRetry" in spec:
        report.count(spec["maxRetry"], "spec.maxRetry")
    job_effects = _policies(spec.get("policies"), "spec.policies", report)
    tasks = report.sequence(spec.get("tasks"), "spec.tasks")
    roles = [_role(task, join("spec.tasks", i), spec, job_effects, report) for i, task in enumerate(tasks)]
    framework, params = _framework(spec, roles, report)
    job_spec: dict[str, Any] = {"framework": framework, "roles": roles}
    if params:
        job_spec["frameworkParams"] = params
    status_policy = _job_status_policy(spec, tasks, roles, job_effects, report)
    if status_policy:
        job_spec["statusPolicy"] = status_policy
    scheduling = _scheduling(spec, tasks, report)
    if spec.get("ttlSecondsAfterFinished") is not None:  # the same meaning: delete the ended job
        job_spec["runPolicy"] = {"ttlSecondsAfterFinished": spec["ttlSecondsAfterFinished"]}
    _volcano_checks(spec, tasks, report)
    pod_priorities = [
        (f"spec.tasks[{i}].template.spec.priorityClassName", t["template"]["spec"]["priorityClassName"])
        for i, t in enumerate(tasks)
        if isinstance(t, dict)
        and isinstance(t.get("template"), dict)
        and isinstance(t["template"].get("spec"), dict)
        and "priorityClassName" in t["template"]["spec"]
    ]
    kueue.apply(raw.get("metadata"), scheduling, "spec.priorityClassName", pod_priorities, report)
    if scheduling:
        job_spec["scheduling"] = scheduling
    meta = metadata(raw.get("metadata"), source, report)
    report.finish()
    return {"apiVersion": "trainmaster/v1", "kind": "Job", "metadata": meta, "spec": job_spec}, report.lines


def _role(task: Any, path: str, spec: dict[str, Any], job_effects: _Effects, report: Report) -> dict[str, Any]:
    task = report.mapping(task, path)
    handled = {"name", "replicas", "minAvailable", "template", "policies", "maxRetry", "dependsOn"}
    report.rest(task, path, handled, _TASK_REASONS, TASK_FIELDS)
    pod = from_template(task.get("template"), join(path, "template"), report)
    replicas = task.get("replicas", 1)
    role: dict[str, Any] = {"name": task.get("name"), "replicas": replicas, **pod.role}
    effects = _policies(task.get("policies"), join(path, "policies"), report)
    policy = {"Always": "Always", "OnFailure": "OnFailure"}.get(pod.restart_policy or "", "Never")
    if pod.restart_policy not in (None, "Always", "OnFailure", "Never"):
        policy = pod.restart_policy  # validation reports it with this role's path
    chosen = effects if effects.restart else job_effects if not effects.decides_failure else None
    if policy == "Never" and chosen is not None and chosen.restart:
        policy = "OnFailure"
    restart: dict[str, Any] = {"policy": policy}
    if chosen is not None and chosen.restart and chosen.scope != "Instance":
        restart["scope"] = chosen.scope
    if chosen is not None and chosen.restart and chosen.exit_codes and not chosen.event_restart:
        restart["exitCodes"] = sorted(set(chosen.exit_codes))  # only those failures restart
    if "maxRetry" in task:  # the job's (checked once, by its own path) unless the task has its own
        max_retry = task["maxRetry"] if report.count(task["maxRetry"], join(path, "maxRetry")) else None
    else:
        max_retry = spec.get("maxRetry") if _is_count(spec.get("maxRetry")) else None
    if max_retry is not None:
        restart["maxRestarts"] = max_retry
    role["restartPolicy"] = restart
    min_available = task.get("minAvailable")
    if isinstance(min_available, int) and isinstance(replicas, int) and 0 < min_available < replicas:
        # The task succeeds with minAvailable successes and fails once it can no longer get them.
        role["statusPolicy"] = {"failed": replicas - min_available + 1, "succeeded": min_available}
        report.approximate(
            join(path, "minAvailable"),
            "the gang is counted over the whole job "
            "(spec.scheduling.minAvailable); the role succeeds once "
            f"{min_available} of its {replicas} instances succeeded",
        )
    tasks = spec.get("tasks")
    known = [t["name"] for t in tasks or [] if isinstance(t, dict) and isinstance(t.get("name"), str)]
    depends = _depends_on(task.get("dependsOn"), join(path, "dependsOn"), report, known)
    if depends:
        role["dependsOn"] = depends
    return role


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _depends_on(value: Any, path: str, report: Report, tasks: list[str]) -> list[dict[str, Any]]:
    depends = report.mapping(value, path)
    report.rest(depends, path, {"name", "iteration"}, {})
    names = depends.get("name")
    single = isinstance(names, str)
    names = [names] if single else report.sequence(names, join(path, "name"))
    for i, name in enumerate(names):
        where = join(path, "name") if single else join(join(path, "name"), i)
        if not isinstance(name, str):
            report.invalid(where, f"must be a task name, not {type(name).__name__}")
        elif name not in tasks:
            report.invalid(where, f"{name[:63]!r} is not a task of this job (tasks: {', '.join(tasks) or 'none'})")
    names = [name for name in names if isinstance(name, str) and name in tasks]
    if depends.get("iteration") == "any" and len(names) > 1:
        report.approximate(
            join(path, "iteration"), f"the role waits for all of {', '.join(map(str, names))}, not for any one of them"
        )
    return [{"role": name} for name in names]


def _policies(value: Any, path: str, report: Report) -> _Effects:
    effects = _Effects()
    seen: set[str] = set()
    for i, policy in enumerate(report.sequence(value, path)):
        where = join(path, i)
        policy = report.mapping(policy, where)
        report.rest(policy, where, {"event", "events", "action", "exitCode", "timeout"}, {})
        action = policy.get("action")
        if not isinstance(action, str) or action not in ACTIONS:
            report.invalid(
                join(where, "action"),
                f"{str(action)[:40]!r} is not a Volcano action (one of {', '.join(sorted(ACTIONS))})",
            )
        if "exitCode" in policy:
            if "event" in policy or "events" in policy:
                report.invalid(where, "give either event(s) or exitCode, not both (Volcano refuses both)")
            _exit_code_effect(policy["exitCode"], str(action), join(where, "exitCode"), effects, report)
            continue
        if "timeout" in policy:
            report.ignore(join(where, "timeout"), "actions are taken at once")
        events = [policy["event"]] if "event" in policy else []
        events += report.sequence(policy.get("events"), join(where, "events"))
        if not events:
            report.invalid(where, "a policy needs an event, events or an exitCode")
        for event in events:
            if not isinstance(event, str) or event not in EVENTS:
                report.invalid(
                    where, f"{str(event)[:40]!r} is not a Volcano event (one of {', '.join(sorted(EVENTS))})"
                )
            elif event in seen:
                report.invalid(where, f"duplicate event {event!r} in policies (Volcano refuses it)")
            else:
                seen.add(event)
                _effect(event, str(action), where, effects, report)
    return effects


def _exit_code_effect(code: Any, action: str, where: str, effects: _Effects, report: Report) -> None:
    """``exitCode: N`` policies: a restart action restarts only failures with those codes
    (``restartPolicy.exitCodes``); AbortJob/TerminateJob end the job on them, which is what a
    failure that is not restarted does, unless an event policy restarts every failure."""
    if not isinstance(code, int) or isinstance(code, bool) or not 1 <= code <= 255:
        report.invalid(where, f"{str(code)[:20]!r}: an exit code from 1 to 255 (Volcano refuses 0)")
    elif action in _RESTART_ACTIONS:
        if effects.restart and effects.scope != _RESTART_ACTIONS[action]:
            report.unsupported(
                where,
                f"exitCode {code} -> {action} beside a policy that restarts a "
                f"different scope ({effects.scope}): one restart scope per task here",
            )
        effects.restart = effects.decides_failure = True
        effects.scope = _RESTART_ACTIONS[action]
        effects.exit_codes.append(code)
    elif action in _FAIL_ACTIONS:
        effects.decides_failure = True
        effects.abort_codes.append(code)
    else:
        report.unsupported(where, f"exitCode {code} -> {action} is not run here")
    if effects.abort_codes and effects.event_restart:
        report.unsupported(
            where,
            "an exitCode policy that ends the job beside an event policy that "
            "restarts every failure is not run here (restarts exclude no exit code)",
        )


def _effect(event: str, action: str, where: str, effects: _Effects, report: Report) -> None:
    if event in _FAILURE_EVENTS and action in _RESTART_ACTIONS:
        # RestartPod: the instance; RestartTask: every instance of the role; RestartJob: of the job
        if effects.restart and effects.scope != _RESTART_ACTIONS[action]:
            report.unsupported(
                where,
                f"{event} -> {action} beside a policy that restarts a "
                f"different scope ({effects.scope}): one restart scope per task here",
            )
        effects.restart = effects.decides_failure = effects.event_restart = True
        effects.scope = _RESTART_ACTIONS[action]
        if effects.abort_codes:
            report.unsupported(
                where,
                "an event policy that restarts every failure beside an exitCode "
                "policy that ends the job is not run here (restarts exclude no exit code)",
            )
    elif event in _FAILURE_EVENTS and action in _FAIL_ACTIONS:
        effects.decides_failure = True  # a failure fails the role and the job: our default
    elif event == "TaskCompleted" and action == "CompleteJob":
        effects.completes_job = True
    elif event == "PodEvicted":
        report.ignore(where, f"{event} -> {action}: instances are never evicted locally")
    else:
        report.unsupported(where, f"{event} -> {action} is not run here yet")


def _framework(spec: dict[str, Any], roles: list[dict[str, Any]], report: Report) -> tuple[str, dict[str, Any]]:
    """The framework and its parameters that carry the job's plugins: ``pytorch`` (the plugin's
    variables), ``command`` with ``indexVariables`` (the ``env`` plugin's ``VK_TASK_INDEX`` and
    ``VC_TASK_INDEX``: the instance's index in its task)."""
    plugins = report.mapping(spec.get("plugins"), "spec.plugins")
    framework, params = "command", dict[str, Any]()
    if "env" in plugins and not ("pytorch" in plugins and _role_names(roles) <= {"master", "worker"}):
        params["indexVariables"] = ["VK_TASK_INDEX", "VC_TASK_INDEX"]
    for name in plugins:
        where = join("spec.plugins", name)
        if name == "env":
            if "indexVariables" not in params and not report.lenient:
                report.unsupported(
                    where,
                    "the env plugin's VK_TASK_INDEX/VC_TASK_INDEX are not set "
                    "together with the pytorch plugin; use RANK (or --lenient)",
                )
            elif "indexVariables" not in params:
                report.ignore(where, "VK_TASK_INDEX/VC_TASK_INDEX not set (the index is in TM_REPLICA_INDEX)")
        elif name == "pytorch" and _role_names(roles) <= {"master", "worker"}:
            framework = "pytorch"  # the plugin's MASTER_ADDR/RANK come from our framework
            report.approximate(
                where,
                "run by the pytorch framework (MASTER_ADDR, MASTER_PORT, "
                "WORLD_SIZE, RANK); the plugin's arguments are not read",
            )
        elif name == "svc":
            params["volcanoSvc"] = True
            _every_task_placed(roles)
            report.approximate(
                where,
                "VC_<TASK>_HOSTS, VC_<TASK>_NUM and the <task>.host files (at /etc/volcano "
                "in a container, as upstream; on the host in the folder VC_HOSTS_DIR names) list "
                "host:port addresses (each instance has its own port here), not DNS names",
            )
        elif name in _PLUGINS_UNSUPPORTED and not report.lenient:
            report.unsupported(where, _PLUGINS_UNSUPPORTED[name] + "; pass --lenient to run without it")
        elif name in _PLUGIN_REASONS or name in _PLUGINS_UNSUPPORTED:
            report.ignore(where, _PLUGIN_REASONS.get(name) or _PLUGINS_UNSUPPORTED[name])
        else:
            report.unknown("spec.plugins", str(name), {"ssh", "svc", "env", "mpi", "pytorch"})
    if framework == "pytorch" and params.pop("volcanoSvc", False):
        report.unsupported(
            "spec.plugins.svc",
            "not run together with the pytorch plugin (the pytorch "
            "framework sets MASTER_ADDR and RANK; the svc plugin's variables are not set)",
        )
    return framework, params


def _role_names(roles: list[dict[str, Any]]) -> set[str]:
    """The roles' names that are text (a task named by anything else is refused by validation)."""
    return {r["name"] for r in roles if isinstance(r.get("name"), str)}


def _every_task_placed(roles: list[dict[str, Any]]) -> None:
    """The svc plugin gives every pod every task's hosts: each role waits until every instance of
    every task is placed (its own task included; a task it already waits for as Running is left)."""
    names = [r["name"] for r in roles if isinstance(r.get("name"), str)]
    for role in roles:
        waited = {d["role"] for d in role.get("dependsOn", [])}
        role["dependsOn"] = [
            *role.get("dependsOn", []),
            *({"role": n, "condition": "Placed"} for n in names if n not in waited),
        ]


def _job_status_policy(
    spec: dict[str, Any], tasks: list[Any], roles: list[dict[str, Any]], job_effects: _Effects, report: Report
) -> dict[str, Any] | None:
    completing = [r["name"] for r, t in zip(roles, tasks) if _policies_complete(t)]
    if completing:
        if len(completing) > 1:
            names = ", ".join(map(str, completing))
            report.approximate(
                "spec.tasks",
                f"TaskCompleted -> CompleteJob on {names}: the job succeeds when all of them succeeded, not any one",
            )
        if "minSuccess" in spec:
            report.ignore("spec.minSuccess", "the TaskCompleted -> CompleteJob policy decides success")
        return {"failed": "any", "succeeded": {"roles": completing}}
    if job_effects.completes_job:
        return {"failed": "any", "succeeded": "any"}
    min_success = spec.get("minSuccess")
    if min_success is None:
        return None
    replicas = [r.get("replicas") for r in roles]
    policy: dict[str, Any] = {"succeeded": {"instances": min_success}}
    if isinstance(min_success, int) and all(isinstance(n, int) for n in replicas):
        # Fail once too many instances failed for minSuccess to be reachable.
        policy["failed"] = {"instances": max(1, sum(n for n in replicas if isinstance(n, int)) - min_success + 1)}
        for role in roles:
            role.setdefault("statusPolicy", {"failed": "all"})  # one failure must not end a role
    return policy


def _policies_complete(task: Any) -> bool:
    if not isinstance(task, dict) or not isinstance(task.get("policies"), list):
        return False
    for policy in task["policies"]:
        if isinstance(policy, dict) and policy.get("action") == "CompleteJob" and "exitCode" not in policy:
            events = [policy.get("event")] + list(policy.get("events") or [])
            if "TaskCompleted" in events:
                return True
    return False


def _scheduling(spec: dict[str, Any], tasks: list[Any], report: Report) -> dict[str, Any]:
    scheduling: dict[str, Any] = {}
    if "minAvailable" in spec:
        scheduling["minAvailable"] = spec["minAvailable"]
    elif any(isinstance(t, dict) and "minAvailable" in t for t in tasks):
        # Volcano's default job minAvailable: the sum of the tasks' minAvailable (or replicas).
        counts = [t.get("minAvailable", t.get("replicas", 1)) for t in tasks if isinstance(t, dict)]
        if all(isinstance(n, int) for n in counts):
            scheduling["minAvailable"] = sum(counts)
    if "queue" in spec:
        scheduling["queue"] = spec["queue"]
    if "priorityClassName" in spec:
        scheduling["priorityClass"] = spec["priorityClassName"]
    return scheduling


def _volcano_checks(spec: dict[str, Any], tasks: list[Any], report: Report) -> None:
    """Volcano's own admission checks on gang sizes: ``minAvailable`` >= 0, a task's at most its
    replicas, the job's at most the sum of the replicas."""
    total = 0
    for i, task in enumerate(tasks):
        if not isinstance(task, dict):
            continue
        replicas = task.get("replicas", 1)
        total += replicas if isinstance(replicas, int) else 0
        task_min = task.get("minAvailable")
        if task_min is None:
            continue
        where = f"spec.tasks[{i}].minAvailable"
        if not isinstance(task_min, int) or isinstance(task_min, bool) or task_min < 0:
            report.invalid(where, "must be an integer >= 0")
        elif isinstance(replicas, int) and task_min > replicas:
            report.invalid(where, f"{task_min} is greater than the task's {replicas} replicas")
    job_min = spec.get("minAvailable")
    if job_min is not None:
        if not isinstance(job_min, int) or isinstance(job_min, bool) or job_min < 0:
            report.invalid("spec.minAvailable", "must be an integer >= 0")
        elif job_min > total:
            report.invalid("spec.minAvailable", f"{job_min} is greater than the {total} replicas of all tasks")
