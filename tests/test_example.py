"""The decay-rate example (examples/decay, docs/extending.md) trained and analysed through the CLI."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import analysis_metrics
import contrast
import runtime
from helpers import EXAMPLE, REPO, main_in_process, patched_settings
from store import restore


def run_example(*args, cwd, settings_dir=EXAMPLE):
    """`python nnpd.py ARGS --settings-dir DIR` in `cwd`, without PYTHONPATH: the settings folder holds the study."""
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PYTHONPATH")}
    return subprocess.run(
        [sys.executable, str(REPO / "nnpd.py"), *args, "--settings-dir", str(settings_dir)],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )


def run_example_in_process(*args, cwd, settings_dir=EXAMPLE):
    """run_example's command through nnpd.main in this process (what it answers needs no fresh process)."""
    return main_in_process(*args, "--settings-dir", str(settings_dir), cwd=cwd)


def cache_stamps(root):
    """{artifact directory: manifest mtime} of every committed artifact."""
    return {path.parent: path.stat().st_mtime_ns for path in Path(root, "cache").glob("*/*/artifact.json")}


KIT_METRICS = {
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
TRUTHS = 1000  # inference.truths.sobol_truths of the quick profile


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The example's quick profile, run once from an empty working directory."""
    work = tmp_path_factory.mktemp("decay")
    result = run_example("run", cwd=work)
    assert result.returncode == 0, result.stdout + result.stderr
    return work / "outputs" / "decay-quick", result


@pytest.mark.launch
def test_quick_profile_trains_both_priors_and_analyses_them(trained):
    root, _ = trained
    runs = sorted(path.parent for path in root.glob("runs/*/*/run.json"))
    assert [json.loads((run / "run.json").read_text())["member"]["prior"] for run in runs] == [
        "log-uniform",
        "uniform-rate",
    ]
    for run in runs:
        assert json.loads((run / "analysis.json").read_text())["state"] == "complete"
        metrics = json.loads((run / "metrics.json").read_text())
        assert set(metrics) == KIT_METRICS
        assert metrics["classification"]["auc"] > 0.7
        assert metrics["posterior"]["flat"]["flat_cases"] == 0  # informative posteriors: no false alarm
        exact = metrics["exact_reference"]
        for level, learned in metrics["coverage"].items():
            cases, nominal = learned["cases"], learned["nominal"]
            assert cases == TRUTHS
            # The exact likelihood's regions cover at the nominal rate: the truths fill the range of θ.
            low, high = exact["coverage"][level]["interval"]
            assert low <= nominal <= high, exact["coverage"][level]
            error = math.sqrt(nominal * (1 - nominal) / cases)
            assert abs(exact["coverage"][level]["joint"] - nominal) < 4 * error
            assert abs(learned["joint"] - nominal) < 0.05, learned
            low, high = learned["interval"]
            assert low <= learned["joint"] <= high
        # Learned regions are about as wide as exact ones, and wider at the higher level.
        widths, exact_widths = metrics["width"], exact["width"]
        assert widths["0.68"]["mean"] < widths["0.95"]["mean"]
        assert all(abs(widths[level]["mean"] / exact_widths[level]["mean"] - 1) < 0.2 for level in widths), widths
        # Modes scatter about the truth by about the posterior's spread (θ's sd is ~1/√8), the learned a little more.
        assert 0.2 < exact["bias"]["rmse"] < 0.5 and metrics["bias"]["rmse"] < 1.3 * exact["bias"]["rmse"]
        assert exact["mode_rmse_learned_vs_exact"] < 0.3
        # The learned log-ratio differences follow the exact ones; r averages to about 1 over the evidence.
        assert metrics["pairwise"]["correlation"] > 0.7
        normalization = metrics["normalization"]["learned"]
        assert abs(normalization["mean_ratio"] - 1) < 4 * normalization["standard_error"] + 0.1


@pytest.mark.launch
def test_a_second_run_recomputes_nothing(trained, tmp_path):
    root, _ = trained
    before = cache_stamps(root)
    again = run_example_in_process("run", cwd=root.parent.parent)
    assert again.returncode == 0, again.stderr
    assert "reused" in again.stdout and "sampling" not in again.stdout
    assert cache_stamps(root) == before


@pytest.mark.launch
def test_restore_gives_the_model_that_was_analysed(trained, monkeypatch):
    root, _ = trained
    monkeypatch.setattr(sys, "path", list(sys.path))  # restore adds the study's folder; undo it afterwards
    run = next(root.glob("runs/*/log-uniform-r0-*"))
    restored = restore(run, device="cpu")
    x, theta = (
        torch.from_numpy(np.asarray(restored.array("training-data", f"test_{name}"))) for name in ("x", "theta")
    )
    inputs, labels = contrast.fixed_pairs(x, theta, runtime.derived_seed(restored.settings["seed"], "test pairs"))
    with torch.no_grad():
        again = analysis_metrics.classification_metrics(restored.model(inputs), labels)
    assert again == pytest.approx(restored.metrics["classification"], rel=1e-6)
    assert type(restored.model).__name__ == "Standardized" and not restored.model.training


@pytest.mark.unit
def test_full_profile_plans_a_choice_of_widths(tmp_path):
    result = run_example_in_process("plan", "--profile", "full", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [c["knob"] for c in report["configurations"]] == [None, "model.hidden"]
    assert report["jobs"] == 12  # two priors times three replicas, per configuration
    assert not list(tmp_path.iterdir())  # plan writes nothing


@pytest.mark.launch
def test_a_bad_example_setting_is_one_line_naming_it(tmp_path):
    settings = patched_settings(tmp_path, {'"log-uniform": {"family": "uniform"}': '"log-uniform": {"family": "log"}'})
    result = run_example("run", cwd=tmp_path, settings_dir=settings)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "priors.log-uniform.family" in result.stderr
    assert not (tmp_path / "outputs").exists()


@pytest.mark.launch
def test_the_kit_figures_are_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    settings = patched_settings(
        tmp_path,
        {
            '"analysis": "nre_analysis:NREAnalysis",': '"analysis": "nre_analysis:NREAnalysis", "plots": '
            '["diagnostic_cases", "expected_coverage"], "cohort_plots": ["priors"], "metrics": ["classification", '
            '"bias", "coverage", "width", "resolution", "posterior", "exact_reference", "expected_coverage"],',
            '"sobol_truths": 1000': '"sobol_truths": 64',
            '"train": 8192, "validation": 1024, "test": 512': '"train": 1024, "validation": 128, "test": 128',
            '"epochs": 8': '"epochs": 1',
        },
    )
    result = run_example("run", cwd=tmp_path, settings_dir=settings)
    assert result.returncode == 0, result.stdout + result.stderr
    figures = sorted(tmp_path.glob("outputs/decay-quick/runs/*/*/plots/*.png"))
    assert len(figures) == 4 and all(figure.read_bytes()[:4] == b"\x89PNG" for figure in figures)
    assert len(list(tmp_path.glob("outputs/decay-quick/runs/*/plots/priors.png"))) == 1
