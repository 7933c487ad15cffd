"""Device choice, ranks, process groups, precision, determinism and backend identity."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import hashlib
import json
import os
import platform
import re
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from settings import DEVICE_FORMS, SettingsError, check_runtime
from store import LaunchError, NnpdError

__all__ = [
    "PRECISIONS",
    "launch_environment",
    "resolve_device",
    "check_precision",
    "Interrupted",
    "Preempted",
    "StopRequest",
    "STOP",
    "unless_stopped",
    "reported_stop",
    "request_stop",
    "exit_status",
    "Runtime",
    "process_settings_kept",
    "set_determinism",
    "derived_seed",
    "seeded_generator",
    "group_backend",
    "group_timeout",
    "start",
    "stop",
    "backend_identity",
    "barrier",
    "broadcast_object",
    "all_reduce_sum",
    "all_gather_object",
]

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
            raise SettingsError(
                f"environment variable {name}={raw!r} is not an integer; launch with torchrun"
            ) from None
    rank, world_size, local_rank = values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"]
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise SettingsError(
            f"inconsistent launch environment RANK={rank} WORLD_SIZE={world_size} LOCAL_RANK={local_rank}; "
            "launch with torchrun"
        )
    return rank, world_size, local_rank


def _cuda_unavailable(spec: str) -> SettingsError:
    """The error for a CUDA device requested where none can be used."""
    why = "built without CUDA" if torch.version.cuda is None else "no GPU visible"
    return SettingsError(
        f"runtime.device: {spec!r} requested but CUDA is not available "
        f'(torch {torch.__version__}, {why}); use "auto" or "cpu"'
    )


def _worker_gpu(spec: str, local_rank: int) -> torch.device:
    """The GPU a worker uses: its local rank selects one of the visible GPUs.

    A scheduler that binds one GPU to each task shows every worker just its own, as cuda:0.
    """
    count = torch.cuda.device_count()
    if count == 1:
        return torch.device("cuda", 0)
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
            f'runtime.device: {spec!r} cannot be used with {world_size} workers; use "cuda" '
            "(the local rank selects the GPU) and choose GPUs with CUDA_VISIBLE_DEVICES"
        )
    if not torch.cuda.is_available():
        raise _cuda_unavailable(spec)
    index, count = int(match.group(1)), torch.cuda.device_count()
    if index >= count:
        raise SettingsError(
            f"runtime.device: {spec!r} is out of range; {count} GPU(s) visible (cuda:0..cuda:{count - 1})"
        )
    return torch.device("cuda", index)


def check_precision(precision: str, device) -> torch.dtype | None:
    """The autocast dtype of a `training.precision` (one of PRECISIONS; None for "off") on a device.

    Refuses what the device cannot do; call it before any data is sampled.
    """
    device = torch.device(device)
    if precision == "float16" and device.type != "cuda":
        raise SettingsError(
            f'training.precision: "float16" needs a CUDA device but runtime.device resolved to {device.type}; '
            'use "bfloat16" or "off"'
        )
    if precision == "bfloat16" and device.type == "cuda":
        # torch.cuda.is_bf16_supported() also accepts GPUs that only emulate bfloat16 (compute
        # capability below 8: V100, T4) and asks the current device, not this worker's.
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            raise SettingsError(
                f'training.precision: "bfloat16" needs a GPU of compute capability 8.0 or newer; '
                f"{torch.cuda.get_device_name(device)} ({device}) has {major}.{minor} and only emulates it; "
                'use "float16" or "off"'
            )
    return {"off": None, "float16": torch.float16, "bfloat16": torch.bfloat16}[precision]


# A stop is one of nnpd's errors and a KeyboardInterrupt: `except NnpdError` and `except
# KeyboardInterrupt` both see it. An `except Exception` sees it too, so nnpd's own handlers of
# that kind let KeyboardInterrupt through first, and a stop that a study's own handler swallowed
# is raised again before anything is committed (unless_stopped).
class Interrupted(NnpdError, KeyboardInterrupt):
    """SIGTERM or SIGINT ended the launch; what was committed is kept, and the same command resumes."""


class Preempted(Interrupted):
    """Training stopped on request at a step every rank agreed on (an interruption, not a failure)."""

    def __init__(self, epoch: int, batch: int, saved: bool):
        self.epoch, self.batch, self.saved = epoch, batch, saved
        then = (
            "its state was saved: run the same command again to resume from there"
            if saved
            else "no state was saved (saving is off): the same command starts it again"
        )
        super().__init__(f"training stopped on request in epoch {epoch} after batch {batch}; {then}")

    def __reduce__(self):
        """Pickle with the constructor's arguments (the message is derived from them)."""
        return Preempted, (self.epoch, self.batch, self.saved)


