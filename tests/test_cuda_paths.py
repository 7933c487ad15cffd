"""The trainer's CUDA paths on one GPU, each mirrored on the CPU (or Gloo) where that makes sense:
bitwise resume at every precision, the timed all-reduce hook in a one-process group, steps
without host synchronisation, and no GPU memory left behind (docs/devices.md). The CUDA cases
are marked `cuda` and skip with the reason without a GPU; the mirrors run everywhere."""

import contextlib
import copy
import gc
import json
import os
import random
import subprocess
import sys

import pytest
import torch

import probes
import runtime
import trainer
from helpers import BATCHES, EPOCHS, REPO, SEED, SETTINGS, Recorder, make_data, make_model

NO_GPU = "needs a CUDA GPU (none visible)"


def on_cuda(*values):
    """A parametrize case that needs a GPU: marked `cuda`, skipped with the reason without one."""
    return pytest.param(
        *values, marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)]
    )


def skip_unsupported(device, precision):
    """Skip bfloat16 on a GPU without it (runtime.check_precision refuses it there)."""
    if device == "cuda" and precision == "bfloat16" and not torch.cuda.is_bf16_supported():
        pytest.skip(f"{torch.cuda.get_device_name()} does not support bfloat16")


@contextlib.contextmanager
def launched(device):
    """The runtime of a single-process launch on `device` (deterministic, as by default), stopped afterwards."""
    rt = runtime.start({"device": device}, environ={})
    try:
        yield rt
    finally:
        runtime.stop(rt)


def train_case(rt, precision, hooks=None, model=None):
    """test_resume's recipe (dropout, clipping, balanced objective) at a precision on rt's device."""
    return trainer.train(
        model or make_model(), make_data(), {**SETTINGS, "precision": precision}, rt, SEED, hooks=hooks
    )


