"""A study's own network (docs/extending.md, "Your own network"): the pulse example (examples/pulse), whose
`Pulse.embedding` is a 1-D convolution over a 200-point series, trained through the real command line on tiny
settings, restored on the CPU and asked for a posterior; its model key follows the embedding; plan refuses a
bad embedding and warns of a build_model of a study's own that drops the input standardisation.

Launches read a copy of the example's folder (output root, device and sizes replaced) whose study module
has a name of its own, so modules of one name are never mixed across tests in one interpreter.
"""

import json
import os
import runpy
import subprocess
import sys

import numpy as np
import pytest
import torch

import networks
import posterior
from helpers import REPO, main_in_process, run_cli
from store import restore

EXAMPLE = REPO / "examples" / "pulse"
SAMPLES, FEATURES, PARAMETERS = 200, 8, 2
ROOT_SETTING = '"output": {"root": f"outputs/pulse-{profile}"}'
# The quick profile made tiny: seconds on one CPU core.
TINY = {
    '"train": 4096, "validation": 512, "test": 512': '"train": 512, "validation": 128, "test": 128',
    '"epochs": 10': '"epochs": 2',
    '"device": "auto"': '"device": "cpu"',
}
NO_PYTHONPATH = {"PYTHONPATH": ""}


def example_copy(folder, root, module, extra="", training=None):
    """The example's files in `folder`, its study as module `module` (with `extra` appended), writing to `root`,
    tiny and on the CPU; `training` replaces further text of settings_training.py ({old: new})."""
    folder.mkdir(parents=True)
    study = (EXAMPLE / "pulse_study.py").read_text() + extra
    (folder / f"{module}.py").write_text(study)
    text = (EXAMPLE / "settings_training.py").read_text()
    replacements = {
        **TINY,
        ROOT_SETTING: f'"output": {{"root": {str(root)!r}}}',
        '"pulse_study:Pulse"': f'"{module}:Pulse"',
        **(training or {}),
    }
    for old, new in replacements.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (folder / "settings_training.py").write_text(text)
    (folder / "settings_analysis.py").write_text((EXAMPLE / "settings_analysis.py").read_text())
    return folder


def runs_by_prior(root):
    """{prior: run folder} of every run of an output root."""
    return {
        json.loads((path / "run.json").read_text())["member"]["prior"]: path
        for path in (run.parent for run in root.glob("runs/*/*/run.json"))
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`python nnpd.py train` of the tiny example without PYTHONPATH: {prior: run folder}."""
    work = tmp_path_factory.mktemp("pulse")
    settings = example_copy(work / "settings", work / "out", f"pulse_{work.name}")
    result = run_cli("train", "--settings-dir", str(settings), env=NO_PYTHONPATH)
    assert result.returncode == 0, result.stdout + result.stderr
    return runs_by_prior(work / "out")


@pytest.fixture
def restored(trained, monkeypatch):
    """The uniform prior's run restored on the CPU (restore adds the study's folder to sys.path; undone after)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    return restore(trained["uniform"], device="cpu")


@pytest.mark.unit
def test_plan_reads_the_example_folder_as_printed_in_the_docs():
    before = (REPO / "outputs" / "pulse-quick").exists()
    result = main_in_process("plan", "--settings-dir", "examples/pulse")  # from the repository root
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["errors"] == [] and plan["warnings"] == [] and plan["jobs"] == 2
    assert plan["configurations"][0]["input_size"] == SAMPLES + PARAMETERS  # the rows stay [x, θ]
    assert (REPO / "outputs" / "pulse-quick").exists() == before  # plan writes nothing


@pytest.mark.launch
def test_the_trained_model_holds_the_embedding_before_the_classifier(trained, restored):
    assert set(trained) == {"uniform", "normal"}
    model = restored.model
    assert isinstance(model, networks.Standardized) and isinstance(model.network, networks.Embedded)
    assert any(isinstance(layer, torch.nn.Conv1d) for layer in model.network.embedding.modules())
    # The `model` section shapes the classifier, which reads the embedding's features beside θ.
    assert model.network.classifier.input.in_features == FEATURES + PARAMETERS
    assert model.network.classifier.input.out_features == 32
    saved = restored.artifacts["model"].state_dict()
    assert {"shift", "scale", "network.embedding.1.weight", "network.classifier.output.weight"} <= set(saved)
    # Trained jointly: the embedding's weights moved from the ones the study initialises.
    fresh = restored.experiment.build_model(restored.member).state_dict()
    for name in ("network.embedding.1.weight", "network.embedding.7.weight", "network.classifier.output.weight"):
        assert fresh[name].shape == saved[name].shape and not torch.equal(fresh[name], saved[name]), name