class StopRequest:
    """SIGTERM/SIGINT handling: raise Interrupted at once, except while training polls the flag.

    Cluster schedulers send SIGTERM before preempting a job. A trainer that polls
    `requested` finishes its step and saves its state; anywhere else the signal interrupts
    at once. A later signal interrupts at once too, except a repeat of the request: one
    arriving within REPEAT_SECONDS of the first, or while training is still stopping (saving
    its state). Slurm signals every process of a step and torchrun passes the signal on
    again, so each worker gets SIGTERM twice, a fraction of a millisecond apart, and srun
    sends it once more when the first node's launcher exits. A second Ctrl-C (SIGINT after
    SIGINT) always interrupts. install/uninstall pairs nest: the command line keeps its
    handlers until it has printed how the launch ended, since a repeat that met the default
    handler after the launch's own pair would kill the worker before it says what it saved;
    and a process running the command line keeps them until exit_status ignores the signal.
    """

    REPEAT_SECONDS = 2.0

    def __init__(self):
        self.requested = None
        self.requested_at = None
        self.polled = False
        self.previous = {}
        self.depth = 0

    def install(self):
        """Handle SIGTERM and SIGINT (only possible in the main thread; elsewhere nothing changes).

        Inside another pair this changes nothing: the outer handlers and request stay.
        """
        self.depth += 1
        if self.depth > 1:
            return
        self.requested = self.requested_at = None
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            self.previous[signum] = signal.signal(signum, self.handle)

    def uninstall(self):
        """Put the previous handlers back (at the end of the outermost pair)."""
        self.depth = max(self.depth - 1, 0)
        if self.depth:
            return
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    @contextlib.contextmanager
    def handling(self):
        """install() for the duration of a block, uninstall() after it."""
        self.install()
        try:
            yield self
        finally:
            self.uninstall()

    def handle(self, signum, frame):
        """The signal handler."""
        name = signal.Signals(signum).name
        if self.requested is not None:
            since = time.monotonic() - (self.requested_at or 0.0)  # set with `requested`
            repeated = self.polled or since < self.REPEAT_SECONDS
            if repeated and not (name == self.requested == "SIGINT"):
                return  # the same request delivered twice
            raise Interrupted(f"stopped by {name}")
        self.requested, self.requested_at = name, time.monotonic()
        if not self.polled:
            raise Interrupted(f"stopped by {name}")

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


