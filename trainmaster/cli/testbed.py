"""CLI of the testbed capability: ``trainmaster testbed up | down | status``."""

from __future__ import annotations

import json
from dataclasses import asdict

import typer

from trainmaster.errors import UserError

sub = typer.Typer(
    help="Hosts as network namespaces joined by rate-capped links, on this machine (needs root).\n\n"
    "Examples:\n\n"
    "  trainmaster testbed up --hosts 3 --link 100mbit\n\n"
    "  trainmaster testbed status\n\n"
    "  ip netns exec tm-h1 python3 -m http.server --bind 0.0.0.0 8000\n\n"
    "  trainmaster testbed down",
    no_args_is_help=True,
)

PREFIX_HELP = (
    "Name prefix of the testbed's namespaces (<prefix>-h1, <prefix>-sw); lets several testbeds live side by side."
)


@sub.command()
def up(
    hosts: int = typer.Option(..., "--hosts", "-n", help="Number of hosts (h1..hN), 1-200."),
    link: str = typer.Option(
        "1gbit", help="Rate cap of each host's link, each direction (tc units: 100mbit, 1gbit; none = uncapped)."
    ),
    switch_link: str = typer.Option(
        "none", help="Cap on everything the switch host's own processes send (e.g. a forwarding node's fan-out)."
    ),
    mtu: int = typer.Option(9000, help="MTU of every link (big datagrams need a big MTU)."),
    prefix: str = typer.Option("tm", help=PREFIX_HELP),
) -> None:
    """Create a testbed (an older one with the same prefix is removed first).

    Example: trainmaster testbed up --hosts 4 --link 100mbit"""
    from trainmaster.testbed import Testbed, TestbedOptions, parse_rate

    options = TestbedOptions(
        hosts=hosts,
        link_rate=parse_rate(link, "--link"),
        switch_link_rate=parse_rate(switch_link, "--switch-link"),
        mtu=mtu,
        prefix=prefix,
    )
    bed = _network_errors(lambda: Testbed.up(options))
    _print_status(bed.status(), as_json=False)


@sub.command()
def down(prefix: str = typer.Option("tm", help=PREFIX_HELP)) -> None:
    """Remove the testbed: its namespaces, links and qdiscs (nothing left if already gone).

    Example: trainmaster testbed down"""
    from trainmaster.testbed import remove

    removed = _network_errors(lambda: remove(prefix))
    print(f"removed {len(removed)} namespace(s)" + (f": {', '.join(removed)}" if removed else ""))


@sub.command()
def status(
    prefix: str = typer.Option("tm", help=PREFIX_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Show hosts, addresses, link caps and the bytes each link carried.

    Example: trainmaster testbed status --json"""
    from trainmaster.testbed import Testbed, iproute

    iproute.require_root_and_tools()
    bed = Testbed.load(prefix)
    _print_status(_network_errors(bed.status), as_json)


def _network_errors(action):  # type: ignore[no-untyped-def]
    """A failing ip/tc command is the machine's refusal, not a bug: one clear line, exit 2."""
    from trainmaster.testbed.iproute import NetworkCommandError

    try:
        return action()
    except NetworkCommandError as exc:
        raise UserError(f"{exc} (network namespaces, veth or tbf may be unavailable here)") from None


def _print_status(state, as_json: bool) -> None:  # type: ignore[no-untyped-def]
    if as_json:
        print(json.dumps(asdict(state)))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"testbed {state.prefix}: {state.subnet}, links {state.link_rate}, "
        f"MTU {state.mtu}" + ("" if state.present else " (INCOMPLETE: run 'trainmaster testbed down' and up again)")
    )
    for column in ("host", "namespace", "address", "device", "cap up", "cap down", "bytes up", "bytes down"):
        table.add_column(
            column,
            justify="right" if column.startswith("bytes") else "left",
            no_wrap=column in ("address", "namespace"),
        )
    for m in state.members:
        c = m.counters
        table.add_row(
            m.name,
            m.namespace,
            m.address,
            m.device,
            m.up_cap,
            m.down_cap,
            str(c.up_bytes) if c else "-",
            str(c.down_bytes) if c else "-",
        )
    Console().print(table)


def register(app: typer.Typer) -> None:
    """Add this capability's commands to the top-level app."""
    app.add_typer(sub, name="testbed")
