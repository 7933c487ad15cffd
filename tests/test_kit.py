"""The study kit's contract: what a study beside its settings files may write, and what nnpd checks for it.

Each test writes a small kit study module next to copies of the repository's settings
files (patched to name it) and runs the real command line: nnpd.main in-process where what it
answers needs no fresh process, a real launch without PYTHONPATH where the import path matters.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import nre_study
import runtime
import trainer
from helpers import REPO, kit_study, main_in_process, module_name, run_without_pythonpath, without_pythonpath
from nre_analysis import NREAnalysis
from store import Store


@pytest.mark.launch
def test_a_study_beside_its_settings_runs_without_pythonpath_and_restores(tmp_path):
    folder, module, root = kit_study(tmp_path)
    result = run_without_pythonpath("run", "--settings-dir", str(folder))
    assert result.returncode == 0, result.stderr
    metrics = [json.loads(path.read_text()) for path in root.glob("runs/*/*/metrics.json")]
    assert len(metrics) == 1 and metrics[0]["coverage"]["0.68"]["joint"] is not None
    run_dir = next(root.glob("runs/*/*/run.json")).parent
    # A fresh interpreter elsewhere: restore finds the study through the folder run.json keeps.
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); import torch; from store import restore; "
        f"r = restore({str(run_dir)!r}); print(tuple(r.model(torch.zeros(3, 5)).shape))"
    )
    restored = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=without_pythonpath(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert restored.returncode == 0, restored.stderr
    assert restored.stdout.strip() == "(3,)"


@pytest.mark.unit
def test_a_missing_study_module_says_where_nnpd_looked_and_what_to_set(tmp_path):
    folder, module, root = kit_study(tmp_path, training='settings["experiment"] = "no_such_kit_study:Line"\n')
    result = main_in_process("plan", "--settings-dir", str(folder))
    assert result.returncode == 2
    assert "cannot import module 'no_such_kit_study'" in result.stderr
    assert str(folder) in result.stderr and "PYTHONPATH" in result.stderr
    assert not root.exists()


@pytest.mark.unit
def test_a_training_typo_fails_plan_for_a_kit_study(tmp_path):
    folder, _, root = kit_study(tmp_path, training='settings["training"]["learning_rat"] = 0.1\n')
    result = main_in_process("plan", "--settings-dir", str(folder))
    assert result.returncode == 2, result.stdout
    assert "training.learning_rat" in result.stderr
    assert not root.exists()


OWN_TRAINER = '''

import runtime
import study
import trainer


class Own(study.Experiment):
    """The full contract, training through the bundled trainer by name."""

    def members(self):
        return [{"name": "only"}]

    def input_size(self):
        return 5

    def data_recipe(self, member):
        return {}

    def sample_data(self, member):
        return {}

    def model_recipe(self, member):
        return {}

    def build_model(self, member):
        return torch.nn.Linear(5, 1)

    def train(self, member, model, data, rt, hooks=None):
        return trainer.train(model, data, self.settings["training"], rt, 0, hooks)
'''


@pytest.mark.unit
def test_a_training_typo_fails_plan_for_a_study_calling_the_bundled_trainer(tmp_path):
    module = module_name(tmp_path)
    folder, _, _ = kit_study(
        tmp_path,
        extra=OWN_TRAINER + "\n\nclass Nothing(study.Analysis):\n"
        "    products = {}\n    metrics = {'size': study.Metric(len)}\n",
        training=f'settings["training"]["learning_rat"] = 0.1\nsettings["experiment"] = "{module}:Own"\n',
        analysis=f'settings["analysis"] = "{module}:Nothing"\nsettings["metrics"] = ["size"]\n',
    )
    result = main_in_process("plan", "--settings-dir", str(folder))
    assert result.returncode == 2, result.stdout
    assert "training.learning_rat" in result.stderr


INSTANCE_MEMBERS = '''

import study
from nre_analysis import NREAnalysis


class PerInstance:
    """An analysis whose members are set in __init__, not on the class; one metric is its own."""

    def __init__(self, settings, experiment):
        kit = NREAnalysis(settings, experiment)
        self.products, self.plots, self.cohort_plots = kit.products, {}, {}
        self.metrics = {**kit.metrics, "per_instance": study.Metric(lambda ctx: {"made_by": type(self).__name__})}
        self.SOURCES, self.validate, self.workload = kit.SOURCES, kit.validate, kit.workload
'''


@pytest.mark.launch
def test_analysis_members_may_be_instance_attributes(tmp_path):
    module = module_name(tmp_path)
    folder, _, root = kit_study(
        tmp_path,
        extra=INSTANCE_MEMBERS,
        analysis=f'settings["analysis"] = "{module}:PerInstance"\n'
        'settings["metrics"] = ["classification", "coverage", "per_instance"]\n',
    )
    result = main_in_process("run", "--settings-dir", str(folder))
    assert result.returncode == 0, result.stderr
    # The class has no members at all: what metrics.json holds came from the instance's products and metrics.
    metrics = [json.loads(path.read_text()) for path in root.glob("runs/*/*/metrics.json")]
    assert len(metrics) == 1
    assert metrics[0]["per_instance"] == {"made_by": "PerInstance"}
    assert metrics[0]["coverage"]["0.68"]["joint"] is not None and metrics[0]["classification"]


TWO_LOGITS = """

