"""Real two-process torchrun launches: CPU Gloo DDP reproduces single-process training, both
objectives, and resumes bitwise from a state saved at a stop every rank agreed on."""

import importlib.util
import math
import os
import subprocess
import sys
import time
import traceback
import weakref
from pathlib import Path

import pytest
import torch

import ddp
import runtime
import trainer

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "ddp_train_worker.py"
ROWS, BATCH, EPOCHS = 41, 40, 3  # global batch N-1: the last batch has one row, rank 1's shard is empty


def _worker_module():
    """Import the worker script for its data and model builders."""
    spec = importlib.util.spec_from_file_location("ddp_train_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torchrun(tmp_path, mode, nproc=2, timeout=120, device="cpu", arguments=()):
    """Launch the worker under torchrun; return (completed process, wall seconds, output file)."""
    output = tmp_path / f"{mode}.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(WORKER),
        str(output),
        mode,
        str(ROWS),
        str(BATCH),
        str(EPOCHS),
        device,
        *map(str, arguments),
    ]
    began = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - began, output


def _result(done, output):
    """Rank 0's saved result of a launch that must have succeeded."""
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(output)


@pytest.mark.unit
def test_sharding_leaves_rank_one_an_empty_last_shard():
    """The chosen sizes really exercise an empty shard, and unequal ones for the balanced objective."""
    last = trainer.epoch_batches(ROWS, BATCH)[-1]
    assert trainer.shard_sizes(last[1] - last[0], 2) == [1, 0]
    batches = trainer.epoch_batches(ROWS, _worker_module().BALANCED_BATCH)
    assert trainer.shard_sizes(batches[0][1] - batches[0][0], 2) == [3, 2]
    assert trainer.shard_sizes(batches[-1][1] - batches[-1][0], 2) == [1, 0]


def _check_matches_single_process(tmp_path, device, tolerance):
    """Launch 2-rank DDP on `device` and compare both objectives with one process on the same device."""
    done, _, output = _torchrun(tmp_path, "train", device=device)
    launched = _result(done, output)
    assert launched["identity"]["ddp_world_size"] == 2
    assert launched["identity"]["device_type"] == torch.device(device).type
    worker = _worker_module()
    rt = runtime.Runtime(device=torch.device(device if device == "cpu" else "cuda:0"))
    for name, settings in worker.objective_settings(BATCH, EPOCHS).items():
        ddp = launched["result"][name]
        assert ddp["history"]["world_size"] == 2
        weights, history = trainer.train(worker.make_model(), worker.make_data(ROWS), settings, rt, seed=worker.SEED)
        _assert_close_training(ddp, weights, history, worker, tolerance)


def _assert_close_training(ddp, weights, history, worker, tolerance, rows=ROWS):
    """DDP's losses, validation and weights equal one process's within `tolerance`."""
    assert history["world_size"] == 1
    assert ddp["history"]["rows_per_epoch"] == history["rows_per_epoch"] == rows
    assert ddp["history"]["train_loss"] == pytest.approx(history["train_loss"], abs=tolerance)
    assert history["train_loss"][-1] < history["train_loss"][0]  # it really trained
    for a, b in zip(ddp["history"]["validation"], history["validation"]):
        assert a["bce"] == pytest.approx(b["bce"], abs=tolerance)
    assert ddp["weights"].keys() == weights.keys()  # unwrapped: no "module." prefix
    for key in weights:
        torch.testing.assert_close(ddp["weights"][key], weights[key], atol=tolerance, rtol=tolerance)
    start = worker.make_model().state_dict()
    assert any(not torch.equal(start[k], weights[k]) for k in weights)


@pytest.mark.launch
def test_two_gloo_ranks_reproduce_single_process_training(tmp_path):
    """Weights and per-epoch losses of 2-rank CPU DDP match one process within float tolerance,
    for the BCE and the balanced objective (unequal and empty shards, a one-class last batch)."""
    _check_matches_single_process(tmp_path, "cpu", 1e-5)


@pytest.mark.launch
def test_two_gloo_ranks_reproduce_re_paired_and_contrastive_training(tmp_path):
    """Joint pairs re-paired in every batch: every rank derives the global batch's atoms, so 2-rank
    DDP equals one process for BCE and contrastive NRE, with unequal and empty shards."""
    done, _, output = _torchrun(tmp_path, "joint")
    launched = _result(done, output)
    worker = _worker_module()
    rt = runtime.Runtime(device=torch.device("cpu"))
    for name, settings in worker.joint_settings(BATCH, EPOCHS).items():
        weights, history = trainer.train(
            worker.make_model(), worker.make_joint_data(ROWS), settings, rt, seed=worker.SEED
        )
        rows = ROWS if name == "contrastive" else 2 * ROWS  # a loss per pair, or per row and re-paired row
        _assert_close_training(launched["result"][name], weights, history, worker, 1e-5, rows)
        objectives = launched["result"][name]["history"]["validation_objective"]
        assert objectives == pytest.approx(history["validation_objective"], abs=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible CUDA GPUs")
@pytest.mark.launch
def test_two_nccl_ranks_reproduce_single_gpu_training(tmp_path):
    """The same equivalence on two GPUs with NCCL."""
    _check_matches_single_process(tmp_path, "cuda", 1e-4)


@pytest.mark.launch
def test_a_rank_failing_mid_training_ends_the_launch_quickly(tmp_path):
    """Rank 1 raises: torchrun exits non-zero, not after the group's 60-minute timeout.

    A rank left waiting would hang far past the 180 s guard (subprocess.TimeoutExpired).
    """
    done, _, output = _torchrun(tmp_path, "fail", timeout=180)
    assert done.returncode != 0
    assert "injected failure on rank 1" in done.stdout + done.stderr
    assert not output.exists()
    # Both ranks' groups ended in runtime.stop on the way out (the worker checks it).
    assert "outlived runtime.stop" not in done.stdout + done.stderr


@pytest.mark.unit
def test_a_failed_trainings_frames_let_go_of_what_they_held():
    """A failed DDP training's traceback keeps its frames, and in them the DDP wrapper whose
    reducer holds the process group; the trainer clears them, the lines stay printable."""

    class Held:
        """Stands for the DDP wrapper."""

    def step(net):
        """Fails as a collective with a lost peer does."""
        raise RuntimeError("connection closed by peer")

    def train(net):
        """Holds `net` in its frame and re-raises as nnpd's launch does."""
        try:
            step(net)
        except RuntimeError as error:
            raise ValueError("training failed") from error

    held = Held()
    alive = weakref.ref(held)
    with pytest.raises(ValueError) as caught:
        train(held)
    del held
    assert alive() is not None  # the frames of both tracebacks hold it
    ddp.release_frames(caught.value)
    assert alive() is None
    printed = "".join(traceback.format_exception(caught.value))
    assert "connection closed by peer" in printed and "in step" in printed and "in train" in printed


# ---------------------------------------------------------------- stop together, resume bitwise

RESUMABLE_BATCHES = 9  # 41 rows in batches of 5: eight of 5 rows and one of 1, 27 steps in 3 epochs
STOPS = ("1", "9", "13", "17", "26", "27")  # flags exchanged after every step
ADAPTIVE_STOP = "~4"  # the trainer's own exchange schedule


def _expected_stop(step):
    """Where a stop rank 1 requests after `step` steps takes effect, as (epoch, batch, saved).

    The flags travel during the next step, so training stops one step later; a request
    at an epoch's last step is answered at that epoch's end.
    """
    step = int(step)
    done = step if step % RESUMABLE_BATCHES == 0 else step + 1
    return (done - 1) // RESUMABLE_BATCHES + 1, (done - 1) % RESUMABLE_BATCHES + 1, True


def _single_process_state(path):
    """A state of the worker's resumable recipe saved by one process: wrong for two ranks."""
    worker = _worker_module()
    hooks = trainer.TrainingHooks(
        save_state=lambda state: worker.save_atomically(state, str(path)),
        save_seconds=math.inf,
        stop_requested=lambda: True,
    )
    with pytest.raises(trainer.Preempted):
        trainer.train(
            worker.make_model(dropout=0.2),
            worker.make_data(ROWS),
            {**worker.RESUMABLE, "epochs": EPOCHS},
            runtime.Runtime(device=torch.device("cpu")),
            seed=worker.SEED,
            hooks=hooks,
        )


def _check_stops(stops):
    """Both ranks stopped at the same step: the predicted one, or for the adaptive schedule
    one after the request and no later than the end of its epoch."""
    assert all(stops[step] == [_expected_stop(step)] * 2 for step in STOPS), stops
    first, second = stops[ADAPTIVE_STOP]
    assert first == second and first[0] == 1 and int(ADAPTIVE_STOP[1:]) < first[1] <= RESUMABLE_BATCHES, stops


def _check_stop_and_resume(tmp_path, device):
    """Stop at several agreed steps saving at every exchange, then resume each state in a new launch."""
    done, _, output = _torchrun(tmp_path, "preempt", device=device, arguments=(tmp_path, *STOPS, ADAPTIVE_STOP))
    preempted = _result(done, output)["result"]
    _check_stops(preempted["stops"])
    files = [str(tmp_path / f"stop-{step}.pt") for step in (*STOPS, ADAPTIVE_STOP)]
    single = str(tmp_path / "single.pt")
    _single_process_state(single)
    ignored = {single: "another number of training ranks", f"rank0:{files[2]}": "rank 1 found no saved state"}
    done, _, output = _torchrun(tmp_path, "resume", device=device, arguments=(*files, *ignored))
    resumed = _result(done, output)["result"]
    reference = preempted["reference"]
    for name, step in [*zip(files, (*STOPS, ADAPTIVE_STOP)), *((name, None) for name in ignored)]:
        expected = [] if step is None else [tuple(preempted["stops"][step][0][:2])]
        assert resumed[name]["resumed"] == expected, name
        assert all(torch.equal(resumed[name]["weights"][k], v) for k, v in reference["weights"].items()), name
        assert resumed[name]["history"] == reference["history"], name
    warned = [line for line in (done.stdout + done.stderr).splitlines() if "ignoring the saved training state" in line]
    assert len(warned) == len(ignored), warned  # one line per ignored state, from rank 0 only
    assert all(sum(reason in line for line in warned) == 1 for reason in ignored.values()), warned


@pytest.mark.launch
def test_two_gloo_ranks_stop_together_and_resume_bitwise(tmp_path):
    """Any rank's stop request stops both at one step; every saved state resumes to the same bits.

    States of another world size, or offered to one rank only, are ignored with one warning.
    """
    _check_stop_and_resume(tmp_path, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible CUDA GPUs")
@pytest.mark.launch
def test_two_nccl_ranks_stop_together_and_resume_bitwise(tmp_path):
    """The same on two GPUs with NCCL (the flags travel on a Gloo side group)."""
    _check_stop_and_resume(tmp_path, "cuda")
