"""A launch's fixed costs: the optimizer without torch.optim (no torch._dynamo import), the same weights."""

import subprocess
import sys

import pytest
import torch

import trainer
from helpers import REPO

SETTINGS = {"learning_rate": 1e-3, "betas": [0.9, 0.999], "epsilon": 1e-8, "weight_decay": 0.01}


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)"),
    ],
)


def train_steps(make_optimizer, device, steps=20):
    """Weights and optimizer state after a few steps of a tiny regression from a fixed start."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(device)
    optimizer = make_optimizer(model.parameters())
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(16, 3, generator=generator).to(device)).pow(2).mean().backward()
        optimizer.step()
    return [p.detach().cpu() for p in model.parameters()], optimizer.state_dict()


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("kind, reference", [("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)])
@pytest.mark.unit
def test_functional_adam_gives_bitwise_the_weights_of_torch_optim(kind, reference, device):
    settings = {**SETTINGS, "optimizer": kind}
    ours, our_state = train_steps(lambda params: trainer.FunctionalAdam(params, settings, torch.device(device)), device)
    theirs, their_state = train_steps(
        lambda params: reference(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True), device
    )
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert set(our_state["state"]) == set(their_state["state"])
    for index, state in their_state["state"].items():
        assert all(torch.equal(state[name], our_state["state"][index][name]) for name in state)


@pytest.mark.unit
def test_functional_adam_continues_from_a_state_torch_optim_saved():
    settings = {**SETTINGS, "optimizer": "adam"}
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    theirs = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
    model(torch.ones(2, 3)).sum().backward()
    theirs.step()
    ours = trainer.FunctionalAdam(model.parameters(), settings, torch.device("cpu"))
    ours.load_state_dict(theirs.state_dict())
    for index, state in theirs.state_dict()["state"].items():
        assert all(torch.equal(state[name], ours.state[index][name]) for name in state)
    model(torch.ones(2, 3)).sum().backward()
    ours.step()
    assert float(ours.state[0]["step"]) == 2


@pytest.mark.unit
def test_a_float16_scaler_keeps_torch_optim():
    settings = {**SETTINGS, "optimizer": "adam"}
    params = [torch.nn.Parameter(torch.ones(3))]
    assert isinstance(trainer.make_optimizer(params, settings, torch.device("cpu"), scaled=True), torch.optim.Adam)
    assert isinstance(trainer.make_optimizer(params, settings, torch.device("cpu")), trainer.FunctionalAdam)


@pytest.mark.launch
def test_a_training_launch_imports_neither_dynamo_nor_inductor(study_dir):
    code = (
        "import sys, nnpd\n"
        f"status = nnpd.main(['train', '--profile', 'smoke', '--settings-dir', {str(study_dir)!r}])\n"
        "print(status, 'torch._dynamo' in sys.modules, 'torch._inductor' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-3:] == ["0", "False", "False"]


@pytest.mark.parametrize("kind, reference", [("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)])
@pytest.mark.unit
def test_torch_optim_continues_bitwise_from_a_state_functional_adam_saved(kind, reference):
    settings = {**SETTINGS, "optimizer": kind}
    both = []
    for second in ("ours", "theirs"):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        ours = trainer.FunctionalAdam(model.parameters(), settings, torch.device("cpu"))
        model(torch.ones(2, 3)).sum().backward()
        ours.step()
        if second == "theirs":
            theirs = reference(model.parameters(), lr=1.0, fused=True)  # hyper-parameters come from the state
            theirs.load_state_dict(ours.state_dict())
            ours = theirs
        ours.zero_grad()
        model(torch.full((2, 3), 2.0)).sum().backward()
        ours.step()
        both.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*both))
