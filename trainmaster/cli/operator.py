"""CLI of operator mode: ``trainmaster operator``."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Optional

import typer

from trainmaster.errors import UserError


def operator(
    kubeconfig: Optional[str] = typer.Option(
        None,
        help="The cluster's kubeconfig (default: $KUBECONFIG, the pod's service account, the cluster of "
        "`trainmaster cluster up`, ~/.kube/config).",
    ),
    context: Optional[str] = typer.Option(None, help="A context of the kubeconfig (default: its current one)."),
    namespace: str = typer.Option("", help="Watch resources of this namespace only (default: every namespace)."),
    lease_namespace: str = typer.Option(
        "", help="Namespace of the leader-election Lease (default: the pod's namespace, else 'default')."
    ),
    identity: str = typer.Option("", help="This replica's name in the Lease (default: <host>-<pid>)."),
    runtime: str = typer.Option(
        "",
        help="Roles with runtime auto (converted Kubeflow/Volcano files): 'container' runs their image, 'host' this "
        "machine's software in the pod (a cluster of this machine only).",
    ),
    interval: float = typer.Option(1.0, help="Seconds between reconcile passes (a pod's change wakes it at once)."),
    lease_seconds: float = typer.Option(
        8.0, help="Lease duration: a standby takes over this long after the leader stops."
    ),
    install_crds: bool = typer.Option(True, help="Create or update the CRDs at start (needs the RBAC to)."),
    metrics_port: int = typer.Option(0, help="Serve Prometheus metrics on 127.0.0.1:PORT (0: none)."),
    work_dir: Optional[str] = typer.Option(
        None,
        help="Where the leader keeps its throwaway cache and the jobs' folders (default: a temporary folder). "
        "In a pod whose jobs run this machine's software, a hostPath folder.",
    ),
) -> None:
    """Run the operator: jobs are custom resources (TrainingJob, PyTorchJob, TFJob, MPIJob,
    Volcano Job) applied with kubectl; their status is written back. Runs until SIGTERM/SIGINT;
    start two for a standby (a Lease elects the leader).

    Examples:

      trainmaster operator --runtime host

      kubectl apply -f examples/kubeflow-pytorchjob.yaml && kubectl get pytorchjobs
    """
    from trainmaster.operator.operator import Operator, OperatorOptions
    from trainmaster.spec.model import RuntimeKind

    if runtime and runtime not in ("host", "container", "auto"):
        raise UserError(f"--runtime: {runtime!r} must be host, container or auto")
    if interval <= 0 or lease_seconds < 2:
        raise UserError("--interval must be positive and --lease-seconds at least 2")
    if not 0 <= metrics_port <= 65535:
        raise UserError(f"--metrics-port: {metrics_port} is not a port")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    pod_namespace = os.environ.get("POD_NAMESPACE", "")
    options = OperatorOptions(
        kubeconfig=kubeconfig,
        context=context,
        identity=identity,
        lease_namespace=lease_namespace or pod_namespace or "default",
        lease_seconds=lease_seconds,
        namespace=namespace,
        runtime=RuntimeKind(runtime) if runtime else None,
        interval=interval,
        install_crds=install_crds,
        metrics_port=metrics_port,
        work_dir=work_dir,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    Operator(options).run(stop)


def register(app: typer.Typer) -> None:
    """Add the operator command to the top-level app."""
    app.command("operator")(operator)