class TwoLogits(Line):
    def build_model(self, member):
        return torch.nn.Linear(self.input_size(), 2)


class ColumnLogits(Line):
    def build_model(self, member):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(self.input_size(), 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
"""


@pytest.mark.unit
def test_a_network_with_two_outputs_is_refused_at_plan_naming_the_study(tmp_path):
    module = module_name(tmp_path)
    folder, _, root = kit_study(tmp_path, extra=TWO_LOGITS, training=f'settings["experiment"] = "{module}:TwoLogits"\n')
    result = main_in_process("plan", "--settings-dir", str(folder))
    assert result.returncode == 2
    assert f"{module}:TwoLogits" in result.stderr and "(2, 2)" in result.stderr and "(N, 1)" in result.stderr
    assert not root.exists()


@pytest.mark.launch
def test_a_network_returning_a_column_of_logits_trains_and_is_analysed(tmp_path):
    module = module_name(tmp_path)
    folder, _, root = kit_study(
        tmp_path,
        extra=TWO_LOGITS,
        analysis='settings["metrics"] += ["pairwise"]\n',
        training=f'settings["experiment"] = "{module}:ColumnLogits"\nsettings["training"]["epochs"] = 10\n',
    )
    with open(folder / f"{module}.py", "a") as handle:  # pairwise needs the exact likelihood
        handle.write(
            "\n    def log_likelihood(self, x, theta):\n"
            "        mean = theta[..., :1] * torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64) + theta[..., 1:]\n"
            "        return torch.distributions.Normal(mean, 0.3).log_prob(x).sum(-1)\n"
        )
    result = main_in_process("run", "--settings-dir", str(folder))
    assert result.returncode == 0, result.stderr
    metrics = json.loads(next(root.glob("runs/*/*/metrics.json")).read_text())
    # Every test simulation is a joint pair: pairwise compares each with the next one's θ.
    assert metrics["pairwise"]["pairs"] == 64 and metrics["classification"]["auc"] > 0.5


def data_source_digest(folder, module):
    """The data key's source part of the study, computed in a fresh interpreter."""
    code = (
        f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(folder)!r}]; import fingerprint, study_loading, importlib; "
        f"cls = importlib.import_module({module!r}).Line; "
        "print(fingerprint.source_fingerprint(*study_loading.experiment_sources(cls.__new__(cls), 'DATA_SOURCES')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return result.stdout.strip()


@pytest.mark.launch
def test_editing_a_helper_the_simulator_calls_changes_the_data_key(tmp_path):
    folder, module, _ = kit_study(tmp_path)
    before = data_source_digest(folder, module)
    source = folder / f"{module}.py"
    source.write_text(source.read_text().replace("return 0.3", "return 0.4"))
    assert data_source_digest(folder, module) != before


METRICS = """

import numpy as np
from nre_analysis import NREAnalysis
from study import Metric


class Extra(NREAnalysis):
    metrics = {**NREAnalysis.metrics,
               "numpy_mean": Metric(lambda ctx: {"value": np.float32(0.25), "list": np.arange(3)}),
               "tensor": Metric(lambda ctx: {"value": torch.tensor([1.0])})}
"""


