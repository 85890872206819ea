"""The ``ina`` worker role for the digits example: the digits MLP trained data-parallel with
gradients averaged through the aggregation fabric instead of gloo.

Reuses ``trainmaster.workloads.digits`` (data, model, training loop); only the gradient
averaging differs: all gradients are flattened into one vector and sent with one ``allreduce``.
Rank 0 writes ``metrics.json`` (test accuracy) to ``TM_OUTPUT_DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from trainmaster.aggregation.torch_hook import client_from_env
from trainmaster.aggregation.worker import AggregationClient
from trainmaster.workloads import digits


def fabric_average(client: AggregationClient):  # type: ignore[no-untyped-def]
    def average(model: torch.nn.Module) -> None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        summed = client.allreduce(flat) / client.world
        offset = 0
        for g in grads:
            g.copy_(summed[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return average


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    started = time.time()
    client = client_from_env()
    try:
        model, acc = digits.train(args.epochs, args.batch, args.lr, client.rank, client.world,
                                  fabric_average(client))
        stats = client.stats()
    finally:
        client.close()
    print(f"rank {client.rank}/{client.world}: test accuracy {acc:.4f} "
          f"(retransmits {stats['retransmits']})", flush=True)
    if client.rank == 0:
        out = Path(os.environ.get("TM_OUTPUT_DIR", "."))
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(
            {"test_accuracy": round(acc, 4), "world_size": client.world, "epochs": args.epochs,
             "transport": "aggregation fabric", "seconds": round(time.time() - started, 2)}))


if __name__ == "__main__":
    main()
