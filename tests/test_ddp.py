"""Real two-process torchrun launches: CPU Gloo DDP reproduces single-process training."""

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

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


def _torchrun(tmp_path, mode, nproc=2, timeout=120, device="cpu"):
    """Launch the worker under torchrun; return (completed process, wall seconds, output file)."""
    output = tmp_path / f"{mode}.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        str(WORKER), str(output), mode, str(ROWS), str(BATCH), str(EPOCHS), device,
    ]
    began = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - began, output


def test_sharding_leaves_rank_one_an_empty_last_shard():
    """The chosen sizes really exercise an empty shard."""
    last = trainer.epoch_batches(ROWS, BATCH)[-1]
    assert trainer.shard_sizes(last[1] - last[0], 2) == [1, 0]


def _check_matches_single_process(tmp_path, device, tolerance):
    """Launch 2-rank DDP on `device` and compare with one process training on the same device."""
    done, _, output = _torchrun(tmp_path, "train", device=device)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ddp = torch.load(output)
    assert ddp["history"]["world_size"] == 2 and ddp["identity"]["ddp_world_size"] == 2
    assert ddp["identity"]["device_type"] == torch.device(device).type

    worker = _worker_module()
    rt = runtime.Runtime(device=torch.device(device if device == "cpu" else "cuda:0"))
    settings = {"epochs": EPOCHS, "batch_size": BATCH, "learning_rate": 0.05, "checkpoint": "last"}
    weights, history = trainer.train(worker.make_model(), worker.make_data(ROWS), settings, rt, seed=worker.SEED)

    assert history["world_size"] == 1
    assert ddp["history"]["rows_per_epoch"] == history["rows_per_epoch"] == ROWS
    assert ddp["history"]["train_loss"] == pytest.approx(history["train_loss"], abs=tolerance)
    assert history["train_loss"][-1] < history["train_loss"][0]  # it really trained
    for a, b in zip(ddp["history"]["validation"], history["validation"]):
        assert a["bce"] == pytest.approx(b["bce"], abs=tolerance)
    assert ddp["weights"].keys() == weights.keys()  # unwrapped: no "module." prefix
    for key in weights:
        torch.testing.assert_close(ddp["weights"][key], weights[key], atol=tolerance, rtol=tolerance)
    start = worker.make_model().state_dict()
    assert any(not torch.equal(start[k], weights[k]) for k in weights)


def test_two_gloo_ranks_reproduce_single_process_training(tmp_path):
    """Weights and per-epoch losses of 2-rank CPU DDP match one process within float tolerance."""
    _check_matches_single_process(tmp_path, "cpu", 1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible CUDA GPUs")
def test_two_nccl_ranks_reproduce_single_gpu_training(tmp_path):
    """The same equivalence on two GPUs with NCCL."""
    _check_matches_single_process(tmp_path, "cuda", 1e-4)


def test_a_rank_failing_mid_training_ends_the_launch_quickly(tmp_path):
    """Rank 1 raises: torchrun exits non-zero within seconds, not after the group timeout."""
    done, wall, output = _torchrun(tmp_path, "fail", timeout=90)
    assert done.returncode != 0
    assert "injected failure on rank 1" in done.stdout + done.stderr
    assert not output.exists()
    assert wall < 30, f"launch took {wall:.1f} s to fail"
