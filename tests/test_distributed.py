"""Real torchrun launches of nnpd on CPU with Gloo: jobs mode, DDP, two nodes, failures."""

import json
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import jobs
import runtime
from helpers import REPO, clean_environment, free_port, torchrun, write_settings
from store import Store

TIMEOUT = 300


def run_folders(root):
    """Every run folder of an output root."""
    return sorted(path.parent for path in Path(root, "runs").glob("*/*/run.json"))


def cache_entries(root):
    """{(name, key): manifest mtime} of every committed artifact."""
    return {
        (path.parent.parent.name, path.parent.name): path.stat().st_mtime_ns
        for path in Path(root, "cache").glob("*/*/artifact.json")
    }


@pytest.mark.launch
def test_two_jobs_workers_take_disjoint_jobs_and_share_products(tmp_path):
    settings = write_settings(tmp_path / "s", tmp_path / "out")
    outputs = []
    for stage in ("train", "analyze"):  # the stages launched separately
        launched = torchrun(stage, "--settings-dir", str(settings))
        assert launched.returncode == 0, launched.stdout + launched.stderr
        outputs.append(launched.stdout)
    runs = run_folders(tmp_path / "out")
    assert len(runs) == 4
    # Every worker logs its own jobs, with its rank; training shows its epochs.
    for run in runs:
        assert str(run.relative_to(tmp_path / "out")) in outputs[0] and "epoch 2/2" in outputs[0]
    assert "rank 0]" in outputs[0] and "rank 1]" in outputs[0], outputs[0]
    for rank in (0, 1):  # each worker reports the epochs of the models it trains
        assert any(f"rank {rank}]" in line and "epoch 2/2" in line for line in outputs[0].splitlines()), outputs[0]
    # Each job was done by exactly one worker (its folder names it), and both workers had work.
    for record in ("status.json", "analysis.json"):
        workers = [json.loads((run / record).read_text())["worker"] for run in runs]
        assert sorted(set(workers)) == [0, 1], (record, workers)
    # Both workers' runs use the one observations artifact: built once under its lock, read by the other.
    used = {json.loads((run / "artifacts.json").read_text())["observations"] for run in runs}
    assert len(used) == 1
    entries = cache_entries(tmp_path / "out")
    assert [name for name, _ in entries].count("observations") == 1
    assert [name for name, _ in entries].count("model") == 4
    assert not (tmp_path / "out" / "damaged").exists()
    assert not list((tmp_path / "out" / "locks").glob("launch-*"))  # launch marks are cleaned up
    second = torchrun("run", "--settings-dir", str(settings))
    assert second.returncode == 0, second.stdout + second.stderr
    assert cache_entries(tmp_path / "out") == entries  # nothing retrained or rebuilt
    # Data and model reused for the 4 jobs, and no epoch trained (the report's lines still name the kept ones).
    assert second.stdout.count(": reused") == 8 and not re.search(r"epoch \d+/\d+", second.stdout)


@pytest.mark.launch
def test_ddp_run_trains_together_and_analyses_on_rank_zero(tmp_path):
    settings = write_settings(
        tmp_path / "s",
        tmp_path / "out",
        training='settings["runtime"]["parallel"] = "ddp"\nsettings["cohort"]["priors"] = ["uniform", "grid"]\n',
    )
    result = torchrun("run", "--settings-dir", str(settings))
    assert result.returncode == 0, result.stdout + result.stderr
    for run in run_folders(tmp_path / "out"):
        assert json.loads((run / "run.json").read_text())["backend"]["ddp_world_size"] == 2
        assert json.loads((run / "analysis.json").read_text())["worker"] == 0
        history = json.loads((run / "status.json").read_text())
        assert history["state"] == "trained"
    assert result.stdout.count("analyze ") >= 2 and "rank 1" not in result.stdout


def readme_two_node_command():
    """The README's several-nodes torchrun line, as tokens."""
    lines = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("torchrun --nnodes")]
    assert len(lines) == 1, "the README shows one several-nodes command"
    return shlex.split(lines[0])


