"""CLI of the cluster capability: ``trainmaster cluster build | up | status | down | manifests``."""

from __future__ import annotations

import json
from dataclasses import asdict

import typer

from trainmaster.errors import UserError

sub = typer.Typer(
    help="A real Kubernetes cluster on this machine (needs root and `make k8s-deps`), and the manifests "
    "that run Trainmaster's operator on any cluster.\n\n"
    "Examples:\n\n"
    "  trainmaster cluster up --nodes 2\n\n"
    "  export KUBECONFIG=$(trainmaster cluster status --kubeconfig)\n\n"
    "  kubectl get nodes\n\n"
    "  trainmaster cluster manifests | kubectl apply -f -\n\n"
    "  trainmaster cluster down",
    no_args_is_help=True,
)

NAME_HELP = "Name of the cluster (1-6 lowercase letters/digits); every namespace, link and cgroup carries it."


@sub.command()
def build() -> None:
    """Build the Kubernetes binaries once into /var/cache/trainmaster (what `make k8s-deps` runs).

    Example: trainmaster cluster build"""
    from trainmaster.cluster.binaries import build as run_build

    code = run_build()
    if code != 0:
        raise typer.Exit(code)


@sub.command()
def up(
    nodes: int = typer.Option(1, "--nodes", "-n", help="Number of nodes (kubelets), 1-8."),
    name: str = typer.Option("tm", help=NAME_HELP),
) -> None:
    """Start etcd, the control plane and N nodes; write a kubeconfig; import the images.

    An older cluster with the same name is removed first.

    Example: trainmaster cluster up --nodes 2"""
    from trainmaster.cluster import Cluster, ClusterOptions

    cluster = _errors(lambda: Cluster.up(ClusterOptions(name=name, nodes=nodes), progress=_say))
    _print_status(cluster.status(), as_json=False)
    print(f"\nexport KUBECONFIG={cluster.layout.kubeconfig}")


@sub.command()
def status(
    name: str = typer.Option("tm", help=NAME_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    kubeconfig: bool = typer.Option(False, "--kubeconfig", help="Print only the kubeconfig's path."),
    api: bool = typer.Option(False, "--api", help="Print only the API server's host:port."),
) -> None:
    """Show the control plane's daemons and each node (Ready, pids).

    Example: trainmaster cluster status --json"""
    from trainmaster.cluster import Cluster

    cluster = Cluster.load(name)
    if kubeconfig:
        print(cluster.layout.kubeconfig)
        return
    if api:
        print(f"{cluster.layout.api_address}:{cluster.layout.api_port}")
        return
    _print_status(cluster.status(), as_json)


@sub.command()
def down(name: str = typer.Option("tm", help=NAME_HELP)) -> None:
    """Stop every daemon and pod of the cluster and remove its links, namespaces and cgroups.

    Example: trainmaster cluster down"""
    from trainmaster.cluster import remove

    removed = _errors(lambda: remove(name))
    print(f"removed cluster {name}: {len(removed)} item(s)" + (f" ({', '.join(removed)})" if removed else ""))


@sub.command()
def manifests(
    image: str = typer.Option(
        "",
        help="The operator's image (default: this installation's python image, which mounts this machine's "
        "Python; a cluster of other machines needs an image with trainmaster installed).",
    ),
    namespace: str = typer.Option("trainmaster-system", help="Namespace of the operator's Deployment."),
    replicas: int = typer.Option(2, help="Operator replicas (one leads, on a coordination.k8s.io Lease)."),
    api_address: str = typer.Option(
        "",
        help="host:port where pods reach the API server, on a cluster without kube-proxy (one of `trainmaster "
        "cluster up`: `trainmaster cluster status --api`).",
    ),
    runtime: str = typer.Option(
        "host", help="The operator's --runtime for roles with runtime auto (host or container)."
    ),
) -> None:
    """Print the CRDs, the least-privilege RBAC and the operator's Deployment as YAML.

    Example: trainmaster cluster manifests --api-address $(trainmaster cluster status --api) | kubectl apply -f -"""
    import yaml

    from trainmaster.operator.manifests import ManifestOptions, operator_manifests

    if runtime not in ("host", "container", "auto"):
        raise UserError(f"--runtime: {runtime!r} must be host, container or auto")
    if replicas < 1:
        raise UserError("--replicas must be at least 1")
    options = ManifestOptions(
        image=image, namespace=namespace, replicas=replicas, api_address=api_address, runtime=runtime
    )
    print(yaml.safe_dump_all(_errors(lambda: operator_manifests(options)), sort_keys=False), end="")


def _say(line: str) -> None:
    print(f"==> {line}", flush=True)


def _errors(action):  # type: ignore[no-untyped-def]
    """A failing ip command or a daemon that never got ready: one clear line, exit 2."""
    from trainmaster.testbed.iproute import NetworkCommandError

    try:
        return action()
    except NetworkCommandError as exc:
        raise UserError(f"{exc} (network namespaces or veth links may be unavailable here)") from None
    except RuntimeError as exc:
        raise UserError(f"the cluster could not start: {exc}", exit_code=1) from None


def _print_status(state, as_json: bool) -> None:  # type: ignore[no-untyped-def]
    if as_json:
        print(json.dumps(asdict(state)))
        return
    from rich.console import Console
    from rich.table import Table

    import sys

    console = Console(width=None if sys.stdout.isatty() else 160)  # piped: whole names, not cut columns
    console.print(
        f"cluster {state.name}: Kubernetes {state.version}, API {state.server} "
        f"({'ready' if state.api_ready else 'NOT answering'}), network {state.subnet}"
    )
    console.print(f"kubeconfig: {state.kubeconfig}")
    daemons = ", ".join(f"{name} {pid or 'STOPPED'}" for name, pid in state.daemons.items())
    console.print(f"control plane (pids): {daemons}")
    table = Table()
    for column in ("node", "address", "network namespace", "ready", "kubelet pid", "containerd pid"):
        table.add_column(column, no_wrap=True)
    for n in state.nodes:
        table.add_row(
            n.name,
            n.address,
            n.namespace,
            "Ready" if n.ready else "NotReady",
            str(n.kubelet_pid or "-"),
            str(n.containerd_pid or "-"),
        )
    console.print(table)


def register(app: typer.Typer) -> None:
    """Add this capability's commands to the top-level app."""
    app.add_typer(sub, name="cluster")
