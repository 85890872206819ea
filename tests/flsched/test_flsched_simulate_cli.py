"""Simulator (convergence curves, concurrency, dropout) and the CLI (schedule, simulate, exit 2)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainmaster.flsched import make_scheduler
from trainmaster.flsched.simulate import ConvergenceCurve, simulate
from trainmaster.flsched.synthetic import make_problem

ROOT = Path(__file__).resolve().parents[2]


def test_convergence_curve_shape():
    """Convergence: accuracy rises with effective progress and falls with missing data coverage."""
    c = ConvergenceCurve(alpha=5.0, beta=0.05, gamma=0.3)
    assert c.accuracy(10, 1.0) < c.accuracy(40, 1.0)
    assert c.accuracy(40, 0.5) == pytest.approx(c.accuracy(40, 1.0) - 0.15)


def test_simulation_reaches_targets_and_keeps_devices_exclusive():
    """Simulator: jobs run concurrently, each round lasts its slowest device, every job reaches
    its target with sa; participation totals equal rounds x per_round."""
    p = make_problem(40, 3, 4, seed=2, weights={"time": 1.0, "fairness": 100.0})
    res = simulate(p, make_scheduler("sa", seed=2, moves=300), seed=2, max_rounds=400)
    assert res.total_time is not None
    for tr in res.jobs:
        assert tr.time_to_target is not None and tr.time_to_target <= res.total_time
        assert tr.participation.sum() == tr.rounds * 4
        assert all(np.diff(tr.times) > 0)
    d = res.to_dict()
    assert set(d["jobs"]) == {"job0", "job1", "job2"}


def test_greedy_skews_participation_and_random_does_not():
    """Fairness matters in simulation: greedy leaves most devices unused, random touches nearly all."""
    p = make_problem(40, 2, 4, seed=3)
    g = simulate(p, make_scheduler("greedy"), seed=3, rounds=30)
    r = simulate(p, make_scheduler("random", seed=3), seed=3, rounds=30)
    assert (g.jobs[0].participation == 0).sum() > (r.jobs[0].participation == 0).sum()
    assert r.jobs[0].final_accuracy() > g.jobs[0].final_accuracy()


def test_dropout_loses_updates():
    """Device dropout mid-round: dropped devices' updates are lost, so progress is slower."""
    p = make_problem(40, 1, 4, seed=5)
    full = simulate(p, make_scheduler("random", seed=1), seed=1, rounds=20)
    lossy = simulate(p, make_scheduler("random", seed=1), seed=1, rounds=20, dropout=0.5)
    assert lossy.jobs[0].final_accuracy() < full.jobs[0].final_accuracy()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainmaster", "flsched", *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


@pytest.mark.timeout(120)
def test_cli_schedule_json_output():
    """CLI schedule: prints assignment, cost and time_ms for the example problem; constraints hold."""
    out = _cli("schedule", str(ROOT / "examples/flsched-problem.json"), "--scheduler", "sa", "--seed", "3", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert set(data["assignment"]) == {"digits", "wine"}
    used = [d for devs in data["assignment"].values() for d in devs]
    assert len(used) == len(set(used)) == 4
    assert "laptop" not in used  # unavailable
    assert "phone-b" not in data["assignment"]["wine"]  # holds no wine data
    assert data["cost"] > 0 and data["time_ms"] >= 0


@pytest.mark.timeout(120)
def test_cli_schedule_infeasible_exits_2(tmp_path):
    """CLI: infeasible problems (more devices asked than available) get a clear error and exit 2."""
    bad = tmp_path / "p.json"
    bad.write_text(
        json.dumps(
            {
                "devices": [{"id": "a", "a": 1, "mu": 1, "bandwidth": 1}],
                "jobs": [{"id": "j", "tau": 1, "per_round": 3, "data": {"a": 1}}],
            }
        )
    )
    out = _cli("schedule", str(bad))
    assert out.returncode == 2
    assert "error:" in out.stderr and "asks for 3 devices" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.timeout(120)
def test_cli_simulate_json():
    """CLI simulate: rounds, total simulated time, per-job times and participation histograms."""
    out = _cli(
        "simulate",
        "--devices",
        "30",
        "--jobs",
        "2",
        "--per-round",
        "3",
        "--scheduler",
        "greedy",
        "--seed",
        "1",
        "--max-rounds",
        "50",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["scheduler"] == "greedy"
    for job in data["jobs"].values():
        assert sum(job["participation_histogram"]["counts"]) == 30
        assert job["rounds"] >= 1


@pytest.mark.timeout(180)
def test_cli_simulate_fleet_json_and_labelled_histogram():
    """CLI simulate --fleet: a sparse deployed-scale pool, mean job completion time, decision CPU
    times, and participation histograms whose bins are labelled with the rounds served; a pool
    too small for a fleet is the user's mistake (exit 2, no traceback)."""
    out = _cli("simulate", "--fleet", "--devices", "3000", "--jobs", "2", "--scheduler", "random", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["devices"] == 3000 and data["mean_completion_time"] > 0 and data["decisions"] >= 2
    for job in data["jobs"].values():
        bins = job["participation_histogram"]["bins"]
        assert sum(b["devices"] for b in bins) == 3000 and bins[0]["rounds"].startswith("0")
    table = _cli("simulate", "--fleet", "--devices", "3000", "--jobs", "2", "--scheduler", "random")
    assert table.returncode == 0 and "served" in table.stdout and "0: " in table.stdout
    small = _cli("simulate", "--fleet", "--devices", "100", "--jobs", "2")
    assert small.returncode == 2 and "error:" in small.stderr and "Traceback" not in small.stderr
