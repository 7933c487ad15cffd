"""Rounds against the amortized default and sbi's sequential methods, at the same simulation budget.

Four problems with exact posteriors: the posterior-quality bench's ring (2 parameters, two
thin arcs), slcp (5, four modes) and linear (10, a correlated Gaussian posterior) of
bench/posterior_problems.py, their kit priors, truths and exact reference draws as that
bench makes them; and `narrow`, this bench's own (not posterior_problems.Narrow): three
parameters θ uniform on [0, 1]^3, x = θ + noise with sd NARROW_SD (0.005: the posterior's
sd is 0.5% of the box's width), whose exact posterior is N(x_o, sd²) cut to the box.
Two tasks the default schedule was not tuned on are run only when named: `--problems mixture`
(posterior_problems.Mixture, sbibm's gaussian_mixture: a broad and a narrow Gaussian about
x_o) and `--problems narrow10` (posterior_problems.Narrow, the posterior-quality bench's
narrow: 10 parameters, a correlated prior object of the study's own, posterior sds 2.5-5% of
the box).

For each problem and observation (drawn at prior truths), each method spends the same
total of `--simulations` simulator calls:

  amortized   nnpd: one training on the whole prior (trained once per problem, it answers
              every observation), the kit's recipe (no `model` or `training` section);
  rounds      nnpd: `rounds.count` (`--rounds`) rounds for x_o, each of simulations / count
              new ones, each also training on the earlier rounds' inside its box unless
              `--no-reuse`, half its train and validation draws from the previous round's
              posterior unless `--proposal prior` (docs/rounds.md);
  SNRE_C,     sbi 0.27's sequential methods (`--sbi SNRE_C SNPE_C`), sbibm's protocol:
  SNPE_C      `--sbi-rounds` rounds (10 as sbibm) of simulations / rounds each, round 1 from
              the prior, each later one from the previous round's posterior for x_o; sbi's
              defaults otherwise (bench/sbi_runner.py, its sequential mode).

Each posterior draws `--samples` samples for x_o (nnpd's `restore(run).posterior(x_o)`
with the default design, sbi's default `build_posterior()` sampler), scored by C2ST
(c2st.py, BENCH_C2ST_EPOCHS epochs) against as many exact draws: 0.5 is perfect. An nnpd
posterior that refuses to sample scores 1.0. CPU seconds, one thread: nnpd's training is
its `train` command (all rounds, with their boxes); sbi's runs from constructing the
method to its last `build_posterior()` (all rounds: simulating, training and drawing each
next proposal); sampling is the final `--samples` draws. Targets, per problem: rounds'
mean C2ST ≤ the amortized's, ≤ the better of SNRE_C and SNPE_C (each on the observations
it finished: an sbi run still going after `--sbi-timeout` wall seconds is stopped and
counts as a failed row, as when SNPE_C's rejection sampling of a proposal that leaks out of
the prior stalls), and on narrow ≤ the amortized's − NARROW_MARGIN. Prints markdown
tables (per problem with PASS/FAIL, per observation, CPU seconds) and with `--json`
writes the results after every observation, so a stopped run keeps what it finished
(`--table FILE ...` prints saved runs' tables).

sbi lives only in bench/.venv-sbi (`make bench-sbi`, or made on first use with `--sbi`):
nnpd's environment never imports sbi. The runner imports the study's module (a copy of
posterior_problems.py, or the narrow module written into the work folder) with the
repository root on its path, and simulates there. sbi's results depend only on the seed,
the sizes and the observation: with `--keep DIR` a run leaves its work folder, and
`--reuse-sbi DIR` takes sbi's samples and timings from such a folder where its job is
the same, scoring them anew (a folder that reused them can serve again). A long bench can
be run in pieces: `--start K` runs only observations K on and `--stop L` those before L
(the others are still drawn, so each observation is the same as in one run with the same
`--observations`: the truths are drawn together, so observation i of a run of 10 is not
observation i of a run of 2), and `--table A.json B.json` merges the pieces' observations
into one table.

    python bench/bench_rounds.py --problems narrow --observations 2 --simulations 6000   # nnpd only, minutes
    python bench/bench_rounds.py --sbi SNRE_C SNPE_C --simulations 2000 --observations 1 --samples 2000
    nice -n 5 python bench/bench_rounds.py --sbi SNRE_C SNPE_C --json out/rounds.json --keep out/rounds

The defaults (all four problems, 10 observations, 10,000 simulations and draws) are the
full protocol, and slow: on one shared core, one observation of one problem with both
sbi methods took 11 to 13 minutes of wall time (CPU seconds per observation: SNPE_C's ten
rounds 320-420, SNRE_C's 190-260 plus 7-33 to sample, nnpd's rounds 30-90, the four
C2STs of 10,000 draws under a minute), so about 8 hours in all; sbi's share is about 85%.
Without `--sbi` the nnpd-only bench takes 1-2 minutes per observation and problem.
"""

import argparse
import io
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any, Callable, NamedTuple

os.environ.setdefault("OMP_NUM_THREADS", "1")

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere
sys.path.insert(0, str(BENCH))

import numpy as np  # noqa: E402
import posterior_problems  # noqa: E402
import torch  # noqa: E402

import posterior  # noqa: E402
import rounds  # noqa: E402
from c2st import c2st  # noqa: E402
from store import restore  # noqa: E402

NARROW_SD = 0.005
NARROW_MARGIN = 0.1  # the target: on narrow, rounds at least this much below the amortized C2ST
BENCH_C2ST_EPOCHS = 50
TEST_SIMULATIONS = 20  # the kit's data.test per training: held out, trains nothing
PROBLEMS = ("narrow", "linear", "slcp", "ring")
# Run only when named, with the name posterior_problems gives each.
NAMED_ONLY = {"mixture": "mixture", "narrow10": "narrow"}
SBI_METHODS = ("SNRE_C", "SNPE_C")
SBI_PYTHON = BENCH / ".venv-sbi" / "bin" / "python"
NARROW_MODULE = f'''"""The narrow problem of bench_rounds.py: x = θ + noise, θ uniform on [0, 1]^3."""
import math

import torch

import nre_study


class Narrow(nre_study.Study):
    """A posterior whose sd is {NARROW_SD} of a unit box."""

    parameters = {{"a": (0.0, 1.0), "b": (0.0, 1.0), "c": (0.0, 1.0)}}

    def simulate(self, theta, generator):
        return theta + {NARROW_SD} * torch.randn(theta.shape, generator=generator, dtype=torch.float64)

    def log_likelihood(self, x, theta):
        z = (x - theta) / {NARROW_SD}
        return (-0.5 * z * z - math.log({NARROW_SD}) - 0.5 * math.log(2 * math.pi)).sum(-1)
'''


def narrow_reference(x_o, n, generator):
    """n exact draws of the narrow posterior, N(x_o, sd²) cut to [0, 1]^3, by rejection."""
    kept, count = [], 0
    while count < n:
        draws = torch.as_tensor(x_o) + NARROW_SD * torch.randn(2 * n, 3, generator=generator, dtype=torch.float64)
        draws = draws[((draws >= 0) & (draws <= 1)).all(-1)]
        kept.append(draws)
        count += len(draws)
    return torch.cat(kept)[:n]


class Problem(NamedTuple):
    """One problem: its kit study module, priors, truths, exact reference and simulator."""

    module: str  # the study module's name, written into every work folder
    source: str
    spec: str  # the settings' experiment
    priors: dict
    prior: str  # the cohort's prior
    sbi_prior: dict  # the prior as sbi_runner builds it
    parameters: int
    truths: Callable[[int, torch.Generator], torch.Tensor]
    reference: Callable[[Any, int, torch.Generator], torch.Tensor]
    simulate: Callable[[torch.Tensor, torch.Generator], torch.Tensor]


def narrow_study():
    """The narrow study, its module run from NARROW_MODULE's source (the one copy of its simulator)."""
    module = types.ModuleType("narrow_problem")
    exec(compile(NARROW_MODULE, "narrow_problem.py", "exec"), module.__dict__)
    return module.Narrow({})


