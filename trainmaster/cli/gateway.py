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
    port_base: int = typer.Option(
        8443,
        help="Gateway port; party i listens on port_base+1+i; with N parties the stream ports follow: the gateway's at port_base+1+N, party i's at port_base+2+N+i.",
    ),
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
        help="Folder for large results, one <task>/<data_id>.json (or .bin) "
        "file each; default: results/ under the initiator's state_dir.",
    ),
    fresh: bool = typer.Option(
        False,
        "--fresh",
        help="Refuse (exit 2) if the task file's task_id was used by an earlier run, instead of "
        "showing that run's stored results.",
    ),
) -> None:
    """Create the task at the gateway and its legs at the parties, send the legs' inputs, fetch
    results through the gateway (retrying while a service is down, until the task's deadline),
    print them as JSON.

    A task_id an earlier run created is not run again: its stored results are shown, and a line on
    stderr and the report's "earlier_run" say so and when it ran (--fresh refuses instead).

    Exit 0 when every leg has a verified result, 1 when some leg has another outcome, 2 for a
    mistake in the input (including a task id used before for another task), 3 when the gateway
    stayed unreachable until the deadline.

    Example: trainmaster task run --config deploy/alice/config.yaml task.yaml --fresh"""
    from trainmaster.gateway.initiator.client import Initiator
    from trainmaster.gateway.initiator.taskfile import load_task
    from trainmaster.gateway.config import load_config

    cfg = load_config(config)
    if cfg.role != "initiator":
        raise UserError(f"{config} is a {cfg.role} config, not an initiator's")
    spec = load_task(task_file)
    initiator = Initiator(cfg, results_dir=out)
    try:
        report = initiator.run_task(spec, fresh=fresh)
    finally:
        initiator.close()
    typer.echo(json.dumps(report, indent=2))
    if any(leg["outcome"] != "result" for leg in report["legs"].values()):
        raise typer.Exit(1)


audit_app = typer.Typer(
    help="The audit logs of the gateway and the parties: check them, or read a running service's.",
    no_args_is_help=True,
)
gateway_app.add_typer(audit_app, name="audit")


@audit_app.command("verify")
def audit_verify(
    log: Path = typer.Argument(..., help="An audit log: <state_dir>/audit.log of the gateway or a party."),
    roster: Optional[Path] = typer.Option(
        None, "--roster", help="roster.json: check every line's signature with the service's public key."
    ),
    service: Optional[str] = typer.Option(
        None, "--service", help="Whose log it is (its name in the roster; default: the log's own lines say)."
    ),
    head: Optional[str] = typer.Option(
        None,
        "--head",
        help="SEQ:HASH taken earlier (e.g. from `audit show`): the log must still reach it "
        "(default: the head recorded beside the log).",
    ),
) -> None:
    """Check an audit log: every line's hash, the chain to the line before, seq order and gaps, the
    signatures (with --roster) and the end against the recorded head. Prints each problem by line.

    Exit 0 when the log is intact, 1 when a line was edited, removed, reordered or cut off, 2 for a
    mistake in the input.

    Example: trainmaster gateway audit verify deploy/gateway/state/audit.log --roster deploy/roster.json"""
    from trainmaster.gateway.audit.log import verify
    from trainmaster.gateway.crypto.provision import load_roster

    if not log.is_file():
        raise UserError(f"audit log not found: {log}", details=["give <state_dir>/audit.log of the gateway or a party"])
    signer = None
    if roster is not None:
        if not roster.is_file():
            raise UserError(f"roster not found: {roster}")
        members = load_roster(roster)
        name = service or _log_service(log)
        if name not in members:
            raise UserError(f"{name!r} is not in {roster}", details=[f"members: {', '.join(sorted(members))}"])
        signer = members[name]
    anchor = None
    if head is not None:
        seq, sep, digest = head.partition(":")
        if not sep or not seq.isdigit() or len(digest) != 64:
            raise UserError(f"invalid --head {head!r}", details=["write SEQ:HASH, e.g. 120:3f5a... (64 hex digits)"])
        anchor = (int(seq), digest)
    verdict = verify(log, signer, anchor)
    typer.echo(
        json.dumps(
            {
                "log": str(log),
                "ok": verdict.ok,
                "lines": verdict.lines,
                "head": f"{verdict.seq}:{verdict.head}",
                "signatures": "checked" if signer else "not checked (give --roster)",
                "problems": verdict.problems,
            },
            indent=2,
        )
    )
    if not verdict.ok:
        raise typer.Exit(1)


def _log_service(log: Path) -> str:
    """The service named by the log's first line."""
    with log.open("rb") as fh:
        for raw in fh:
            try:
                return str(json.loads(raw)["service"])
            except (ValueError, KeyError, TypeError):
                continue
    raise UserError(f"{log} holds no audit entry naming its service", details=["give --service NAME"])


@audit_app.command("show")
def audit_show(
    config: Path = typer.Option(..., "--config", help="The operator's config.yaml from `gateway init`."),
    service: str = typer.Option("gateway", "--service", help="Whose log: gateway, or a party's name."),
    task: Optional[str] = typer.Option(None, "--task", help="Only this task's entries."),
    after: int = typer.Option(0, "--after", help="Only entries after this seq."),
    limit: int = typer.Option(200, "--limit", help="At most this many entries."),
) -> None:
    """Read a running service's audit log over mutual TLS (the operator identity only), with the
    service's own check of the whole log.

    Example: trainmaster gateway audit show --config deploy/operator/config.yaml --service a --task t1"""
    import httpx

    from trainmaster.gateway.config import load_config
    from trainmaster.gateway.crypto.provision import load_roster
    from trainmaster.gateway.net.tls import client_ssl_context, expect

    cfg = load_config(config)
    if cfg.role != "operator":
        raise UserError(f"{config} is a {cfg.role} config; the audit log is read with the operator's")
    roster = load_roster(cfg.roster)
    member = roster.get(service)
    if member is None or member.role not in ("gateway", "party") or not member.endpoint:
        raise UserError(f"{service!r} is not the gateway or a party of this deployment")
    params: dict[str, str | int] = {"after": after, "limit": limit, "verify": "true"}
    if task:
        params["task_id"] = task
    try:
        with httpx.Client(verify=client_ssl_context(cfg), timeout=60.0) as http:
            resp = http.get(f"{member.endpoint}/v1/audit", params=params, extensions=expect(service, member.role))
    except httpx.TransportError as exc:
        raise UserError(f"{service} at {member.endpoint} is unreachable: {type(exc).__name__}", exit_code=3) from exc
    if resp.status_code != 200:
        raise UserError(f"{service} refused ({resp.status_code}): {resp.text[:300]}")
    typer.echo(json.dumps(resp.json(), indent=2))


def register(app: typer.Typer) -> None:
    """Add the gateway, party and task groups to the top-level app."""
    app.add_typer(gateway_app, name="gateway")
    app.add_typer(party_app, name="party")
    app.add_typer(task_app, name="task")
