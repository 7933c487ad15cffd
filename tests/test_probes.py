"""Timing probes: exact accumulators in C and in Python, the same output from both, the
NNPD_PROBES switch, and the extension's build from a clean copy of the repository."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

import probes
from helpers import REPO

RECORD_KEYS = ["count", "nested", "total_s", "min_s", "max_s", "cpu_s"]


# ---- building the extension --------------------------------------------------------------


def clean_copy(destination):
    """Copy the repository's top-level sources and build files, as a clean checkout has them."""
    destination.mkdir(parents=True)
    for path in REPO.iterdir():
        if path.is_file() and (path.suffix in (".py", ".c", ".toml") or path.name == "README.md"):
            shutil.copy(path, destination / path.name)
    return destination


def pip_install(source, target, env=None):
    """`pip install SOURCE --target TARGET` (verbose, offline) with the test interpreter."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-v",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--no-cache-dir",
        "--target",
        str(target),
        str(source),
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A `pip install .` of a clean copy into a temporary target (the C extension included)."""
    work = tmp_path_factory.mktemp("built")
    done = pip_install(clean_copy(work / "source"), work / "target")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return work / "target"


@pytest.fixture(scope="module")
def without_compiler(tmp_path_factory):
    """The same install with CC=/bin/false: it succeeds, without the extension."""
    work = tmp_path_factory.mktemp("no_compiler")
    done = pip_install(
        clean_copy(work / "source"), work / "target", env={**environment_without_switches(), "CC": "/bin/false"}
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return work / "target", done.stdout + done.stderr


def environment_without_switches():
    """This process's environment without any probes switch."""
    return {k: v for k, v in os.environ.items() if not k.startswith("NNPD_PROBES")}


@pytest.fixture(scope="module")
def native(installed):
    """The freshly built C extension, loaded from the install target."""
    library = next(installed.glob("_probes*.so"))
    spec = importlib.util.spec_from_file_location("_probes", library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(params=["native", "python"])
def make(request, native):
    """A maker of fresh probes of each implementation, with the probes module's decorator."""
    maker = native.Probes if request.param == "native" else probes.PythonProbes
    return lambda **hooks: maker(decorate=probes.decorate, **hooks)


def run_probes_script(target, code, **env):
    """Run `code` in a fresh interpreter that sees only the standard library and `target`."""
    environment = {**environment_without_switches(), "PYTHONPATH": str(target), **env}
    # -S: no site-packages, so no other build of _probes (e.g. an editable install) is found
    return subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=target, env=environment, capture_output=True, text=True, timeout=60
    )


@pytest.mark.launch
def test_pip_install_packages_the_extension_and_the_probes_use_it(installed):
    assert list(installed.glob("_probes*.so")) and (installed / "probes.py").is_file()
    done = run_probes_script(
        installed,
        "import probes\nwith probes.phase('x'): pass\n"
        "print(probes.MODE, probes.NATIVE, probes.snapshot()['x']['count'])",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["native", "True", "1"]


@pytest.mark.launch
def test_without_a_compiler_the_install_succeeds_says_so_in_one_line_and_falls_back(without_compiler):
    target, output = without_compiler
    assert not list(target.glob("_probes*.so")) and (target / "probes.py").is_file()
    notices = [line for line in output.splitlines() if "_probes not built" in line]
    assert len(notices) == 1 and "pure-Python fallback" in notices[0]
    done = run_probes_script(
        target,
        "import probes\nwith probes.phase('x'): pass\n"
        "print(probes.MODE, probes.NATIVE, probes.snapshot()['x']['count'])",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["python", "False", "1"]


@pytest.mark.launch
def test_native_without_the_extension_is_a_clear_one_line_error(without_compiler):
    target, _ = without_compiler
    done = run_probes_script(target, "import probes\nprint(probes.MODE)\nprobes.check()", NNPD_PROBES="native")
    assert done.stdout.split() == ["off"]  # the import itself succeeds, probes off
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("probes.ProbesError: NNPD_PROBES=native") and "make setup" in last
    assert "NNPD_PROBES=python" in last


@pytest.mark.parametrize(
    "value, message", [("fast", "NNPD_PROBES='fast' is not valid"), ("yes", "NNPD_PROBES_CUDA='yes' is not valid")]
)
@pytest.mark.launch
def test_invalid_switches_are_clear_errors(installed, value, message):
    name = "NNPD_PROBES" if value == "fast" else "NNPD_PROBES_CUDA"
    done = run_probes_script(installed, "import probes\nprobes.check()", **{name: value})
    assert done.returncode != 0 and message in done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("mode, native_flag", [("native", "True"), ("python", "False")])
@pytest.mark.launch
def test_the_switch_chooses_the_implementation(installed, mode, native_flag):
    code = (
        "import json, probes\n"
        "with probes.phase('a'):\n    with probes.phase('a'): pass\n"
        "print(probes.MODE, probes.NATIVE, type(probes.PROBES).__name__)\n"
        "print(json.dumps(probes.snapshot()['a']))"
    )
    done = run_probes_script(installed, code, NNPD_PROBES=mode)
    assert done.returncode == 0, done.stderr
    first, record = done.stdout.splitlines()
    expected_type = "Probes" if mode == "native" else "PythonProbes"
    assert first.split() == [mode, native_flag, expected_type]
    assert {k: v for k, v in json.loads(record).items() if k in ("count", "nested")} == {"count": 1, "nested": 1}


@pytest.mark.launch
def test_off_gives_no_op_probes(installed):
    code = (
        "import probes\n"
        "def f(x): return x + 1\n"
        "timed = probes.phase('f')(f)\n"
        "with probes.phase('a', device='cuda') as p:\n    r = timed(1)\n"
        "probes.reset()\n"
        "print(probes.MODE, probes.NATIVE, timed is f, r, probes.snapshot())"
    )
    done = run_probes_script(installed, code, NNPD_PROBES="off", NNPD_PROBES_CUDA="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["off", "False", "True", "2", "{}"]


# ---- exact accumulators, both implementations ---------------------------------------------


@pytest.mark.launch
def test_counts_nesting_and_recursion_are_exact(make):
    p = make()
    with p.phase("a"):
        with p.phase("a"):
            with p.phase("b"):
                pass
        with p.phase("b"):
            pass

    @p.phase("fib")
    def fib(n):
        return n if n < 2 else fib(n - 1) + fib(n - 2)

    assert fib(10) == 55 and fib.__name__ == "fib" and fib.__wrapped__ is not None
    fib(1)
    snap = p.snapshot()
    assert list(snap) == ["a", "b", "fib"]
    assert [(snap[n]["count"], snap[n]["nested"]) for n in snap] == [(1, 1), (2, 0), (2, 176)]
    for record in snap.values():
        assert list(record) == RECORD_KEYS
        assert 0 <= record["min_s"] <= record["max_s"] <= record["total_s"]
        assert 0 <= record["cpu_s"] <= record["total_s"]


@pytest.mark.launch
def test_exceptions_inside_a_phase_are_recorded_and_pass_through(make):
    p = make()
    with pytest.raises(ZeroDivisionError):
        with p.phase("outer"):
            with p.phase("inner"):
                with p.phase("inner"):
                    raise ZeroDivisionError
    with pytest.raises(KeyError):
        p.phase("decorated")(lambda: {}["missing"])()
    snap = p.snapshot()
    assert {n: (r["count"], r["nested"]) for n, r in snap.items()} == {
        "outer": (1, 0),
        "inner": (1, 1),
        "decorated": (1, 0),
    }
    with p.phase("outer"):  # nothing stays open after the exception
        pass
    assert p.snapshot()["outer"]["count"] == 2 and p.snapshot()["outer"]["nested"] == 0


@pytest.mark.launch
def test_wall_and_cpu_time_are_measured(make):
    p = make()
    with p.phase("sleep"):
        time.sleep(0.02)
    with p.phase("spin"):
        until = time.thread_time() + 0.02
        while time.thread_time() < until:
            pass
    snap = p.snapshot()
    assert snap["sleep"]["total_s"] >= 0.02 and snap["sleep"]["cpu_s"] < 0.01
    assert snap["spin"]["cpu_s"] >= 0.02 and snap["spin"]["total_s"] >= snap["spin"]["cpu_s"]


@pytest.mark.launch
def test_a_phase_object_is_single_use_at_a_time(make):
    p = make()
    phase = p.phase("x")
    with phase:
        pass
    with phase:  # sequential reuse is fine
        with pytest.raises(RuntimeError, match="already open"):
            phase.__enter__()
    with pytest.raises(RuntimeError, match="without being entered"):
        phase.__exit__(None, None, None)
    with pytest.raises(TypeError, match="must be a str"):
        p.phase(3)
    assert p.snapshot()["x"]["count"] == 2 and phase.name == "x" and phase.device is None


@pytest.mark.launch
def test_reset_forgets_closed_spans_and_keeps_open_ones(make):
    p = make()
    with p.phase("gone"):
        pass
    with p.phase("open"):
        p.reset()
        assert p.snapshot() == {}
    snap = p.snapshot()
    assert list(snap) == ["open"] and snap["open"]["count"] == 1


@pytest.mark.launch
def test_generators_may_close_a_phase_out_of_order_and_in_another_thread(make):
    p = make()

    def suspended():
        with p.phase("g"):
            yield
            yield

    first = suspended()
    with p.phase("h"):
        next(first)  # g opens inside h ...
    next(first, None)
    next(first, None)  # ... and closes after it
    second = suspended()
    next(second)
    mover = threading.Thread(target=lambda: (next(second, None), next(second, None)))
    mover.start()
    mover.join()  # g opened here, closed in the other thread
    with p.phase("g"):  # neither left g open in this thread
        pass
    snap = p.snapshot()
    assert (snap["g"]["count"], snap["g"]["nested"], snap["h"]["count"]) == (3, 0, 1)


@pytest.mark.launch
def test_a_span_closed_in_another_thread_adds_no_cpu_time(make):
    p = make()

    def suspended():
        with p.phase("moved"):
            yield

    generator = suspended()
    next(generator)
    mover = threading.Thread(target=lambda: next(generator, None))
    mover.start()
    mover.join()
    record = p.snapshot()["moved"]
    assert record["count"] == 1 and record["cpu_s"] == 0 and record["total_s"] > 0


@pytest.mark.launch
def test_threads_have_their_own_nesting_and_counts_add_up(make):
    p = make()
    workers, rounds = 6, 200
    barrier = threading.Barrier(workers)

    def work():
        with p.phase("outer"):
            barrier.wait()  # every thread holds "outer" open at once
            with p.phase("outer"):
                for _ in range(rounds):
                    with p.phase("step"):
                        pass

    threads = [threading.Thread(target=work) for _ in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    snap = p.snapshot()
    assert (snap["outer"]["count"], snap["outer"]["nested"]) == (workers, workers)
    assert (snap["step"]["count"], snap["step"]["nested"]) == (workers * rounds, 0)


@pytest.mark.launch
def test_cpu_time_is_the_threads_own(make):
    p = make()
    started, finished = threading.Event(), threading.Event()

    def spin():
        started.wait()
        until = time.thread_time() + 0.05
        while time.thread_time() < until:
            pass
        finished.set()

    spinner = threading.Thread(target=spin)
    spinner.start()
    with p.phase("waiting"):  # the other thread spins entirely inside this span
        started.set()
        finished.wait()
    spinner.join()
    record = p.snapshot()["waiting"]
    assert record["total_s"] >= 0.05 and record["cpu_s"] < 0.025


@pytest.mark.launch
def test_the_device_hook_brackets_spans_given_a_device(make):
    calls = []

    def device_timer(name, device):
        calls.append(("start", name, device))
        return lambda: calls.append(("stop", name, device))

    p = make(device_timer=device_timer)
    with p.phase("host"):
        with p.phase("step", device="gpu0"):
            calls.append(("body", "step", "gpu0"))
    p.phase("call", "gpu1")(lambda: None)()
    assert calls == [
        ("start", "step", "gpu0"),
        ("body", "step", "gpu0"),
        ("stop", "step", "gpu0"),
        ("start", "call", "gpu1"),
        ("stop", "call", "gpu1"),
    ]
    with pytest.raises(TypeError, match="unexpected keyword"):
        p.phase("x", devices="cpu")


@pytest.mark.launch
def test_a_nested_span_of_the_same_name_is_not_timed_on_the_device_twice(make):
    calls = []

    def device_timer(name, device):
        calls.append(("start", name))
        return lambda: calls.append(("stop", name))

    p = make(device_timer=device_timer)
    with p.phase("step", device="gpu0"):
        with p.phase("step", device="gpu0"):  # recursion or nesting: one span of device time
            pass
    assert calls == [("start", "step"), ("stop", "step")]
    assert p.snapshot()["step"]["nested"] == 1


@pytest.mark.unit
def test_the_cuda_timer_ignores_devices_that_are_not_cuda():
    timer = probes.CudaEventTimer()
    assert timer("step", torch.device("cpu")) is None and timer("step", "cpu") is None
    assert timer.resolve() == {}


# ---- the C extension against the Python fallback ---------------------------------------


def nest(names, depth):
    """A strategy for trees of phase names: (name, children) pairs."""
    leaf = st.tuples(names, st.just(()))
    return st.recursive(leaf, lambda inner: st.tuples(names, st.lists(inner, max_size=3).map(tuple)), max_leaves=depth)


def replay(p, tree, fail_at):
    """Run a tree of phases; the phase named `fail_at` raises after its children."""
    name, children = tree
    with p.phase(name):
        for child in children:
            try:
                replay(p, child, fail_at)
            except LookupError:
                pass
        if name == fail_at:
            raise LookupError(name)


def expected_counts(tree, open_names=()):
    """The model: {name: [count, nested]} for a tree, nested when already open."""
    name, children = tree
    counts = {name: [0, 1] if name in open_names else [1, 0]}
    for child in children:
        for child_name, (count, nested) in expected_counts(child, open_names + (name,)).items():
            total = counts.setdefault(child_name, [0, 0])
            total[0] += count
            total[1] += nested
    return counts


@settings(max_examples=40, deadline=None)
@given(trees=st.lists(nest(st.sampled_from("abc"), 12), min_size=1, max_size=3), fail_at=st.sampled_from("abcz"))
@pytest.mark.launch
def test_the_fallback_matches_the_extension_and_the_model(native, trees, fail_at):
    both = [native.Probes(decorate=probes.decorate), probes.PythonProbes(decorate=probes.decorate)]
    model = {}
    for tree in trees:
        for name, (count, nested) in expected_counts(tree).items():
            model.setdefault(name, [0, 0])
            model[name][0] += count
            model[name][1] += nested
        for p in both:
            try:
                replay(p, tree, fail_at)
            except LookupError:
                pass
    snapshots = [p.snapshot() for p in both]
    for snap in snapshots:
        assert {name: [r["count"], r["nested"]] for name, r in snap.items()} == model
        for record in snap.values():
            assert list(record) == RECORD_KEYS
            assert 0 <= record["cpu_s"] <= record["total_s"]
            assert record["min_s"] * record["count"] <= record["total_s"] + 1e-9
            assert record["max_s"] * record["count"] >= record["total_s"] - 1e-9
    assert list(snapshots[0]) == list(snapshots[1])


# ---- CUDA event timing (skipped without a GPU) ------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.launch
def test_cuda_events_time_the_device_side_of_a_phase(make):
    timer = probes.CudaEventTimer()
    p = make(device_timer=timer)
    x = torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    with p.phase("matmul", device=x.device):
        for _ in range(20):
            y = torch.tanh(x @ x)
    with p.phase("host"):
        y.sum()
    with p.phase("cpu side", device="cpu"):
        pass
    torch.cuda.synchronize()
    assert list(timer.resolve(wait=False)) == ["matmul"]  # finished pairs fold in without waiting
    with p.phase("matmul", device="cuda"):
        y = x @ x
    seconds = timer.resolve()
    assert list(seconds) == ["matmul"] and seconds["matmul"] > 0
    assert p.snapshot()["matmul"]["count"] == 2
    timer.reset()
    assert timer.resolve() == {}


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("flag", ["1", "0"])
@pytest.mark.launch
def test_device_time_is_reported_only_with_nnpd_probes_cuda(flag):
    code = (
        "import json, torch, probes\n"
        "x = torch.randn(512, 512, device='cuda')\n"
        "with probes.phase('matmul', device=x.device):\n    y = x @ x\n"
        "with probes.phase('host'):\n    pass\n"
        "print(json.dumps(probes.snapshot()))"
    )
    environment = {**environment_without_switches(), "PYTHONPATH": str(REPO), "NNPD_PROBES_CUDA": flag}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=environment, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    snap = json.loads(done.stdout)
    assert ("device_s" in snap["matmul"]) == (flag == "1") and "device_s" not in snap["host"]
    if flag == "1":
        assert snap["matmul"]["device_s"] > 0
