"""The command line's edges: settings code raising KeyboardInterrupt, a real Ctrl-C, a reader that leaves, and
banks and infer inputs that must be answered in one line."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from helpers import REPO, ahead, kit_study, made_ahead, main_in_process, one_error_line, run_cli, write_settings
from posterior import PosteriorError, PosteriorWarning
from store import restore

pytestmark = pytest.mark.launch


def clean_environment():
    """This environment without the variables of an outer torchrun launch."""
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


# ---------------------------------------------------------------- KeyboardInterrupt in settings code


def run_settings_raising_keyboard_interrupt(folder, where):
    """`run` of settings in `folder` whose training file raises KeyboardInterrupt `where`."""
    settings = write_settings(
        folder / "s", folder / "out", training="raise KeyboardInterrupt\n" if where == "make_settings" else ""
    )
    training = settings / "settings_training.py"
    if where == "top level":
        training.write_text(training.read_text() + "\nraise KeyboardInterrupt\n")
    return run_cli("run", "--settings-dir", str(settings))


@pytest.fixture(scope="module")
def keyboard_interrupt_launches(request, tmp_path_factory):
    """The launches of the cases below, made side by side before the first one."""
    return ahead(
        request,
        tmp_path_factory,
        "test_settings_code_raising_keyboard_interrupt_is_a_settings_error",
        run_settings_raising_keyboard_interrupt,
    )


@pytest.mark.parametrize("where", ["top level", "make_settings"])
def test_settings_code_raising_keyboard_interrupt_is_a_settings_error(keyboard_interrupt_launches, tmp_path, where):
    folder, result = made_ahead(
        keyboard_interrupt_launches, run_settings_raising_keyboard_interrupt, tmp_path, where=where
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("nnpd: settings error:") and "Traceback" not in result.stderr
    assert "settings_training.py" in lines[0] and "KeyboardInterrupt" in lines[0]
    assert not (folder / "out").exists()


def ctrl_c_as_at_a_terminal():
    """In the child before exec: SIGINT at its default, as in a shell at a terminal.

    A suite started in the background of a non-interactive shell (`make test &`, many CI
    runners) inherits SIGINT ignored, and so would nnpd, which rightly keeps an ignored
    SIGINT ignored while settings load: the Ctrl-C below would then change nothing.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_real_ctrl_c_while_settings_load_still_interrupts(tmp_path):
    settings = write_settings(tmp_path / "s", tmp_path / "out")
    started = tmp_path / "loading"
    training = settings / "settings_training.py"
    training.write_text(f"import time\nopen({str(started)!r}, 'w').close()\ntime.sleep(120)\n" + training.read_text())
    process = subprocess.Popen(
        [sys.executable, str(REPO / "nnpd.py"), "plan", "--settings-dir", str(settings)],
        env=clean_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_as_at_a_terminal,
    )
    deadline = time.monotonic() + 120
    while not started.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "settings error" not in stderr and "Traceback" not in stderr


# ---------------------------------------------------------------- a reader that leaves


