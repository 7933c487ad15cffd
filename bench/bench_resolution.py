"""Resolution of the exact target at dimensions 1 to 6: fixed against adaptive candidates.

Prints a markdown table of joint and projected coverage and width of the exact
likelihood's highest-density regions next to their analytic values, with the points and
evaluations each design used. The analytic values are given twice: for the posterior
truncated to the prior box at the table's truths, averaged over their observations
(truncated_analytic: what an exact analysis should measure), and untruncated (a p-D HLD
ball of σ = 2 and 15 observations: projected half-width √χ²_p(level)·0.516). `--analytic`
prints the references alone, with their Monte Carlo errors. `--speed` times one
dimension-6 learned analysis per case, fixed against adaptive, side by side; `--budget`
sums the default profile's planned model evaluations for both designs. Timings on a
shared machine are noisy.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import adaptive  # noqa: E402
import analysis_metrics  # noqa: E402
import case_blocks  # noqa: E402
import case_scores  # noqa: E402
import designs  # noqa: E402
import gaussian  # noqa: E402
import gaussian_study  # noqa: E402
import networks  # noqa: E402
import nnpd  # noqa: E402
import nre_analysis  # noqa: E402
import priors  # noqa: E402
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


def summarise(problem, truths, observations, candidates, targets, scoring, folder):
    """Run the study's summarise step for one design; returns its written arrays and the points per case."""
    p = problem.parameter_count
    points, log_measure = designs.make_candidates(problem.low, problem.high, [None] * p, candidates, 11)
    box = adaptive.support_box(problem.low, problem.high, [None] * p)
    sizes = designs.adaptive_sizes(p, candidates, len(targets)) if candidates["kind"] == "adaptive" else None
    design = case_blocks.Design(candidates["kind"], [None] * p, adaptive.Refinement(box, LEVELS, sizes, 5))
    work = nre_analysis.Cases(
        targets, truths, case_blocks.Candidates(points, log_measure), {"mode": "diagnostic", "cases": 0}
    )
    meta = nre_analysis.summarise_cases(Writer(folder), scoring, design, work, lambda case: None)
    arrays = {f"{t}_{f}": np.load(Path(folder) / f"{t}_{f}.npy") for t in targets for f in nre_analysis.SUMMARY_FIELDS}
    return arrays, meta["candidates"]


SIGMA, OBSERVATIONS = 2.0, 15  # the study's known σ and the default profile's observations per case


def analytic(p, level):
    """Projected coverage and width of the p-D HLD ball at a level (σ = 2, 15 observations), untruncated."""
    radius = math.sqrt(nre_analysis.chi_square_quantile(level, p))
    return math.erf(radius / math.sqrt(2)), 2 * radius * SIGMA / math.sqrt(OBSERVATIONS)


TRUNCATION_REACH = 5.0  # a box edge farther than this many s from x̄ moves r² by less than 1e-5


def _truncated_normal_quantiles(u, a, b):
    """Standard normal quantiles of u truncated to [a, b] (broadcast); the upper tail is used where
    the interval lies above 0, so that Φ differences do not cancel."""
    flip = a > 0
    a, b, u = torch.where(flip, -b, a), torch.where(flip, -a, b), torch.where(flip, 1 - u, u)
    low, high = torch.special.ndtr(a), torch.special.ndtr(b)
    z = torch.special.ndtri((low + u * (high - low)).clamp(1e-300, 1 - 1e-16))
    z = torch.minimum(torch.maximum(z, a), b)
    return torch.where(flip, -z, z)


def truncated_radius2(a, b, level, inner, generator):
    """r² of the HPD ball of N(0, I) truncated to the box [a, b] (n, p) in units of s, per row.

    Exact (χ²_p's quantile) where no edge is within TRUNCATION_REACH; elsewhere the level-quantile
    of |z|² over `inner` independent draws from the truncated normal (per row, so the estimate's
    error averages out over rows; its bias is O(1/inner)).
    """
    n, p = a.shape
    r2 = torch.full((n,), nre_analysis.chi_square_quantile(level, p), dtype=torch.float64)
    near = (a > -TRUNCATION_REACH) | (b < TRUNCATION_REACH)
    rows = torch.nonzero(near.any(1), as_tuple=True)[0]
    if rows.numel():
        u = torch.rand(rows.numel(), p, inner, generator=generator, dtype=torch.float64).clamp(1e-300, 1 - 1e-16)
        z = torch.special.ndtri(u)
        sub, axes = torch.nonzero(near[rows], as_tuple=True)
        z[sub, axes] = _truncated_normal_quantiles(u[sub, axes], a[rows[sub], axes, None], b[rows[sub], axes, None])
        r2[rows] = torch.kthvalue((z**2).sum(1), math.ceil(level * inner), dim=1).values
    return r2


