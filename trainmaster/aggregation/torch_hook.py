"""PyTorch DDP communication hook: gradient buckets go through the aggregation fabric.

An existing DDP script switches with two lines::

    from trainmaster.aggregation.torch_hook import (FabricHookState, client_from_env,
                                                    fabric_allreduce_hook)
    ddp_model.register_comm_hook(FabricHookState(client_from_env()), fabric_allreduce_hook)

(``register_comm_hook(client_from_env(), fabric_allreduce_hook)``, the earlier form, still
works: the hook then makes the state for that client itself.)

The hook is asynchronous, as gloo's and NCCL's are: it hands the bucket to the state's
communication thread and returns a ``torch.futures.Future`` at once, so autograd goes on
computing the next buckets' gradients while this one is on the wire; the thread completes the
future when the bucket's sum is back, and DDP waits for all of them at the end of backward. One
thread, first in first out: every rank reduces the buckets in the order DDP launches them, which
is what matches the rounds of the fabric across ranks. DDP still uses its process group for
parameter broadcast at construction.
"""

import dataclasses
import os
import queue
import threading
import weakref

import torch
import torch.distributed as dist

from trainmaster.aggregation.worker import RESULT_PRECISIONS, AggregationClient, WorkerConfig, quantizer_for


def client_from_env(config: WorkerConfig | None = None) -> AggregationClient:
    """A worker client from the environment the ``ina`` framework (or the user) sets:

    ``TM_AGGREGATION_SWITCH`` (host:port of this worker's forwarding node),
    ``TM_AGGREGATION_JOB`` (job id, default 1), ``RANK``, ``WORLD_SIZE`` and
    ``TM_AGGREGATION_TRANSPORT`` (``udp`` default, or ``shm``: the same variable the
    ``parameter-node`` and ``forwarding-node`` commands read); optional
    ``TM_AGGREGATION_CHUNK`` (elements per packet, when ``config`` sets none) and
    ``TM_AGGREGATION_PRECISION`` (``int32``, ``int16`` or ``int8``: the quantiser, when
    ``config`` is None) and ``TM_AGGREGATION_RESULTS`` (``exact`` or ``int8``: how the sums
    come down, ``WorkerConfig.results``); the worker binds to ``TM_HOST``, the address of the host the controller
    placed it on.
    """
    switch = os.environ.get("TM_AGGREGATION_SWITCH", "")
    host, _, port = switch.rpartition(":")
    if not host or not port.isdigit():
        raise RuntimeError(f"TM_AGGREGATION_SWITCH must be HOST:PORT of a forwarding node, got {switch!r}")
    chunk = os.environ.get("TM_AGGREGATION_CHUNK", "")
    if chunk and (config is None or config.chunk is None):
        if not chunk.isdigit():
            raise RuntimeError(f"TM_AGGREGATION_CHUNK must be a number of elements, got {chunk!r}")
        config = dataclasses.replace(config or WorkerConfig(), chunk=int(chunk))
    precision = os.environ.get("TM_AGGREGATION_PRECISION", "")
    if precision:
        try:
            quantizer = quantizer_for(precision)
        except ValueError as exc:
            raise RuntimeError(f"TM_AGGREGATION_PRECISION: {exc}") from None
        config = dataclasses.replace(config or WorkerConfig(), quantizer=quantizer)
    results = os.environ.get("TM_AGGREGATION_RESULTS", "")
    if results:
        if results not in RESULT_PRECISIONS:
            raise RuntimeError(f"TM_AGGREGATION_RESULTS must be one of {', '.join(RESULT_PRECISIONS)}, got {results!r}")
        config = dataclasses.replace(config or WorkerConfig(), results=results)
    client = AggregationClient(
        (host, int(port)),
        int(os.environ.get("TM_AGGREGATION_JOB", "1")),
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        config,
        host=os.environ.get("TM_HOST", "127.0.0.1"),  # this instance's host (testbed)
        transport=os.environ.get("TM_AGGREGATION_TRANSPORT", "udp"),
    )
    client.join()
    return client


class FabricHookState:
    """The hook's state: a client and the communication thread that runs its all-reduces.

    ``completed`` counts buckets whose future the thread completed; ``launched_before_done``
    counts hooks that returned while an earlier bucket was still being reduced (the overlap)."""

    def __init__(self, client: AggregationClient):
        self.client = client
        self.completed = 0
        self.launched_before_done = 0
        self._pending = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"aggregation-comm-{client.rank}")
        self._thread.start()

    def submit(self, tensor: torch.Tensor, key: object = None) -> torch.futures.Future:
        """Queue ``tensor`` for an in-place average over the workers; returns its future.
        ``key``: which bucket it is (low-bit aggregation carries its scale and error from one
        step to the next per key; DDP's bucket index)."""
        future: torch.futures.Future = torch.futures.Future()
        if self._pending:
            self.launched_before_done += 1
        self._pending += 1
        self._queue.put((tensor, future, key))
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            tensor, future, key = item
            try:
                self.average(tensor, key)
            except BaseException as exc:  # the waiting DDP step raises it
                self._pending -= 1
                future.set_exception(exc)
                continue
            self._pending -= 1
            self.completed += 1
            future.set_result(tensor)

    def average(self, tensor: torch.Tensor, key: object) -> None:
        """Replace ``tensor`` by its average over the workers (on the communication thread;
        ``trainmaster.aggregation.lowrank`` overrides it to send low-rank factors instead)."""
        if tensor.device.type == "cpu" and tensor.dtype == torch.float32 and tensor.is_contiguous():
            flat = tensor.view(-1).numpy()
            self.client.allreduce(flat, out=flat, key=key)  # in place, like gloo
        else:
            tensor.copy_(self.client.allreduce(tensor, key=key))
        tensor.div_(self.client.world)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread after the queued buckets (the client stays open)."""
        self._queue.put(None)
        self._thread.join(timeout)


_states: "weakref.WeakKeyDictionary[AggregationClient, FabricHookState]" = weakref.WeakKeyDictionary()


def _state(state: "FabricHookState | AggregationClient") -> FabricHookState:
    if isinstance(state, FabricHookState):
        return state
    made = _states.get(state)  # the earlier form: one hook state per client, made once
    if made is None:
        made = _states[state] = FabricHookState(state)
    return made


# no ``from __future__ import annotations`` here: DDP checks these annotations at runtime
def fabric_allreduce_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook (``register_comm_hook(state, hook)``): average the bucket over all workers,
    asynchronously; ``state`` is a ``FabricHookState`` (or an ``AggregationClient``)."""
    return _state(state).submit(bucket.buffer(), ("bucket", bucket.index()))  # type: ignore[arg-type]
