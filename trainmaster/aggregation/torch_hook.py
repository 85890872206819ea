"""PyTorch DDP communication hook: gradient buckets go through the aggregation fabric.

An existing DDP script switches with two lines::

    from trainmaster.aggregation.torch_hook import client_from_env, fabric_allreduce_hook
    ddp_model.register_comm_hook(client_from_env(), fabric_allreduce_hook)

DDP still uses its process group for parameter broadcast at construction; every gradient
all-reduce afterwards is the fabric's (summed, then divided by the world size as DDP expects).
"""

import os

import torch
import torch.distributed as dist

from trainmaster.aggregation.worker import AggregationClient, WorkerConfig


def client_from_env(config: WorkerConfig | None = None) -> AggregationClient:
    """A worker client from the environment the ``ina`` framework (or the user) sets:

    ``TM_AGGREGATION_SWITCH`` (host:port of this worker's forwarding node),
    ``TM_AGGREGATION_JOB`` (job id, default 1), ``RANK``, ``WORLD_SIZE`` and
    ``TM_AGGREGATION_TRANSPORT`` (``udp`` default, or ``shm``: the same variable the
    ``parameter-node`` and ``forwarding-node`` commands read).
    """
    switch = os.environ.get("TM_AGGREGATION_SWITCH", "")
    host, _, port = switch.rpartition(":")
    if not host or not port.isdigit():
        raise RuntimeError("TM_AGGREGATION_SWITCH must be HOST:PORT of a forwarding node, "
                           f"got {switch!r}")
    client = AggregationClient((host, int(port)), int(os.environ.get("TM_AGGREGATION_JOB", "1")),
                               int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), config,
                               transport=os.environ.get("TM_AGGREGATION_TRANSPORT", "udp"))
    client.join()
    return client


# no ``from __future__ import annotations`` here: DDP checks these annotations at runtime
def fabric_allreduce_hook(state: AggregationClient,
                          bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook (``register_comm_hook(state, hook)``): average the bucket over all workers."""
    tensor = bucket.buffer()
    summed = state.allreduce(tensor)
    tensor.copy_(summed.div_(state.world))
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future
