"""Nothing trained is lost: resume inside a model after SIGKILL or SIGTERM, elastic restarts,
workers that stop with their launcher, and models of every backend kept.

Each test interrupts a real launch at a point it can observe (the first saved training
state appearing in the store's scratch area), then checks that the final weights are
bitwise those of an uninterrupted launch with the same settings in another output root.
"""

import functools
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from helpers import (
    command,
    finish_launch,
    kit_study,
    main_in_process,
    module_name,
    saved_states,
    settings_for,
    side_by_side,
    start,
    wait_for,
    weights,
    worker_pids,
    write_settings,
)

pytestmark = pytest.mark.launch

# Two ranks train the 3 epochs of INTERRUPTIBLE_TRAINING in about a second: 12 leave a kill
# after the first saved state a wide margin to land inside the model.
DDP = 'settings["runtime"]["parallel"] = "ddp"\nsettings["training"]["epochs"] = 12\n'


def assert_bitwise_equal(ours, reference):
    """Same models, every tensor bitwise equal."""
    assert ours.keys() == reference.keys() and ours
    for key in ours:
        assert all(torch.equal(ours[key][name], reference[key][name]) for name in reference[key]), key


def alive(pid):
    """Whether a process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted single-process and 2-rank DDP trainings of the same settings, launched side by side."""

    def trained(name, extra, workers):
        folder = tmp_path_factory.mktemp(name)
        done = finish_launch(command(settings_for(folder, extra), workers=workers))
        assert done.returncode == 0, done.stdout + done.stderr
        return weights(folder / "out")

    return side_by_side(
        {
            name: functools.partial(trained, name, extra, workers)
            for name, extra, workers in (("single", "", 1), ("ddp", DDP, 2))
        }
    )


def test_sigkill_mid_training_then_the_same_command_resumes_bitwise(tmp_path, reference):
    settings = settings_for(tmp_path)
    process = start(command(settings))
    wait_for(lambda: saved_states(tmp_path / "out"), "a saved training state", process=process)
    process.kill()
    process.wait()
    assert not weights(tmp_path / "out")  # killed inside the model
    again = finish_launch(command(settings))
    assert again.returncode == 0, again.stderr
    assert "resumed" in again.stdout and not saved_states(tmp_path / "out")
    assert_bitwise_equal(weights(tmp_path / "out"), reference["single"])


def test_sigterm_saves_and_exits_with_one_line_then_resumes_bitwise(tmp_path, reference):
    settings = settings_for(tmp_path)
    process = start(command(settings))
    wait_for(lambda: saved_states(tmp_path / "out"), "a saved training state", process=process)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 143
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "same command" in lines[0] and "Traceback" not in stderr, stderr
    again = finish_launch(command(settings))
    assert again.returncode == 0 and "resumed" in again.stdout, again.stderr
    assert_bitwise_equal(weights(tmp_path / "out"), reference["single"])


# A simulator of two halves that says so and waits the first time a half has HOLD_ROWS rows or more,
# catching every Exception as many simulators do. nnpd's plan checks simulate 16 rows, the training
# data 256 in one call: a stop there spoils its second half only, which data.invalid "drop" would drop.
HOLDING_STUDY = """
import pathlib
import time


class Holding(Line):
    def simulate(self, theta, generator):
        half = theta.shape[0] // 2
        return torch.cat([super().simulate(theta[:half], generator), self.held(theta[half:], generator)])

    def held(self, theta, generator):
        started = pathlib.Path(__file__).with_name("simulating")
        try:
            if theta.shape[0] >= {rows} and not started.exists():
                started.touch()
                time.sleep(120)
            return super().simulate(theta, generator)
        except Exception:
            return torch.full((theta.shape[0], 3), float("nan"), dtype=torch.float64)
"""


@pytest.mark.parametrize(
    "rows, invalid",
    [(1, "error"), (64, "error"), (64, "drop")],
    ids=["plan check", "data, invalid fails", "data, invalid dropped"],
)
def test_a_stop_the_study_swallows_still_stops_and_commits_nothing_it_spoiled(tmp_path, rows, invalid):
    """SIGTERM inside a simulator whose `except Exception` catches the stop: the launch stops as
    asked, the failures that follow are not blamed on the study, and spoiled rows are not committed."""
    choice = f'settings["experiment"] = "{module_name(tmp_path)}:Holding"\nsettings["data"]["invalid"] = "{invalid}"\n'
    folder, module, root = kit_study(tmp_path, extra=HOLDING_STUDY.format(rows=rows), training=choice)
    process = start(command(folder, action="run"))
    wait_for(lambda: (folder / "simulating").exists(), "the simulator to start", process=process)
    time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    *warned, last = stderr.strip().splitlines()  # "drop" warns of the rows it drops, then the stop
    assert last.startswith("nnpd: stopped by SIGTERM") and "same command" in last, stderr
    assert all(line.startswith("nnpd: warning: data.train: 128 of 256") for line in warned) and len(warned) <= 1
    assert not list(root.glob("cache/training-data/*/artifact.json"))
    if invalid == "drop":
        assert "not committed" in last and warned
        again = finish_launch(command(folder, action="run"))
        assert again.returncode == 0, again.stderr
        assert "dropped_simulations" not in json.loads(next(root.glob("runs/*/*/run.json")).read_text())


