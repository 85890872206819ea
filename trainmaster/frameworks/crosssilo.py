"""``crosssilo``: cross-silo tasks through the gateway, run by the controller.

Roles ``gateway`` (one instance), ``party`` (replicas, each with its own data directory) and
``initiator`` (depends on both). The first instance whose environment is computed provisions the
deployment (CA, certificates, keys, roster; :func:`trainmaster.gateway.crypto.provision.init_deployment`)
in the run's own ``crosssilo/`` folder (mode 0700, beside ``output/``, so never copied with the
outputs), holding a file lock so concurrent instances agree on one deployment; the gateway and
party ports are chosen there (the roster needs every endpoint before any service starts), so these
roles ask the controller for no ports. The job's outputs (``output/crosssilo/``) get what a user
keeps: the initiator's report, the CA certificate and the roster of public keys (to check the
results' signatures later); private keys stay in the deployment folder, 0600, and are never copied.
The job succeeds when the initiator succeeds.

frameworkParams:
  ``dataset: breast_cancer`` -- each party writes its own row block of scikit-learn's breast-cancer
  data (a demo stand-in for data that already sits at the party); otherwise ``data_dirs`` lists one
  directory per party.  ``rounds`` (FedAvg rounds, default 5), ``tolerance`` (max accuracy gap to
  the pooled model, default 0.03).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from trainmaster.frameworks.base import Framework, InstanceContext, python_module
from trainmaster.spec.model import Job, Role, RoleSelector, StatusPolicy


def party_name(index: int) -> str:
    return f"p{index}"


def provision(output_dir: str, n_parties: int) -> Path:
    """Create the job's deployment once (idempotent across instances and processes) in the run's
    folder beside ``output_dir``, and put its public parts into the outputs."""
    root = Path(output_dir).parent / "crosssilo"
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "deploy" / "roster.json").exists():
            from trainmaster.gateway.crypto.provision import init_deployment, ports_needed
            from trainmaster.gateway.localdeploy import free_port_block

            deploy = root / "deploy"
            init_deployment(
                deploy, [party_name(i) for i in range(n_parties)], port_base=free_port_block(ports_needed(n_parties))
            )
            kept = outputs(output_dir)
            kept.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(deploy / "ca" / "ca.pem", kept / "ca.pem")
            shutil.copyfile(deploy / "roster.json", kept / "roster.json")
    return root


def outputs(output_dir: str) -> Path:
    """Where the job's keepsakes go: the report, the CA certificate, the roster (no private key)."""
    return Path(output_dir) / "crosssilo"


class CrossSiloFramework(Framework):
    name = "crosssilo"
    role_names = ("gateway", "party", "initiator")
    required_roles = ("gateway", "party", "initiator")
    default_dependencies = {"initiator": ("gateway", "party")}
    single_instance_roles = ("gateway", "initiator")

    def role_command(self, job: Job, role: Role) -> list[str] | None:
        return python_module("trainmaster.frameworks.crosssilo", role.name)

    def validate(self, spec: dict[str, Any], roles: list[dict[str, Any]]) -> list[str]:
        errors = super().validate(spec, roles)
        params = spec.get("frameworkParams", spec.get("framework_params", {})) or {}
        party = next((r for r in roles if r.get("name") == "party"), {})
        dirs = params.get("data_dirs")
        if params.get("dataset") not in (None, "breast_cancer"):
            errors.append("spec.frameworkParams.dataset: only 'breast_cancer' is built in; give data_dirs instead")
        if dirs is not None and len(dirs) != party.get("replicas", 1):
            errors.append("spec.frameworkParams.data_dirs: needs one directory per party replica")
        return errors

    def defaults(self, job: Job) -> Job:
        job = super().defaults(job)
        if job.spec.status_policy == StatusPolicy():
            job.spec.status_policy = StatusPolicy(failed="any", succeeded=RoleSelector(roles=["initiator"]))
        return job

    def environment(self, ctx: InstanceContext) -> dict[str, str]:
        root = provision(ctx.output_dir, ctx.role_replicas.get("party", 1))
        name = party_name(ctx.index) if ctx.role == "party" else ctx.role
        return {
            "TM_CROSSSILO_DIR": str(root),
            "TM_CROSSSILO_OUTPUT": str(outputs(ctx.output_dir)),
            "TM_CROSSSILO_NAME": name,
            "TM_CROSSSILO_PARAMS": json.dumps(ctx.params),
        }


def _party_data(root: Path, name: str, index: int, n_parties: int, params: dict[str, Any]) -> Path:
    if params.get("data_dirs"):
        return Path(params["data_dirs"][index])
    from trainmaster.gateway.localdeploy import breast_cancer_split, write_csv

    names, splits = breast_cancer_split(n_parties)
    data = root / "data" / name
    data.mkdir(parents=True, exist_ok=True)
    write_csv(data / f"m_{name}.csv", names, splits[index])
    return data


class _Published:
    """The initiator, publishing each task's legs for the dashboard's gateway view."""

    def __init__(self, initiator: Any):
        self.initiator = initiator
        self.roster = initiator.roster

    def run_task(self, spec: Any) -> dict[str, Any]:
        import trainmaster

        result = self.initiator.run_task(spec)
        rules = {leg.data_id: leg.rule for leg in spec.legs}
        trainmaster.publish(
            "gateway.task",
            {
                "task": result["task_id"],
                "legs": [
                    {
                        "data_id": data_id,
                        "party": leg.get("party", ""),
                        "rule": rules.get(data_id, ""),
                        "outcome": leg.get("outcome", ""),
                    }
                    for data_id, leg in result["legs"].items()
                ],
            },
        )
        return result

    def close(self) -> None:
        self.initiator.close()