def differences(a, b, path="") -> list:
    """Where two saved states differ: tensors bitwise (dtype and shape too), everything else by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
        return [] if same else [path or "/"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path or '/'} (keys {sorted(map(str, a))} != {sorted(map(str, b))})"]
        return [where for key in a for where in differences(a[key], b[key], f"{path}/{key}")]
    if isinstance(a, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
        return [where for i, (x, y) in enumerate(zip(a, b)) for where in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [path or "/"]


def load(path):
    """A saved training state, as nnpd reads it back."""
    return torch.load(path, weights_only=True)


# ---------------------------------------------------------------- bitwise resume at every precision

RESUME_CASES = [
    ("cpu", "off"),
    ("cpu", "bfloat16"),
    on_cuda("cuda", "off"),
    on_cuda("cuda", "float16"),
    on_cuda("cuda", "bfloat16"),
]


def stop_step(device, precision) -> int:
    """A random step to stop after, drawn from a stream fixed per case so that a failure reproduces."""
    return random.Random(f"stop/{device}/{precision}").randint(1, EPOCHS * BATCHES)


def check_dropout_streams(saved, device):
    """The saved state holds the global streams dropout draws from: CPU's, and the GPU's on CUDA."""
    (streams,) = [part["rng"] for part in saved["ranks"]]
    assert isinstance(streams["cpu"], torch.Tensor)
    if device == "cuda":
        assert isinstance(streams["cuda"], torch.Tensor) and streams["cuda"].dtype == torch.uint8, (
            "the saved state lacks the CUDA random stream that dropout on the GPU draws from"
        )


@pytest.mark.parametrize("device, precision", RESUME_CASES)
@pytest.mark.unit
def test_a_stop_at_a_random_step_resumes_to_the_same_bits(tmp_path, device, precision):
    """Uninterrupted, and stopped (state saved) then resumed: the final weights, Adam state, GradScaler
    state, streams and per-epoch history are bitwise the same, with dropout and clipping on."""
    skip_unsupported(device, precision)
    step = stop_step(device, precision)
    whole, part = Recorder(tmp_path / "whole.pt"), Recorder(tmp_path / "part.pt", stop_after=step)
    with launched(device) as rt:
        reference = train_case(rt, precision, whole.hooks(load=False))  # saves at each epoch end
        with pytest.raises(trainer.Preempted) as stopped:
            train_case(rt, precision, part.hooks())
        assert stopped.value.saved and part.polls == step
        check_dropout_streams(load(part.path), device)
        resumed = Recorder(part.path)
        # Another initialisation: everything must come from the saved state.
        result = train_case(rt, precision, resumed.hooks(), model=make_model(seed=99))
    assert resumed.resumed == [(stopped.value.epoch, stopped.value.batch)], f"stopped after step {step}"
    final, expected = load(part.path), load(whole.path)  # the states saved at the last epoch end
    assert final["state"]["epoch"] == EPOCHS and final["state"]["history"]["train_loss"]
    assert (final["state"]["scaler"] != {}) == (precision == "float16")  # the scaler's state is compared too
    assert differences(final["state"], expected["state"]) == [], f"stopped after step {step}"
    assert differences(final["ranks"], expected["ranks"]) == [], f"stopped after step {step}"
    assert differences(list(result), list(reference)) == []


# ---------------------------------------------------------------- no host synchronisation within a step


class SyncGuard:
    """A stop_requested hook that forbids host synchronisation from each epoch's second step to its last.

    It is polled after every step; the epoch's permutation (before its first step) and its
    close (after its last) synchronise by design, so the mode is "error" only between them.
    """

    def __init__(self, batches):
        self.batches, self.polls, self.guarded = batches, 0, 0

    def __call__(self) -> bool:
        """Guard the next step when it is of the same epoch; never ask to stop."""
        self.polls += 1
        more = self.polls % self.batches != 0
        torch.cuda.set_sync_debug_mode("error" if more else "default")
        self.guarded += more
        return False


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
@pytest.mark.parametrize("precision", ["off", "float16", "bfloat16"])
@pytest.mark.unit
def test_training_steps_never_wait_for_the_gpu(precision):
    """torch.cuda.set_sync_debug_mode("error") around every step that follows another in its epoch."""
    skip_unsupported("cuda", precision)
    previous = torch.cuda.get_sync_debug_mode()
    guard = SyncGuard(BATCHES)
    try:
        torch.cuda.set_sync_debug_mode("error")
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.ones(1, device="cuda").item()  # the mode really catches a synchronisation here
        torch.cuda.set_sync_debug_mode("default")
        with launched("cuda") as rt:
            weights, history = train_case(rt, precision, trainer.TrainingHooks(stop_requested=guard))
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert guard.guarded == EPOCHS * (BATCHES - 1)
    assert len(history["train_loss"]) == EPOCHS and all(t.device.type == "cpu" for t in weights.values())


# ---------------------------------------------------------------- no GPU memory left behind


def stop_then_resume(rt, precision, path, step):
    """A whole interrupted training: stopped after `step` steps with its state saved, then resumed."""
    try:
        train_case(rt, precision, Recorder(path, stop_after=step).hooks())
    except trainer.Preempted:
        pass  # leaving the block drops the exception, and with it the frames it holds
    else:
        raise AssertionError(f"no stop after step {step}")
    return train_case(rt, precision, Recorder(path).hooks())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
@pytest.mark.parametrize("precision", ["off", "float16"])
@pytest.mark.unit
def test_a_whole_training_leaves_no_gpu_memory_allocated(tmp_path, precision):
    """After a stopped and resumed training's objects are dropped, allocated GPU memory is what it was."""
    with launched("cuda") as rt:
        # cuBLAS keeps one workspace per handle and stream for the rest of the process: a first
        # training sets it up, so that the measured one is compared with a steady state.
        train_case(rt, precision)
        gc.collect()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        weights, _ = stop_then_resume(rt, precision, tmp_path / "state.pt", step=BATCHES + 3)
        gc.collect()
        assert torch.cuda.max_memory_allocated() > before  # the measured training did use the GPU
        assert torch.cuda.memory_allocated() == before
    assert all(t.device.type == "cpu" for t in weights.values())


