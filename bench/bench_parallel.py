"""Multi-worker launches on CPU: jobs-mode speedup, load balance, and DDP against one process.

Every measured launch is a real `nnpd.py` process (under `torch.distributed.run` for
more than one worker) writing into a fresh output root, so nothing is cached between
measurements. Compared launches run side by side in one run, alternating their order
on repeats. Parts:

  a  jobs mode, 2 workers vs 1 worker, 4 priors        target: speedup >= 1.6 on 2 cores
  b  16 jobs of unequal cost (dimension 1-4 x 4 priors), claiming vs round-robin
  c  ddp with 2 Gloo ranks vs 1 process, train and analyze timed as separate launches

Run: python bench/bench_parallel.py [--parts abc] [--repeats 1] [--train-rows 20000] ...
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def patched_source(name, patch):
    """The repository's settings file with make_settings wrapped by `patch`."""
    source = (REPO / name).read_text()
    source += "\n\nfrom settings import Choice  # noqa: E402,F811\n"
    source += "_repository_make_settings = make_settings\n\n\ndef make_settings(profile):\n"
    source += "    settings = _repository_make_settings(profile)\n"
    source += textwrap.indent(patch, "    ") + "    return settings\n"
    return source


def code(text):
    """An indented triple-quoted block of settings code as plain, unindented lines."""
    return textwrap.dedent(text).strip("\n") + "\n"


def write_settings(directory, training, analysis):
    """Write both patched settings files into `directory`; output goes to directory/out."""
    training += f'\nsettings["output"]["root"] = {str(directory / "out")!r}\n'
    training += 'settings["runtime"].update(device="cpu", cpu_threads=1)\n'
    (directory / "settings_training.py").write_text(patched_source("settings_training.py", training))
    (directory / "settings_analysis.py").write_text(patched_source("settings_analysis.py", analysis))


def command(workers, stage, settings_dir):
    """The command line of one launch: plain python for one worker, torch.distributed.run else."""
    tail = ["nnpd.py", stage, "--settings-dir", str(settings_dir)]
    if workers == 1:
        return [sys.executable, *tail]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workers}", *tail]


