"""Job verbs that need no server: ``validate``, ``run`` (an embedded controller) and ``resume``."""

from __future__ import annotations

import json
import signal
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Callable, Optional

import typer
from rich.console import Console

from trainmaster.cli.output import console

from trainmaster.errors import UserError

if TYPE_CHECKING:  # the facade imports the controller and the store: only when a verb runs
    from trainmaster.api import DryRun, LocalTrainmaster, RunResult
    from trainmaster.client import JobStatus
    from trainmaster.backends.base import Backend

FileArg = Annotated[
    Path, typer.Argument(help="Job file: trainmaster/v1 Job, Kubeflow (v1 or Trainer TrainJob) or Volcano YAML/JSON.")
]
RuntimeFilesArg = Annotated[
    Optional[list[Path]],
    typer.Argument(
        help="Kubeflow Trainer runtime files the TrainJob names (else the installed ones: trainmaster runtime add)."
    ),
]
DbOpt = Annotated[
    Optional[str],
    typer.Option(
        "--db", envvar="TRAINMASTER_DB", help="SQLAlchemy URL of the store (default: SQLite in ~/.trainmaster)."
    ),
]
LenientOpt = Annotated[
    bool,
    typer.Option(
        "--lenient", help="Kubeflow/Volcano files: list unknown fields and ignore them instead of refusing the file."
    ),
]
AllowPathOpt = Annotated[
    Optional[list[Path]],
    typer.Option(
        "--allow-path",
        help="A directory that workingDir/output.path may name by absolute path (repeatable; "
        "the current directory always is).",
    ),
]
AllowFrameworkOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "--allow-framework",
        help="ID=TARGET or TARGET: load a framework that is not installed from a module "
        "'pkg.mod:Class' or a file 'path/fw.py' (repeatable).",
    ),
]


class RuntimeChoice(str, Enum):
    """``--runtime`` (the spec's RuntimeKind, without importing the models at CLI start)."""

    HOST = "host"
    CONTAINER = "container"
    AUTO = "auto"


RuntimeOpt = Annotated[
    Optional[RuntimeChoice],
    typer.Option(
        "--runtime",
        envvar="TRAINMASTER_RUNTIME",
        help="Where roles with 'runtime: auto' (converted Kubeflow/Volcano files) run: host or container "
        "(default auto: in a container where podman can run one).",
        case_sensitive=False,
    ),
]


def load_options(  # type: ignore[no-untyped-def]
    lenient: bool,
    allow_path: list[Path] | None,
    allow_framework: list[str] | None,
    runtime: RuntimeChoice | None = None,
    backend: str | None = None,
    db: str | None = None,
):
    """The options of a job verb run by the user on this machine (``run``, ``validate``);
    ``backend``: ``run``'s ``--backend`` (None: the job's own, else local)."""
    from trainmaster.frameworks import allow_frameworks
    from trainmaster.spec.load import LoadOptions
    from trainmaster.spec.model import RuntimeKind
    from trainmaster.spec.paths import PathPolicy

    if allow_framework:
        try:
            allow_frameworks(allow_framework)
        except ValueError as exc:
            raise UserError(f"--allow-framework {exc}") from None
    kind = None if runtime is None else RuntimeKind(runtime.value)
    from trainmaster.spec.compat.trainer import RuntimeDoc
    from trainmaster.store.runtimes import installed_reader

    readers = [installed_reader(db)]
    if backend == "kubernetes":  # a TrainJob may also name a runtime applied to the cluster
        from trainmaster.operator.trainjob import cluster_reader

        readers.append(cluster_reader())

    def installed() -> list[RuntimeDoc]:  # the store's first, then the cluster's
        return [runtime for read in readers for runtime in read()]

    return LoadOptions(
        paths=PathPolicy.for_command_line(allow_path),
        lenient=lenient,
        runtime=kind,
        backend=backend,
        installed_runtimes=installed,
    )


