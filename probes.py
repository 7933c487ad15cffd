"""Timing probes: per-name counts and times of the phases of a launch.

    import probes
    with probes.phase("train.forward"):
        ...
    @probes.phase("analysis.case")          # each call is one span
    def analyse_case(...): ...
    probes.snapshot()  # {name: {"count", "nested", "total_s", "min_s", "max_s", "cpu_s"}}
    probes.reset()

A name accumulates its closed spans: how many (count), their wall time from a monotonic
clock (total_s, min_s, max_s) and the CPU time of the thread that ran each one (cpu_s). A
span is recorded when it closes, also when an exception leaves it. A phase entered while
one of the same name is open in the same thread (nesting, recursion) is counted under
"nested" and adds no time, so total_s is the wall time the name covers, never more. Probes
may be used from several threads at once; a span that ends in another thread than it
began in (a generator moved between threads) adds no CPU time.

The numbers are kept by the C extension `_probes` when it is built (NATIVE is True), else
by PythonProbes, its pure-Python twin with the same output. NNPD_PROBES chooses:
    native   the C extension; an error if it is not built
    python   the pure-Python fallback
    off      no-op probes: phase() does nothing, snapshot() is {}
    (unset)  native when built, else python
A value that cannot be honoured leaves the probes off and is kept in PROBLEM as one line
with its fix; `probes.check()` raises it as ProbesError, as nnpd's command line does.

CUDA device time: with NNPD_PROBES_CUDA=1, `probes.phase(name, device=d)` with d a CUDA
device also records a pair of CUDA events on d's current stream around the span, and
snapshot() waits for them and reports their summed elapsed time as that name's "device_s".
Without NNPD_PROBES_CUDA=1 the device is ignored: nothing is recorded on it and nothing
waits for it. Names never timed on a device have no "device_s".
"""

import collections
import functools
import os
import sys
import threading
from threading import get_ident
from time import perf_counter_ns, thread_time_ns

__all__ = [
    "STEP_PHASES",
    "COMMUNICATE",
    "PythonProbes",
    "OffProbes",
    "decorate",
    "CudaEventTimer",
    "probes_mode",
    "MODE",
    "DEVICE_TIMER",
    "PROBLEM",
    "phase",
    "count",
    "snapshot",
    "reset",
]

# The training's timed phases that timings.py reads back: one step's (timed in trainer.py) and DDP's
# gradient all-reduce within its backward pass (ddp.py). Named here so that timings needs neither module.
STEP_PHASES = ("train.forward", "train.loss", "train.backward", "train.optimizer")
COMMUNICATE = "train.communicate"

MODES = ("native", "python", "off")
NO_MINIMUM = 2**63 - 1  # what an empty minimum starts at, as in the C extension
COUNT, NESTED, TOTAL, MINIMUM, MAXIMUM, CPU = range(6)  # fields of a Python accumulator
PENDING_EVENTS = 4096  # completed CUDA event pairs are folded in beyond this many


class ProbesError(RuntimeError):
    """NNPD_PROBES or NNPD_PROBES_CUDA asks for something impossible (one line, with the fix)."""


# ---- the pure-Python twin of the C extension ------------------------------------------

_thread_state = threading.local()


def thread_open_stack():
    """This thread's list of open phases (Python twin of the C extension's stack)."""
    try:
        return _thread_state.stack
    except AttributeError:
        _thread_state.stack = []
        return _thread_state.stack


def _already_open(name):
    """The error for entering a phase object that is open."""
    return RuntimeError(f"probes.phase({name!r}) is already open; make a new probes.phase(...) for each with-block")


