"""End-to-end pipeline on tiny settings: train, analyze, reuse, clean-up, restore."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import contrast
import jobs
import nnpd
import runtime
from helpers import REPO, write_settings
from store import RestoreError, Store, restore

pytestmark = pytest.mark.launch


def cache_entries(root):
    """{(name, key): manifest mtime} of every committed artifact."""
    return {
        (path.parent.parent.name, path.parent.name): path.stat().st_mtime_ns
        for path in Path(root, "cache").glob("*/*/artifact.json")
    }


def run_dirs(root):
    """Every run folder under the output root."""
    return sorted(path.parent for path in Path(root, "runs").glob("*/*/run.json"))


def test_train_then_analyze_then_rerun_reuses_everything(study_dir, tmp_path):
    root = tmp_path / "out"
    nnpd.execute("train", "smoke", study_dir)
    runs = run_dirs(root)
    assert len(runs) == 4
    for run in runs:
        assert json.loads((run / "status.json").read_text())["state"] == "trained"
        assert not (run / "metrics.json").exists()
    trained = cache_entries(root)
    assert {name for name, _ in trained} == {"training-data", "model"}
    assert sum(name == "model" for name, _ in trained) == 4

    nnpd.execute("analyze", "smoke", study_dir)
    analysed = cache_entries(root)
    assert all(analysed[entry] == stamp for entry, stamp in trained.items())  # nothing retrained
    # Truths and observations are shared by all priors; the three continuous priors share candidates.
    names = [name for name, _ in analysed]
    assert names.count("truths") == 1 and names.count("observations") == 1
    assert names.count("candidates") == 2 and names.count("exact") == 2
    assert names.count("learned") == 4 and names.count("pairwise") == 4 and names.count("reference_logits") == 4
    for run in runs:
        check_metrics_of_a_tiny_run(run)
    check_the_plan_estimate_is_what_was_evaluated(root, study_dir)

    nnpd.execute("run", "smoke", study_dir)
    assert cache_entries(root) == analysed  # a re-run builds nothing
    checked, damaged = Store(root).verify()
    assert checked == len(analysed) and damaged == []


def check_metrics_of_a_tiny_run(run):
    """Every metric of the smoke analysis is there, with sane values."""
    metrics = json.loads((run / "metrics.json").read_text())
    assert set(metrics) == {
        "classification",
        "bias",
        "coverage",
        "width",
        "resolution",
        "posterior",
        "exact_reference",
        "expected_coverage",
        "pairwise",
        "reweighting",
        "normalization",
    }
    curve = metrics["expected_coverage"]
    assert len(curve["levels"]) == 99 and set(curve) == {"levels", "cases", "ratio", "posterior", "exact"}
    assert curve["exact"]["coverage"][67] == metrics["exact_reference"]["coverage"]["0.68"]["joint"]
    exact = metrics["normalization"]["exact"]  # a Monte Carlo mean of 32 ratios: within 4 standard errors
    assert abs(exact["mean_ratio"] - 1.0) <= 4 * exact["standard_error"]
    weighted = metrics["reweighting"]["sliced_wasserstein"]
    assert all(value > 0 for value in weighted.values())
    assert metrics["pairwise"]["pairs"] == 64  # every test simulation is a joint pair
    assert json.loads((run / "analysis.json").read_text())["state"] == "complete"
    assert 0.0 <= metrics["classification"]["accuracy"] <= 1.0


def check_the_plan_estimate_is_what_was_evaluated(root, study_dir):
    """The plan's workload estimate of the uniform member equals the model rows its analysis evaluated."""
    uniform = [
        job
        for c in nnpd.plan("smoke", study_dir)["configurations"]
        for job in c["jobs"]
        if job["member"] == "uniform-r0"
    ][0]
    store = Store(root)
    truths = next(store.artifact_at(p) for p in root.glob("cache/truths/*")).array("truths")
    uniform_run = next(run for run in run_dirs(root) if run.name.startswith("uniform-r0"))
    learned = store.artifact_at(root / json.loads((uniform_run / "artifacts.json").read_text())["learned"])
    assert uniform["workload"]["model_evaluations"] == len(truths) * (learned.metadata["candidates"] + 1) * 5


def test_adding_a_metric_reuses_weights_and_products(tmp_path):
    settings = write_settings(tmp_path / "s", tmp_path / "out", analysis='settings["metrics"] = ["bias"]\n')
    nnpd.execute("run", "smoke", settings)
    before = cache_entries(tmp_path / "out")
    write_settings(tmp_path / "s", tmp_path / "out", analysis='settings["metrics"] = ["bias", "coverage", "width"]\n')
    nnpd.execute("analyze", "smoke", settings)
    after = cache_entries(tmp_path / "out")
    assert after == before  # coverage and width read the same products
    for run in run_dirs(tmp_path / "out"):
        assert set(json.loads((run / "metrics.json").read_text())) == {"bias", "coverage", "width"}


