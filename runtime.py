"""Device choice, ranks, process groups, precision, determinism and backend identity."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import platform
import random
import re
import signal
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from settings import DEVICE_FORMS, SettingsError, check_runtime

PRECISIONS = ("off", "float16", "bfloat16")
_INDEXED_CUDA = re.compile(r"cuda:(\d+)")


def launch_environment(environ=None) -> tuple[int, int, int]:
    """Return (rank, world_size, local_rank) from torchrun's variables (0, 1, 0 without torchrun)."""
    environ = os.environ if environ is None else environ
    values = {}
    for name, default in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)):
        raw = environ.get(name, "")
        try:
            values[name] = int(raw) if str(raw).strip() else default
        except ValueError:
            raise SettingsError(f"environment variable {name}={raw!r} is not an integer; launch with torchrun") from None
    rank, world_size, local_rank = values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"]
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise SettingsError(
            f"inconsistent launch environment RANK={rank} WORLD_SIZE={world_size} LOCAL_RANK={local_rank}; launch with torchrun"
        )
    return rank, world_size, local_rank


def _cuda_unavailable(spec: str) -> SettingsError:
    """The error for a CUDA device requested where none can be used."""
    why = "built without CUDA" if torch.version.cuda is None else "no GPU visible"
    return SettingsError(
        f"runtime.device: {spec!r} requested but CUDA is not available "
        f"(torch {torch.__version__}, {why}); use \"auto\" or \"cpu\""
    )


def _worker_gpu(spec: str, local_rank: int) -> torch.device:
    """The GPU a worker uses: its local rank selects one of the visible GPUs."""
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise SettingsError(
            f"runtime.device: {spec!r} with local rank {local_rank} but only {count} GPU(s) are visible; "
            "start one worker per visible GPU (torchrun --nproc_per_node, CUDA_VISIBLE_DEVICES)"
        )
    return torch.device("cuda", local_rank)


