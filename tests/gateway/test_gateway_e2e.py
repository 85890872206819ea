"""End to end over mutual TLS with real processes: three parties holding rows of breast-cancer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gateway_harness import Deployment

from trainmaster.gateway.initiator.taskfile import LegSpec, TaskSpec

pytestmark = pytest.mark.timeout(180)
PARTIES = ["a", "b", "c"]


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    d = Deployment(tmp_path_factory.mktemp("e2e"), PARTIES).start_all()
    yield d
    d.stop_all()


def test_pooled_statistics_equal_direct_computation(dep: Deployment) -> None:
    """Flow steps 1-7 (task creation, executor report, mapping table, data receive, transfer,
    decrypt/re-encrypt at the gateway): pooled summary stats and histograms equal the pooled data's."""
    edges = [0.0, 11.0, 13.0, 15.0, 18.0, 40.0]  # every non-empty bin holds >= 5 rows at each party (item 10)
    ini = dep.initiator()
    spec = TaskSpec(
        task_id="stats1",
        legs=[
            LegSpec(data_id=f"m_{p}", party=p, rule="summary_stats", params={"columns": ["mean_radius", "label"]})
            for p in PARTIES
        ],
    )
    out = ini.run_task(spec)
    hist = ini.run_task(
        TaskSpec(
            task_id="hist1",
            legs=[
                LegSpec(data_id=f"m_{p}", party=p, rule="histogram", params={"column": "mean_radius", "edges": edges})
                for p in PARTIES
            ],
        )
    )
    ini.close()
    pooled = np.concatenate(dep.splits)
    col = pooled[:, dep.names.index("mean_radius")]
    stats = [out["legs"][f"m_{p}"]["result"]["columns"]["mean_radius"] for p in PARTIES]
    assert all(out["legs"][f"m_{p}"]["outcome"] == "result" for p in PARTIES)
    assert sum(s["count"] for s in stats) == col.size
    assert min(s["min"] for s in stats) == col.min() and max(s["max"] for s in stats) == col.max()
    assert sum(s["sum"] for s in stats) == pytest.approx(col.sum(), rel=1e-12)
    counts = np.sum([hist["legs"][f"m_{p}"]["result"]["counts"] for p in PARTIES], axis=0)
    assert counts.tolist() == np.histogram(col, bins=edges)[0].tolist()


def test_federated_training_matches_pooled_model(dep: Deployment) -> None:
    """Rules `train` and `score` through the gateway: FedAvg of local logistic regressions scores
    within 3 accuracy points of the same model trained on the pooled data (2 rounds)."""
    from trainmaster.gateway.rules.registry import TrainParams, score, train, ScoreParams

    pooled = np.concatenate(dep.splits)
    feats = dep.names[:10]
    x = pooled[:, :10]
    std = {"mean": x.mean(axis=0).tolist(), "std": x.std(axis=0).tolist()}
    ini = dep.initiator()
    weights = {"w": [0.0] * 10, "b": 0.0}
    for rnd in range(2):
        res = ini.run_task(
            TaskSpec(
                task_id=f"train{rnd}",
                legs=[
                    LegSpec(
                        data_id=f"m_{p}",
                        party=p,
                        rule="train",
                        params={
                            "features": feats,
                            "label": "label",
                            "epochs": 30,
                            "lr": 0.5,
                            "standardize": std,
                            "init": weights,
                        },
                    )
                    for p in PARTIES
                ],
            )
        )
        legs = [res["legs"][f"m_{p}"]["result"] for p in PARTIES]
        n = np.array([leg["rows"] for leg in legs], dtype=float)
        weights = {
            "w": (np.array([leg["weights"]["w"] for leg in legs]) * n[:, None]).sum(0) / n.sum(),
            "b": float((np.array([leg["weights"]["b"] for leg in legs]) * n).sum() / n.sum()),
        }
        weights = {"w": weights["w"].tolist(), "b": weights["b"]}
    sc = ini.run_task(
        TaskSpec(
            task_id="score1",
            legs=[
                LegSpec(
                    data_id=f"m_{p}",
                    party=p,
                    rule="score",
                    params={"features": feats, "label": "label", "weights": weights, "standardize": std},
                )
                for p in PARTIES
            ],
        )
    )
    ini.close()
    fed_acc = sum(sc["legs"][f"m_{p}"]["result"]["correct"] for p in PARTIES) / len(pooled)
    table = {n: pooled[:, i] for i, n in enumerate(dep.names)}
    central = train(table, TrainParams(features=feats, label="label", epochs=60, lr=0.5, standardize=std))
    central_acc = score(table, ScoreParams(features=feats, label="label", weights=central["weights"], standardize=std))[
        "correct"
    ] / len(pooled)
    assert fed_acc > 0.85
    assert abs(fed_acc - central_acc) <= 0.03


def test_cli_task_run_prints_decrypted_results(dep: Deployment, tmp_path: Path) -> None:
    """`trainmaster task run --config ... TASK.yaml` (the initiator CLI) prints every leg's result."""
    task = tmp_path / "task.yaml"
    task.write_text(
        "task_id: cli1\nlegs:\n" + "".join(f"  - {{data_id: m_{p}, party: {p}, rule: row_count}}\n" for p in PARTIES)
    )
    out = subprocess.run(
        [sys.executable, "-m", "trainmaster", "task", "run", "--config", str(dep.configs["initiator"]), str(task)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = {k: v["result"]["rows"] for k, v in json.loads(out.stdout)["legs"].items()}
    assert rows == {f"m_{p}": len(s) for p, s in zip(PARTIES, dep.splits)}
    assert dep.health("gateway")["in_flight_legs"] == 0