def test_changed_learning_rate_reuses_training_data(tmp_path):
    settings = write_settings(tmp_path / "s", tmp_path / "out")
    nnpd.execute("train", "smoke", settings)
    first = cache_entries(tmp_path / "out")
    write_settings(tmp_path / "s", tmp_path / "out", training='settings["training"]["learning_rate"] = 3e-3\n')
    nnpd.execute("train", "smoke", settings)
    second = cache_entries(tmp_path / "out")
    data = {entry for entry in first if entry[0] == "training-data"}
    assert data == {entry for entry in second if entry[0] == "training-data"}
    assert all(second[entry] == first[entry] for entry in data)
    models_first = {entry for entry in first if entry[0] == "model"}
    models_second = {entry for entry in second if entry[0] == "model"}
    assert len(models_second) == 8 and models_first < models_second  # both trainings kept
    assert len(run_dirs(tmp_path / "out")) == 4  # runs/ holds only the latest launch


def trained_models(root):
    """The model keys the run folders of the latest training point at."""
    return {json.loads((run / "status.json").read_text())["model"] for run in run_dirs(root)}


def test_latest_settings_win_keeping_three(tmp_path):
    root, settings = tmp_path / "out", tmp_path / "s"
    models_of = {}
    for rate in (1e-3, 2e-3, 3e-3, 4e-3):
        write_settings(
            settings,
            root,
            training=f'settings["training"]["learning_rate"] = {rate}\nsettings["cohort"]["priors"] = ["uniform"]\n',
        )
        nnpd.execute("train", "smoke", settings)
        models_of[rate] = trained_models(root)
    assert len(set().union(*models_of.values())) == 4
    history = json.loads((root / "history.json").read_text())
    assert len(history["trainings"]) == 3
    models = {key for name, key in cache_entries(root) if name == "model"}
    assert models == models_of[2e-3] | models_of[3e-3] | models_of[4e-3]  # the oldest is gone
    assert (root / "settings_training.py").read_bytes() == (settings / "settings_training.py").read_bytes()
    # Switching back to a kept setting retrains nothing and does not use up a slot.
    write_settings(
        settings,
        root,
        training='settings["training"]["learning_rate"] = 2e-3\nsettings["cohort"]["priors"] = ["uniform"]\n',
    )
    before = cache_entries(root)
    nnpd.execute("train", "smoke", settings)
    assert cache_entries(root) == before
    assert trained_models(root) == models_of[2e-3]
    history = json.loads((root / "history.json").read_text())
    assert len(history["trainings"]) == 3
    assert len(list((root / "source").glob("*.zip"))) >= 1


def test_rerun_from_the_output_root_copies(study_dir, tmp_path):
    nnpd.execute("train", "smoke", study_dir)
    root = tmp_path / "out"
    before = cache_entries(root)
    nnpd.execute("train", "smoke", root)  # --settings-dir outputs/<profile>
    assert cache_entries(root) == before


def test_restore_on_cpu_after_moving_the_output_root(study_dir, tmp_path, monkeypatch):
    nnpd.execute("run", "smoke", study_dir)
    moved = tmp_path / "elsewhere" / "root"
    moved.parent.mkdir()
    shutil.move(str(tmp_path / "out"), str(moved))
    run = run_dirs(moved)[0]
    monkeypatch.setenv("RANK", "1")  # torchrun variables are ignored
    monkeypatch.setenv("WORLD_SIZE", "2")
    restored = restore(run, device="cpu")
    assert not torch.distributed.is_initialized()
    assert not restored.model.training
    assert next(restored.model.parameters()).device.type == "cpu"
    assert restored.member["name"] == run.name.rsplit("-", 1)[0]
    assert restored.history["epochs"] == 2 and len(restored.history["train_loss"]) == 2
    assert restored.settings["training"]["epochs"] == 2
    data = restored.artifacts["training-data"]
    x, theta = (torch.from_numpy(data.array(f"test_{name}")) for name in ("x", "theta"))
    inputs, _ = contrast.fixed_pairs(x, theta, runtime.derived_seed(restored.settings["seed"], "test pairs"))
    logits = restored.model(inputs).detach()
    stored = restored.array("test_predictions", "logits")
    np.testing.assert_allclose(logits.numpy(), stored, rtol=1e-5, atol=1e-5)
    assert restored.metrics["classification"]["accuracy"] >= 0.0


def test_restore_of_a_run_folder_moved_alone_fails_clearly(study_dir, tmp_path):
    nnpd.execute("train", "smoke", study_dir)
    run = run_dirs(tmp_path / "out")[0]
    lonely = tmp_path / "a" / "b" / "c" / "lonely"
    shutil.copytree(run, lonely)
    with pytest.raises(RestoreError, match="without its output root"):
        restore(lonely)