# ---------------------------------------------------------------- the timed all-reduce in a one-process group


def all_reduce_check(device: str, directory: str) -> dict:
    """Gradients of DDP's own all-reduce and of trainer.timed_allreduce, and what the probes recorded.

    Runs in a process of its own (see run_all_reduce_check): a one-process NCCL or Gloo group
    on a FileStore, two DDP copies of one model, and three backward passes on the same inputs.
    """
    import torch.distributed as dist

    runtime.set_determinism(True)
    where = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    if where.type == "cuda":
        torch.cuda.set_device(where)
    store = dist.FileStore(os.path.join(directory, "store"), 1)
    dist.init_process_group("nccl" if where.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
    try:
        rt = runtime.Runtime(device=where, parallel="ddp", world_size=1)
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(2, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        ).to(where)
        ids = [where.index] if where.type == "cuda" else None
        native = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), device_ids=ids)
        timed = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), device_ids=ids)
        hook, calls = trainer.timed_allreduce(rt), []

        def counted(state, bucket):
            """The trainer's hook, counting its calls."""
            calls.append(bucket.index())
            return hook(state, bucket)

        timed.register_comm_hook(None, counted)
        generator, same, nonzero = torch.Generator().manual_seed(1), [], []
        for _ in range(3):
            inputs = torch.randn(32, 2, generator=generator).to(where)
            gradients = []
            for net in (native, timed):
                net.zero_grad(set_to_none=True)
                net(inputs).square().mean().backward()
                gradients.append([p.grad.detach().to("cpu", copy=True) for p in net.module.parameters()])
            same.append(all(torch.equal(a, b) for a, b in zip(*gradients)))
            nonzero.append(all(bool(g.abs().sum() > 0) for g in gradients[1]))
        record = probes.snapshot().get(trainer.COMMUNICATE)
        del native, timed
        gc.collect()
    finally:
        dist.destroy_process_group()
    return {"same": same, "nonzero": nonzero, "calls": len(calls), "record": record, "mode": probes.MODE}


def run_all_reduce_check(device, tmp_path) -> dict:
    """all_reduce_check in a fresh process with NNPD_PROBES_CUDA=1, as a launch would set it."""
    environment = {
        name: value
        for name, value in os.environ.items()
        if name not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NNPD_PROBES")
    }
    environment.update(NNPD_PROBES_CUDA="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, __file__, "all-reduce", device, str(tmp_path)],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("device", ["cpu", on_cuda("cuda")])
@pytest.mark.launch
def test_the_timed_all_reduce_gives_ddps_own_gradients_and_is_timed(tmp_path, device):
    """One-process Gloo (CPU) or NCCL (CUDA) group: the hook's gradients are bitwise DDP's own; every
    call is a train.communicate span, with device time from CUDA events on CUDA only."""
    found = run_all_reduce_check(device, tmp_path)
    assert found["mode"] != "off"
    assert found["same"] == [True] * 3 and all(found["nonzero"])
    assert found["calls"] >= 3  # at least one bucket per backward pass
    record = found["record"]
    assert record is not None and record["count"] + record["nested"] == found["calls"] and record["count"] >= 1
    # NNPD_PROBES_CUDA=1: CUDA events time NCCL's all-reduce; Gloo's span is host time only.
    assert ("device_s" in record) == (device == "cuda"), record
    assert record.get("device_s", 0.0) >= 0.0


if __name__ == "__main__":
    if sys.argv[1:2] == ["all-reduce"]:
        print(json.dumps(all_reduce_check(sys.argv[2], sys.argv[3])))
    else:
        raise SystemExit(f"usage: {sys.argv[0]} all-reduce cpu|cuda DIRECTORY")
