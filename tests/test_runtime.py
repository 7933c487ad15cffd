"""Device choice, launch environment, precision, determinism, identity and process-group rules."""

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import runtime
from settings import RUNTIME_DEFAULTS, SettingsError, check_runtime

ROOT = Path(__file__).resolve().parent.parent
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour of a machine without CUDA")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---------------------------------------------------------------- settings and environment


@pytest.mark.unit
def test_settings_defaults_and_validation():
    assert check_runtime({}) == RUNTIME_DEFAULTS
    assert check_runtime({"parallel": "ddp"})["parallel"] == "ddp"
    bad = [
        ({"parallel": "threads"}, "runtime.parallel"),
        ({"cpu_threads": 0}, "runtime.cpu_threads"),
        ({"cpu_threads": True}, "runtime.cpu_threads"),
        ({"cpu_threads": 1.5}, "runtime.cpu_threads"),
        ({"timeout_minutes": 0}, "runtime.timeout_minutes"),
        ({"timeout_minutes": "5"}, "runtime.timeout_minutes"),
        ({"deterministic": "yes"}, "runtime.deterministic"),
        ({"device": 0}, "runtime.device"),
        ({"devcie": "cpu"}, "runtime.devcie"),
        ({"resume_seconds": -1}, "runtime.resume_seconds"),
        ({"device": "cuda\n0"}, "runtime.device"),
    ]
    for given, name in bad:
        with pytest.raises(SettingsError, match=name):
            check_runtime(given)


