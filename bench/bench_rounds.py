"""Rounds against the amortized default at the same simulation budget, nnpd only (docs/rounds.md).

A narrow problem, whose posterior is much narrower than its prior box: three parameters
θ uniform on [0, 1]^3, x = θ + noise with sd NARROW_SD (0.005: the posterior's sd is 0.5%
of the box's width), and its exact posterior (N(x_o, sd²) cut to the box) for reference.
Optionally the ring of bench/posterior_problems.py, whose posterior fills much of its box.

For each problem and observation (drawn at prior truths), two nnpd trainings of the same
total of simulator calls, the kit's recipe otherwise (no `model` or `training` section):

  amortized   one training on `--simulations` simulations from the whole prior;
  rounds      `rounds.count` rounds for x_o, each of simulations / count new ones, each also
              training on the earlier rounds' inside its box unless `--no-reuse` (docs/rounds.md).

Each posterior (`restore(run).posterior(x_o)`, the default design) draws `--samples`
samples, scored by C2ST (c2st.py, BENCH_C2ST_EPOCHS epochs) against as many exact draws:
0.5 is perfect. CPU seconds are the `train` command's, one thread. Prints a markdown table
and writes a JSON with `--json`.

    python bench/bench_rounds.py                          # about 10 minutes on one CPU core
    python bench/bench_rounds.py --problems narrow ring --observations 3 --simulations 10000
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere
sys.path.insert(0, str(BENCH))

import numpy as np  # noqa: E402
import posterior_problems  # noqa: E402
import torch  # noqa: E402

import posterior  # noqa: E402
from c2st import c2st  # noqa: E402
from store import restore  # noqa: E402

NARROW_SD = 0.005
BENCH_C2ST_EPOCHS = 50
TEST_SIMULATIONS = 20  # the kit's data.test per training: held out, trains nothing
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


def problem(name):
    """(module source or None, experiment spec, kit prior, truth sampler, reference sampler, simulate)."""
    if name == "narrow":
        return (
            NARROW_MODULE,
            "narrow_problem:Narrow",
            {"family": "uniform"},
            lambda n, g: torch.rand(n, 3, generator=g, dtype=torch.float64),
            narrow_reference,
            lambda theta, g: theta + NARROW_SD * torch.randn(theta.shape, generator=g, dtype=torch.float64),
        )
    study = posterior_problems.Ring({})
    return (
        None,
        "posterior_problems:Ring",
        posterior_problems.kit_prior(study),
        lambda n, g: posterior_problems.prior_draws(study, n, g),
        study.reference,
        study.simulate,
    )


def write_settings(folder, source, spec, prior, data, rounds):
    """The study module and both settings files of one training in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    if source is None:
        (folder / "posterior_problems.py").write_text((BENCH / "posterior_problems.py").read_text())
    else:
        (folder / "narrow_problem.py").write_text(source)
    training = {
        "experiment": spec,
        "output": {"root": str(folder / "outputs")},
        "seed": 7,
        "cohort": {"priors": ["prior"], "replicas": 1},
        "priors": {"prior": prior},
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


def train(folder):
    """`nnpd train` on the folder's settings, one thread; (restored run, CPU seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        [sys.executable, str(REPO / "nnpd.py"), "train", "--settings-dir", str(folder)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        cwd=folder,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise RuntimeError(f"nnpd train failed:\n{done.stdout[-1500:]}{done.stderr[-1500:]}")
    run = next(path.parent for path in (folder / "outputs" / "runs").glob("*/*/run.json"))
    return restore(run), (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def score(restored, x_o, reference, seed):
    """C2ST of the run's posterior samples for x_o against the exact draws (1.0 when it cannot sample)."""
    try:
        samples = restored.posterior(x_o).sample(len(reference), seed=seed).numpy()
    except posterior.PosteriorError as error:  # a refused posterior scores as a disjoint one
        print(f"  refused: {error}", flush=True)
        return 1.0
    return c2st(samples, reference.numpy(), seed=seed, epochs=BENCH_C2ST_EPOCHS)


def bench_problem(name, args, workdir):
    """Per observation: amortized and rounds C2ST, box share and CPU seconds."""
    source, spec, prior, truths, reference, simulate = problem(name)
    generator = torch.Generator().manual_seed(args.seed)
    folder = workdir / name / "amortized"
    write_settings(folder, source, spec, prior, split(args.simulations), None)
    amortized, amortized_seconds = train(folder)
    rows = []
    for i, theta in enumerate(truths(args.observations, generator)):
        x_o = simulate(theta[None], generator)[0].numpy()
        exact = reference(x_o, args.samples, generator)
        folder = workdir / name / f"rounds-{i}"
        np.save(workdir / name / f"x_o-{i}.npy", x_o)
        rounds = {"count": args.rounds, "observation": str(workdir / name / f"x_o-{i}.npy"), "reuse": not args.no_reuse}
        write_settings(folder, source, spec, prior, split(args.simulations // args.rounds), rounds)
        targeted, seconds = train(folder)
        rows.append(
            {
                "observation": i,
                "amortized": score(amortized, x_o, exact, i),
                "rounds": score(targeted, x_o, exact, i),
                "rounds_cpu_seconds": seconds,
                "volumes": [row["volume"] for row in targeted.member["history"]],
                "reused": [row.get("reused") for row in targeted.member["history"]],
                "final_volume": targeted.member["history"][-1]["volume"],
            }
        )
        print(f"{name} observation {i}: {rows[-1]}", flush=True)
    return {"amortized_cpu_seconds": amortized_seconds, "observations": rows}


def table(results, args):
    """A markdown table: mean C2ST per method, the final box's share and training CPU seconds."""
    lines = [
        f"| problem | amortized C2ST | rounds ({args.rounds}) C2ST | final box (share of the prior's volume) | "
        "train CPU s: amortized (once) / rounds (per observation) |",
        "|---|---|---|---|---|",
    ]
    for name, result in results.items():
        rows = result["observations"]
        mean = lambda key: np.mean([row[key] for row in rows])  # noqa: E731
        lines.append(
            f"| {name} | {mean('amortized'):.3f} | {mean('rounds'):.3f} | {mean('final_volume'):.2g} | "
            f"{result['amortized_cpu_seconds']:.0f} / {mean('rounds_cpu_seconds'):.0f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    """Run the bench and print its table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", default=["narrow"], choices=["narrow", "ring"])
    parser.add_argument("--observations", type=int, default=3)
    parser.add_argument("--simulations", type=int, default=6000, help="simulator calls per method and observation")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-reuse", action="store_true", help="rounds train on their own simulations alone")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-rounds-") as workdir:
        results = {name: bench_problem(name, args, Path(workdir)) for name in args.problems}
    print(table(results, args))
    print(f"({time.monotonic() - started:.0f} s wall)")
    if args.json:
        Path(args.json).write_text(json.dumps({"arguments": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
