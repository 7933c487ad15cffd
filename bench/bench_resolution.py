"""Resolution of the exact target at dimensions 1 to 6: fixed against adaptive candidates.

Prints a markdown table of joint and projected coverage and width of the exact
likelihood's highest-density regions next to their analytic values (a p-D HLD ball of
σ = 2 and 15 observations: projected half-width √χ²_p(level)·0.516), with the points
and evaluations each design used. `--speed` times one dimension-6 learned analysis per
case, fixed against adaptive, side by side; `--budget` sums the default profile's planned
model evaluations for both designs. Timings on a shared machine are noisy.
"""
import argparse
import copy
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script from anywhere

import gaussian  # noqa: E402
import gaussian_study  # noqa: E402
import inference  # noqa: E402
import nnpd  # noqa: E402
import runtime  # noqa: E402
import settings_analysis  # noqa: E402
import settings_training  # noqa: E402
from store import Writer  # noqa: E402

LEVELS = [0.68, 0.95]
FIXED = {"kind": "sobol", "candidate_count": 16_384}


def study_problem(dimension):
    """The bundled study's problem (means in [0, 10], σ = 2) at a dimension."""
    settings = dict(settings_training.base_settings("default")["problem"], dimension=dimension)
    return gaussian.GaussianProblem.from_settings(settings)


def default_inference():
    """The default profile's inference settings."""
    return settings_analysis.make_settings("default")["inference"]


def summarise(problem, truths, observations, candidates, targets, case_scores, folder):
    """Run the study's summarise step for one design; returns its written arrays and the points per case."""
    p = problem.parameter_count
    points, log_measure = inference.make_candidates(problem.low, problem.high, [None] * p, candidates, 11)
    writer, retain = Writer(folder), {"mode": "diagnostic", "cases": 0}
    if candidates["kind"] == "adaptive":
        box = inference.support_box(problem.low, problem.high, [None] * p)
        sizes = inference.adaptive_sizes(p, candidates, len(targets))
        meta = gaussian_study.summarise_adaptive(writer, targets, case_scores, truths, (points, log_measure), box,
                                                 LEVELS, retain, sizes, 5)
    else:
        meta = gaussian_study.summarise_cases(
            writer, targets, lambda i: case_scores(i, torch.cat([points, truths[i:i + 1]])), truths, points,
            log_measure, LEVELS, retain)
    arrays = {f"{t}_{f}": np.load(Path(folder) / f"{t}_{f}.npy")
              for t in targets for f in gaussian_study.SUMMARY_FIELDS}
    return arrays, meta["candidates"]


def analytic(p, level):
    """Projected coverage and width of the p-D HLD ball at a level (σ = 2, 15 observations)."""
    radius = math.sqrt(gaussian_study.chi_square_quantile(level, p))
    return math.erf(radius / math.sqrt(2)), 2 * radius * 2 / math.sqrt(15)


def exact_row(p, design, candidates, cases, folder):
    """One table row: the exact target's coverage, width and resolution with one design."""
    problem = study_problem(p)
    settings = default_inference()
    truths = inference.make_truths(problem.low, problem.high, problem.grid_step,
                                   dict(settings["truths"], sobol_truths=max(1, cases >> (p - 1))), 1)
    observations = inference.make_observations(problem.simulate, truths, settings["observations"], 2)

    def case_scores(i, points):
        return {"exact": inference.exact_scores(problem.log_likelihood, observations[i], points, 262_144)}

    arrays, per_case = summarise(problem, truths, observations, candidates, ["exact"], case_scores, folder)
    summary = {f: arrays[f"exact_{f}"] for f in gaussian_study.SUMMARY_FIELDS}
    coverage = inference.coverage_metrics(summary, truths.numpy(), LEVELS, problem.names)
    width = inference.width_metrics(summary, LEVELS, problem.names)["0.68"]["mean"]
    warning = inference.resolution_metrics(summary, per_case, LEVELS, candidates["kind"])["warning"]
    projected, analytic_width = analytic(p, 0.68)
    joint = " / ".join("{:.3f} [{:.3f}, {:.3f}]".format(coverage[k]["joint"], *coverage[k]["interval"])
                       for k in ("0.68", "0.95"))
    evaluations = truths.shape[0] * (per_case + 1) * settings["observations"]
    return (f"| {p} | {design} | {truths.shape[0]} | {per_case} | {evaluations:.3g} | {joint} | "
            f"{coverage['0.68']['mean']:.3f} ({projected:.3f}) | {width:.2f} ({analytic_width:.2f}) | "
            f"{'yes' if warning else 'none'} |")


