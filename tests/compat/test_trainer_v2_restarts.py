"""Mechanisms: restarting only the part of a job that failed (JobSet's failurePolicy, JobSet
#1129 and Trainer #2269), on a TrainJob and its runtime. A replicated job 'node' (2 instances,
node 1 failing its first run) beside an 'evaluator' that runs until the job ends:

* no failurePolicy: the failed pod alone is recreated (its Job's backoffLimit): node 1 restarts,
  node 0 and the evaluator keep their first attempt;
* a rule ``RestartJob`` on node: the node replicated job restarts (both nodes), the evaluator
  keeps running, untouched (same attempt, same process);
* no rule (JobSet's default ``RestartJobSet``): what the user asked, the whole job restarts."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from controller_harness import PY, Harness, events
from trainmaster.loading import load_document
from trainmaster.spec.compat.trainer import RuntimeDoc, runtime_doc
from trainmaster.spec.load import LoadOptions
from trainmaster.spec.model import RuntimeKind


def node_command(marker: Path) -> list[str]:
    """Node 1 fails its first run (exit 3); every run records its pid; nodes end after 1 s."""
    return [
        PY,
        "-c",
        "import os, pathlib, sys, time\n"
        f"m = pathlib.Path('{marker}')\n"
        "if os.environ['TM_REPLICA_INDEX'] == '1' and not m.exists():\n"
        "    m.write_text('failed once'); time.sleep(0.5); sys.exit(3)\n"
        "time.sleep(1.5)\n",
    ]


EVALUATOR = [PY, "-c", "import time\nwhile True: time.sleep(0.2)\n"]


def runtime(failure_policy: dict[str, Any] | None) -> RuntimeDoc:
    spec: dict[str, Any] = {
        "successPolicy": {"operator": "All", "targetReplicatedJobs": ["node"]},
        "replicatedJobs": [
            {
                "name": "evaluator",
                "template": {
                    "spec": {"template": {"spec": {"containers": [{"name": "evaluator", "command": EVALUATOR}]}}}
                },
            },
            {
                "name": "node",
                "template": {
                    "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                    "spec": {"template": {"spec": {"containers": [{"name": "node", "command": ["true"]}]}}},
                },
            },
        ],
    }
    if failure_policy is not None:
        spec["failurePolicy"] = failure_policy
    raw = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainingRuntime",
        "metadata": {"name": "two-part"},
        "spec": {"template": {"spec": spec}},
    }
    return runtime_doc(copy.deepcopy(raw), "test")


def trainjob(marker: Path) -> dict[str, Any]:
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": "restart-part"},
        "spec": {
            "runtimeRef": {"name": "two-part", "kind": "TrainingRuntime"},
            "trainer": {"numNodes": 2, "command": node_command(marker)},
        },
    }


def run(harness: Harness, tmp_path: Path, failure_policy: dict[str, Any] | None) -> dict[str, Any]:
    loaded = load_document(
        trainjob(tmp_path / "marker"),
        options=LoadOptions(runtime=RuntimeKind.HOST, runtimes=(runtime(failure_policy),)),
    )
    job_id = harness.jobs.submit(loaded, harness.controller, unique_name=False).id
    assert harness.controller.run_job(job_id) == "succeeded", harness.status(job_id)["message"]
    return harness.status(job_id)


def attempts(status: dict[str, Any]) -> dict[str, int]:
    """Each instance's last attempt (1: never restarted)."""
    return {
        f"{i['role']}-{i['index']}": i["attempt"]
        for i in status["instances"]
        if i["state"] != "stopped" or i["role"] == "evaluator"
    }


@pytest.mark.timeout(120)
def test_without_a_failure_policy_only_the_failed_instance_restarts(harness: Harness, tmp_path: Path) -> None:
    status = run(harness, tmp_path, None)
    assert attempts(status) == {"evaluator-0": 1, "node-0": 1, "node-1": 2}
    assert not events(status, "RestartingGroup")


@pytest.mark.timeout(120)
def test_restart_job_restarts_the_replicated_job_and_leaves_the_rest_running(harness: Harness, tmp_path: Path) -> None:
    policy = {"maxRestarts": 2, "rules": [{"action": "RestartJob", "targetReplicatedJobs": ["node"]}]}
    status = run(harness, tmp_path, policy)
    assert attempts(status) == {"evaluator-0": 1, "node-0": 2, "node-1": 2}
    group = events(status, "RestartingGroup")
    assert len(group) == 1 and "every instance of the role node" in group[0]["message"], group


@pytest.mark.timeout(120)
def test_the_default_action_restarts_the_whole_job_as_asked(harness: Harness, tmp_path: Path) -> None:
    status = run(harness, tmp_path, {"maxRestarts": 2})
    assert attempts(status) == {"evaluator-0": 2, "node-0": 2, "node-1": 2}
    group = events(status, "RestartingGroup")
    assert len(group) == 1 and "every instance of the job" in group[0]["message"], group


