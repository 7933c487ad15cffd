"""A posterior right after training, the kit's analysis defaults, and the flat posterior's report.

A one-parameter kit study written beside settings files that name only what they must: the training
settings, and an analysis file holding nothing but the analysis class. One model is trained well, one
deliberately flat (one epoch on a few rows at a learning rate too small to move it). `train`, `run` and
`infer` are the real command line: infer after train alone in a fresh process, the rest in-process.
"""

import copy
import json
import textwrap

import numpy as np
import pytest

import inference_schema
import posterior as post
import settings_analysis
from helpers import main_in_process, run_cli
from inference_schema import check_inference_settings
from settings import SettingsError
from store import restore

STUDY = '''
import torch
import nre_study


class Shift(nre_study.Study):
    """Three noisy copies of one number: x = θ + 0.3 · noise."""

    parameters = {"shift": (-1.0, 1.0)}

    def simulate(self, theta, generator):
        return theta + 0.3 * torch.randn(theta.shape[0], 3, generator=generator, dtype=torch.float64)

    def log_likelihood(self, x, theta):
        return (-0.5 * ((x - theta) / 0.3) ** 2).sum(-1)
'''
TRAINING = """
DEFAULT_PROFILE = "quick"
PROFILES = ("quick",)


def make_settings(profile):
    return {{
        "experiment": "{module}:Shift",
        "output": {{"root": {root!r}}},
        "seed": 7,
        "cohort": {{"priors": ["uniform"], "replicas": 1}},
        "priors": {{"uniform": {{"family": "uniform"}}}},
        "data": {data},
        "model": {{"kind": "mlp", "hidden": [32, 32], "activation": "relu"}},
        "training": {training},
        "runtime": {{"device": "cpu"}},
    }}
"""
ANALYSIS = """
PROFILES = ("quick",)


def make_settings(profile):
    return {{"analysis": "nre_analysis:NREAnalysis"{extra}}}
"""
GOOD = ({"train": 4096, "validation": 512, "test": 512}, {"epochs": 6, "batch_size": 128, "learning_rate": 3e-3})
FLAT = ({"train": 64, "validation": 64, "test": 64}, {"epochs": 1, "batch_size": 64, "learning_rate": 1e-7})


def study_folder(folder, kind, extra=""):
    """Settings files and the study module in `folder`, writing to folder/out; returns (folder, root)."""
    folder.mkdir(parents=True, exist_ok=True)
    module = f"shift_{folder.parent.name}_{folder.name}".replace("-", "_")
    data, training = GOOD if kind == "good" else FLAT
    (folder / f"{module}.py").write_text(STUDY)
    (folder / "settings_training.py").write_text(
        textwrap.dedent(TRAINING.format(module=module, root=str(folder / "out"), data=data, training=training))
    )
    (folder / "settings_analysis.py").write_text(ANALYSIS.format(extra=extra))
    return folder, folder / "out"


def trained_only(tmp_path_factory, kind):
    """A study of `kind` after `train` alone: (settings folder, run folder)."""
    folder, root = study_folder(tmp_path_factory.mktemp(kind) / "settings", kind)
    result = main_in_process("train", "--settings-dir", str(folder))
    assert result.returncode == 0, result.stdout + result.stderr
    return folder, next(root.glob("runs/*/uniform-r0-*"))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return trained_only(tmp_path_factory, "good")


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    return trained_only(tmp_path_factory, "flat")


def infer_files(run, tmp_path, x):
    """`python nnpd.py infer` in a fresh process: (completed process, summary JSON)."""
    np.save(tmp_path / "x.npy", x)
    result = run_cli("infer", str(run), "--observations", str(tmp_path / "x.npy"), "--samples", "300")
    summary = tmp_path / "x-uniform-r0.posterior.json"
    return result, json.loads(summary.read_text()) if summary.exists() else None


@pytest.mark.launch
def test_infer_after_train_alone_uses_the_default_design_and_equals_restore(good, tmp_path):
    _, run = good
    assert not (run / "analysis.json").exists()
    x = np.array([0.31, 0.42, 0.2])
    result, summary = infer_files(run, tmp_path, x)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "x-uniform-r0.samples.npy").is_file() and "warning" not in result.stdout
    posterior = restore(run).posterior(x)
    expected = json.loads(json.dumps(posterior.summary()))
    assert {key: summary[key] for key in expected} == expected
    assert summary["candidates"] <= post.POSTERIOR_CANDIDATES["candidate_count"]  # the design of a run never analysed
    assert summary["flat"]["flat"] is False and summary["flat"]["sd_share"][0] < 0.5
    assert 0.1 < summary["sd"][0] < 0.3 and abs(summary["mean"][0] - 0.31) < 0.15