@pytest.mark.unit
def test_launch_environment():
    assert runtime.launch_environment({}) == (0, 1, 0)
    assert runtime.launch_environment({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == (3, 4, 1)
    with pytest.raises(SettingsError, match="RANK"):
        runtime.launch_environment({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(SettingsError, match="inconsistent"):
        runtime.launch_environment({"RANK": "2", "WORLD_SIZE": "2"})


# ---------------------------------------------------------------- device rows


@no_cuda
@pytest.mark.unit
def test_auto_is_cpu_without_cuda():
    assert runtime.resolve_device("auto") == torch.device("cpu")
    assert runtime.resolve_device("auto", local_rank=1, world_size=2) == torch.device("cpu")
    assert runtime.resolve_device("cpu", local_rank=1, world_size=2) == torch.device("cpu")


@no_cuda
@pytest.mark.parametrize("spec", ["cuda", "cuda:0"])
@pytest.mark.unit
def test_cuda_without_cuda_fails_clearly(spec):
    with pytest.raises(SettingsError) as caught:
        runtime.resolve_device(spec)
    message = str(caught.value)
    assert message.startswith(f"runtime.device: '{spec}' requested but CUDA is not available")
    assert torch.__version__ in message and '"cpu"' in message and "\n" not in message


@pytest.mark.unit
def test_indexed_cuda_under_multi_worker_launch_names_cuda_visible_devices():
    with pytest.raises(SettingsError, match="CUDA_VISIBLE_DEVICES") as caught:
        runtime.resolve_device("cuda:0", local_rank=1, world_size=2)
    assert 'use "cuda"' in str(caught.value)


@pytest.mark.unit
def test_indexed_cuda_through_start_with_torchrun_environment():
    environ = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    with pytest.raises(SettingsError, match="CUDA_VISIBLE_DEVICES"):
        runtime.start({"device": "cuda:0"}, environ=environ)
    assert not dist.is_initialized()


@pytest.mark.parametrize("spec", ["mps", "meta", "gpu", "cuda0", "CPU", "cuda:", "cuda:-1", "cuda:x", ""])
@pytest.mark.unit
def test_other_strings_list_the_valid_forms(spec):
    with pytest.raises(SettingsError) as caught:
        runtime.resolve_device(spec)
    message = str(caught.value)
    assert message.startswith("runtime.device:")
    for form in ('"auto"', '"cpu"', '"cuda"', '"cuda:N"'):
        assert form in message


@cuda
@pytest.mark.cuda
@pytest.mark.unit
def test_cuda_rows_on_a_gpu_machine():
    count = torch.cuda.device_count()
    assert runtime.resolve_device("auto") == torch.device("cuda", 0)
    assert runtime.resolve_device("cuda", local_rank=count - 1, world_size=count) == torch.device("cuda", count - 1)
    assert runtime.resolve_device(f"cuda:{count - 1}") == torch.device("cuda", count - 1)
    with pytest.raises(SettingsError, match="out of range"):
        runtime.resolve_device(f"cuda:{count}")
    if count > 1:
        with pytest.raises(SettingsError, match="one worker per visible GPU"):
            runtime.resolve_device("cuda", local_rank=count, world_size=count + 1)


@pytest.fixture
def fake_gpus(monkeypatch):
    """Make torch report `count` visible GPUs of a compute capability, and note which device is asked."""
    asked = []

    def fake(count=1, capability=(7, 0), name="Tesla V100-SXM2-16GB"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        return asked

    return fake


@pytest.mark.unit
def test_bfloat16_is_refused_on_a_gpu_that_only_emulates_it_judged_on_the_workers_own_gpu(fake_gpus):
    asked = fake_gpus(count=2, capability=(7, 0))
    with pytest.raises(SettingsError, match=r"compute capability 8.0 .*V100.*cuda:1.* has 7.0"):
        runtime.check_precision("bfloat16", torch.device("cuda", 1))
    assert asked == [torch.device("cuda", 1)]  # the worker's GPU, not the current one
    fake_gpus(count=2, capability=(8, 0), name="NVIDIA A100")
    assert runtime.check_precision("bfloat16", torch.device("cuda", 1)) is torch.bfloat16


@pytest.mark.unit
def test_a_worker_that_sees_one_gpu_uses_it_whatever_its_local_rank(fake_gpus):
    fake_gpus(count=1)
    assert runtime.resolve_device("cuda", local_rank=3, world_size=4) == torch.device("cuda", 0)
    fake_gpus(count=2)
    with pytest.raises(SettingsError, match="local rank 3 but only 2 GPU"):
        runtime.resolve_device("cuda", local_rank=3, world_size=4)


@pytest.mark.parametrize("site, used", [(":0:0", ":4096:8"), (":16:8", ":16:8"), (None, ":4096:8")])
@pytest.mark.unit
def test_a_non_deterministic_cublas_workspace_is_overridden_at_start_in_one_warning(monkeypatch, site, used):
    if site is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", site)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rt = runtime.start({"device": "cpu", "deterministic": True})
    inside = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    runtime.stop(rt)
    assert inside == used and os.environ.get("CUBLAS_WORKSPACE_CONFIG") == site  # stop puts the site's back
    messages = [str(w.message) for w in caught if "CUBLAS_WORKSPACE_CONFIG" in str(w.message)]
    assert len(messages) == (site == ":0:0") and all("\n" not in m for m in messages)


# ---------------------------------------------------------------- precision


@pytest.mark.unit
def test_precision_rules_on_cpu():
    assert runtime.check_precision("off", "cpu") is None
    assert runtime.check_precision("bfloat16", torch.device("cpu")) is torch.bfloat16
    with pytest.raises(SettingsError, match=r"^training\.precision: \"float16\" needs a CUDA device"):
        runtime.check_precision("float16", "cpu")


@cuda
@pytest.mark.cuda
@pytest.mark.unit
def test_precision_rules_on_cuda():
    assert runtime.check_precision("float16", "cuda") is torch.float16
    if torch.cuda.is_bf16_supported():
        assert runtime.check_precision("bfloat16", "cuda") is torch.bfloat16


# ---------------------------------------------------------------- determinism and streams


@pytest.mark.unit
def test_seeded_generator_streams():
    a = torch.rand(5, generator=runtime.seeded_generator(3, "permutation"))
    b = torch.rand(5, generator=runtime.seeded_generator(3, "permutation"))
    c = torch.rand(5, generator=runtime.seeded_generator(3, "init"))
    d = torch.rand(5, generator=runtime.seeded_generator(4, "permutation"))
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)
    assert 0 <= runtime.seeded_generator(3, "x").initial_seed() < 2**63


@pytest.mark.unit
def test_set_determinism_switches_torch_flags():
    before = torch.are_deterministic_algorithms_enabled()
    try:
        runtime.set_determinism(True)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] in (":4096:8", ":16:8")
        runtime.set_determinism(False)
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before)


# ---------------------------------------------------------------- start, identity, collectives


@pytest.mark.unit
def test_start_single_process_and_identity():
    rt = runtime.start({"device": "cpu", "cpu_threads": 2, "deterministic": False}, environ={})
    try:
        assert (rt.rank, rt.world_size, rt.is_main, rt.distributed, rt.ddp) == (0, 1, True, False, False)
        assert torch.get_num_threads() == 2
        identity = runtime.backend_identity(rt)
        assert identity == {
            "device_type": "cpu",
            "device_name": identity["device_name"],
            "cuda_version": torch.version.cuda,
            "torch_version": torch.__version__,
            "ddp_world_size": 1,
            "cpu_threads": 2,
            "deterministic": False,
        }
        assert isinstance(identity["device_name"], str) and identity["device_name"]
        assert type(identity["torch_version"]) is str
    finally:
        runtime.stop(rt)
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(False)


@pytest.mark.unit
def test_ddp_in_one_process_starts_nothing_and_collectives_are_no_ops():
    rt = runtime.start({"device": "cpu", "parallel": "ddp"}, environ={})
    try:
        assert not dist.is_initialized() and not rt.owns_group
        assert not rt.ddp and rt.train_world_size == 1
        assert runtime.backend_identity(rt)["ddp_world_size"] == 1
        runtime.barrier(rt)
        assert runtime.broadcast_object(rt, {"a": 1}) == {"a": 1}
        assert runtime.all_gather_object(rt, 5) == [5]
        assert torch.equal(runtime.all_reduce_sum(rt, torch.tensor([2.0])), torch.tensor([2.0]))
    finally:
        runtime.stop(rt)
        runtime.stop(rt)  # safe twice
        torch.use_deterministic_algorithms(False)


@pytest.mark.unit
def test_world_size_properties():
    jobs = runtime.Runtime(device=torch.device("cpu"), parallel="jobs", rank=1, world_size=2)
    ddp = runtime.Runtime(device=torch.device("cpu"), parallel="ddp", rank=1, world_size=2)
    assert jobs.distributed and not jobs.ddp and jobs.train_world_size == 1 and not jobs.is_main
    assert ddp.ddp and ddp.train_world_size == 2
    assert runtime.backend_identity(jobs)["ddp_world_size"] == 1
    assert runtime.backend_identity(ddp)["ddp_world_size"] == 2


NESTED = textwrap.dedent(
    """
    import tempfile, os, torch.distributed as dist
    import runtime
    path = os.path.join(tempfile.mkdtemp(), "rdzv")
    dist.init_process_group("gloo", init_method="file://" + path, rank=0, world_size=1)
    try:
        runtime.start({"device": "cpu"}, environ={})
    except (RuntimeError, ValueError) as error:
        print("REFUSED:", error)
    print("STILL_INITIALIZED:", dist.is_initialized())
    dist.destroy_process_group()
    """
)


@pytest.mark.launch
def test_nesting_inside_an_active_process_group_is_refused():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", NESTED], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "REFUSED: a launch cannot be started inside an active process group" in done.stdout
    assert "STILL_INITIALIZED: True" in done.stdout


# ---------------------------------------------------------------- stop requests


@pytest.fixture
def stop_request():
    """A StopRequest handling this process's SIGTERM and SIGINT, uninstalled afterwards."""
    request = runtime.StopRequest()
    request.install()
    yield request
    request.uninstall()


@pytest.mark.unit
def test_a_sigterm_delivered_twice_is_one_request_that_training_saves_on(stop_request):
    """Slurm and torchrun both pass SIGTERM on: the worker must still stop at its next step and save."""
    with stop_request.polling():
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)  # the second copy, a moment later
        assert stop_request() and stop_request.requested == "SIGTERM"
        time.sleep(0.01)
    signal.raise_signal(signal.SIGTERM)  # still within the window, training done: one request
    assert stop_request.requested == "SIGTERM"


@pytest.mark.unit
def test_a_later_signal_and_a_second_ctrl_c_interrupt_at_once(stop_request, monkeypatch):
    with stop_request.polling():
        signal.raise_signal(signal.SIGINT)
        with pytest.raises(runtime.Interrupted, match="SIGINT"):
            signal.raise_signal(signal.SIGINT)  # a second Ctrl-C: the user means it
    monkeypatch.setattr(runtime.StopRequest, "REPEAT_SECONDS", 0.05)
    time.sleep(0.1)
    with pytest.raises(runtime.Interrupted, match="SIGTERM"):
        signal.raise_signal(signal.SIGTERM)  # outside training, past the window


@pytest.mark.unit
def test_a_first_signal_outside_training_interrupts_at_once(stop_request):
    with pytest.raises(runtime.Interrupted, match="SIGTERM"):
        signal.raise_signal(signal.SIGTERM)
    signal.raise_signal(signal.SIGTERM)  # its repeat does not interrupt the clean-up


@pytest.mark.unit
def test_pairs_nest_and_the_outer_one_keeps_handlers_and_request_until_it_ends():
    """The command line's pair outlives the launch's own, so a repeat arriving while the end is printed is absorbed."""
    before = signal.getsignal(signal.SIGTERM)
    request = runtime.StopRequest()
    with request.handling():  # the command line's pair
        with request.polling(), request.handling():  # the launch's own, with training inside it
            signal.raise_signal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) == request.handle and request.requested == "SIGTERM"
        signal.raise_signal(signal.SIGTERM)  # a repeat: neither the default action nor an interruption
    assert signal.getsignal(signal.SIGTERM) is before and request.requested == "SIGTERM"