@pytest.mark.launch
def test_numpy_metric_values_are_stored_and_a_tensor_fails_naming_the_metric(tmp_path):
    module = module_name(tmp_path)
    folder, _, root = kit_study(
        tmp_path,
        extra=METRICS,
        analysis=f'settings["analysis"] = "{module}:Extra"\nsettings["metrics"] = ["numpy_mean"]\n',
    )
    analysis = folder / "settings_analysis.py"
    result = main_in_process("run", "--settings-dir", str(folder))
    assert result.returncode == 0, result.stderr
    run_dir = next(root.glob("runs/*/*/metrics.json")).parent
    assert json.loads((run_dir / "metrics" / "numpy_mean.json").read_text()) == {"value": 0.25, "list": [0, 1, 2]}
    analysis.write_text(analysis.read_text().replace('["numpy_mean"]', '["tensor"]'))
    result = main_in_process("analyze", "--settings-dir", str(folder))
    assert result.returncode == 1
    assert "metric 'tensor'.value is a Tensor" in result.stdout + result.stderr


@pytest.mark.unit
def test_the_bundled_trainer_takes_the_data_artifact_train_receives(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        f"{split}_{kind}": (rng.normal(size=(64, 3)) if kind == "inputs" else rng.integers(0, 2, 64)).astype(np.float32)
        for split in ("train", "validation")
        for kind in ("inputs", "labels")
    }
    store = Store(tmp_path / "root")

    def build(writer):
        for name, value in arrays.items():
            writer.array(name, value)

    artifact = store.get("training-data", {"test": 1}, build=build)
    settings = {"epochs": 1, "batch_size": 16, "optimizer": "adam", "learning_rate": 1e-2}
    rt = runtime.Runtime(device=torch.device("cpu"))
    weights = [
        trainer.train(torch.manual_seed(0) and torch.nn.Linear(3, 1), data, settings, rt, 0)[0]
        for data in (artifact, arrays, {k: torch.from_numpy(v) for k, v in arrays.items()})
    ]
    assert all(torch.equal(weights[0][k], other[k]) for other in weights[1:] for k in weights[0])
    with pytest.raises(TypeError, match="dict of arrays or the data artifact"):
        trainer.train(torch.nn.Linear(3, 1), [1, 2], settings, rt, 0)


@pytest.mark.launch
def test_plan_says_in_one_line_when_models_of_the_earlier_data_meaning_will_be_retrained(tmp_path):
    folder, _, root = kit_study(tmp_path, training='settings["data"]["pairing"] = "fixed"\n')
    assert main_in_process("train", "--settings-dir", str(folder)).returncode == 0
    planned = main_in_process("plan", "--settings-dir", str(folder))
    assert planned.returncode == 0, planned.stderr
    kept = json.loads(planned.stdout)
    assert not any("fixed pairs" in warning for warning in kept["warnings"])
    source = (folder / "settings_training.py").read_text()
    (folder / "settings_training.py").write_text(source.replace('settings["data"]["pairing"] = "fixed"', "pass"))
    planned = main_in_process("plan", "--settings-dir", str(folder))
    assert planned.returncode == 0, planned.stderr
    notes = [warning for warning in json.loads(planned.stdout)["warnings"] if "fixed pairs" in warning]
    assert len(notes) == 1 and "1 model(s)" in notes[0] and 'data.pairing = "fixed"' in notes[0]


@pytest.mark.launch
def test_run_and_report_print_every_resolution_warning_under_the_table(tmp_path):
    # 16 fixed points over the box cannot resolve a posterior this narrow: every case is under-resolved.
    folder, _, root = kit_study(
        tmp_path,
        noise=0.02,
        analysis='settings["inference"]["candidates"].update('
        'kind="sobol", candidate_count=16)\nsettings["metrics"] += ["resolution"]\n',
    )
    ran = main_in_process("run", "--settings-dir", str(folder))
    assert ran.returncode == 0, ran.stderr
    metrics = json.loads(next(root.glob("runs/*/*/metrics.json")).read_text())
    warning = metrics["resolution"]["warning"]
    assert isinstance(warning, str)
    line = f"warning: baseline uniform: {warning}"
    assert line in ran.stdout.splitlines()
    reported = main_in_process("report", "--settings-dir", str(folder))
    assert reported.returncode == 0 and line in reported.stdout.splitlines()
    # ... and the table's last column counts the flagged cases.
    lines = reported.stdout.splitlines()
    header = next(i for i, text in enumerate(lines) if text.startswith("configuration"))
    assert lines[header].split()[-1] == "unresolved"
    assert lines[header + 1].split()[-1] == str(metrics["resolution"]["flagged"]["any"]) != "0"


