"""Posterior quality: nnpd against sbi 0.27's NRE_A and NRE_C, side by side, on exact posteriors.

Four problems with exact reference posteriors (bench/posterior_problems.py):

  ring     2 parameters: a thin ring cut by a wide band, two thin curved arcs (bimodal);
  slcp     5 parameters, four modes: 4 draws of a 2-D Gaussian with mean (θ1, θ2), sds
           θ3², θ4², correlation tanh θ5, uniform prior on [-3, 3]^5;
  linear   10 parameters: x = A θ + noise, prior N(0, 1) per parameter truncated at ±5 sd
           (the mass cut off is about 6e-6 of the prior and far less of a posterior, so the
           truncation is negligible; sbi is given the untruncated normal);
  narrow   10 parameters: x = B θ + small noise, prior N(0, 0.8^|i-j|) cut at ±5 sd (the study's
           own prior object): a narrow (sds 2.5-5% of the box), correlated posterior, which
           nnpd's candidate design alone resolved into 1-17 effective candidates and refused.

Each method gets the same budget of 10,000 simulator calls, the same (θ, x) pairs drawn
here from the prior with a seed: sbi through `append_simulations`, nnpd as a simulation
bank (`data.bank`, 9,000 for training and 1,000 for validation, as sbi splits them; two
more simulations fill the kit's test split, which trains nothing). nnpd's study writes no
`model`, `training` or inference settings: its documented defaults, `python nnpd.py
train`, then `restore(run).posterior(x_o).sample(n)` with the default design for the
parameter box. One CPU thread each. For every observation (10, drawn at prior truths) each
method draws 10,000 posterior samples, sbi by its default `build_posterior()` sampler.
Each is scored by C2ST against 10,000 exact reference draws computed here (rejection or
conjugate sampling, see posterior_problems.py). `--check-references`
checks them two ways on the first observation: Metropolis chains of the exact likelihood
started at the draws leave an exact sample's moments where they are (they did, within
noise, for all three problems), and in 2-D the marginal CDFs are within the KS noise of a
1,000 × 1,000 grid's (gaps 0.005 to 0.012 for 10,000 draws, where 0.0136 is the 95% bound).

C2ST (c2st.py, trained C2ST_EPOCHS epochs): the 5-fold cross-validated accuracy of a
small MLP separating the method's samples from the reference draws, both standardised by
the reference's mean and sd; 0.5 is a perfect posterior, 1.0 a disjoint one (what an
observation scores when nnpd refuses to sample it; the table counts those). The same
definition for all three methods. sbi's results depend only on the seed and the sizes:
`--reuse-sbi DIR` takes its samples and timings from an earlier run's `--keep` folder and
scores them anew beside nnpd's.

CPU seconds (one thread): nnpd's training is its whole `train` command (start-up, reading
the bank, training, store commits), sbi's runs from constructing NRE_A / NRE_C to
`build_posterior()` in its process; sampling is per observation, 10,000 draws, nnpd's
from `posterior(x_o)` (the candidate design refined for x_o) to its draws.

Targets, per problem: nnpd's mean C2ST at most the better of NRE_A and NRE_C, and nnpd's
sampling at least 5× faster per observation (CPU seconds, 10,000 draws) than the faster
of sbi's samplers. Prints a markdown table and PASS/FAIL per problem; writes a JSON.

sbi lives only in bench/.venv-sbi (`make bench-sbi`, or made on first use): a venv over
nnpd's .venv that reuses its torch (pinned by a constraints file), run in a subprocess
that exchanges .npy files with this one, so nnpd's environment never imports sbi.

    make bench-sbi                                              # once: the sbi venv
    python bench/bench_posterior_quality.py --quick             # minutes: 2 observations, small budget
    nice -n 10 python bench/bench_posterior_quality.py          # the full bench (hours on one CPU)
    python bench/bench_posterior_quality.py --problems ring slcp --observations 4 --json out.json
"""

