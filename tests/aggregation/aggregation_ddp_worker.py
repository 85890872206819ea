"""One DDP rank for the hook test: trains a few steps with the fabric hook and checks every
gradient against gloo's all-reduce of the same local gradients. Prints the largest error.

``TM_TEST_LOWRANK=1``: the low-rank hook (``LowRankHookState``, rank 1, 2 plain steps) instead;
its plain steps are checked against gloo as above, its compressed steps for being the same
gradients on every rank (gloo's all-gather) and a rank-1 matrix where the layer is compressed."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainmaster.aggregation.lowrank import LowRankHookState, fabric_lowrank_hook
from trainmaster.aggregation.torch_hook import (
    FabricHookState,
    client_from_env,
    fabric_allreduce_hook,
)


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    model = torch.nn.Sequential(*model, torch.nn.ReLU(), torch.nn.Linear(3, 3))
    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets per step: several futures in flight
    lowrank = os.environ.get("TM_TEST_LOWRANK") == "1"
    steps = 4 if lowrank else 3
    plain_steps = 2 if lowrank else steps
    if lowrank:
        state: FabricHookState = LowRankHookState(client_from_env(), rank=1, start=plain_steps, seed=3)
        ddp.register_comm_hook(state, fabric_lowrank_hook)
    else:
        state = FabricHookState(client_from_env())
        ddp.register_comm_hook(state, fabric_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    worst = 0.0
    for step in range(steps):
        torch.manual_seed(100 * step + rank)
        x, y = torch.randn(16, 20), torch.randint(0, 3, (16,))
        # the reference: local gradients of the same replica, averaged with gloo
        ref = [torch.zeros_like(p) for p in model.parameters()]
        local = torch.nn.functional.cross_entropy(model(x), y)
        for r, g in zip(ref, torch.autograd.grad(local, list(model.parameters()))):
            r.copy_(g)
            dist.all_reduce(r)
            r.div_(world)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        for p, r in zip(model.parameters(), ref):
            if step < plain_steps:
                worst = max(worst, float((p.grad - r).abs().max()))
            else:  # compressed: the same on every rank; the 64 x 20 layer's gradient has rank 1
                gathered = [torch.zeros_like(p.grad) for _ in range(world)]
                dist.all_gather(gathered, p.grad)
                worst = max(worst, *(float((g - p.grad).abs().max()) for g in gathered))
                if p.grad.shape == (64, 20):
                    singular = torch.linalg.svdvals(p.grad)
                    worst = max(worst, float(singular[1] / singular[0]))
        opt.step()
    print(
        f"max_grad_error {worst:.3e} completed {state.completed} "
        f"launched_before_done {state.launched_before_done} "
        f"comm_thread {state._thread.name} "
        f"compressed_buckets {getattr(state, 'compressed_buckets', 0)}",
        flush=True,
    )
    state.close()
    state.client.close()
    dist.destroy_process_group()
    sys.exit(0 if worst < 1e-5 else 1)


if __name__ == "__main__":
    main()