def test_plan_into_a_pipe_closed_early_ends_quietly():
    process = subprocess.Popen(
        [sys.executable, str(REPO / "nnpd.py"), "plan", "--profile", "default"],
        env=clean_environment(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    process.stdout.close()  # the reader leaves before anything is written
    stderr = process.stderr.read().decode()
    process.wait(timeout=120)
    assert "Traceback" not in stderr and "Exception ignored" not in stderr and "BrokenPipe" not in stderr, stderr
    assert process.returncode == 1


def test_plan_piped_into_head_prints_no_traceback():
    result = subprocess.run(
        ["bash", "-c", f"{sys.executable} {REPO / 'nnpd.py'} plan --profile default | head -1"],
        env=clean_environment(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.stdout == "{\n"
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr


# ---------------------------------------------------------------- banks and infer's inputs, answered in one line


def test_a_fifo_as_the_bank_is_refused_by_plan_and_train_without_hanging(tmp_path):
    os.mkfifo(tmp_path / "bank.npz")  # opening it would block for ever
    folder, _, root = kit_study(tmp_path, training=f'settings["data"]["bank"] = {str(tmp_path / "bank.npz")!r}\n')
    for action in ("plan", "train"):
        result = run_cli(action, "--settings-dir", str(folder), timeout=120)
        line = one_error_line(result)
        assert result.returncode == 2 and "data.bank: " in line and "is not a regular file" in line, result.stderr
    assert not root.exists()


ALWAYS_NAN = """
class AlwaysNaN(Line):
    def simulate(self, theta, generator):
        return super().simulate(theta, generator) * float("nan")
"""


@pytest.mark.parametrize(
    "invalid, message",
    [
        ("drop", r"leaving 0 \(at least 2 needed\); fix the simulator there, or narrow the parameter box"),
        ("error", r'; fix the simulator there, or set data\.invalid = "drop" to train on the others'),
    ],
    ids=["drop", "error"],
)
def test_a_simulator_failing_everywhere_is_refused_by_train_in_one_line_writing_nothing(tmp_path, invalid, message):
    choice = f'settings["experiment"] = "kit_{tmp_path.name}:AlwaysNaN"\nsettings["data"]["invalid"] = "{invalid}"\n'
    folder, _, root = kit_study(tmp_path, extra=ALWAYS_NAN, training=choice)
    result = run_cli("train", "--settings-dir", str(folder), timeout=120)
    line = one_error_line(result)
    assert result.returncode == 2 and line.startswith("nnpd: settings error: configuration baseline-"), line
    assert re.search(r"data\.invalid: 16 of 16 simulations that plan drew from prior 'uniform' \(100\.00%\) ", line)
    assert re.search(message, line), line
    assert not root.exists()


def test_a_bank_split_left_empty_under_drop_is_refused_by_train_in_one_line_writing_nothing(tmp_path):
    x, theta = np.zeros((400, 3)), np.zeros((400, 2))
    x[256:320] = np.nan  # every row of data.validation (64 after the 256 of data.train)
    np.savez(tmp_path / "bank.npz", x=x, theta=theta)
    bank = f'settings["data"]["bank"] = {str(tmp_path / "bank.npz")!r}\nsettings["data"]["invalid"] = "drop"\n'
    folder, _, root = kit_study(tmp_path, training=bank)
    result = run_cli("train", "--settings-dir", str(folder), timeout=120)
    line = one_error_line(result)
    assert result.returncode == 2 and "data.validation: 64 of 64 simulations (100.00%) returned NaN" in line, line
    assert "leaving 0 (at least 2 needed); fix the simulator there" in line and "set data.invalid" not in line
    assert not root.exists()


@pytest.fixture(scope="module")
def smoke_run(trained_smoke_root):
    """A run folder of the shared trained root (read, never changed)."""
    return next(trained_smoke_root.glob("runs/*/uniform-r0-*"))


def test_infer_output_through_a_link_into_the_cache_is_refused(smoke_run, tmp_path):
    np.save(tmp_path / "x.npy", np.array([5.0]))
    entry = next(smoke_run.parents[2].glob("cache/model/*"))
    (tmp_path / "link").symlink_to(entry)  # outside the root, pointing into it
    before = sorted(entry.iterdir())
    result = main_in_process(
        "infer", str(smoke_run), "--observations", str(tmp_path / "x.npy"), "--output", str(tmp_path / "link")
    )
    assert result.returncode == 2 and "inside the output root" in one_error_line(result), result.stderr
    assert sorted(entry.iterdir()) == before


def test_infer_answers_a_huge_observation_and_an_output_name_that_is_a_folder_in_one_line(smoke_run, tmp_path):
    np.save(tmp_path / "big.npy", np.array([1e300]))
    np.save(tmp_path / "x.npy", np.array([5.0]))
    (tmp_path / "x-uniform-r0.samples.npy").mkdir()
    for observations, message in (
        ("big.npy", "beyond float32's range"),
        (
            "x.npy",
            r"samples\.npy: exists and is "
            r"not a file; move it",
        ),
    ):
        result = main_in_process(
            "infer", str(smoke_run), "--observations", str(tmp_path / observations), "--samples", "50"
        )
        assert result.returncode == 2 and re.search(message, one_error_line(result)), result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.npy", "x-uniform-r0.samples.npy", "x.npy"]


def test_infer_scores_c2st_on_sets_of_equal_size(smoke_run, tmp_path):
    np.save(tmp_path / "x.npy", np.array([5.0]))
    with warnings.catch_warnings():  # the smoke model is barely trained: its flatness is not this test's concern
        warnings.simplefilter("ignore", PosteriorWarning)
        posterior = restore(smoke_run).posterior(np.array([5.0]))
    np.save(tmp_path / "reference.npy", posterior.sample(2000, seed=7).numpy())  # the very posterior, 10× as many
    result = main_in_process(
        "infer",
        str(smoke_run),
        "--observations",
        str(tmp_path / "x.npy"),
        "--samples",
        "200",
        "--reference",
        str(tmp_path / "reference.npy"),
    )
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("c2st:"))
    assert ", 200 samples against 200 of the 2000 reference draws (sets of equal size" in line
    summary = json.loads((tmp_path / "x-uniform-r0.posterior.json").read_text())
    assert summary["c2st_draws"] == 200 and summary["c2st"] < 0.7  # unequal sets read about 0.9


@pytest.mark.parametrize(
    "observations, message",
    [
        (np.array([5.0 + 1j]), "complex128, not real numbers"),
        (np.ma.masked_array([5.0], mask=[True]), "a masked array; fill or drop the masked values"),
        (np.array([5.0], dtype=object), "of object, not real numbers"),
        ("5.0", "str of <U3, not real numbers"),
        ({"x": 5.0}, "dict of object, not real numbers"),
        (np.array([1e300]), "beyond float32's range"),
    ],
)
def test_restore_posterior_refuses_input_that_is_not_real_numbers_naming_the_fix(smoke_run, observations, message):
    with pytest.raises(PosteriorError, match=message):
        restore(smoke_run).posterior(observations)
