"""Integrity on every read: analyses never outlive their products, and same-size damage of any
artifact, record or training state is found by the next launch, without `verify`, and repaired.

Each damage test copies one analysed output root, damages one thing in it, re-runs and checks
that the metrics are those of the undamaged root.
"""

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import nnpd
import store
from helpers import REPO, command, finish_launch, saved_states, settings_for, start, wait_for, weights, write_settings
from store import restore

pytestmark = pytest.mark.launch


def cli(monkeypatch, *args):
    """The command line, in this process; returns its exit status."""
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # main() sets nnpd's format
    return nnpd.main(list(args))


def run_dirs(root):
    """Every run folder under the output root."""
    return sorted(path.parent for path in Path(root, "runs").glob("*/*/run.json"))


def all_metrics(root):
    """{run folder name: metrics.json} of every run."""
    return {run.name: json.loads((run / "metrics.json").read_text()) for run in run_dirs(root)}


def flip_byte(path, offset=None):
    """Flip one bit of a file in place: same size, same name."""
    size = path.stat().st_size
    offset = size // 2 if offset is None else offset
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x01]))


def is_intact(path):
    """Whether a committed artifact's every file matches its manifest's checksum."""
    manifest = json.loads((path / "artifact.json").read_text())
    return not store._problems(path, manifest, deep=True)


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    """A folder with settings (output root "out", relative) after one `run`, and its metrics."""
    folder = tmp_path_factory.mktemp("analysed")
    settings = write_settings(folder / "s", Path("out"))
    here = os.getcwd()
    os.chdir(folder)
    try:
        nnpd.execute("run", "smoke", settings)
    finally:
        os.chdir(here)
    return folder, all_metrics(folder / "out")


