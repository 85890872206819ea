"""CLI of the flsched capability: schedule one round from a problem file, or simulate many."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from trainmaster.errors import UserError

SIM_FAIRNESS_WEIGHT = 300.0  # seconds of round time one unit of participation variance is worth


def register(app: typer.Typer) -> None:
    """Add the ``flsched`` group (schedule, simulate) to the top-level app."""
    sub = typer.Typer(help="Multi-job federated learning: schedule FL jobs over one device pool.", no_args_is_help=True)

    @sub.command("schedule")
    def schedule(
        problem_file: Path = typer.Argument(..., help="PROBLEM.json: devices, jobs, history, weights."),
        scheduler: str = typer.Option(
            "sa", "--scheduler", help="sa, greedy, random, roundrobin, genetic, fedcs, oort, exact."
        ),
        seed: int = typer.Option(0, "--seed", help="Random seed of the scheduler."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON only."),
    ) -> None:
        """Choose this round's devices for every job of PROBLEM.json; prints assignment, cost, time_ms."""
        import time

        from trainmaster.flsched import ExactCost, Problem, make_scheduler, violations

        try:
            raw = json.loads(problem_file.read_text())
        except FileNotFoundError:
            raise UserError(f"no such problem file: {problem_file}") from None
        except json.JSONDecodeError as exc:
            raise UserError(f"{problem_file} is not valid JSON: {exc}") from None
        problem = Problem.from_dict(raw)
        sched = make_scheduler(scheduler, seed=seed)
        cost = ExactCost(problem)
        t0 = time.perf_counter()
        assignment = sched.schedule(problem, cost)
        elapsed_ms = (time.perf_counter() - t0) * 1000
        faults = violations(problem, assignment)
        if faults:  # a scheduler bug, not the user's: fail loudly
            raise RuntimeError(f"scheduler {scheduler} broke constraints: {faults}")
        chosen = {problem.jobs[m].id: [problem.devices[int(k)].id for k in s] for m, s in enumerate(assignment)}
        total = round(cost.cost(assignment), 6)
        breakdown = cost.breakdown(assignment)
        if as_json:
            out = {
                "assignment": chosen,
                "cost": total,
                "time_ms": round(elapsed_ms, 3),
                "scheduler": scheduler,
                "jobs": breakdown,
            }
            print(json.dumps(out))
            return
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"{scheduler}: cost {total:.4f}, decided in {round(elapsed_ms, 3):.1f} ms")
        for col in ("job", "devices", "expected round time (s)", "fairness variance"):
            table.add_column(col)
        for job, devs in chosen.items():
            b = breakdown[job]
            table.add_row(job, ", ".join(devs), f"{b['time']:.3f}", f"{b['fairness']:.4f}")
        Console().print(table)

    @sub.command("simulate")
    def simulate_cmd(
        devices: int = typer.Option(100, "--devices", min=1, help="Devices in the pool."),
        jobs: int = typer.Option(3, "--jobs", min=1, help="Concurrent FL jobs."),
        per_round: int = typer.Option(10, "--per-round", min=1, help="Devices per job per round."),
        scheduler: str = typer.Option("sa", "--scheduler", help="Scheduler name (see `schedule --help`)."),
        seed: int = typer.Option(1, "--seed", help="Seed of the pool, the draws and the scheduler."),
        fairness_weight: float = typer.Option(
            SIM_FAIRNESS_WEIGHT,
            "--fairness-weight",
            min=0.0,
            help="Weight of the fairness variance in the cost (time weight is 1).",
        ),
        availability: float = typer.Option(
            0.9, "--availability", min=0.0, max=1.0, help="Chance a device is reachable at a decision."
        ),
        max_rounds: int = typer.Option(2000, "--max-rounds", min=1, help="Give up on a job after this many rounds."),
        fleet: bool = typer.Option(
            False,
            "--fleet",
            help="A deployed-scale pool in sparse form (make_fleet: data on 5-50%% of the devices, per_round 10-50, "
            "a slow quarter; --per-round and --fairness-weight do not apply): try --devices 100000 --jobs 20.",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print JSON only."),
    ) -> None:
        """Simulate jobs until each reaches its target: rounds, simulated time, per-job times, participation.

        Examples: trainmaster flsched simulate --devices 100 --jobs 3 --scheduler sa;
        trainmaster flsched simulate --fleet --devices 100000 --jobs 20 --scheduler sa"""
        from trainmaster.flsched import make_scheduler
        from trainmaster.flsched.simulate import simulate
        from trainmaster.flsched.synthetic import make_fleet, make_fleet_curves, make_problem

        if scheduler == "exact" and devices > 40:
            raise UserError("the exact (MILP) scheduler is for small pools; use --devices 40 or fewer")
        sched = make_scheduler(scheduler, seed=seed)
        if fleet:
            if devices < 150 * jobs:
                raise UserError(
                    f"--fleet needs at least 150 devices per job ({150 * jobs} for {jobs} jobs), got {devices}"
                )
            pool = make_fleet(devices, jobs, seed)
            result = simulate(
                pool,
                sched,
                curves=make_fleet_curves(jobs, seed),
                seed=seed,
                availability=availability,
                max_rounds=max_rounds,
            )
        else:
            if jobs * per_round > devices:
                raise UserError(
                    f"{jobs} jobs x {per_round} devices per round need {jobs * per_round} devices, the pool has {devices}"
                )
            problem = make_problem(devices, jobs, per_round, seed, weights={"time": 1.0, "fairness": fairness_weight})
            result = simulate(problem, sched, seed=seed, availability=availability, max_rounds=max_rounds)
        out = result.to_dict()
        if as_json:
            print(json.dumps(out))
            return
        from rich.console import Console
        from rich.table import Table

        total = "never (a job missed its target)" if out["total_time"] is None else f"{out['total_time']:.1f} s"
        mean = "-" if out["mean_completion_time"] is None else f"{out['mean_completion_time']:.1f} s"
        table = Table(
            title=f"{scheduler}: all targets reached at {total}, mean job completion {mean}; "
            f"decision {out['decision_ms_median']:.1f} ms ({out['decision_cpu_ms_median']:.1f} ms CPU, "
            f"max {out['decision_cpu_ms_max']:.1f})"
        )
        for col in (
            "job",
            "rounds",
            "time to target (s)",
            "final accuracy",
            "devices never used",
            "devices by rounds served",
        ):
            table.add_column(col)
        for job, j in out["jobs"].items():
            ttt = "-" if j["time_to_target"] is None else f"{j['time_to_target']:.1f}"
            table.add_row(
                job,
                str(j["rounds"]),
                ttt,
                f"{j['final_accuracy']:.3f}",
                str(j["devices_never_used"]),
                ", ".join(
                    f"{b['rounds']}: {b['devices']}" for b in j["participation_histogram"]["bins"] if b["devices"]
                ),
            )
        Console().print(table)

    @sub.command("train")
    def train_cmd(
        scheduler: str = typer.Option("sa", "--scheduler", help="Scheduler name (see `schedule --help`)."),
        devices: int = typer.Option(20, "--devices", min=3, help="Devices in the pool."),
        per_round: int = typer.Option(3, "--per-round", min=1, help="Devices per job per round."),
        rounds: int = typer.Option(40, "--rounds", min=1, help="At most this many rounds per job."),
        dropout: float = typer.Option(
            0.1, "--dropout", min=0.0, max=1.0, help="Chance a chosen device drops mid-round."
        ),
        seed: int = typer.Option(0, "--seed", help="Seed of the data split, the pool and the draws."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON only."),
    ) -> None:
        """Really train digits, wine and breast-cancer (PyTorch, FedAvg, non-IID) over one pool; report
        accuracy against simulated wall time and time to target per job."""
        from trainmaster.flsched import make_scheduler
        from trainmaster.flsched.runtime import MultiJobOptions, run_multijob

        if 3 * per_round > devices:
            raise UserError(
                f"3 jobs x {per_round} devices per round need {3 * per_round} devices, the pool has {devices}"
            )
        options = MultiJobOptions(num_devices=devices, per_round=per_round, rounds=rounds, seed=seed, dropout=dropout)
        jobs = run_multijob(make_scheduler(scheduler, seed=seed), options)
        out = {
            j.name: {
                "target": j.target,
                "time_to_target": j.time_to_target,
                "rounds": len(j.curve),
                "final_accuracy": j.curve[-1][1] if j.curve else 0.0,
                "curve": [[round(t, 2), round(a, 4)] for t, a in j.curve],
            }
            for j in jobs
        }
        if as_json:
            print(json.dumps({"scheduler": scheduler, "jobs": out}))
            return
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"{scheduler}: real FedAvg training, simulated device time")
        for col in ("job", "rounds", "final accuracy", "target", "time to target (s)"):
            table.add_column(col)
        for name, j in out.items():
            ttt = "-" if j["time_to_target"] is None else f"{j['time_to_target']:.1f}"
            table.add_row(name, str(j["rounds"]), f"{j['final_accuracy']:.3f}", f"{j['target']:.2f}", ttt)
        Console().print(table)

    @sub.command("arbiter")
    def arbiter_cmd(
        host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (loopback by default)."),
        port: int = typer.Option(8470, "--port", min=1, max=65535, help="Port to listen on."),
        scheduler: str = typer.Option("sa", "--scheduler", help="Scheduler that decides each joint round."),
        seed: int = typer.Option(0, "--seed", help="Seed of the scheduler."),
        fairness_weight: float = typer.Option(
            30.0, "--fairness-weight", min=0.0, help="Weight of the participation variance (time weight is 1)."
        ),
        gather_s: float = typer.Option(
            0.5, "--gather-s", min=0.0, help="How long a request waits for the other runs' requests (seconds)."
        ),
        lease_s: float = typer.Option(
            600.0, "--lease-s", min=1.0, help="A lease not released by then ends (a run that died)."
        ),
        state: Path | None = typer.Option(
            None,
            "--state",
            help="JSON file of the arbiter's state (profiles, runs, history, leases), written at every change; "
            "an arbiter restarted on it resumes, leases included.",
        ),
    ) -> None:
        """Serve the node arbiter: concurrent Flower runs lease their rounds' nodes from it.

        Example: trainmaster flsched arbiter --port 8470 --fairness-weight 600

        Runs register (PUT /v1/runs/RUN), nodes enrol (PUT /v1/devices), each round leases
        (POST /v1/runs/RUN/lease) and releases (POST /v1/runs/RUN/release); GET /v1/leases
        shows every lease. See docs/flsched.md (Flower)."""
        from trainmaster.flsched import names
        from trainmaster.flsched.arbiter import serve

        if scheduler not in names():
            raise UserError(f"unknown scheduler {scheduler!r}", [f"choose one of: {', '.join(names())}"])
        if state is not None and not state.parent.is_dir():
            raise UserError(f"--state {state}: the directory {state.parent} does not exist")
        serve(host, port, scheduler, seed, fairness_weight, gather_s, lease_s, None if state is None else str(state))

    app.add_typer(sub, name="flsched")