def test_non_gaussian_experiment_runs_through_the_framework(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    settings = tmp_path / "s"
    settings.mkdir()
    for name in ("settings_training.py", "settings_analysis.py"):
        text = (Path(__file__).parent / "toy_settings" / name).read_text()
        (settings / name).write_text(text.replace("OUTPUT_ROOT", str(tmp_path / "out")))
    summary = nnpd.execute("run", "toy", settings)
    assert len(summary["runs"]) == 3
    for run in run_dirs(tmp_path / "out"):
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["accuracy"]["accuracy"] > 0.7
        assert abs(metrics["slope"]["estimate"] - metrics["slope"]["truth"]) < 0.5
    assert json.loads((run / "run.json").read_text())["settings"]["experiment"] == "toy_study:SlopeExperiment"
    restored = restore(run)
    assert restored.model(torch.zeros(3, 2)).shape == (3,)


def test_analyze_after_editing_training_settings_analyses_the_latest_training(tmp_path, capsys):
    settings = write_settings(tmp_path / "s", tmp_path / "out", training='settings["cohort"]["priors"] = ["uniform"]\n')
    nnpd.execute("train", "smoke", settings)
    write_settings(
        tmp_path / "s",
        tmp_path / "out",
        training='settings["cohort"]["priors"] = ["uniform"]\nsettings["training"]["learning_rate"] = 5e-3\n',
    )
    before = cache_entries(tmp_path / "out")
    nnpd.execute("analyze", "smoke", settings)
    assert "differs from the latest training" in capsys.readouterr().err
    after = cache_entries(tmp_path / "out")
    assert {e for e in after if e[0] == "model"} == {e for e in before if e[0] == "model"}  # never trains
    run = run_dirs(tmp_path / "out")[0]
    assert json.loads((run / "analysis.json").read_text())["state"] == "complete"


def test_a_dropped_metric_leaves_no_stale_result(tmp_path):
    settings = write_settings(
        tmp_path / "s",
        tmp_path / "out",
        training='settings["cohort"]["priors"] = ["grid"]\n',
        analysis='settings["metrics"] = ["bias", "coverage"]\n',
    )
    nnpd.execute("run", "smoke", settings)
    write_settings(
        tmp_path / "s",
        tmp_path / "out",
        training='settings["cohort"]["priors"] = ["grid"]\n',
        analysis='settings["metrics"] = ["bias"]\n',
    )
    nnpd.execute("analyze", "smoke", settings)
    run = run_dirs(tmp_path / "out")[0]
    assert sorted(p.name for p in (run / "metrics").iterdir()) == ["bias.json"]
    assert set(json.loads((run / "metrics.json").read_text())) == {"bias"}
    assert set(restore(run).metrics) == {"bias"}


PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(jobs.matplotlib_missing(), reason="matplotlib (the optional [plots] extra) is not installed")
def test_figures_are_written_per_run_and_per_cohort(tmp_path):
    settings = write_settings(
        tmp_path / "s",
        tmp_path / "out",
        training='settings["cohort"]["priors"] = ["uniform", "grid"]\n',
        analysis='settings["plots"] = ["diagnostic_cases"]\n'
        'settings["cohort_plots"] = ["priors", "training", "estimates", "bias_width"]\n',
    )
    nnpd.execute("run", "smoke", settings)
    root = tmp_path / "out"
    for run in run_dirs(root):
        assert (run / "plots" / "diagnostic_cases.png").read_bytes().startswith(PNG)
    cohort = list(root.glob("runs/*/plots/*.png"))
    assert sorted(p.stem for p in cohort) == ["bias_width", "estimates", "priors", "training"]
    assert all(p.read_bytes().startswith(PNG) and p.stat().st_size > 5000 for p in cohort)
    # Retraining clears the cohort's figures with its analyses; a later analyze draws them again.
    write_settings(
        tmp_path / "s",
        tmp_path / "out",
        training='settings["cohort"]["priors"] = ["uniform", "grid"]\nsettings["training"]["epochs"] = 1\n',
        analysis='settings["cohort_plots"] = ["priors"]\n',
    )
    nnpd.execute("train", "smoke", settings)
    assert not list(root.glob("runs/*/plots")) and not list(root.glob("runs/*/*/plots"))
    nnpd.execute("analyze", "smoke", settings)
    assert sorted(p.stem for p in root.glob("runs/*/plots/*.png")) == ["priors"]


def test_figures_without_matplotlib_are_skipped_with_a_clear_warning(tmp_path):
    settings = write_settings(
        tmp_path / "s",
        tmp_path / "out",
        training='settings["cohort"]["priors"] = ["uniform"]\n',
        analysis='settings["cohort_plots"] = ["priors"]\n',
    )
    blocked = "import sys; sys.modules['matplotlib'] = None; import nnpd; sys.exit(nnpd.main(sys.argv[1:]))"
    plan = subprocess.run(
        [sys.executable, "-c", blocked, "plan", "--settings-dir", str(settings)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plan.returncode == 0, plan.stderr
    assert any("matplotlib is not installed" in w for w in json.loads(plan.stdout)["warnings"])
    done = subprocess.run(
        [sys.executable, "-c", blocked, "run", "--settings-dir", str(settings)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert not list((tmp_path / "out").glob("runs/**/*.png"))
    assert len(list((tmp_path / "out").glob("runs/*/*/metrics.json"))) == 1
