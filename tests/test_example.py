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

import inference
from conftest import REPO
from store import restore

EXAMPLE = REPO / "examples" / "decay"


def run_example(*args, cwd, settings_dir=EXAMPLE):
    """`python nnpd.py ARGS --settings-dir DIR` with the example's folder importable, in `cwd`."""
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    environment["PYTHONPATH"] = os.pathsep.join([str(EXAMPLE), str(REPO)])
    return subprocess.run([sys.executable, str(REPO / "nnpd.py"), *args, "--settings-dir", str(settings_dir)],
                          cwd=cwd, env=environment, capture_output=True, text=True, timeout=600)


def patched_settings(tmp_path, replacements):
    """A copy of the example's settings files with text replaced ({old: new}; each old text must occur)."""
    folder = tmp_path / "settings"
    folder.mkdir()
    texts = {name: (EXAMPLE / name).read_text() for name in ("settings_training.py", "settings_analysis.py")}
    for old, new in replacements.items():
        assert sum(old in text for text in texts.values()) == 1, old
        texts = {name: text.replace(old, new) for name, text in texts.items()}
    for name, text in texts.items():
        (folder / name).write_text(text)
    return folder


def cache_stamps(root):
    """{artifact directory: manifest mtime} of every committed artifact."""
    return {path.parent: path.stat().st_mtime_ns for path in Path(root, "cache").glob("*/*/artifact.json")}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The example's quick profile, run once from an empty working directory."""
    work = tmp_path_factory.mktemp("decay")
    result = run_example("run", cwd=work)
    assert result.returncode == 0, result.stdout + result.stderr
    return work / "outputs" / "decay-quick", result


def test_quick_profile_trains_both_priors_and_analyses_them(trained):
    root, _ = trained
    runs = sorted(path.parent for path in root.glob("runs/*/*/run.json"))
    assert [json.loads((run / "run.json").read_text())["member"]["prior"] for run in runs] == ["log-uniform", "uniform"]
    for run in runs:
        assert json.loads((run / "analysis.json").read_text())["state"] == "complete"
        metrics = json.loads((run / "metrics.json").read_text())
        assert set(metrics) == {"classification", "coverage", "width", "bias", "agreement"}
        assert metrics["classification"]["auc"] > 0.7
        # The learned posterior's mean is far closer to the exact one than the prior width (3.2).
        assert metrics["agreement"]["posterior_mean_abs_error"] < 0.2
        for level in metrics["coverage"].values():
            cases, nominal = level["cases"], level["nominal"]
            assert cases == 2000
            error = math.sqrt(nominal * (1 - nominal) / cases)
            # The exact posterior is calibrated by construction (truths drawn from the prior).
            assert abs(level["exact"] - nominal) < 4 * error, level
            assert abs(level["joint"] - nominal) < 0.1, level
            low, high = level["interval"]
            assert low <= level["joint"] <= high
        # Learned regions are about as wide as exact ones, and wider at the higher level.
        widths = metrics["width"]
        assert widths["0.68"]["mean"] < widths["0.95"]["mean"]
        assert all(abs(w["mean"] / w["exact_mean"] - 1) < 0.2 for w in widths.values()), widths
        # Posterior means scatter about the truth by about the posterior's spread (θ's sd is ~1/√8).
        assert 0.2 < metrics["bias"]["exact_rmse"] < 0.5 and metrics["bias"]["rmse"] < 1.3 * metrics["bias"]["exact_rmse"]


def test_a_second_run_recomputes_nothing(trained, tmp_path):
    root, _ = trained
    before = cache_stamps(root)
    again = run_example("run", cwd=root.parent.parent)
    assert again.returncode == 0, again.stderr
    assert "reused" in again.stdout and "sampling" not in again.stdout
    assert cache_stamps(root) == before


def test_restore_gives_the_model_that_was_analysed(trained, monkeypatch):
    root, _ = trained
    monkeypatch.syspath_prepend(str(EXAMPLE))
    run = next(root.glob("runs/*/log-uniform-r0-*"))
    restored = restore(run, device="cpu")
    inputs = torch.from_numpy(np.asarray(restored.array("training-data", "test_inputs")))
    labels = torch.from_numpy(np.asarray(restored.array("training-data", "test_labels")))
    with torch.no_grad():
        again = inference.classification_metrics(restored.model(inputs), labels)
    assert again == restored.metrics["classification"]
    assert type(restored.model).__name__ == "Sequential" and not restored.model.training


def test_full_profile_plans_a_choice_of_widths(tmp_path):
    result = run_example("plan", "--profile", "full", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [c["knob"] for c in report["configurations"]] == [None, "model.hidden"]
    assert report["jobs"] == 12                       # two priors times three replicas, per configuration
    assert not list(tmp_path.iterdir())               # plan writes nothing


def test_a_bad_example_setting_is_one_line_naming_it(tmp_path):
    settings = patched_settings(tmp_path, {'"rate_high": 5.0': '"rate_high": 0.1'})
    result = run_example("run", cwd=tmp_path, settings_dir=settings)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "problem.rate_high" in result.stderr
    assert not (tmp_path / "outputs").exists()


def test_the_posteriors_figure_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    settings = patched_settings(tmp_path, {'"plots": [],': '"plots": ["posteriors"],',
                                           '"train": 8192': '"train": 1024', '"epochs": 8': '"epochs": 1'})
    result = run_example("run", cwd=tmp_path, settings_dir=settings)
    assert result.returncode == 0, result.stdout + result.stderr
    figures = sorted(tmp_path.glob("outputs/decay-quick/runs/*/*/plots/posteriors.png"))
    assert len(figures) == 2 and all(figure.read_bytes()[:4] == b"\x89PNG" for figure in figures)