class PythonPhase:
    """One timed span of a PythonProbes: a single-use context manager, or a decorator."""

    __slots__ = (
        "owner",
        "name",
        "device",
        "acc",
        "stack",
        "thread",
        "nested",
        "wall_start",
        "cpu_start",
        "device_stop",
    )

    def __init__(self, owner, name, device):
        self.owner, self.name, self.device = owner, name, device
        self.acc = owner.accumulator(name)
        self.stack = self.device_stop = None
        self.nested = False

    def __enter__(self):
        """Start the clocks: wall first, CPU last, so the CPU span lies inside the wall span."""
        if self.stack is not None:
            raise _already_open(self.name)
        stack = thread_open_stack()
        acc = self.acc
        self.nested = False
        for other in stack:
            if other.acc is acc:
                self.nested = True
                break
        stack.append(self)
        self.stack, self.thread = stack, get_ident()
        if self.device is not None and self.owner.device_timer is not None and not self.nested:
            self.device_stop = self.owner.device_timer(self.name, self.device)  # nested: no time twice
        if not self.nested:
            self.wall_start = perf_counter_ns()
            self.cpu_start = thread_time_ns()
        return self

    def __exit__(self, exc_type, exc, traceback):
        """Stop the clocks and add the span to its name; the exception passes through."""
        stack = self.stack
        if stack is None:
            raise RuntimeError(f"probes.phase({self.name!r}) exited without being entered")
        acc = self.acc
        if self.nested:
            acc[NESTED] += 1
        else:
            cpu = thread_time_ns() - self.cpu_start if get_ident() == self.thread else 0
            wall = perf_counter_ns() - self.wall_start
            acc[COUNT] += 1
            acc[TOTAL] += wall
            acc[CPU] += cpu
            if wall < acc[MINIMUM]:
                acc[MINIMUM] = wall
            if wall > acc[MAXIMUM]:
                acc[MAXIMUM] = wall
        if stack[-1] is self:
            stack.pop()
        else:  # a generator suspended inside a phase closes out of order
            del stack[next(i for i, other in enumerate(stack) if other is self)]
        self.stack = None
        stop, self.device_stop = self.device_stop, None
        if stop is not None:
            stop()
        return False

    def __call__(self, function):
        """Decorate a function: each call runs inside a new phase of this name."""
        if self.owner.decorate is None:
            raise TypeError("this Probes object has no decorate hook; decorate through the probes module")
        return self.owner.decorate(self, function)

    def __repr__(self):
        return f"<probes phase {self.name!r}{' (open)' if self.stack is not None else ''}>"


class PythonProbes:
    """Per-name accumulators in pure Python, with the API and output of `_probes.Probes`."""

    def __init__(self, *, decorate=None, device_timer=None):
        self.decorate, self.device_timer = decorate, device_timer
        self.accumulators = {}

    def accumulator(self, name):
        """The accumulator list of a name, created (zeroed) on first use."""
        try:
            return self.accumulators[name]
        except KeyError:
            pass
        if not isinstance(name, str):
            raise TypeError(f"a phase name must be a str, not {type(name).__name__}")
        acc = self.accumulators[name] = [0, 0, 0, NO_MINIMUM, 0, 0]
        return acc

    def phase(self, name, /, device=None):
        """A new, closed phase of that name."""
        return PythonPhase(self, name, device)

    def snapshot(self):
        """{name: {count, nested, total_s, min_s, max_s, cpu_s}} since the last reset."""
        return {name: _record(acc) for name, acc in self.accumulators.items() if acc[COUNT] or acc[NESTED]}

    def reset(self):
        """Forget every closed span; spans open now are recorded when they close."""
        for acc in self.accumulators.values():
            acc[:] = [0, 0, 0, NO_MINIMUM, 0, 0]


def _record(acc):
    """The snapshot record of one Python accumulator (the C extension's keys and units)."""
    empty = acc[COUNT] == 0
    return {
        "count": acc[COUNT],
        "nested": acc[NESTED],
        "total_s": acc[TOTAL] / 1e9,
        "min_s": None if empty else acc[MINIMUM] / 1e9,
        "max_s": None if empty else acc[MAXIMUM] / 1e9,
        "cpu_s": acc[CPU] / 1e9,
    }


# ---- no-op probes -----------------------------------------------------------------------