def unless_stopped(build: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`build`, ending in Interrupted when a stop was requested while it ran.

    A stop interrupts the build at once. If the study's own `except Exception` caught that,
    the build may go on to return a result the stop spoiled (a simulation turned invalid, a
    training cut short), which must not be committed, or to fail for that reason, which must
    not be reported as the study's fault.
    """

    def guarded(writer):
        try:
            produced = build(writer)
        except Exception as error:
            if STOP.requested is None or isinstance(error, KeyboardInterrupt):
                raise
            raise Interrupted(f"stopped by {STOP.requested}; what was being built is not committed") from error
        if STOP.requested is not None:
            raise Interrupted(f"stopped by {STOP.requested}; what was being built is not committed")
        return produced

    return guarded


def reported_stop(error: BaseException) -> int | None:
    """The exit status of a launch a stop ended (143 for SIGTERM, 130 for SIGINT), after its one line on
    stderr; None when `error` is no stop.

    An error raised while a stop was pending is that stop: a study's `except Exception` caught the
    stop, then its code failed for want of what the stop cut short.
    """
    if not isinstance(error, KeyboardInterrupt) and STOP.requested is None:
        return None
    message = " ".join(str(error).split()) if isinstance(error, KeyboardInterrupt) else f"stopped by {STOP.requested}"
    message = message or "interrupted"
    then = "" if "same command" in message else "; everything committed so far is kept, and the same command resumes"
    print(f"nnpd: {message}{then}", file=sys.stderr)
    return 143 if STOP.requested == "SIGTERM" else 130


def request_stop():
    """Ask this process to stop as SIGTERM would (used when the launcher died)."""
    signal.raise_signal(signal.SIGTERM)


def exit_status(status: int) -> int:
    """`status`, once a process that a signal stopped ignores that signal from here on.

    The process is about to exit, and a repeat of the signal (Slurm and torchrun each send
    SIGTERM) meeting the default handler would kill the interpreter's exit.
    """
    if STOP.requested is not None and threading.current_thread() is threading.main_thread():
        signal.signal(getattr(signal, STOP.requested), signal.SIG_IGN)
    return status


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
    previous_torch_state: tuple = ()  # what start changed (torch_state()), put back by stop

    def __post_init__(self):
        """Give a CUDA device its index: barriers, DDP and NCCL need to know which GPU."""
        self.device = torch.device(self.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

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

    A forward pass over a large batch frees and re-allocates megabyte-sized activations,
    and the analysis frees and re-allocates a block of cases' arrays (hundreds of MiB) in
    every pass; with glibc's default thresholds they are unmapped and page-faulted back
    each time, which was measured to cost up to a third of the CPU evaluation rate. Up to
    1 GiB freed at the heap's top is kept (256 MiB still faulted 40,000 pages a block).
    Elsewhere (no glibc) this does nothing.
    """
    mallopt = _mallopt()
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, 64 << 20)
        mallopt(M_TRIM_THRESHOLD, 1 << 30)  # mallopt takes a C int: at most 2^31 - 1
        _ALLOCATOR["kept"] = True


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
_ALLOCATOR = {"kept": False}  # whether keep_freed_memory changed glibc's thresholds in this process


def _mallopt():
    """glibc's mallopt, or None where there is no glibc."""
    try:
        return ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None


