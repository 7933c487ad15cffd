"""The exact target at dimension 6: adaptive candidates resolve it, a fixed design of the same size warns."""

import math

import numpy as np
import pytest
import torch

import adaptive
import gaussian
import inference as inf
import nre_analysis
import settings_analysis
import settings_training
from store import Writer

LEVELS = [0.68, 0.95]
RADIUS_68 = math.sqrt(7.009170)         # √χ²_6(0.68): 1 − e^{−x/2}(1 + x/2 + x²/8) = 0.68


def study_problem(dimension):
    """The bundled study's Gaussian problem (σ = 2, means in [0, 10]) at a dimension."""
    problem = dict(settings_training.base_settings("default")["problem"], dimension=dimension)
    return gaussian.GaussianProblem.from_settings(problem)


def log_likelihood(x, theta):
    """log p(x | θ) of the study's problem when only the means are inferred (σ = 2), in few operations."""
    z = (x - theta) / 2.0
    return (-0.5 * z * z).sum(dim=-1) - x.shape[-1] * math.log(2.0 * math.sqrt(2 * math.pi))


def exact_summaries(tmp_path, problem, truths, observations, candidates, name):
    """Every case's exact-target summaries on a design, through the study's summarise functions."""
    p = problem.parameter_count
    seed = 11
    points, log_measure = inf.make_candidates(problem.low, problem.high, [None] * p, candidates, seed)

    scoring = nre_analysis.exact_scoring(log_likelihood, observations, torch.device("cpu"), 1 << 24)
    writer = Writer(tmp_path / name)
    (tmp_path / name).mkdir()
    retain = {"mode": "diagnostic", "cases": 0}
    if candidates["kind"] == "adaptive":
        box = adaptive.support_box(problem.low, problem.high, [None] * p)
        sizes = inf.adaptive_sizes(p, candidates, 1)
        nre_analysis.summarise_adaptive(writer, ["exact"], scoring, truths, (points, log_measure), box,
                                        LEVELS, retain, sizes, seed, lambda case: None)
    else:
        nre_analysis.summarise_cases(writer, ["exact"], scoring, truths, points, log_measure, LEVELS, retain,
                                     lambda case: None)
    return {field: np.load(tmp_path / name / f"exact_{field}.npy") for field in nre_analysis.SUMMARY_FIELDS}


@pytest.fixture
def one_thread():
    """One intra-op thread, as analyses run (runtime.cpu_threads): small operations stay fast on busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_fast_likelihood_is_the_study_likelihood():
    problem = study_problem(3)
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(5, 1, 3, generator=generator, dtype=torch.float64) * 10
    theta = torch.rand(1, 7, 3, generator=generator, dtype=torch.float64) * 10
    torch.testing.assert_close(log_likelihood(x, theta), problem.log_likelihood(x, theta), rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_dimension_six_exact_target_is_resolved_by_adaptive_candidates_only(tmp_path, one_thread):
    problem = study_problem(6)
    analysis = settings_analysis.make_settings("default")["inference"]
    truths = inf.make_truths(problem.low, problem.high, problem.grid_step,
                             dict(analysis["truths"], sobol_truths=32), seed=1)
    assert truths.shape == (1024, 6)
    observations = inf.make_observations(problem.simulate, truths, analysis["observations"], seed=2)
    names = problem.names
    adaptive = exact_summaries(tmp_path, problem, truths, observations, analysis["candidates"], "adaptive")
    coverage = inf.coverage_metrics(adaptive, truths.numpy(), LEVELS, names)
    for level in LEVELS:
        entry = coverage[inf.level_key(level)]
        assert abs(entry["joint"] - level) <= 3 * math.sqrt(level * (1 - level) / 1024)
        assert entry["cases"] == 1024 and entry["interval"][0] < entry["joint"] < entry["interval"][1]
    assert coverage["0.68"]["mean"] >= 0.95
    analytic_width = 2 * RADIUS_68 * 2 / math.sqrt(15)
    assert abs(inf.width_metrics(adaptive, LEVELS, names)["0.68"]["mean"] / analytic_width - 1) < 0.10
    resolution = inf.resolution_metrics(adaptive, analysis["candidates"]["candidate_count"], LEVELS, "adaptive")
    assert resolution["warning"] is None and resolution["flagged"]["any"] == 0
    # Today's fixed design of the same size, on the first 256 cases: nearly every one is flagged.
    fixed = exact_summaries(tmp_path, problem, truths[:256], observations, {"kind": "sobol", "candidate_count": 16384},
                            "fixed")
    resolution = inf.resolution_metrics(fixed, 16384, LEVELS, "sobol")
    assert resolution["warning"] is not None and resolution["flagged"]["few_effective_points"] > 250
