"""The output root is nnpd's alone: ownership, links, concurrent launches, repair, hostile run folders."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import REPO, limit_file_size, main_in_process, one_error_line, run_cli, write_settings
from store import ROOT_MARKER, DamagedArtifact, record_checksum, restore

pytestmark = pytest.mark.launch


def files_with_content(folder):
    """{relative path: bytes} of every file below folder."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


# What the command line answers about the root does not depend on a fresh process: most commands below call
# nnpd.main in-process (conftest.main_in_process); concurrent launches, a kill's leftovers and the full disk's
# file-size limit are real processes.


@pytest.fixture(scope="module")
def trained(trained_smoke_root):
    """A run smoke root (tiny settings), reused read-only or copied by the tests below: (its folder, settings)."""
    return trained_smoke_root.parent, trained_smoke_root.parent / "s"


def copy_root(trained, tmp_path):
    """A private copy of the trained root and settings pointing at it."""
    source, _ = trained
    subprocess.run(["cp", "-a", str(source / "out"), str(tmp_path / "out")], check=True)
    return write_settings(tmp_path / "s", tmp_path / "out")


# ---------------------------------------------------------------- ownership


def test_a_users_folder_is_refused_and_left_untouched(tmp_path):
    root = tmp_path / "mine"
    for name, text in {
        "source/main.c": "int main;",
        "runs/2023/notes.txt": "x",
        "history.json": "{}",
        "settings_training.py": "# mine",
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    before = files_with_content(root)
    settings = write_settings(tmp_path / "s", root)
    result = main_in_process("run", "--settings-dir", str(settings))
    assert result.returncode == 1
    assert "did not create" in one_error_line(result) and ROOT_MARKER in result.stderr
    assert files_with_content(root) == before


def train_into(folder, root, words):
    """`train` with the output root `root`, the settings in `folder`."""
    return main_in_process("train", "--settings-dir", str(write_settings(folder / "s", Path(root).expanduser())))


@pytest.mark.parametrize(
    "root, words",
    [("/", "choose a folder of its own"), ("~", "choose a folder of its own"), ("/dev/null", "not a folder")],
)
def test_obviously_wrong_roots_are_refused(tmp_path, root, words):
    result = train_into(tmp_path, root, words)
    assert result.returncode == 1 and words in one_error_line(result)


def test_an_empty_folder_becomes_a_root_with_its_marker(tmp_path):
    (tmp_path / "out").mkdir()
    settings = write_settings(tmp_path / "s", tmp_path / "out")
    assert main_in_process("train", "--settings-dir", str(settings)).returncode == 0
    assert json.loads((tmp_path / "out" / ROOT_MARKER).read_text())["by"] == "nnpd"


def test_clean_up_removes_only_what_nnpd_made(trained, tmp_path):
    settings = copy_root(trained, tmp_path)
    root = tmp_path / "out"
    variant = next((root / "runs").iterdir())
    (variant / "my-notes").mkdir()
    (variant / "my-notes" / "draft.txt").write_text("keep me")
    (root / "runs" / "2023").mkdir()
    write_settings(tmp_path / "s", root, training='settings["training"]["learning_rate"] = 2e-3\n')
    result = main_in_process("train", "--settings-dir", str(settings))
    assert result.returncode == 0, result.stderr
    assert (variant / "my-notes" / "draft.txt").read_text() == "keep me" and (root / "runs" / "2023").is_dir()
    assert "left alone" in result.stderr
    assert not list(variant.glob("uniform-*"))  # nnpd's own run folders of the old settings are gone


# ---------------------------------------------------------------- links


def test_links_inside_the_root_are_refused_and_never_followed(trained, tmp_path):
    settings = copy_root(trained, tmp_path)
    root = tmp_path / "out"
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data.txt").write_text("precious")
    (root / "runs" / "stale").symlink_to(outside)
    result = main_in_process("run", "--settings-dir", str(settings))
    assert result.returncode == 1 and "symbolic link" in one_error_line(result)
    assert (outside / "data.txt").read_text() == "precious"
    (root / "runs" / "stale").unlink()
    run = next((root / "runs").glob("*/uniform-*"))
    moved = tmp_path / "moved"
    run.rename(moved)
    run.symlink_to(moved)  # a linked run folder
    result = main_in_process("run", "--settings-dir", str(settings))
    assert result.returncode == 1 and "symbolic link" in one_error_line(result)


# ---------------------------------------------------------------- concurrency


def launch(settings, action="run"):
    """Start `nnpd.py action` in the background."""
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.Popen(
        [sys.executable, str(REPO / "nnpd.py"), action, "--settings-dir", str(settings)],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_launches_with_different_settings_run_one_after_the_other(tmp_path):
    first = write_settings(tmp_path / "a", tmp_path / "out", training='settings["data"]["train"] = 4096\n')
    second = write_settings(tmp_path / "b", tmp_path / "out", training='settings["training"]["learning_rate"] = 2e-3\n')
    processes = [launch(first), launch(second)]
    outputs = [process.communicate(timeout=600) for process in processes]
    assert [process.returncode for process in processes] == [0, 0], outputs
    assert any("waiting for it to end" in stderr for _, stderr in outputs)
    history = json.loads((tmp_path / "out" / "history.json").read_text())["trainings"]
    assert len(history) == 2
    for run in history[0]["runs"]:  # the latest launch's runs are all there
        assert json.loads((tmp_path / "out" / run / "analysis.json").read_text())["state"] == "complete"
    kept = {key for entry in history for backend in entry["backends"].values() for key in backend["artifacts"]}
    models = {p.name for p in (tmp_path / "out" / "cache" / "model").iterdir()}
    assert len(models) == 8 and models <= kept  # both settings' models are kept


def test_four_concurrent_analyses_of_one_run_all_succeed(trained, tmp_path):
    settings = copy_root(trained, tmp_path)
    for path in (tmp_path / "out" / "runs").glob("*/*/analysis.json"):
        path.unlink()  # every analysis has work to do
    processes = [launch(settings, "analyze") for _ in range(4)]
    outputs = [process.communicate(timeout=600) for process in processes]
    assert [process.returncode for process in processes] == [0, 0, 0, 0], outputs
    for run in (tmp_path / "out" / "runs").glob("*/*/"):
        assert json.loads((run / "analysis.json").read_text())["state"] == "complete"
        assert "coverage" in json.loads((run / "metrics.json").read_text())


# ---------------------------------------------------------------- damage the next launch repairs


def flip_a_byte(path):
    """Change one byte in the middle of a file, keeping its size."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_flipped_byte_is_moved_aside_by_verify_and_rebuilt_by_the_next_launch(trained, tmp_path):
    settings = copy_root(trained, tmp_path)
    root = tmp_path / "out"
    metrics = {p: p.read_text() for p in root.glob("runs/*/*/metrics.json")}
    target = next(root.glob("cache/training-data/*/test_x.npy"))
    flip_a_byte(target)
    checked = main_in_process("verify", "--settings-dir", str(settings))
    assert checked.returncode == 1 and str(target.parent) in json.loads(checked.stdout)["damaged"]
    assert not target.parent.exists() and list(root.glob("damaged/training-data/*"))
    again = json.loads(main_in_process("verify", "--settings-dir", str(settings)).stdout)
    # Nothing more is moved, but the runs that use the entry still miss it until a launch rebuilds it.
    assert again["damaged_folder"]["entries"] == 1 and again["damaged"]
    assert all(line.endswith("is missing (the next launch rebuilds it)") for line in again["damaged"])
    rerun = main_in_process("run", "--settings-dir", str(settings))
    assert rerun.returncode == 0, rerun.stderr
    assert target.is_file() and {p: p.read_text() for p in metrics} == metrics  # rebuilt identically
    assert main_in_process("verify", "--settings-dir", str(settings)).returncode == 0


def test_a_deleted_artifacts_json_is_rewritten_without_retraining(trained, tmp_path):
    settings = copy_root(trained, tmp_path)
    root = tmp_path / "out"
    run = next(root.glob("runs/*/uniform-*"))
    (run / "artifacts.json").unlink()
    models = {p: p.stat().st_mtime_ns for p in root.glob("cache/model/*/weights.pt")}
    for _ in range(2):
        result = main_in_process("run", "--settings-dir", str(settings))
        assert result.returncode == 0, result.stderr
    assert {p: p.stat().st_mtime_ns for p in root.glob("cache/model/*/weights.pt")} == models
    assert restore(run).member["prior"] == "uniform"


def test_analyze_after_artifacts_json_is_deleted_says_so_and_train_records_them_again(trained, tmp_path):
    settings = copy_root(trained, tmp_path)
    root = tmp_path / "out"
    run = next(root.glob("runs/*/uniform-*"))
    (run / "artifacts.json").unlink()
    analyzed = main_in_process("analyze", "--settings-dir", str(settings))
    assert analyzed.returncode != 0 and "no trained model" not in analyzed.stderr
    assert "status says trained, but artifacts.json" in analyzed.stderr and "python nnpd.py train" in analyzed.stderr
    models = {p: p.stat().st_mtime_ns for p in root.glob("cache/model/*/weights.pt")}
    assert main_in_process("train", "--settings-dir", str(settings)).returncode == 0
    assert {p: p.stat().st_mtime_ns for p in root.glob("cache/model/*/weights.pt")} == models
    assert main_in_process("analyze", "--settings-dir", str(settings)).returncode == 0


def redo_unreadable(trained, folder, name):
    """In a copy of the trained root in `folder`, make record `name` unreadable, `run`, then `verify`:
    (the run, the record's bytes after it or None, the verify)."""
    settings = copy_root(trained, folder)
    root = folder / "out"
    path = root / name if name == "history.json" else next(root.glob("runs/*/normal-*")) / name
    path.write_bytes(b"\xff{not json")
    result = main_in_process("run", "--settings-dir", str(settings))
    written = path.read_bytes() if path.is_file() else None
    return result, written, main_in_process("verify", "--settings-dir", str(settings))


@pytest.mark.parametrize(
    "name", ["status.json", "analysis.json", "artifacts.json", "run.json", "metrics.json", "history.json"]
)
def test_an_unreadable_record_is_redone_with_one_warning(trained, tmp_path, name):
    result, written, checked = redo_unreadable(trained, tmp_path, name)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "warning" in result.stderr
    assert written is not None and json.loads(written.decode())  # written again, readable
    assert checked.returncode == 0, checked.stdout


def test_verify_moves_an_unreadable_record_aside(trained, tmp_path):
    settings = copy_root(trained, tmp_path)
    status = next((tmp_path / "out").glob("runs/*/grid-*")) / "status.json"
    status.write_text("{")
    checked = main_in_process("verify", "--settings-dir", str(settings))
    assert checked.returncode == 1 and str(status) in json.loads(checked.stdout)["damaged"]
    assert not status.exists() and list((tmp_path / "out").glob("damaged/records/*status.json-*"))
    assert main_in_process("run", "--settings-dir", str(settings)).returncode == 0 and status.exists()


def test_leftovers_of_killed_launches_are_tidied_by_the_next(trained, tmp_path):
    settings = copy_root(trained, tmp_path)
    root = tmp_path / "out"
    stale = [
        root / "cache" / "model" / f".tmp-{'0' * 64}-1-abc",
        root / "cache" / "model" / f".tmp-{'1' * 64}-prune-2-ab",
        root / "locks" / "launch-dead",
        root / "runs" / "x-1" / ".trash-y-1-2",
    ]
    for path in stale:
        path.mkdir(parents=True)
    (root / "locks" / f"model-{'2' * 64}.lock").touch()
    for index in range(5):
        (root / "damaged" / "model" / f"{'3' * 64}-2026010{index}T000000.000000Z").mkdir(parents=True)
    assert run_cli("run", "--settings-dir", str(settings)).returncode == 0
    assert not any(path.exists() for path in stale) and not (root / "locks" / f"model-{'2' * 64}.lock").exists()
    assert sorted(p.name[-23:-15] for p in (root / "damaged" / "model").iterdir()) == [
        "20260102",
        "20260103",
        "20260104",
    ]


# ---------------------------------------------------------------- loading never runs code


def tamper(run, change):
    """Rewrite run.json with a change and a matching checksum (as an attacker could)."""
    record = json.loads((run / "run.json").read_text())
    change(record)
    record["checksum"] = record_checksum(record)
    (run / "run.json").write_text(json.dumps(record))


def test_restore_refuses_a_tampered_run_json_without_calling_anything(trained, tmp_path, monkeypatch):
    copy_root(trained, tmp_path)
    run = next((tmp_path / "out").glob("runs/*/uniform-*"))
    record = json.loads((run / "run.json").read_text())
    record["settings"]["experiment"] = "subprocess:Popen"
    (run / "run.json").write_text(json.dumps(record))  # checksum left stale
    with pytest.raises(DamagedArtifact, match="checksum"):
        restore(run)
    evidence = tmp_path / "called"
    (tmp_path / "evil_module.py").write_text(
        f"class Evil:\n    def __init__(self, *args):\n        open({str(evidence)!r}, 'w').close()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec, words in (
        ("subprocess:Popen", "standard-library"),
        ("builtins:dict", "standard-library"),
        ("evil_module:Evil", "lacks members"),
    ):
        tamper(run, lambda r: r["settings"].update(experiment=spec))
        with pytest.raises(ValueError, match=words):
            restore(run)
    assert not evidence.exists()


# ---------------------------------------------------------------- a full disk


def test_a_full_disk_ends_with_one_line_naming_the_path(tmp_path):
    settings = write_settings(tmp_path / "s", tmp_path / "out", training='settings["data"]["train"] = 20_000\n')
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run(
        [sys.executable, str(REPO / "nnpd.py"), "train", "--settings-dir", str(settings)],
        env={**environment, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=limit_file_size(100_000),
    )
    assert result.returncode == 1
    line = one_error_line(result)
    assert "disk is full" in line and str(tmp_path / "out") in line
    assert not list((tmp_path / "out").glob("cache/*/*/artifact.json"))  # nothing partial committed
    assert main_in_process("train", "--settings-dir", str(settings)).returncode == 0  # space back: it completes
    assert np.load(next((tmp_path / "out").glob("cache/training-data/*/train_x.npy"))).shape[0] == 20_000
