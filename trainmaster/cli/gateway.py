"""CLI of the gateway capability: ``gateway init|serve``, ``party serve``, ``task run``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from trainmaster.errors import UserError

gateway_app = typer.Typer(
    help="Cross-silo task gateway: provision identities and run the gateway service.", no_args_is_help=True
)
party_app = typer.Typer(
    help="Party agent: holds data files and runs registered rules in per-task executors.", no_args_is_help=True
)
task_app = typer.Typer(help="Initiator: start a cross-silo task and print its decrypted results.", no_args_is_help=True)


@gateway_app.command("init")
def gateway_init(
    out_dir: Path = typer.Argument(..., help="Directory to write the CA, certificates, keys, roster and configs to."),
    parties: str = typer.Option(..., "--parties", help="Comma-separated party names, e.g. a,b,c."),
    initiators: str = typer.Option(
        "initiator",
        "--initiators",
        help="Comma-separated initiator names (each gets its own "
        "client-only certificate and keys; tasks belong to the initiator that created them).",
    ),
    host: str = typer.Option("127.0.0.1", help="Address every service listens on (goes into certificates)."),
    port_base: int = typer.Option(8443, help="Gateway port; party i listens on port_base+1+i."),
    hosts: str = typer.Option(
        "",
        "--hosts",
        help="Per-service host when services run on separate machines, e.g. "
        "gateway=gw.example.org,a=10.0.0.12 (endpoint, listen address and certificate name); "
        "services not named use --host.",
    ),
) -> None:
    """Create a private CA, TLS certificates, Ed25519/X25519 keys per identity, a roster and configs."""
    from trainmaster.gateway.crypto.provision import init_deployment

    names = [p.strip() for p in parties.split(",") if p.strip()]
    inits = [i.strip() for i in initiators.split(",") if i.strip()]
    per_host: dict[str, str] = {}
    for item in filter(None, (h.strip() for h in hosts.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise UserError(f"invalid --hosts entry {item!r}", details=["write NAME=HOST, e.g. gateway=gw.example.org"])
        per_host[name.strip()] = value.strip()
    configs = init_deployment(out_dir, names, host=host, port_base=port_base, initiators=inits, hosts=per_host)
    for name, path in configs.items():
        typer.echo(f"{name:>12}: {path}")


@gateway_app.command("serve")
def gateway_serve(
    config: Path = typer.Option(..., "--config", help="The gateway's config.yaml from `gateway init`."),
) -> None:
    """Run the gateway on one mutual-TLS port."""
    from trainmaster.gateway.relay.app import build_gateway_app
    from trainmaster.gateway.config import load_config
    from trainmaster.gateway.net.service import serve

    cfg = load_config(config)
    if cfg.role != "gateway":
        raise UserError(f"{config} is a {cfg.role} config, not the gateway's")
    serve(build_gateway_app(cfg), cfg)


@party_app.command("serve")
def party_serve(
    config: Path = typer.Option(..., "--config", help="This party's config.yaml from `gateway init`."),
    data: Path = typer.Option(
        ..., "--data", help="Directory of <data_id>.csv or <data_id>.parquet files this party holds."
    ),
    isolation: Optional[str] = typer.Option(
        None, "--isolation", help="Override the config's isolation: sandbox (bubblewrap, the default) or process."
    ),
) -> None:
    """Run a party agent on its mutual-TLS port."""
    from trainmaster.gateway.party.app import build_party_app
    from trainmaster.gateway.config import load_config
    from trainmaster.gateway.net.service import serve

    cfg = load_config(config)
    if cfg.role != "party":
        raise UserError(f"{config} is a {cfg.role} config, not a party's")
    if isolation is not None:
        if isolation not in ("sandbox", "process"):
            raise UserError(f"--isolation must be sandbox or process, not {isolation!r}")
        cfg = cfg.model_copy(update={"isolation": isolation})
    if not data.is_dir():
        raise UserError(f"data directory not found: {data}")
    serve(build_party_app(cfg, data), cfg)


@task_app.command("run")
def task_run(
    task_file: Path = typer.Argument(
        ..., help="TASK.yaml: task_id, leg_timeout_s and legs (data_id, party, rule, params)."
    ),
    config: Path = typer.Option(..., "--config", help="The initiator's config.yaml from `gateway init`."),
    out: Path = typer.Option(
        None,
        "--out",
        help="Folder for streamed (large) results, one <task>/<data_id>.json "
        "file each; default: results/ under the initiator's state_dir.",
    ),
) -> None:
    """Create the task at the gateway and its legs at the parties, fetch results through the gateway
    (retrying while a service is down, until the task's deadline), print them as JSON.

    Exit 0 when every leg has a verified result, 1 when some leg has another outcome, 2 for a
    mistake in the input (including a task id used before for another task), 3 when the gateway
    stayed unreachable until the deadline."""
    from trainmaster.gateway.initiator.client import Initiator
    from trainmaster.gateway.initiator.taskfile import load_task
    from trainmaster.gateway.config import load_config

    cfg = load_config(config)
    if cfg.role != "initiator":
        raise UserError(f"{config} is a {cfg.role} config, not an initiator's")
    spec = load_task(task_file)
    initiator = Initiator(cfg, results_dir=out)
    try:
        report = initiator.run_task(spec)
    finally:
        initiator.close()
    typer.echo(json.dumps(report, indent=2))
    if any(leg["outcome"] != "result" for leg in report["legs"].values()):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add the gateway, party and task groups to the top-level app."""
    app.add_typer(gateway_app, name="gateway")
    app.add_typer(party_app, name="party")
    app.add_typer(task_app, name="task")
