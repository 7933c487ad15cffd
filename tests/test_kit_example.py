"""The Weibull example (examples/weibull, docs/extending.md): a study on the kit, planned, run, reported, run
again by two torchrun workers and restored, all from the repository root without PYTHONPATH: the settings
folder alone makes the study importable.

The first run and the torchrun launch are real processes without PYTHONPATH; plan, report and infer call
nnpd.main in-process (what they answer needs no fresh process). Runs write to temporary output roots: the
launches read a copy of the example's folder whose output root is replaced and whose device is the CPU (the
study module beside it, on no import path); plan, which writes nothing, reads the example itself.
"""

import csv
import importlib
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import analysis_metrics
import contrast
import results
import runtime
from helpers import REPO, main_in_process, run_cli
from store import restore

EXAMPLE = REPO / "examples" / "weibull"
ROOT_SETTING = '"output": {"root": f"outputs/weibull-{profile}"}'
NO_PYTHONPATH = {"PYTHONPATH": ""}  # empty: Python adds nothing, as when it is unset
LEVELS = {"0.68": 0.68, "0.95": 0.95}
PRIORS = {"uniform", "normal"}
TRUTHS = 1024  # inference.truths.sobol_truths 512, times 2 for two parameters


def example_copy(folder, root):
    """The example's files in `folder`, with `root` as output root and on the CPU: the module beside its settings."""
    folder.mkdir(parents=True)
    for path in EXAMPLE.glob("*.py"):
        text = path.read_text()
        if path.name == "settings_training.py":
            assert ROOT_SETTING in text and '"device": "auto"' in text
            text = text.replace(ROOT_SETTING, f'"output": {{"root": {str(root)!r}}}')
            text = text.replace('"device": "auto"', '"device": "cpu"')
        (folder / path.name).write_text(text)
    return folder