def resolve_device(spec: str, local_rank: int = 0, world_size: int = 1) -> torch.device:
    """Turn `runtime.device` into a torch.device for this worker; never falls back silently."""
    if not isinstance(spec, str):
        raise SettingsError(f"runtime.device: expected one of {DEVICE_FORMS}; got {spec!r}")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "auto":
        return _worker_gpu(spec, local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cuda":
        if not torch.cuda.is_available():
            raise _cuda_unavailable(spec)
        return _worker_gpu(spec, local_rank)
    match = _INDEXED_CUDA.fullmatch(spec)
    if match is None:
        raise SettingsError(f"runtime.device: {spec!r} is not a valid device; use {DEVICE_FORMS}")
    # An index would put every worker on the same GPU, so it is refused under a launch.
    if world_size > 1:
        raise SettingsError(
            f"runtime.device: {spec!r} cannot be used with {world_size} workers; use \"cuda\" "
            "(the local rank selects the GPU) and choose GPUs with CUDA_VISIBLE_DEVICES"
        )
    if not torch.cuda.is_available():
        raise _cuda_unavailable(spec)
    index, count = int(match.group(1)), torch.cuda.device_count()
    if index >= count:
        raise SettingsError(f"runtime.device: {spec!r} is out of range; {count} GPU(s) visible (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", index)


def check_precision(precision: str, device) -> torch.dtype | None:
    """The autocast dtype of a `training.precision` (one of PRECISIONS; None for "off") on a device.

    Refuses what the device cannot do; call it before any data is sampled.
    """
    device = torch.device(device)
    if precision == "float16" and device.type != "cuda":
        raise SettingsError(
            f"training.precision: \"float16\" needs a CUDA device but runtime.device resolved to {device.type}; "
            "use \"bfloat16\" or \"off\""
        )
    if precision == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise SettingsError(
            f"training.precision: \"bfloat16\" is not supported by {torch.cuda.get_device_name(device)}; "
            "use \"float16\" or \"off\""
        )
    return {"off": None, "float16": torch.float16, "bfloat16": torch.bfloat16}[precision]


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT ended the launch; what was committed is kept, and the same command resumes."""


class Preempted(Interrupted):
    """Training stopped on request after saving its state; the same command resumes it."""


class StopRequest:
    """SIGTERM/SIGINT handling: raise Interrupted at once, except while training polls the flag.

    Cluster schedulers send SIGTERM before preempting a job. A trainer that polls
    `requested` finishes its step and saves its state; anywhere else the signal interrupts
    at once. A second signal always interrupts at once.
    """

    def __init__(self):
        self.requested = None
        self.polled = False
        self.previous = {}

    def install(self):
        """Handle SIGTERM and SIGINT (only possible in the main thread; elsewhere nothing changes)."""
        self.requested = None
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            self.previous[signum] = signal.signal(signum, self.handle)

    def uninstall(self):
        """Put the previous handlers back."""
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    def handle(self, signum, frame):
        """The signal handler."""
        first = self.requested is None
        self.requested = signal.Signals(signum).name
        if not (self.polled and first):
            raise Interrupted(f"stopped by {self.requested}")

    @contextlib.contextmanager
    def polling(self):
        """Within this block a first signal only sets `requested` (the trainer stops at its next step)."""
        self.polled = True
        try:
            yield
        finally:
            self.polled = False

    def __call__(self):
        """Whether a stop was requested (the trainer's stop_requested hook)."""
        return self.requested is not None


STOP = StopRequest()


def request_stop():
    """Ask this process to stop as SIGTERM would (used when the launcher died)."""
    signal.raise_signal(signal.SIGTERM)


@dataclass
class Runtime:
    """Where and how this worker runs: device, ranks and the process group it owns."""

    device: torch.device
    parallel: str = "jobs"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    cpu_threads: int = 1
    deterministic: bool = True
    timeout_minutes: float = 60
    resume_seconds: float = 60
    owns_group: bool = False
    previous_torch_state: tuple = ()   # (threads, deterministic) to put back on stop

    @property
    def is_main(self) -> bool:
        """True on rank 0."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when several workers were launched."""
        return self.world_size > 1

    @property
    def ddp(self) -> bool:
        """True when all workers train each model together."""
        return self.parallel == "ddp" and self.world_size > 1

    @property
    def leads_training(self) -> bool:
        """True on the worker that saves, reports and commits what it trains: each one in jobs mode, rank 0 in DDP."""
        return self.is_main or not self.ddp

    @property
    def train_world_size(self) -> int:
        """Number of workers that train one model together (1 in jobs mode)."""
        return self.world_size if self.ddp else 1


def keep_freed_memory() -> None:
    """Ask glibc's allocator to keep freed large buffers rather than hand them back to the OS.

    A forward pass over a large batch frees and re-allocates megabyte-sized activations;
    with glibc's default thresholds they are unmapped and page-faulted back on every
    call, which was measured to cost up to a third of the CPU evaluation rate.
    Elsewhere (no glibc) this does nothing.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    trim_threshold, mmap_threshold = -1, -3          # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD
    mallopt(mmap_threshold, 64 << 20)
    mallopt(trim_threshold, 256 << 20)


def set_deterministic_algorithms(flag: bool) -> None:
    """torch.use_deterministic_algorithms(flag) without importing torch._inductor (~1 s).

    That function only adds inductor's `deterministic` config to the global flag set
    here; inductor reads it from TORCHINDUCTOR_DETERMINISTIC when first imported, so it
    is set there (or on the config, if something imported inductor already).
    """
    torch.set_deterministic_debug_mode("error" if flag else "default")
    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is not None:
        inductor_config.deterministic = flag
    else:
        os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1" if flag else "0"


def set_determinism(flag: bool) -> None:
    """Ask torch (and CUDA) for deterministic algorithms, or allow the fast ones again."""
    if flag:
        # cuBLAS reads this when its first handle is created, so it must precede CUDA work.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    set_deterministic_algorithms(flag)
    torch.backends.cudnn.deterministic = flag
    if flag:
        torch.backends.cudnn.benchmark = False


def derived_seed(seed: int, *labels) -> int:
    """A 63-bit seed derived from SHA-256 of (seed, labels): independent named streams."""
    text = json.dumps([seed, *labels], default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def seeded_generator(seed: int, *labels) -> torch.Generator:
    """A CPU generator seeded with derived_seed(seed, *labels)."""
    return torch.Generator().manual_seed(derived_seed(seed, *labels))


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) global streams."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _create_group(rt: Runtime, environ) -> None:
    """Create the default process group from torchrun's environment (Gloo on CPU, NCCL on CUDA)."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(name)]
    if missing:
        raise SettingsError(f"WORLD_SIZE={rt.world_size} but {', '.join(missing)} not set; launch with torchrun")
    backend = "nccl" if rt.device.type == "cuda" else "gloo"
    timeout = timedelta(minutes=rt.timeout_minutes)
    dist.init_process_group(backend=backend, rank=rt.rank, world_size=rt.world_size, timeout=timeout,
                            **_rendezvous(environ, rt.world_size, timeout))
    rt.owns_group = True


def _rendezvous(environ, world_size, timeout) -> dict:
    """How workers meet: torchrun's agent store, with keys of their own per restart, else env://.

    The agent's store outlives a worker group, so after an elastic restart (torchrun
    --max-restarts) a new worker could read the address a dead one left there; a prefix
    per restart keeps every group's keys apart.
    """
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {"init_method": "env://"}
    client = dist.TCPStore(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), world_size, is_master=False,
                           timeout=timeout)
    restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"nnpd/restart-{restart}", client)}


