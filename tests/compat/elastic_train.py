"""An elastic DDP training script (gloo, a small MLP on a fixed synthetic regression) run by
torchrun's elastic agents in the elastic PyTorch test.

Rank 0 checkpoints the model, optimizer and step after every step (an atomic rename), and every
(re)started worker resumes from it, as torchrun's elastic training expects. Rank 0 appends one
JSON line per step to $PROGRESS: time, step, world size, loss, the agent's restart count,
the worker's start time. The
group stops together (rank 0's decision is broadcast, then a barrier) once $STOP exists or
$STEPS are done.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    born = time.time()  # this worker's start: a record after a kill with a later birth is a re-formed group's
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    checkpoint, progress, stop = Path(os.environ["CKPT"]), Path(os.environ["PROGRESS"]), Path(os.environ["STOP"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    step = 0
    if checkpoint.exists():
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    data = torch.Generator().manual_seed(1234)
    x = torch.randn(8192, 16, generator=data)
    y = x @ torch.randn(16, 1, generator=data) + 0.01 * torch.randn(8192, 1, generator=data)
    total, pause = int(os.environ.get("STEPS", "100000")), float(os.environ.get("PAUSE", "0.1"))
    while step < total:
        rows = torch.arange(rank, 8192, world)
        batch = rows[(step * 32) % len(rows) :][:32]
        loss = torch.nn.functional.mse_loss(ddp(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        flag = torch.tensor([1 if rank == 0 and stop.exists() else 0])
        dist.broadcast(flag, 0)
        if rank == 0:
            scratch = checkpoint.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, scratch)
            os.replace(scratch, checkpoint)
            record = {
                "t": time.time(),
                "step": step,
                "world": world,
                "loss": round(loss.item(), 5),
                "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                "born": born,
            }
            with progress.open("a") as out:
                out.write(json.dumps(record) + "\n")
        if flag.item():
            break
        time.sleep(pause)
    # leave together: rank 0 hosts the workers' store and saves the checkpoint last; a rank
    # still tearing down when it exits could fail, and a failed worker makes its agent restart
    # and wait at a rendezvous (600 s) while its peers wait at torchrun's exit barrier (300 s)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