@pytest.mark.launch
def test_the_standardisation_is_fitted_on_the_training_rows(restored):
    assert isinstance(restored.model.network, networks.Embedded)  # in front of the embedding, on [x, θ]
    x, theta = (
        np.asarray(restored.array("training-data", f"train_{name}"), dtype=np.float64) for name in ("x", "theta")
    )
    rows = np.concatenate([x, theta], axis=1)
    assert restored.model.shift.shape == (SAMPLES + PARAMETERS,)
    np.testing.assert_allclose(restored.model.shift.numpy(), rows.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(restored.model.scale.numpy(), rows.std(0, ddof=1), rtol=1e-5)


@pytest.mark.launch
def test_restore_gives_the_posterior_of_an_observation(restored):
    assert isinstance(restored.model.network, networks.Embedded)
    truth = torch.tensor([[1.2, 0.2]], dtype=torch.float64)
    x_o = restored.experiment.simulate(truth, torch.Generator().manual_seed(3)).numpy()  # (1, 200)
    with pytest.warns(posterior.PosteriorWarning, match="learned little"):  # the tiny profile learns little
        post = restored.posterior(x_o)
    mean = np.asarray(post.mean())
    assert mean.shape == (PARAMETERS,)
    assert 0.5 <= mean[0] <= 2.0 and 0.05 <= mean[1] <= 0.5  # inside the parameters' box
    assert post.sample(100, seed=0).shape == (100, PARAMETERS)
    # The network reads x: another observation gives another posterior.
    other = restored.experiment.simulate(
        torch.tensor([[0.6, 0.45]], dtype=torch.float64), torch.Generator().manual_seed(4)
    ).numpy()
    with pytest.warns(posterior.PosteriorWarning, match="learned little"):
        assert not np.allclose(np.asarray(restored.posterior(other).mean()), mean)


NARROWER = """

class Narrower(Pulse):
    def embedding(self):
        return torch.nn.Sequential(torch.nn.Unflatten(1, (1, SAMPLES)), torch.nn.Conv1d(1, 4, kernel_size=9, stride=4),
                                   torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 48, FEATURES))


class Without(Pulse):
    def embedding(self):
        return None
"""


@pytest.mark.unit
def test_the_model_recipe_follows_the_embedding(tmp_path, monkeypatch):
    module = f"pulse_{tmp_path.name}"
    folder = example_copy(tmp_path / "settings", tmp_path / "out", module, extra=NARROWER)
    monkeypatch.syspath_prepend(str(folder))
    studies = __import__(module)
    settings = runpy.run_path(str(folder / "settings_training.py"))["make_settings"]("quick")
    member = {"name": "uniform-r0", "prior": "uniform", "replica": 0}
    recipe, narrower, without = (
        cls(settings).model_recipe(member) for cls in (studies.Pulse, studies.Narrower, studies.Without)
    )
    assert recipe["embedding"]["features"] == FEATURES and "Conv1d(1, 8" in recipe["embedding"]["network"]
    assert "Conv1d(1, 4" in narrower["embedding"]["network"] and narrower != recipe
    assert {key: value for key, value in narrower.items() if key != "embedding"} == without
    # A study without an embedding keeps the recipe, so the keys of its models, as before.
    assert set(without) == {"model", "training", "seed", "member", "input_size"}


WRONG_SHAPE = """

class Flat(Pulse):
    def embedding(self):
        return torch.nn.Unflatten(1, (1, SAMPLES))          # (n, 1, 200): not features (n, k)
"""


@pytest.mark.unit
def test_an_embedding_returning_no_feature_rows_is_refused_at_plan_in_one_line(tmp_path):
    module = f"pulse_{tmp_path.name}"
    folder = example_copy(
        tmp_path / "settings",
        tmp_path / "out",
        module,
        extra=WRONG_SHAPE,
        training={f'"{module}:Pulse"': f'"{module}:Flat"'},
    )
    result = main_in_process("plan", "--settings-dir", str(folder))
    assert result.returncode == 2, result.stdout
    assert result.stderr.strip().count("\n") == 0
    assert "Flat.embedding()" in result.stderr and "(2, 1, 200)" in result.stderr
    assert not (tmp_path / "out").exists()


OWN_NETWORK = """

class OwnNetwork(Pulse):
    def build_model(self, member):
        torch.manual_seed(0)
        return torch.nn.Linear(self.input_size(), 1)


class OwnUnscaled(OwnNetwork):
    standardize = False
"""


@pytest.mark.parametrize("study, warned", [("OwnNetwork", True), ("OwnUnscaled", False), ("Pulse", False)])
@pytest.mark.unit
def test_a_build_model_of_the_studys_own_without_standardisation_is_warned_at_plan(tmp_path, study, warned):
    module = f"pulse_{tmp_path.name}"
    folder = example_copy(
        tmp_path / "settings",
        tmp_path / "out",
        module,
        extra=OWN_NETWORK,
        training={f'"{module}:Pulse"': f'"{module}:{study}"'},
    )
    result = main_in_process("plan", "--settings-dir", str(folder))
    assert result.returncode == 0, result.stderr
    lines = [line for line in json.loads(result.stdout)["warnings"] if "build_model" in line]
    assert bool(lines) == warned, lines
    if warned:
        assert f"{study}.build_model" in lines[0] and "standardisation" in lines[0] and "embedding()" in lines[0]


@pytest.mark.slow
@pytest.mark.launch
def test_two_torchrun_workers_train_the_embedding_together(tmp_path, monkeypatch):
    module = f"pulse_{tmp_path.name}"
    folder = example_copy(
        tmp_path / "settings",
        tmp_path / "out",
        module,
        training={
            '"parallel": "jobs"': '"parallel": "ddp"',
            '"priors": ["uniform", "normal"]': '"priors": ["uniform"]',
        },
    )
    environment = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    environment.update(NO_PYTHONPATH, OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(REPO / "nnpd.py"),
        "train",
        "--settings-dir",
        str(folder),
    ]
    result = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    run = runs_by_prior(tmp_path / "out")["uniform"]
    assert json.loads((run / "run.json").read_text())["backend"]["ddp_world_size"] == 2
    monkeypatch.setattr(sys, "path", list(sys.path))
    model = restore(run).model
    assert isinstance(model.network, networks.Embedded) and float(model.scale.min()) != 1.0
    with torch.no_grad():
        assert model(torch.zeros(3, SAMPLES + PARAMETERS)).shape == (3,)
