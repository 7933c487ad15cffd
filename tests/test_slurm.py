"""A real Slurm on this machine runs examples/slurm.sbatch, preempted in the middle of training by
`scancel --signal=TERM` and by `scontrol requeue`: every worker saves its training state, the next
run resumes from exactly those states and completes, and the output root verifies clean.

The module starts munged, slurmctld and two slurmd (nodes n1 and n2, both this machine, on ports
of their own) with the key, sockets, configuration, state and logs in a temporary folder, and at
the end stops them and whatever their jobs left behind, also when a test fails. It skips when the
daemons are not installed (.ci/run installs them where it can) or when not run as root.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, free_port, saved_states, toy_environment, toy_settings

COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue")
MISSING = [name for name in COMMANDS if shutil.which(name) is None]
pytestmark = [
    pytest.mark.launch,
    pytest.mark.skipif(
        bool(MISSING),
        reason=f"Slurm or MUNGE is not installed (no {', '.join(MISSING)} on PATH; "
        "Debian: apt-get install slurm-wlm munge)",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="the one-machine Slurm runs its daemons and jobs as root"),
]
SCRIPT = REPO / "examples" / "slurm.sbatch"
OUTER = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")  # an enclosing Slurm job's variables would steer ours
ENDED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}
STARTUP = 60  # seconds the daemons get to come up, and to stop
JOB = 300  # seconds a job gets to reach what a test waits for
NODES = ("n1", "n2")

CONFIGURATION = """\
ClusterName=nnpdtest
SlurmctldHost=localhost
SlurmctldPort={controller_port}
SlurmdPort={node_ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job may start again only once its credentials expired: 5 s here, not 120.
AuthInfo=socket={folder}/run/munge.socket,cred_expire=5
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/run/slurmctld.pid
SlurmdPidFile={folder}/run/slurmd-%n.pid
SlurmctldLogFile={folder}/log/slurmctld.log
SlurmdLogFile={folder}/log/slurmd-%n.log
# No cgroups: processes are tracked through their parents, and tasks are not bound to CPUs.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
# A requeued job becomes eligible on its own; the scheduler looks for it every second, not every minute.
# A submitted batch job is scheduled at once, not up to 3 s later (batch_sched_delay, for high submit rates).
SchedulerParameters=sched_interval=1,batch_sched_delay=0
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
# The nodes are as the configuration says, whatever this machine has; finished jobs stay visible to scontrol.
SlurmdParameters=config_overrides
MinJobAge=3600
# Between SIGTERM and SIGKILL, the time a preempted job gets to save: Slurm's default.
KillWait=30
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={node_ports[0]} CPUs=2 RealMemory=1000
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={node_ports[1]} CPUs=2 RealMemory=1000
PartitionName=test Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


def wait_until(condition, what, seconds, explain=lambda: ""):
    """condition()'s first true value, polled; past `seconds`, the test fails with explain()'s text."""
    deadline = time.monotonic() + seconds
    while not (found := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}\n{explain()}")
        time.sleep(0.1)
    return found


def outer_free(environment):
    """An environment without the variables of an enclosing Slurm job."""
    return {name: value for name, value in environment.items() if not name.startswith(OUTER)}


class Cluster:
    """munged, slurmctld and two slurmd on this machine, with all they write under `folder`."""

    def __init__(self, folder):
        self.folder = folder
        self.conf = folder / "slurm.conf"
        self.daemons = []

    def environment(self, extra=None):
        """The environment of Slurm's commands and daemons here: this cluster's configuration."""
        return {**outer_free(os.environ), "SLURM_CONF": str(self.conf), **outer_free(extra or {})}

    def command(self, *arguments, check=True):
        """Run one of Slurm's commands on this cluster; returns its output."""
        done = subprocess.run(arguments, env=self.environment(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 or not check, f"{' '.join(arguments)}: {done.stderr.strip()}"
        return done.stdout

    def job(self, job_id):
        """scontrol's record of a job: {field: value}; {} while slurmctld does not answer."""
        record = self.command("scontrol", "show", "job", "-o", str(job_id), check=False)
        return dict(re.findall(r"(\w+)=(\S*)", record))

    def logs(self):
        """The last lines of every daemon's log, to explain a failure."""
        return "\n".join(
            f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:])
            for path in sorted((self.folder / "log").glob("*"))
        )

    def daemon(self, *arguments):
        """Start a daemon in the foreground of a session of its own, its output in log/."""
        with open(self.folder / "log" / f"{arguments[0]}{len(self.daemons)}.out", "w") as log:
            self.daemons.append(
                subprocess.Popen(
                    arguments, env=self.environment(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )

    def start(self):
        """Write the key and configuration, start the daemons, and wait until both nodes are idle."""
        for name in ("key", "run", "state", "spool", "log"):
            (self.folder / name).mkdir(mode=0o700)
        key = self.folder / "key" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        # --force: pytest's temporary folders are private, and munged wants a socket others can reach.
        run = self.folder / "run"
        self.daemon(
            "munged",
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={run}/munge.socket",
            f"--pid-file={run}/munged.pid",
            f"--seed-file={run}/munged.seed",
            f"--log-file={self.folder}/log/munged.log",
        )
        wait_until(lambda: (run / "munge.socket").exists(), "munged's socket", STARTUP, self.logs)
        self.conf.write_text(
            CONFIGURATION.format(folder=self.folder, controller_port=free_port(), node_ports=[free_port(), free_port()])
        )
        self.daemon("slurmctld", "-D", "-f", str(self.conf))
        wait_until(lambda: "is UP" in self.command("scontrol", "ping", check=False), "slurmctld", STARTUP, self.logs)
        for node in NODES:
            self.daemon("slurmd", "-D", "-f", str(self.conf), "-N", node)
        wait_until(self.idle, "both nodes to be idle", STARTUP, self.logs)

    def idle(self):
        """Whether both nodes registered and are idle."""
        states = self.command("scontrol", "show", "node", "-o", check=False)
        return len(re.findall(r"State=IDLE\b", states)) == len(NODES)

    def stop(self):
        """Cancel every job, stop the daemons, and kill whatever the jobs left running."""
        try:
            if len(self.daemons) == 1 + 1 + len(NODES):  # only a complete cluster runs jobs
                self.cancel_jobs()
        finally:
            for process in reversed(self.daemons):
                stop_process(process)
            for pid in leftovers(self.folder):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def cancel_jobs(self):
        """Cancel every job and wait until none is left (Slurm gives each KillWait to end)."""
        jobs = self.command("squeue", "-h", "-o", "%i", check=False).split()
        if jobs:
            self.command("scancel", *jobs, check=False)
            wait_until(lambda: not self.command("squeue", "-h", check=False).strip(), "the jobs to end", STARTUP)


def stop_process(process):
    """SIGTERM a daemon we started, and SIGKILL it if it does not end in time."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=STARTUP / 2)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def leftovers(folder):
    """Processes of this cluster still running: those whose environment, command line or open files name it."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            mentions = (entry / "environ").read_bytes() + (entry / "cmdline").read_bytes()
            mentions += " ".join(os.readlink(fd) for fd in (entry / "fd").iterdir()).encode()
        except OSError:  # it ended meanwhile, or is not ours to read
            continue
        if f"{folder}{os.sep}".encode() in mentions:
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A running one-machine Slurm with nodes n1 and n2; stopped at the end, whatever happened."""
    running = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        running.start()
        yield running
    finally:
        running.stop()


# ---------------------------------------------------------------- one job of the Slurm script


class Study:
    """The toy study submitted with the script from `folder`, on `nodes` nodes of `workers` CPU workers each."""

    def __init__(self, cluster, folder, nodes, workers):
        self.cluster, self.folder, self.nodes, self.workers = cluster, folder, nodes, workers
        # Three models that train for seconds: every worker is still inside its first model when all
        # have saved a state (at their first epoch's end), and the resumed job trains the rest.
        self.settings = toy_settings(folder, train=20000, epochs=4)
        self.root = folder / "out"
        self.port = free_port()

    def submit(self):
        """sbatch the script as docs/clusters.md says for CPU nodes; returns the job id."""
        variables = {
            "NNPD_DIR": str(REPO),
            "PYTHON": sys.executable,
            "NNPD_WORKERS_PER_NODE": str(self.workers),
            "NNPD_RDZV_PORT": str(self.port),
        }
        done = subprocess.run(
            [
                "sbatch",
                "--parsable",
                f"--nodes={self.nodes}",
                f"--output={self.folder}/job-%j.out",
                str(SCRIPT),
                "train",
                "--settings-dir",
                str(self.settings),
            ],
            env=self.cluster.environment({**toy_environment(), **variables}),
            cwd=self.folder,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return int(done.stdout.split(";")[0])

    def output(self, job_id):
        """What the job wrote so far (every run of it: the output file is appended to)."""
        path = self.folder / f"job-{job_id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def explain(self, job_id):
        """A job's record, output and the daemons' logs."""
        return f"{self.cluster.job(job_id)}\n--- job output\n{self.output(job_id)}\n{self.cluster.logs()}"

    def wait_for_training(self, job_id):
        """Wait until every worker saved a training state (so each is training); fails if the job ends first."""

        def training():
            assert self.cluster.job(job_id).get("JobState") not in ENDED, self.explain(job_id)
            return len(saved_states(self.root)) == self.nodes * self.workers

        wait_until(training, "every worker's saved training state", JOB, lambda: self.explain(job_id))

    def wait_for_end(self, job_id, restarts=0):
        """The job's record once it ended after `restarts` requeueings."""

        def ended():
            record = self.cluster.job(job_id)
            return record if record.get("JobState") in ENDED and record.get("Restarts") == str(restarts) else None

        return wait_until(ended, f"job {job_id} to end", JOB, lambda: self.explain(job_id))

    def header(self):
        """The script's first line of each run."""
        return f"nnpd: {self.nodes} nodes x {self.workers} workers, rendezvous 127.0.0.1:{self.port}: train"


def stop_points(preempted, study):
    """Sorted (epoch, batch) where each worker stopped and saved, from the preempted run's output."""
    assert "Traceback" not in preempted, preempted
    # Each node's torchrun ended with the launcher's one line, after its workers stopped.
    assert preempted.count("nnpd: torchrun stopped by SIGTERM after its workers stopped") == study.nodes, preempted
    points = re.findall(r"training stopped on request in epoch (\d+) after batch (\d+); its state was saved", preempted)
    assert len(points) == study.nodes * study.workers, preempted  # every worker saved
    return sorted(points)


def assert_resumed_and_complete(rerun, points, study):
    """The rerun resumed every saved state, trained everything and left a clean output root."""
    resumed = re.findall(r"resumed (runs/\S+): epoch (\d+), after batch (\d+)", rerun)
    assert len({run for run, _, _ in resumed}) == len(resumed) == len(points), rerun
    assert sorted((epoch, batch) for _, epoch, batch in resumed) == points, rerun  # where each worker stopped
    assert "train done" in rerun and "Traceback" not in rerun, rerun
    assert len(list((study.root / "cache" / "model").glob("*/artifact.json"))) == 3
    assert not saved_states(study.root)
    verify = subprocess.run(
        [sys.executable, str(REPO / "nnpd.py"), "verify", "--settings-dir", str(study.settings)],
        env=toy_environment(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=JOB,
    )
    assert verify.returncode == 0 and json.loads(verify.stdout)["damaged"] == [], verify.stdout + verify.stderr


def test_scancel_signal_term_on_one_node_then_resubmitting_resumes(cluster, tmp_path):
    study = Study(cluster, tmp_path, nodes=1, workers=2)
    job = study.submit()
    study.wait_for_training(job)
    cluster.command("scancel", "--signal=TERM", str(job))  # every process of the step, not the batch shell
    preempted = study.wait_for_end(job)
    assert (preempted["JobState"], preempted["ExitCode"]) == ("FAILED", "143:0"), study.explain(job)
    points = stop_points(study.output(job), study)
    again = study.submit()  # the same command
    done = study.wait_for_end(again)
    assert (done["JobState"], done["ExitCode"]) == ("COMPLETED", "0:0"), study.explain(again)
    assert_resumed_and_complete(study.output(again), points, study)


def test_scontrol_requeue_on_two_nodes_resumes_in_the_requeued_job(cluster, tmp_path):
    study = Study(cluster, tmp_path, nodes=2, workers=1)
    job = study.submit()
    study.wait_for_training(job)
    cluster.command("scontrol", "requeue", str(job))  # SIGTERM to every process, SIGKILL after KillWait
    done = study.wait_for_end(job, restarts=1)
    assert (done["JobState"], done["ExitCode"]) == ("COMPLETED", "0:0"), study.explain(job)
    runs = study.output(job).split(study.header())
    assert len(runs) == 3, study.explain(job)  # the preempted run and the requeued one
    assert_resumed_and_complete(runs[2], stop_points(runs[1], study), study)
