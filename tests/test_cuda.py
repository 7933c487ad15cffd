"""The study on CUDA: precisions, restore onto CUDA and CPU, NCCL DDP. Skipped without a GPU."""

import json

import numpy as np
import pytest
import torch

import nnpd
from helpers import torchrun, write_settings
from store import restore

pytestmark = [
    pytest.mark.launch,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)"),
]


def precision_supported(precision):
    """Whether this GPU can train at the precision."""
    return precision != "bfloat16" or torch.cuda.is_bf16_supported()


def assert_same_state(on_cpu, on_gpu):
    """A state dict restored on the CPU is bitwise the one on the GPU, float32 master weights included."""
    assert on_cpu.keys() == on_gpu.keys()
    for name, tensor in on_gpu.items():
        assert tensor.is_cuda and on_cpu[name].device.type == "cpu"
        assert on_cpu[name].dtype == tensor.dtype == torch.float32, name  # autocast never lowers the weights
        assert torch.equal(on_cpu[name], tensor.cpu()), name


@pytest.mark.parametrize("precision", ["off", "float16", "bfloat16"])
def test_single_gpu_run_and_restore_on_cuda_and_cpu(tmp_path, precision):
    if not precision_supported(precision):
        pytest.skip(f"{torch.cuda.get_device_name()} does not support bfloat16")
    settings = write_settings(
        tmp_path / "s",
        tmp_path / "out",
        training=f'settings["runtime"]["device"] = "cuda"\n'
        f'settings["training"]["precision"] = "{precision}"\n'
        'settings["cohort"]["priors"] = ["uniform", "grid"]\n',
    )
    nnpd.execute("run", "smoke", settings)
    runs = sorted(p.parent for p in (tmp_path / "out").glob("runs/*/*/run.json"))
    assert len(runs) == 2
    for run in runs:
        record = json.loads((run / "run.json").read_text())
        assert record["backend"]["device_type"] == "cuda" and record["backend"]["cuda_version"]
        assert json.loads((run / "analysis.json").read_text())["state"] == "complete"
        on_gpu, on_cpu = restore(run, device="cuda"), restore(run, device="cpu")
        assert next(on_gpu.model.parameters()).is_cuda and not next(on_cpu.model.parameters()).is_cuda
        assert_same_state(on_cpu.model.state_dict(), on_gpu.model.state_dict())
        inputs = torch.from_numpy(on_cpu.array("training-data", "test_inputs"))
        with torch.no_grad():
            gpu = on_gpu.model(inputs.cuda()).cpu().numpy()
            cpu = on_cpu.model(inputs).numpy()
        np.testing.assert_allclose(gpu, cpu, rtol=1e-4, atol=1e-4)


def test_a_cpu_launch_does_not_reuse_a_gpu_model(tmp_path):
    settings = write_settings(
        tmp_path / "s",
        tmp_path / "out",
        training='settings["runtime"]["device"] = "cuda"\nsettings["cohort"]["priors"] = ["uniform"]\n',
    )
    nnpd.execute("train", "smoke", settings)
    write_settings(
        tmp_path / "s",
        tmp_path / "out",
        training='settings["runtime"]["device"] = "cpu"\nsettings["cohort"]["priors"] = ["uniform"]\n',
    )
    nnpd.execute("train", "smoke", settings)
    models = list((tmp_path / "out").glob("cache/model/*"))
    data = list((tmp_path / "out").glob("cache/training-data/*"))
    assert len(models) == 2 and len(data) == 1  # shared data, never a shared model


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible CUDA GPUs")
@pytest.mark.parametrize("parallel", ["jobs", "ddp"])
def test_two_gpus_under_torchrun(tmp_path, parallel):
    settings = write_settings(
        tmp_path / "s",
        tmp_path / "out",
        training=f'settings["runtime"]["device"] = "cuda"\nsettings["runtime"]["parallel"] = "{parallel}"\n',
    )
    result = torchrun("run", "--settings-dir", str(settings), extra_env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert result.returncode == 0, result.stdout + result.stderr
    runs = sorted(p.parent for p in (tmp_path / "out").glob("runs/*/*/run.json"))
    assert len(runs) == 4
    expected = 2 if parallel == "ddp" else 1
    assert all(json.loads((r / "run.json").read_text())["backend"]["ddp_world_size"] == expected for r in runs)