def on_loopback(command, port, settings, rendezvous_id):
    """A README torchrun command made to run here: one worker per node, 127.0.0.1, test settings."""
    substitutes = {"torchrun": [sys.executable, "-m", "torch.distributed.run"], "nnpd.py": [str(REPO / "nnpd.py")]}
    result = []
    for token in command:
        if token.startswith("--nproc_per_node="):
            token = "--nproc_per_node=1"
        elif token.startswith("--rdzv-endpoint="):
            token = f"--rdzv-endpoint=127.0.0.1:{port}"
        elif token.startswith("--rdzv-id="):
            token = f"--rdzv-id={rendezvous_id}"
        result += substitutes.get(token, [token])
    profile = result.index("--profile")
    return result[:profile] + ["--settings-dir", str(settings)] + result[profile + 2 :]


@pytest.mark.unit
def test_the_readme_two_node_command_uses_a_c10d_rendezvous():
    command = readme_two_node_command()
    assert "--standalone" not in command and "--nnodes=2" in command and "--rdzv-backend=c10d" in command
    assert any(token.startswith("--rdzv-endpoint=") for token in command)


@pytest.mark.parametrize("parallel", ["jobs", "ddp"])
@pytest.mark.launch
def test_two_nodes_on_loopback(tmp_path, parallel):
    """The README's several-nodes command, run as two agents on this machine."""
    settings = write_settings(
        tmp_path / "s",
        tmp_path / "out",
        training=f'settings["runtime"]["parallel"] = "{parallel}"\n'
        'settings["cohort"]["priors"] = ["uniform", "normal"]\n',
    )
    command = on_loopback(readme_two_node_command(), free_port(), settings, f"nnpd-{parallel}")
    nodes = [
        subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_environment(), cwd=REPO
        )
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=TIMEOUT)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    runs = run_folders(tmp_path / "out")
    assert len(runs) == 2
    assert all(json.loads((run / "analysis.json").read_text())["state"] == "complete" for run in runs)


@pytest.mark.launch
def test_a_rank_that_raises_mid_training_ends_the_launch_promptly(tmp_path):
    toy = REPO / "tests" / "toy_settings"
    settings = tmp_path / "s"
    settings.mkdir()
    for name in ("settings_training.py", "settings_analysis.py"):
        text = (toy / name).read_text().replace("OUTPUT_ROOT", str(tmp_path / "out"))
        text = text.replace('"parallel": "jobs"', '"parallel": "ddp"').replace(
            '"timeout_minutes": 5', '"timeout_minutes": 10'
        )
        text = text.replace('"epochs": 6', '"epochs": 2')  # the poison stops the first epoch; the relaunch is short
        (settings / name).write_text(text.replace('"noise": 0.3}', '"noise": 0.3, "poison": True}'))
    # A rank left waiting would hang until the 10-minute group timeout, far past this 240 s guard.
    failed = torchrun("train", "--settings-dir", str(settings), timeout=240)
    assert failed.returncode != 0
    assert "non-finite" in failed.stdout + failed.stderr  # the original error is visible
    assert [name for name, _ in cache_entries(tmp_path / "out")].count("model") == 0
    text = (settings / "settings_training.py").read_text()
    (settings / "settings_training.py").write_text(text.replace(', "poison": True', ""))
    relaunch = torchrun("train", "--settings-dir", str(settings))
    assert relaunch.returncode == 0, relaunch.stdout + relaunch.stderr
    assert [name for name, _ in cache_entries(tmp_path / "out")].count("model") == 3


@pytest.mark.unit
def test_a_workers_watch_ends_quietly_once_rank_zero_removed_the_launchs_marks(tmp_path, monkeypatch):
    """Rank 0 removes the marks folder at the end while every worker's watch may still beat in it."""
    failures = []
    monkeypatch.setattr(threading, "excepthook", failures.append)
    rt = runtime.Runtime(device=torch.device("cpu"), rank=1, world_size=2)
    launch = jobs.Launch("train", None, tmp_path, Store(tmp_path), rt, {}, id="ended")
    launch.marks.mkdir(parents=True)
    jobs.keep_watch(launch, interval=0.01)
    time.sleep(0.05)
    assert (launch.marks / "alive-1").exists()
    shutil.rmtree(launch.marks)
    deadline = time.monotonic() + 5
    while any(thread.name == "nnpd-watch" for thread in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert failures == [] and not any(thread.name == "nnpd-watch" for thread in threading.enumerate())