def return_freed_memory() -> None:
    """Undo keep_freed_memory: glibc's thresholds as a process starts with (its defaults, or MALLOC_*_ set).

    glibc can neither report its thresholds nor turn their adjustment back on, so this sets
    the values a new process has: 128 KiB each unless MALLOC_MMAP_THRESHOLD_ or
    MALLOC_TRIM_THRESHOLD_ say otherwise (GLIBC_TUNABLES is not read).
    """
    mallopt = _mallopt()
    if mallopt is None or not _ALLOCATOR["kept"]:
        return
    for option, variable in (
        (M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_"),
        (M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_"),
    ):
        value = os.environ.get(variable, "")
        mallopt(option, int(value) if value.isdigit() and int(value) < 2**31 else 128 << 10)
    _ALLOCATOR["kept"] = False


@contextlib.contextmanager
def process_settings_kept():
    """Within the block a launch may change process-wide settings; after it, sys.path, warnings' filters,
    display and format, and glibc's allocator thresholds are as they were (nnpd.main's whole launch)."""
    saved_path, saved_format, kept = list(sys.path), warnings.formatwarning, _ALLOCATOR["kept"]
    try:
        with warnings.catch_warnings():
            yield
    finally:
        sys.path[:] = saved_path
        warnings.formatwarning = saved_format
        if not kept:
            return_freed_memory()


def set_deterministic_algorithms(flag: bool) -> None:
    """torch.use_deterministic_algorithms(flag) without importing torch._inductor (~1 s).

    That function only adds inductor's `deterministic` config to the global flag set
    here; inductor reads it from TORCHINDUCTOR_DETERMINISTIC when first imported, so it
    is set there (or on the config, if something imported inductor already).
    """
    torch.set_deterministic_debug_mode("error" if flag else "default")
    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is not None:
        inductor_config.deterministic = flag  # type: ignore[attr-defined]  # found in sys.modules: untyped
    else:
        os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1" if flag else "0"


DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")  # the workspace settings cuBLAS documents as deterministic


def set_determinism(flag: bool) -> None:
    """Ask torch (and CUDA) for deterministic algorithms, or allow the fast ones again."""
    if flag:
        # cuBLAS reads this when its first handle is created, so it must precede CUDA work.
        # Another value makes deterministic training fail at its first matrix product.
        found = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        if found not in (None, *DETERMINISTIC_CUBLAS):
            warnings.warn(
                f"CUBLAS_WORKSPACE_CONFIG={found!r} is not one of cuBLAS's deterministic settings "
                f"({', '.join(DETERMINISTIC_CUBLAS)}); runtime.deterministic is on, so this launch uses "
                f"{DETERMINISTIC_CUBLAS[0]}",
                stacklevel=2,
            )
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = found if found in DETERMINISTIC_CUBLAS else DETERMINISTIC_CUBLAS[0]
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


def _create_group(rt: Runtime, environ) -> None:
    """Create the default process group from torchrun's environment (see group_backend, group_timeout)."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(name)]
    if missing:
        raise SettingsError(f"WORLD_SIZE={rt.world_size} but {', '.join(missing)} not set; launch with torchrun")
    backend, timeout = group_backend(rt), group_timeout(rt)
    # NCCL given its GPU at once: a wrong mapping fails here, not at the first collective.
    device: dict[str, Any] = {"device_id": rt.device} if backend == "nccl" else {}
    # This module's functions bind `group=group.WORLD` as default arguments when it is first
    # imported (DDP imports it, through torch._dynamo); imported once the group exists, they
    # would keep the group alive past destroy_process_group (see stop).
    from torch.distributed.nn import functional  # noqa: F401

    dist.init_process_group(
        backend=backend,
        rank=rt.rank,
        world_size=rt.world_size,
        timeout=timeout,
        **device,
        **_rendezvous(environ, rt.world_size, timeout),
    )
    rt.owns_group = True


def group_backend(rt: Runtime) -> str:
    """NCCL where workers train one model together on GPUs, else Gloo.

    In jobs mode the group carries only small object collectives; on Gloo a wait that runs
    out ends in nnpd's one line, where NCCL's watchdog would abort the process.
    """
    return "nccl" if rt.device.type == "cuda" and rt.ddp else "gloo"


def group_timeout(rt: Runtime) -> timedelta:
    """How long a collective waits: twice runtime.timeout_minutes, and a minute.

    Before its first broadcast rank 0 may wait up to runtime.timeout_minutes for the root's
    lease and as long again for an earlier launch's workers; the others wait in that broadcast.
    """
    return timedelta(minutes=2 * rt.timeout_minutes + 1)


def _rendezvous(environ, world_size, timeout) -> dict:
    """How workers meet: torchrun's agent store, with keys of their own per restart, else env://.

    The agent's store outlives a worker group, so after an elastic restart (torchrun
    --max-restarts) a new worker could read the address a dead one left there; a prefix
    per restart keeps every group's keys apart.
    """
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {"init_method": "env://"}
    client = dist.TCPStore(
        environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"nnpd/restart-{restart}", client)}


def start(runtime_settings: dict | None, environ=None) -> Runtime:
    """Validate settings, pick the device, configure torch and join the launch's process group."""
    settings = check_runtime(runtime_settings)
    environ = os.environ if environ is None else environ
    rank, world_size, local_rank = launch_environment(environ)
    if dist.is_available() and dist.is_initialized():
        raise SettingsError(
            "a launch cannot be started inside an active process group; "
            "start nnpd as its own launch (for a trained model, use store.restore)"
        )
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
    rt.previous_torch_state = torch_state()
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
    thread count, determinism and cuDNN flags and environment back.
    """
    if rt.owns_group and dist.is_initialized():
        # The group and its Gloo threads must end here, not at interpreter exit, where a Gloo
        # thread that frees a tensor cannot take the GIL and aborts the process ("terminate
        # called without an active exception"). So nothing may still hold the group: a DDP
        # wrapper's reducer does, and the first wrapper of a process sits in a reference cycle
        # (left by torch._dynamo's import inside DDP.__init__), collected here. A failed
        # training lets go of its wrapper (trainer.train); see also _create_group.
        gc.collect()
        dist.destroy_process_group()
    rt.owns_group = False
    if rt.previous_torch_state:
        put_back_torch_state(rt.previous_torch_state)
        rt.previous_torch_state = ()


SET_ENVIRONMENT = ("CUBLAS_WORKSPACE_CONFIG", "TORCHINDUCTOR_DETERMINISTIC")  # what set_determinism may set


def torch_state() -> tuple:
    """What start changes: threads, the determinism flag, cuDNN's flags and the environment it sets."""
    return (
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        {name: os.environ.get(name) for name in SET_ENVIRONMENT},
    )


def put_back_torch_state(state: tuple) -> None:
    """Restore what torch_state() recorded."""
    threads, deterministic, cudnn_deterministic, cudnn_benchmark, environment = state
    torch.set_num_threads(threads)
    set_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_deterministic, cudnn_benchmark
    for name, value in environment.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


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


@contextlib.contextmanager
def _collective(rt: Runtime, what: str):
    """Run one collective; a worker that died or cannot be reached ends the launch with one line.

    Gloo and NCCL report a vanished peer as a RuntimeError (DistBackendError and
    DistNetworkError are ones) with a multi-line C++ message.
    """
    try:
        yield
    except RuntimeError as error:
        raise LaunchError(lost_worker(rt, what, error)) from error


def lost_worker(rt: Runtime, what: str, error: BaseException) -> str:
    """The one line for a collective that failed because another worker is gone."""
    others = [rank for rank in range(rt.world_size) if rank != rt.rank]
    who = f"worker {others[0]}" if len(others) == 1 else "another worker"
    # "[.../pair.cc:553] Connection closed by peer [addr]:port. This is typically ..." -> its first sentence
    text = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(error).split())).split(". ")[0] or type(error).__name__
    return (
        f"{who} stopped or cannot be reached (worker {rt.rank}: {what} failed: {text}); "
        "the launch ends; the same command resumes"
    )


def barrier(rt: Runtime) -> None:
    """Wait for every worker (no-op in a single process)."""
    if not rt.distributed:
        return
    with _collective(rt, "barrier"):
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[rt.device.index])
        else:
            dist.barrier()


def broadcast_object(rt: Runtime, obj, src: int = 0):
    """Return rank `src`'s picklable object on every worker."""
    if not rt.distributed:
        return obj
    box = [obj]
    with _collective(rt, "broadcast"):
        dist.broadcast_object_list(box, src=src, device=rt.device if dist.get_backend() == "nccl" else None)
    return box[0]


def all_reduce_sum(rt: Runtime, tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over workers in place and return it."""
    if rt.distributed:
        with _collective(rt, "all_reduce"):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_object(rt: Runtime, obj) -> list:
    """Return every worker's object, in rank order."""
    if not rt.distributed:
        return [obj]
    gathered = [None] * rt.world_size
    with _collective(rt, "all_gather"):
        dist.all_gather_object(gathered, obj)
    return gathered