def metrics_by_prior(root):
    """{prior: metrics} of every analysed run of an output root."""
    found = {}
    for path in sorted(root.glob("runs/*/*/metrics.json")):
        found[json.loads((path.parent / "run.json").read_text())["member"]["prior"]] = json.loads(path.read_text())
    return found


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`python nnpd.py run` of the example once: (output root, settings folder, {prior: metrics})."""
    work = tmp_path_factory.mktemp("weibull")
    settings = example_copy(work / "settings", work / "out")
    result = run_cli("run", "--settings-dir", str(settings), env=NO_PYTHONPATH)
    assert result.returncode == 0, result.stdout + result.stderr
    return work / "out", settings, metrics_by_prior(work / "out")


@pytest.mark.unit
def test_plan_reads_the_example_folder_as_printed_in_the_docs():
    before = (REPO / "outputs" / "weibull-quick").exists()
    result = main_in_process("plan", "--settings-dir", "examples/weibull")  # from the repository root
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["output_root"] == "outputs/weibull-quick" and plan["jobs"] == 2
    assert plan["errors"] == [] and plan["warnings"] == []
    (configuration,) = plan["configurations"]
    assert configuration["input_size"] == 6 + 2  # six log lifetimes and (shape, scale)
    assert {job["member"] for job in configuration["jobs"]} == {"uniform-r0", "normal-r0"}
    assert (REPO / "outputs" / "weibull-quick").exists() == before  # plan writes nothing


@pytest.mark.launch
def test_the_exact_target_covers_at_the_nominal_level(trained):
    _, _, metrics = trained
    assert set(metrics) == PRIORS
    for prior, run in metrics.items():
        exact = run["exact_reference"]["coverage"]
        for key, nominal in LEVELS.items():
            assert exact[key]["cases"] == TRUTHS
            low, high = exact[key]["interval"]
            assert low <= nominal <= high, (prior, key, exact[key])
            # The learned ratio is close to calibrated too (measured 0.69 and 0.95).
            assert abs(run["coverage"][key]["joint"] - nominal) < 0.06, (prior, key, run["coverage"][key])


@pytest.mark.launch
def test_the_exact_expected_coverage_follows_the_diagonal(trained):
    _, _, metrics = trained
    for prior, run in metrics.items():
        curve = run["expected_coverage"]
        assert curve["cases"] == TRUTHS and len(curve["levels"]) == 99
        exact = curve["exact"]
        inside = [low <= level <= high for level, low, high in zip(curve["levels"], exact["lower"], exact["upper"])]
        assert sum(inside) >= 94, (prior, [lv for lv, ok in zip(curve["levels"], inside) if not ok])


@pytest.mark.launch
def test_the_report_writes_one_csv_row_per_run(trained, tmp_path):
    _, settings, metrics = trained
    table = tmp_path / "weibull.csv"
    result = main_in_process("report", "--settings-dir", str(settings), "--csv", str(table))
    assert result.returncode == 0, result.stderr
    assert "cov68" in result.stdout and "normal" in result.stdout and "uniform" in result.stdout
    assert "exact68" in result.stdout and "nearly flat" not in result.stdout  # informative: no false alarm
    rows = list(csv.DictReader(table.open()))
    assert {row["prior"] for row in rows} == PRIORS
    for row in rows:
        for column in ("coverage.0.68.joint", "exact_reference.coverage.0.95.joint", "classification.auc"):
            assert math.isclose(float(row[column]), results.lookup(metrics[row["prior"]], column)), column


@pytest.mark.launch
def test_two_torchrun_workers_in_jobs_mode_give_the_same_results(trained, tmp_path):
    _, _, serial = trained
    settings = example_copy(tmp_path / "settings", tmp_path / "out")
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
        "nnpd.py",
        "run",
        "--settings-dir",
        str(settings),
    ]
    result = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "2 worker(s), parallel=jobs" in output
    assert "rank 0] train" in output and "rank 1] train" in output  # each worker trained a model
    assert metrics_by_prior(tmp_path / "out") == serial  # the same models and analysis


@pytest.mark.launch
def test_restore_gives_the_analysed_model(trained, monkeypatch):
    root, _, metrics = trained
    monkeypatch.setattr(sys, "path", list(sys.path))  # restore adds the study's folder; undo it afterwards
    run = next(root.glob("runs/*/uniform-r0-*"))
    restored = restore(run, device="cpu")
    assert not restored.model.training and restored.metrics == metrics["uniform"]
    # The classification metric scores each test simulation and its x re-paired with another's θ.
    x, theta = (
        torch.from_numpy(np.asarray(restored.array("training-data", f"test_{name}"))) for name in ("x", "theta")
    )
    inputs, labels = contrast.fixed_pairs(x, theta, runtime.derived_seed(restored.settings["seed"], "test pairs"))
    with torch.no_grad():
        logits = restored.model(inputs)
    assert logits.shape == (len(inputs),)
    again = analysis_metrics.classification_metrics(logits, labels)
    assert again == pytest.approx(restored.metrics["classification"], rel=1e-6)
    # On fresh observations the learned log ratio prefers the parameters they were simulated at.
    study = importlib.import_module("weibull_study").Weibull(restored.settings)
    truth, other = torch.tensor([[1.5, 1.0]], dtype=torch.float64), torch.tensor([[3.0, 0.6]], dtype=torch.float64)
    x = study.simulate(truth.expand(256, 2), torch.Generator().manual_seed(0))
    with torch.no_grad():
        scores = [restored.model(torch.cat([x, theta.expand(256, 2)], 1).float()).mean() for theta in (truth, other)]
    assert scores[0] > scores[1] + 1.0


@pytest.mark.launch
def test_infer_gives_the_posterior_of_an_observation_with_a_corner_plot(trained, tmp_path):
    root, _, _ = trained
    run = next(root.glob("runs/*/uniform-r0-*"))
    restored = restore(run, device="cpu")
    np.save(tmp_path / "lifetimes.npy", restored.array("observations", "observations")[5])
    np.save(tmp_path / "truth.npy", restored.array("truths", "truths")[5])
    result = main_in_process(
        "infer",
        str(run),
        "--observations",
        str(tmp_path / "lifetimes.npy"),
        "--truth",
        str(tmp_path / "truth.npy"),
        "--samples",
        "800",
        "--plot",
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "lifetimes-uniform-r0.posterior.json").read_text())
    assert summary["parameters"] == ["shape", "scale"] and len(summary["hpd"]["0.95"]["upper"]) == 2
    samples = np.load(tmp_path / "lifetimes-uniform-r0.samples.npy")
    assert samples.shape == (800, 2)
    assert np.all((samples >= [0.5, 0.5]) & (samples <= [3.0, 2.0]))  # inside the parameters' box
    assert (tmp_path / "lifetimes-uniform-r0.corner.png").read_bytes()[:4] == b"\x89PNG"