def validate(
    file: FileArg,
    runtime_files: RuntimeFilesArg = None,
    lenient: LenientOpt = False,
    allow_path: AllowPathOpt = None,
    allow_framework: AllowFrameworkOpt = None,
    runtime: RuntimeOpt = None,
) -> None:
    """Check a job file and list every problem with its field path (exit 2 if any)."""
    from trainmaster.loading import load_job

    loaded = load_job(file, load_options(lenient, allow_path, allow_framework, runtime), runtime_files or ())
    job = loaded.job
    for path in loaded.ignored:
        console(stderr=True).print(f"[yellow]ignored:[/] {path}", highlight=False)
    print(
        f"{file}: valid ({job.spec.framework} job '{job.name}', {len(job.spec.roles)} role(s), "
        f"{job.spec.total_replicas} instance(s))"
    )


def make_backend(name: str, cpus: float | None = None, ray_address: str | None = None) -> Backend:
    """The backend named ``name``, built from the ``server`` flags (:func:`trainmaster.backends.registry.make_backend`)."""
    from trainmaster.backends.base import BackendOptions
    from trainmaster.backends.registry import make_backend as build

    return build(name, BackendOptions(cpus=cpus, address=ray_address))


def run(
    file: FileArg,
    runtime_files: RuntimeFilesArg = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print the validated job with every default filled in (as it runs) and the LaunchSpec each "
            "instance would get (two YAML documents), and exit: nothing is stored or started.",
        ),
    ] = False,
    db: DbOpt = None,
    backend: Annotated[
        Optional[str],
        typer.Option(
            help="Where instances run: local (subprocesses), ray, or testbed (the hosts of 'trainmaster testbed up'); "
            "default: the job's spec.scheduling.backend, else local."
        ),
    ] = None,
    interval: Annotated[float, typer.Option(min=0.01, help="Seconds between reconcile passes.")] = 1.0,
    grace: Annotated[float, typer.Option(min=0, help="Seconds between SIGTERM and SIGKILL when stopping.")] = 5.0,
    cpus: Annotated[
        Optional[float], typer.Option(help="CPUs the local backend offers (default: this machine's).")
    ] = None,
    ray_address: Annotated[
        Optional[str], typer.Option(help="Join this Ray cluster (backend ray; default: start one).")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the final status as JSON.")] = False,
    lenient: LenientOpt = False,
    allow_path: AllowPathOpt = None,
    allow_framework: AllowFrameworkOpt = None,
    runtime: RuntimeOpt = None,
) -> None:
    """Run a job to its end with a live view; exit 0 if it succeeded, 1 if it failed or was cancelled."""
    from trainmaster.loading import load_job

    loaded = load_job(
        file, load_options(lenient, allow_path, allow_framework, runtime, backend, db), runtime_files or ()
    )
    wanted = loaded.job.spec.scheduling.backend
    if backend is not None and wanted is not None and wanted.value != backend:
        raise UserError(
            f"--backend {backend} conflicts with the job's spec.scheduling.backend: {wanted.value}; drop one of them"
        )
    backend = backend or (wanted.value if wanted is not None else "local")
    err = console(stderr=True, highlight=False)
    for path in loaded.ignored:
        err.print(f"[yellow]ignored:[/] {path}")
    from trainmaster.api import LocalTrainmaster, RunOptions

    if dry_run:
        print_dry_run(LocalTrainmaster.dry_run(loaded, backend))
        return

    options = RunOptions(backend=backend, interval=interval, grace=grace, cpus=cpus, ray_address=ray_address)
    result = _follow(
        LocalTrainmaster.open(db), lambda facade, ticks, cancel: facade.run(loaded, options, ticks, cancel), json_out
    )
    raise typer.Exit(0 if result.succeeded else 1)


def print_dry_run(plan: DryRun) -> None:
    """The job, then its launches, as two YAML documents (``yaml.safe_load_all`` reads both)."""
    import yaml

    from trainmaster.spec.load import dump_yaml
    from trainmaster.spec.status import with_policies_resolved

    # the job with every default as the controller applies it (status policies expanded)
    print(dump_yaml(with_policies_resolved(plan.job)), end="")
    print("---")
    print(
        "# the LaunchSpec of each instance's first attempt, in start order: $RUN_DIR is the job's folder "
        "(made when it is submitted);\n# host and ports are chosen by the backend when each attempt starts; "
        "the controller's environment is added to env"
    )
    print(yaml.safe_dump({"launches": [spec.to_dict() for spec in plan.launches]}, sort_keys=False), end="")


