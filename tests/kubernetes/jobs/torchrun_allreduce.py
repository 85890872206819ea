"""A PyTorchJob's script under torchrun: torchrun reads its rendezvous from PET_* (as the Kubeflow
operator sets them) and starts this with RANK/WORLD_SIZE; all ranks all-reduce over gloo."""

import datetime
import os

import torch
import torch.distributed as dist

pet = {k: v for k, v in sorted(os.environ.items()) if k.startswith("PET_")}
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
assert value.item() == world * (world + 1) / 2, value
print(f"rank {rank} of {world} (PET: {pet}): all_reduce sum = {value.item():g}", flush=True)
dist.destroy_process_group()