@pytest.mark.unit
def test_an_index_less_cuda_device_gets_the_current_gpus_index(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert runtime.Runtime(device=torch.device("cuda")).device == torch.device("cuda", 2)
    assert runtime.Runtime(device="cpu").device == torch.device("cpu")


@pytest.mark.unit
def test_stop_puts_back_cudnn_flags_and_the_environment_start_set(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_DETERMINISTIC", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    rt = runtime.start({"device": "cpu", "deterministic": True})
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    runtime.stop(rt)
    assert not torch.backends.cudnn.deterministic and torch.backends.cudnn.benchmark
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ and "TORCHINDUCTOR_DETERMINISTIC" not in os.environ


@pytest.mark.parametrize(
    "device, parallel, world, backend",
    [
        ("cpu", "ddp", 2, "gloo"),
        ("cuda:0", "ddp", 2, "nccl"),
        ("cuda:0", "jobs", 2, "gloo"),
        ("cuda:0", "ddp", 1, "gloo"),
    ],
)
@pytest.mark.unit
def test_only_collective_training_on_gpus_uses_nccl(device, parallel, world, backend):
    """Jobs mode exchanges only small objects: on Gloo a wait that runs out ends in nnpd's line."""
    rt = runtime.Runtime(device=torch.device(device), parallel=parallel, world_size=world)
    assert runtime.group_backend(rt) == backend


@pytest.mark.unit
def test_the_group_outwaits_rank_zeros_waits_for_the_lease_and_leftovers():
    rt = runtime.Runtime(device=torch.device("cpu"), timeout_minutes=5)
    assert runtime.group_timeout(rt) > timedelta(minutes=2 * 5)  # lease, then leftovers, then the broadcast