def resolution_table(cases):
    """Print the markdown table for dimensions 1 to 6."""
    print("| d | design | cases | points/case | evaluations | joint 68% / 95% [95% interval] | "
          "projected 68% (analytic) | width 68% (analytic) | resolution warning |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in range(1, 7):
        for design, candidates in (("fixed sobol", FIXED), ("adaptive", default_inference()["candidates"])):
            with tempfile.TemporaryDirectory() as folder:
                print(exact_row(p, design, candidates, cases, folder), flush=True)


def learned_timer(cases, candidates):
    """A function timing one dimension-6 learned analysis (ratio and posterior) of `cases` cases."""
    problem = study_problem(6)
    prior = gaussian.make_prior(problem, {"family": "uniform"})
    torch.manual_seed(0)
    model = gaussian.build_network({"kind": "mlp", "hidden": [64] * 4, "activation": "relu", "dropout": 0.0}, 12)
    model.eval()
    truths = inference.make_truths(problem.low, problem.high, problem.grid_step, default_inference()["truths"], 1)
    truths = truths[:cases]
    observations = inference.make_observations(problem.simulate, truths, 15, 2)
    targets = ["ratio", "posterior"]

    def timed():
        evaluations = [0]
        case_scores = gaussian_study.learned_case_scores(model, "cpu", prior, observations, targets, 262_144,
                                                         evaluations)
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as folder, torch.no_grad():
            summarise(problem, truths, observations, candidates, targets, case_scores, folder)
        return (time.perf_counter() - started) / cases, evaluations[0] / cases

    return timed


def speed(cases, repeats):
    """Print ms per case of the fixed and the adaptive design, alternating which goes first."""
    runtime.start({"device": "cpu", "cpu_threads": 1, "deterministic": False})   # as nnpd runs analyses
    timers = {"fixed sobol": learned_timer(cases, FIXED),
              "adaptive": learned_timer(cases, default_inference()["candidates"])}
    seconds = {name: [] for name in timers}
    for repeat in range(repeats):
        for name in (list(timers) if repeat % 2 == 0 else list(timers)[::-1]):
            elapsed, evaluations = timers[name]()
            seconds[name].append(elapsed)
            print(f"{name:12s} {elapsed * 1e3:7.1f} ms per case, {evaluations:.0f} model evaluations per case",
                  flush=True)
    paired = sorted(a / f for a, f in zip(seconds["adaptive"], seconds["fixed sobol"]))
    print(f"adaptive / fixed time per case: best-of {min(seconds['adaptive']) / min(seconds['fixed sobol']):.2f}, "
          f"median of pairs {paired[len(paired) // 2]:.2f} (target <= 1)")


def budget():
    """Print the default profile's planned model evaluations with its adaptive and with a fixed design."""
    profile = nnpd.load("default")
    jobs = nnpd.make_plan(profile).jobs
    adaptive = sum(job.analysis_workload["model_evaluations"] for job in jobs)
    fixed = 0
    for job in jobs:
        settings = copy.deepcopy(job.analysis.settings)
        settings["inference"]["candidates"].update(FIXED)
        fixed += gaussian_study.GaussianAnalysis(settings, job.experiment).workload(job.member)["model_evaluations"]
    print(f"default profile, planned model evaluations: adaptive {adaptive:.4g}, "
          f"fixed 16,384-point sobol {fixed:.4g} (ratio {adaptive / fixed:.2f})")


def main():
    """Run the table, and the timing or budget when asked."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=1024, help="truth cases per dimension")
    parser.add_argument("--speed", action="store_true", help="time a dimension-6 learned analysis instead")
    parser.add_argument("--speed-cases", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--budget", action="store_true", help="sum the default profile's planned evaluations instead")
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    if arguments.speed:
        speed(arguments.speed_cases, arguments.repeats)
    elif arguments.budget:
        budget()
    else:
        resolution_table(arguments.cases)


if __name__ == "__main__":
    main()