def start(runtime_settings: dict | None, environ=None) -> Runtime:
    """Validate settings, pick the device, configure torch and join the launch's process group."""
    settings = check_runtime(runtime_settings)
    environ = os.environ if environ is None else environ
    rank, world_size, local_rank = launch_environment(environ)
    if dist.is_available() and dist.is_initialized():
        raise SettingsError("a launch cannot be started inside an active process group; "
                            "start nnpd as its own launch (for a trained model, use store.restore)")
    device = resolve_device(settings["device"], local_rank, world_size)
    rt = Runtime(
        device=device,
        parallel=settings["parallel"],
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        cpu_threads=settings["cpu_threads"],
        deterministic=settings["deterministic"],
        timeout_minutes=settings["timeout_minutes"],
        resume_seconds=settings["resume_seconds"],
    )
    rt.previous_torch_state = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
    torch.set_num_threads(rt.cpu_threads)
    set_determinism(rt.deterministic)
    keep_freed_memory()
    if device.type == "cuda":
        # NCCL and object collectives use the current device, so it is set before the group exists.
        torch.cuda.set_device(device)
    if rt.distributed:
        _create_group(rt, environ)
    return rt


def stop(rt: Runtime) -> None:
    """Destroy the process group this runtime created and put torch's settings back.

    Safe to call twice or after an error; a Python caller of a launch gets its own
    thread count and determinism flag back.
    """
    if rt.owns_group and dist.is_initialized():
        dist.destroy_process_group()
    rt.owns_group = False
    if rt.previous_torch_state:
        threads, deterministic = rt.previous_torch_state
        torch.set_num_threads(threads)
        set_deterministic_algorithms(deterministic)
        rt.previous_torch_state = ()


def backend_identity(rt: Runtime) -> dict:
    """What a trained model depends on besides its settings: device, versions, world size, threads."""
    if rt.device.type == "cuda":
        name = torch.cuda.get_device_name(rt.device)
    else:
        name = platform.processor() or "cpu"
    return {
        "device_type": rt.device.type,
        "device_name": name,
        "cuda_version": torch.version.cuda,
        "torch_version": str(torch.__version__),
        "ddp_world_size": rt.train_world_size,
        "cpu_threads": rt.cpu_threads,
        "deterministic": rt.deterministic,
    }


def barrier(rt: Runtime) -> None:
    """Wait for every worker (no-op in a single process)."""
    if not rt.distributed:
        return
    if rt.device.type == "cuda":
        dist.barrier(device_ids=[rt.device.index])
    else:
        dist.barrier()


def broadcast_object(rt: Runtime, obj, src: int = 0):
    """Return rank `src`'s picklable object on every worker."""
    if not rt.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=rt.device if rt.device.type == "cuda" else None)
    return box[0]


def all_reduce_sum(rt: Runtime, tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over workers in place and return it."""
    if rt.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_object(rt: Runtime, obj) -> list:
    """Return every worker's object, in rank order."""
    if not rt.distributed:
        return [obj]
    gathered = [None] * rt.world_size
    dist.all_gather_object(gathered, obj)
    return gathered