def test_elastic_policies_become_the_pytorch_frameworks_elastic_node_role() -> None:
    """v2.1's torch ``elasticPolicy`` (minNodes/maxNodes/maxRestarts) and a PyTorchJob's
    (minReplicas/maxReplicas) both give an elastic ``node`` role beside the ``rendezvous`` store,
    with torchrun's elastic variables; scaling outside min..max is refused by validation."""
    from trainmaster.frameworks import get_framework
    from trainmaster.frameworks.base import InstanceContext
    from trainmaster.loading import validate_document

    raw = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "ClusterTrainingRuntime",
        "metadata": {"name": "torch-elastic"},
        "spec": {
            "mlPolicy": {"numNodes": 2, "torch": {"elasticPolicy": {"minNodes": 2, "maxNodes": 4, "maxRestarts": 7}}},
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {
                            "name": "node",
                            "template": {
                                "spec": {
                                    "template": {
                                        "spec": {"containers": [{"name": "node", "command": ["torchrun", "t.py"]}]}
                                    }
                                }
                            },
                        }
                    ]
                }
            },
        },
    }
    trainjob = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": "elastic"},
        "spec": {"runtimeRef": {"name": "torch-elastic"}},
    }
    loaded = load_document(
        trainjob, options=LoadOptions(runtime=RuntimeKind.HOST, runtimes=(runtime_doc(raw, "test"),))
    )
    spec = loaded.job.spec
    assert spec.framework_params["elastic"] == {"minReplicas": 2, "maxReplicas": 4, "maxRestarts": 7}
    assert [r.name for r in spec.roles] == ["node", "rendezvous"]
    assert [d.role for d in spec.role("node").depends_on] == ["rendezvous"]
    env = get_framework("pytorch").environment(
        InstanceContext(
            "elastic",
            "node",
            0,
            2,
            {"node": 2, "rendezvous": 1},
            "127.0.0.1",
            [5000],
            {"rendezvous": ["127.0.0.1:6000"]},
            spec.framework_params,
            job_id=3,
        )
    )
    assert env["PET_NNODES"] == "2:4" and env["PET_RDZV_BACKEND"] == "c10d" and env["PET_MAX_RESTARTS"] == "7"
    assert env["PET_RDZV_ENDPOINT"] == "127.0.0.1:6000" and "is_host=0" in env["PET_RDZV_CONF"]
    document = loaded.job.dump()
    document["spec"]["roles"][0]["replicas"] = 5
    with pytest.raises(Exception, match="between minReplicas and maxReplicas"):
        validate_document(document)

    from trainmaster.spec.compat import convert

    pytorchjob = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "el"},
        "spec": {
            "elasticPolicy": {"minReplicas": 1, "maxReplicas": 3, "rdzvBackend": "c10d", "maxRestarts": 5},
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": 2,
                    "template": {"spec": {"containers": [{"name": "pytorch", "command": ["torchrun", "t.py"]}]}},
                }
            },
        },
    }
    converted = convert(pytorchjob)
    assert converted is not None
    assert converted.document["spec"]["frameworkParams"]["elastic"] == {
        "minReplicas": 1,
        "maxReplicas": 3,
        "maxRestarts": 5,
    }
    assert [r["name"] for r in converted.document["spec"]["roles"]] == ["node"]


def test_a_trainjob_finds_its_runtime_given_beside_it_or_installed(tmp_path: Path) -> None:
    """The runtime in the same file (a second YAML document), in a file given after the job's, or
    installed in the store (``runtime add``, replacing one of the same kind and name; ``delete``)."""
    import yaml

    from trainmaster.errors import UserError
    from trainmaster.loading import load_job
    from trainmaster.store import runtimes as store
    from trainmaster.store.db import make_engine, session_factory

    runtime_raw = runtime(None).document
    job_raw = trainjob(tmp_path / "marker")
    both = tmp_path / "both.yaml"
    both.write_text(yaml.safe_dump_all([job_raw, runtime_raw]))
    options = LoadOptions(runtime=RuntimeKind.HOST)
    assert load_job(both, options).job.spec.role("node").replicas == 2
    alone, runtime_file = tmp_path / "job.yaml", tmp_path / "runtime.yaml"
    alone.write_text(yaml.safe_dump(job_raw))
    runtime_file.write_text(yaml.safe_dump(runtime_raw))
    assert load_job(alone, options, [runtime_file]).job.name == "restart-part"
    with pytest.raises(UserError) as missing:
        load_job(alone, options)
    assert missing.value.details[0].startswith("spec.runtimeRef.name: no TrainingRuntime named 'two-part'")
    url = f"sqlite:///{tmp_path / 'store.db'}"
    sessions = session_factory(make_engine(url))
    with sessions() as session:
        assert store.install(session, runtime_doc(runtime_raw, str(runtime_file))) is False
        assert store.install(session, runtime_doc(runtime_raw, str(runtime_file))) is True  # replaced
        session.commit()
    installed = LoadOptions(runtime=RuntimeKind.HOST, installed_runtimes=store.installed_reader(url))
    loaded = load_job(alone, installed)
    assert "TrainingRuntime/two-part (installed from" in loaded.job.metadata.annotations["trainer.kubeflow.org/runtime"]
    with sessions() as session:
        assert store.remove(session, "two-part") == 1
        session.commit()
    with pytest.raises(UserError):
        load_job(alone, installed)