@pytest.mark.launch
def test_a_flat_posterior_is_reported_by_infer(flat, tmp_path):
    _, run = flat
    result, summary = infer_files(run, tmp_path, np.array([0.31, 0.42, 0.2]))
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("warning:")]
    assert len(lines) == 1 and "nearly flat in shift" in lines[0] and "learned little" in lines[0], result.stdout
    assert summary["flat"]["flat"] is True and summary["flat"]["warning"] in lines[0]
    assert summary["flat"]["validation_auc"] < 0.75


@pytest.mark.launch
def test_the_python_posterior_warns_the_lines_infer_prints(flat, tmp_path):
    _, run = flat
    x = np.array([0.31, 0.42, 0.2])
    result, _ = infer_files(run, tmp_path, x)
    printed = [line.removeprefix("warning: ") for line in result.stdout.splitlines() if line.startswith("warning:")]
    with pytest.warns(post.PosteriorWarning) as caught:
        posterior = restore(run).posterior(x)
    assert printed and posterior.warnings == printed == [str(warning.message) for warning in caught]
    assert posterior.flat["flat"] is True and caught[0].filename == __file__  # warned at the user's line


@pytest.mark.launch
def test_run_with_only_the_analysis_class_reports_a_flat_posterior(flat):
    folder, run = flat
    result = main_in_process("run", "--settings-dir", str(folder))
    assert result.returncode == 0, result.stdout + result.stderr
    metrics = json.loads((run / "metrics.json").read_text())
    assert set(metrics) >= {"classification", "coverage", "posterior", "exact_reference", "normalization"}
    assert metrics["resolution"]["design"] == "adaptive" and metrics["resolution"]["candidate_count"] == 1024
    assert metrics["posterior"]["flat"]["flat_cases"] == metrics["posterior"]["flat"]["cases"] == 4
    warning = metrics["posterior"]["flat"]["warning"]
    assert warning and f"warning: baseline uniform: {warning}" in result.stdout
    report = main_in_process("report", "--settings-dir", str(folder))
    assert f"warning: baseline uniform: {warning}" in report.stdout
    # Analysed now: restore's posterior reads the run's analysis settings, the same defaults.
    assert json.loads((run / "analysis.json").read_text())["settings"]["inference"]["candidates"]["coarse_count"] == 128


@pytest.mark.launch
def test_a_good_model_gets_no_flat_warning_from_the_analysis(good):
    folder, run = good
    result = main_in_process("run", "--settings-dir", str(folder))
    assert result.returncode == 0, result.stdout + result.stderr
    flatness = json.loads((run / "metrics.json").read_text())["posterior"]["flat"]
    assert flatness["warning"] is None and flatness["flat_cases"] == 0 and "warning:" not in result.stdout


@pytest.mark.parametrize(
    "extra, message",
    [
        (', "inference": {"candidates": {"kind": "sobl"}}', "inference.candidates.kind"),
        (', "inference": {"candidates": {"coarse_cont": 64}}', "unknown keys ['coarse_cont']"),
        (', "inference": {"levels": [0.95, 0.68]}', "inference.levels"),
        (', "verification": {"max_saved_bytes": -1}', "verification.max_saved_bytes"),
    ],
)
@pytest.mark.unit
def test_a_bad_value_in_a_minimal_analysis_file_gets_one_line(tmp_path, extra, message):
    folder, _ = study_folder(tmp_path / "settings", "flat", extra)
    result = main_in_process("plan", "--settings-dir", str(folder))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr


@pytest.mark.unit
def test_every_inference_key_has_a_default_sized_for_the_parameters():
    filled = check_inference_settings({}, 10, likelihood=False)
    assert filled["candidates"]["candidate_count"] == 10_240 and filled["candidates"]["coarse_count"] == 1280
    assert filled["targets"] == ["ratio", "posterior"]
    given = check_inference_settings({"candidates": {"kind": "sobol", "candidate_count": 512}}, 2)
    assert given["candidates"]["candidate_count"] == 512 and given["targets"][-1] == "exact"
    with pytest.raises(SettingsError, match="inference.observations"):
        check_inference_settings({"observations": 0}, 1)


@pytest.mark.unit
def test_the_typed_section_and_the_schema_name_the_same_keys():
    # The TypedDicts are what mypy checks reads against; the schema is what a user's file is checked against.
    schema = inference_schema.INFERENCE_SCHEMA
    assert set(inference_schema.Inference.__annotations__) == set(schema)
    for section, typed in (("truths", inference_schema.Truths), ("candidates", inference_schema.Candidates)):
        assert set(typed.__annotations__) == set(schema[section]), section
    assert set(check_inference_settings({}, 2)) == set(schema)


@pytest.mark.parametrize("profile", settings_analysis.PROFILES)
@pytest.mark.unit
def test_settings_that_spell_out_every_key_are_unchanged_so_their_keys_are_too(profile):
    given = settings_analysis.make_settings(profile)["inference"]
    assert check_inference_settings(copy.deepcopy(given), 3) == given