def _run_initiator(root: Path, output: Path, params: dict[str, Any]) -> int:
    """Statistics and FedAvg training through the gateway, checked against the pooled computation."""
    import numpy as np

    from trainmaster.gateway.initiator.client import Initiator
    from trainmaster.gateway.initiator.taskfile import LegSpec, TaskSpec
    from trainmaster.gateway.localdeploy import breast_cancer_split, wait_until_serving
    from trainmaster.gateway.config import load_config
    from trainmaster.gateway.rules.registry import ScoreParams, TrainParams, score, train

    cfg = load_config(root / "deploy" / "initiator" / "config.yaml")
    ini = _Published(Initiator(cfg))
    parties = sorted(n for n, p in ini.roster.items() if p.role == "party")
    for p in ["gateway", *parties]:
        wait_until_serving(cfg, ini.roster[p].endpoint or "", timeout_s=120)
    names, splits = breast_cancer_split(len(parties))  # public data: used here only to check the answer
    pooled = np.concatenate(splits)
    feats = names[:10]
    legs = lambda rule, params: [LegSpec(data_id=f"m_{p}", party=p, rule=rule, params=params) for p in parties]  # noqa: E731
    stats = ini.run_task(TaskSpec(legs=legs("summary_stats", {"columns": feats + ["label"]})))
    failed = {k: v for k, v in stats["legs"].items() if v["outcome"] != "result"}
    if failed:
        print(json.dumps(failed, indent=2))
        return 1
    per = [stats["legs"][f"m_{p}"]["result"]["columns"] for p in parties]
    ok = True
    report: dict[str, Any] = {"statistics": {}}
    for i, col in enumerate(feats + ["label"]):
        j = names.index(col)
        count = sum(s[col]["count"] for s in per)
        mean = sum(s[col]["sum"] for s in per) / count
        direct = pooled[:, j]
        same = (
            count == direct.size
            and min(s[col]["min"] for s in per) == direct.min()
            and max(s[col]["max"] for s in per) == direct.max()
            and abs(mean - direct.mean()) <= 1e-12 * abs(direct.mean())
        )
        ok &= same
        report["statistics"][col] = {
            "count": count,
            "mean_via_gateway": mean,
            "mean_pooled": float(direct.mean()),
            "equal": bool(same),
        }
    x = pooled[:, :10]
    std = {"mean": x.mean(axis=0).tolist(), "std": x.std(axis=0).tolist()}
    weights: dict[str, Any] = {"w": [0.0] * len(feats), "b": 0.0}
    rounds, epochs = int(params.get("rounds", 5)), 20
    for _ in range(rounds):
        res = ini.run_task(
            TaskSpec(
                legs=legs(
                    "train",
                    {
                        "features": feats,
                        "label": "label",
                        "epochs": epochs,
                        "lr": 0.5,
                        "standardize": std,
                        "init": weights,
                    },
                )
            )
        )
        got = [res["legs"][f"m_{p}"]["result"] for p in parties]
        n = np.array([g["rows"] for g in got], dtype=float)
        weights = {
            "w": ((np.array([g["weights"]["w"] for g in got]) * n[:, None]).sum(0) / n.sum()).tolist(),
            "b": float((np.array([g["weights"]["b"] for g in got]) * n).sum() / n.sum()),
        }
    sc = ini.run_task(
        TaskSpec(legs=legs("score", {"features": feats, "label": "label", "weights": weights, "standardize": std}))
    )
    fed_acc = sum(sc["legs"][f"m_{p}"]["result"]["correct"] for p in parties) / len(pooled)
    table = {n: pooled[:, i] for i, n in enumerate(names)}
    central = train(table, TrainParams(features=feats, label="label", epochs=rounds * epochs, lr=0.5, standardize=std))
    central_acc = score(table, ScoreParams(features=feats, label="label", weights=central["weights"], standardize=std))[
        "correct"
    ] / len(pooled)
    tol = float(params.get("tolerance", 0.03))
    report["model"] = {
        "accuracy_via_gateway": fed_acc,
        "accuracy_pooled": central_acc,
        "tolerance": tol,
        "within_tolerance": abs(fed_acc - central_acc) <= tol,
    }
    ok &= report["model"]["within_tolerance"]
    ini.close()
    output.mkdir(parents=True, exist_ok=True)
    (output / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print(
        "crosssilo: results equal the pooled computation" if ok else "crosssilo: MISMATCH with the pooled computation"
    )
    return 0 if ok else 1


def main(role: str) -> int:
    root = Path(os.environ["TM_CROSSSILO_DIR"])
    name = os.environ["TM_CROSSSILO_NAME"]
    params = json.loads(os.environ.get("TM_CROSSSILO_PARAMS", "{}"))
    from trainmaster.gateway.config import load_config
    from trainmaster.gateway.net.service import serve

    if role == "initiator":
        return _run_initiator(root, Path(os.environ["TM_CROSSSILO_OUTPUT"]), params)
    cfg = load_config(root / "deploy" / name / "config.yaml")
    if role == "gateway":
        from trainmaster.gateway.relay.app import build_gateway_app

        serve(build_gateway_app(cfg), cfg)
        return 0
    from trainmaster.gateway.party.app import build_party_app
    from trainmaster.gateway.crypto.provision import load_roster

    n_parties = sum(p.role == "party" for p in load_roster(cfg.roster).values())
    data = _party_data(root, name, int(name[1:]), n_parties, params)
    serve(build_party_app(cfg, data), cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
