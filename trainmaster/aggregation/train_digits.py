"""The digits MLP trained data-parallel, gradients averaged through the aggregation fabric (the
``ina`` worker role) or, with ``--allreduce gloo``, through gloo's all-reduce (the anchor, run
by the ``pytorch`` framework on the same hosts): one script, so both variants share the data,
model, loop and timing, and only the gradient averaging differs.

Reuses ``trainmaster.workloads.digits`` (data, model, training loop). On the fabric all
gradients are flattened into one vector and sent with one ``allreduce``; on gloo each tensor
goes with its own ``all_reduce`` (what ``workloads.digits`` does). Rank 0 writes
``metrics.json`` (test accuracy, seconds per epoch) to ``TM_OUTPUT_DIR``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from trainmaster.workloads import digits


def fabric_average(client: object) -> Callable[[torch.nn.Module], None]:
    """Average gradients with one fabric ``allreduce`` of all of them, flattened."""

    def average(model: torch.nn.Module) -> None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        summed = client.allreduce(flat, key="gradients") / client.world  # type: ignore[attr-defined]
        offset = 0
        for g in grads:
            g.copy_(summed[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    return average


def gloo_interface(host: str) -> str | None:
    """The network interface that holds ``host`` (this instance's ``TM_HOST``), or None.

    gloo picks its interface from the machine's hostname, which resolves to 127.0.0.1 inside
    a testbed host: every rank then tries to reach the others on loopback, where they are not
    (``connectFullMesh ... Connection refused``). Naming the interface (``GLOO_SOCKET_IFNAME``)
    makes it use the host's own link, as the benchmark does."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == host for a in addresses):
            return name
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument(
        "--allreduce",
        choices=("fabric", "gloo"),
        default="fabric",
        help="fabric: the ina framework's forwarding and parameter nodes "
        "(TM_AGGREGATION_*); gloo: torch.distributed (MASTER_ADDR, ...)",
    )
    args = parser.parse_args()
    if args.epochs < 1 or args.batch < 1 or args.lr <= 0:
        parser.error("--epochs and --batch must be at least 1 and --lr above 0")
    started = time.time()
    client = None
    stats: dict[str, object] = {}
    if args.allreduce == "fabric":
        from trainmaster.aggregation.torch_hook import client_from_env

        client = client_from_env()  # joined: every worker of the job is there
        rank, world = client.rank, client.world
        average = fabric_average(client)
    else:
        import torch.distributed as dist

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        interface = gloo_interface(os.environ.get("TM_HOST", ""))
        if interface is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        average = digits.gloo_average
    try:
        # the training loop alone is timed: start-up (imports, joining) differs between the
        # variants and is not what the all-reduce changes
        trained = time.perf_counter()
        _, acc = digits.train(args.epochs, args.batch, args.lr, rank, world, average)
        epoch_s = (time.perf_counter() - trained) / args.epochs
        if client is not None:
            stats = client.stats()
    finally:
        if client is not None:
            client.close()
        else:
            import torch.distributed as dist

            dist.barrier()  # no rank leaves while another still reads from it
            dist.destroy_process_group()
    resent = f", retransmits {stats['retransmits']}" if stats else ""
    print(
        f"rank {rank}/{world} ({args.allreduce}): test accuracy {acc:.4f}, {epoch_s:.3f} s per epoch{resent}",
        flush=True,
    )
    if rank == 0:
        out = Path(os.environ.get("TM_OUTPUT_DIR", "."))
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(
            json.dumps(
                {
                    "test_accuracy": round(acc, 4),
                    "world_size": world,
                    "epochs": args.epochs,
                    "allreduce": args.allreduce,
                    "seconds_per_epoch": round(epoch_s, 4),
                    "transport": "aggregation fabric" if client is not None else "gloo",
                    "seconds": round(time.time() - started, 2),
                }
            )
        )


if __name__ == "__main__":
    main()