class NoPhase:
    """The phase of NNPD_PROBES=off: does nothing, and decorates by returning the function."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        return False

    def __call__(self, function):
        return function


NO_PHASE = NoPhase()


class OffProbes:
    """Probes that record nothing (NNPD_PROBES=off)."""

    def phase(self, name, /, device=None):
        """The shared no-op phase."""
        return NO_PHASE

    def snapshot(self):
        """Always empty."""
        return {}

    def reset(self):
        """Nothing to forget."""


# ---- hooks shared by both implementations ---------------------------------------------


def decorate(phase, function):
    """Wrap a function so that each call runs inside a new phase like `phase`."""
    make, name, device = phase.owner.phase, phase.name, phase.device

    @functools.wraps(function)
    def timed(*args, **kwargs):
        """The function, timed as one span."""
        with make(name, device):
            return function(*args, **kwargs)

    return timed


class CudaEventTimer:
    """Device time of phases on CUDA devices, from pairs of CUDA events resolved lazily."""

    def __init__(self):
        self.pending: collections.deque = collections.deque()  # (name, start event, end event), oldest first
        self.seconds: dict[str, float] = {}
        self.lock = threading.Lock()

    def __call__(self, name, device):
        """Record a start event when `device` is a CUDA device; return what records the end."""
        torch = sys.modules.get("torch") or __import__("torch")
        device = torch.device(device)
        if device.type != "cuda":
            return None
        stream = torch.cuda.current_stream(device)
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)

        def stop():
            """Record the end event and queue the pair for snapshot()."""
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            self.pending.append((name, start, end))
            if len(self.pending) > PENDING_EVENTS:
                self.resolve(wait=False)

        return stop

    def resolve(self, wait=True):
        """Fold finished event pairs into the totals (waiting for all when `wait`); the totals."""
        with self.lock:
            while self.pending:
                name, start, end = self.pending[0]
                if not wait and not end.query():
                    break
                end.synchronize()
                self.seconds[name] = self.seconds.get(name, 0.0) + start.elapsed_time(end) / 1000
                self.pending.popleft()
            return dict(self.seconds)

    def reset(self):
        """Forget every recorded pair."""
        with self.lock:
            self.pending.clear()
            self.seconds.clear()


# ---- the module's own probes, chosen by NNPD_PROBES ------------------------------------


def probes_mode(environ=os.environ):
    """The implementation NNPD_PROBES asks for, with an unset variable meaning the best one built."""
    mode = environ.get("NNPD_PROBES", "").strip().lower()
    if mode and mode not in MODES:
        raise ProbesError(f"NNPD_PROBES={mode!r} is not valid; use native, python or off, or leave it unset")
    if mode in ("", "native") and _native_module() is None:
        if mode == "native":
            raise ProbesError(
                "NNPD_PROBES=native but the C extension _probes is not built; run `make setup` "
                "with a C compiler, or set NNPD_PROBES=python"
            )
        return "python"
    return mode or "native"


def cuda_events_enabled(environ=os.environ):
    """Whether NNPD_PROBES_CUDA=1 asks for CUDA event timing."""
    value = environ.get("NNPD_PROBES_CUDA", "").strip()
    if value not in ("", "0", "1"):
        raise ProbesError(f"NNPD_PROBES_CUDA={value!r} is not valid; use 1 (CUDA event timing) or 0")
    return value == "1"


def _native_module():
    """The C extension, or None when it is not built."""
    try:
        import _probes  # type: ignore[import-not-found]   # built by setup.py; no stubs
    except ImportError:
        return None
    return _probes


def make_probes(mode, device_timer=None):
    """A new set of probes of one mode, with this module's decorator and device hooks."""
    if mode == "off":
        return OffProbes()
    maker = _native_module().Probes if mode == "native" else PythonProbes
    return maker(decorate=decorate, device_timer=device_timer)


def configured(environ=os.environ):
    """(mode, device timer, problem): what the switches ask for, or probes off and what is wrong with them.

    A bad switch does not fail the import, so that every module using probes still imports
    (a model restores anywhere); `check()` raises it, and the command line does so first.
    """
    try:
        mode = probes_mode(environ)
        return mode, CudaEventTimer() if mode != "off" and cuda_events_enabled(environ) else None, None
    except ProbesError as error:
        return "off", None, " ".join(str(error).split())


def check():
    """Raise ProbesError when NNPD_PROBES or NNPD_PROBES_CUDA was set to something impossible."""
    if PROBLEM:
        raise ProbesError(PROBLEM)


MODE, DEVICE_TIMER, PROBLEM = configured()
NATIVE = MODE == "native"
PROBES = make_probes(MODE, DEVICE_TIMER)
phase = PROBES.phase


COUNTERS: dict[str, dict[str, float]] = {}  # phase -> {counter: amount} added by count() since the last reset


def count(name, **amounts):
    """Add amounts of work (model evaluations, network calls, ...) to a phase's record in the snapshot."""
    mine = COUNTERS.setdefault(name, {})
    for key, amount in amounts.items():
        mine[key] = mine.get(key, 0) + int(amount)


def snapshot():
    """{name: {count, nested, total_s, min_s, max_s, cpu_s[, device_s][, counters]}} since the last reset."""
    result = PROBES.snapshot()
    if DEVICE_TIMER is not None:
        for name, seconds in DEVICE_TIMER.resolve().items():
            if name in result:
                result[name]["device_s"] = seconds
    for name, amounts in COUNTERS.items():
        if name in result:  # a phase that was timed: its rates can be read off
            result[name].update(amounts)
    return result


def reset():
    """Forget everything recorded so far."""
    PROBES.reset()
    COUNTERS.clear()
    if DEVICE_TIMER is not None:
        DEVICE_TIMER.reset()
