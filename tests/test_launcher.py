"""launcher.py: a SIGTERM'd torchrun launch ends with exit 143 and one line, and is torchrun otherwise.

Real torchrun agents and workers on CPU (Gloo), as in tests/test_preemption.py.
"""

import signal
import subprocess
import sys
import time

import pytest

from helpers import (
    REPO,
    TIMEOUT,
    ahead,
    finish_agent,
    made_ahead,
    saved_states,
    toy_environment,
    toy_settings,
    train_command,
    wait_for,
)

pytestmark = pytest.mark.launch

LAUNCHER = str(REPO / "launcher.py")
STOPPED = "nnpd: torchrun stopped by SIGTERM after its workers stopped; the same command resumes from what they saved"


def test_a_sigtermed_launch_ends_with_143_and_one_line_then_resumes(tmp_path):
    # Three models, two workers: each worker is still inside its first model when both saved a state
    # (at their first epoch's end), and the resume trains what is left of four epochs.
    settings = toy_settings(tmp_path, train=20000, epochs=4)
    agent = subprocess.Popen(
        train_command(LAUNCHER, "--standalone", "--nproc_per_node=2", settings=settings),
        env=toy_environment(),
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    # Both workers are training once each has saved a state (at its first epoch's end).
    wait_for(lambda: len(saved_states(tmp_path / "out")) == 2, "both workers' saved states", process=agent)
    agent.send_signal(signal.SIGTERM)
    stderr = agent.communicate(timeout=TIMEOUT)[1]
    assert agent.returncode == 143, stderr
    assert "Traceback" not in stderr and stderr.count(STOPPED) == 1, stderr
    assert stderr.rstrip().endswith(STOPPED), stderr  # the launch's last word
    assert stderr.count("training stopped on request") == 2, stderr  # each worker saved and stopped
    again = subprocess.run(
        train_command(settings=settings),
        env=toy_environment(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("resumed runs/") == 2, again.stdout
    assert len(list((tmp_path / "out" / "cache" / "model").glob("*/artifact.json"))) == 3
    assert not saved_states(tmp_path / "out")


LAUNCHERS = ([LAUNCHER], ["-m", "torch.distributed.run"])


def launch_both(folder, arguments, status, says):
    """launcher.py and torchrun with `arguments` in `folder` (which has fails.py), side by side:
    [(launcher, exit status, output)] (a failed worker's rendezvous is --standalone: they do not meet)."""
    (folder / "fails.py").write_text("import sys\nsys.exit(3)\n")
    agents = [
        subprocess.Popen(
            [sys.executable, *launcher, *arguments],
            env=toy_environment(),
            cwd=folder,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for launcher in LAUNCHERS
    ]
    endings = []
    for launcher, agent in zip(LAUNCHERS, agents):
        output = finish_agent(agent)
        endings.append((launcher, agent.returncode, output))
    return endings


@pytest.fixture(scope="module")
def other_endings(request, tmp_path_factory):
    """The launches of the cases below, made side by side before the first one."""
    return ahead(request, tmp_path_factory, "test_any_other_ending_is_torchruns_own", launch_both)


@pytest.mark.parametrize(
    "arguments, status, says",
    [
        (["--standalone", "--nproc_per_node=1", "fails.py"], 1, "ChildFailedError"),
        (["--no-such-option"], 2, "usage:"),
    ],
    ids=["a failed worker", "a usage error"],
)
def test_any_other_ending_is_torchruns_own(other_endings, tmp_path, arguments, status, says):
    _, endings = made_ahead(other_endings, launch_both, tmp_path, arguments=arguments, status=status, says=says)
    for launcher, returncode, output in endings:  # the same ending from both
        assert returncode == status and says in output and "nnpd:" not in output, (launcher, output)


SLOW_TO_STOP = """
import os, signal, sys, time
from pathlib import Path


def stop(signum, frame):
    time.sleep(3)           # a worker saving its state for a while
    sys.exit(0)


signal.signal(signal.SIGTERM, stop)
Path(sys.argv[1]).write_text(str(os.getpid()))
while True:
    time.sleep(0.1)
"""


def alive(pid):
    """Whether process `pid` still runs (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_repeated_signals_end_the_launch_only_after_its_workers(tmp_path):
    # Slurm signals every process of a step, and srun forwards the signal again: torchrun's agent is
    # interrupted while it waits for its workers. The launcher's line still comes after they ended.
    (tmp_path / "slow.py").write_text(SLOW_TO_STOP)
    pid_file = tmp_path / "worker.pid"
    agent = subprocess.Popen(
        [sys.executable, LAUNCHER, "--standalone", "--nproc_per_node=1", "slow.py", str(pid_file)],
        env=toy_environment(),
        cwd=tmp_path,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    wait_for(lambda: pid_file.is_file() and pid_file.read_text(), "the worker's start", process=agent)
    worker = int(pid_file.read_text())
    for _ in range(100):  # every 20 ms for 2 s, or until the launch has ended
        if agent.poll() is not None:
            break
        agent.send_signal(signal.SIGTERM)
        time.sleep(0.02)
    stderr = agent.communicate(timeout=TIMEOUT)[1]
    ended_with_launch = not alive(worker)
    assert agent.returncode == 143 and stderr.rstrip().endswith(STOPPED), stderr
    assert ended_with_launch, "the launcher ended while its worker still ran"