@pytest.mark.unit
def test_a_settings_file_importing_its_sibling_gets_the_sibling_not_nnpds_own(tmp_path):
    # The study's analysis settings take the profile names from its own training settings.
    folder, _, root = kit_study(tmp_path, training='settings["seed"] = 17\n')
    training = folder / "settings_training.py"
    training.write_text(
        training.read_text().replace('PROFILES = ("smoke", "default", "paper")', 'PROFILES = ("smoke", "mine")')
    )
    analysis = folder / "settings_analysis.py"
    analysis.write_text(
        analysis.read_text().replace(
            'PROFILES = ("smoke", "default", "paper")', "from settings_training import PROFILES"
        )
    )
    planned = main_in_process("plan", "--settings-dir", str(folder), "--profile", "mine")
    assert planned.returncode == 0, planned.stderr
    import settings_analysis
    import settings_training

    assert settings_training.PROFILES == settings_analysis.PROFILES == ("smoke", "default", "paper")
    assert str(folder) not in sys.path


@pytest.mark.launch
def test_a_simulators_warning_is_shown_as_the_studys_not_nnpds(tmp_path):
    module = module_name(tmp_path)
    folder, _, _ = kit_study(
        tmp_path,
        extra="""
        class Warns(Line):
            def simulate(self, theta, generator):
                import warnings
                warnings.warn("my simulator is unsure")
                return super().simulate(theta, generator)
        """,
        training=f'settings["experiment"] = "{module}:Warns"\n',
    )
    result = main_in_process("train", "--settings-dir", str(folder))
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "my simulator is unsure" in line]
    assert lines and all(line.startswith(f"{module}.py:") and ": warning: " in line for line in lines), lines


@pytest.mark.launch
def test_dropped_invalid_simulations_are_kept_in_run_json_and_named_by_the_report(tmp_path):
    module = module_name(tmp_path)
    folder, _, root = kit_study(
        tmp_path,
        extra="""
        class SometimesNaN(Line):
            def simulate(self, theta, generator):
                x = super().simulate(theta, generator)
                x[theta[:, 0] > 0.8] = float("nan")       # a tenth of the uniform prior's draws
                return x
        """,
        training=f'settings["experiment"] = "{module}:SometimesNaN"\nsettings["data"]["invalid"] = "drop"\n',
    )
    ran = main_in_process("run", "--settings-dir", str(folder))
    assert ran.returncode == 0, ran.stderr
    record = json.loads(next(root.glob("runs/*/*/run.json")).read_text())
    dropped = record["dropped_simulations"]
    assert set(dropped) == {"train", "validation", "test"} and dropped["train"] > 0
    data = next(root.glob("cache/training-data/*"))
    train_x = np.load(data / "train_x.npy")
    assert len(train_x) == record["settings"]["data"]["train"] - dropped["train"]
    line = f"note: baseline uniform: {sum(dropped.values()):,} invalid simulations dropped"
    assert any(entry.startswith(line) for entry in ran.stdout.splitlines()), ran.stdout
    reported = main_in_process("report", "--settings-dir", str(folder))
    assert reported.returncode == 0 and any(entry.startswith(line) for entry in reported.stdout.splitlines())


@pytest.mark.launch
def test_a_slow_simulator_shows_data_progress_with_rate_and_time_left(tmp_path):
    module = module_name(tmp_path)
    chunk = nre_study.SIMULATION_CHUNK
    folder, _, _ = kit_study(
        tmp_path,
        extra="""
        import time

        class Slow(Line):
            def simulate(self, theta, generator):
                if len(theta) > 2:              # not plan's contract checks, which simulate two rows
                    time.sleep(0.8)
                return super().simulate(theta, generator)
        """,
        training=f'settings["experiment"] = "{module}:Slow"\nsettings["data"]["train"] = {4 * chunk}\n'
        'settings["training"] = {"epochs": 1}\n',
    )
    trained = main_in_process("train", "--settings-dir", str(folder))
    assert trained.returncode == 0, trained.stderr
    lines = [line for line in trained.stdout.splitlines() if "] data    runs/" in line and "data.train" in line]
    # Four chunks of 0.8 s: quiet for the first 2 s, then a line at the third quarter and at the end.
    assert any(
        f"data.train {3 * chunk:,}/{4 * chunk:,} simulations" in line and "simulations/s" in line and "s left" in line
        for line in lines
    ), trained.stdout
    assert f"data.train {4 * chunk:,}/{4 * chunk:,} simulations" in lines[-1]


