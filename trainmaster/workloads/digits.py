"""Data-parallel training of a small MLP on scikit-learn's bundled digits data (8x8 images, 10 classes).

Run as a role command (``python -m trainmaster.workloads.digits``) under the ``pytorch``
framework: every rank trains on its shard, gradients are averaged with torch.distributed
(gloo), and rank 0 evaluates on the held-out test split and writes ``metrics.json`` into
``TM_OUTPUT_DIR``. Without ``WORLD_SIZE`` it trains alone, which is handy for a baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from trainmaster.runtime.report import report


def load_digits_split(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standardised train/test tensors (75/25 split, fixed seed so every rank agrees)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, data.target, test_size=0.25, random_state=seed, stratify=data.target
    )
    mean, std = x_train.mean(0), x_train.std(0) + 1e-6
    as_x = lambda a: torch.from_numpy((a - mean) / std)  # noqa: E731
    return as_x(x_train), torch.from_numpy(y_train), as_x(x_test), torch.from_numpy(y_test)


def make_model(hidden: int = 64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # identical initial weights on every rank
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train(epochs: int, batch: int, lr: float, rank: int, world: int, average_gradients=None) -> tuple[nn.Module, float]:  # type: ignore[no-untyped-def]
    """Train this rank's shard; ``average_gradients(model)`` combines gradients across ranks."""
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_digits_split()
    shard = torch.arange(rank, len(x_train), world)
    x, y = x_train[shard], y_train[shard]
    model = make_model()
    optimiser = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    generator = torch.Generator().manual_seed(1234 + rank)
    loss_fn = nn.CrossEntropyLoss()
    steps = max(1, len(x) // batch)
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        total = 0.0
        for step in range(steps):
            idx = order[step * batch : (step + 1) * batch]
            optimiser.zero_grad()
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            total += loss.detach().item()  # a plain number: no autograd warning in every log
            if average_gradients is not None:
                average_gradients(model)
            optimiser.step()
        # progress for the live view, status and the dashboard (nothing happens outside an instance)
        report(epoch=epoch + 1, total=epochs, loss=total / steps)
    return model, accuracy(model, x_test, y_test)


def gloo_average(model: nn.Module) -> None:
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    started = time.time()
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(60))
    model, acc = train(args.epochs, args.batch, args.lr, rank, world, gloo_average if world > 1 else None)
    print(f"rank {rank}/{world}: test accuracy {acc:.4f}", flush=True)
    if rank == 0:
        out = Path(os.environ.get("TM_OUTPUT_DIR", "."))
        out.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), out / "model.pt")
        (out / "metrics.json").write_text(
            json.dumps(
                {
                    "test_accuracy": round(acc, 4),
                    "world_size": world,
                    "epochs": args.epochs,
                    "seconds": round(time.time() - started, 2),
                }
            )
        )
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