def _follow(
    facade: LocalTrainmaster,
    drive: Callable[[LocalTrainmaster, Callable[[int], None], Callable[[], bool]], RunResult],
    json_out: bool,
) -> RunResult:
    """Run ``drive`` (the facade's ``run`` or ``resume``) showing the job's status as it goes;
    SIGINT, SIGTERM and SIGHUP (a closed terminal) cancel the job, so no instance outlives the
    command."""
    from rich.live import Live

    from trainmaster.cli.view import event_line, render_status

    out = console(highlight=False)  # without a terminal: nothing wrapped or cut (a JSON result stays one line)
    stop = {"requested": False}

    def request_stop(signum: int, _frame: object) -> None:
        stop["requested"] = True

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, request_stop)
    shown = {"events": 0}

    def print_new_events(status: JobStatus) -> None:
        events = status["events"]
        for ev in events[shown["events"] :]:
            print(event_line(ev), flush=True)
        shown["events"] = len(events)

    def should_cancel() -> bool:
        return stop["requested"]

    if out.is_terminal and not json_out:
        live = Live(console=out, refresh_per_second=4, vertical_overflow="crop")

        def show(job_id: int) -> None:
            live.update(render_status(facade.status(job_id, events=200), width=out.size.width, height=out.size.height))

        with live:
            result = drive(facade, show, should_cancel)
    elif json_out:
        result = drive(facade, lambda _job_id: None, should_cancel)
    else:
        result = drive(facade, lambda job_id: print_new_events(facade.status(job_id, events=200)), should_cancel)
    if json_out:
        print(json.dumps(result.status, indent=2))
    else:
        if not out.is_terminal:
            print_new_events(result.status)
        _print_result(out, result.status)
    return result


def resume(
    job: Annotated[str, typer.Argument(help="Job name (most recent of that name) or id.")],
    db: DbOpt = None,
    interval: Annotated[float, typer.Option(min=0.01, help="Seconds between reconcile passes.")] = 1.0,
    grace: Annotated[float, typer.Option(min=0, help="Seconds between SIGTERM and SIGKILL when stopping.")] = 5.0,
    ray_address: Annotated[Optional[str], typer.Option(help="The Ray cluster the job ran on (backend ray).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the final status as JSON.")] = False,
) -> None:
    """Take over a job whose `trainmaster run` ended before it (kill -9, out of memory) and run it
    to its end: live instances are re-adopted, ended ones handled by their restart policy."""
    from trainmaster.api import LocalTrainmaster, RunOptions

    options = RunOptions(interval=interval, grace=grace, ray_address=ray_address)
    result = _follow(
        LocalTrainmaster.open(db), lambda facade, ticks, cancel: facade.resume(job, options, ticks, cancel), json_out
    )
    raise typer.Exit(0 if result.succeeded else 1)


def _print_result(out: Console, final: JobStatus) -> None:
    out.print(f"job {final['name']} (id {final['id']}) {final['state']}: {final['message']}")
    metrics = Path(final["runDir"] or ".") / "output" / "metrics.json"  # a run's job always has its folder
    if metrics.is_file():
        out.print(f"result: {metrics.read_text().strip()}")
    for inst in final["instances"]:
        if inst["state"] == "failed" and inst.get("message"):
            # the node's own words for a start that failed ("program 'x' not found"), or the exit
            out.print(
                f"{inst['role']}-{inst['index']} {inst.get('reason') or 'failed'}: {inst['message']}", markup=False
            )
        if inst["state"] == "failed" and inst["logPath"] and Path(inst["logPath"]).is_file():
            tail = Path(inst["logPath"]).read_text(errors="replace").splitlines()[-5:]
            out.print(f"last lines of {inst['role']}-{inst['index']} ({inst['logPath']}):")
            for line in tail:
                out.print(f"  {line}", markup=False)
    out.print(f"logs: {final['runDir']}/logs")


def register(app: typer.Typer) -> None:
    """Add the job verbs to the top-level app."""
    app.command()(validate)
    app.command()(run)
    app.command()(resume)