def truncated_analytic(problem, truths, level, draws=16, inner=2048, seed=0, chunk=64):
    """Projected coverage and mean projected width of the exact HPD region, the posterior truncated to the box.

    Per truth θ*, the posterior of the means (σ known, m observations) is N(x̄, s²I), s = σ/√m,
    truncated to the prior's box; its HPD region at `level` is the ball |θ − x̄| ≤ r·s cut by the
    box, with r solving mass(ball ∩ box) = level · mass(box) (see truncated_radius2). Its projection
    on axis j is [max(a_j, −R_j), min(b_j, R_j)] (the box in units of s around x̄), with
    R_j² = r² − Σ_{k≠j} (distance from x̄_k to the box)². Averaged over `draws` x̄ ~ N(θ*, s²I) per
    truth; returns the projected coverage and width, each with its Monte Carlo standard error.
    """
    s = SIGMA / math.sqrt(OBSERVATIONS)
    truths = torch.as_tensor(truths, dtype=torch.float64)
    low, high = designs.as_f64(problem.low), designs.as_f64(problem.high)
    generator = torch.Generator().manual_seed(seed)
    target = truths.repeat_interleave(draws, 0)
    xbar = target + s * torch.randn(target.shape, generator=generator, dtype=torch.float64)
    widths, covered = [], []
    for start in range(0, xbar.shape[0], chunk):
        centre, truth = xbar[start : start + chunk], target[start : start + chunk]
        a, b = (low - centre) / s, (high - centre) / s
        r2 = truncated_radius2(a, b, level, inner, generator)
        distance = torch.clamp(torch.maximum(a, -b), min=0.0) ** 2
        reach = torch.sqrt(torch.clamp(r2[:, None] - (distance.sum(1, keepdim=True) - distance), min=0.0))
        widths.append(s * (torch.minimum(b, reach) - torch.maximum(a, -reach)).mean(1))
        covered.append((((truth - centre) / s).abs() <= reach).to(torch.float64).mean(1))
    widths, covered = torch.cat(widths), torch.cat(covered)
    return tuple((float(v.mean()), float(v.std() / math.sqrt(v.numel()))) for v in (covered, widths))


def bench_truths(problem, cases):
    """The table's truths: the default profile's, `cases` Sobol points whatever the dimension."""
    settings = default_inference()["truths"]
    p = problem.parameter_count
    return designs.make_truths(
        problem.low, problem.high, problem.grid_step, dict(settings, sobol_truths=max(1, cases >> (p - 1))), 1
    )


