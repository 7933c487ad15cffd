"""Stress the exit of Gloo DDP workers on a loaded machine and count the ranks that abort.

An abort is a launch whose output says "terminate called" or reports a rank killed by
SIGABRT (exit -6). Each run is one of:

  worker   one torchrun launch of tests/ddp_train_worker.py (train mode), alternating
           2 and 3 ranks and NNPD_PROBES python/off (the timed all-reduce and DDP's own)
  pytest   one pytest process running TESTS (or the node ids given with --tests)

Busy loops (`--load`, default 2: one per core of a 2-core machine) keep every core taken
while the runs go; `--parallel` runs several at once, as two test suites side by side.
The output of every aborted or failed run is kept under --logs; with --cores (worker runs
only) an aborting rank leaves a core file there: `gdb python CORE`, then `thread apply
all bt`, shows the thread that aborted.

Run: python bench/stress_ddp_exit.py [--runs 30] [--kind worker|pytest] [--load 2] [--parallel 1]
It is not part of `make test` or `make bench`: 30 pytest runs take about an hour on 2 cores.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = [
    "tests/test_timings.py::test_the_timed_allreduce_trains_bitwise_like_ddps_own",
    "tests/test_ddp.py::test_two_gloo_ranks_reproduce_single_process_training",
    "tests/test_ddp.py::test_a_rank_failing_mid_training_ends_the_launch_quickly",
]
ABORT = re.compile(r"terminate called|exitcode\s*:\s*-6|Signal 6 \(SIGABRT\)|SIGABRT")
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def environment(probes: str | None = None) -> dict:
    """The environment of a run: one thread per rank, no inherited launch variables."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1"}
    for name in LAUNCH_VARIABLES:
        env.pop(name, None)
    if probes is not None:
        env["NNPD_PROBES"] = probes
    return env


def worker_command(index: int, scratch: Path) -> tuple[list, dict]:
    """Run `index`'s torchrun launch of the DDP test worker, and its environment."""
    ranks, probes = (3, 2)[index % 2], ("python", "off")[index // 2 % 2]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        str(REPO / "tests" / "ddp_train_worker.py"),
        str(scratch / "result.pt"),
        "train",
        "41",
        "40",
        "2",
        "cpu",
    ]
    return command, environment(probes)


def pytest_command(scratch: Path, tests: list) -> tuple[list, dict]:
    """A pytest process over `tests` (node ids relative to the repository), and its environment."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--basetemp={scratch / 'tmp'}",
        *(str(REPO / test) for test in tests),
    ]
    return command, environment()


def one_run(index: int, args) -> dict:
    """Run once in a scratch folder; the outcome, with the output kept when it aborted or failed."""
    with tempfile.TemporaryDirectory(prefix="stress-ddp-") as scratch:
        if args.kind == "worker":
            command, env = worker_command(index, Path(scratch))
        else:
            command, env = pytest_command(Path(scratch), args.tests)
        # The tests' launches run in the repository, so only worker runs may write core files.
        limits = "ulimit -c unlimited; " if args.cores and args.kind == "worker" else ""
        began = time.monotonic()
        done = subprocess.run(
            ["bash", "-c", limits + 'exec "$@"', "run", *command],
            env=env,
            cwd=scratch if args.kind == "worker" else REPO,
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        seconds = time.monotonic() - began
        output = done.stdout + done.stderr
        outcome = {"index": index, "rc": done.returncode, "seconds": seconds, "aborted": bool(ABORT.search(output))}
        if outcome["aborted"] or done.returncode != 0:
            keep(args.logs / f"run-{index:03d}", output, Path(scratch))
    return outcome


def keep(folder: Path, output: str, scratch: Path) -> None:
    """Save a run's output and any core file it left."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "output.txt").write_text(output)
    for core in scratch.rglob("core*"):
        if core.is_file():
            core.rename(folder / f"{core.parent.name}-{core.name}")


def busy_loops(count: int) -> list:
    """Start `count` processes that spin on a core each until stopped."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def stop_all(processes: list) -> None:
    """Stop the busy loops this script started."""
    for process in processes:
        process.kill()
        process.wait()


def main() -> None:
    """Run the loop under load and print one line per run, then the totals."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--kind", choices=("worker", "pytest"), default="pytest")
    parser.add_argument("--load", type=int, default=2, help="busy-loop processes alongside")
    parser.add_argument("--parallel", type=int, default=1, help="runs at the same time")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--cores", action="store_true", help="let aborting ranks write core files")
    parser.add_argument("--tests", nargs="+", default=TESTS, help="pytest node ids of pytest runs")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "stress_ddp_exit")
    args = parser.parse_args()
    loops, began, outcomes = busy_loops(args.load), time.monotonic(), []
    try:
        with ThreadPoolExecutor(args.parallel) as pool:
            for outcome in pool.map(lambda index: one_run(index, args), range(args.runs)):
                outcomes.append(outcome)
                print(
                    f"run {outcome['index']:3d}: rc {outcome['rc']:4d}  {outcome['seconds']:6.1f} s"
                    f"{'  ABORT' if outcome['aborted'] else ''}",
                    flush=True,
                )
    finally:
        stop_all(loops)
    aborted = sum(outcome["aborted"] for outcome in outcomes)
    failed = sum(outcome["rc"] != 0 for outcome in outcomes)
    print(
        f"{args.kind}: {len(outcomes)} runs, {aborted} aborted, {failed} failed, load {args.load} busy loops, "
        f"{args.parallel} at a time, {time.monotonic() - began:.0f} s; logs in {args.logs}"
    )
    sys.exit(1 if aborted or failed else 0)


if __name__ == "__main__":
    main()
