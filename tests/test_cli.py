"""The command line: plan, the real smoke profile, verify, and user errors."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO, main_in_process, run_cli, wait_for, write_settings


def files_under(path):
    """Every file below a directory (empty when it does not exist)."""
    return sorted(p for p in Path(path).rglob("*") if p.is_file())


@pytest.mark.unit
def test_bare_command_plans_and_writes_nothing(tmp_path):
    settings = write_settings(tmp_path / "s", tmp_path / "out")
    before = files_under(tmp_path)
    result = main_in_process("--settings-dir", str(settings))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["jobs"] == 4 and report["errors"] == []
    job = report["configurations"][0]["jobs"][0]
    assert job["workload"]["model_evaluations"] > 0
    assert report["configurations"][0]["input_size"] == 2
    assert files_under(tmp_path) == before and not (tmp_path / "out").exists()


@pytest.mark.unit
def test_default_profile_plan_is_one_factor_at_a_time():
    result = main_in_process("plan", "--profile", "default")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [c["value"] for c in report["configurations"]] == [None, 2, 3, 4, 5, 6]
    assert report["jobs"] == 24
    assert [c["input_size"] for c in report["configurations"]] == [2, 4, 6, 8, 10, 12]


@pytest.mark.launch
def test_smoke_profile_runs_reruns_for_free_and_verifies(tmp_path):
    for name in ("settings_training.py", "settings_analysis.py"):
        shutil.copy(REPO / name, tmp_path / name)  # the real smoke profile, run from tmp_path
    first = run_cli("run", "--profile", "smoke", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    root = tmp_path / "outputs" / "smoke"
    weights = {p: p.stat().st_mtime_ns for p in root.glob("cache/model/*/weights.pt")}
    assert len(weights) == 4
    metrics = list(root.glob("runs/*/*/metrics.json"))
    assert len(metrics) == 4
    second = main_in_process("run", "--profile", "smoke", cwd=tmp_path)  # the re-run and verify in-process
    assert second.returncode == 0, second.stderr
    assert {p: p.stat().st_mtime_ns for p in root.glob("cache/model/*/weights.pt")} == weights
    verified = main_in_process("verify", "--profile", "smoke", cwd=tmp_path)
    assert verified.returncode == 0, verified.stderr
    report = json.loads(verified.stdout)
    assert report["damaged"] == [] and report["checked"] >= 4 + 4 + 4


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here, so device=cuda is no error")
USER_ERRORS = [
    pytest.param('settings["runtime"]["device"] = "cuda"\n', "", "train", "runtime.device", marks=NO_CUDA),
    ('settings["training"]["precision"] = "float16"\n', "", "train", "training.precision"),
    ("", 'settings["metrics"] = ["bias", "sharpness"]\n', "run", "sharpness"),
    ("", 'settings["inference"]["candidates"]["candidate_count"] = 10_000_000\n', "run", "max_candidate_points"),
    ("", "", "analyze", "train"),
    ('settings["runtime"]["device"] = "mps"\n', "", "train", "runtime.device"),
    ('settings["cohort"]["priors"] = ["uniform", "uniform"]\n', "", "train", "cohort.priors"),
    ('settings["seed"] = "abc"\n', "", "train", "seed"),
    ('settings["output"]["root"] = " "\n', "", "train", "output.root"),  # left out, it is outputs/<profile>
]


@pytest.mark.parametrize("training, analysis, action, named", USER_ERRORS)
@pytest.mark.unit
def test_user_errors_exit_with_one_clear_line_and_write_nothing(tmp_path, training, analysis, action, named):
    # The command line in-process: what it answers does not depend on a fresh process (the settings errors of
    # tests/test_cli_edges.py and tests/test_timings.py are real launches).
    folder = tmp_path
    settings = write_settings(folder / "s", folder / "out", training=training, analysis=analysis)
    result = main_in_process(action, "--settings-dir", str(settings))
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nnpd:"), result.stderr
    assert named in lines[0]
    assert "Traceback" not in result.stderr
    assert not (folder / "out").exists()


@pytest.mark.unit
def test_unknown_profile_lists_the_known_ones(tmp_path):
    result = main_in_process("plan", "--profile", "nope")
    assert result.returncode == 2
    assert "smoke" in result.stderr and "default" in result.stderr and "paper" in result.stderr


@pytest.mark.unit
def test_verify_without_a_store_is_a_clear_error(tmp_path):
    settings = write_settings(tmp_path / "s", tmp_path / "out")
    result = main_in_process("verify", "--settings-dir", str(settings))
    assert result.returncode == 1 and "train" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.unit
def test_posterior_of_a_grid_prior_on_continuous_candidates_is_refused_at_plan_time(tmp_path):
    settings = write_settings(
        tmp_path / "s", tmp_path / "out", analysis='settings["inference"]["candidates"]["native_grid_prior"] = False\n'
    )
    result = main_in_process("plan", "--settings-dir", str(settings))
    assert result.returncode == 2  # a settings error, as for run
    assert any("native_grid_prior" in error for error in json.loads(result.stdout)["errors"])
    assert "native_grid_prior" in result.stderr


@pytest.mark.launch
def test_a_run_killed_mid_training_loses_nothing_committed(tmp_path):
    settings = write_settings(
        tmp_path / "s",
        tmp_path / "out",
        training='settings["data"]["train"] = 20_000\nsettings["training"]["epochs"] = 3\n'
        'settings["runtime"]["resume_seconds"] = 0.1\n',
    )
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    process = subprocess.Popen(
        [sys.executable, str(REPO / "nnpd.py"), "train", "--settings-dir", str(settings)],
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    models = tmp_path / "out" / "cache" / "model"
    states = tmp_path / "out" / "scratch" / "model"

    def in_progress():
        """Keys of the models whose training state is saved but which are not committed."""
        committed = {path.parent.name for path in models.glob("[0-9a-f]*/artifact.json")}
        return {state.stem for state in states.glob("*.pt")} - committed

    def second_model_in_progress():
        """A model is committed and another one's training state is saved: the kill lands mid-build."""
        return bool(list(models.glob("[0-9a-f]*/artifact.json")) and in_progress())

    # Fails, rather than killing anyway, if the launch ends or the deadline passes before that point.
    wait_for(second_model_in_progress, "a second model's training in progress", seconds=300, process=process)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    first = {p: p.stat().st_mtime_ns for p in models.glob("[0-9a-f]*/artifact.json")}
    interrupted = in_progress()
    assert len(first) >= 1 and interrupted, "the kill did not land in the middle of a model's training"
    result = run_cli("train", "--settings-dir", str(settings))
    assert result.returncode == 0, result.stderr
    after = {p: p.stat().st_mtime_ns for p in models.glob("[0-9a-f]*/artifact.json")}
    assert len(after) == 4 and all(after[p] == stamp for p, stamp in first.items())  # kept, not retrained
    assert interrupted <= {path.parent.name for path in after}  # and the killed one built
    verified = main_in_process("verify", "--settings-dir", str(settings))
    assert verified.returncode == 0 and json.loads(verified.stdout)["damaged"] == []
    assert not list((tmp_path / "out" / "cache").glob("*/.tmp-*"))  # the killed build's leftovers are gone
