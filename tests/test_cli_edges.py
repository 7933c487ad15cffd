"""The command line's edges: settings code raising KeyboardInterrupt, a real Ctrl-C, and a reader that leaves."""
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO, ahead, made_ahead, run_cli, write_settings

pytestmark = pytest.mark.launch


def clean_environment():
    """This environment without the variables of an outer torchrun launch."""
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


# ---------------------------------------------------------------- KeyboardInterrupt in settings code

def run_settings_raising_keyboard_interrupt(folder, where):
    """`run` of settings in `folder` whose training file raises KeyboardInterrupt `where`."""
    settings = write_settings(folder / "s", folder / "out",
                              training="raise KeyboardInterrupt\n" if where == "make_settings" else "")
    training = settings / "settings_training.py"
    if where == "top level":
        training.write_text(training.read_text() + "\nraise KeyboardInterrupt\n")
    return run_cli("run", "--settings-dir", str(settings))


@pytest.fixture(scope="module")
def keyboard_interrupt_launches(request, tmp_path_factory):
    """The launches of the cases below, made side by side before the first one."""
    return ahead(request, tmp_path_factory, "test_settings_code_raising_keyboard_interrupt_is_a_settings_error",
                 run_settings_raising_keyboard_interrupt)


@pytest.mark.parametrize("where", ["top level", "make_settings"])
def test_settings_code_raising_keyboard_interrupt_is_a_settings_error(keyboard_interrupt_launches, tmp_path, where):
    folder, result = made_ahead(keyboard_interrupt_launches, run_settings_raising_keyboard_interrupt, tmp_path,
                                where=where)
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
    process = subprocess.Popen([sys.executable, str(REPO / "nnpd.py"), "plan", "--settings-dir", str(settings)],
                               env=clean_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=ctrl_c_as_at_a_terminal)
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
    process = subprocess.Popen([sys.executable, str(REPO / "nnpd.py"), "plan", "--profile", "default"],
                               env=clean_environment(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()                              # the reader leaves before anything is written
    stderr = process.stderr.read().decode()
    process.wait(timeout=120)
    assert "Traceback" not in stderr and "Exception ignored" not in stderr and "BrokenPipe" not in stderr, stderr
    assert process.returncode == 1


def test_plan_piped_into_head_prints_no_traceback():
    result = subprocess.run(["bash", "-c", f"{sys.executable} {REPO / 'nnpd.py'} plan --profile default | head -1"],
                            env=clean_environment(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.stdout == "{\n"
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr
