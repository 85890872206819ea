"""CLI of the aggregation capability: the fault-injection demo and the standalone node roles."""

from __future__ import annotations

import json
import os
import signal
from typing import TYPE_CHECKING

import typer

from trainmaster.errors import UserError

if TYPE_CHECKING:
    from trainmaster.aggregation.node import DatagramNode

sub = typer.Typer(help="Gradient aggregation through forwarding nodes and a parameter node.", no_args_is_help=True)


def _probability(name: str, value: float) -> float:
    if not 0.0 <= value < 1.0:
        raise UserError(f"--{name} must be a probability in [0, 1), got {value}")
    return value


def _transport(name: str) -> str:
    from trainmaster.aggregation.transport import TRANSPORTS

    if name not in TRANSPORTS:
        raise UserError(f"--transport must be one of {', '.join(TRANSPORTS)}, got {name!r}")
    return name


@sub.command()
def demo(
    workers: int = typer.Option(4, help="Workers per job (1-64)."),
    jobs: int = typer.Option(1, help="Jobs sharing the forwarding nodes (multi-tenant)."),
    elements: int = typer.Option(100_000, help="float32 elements per tensor."),
    rounds: int = typer.Option(2, help="allreduce calls per worker."),
    drop: float = typer.Option(0.0, help="Probability of dropping each datagram, per link."),
    duplicate: float = typer.Option(0.0, help="Probability of duplicating each datagram."),
    reorder: float = typer.Option(0.0, help="Probability of holding a datagram back a few ms."),
    delay: float = typer.Option(0.0, help="Probability of delaying a datagram up to 10 ms."),
    overflow: bool = typer.Option(
        False,
        help="Large values in every 5th slice so that sums overflow and the float fallback runs "
        "(int32: a fixed scale; int8/int16: values outgrow the scale the previous round set).",
    ),
    precision: str = typer.Option(
        "int32", help="int32 (block floating point), or int16 / int8: low-bit aggregation with a shared scale."
    ),
    results: str = typer.Option(
        "",
        help="How the sums come down: exact, or int8 (re-quantised by the parameter node); "
        "default int8 with --precision int8, else exact.",
    ),
    slots: int = typer.Option(64, help="Aggregator slots per forwarding node."),
    levels: int = typer.Option(
        1, help="1: one forwarding node; 2: two first-level nodes under a second-level node that also has workers."
    ),
    chunk: int = typer.Option(4096, help="Elements per packet (up to 262135 on udp, 2097136 on shm)."),
    seed: int = typer.Option(0, help="Seed of the inputs and of every link's fault injector."),
    timeout: float = typer.Option(60.0, help="Seconds without progress before a worker fails."),
    transport: str = typer.Option("udp", help="udp, or shm: shared-memory rings for large packets (same host)."),
    siblings: int = typer.Option(1, help="Forwarding nodes directly under the parameter node (with --levels 1)."),
    mtu: int = typer.Option(
        0, help="Cut packets into datagrams of at most this MTU (576-65536; 0: each path's own, 65536 on loopback)."
    ),
    per_datagram: bool = typer.Option(
        False, help="Inject the faults into each datagram of a cut packet instead of the packet as a whole."
    ),
    partitions: int = typer.Option(
        0, help="0: the jobs share every forwarding node's slots; N: each pool split statically into N parts."
    ),
    kill: str = typer.Option(
        "", help="Process fault: ps, switch, switch:I or worker:R kills itself at the moment --kill-after chooses."
    ),
    kill_after: int = typer.Option(
        50, help="Packets the --kill victim handles before the signal (received for a node, sent for a worker)."
    ),
    kill_signal: str = typer.Option("KILL", help="KILL, or STOP (the process freezes)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Start the tier and workers as processes, reduce random tensors under injected faults
    and check every result: the fabric's integer sums against every worker's quantised values
    (exact, element by element, where the workers shared a scale) and the float result against
    the exact float64 sum (within the stated quantisation bound). Exits 1 if any check fails."""
    from trainmaster.aggregation.demo import DemoConfig, run_demo
    from trainmaster.aggregation.protocol import HEADER_SIZE, MAX_WORKERS
    from trainmaster.aggregation.transport import SHM_MAX_ELEMENTS, TRANSPORTS, UDP_MAX_PACKET, FaultPlan

    udp_max = (UDP_MAX_PACKET - HEADER_SIZE) // 4

    problems = []
    if not 1 <= workers <= MAX_WORKERS:
        problems.append(f"--workers must be between 1 and {MAX_WORKERS}")
    if jobs < 1 or elements < 1 or rounds < 1:
        problems.append("--jobs, --elements and --rounds must be at least 1")
    if levels not in (1, 2):
        problems.append("--levels must be 1 or 2")
    if not 1 <= slots <= 65535:
        problems.append("--slots must be between 1 and 65535")
    from trainmaster.aggregation.worker import PRECISIONS, RESULT_PRECISIONS

    if precision not in PRECISIONS:
        problems.append(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if results and results not in RESULT_PRECISIONS:
        problems.append(f"--results must be one of {', '.join(RESULT_PRECISIONS)}, got {results!r}")
    if transport not in TRANSPORTS:
        problems.append(f"--transport must be one of {', '.join(TRANSPORTS)}")
    elif transport == "udp" and not 1 <= chunk <= udp_max:
        problems.append(f"--chunk must be between 1 and {udp_max} on udp")
    elif not 1 <= chunk <= SHM_MAX_ELEMENTS:
        problems.append(f"--chunk must be between 1 and {SHM_MAX_ELEMENTS} on shm")
    if not 0 <= partitions <= slots:
        problems.append(f"--partitions must be between 0 and --slots ({slots})")
    if mtu and not 576 <= mtu <= 65536:
        problems.append(f"--mtu must be 0 or between 576 and 65536, got {mtu}")
    if not 1 <= siblings <= 16 or (siblings > 1 and levels != 1):
        problems.append("--siblings must be between 1 and 16, and more than 1 only with --levels 1")
    plan = None
    if kill:
        from trainmaster.aggregation.kills import KillPlan

        try:
            plan = KillPlan(kill, kill_after, kill_signal.upper())
        except ValueError as exc:
            problems.append(f"--kill: {exc}")
    if problems:
        raise UserError("invalid demo options", details=problems)
    faults = FaultPlan(
        drop=_probability("drop", drop),
        duplicate=_probability("duplicate", duplicate),
        reorder=_probability("reorder", reorder),
        delay=_probability("delay", delay),
        seed=seed,
        per_datagram=per_datagram,
    )
    cfg = DemoConfig(
        workers=workers,
        jobs=jobs,
        elements=elements,
        rounds=rounds,
        slots=slots,
        levels=levels,
        overflow=overflow,
        chunk=chunk,
        seed=seed,
        faults=faults,
        timeout=timeout,
        transport=transport,
        siblings=siblings,
        kill=plan,
        precision=precision,
        results=results or None,
        mtu=mtu or None,
        partitions=partitions,
    )
    result = run_demo(cfg)
    if as_json:
        print(json.dumps(result))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="aggregation demo")
        table.add_column("measure")
        table.add_column("value", justify="right")
        for key, value in result.items():
            if key != "config":
                table.add_row(key, str(value))
        Console().print(table)
    if not result["ok"]:
        raise typer.Exit(1)


@sub.command("parameter-node")
def parameter_node(
    host: str = typer.Option("127.0.0.1", envvar="TM_AGGREGATION_HOST", help="Address to bind."),
    port: int = typer.Option(0, envvar="TM_AGGREGATION_PORT", help="UDP port (0: any free port, printed)."),
    dead_after: float = typer.Option(
        10.0,
        help="Seconds without a control message (HELLO, heartbeat, BYE: retransmitted "
        "until acknowledged) before a waited-for worker on another host is dead (a worker on "
        "this host is watched through its process).",
    ),
    stalled_after: float = typer.Option(
        2.0, help="Seconds a same-host worker may be stopped (SIGSTOP) and silent before the job is aborted naming it."
    ),
    transport: str = typer.Option(
        "udp", envvar="TM_AGGREGATION_TRANSPORT", help="udp, or shm (shared-memory rings, same host)."
    ),
) -> None:
    """Run a parameter node in the foreground (verifies sums, aggregates fallbacks)."""
    from trainmaster.aggregation.parameter_node import ParameterNode

    if dead_after <= 0 or stalled_after <= 0:
        raise UserError("--dead-after and --stalled-after must be positive numbers of seconds")
    node = ParameterNode(
        host, port, dead_after=dead_after, transport=_transport(transport), stalled_after=stalled_after
    )
    print(f"parameter node listening on {node.address[0]}:{node.address[1]} ({transport})", flush=True)
    _serve_publishing(node, "parameter node")


@sub.command("forwarding-node")
def forwarding_node(
    parent: str = typer.Option(
        ..., envvar="TM_AGGREGATION_PARENT", help="HOST:PORT of the parameter node or upper node."
    ),
    slots: int = typer.Option(64, envvar="TM_AGGREGATION_SLOTS", help="Aggregator slots."),
    host: str = typer.Option("127.0.0.1", envvar="TM_AGGREGATION_HOST", help="Address to bind."),
    port: int = typer.Option(0, envvar="TM_AGGREGATION_PORT", help="UDP port (0: any free port, printed)."),
    transport: str = typer.Option(
        "udp", envvar="TM_AGGREGATION_TRANSPORT", help="udp, or shm (shared-memory rings, same host)."
    ),
    partitions: int = typer.Option(
        0,
        envvar="TM_AGGREGATION_PARTITIONS",
        help="0: every job's slices share the whole pool (multi-tenant slots); N: the pool split "
        "statically into N equal parts, one per job.",
    ),
    multicast: bool = typer.Option(
        True,
        envvar="TM_AGGREGATION_MULTICAST",
        help="Send each result once to the job's multicast group for the workers on this node's "
        "segment that joined it (the bridge replicates it); off: one unicast copy per worker.",
    ),
    multicast_network: str = typer.Option(
        "239.192.0.0/16",  # multicast.DEFAULT_NETWORK (the aggregation package loads lazily here)
        envvar="TM_AGGREGATION_MULTICAST_NETWORK",
        help="Range of IPv4 multicast groups the jobs' groups are taken from (alike at every node and worker).",
    ),
) -> None:
    """Run a forwarding node (software switch) in the foreground."""
    from trainmaster.aggregation.multicast import parse_network
    from trainmaster.aggregation.switch import ForwardingNode

    h, _, p = parent.rpartition(":")
    if not h or not p.isdigit():
        raise UserError(f"--parent must be HOST:PORT, got {parent!r}")
    if not 1 <= slots <= 65535 or not 0 <= partitions <= slots:
        raise UserError(f"--slots must be 1-65535 and --partitions 0-{slots}, got {slots} and {partitions}")
    try:
        parse_network(multicast_network)
    except ValueError as exc:
        raise UserError(f"--multicast-network: {exc}") from None
    node = ForwardingNode(
        (h, int(p)),
        slots=slots,
        host=host,
        port=port,
        transport=_transport(transport),
        partitions=partitions,
        multicast=multicast,
        multicast_network=multicast_network,
    )
    print(f"forwarding node listening on {node.address[0]}:{node.address[1]} ({transport})", flush=True)
    _serve_publishing(node, f"forwarding node {os.environ.get('TM_REPLICA_INDEX', '0')}")


def _serve_publishing(node: DatagramNode, label: str) -> None:
    """Serve until a SHUTDOWN or SIGTERM, publishing the node's counters every 2 s and once more
    at the end. SIGTERM (how the controller stops a node's role once its job has ended) makes
    ``serve`` return, so that last sample is the final one; killed by the signal, the node left
    its last periodic sample, which may predate every sum of the job."""
    from trainmaster.runtime.views import PeriodicPublisher, numbers

    signal.signal(signal.SIGTERM, lambda *_: node.stop())
    with PeriodicPublisher("aggregation.counters", lambda: {"node": label, **numbers("", node.stats())}):
        node.serve()


def register(app: typer.Typer) -> None:
    """Add this capability's commands to the top-level app."""
    app.add_typer(sub, name="aggregation")
