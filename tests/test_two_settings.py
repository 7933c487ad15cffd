"""A kit study in two plain settings dicts (README.md, "The settings files"): only `experiment` and `data`,
run and reported with every other setting at its default; the log and the report say how training ended, and
the `training` figure names the objective it trained."""

import json
import re

import pytest

from helpers import main_in_process, recorded_figures

pytestmark = pytest.mark.launch

STUDY = """
import torch

import nre_study


class Line(nre_study.Study):
    parameters = {"slope": (-1.0, 1.0), "offset": (-1.0, 1.0)}

    def simulate(self, theta, generator):
        noise = 0.3 * torch.randn(len(theta), 3, generator=generator, dtype=torch.float64)
        return theta[:, :1] * torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64) + theta[:, 1:] + noise
"""
# The kit's recipe (contrastive, up to 500 epochs, patience 50) on 400 simulations: a hundred or so short epochs.
TRAINING = 'SETTINGS = {{"experiment": "{module}:Line", "data": {{"train": 400, "validation": 200}}}}\n'
ANALYSIS = (
    'SETTINGS = {"analysis": "nre_analysis:NREAnalysis", "inference": {"truths": {"sobol_truths": 16}},\n'
    '            "cohort_plots": ["training"]}\n'
)
OUTCOME = re.compile(
    r"stopped early at epoch (\d+) of 500 \(patience 50: the validation contrastive loss had not "
    r"improved for 50 epochs\), kept epoch (\d+) \(validation contrastive loss ([\d.]+)\)"
)


@pytest.fixture(scope="module")
def smallest(tmp_path_factory):
    """The study run and reported from a folder with a space in its name: (output root, run, report, figures)."""
    tmp = tmp_path_factory.mktemp("two_settings")
    folder, module = tmp / "tiny line", f"line_{tmp.name}"
    folder.mkdir()
    (folder / f"{module}.py").write_text(STUDY)
    (folder / "settings_training.py").write_text(TRAINING.format(module=module))
    (folder / "settings_analysis.py").write_text(ANALYSIS)
    pytest.importorskip("matplotlib")
    with recorded_figures() as figures:
        ran = main_in_process("run", "--settings-dir", str(folder), cwd=tmp)
    reported = main_in_process("report", "--settings-dir", str(folder), cwd=tmp)
    return tmp / "outputs" / "tiny_line", ran, reported, figures


def history(root):
    """The history of the root's one trained model."""
    (run,) = root.glob("runs/*/*/artifacts.json")
    return json.loads((root / json.loads(run.read_text())["model"] / "history.json").read_text())


def test_experiment_and_data_alone_train_one_uniform_member_and_analyse_it(smallest):
    root, ran, reported, _ = smallest
    assert ran.returncode == 0 and reported.returncode == 0, ran.stderr + reported.stderr
    (metrics,) = root.glob("runs/baseline-*/uniform-r0-*/metrics.json")  # outputs/<folder>: one member
    assert json.loads(metrics.read_text())["classification"]["auc"] > 0.8  # on the default test split
    assert json.loads((metrics.parent / "run.json").read_text())["settings"]["seed"] == 0


def test_the_log_ends_training_with_where_patience_stopped_it_and_the_kept_epoch(smallest):
    root, ran, _, _ = smallest
    found = history(root)
    logged = "\n".join(line for line in ran.stdout.splitlines() if "] model   runs/" in line)
    ((stopped, kept, loss),) = OUTCOME.findall(logged)
    assert int(stopped) == found["stopped_epoch"] == len(found["validation"]) < 500
    assert int(kept) == found["selected_epoch"] == int(stopped) - 50
    assert loss == f"{found['validation_objective'][int(kept) - 1]:.4f}"
    last = next(line for line in ran.stdout.splitlines() if f"epoch {stopped}/500: " in line)
    assert f"validation contrastive loss {found['validation_objective'][-1]:.4f}, BCE " in last and "AUC " in last


def test_report_repeats_how_training_ended_under_its_table(smallest):
    _, ran, reported, _ = smallest
    outcome = OUTCOME.search(ran.stdout).group(0)
    assert f"training: baseline uniform: {outcome}" in reported.stdout.splitlines()


def test_the_training_figure_names_the_objective_it_trained(smallest):
    (figure,) = [figure for figure in smallest[3] if figure.get_suptitle().startswith("Training of the members")]
    curves = figure.axes[0]
    legend = [text.get_text() for text in curves.get_legend().get_texts()]
    assert {"training contrastive loss", "validation contrastive loss"} <= set(legend)
    assert curves.get_ylabel() == "contrastive loss" and "BCE" not in curves.get_title()