def timed_launch(workers, stage, settings_dir, extra_env=None, timeout=1800):
    """Seconds one launch takes; a failed launch stops the benchmark with its output."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES + ("NNPD_ASSIGNMENT",)}
    env.update(OMP_NUM_THREADS="1", **(extra_env or {}))
    started = time.perf_counter()
    done = subprocess.run(
        command(workers, stage, settings_dir), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(
            f"launch failed ({workers} worker(s), {stage}, rc {done.returncode}):\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return elapsed


def fresh_launch(training, analysis, workers, stages=("run",), extra_env=None):
    """Write settings into a new temporary directory and time each stage in turn."""
    work = Path(tempfile.mkdtemp(prefix="nnpd-bench-"))
    try:
        write_settings(work, training, analysis)
        return [timed_launch(workers, stage, work, extra_env) for stage in stages]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def side_by_side(variants, repeats):
    """Run each (name, thunk) `repeats` times, alternating order; returns name -> list of results."""
    results = {name: [] for name, _ in variants}
    for repeat in range(repeats):
        order = variants if repeat % 2 == 0 else variants[::-1]
        for name, thunk in order:
            results[name].append(thunk())
            print(f"    {name}: {fmt(results[name][-1])}", flush=True)
    return results


def fmt(value):
    """Seconds, or a list of seconds, as short text."""
    if isinstance(value, list):
        return " + ".join(f"{v:.1f}" for v in value) + f" = {sum(value):.1f} s"
    return f"{value:.1f} s"


def best(values):
    """The smallest total of a list of timings (the least disturbed by other load)."""
    return min(sum(v) if isinstance(v, list) else v for v in values)


def training_patch(arguments, priors=None):
    """Training settings of parts a and c: the smoke study with a real amount of work."""
    hidden = [int(h) for h in arguments.hidden.split(",")]
    patch = code(f"""
        settings["data"] = {{"train": {arguments.train_rows}, "validation": {arguments.train_rows // 4},
                            "test": {arguments.train_rows // 4}}}
        settings["model"]["hidden"] = {hidden!r}
        settings["training"]["epochs"] = {arguments.epochs}
    """)
    if priors:
        patch += f'settings["cohort"]["priors"] = settings["cohort"]["priors"][:{priors}]\n'
    return patch


def analysis_patch(arguments):
    """Analysis settings of parts a and c: grid truths and Sobol candidates."""
    return code(f"""
        settings["inference"]["truths"]["truth_points_per_axis"] = {arguments.grid_truths}
        settings["inference"]["candidates"]["candidate_count"] = {arguments.candidates}
    """)


def part_a(arguments):
    """Jobs mode: 2 workers against 1 worker on the 4-prior study."""
    print(
        f"(a) jobs mode, 4 priors, {arguments.train_rows} rows x {arguments.epochs} epochs, hidden "
        f"[{arguments.hidden}], {arguments.candidates} candidates, {arguments.grid_truths} truths",
        flush=True,
    )
    training, analysis = training_patch(arguments), analysis_patch(arguments)
    results = side_by_side(
        [
            ("1 worker ", lambda: fresh_launch(training, analysis, 1)[0]),
            ("2 workers", lambda: fresh_launch(training, analysis, 2)[0]),
        ],
        arguments.repeats,
    )
    one, two = best(results["1 worker "]), best(results["2 workers"])
    print(f"  (a) 1 worker {one:.1f} s, 2 workers {two:.1f} s, speedup {one / two:.2f}x (target >= 1.6)")


def part_b(arguments):
    """Load balance: claiming against round-robin on 16 jobs of unequal cost."""
    print(
        f"(b) load balance, dimension Choice([1, 2, 3, 4]) x {arguments.balance_priors} priors, sobol truths "
        f"{arguments.sobol_truths}*2^(p-1), {arguments.balance_candidates} candidates, grid prior "
        f"enumerated up to {arguments.max_enumerated} points",
        flush=True,
    )
    training = code(f"""
        settings["problem"]["dimension"] = Choice([1, 2, 3, 4])
        settings["cohort"]["priors"] = settings["cohort"]["priors"][:{arguments.balance_priors}]
        settings["data"] = {{"train": {arguments.balance_rows}, "validation": {arguments.balance_rows // 4},
                            "test": {arguments.balance_rows // 4}}}
    """)
    analysis = code(f"""
        settings["inference"]["truths"]["kind"] = "sobol"
        settings["inference"]["truths"]["sobol_truths"] = {arguments.sobol_truths}
        settings["inference"]["candidates"]["candidate_count"] = {arguments.balance_candidates}
        settings["inference"]["candidates"]["max_enumerated"] = {arguments.max_enumerated}
    """)
    results = side_by_side(
        [
            ("claiming   ", lambda: fresh_launch(training, analysis, 2)[0]),
            (
                "round-robin",
                lambda: fresh_launch(training, analysis, 2, extra_env={"NNPD_ASSIGNMENT": "round-robin"})[0],
            ),
        ],
        arguments.repeats,
    )
    claiming, robin = best(results["claiming   "]), best(results["round-robin"])
    print(f"  (b) claiming {claiming:.1f} s, round-robin {robin:.1f} s, round-robin / claiming {robin / claiming:.2f}")


def part_c(arguments):
    """DDP with 2 Gloo ranks against one process; train and analyze launched separately."""
    print(f"(c) ddp, {arguments.ddp_priors} priors, otherwise as (a); train and analyze timed apart", flush=True)
    training = training_patch(arguments, arguments.ddp_priors)
    analysis = analysis_patch(arguments)
    ddp = training + 'settings["runtime"]["parallel"] = "ddp"\n'
    results = side_by_side(
        [
            ("1 process   ", lambda: fresh_launch(training, analysis, 1, ("train", "analyze"))),
            ("2 ddp ranks ", lambda: fresh_launch(ddp, analysis, 2, ("train", "analyze"))),
        ],
        arguments.repeats,
    )
    one = min(results["1 process   "], key=sum)
    two = min(results["2 ddp ranks "], key=sum)
    print(
        f"  (c) 1 process: train {one[0]:.1f} s + analyze {one[1]:.1f} s = {sum(one):.1f} s; "
        f"2 ddp ranks: train {two[0]:.1f} s + analyze {two[1]:.1f} s = {sum(two):.1f} s"
    )
    print(
        f"  (c) speedup ddp vs 1 process: total {sum(one) / sum(two):.2f}x, train {one[0] / two[0]:.2f}x, "
        f"analyze {one[1] / two[1]:.2f}x"
    )


def main():
    """Parse the sizes and run the selected parts."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # defaults: about 15 s of work per model in a and c, so that the 5-10 s of starting
    # torch.distributed.run and importing torch in each worker does not hide the speedup
    parser.add_argument("--parts", default="abc", help="which parts to run, e.g. 'ac'")
    parser.add_argument("--repeats", type=int, default=1, help="launches per variant, alternating order")
    parser.add_argument("--train-rows", type=int, default=100_000)
    parser.add_argument("--hidden", default="64,64,64,64")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--candidates", type=int, default=16_384)
    parser.add_argument("--grid-truths", type=int, default=48)
    parser.add_argument("--ddp-priors", type=int, default=2)
    parser.add_argument("--balance-rows", type=int, default=4096, help="training rows in part b")
    parser.add_argument("--sobol-truths", type=int, default=64)
    parser.add_argument("--balance-candidates", type=int, default=2048)
    parser.add_argument("--balance-priors", type=int, default=4, help="cohort size in part b (4: 16 jobs)")
    # the default 200,000 would enumerate the grid prior's 51^3 lattice at dimension 3: one job
    # 100x the others; 10,000 enumerates it up to dimension 2 and samples it above
    parser.add_argument("--max-enumerated", type=int, default=10_000, help="grid-prior enumeration limit in b")
    arguments = parser.parse_args()
    print(f"cpu cores: {os.cpu_count()}, OMP_NUM_THREADS=1, runtime.cpu_threads=1, device cpu", flush=True)
    for part in arguments.parts:
        {"a": part_a, "b": part_b, "c": part_c}[part](arguments)


if __name__ == "__main__":
    main()
