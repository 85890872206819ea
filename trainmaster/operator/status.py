"""A job's status written back into its custom resource, in the shape its upstream operator uses.

- Kubeflow (PyTorchJob, TFJob, MPIJob): ``conditions`` of types Created, Running, Restarting,
  Succeeded, Failed (``status`` "True"/"False", reason ``<Kind><Phase>``, times), and
  ``replicaStatuses`` per replica type (active, succeeded, failed), ``startTime``,
  ``completionTime``: ``kubectl get pytorchjobs`` shows the last condition and ``kubectl wait
  --for=condition=Succeeded`` returns when it holds.
- Volcano (Job): ``state.phase`` (Pending, Running, Restarting, Completed, Failed, Aborted) and
  the counts of pending/running/succeeded/failed pods, ``minAvailable``, ``retryCount``.
- TrainingJob (ours): the state, reason and message of ``trainmaster job status``, its
  conditions (Kubeflow's types) and the per-role counts.

Pure functions of the controller's status document (:func:`repository.job_status`).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from trainmaster.operator.kinds import ResourceKind

ENDED = ("succeeded", "failed", "cancelled")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _stamp(iso: str | None) -> str | None:
    if not iso:
        return None
    return datetime.fromisoformat(iso).astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _counts(status: dict[str, Any], role: str) -> dict[str, int]:
    for entry in status.get("roles", []):
        if entry["name"] == role:
            return {k: int(v) for k, v in (entry.get("counts") or {}).items()}
    return {}


def _restarting(status: dict[str, Any]) -> bool:
    return any(i["state"] == "pending" and i["restarts"] > 0 for i in status.get("instances", []))


def _previous(old: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for condition in (old or {}).get("conditions") or []:
        if condition.get("type") == type_:
            return dict(condition)
    return None


def _condition(old: dict[str, Any] | None, type_: str, holds: bool, reason: str, message: str) -> dict[str, Any]:
    """A condition that keeps its ``lastTransitionTime`` while its status stays the same."""
    status = "True" if holds else "False"
    before = _previous(old, type_) or {}
    now = _now()
    changed = before.get("status") != status
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastUpdateTime": now
        if changed or (before.get("reason"), before.get("message")) != (reason, message)
        else before.get("lastUpdateTime", now),
        "lastTransitionTime": now if changed else before.get("lastTransitionTime", now),
    }


def kubeflow_status(
    kind: ResourceKind, name: str, status: dict[str, Any], replica_types: list[str], old: dict[str, Any] | None
) -> dict[str, Any]:
    state = status["state"]
    k = kind.kind
    created = f"{k} {name} is created."
    if state == "pending" and status.get("message"):  # why it waits: the gang does not fit, a queue
        created += f" {status.get('reason') or 'Pending'}: {status['message']}"
    conditions = [_condition(old, "Created", True, f"{k}Created", created)]
    ran = status.get("runningAt") is not None or state in ("running", "succeeded", "failed")
    if ran or _previous(old, "Running"):
        conditions.append(_condition(old, "Running", state == "running", f"{k}Running", f"{k} {name} is running."))
    if _restarting(status) and state not in ENDED:
        conditions.append(_condition(old, "Restarting", True, f"{k}Restarting", f"{k} {name} is restarting."))
    if state == "succeeded":
        conditions.append(_condition(old, "Succeeded", True, f"{k}Succeeded", f"{k} {name} successfully completed."))
    elif state in ("failed", "cancelled"):
        reason = status.get("reason") or "Failed"
        conditions.append(_condition(old, "Failed", True, f"{k}{reason}", status.get("message") or reason))
    replicas = {}
    for replica_type in replica_types:
        counts = _counts(status, replica_type.lower())
        replicas[replica_type] = {  # an ended job's running instances were stopped with it
            "active": 0 if state in ENDED else counts.get("running", 0) + counts.get("starting", 0),
            "succeeded": counts.get("succeeded", 0),
            "failed": counts.get("failed", 0),
        }
    out: dict[str, Any] = {"conditions": conditions, "replicaStatuses": replicas}
    if status.get("startedAt"):
        out["startTime"] = _stamp(status["startedAt"])
    if status.get("completedAt"):
        out["completionTime"] = _stamp(status["completedAt"])
    return out


VOLCANO_PHASES = {
    "pending": "Pending",
    "starting": "Pending",
    "running": "Running",
    "succeeded": "Completed",
    "failed": "Failed",
    "cancelled": "Aborted",
}


def volcano_status(status: dict[str, Any], min_available: int, old: dict[str, Any] | None) -> dict[str, Any]:
    phase = VOLCANO_PHASES.get(status["state"], "Pending")
    if phase == "Running" and _restarting(status):
        phase = "Restarting"
    before = ((old or {}).get("state") or {}).get("phase")
    state = {
        "phase": phase,
        "reason": status.get("reason") or "",
        "message": status.get("message") or "",
        "lastTransitionTime": _now() if before != phase else ((old or {}).get("state") or {}).get("lastTransitionTime"),
    }
    totals = {"pending": 0, "running": 0, "succeeded": 0, "failed": 0, "terminating": 0, "unknown": 0}
    tasks: dict[str, Any] = {}
    for entry in status.get("roles", []):
        counts = entry.get("counts") or {}
        totals["pending"] += int(counts.get("pending", 0)) + int(counts.get("starting", 0))
        for key in ("running", "succeeded", "failed", "terminating", "unknown"):
            totals[key] += int(counts.get(key, 0))
        tasks[entry["name"]] = {"phase": {k.capitalize(): int(v) for k, v in counts.items() if v}}
    return {
        "state": state,
        "minAvailable": min_available,
        **totals,
        "retryCount": sum(i["restarts"] for i in status.get("instances", [])),
        "version": 1,
        "taskStatusCount": tasks,
    }


def trainmaster_status(status: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
    kind = ResourceKind("trainmaster.io", ("v1",), "TrainingJob", "trainingjobs", (), "trainmaster", ())
    roles = [r["name"].capitalize() for r in status.get("roles", [])]
    kubeflow = kubeflow_status(kind, status["name"], status, roles, old)
    return {
        "state": status["state"],
        "reason": status.get("reason") or "",
        "message": status.get("message") or "",
        "conditions": kubeflow["conditions"],
        "roles": [
            {"name": r["name"], "replicas": r["replicas"], "state": r["state"], "counts": r.get("counts") or {}}
            for r in status.get("roles", [])
        ],
        **({"startTime": kubeflow["startTime"]} if "startTime" in kubeflow else {}),
        **({"completionTime": kubeflow["completionTime"]} if "completionTime" in kubeflow else {}),
    }


def invalid_status(kind: ResourceKind, message: str, details: list[str], old: dict[str, Any] | None) -> dict[str, Any]:
    """A resource that cannot run as written: Failed, with every wrong field by its path."""
    text = message + ("".join(f"; {d}" for d in details) if details else "")
    failed = _condition(old, "Failed", True, "InvalidSpec", text)
    if kind.status == "trainer":  # a metav1.Condition, as the Trainer writes it
        failed.pop("lastUpdateTime")
    if kind.status == "volcano":
        return {
            "state": {"phase": "Failed", "reason": "InvalidSpec", "message": text, "lastTransitionTime": _now()},
            "conditions": [failed],
        }
    out: dict[str, Any] = {"conditions": [failed]}
    if kind.status == "trainmaster":
        out.update(state="failed", reason="InvalidSpec", message=text)
    return out


def is_final(kind: ResourceKind, status: dict[str, Any] | None) -> bool:
    """Whether a resource's written status is an end: it is not run again by a new leader."""
    if not status:
        return False
    for condition in status.get("conditions") or []:
        if condition.get("type") in ("Succeeded", "Complete", "Failed") and condition.get("status") == "True":
            return True
    return ((status.get("state") or {}) if isinstance(status.get("state"), dict) else {}).get("phase") in (
        "Completed",
        "Failed",
        "Aborted",
    )