@pytest.fixture
def copy(analysed, tmp_path, monkeypatch):
    """A copy of the analysed folder, worked in: (settings dir, root); same settings text, so same snapshot."""
    for name in ("s", "out"):
        shutil.copytree(analysed[0] / name, tmp_path / name, symlinks=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "s", tmp_path / "out"


def test_the_readmes_command_sequence_leaves_every_run_restorable(tmp_path, monkeypatch, capsys):
    settings = str(write_settings(tmp_path / "s", tmp_path / "out"))
    root = tmp_path / "out"
    for action in ("run", "plan", "train", "analyze", "run", "verify", "report"):
        assert cli(monkeypatch, action, "--settings-dir", settings) == 0, (action, capsys.readouterr().err)
        for run in run_dirs(root):  # whatever is referenced is there, after every step
            assert not store_missing(root, run), (action, run)
    for run in run_dirs(root):
        restored = restore(run)
        assert restored.missing == [] and restored.metrics is not None
        assert "classification" in restored.metrics


def store_missing(root, run):
    """The artifacts a run folder refers to that are not committed in the store."""
    references = json.loads((run / "artifacts.json").read_text())
    return [path for path in references.values() if not (root / path / "artifact.json").is_file()]


def test_an_analysis_product_moved_aside_by_verify_is_rebuilt_by_the_next_run(copy, analysed, monkeypatch, capsys):
    settings, root = copy
    product = next(path for path in root.glob("cache/learned/*") if path.is_dir())
    flip_byte(next(product.glob("*.npy")))
    with pytest.warns(UserWarning, match=f"{product.name} was damaged .*checksum mismatch.*; moved to"):
        assert cli(monkeypatch, "verify", "--settings-dir", str(settings)) == 1
    report = json.loads(capsys.readouterr().out)
    assert f"out/cache/learned/{product.name}" in report["damaged"]
    assert any("artifacts.json" in line and product.name in line for line in report["damaged"])  # its users
    assert not product.exists()
    with pytest.warns(UserWarning, match="missing or damaged"):
        run = next(run for run in run_dirs(root) if product.name in (run / "artifacts.json").read_text())
        assert restore(run).metrics is None  # restores, but its analysis is not complete
    assert cli(monkeypatch, "run", "--settings-dir", str(settings)) == 0
    assert "analysing it again" in capsys.readouterr().err
    assert is_intact(product)
    assert all_metrics(root) == analysed[1]
    assert cli(monkeypatch, "verify", "--settings-dir", str(settings)) == 0
    assert all(restore(run).metrics is not None for run in run_dirs(root))


@pytest.mark.parametrize(
    "name, pattern",
    [
        ("training-data", "*.npy"),
        ("model", "weights.pt"),
        ("learned", "*.npy"),
        ("truths", "*.npy"),
        ("candidates", "*.npy"),
    ],
)
def test_a_same_size_flip_is_found_and_repaired_by_the_next_run(copy, analysed, monkeypatch, capsys, name, pattern):
    settings, root = copy
    entry = next(path for path in sorted(root.glob(f"cache/{name}/*")) if path.is_dir())
    flip_byte(sorted(entry.glob(pattern))[0])
    with pytest.warns(UserWarning, match="damaged"):
        assert cli(monkeypatch, "run", "--settings-dir", str(settings)) == 0
    assert is_intact(entry)  # rebuilt in place, the same artifact
    assert len(list(root.glob(f"damaged/{name}/*"))) == 1  # the damaged copy is kept aside
    assert all_metrics(root) == analysed[1]
    assert cli(monkeypatch, "verify", "--settings-dir", str(settings)) == 0


def test_rewritten_metrics_and_records_are_redone(copy, analysed, monkeypatch, capsys):
    settings, root = copy
    first, second = run_dirs(root)[:2]
    metrics = json.loads((first / "metrics.json").read_text())
    metrics["classification"]["auc"] = 0.123456789  # valid JSON, wrong value
    (first / "metrics.json").write_text(json.dumps(metrics))
    analysis = json.loads((second / "analysis.json").read_text())
    analysis["model"] = analysis["model"][::-1]  # a record that parses but disagrees
    (second / "analysis.json").write_text(json.dumps(analysis))
    assert restore(first).metrics is None
    assert cli(monkeypatch, "run", "--settings-dir", str(settings)) == 0
    err = capsys.readouterr().err
    assert "metrics.json is not what the analysis wrote" in err
    assert all_metrics(root) == analysed[1]
    assert restore(first).metrics == analysed[1][first.name]


def test_verify_moves_rewritten_metrics_aside(copy, monkeypatch, capsys):
    settings, root = copy
    run = run_dirs(root)[0]
    metrics = json.loads((run / "metrics.json").read_text())
    metrics["classification"]["auc"] = 0.5
    (run / "metrics.json").write_text(json.dumps(metrics))
    with pytest.warns(UserWarning, match="metrics.json was damaged .*not what its analysis wrote.*; moved to"):
        assert cli(monkeypatch, "verify", "--settings-dir", str(settings)) == 1
    assert str((run / "metrics.json").relative_to(root.parent)) in json.loads(capsys.readouterr().out)["damaged"]
    assert not (run / "metrics.json").exists()


def test_a_damaged_training_state_is_refused_with_a_warning(tmp_path):
    """A flipped byte in a saved state: training starts afresh and ends bitwise as if never interrupted."""
    reference = start(command(settings_for(tmp_path / "reference")))  # side by side with the damaged one
    damaged = settings_for(tmp_path / "damaged")
    process = start(command(damaged))
    wait_for(lambda: saved_states(tmp_path / "damaged" / "out"), "a saved training state", process=process)
    process.kill()
    process.communicate()
    state = saved_states(tmp_path / "damaged" / "out")[0]
    flip_byte(state, state.stat().st_size - 100)  # inside the saved tensors
    result = finish_launch(command(damaged))
    assert result.returncode == 0, result.stderr
    assert "ignoring the saved training state" in result.stderr and "checksum" in result.stderr
    assert "resumed" not in result.stdout
    reference_output = reference.communicate(timeout=600)
    assert reference.returncode == 0, reference_output
    ours, theirs = weights(tmp_path / "damaged" / "out"), weights(tmp_path / "reference" / "out")
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert all(torch.equal(ours[key][name], theirs[key][name]) for name in ours[key])


def test_restore_checks_the_named_class_before_importing_its_module(copy, tmp_path):
    settings, root = copy
    run = run_dirs(root)[0]
    marker = tmp_path / "imported"
    (tmp_path / "acts_on_import.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    for named in ("acts_on_import:Experiment", "setup:setup"):
        record = json.loads((run / "run.json").read_text())
        record["settings"]["experiment"] = named
        record["checksum"] = store.record_checksum(record)  # a record re-signed by whoever edited it
        (run / "run.json").write_text(json.dumps(record))
        code = (
            "import sys, store\n"
            f"try:\n    store.restore({str(run)!r})\nexcept ValueError as error:\n    print(error)\n"
            "print(sorted({'setuptools', 'setup', 'acts_on_import'} & set(sys.modules)))"
        )
        result = subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"},
        )
        assert result.returncode == 0, result.stderr
        assert "does not define a class" in result.stdout and result.stdout.rstrip().endswith("[]"), result.stdout
    assert not marker.exists()