import argparse
import fcntl
import json
import math
import os
import resource
import shutil
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
import runtime  # noqa: E402
from c2st import c2st  # noqa: E402
from store import restore  # noqa: E402

SBI_VENV = BENCH / ".venv-sbi"
SBI_PYTHON = SBI_VENV / "bin" / "python"
SBI_REQUIREMENT = "sbi==0.27.0"
SBI_METHODS = ("NRE_A", "NRE_C")
METHODS = ("nnpd",) + SBI_METHODS
SPEEDUP_TARGET = 5.0
# The bench's C2ST trains each fold's classifier longer than `infer --reference` does (closer
# to training to convergence, as sbibm does): it tells close posteriors apart better.
C2ST_EPOCHS, C2ST_BATCH = 100, 256
TEST_SIMULATIONS = 2  # the kit's data.test: held out for the classification metric, not trained on


def parse_args(argv=None):
    """Command line: problems, sizes, quick mode, output."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--problems",
        nargs="+",
        choices=list(posterior_problems.PROBLEMS),
        default=list(posterior_problems.DEFAULT_PROBLEMS),
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=list(METHODS),
        default=list(METHODS),
        help="a subset while developing (the targets need nnpd and an sbi method)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a fast check: 2 observations, 2,000 simulations, 2,000 samples and reference draws",
    )
    parser.add_argument("--observations", type=int, help="observations per problem (default 10; quick 2)")
    parser.add_argument("--simulations", type=int, help="simulator calls per method (default 10,000; quick 2,000)")
    parser.add_argument("--samples", type=int, help="posterior and reference draws (default 10,000; quick 2,000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=BENCH / "out" / "posterior_quality.json")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (settings, runs, .npy files)")
    parser.add_argument(
        "--check-references",
        action="store_true",
        help="check the first observation's reference: exact-likelihood Metropolis chains from it keep its "
        "moments, and in 2-D its marginal CDFs against a fine grid's",
    )
    parser.add_argument("--sbi-setup", action="store_true", help="only create bench/.venv-sbi and exit")
    parser.add_argument(
        "--nnpd-training",
        type=json.loads,
        metavar="JSON",
        default=None,
        help="a `training` section for nnpd instead of its defaults, to compare recipes: "
        '\'{"objective": "bce"}\' (the keys it names replace the kit recipe\'s)',
    )
    parser.add_argument(
        "--reuse-sbi",
        type=Path,
        metavar="DIR",
        help="take sbi's samples and timings from the --keep folder of an earlier run of the same "
        "seed and sizes (they depend on nothing else), scoring them anew beside nnpd's",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    args.observations = args.observations or (2 if quick else 10)
    args.simulations = args.simulations or (2000 if quick else 10_000)
    args.samples = args.samples or (2000 if quick else 10_000)
    return args


# ---------------------------------------------------------------- sbi's environment


def ensure_sbi_venv():
    """Create bench/.venv-sbi once: nnpd's torch reused and pinned, sbi installed beside it."""
    # Two benches started together in a fresh checkout would both build the venv, and the
    # second pip install would fail: the lock makes the second wait, then find sbi there.
    with open(BENCH / ".venv-sbi.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not sbi_importable():
            make_sbi_venv()


def sbi_importable():
    """Whether bench/.venv-sbi's python imports sbi."""
    return (
        SBI_PYTHON.exists()
        and subprocess.run([str(SBI_PYTHON), "-c", "import sbi"], capture_output=True).returncode == 0
    )


def make_sbi_venv():
    """bench/.venv-sbi over nnpd's site-packages, sbi installed with torch pinned to nnpd's."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(SBI_VENV)], check=True)
    # --system-site-packages reaches the base interpreter's packages, not those of nnpd's
    # .venv, where torch may live: a .pth file adds nnpd's site-packages behind sbi's own.
    here = subprocess.run(
        [sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    there = subprocess.run(
        [str(SBI_PYTHON), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(there, "nnpd-venv.pth").write_text(here + "\n")
    constraints = SBI_VENV / "constraints.txt"
    constraints.write_text(f"torch=={torch.__version__}\n")  # never a second torch
    subprocess.run([str(SBI_PYTHON), "-m", "pip", "install", "-c", str(constraints), SBI_REQUIREMENT], check=True)
    version = subprocess.run(
        [str(SBI_PYTHON), "-c", "import torch; print(torch.__version__, torch.__file__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if version[0] != torch.__version__ or not version[1].startswith(here):
        raise RuntimeError(f"{SBI_VENV} sees torch {version} instead of nnpd's {torch.__version__} in {here}")


def run_sbi(method, folder):
    """One sbi method on the simulations in `folder`, in its own venv's python; its samples and timings."""
    # In `folder`: sbi writes its training logs (sbi-logs/) under the working directory.
    completed = subprocess.run(
        [str(SBI_PYTHON), str(BENCH / "sbi_runner.py"), str(folder), method],
        env=single_thread_env(),
        capture_output=True,
        text=True,
        cwd=folder,
    )
    if completed.returncode:
        raise RuntimeError(f"{method} failed:\n{completed.stderr[-2000:]}")
    timings = json.loads((folder / f"{method}.json").read_text())
    return {
        "samples": np.load(folder / f"{method}-samples.npy"),
        "train_cpu_seconds": timings["train_cpu_seconds"],
        "sample_cpu_seconds": timings["sample_cpu_seconds"],
        "epochs": timings.get("epochs"),
    }


def single_thread_env():
    """The environment of a child process, held to one thread."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# ---------------------------------------------------------------- nnpd's side


def settings_files(name, study, folder, args, bank):
    """Write the study module, both settings files and the simulation bank of one problem into `folder`.

    The settings name no `model` or `training` section (the kit's recipe) and no inference
    settings (the default design for the parameter box); data.bank holds the simulations
    sbi trains on, 90% for training and 10% for validation, as sbi splits them.
    """
    folder.mkdir(parents=True, exist_ok=True)
    # The module is copied, not imported from bench/: the kit checks that the module it
    # names defines the class itself, and its source enters the keys.
    shutil.copy(BENCH / "posterior_problems.py", folder / "posterior_problems.py")
    theta, x = bank
    np.savez(folder / "bank.npz", theta=theta.numpy(), x=x.numpy())
    validation = args.simulations // 10
    priors, prior = posterior_problems.kit_priors(study)
    training = {
        "experiment": f"posterior_problems:{type(study).__name__}",
        "output": {"root": str(folder / "outputs")},
        "seed": args.seed,
        "cohort": {"priors": [prior], "replicas": 1},
        "priors": priors,
        "data": {
            "train": args.simulations - validation,
            "validation": validation,
            "test": TEST_SIMULATIONS,
            "bank": str(folder / "bank.npz"),
        },
        "runtime": {"device": "cpu", "parallel": "jobs", "cpu_threads": 1},
        **({"training": args.nnpd_training} if args.nnpd_training else {}),
    }
    analysis = {"analysis": "nre_analysis:NREAnalysis"}
    for file, settings in (("settings_training.py", training), ("settings_analysis.py", analysis)):
        (folder / file).write_text(
            f'"""Bench settings for {name} (written by bench_posterior_quality.py)."""\n'
            f'DEFAULT_PROFILE = "bench"\nPROFILES = ("bench",)\nBENCH = {settings!r}\n\n\n'
            'def make_settings(profile):\n    """The one profile."""\n'
            "    import copy\n    return copy.deepcopy(BENCH)\n"
        )


def nnpd_command(stage, folder):
    """Run one nnpd stage on the settings in `folder`; returns (completed process, child CPU seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    completed = subprocess.run(
        [sys.executable, str(REPO / "nnpd.py"), stage, "--settings-dir", str(folder)],
        env=single_thread_env(),
        capture_output=True,
        text=True,
        cwd=folder,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return completed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def train_nnpd(name, study, bank, observations, folder, args):
    """nnpd's documented defaults on the bank's simulations: `train`, then restore(run).posterior(x_o).sample(n)."""
    settings_files(name, study, folder, args, bank)
    completed, train_seconds = nnpd_command("train", folder)
    if completed.returncode:
        raise RuntimeError(f"nnpd train failed:\n{completed.stdout[-1500:]}{completed.stderr[-1500:]}")
    run_dir = next(path.parent for path in (folder / "outputs" / "runs").glob("*/*/run.json"))
    restored = restore(run_dir)
    samples, sample_seconds, refused, methods, paths = [], [], {}, [], []
    for i, x_o in enumerate(observations):
        start = time.process_time()
        try:
            post = restored.posterior(x_o)
            drawn = post.sample(args.samples, seed=args.seed + i).numpy()
            methods.append(post.sampling["method"])
            paths.append(post.sampling.get("path"))  # what placed the proposal (sampler.py)
        except posterior.PosteriorError as error:  # too few effective candidates: no samples
            drawn, refused[i] = None, str(error)
        sample_seconds.append(time.process_time() - start)
        samples.append(drawn)
    history = restored.history
    return {
        "samples": samples,
        "train_cpu_seconds": train_seconds,
        "sample_cpu_seconds": sample_seconds,
        "refused": refused,
        "sampling": methods,
        "paths": paths,
        "epochs": len(history["train_loss"]),
        "selected_epoch": history["selected_epoch"],
    }


def reused_sbi(method, folder, args):
    """sbi's samples and timings kept by an earlier run (--reuse-sbi), or None when it kept none."""
    kept = args.reuse_sbi / folder.name
    if not (kept / f"{method}-samples.npy").is_file():
        return None
    for name in (f"{method}-samples.npy", f"{method}.json"):
        shutil.copy(kept / name, folder / name)
    timings = json.loads((folder / f"{method}.json").read_text())
    return {
        "samples": np.load(folder / f"{method}-samples.npy"),
        "train_cpu_seconds": timings["train_cpu_seconds"],
        "sample_cpu_seconds": timings["sample_cpu_seconds"],
        "epochs": timings.get("epochs"),
        "reused": str(kept),
    }


# ---------------------------------------------------------------- C2ST


def score(samples, reference, seed):
    """nnpd's C2ST (c2st.py) at the bench's training length: one definition for every method."""
    return float(c2st(samples, reference, seed=seed, epochs=C2ST_EPOCHS, batch=C2ST_BATCH))


# ---------------------------------------------------------------- the exact references


def check_reference(study, x_o, reference, generator, steps=300):
    """Exact-likelihood Metropolis chains started at every reference draw: an exact sample keeps its moments."""
    low, high = posterior_problems.bounds(study)
    normal = isinstance(study, posterior_problems.Linear)
    correlated = posterior_problems.CorrelatedPrior() if isinstance(study, posterior_problems.Narrow) else None

    def log_target(theta):
        """Unnormalised log posterior: likelihood times prior, −inf outside the box."""
        value = study.log_likelihood(x_o, theta) - (0.5 * (theta**2).sum(-1) if normal else 0.0)
        value = value + correlated.log_prob(theta) if correlated else value
        inside = ((theta >= low) & (theta <= high)).all(-1)
        return torch.where(inside, value, torch.full_like(value, -math.inf))

    current = reference.clone()
    log_current = log_target(current)
    step = 0.3 * reference.std(0)
    for _ in range(steps):
        proposal = current + step * torch.randn(current.shape, dtype=torch.float64, generator=generator)
        log_proposal = log_target(proposal)
        accept = torch.rand(len(current), dtype=torch.float64, generator=generator).log() < log_proposal - log_current
        current[accept], log_current[accept] = proposal[accept], log_proposal[accept]
    # |θ| too: the modes of ring and slcp are mirror images, so the means alone say little.
    check = {
        what: [values.mean(0).tolist(), values.abs().mean(0).tolist(), values.std(0).tolist()]
        for what, values in (("reference", reference), ("after_chains", current))
    }
    if len(low) == 2:
        check["grid_ks"] = grid_ks(log_target, reference, low, high)
    return check


def grid_ks(log_target, reference, low, high, points=1000):
    """Per axis, the largest gap between the reference's marginal CDF and a fine grid's (2-D problems)."""
    axes = [torch.linspace(float(a), float(b), points + 1, dtype=torch.float64) for a, b in zip(low, high)]
    middles = [(axis[1:] + axis[:-1]) / 2 for axis in axes]
    grid = torch.stack(torch.meshgrid(*middles, indexing="ij"), -1)
    mass = torch.softmax(log_target(grid.reshape(-1, 2)), 0).reshape(points, points)
    gaps = []
    for axis, marginal in enumerate((mass.sum(1), mass.sum(0))):
        edges = axes[axis][1:]
        empirical = torch.searchsorted(reference[:, axis].sort().values.contiguous(), edges, right=True) / len(
            reference
        )
        gaps.append(float((empirical - marginal.cumsum(0)).abs().max()))
    return gaps


# ---------------------------------------------------------------- one problem


def seeded(args, *labels):
    """A generator for one named stream of the bench."""
    return torch.Generator().manual_seed(runtime.derived_seed(args.seed, "posterior-quality", *labels))


def bench_problem(name, args, workdir):
    """Simulations, observations and references of one problem; every method's samples, scores and timings."""
    study = posterior_problems.PROBLEMS[name]({})
    theta = posterior_problems.prior_draws(study, args.simulations, seeded(args, name, "theta"))
    x = study.simulate(theta, seeded(args, name, "x"))
    truths = posterior_problems.prior_draws(study, args.observations, seeded(args, name, "truths"))
    observations = study.simulate(truths, seeded(args, name, "observations"))
    start = time.process_time()
    references = [
        study.reference(x_o, args.samples, seeded(args, name, "reference", i)) for i, x_o in enumerate(observations)
    ]
    result = {
        "parameters": len(study.parameters),
        "reference_cpu_seconds": time.process_time() - start,
        "truths": truths.tolist(),
        "observations": observations.tolist(),
        "methods": {},
    }
    if args.check_references:
        result["reference_check"] = check_reference(study, observations[0], references[0], seeded(args, name, "check"))
        print(f"{name}: reference check {json.dumps(result['reference_check'])}", flush=True)
    folder = workdir / name
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "theta.npy", theta.numpy())
    np.save(folder / "x.npy", x.numpy())
    np.save(folder / "observations.npy", observations.numpy())
    (folder / "job.json").write_text(
        json.dumps({"prior": posterior_problems.sbi_prior(study), "samples": args.samples, "seed": args.seed})
    )
    for method in args.methods:
        print(f"{name}: {method} ...", flush=True)
        try:
            if method == "nnpd":
                extra = posterior_problems.prior_draws(study, TEST_SIMULATIONS, seeded(args, name, "test theta"))
                bank = (torch.cat([theta, extra]), torch.cat([x, study.simulate(extra, seeded(args, name, "test x"))]))
                outcome = train_nnpd(name, study, bank, observations, folder / "nnpd", args)
            else:
                outcome = (args.reuse_sbi and reused_sbi(method, folder, args)) or run_sbi(method, folder)
        except Exception as error:  # one method failing still leaves the others' rows
            print(f"{name}: {method} failed: {error}", flush=True)
            result["methods"][method] = {"error": str(error)}
            continue
        # An observation without samples (nnpd refusing to resample) scores 1.0, a disjoint posterior.
        scores = [
            1.0 if samples is None else score(samples, reference, args.seed)
            for samples, reference in zip(outcome.pop("samples"), references)
        ]
        result["methods"][method] = {**outcome, "c2st": scores}
        print(f"{name}: {method} C2ST {np.mean(scores):.3f}", flush=True)
    result["verdict"] = verdict(result["methods"])
    return result


def verdict(methods):
    """PASS when nnpd's mean C2ST is at most the better sbi method's and it samples ≥ 5× faster than both."""
    ran = {name: m for name, m in methods.items() if "c2st" in m}
    if "nnpd" not in ran or not any(name in ran for name in SBI_METHODS):
        return {"pass": False, "why": "nnpd or both sbi methods did not run or finish"}
    nnpd = ran["nnpd"]
    best = min(np.mean(m["c2st"]) for name, m in ran.items() if name != "nnpd")
    fastest = min(np.mean(m["sample_cpu_seconds"]) for name, m in ran.items() if name != "nnpd")
    speedup = fastest / max(np.mean(nnpd["sample_cpu_seconds"]), 1e-9)
    quality = float(np.mean(nnpd["c2st"])) <= best
    return {
        "pass": bool(quality and speedup >= SPEEDUP_TARGET),
        "quality": bool(quality),
        "best_sbi_c2st": float(best),
        "speedup": float(speedup),
    }


# ---------------------------------------------------------------- report


def table(results):
    """The markdown table of every problem and method, then PASS/FAIL lines."""
    lines = [
        "| problem | p | method | C2ST mean ± sd | train CPU s | sample CPU s / obs |",
        "|---|---|---|---|---|---|",
    ]
    for name, result in results.items():
        for method in METHODS:
            m = result["methods"].get(method)
            if m is None or "c2st" not in m:
                lines.append(
                    f"| {name} | {result['parameters']} | {method} | {'not run' if m is None else 'failed'} | | |"
                )
                continue
            refused = f" ({len(m['refused'])} refused: 1.0)" if m.get("refused") else ""
            lines.append(
                f"| {name} | {result['parameters']} | {method} | {np.mean(m['c2st']):.3f} ± "
                f"{np.std(m['c2st']):.3f}{refused} | {m['train_cpu_seconds']:.1f} | "
                f"{np.mean(m['sample_cpu_seconds']):.2f} |"
            )
    lines.append("")
    for name, result in results.items():
        v = result["verdict"]
        detail = v.get("why") or (
            f"C2ST {'≤' if v['quality'] else '>'} best sbi {v['best_sbi_c2st']:.3f}; "
            f"sampling {v['speedup']:.1f}× faster (target {SPEEDUP_TARGET:g}×)"
        )
        lines.append(f"{name}: {'PASS' if v['pass'] else 'FAIL'} ({detail})")
    return "\n".join(lines)


def main(argv=None):
    """Run the chosen problems, print the table, write the JSON."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.sbi_setup or set(args.methods) & set(SBI_METHODS):
        ensure_sbi_venv()
    if args.sbi_setup:
        return 0
    print(
        f"c2st: c2st.py, {C2ST_EPOCHS} epochs; {args.simulations} simulations, {args.observations} observations, "
        f"{args.samples} draws",
        flush=True,
    )
    results = {}
    with tempfile.TemporaryDirectory(prefix="nnpd-posterior-quality-") as scratch:
        workdir = (args.keep or Path(scratch)).resolve()
        for name in args.problems:
            results[name] = bench_problem(name, args, workdir)
            write_json(args, results)  # after every problem: a long run keeps what it finished
    print(table(results))
    return 0 if all(r["verdict"]["pass"] for r in results.values()) else 1


def write_json(args, results):
    """The results so far, with the run's sizes."""
    args.json.parent.mkdir(parents=True, exist_ok=True)
    sizes = {k: v for k, v in vars(args).items() if k in ("quick", "observations", "simulations", "samples", "seed")}
    args.json.write_text(
        json.dumps({"sizes": sizes, "c2st": f"c2st.py, {C2ST_EPOCHS} epochs", "problems": results}, indent=1)
    )


if __name__ == "__main__":
    sys.exit(main())