@pytest.mark.launch
def test_run_notes_posterior_coverage_under_a_non_uniform_prior_and_not_under_a_uniform_one(tmp_path):
    folder, _, root = kit_study(
        tmp_path,
        training='settings["cohort"]["priors"] = ["uniform", "normal"]\n'
        'settings["priors"]["normal"] = {"family": "normal"}\n',
        analysis='settings["inference"]["targets"] = ["ratio", "posterior"]\nsettings["metrics"] += ["posterior"]\n',
    )
    ran = main_in_process("run", "--settings-dir", str(folder))
    assert ran.returncode == 0, ran.stderr
    notes = [line for line in ran.stdout.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and notes[0].startswith(
        "note: baseline normal: the posterior target's coverage is judged against truths spread evenly over the box"
    ), ran.stdout
    for metrics in root.glob("runs/*/*/metrics.json"):
        note = json.loads(metrics.read_text())["posterior"]["truths_note"]
        assert (note is None) == ("/uniform-" in str(metrics)) and (note is None or note in notes[0])


class Flat(nre_study.Study):
    """x = θ + noise, for the kit's defaults."""

    parameters = {"a": (0.0, 1.0)}

    def simulate(self, theta, generator):
        return theta + torch.randn(len(theta), 1, generator=generator, dtype=torch.float64)


@pytest.mark.unit
def test_the_kit_defaults_one_uniform_member_and_a_test_split_enter_the_keys_as_if_written_out():
    short = Flat({"experiment": "x:Flat", "seed": 0, "data": {"train": 64, "validation": 16}})
    spelled = Flat(
        {
            "experiment": "x:Flat",
            "seed": 0,
            "cohort": {"priors": ["uniform"], "replicas": 1},
            "priors": {"uniform": {"family": "uniform"}},
            "data": {"train": 64, "validation": 16, "test": 16},
        }
    )
    short.validate()
    (member,) = short.members()
    assert member["name"] == "uniform-r0" and short.sample_data(member)["test_x"].shape == (16, 1)
    assert short.data_recipe(member) == spelled.data_recipe(member)
    assert short.model_recipe(member) == spelled.model_recipe(member)
    assert Flat({"cohort": {"priors": ["uniform"]}, "data": {}}).settings["cohort"]["replicas"] == 1


@pytest.mark.unit
def test_a_kit_study_without_data_is_told_what_it_reads_and_where_the_defaults_are(tmp_path):
    folder = tmp_path / "nodata"
    folder.mkdir()
    (folder / "flat_nodata.py").write_text(
        "import nre_study\n\n\nclass Flat(nre_study.Study):\n    parameters = {'a': (0.0, 1.0)}\n"
    )
    (folder / "settings_training.py").write_text('SETTINGS = {"experiment": "flat_nodata:Flat"}\n')
    (folder / "settings_analysis.py").write_text('SETTINGS = {"analysis": "nre_analysis:NREAnalysis"}\n')
    result = main_in_process("plan", "--settings-dir", str(folder), cwd=tmp_path)
    assert result.returncode == 2, result.stdout
    assert "missing sections: data; Flat reads:" in result.stderr
    assert (
        '(optional: cohort, priors, problem, model, training, rounds) (README.md, "The settings files")'
        in result.stderr
    )
    assert not (tmp_path / "outputs").exists()


class Copies(nre_study.Study):
    """x = θ + noise, two numbers: the smallest kit study, for what the kit's analysis fills in."""

    parameters = {"rate": (0.0, 1.0)}

    def simulate(self, theta, generator):
        return theta + 0.1 * torch.randn(len(theta), 2, generator=generator, dtype=torch.float64)


@pytest.mark.unit
def test_the_kit_analysis_draws_a_small_set_of_figures_unless_the_settings_name_them():
    experiment = Copies(
        {
            "seed": 1,
            "cohort": {"priors": ["uniform"], "replicas": 1},
            "priors": {"uniform": {"family": "uniform"}},
            "data": {"train": 64, "validation": 8},
        }
    )
    filled = NREAnalysis({"analysis": "nre_analysis:NREAnalysis"}, experiment).settings
    assert filled["plots"] == ["expected_coverage"]
    assert filled["cohort_plots"] == ["training", "estimates", "bias_width"]
    named = NREAnalysis(
        {"analysis": "nre_analysis:NREAnalysis", "plots": [], "cohort_plots": ["priors"]}, experiment
    ).settings
    assert named["plots"] == [] and named["cohort_plots"] == ["priors"]