def references(p, cases, level=0.68):
    """Analytic projected coverage and width at a level: truncated to the box at the table's truths, and not."""
    problem = study_problem(p)
    coverage, width = truncated_analytic(problem, bench_truths(problem, cases), level, draws=max(16, 96 // p))
    return {"truncated": (coverage, width), "untruncated": analytic(p, level)}


def exact_scoring(problem, observations):
    """The exact target's scoring of blocks of cases on the CPU, as the exact product does it."""
    return case_blocks.exact_scoring(problem.log_likelihood, observations, torch.device("cpu"), 1 << 24)


def exact_row(p, design, candidates, cases, folder, reference):
    """One table row: the exact target's coverage, width and resolution with one design."""
    problem = study_problem(p)
    settings = default_inference()
    truths = bench_truths(problem, cases)
    observations = designs.make_observations(problem.simulate, truths, settings["observations"], 2)

    arrays, per_case = summarise(
        problem, truths, observations, candidates, ["exact"], exact_scoring(problem, observations), folder
    )
    summary = {f: arrays[f"exact_{f}"] for f in nre_analysis.SUMMARY_FIELDS}
    coverage = analysis_metrics.coverage_metrics(summary, truths.numpy(), LEVELS, problem.names)
    width = analysis_metrics.width_metrics(summary, LEVELS, problem.names)["0.68"]["mean"]
    warning = analysis_metrics.resolution_metrics(summary, per_case, LEVELS, candidates["kind"])["warning"]
    (projected, _), (truncated_width, _) = reference["truncated"]
    plain_projected, plain_width = reference["untruncated"]
    joint = " / ".join(
        "{:.3f} [{:.3f}, {:.3f}]".format(coverage[k]["joint"], *coverage[k]["interval"]) for k in ("0.68", "0.95")
    )
    evaluations = truths.shape[0] * (per_case + 1) * settings["observations"]
    return (
        f"| {p} | {design} | {truths.shape[0]} | {per_case} | {evaluations:.3g} | {joint} | "
        f"{coverage['0.68']['mean']:.3f} ({projected:.3f} / {plain_projected:.3f}) | "
        f"{width:.2f} ({truncated_width:.2f} / {plain_width:.2f}) | {'yes' if warning else 'none'} |"
    )


def resolution_table(cases):
    """Print the markdown table for dimensions 1 to 6."""
    print(
        "| d | design | cases | points/case | evaluations | joint 68% / 95% [95% interval] | "
        "projected 68% (analytic: truncated / untruncated) | width 68% (analytic: truncated / untruncated) | "
        "resolution warning |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for p in range(1, 7):
        reference = references(p, cases)
        for design, candidates in (("fixed sobol", FIXED), ("adaptive", default_inference()["candidates"])):
            with tempfile.TemporaryDirectory() as folder:
                print(exact_row(p, design, candidates, cases, folder, reference), flush=True)


def analytic_table(cases):
    """Print the analytic references alone for dimensions 1 to 6 (a minute or two), with their Monte Carlo errors."""
    print(
        "| d | cases | projected 68%: truncated ± MC error / untruncated | "
        "width 68%: truncated ± MC error / untruncated | width truncated / untruncated |"
    )
    print("|---|---|---|---|---|")
    for p in range(1, 7):
        reference = references(p, cases)
        (coverage, coverage_error), (width, width_error) = reference["truncated"]
        plain_coverage, plain_width = reference["untruncated"]
        print(
            f"| {p} | {cases} | {coverage:.4f} ± {coverage_error:.4f} / {plain_coverage:.4f} | "
            f"{width:.4f} ± {width_error:.4f} / {plain_width:.4f} | {width / plain_width:.4f} |",
            flush=True,
        )


def learned_timer(cases, candidates):
    """A function timing one dimension-6 learned analysis (ratio and posterior) of `cases` cases."""
    problem = study_problem(6)
    prior = priors.make_prior(problem, {"family": "uniform"})
    torch.manual_seed(0)
    model = networks.build_network(
        {"kind": "mlp", "hidden": [64] * 4, "activation": "relu", "dropout": 0.0},
        12,
        gaussian_study.GaussianExperiment.standardize,
    )
    model.eval()
    truths = designs.make_truths(problem.low, problem.high, problem.grid_step, default_inference()["truths"], 1)
    truths = truths[:cases]
    observations = designs.make_observations(problem.simulate, truths, 15, 2)
    targets = ["ratio", "posterior"]

    def timed():
        counted = case_scores.Evaluations()
        scoring = case_blocks.learned_scoring(
            model, torch.device("cpu"), prior, observations, targets, default_inference(), counted
        )
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as folder, torch.no_grad():
            summarise(problem, truths, observations, candidates, targets, scoring, folder)
        return (time.perf_counter() - started) / cases, counted.rows / cases

    return timed


def speed(cases, repeats):
    """Print ms per case of the fixed and the adaptive design, alternating which goes first."""
    runtime.start({"device": "cpu", "cpu_threads": 1, "deterministic": False})  # as nnpd runs analyses
    timers = {
        "fixed sobol": learned_timer(cases, FIXED),
        "adaptive": learned_timer(cases, default_inference()["candidates"]),
    }
    seconds = {name: [] for name in timers}
    for repeat in range(repeats):
        for name in list(timers) if repeat % 2 == 0 else list(timers)[::-1]:
            elapsed, evaluations = timers[name]()
            seconds[name].append(elapsed)
            print(
                f"{name:12s} {elapsed * 1e3:7.1f} ms per case, {evaluations:.0f} model evaluations per case", flush=True
            )
    paired = sorted(a / f for a, f in zip(seconds["adaptive"], seconds["fixed sobol"]))
    print(
        f"adaptive / fixed time per case: best-of {min(seconds['adaptive']) / min(seconds['fixed sobol']):.2f}, "
        f"median of pairs {paired[len(paired) // 2]:.2f} (target <= 1)"
    )


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
    print(
        f"default profile, planned model evaluations: adaptive {adaptive:.4g}, "
        f"fixed 16,384-point sobol {fixed:.4g} (ratio {adaptive / fixed:.2f})"
    )


def main():
    """Run the table, and the timing or budget when asked."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=1024, help="truth cases per dimension")
    parser.add_argument("--speed", action="store_true", help="time a dimension-6 learned analysis instead")
    parser.add_argument("--speed-cases", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--budget", action="store_true", help="sum the default profile's planned evaluations instead")
    parser.add_argument(
        "--analytic",
        action="store_true",
        help="print the analytic references (truncated to the prior box and not) only",
    )
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    if arguments.speed:
        speed(arguments.speed_cases, arguments.repeats)
    elif arguments.budget:
        budget()
    elif arguments.analytic:
        analytic_table(arguments.cases)
    else:
        resolution_table(arguments.cases)


if __name__ == "__main__":
    main()
