"""A DDP worker that dies while rank 0 analyses: rank 0 ends with nnpd's one line, not a Gloo traceback.

The two workers run under two torchrun agents (two "nodes" on the loopback interface, a
static rendezvous hosted by node 0), so that rank 0's agent does not stop rank 0 when rank
1 dies: rank 0 meets the loss in its next collective, as on a real cluster.
"""

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from helpers import REPO, free_port, start, wait_for, worker_pids, write_settings

pytestmark = pytest.mark.launch

# One model, and an analysis that lasts a few seconds (the window in which rank 1 is killed).
TRAINING = 'settings["runtime"]["parallel"] = "ddp"\nsettings["cohort"]["priors"] = ["uniform"]\n'
ANALYSIS = (
    'settings["inference"]["truths"]["truth_points_per_axis"] = 64\n'
    'settings["inference"]["candidates"]["candidate_count"] = 2048\n'
)


def node(settings, node_rank, port, logs):
    """The torchrun command of one node of two, one worker each; the workers' output goes to files under logs."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        f"--node-rank={node_rank}",
        "--nproc-per-node=1",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "--max-restarts=0",
        f"--log-dir={logs}",
        "--redirects=3",
        str(REPO / "nnpd.py"),
        "run",
        "--settings-dir",
        str(settings),
    ]


def analysing_while_rank_one_waits(root):
    """Rank 0 analyses the model and rank 1 waits at its mark for the analysis to end."""
    records = list(Path(root, "runs").glob("*/*/analysis.json"))
    running = any(json.loads(path.read_text()).get("state") == "running" for path in records if path.stat().st_size)
    return running and bool(list(Path(root, "locks").glob("launch-*/*-analysed-1")))


def test_a_ddp_worker_killed_during_rank_zeros_analysis_ends_rank_zero_with_one_line(tmp_path):
    settings = write_settings(tmp_path / "s", tmp_path / "out", training=TRAINING, analysis=ANALYSIS)
    port = free_port()
    nodes = [start(node(settings, rank, port, tmp_path / f"logs{rank}")) for rank in (0, 1)]
    try:
        wait_for(lambda: analysing_while_rank_one_waits(tmp_path / "out"), "rank 0's analysis", process=nodes[0])
        os.kill(worker_pids(nodes[1].pid)[1], signal.SIGKILL)
        for agent in nodes:
            agent.communicate(timeout=300)
    finally:
        for agent in nodes:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    stderr = "".join(path.read_text() for path in (tmp_path / "logs0").rglob("stderr.log"))
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("nnpd:")]
    assert len(lines) == 1 and lines[0].startswith("nnpd: error: worker 1 stopped"), stderr
    assert "the same command resumes" in lines[0]
    assert nodes[0].returncode == 1
