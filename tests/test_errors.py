"""One error family, and launches and restores that leave the process as they found it."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import infer
import posterior
import runtime
import settings
import store
import trainer
from helpers import REPO, kit_study, main_in_process, run_without_pythonpath, without_pythonpath, write_settings
from store import DamagedArtifact, NnpdError, RestoreError, record_checksum, restore


@pytest.mark.unit
def test_every_error_nnpd_raises_for_the_user_is_an_nnpd_error():
    family = (
        settings.SettingsError,
        store.LaunchError,
        DamagedArtifact,
        store.MissingArtifact,
        RestoreError,
        posterior.PosteriorError,
        infer.InferError,
        runtime.Interrupted,
        runtime.Preempted,
    )
    assert all(issubclass(error, NnpdError) for error in family)
    assert not issubclass(DamagedArtifact, OSError) and not issubclass(store.LaunchError, RuntimeError)
    assert issubclass(settings.SettingsError, ValueError)  # what user code caught before stays caught
    # One Preempted, a stop: `except KeyboardInterrupt` (torchrun's, the interpreter's exit status) still sees it.
    assert trainer.Preempted is runtime.Preempted and issubclass(runtime.Preempted, runtime.Interrupted)
    assert issubclass(runtime.Interrupted, KeyboardInterrupt)


@pytest.mark.unit
def test_restore_of_a_folder_that_is_no_run_raises_an_nnpd_error(tmp_path):
    with pytest.raises(RestoreError, match="not a run folder"):
        restore(tmp_path)


@pytest.mark.unit
def test_loading_settings_leaves_the_import_path_as_it_was(tmp_path):
    folder = write_settings(tmp_path / "settings", tmp_path / "out")
    before = list(sys.path)
    settings.load_profile(folder, "smoke")
    assert sys.path == before


@pytest.mark.unit
def test_a_sigterm_inside_settings_code_is_a_stop_not_a_settings_error(tmp_path):
    # A settings file raising KeyboardInterrupt itself stays a settings error (test_cli_edges.py);
    # nnpd's own stop, which SIGTERM raises wherever the code is, passes through as the stop.
    stopping = "import os, signal, time\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(5)\n"
    folder = write_settings(tmp_path / "settings", tmp_path / "out", training=stopping)
    with runtime.STOP.handling(), pytest.raises(runtime.Interrupted, match="stopped by SIGTERM"):
        settings.load_profile(folder, "smoke")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def kit_run(tmp_path_factory):
    """A kit study beside its settings, run without PYTHONPATH: (settings folder, module name, run folder)."""
    folder, module, root = kit_study(tmp_path_factory.mktemp("errors"))
    result = run_without_pythonpath("run", "--settings-dir", str(folder))
    assert result.returncode == 0, result.stderr
    return folder, module, next(root.glob("runs/*/*/run.json")).parent


def moved_study(kit_run, tmp_path, name, source_edit, spec=None):
    """A copy of the run's output root whose run.json names a copy of the study folder, its module edited."""
    folder, module, run = kit_run
    study = tmp_path / f"{name}-study"
    shutil.copytree(folder, study)
    source = study / f"{module}.py"
    source.write_text(source_edit(source.read_text()))
    shutil.copytree(run.parents[2], tmp_path / f"{name}-out", symlinks=True)
    copy = tmp_path / f"{name}-out" / run.relative_to(run.parents[2])
    record = json.loads((copy / "run.json").read_text())
    record["study_path"] = str(study)
    record["settings"]["experiment"] = spec or record["settings"]["experiment"]
    record["checksum"] = record_checksum(record)
    (copy / "run.json").write_text(json.dumps(record))
    return copy


@pytest.mark.launch
def test_restore_leaves_the_import_path_and_serves_each_study_its_own_module(kit_run, tmp_path):
    folder, module, run = kit_run
    before = list(sys.path)
    first = restore(run)
    assert sys.path == before and str(folder) not in sys.path
    with pytest.warns(posterior.PosteriorWarning, match="learned little"):  # the tiny model learns nothing
        assert first.posterior(np.array([0.1, 0.2, 0.3])).summary()  # works with the folder off the path
    second = restore(moved_study(kit_run, tmp_path, "second", lambda text: text + "\nWHICH = 'second'\n"))
    assert sys.path == before
    assert sys.modules[type(second.experiment).__module__].WHICH == "second"
    assert type(first.experiment) is not type(second.experiment) and not hasattr(first.experiment, "WHICH")
    with pytest.warns(posterior.PosteriorWarning, match="learned little"):  # the tiny model learns nothing
        assert first.posterior(np.array([0.1, 0.2, 0.3])).summary()  # the first keeps its class


@pytest.mark.launch
def test_infer_lets_a_bug_in_the_study_end_in_a_traceback_not_exit_2(kit_run, tmp_path):
    folder, module, run = kit_run
    buggy = (
        "\n\nclass Buggy(Line):\n    def posterior(self, *args, **kwargs):\n"
        "        return len(None)                      # a bug: TypeError\n"
    )
    copy = moved_study(kit_run, tmp_path, "buggy", lambda text: text + buggy, spec=f"{module}:Buggy")
    np.save(tmp_path / "x.npy", np.array([0.1, 0.2, 0.3]))
    result = main_in_process("infer", str(copy), "--observations", str(tmp_path / "x.npy"))
    assert result.returncode == 1 and "TypeError" in result.stderr, result.stderr
    assert "Traceback" in result.stderr


@pytest.mark.launch
def test_infer_answers_a_damaged_run_json_in_one_line(kit_run, tmp_path):
    folder, module, run = kit_run
    copy = moved_study(kit_run, tmp_path, "damaged", lambda text: text)
    record = json.loads((copy / "run.json").read_text())
    record["seed"] = "altered"  # checksum left stale
    (copy / "run.json").write_text(json.dumps(record))
    np.save(tmp_path / "x.npy", np.array([0.1, 0.2, 0.3]))
    result = main_in_process("infer", str(copy), "--observations", str(tmp_path / "x.npy"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "checksum" in result.stderr, result.stderr


LAUNCH_IN_PROCESS = """
import ctypes, sys, warnings
sys.path.insert(0, {repo!r})
import nnpd

class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype, libc.malloc.restype, libc.malloc.argtypes = Info, ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def mapped():
    # glibc maps a 48 MiB block of its own unless keep_freed_memory raised the threshold to 64 MiB
    before = libc.mallinfo2().hblks
    block = libc.malloc(48 << 20)
    after = libc.mallinfo2().hblks
    libc.free(block)
    return after > before

state = lambda: (list(sys.path), warnings.formatwarning, list(warnings.filters), mapped())
before = state()
status = nnpd.main(["train", "--settings-dir", {folder!r}])
print(status, state() == before, [a == b for a, b in zip(state(), before)])
"""


@pytest.mark.launch
def test_a_launch_in_process_puts_back_the_import_path_warnings_and_allocator(kit_run):
    folder, module, run = kit_run
    code = LAUNCH_IN_PROCESS.format(repo=str(REPO), folder=str(folder))
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=without_pythonpath(), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].split()[:2] == ["0", "True"], (result.stdout, result.stderr[-2000:])