def problem(name):
    """The named problem: this bench's narrow, or one of posterior_problems' as its bench uses it."""
    if name == "narrow":
        study = narrow_study()
        return Problem(
            "narrow_problem",
            NARROW_MODULE,
            "narrow_problem:Narrow",
            {"prior": {"family": "uniform"}},
            "prior",
            {"kind": "box", "low": [0.0] * 3, "high": [1.0] * 3},
            3,
            lambda n, g: torch.rand(n, 3, generator=g, dtype=torch.float64),
            narrow_reference,
            study.simulate,
        )
    study = posterior_problems.PROBLEMS[NAMED_ONLY.get(name, name)]({})
    priors, prior = posterior_problems.kit_priors(study)
    return Problem(
        "posterior_problems",
        (BENCH / "posterior_problems.py").read_text(),
        f"posterior_problems:{type(study).__name__}",
        priors,
        prior,
        posterior_problems.sbi_prior(study),
        len(study.parameters),
        lambda n, g: posterior_problems.prior_draws(study, n, g),
        study.reference,
        study.simulate,
    )


def write_module(folder, case):
    """The problem's study module in `folder` (the kit checks the module defines the class; its source is keyed)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{case.module}.py").write_text(case.source)


def write_settings(folder, case, data, rounds):
    """The study module and both settings files of one training in `folder`."""
    write_module(folder, case)
    training = {
        "experiment": case.spec,
        "output": {"root": str(folder / "outputs")},
        "seed": 7,
        "cohort": {"priors": [case.prior], "replicas": 1},
        "priors": case.priors,
        "data": data,
        "runtime": {"device": "cpu", "parallel": "jobs", "cpu_threads": 1},
    }
    if rounds:
        training["rounds"] = rounds
    for file, settings in (
        ("settings_training.py", training),
        ("settings_analysis.py", {"analysis": "nre_analysis:NREAnalysis"}),
    ):
        (folder / file).write_text(f'"""Bench settings (written by bench_rounds.py)."""\nSETTINGS = {settings!r}\n')


def split(simulations):
    """data.* for a training of `simulations` simulator calls: 90% train, 10% validation, plus the test split."""
    validation = simulations // 10
    return {"train": simulations - validation - TEST_SIMULATIONS, "validation": validation, "test": TEST_SIMULATIONS}


def single_thread_env():
    """The environment of a child process, held to one thread."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def child(command, folder, timeout=None):
    """Run a child process in `folder`, killed after `timeout` wall seconds; (completed process, CPU seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, env=single_thread_env(), capture_output=True, text=True, cwd=folder, timeout=timeout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return done, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def train(folder):
    """`nnpd train` on the folder's settings, one thread; (restored run, CPU seconds)."""
    done, seconds = child([sys.executable, str(REPO / "nnpd.py"), "train", "--settings-dir", str(folder)], folder)
    if done.returncode:
        raise RuntimeError(f"nnpd train failed:\n{done.stdout[-1500:]}{done.stderr[-1500:]}")
    run = next(path.parent for path in (folder / "outputs" / "runs").glob("*/*/run.json"))
    return restore(run), seconds


def score(samples, reference, seed):
    """C2ST of samples against the exact draws, the bench's one definition for every method."""
    return float(c2st(samples, reference.numpy(), seed=seed, epochs=BENCH_C2ST_EPOCHS))


def nnpd_posterior(restored, x_o, reference, seed):
    """The run's posterior for x_o: C2ST and sampling CPU seconds (C2ST 1.0 when it refuses to sample)."""
    start = time.process_time()
    try:
        samples = restored.posterior(x_o).sample(len(reference), seed=seed).numpy()
    except posterior.PosteriorError as error:  # a refused posterior scores as a disjoint one
        print(f"  refused: {error}", flush=True)
        return {"c2st": 1.0, "sample_cpu_seconds": time.process_time() - start, "refused": str(error)}
    seconds = time.process_time() - start
    return {"c2st": score(samples, reference, seed), "sample_cpu_seconds": seconds}


