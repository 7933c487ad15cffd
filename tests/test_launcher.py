"""launcher.py: a SIGTERM'd torchrun launch ends with exit 143 and one line, and is torchrun otherwise.

Real torchrun agents and workers on CPU (Gloo), as in tests/test_preemption.py.
"""
import signal
import subprocess
import sys

import pytest

from conftest import REPO
from test_docs import TIMEOUT, finish, toy_environment, toy_settings, train_command
from test_preemption import saved_states, wait_for

LAUNCHER = str(REPO / "launcher.py")
STOPPED = "nnpd: torchrun stopped by SIGTERM after its workers stopped; the same command resumes from what they saved"


def test_a_sigtermed_launch_ends_with_143_and_one_line_then_resumes(tmp_path):
    settings = toy_settings(tmp_path, train=20000, epochs=8)         # three models, two workers
    agent = subprocess.Popen(train_command(LAUNCHER, "--standalone", "--nproc_per_node=2", settings=settings),
                             env=toy_environment(), cwd=REPO, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    # Both workers are training once each has saved a state (at its first epoch's end).
    wait_for(lambda: len(saved_states(tmp_path / "out")) == 2, "both workers' saved states", process=agent)
    agent.send_signal(signal.SIGTERM)
    stderr = agent.communicate(timeout=TIMEOUT)[1]
    assert agent.returncode == 143, stderr
    assert "Traceback" not in stderr and stderr.count(STOPPED) == 1, stderr
    assert stderr.rstrip().endswith(STOPPED), stderr                     # the launch's last word
    assert stderr.count("training stopped on request") == 2, stderr     # each worker saved and stopped
    again = subprocess.run(train_command(settings=settings), env=toy_environment(), cwd=REPO, capture_output=True,
                           text=True, timeout=TIMEOUT)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("resumed runs/") == 2, again.stdout
    assert len(list((tmp_path / "out" / "cache" / "model").glob("*/artifact.json"))) == 3
    assert not saved_states(tmp_path / "out")


@pytest.mark.parametrize("arguments, status, says", [
    (["--standalone", "--nproc_per_node=1", "fails.py"], 1, "ChildFailedError"),
    (["--no-such-option"], 2, "usage:"),
], ids=["a failed worker", "a usage error"])
def test_any_other_ending_is_torchruns_own(tmp_path, arguments, status, says):
    (tmp_path / "fails.py").write_text("import sys\nsys.exit(3)\n")
    for launcher in ([LAUNCHER], ["-m", "torch.distributed.run"]):          # the same ending from both
        agent = subprocess.Popen([sys.executable, *launcher, *arguments], env=toy_environment(), cwd=tmp_path,
                                 text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        output = finish(agent)
        assert agent.returncode == status and says in output and "nnpd:" not in output, (launcher, output)
