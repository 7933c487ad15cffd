"""The trainer's DDP machinery: global-batch sharding, the DDP wrapper and its timed all-reduce,
the stop/save flag exchange, and freeing a failed DDP training's process group.

Apart from the loop (trainer.py) because it is what makes W processes train as one: every
rank cuts the same global batches, averages gradients as DDP does, and agrees on the steps
at which to save or stop. Behaviour with one process is the DDP case with W = 1.
"""

from __future__ import annotations

import contextlib
import time
import traceback
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

import probes
import runtime
from probes import COMMUNICATE

__all__ = [
    "epoch_batches",
    "shard_slice",
    "shard_sizes",
    "loss_scale",
    "FlagExchange",
    "timed_allreduce",
    "wrapped",
    "release_frames",
]


# ---------------------------------------------------------------- sharding math (pure)


def epoch_batches(rows: int, batch_size: int) -> list[tuple[int, int]]:
    """Consecutive global batches (start, stop) over one permutation; the last may be short."""
    if rows < 0 or batch_size < 1:
        raise ValueError(f"need rows >= 0 and batch_size >= 1, got {rows}, {batch_size}")
    return [(start, min(start + batch_size, rows)) for start in range(0, rows, batch_size)]


def shard_slice(batch_len: int, rank: int, world_size: int) -> slice:
    """Rank's strided part `rank::world_size` of a global batch (empty when rank >= batch_len)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return slice(rank, batch_len, world_size)


def shard_sizes(batch_len: int, world_size: int) -> list[int]:
    """Number of rows each rank takes from a global batch of `batch_len` rows."""
    return [max(0, -(-(batch_len - rank) // world_size)) for rank in range(world_size)]


def loss_scale(shard_len: int, batch_len: int, world_size: int) -> float:
    """Factor for a rank's mean shard loss so DDP's averaged gradient is the global-batch mean's."""
    if batch_len < 1:
        raise ValueError("a global batch has at least one row")
    return world_size * shard_len / batch_len


# ---------------------------------------------------------------- flags at agreed steps


# Weak references to (default group, its Gloo side group) under NCCL: c10d holds both until
# destroy_process_group, which must end them (see runtime.stop).
_side_group: tuple[Callable[[], object], Callable[[], object]] = (lambda: None, lambda: None)


def _flag_group(rt: runtime.Runtime):
    """The group carrying stop and save flags: the default one on CPU (Gloo).

    Under NCCL a Gloo side group keeps the flags on the host, so reading them never
    waits for the GPU; it is made once per default group (all ranks train together).
    """
    global _side_group
    if rt.device.type != "cuda":
        return None
    world, side = dist.group.WORLD, _side_group[1]()
    if side is None or _side_group[0]() is not world:
        side = dist.new_group(backend="gloo")
        _side_group = (weakref.ref(world), weakref.ref(side))
    return side


class FlagExchange:
    """DDP's agreement on [stop, save due]: an asynchronous all-reduce every few steps.

    Each exchange is waited for one step after it was posted, so its latency hides behind
    that step. Rank 0 sets how many steps pass until the next exchange (about `seconds` of
    them, trainer.FLAG_EXCHANGE_SECONDS; at least one) and the count travels with the flags,
    so every rank posts at the same steps: one exchange after every step added a quarter or
    more to a small model's step time on CPU Gloo (bench/bench_resume.py).
    """

    def __init__(self, rt: runtime.Runtime, seconds: float):
        self.rt, self.group, self.seconds = rt, _flag_group(rt), seconds
        self.step = 0  # steps trained in this call
        self.next_post = 1  # the step that posts next, the same on every rank
        self.last_post = (0, time.monotonic())  # step and time of the latest post
        self.pending: tuple[Any, torch.Tensor] | None = None

    def collect(self) -> tuple[bool, bool]:
        """Wait for the pending exchange: the agreed (stop, save due); (False, False) without one."""
        if self.pending is None:
            return False, False
        work, flags = self.pending
        self.pending = None
        work.wait()
        stop, due, interval = flags.tolist()
        self.next_post = self.last_post[0] + int(interval)
        return stop > 0, due > 0

    def offer(self, stop: bool, due: bool) -> None:
        """Count a step, and post this rank's flags when this is an exchange step."""
        self.step += 1
        if self.step < self.next_post:
            return
        interval = self._interval() if self.rt.is_main else 0.0
        flags = torch.tensor([float(stop), float(due), interval])
        self.pending = (dist.all_reduce(flags, group=self.group, async_op=True), flags)
        self.last_post = (self.step, time.monotonic())

    def _interval(self) -> float:
        """Rank 0's steps until the next exchange, from the step time since the latest post."""
        step, posted_at = self.last_post
        per_step = max((time.monotonic() - posted_at) / max(self.step - step, 1), 1e-9)
        return float(min(max(int(self.seconds / per_step), 1), 10_000))

    def agree_at_epoch_end(self, stop: bool) -> bool:
        """Finish the pending exchange, then agree on stopping (one blocking exchange per epoch)."""
        self.collect()
        flag = torch.tensor([float(stop)])
        dist.all_reduce(flag, group=self.group)
        return flag.item() > 0


# ---------------------------------------------------------------- the DDP wrapper


def timed_allreduce(rt: runtime.Runtime):
    """A DDP communication hook doing DDP's own averaging all-reduce, timed as the phase train.communicate.

    DDP's own averaging multiplies each gradient by 1/world as it fills the bucket (not a
    division: with 3 workers the two differ in the last bit), then sums over the workers.
    """
    if rt.device.type == "cuda":
        return _nccl_timed_allreduce(rt.device, rt.world_size)
    return _gloo_timed_allreduce(rt.world_size)


def _gloo_timed_allreduce(world: int):
    """The CPU (Gloo) hook: each bucket's all-reduce is waited for inside the hook.

    No Python then runs in Gloo's own threads: a Python callback there (what Future.then
    would run) can abort the process when it exits meanwhile. The price, for models of
    several buckets only (the bundled ones have one), is the all-reduce's overlap with the
    rest of the backward pass.
    """

    def hook(_, bucket):
        """Average one bucket's gradients over the workers, timing the all-reduce."""
        tensor = bucket.buffer().mul_(1.0 / world)
        with probes.phase(COMMUNICATE):
            dist.all_reduce(tensor)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(tensor)
        return done

    return hook


def _nccl_timed_allreduce(device: torch.device, world: int):
    """The CUDA (NCCL) hook: a span from the hook's call to the all-reduce's completion callback.

    NCCL completes the future as it enqueues the work, so the callback runs at once in this
    thread and the host span is short. With NNPD_PROBES_CUDA=1 the device time is taken on a
    stream of its own that waits for the gradients, then (in the callback, whose current
    stream has waited for the all-reduce) for the all-reduce, so the compute stream waits
    for nothing more than it would. A bucket posted while another's span is still open
    counts as nested (no time).
    """
    timing = torch.cuda.Stream(device) if probes.DEVICE_TIMER is not None else None

    def hook(_, bucket):
        """Average one bucket's gradients over the workers, timing the all-reduce."""
        tensor = bucket.buffer().mul_(1.0 / world)
        if timing is not None:
            timing.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(timing) if timing is not None else contextlib.nullcontext():
            span = probes.phase(COMMUNICATE, device=device)
            span.__enter__()
        future = dist.all_reduce(tensor, async_op=True).get_future()

        def close(done):
            """End the span once the all-reduce is done; DDP reads the averaged bucket."""
            if timing is not None:
                timing.wait_stream(torch.cuda.current_stream(device))
            span.__exit__(None, None, None)
            return done.value()[0]

        return future.then(close)

    return hook


def wrapped(model: torch.nn.Module, rt: runtime.Runtime):
    """The network the steps call: the model itself, or under DDP its wrapper (with a timed all-reduce)."""
    if not rt.ddp:
        return model
    device = rt.device
    net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if probes.MODE != "off":
        net.register_comm_hook(None, timed_allreduce(rt))
    return net


def release_frames(error: BaseException) -> None:
    """Clear the locals of the finished frames in a failed DDP training's tracebacks.

    They hold the DDP wrapper, whose reducer holds the process group, for as long as the
    exception lives: past runtime.stop, which must destroy the group (see there). The
    tracebacks keep their lines.
    """
    pending: list[BaseException | None] = [error]
    seen: set[int] = set()
    while pending:
        link = pending.pop()
        if link is not None and id(link) not in seen:
            seen.add(id(link))
            traceback.clear_frames(link.__traceback__)
            pending += [link.__cause__, link.__context__]