def test_sigterm_repeated_until_the_launch_has_exited_changes_nothing(tmp_path):
    """Slurm, torchrun and srun each send SIGTERM: a repeat, even one arriving while the launch
    prints how it ended or while the interpreter exits, must not kill it with the default action."""
    process = start(command(settings_for(tmp_path)))
    wait_for(lambda: saved_states(tmp_path / "out"), "a saved training state", process=process)
    first = time.monotonic()
    while process.poll() is None and time.monotonic() - first < 1.0:  # inside the 2 s repeat window
        process.send_signal(signal.SIGTERM)
        time.sleep(0.002)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr  # -15: a repeat met the default handler
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "training stopped on request" in lines[0] and "its state was saved" in lines[0], stderr
    assert saved_states(tmp_path / "out")


def test_a_killed_ddp_launch_resumes_bitwise(tmp_path, reference):
    settings = settings_for(tmp_path, DDP)
    process = start(command(settings, workers=2))
    wait_for(lambda: saved_states(tmp_path / "out"), "a saved training state", process=process)
    os.killpg(process.pid, signal.SIGKILL)  # the agent and both workers
    process.wait()
    assert not weights(tmp_path / "out")  # killed inside the model
    again = finish_launch(command(settings, workers=2))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed" in again.stdout
    assert_bitwise_equal(weights(tmp_path / "out"), reference["ddp"])


def test_an_elastic_restart_after_a_killed_rank_resumes_bitwise(tmp_path, reference):
    settings = settings_for(tmp_path, DDP)
    process = start(command(settings, workers=2, restarts=1))
    wait_for(lambda: saved_states(tmp_path / "out") and 1 in worker_pids(process.pid), "a saved state", process=process)
    os.kill(worker_pids(process.pid)[1], signal.SIGKILL)
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stdout + stderr
    assert "resumed" in stdout
    assert_bitwise_equal(weights(tmp_path / "out"), reference["ddp"])


def test_workers_stop_when_the_agent_dies_and_a_relaunch_completes(tmp_path):
    two_models = 'settings["cohort"]["priors"] = ["uniform", "grid"]\n'
    settings = settings_for(tmp_path, two_models + 'settings["training"]["epochs"] = 500\n')  # minutes
    process = start(command(settings, workers=2))
    wait_for(lambda: len(worker_pids(process.pid)) == 2, "two workers", process=process)
    workers = list(worker_pids(process.pid).values())
    # In jobs mode each worker trains a model of its own and saves its state.
    wait_for(lambda: len(saved_states(tmp_path / "out")) == 2, "both workers' saved states", process=process)
    process.kill()  # the agent alone, in the middle of training
    process.wait()
    # Each worker notices within its watch interval (2 s) and stops within its grace (10 s).
    wait_for(lambda: not any(alive(pid) for pid in workers), "the orphaned workers to stop", seconds=30)
    settings = settings_for(tmp_path, two_models + 'settings["training"]["epochs"] = 1\n')  # a short relaunch
    again = finish_launch(command(settings, workers=2))
    assert again.returncode == 0, again.stdout + again.stderr
    assert not list((tmp_path / "out" / "locks").glob("launch-*"))


def test_switching_backends_keeps_the_models_of_both(tmp_path):
    settings = write_settings(
        tmp_path / "s", tmp_path / "out", training=DDP + 'settings["cohort"]["priors"] = ["uniform", "grid"]\n'
    )
    for workers in (2, 1):  # the single-process training through nnpd.main in-process
        done = (
            finish_launch(command(settings, workers=2))
            if workers == 2
            else main_in_process("train", "--settings-dir", str(settings))
        )
        assert done.returncode == 0, done.stdout + done.stderr
    models = {p: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("cache/model/*/weights.pt")}
    assert len(models) == 4  # two priors, two backends (world size 2 and 1)
    third = finish_launch(command(settings, workers=2))
    assert third.returncode == 0, third.stdout + third.stderr
    assert third.stdout.count("reused") >= 2 and not re.search(r"epoch \d+/\d+", third.stdout)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("cache/model/*/weights.pt")} == models
    history = json.loads((tmp_path / "out" / "history.json").read_text())["trainings"]
    assert len(history) == 1 and len(history[0]["backends"]) == 2
