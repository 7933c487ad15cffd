"""Expected coverage over every credibility level: from each case's truth credibility, for any target."""

import numpy as np
import pytest
import torch

import analysis_metrics
import designs
import hpd
import nre_analysis
import settings_analysis
from helpers import LEVELS, exact_summaries, study_problem

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dimension, cases", [(1, 512), (3, 512)])
def test_the_exact_target_follows_the_diagonal_and_agrees_with_joint_coverage(tmp_path, one_thread, dimension, cases):
    problem = study_problem(dimension)
    analysis = settings_analysis.make_settings("default")["inference"]
    truths = designs.make_truths(
        problem.low, problem.high, problem.grid_step, dict(analysis["truths"], sobol_truths=cases), seed=3
    )[:cases]
    observations = designs.make_observations(problem.simulate, truths, analysis["observations"], seed=4)
    candidates = dict(analysis["candidates"], candidate_count=1024, coarse_count=128)
    summaries = exact_summaries(tmp_path, problem, truths, observations, candidates, "adaptive")
    curve = nre_analysis.coverage_curve(summaries["credibility"])
    levels = np.asarray(nre_analysis.CREDIBILITY_LEVELS)
    inside = (np.asarray(curve["lower"]) <= levels) & (levels <= np.asarray(curve["upper"]))
    assert inside.all(), levels[~inside]
    # At the analysis' own levels the curve is the joint coverage, exactly.
    coverage = analysis_metrics.coverage_metrics(summaries, truths.numpy(), LEVELS, problem.names)
    for level in LEVELS:
        assert (
            curve["coverage"][nre_analysis.CREDIBILITY_LEVELS.index(level)]
            == coverage[analysis_metrics.level_key(level)]["joint"]
        )


def test_credibility_is_the_mass_denser_than_the_truth():
    scores = torch.tensor([[3.0, 1.0, 2.0, 0.0]], dtype=torch.float64)
    log_measure = torch.zeros(4, dtype=torch.float64)
    points = torch.arange(4, dtype=torch.float64)[:, None]
    masses = torch.softmax(scores[0], 0)
    for truth, expected in ((3.5, 0.0), (2.5, masses[0]), (1.5, masses[0] + masses[2]), (-1.0, 1.0)):
        summary = hpd.hld_summaries(scores, log_measure, points, torch.tensor([truth]), [0.5])
        assert summary["credibility"][0] == pytest.approx(float(expected), abs=1e-15)
        assert bool(summary["covered"][0, 0]) == (summary["credibility"][0] < 0.5)


def test_the_coverage_curve_counts_cases_below_each_level():
    curve = nre_analysis.coverage_curve([0.05, 0.5, 0.97], levels=(0.01, 0.5, 0.51, 0.99))
    assert curve["coverage"] == [0.0, 1 / 3, 2 / 3, 1.0]
    assert all(
        low - 1e-12 <= value <= high + 1e-12
        for low, value, high in zip(curve["lower"], curve["coverage"], curve["upper"])
    )
    # The bands hold jointly over the levels: wider than one level's 95% Wilson interval.
    single = analysis_metrics.wilson_interval(1, 3)
    assert curve["lower"][1] < single[0] and curve["upper"][1] > single[1]