def nnpd_rounds(case, x_o, reference, i, folder, args):
    """nnpd's rounds for x_o: C2ST, CPU seconds and each round's box share."""
    write_module(folder, case)
    np.save(folder / "x_o.npy", x_o)
    section = {
        "count": args.rounds,
        "observation": str(folder / "x_o.npy"),
        "reuse": not args.no_reuse,
        "proposal": args.proposal,
    }
    write_settings(folder, case, split(args.simulations // args.rounds), section)
    targeted, seconds = train(folder)
    history = targeted.member["history"]
    return {
        **nnpd_posterior(targeted, x_o, reference, i),
        "train_cpu_seconds": seconds,
        "volumes": [row["volume"] for row in history],
        "reused": [row.get("reused") for row in history],
        "final_volume": history[-1]["volume"],
    }


# ---------------------------------------------------------------- sbi's sequential methods


def sbi_job(case, x_o, i, args):
    """The sbi runner's job for one observation: {file name: bytes} of its job.json and x_o."""
    job = {
        "prior": case.sbi_prior,
        "samples": args.samples,
        "seed": args.seed * 1000 + i,
        "experiment": case.spec,
        "simulations": args.simulations,
        "rounds": args.sbi_rounds,
    }
    buffer = io.BytesIO()
    np.save(buffer, x_o)
    return {"job.json": json.dumps(job, sort_keys=True).encode(), "observation.npy": buffer.getvalue()}


def reused_sbi(method, job, folder, args):
    """True when --reuse-sbi's folder holds this method's results for the same job (copied here)."""
    kept = args.reuse_sbi / folder.relative_to(args.workdir) if args.reuse_sbi else None
    if kept is None or not (kept / f"{method}-samples.npy").is_file():
        return False
    if any(not (kept / name).is_file() or (kept / name).read_bytes() != content for name, content in job.items()):
        return False
    if kept != folder:
        folder.mkdir(parents=True, exist_ok=True)
        for name in (f"{method}-samples.npy", f"{method}.json", *job):  # with the job: this folder can serve again
            shutil.copy(kept / name, folder / name)
    return True


def run_sbi(method, case, x_o, reference, i, folder, args):
    """One sbi sequential method for x_o in its own venv: C2ST, CPU seconds and its rounds' timings."""
    job = sbi_job(case, x_o, i, args)
    reused = reused_sbi(method, job, folder, args)
    if not reused:
        write_module(folder, case)
        for name, content in job.items():
            (folder / name).write_bytes(content)
        command = [str(SBI_PYTHON), str(BENCH / "sbi_runner.py"), str(folder), method]
        try:
            done, _ = child(command, folder, timeout=args.sbi_timeout)
        except subprocess.TimeoutExpired:  # seen: SNPE_C's rejection sampling of a proposal leaking out of the box
            raise RuntimeError(
                f"{method} stopped after {args.sbi_timeout:.0f} s of wall time (--sbi-timeout)"
            ) from None
        if done.returncode:
            raise RuntimeError(f"{method} failed:\n{done.stderr[-2000:]}")
    timings = json.loads((folder / f"{method}.json").read_text())
    samples = np.load(folder / f"{method}-samples.npy")
    return {"c2st": score(samples, reference, i), **timings, "reused": reused}


def ensure_sbi():
    """bench/.venv-sbi with sbi in it, made as bench_posterior_quality.py makes it."""
    from bench_posterior_quality import ensure_sbi_venv

    ensure_sbi_venv()


# ---------------------------------------------------------------- one problem


def timed(what, name, i, function, *arguments):
    """function(*arguments) with a progress line; a failure is a row with its error, the others still run."""
    start = time.monotonic()
    try:
        outcome = function(*arguments)
    except Exception as error:  # one method failing still leaves the others' results
        print(f"{name} observation {i}: {what} failed: {error}", flush=True)
        return {"error": str(error)}
    print(
        f"{name} observation {i}: {what} C2ST {outcome['c2st']:.3f} ({time.monotonic() - start:.0f} s wall)",
        flush=True,
    )
    return outcome


def bench_problem(name, args, result, save):
    """Per observation: every method's C2ST, box share and CPU seconds, saved after each observation."""
    case = problem(name)
    workdir = args.workdir / name
    generator = torch.Generator().manual_seed(args.seed)
    folder = workdir / "amortized"
    write_settings(folder, case, split(args.simulations), None)
    amortized, amortized_seconds = train(folder)
    sizes = {
        key: getattr(args, key)
        for key in ("simulations", "samples", "rounds", "no_reuse", "proposal", "sbi", "sbi_rounds")
    }
    result.update(parameters=case.parameters, sizes=sizes, amortized_cpu_seconds=amortized_seconds, observations=[])
    for i, theta in enumerate(case.truths(args.observations, generator)):
        x_o = case.simulate(theta[None], generator)[0].numpy()
        exact = case.reference(x_o, args.samples, generator)
        if i < args.start:  # drawn all the same, so that observation i is the same in every run
            continue
        if args.stop is not None and i >= args.stop:
            break
        row = {"observation": i, "x_o": x_o.tolist()}
        row["amortized"] = timed("amortized", name, i, nnpd_posterior, amortized, x_o, exact, i)
        row["rounds"] = timed("rounds", name, i, nnpd_rounds, case, x_o, exact, i, workdir / f"rounds-{i}", args)
        for method in args.sbi:
            row[method] = timed(method, name, i, run_sbi, method, case, x_o, exact, i, workdir / f"sbi-{i}", args)
        result["observations"].append(row)
        save()


# ---------------------------------------------------------------- report


def scores(rows, method):
    """The method's C2ST per observation that it finished."""
    return [row[method]["c2st"] for row in rows if "c2st" in row.get(method, {})]


def mean_sd(values):
    """The "mean ± sd" of a list, or "–" when it is empty."""
    return f"{np.mean(values):.3f} ± {np.std(values):.3f}" if values else "–"


def finished(values, observations):
    """mean ± sd of a method's C2STs, with how many observations it finished when it did not finish all."""
    return mean_sd(values) + (f" ({len(values)} of {observations})" if values and len(values) < observations else "")


def mean_of(rows, method, key):
    """The mean of one number over the observations the method finished, or NaN."""
    values = [row[method][key] for row in rows if key in row.get(method, {})]
    return float(np.mean(values)) if values else math.nan


def verdicts(name, rows):
    """PASS/FAIL of the targets: rounds ≤ amortized, rounds ≤ the better sbi method, narrow's margin."""
    rounds, amortized = np.mean(scores(rows, "rounds") or [math.nan]), np.mean(scores(rows, "amortized") or [math.nan])
    # Against sbi on the observations both finished: a stopped sbi run leaves its observation out of both means.
    both = {m: [row for row in rows if scores([row], m) and scores([row], "rounds")] for m in SBI_METHODS}
    sbi = [np.mean(scores(both[m], m)) - np.mean(scores(both[m], "rounds")) for m in SBI_METHODS if both[m]]
    mark = lambda ok: "–" if ok is None else ("PASS" if ok else "FAIL")  # noqa: E731
    return (
        mark(bool(rounds <= amortized) if not math.isnan(rounds + amortized) else None),
        mark(bool(min(sbi) >= 0) if sbi else None),
        mark(bool(rounds <= amortized - NARROW_MARGIN) if name == "narrow" and not math.isnan(rounds) else None),
    )


def table(results):
    """The markdown tables: per problem with the targets, per observation, and CPU seconds."""
    lines = [
        "| problem (p) | obs | simulations | rounds: nnpd / sbi | amortized | rounds | SNRE_C | SNPE_C | final box | "
        f"rounds ≤ amortized | rounds ≤ best sbi (on the same obs) | narrow: rounds ≤ amortized − {NARROW_MARGIN} |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, result in results.items():
        rows, sizes = result.get("observations", []), result.get("sizes", {})
        cells = [finished(scores(rows, m), len(rows)) for m in ("amortized", "rounds", *SBI_METHODS)]
        lines.append(
            f"| {name} ({result.get('parameters', '?')}) | {len(rows)} | {sizes.get('simulations', '?')} | "
            f"{sizes.get('rounds', '?')} / {sizes.get('sbi_rounds', '?') if sizes.get('sbi') else '–'} | "
            f"{' | '.join(cells)} | "
            f"{mean_of(rows, 'rounds', 'final_volume'):.2g} | {' | '.join(verdicts(name, rows))} |"
        )
    lines += ["", "| problem | obs | amortized | rounds | SNRE_C | SNPE_C | final box | box per round |"]
    lines.append("|---|---|---|---|---|---|---|---|")
    for name, result in results.items():
        for row in result.get("observations", []):
            cells = [
                f"{row[m]['c2st']:.3f}" if "c2st" in row.get(m, {}) else "–"
                for m in ("amortized", "rounds", *SBI_METHODS)
            ]
            volumes = row["rounds"].get("volumes", [])
            final = f"{volumes[-1]:.2g}" if volumes else "–"
            lines.append(
                f"| {name} | {row['observation']} | {' | '.join(cells)} | {final} | "
                f"{' → '.join(f'{v:.2g}' for v in volumes)} |"
            )
    lines += [
        "",
        "| problem | train CPU s: amortized (once) / rounds / SNRE_C / SNPE_C (per obs) | "
        "sample CPU s per obs: amortized / rounds / SNRE_C / SNPE_C |",
        "|---|---|---|",
    ]
    for name, result in results.items():
        rows = result.get("observations", [])
        train_cells = [f"{result.get('amortized_cpu_seconds', math.nan):.0f}"] + [
            f"{mean_of(rows, m, 'train_cpu_seconds'):.0f}" for m in ("rounds", *SBI_METHODS)
        ]
        sample_cells = [f"{mean_of(rows, m, 'sample_cpu_seconds'):.2f}" for m in ("amortized", "rounds", *SBI_METHODS)]
        lines.append(f"| {name} | {' / '.join(train_cells)} | {' / '.join(sample_cells)} |")
    return "\n".join(lines)


def merged(runs):
    """Several runs' results as one: per problem the first run's, plus later runs' observations it lacks."""
    results = {}
    for run in runs:
        for name, result in run.items():
            first = results.setdefault(name, {**result, "observations": []})
            done = {row["observation"] for row in first["observations"]}
            first["observations"] += [row for row in result.get("observations", []) if row["observation"] not in done]
            first["observations"].sort(key=lambda row: row["observation"])
    return results


def parse_args(argv=None):
    """Command line: problems, sizes, sbi methods, output."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=PROBLEMS + tuple(NAMED_ONLY))
    parser.add_argument("--observations", type=int, default=10)
    parser.add_argument("--simulations", type=int, default=10_000, help="simulator calls per method and observation")
    parser.add_argument("--rounds", type=int, default=rounds.DEFAULT_COUNT, help="nnpd's rounds.count")
    parser.add_argument("--samples", type=int, default=10_000, help="posterior and exact draws per observation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--start", type=int, default=0, help="run observations from this index on (the earlier ones are drawn, not run)"
    )
    parser.add_argument(
        "--stop", type=int, help="run observations before this index only (as drawn for --observations)"
    )
    parser.add_argument("--no-reuse", action="store_true", help="nnpd's rounds train on their own simulations alone")
    parser.add_argument(
        "--proposal",
        choices=("posterior", "prior"),
        default="posterior",
        help="nnpd's rounds.proposal (docs/rounds.md)",
    )
    parser.add_argument("--sbi", nargs="*", default=[], choices=SBI_METHODS, help="sbi's sequential methods to run")
    parser.add_argument("--sbi-rounds", type=int, default=10, help="sbi's rounds (sbibm: 10)")
    parser.add_argument(
        "--sbi-timeout", type=float, default=3600, help="wall seconds after which one sbi run is stopped, a failed row"
    )
    parser.add_argument("--json", type=Path, help="write the results here, after every observation")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (settings, runs, sbi's samples)")
    parser.add_argument(
        "--reuse-sbi", type=Path, metavar="DIR", help="take sbi's results from an earlier --keep folder"
    )
    parser.add_argument(
        "--table", type=Path, nargs="+", metavar="JSON", help="print the tables of saved --json files and exit"
    )
    return parser.parse_args(argv)


def main(argv=None):
    """Run the bench and print its tables."""
    args = parse_args(argv)
    if args.table:
        print(table(merged([json.loads(file.read_text())["results"] for file in args.table])))
        return
    torch.set_num_threads(1)
    if args.sbi:
        ensure_sbi()
    started, results = time.monotonic(), {}
    arguments = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}

    def save():
        """The results so far, when --json names a file."""
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"arguments": arguments, "results": results}, indent=1))

    with tempfile.TemporaryDirectory(prefix="bench-rounds-") as scratch:
        args.workdir = (args.keep or Path(scratch)).resolve()
        args.reuse_sbi = args.reuse_sbi and args.reuse_sbi.resolve()
        for name in args.problems:
            results[name] = {}
            bench_problem(name, args, results[name], save)
    print(table(results))
    print(f"({time.monotonic() - started:.0f} s wall)")


if __name__ == "__main__":
    main()
