"""Cost of the timing probes, measured side by side in one run.

First half: nanoseconds per `with probes.phase(name): pass` (one enter/exit pair) for the
C extension and for the pure-Python fallback, in alternating rounds; the best round of
each counts. Target: the C pair at most half the Python one. For context it also prints
what the pair's two thread-CPU-clock reads cost alone (a system call each), and the
no-op probes of NNPD_PROBES=off.

Second half (skipped with --pairs-only): the wall time of whole `python nnpd.py train`
processes training one default-size model, with probes on against NNPD_PROBES=off,
alternated. Target: at most 2% more with probes on. The difference of walls is within
this machine's noise, so it also prints the spans the launch closed times the cost of a
pair measured above: the probes' own cost.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import probes  # noqa: E402

PAIR = "with phase('train.forward'): pass"


def best_ns_per_call(statement, namespace, number, rounds):
    """Best-of-rounds nanoseconds per execution of a statement."""
    timer = timeit.Timer(statement, globals=namespace)
    return min(timer.timeit(number) for _ in range(rounds)) / number * 1e9


def pair_costs(number, rounds):
    """{implementation: ns per enter/exit pair}, the implementations timed in alternation."""
    makers = {"python": probes.PythonProbes, "off": probes.OffProbes}
    if probes.probes_mode({}) == "native":  # built, whatever NNPD_PROBES says
        import _probes

        makers = {"C": _probes.Probes, **makers}
    phases = {
        name: (make(decorate=probes.decorate) if name != "off" else make()).phase for name, make in makers.items()
    }
    clock = {"clock": time.thread_time_ns}
    best = {name: float("inf") for name in [*phases, "clock"]}
    for _ in range(rounds):
        for name, phase in phases.items():
            best[name] = min(best[name], best_ns_per_call(PAIR, {"phase": phase}, number, 1))
        best["clock"] = min(best["clock"], best_ns_per_call("clock(); clock()", clock, number, 1))
    return best


def report_pair_costs(number, rounds):
    """Print the per-pair costs and the C/Python ratio against its target; returns the costs."""
    best = pair_costs(number, rounds)
    print(f"enter/exit pair, best of {rounds} alternating rounds of {number:,}:")
    for name in best:
        label = {
            "clock": "two thread-CPU-clock reads alone (time.thread_time_ns)",
            "off": "NNPD_PROBES=off (no-op)",
        }.get(name, name)
        print(f"  {label:55s} {best[name]:7.0f} ns")
    if "C" not in best:
        print("C extension _probes not built (run `make setup` with a C compiler): no C/Python ratio")
        return best
    ratio = best["C"] / best["python"]
    print(f"C / Python: {ratio:.2f} (target <= 0.5) {'OK' if ratio <= 0.5 else 'ABOVE TARGET'}")
    print(
        f"without the two CPU-clock reads: C {best['C'] - best['clock']:.0f} ns, "
        f"Python {best['python'] - best['clock']:.0f} ns"
    )
    return best


def one_model_settings(directory, output_root):
    """A settings directory for the default profile cut to one model (dimension 1, uniform)."""
    directory.mkdir(parents=True)
    shutil.copy(REPO / "settings_analysis.py", directory)
    source = (REPO / "settings_training.py").read_text()
    source += (
        "\n\n_repository_make_settings = make_settings\n\n\n"
        "def make_settings(profile):\n"
        "    settings = _repository_make_settings(profile)\n"
        "    settings['problem']['dimension'] = 1\n"
        "    settings['cohort']['priors'] = ['uniform']\n"
        f"    settings['output']['root'] = {str(output_root)!r}\n"
        "    return settings\n"
    )
    (directory / "settings_training.py").write_text(source)
    return directory


def timed_train(work, label, probes_mode):
    """Seconds of one whole `nnpd.py train --profile default` process into a fresh output root, and its root."""
    root = work / f"out-{label}"
    settings = one_model_settings(work / f"settings-{label}", root)
    environment = {**os.environ, "NNPD_PROBES": probes_mode}
    began = time.perf_counter()
    subprocess.run(
        [sys.executable, str(REPO / "nnpd.py"), "train", "--profile", "default", "--settings-dir", str(settings)],
        cwd=work,
        env=environment,
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - began, root


def spans_of(root):
    """How many spans the launch's probes closed (nested ones included), from its timings.json."""
    record = json.loads((root / "timings.json").read_text())
    return sum(
        phase["count"] + phase["nested"] for worker in record["workers"].values() for phase in worker["phases"].values()
    )


def train_wall_with_probes_on_and_off(repeats, pair_ns):
    """Print the wall of a one-model default-size train with probes on against NNPD_PROBES=off."""
    on_mode = probes.probes_mode({})  # native when built, else python
    times, spans = {on_mode: [], "off": []}, 0
    with tempfile.TemporaryDirectory() as work:
        timed_train(Path(work), "warm-up", "off")  # untimed: the first process pays for cold caches
        for round_number in range(repeats):
            for mode in times:
                wall, root = timed_train(Path(work), f"{mode}-{round_number}", mode)
                times[mode].append(wall)
                spans = spans_of(root) if mode != "off" else spans
    print(f"one-model default-size train, whole process, {repeats} alternating rounds:")
    for mode, label in ((on_mode, f"probes on ({on_mode})"), ("off", "NNPD_PROBES=off")):
        print(
            f"  {label:20s} best {min(times[mode]):.2f} s  median {statistics.median(times[mode]):.2f} s  "
            f"{[round(t, 2) for t in times[mode]]}"
        )
    on, off = statistics.median(times[on_mode]), statistics.median(times["off"])
    print(
        f"  on / off: best {min(times[on_mode]) / min(times['off']):.3f}  median {on / off:.3f} "
        f"(target <= 1.02) {'OK' if on / off <= 1.02 else 'ABOVE TARGET (or noise: rerun)'}"
    )
    if pair_ns is not None:
        cost = spans * pair_ns / 1e9
        print(
            f"  {spans:,} spans x {pair_ns:.0f} ns per pair = {cost:.3f} s, {cost / off:.2%} of the off wall "
            "(the probes' own cost, less noisy than the difference of walls)"
        )


def main():
    """Run the first half, and the second with --train."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--number", type=int, default=50_000, help="pairs per round")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds per implementation")
    parser.add_argument("--pairs-only", action="store_true", help="skip the whole train processes")
    parser.add_argument("--train-repeats", type=int, default=3)
    args = parser.parse_args()
    best = report_pair_costs(args.number, args.rounds)
    if not args.pairs_only:
        on_mode = probes.probes_mode({})
        train_wall_with_probes_on_and_off(args.train_repeats, best.get("C" if on_mode == "native" else on_mode))


if __name__ == "__main__":
    main()
